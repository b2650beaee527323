"""One pass of megatron's `get_forward_backward_func` over micro-batches, with the DVP op → callback.

Shared by the training step (forward + backward) and the log-prob recompute (forward only). A packed
micro-batch reaches the model as one row `[1, T]` with megatron's `PackedSeqParams(qkv_format="thd")`
(`packed_seq_params`), which both layer specs' attention honours; a padded one as `[b, s]` rows with
causal attention. On the last pipeline stage, either
- the vocab-parallel logits `[b, s, V_padded/tp]` go straight into `vocab_parallel_masked_logprobs`
  (padded columns masked via the true `vocab_size`); with bf16 they stay bf16 (`fp32_output=False`: the
  op computes in fp32 chunks, so no fp32 copy is made), and when training the op takes them over
  (`inplace_backward`: their storage becomes their gradient, as with megatron's cross-entropy); or,
- with the model's `fused_output_layer`, the final-norm hidden states `[s, b, h]` and the output layer's
  weight go into `vocab_parallel_linear_masked_logprobs`, and the logits never exist. A tied weight is the
  embedding's (on PP > 1 the last stage's copy, whose gradient megatron's `finalize_model_grads` sums with
  the first stage's, as for its own output layer).

MoE load-balancing loss: the loss callback's loss is already normalised by a global token count and
megatron's 1/num_tokens gradient scaling is off (`setup.py`), so a training pass sets the aux losses'
backward scale itself (`moe_aux_loss_scale`, applied by a hook on each micro-batch's model output). The
routers leave padding out of it (`router_padding_mask`): a padded row's pad tokens (all one id) would
otherwise take a share of the balance the loss asks for. A micro-batch without sample tokens (a DP rank's
empty packed one) adds neither to the loss nor to megatron's aux-loss tracker (`EmptyMicroBatchAuxLogs`),
whose sums `moe/aux_loss` reports.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.transformer.module import Float16Module
from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler, get_moe_layer_wise_logging_tracker
from megatron.core.utils import unwrap_model

from megatron_tail.model.thd_attention import HostPackedSeqParams, thd_packed_seq_params
from megatron_tail.ops import (
    DEFAULT_LOG_RHO,
    MaskedLogprobs,
    vocab_parallel_linear_masked_logprobs,
    vocab_parallel_masked_logprobs,
)
from megatron_tail.patches import cpu_device_scope
from megatron_tail.rollout.columns import SUPPORT

from .batch import MicroBatch
from .collectives import all_reduce_scalars
from .parallel import ParallelGroups
from .routing import RoutingPass

# (op outputs [b, s] of one micro-batch, the micro-batch) -> (0-d loss tensor, extra object to return)
OnOutputs = Callable[[MaskedLogprobs, MicroBatch], tuple[torch.Tensor, Any]]

SAMPLING_SUPPORT_FIELD = SUPPORT
"""The `sampling_support` column (`rollout.columns`) as a ragged per-token field of a micro-batch
(`utils.ragged.Ragged`, `b·s` rows in position order): the token ids of the sampling support the engine drew
each target from, no row off the response. When present, every
pass (θ_old, the update, the reference) hands it to the op as `sampling_support`, densified on the device,
unless `OpSettings.replay_support` is off."""


def sampling_support(mb: MicroBatch) -> torch.Tensor | None:
    """`[b, s, K]` int32 global ids, −1 padding (the op's `sampling_support`), or None. K is this
    micro-batch's widest support (a CP shard's own), so one wide token widens one micro-batch, not the
    step; int32, since the op widens the ids to int64 a block of rows at a time. Built where the
    micro-batch is (the device), with no host sync (`Ragged.dense`)."""
    support = mb.fields.get(SAMPLING_SUPPORT_FIELD)
    return None if support is None else support.dense().view(*mb.shape, support.width)


@dataclass(frozen=True)
class OpSettings:
    """Arguments of the DVP op (`megatron_tail.ops.vocab_parallel_masked_logprobs`)."""

    log_rho: float | None = DEFAULT_LOG_RHO
    """log ρ of the safe set; None or -inf: no pruning."""
    temperature: float = 1.0
    """Sampling temperature the rollout used."""
    compute_entropy: bool = True
    """Also compute the entropy of π^mp."""
    compute_safe_set_size: bool = False
    """Also count |V_S| per position (in the same pass)."""
    backend: str = "auto"
    """The op's implementation (`ops.backend`; `model.op_backend`)."""
    replay_support: bool = True
    """Hand a micro-batch's sampling support (`SAMPLING_SUPPORT_FIELD`) to the op; False scores over the
    full vocabulary (or V_S) although the samples were truncated (`algorithm.sampling_support: ignore`)."""


def run_micro_batches(
    chunks: list[torch.nn.Module],
    micro_batches: Sequence[MicroBatch],
    on_outputs: OnOutputs,
    *,
    groups: ParallelGroups,
    vocab_size: int,
    op: OpSettings,
    forward_only: bool,
    routing: RoutingPass | None = None,
) -> list[Any]:
    """Run the forward(-backward) schedule; return `on_outputs`' extra objects (last stage; [] elsewhere).

    Micro-batches may differ in shape: on PP > 1 the model config's `variable_seq_lengths` (set by
    `model.transformer_config`) makes the stages exchange each activation's shape first. `routing` (MoE):
    what the routers do in this pass (`routing.RoutingPass`: record, replay, observe), around each
    micro-batch's forward. `groups`: the trainer's process groups (the op's TP group, the aux loss's DP).
    """
    if not micro_batches:
        raise ValueError("no micro-batches")
    config = unwrap_model(chunks[0]).config
    shapes = {mb.shape for mb in micro_batches}
    if len(shapes) != 1 and groups.pp_size > 1:
        if not config.variable_seq_lengths:
            raise ValueError(
                f"micro-batches differ in shape {sorted(shapes)} but variable_seq_lengths is off"
            )
    rows, _ = max(shapes)
    # The whole row's length, not a CP shard's: megatron's `get_tensor_shapes` (pipeline_parallel/
    # schedules.py) divides `seq_length` by the CP size itself (and by TP under sequence parallelism) to size
    # the stages' activations when `variable_seq_lengths` is off.
    seq_len = max(mb.whole.shape[1] for mb in micro_batches)
    device = next(chunks[0].parameters()).device
    tp_group = groups.tp
    half = _has_float16_module(chunks[0])
    aux_scale = None if forward_only else moe_aux_loss_scale(config, micro_batches, groups)
    aux_logs = EmptyMicroBatchAuxLogs() if aux_scale is not None else None

    def set_aux_loss_scale(mb: MicroBatch, grad: torch.Tensor) -> None:
        # Runs when the backward reaches the micro-batch's output, before its routers' `MoEAuxLossAutoScaler`
        # backward: megatron's `forward_step` (pipeline_parallel/schedules.py, "Set the loss scale for the
        # auxiliary loss of the MoE layer") has just reset the scale to the bare optimizer loss scale.
        one = torch.ones(1, device=grad.device)
        loss_scale = config.grad_scale_func(one) if config.grad_scale_func is not None else one
        # An empty micro-batch (no sample token) adds no aux loss: it has no token to balance.
        MoEAuxLossAutoScaler.set_loss_scale(loss_scale * (aux_scale if mb.num_sample_tokens else 0.0))
        # This micro-batch's backward on this stage runs next, alone, a full recompute's routers included.
        aux_logs.at(not mb.num_sample_tokens)

    def forward_step(data_iterator, model):
        mb = next(data_iterator).to(device)
        kwargs = {"fp32_output": False} if half else {}
        padding_mask = router_padding_mask(mb, unwrap_model(model), config, groups)
        if padding_mask is not None:
            kwargs["padding_mask"] = padding_mask
        if routing is not None:
            routing.before(model, mb)
        if aux_logs is not None:
            aux_logs.at(not mb.num_sample_tokens)
        output = model(mb.tokens, None, None, packed_seq_params=thd_params(mb), **kwargs)
        if routing is not None:
            routing.after(model, mb, output)
        if aux_scale is not None and output.requires_grad:
            output.register_hook(partial(set_aux_loss_scale, mb))
        return output, partial(_loss_func, mb, unwrap_model(model))

    def _loss_func(mb: MicroBatch, model, output: torch.Tensor):
        settings = dict(
            log_rho=op.log_rho,
            temperature=op.temperature,
            vocab_size=vocab_size,
            tp_group=tp_group,
            compute_entropy=op.compute_entropy,
            compute_safe_set_size=op.compute_safe_set_size,
            sampling_support=sampling_support(mb) if op.replay_support else None,
            backend=op.backend,
        )
        if getattr(model, "fused_output_layer", False):
            out = _fused_logprobs(model, output, mb.targets, settings)
        else:
            out = vocab_parallel_masked_logprobs(
                output, mb.targets, inplace_backward=not forward_only, **settings
            )
        loss, extra = on_outputs(out, mb)
        if not len(mb.sample_ids):
            # An empty micro-batch (a DP rank with fewer packed ones): keep the loss on the graph so the
            # backward pass runs through the model like on the other ranks.
            loss = loss + out.logprobs.sum() * 0.0
        # A fill, not torch.tensor(...): that is a blocking host→device copy per micro-batch on CUDA.
        num_tokens = torch.full((), mb.num_loss_tokens, dtype=torch.int, device=loss.device)
        return loss, num_tokens, extra

    with cpu_device_scope(), routing if routing is not None else contextlib.nullcontext():
        try:
            return get_forward_backward_func()(
                forward_step_func=forward_step,
                data_iterator=iter(micro_batches),
                model=chunks,
                num_microbatches=len(micro_batches),
                seq_length=seq_len,
                micro_batch_size=rows,
                forward_only=forward_only,
            )
        finally:
            if aux_logs is not None:
                aux_logs.at(False)


class EmptyMicroBatchAuxLogs:
    """Keeps what an empty micro-batch's routers log out of megatron's aux-loss tracker (`moe_utils.
    get_moe_layer_wise_logging_tracker`, summed per layer by `save_to_aux_losses_tracker`): its pad tokens'
    loss is no measure of the balance. A training pass calls `at` at the points after which one micro-batch's
    routers run, alone, until the next such point: its forward (`forward_step`), and its backward on this
    stage, which starts when the backward reaches its output (the hook that sets its aux scale) and runs a
    full activation recompute's routers again (a checkpointed layer's first forward runs without grad and
    logs nothing); and once more when the schedule returns. An empty micro-batch's window ends with the
    tracker's values put back (a name it created zeroed, so that every rank has the names, and their
    reduce groups, that `reduce_aux_losses_tracker_across_ranks` reduces over). Tensor copies on the device,
    no host sync."""

    def __init__(self):
        self._saved: dict[str, torch.Tensor] | None = None

    def at(self, empty: bool) -> None:
        """A point where another micro-batch's routers start: `empty` whether it has no sample token."""
        tracker = get_moe_layer_wise_logging_tracker()
        if self._saved is not None:
            for name, entry in tracker.items():
                if name in self._saved:
                    entry["values"].copy_(self._saved[name])
                else:
                    entry["values"].zero_()
        self._saved = {name: entry["values"].clone() for name, entry in tracker.items()} if empty else None


def moe_aux_loss_scale(config, micro_batches: Sequence[MicroBatch], groups: ParallelGroups) -> float | None:
    """The MoE aux losses' backward scale of a training pass (before the optimizer's loss scale): 1 / the
    step's sample tokens (non-padding, over micro-batches and DP ranks), or None for a dense model.
    Collective over the DP group (not CP: every CP rank knows its whole micro-batch's count).

    megatron's router (transformer/moe/router.py, `_apply_aux_loss` → `attach_and_log_load_balancing_loss`)
    attaches each micro-batch's aux loss times a token count n under `calculate_per_token_loss`, expecting
    `finalize_model_grads` to divide every gradient by the step's token count; our finalize does not
    (`setup.py`). With our `padding_mask` (`router_padding_mask`), megatron-core 0.16.1's loss covers the
    non-padding tokens only (`compute_routing_scores_for_aux_loss` zeroes the padding's scores and routes)
    and n is the micro-batch's N non-padding tokens over the whole TP × CP group on every shard:
    `get_tokens_per_expert_and_token_count(with_padding_mask=True)` sums its `local_tokens_per_expert` after
    `reduce_from_tensor_model_parallel_region`, whose `_reduce` (tensor_parallel/mappings.py) all-reduces
    that tensor in place. Each TP (under sequence parallelism) and CP shard's aux loss is its share of the
    micro-batch's (probabilities of its own tokens, counts over the group), and the router's gradients are
    summed over TP (`sequence_parallel` weights) and DP × CP, so with this scale the gradient is coeff · ∇
    of Σ_mb N·aux / Σ_mb N: the sample-token-weighted mean of the per-micro-batch losses of the step.
    (megatron's own divisor is the loss-token count; ours are the tokens the routers balance.)
    `tests/train/test_moe_aux_loss_scale.py` checks it against a float64 recomputation, which would catch
    an upstream change of n. (A z-loss, which `model.moe` does not configure, would attach its shard's own
    count, `apply_z_loss`'s `(~padding_mask).sum()`, and need its own scale.)
    """
    if not getattr(config, "num_moe_experts", None):
        return None
    local = sum(mb.num_sample_tokens for mb in micro_batches)
    total = all_reduce_scalars({"router_tokens": local}, groups.dp)
    return 1.0 / max(total["router_tokens"], 1.0)


def router_padding_mask(mb: MicroBatch, model, config, groups: ParallelGroups) -> torch.Tensor | None:
    """megatron's `padding_mask` of a MoE model's forward for `mb` (on its device): `[b, s]` bool, True at
    padding (megatron-core 0.16.1: `TransformerLayer._forward_mlp`'s docstring; `TopKRouter.routing` hands
    it to `compute_routing_scores_for_aux_loss`, `apply_z_loss` and `_apply_expert_bias`, which invert it,
    and not to the top-k that dispatches the tokens; the router's own docstrings say the opposite), or
    None: a dense model, or a micro-batch without sample tokens (its aux loss would divide by zero tokens:
    `switch_load_balancing_loss_func`'s `total_num_tokens`; the training pass gives that micro-batch an aux
    scale of 0 instead, and keeps what it logs out of the tracker: `EmptyMicroBatchAuxLogs`).

    `model`: the unwrapped chunk. `GPTModel._preprocess` scatters the mask to the sequence-parallel region
    only on the first stage (`elif self.pre_process:`); a later stage under sequence parallelism gets this
    TP rank's slice of the sequence here, as `scatter_to_sequence_parallel_region` would cut it.
    """
    if not getattr(config, "num_moe_experts", None) or mb.padding is None or not mb.num_sample_tokens:
        return None
    mask = mb.padding
    if config.sequence_parallel and not model.pre_process:
        width = mask.shape[1] // groups.tp_size
        mask = mask[:, groups.tp_rank * width : (groups.tp_rank + 1) * width]
    return mask


def thd_params(mb: MicroBatch) -> HostPackedSeqParams | None:
    """The THD `PackedSeqParams` of a packed micro-batch on its device (None when padded): its trailing
    padding is a block of its own, so the contract of `model.thd_packed_seq_params` holds."""
    return thd_packed_seq_params(mb.cu_seqlens, mb.tokens.device) if mb.packed else None


def _fused_logprobs(model, hidden: torch.Tensor, targets: torch.Tensor, settings: dict) -> MaskedLogprobs:
    """The op on hidden states `[s, b, h]` (megatron's layout; with sequence parallelism this rank's
    `s/tp` shard) and `targets [b, s]`; outputs `[b, s]` like the unfused path's."""
    config = model.config
    support = settings.pop("sampling_support")
    weight = model.output_weight()
    out = vocab_parallel_linear_masked_logprobs(
        hidden,
        weight,
        targets.t(),
        sampling_support=None if support is None else support.transpose(0, 1),
        sequence_parallel=config.sequence_parallel,
        gradient_accumulation_fusion=fused_layer_into_main_grad(weight),
        **settings,
    )
    return MaskedLogprobs(**{k: None if v is None else v.t() for k, v in vars(out).items()})


def fused_layer_into_main_grad(weight: torch.Tensor) -> bool:
    """Whether the fused output layer adds its weight gradient into `weight.main_grad` itself: wherever DDP
    gave the weight one, whatever `model.gradient_accumulation_fusion` says. That setting is about megatron's
    own linears, which need apex's kernel for it; the fused op accumulates with torch alone
    (`ops.matmul_accumulate`) and sets megatron's `grad_added_to_main_grad`, which DDP's hook reads
    whatever the config (`distributed_data_parallel.py`, `_make_backward_post_hook`: it adds `param.grad`
    only when the flag is off or the weight has `zero_out_wgrad`, tied embeddings at PP 1). Measured on the
    H200 (`docs/results/gpu/h200_2026-12-01.md`, third call, fwd + bwd of the fused op): into main_grad the
    backward keeps the forward's token chunks and allocates no weight gradient, 64.25 ms / 576 MiB at the
    1.7B step's 16,384 × 2,048 @ 151,936 against 69.02 ms / 706 MiB for the returned bf16 gradient's four
    row blocks, and DDP's add of that [V, H] gradient into main_grad (timed by `bench.op`) is saved too. The
    frozen reference policy has no DDP buffer: its weight is not asked (as megatron's linears: only a weight
    with a `main_grad`, `LinearWithGradAccumulationAndAsyncCommunication.forward`)."""
    return hasattr(weight, "main_grad")


def _has_float16_module(module: torch.nn.Module) -> bool:
    while module is not None:
        if isinstance(module, Float16Module):
            return True
        module = getattr(module, "module", None)
    return False
