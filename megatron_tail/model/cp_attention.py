"""Context-parallel core attention for the local spec: each CP rank holds chunks r and 2·CP−1−r of every
packed sequence (`context_parallel_index`); forward all-gathers K/V over the CP group and runs causal
attention per sequence at the tokens' global positions, backward reduce-scatters the K/V gradients.

It is what `ThdDotProductAttention` runs when `config.context_parallel_size > 1`; on the TE spec, Transformer
Engine's `DotProductAttention` runs CP itself (megatron's `TEDotProductAttention.__init__` hands it
`cp_group`, `cp_global_ranks`, `cp_stream` and `cp_comm_type`, "p2p" here: see `model.config`). Both see the
same inputs (megatron's `SelfAttention.forward` with THD `packed_seq_params` carrying the whole row's
cu_seqlens, and RoPE already applied at the global positions by `_apply_rotary_pos_emb_thd`), and both
compute exact softmax attention, so the CPU tests of this module stand for the GPU path.

Memory: the whole row's K/V (`[T, 2, hkv, d]`) is kept per layer for backward (TE's ring holds two blocks
of it at a time); a score matrix `[hq, L/(2·CP), ≤ L]` exists for one chunk of one sequence at a time and
is recomputed in backward (SDPA with an explicit mask would keep the mask in fp32, O(L²/CP) per chunk).
"""

from __future__ import annotations

from itertools import pairwise

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from megatron_tail.utils.device_copy import to_device


def context_parallel_index(bounds, cp_rank: int, cp_size: int) -> torch.Tensor:
    """`[T/CP]` int64: the positions of a packed row (causal blocks `[bounds[i], bounds[i+1])`, each a
    multiple of 2·CP long) that CP rank `cp_rank` keeps, in its local order: per block, chunk r then chunk
    2·CP−1−r of 2·CP equal chunks (Transformer Engine's `thd_get_partitioned_indices`, megatron's
    `_get_thd_freqs_on_this_cp_rank`; see `train.engine.context_parallel`).
    Raises ValueError naming a block whose length is not a multiple of 2·CP."""
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank must be in [0, {cp_size}); got {cp_rank}")
    pieces = []
    for a, b in pairwise(bounds):
        if (b - a) % (2 * cp_size):
            raise ValueError(
                f"packed block [{a}, {b}) of {b - a} tokens is not a multiple of 2·context_parallel = "
                f"{2 * cp_size}; pack with sequence_multiple={2 * cp_size}"
            )
        seg = (b - a) // (2 * cp_size)
        for chunk in (cp_rank, 2 * cp_size - 1 - cp_rank):
            pieces.append(torch.arange(a + chunk * seg, a + (chunk + 1) * seg))
    return torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.long)


class _AllGatherFirstDim(torch.autograd.Function):
    """`[t, ...]` on each rank → `[size·t, ...]` (rank order); backward: reduce-scatter of the gradient,
    so each rank gets the sum over ranks of the gradient of its own rows."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        size = dist.get_world_size(group)
        full = torch.empty((size * local.shape[0], *local.shape[1:]), dtype=local.dtype, device=local.device)
        dist.all_gather_into_tensor(full, local.contiguous(), group=group)
        return full

    @staticmethod
    def backward(ctx, grad_full: torch.Tensor):
        size = dist.get_world_size(ctx.group)
        local = torch.empty(
            (grad_full.shape[0] // size, *grad_full.shape[1:]), dtype=grad_full.dtype, device=grad_full.device
        )
        dist.reduce_scatter_tensor(local, grad_full.contiguous(), group=ctx.group)
        return local, None


def _chunk_attention(q, k, v, offset: int, scale: float) -> torch.Tensor:
    """`q [1, hq, seg, d]` at positions offset..offset+seg−1 of its sequence, `k`/`v [1, hkv, offset+seg, d]`
    from its start: query i sees keys 0..offset+i (a lower-right-aligned causal mask)."""
    seg, n = q.shape[2], k.shape[2]
    keys = torch.arange(n, device=q.device)
    mask = keys[None, :] <= (offset + torch.arange(seg, device=q.device))[:, None]
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1]
    )


def context_parallel_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    bounds: list[int],
    scale: float,
    cp_group: dist.ProcessGroup,
) -> torch.Tensor:
    """Causal attention of this CP rank's tokens of a packed row.

    Args:
        query: `[T/CP, hq, d]`, key/value `[T/CP, hkv, d]`: this rank's tokens (`context_parallel_index`
            order), RoPE applied at their global positions.
        bounds: the whole row's causal blocks (padded cu_seqlens, host ints), ending at T.
        scale: softmax scale.
        cp_group: the CP group (one all-gather of K/V forward, one reduce-scatter backward).
    Returns:
        `[T/CP, hq·d]` in the local token order.
    """
    size, rank = dist.get_world_size(cp_group), dist.get_rank(cp_group)
    local_len = query.shape[0]
    if bounds[-1] != size * local_len:
        raise ValueError(f"cu_seqlens end at {bounds[-1]} but {size} CP ranks hold {local_len} tokens each")
    kv = _AllGatherFirstDim.apply(torch.stack((key, value), dim=1), cp_group)  # [T, 2, hkv, d], rank order
    order = torch.cat([context_parallel_index(bounds, r, size) for r in range(size)])
    whole = torch.empty_like(order)
    whole[order] = torch.arange(order.numel())  # whole-row position → row of `kv`
    kv = kv[to_device(whole, kv.device)]  # [T, 2, hkv, d] in sequence order (index made on the host)
    pieces, start = [], 0
    for a, b in pairwise(bounds):
        seg = (b - a) // (2 * size)
        for chunk in (rank, 2 * size - 1 - rank):
            if seg == 0:
                continue
            first = a + chunk * seg  # global position of the chunk's first query
            q = query[start : start + seg].transpose(0, 1).unsqueeze(0)  # [1, hq, seg, d]
            k, v = (kv[a : first + seg, i].transpose(0, 1).unsqueeze(0) for i in (0, 1))  # [1, hkv, n, d]
            # recomputed in backward: SDPA would keep its [seg, n] mask as fp32 for backward (O(L²/CP) per
            # chunk); recomputing keeps only q and the K/V views (megatron's selective recompute of
            # core_attn does the same for the whole core)
            out = checkpoint(_chunk_attention, q, k, v, first - a, scale, use_reentrant=False)
            pieces.append(out[0].transpose(0, 1))  # [seg, hq, d]
            start += seg
    return torch.cat(pieces).reshape(local_len, -1)
