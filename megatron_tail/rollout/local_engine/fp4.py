"""NVFP4 weights with bf16 activations (W4A16) on CPU: `rollout.quantization: nvfp4_a16` on the local engine.

How SGLang 0.5.23 serves 4-bit weights on a dense model:
- `--quantization modelopt_fp4` on a ModelOpt NVFP4A16 checkpoint gives every `LinearBase` a
  `ModelOptNvFp4A16LinearMethod` (srt/layers/quantization/modelopt_quant.py): packed e2m1 weights, one
  e4m3 scale per 16 consecutive inputs (`group_size = 16`, checked in `process_weights_after_loading`) and
  one fp32 global scale `weight_scale_2` per tensor; `apply` → `apply_fp4_marlin_linear` dequantizes the
  weights group by group and multiplies bf16 activations (no activation quantization). Embeddings, the LM
  head and the norms stay in the model dtype.
- SGLang has no online 4-bit path for dense layers: `--quantization nvfp4_online`
  (srt/layers/quantization/nvfp4_online.py, `NvFp4OnlineConfig.get_quant_method`) converts MoE experts only
  ("dense layers retain their source precision"). Its expert recipe (`_quantize_weight_nvfp4`) fixes the
  global decode scale at amax(W) / (448 · 6), the scale the emulation below uses.

So serving an RL policy in NVFP4 means exporting an NVFP4 checkpoint at every weight sync; the local engine
emulates that by re-quantizing after every update (as `fp8.py` does): block scale = e4m3(block amax / 6 /
global scale), element = nearest e2m1 value of w / (block scale · global scale), round to nearest (ModelOpt's
default; FlashInfer's "4over6" MSE search of `_quantize_weight_nvfp4` is not emulated).
"""

from __future__ import annotations

import torch
from torch import nn

from .fp8 import E4M3, E4M3_MAX, SCALE_EPS

FP4_MAX = 6.0
GROUP = 16
E2M1_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
"""The non-negative magnitudes of e2m1 (1 sign, 2 exponent, 1 mantissa bits)."""
_MIDPOINTS = (E2M1_VALUES[1:] + E2M1_VALUES[:-1]) / 2


def round_to_e2m1(x: torch.Tensor) -> torch.Tensor:
    """Nearest e2m1 value of each element of `x` (fp32; magnitudes clamped to 6; ties go down)."""
    index = torch.bucketize(x.abs().clamp(max=FP4_MAX), _MIDPOINTS)
    return E2M1_VALUES[index] * x.sign()


def nvfp4_dequantized(weight: torch.Tensor) -> torch.Tensor:
    """`weight` `[N, K]` (K a multiple of 16) → its NVFP4 round trip `[N, K]` fp32: global scale
    amax / (448 · 6) per tensor, one e4m3 scale per 16 inputs of a row (reduced over the group), e2m1
    elements."""
    n, k = weight.shape
    if k % GROUP:
        raise ValueError(f"NVFP4 needs in_features to be a multiple of {GROUP}; got weight shape {(n, k)}")
    w = weight.float().reshape(n, k // GROUP, GROUP)
    global_scale = (w.abs().amax() / (E4M3_MAX * FP4_MAX)).clamp(min=SCALE_EPS)
    block = (w.abs().amax(dim=-1, keepdim=True) / FP4_MAX / global_scale).clamp(max=E4M3_MAX)
    block = block.to(E4M3).float() * global_scale  # the stored e4m3 block scale, decoded
    elements = round_to_e2m1(w / block.clamp(min=SCALE_EPS))
    return (elements * block).reshape(n, k)


class Nvfp4Linear(nn.Module):
    """An `nn.Linear` served with NVFP4 weights and unquantized activations; `weight`/`bias` stay the loaded
    parameters (weight updates address them by name), `requantize()` derives the 4-bit round trip."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        self.register_buffer("_weight_dequantized", torch.empty(0), persistent=False)
        self.requantize()

    @torch.no_grad()
    def requantize(self) -> None:
        self._weight_dequantized = nvfp4_dequantized(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """`x` `[..., K]` → `[..., N]` in x's dtype (fp32 accumulation, as Marlin's)."""
        out = x.float() @ self._weight_dequantized.t()
        if self.bias is not None:
            out = out + self.bias.float()
        return out.to(x.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, nvfp4 w4a16"
