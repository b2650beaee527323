"""Context parallelism (CP) for packed micro-batches: the load-balanced 2·CP split of every sequence, and
the gather of per-token results back into whole sequences.

    mbs = pack_micro_batches(samples, ..., sequence_multiple=2 * cp, pad_to_multiple=2 * cp * sp_tp)
    shards = [split_for_context_parallel(mb, groups.cp_rank, groups.cp_size) for mb in mbs]
    whole_out = gather_whole_outputs(shard, shard_out, groups.cp)   # [1, T] op outputs of the whole row

The index rule (one packed row, causal blocks `[a, b)` of the padded boundaries, each a multiple of 2·CP
long): a block of L tokens is cut into 2·CP chunks of L/(2·CP); rank r keeps chunk r and chunk 2·CP−1−r, in
that order, block after block. It is the rule of
- Transformer Engine: `thd_get_partitioned_indices` (common/fused_attn/context_parallel.cu, kernel
  `thd_partition_indices_kernel`), whose test `test_thd_get_partitioned_indices_matches_dual_chunk_expected_
  indices` (tests/pytorch/attention/test_cp_utils.py) expects rank 0 = [0, 1, 6, 7, 8, 9, 14, 15] for
  cu_seqlens [0, 8, 16] at CP = 2 (our test asserts the same);
- megatron-core 0.16.1's RoPE for THD under CP (models/common/embeddings/rope_utils.py,
  `_apply_rotary_pos_emb_thd` → `_get_thd_freqs_on_this_cp_rank`): each sequence's local tokens are its
  (global length)/CP, the first half at positions [r·seg, (r+1)·seg), the second at
  [L − (r+1)·seg, L − r·seg), seg = L/(2·CP) — the same chunks, so RoPE keeps each token's position in the
  original sequence when the model gets the *global* padded cu_seqlens (which it does: the shard keeps
  the whole row's `cu_seqlens`);
- megatron's `get_batch_on_this_cp_rank` (core/utils.py) for one unpacked sequence (chunks r, 2·CP−1−r).

Every per-token `[1, T]` tensor of the micro-batch is split by the same index, `fields` included, so any
per-token sample field (whatever its name) follows its tokens; the whole micro-batch stays on the shard
(`cp.whole`) for the sequence-level rules, which run on whole sequences (`train.rl.objective`).

The padding of a sequence to a multiple of 2·CP sits after its last token inside its own causal block
(cu_seqlens equal to cu_seqlens_padded): no real token attends to it (causal), it is never a loss token,
and Transformer Engine gets no padding between sequences, so every row of its output is written (with
`cu_seqlens_q != cu_seqlens_q_padded` TE leaves the padded rows unset and rules out its FlashAttention
backend, `thd_packed_seq_params`); the cost is < 2·CP extra tokens per sequence.
"""

from __future__ import annotations

from dataclasses import fields, replace

import torch
import torch.distributed as dist

from megatron_tail.model.cp_attention import context_parallel_index
from megatron_tail.ops import MaskedLogprobs

from .batch import CpShard, MicroBatch, take_positions
from .parallel import comm_device


def split_for_context_parallel(mb: MicroBatch, cp_rank: int, cp_size: int) -> MicroBatch:
    """CP rank `cp_rank`'s shard of the packed micro-batch `mb` (built with `sequence_multiple=2·CP`).

    Every per-token `[1, T]` tensor (tokens, targets, loss mask, sample index, padding, each of `fields`) is
    indexed by `context_parallel_index`; `cu_seqlens` stay the whole row's (the model's RoPE and attention
    take the global boundaries, see the module docstring); `sample_ids` are the whole micro-batch's, so a
    shard without loss tokens still counts as a micro-batch with samples. `extras` start empty.
    """
    if not mb.packed:
        raise ValueError(
            "context parallelism needs packed (THD) micro-batches: set train.max_tokens_per_micro_batch"
        )
    if cp_size == 1:
        return mb
    indices = tuple(context_parallel_index(mb.cu_seqlens, r, cp_size) for r in range(cp_size))
    index = indices[cp_rank]
    owner = torch.zeros_like(mb.loss_mask)
    owner[:, index] = True
    take = {name: getattr(mb, name)[:, index] for name in ("tokens", "targets", "loss_mask", "sample_index")}
    if mb.padding is not None:
        take["padding"] = mb.padding[:, index]
    return replace(
        mb,
        **take,
        fields={name: take_positions(value, index) for name, value in mb.fields.items()},
        extras={},
        num_loss_tokens=int(take["loss_mask"].sum()),
        num_sample_tokens=mb.num_sample_tokens,
        sample_rows=None,
        sample_cols=None,
        sample_valid=mb.sample_valid,
        cp=CpShard(
            whole=mb,
            index=index,
            indices=indices,
            sample_owned=mb.sample_valid & mb.to_samples(owner),
            rank=cp_rank,
            size=cp_size,
        ),
    )


def gather_whole_row(x: torch.Tensor, mb: MicroBatch, cp_group: dist.ProcessGroup) -> torch.Tensor:
    """Per-token `[k, T/CP]` values of every CP rank's shard → `[k, T]` of the whole row (float64 on the
    CPU: exact for float32, bool and int values). One all-gather over `cp_group`, on `comm_device()`."""
    cp = mb.cp
    local = x.to(device=comm_device(), dtype=torch.float64).contiguous()
    gathered = torch.empty((cp.size * local.shape[0], local.shape[1]), dtype=local.dtype, device=local.device)
    dist.all_gather_into_tensor(gathered, local, group=cp_group)
    gathered = gathered.view(cp.size, *local.shape)
    whole = torch.zeros((x.shape[0], cp.whole.tokens.shape[1]), dtype=torch.float64)
    for rank, index in enumerate(cp.indices):
        whole[:, index] = gathered[rank].cpu()
    return whole


def gather_whole_outputs(mb: MicroBatch, out: MaskedLogprobs, cp_group: dist.ProcessGroup) -> MaskedLogprobs:
    """The op's `[1, T/CP]` outputs on a CP shard → `[1, T]` outputs of the whole row (CPU, detached, each
    in its dtype); one all-gather of all fields stacked. Without CP, `out` itself."""
    if mb.cp is None:
        return out
    names = [f.name for f in fields(out) if getattr(out, f.name) is not None]
    stacked = torch.cat([getattr(out, n).detach().reshape(1, -1) for n in names])
    whole = gather_whole_row(stacked, mb, cp_group)
    values = {n: whole[i : i + 1].to(getattr(out, n).dtype) for i, n in enumerate(names)}
    return MaskedLogprobs(**{f.name: values.get(f.name) for f in fields(out)})
