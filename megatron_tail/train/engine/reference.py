"""The frozen reference policy π_ref for a KL penalty: the initial model, sharded like the trainer's
(same TP / PP stage), forward-only, optionally kept in CPU memory between its passes.

    ref = build_reference(trainer, hf_dir, offload=True)
    with ref.on_device():                                   # weights to the GPU for this pass only
        outs = recompute_logprobs(trainer, mbs, op=op, chunks=ref.chunks)

Memory: the reference holds one copy of the weights in the training dtype (bf16/fp16: 2 B/param per TP×PP
shard) and no gradients or optimizer state. With `offload` that copy lives in pinned host memory and
occupies the GPU only during the reference pass (copied in with non-blocking transfers, dropped after).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from megatron.core.transformer.module import Float16Module

from megatron_tail.model import build_gpt_model, load_hf_weights

from .setup import Trainer


@dataclass
class ReferenceModel:
    chunks: list[torch.nn.Module]
    """This rank's chunk(s) of π_ref (eval mode, no gradients)."""
    offload: bool
    """Parameters live in (pinned) host memory between passes."""
    device: torch.device
    """Where the passes run (the trainer's device)."""
    _host: list[tuple[torch.nn.Parameter, torch.Tensor]] = field(default_factory=list, repr=False)

    @contextlib.contextmanager
    def on_device(self) -> Iterator[None]:
        """The parameters on `device` for the duration (a no-op without offload or where host is device)."""
        if not self.offload or self.device.type == "cpu":
            yield
            return
        for param, host in self._host:
            param.data = host.to(self.device, non_blocking=True)
        try:
            yield
        finally:
            for param, host in self._host:
                param.data = host  # the frozen weights never change: drop the device copy, keep the host one


def build_reference(trainer: Trainer, hf_dir: str | Path, *, offload: bool = False) -> ReferenceModel:
    """π_ref = the HF checkpoint in `hf_dir`, built with the trainer's architecture and model settings on
    this rank's stage; frozen. With `offload`, parameters move to pinned host memory now."""
    model = build_gpt_model(trainer.arch, trainer.model_settings, routing_replay=trainer.arch.moe is not None)
    load_hf_weights(model, hf_dir, trainer.arch, trainer.model_settings)
    if model.config.bf16 or model.config.fp16:
        model = Float16Module(model.config, model)
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    device = next(model.parameters()).device
    ref = ReferenceModel([model], offload=offload, device=device)
    if offload and device.type != "cpu":
        for p in model.parameters():
            host = p.data.to("cpu").pin_memory()
            ref._host.append((p, host))
            p.data = host
    return ref
