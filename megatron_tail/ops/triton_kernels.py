"""Triton kernels of the masked log-prob op: the op's three passes over the logits, one program per row.

    row_max(x)                                   pass 1: `[N]` max over the valid columns (NaN if any NaN)
    partial_sums(x, max, θ, 1/T, cols, owned)    pass 2: `[N, NUM_PARTIALS]` the dense partial sums
    write_grad(x, out, max, θ, log S_K, bias, scale_h, 1/T)
                                                 backward: p·(bias + scale_h·log p) on V_S, 0 elsewhere

The math is `masked_logprobs_math`'s (its docstring has the notation); the collectives, the threshold rule
(`safe_vocab`, in torch so that the comparison is the sampler's bit for bit), the sampling support and the
target / support columns of the gradient stay in torch (`[N]`, `[N, K]` work), so these kernels are the
only `[N, V]` passes. Each program walks its row in `BLOCK`-column tiles, whose size and warps per kernel come
from one table of measured (H200) and projected configs (`TILES`, `tile`); the logits are read in their own
dtype and upcast to the compute dtype (float32, float64 for float64 logits) right after each load, which is
also what Triton's interpreter needs (it holds bf16 as bit patterns). `tl.max` drops NaN, so pass 1 carries a
NaN flag: a NaN anywhere in a row makes its max NaN, and from there every output and gradient of the row,
as in the torch path.

Importing this module compiles nothing; on a CPU tensor the kernels run only under Triton's interpreter,
`TRITON_INTERPRET=1` set before this module is imported (`ops.backend.load_kernels` checks).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .masked_logprobs_math import NUM_PARTIALS, S_ALL, S_SAFE, S_SAFE_EZ, SAFE_COUNT, TARGET_LOGIT


class Tile(NamedTuple):
    """One kernel's launch: columns per tile (`BLOCK`, a power of two) and warps per program (one per row)."""

    block: int
    num_warps: int


KERNELS = ("row_max", "partial_sums", "grad")

MEASURED_H200 = "H200 sm_90, bf16 16,384 × 151,936, 2026-11-28 (research/op-kernels.md)"
TILES: dict[tuple[str, str, tuple[int, int] | None], Tile] = {
    # Each pass alone on one H200 (measured, MEASURED_H200), ms per pass over the tile × warps tried:
    #                  1024×4  2048×8  4096×16  8192×16  8192×32  16384×16
    #   row max         1.10    1.10    1.10     1.39     1.11     1.33     a read at the copy rate
    #   partial sums    1.81    1.84    2.07     3.09     2.38     4.72     bound by instructions per element
    #   gradient        2.54    2.50    2.48     2.49     2.45     2.45     read + write, 92–95% of copy
    # Per pass the smallest tile within 2% of the fastest (fewer registers, a shorter partial tile at a
    # shard's end): 5.39 ms together, against 6.97 ms at 8192 × 16, the untuned tile used before for all.
    ("row_max", "16-bit", (9, 0)): Tile(1024, 4),
    ("partial_sums", "16-bit", (9, 0)): Tile(1024, 4),
    ("grad", "16-bit", (9, 0)): Tile(4096, 16),
    # Projected, not measured: other GPUs (A100 sm_80, B200 sm_100) and 4-byte logits take the H200's
    # 16-bit tiles (the partial sums' cost is per element, not per byte, and 8 values per thread fit the
    # registers of every pass at 4 bytes too). float64, the gradcheck dtype: 2048 × 8, 8 values per thread
    # as before (`tests/ops/test_kernels_compile.py` checks that no tile spills on sm_80 and sm_90a).
    ("row_max", "16-bit", None): Tile(1024, 4),
    ("partial_sums", "16-bit", None): Tile(1024, 4),
    ("grad", "16-bit", None): Tile(4096, 16),
    ("row_max", "32-bit", None): Tile(1024, 4),
    ("partial_sums", "32-bit", None): Tile(1024, 4),
    ("grad", "32-bit", None): Tile(4096, 16),
    ("row_max", "64-bit", None): Tile(2048, 8),
    ("partial_sums", "64-bit", None): Tile(2048, 8),
    ("grad", "64-bit", None): Tile(2048, 8),
}
"""Launch config per (kernel, logits dtype width, device capability; None = any other device), for rows of
at least a tile. A narrower row (a small shard, a test) takes one tile of `next_power_of_2(columns)` columns
with at most the table's warps (`tile`). The widths the shards of Qwen3's 151,936-token vocabulary have
(75,968 at TP = 2, 37,984 at 4, 18,992 at 8) take the table's tiles: 19 or more tiles per row, whose cost per
element is the measured one (projected: only 151,936 was timed)."""

INTERPRETER_TILE = Tile(256, 1)
"""Under Triton's interpreter (CPU tensors, tests only): one fixed small tile, so the tests' rows of a few
hundred columns span several tiles, the last one partial, as a GPU's rows do, at a cost the CPU suite can
afford (the interpreter runs each tile as numpy calls)."""


def _width_class(dtype: torch.dtype) -> str:
    return f"{min(max(torch.finfo(dtype).bits, 16), 64)}-bit"


@functools.cache
def _capability(index: int | None) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def tile(kernel: str, dtype: torch.dtype, n_cols: int, device: torch.device) -> Tile:
    """The launch config of `kernel` ("row_max", "partial_sums" or "grad") over rows of `n_cols` columns of
    `dtype` logits on `device` (`TILES`; `INTERPRETER_TILE` off CUDA)."""
    if device.type != "cuda":
        base = INTERPRETER_TILE
    else:
        key = (kernel, _width_class(dtype))
        base = TILES.get((*key, _capability(device.index)), TILES[(*key, None)])
    block = max(16, min(base.block, triton.next_power_of_2(max(n_cols, 1))))
    # a narrowed tile keeps 8 values per thread (256 columns per warp), as every tile of the table does
    return Tile(block, max(1, min(base.num_warps, block // 256)))


def tiles(dtype: torch.dtype, n_cols: int, device: torch.device) -> dict[str, Tile]:
    """Every kernel's launch config for such rows."""
    return {k: tile(k, dtype, n_cols, device) for k in KERNELS}


def describe_tiles(dtype: torch.dtype, n_cols: int, device: torch.device) -> str:
    """The configs `tiles` picks, and where they come from, on one line (what `bench.op` prints)."""
    configs = " · ".join(f"{k} {t.block}×{t.num_warps}" for k, t in tiles(dtype, n_cols, device).items())
    if device.type != "cuda":
        return f"{configs} (Triton's interpreter: one fixed tile)"
    major, minor = _capability(device.index)
    measured = all((k, _width_class(dtype), (major, minor)) in TILES for k in KERNELS)
    source = f"measured table, {MEASURED_H200}" if measured else "projected: no timing on this device"
    return f"{configs} (sm_{major}{minor}, {source})"


_COMPUTE = {torch.float64: tl.float64}
LOG2_E = 1.4426950408889634


def _compute_dtype(x: torch.Tensor):
    return _COMPUTE.get(x.dtype, tl.float32)


@triton.jit
def _row_max_kernel(X, stride_x, n_cols, OUT, BLOCK: tl.constexpr, COMPUTE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = X + row * stride_x
    cols = tl.arange(0, BLOCK)
    best = tl.full([BLOCK], float("-inf"), COMPUTE)
    nan = tl.zeros([BLOCK], tl.int32)
    for start in range(0, n_cols, BLOCK):
        c = start + cols
        x = tl.load(base + c, mask=c < n_cols, other=float("-inf")).to(COMPUTE)
        best = tl.maximum(best, x)
        nan = tl.maximum(nan, (x != x).to(tl.int32))
    row_max = tl.max(best, axis=0)
    row_max = tl.where(tl.max(nan, axis=0) > 0, float("nan"), row_max)
    tl.store(OUT + row, row_max)


@triton.jit
def _sums_tile(x, m, threshold, exp2_scale, s_all, s_safe, s_ez, count, WITH_ENTROPY: tl.constexpr,
               WITH_COUNT: tl.constexpr):  # fmt: skip
    # base-2 exponent z/ln 2 = (x − m)/T·log2(e): one multiply into exp2, no log2(e) multiply inside exp;
    # x − m first, so the row max's own exponent is exactly 0
    z2 = (x - m) * exp2_scale
    e = tl.exp2(z2)
    s_all += e
    safe = x >= threshold  # θ is finite: −inf logits (and the tail's masked lanes) are never safe
    s_safe += tl.where(safe, e, 0.0)
    if WITH_ENTROPY:
        s_ez += tl.where(safe, e * z2, 0.0)  # after the product: 0·(−inf) is NaN on −inf logits
    if WITH_COUNT:
        count += safe.to(s_all.dtype)
    return s_all, s_safe, s_ez, count


@triton.jit
def _partials_kernel(
    X,
    stride_x,
    n_cols,
    MAX,
    THRESHOLD,
    TARGET_COL,
    OWNED,
    exp2_scale,
    OUT,
    stride_out,
    WITH_ENTROPY: tl.constexpr,
    WITH_COUNT: tl.constexpr,
    BLOCK: tl.constexpr,
    COMPUTE: tl.constexpr,
    COL_ALL: tl.constexpr,
    COL_SAFE: tl.constexpr,
    COL_SAFE_EZ: tl.constexpr,
    COL_TARGET: tl.constexpr,
    COL_COUNT: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    base = X + row * stride_x
    m = tl.load(MAX + row)
    threshold = tl.load(THRESHOLD + row)
    cols = tl.arange(0, BLOCK)
    s_all = tl.zeros([BLOCK], COMPUTE)
    s_safe = tl.zeros([BLOCK], COMPUTE)
    s_ez = tl.zeros([BLOCK], COMPUTE)
    count = tl.zeros([BLOCK], COMPUTE)
    # This pass is bound by instructions per element, not by memory: whole tiles load without a mask,
    # and only the last, partial one (0 or 1 iterations of the second loop) pays for it.
    whole = n_cols - n_cols % BLOCK
    for start in range(0, whole, BLOCK):
        x = tl.load(base + start + cols).to(COMPUTE)
        s_all, s_safe, s_ez, count = _sums_tile(
            x, m, threshold, exp2_scale, s_all, s_safe, s_ez, count, WITH_ENTROPY, WITH_COUNT
        )
    for start in range(whole, n_cols, BLOCK):
        # masked lanes read −inf: e = 0, never safe (m = ±inf or NaN makes the row's valid lanes NaN too)
        x = tl.load(base + start + cols, mask=start + cols < n_cols, other=float("-inf")).to(COMPUTE)
        s_all, s_safe, s_ez, count = _sums_tile(
            x, m, threshold, exp2_scale, s_all, s_safe, s_ez, count, WITH_ENTROPY, WITH_COUNT
        )
    out = OUT + row * stride_out
    tl.store(out + COL_ALL, tl.sum(s_all, axis=0))
    tl.store(out + COL_SAFE, tl.sum(s_safe, axis=0))
    tl.store(out + COL_SAFE_EZ, tl.sum(s_ez, axis=0) * 0.6931471805599453)  # base 2 back to e: × ln 2
    tl.store(out + COL_COUNT, tl.sum(count, axis=0))
    owned = tl.load(OWNED + row) != 0
    target = tl.load(base + tl.load(TARGET_COL + row), mask=owned, other=0.0).to(COMPUTE)
    tl.store(out + COL_TARGET, target)


@triton.jit
def _grad_kernel(
    X,
    stride_x,
    G,
    stride_g,
    n_cols,
    MAX,
    THRESHOLD,
    LOG_NORM,
    BIAS,
    SCALE_H,
    inv_t,
    HAS_SCALE_H: tl.constexpr,
    BLOCK: tl.constexpr,
    COMPUTE: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    base_x = X + row * stride_x
    base_g = G + row * stride_g
    m = tl.load(MAX + row)
    threshold = tl.load(THRESHOLD + row)
    log_norm = tl.load(LOG_NORM + row)
    bias = tl.load(BIAS + row)
    scale_h = bias * 0.0  # a tensor like bias in both branches (NaN with a NaN bias: poisoned anyway)
    if HAS_SCALE_H:
        scale_h = tl.load(SCALE_H + row)
    # the torch path's NaN semantics: a NaN max (a NaN logit), norm or upstream gradient poisons the row
    poisoned = (m != m) | (log_norm != log_norm) | (bias != bias) | (scale_h != scale_h)
    cols = tl.arange(0, BLOCK)
    for start in range(0, n_cols, BLOCK):
        c = start + cols
        valid = c < n_cols
        # G may be X itself (in place): this tile is read whole before it is written
        x = tl.load(base_x + c, mask=valid, other=float("-inf")).to(COMPUTE)
        log_p = (x - m) * inv_t - log_norm
        safe = x >= threshold
        p = tl.exp(log_p)
        if HAS_SCALE_H:
            g = p * (bias + scale_h * log_p)
        else:
            g = p * bias
        g = tl.where(safe, g, 0.0)
        g = tl.where(poisoned, float("nan"), g)
        tl.store(base_g + c, g.to(G.dtype.element_ty), mask=valid)


def row_max(x: torch.Tensor, compute_dtype: torch.dtype) -> torch.Tensor:
    """`[N]` max of each row of `x` (`[N, V]`, unit column stride), NaN where the row holds a NaN."""
    out = torch.empty(x.shape[0], dtype=compute_dtype, device=x.device)
    if x.shape[0]:
        t = tile("row_max", x.dtype, x.shape[1], x.device)
        _row_max_kernel[(x.shape[0],)](
            x, x.stride(0), x.shape[1], out, BLOCK=t.block, COMPUTE=_compute_dtype(x), num_warps=t.num_warps
        )
    return out


def partial_sums(
    x: torch.Tensor,
    max_logit: torch.Tensor,
    threshold: torch.Tensor,
    inv_temperature: float,
    local_target: torch.Tensor,
    owned: torch.Tensor,
    with_entropy: bool,
    with_count: bool,
) -> torch.Tensor:
    """`masked_logprobs_math.chunk_partial_sums` of all rows at once: `[N, NUM_PARTIALS]` in max_logit's
    dtype, the support's columns left 0."""
    out = torch.zeros((x.shape[0], NUM_PARTIALS), dtype=max_logit.dtype, device=x.device)
    if x.shape[0] and x.shape[1]:
        t = tile("partial_sums", x.dtype, x.shape[1], x.device)
        _partials_kernel[(x.shape[0],)](
            x,
            x.stride(0),
            x.shape[1],
            max_logit.contiguous(),
            threshold.contiguous(),
            local_target.contiguous(),
            owned.to(torch.int8).contiguous(),
            inv_temperature * LOG2_E,
            out,
            out.stride(0),
            WITH_ENTROPY=with_entropy,
            WITH_COUNT=with_count,
            BLOCK=t.block,
            COMPUTE=_compute_dtype(x),
            COL_ALL=S_ALL,
            COL_SAFE=S_SAFE,
            COL_SAFE_EZ=S_SAFE_EZ,
            COL_TARGET=TARGET_LOGIT,
            COL_COUNT=SAFE_COUNT,
            num_warps=t.num_warps,
        )
    return out


def write_grad(
    x: torch.Tensor,
    out: torch.Tensor,
    *,
    max_logit: torch.Tensor,
    threshold: torch.Tensor,
    log_norm: torch.Tensor,
    bias: torch.Tensor,
    scale_h: torch.Tensor | None,
    inv_temperature: float,
) -> None:
    """Write p·(bias + scale_h·log p) on V_S (0 elsewhere) for every row into `out` (`[N, V]`, unit column
    stride; may be `x` itself), in out's dtype. The target and support columns are the caller's to
    overwrite (`masked_logprobs_triton`)."""
    if not (x.shape[0] and x.shape[1]):
        return
    t = tile("grad", x.dtype, x.shape[1], x.device)
    _grad_kernel[(x.shape[0],)](
        x,
        x.stride(0),
        out,
        out.stride(0),
        x.shape[1],
        max_logit.contiguous(),
        threshold.contiguous(),
        log_norm.contiguous(),
        bias.contiguous(),
        bias if scale_h is None else scale_h.contiguous(),
        inv_temperature,
        HAS_SCALE_H=scale_h is not None,
        BLOCK=t.block,
        COMPUTE=_compute_dtype(x),
        num_warps=t.num_warps,
    )
