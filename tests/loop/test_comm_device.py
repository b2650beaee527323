"""Every tensor the trainer's own code hands to a collective lives on `comm_device()`.

On a GPU cluster under NCCL a CPU tensor in a collective fails; on CPU/gloo every tensor is a CPU tensor,
so the device alone proves nothing here. The test therefore patches `comm_device()` to return a sentinel
(the meta device), and a `TorchFunctionMode` turns every tensor made or moved onto the sentinel into a CPU
tensor that it *tags*. Every collective called from `megatron_tail` code during one DP = 2 step of the
real loop must receive tagged tensors. (Exempt: `megatron_tail.ops`, whose collectives run on the logits'
own device, and `megatron_tail.model`, whose weight gathers run on the parameters' device; megatron's and
torch's internals are not ours.)
"""

from __future__ import annotations

import sys
import weakref

import torch

from megatron_tail.config import load_config
from tests.harness import run_distributed
from tests.loop.conftest import loop_overrides

SENTINEL = torch.device("meta")
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "broadcast", "reduce_scatter_tensor")
EXEMPT = ("megatron_tail.ops", "megatron_tail.model")


def _spy_rank(rank, world, overrides):  # noqa: ARG001
    import torch.distributed as dist
    from torch.overrides import TorchFunctionMode

    import megatron_tail.train.engine.parallel as parallel
    from megatron_tail.train.run.loop import run

    tagged: dict[int, weakref.ref] = {}  # id → tensor (tensors compare elementwise: no set of tensors)
    calls: list[tuple[str, str, bool]] = []

    def is_tagged(t) -> bool:
        ref = tagged.get(id(t))
        return ref is not None and ref() is t

    def on_sentinel(x) -> bool:
        return (isinstance(x, torch.device) and x.type == SENTINEL.type) or (
            isinstance(x, str) and x == SENTINEL.type
        )

    def tensors_in(values):
        for v in values:
            if isinstance(v, torch.Tensor):
                yield v
            elif isinstance(v, (list, tuple)):
                yield from tensors_in(v)

    class TagCommTensors(TorchFunctionMode):
        """Made or moved onto the sentinel → a tagged CPU tensor; made from tagged tensors only → tagged."""

        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            hit = any(on_sentinel(a) for a in args) or any(on_sentinel(v) for v in kwargs.values())
            inputs = list(tensors_in([*args, *kwargs.values()]))
            derived = bool(inputs) and all(is_tagged(t) for t in inputs)
            args = tuple(torch.device("cpu") if on_sentinel(a) else a for a in args)
            kwargs = {k: torch.device("cpu") if on_sentinel(v) else v for k, v in kwargs.items()}
            out = func(*args, **kwargs)
            if (hit or derived) and isinstance(out, torch.Tensor):
                tagged[id(out)] = weakref.ref(out)
            return out

    def spy(name, original):
        def wrapper(*args, **kwargs):
            frame = sys._getframe(1)
            module = frame.f_globals.get("__name__", "")
            if module.startswith("megatron_tail") and not module.startswith(EXEMPT):
                tensor = args[1] if name == "all_gather" else args[0]
                calls.append((f"{module}:{frame.f_code.co_name}", name, is_tagged(tensor)))
            return original(*args, **kwargs)

        return wrapper

    original_comm_device = parallel.comm_device
    for module in list(sys.modules.values()):
        if getattr(module, "__name__", "").startswith("megatron_tail"):
            if getattr(module, "comm_device", None) is original_comm_device:
                module.comm_device = lambda: SENTINEL
    for name in COLLECTIVES:
        setattr(dist, name, spy(name, getattr(dist, name)))
    with TagCommTensors():
        result = run(load_config(None, overrides))
    return result.completed_steps, calls


def test_every_collective_of_the_loop_uses_comm_device(tiny_model_dir, prompt_file, engine, tmp_path):
    extra = {
        "parallel.tensor_parallel": 1,  # world 2 = DP 2: the DP reductions really communicate
        "rollout.engine": "remote",
        "rollout.server_urls": f"[{engine.url}]",
        "train.steps": 1,
        "algorithm.stapo": "true",
    }
    overrides = loop_overrides(tiny_model_dir, prompt_file, tmp_path / "run", extra)
    # comm_device is patched before the loop imports its modules: import them first, in the parent
    import megatron_tail.train.rl.objective
    import megatron_tail.train.run.loop  # noqa: F401

    results = run_distributed(_spy_rank, 2, overrides, timeout=600)
    for steps, calls in results:
        assert steps == 1
        untagged = [(caller, name) for caller, name, ok in calls if not ok]
        assert not untagged, f"collectives on tensors not from comm_device(): {untagged}"
        callers = {caller for caller, _, _ in calls}
        # not vacuous: the metric reductions, the loss counts and the stop flag were all seen
        engine = "megatron_tail.train.engine.collectives"
        assert {f"{engine}:all_reduce_scalars", f"{engine}:all_reduce_sum_", f"{engine}:any_rank"} <= callers
        assert sum(name == "all_gather" for _, name, _ in calls) >= 2  # θ_old diagnostics + update metrics


def _backend_rank(rank, world):  # noqa: ARG001
    import megatron_tail.train.engine.parallel as parallel

    torch.cuda.is_available = lambda: True  # a host with GPUs (this forked rank only)
    torch.cuda.current_device = lambda: 0
    return str(parallel.comm_device())


def test_comm_device_follows_the_backend_not_the_presence_of_cuda():
    """A gloo world on a host with GPUs communicates host tensors (a CUDA tensor there would be copied
    through the host by gloo, or refused); NCCL's comm device is the current GPU."""
    assert run_distributed(_backend_rank, 1) == ["cpu"]
