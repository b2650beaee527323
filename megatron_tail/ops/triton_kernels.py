"""Triton kernels of the masked log-prob op: the op's three passes over the logits, one program per row.

    row_max(x)                                   pass 1: `[N]` max over the valid columns (NaN if any NaN)
    partial_sums(x, max, θ, 1/T, cols, owned)    pass 2: `[N, NUM_PARTIALS]` the dense partial sums
    max_and_sums(x, …, offset, launch)           TP = 1: both passes and θ in one program per row
    write_grad(x, out, max, θ, log S_K, bias, scale_h, 1/T[, targets, start, target_add])
                                                 backward: p·(bias + scale_h·log p) on V_S, 0 elsewhere
                                                 (and the target's column, for calls without a support)

The math is `masked_logprobs_math`'s (its docstring has the notation); the collectives, the threshold rule
(`safe_vocab`, in torch so that the comparison is the sampler's bit for bit), the sampling support and the
target / support columns of the gradient stay in torch (`[N]`, `[N, K]` work; without a support the gradient
kernel writes the target's column, a dozen launches fewer per call or fused block), so these
kernels are the only `[N, V]` passes. At TP = 1 nothing sits between the passes, and where a GPU run measured
it faster (`ONE_PROGRAM`) one persistent kernel does both and θ in between, with `safe_threshold`'s one
rounding of the same two values. Each program walks its row in `BLOCK`-column tiles, whose size and warps per
kernel come from one table of measured (H200) and projected configs (`TILES`, `tile`); the logits are read in
their own dtype and upcast to the compute dtype (float32, float64 for float64 logits) right after each load,
which is also what Triton's interpreter needs (it holds bf16 as bit patterns). `tl.max` drops NaN, so pass 1
keeps a NaN-propagating max per lane and checks its lanes once: a NaN anywhere in a row makes its max NaN, and
from there every output and gradient of the row, as in the torch path.

Importing this module compiles nothing; on a CPU tensor the kernels run only under Triton's interpreter,
`TRITON_INTERPRET=1` set before this module is imported (`ops.backend.load_kernels` checks).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ..utils.scoped import scoped
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


class OneProgram(NamedTuple):
    """The one-program forward's launch (`max_and_sums`): its tile, how many programs per SM the persistent
    grid starts (how many rows are in flight at once), the L2 eviction priority each walk's loads ask for, in
    `tl.load`'s words (`EVICTIONS`; "" = the default, normal priority), and the software pipeline of pass 1's
    whole-tile loop (`tl.range(num_stages=pass1_stages)`: 1 = none; s > 1 keeps s − 1 tiles' loads in flight
    per program through shared memory, `cp.async` on sm_80+). Pass 2 is not pipelined: it is to read from
    L2, where one load per thread in flight is enough, and a pipeline's shared-memory round trip costs its
    instruction-bound loop 15% more instructions per element (`tests/ops/kernels_aot.py`)."""

    tile: Tile
    programs_per_sm: int
    pass1_eviction: str = ""
    pass2_eviction: str = ""
    pass1_stages: int = 1


ONE_PROGRAM: dict[tuple[str, tuple[int, int]], OneProgram] = {
    # H200 (sm_90), 16,384 × 151,936 bf16, DVP + entropy, median of 10 per row, two runs on one node
    # (2026-12-01, main at df0017b, torch 2.11 + CUDA 13, Triton 3.6): fwd + bwd in place 4.94 / 4.95 ms
    # against the two kernels' 5.12 / 5.13 ms (Liger's CE 4.35 / 4.43 ms), forward 2.30 / 2.30 against
    # 2.79 / 2.47 ms. The other candidates: 2048×8 at 4 per SM 5.05, 8192×32 at 1 per SM 5.03, 4096×16 at
    # 1 per SM 5.51, 2048×8 at 2 per SM 6.02 ms. Its kernel alone, 2.21 ms, is 95% of two reads of the
    # logits at the copy rate (4.3 TB/s): pass 2 mostly misses L2, and the gain is the overlap of passes.
    ("16-bit", (9, 0)): OneProgram(Tile(4096, 16), 2),
}
"""Where the forward of the TP = 1 op runs as one program per row (pass 1, θ, then pass 2 over the same row:
`max_and_sums`) instead of two kernels with θ computed between them, keyed by (logits dtype width, device
capability): only devices where a GPU run measured it faster (`python -m megatron_tail.bench.op --device
cuda` sweeps `ONE_PROGRAM_CANDIDATES` against the two kernels and prints the entry to add here). The H100
is sm_90 too, so it runs the H200's entry unmeasured, as it runs `TILES`' H200 entries.

Why it can be faster (projected from the 2026-11-28 H200 timings, `research/op-kernels.md`): the two kernels
are 1.10 ms (a read, at the copy rate) + 1.81 ms (bound by instructions per element, the memory half idle).
One program reads its row for pass 1 and again for pass 2, which then comes from L2 when the rows in flight
fit it (a 151,936-column bf16 row is 297 KB: about 170 rows in 50 MB, the L2 of an H100 and of the H200,
the same GH100 die), so HBM sees one read, and the SMs overlap one program's memory-bound pass 1 with
another's instruction-bound pass 2. The grid is persistent (programs × SMs rows in flight) because a grid of
one program per row keeps every resident program's row in flight, several times L2. Pass 2 walks its row
backwards, the tiles pass 1 read last first.
Not under TP > 1: the MAX collective sits between the passes there."""

EVICTIONS = ("", "evict_first", "evict_last")
"""The L2 priorities a walk's loads may ask for. Triton 3.7 lowers `tl.load(eviction_policy=…)` on sm_80+ to
`ld.global.L1::<policy>.L2::cache_hint` with a `createpolicy.fractional.L2::<policy>.b64 …, 1.0` operand
(`tests/ops/kernels_aot.py` checks the PTX): an L2 priority, not only an L1 one."""

ONE_PROGRAM_CANDIDATES: tuple[OneProgram, ...] = (
    OneProgram(Tile(2048, 8), 4),
    OneProgram(Tile(4096, 16), 1),
    OneProgram(Tile(4096, 16), 2),
    OneProgram(Tile(8192, 32), 1),
    OneProgram(Tile(4096, 16), 2, "", "evict_first"),
    OneProgram(Tile(4096, 16), 2, "evict_last", "evict_first"),
    OneProgram(Tile(8192, 32), 1, "", "evict_first"),
    OneProgram(Tile(8192, 32), 1, "evict_last", "evict_first"),
    OneProgram(Tile(4096, 16), 2, "", "evict_first", 3),
    OneProgram(Tile(8192, 32), 1, "", "evict_first", 3),
)
"""The launches `bench.op` times on a GPU: 8 values per thread (as every measured tile), 16–32 warps per SM
(fewer would not keep the reads of pass 1 in flight), 130–260 rows in flight on an H100 / H200 (39–78 MB of
bf16 rows at 151,936 columns, around their 50 MB L2).

From the fifth on they ask L2 to keep what pass 2 still needs. Measured, the kernel took 95% of two reads of
the logits at 2 per SM, and about as long at 1 per SM (8192 × 32): pass 2 mostly missed L2 although it walks
its row backwards, and although 132 rows in flight are 39 MB. Under the default (LRU-like) priority, pass 2's
hits make the lines they consume the most recently used, so L2 keeps each program's last summed row, dead,
beside the row its pass 1 is reading: twice the rows in flight, 78 MB at 1 per SM, over the 50 MB L2.
`evict_first` on pass 2 makes a consumed line the first to go (39 MB live at 1 per SM, 78 at 2), and
`evict_last` on pass 1 keeps a line until its row's pass 2 demotes it. Projected, not measured: how much of
pass 2 then hits depends on how the H200 honours the hints (an `evict_last` line may be held only within a
set-aside part of L2, `cudaLimitPersistingL2CacheSize`, 0 by default); the next GPU run's designs table says.
The last two also pipeline pass 1's loads (3 stages). Unpipelined, a thread keeps one 16-byte load in flight:
16 KB per SM at 32 warps (8 at 16, where 4096 × 16 at 1 per SM was the slowest of the candidates kept), short
of the ~25 KB an H200 needs in flight to stream at its copy rate (Little's law: ~4.8 TB/s × ~0.7 µs over 132
SMs; projected); the one-program-per-row kernels reach it by occupancy instead (up to 64 warps per SM)."""

INTERPRETER_ONE_PROGRAM = OneProgram(INTERPRETER_TILE, 1)
"""Under Triton's interpreter: the fixed tile, and a grid of `INTERPRETER_PROGRAMS` programs."""
INTERPRETER_PROGRAMS = 3
"""So that a test's program walks several rows (rows pid, pid + 3, …), as a GPU's persistent grid does."""

TWO_KERNELS = "two kernels"
_FORWARD_CHOICE: contextvars.ContextVar[OneProgram | str | None] = contextvars.ContextVar(
    "forward_choice", default=None
)


def forward_design(choice: OneProgram | str) -> contextlib.AbstractContextManager[None]:
    """Within its `with` block, the TP = 1 forward runs as `choice` (a `OneProgram` launch or `TWO_KERNELS`)
    whatever `ONE_PROGRAM` says: what `bench.op` compares, and the tests run both ways."""
    if not isinstance(choice, OneProgram) and choice != TWO_KERNELS:
        raise ValueError(f"forward_design takes a OneProgram or {TWO_KERNELS!r}; got {choice!r}")
    if isinstance(choice, OneProgram):
        if {choice.pass1_eviction, choice.pass2_eviction} - set(EVICTIONS):
            raise ValueError(f"a OneProgram's evictions are one of {EVICTIONS}; got {choice!r}")
        if choice.pass1_stages not in (1, 2, 3, 4):
            raise ValueError(f"a OneProgram's pass 1 stages are 1 to 4; got {choice!r}")
    return scoped(_FORWARD_CHOICE, choice)


def one_program(dtype: torch.dtype, device: torch.device) -> OneProgram | None:
    """The one-program launch of the TP = 1 forward on `dtype` logits on `device`, or None for the two
    kernels (`ONE_PROGRAM`, or the `forward_design` in force)."""
    choice = _FORWARD_CHOICE.get()
    if choice is not None:
        if choice == TWO_KERNELS:
            return None
        if device.type == "cuda":
            return choice
        # the interpreter's tile and grid, with the choice's loads (the interpreter ignores their L2 priority
        # and runs a pipelined loop as a plain one)
        return choice._replace(
            tile=INTERPRETER_ONE_PROGRAM.tile, programs_per_sm=INTERPRETER_ONE_PROGRAM.programs_per_sm
        )
    if device.type != "cuda":
        return None  # as an unmeasured GPU: the two kernels
    return ONE_PROGRAM.get((_width_class(dtype), _capability(device.index)))


def one_program_tile(launch: OneProgram, dtype: torch.dtype, n_cols: int) -> Tile:
    """The tile `max_and_sums` runs `launch` with on a GPU, over rows of `n_cols` columns of `dtype`: its own,
    but float64 logits (the gradcheck dtype) keep the two kernels' 8 × 256 columns (`TILES`): four float64
    accumulators at 32 warps would spill (`tests/ops/test_kernels_compile.py`)."""
    base = launch.tile if _width_class(dtype) != "64-bit" else TILES[("partial_sums", "64-bit", None)]
    return _narrowed(base, n_cols)


@functools.cache
def _multiprocessors(index: int | None) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


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
    return _narrowed(base, n_cols)


def _narrowed(base: Tile, n_cols: int) -> Tile:
    """`base`, or for a row narrower than it one tile of `next_power_of_2(n_cols)` columns."""
    block = max(16, min(base.block, triton.next_power_of_2(max(n_cols, 1))))
    # a narrowed tile keeps 8 values per thread (256 columns per warp), as every tile of the table does
    return Tile(block, max(1, min(base.num_warps, block // 256)))


def tiles(dtype: torch.dtype, n_cols: int, device: torch.device) -> dict[str, Tile]:
    """Every kernel's launch config for such rows."""
    return {k: tile(k, dtype, n_cols, device) for k in KERNELS}


def describe_launch(launch: OneProgram) -> str:
    """A one-program launch in words: its tile, programs per SM, and its walks' L2 priorities if any."""
    what = f"one program, {launch.tile.block}×{launch.tile.num_warps}, {launch.programs_per_sm} per SM"
    if launch.pass1_eviction or launch.pass2_eviction:
        what += f", L2 {launch.pass1_eviction or 'normal'} / {launch.pass2_eviction or 'normal'}"
    if launch.pass1_stages > 1:
        what += f", pass 1 in {launch.pass1_stages} stages"
    return what


def describe_tiles(dtype: torch.dtype, n_cols: int, device: torch.device) -> str:
    """The configs `tiles` picks, and where they come from, on one line (what `bench.op` prints)."""
    configs = " · ".join(f"{k} {t.block}×{t.num_warps}" for k, t in tiles(dtype, n_cols, device).items())
    if device.type != "cuda":
        return f"{configs} (Triton's interpreter: one fixed tile)"
    major, minor = _capability(device.index)
    measured = all((k, _width_class(dtype), (major, minor)) in TILES for k in KERNELS)
    source = f"measured table, {MEASURED_H200}" if measured else "projected: no timing on this device"
    launch = one_program(dtype, device)
    forward = (
        "TP = 1 forward: two kernels" if launch is None else f"TP = 1 forward: {describe_launch(launch)}"
    )
    return f"{configs} (sm_{major}{minor}, {source}); {forward}"


PARTIAL_COLUMNS = dict(
    COL_ALL=S_ALL, COL_SAFE=S_SAFE, COL_SAFE_EZ=S_SAFE_EZ, COL_TARGET=TARGET_LOGIT, COL_COUNT=SAFE_COUNT
)
"""The partials' columns (`masked_logprobs_math`) as the constexprs of both kernels that write them."""

_COMPUTE = {torch.float64: tl.float64}
LOG2_E = 1.4426950408889634


def _compute_dtype(x: torch.Tensor):
    return _COMPUTE.get(x.dtype, tl.float32)


@triton.jit
def _as_compute(scalar, COMPUTE: tl.constexpr):
    # A float argument of these kernels is annotated `tl.float64`: the JIT passes an unannotated Python float
    # as float32 (`triton.runtime.jit.mangle_type`), which would round float64 logits' 1/T to float32 on a
    # GPU; annotated, the launcher packs a double (`backends/nvidia/driver.c`, `extractFP64`). Rounded here,
    # once per program, to the compute dtype (float32 for 16- and 32-bit logits: the value the float32
    # argument had). The product with a one of that dtype (exact, folded by the compiler) is what makes this
    # run under Triton's interpreter too, which ignores the annotation and hands the kernel the Python float.
    return (scalar * tl.full([], 1, COMPUTE)).to(COMPUTE)


@triton.jit
def _walk_max(base, n_cols, BLOCK: tl.constexpr, COMPUTE: tl.constexpr, EVICTION: tl.constexpr,
              STAGES: tl.constexpr):  # fmt: skip
    # pass 1 of one row: its max over the valid columns, NaN if any is NaN (EVICTION: the loads' L2 priority;
    # STAGES: the whole-tile loop's software pipeline, `OneProgram.pass1_stages`)
    cols = tl.arange(0, BLOCK)
    best = tl.full([BLOCK], float("-inf"), COMPUTE)
    whole = n_cols - n_cols % BLOCK
    # max.NaN on sm_80+: a NaN sticks in its lane, one instruction per element (a separate NaN flag was
    # three); the masked tail's lanes read −inf, which no max keeps. Unpipelined, a plain `range`: the code
    # the measured launches ran (a `tl.range` of one stage allocates registers otherwise: a spill at 4096)
    if STAGES > 1:
        for start in tl.range(0, whole, BLOCK, num_stages=STAGES):
            x = tl.load(base + start + cols, eviction_policy=EVICTION).to(COMPUTE)
            best = tl.maximum(best, x, propagate_nan=tl.PropagateNan.ALL)
    else:
        for start in range(0, whole, BLOCK):
            x = tl.load(base + start + cols, eviction_policy=EVICTION).to(COMPUTE)
            best = tl.maximum(best, x, propagate_nan=tl.PropagateNan.ALL)
    for start in range(whole, n_cols, BLOCK):
        x = tl.load(
            base + start + cols, mask=start + cols < n_cols, other=float("-inf"), eviction_policy=EVICTION
        ).to(COMPUTE)
        best = tl.maximum(best, x, propagate_nan=tl.PropagateNan.ALL)
    # `tl.max` drops NaN (PropagateNan.NONE): a NaN lane makes the row's max NaN explicitly
    has_nan = tl.max((best != best).to(tl.int32), axis=0) > 0
    return tl.where(has_nan, float("nan"), tl.max(best, axis=0))


@triton.jit
def _row_max_kernel(X, stride_x, n_cols, OUT, BLOCK: tl.constexpr, COMPUTE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    tl.store(OUT + row, _walk_max(X + row * stride_x, n_cols, BLOCK, COMPUTE, "", 1))


@triton.jit
def _sums_tile(x, m, threshold, exp2_scale, s_all, s_safe, s_ez, count, WITH_ENTROPY: tl.constexpr,
               WITH_COUNT: tl.constexpr):  # fmt: skip
    # base-2 exponent z/ln 2 = (x − m)/T·log2(e): one multiply into exp2, no log2(e) multiply inside exp;
    # x − m first, so the row max's own exponent is exactly 0
    z2 = (x - m) * exp2_scale
    e = tl.exp2(z2)
    s_all += e
    safe = x >= threshold  # θ is finite: −inf logits (and the tail's masked lanes) are never safe
    # Instructions per element are this pass's cost (`ONE_PROGRAM`), so each sum is one FMA where it can
    # be. e ∈ [0, 1] wherever the row is not poisoned (x ≤ m), so e·0 = 0 off V_S; a poisoned row (NaN or
    # ±inf max) is NaN either way.
    if WITH_COUNT:
        safe_f = safe.to(s_all.dtype)
        s_safe += e * safe_f
        count += safe_f
    else:
        s_safe += tl.where(safe, e, 0.0)
    if WITH_ENTROPY:
        s_ez += e * tl.where(safe, z2, 0.0)  # select before the product: z2 = −inf on −inf logits
    return s_all, s_safe, s_ez, count


@triton.jit
def _walk_sums(base, n_cols, m, threshold, exp2_scale, BACKWARDS: tl.constexpr, WITH_ENTROPY: tl.constexpr,
               WITH_COUNT: tl.constexpr, BLOCK: tl.constexpr, COMPUTE: tl.constexpr,
               EVICTION: tl.constexpr):  # fmt: skip
    # pass 2 of one row: (S_all, S_safe, Σ_safe e^z·z, |V_S|) over its valid columns. `BACKWARDS`: the last
    # tile first, so that right after pass 1 walked the row forwards the most recently read tiles (the ones
    # an L2 still holds) come first. EVICTION: the loads' L2 priority.
    cols = tl.arange(0, BLOCK)
    s_all = tl.zeros([BLOCK], COMPUTE)
    s_safe = tl.zeros([BLOCK], COMPUTE)
    s_ez = tl.zeros([BLOCK], COMPUTE)
    count = tl.zeros([BLOCK], COMPUTE)
    # This pass is bound by instructions per element, not by memory: whole tiles load without a mask,
    # and only the last, partial one (0 or 1 iterations of its loop) pays for it.
    n_whole = n_cols // BLOCK
    whole = n_whole * BLOCK
    if BACKWARDS:
        for start in range(whole, n_cols, BLOCK):
            x = tl.load(
                base + start + cols, mask=start + cols < n_cols, other=float("-inf"), eviction_policy=EVICTION
            ).to(COMPUTE)
            s_all, s_safe, s_ez, count = _sums_tile(
                x, m, threshold, exp2_scale, s_all, s_safe, s_ez, count, WITH_ENTROPY, WITH_COUNT
            )
        for i in range(0, n_whole):
            x = tl.load(base + (whole - BLOCK - i * BLOCK) + cols, eviction_policy=EVICTION).to(COMPUTE)
            s_all, s_safe, s_ez, count = _sums_tile(
                x, m, threshold, exp2_scale, s_all, s_safe, s_ez, count, WITH_ENTROPY, WITH_COUNT
            )
    else:
        for start in range(0, whole, BLOCK):
            x = tl.load(base + start + cols, eviction_policy=EVICTION).to(COMPUTE)
            s_all, s_safe, s_ez, count = _sums_tile(
                x, m, threshold, exp2_scale, s_all, s_safe, s_ez, count, WITH_ENTROPY, WITH_COUNT
            )
        for start in range(whole, n_cols, BLOCK):
            # masked lanes read −inf: e = 0, never safe (m = ±inf or NaN makes the row's valid lanes NaN too)
            x = tl.load(
                base + start + cols, mask=start + cols < n_cols, other=float("-inf"), eviction_policy=EVICTION
            ).to(COMPUTE)
            s_all, s_safe, s_ez, count = _sums_tile(
                x, m, threshold, exp2_scale, s_all, s_safe, s_ez, count, WITH_ENTROPY, WITH_COUNT
            )
    # Σ e^z·z was summed in base 2 (z/ln 2): × ln 2 back to e
    return (
        tl.sum(s_all, axis=0),
        tl.sum(s_safe, axis=0),
        tl.sum(s_ez, axis=0) * 0.6931471805599453,
        tl.sum(count, axis=0),
    )


@triton.jit
def _store_partials(out, base, s_all, s_safe, s_ez, count, TARGET_COL, OWNED, row, COMPUTE: tl.constexpr,
                    COL_ALL: tl.constexpr, COL_SAFE: tl.constexpr, COL_SAFE_EZ: tl.constexpr,
                    COL_TARGET: tl.constexpr, COL_COUNT: tl.constexpr):  # fmt: skip
    tl.store(out + COL_ALL, s_all)
    tl.store(out + COL_SAFE, s_safe)
    tl.store(out + COL_SAFE_EZ, s_ez)
    tl.store(out + COL_COUNT, count)
    owned = tl.load(OWNED + row) != 0
    target = tl.load(base + tl.load(TARGET_COL + row), mask=owned, other=0.0).to(COMPUTE)
    tl.store(out + COL_TARGET, target)


@triton.jit
def _partials_kernel(
    X,
    stride_x,
    n_cols,
    MAX,
    THRESHOLD,
    TARGET_COL,
    OWNED,
    exp2_scale: tl.float64,
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
    exp2_scale = _as_compute(exp2_scale, COMPUTE)
    s_all, s_safe, s_ez, count = _walk_sums(
        base, n_cols, m, threshold, exp2_scale, False, WITH_ENTROPY, WITH_COUNT, BLOCK, COMPUTE, ""
    )
    _store_partials(OUT + row * stride_out, base, s_all, s_safe, s_ez, count, TARGET_COL, OWNED, row,
                    COMPUTE, COL_ALL, COL_SAFE, COL_SAFE_EZ, COL_TARGET, COL_COUNT)  # fmt: skip


@triton.jit
def _max_and_sums_kernel(
    X,
    stride_x,
    n_rows,
    n_cols,
    offset: tl.float64,
    TARGET_COL,
    OWNED,
    exp2_scale: tl.float64,
    MAX,
    THRESHOLD,
    OUT,
    stride_out,
    PRUNE: tl.constexpr,
    WITH_ENTROPY: tl.constexpr,
    WITH_COUNT: tl.constexpr,
    BLOCK: tl.constexpr,
    COMPUTE: tl.constexpr,
    COL_ALL: tl.constexpr,
    COL_SAFE: tl.constexpr,
    COL_SAFE_EZ: tl.constexpr,
    COL_TARGET: tl.constexpr,
    COL_COUNT: tl.constexpr,
    MAX_FLOAT: tl.constexpr,
    PASS1_EVICTION: tl.constexpr,
    PASS2_EVICTION: tl.constexpr,
    PASS1_STAGES: tl.constexpr,
):
    # Persistent: the grid is the rows in flight (`max_and_sums`), each program walks rows pid, pid + grid, …
    # rounded to the compute dtype as `max_logit + offset` converts it in torch: beyond float32's range, −inf
    offset = _as_compute(offset, COMPUTE)
    exp2_scale = _as_compute(exp2_scale, COMPUTE)
    for row in range(tl.program_id(0).to(tl.int64), n_rows, tl.num_programs(0)):
        base = X + row * stride_x
        m = _walk_max(base, n_cols, BLOCK, COMPUTE, PASS1_EVICTION, PASS1_STAGES)
        # θ = m + T·log ρ as `safe_vocab.safe_threshold` adds it (one rounding in the compute dtype of the
        # same two values): the sampler's comparison, bit for bit, and never below −max_float, as
        # `masked_logprobs.op_threshold` clamps it (a NaN max stays NaN); without pruning θ = −max_float
        if PRUNE:
            lowest = tl.full([], -MAX_FLOAT, COMPUTE)
            threshold = tl.maximum(m + offset, lowest, propagate_nan=tl.PropagateNan.ALL)
        else:
            threshold = offset
        s_all, s_safe, s_ez, count = _walk_sums(base, n_cols, m, threshold, exp2_scale, True, WITH_ENTROPY,
                                                WITH_COUNT, BLOCK, COMPUTE, PASS2_EVICTION)  # fmt: skip
        tl.store(MAX + row, m)
        tl.store(THRESHOLD + row, threshold)
        _store_partials(OUT + row * stride_out, base, s_all, s_safe, s_ez, count, TARGET_COL, OWNED, row,
                        COMPUTE, COL_ALL, COL_SAFE, COL_SAFE_EZ, COL_TARGET, COL_COUNT)  # fmt: skip


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
    inv_t: tl.float64,
    TARGETS,
    TARGET_ADD,
    target_start,
    HAS_SCALE_H: tl.constexpr,
    HAS_TARGET: tl.constexpr,
    BLOCK: tl.constexpr,
    COMPUTE: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    inv_t = _as_compute(inv_t, COMPUTE)
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
    # the target's column (`triton_grad.special_columns` without a support, in the same pass): -1 where
    # these columns do not hold it, so no column matches
    if HAS_TARGET:
        local = tl.load(TARGETS + row) - target_start
        # int32 like the column indices, so the per-element compare is one instruction
        target_col = tl.where((local >= 0) & (local < n_cols), local, -1).to(tl.int32)
        target_add = tl.load(TARGET_ADD + row)
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
        if HAS_TARGET:
            # the target's own term whether or not it is safe, plus the log-prob's; p = 0 (log p = −inf):
            # no own term, not 0·(−inf) = NaN (`special_columns` clamps log p with `finite_` for that)
            own = tl.where(p == 0.0, 0.0, g) + target_add
            g = tl.where(c == target_col, own, tl.where(safe, g, 0.0))
        else:
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
            **PARTIAL_COLUMNS,
            num_warps=t.num_warps,
        )
    return out


def max_and_sums(
    x: torch.Tensor,
    compute_dtype: torch.dtype,
    *,
    offset: float,
    prune: bool,
    inv_temperature: float,
    local_target: torch.Tensor,
    owned: torch.Tensor,
    with_entropy: bool,
    with_count: bool,
    launch: OneProgram,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Both forward passes of a TP = 1 call in one kernel: each row's max (`row_max`), θ = max + `offset`
    (`prune`; else θ = `offset`), and its `partial_sums` against that θ.

    Args:
        x: `[N, V]` logits, V ≥ 1 valid columns (the whole vocabulary: its max is the global max), unit
            column stride.
        offset: T·log ρ with pruning, else −max_float of `compute_dtype` (`masked_logprobs.threshold_offset`).
        launch: the tile, programs per SM and the walks' L2 priorities (`one_program`).
    Returns:
        (`[N]` max, `[N]` θ, `[N, NUM_PARTIALS]` partial sums, the support's columns 0), in `compute_dtype`.
    """
    n = x.shape[0]
    max_logit = torch.empty(n, dtype=compute_dtype, device=x.device)
    threshold = torch.empty_like(max_logit)
    out = torch.zeros((n, NUM_PARTIALS), dtype=compute_dtype, device=x.device)
    if not n:
        return max_logit, threshold, out
    if x.device.type == "cuda":
        t = one_program_tile(launch, x.dtype, x.shape[1])
        programs = launch.programs_per_sm * _multiprocessors(x.device.index)
    else:
        t, programs = tile("partial_sums", x.dtype, x.shape[1], x.device), INTERPRETER_PROGRAMS
    _max_and_sums_kernel[(min(n, programs),)](
        x,
        x.stride(0),
        n,
        x.shape[1],
        offset,
        local_target.contiguous(),
        owned.to(torch.int8).contiguous(),
        inv_temperature * LOG2_E,
        max_logit,
        threshold,
        out,
        out.stride(0),
        PRUNE=prune,
        WITH_ENTROPY=with_entropy,
        WITH_COUNT=with_count,
        BLOCK=t.block,
        COMPUTE=_compute_dtype(x),
        **PARTIAL_COLUMNS,
        MAX_FLOAT=torch.finfo(compute_dtype).max,
        PASS1_EVICTION=launch.pass1_eviction,
        PASS2_EVICTION=launch.pass2_eviction,
        PASS1_STAGES=launch.pass1_stages,
        num_warps=t.num_warps,
    )
    return max_logit, threshold, out


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
    targets: torch.Tensor | None = None,
    target_start: int = 0,
    target_add: torch.Tensor | None = None,
) -> None:
    """Write p·(bias + scale_h·log p) on V_S (0 elsewhere) for every row into `out` (`[N, V]`, unit column
    stride; may be `x` itself), in out's dtype. The target and support columns are the caller's to
    overwrite (`masked_logprobs_triton`), unless `targets` (`[N]` int64 ids, −1 for none) and `target_add`
    (`[N]`) are given, for a call without a sampling support whose columns are the ids `target_start`,
    `target_start + 1`, … in the same frame as `targets` (the fused op's blocks: global ids; the op's own
    call: this shard's local ids, `target_start` = 0): then the target's column, where these columns hold it,
    gets `triton_grad.special_columns`' value in the same pass, p·(bias + scale_h·log p) whether or not it is
    in V_S (0 where p = 0), plus `target_add`. A row poisoned by a NaN bias or scale_h (a NaN upstream
    gradient) is NaN in its target's column too, as in the PyTorch backend, where `special_columns` (the
    columns of a call with a support) writes `target_add` there when p = 0."""
    if not (x.shape[0] and x.shape[1]):
        return
    t = tile("grad", x.dtype, x.shape[1], x.device)
    has_target = targets is not None
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
        targets.contiguous() if has_target else bias,
        target_add.contiguous() if has_target else bias,
        target_start,
        HAS_SCALE_H=scale_h is not None,
        HAS_TARGET=has_target,
        BLOCK=t.block,
        COMPUTE=_compute_dtype(x),
        num_warps=t.num_warps,
    )
