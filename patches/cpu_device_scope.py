"""A scoped `TorchFunctionMode` that turns tensors requested on "cuda" into CPU tensors.

megatron-core 0.16 hard-codes `device="cuda"` in a few places that a CPU run goes through:
`MixedPrecisionOptimizer`/`DistributedOptimizer.__init__` (`found_inf`, `_scale_one`, ...),
`clip_grads` and the schedules' `total_num_tokens = torch.zeros([], device="cuda")`; and the
optimizers sort parameters by `param.type() == "torch.cuda.FloatTensor"` (a CPU parameter's type string is
"torch.FloatTensor" and is refused), so inside the scope `Tensor.type()` reports CPU tensors as their
`torch.cuda.*` twin. Wrapping
`get_megatron_optimizer(...)`, `optimizer.step()` and the forward-backward function's call in this
scope makes them allocate on CPU. It is scoped (not global) because a global mode slows every torch
call and would hide real device bugs elsewhere.
"""

from __future__ import annotations

import contextlib

import torch
from torch.overrides import TorchFunctionMode

from .pinning import check_pinned

_TO_CPU_METHODS = {torch.Tensor.cuda}


def _is_cuda(device) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.split(":")[0] == "cuda"
    return False


class _CudaToCpuMode(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func in _TO_CPU_METHODS:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name.replace("torch.", "torch.cuda.", 1) if not name.startswith("torch.cuda.") else name
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = "cpu"
        if func is torch.Tensor.to and args[1:] and _is_cuda(args[1]):
            args = (args[0], "cpu", *args[2:])
        return func(*args, **kwargs)


@contextlib.contextmanager
def cpu_device_scope():
    """Inside the block, `device="cuda"` factories, `.cuda()` and `.to("cuda")` give CPU tensors.

    A no-op where CUDA is available.
    """
    if torch.cuda.is_available():
        yield
        return
    check_pinned()
    with _CudaToCpuMode():
        yield
