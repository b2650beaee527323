"""An FP8 (e4m3) KV cache on CPU: `rollout.local.kv_cache_dtype: fp8_e4m3` on the local engine.

What SGLang 0.5.23 does with `--kv-cache-dtype fp8_e4m3`: the attention layer writes each token's key and
value into the pool through `MHATokenToKVPool.set_kv_buffer` (srt/mem_cache/memory_pool.py), which divides by
the layer's `k_scale` / `v_scale` when the checkpoint carries them (`BaseKVCacheMethod`,
srt/layers/quantization/kv_cache.py; a bf16 checkpoint has none, so `RadixAttention.k_scale` stays None,
srt/layers/radix_attention.py) and casts `cache_k.to(self.dtype)` to e4m3; attention then reads every key
and value, the current token's included, from that pool. So with a bf16 checkpoint every K/V element the
attention sees is its e4m3 rounding at scale 1. `Fp8KVCache` stores and returns exactly that.
Magnitudes beyond ±448 are clamped (the cast's saturating behaviour on GPUs is assumed; the tail models'
keys and values are far below it).
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

from .fp8 import E4M3, E4M3_MAX

KV_CACHE_DTYPES = ("auto", "fp8_e4m3")
"""`rollout.local.kv_cache_dtype`: "auto" (the engine's dtype) or "fp8_e4m3"."""


def e4m3_round_trip(x: torch.Tensor) -> torch.Tensor:
    """`x` rounded to e4m3 at scale 1 (clamped to ±448), back in x's dtype; same shape."""
    return x.float().clamp(-E4M3_MAX, E4M3_MAX).to(E4M3).to(x.dtype)


class Fp8KVCache(DynamicCache):
    """A `DynamicCache` whose stored (and so returned) keys and values are e4m3 round trips."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        return super().update(
            e4m3_round_trip(key_states), e4m3_round_trip(value_states), layer_idx, *args, **kwargs
        )
