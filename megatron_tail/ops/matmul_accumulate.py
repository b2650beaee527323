"""`dest += a @ b` in place, for the fused output layer's gradients: the weight gradient summed over token
chunks (dest `[V_local, H]`, a = dlogitsᵀ `[V_local, n]`, b = hidden rows `[n, H]`) and the hidden gradient
summed over vocabulary blocks (dest `[n, H]`, a = dlogits `[n, cols]`, b = weight rows `[cols, H]`).

    add_matmul_(grad_weight, dlogits.t(), hidden_rows)

No temporary the size of `dest` exists at any point, whatever the dtypes:
- dest in the operands' dtype (the returned weight gradient is the weight's dtype; float32 weights): one
  `addmm_` (β = 1). BLAS accumulates the product in float32 and adds it to dest, so a bf16 dest is rounded
  once per call (per token block: 4 roundings on the Triton backend up to 87k tokens at H = 4,096, each
  relative 2⁻⁹ of the running sum),
  against megatron's one rounding of its single GEMM.
- float32 dest, bf16/fp16 operands (megatron's float32 `main_grad` under gradient-accumulation fusion;
  the hidden gradient's float32 accumulator over vocabulary blocks): on CUDA with torch ≥ 2.8, one cuBLAS
  call, `torch.addmm(dest, a, b, out_dtype=torch.float32, out=dest)`, which reads and writes dest in float32
  with no rounding of the product (Liger-Kernel's fused linear cross entropy does the same). The
  capability is probed once per (device, dtypes) by a 1 × 1 call (`_out_dtype_addmm_works`): a torch that
  lacks the overload (TypeError), or whose CUDA kernel refuses a float32 `self` (some releases require
  `self` in the operands' dtype: RuntimeError), or a CPU build (NotImplementedError, torch 2.13) falls back.
- fallback: dest in row blocks of at most `BLOCK_ELEMENTS` elements; per block on CUDA the product in the
  operands' dtype on the tensor cores (rounded once), added in float32; elsewhere (CPU BLAS, where float32
  GEMMs are the fast ones) the block's operands upcast and multiplied in float32 (exact products). Extra
  memory: one block's product, and on CPU b upcast (`[n, H]`, one token chunk's hidden rows).
"""

from __future__ import annotations

import torch

BLOCK_ELEMENTS = 1 << 24
"""Elements of one fallback block's product (`[rows, H]`): 64 MiB in float32; at H = 4,096, 4,096 rows of
the weight, so a 152k-row weight is 38 GEMMs per token chunk, each still large enough for the tensor cores."""

_OUT_DTYPE_WORKS: dict[tuple, bool] = {}


def _out_dtype_addmm_works(device: torch.device, operands: torch.dtype, dest: torch.dtype) -> bool:
    """Does `torch.addmm(dest, a, b, out_dtype=dest.dtype, out=dest)` run here for these dtypes? Tried once
    on 1 × 1 tensors (no value read back: an unsupported call raises on the host before any launch)."""
    key = (device.type, device.index, operands, dest)
    if key not in _OUT_DTYPE_WORKS:
        try:
            c = torch.zeros((1, 1), dtype=dest, device=device)
            a = torch.zeros((1, 1), dtype=operands, device=device)
            torch.addmm(c, a, a, out_dtype=dest, out=c)
            _OUT_DTYPE_WORKS[key] = True
        except (TypeError, RuntimeError):  # NotImplementedError is a RuntimeError
            _OUT_DTYPE_WORKS[key] = False
    return _OUT_DTYPE_WORKS[key]


def accumulation_path(dest: torch.Tensor, a: torch.Tensor) -> str:
    """Which way `add_matmul_` accumulates into `dest` for operands like `a` (the module docstring):
    "addmm" (one in-place call, dest in the operands' dtype), "addmm_out_dtype" (one in-place cuBLAS call
    into a wider dest) or "blocks" (the fallback)."""
    if dest.dtype == a.dtype:
        return "addmm"
    if dest.device.type == "cuda" and _out_dtype_addmm_works(dest.device, a.dtype, dest.dtype):
        return "addmm_out_dtype"
    return "blocks"


def add_matmul_(dest: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """`dest += a @ b` in place and return dest.

    Args:
        dest: `[m, k]` float (any layout addmm's `out=` accepts: a row slice of a contiguous tensor is fine).
        a: `[m, n]`, b: `[n, k]`: one float dtype, dest's or a narrower one.
    Sums over n; the product is never materialised whole in dest's shape (module docstring).
    """
    path = accumulation_path(dest, a)
    if path == "addmm":
        return dest.addmm_(a, b)
    if path == "addmm_out_dtype":
        return torch.addmm(dest, a, b, out_dtype=dest.dtype, out=dest)
    return add_matmul_blocks_(dest, a, b, upcast=dest.device.type != "cuda")


def add_matmul_blocks_(dest: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, upcast: bool) -> torch.Tensor:
    """The fallback of `add_matmul_`: row blocks of dest, each `dest[rows] += a[rows] @ b`; `upcast`: the
    product in dest's dtype from upcast operands (exact), else in the operands' dtype, then added."""
    step = max(1, BLOCK_ELEMENTS // max(dest.shape[1], 1))
    wide_b = b.to(dest.dtype) if upcast else b
    for start in range(0, dest.shape[0], step):
        rows = slice(start, min(start + step, dest.shape[0]))
        if upcast:
            dest[rows].addmm_(a[rows].to(dest.dtype), wide_b)
        else:
            dest[rows] += a[rows] @ b
    return dest
