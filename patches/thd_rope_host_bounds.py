"""megatron's unfused THD RoPE from host boundaries (megatron-core 0.16.x): `use_host_rope_bounds()`.

`_apply_rotary_pos_emb_thd` (`models/common/embeddings/rope_utils.py`), the RoPE of packed micro-batches
without Transformer Engine's fusion (`apply_rope_fusion` off: the local layer spec), reads the boundaries
back from the device three ways: `.tolist()` of the lengths, the truth value of `freqs.size(0) ==
cu_seqlens[-1]`, and `.item()` of each start. On a GPU that is several device→host syncs in every layer,
twice (query and key), per micro-batch, each draining the GPU's queue. Where the boundaries' tensor carries
its host copy (`HOST_BOUNDS`, set by `model.thd_attention.thd_packed_seq_params`), the patched function
computes the same thing from that copy, with megatron's own helpers; any other call goes to megatron's
function as it was. GPUs too (that is where it matters); a no-op for every other RoPE.
"""

from __future__ import annotations

import importlib
from itertools import pairwise

import torch

from .pinning import check_pinned

HOST_BOUNDS = "_mt_host_bounds"
"""Attribute of a `cu_seqlens` tensor: the same boundaries as a tuple of Python ints."""

_MODULE = "megatron.core.models.common.embeddings.rope_utils"
_NAME = "_apply_rotary_pos_emb_thd"
_original = None
_rope = None
"""megatron's module, bound once: the patched function runs in every layer."""


def use_host_rope_bounds() -> None:
    """Route megatron's unfused THD RoPE through `_from_host_bounds`. Idempotent."""
    global _original, _rope
    if _original is not None:
        return
    check_pinned()
    _rope = importlib.import_module(_MODULE)
    _original = getattr(_rope, _NAME)
    setattr(_rope, _NAME, _from_host_bounds)


def stop_using_host_rope_bounds() -> None:
    """megatron's function again (for the test that compares the two)."""
    global _original
    if _original is not None:
        setattr(importlib.import_module(_MODULE), _NAME, _original)
        _original = None


def _from_host_bounds(
    t: torch.Tensor,
    cu_seqlens: torch.Tensor,
    freqs: torch.Tensor,
    rotary_interleaved: bool = False,
    multi_latent_attention: bool = False,
    mscale: float = 1.0,
    cp_group=None,
) -> torch.Tensor:
    """megatron-core 0.16.1's `_apply_rotary_pos_emb_thd`, line for line, with the boundaries read from
    `cu_seqlens`'s host copy: `[t, h, d]` in, `[t, h, d]` out."""
    bounds = getattr(cu_seqlens, HOST_BOUNDS, None)
    if bounds is None or cp_group is None:
        return _original(t, cu_seqlens, freqs, rotary_interleaved, multi_latent_attention, mscale, cp_group)
    rope = _rope
    cp_size, cp_rank = cp_group.size(), cp_group.rank()
    seqlens = [(b - a) // cp_size for a, b in pairwise(bounds)]
    splits = torch.split(t, seqlens)
    if freqs.dim() >= 1 and freqs.size(0) == bounds[-1]:  # megatron's CASE 1: each sequence at its offset
        slices = [
            rope._get_thd_freqs_on_this_cp_rank(cp_rank, cp_size, x, freqs, start)
            for x, start in zip(splits, bounds, strict=False)
        ]
    else:  # CASE 2: every sequence from position 0
        slices = [rope._get_thd_freqs_on_this_cp_rank(cp_rank, cp_size, x, freqs) for x in splits]
    return rope._apply_rotary_pos_emb_bshd(
        t.unsqueeze(1),
        torch.cat(slices, dim=0),
        rotary_interleaved=rotary_interleaved,
        multi_latent_attention=multi_latent_attention,
        mscale=mscale,
    ).squeeze(1)
