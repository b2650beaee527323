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
    if attention_mask is None:
        lengths = [key.shape[2]] * batch
    else:  # the last query of a row sees every key of the row (its causal horizon)
        lengths = attention_mask[:, 0, -1].sum(-1).tolist()
    windowed = kwargs.get("sliding_window") is not None
    out = query.new_zeros(batch, q_len, query.shape[1], value.shape[-1])
    rows_of: dict[int, list[int]] = {}
    for b, n in enumerate(lengths):
        rows_of.setdefault(n, []).append(b)
    for n, rows in rows_of.items():  # rows of one length: the same call, row by row independent
        n_q = min(q_len, n)
        # every row (one length: a row alone, a group in step): views, not copies of the KV cache
        pick = slice(None) if len(rows) == batch else torch.tensor(rows, device=query.device)
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


AttentionInterface.register(ROW_INVARIANT_SDPA, row_invariant_sdpa)
AttentionMaskInterface.register(ROW_INVARIANT_SDPA, sdpa_mask)
