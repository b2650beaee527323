"""Triton kernels of the masked log-prob op: the op's three passes over the logits, one program per row.

    row_max(x)                                   pass 1: `[N]` max over the valid columns (NaN if any NaN)
    partial_sums(x, max, θ, 1/T, cols, owned)    pass 2: `[N, NUM_PARTIALS]` the dense partial sums
    write_grad(x, out, max, θ, log S_K, bias, scale_h, 1/T)
                                                 backward: p·(bias + scale_h·log p) on V_S, 0 elsewhere

The math is `masked_logprobs_math`'s (its docstring has the notation); the collectives, the threshold rule
(`safe_vocab`, in torch so that the comparison is the sampler's bit for bit), the sampling support and the
target / support columns of the gradient stay in torch (`[N]`, `[N, K]` work), so these kernels are the
only `[N, V]` passes. Each program walks its row in `BLOCK`-column tiles; the logits are read in their own
dtype and upcast to the compute dtype (float32, float64 for float64 logits) right after each load, which is
also what Triton's interpreter needs (it holds bf16 as bit patterns). `tl.max` drops NaN, so pass 1 carries a
NaN flag: a NaN anywhere in a row makes its max NaN, and from there every output and gradient of the row,
as in the torch path.

Importing this module compiles nothing; on a CPU tensor the kernels run only under Triton's interpreter,
`TRITON_INTERPRET=1` set before this module is imported (`ops.backend.load_kernels` checks).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .masked_logprobs_math import NUM_PARTIALS, S_ALL, S_SAFE, S_SAFE_EZ, SAFE_COUNT, TARGET_LOGIT

MAX_BLOCK = 8192
"""Columns per tile at most: 32 KiB of float32 per program on the GPU (16 warps: 16 values per thread);
a 152k vocabulary is 19 tiles per row. A quarter of it for float64 logits (the gradcheck dtype), whose
doubled registers would spill at the full tile (`tests/ops/test_kernels_compile.py`). Untuned: no GPU has
timed it yet."""


def _block(n_cols: int, float64: bool = False) -> int:
    limit = MAX_BLOCK // 4 if float64 else MAX_BLOCK
    return max(16, min(limit, triton.next_power_of_2(max(n_cols, 1))))


def _warps(block: int) -> int:
    return 4 if block <= 1024 else 8 if block <= 4096 else 16


_COMPUTE = {torch.float64: tl.float64}


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
def _partials_kernel(
    X,
    stride_x,
    n_cols,
    MAX,
    THRESHOLD,
    TARGET_COL,
    OWNED,
    inv_t,
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
    for start in range(0, n_cols, BLOCK):
        c = start + cols
        valid = c < n_cols
        x = tl.load(base + c, mask=valid, other=float("-inf")).to(COMPUTE)
        z = (x - m) * inv_t
        e = tl.where(valid, tl.exp(z), 0.0)
        s_all += e
        safe = x >= threshold  # θ is finite: −inf logits and padding are never safe
        s_safe += tl.where(safe, e, 0.0)
        if WITH_ENTROPY:
            s_ez += tl.where(safe, e * z, 0.0)
        if WITH_COUNT:
            count += safe.to(COMPUTE)
    out = OUT + row * stride_out
    tl.store(out + COL_ALL, tl.sum(s_all, axis=0))
    tl.store(out + COL_SAFE, tl.sum(s_safe, axis=0))
    tl.store(out + COL_SAFE_EZ, tl.sum(s_ez, axis=0))
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
        block = _block(x.shape[1], x.dtype == torch.float64)
        _row_max_kernel[(x.shape[0],)](
            x, x.stride(0), x.shape[1], out, BLOCK=block, COMPUTE=_compute_dtype(x), num_warps=_warps(block)
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
        block = _block(x.shape[1], x.dtype == torch.float64)
        _partials_kernel[(x.shape[0],)](
            x,
            x.stride(0),
            x.shape[1],
            max_logit.contiguous(),
            threshold.contiguous(),
            local_target.contiguous(),
            owned.to(torch.int8).contiguous(),
            inv_temperature,
            out,
            out.stride(0),
            WITH_ENTROPY=with_entropy,
            WITH_COUNT=with_count,
            BLOCK=block,
            COMPUTE=_compute_dtype(x),
            COL_ALL=S_ALL,
            COL_SAFE=S_SAFE,
            COL_SAFE_EZ=S_SAFE_EZ,
            COL_TARGET=TARGET_LOGIT,
            COL_COUNT=SAFE_COUNT,
            num_warps=_warps(block),
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
    block = _block(x.shape[1], x.dtype == torch.float64)
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
        BLOCK=block,
        COMPUTE=_compute_dtype(x),
        num_warps=_warps(block),
    )
