"""The output layer + log-prob variants of the op benchmark (`python -m megatron_tail.bench.op`).

Each variant runs forward + backward from the final hidden states `[tokens, H]` and this rank's output
weight `[vocab/TP, H]` to the loss, producing both gradients:
  fused          `vocab_parallel_linear_masked_logprobs` (DVP, entropy): the logits never exist
  megatron       megatron-core's own output layer (`linear_with_grad_accumulation_and_async_allreduce`, as
                 `ColumnParallelLinear` calls it) + `vocab_parallel_cross_entropy`, which overwrites the
                 fresh logits in place
  matmul+ours    the same linear + `vocab_parallel_masked_logprobs` (read-only logits: a gradient buffer)
  matmul+ours_ip the same with `inplace_backward=True` (the trainer's unfused path)
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_tail.ops import vocab_parallel_linear_masked_logprobs, vocab_parallel_masked_logprobs

LINEAR_VARIANTS = ("fused", "megatron", "matmul+ours", "matmul+ours_ip")
LOG_RHO = -13.0


def make_linear_inputs(tokens: int, hidden_size: int, vocab_local: int, dtype: torch.dtype, rank: int):
    """Hidden states `[tokens, H]` (identical on every TP rank), this rank's weight rows `[vocab_local, H]`
    scaled so the logits are about N(0, 4²), and targets `[tokens]` over the whole vocabulary."""
    gen = torch.Generator().manual_seed(11)
    hidden = torch.randn(tokens, hidden_size, generator=gen).to(dtype)
    weight_gen = torch.Generator().manual_seed(100 + rank)
    weight = (torch.randn(vocab_local, hidden_size, generator=weight_gen) * (4.0 / hidden_size**0.5)).to(
        dtype
    )
    tp = dist.get_world_size() if dist.is_initialized() else 1
    targets = torch.randint(0, vocab_local * tp, (tokens,), generator=gen)
    return hidden, weight, targets


def run_linear_variant(
    name: str, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, group
) -> None:
    """One forward + backward; gradients reach `hidden` (TP-all-reduced) and `weight` in every variant."""
    h = hidden.detach().requires_grad_()
    w = weight.detach().requires_grad_()
    tp = 1 if group is None else dist.get_world_size(group)
    if name == "fused":
        out = vocab_parallel_linear_masked_logprobs(h, w, targets, log_rho=LOG_RHO, tp_group=group)
        (out.logprobs.sum() + out.entropy.sum()).backward()
        return
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy
    from megatron.core.tensor_parallel.layers import linear_with_grad_accumulation_and_async_allreduce

    logits = linear_with_grad_accumulation_and_async_allreduce(
        h,
        w,
        None,
        gradient_accumulation_fusion=False,
        allreduce_dgrad=tp > 1,
        sequence_parallel=False,
        tp_group=group,
    )
    if name == "megatron":
        vocab_parallel_cross_entropy(logits, targets).sum().backward()  # TP group: megatron's own state
    elif name in ("matmul+ours", "matmul+ours_ip"):
        out = vocab_parallel_masked_logprobs(
            logits, targets, log_rho=LOG_RHO, tp_group=group, inplace_backward=name == "matmul+ours_ip"
        )
        (out.logprobs.sum() + out.entropy.sum()).backward()
    else:
        raise ValueError(f"unknown variant {name!r}; expected one of {LINEAR_VARIANTS}")
