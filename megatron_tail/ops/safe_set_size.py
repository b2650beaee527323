"""|V_S|, the size of the DVP safe set per position, from vocab-parallel logits.

    sizes = vocab_parallel_safe_set_size(logits_shard, log_rho=-13.0, temperature=1.0, vocab_size=V,
                                         tp_group=tp_group)          # [...] int64

The threshold is the op's own (`masked_logprobs.safe_set_threshold`, one MAX on the TP group), and the
per-shard counts are summed with one SUM. The op does not return |V_S| (yet); the trainer counts it on the
logits of its θ_old pass through a forward hook (`megatron_tail.train.rl.safe_set_sizes`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .masked_logprobs import group_size_and_rank, row_chunks, safe_set_threshold, valid_columns
from .safe_vocab import check_log_rho, check_temperature


@torch.no_grad()
def vocab_parallel_safe_set_size(
    logits: torch.Tensor,
    *,
    log_rho: float | None,
    temperature: float = 1.0,
    vocab_size: int | None = None,
    tp_group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """Number of tokens in the safe set of each position.

    Args:
        logits: `[..., V_local]` this rank's contiguous vocab shard (rank r holds [r·V_local, (r+1)·V_local)).
        log_rho: log ρ ≤ 0; None or -inf: no pruning (every finite-logit token of the true vocab counts).
        temperature: T > 0 the policy is scored at.
        vocab_size: true vocabulary size; columns at or beyond it (Megatron's padding) never count.
        tp_group: the vocab shards' group (None: one unsharded rank).
    Returns:
        `[...]` int64, identical on every rank of `tp_group`; reduced over the vocab (all shards).
    """
    log_rho = check_log_rho(log_rho)
    temperature = check_temperature(temperature)
    tp_size, tp_rank = group_size_and_rank(tp_group)
    v_local = logits.shape[-1]
    vocab_size = v_local * tp_size if vocab_size is None else vocab_size
    _, num_valid = valid_columns(v_local, vocab_size, tp_rank)
    x = logits.detach().reshape(-1, v_local)[:, :num_valid]
    _, threshold = safe_set_threshold(
        x,
        v_local=v_local,
        vocab_size=vocab_size,
        log_rho=log_rho,
        temperature=temperature,
        tp_group=tp_group,
        tp_size=tp_size,
    )
    counts = torch.zeros(x.shape[0], dtype=torch.int64, device=x.device)
    if num_valid:
        for rows in row_chunks(x.shape[0], v_local, x.device):
            counts[rows] = (x[rows].to(threshold.dtype) >= threshold[rows, None]).sum(dim=1)
    if tp_size > 1:
        dist.all_reduce(counts, op=dist.ReduceOp.SUM, group=tp_group)
    return counts.reshape(logits.shape[:-1])
