"""SGLang 0.5.23's real `Sampler` on CPU tensors, with the smallest set-up it needs.

`sglang.srt.layers.sampler` pulls in much of SGLang. On a CPU host one import on that chain has no usable
wheel: `sglang.srt.multimodal.internvl_utils` imports torchvision (image transforms for InternVL), and
PyPI's torchvision is built against CUDA torch (with the CPU torch it fails to import and breaks
transformers). While the sampler module is imported, and only then, `torchvision` is a stub; nothing on
the sampling path touches it. Everything else (sampler, batch info, processor application) is SGLang's code.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
import types
from contextlib import contextmanager
from unittest import mock

import torch

_TORCHVISION_STUBS = ("torchvision", "torchvision.transforms", "torchvision.transforms.functional")


@contextmanager
def _torchvision_stub():
    if importlib.util.find_spec("torchvision") is not None:
        yield
        return
    saved = {name: sys.modules.get(name) for name in _TORCHVISION_STUBS}
    for name in _TORCHVISION_STUBS:
        stub = mock.MagicMock(name=f"stub:{name}")
        stub.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
        sys.modules[name] = stub
    try:
        yield
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module


def import_sglang_sampler() -> types.SimpleNamespace:
    """The SGLang modules the tests use: `sampler`, `SamplingBatchInfo`, `ProcessorEntry`, ... ."""
    import sglang  # noqa: F401 - its __init__ must run before the stub goes in (it imports transformers)

    with _torchvision_stub():
        from sglang.srt.layers import sampler
        from sglang.srt.layers.logits_processor import LogitsProcessorOutput
        from sglang.srt.runtime_context import get_context, get_parallel
        from sglang.srt.sampling.custom_logit_processor import CustomLogitProcessor
        from sglang.srt.sampling.sampling_batch_info import ProcessorEntry, SamplingBatchInfo
        from sglang.srt.sampling.sampling_params import TOP_K_ALL
    return types.SimpleNamespace(
        sampler=sampler,
        LogitsProcessorOutput=LogitsProcessorOutput,
        get_context=get_context,
        get_parallel=get_parallel,
        CustomLogitProcessor=CustomLogitProcessor,
        ProcessorEntry=ProcessorEntry,
        SamplingBatchInfo=SamplingBatchInfo,
        TOP_K_ALL=TOP_K_ALL,
    )


def import_sglang_rl_loader():
    """SGLang's `QuantizedRLModelLoader` (srt/model_loader/loader.py: the FP8 RL loader of
    `--load-format flash_rl`), imported under the same stub."""
    import sglang  # noqa: F401

    with _torchvision_stub():
        from sglang.srt.model_loader.loader import QuantizedRLModelLoader
    return QuantizedRLModelLoader


@contextmanager
def cpu_sampler(sg: types.SimpleNamespace):
    """A `Sampler` built under a published server config (custom processors on, CPU, TP = 1)."""
    tp_group = types.SimpleNamespace(device_group=None)  # read only to sync token ids across TP ranks
    with (
        sg.get_context().override_server_args(enable_custom_logit_processor=True, device="cpu"),
        sg.get_parallel().override(tp_group=tp_group),
    ):
        yield sg.sampler.Sampler()


def batch_info(sg, temperatures: torch.Tensor, vocab_size: int, processor_str: str | None, custom_params):
    """`SamplingBatchInfo` for plain sampling (no top-k/p, min-p) of `len(temperatures)` rows.

    The processor is deserialized with SGLang's `CustomLogitProcessor.from_str`, as the scheduler does.
    """
    batch = temperatures.shape[0]
    processors = None
    if processor_str is not None:
        processors = {
            hash(processor_str): sg.ProcessorEntry(
                processor=sg.CustomLogitProcessor.from_str(processor_str),
                rows=list(range(batch)),
                indices=torch.arange(batch),
            )
        }
    return sg.SamplingBatchInfo(
        temperatures=temperatures.view(-1, 1).float(),
        top_ps=torch.ones(batch),
        top_ks=torch.full((batch,), sg.TOP_K_ALL, dtype=torch.int32),
        min_ps=torch.zeros(batch),
        is_all_greedy=False,
        is_any_greedy=False,
        need_top_p_sampling=False,
        need_top_k_sampling=False,
        need_min_p_sampling=False,
        vocab_size=vocab_size,
        has_custom_logit_processor=processor_str is not None,
        custom_params=custom_params,
        custom_logit_processor=processors,
        device="cpu",
    )


def sample(sg, sampler, logits: torch.Tensor, info) -> tuple[torch.Tensor, torch.Tensor]:
    """Run `Sampler.forward` with `return_logprob`: `(token ids [B] int, their logprobs [B] fp32)`."""
    batch = logits.shape[0]
    output = sg.LogitsProcessorOutput(next_token_logits=logits.clone())
    ids = sampler.forward(
        output, info, True, [0] * batch, [None] * batch, torch.zeros(batch, dtype=torch.long)
    )
    return ids.long(), output.next_token_logprobs


def sample_with_masks(sg, logits: torch.Tensor, info, backend: str):
    """`Sampler.forward` on `[B, V]` logits under `--sampling-backend backend`, every row of `info` asking for
    its sampling mask: `(token ids [B] int64, SGLang's sampling_mask_output)`."""
    batch = logits.shape[0]
    tp_group = types.SimpleNamespace(device_group=None)
    with (
        sg.get_context().override_server_args(device="cpu", sampling_backend=backend),
        sg.get_parallel().override(tp_group=tp_group),
    ):
        sampler = sg.sampler.Sampler()
        output = sg.LogitsProcessorOutput(next_token_logits=logits.clone())
        ids = sampler.forward(
            output, info, False, [0] * batch, [None] * batch, torch.zeros(batch, dtype=torch.long)
        )
    return ids.long(), output.sampling_mask_output
