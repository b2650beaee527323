"""Pure tensor layout conversions between HF tensors and Megatron's fused, TP-sharded parameters.

- `linear_qkv` (weight `[ng·(nh/ng + 2)·d, h]`, bias `[ng·(nh/ng + 2)·d]`): per query group g the rows
  are [q heads of g..., k_g, v_g]; TP ranks hold contiguous row chunks of that fused tensor.
- `linear_fc1` (weight `[2·ffn/tp, h]` per rank): each rank's shard is [gate shard; up shard], so the
  unsharded fc1 is *not* [gate; up] but the concatenation of per-rank [gate_r; up_r].
- Column-parallel (qkv, fc1, embedding, output layer) shard dim 0; row-parallel (`linear_proj`,
  `linear_fc2`) shard dim 1; norms are replicated.
- The embedding and output layer have `padded_vocab` rows; rows ≥ vocab_size are zero padding.
"""

from __future__ import annotations

import torch


def fuse_qkv(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_heads: int, num_groups: int
) -> torch.Tensor:
    """HF q `[nh·d, ...]`, k/v `[ng·d, ...]` (weights or biases) → Megatron's fused per-group layout."""
    d = q.shape[0] // num_heads
    rest = q.shape[1:]
    qg = q.reshape(num_groups, num_heads // num_groups, d, *rest)
    kg = k.reshape(num_groups, 1, d, *rest)
    vg = v.reshape(num_groups, 1, d, *rest)
    return torch.cat([qg, kg, vg], dim=1).reshape(-1, *rest)


def split_qkv(
    fused: torch.Tensor, num_heads: int, num_groups: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of `fuse_qkv`: Megatron's fused (unsharded) qkv → HF (q, k, v), contiguous copies."""
    per_group = num_heads // num_groups + 2
    d = fused.shape[0] // (num_groups * per_group)
    rest = fused.shape[1:]
    grouped = fused.reshape(num_groups, per_group, d, *rest)
    q = grouped[:, : per_group - 2].reshape(-1, *rest).contiguous()
    k = grouped[:, per_group - 2].reshape(-1, *rest).contiguous()
    v = grouped[:, per_group - 1].reshape(-1, *rest).contiguous()
    return q, k, v


def tp_chunk(t: torch.Tensor, dim: int, tp_size: int, tp_rank: int) -> torch.Tensor:
    """This rank's contiguous chunk of `t` along `dim` (size must divide evenly)."""
    if t.shape[dim] % tp_size:
        raise ValueError(f"dim {dim} of shape {tuple(t.shape)} is not divisible by tensor_parallel={tp_size}")
    return t.chunk(tp_size, dim=dim)[tp_rank]


def fc1_shard(gate: torch.Tensor, up: torch.Tensor, tp_size: int, tp_rank: int) -> torch.Tensor:
    """HF gate/up `[ffn, h]` → this rank's `linear_fc1` shard `[2·ffn/tp, h]` = [gate_r; up_r]."""
    return torch.cat([tp_chunk(gate, 0, tp_size, tp_rank), tp_chunk(up, 0, tp_size, tp_rank)], dim=0)


def fc1_unshard(shards: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-rank `linear_fc1` shards (rank order) → HF (gate, up) `[ffn, h]` each."""
    halves = [s.chunk(2, dim=0) for s in shards]
    return torch.cat([g for g, _ in halves], dim=0), torch.cat([u for _, u in halves], dim=0)
