"""`vocab_parallel_linear_masked_logprobs`: the output layer fused with the DVP log-prob op, so the
`[N, V/TP]` logits never exist.

    out = vocab_parallel_linear_masked_logprobs(hidden, weight_shard, targets, log_rho=-13.0,
                                                vocab_size=V, tp_group=tp_group)

The logits of a block of tokens × vocabulary rows are computed (`hidden[rows] @ weight[cols].T`, in the
inputs' dtype, as megatron's output layer computes them), used, and dropped; extra memory is one block
plus `[N]`-sized per-token state. The math per block is the materialized op's (`masked_logprobs_math`),
so both ops agree to rounding.

Passes over the blocks (each one matmul per block):
- forward, TP = 1 with the whole vocabulary in one block: one pass (the block's row max is the global max;
  on Triton one kernel per block where `triton_kernels.ONE_PROGRAM` says so);
- forward otherwise: pass 1 finds the row max, then the MAX collective, then pass 2 sums the partials,
  then the SUM collective (the two collectives of the materialized op, nothing more);
- backward: recompute each block's logits, turn them into dlogits in place, and multiply into the
  hidden-state and weight gradients. The hidden gradient is then all-reduced over TP (what megatron's
  `copy_to_tensor_model_parallel_region` does before a `ColumnParallelLinear`), or reduce-scattered with
  sequence parallelism. Row blocks outside, column blocks inside, so a row block's hidden gradient is summed
  in an accumulator of that row block only; on Triton, blocks of `[N / BACKWARD_TOKEN_BLOCKS, H]`, not the
  forward's token chunks (the backward holds the weight gradient too), except into `main_grad`.

Memory (both backends, the same discipline). The layer exists to hold less than `hidden @ weight.T` then the
op, so besides its inputs it holds, at any time, one block of logits (`[rows, cols]` in the inputs' dtype,
turned into dlogits in place), the PyTorch backend's float32 temporaries of that block, `[N]` per-token state,
the hidden gradient (`[N, H]`, and a float32 `[rows, H]` accumulator of one row block while it is summed over
vocabulary blocks), and the weight gradient: nothing else of the weight's size. On an H200 at 8,192 × 4,096 @
151,936 bf16 the Triton backward held one 1,766-row chunk (512 MiB) besides the gradients, 1.33× Liger's peak
(2026-12-01, `docs/results/gpu/h200_2026-12-01.md`); its blocks (`BACKWARD_TOKEN_BLOCKS`) hold 48 MiB there,
against Liger's 74 MiB chunk. Each block's dlogitsᵀ·hidden goes straight into the gradient
(`matmul_accumulate.add_matmul_`): into megatron's float32 `main_grad` under gradient-accumulation fusion (on
CUDA one cuBLAS `addmm` with `out_dtype=float32` per block), else into the returned gradient in the weight's
dtype, `addmm` in place per token block (BLAS accumulates each product in float32; a bf16 gradient is rounded
once per token block, 4 times on the Triton backend up to 87k tokens at H = 4,096). A float32 accumulator of
the returned gradient would be twice a bf16 weight again (on an H200 at 8,192 × 4,096 @ 151,936: 7.58 GiB
extra with it and a per-chunk product, 1.29 GiB for Liger's fused linear cross entropy; measured 2026-11-28,
`research/op-kernels.md`), and exact float32 accumulation is what gradient-accumulation fusion is for.

Under TP > 1 each rank holds `[V/TP, H]` rows and walks the same token chunks over its own columns. The
MAX collective sits between the forward's two passes, so a chunk's logits are computed twice: pass 1 (GEMM,
row max) over every chunk, the call's one MAX, pass 2 (GEMM again, partial sums) over every chunk, the one
SUM. Nothing is reused across the collective: keeping every chunk's logits from pass 1 to pass 2 would be
the materialized op's memory, and a chunk (0.5 GB on CUDA) is far larger than any L2, so its kernels read
it from HBM right after its GEMM wrote it. At TP = 1 the forward is one pass (a block of the whole
vocabulary holds the global max). The backward needs no collective before the hidden gradient's.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from typing import NamedTuple

import torch
import torch.distributed as dist

from ..utils.scoped import scoped
from . import masked_logprobs_math as chunk_math
from . import sampling_support_math as support_math
from .backend import load_kernels, resolve_backend
from .log_rho import DEFAULT_LOG_RHO, check_log_rho, check_temperature
from .masked_logprobs import (
    MaskedLogprobs,
    as_outputs,
    check_sampling_support,
    check_targets,
    describe_value,
    function_outputs,
    global_max_logit,
    group_size_and_rank,
    op_threshold,
    spans,
    triton_backward,
    triton_forward_one_program,
    valid_columns,
)
from .matmul_accumulate import add_matmul_
from .safe_vocab import rule_dtype

BLOCK_ELEMENTS = {"cpu": 1 << 18, "cuda": 1 << 24}
"""Logits per block (rows × vocabulary columns). A block's temporaries are a few float32 copies of it (the
upcast, z, e^z, the safe indicator). CPU: 512 × 512 blocks, 1 MiB each; the op's extra memory in the
benchmark case is ~0.07× the logits besides the weight gradient, at the speed of 4× larger blocks.
CUDA: 64 MiB each, ~0.3 GB in all (a 16k-token micro-batch at Qwen3's 76k vocabulary per TP = 2 rank is
~75 blocks per pass)."""
TRITON_CHUNK_ELEMENTS = {"cpu": 1 << 16, "cuda": 1 << 28}
"""With the Triton kernels: logits per token chunk, whose rows span this rank's whole vocabulary (the
kernels walk a row's columns themselves). CUDA: 0.5 GB of bf16, ~1,800 rows at Qwen3's 152k vocabulary, so
each GEMM is large; CPU (the interpreter, tests only): small."""
BackwardChoice = int | tuple[int, int] | str
"""A `backward_blocks` choice: a row-block count, `(row blocks, k)`, or `FORWARD_CHUNKS`."""
BACKWARD_TOKEN_BLOCKS: BackwardChoice = 4
"""The Triton backend's backward walks the tokens in this many row blocks, each over column blocks of H
vocabulary columns (any `backward_blocks` choice is a valid value: `(row blocks, k)` for column blocks of k·H,
or `FORWARD_CHUNKS`, as `bench.op`'s `BACKWARD_TOKEN_BLOCKS = …` line may print). A row block adds into the
whole weight gradient once (a read and a write of it inside its GEMMs' epilogues), and holds a float32
`[rows, H]` accumulator of its hidden gradient. With four, the backward's working memory (a `[N/4, H]` block
of logits in their dtype and the accumulator: 1.5 bytes per element of `hidden`, at 16 bits) is three quarters
of the least that Liger-Kernel's fused linear cross entropy holds (one `[chunk, V]` chunk of at least about
`N·H` elements: `chunk = next_power_of_2(⌈N / ⌈V/H⌉⌉)`), and every GEMM but a row's last column block's is
`[N/4, H] × [H, H]`. (Past `TRITON_CHUNK_ELEMENTS` of block and accumulator, beyond 87k tokens at H = 4,096,
the row blocks are smaller and more: more passes over the weight gradient, each a bf16 rounding of it.)

Measured on an H200 (2026-12-01, at 98ed5a5, fwd + bwd, DVP + entropy, bf16 weight gradient; ms / peak extra
MiB, Liger-Kernel's fused linear cross entropy in the same run; `docs/results/gpu/h200_2026-12-01.md`):

| tokens × H @ 151,936 | Liger | forward's chunks | 2 row blocks | **4** | 8 |
|---|---|---|---|---|---|
| 8,192 × 4,096 | 63.7 / 1,326 | 58.7 / 1,764 | 60.4 / 1,348 | 63.9 / 1,300 | 67.2 / 1,276 |
| 4,096 × 4,096 | 54.1 / 1,257 | 29.3 / 1,732 | 31.3 / 1,268 | 33.6 / 1,244 | 37.3 / 1,232 |
| 16,384 × 2,048 | 65.8 / 732 | 61.0 / 1,170 | 66.2 / 754 | 69.0 / 706 | 72.9 / 682 |

Four is the fewest under Liger's peak at all three shapes; each doubling of the row blocks costs 3.3–3.5 ms
at 8,192 × 4,096 (a pass over the weight gradient, narrower GEMMs), 2.3–3.7 ms at 4,096 tokens. Into float32
`main_grad` (gradient-accumulation fusion) the backward allocates no weight gradient, and its peak is the
forward's chunk whatever its blocks (512 MiB; 576 with the forward's chunks, the hidden gradient on top), so
it keeps the forward's chunks, the fastest: 61.4 ms against 65.3 with four blocks at 8,192 × 4,096."""
FORWARD_CHUNKS = "forward's chunks"
BACKWARD_BLOCK_CHOICES: tuple[BackwardChoice, ...] = (FORWARD_CHUNKS, 2, 4, 8, (4, 2))
"""What `bench.op` times the Triton backward in (`backward_blocks`), beside Liger in the same run.

`(4, 2)`, four row blocks over column blocks of 2·H, is not measured yet. Each row block's accumulating
hidden-gradient GEMMs read and write its float32 accumulator once per column block (32 MiB at 2,048 × 4,096,
37 times per row block at H columns), so half as many column blocks halve that traffic and the launches, and
each GEMM is twice as wide. Its block of logits is twice the bytes: projected from the four-block peaks
above, 1,316 MiB at 8,192 × 4,096 (Liger 1,326), 1,252 at 4,096 × 4,096 (1,257), 722 at 16,384 × 2,048
(732): still under Liger's at all three."""
_BACKWARD_CHOICE: contextvars.ContextVar[BackwardChoice | None] = contextvars.ContextVar(
    "backward_choice", default=None
)


def _row_blocks_and_width(choice: BackwardChoice) -> tuple[int, int] | None:
    """A row-block choice as (row blocks, column blocks' width in multiples of H); None if it is not one."""
    count, width = choice if isinstance(choice, tuple) and len(choice) == 2 else (choice, 1)
    ints = all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in (count, width))
    return (count, width) if ints else None


def describe_backward_blocks(choice: BackwardChoice) -> str:
    """A `backward_blocks` choice in words: "forward's chunks", "4 row blocks", "4 row blocks × 2H" (and one
    it refuses as itself)."""
    if choice == FORWARD_CHUNKS:
        return str(choice)
    shape = _row_blocks_and_width(choice)
    if shape is None:
        return repr(choice)
    count, width = shape
    return f"{count} row blocks" + ("" if width == 1 else f" × {width}H")


def backward_blocks(choice: BackwardChoice) -> contextlib.AbstractContextManager[None]:
    """Within its `with` block, the Triton backend's backward runs in `choice` row blocks (an int ≥ 1, each
    over column blocks of H; or `(row blocks, k)`, over column blocks of k·H) or in the forward's chunks
    (`FORWARD_CHUNKS`), whatever `BACKWARD_TOKEN_BLOCKS` and `main_grad` say: what `bench.op` compares
    (`BACKWARD_BLOCK_CHOICES`)."""
    if choice != FORWARD_CHUNKS and _row_blocks_and_width(choice) is None:
        raise ValueError(
            f"backward_blocks takes a row-block count ≥ 1, (row blocks, columns in multiples of H) or "
            f"{FORWARD_CHUNKS!r}; got {choice!r}"
        )
    return scoped(_BACKWARD_CHOICE, choice)


ONE_PASS_MIN_ROWS = 128
"""With TP = 1, a block that holds the whole vocabulary needs no separate max pass (one matmul fewer); it
is used when such a block still has this many token rows, else blocks stay square for efficient GEMMs."""


def _blocks(
    num_rows: int, num_cols: int, device: torch.device, tp_size: int, backend: str = "torch"
) -> tuple[int, int]:
    """(rows, columns) of a block. Square-ish blocks (√budget on a side) keep every GEMM's inner dimension
    large: the weight-gradient GEMM sums over a block's rows, the hidden-gradient one over its columns,
    so thin blocks would turn both into memory-bound passes over the weight. The Triton kernels take token
    chunks of whole rows (`TRITON_CHUNK_ELEMENTS`)."""
    num_rows, num_cols = max(num_rows, 1), max(num_cols, 1)
    if backend == "triton":
        budget = TRITON_CHUNK_ELEMENTS.get(device.type, TRITON_CHUNK_ELEMENTS["cuda"])
        return min(num_rows, max(1, budget // num_cols)), num_cols
    budget = BLOCK_ELEMENTS.get(device.type, BLOCK_ELEMENTS["cuda"])
    if tp_size == 1 and budget // num_cols >= min(num_rows, ONE_PASS_MIN_ROWS):
        return min(num_rows, budget // num_cols), num_cols
    rows = min(num_rows, math.isqrt(budget))
    return rows, min(num_cols, max(1, budget // rows))


def _backward_blocks(
    num_rows: int,
    num_cols: int,
    hidden_size: int,
    device: torch.device,
    forward_block: tuple[int, int],
    backend: str,
    into_main_grad: bool,
) -> tuple[int, int]:
    """(rows, columns) of the backward's blocks. The PyTorch backend keeps its forward's blocks. The Triton
    backend's forward takes token chunks of whole rows (no accumulation there), but its backward would then
    hold a whole chunk besides the weight gradient it allocates: `BACKWARD_TOKEN_BLOCKS` row blocks of
    `hidden_size` columns instead, at most `TRITON_CHUNK_ELEMENTS` elements of block and accumulator
    together. Into `main_grad` it allocates no weight gradient, and keeps the forward's chunks (the table
    at `BACKWARD_TOKEN_BLOCKS`)."""
    if backend != "triton":
        return forward_block
    choice = _BACKWARD_CHOICE.get()
    if choice is None:
        choice = FORWARD_CHUNKS if into_main_grad else BACKWARD_TOKEN_BLOCKS
    if choice == FORWARD_CHUNKS:
        return forward_block
    count, width = _row_blocks_and_width(choice)
    cols = max(1, min(num_cols, width * hidden_size))
    budget = TRITON_CHUNK_ELEMENTS.get(device.type, TRITON_CHUNK_ELEMENTS["cuda"])
    rows = math.ceil(max(num_rows, 1) / count)
    return min(rows, max(1, budget // (cols + 2 * hidden_size))), cols


class _SequenceParallelGather(torch.autograd.Function):
    """All-gather along dim 0 over the TP group; backward reduce-scatters (megatron's SP layout)."""

    @staticmethod
    def forward(ctx, local, tp_group, tp_size):
        ctx.tp_group, ctx.tp_size = tp_group, tp_size
        full = local.new_empty((local.shape[0] * tp_size, *local.shape[1:]))
        dist.all_gather_into_tensor(full, local.contiguous(), group=tp_group)
        return full

    @staticmethod
    def backward(ctx, grad_full):
        local = grad_full.new_empty((grad_full.shape[0] // ctx.tp_size, *grad_full.shape[1:]))
        dist.reduce_scatter_tensor(local, grad_full.contiguous(), group=ctx.tp_group)
        return local, None, None


class _Settings(NamedTuple):
    """The fused op's non-tensor arguments, validated (`vocab_parallel_linear_masked_logprobs`)."""

    log_rho: float | None
    temperature: float
    vocab_size: int
    tp_group: dist.ProcessGroup | None
    tp_size: int
    tp_rank: int
    entropy: bool
    count: bool
    all_reduce_grad: bool
    """All-reduce the hidden gradient over TP (off at TP = 1 and with SP, whose gather reduce-scatters it)."""
    into_main_grad: bool
    """megatron's gradient-accumulation fusion: add the weight gradient into `weight.main_grad`."""
    backend: str
    """"triton" or "torch" (resolved, `ops.backend`)."""


class _LinearMaskedLogprobsFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden2d, weight, targets1d, support2d, settings: _Settings):
        log_rho, temperature, vocab_size, tp_group, tp_size, tp_rank, entropy, count, *_ = settings
        v_local = weight.shape[0]
        vocab_start, num_valid = valid_columns(v_local, vocab_size, tp_rank)
        n = hidden2d.shape[0]
        dtype = rule_dtype(hidden2d.dtype)
        rows, cols = _blocks(n, num_valid, hidden2d.device, tp_size, settings.backend)
        w = weight[:num_valid]  # padded rows excluded by a view
        one_pass = tp_size == 1 and cols >= num_valid
        partials = torch.zeros((n, chunk_math.NUM_PARTIALS), dtype=dtype, device=hidden2d.device)
        kernels = load_kernels(hidden2d.device) if settings.backend == "triton" else None

        def row_max(x):
            return x.amax(dim=1).to(dtype) if kernels is None else kernels.row_max(x, dtype)

        def with_support_sums(sums, x, max_logit, r, start, width):
            if support2d is not None:  # the block's share of the support sums, in the same SUM
                # per block: `[rows, K]` temporaries only, so the extra memory stays below the support's
                local, sup_owned = support_math.support_columns(support2d[r], start, width)
                sums[:, chunk_math.S_SUPPORT :] = support_math.support_partials(
                    x, local, sup_owned, max_logit, 1.0 / temperature
                )
            return sums

        def block_sums(x, max_logit, threshold, local_target, owned, r, start, width):
            args = (x, max_logit, threshold, 1.0 / temperature, local_target, owned, entropy)
            if kernels is None:
                sums = chunk_math.chunk_partial_sums(*args, with_count=count)
            else:
                sums = kernels.partial_sums(*args, count)
            return with_support_sums(sums, x, max_logit, r, start, width)

        if one_pass:
            max_logit = torch.empty(n, dtype=dtype, device=hidden2d.device)
            threshold = torch.empty_like(max_logit)
            local_target, owned = chunk_math.target_columns(targets1d, vocab_start, num_valid)
            for r in spans(n, rows):
                x = hidden2d[r] @ w.t()
                # TP = 1: the block holds the whole (non-empty) vocabulary, so its row max is the global max
                one_program = None
                if kernels is not None:
                    one_program = triton_forward_one_program(
                        kernels, x, log_rho, temperature, local_target[r], owned[r], entropy, count
                    )
                if one_program is not None:
                    max_logit[r], threshold[r], sums = one_program
                    partials[r] = with_support_sums(sums, x, max_logit[r], r, vocab_start, num_valid)
                else:
                    max_logit[r] = row_max(x)
                    threshold[r] = op_threshold(max_logit[r], log_rho, temperature)
                    partials[r] = block_sums(
                        x, max_logit[r], threshold[r], local_target[r], owned[r], r, vocab_start, num_valid
                    )
                del x  # before the next block's GEMM allocates: one block alive, not two
        else:
            local_max = torch.full((n,), -math.inf, dtype=dtype, device=hidden2d.device)
            for r in spans(n, rows):
                for c in spans(num_valid, cols):
                    x = hidden2d[r] @ w[c].t()
                    local_max[r] = torch.maximum(local_max[r], row_max(x))
                    del x
            max_logit = global_max_logit(local_max, v_local, vocab_size, tp_group, tp_size)
            threshold = op_threshold(max_logit, log_rho, temperature)
            for c in spans(num_valid, cols):
                local_target, owned = chunk_math.target_columns(
                    targets1d, vocab_start + c.start, c.stop - c.start
                )
                start, width = vocab_start + c.start, c.stop - c.start
                for r in spans(n, rows):
                    x = hidden2d[r] @ w[c].t()
                    partials[r] += block_sums(
                        x, max_logit[r], threshold[r], local_target[r], owned[r], r, start, width
                    )
                    del x
            if tp_size > 1:
                dist.all_reduce(partials, op=dist.ReduceOp.SUM, group=tp_group)
        rows_with_support = in_support = None
        if support2d is not None:
            rows_with_support = support_math.support_rows(support2d)
            in_support = support_math.target_in_support(support2d, targets1d)
        out = chunk_math.finalize(
            partials, max_logit, threshold, 1.0 / temperature, entropy, rows_with_support, in_support
        )
        ctx.save_for_backward(
            hidden2d, weight, targets1d, max_logit, threshold, out["log_norm"], out["entropy"]
        )
        ctx.support = None
        if support2d is not None:  # the caller's tensor, kept by reference
            ctx.support = (support2d, out["forced_support"], rows_with_support)
        ctx.settings, ctx.num_valid, ctx.vocab_start, ctx.block = (
            settings,
            num_valid,
            vocab_start,
            (rows, cols),
        )
        return function_outputs(ctx, out, log_rho, count)

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy, *_):
        hidden2d, weight, targets1d, max_logit, threshold, log_norm, entropy = ctx.saved_tensors
        settings: _Settings = ctx.settings
        if grad_logprobs is None and grad_entropy is None:
            return None, None, None, None, None
        inv_t = 1.0 / settings.temperature
        bias, scale_h, target_add = chunk_math.grad_coefficients(
            log_norm, inv_t, grad_logprobs, grad_entropy, entropy
        )
        support = None
        dense_bias, dense_scale_h = bias, scale_h
        if ctx.support is not None:
            support2d, forced, rows_with_support = ctx.support
            support = (support2d, forced, rows_with_support)
            dense_bias, dense_scale_h = support_math.dense_coefficients(rows_with_support, bias, scale_h)
        rows_state = _RowState(
            targets1d, max_logit, threshold, log_norm, inv_t, dense_bias, dense_scale_h, bias, scale_h,
            target_add, support, ctx.vocab_start,
        )  # fmt: skip
        num_valid = ctx.num_valid
        n, hidden_size = hidden2d.shape
        rows, cols = _backward_blocks(
            n, num_valid, hidden_size, hidden2d.device, ctx.block, settings.backend, settings.into_main_grad
        )
        w = weight[:num_valid]
        # A block of the whole vocabulary gives its tokens' hidden gradient whole, in the hidden states'
        # dtype; narrower blocks sum it over the row block's column blocks in the compute dtype, in an
        # accumulator of one row block (16-bit hidden states), then rounded once into the gradient.
        grad_hidden = torch.empty_like(hidden2d)
        acc = None
        if cols < num_valid and rule_dtype(hidden2d.dtype) != hidden2d.dtype:
            acc = hidden2d.new_empty((min(rows, n), hidden_size), dtype=rule_dtype(hidden2d.dtype))
        # the gradient itself is the only [V, H] tensor (module docstring, "Memory")
        grad_weight = weight.main_grad if settings.into_main_grad else torch.zeros_like(weight)
        for r in spans(n, rows):
            dest = grad_hidden[r] if acc is None else acc[: r.stop - r.start]
            dest.zero_()
            state = rows_state.of_rows(r)  # sliced once per row block: a block's host work is its launches
            for c in spans(num_valid, cols):
                x = hidden2d[r] @ w[c].t()
                _dlogits_(x, state, c, settings.backend)
                add_matmul_(dest, x, w[c])
                add_matmul_(grad_weight[c], x.t(), hidden2d[r])
                del x  # before the next block's GEMM allocates: one block alive, not two
            if acc is not None:
                grad_hidden[r].copy_(dest)
        if settings.all_reduce_grad:
            dist.all_reduce(grad_hidden, group=settings.tp_group)
        if settings.into_main_grad:
            grad_weight = _dummy_weight_grad(weight)
        return grad_hidden, grad_weight, None, None, None


class _RowState(NamedTuple):
    """Per-token (`[N]`) state of the fused op's backward, shared by its blocks (`_dlogits_`)."""

    targets: torch.Tensor
    max_logit: torch.Tensor
    threshold: torch.Tensor
    log_norm: torch.Tensor
    inv_t: float
    dense_bias: torch.Tensor
    """The dense coefficients: zero on rows with a sampling support (the support carries their p terms)."""
    dense_scale_h: torch.Tensor | None
    bias: torch.Tensor
    """The coefficients of the support's (and the forced target's) own terms."""
    scale_h: torch.Tensor | None
    target_add: torch.Tensor
    support: tuple | None
    """None, or (support `[N, K]`, forced `[N]`, rows_with_support `[N]`)."""
    vocab_start: int

    def of_rows(self, r: slice) -> _RowState:
        """The state of the rows `r` (views)."""

        def rows(t):
            return None if t is None else t[r]

        support = None if self.support is None else tuple(t[r] for t in self.support)
        fields = self._asdict()
        del fields["support"]
        tensors = {k: rows(v) for k, v in fields.items() if isinstance(v, torch.Tensor) or v is None}
        return self._replace(**tensors, support=support)


def _dlogits_(x: torch.Tensor, s: _RowState, c: slice, backend: str) -> None:
    """Turn one block of logits `x` (`[rows, columns c]` of this shard's valid vocabulary; `s` those rows'
    state) into dloss/dlogits in place, with the materialized op's math (`masked_logprobs_math.chunk_grad`,
    or the Triton backward)."""
    start, width = s.vocab_start + c.start, c.stop - c.start
    if backend == "triton" and s.support is None:
        # one launch with the global ids: the gradient kernel writes the target's column too (without a
        # support the dense coefficients are the target's own); `triton_backward` would first map the targets
        # to this block's local ids, a few `[rows]` torch ops per block of a backward of ~150 blocks
        load_kernels(x.device).write_grad(
            x, x, max_logit=s.max_logit, threshold=s.threshold, log_norm=s.log_norm, bias=s.bias,
            scale_h=s.scale_h, inv_temperature=s.inv_t, targets=s.targets, target_start=start,
            target_add=s.target_add,
        )  # fmt: skip
        return
    local_target, owned = chunk_math.target_columns(s.targets, start, width)
    if backend == "triton":  # with a support (without one: above)
        support2d, forced, rows_with_support = s.support
        support = (support2d, s.targets, forced, rows_with_support, start)
        per_row = dict(max_logit=s.max_logit, log_norm=s.log_norm, inv_temperature=s.inv_t)
        dense = dict(threshold=s.threshold, bias=s.dense_bias, scale_h=s.dense_scale_h)
        sparse = dict(
            local_target=local_target, owned=owned, bias=s.bias, scale_h=s.scale_h,
            target_add=s.target_add, support=support, num_valid=width,
        )  # fmt: skip
        triton_backward(x, x, per_row, dense, sparse)  # x over itself: each tile is read before written
        return
    sparse = None
    if s.support is not None:  # the support's logits, read before x turns into dlogits
        support2d, forced, rows_with_support = s.support
        ids = support_math.with_forced_target(support2d, s.targets, forced)
        sup_local, sup_owned = support_math.support_columns(ids, start, width)
        terms = support_math.support_grad_terms(
            x, sup_local, sup_owned, rows_with_support, s.max_logit, s.inv_t, s.log_norm, s.bias, s.scale_h
        )
        sparse = (sup_local, terms)
    chunk_math.chunk_grad(
        x,
        x,  # dlogits over the logits: each block is read (upcast) before it is written
        out_holds_exp=False,
        max_logit=s.max_logit,
        threshold=s.threshold,
        inv_temperature=s.inv_t,
        log_norm=s.log_norm,
        local_target=local_target,
        owned=owned,
        bias=s.dense_bias,
        scale_h=s.dense_scale_h,
        target_add=s.target_add,
    )
    if sparse is not None:
        support_math.add_at_columns_(x, *sparse)


def _dummy_weight_grad(weight: torch.Tensor) -> torch.Tensor | None:
    """What megatron's linear returns after accumulating into main_grad (`tensor_parallel/layers.py`,
    `LinearWithGradAccumulationAndAsyncCommunication.backward`): a placeholder gradient with
    `grad_added_to_main_grad` set, so DDP's hook does not add it again, or None without that flag. Zeros only
    where the weight has `zero_out_wgrad` (tied embeddings on one stage: megatron's `LanguageModule`; the
    hook then adds the placeholder plus the embedding's own gradient), else uninitialised: no [V, H] fill
    per micro-batch."""
    if hasattr(weight, "grad_added_to_main_grad"):
        weight.grad_added_to_main_grad = True
        return (
            torch.zeros_like(weight) if getattr(weight, "zero_out_wgrad", False) else torch.empty_like(weight)
        )
    return None


def vocab_parallel_linear_masked_logprobs(
    hidden: torch.Tensor,
    weight_shard: torch.Tensor,
    targets: torch.Tensor,
    *,
    log_rho: float | None = DEFAULT_LOG_RHO,
    temperature: float = 1.0,
    vocab_size: int | None = None,
    tp_group: dist.ProcessGroup | None = None,
    compute_entropy: bool = True,
    compute_safe_set_size: bool = False,
    sequence_parallel: bool = False,
    gradient_accumulation_fusion: bool = False,
    sampling_support: torch.Tensor | None = None,
    backend: str = "auto",
) -> MaskedLogprobs:
    """`vocab_parallel_masked_logprobs(hidden @ weight_shard.T, targets, ...)` without the logits.

    Args:
        hidden: `[..., H]` final-norm output, any float dtype (the logits are computed in it, as megatron's
            output layer does). Without sequence parallelism: the full sequence, identical on every TP rank.
            With `sequence_parallel`: this rank's shard of megatron's `[s, b, H]` layout along dim 0
            (`s/tp` rows, in rank order); it is all-gathered here, as megatron's output layer does.
        weight_shard: `[V_padded/TP, H]` this rank's rows of the output layer (or of the tied embedding),
            contiguous in rank order, same dtype as `hidden`.
        targets: `[...]` global token ids, the shape of the (gathered) hidden states without H.
        log_rho, temperature, vocab_size, tp_group, compute_entropy, compute_safe_set_size: as in
            `vocab_parallel_masked_logprobs` (same validation, same outputs).
        sequence_parallel: `hidden` is the SP shard (above).
        gradient_accumulation_fusion: add the weight gradient into `weight_shard.main_grad` (fp32) instead
            of returning it, as megatron's `ColumnParallelLinear` does under
            `config.gradient_accumulation_fusion`; the returned gradient is then a zero tensor with
            `grad_added_to_main_grad` set (or None without that attribute), exactly as megatron's.
        sampling_support: `[..., K]` ids (−1 padding), as in `vocab_parallel_masked_logprobs`; each column
            block gathers the support ids it holds from the block's logits.
        backend: as in `vocab_parallel_masked_logprobs`; "triton": token chunks of whole rows, each one GEMM
            into a chunk buffer and the kernels' passes over it (backward, in `[N/4, H]` blocks, or the
            chunks into main_grad: the GEMM again, the gradient kernel in place, then dX += dL·W and
            dW += dLᵀ·X).
    Returns:
        `MaskedLogprobs` of `[...]` tensors. Gradients reach `hidden` (all-reduced over TP, the full
        gradient on every rank; reduce-scattered to the shard with SP) and `weight_shard` (this rank's
        rows).
    Collectives: forward a MAX and a SUM on `tp_group` (none at TP = 1), plus the SP all-gather; backward
    the hidden-gradient all-reduce (SP: reduce-scatter).
    """
    log_rho = check_log_rho(log_rho)
    temperature = check_temperature(temperature)
    tp_size, tp_rank = group_size_and_rank(tp_group)
    for name, t in (("hidden", hidden), ("weight_shard", weight_shard)):
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor; got {describe_value(t)}")
    if hidden.dim() < 1:
        raise ValueError(f"hidden must be [..., H]; got shape {tuple(hidden.shape)}")
    if weight_shard.dim() != 2 or weight_shard.shape[1] != hidden.shape[-1]:
        raise ValueError(
            f"weight_shard must be [V_local, H] with H = hidden.shape[-1] = {hidden.shape[-1]}; "
            f"got {tuple(weight_shard.shape)}"
        )
    if weight_shard.dtype != hidden.dtype or weight_shard.device != hidden.device:
        raise ValueError(
            f"hidden and weight_shard must share dtype and device; got {hidden.dtype} on {hidden.device} "
            f"and {weight_shard.dtype} on {weight_shard.device}"
        )
    if gradient_accumulation_fusion and getattr(weight_shard, "main_grad", None) is None:
        raise ValueError(
            "gradient_accumulation_fusion=True needs weight_shard.main_grad (megatron's DDP sets it)"
        )
    if sequence_parallel and tp_size > 1:
        hidden = _SequenceParallelGather.apply(hidden, tp_group, tp_size)
    vocab_size = check_targets(
        targets, "hidden", hidden, tuple(hidden.shape[:-1]), weight_shard.shape[0], vocab_size, tp_size
    )
    settings = _Settings(
        log_rho=log_rho,
        temperature=temperature,
        vocab_size=vocab_size,
        tp_group=tp_group,
        tp_size=tp_size,
        tp_rank=tp_rank,
        entropy=bool(compute_entropy),
        count=bool(compute_safe_set_size),
        all_reduce_grad=tp_size > 1 and not sequence_parallel,
        into_main_grad=bool(gradient_accumulation_fusion),
        backend=resolve_backend(backend, hidden.device),
    )
    support2d = check_sampling_support(sampling_support, targets, vocab_size)
    outs = _LinearMaskedLogprobsFunction.apply(
        hidden.reshape(-1, hidden.shape[-1]), weight_shard, targets.reshape(-1).long(), support2d, settings
    )
    return as_outputs(outs, targets.shape)
