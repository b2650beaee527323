"""Batch-invariant attention for the local engine: a sequence's tokens and log-probs do not depend on what
else is in the running batch, as SGLang's `--enable-deterministic-inference` makes them (batch-invariant
kernels).

HF's SDPA attention (`transformers/integrations/sdpa_attention.py: sdpa_attention_forward`) takes a different
kernel path for the same row when the batch is left-padded: with no mask it runs GQA inside SDPA
(`enable_gqa`), with a padding mask it packs the query heads (`pack_gqa`, one query) or repeats the key/value
heads (`repeat_kv`). The two round differently in bf16. On an AMD EPYC (AVX2) a tiny Qwen3's log-probs moved
by up to 0.03 nats when a sequence ran beside others instead of alone, so two runs of the same seeds
sampled different tokens wherever the requests' arrival (timing) batched them differently.

Here every row attends as if alone: its own keys (the suffix the left padding leaves, `ContinuousBatcher`),
its own queries, no mask, the call a batch of that one sequence makes. Rows of the same length share one
call (SDPA computes each batch row on its own; a group's samples grow in step, so they usually do). The
projections and MLPs stay batched (row-wise matmuls, batch-invariant on the CPUs we test). Checked in
`tests/rollout/test_local_engine.py`.
"""

from __future__ import annotations

import weakref

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

ROW_INVARIANT_SDPA = "megatron_tail_row_sdpa"
"""The `attn_implementation` name the local engine loads its model with (registered below)."""


def row_invariant_sdpa(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """HF's attention-function signature. `query` `[B, heads, q, head_dim]`, `key` / `value`
    `[B, kv_heads, T, head_dim]`, `attention_mask` bool `[B, 1, q, T]` (True: attend; None: no padding and
    causal). Left padding: a row's keys are the last `n` of T, its real queries the last `min(q, n)`.
    Returns `[B, q, heads, head_dim]`; padded query positions are zeros (their outputs are never read).
    One SDPA call per distinct row length."""
    batch, _, q_len, _ = query.shape
    windowed = kwargs.get("sliding_window") is not None
    out = query.new_zeros(batch, q_len, query.shape[1], value.shape[-1])
    for n, pick in _row_groups(attention_mask, batch, key.shape[2], query.device):
        n_q = min(q_len, n)
        row_mask = None
        if windowed and attention_mask is not None:  # a window is not the plain causal mask: keep it
            row_mask = attention_mask[pick][:, :, q_len - n_q :, key.shape[2] - n :]
        result, _ = sdpa_attention_forward(
            module,
            query[pick][:, :, q_len - n_q :],
            key[pick][:, :, key.shape[2] - n :],
            value[pick][:, :, value.shape[2] - n :],
            row_mask,
            **kwargs,
        )
        out[pick, q_len - n_q :] = result
    return out, None


_groups_of_mask: tuple = (None, [])
"""(weak reference to the last mask, its row groups): HF builds a forward's mask once and hands the same
tensor to every layer (`Qwen3Model.forward`'s `causal_mask_mapping`), so its lengths are read to the host
once per forward, not once per layer (on a GPU each read waits for the device)."""


def _row_groups(
    attention_mask: torch.Tensor | None, batch: int, keys: int, device: torch.device
) -> list[tuple[int, slice | torch.Tensor]]:
    """`(n, rows)` per distinct row length n: `rows` indexes the batch rows of that length (a slice where
    it is every row: views, not copies of the KV cache)."""
    global _groups_of_mask
    if attention_mask is None:
        return [(keys, slice(None))]
    cached, groups = _groups_of_mask
    if cached is not None and cached() is attention_mask:
        return groups
    lengths = _row_lengths(attention_mask)
    rows_of: dict[int, list[int]] = {}
    for b, n in enumerate(lengths):
        rows_of.setdefault(n, []).append(b)
    groups = [
        (n, slice(None) if len(rows) == batch else torch.tensor(rows, device=device))
        for n, rows in rows_of.items()
    ]
    _groups_of_mask = (weakref.ref(attention_mask), groups)
    return groups


def _row_lengths(attention_mask: torch.Tensor) -> list[int]:
    """Each row's key count (host ints; one device→host read): the last query of a row sees every key of
    the row (its causal horizon)."""
    return attention_mask[:, 0, -1].sum(-1).tolist()


AttentionInterface.register(ROW_INVARIANT_SDPA, row_invariant_sdpa)
AttentionMaskInterface.register(ROW_INVARIANT_SDPA, sdpa_mask)
