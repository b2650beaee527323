"""FP8 (e4m3) rollouts on CPU, with SGLang's numerics: `rollout.quantization: fp8` on the local engine.

What SGLang 0.5.23 does with `--quantization fp8` on a bf16 checkpoint (srt/layers/quantization/fp8.py):
- `Fp8Config.get_quant_method` gives every `LinearBase` (q/k/v/o, gate/up/down projections) an
  `Fp8LinearMethod`; embeddings and the LM head (`VocabParallelEmbedding`/`ParallelLMHead`) and the norms
  stay in the model dtype.
- `Fp8LinearMethod.process_weights_after_loading`, checkpoint not fp8-serialized: on GPUs where
  `cutlass_fp8_supported()` (sm89+, so H100) it quantizes per output channel,
  `per_token_group_quant_fp8(weight, weight.shape[-1])` (sglang/kernels/ops/quantization/fp8_kernel.py,
  `_per_token_group_quant_8bit`: scale = max(|row|, eps) / 448, q = clamp(row · (1/scale), ±448) → e4m3fn);
  elsewhere per tensor (`fp8_utils.input_to_float8`). We use per-channel: the H100 recipes' case.
- `Fp8LinearMethod.apply` → `fp8_utils.apply_fp8_linear` with no static input scale: activations are
  quantized dynamically per token (`sglang_per_token_quant_fp8`), the GEMM accumulates in fp32 and
  rescales by (token scale × channel scale) into the activation dtype.

Here the GEMM runs on the dequantized values in fp32, `(q_x · s_x) @ (q_w · s_w)ᵀ`, then casts to the
model dtype: the same numbers up to fp32 summation order. The engine quantizes at load and after every
weight update (`formats.requantize_`), as SGLang's FP8 RL reload does (`QuantizedRLModelLoader`, see
`megatron_tail/rollout/weight_sync.py`).
"""

from __future__ import annotations

import torch
from torch import nn

E4M3 = torch.float8_e4m3fn
E4M3_MAX = float(torch.finfo(E4M3).max)  # 448
SCALE_EPS = 1e-10
"""Floor of a row's absolute maximum (SGLang's `eps` in `per_token_group_quant_fp8`), so a zero row
quantizes to zeros instead of NaN."""


def quantize_tensor(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-tensor e4m3 quantization: `x` any shape → `(q float8_e4m3fn, scale [] float32)`, scale =
    max |x| / 448 over every element (SGLang's `fp8_utils.input_to_float8` for weights and its dynamic
    per-tensor `scaled_fp8_quant(x, None)` for activations)."""
    xf = x.float()
    scale = xf.abs().amax().clamp(min=SCALE_EPS) / E4M3_MAX
    return (xf * scale.reciprocal()).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3), scale


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row e4m3 quantization (rows = the leading dims, one scale per row).

    `x` `[..., K]` any float dtype → `(q [..., K] float8_e4m3fn, scale [..., 1] float32)` with
    `x ≈ q · scale`; scale = max_k |x| / 448 (floored at `SCALE_EPS / 448`), reduced over the last dim.
    For a weight `[N, K]` that is SGLang's per-output-channel scale; for activations `[T, K]`, its dynamic
    per-token scale.
    """
    xf = x.float()
    amax = xf.abs().amax(dim=-1, keepdim=True).clamp(min=SCALE_EPS)
    scale = amax / E4M3_MAX
    q = (xf * scale.reciprocal()).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
    return q, scale


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """`q · scale` in fp32 (shapes as `quantize_rows` returns them)."""
    return q.float() * scale


class Fp8Linear(nn.Module):
    """An `nn.Linear` served in FP8: the wrapped layer's `weight` (and `bias`) stay the loaded parameters
    (same names, so weight updates address them as before); `requantize()` derives the e4m3 weight and its
    per-channel scales from them, and `forward` quantizes each token's input and multiplies the dequantized
    values in fp32.
    """

    def __init__(self, linear: nn.Linear, per_tensor: bool = False):
        super().__init__()
        self.per_tensor = per_tensor
        self._quantize = quantize_tensor if per_tensor else quantize_rows
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        self.register_buffer("weight_fp8", torch.empty(0, dtype=E4M3), persistent=False)
        self.register_buffer("weight_scale", torch.empty(0), persistent=False)
        self.register_buffer("_weight_dequantized", torch.empty(0), persistent=False)
        self.requantize()

    @torch.no_grad()
    def requantize(self) -> None:
        """e4m3 weight `[N, K]` + fp32 scales `[N, 1]` from the current `weight`."""
        self.weight_fp8, self.weight_scale = self._quantize(self.weight)
        self._weight_dequantized = dequantize(self.weight_fp8, self.weight_scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """`x` `[..., K]` (model dtype) → `[..., N]` in x's dtype."""
        q, scale = self._quantize(x.reshape(-1, x.shape[-1]))
        out = dequantize(q, scale) @ self._weight_dequantized.t()
        if self.bias is not None:
            out = out + self.bias.float()
        return out.to(x.dtype).reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        scheme = "per-tensor" if self.per_tensor else "per-channel"
        return f"in_features={self.in_features}, out_features={self.out_features}, e4m3 {scheme}"
