"""Log-prob recompute (θ_old): the training forward path without gradients, returning the op's outputs.

    outs = recompute_logprobs(trainer, micro_batches, op=OpSettings(log_rho=-13.0))
    outs[i].logprobs   # [b, s] float32 for micro_batches[i], aligned with its targets

Same model, same schedule, same op and the same micro-batch layout as `train_step`, so θ_old log-probs
are computed exactly as the training pass computes log π_θ (at θ = θ_old they are equal bitwise up to
the nondeterminism of the backend).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from megatron_tail.ops import MaskedLogprobs

from .batch import MicroBatch
from .collectives import broadcast_from_last_stage
from .forward import OpSettings, run_micro_batches
from .routing import RoutingPass
from .setup import Trainer


@torch.no_grad()
def recompute_logprobs(
    trainer: Trainer,
    micro_batches: Sequence[MicroBatch],
    *,
    op: OpSettings | None = None,
    broadcast: bool = True,
    chunks: Sequence[torch.nn.Module] | None = None,
    routing: RoutingPass | None = None,
) -> list[MaskedLogprobs] | None:
    """Per-micro-batch op outputs (`[b, s]` tensors, CPU, detached) of the current parameters, or of `chunks`
    (another model sharded like the trainer's, e.g. the frozen reference policy).

    Collective over all ranks. The outputs exist on the last pipeline stage; with `broadcast` they are
    sent to every stage (so any rank can use them), otherwise other stages get None. Positions off the
    loss mask hold the op's values for the pad/next-token there and are meaningless. `routing`: the MoE
    routers' action in this pass (`routing.RoutingPass`, built on the same `chunks`).
    """
    op = op or OpSettings()
    chunks = list(trainer.chunks if chunks is None else chunks)
    for chunk in chunks:
        chunk.eval()

    def on_outputs(out: MaskedLogprobs, mb: MicroBatch):  # noqa: ARG001 - callback signature
        # kept on the device until the pass is queued: a read back per micro-batch would drain the GPU's
        # queue each time (`_on_host`)
        detached = MaskedLogprobs(**{k: None if v is None else v.detach() for k, v in vars(out).items()})
        return torch.zeros((), device=out.logprobs.device), detached

    outs = run_micro_batches(
        chunks,
        micro_batches,
        on_outputs,
        groups=trainer.groups,
        vocab_size=trainer.vocab_size,
        op=op,
        forward_only=True,
        routing=routing,
    )
    groups = trainer.groups
    mine = [_on_host(out) for out in outs] if groups.is_last_stage else None
    return broadcast_from_last_stage(mine, groups) if broadcast else mine


def _on_host(out: MaskedLogprobs) -> MaskedLogprobs:
    """A micro-batch's outputs on the host, read after the whole pass was queued: the first read waits for
    the pass, the others find the device idle."""
    return MaskedLogprobs(**{k: None if v is None else v.cpu() for k, v in vars(out).items()})
