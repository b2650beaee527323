"""`vocab_parallel_masked_logprobs`: log π^mp and entropy over the DVP safe set, on vocab-parallel logits.

Public functional API on top, a thin `torch.autograd.Function` under it, and the math in
`masked_logprobs_math` (one chunk of tokens at a time). Collectives, at most two per call, both on the
`tp_group` passed in: a MAX of the per-token max logit (with the shard sizes piggy-backed for validation)
and one SUM of a `[N, 4]` stack of partial sums. Backward needs no collective.

Passes over the logits (the Triton backend; the PyTorch one walks the same passes in row chunks): pass 1
the local row max, collective 1, pass 2 the partial sums, collective 2; backward one read and one write.
Under TP > 1 the MAX collective sits between the two passes, so the forward reads this rank's shard twice
from HBM: at TP = 1 one program could walk its row twice and find it in L2 the second time (132 rows in
flight × 297 KB = 39 MB, under an H200's ~60 MB L2; research/op-kernels.md), but a collective cannot sit
inside a program. Its analogue, pass 1 over a block of rows sized to L2, that block's MAX, pass 2 while it
is cached, costs one collective per block, about what it saves (projected, not measured): at 16,384 tokens
and TP = 2 a shard is 2.49 GB of bf16 (the second read 0.6 ms at 4.2 TB/s), and ~40 blocks of ~390 rows of
152 KB fill 60 MB, 0.4–0.8 ms of collectives at 10–20 µs each; at TP = 8 the read is 0.15 ms against ~10
blocks. So each call keeps one MAX and one SUM, and the forward two HBM reads of the shard.

Non-finite logits: a NaN anywhere in a token's row (on any shard) makes every output of that token NaN
and its gradient NaN; +inf likewise gives NaN (inf − inf). Nothing non-finite is ever turned into a
finite value. −inf logits are ordinary probability-zero tokens: never in the safe set, zero gradient;
only a *target* whose logit is −inf gets `logprobs = logprobs_full = −inf`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from . import masked_logprobs_math as chunk_math
from . import sampling_support_math as support_math
from . import triton_grad
from .backend import load_kernels, resolve_backend
from .log_rho import DEFAULT_LOG_RHO, check_log_rho, check_temperature
from .safe_vocab import rule_dtype, safe_threshold

CHUNK_ELEMENTS = {"cpu": 1 << 18, "cuda": 1 << 25}
"""Elements per chunk of tokens (rows = max(1, elements // V_local)); extra memory is O(chunk), never another
copy of the logits. CPU: a chunk's 1 MiB float32 buffers stay in L2/L3 (best between 2^17 and 2^19 on
2048 × 32768). CUDA: 128 MiB buffers, so a 16k-token × 152k-vocab call is ~40 chunks, not thousands of
kernel launches."""


@dataclass
class MaskedLogprobs:
    """Per-token outputs, each of the targets' shape `[...]`.

    logprobs: float32, log π^mp(target) renormalised over V_S ∪ {target}; differentiable.
    entropy: float32, H(π^mp) over the same support; differentiable; None if not computed.
    in_safe_set: bool, target ∈ V_S (False: the target was force-kept and must be masked or vetoed).
    safe_mass: float32, Z = Σ_{k∈V_S} π(k), the full-softmax mass kept (Prop. 5.5's bound uses min Z).
    logprobs_full: float32, unpruned log π(target); equals logprobs + log Z where in_safe_set.
    safe_set_size: int64, |V_S| (the force-kept target not counted); None unless asked for.
    top_logprob: float32, log π^mp of the most probable token (always in V_S), so that
        (top_logprob − logprobs)·T = max_k x_k − x_target, the target's raw-logit gap to the max: what an
        engine's top-1 log-prob lets one compare without its logits (DVP Prop. 4.2's ε̂). No gradient.
    """

    logprobs: torch.Tensor
    entropy: torch.Tensor | None
    in_safe_set: torch.Tensor
    safe_mass: torch.Tensor
    logprobs_full: torch.Tensor
    safe_set_size: torch.Tensor | None = None
    top_logprob: torch.Tensor | None = None


def group_size_and_rank(tp_group) -> tuple[int, int]:
    if tp_group is None:
        return 1, 0
    return dist.get_world_size(tp_group), dist.get_rank(tp_group)


def _check_inputs(logits: torch.Tensor, targets: torch.Tensor, vocab_size: int | None, tp_size: int) -> int:
    """Local checks; returns the true vocab size."""
    if not isinstance(logits, torch.Tensor) or not logits.is_floating_point():
        raise TypeError(
            f"logits must be a floating-point tensor [..., V_local]; got {describe_value(logits)}"
        )
    if logits.dim() < 1:
        raise ValueError(
            f"logits must have a vocab dimension [..., V_local]; got shape {tuple(logits.shape)}"
        )
    return check_targets(
        targets, "logits", logits, tuple(logits.shape[:-1]), logits.shape[-1], vocab_size, tp_size
    )


def check_targets(
    targets: torch.Tensor,
    name: str,
    source: torch.Tensor,
    lead_shape: tuple[int, ...],
    v_local: int,
    vocab_size: int | None,
    tp_size: int,
) -> int:
    """Checks of `targets` against the scored tensor `source` (logits, or the fused op's hidden states):
    integer dtype, shape `lead_shape`, same device, ids in [0, vocab_size); and of `vocab_size` against the
    padded vocab `v_local · tp_size`. Returns the true vocab size."""
    if not isinstance(targets, torch.Tensor) or targets.is_floating_point() or targets.is_complex():
        raise TypeError(f"targets must be an integer tensor of token ids; got {describe_value(targets)}")
    if targets.dtype == torch.bool:
        raise TypeError("targets must be an integer tensor of token ids; got dtype torch.bool")
    if tuple(lead_shape) != tuple(targets.shape):
        raise ValueError(
            f"{name}.shape[:-1] must equal targets.shape; got {name} {tuple(source.shape)} "
            f"and targets {tuple(targets.shape)}"
        )
    if targets.device != source.device:
        raise ValueError(f"targets are on {targets.device} but {name} on {source.device}")
    padded = v_local * tp_size
    if vocab_size is None:
        vocab_size = padded
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or not 0 < vocab_size <= padded:
        raise ValueError(
            f"vocab_size must be an int in [1, V_local·tp = {v_local}·{tp_size} = {padded}]; "
            f"got {vocab_size!r}"
        )
    if targets.numel():
        bad = (targets < 0) | (targets >= vocab_size)
        assert_none(bad, targets, f"targets must be token ids in [0, vocab_size={vocab_size})")
    return vocab_size


def reads_back(tensor: torch.Tensor) -> bool:
    """May a check read a flag of `tensor` back to the host? On CPU only: on an accelerator that read is
    a device→host sync on every call (the hot path of every micro-batch). Tests force False on CPU to
    run the device branch under a no-scalar-read guard (`tests/ops/test_no_scalar_reads.py`)."""
    return tensor.device.type == "cpu"


def assert_none(bad: torch.Tensor, values: torch.Tensor, message: str) -> None:
    """Fail if any element of `bad` (bool, the shape of `values`) is set. On the host: `ValueError` with
    `message`, the first bad value and its index. On a device: `torch._assert_async`, a device-side assert
    that fails the next synchronising call with `message`, so the check costs no sync."""
    if not reads_back(bad):
        torch._assert_async(~bad.any(), message)
        return
    if bool(bad.any()):
        index = tuple(int(i) for i in bad.nonzero()[0])
        raise ValueError(f"{message}; got {int(values[index])} at index {index}")


def describe_value(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"tensor of dtype {value.dtype}"
    return f"{type(value).__name__} {value!r}"


def valid_columns(v_local: int, vocab_size: int, tp_rank: int) -> tuple[int, int]:
    """(global id of this shard's first column, how many of its columns are real vocab, not padding)."""
    vocab_start = tp_rank * v_local
    return vocab_start, min(max(vocab_size - vocab_start, 0), v_local)


def safe_set_threshold(
    x: torch.Tensor,
    *,
    v_local: int,
    vocab_size: int,
    log_rho: float | None,
    temperature: float,
    tp_group,
    tp_size: int,
    backend: str = "torch",
) -> tuple[torch.Tensor, torch.Tensor]:
    """The global max logit and the safe-set threshold of each row of vocab-parallel logits (the fused op
    computes the same max blockwise and takes θ from `op_threshold` too); `backend` "triton": the local
    max by the kernel (pass 1), else by torch.

    Args:
        x: `[N, V_valid]` this shard's real (unpadded) columns; V_valid may be 0 on a shard of padding.
        v_local, vocab_size: the shard width and the true vocab size (checked equal across the group).
        log_rho, temperature: validated rule parameters (`safe_vocab`); log_rho None means no pruning.
    Returns:
        `([N], [N])` in `rule_dtype(x.dtype)`: max over the whole vocab, and θ such that k ∈ V_S iff
        x_k ≥ θ. With pruning off θ = −max_float, which drops only −inf logits (probability zero).
    Collective 1 of the op: a MAX over `tp_group` (shard sizes piggy-backed to check consistency).
    """
    compute_dtype = rule_dtype(x.dtype)
    if not x.shape[1]:
        local_max = torch.full((x.shape[0],), -math.inf, dtype=compute_dtype, device=x.device)
    elif backend == "triton":
        local_max = load_kernels(x.device).row_max(x, compute_dtype)
    else:
        local_max = x.amax(dim=1).to(compute_dtype)  # exact in the logits' dtype: no upcast copy needed
    max_logit = global_max_logit(local_max, v_local, vocab_size, tp_group, tp_size)
    return max_logit, op_threshold(max_logit, log_rho, temperature)


def op_threshold(max_logit: torch.Tensor, log_rho: float | None, temperature: float) -> torch.Tensor:
    """θ of each row from its global max (compute dtype): the rule's `safe_threshold`, or −max_float with
    pruning off, which drops only −inf logits (probability zero either way). θ is never below −max_float:
    where max + T·log ρ overflows to −inf (|T·log ρ| beyond the dtype's range) it is −max_float too, the
    same safe set of finite logits, so −inf logits, and the kernels' masked tail lanes, are never safe."""
    lowest = -torch.finfo(max_logit.dtype).max
    if log_rho is None:
        return torch.full_like(max_logit, lowest)
    return safe_threshold(max_logit, log_rho, temperature).clamp_(min=lowest)


def threshold_offset(log_rho: float | None, temperature: float, dtype: torch.dtype) -> tuple[float, bool]:
    """What `op_threshold` adds to each row's max, for a kernel that computes θ itself (`triton_kernels.
    max_and_sums`): (T·log ρ, True) as `safe_vocab.safe_threshold` adds it, or without pruning
    (−max_float of `dtype`, the compute dtype, False: θ is that constant)."""
    if log_rho is None:
        return -torch.finfo(dtype).max, False
    return temperature * log_rho, True


def triton_forward_one_program(
    kernels, x: torch.Tensor, log_rho, temperature: float, local_target, owned, entropy: bool, count: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """The forward of a TP = 1 call on the Triton backend as one kernel (`triton_kernels.max_and_sums`):
    (`[N]` max, `[N]` θ, `[N, NUM_PARTIALS]` partials), or None where the two kernels run instead
    (`triton_kernels.one_program`; no columns)."""
    launch = kernels.one_program(x.dtype, x.device)
    if launch is None or not x.shape[1]:
        return None
    compute_dtype = rule_dtype(x.dtype)
    offset, prune = threshold_offset(log_rho, temperature, compute_dtype)
    return kernels.max_and_sums(
        x, compute_dtype, offset=offset, prune=prune, inv_temperature=1.0 / temperature,
        local_target=local_target, owned=owned, with_entropy=entropy, with_count=count, launch=launch,
    )  # fmt: skip


def global_max_logit(
    max_logit: torch.Tensor, v_local: int, vocab_size: int, tp_group, tp_size: int
) -> torch.Tensor:
    """Collective 1: MAX over shards of the max logit, with shard sizes piggy-backed to check consistency."""
    if tp_size == 1:
        return max_logit
    # Filled on the device (a tensor from a list would be a blocking host→device copy on CUDA).
    stacked = torch.empty(max_logit.shape[0] + 4, dtype=max_logit.dtype, device=max_logit.device)
    stacked[:-4] = max_logit
    for i, value in enumerate((v_local, -v_local, vocab_size, -vocab_size)):
        stacked[-4 + i] = value
    dist.all_reduce(stacked, op=dist.ReduceOp.MAX, group=tp_group)
    if stacked.device.type != "cpu":
        # No `.tolist()` (a device→host sync per call) on an accelerator: the same checks, asserted there.
        hi_v, neg_lo_v, hi_vocab, neg_lo_vocab = stacked[-4:].unbind()
        ok = (hi_v == -neg_lo_v) & (hi_vocab == -neg_lo_vocab)
        torch._assert_async(ok, "V_local or vocab_size differs across the tensor-parallel ranks")
        return stacked[:-4]
    hi_v, neg_lo_v, hi_vocab, neg_lo_vocab = (int(v) for v in stacked[-4:].tolist())
    if hi_v != -neg_lo_v:
        raise ValueError(
            f"vocab shards differ across the {tp_size} tensor-parallel ranks: V_local ranges from "
            f"{-neg_lo_v} to {hi_v} (this rank: {v_local}); megatron shards the padded vocab evenly"
        )
    if hi_vocab != -neg_lo_vocab:
        raise ValueError(
            f"vocab_size differs across tensor-parallel ranks: from {-neg_lo_vocab} to {hi_vocab} "
            f"(this rank: {vocab_size})"
        )
    return stacked[:-4]


def spans(total: int, step: int):
    """Consecutive slices of `range(total)`, `step` long (the last one shorter)."""
    for start in range(0, total, step):
        yield slice(start, min(start + step, total))


def row_chunks(num_rows: int, v_local: int, device: torch.device):
    return spans(num_rows, _chunk_rows(v_local, device))


def _chunk_rows(v_local: int, device: torch.device) -> int:
    elements = CHUNK_ELEMENTS.get(device.type, CHUNK_ELEMENTS["cuda"])
    return max(1, elements // max(v_local, 1))


SUPPORT_BLOCK_ROWS = 256
"""Rows whose sampling-support temporaries (`[rows, K]` ids, flags, logits, terms) exist at once: a few
hundred KiB at K = 50, below the support's own bytes for any real micro-batch, in few enough blocks that
the per-op overhead stays small. Backward runs the dense chunks inside these blocks (whole chunks each)."""


def support_blocks(num_rows: int, v_local: int, device: torch.device):
    step = _chunk_rows(v_local, device)
    return spans(num_rows, step * max(1, SUPPORT_BLOCK_ROWS // step))


SPECIAL_ELEMENTS = 1 << 24
"""The Triton backend's `[rows, J, J]` merge of a block's special gradient columns (`triton_grad`; J = K + 2
with a support) holds at most this many elements; its `[rows, K]` support sums likewise. Few, large blocks:
each is a handful of small kernels, and a 16k-token call without a support is one block."""


def special_blocks(num_rows: int, width: int):
    """Row blocks of the Triton backend's `[rows, width]`-sized torch work (`width`: J·J, or K)."""
    return spans(num_rows, max(1, SPECIAL_ELEMENTS // max(width, 1)))


class _MaskedLogprobsFunction(torch.autograd.Function):
    """Forward keeps, when the logits are float32/float64 and need a gradient, the masked exponentials
    in a buffer that backward turns into the gradient in place (the gradient must be written anyway, so
    this costs no extra peak memory and saves recomputing exp). For bf16/fp16 logits a float32 buffer
    would be twice the logits' size, so backward recomputes from the logits chunk by chunk instead.

    `inplace`: no gradient buffer at all. The logits stay intact through forward (a later read sees
    them), and backward recomputes from each chunk and writes the gradient over it, returning the logits'
    own storage as their gradient (megatron's cross-entropy does the same). Autograd's version counter
    guards it: the logits are saved for backward, so a later in-place change makes backward raise, and
    backward's own writes bump the version, so an op that saved the logits earlier raises in its backward.
    """

    @staticmethod
    def forward(
        ctx,
        logits2d,
        targets1d,
        log_rho,
        temperature,
        vocab_size,
        tp_group,
        tp_size,
        tp_rank,
        entropy,
        count,
        inplace,
        support2d,
        backend,
    ):
        v_local = logits2d.shape[1]
        vocab_start, num_valid = valid_columns(v_local, vocab_size, tp_rank)
        x = logits2d[:, :num_valid]  # padded columns excluded by a view: no copy
        num_rows = x.shape[0]
        compute_dtype = rule_dtype(x.dtype)
        inv_t = 1.0 / temperature
        local_target, owned = chunk_math.target_columns(targets1d, vocab_start, num_valid)
        one_program = None
        if backend == "triton" and tp_size == 1:  # nothing between the passes: maybe one kernel
            one_program = triton_forward_one_program(
                load_kernels(x.device), x, log_rho, temperature, local_target, owned, entropy, count
            )
        if one_program is not None:
            max_logit, threshold, partials = one_program
        else:
            max_logit, threshold = safe_set_threshold(
                x,
                v_local=v_local,
                vocab_size=vocab_size,
                log_rho=log_rho,
                temperature=temperature,
                tp_group=tp_group,
                tp_size=tp_size,
                backend=backend,
            )
            if backend == "triton":
                partials = load_kernels(x.device).partial_sums(
                    x, max_logit, threshold, inv_t, local_target, owned, entropy, count
                )
            else:
                partials = torch.empty(
                    (num_rows, chunk_math.NUM_PARTIALS), dtype=compute_dtype, device=x.device
                )

        # the Triton backward recomputes p from the logits in one pass: nothing kept for it
        keep_exp = (
            ctx.needs_input_grad[0] and logits2d.dtype == compute_dtype and not inplace and backend == "torch"
        )
        grad_buffer = torch.empty_like(logits2d) if keep_exp else None
        if grad_buffer is not None:
            grad_buffer[:, num_valid:].zero_()  # padded columns never receive gradient
        for rows in row_chunks(num_rows, v_local, x.device) if backend == "torch" else ():
            partials[rows] = chunk_math.chunk_partial_sums(
                x[rows],
                max_logit[rows],
                threshold[rows],
                inv_t,
                local_target[rows],
                owned[rows],
                entropy,
                exp_out=None if grad_buffer is None else grad_buffer[rows, :num_valid],
                with_count=count,
            )
        rows_with_support = in_support = None
        if support2d is not None:  # its sums fill the partials' support columns: still one SUM
            rows_with_support = support_math.support_rows(support2d)
            blocks = (
                special_blocks(num_rows, support2d.shape[1])
                if backend == "triton"
                else support_blocks(num_rows, v_local, x.device)
            )
            for rows in blocks:
                local, sup_owned = support_math.support_columns(support2d[rows], vocab_start, num_valid)
                partials[rows, chunk_math.S_SUPPORT :] = support_math.support_partials(
                    x[rows], local, sup_owned, max_logit[rows], inv_t
                )
            in_support = support_math.target_in_support(support2d, targets1d)
        if tp_size > 1:
            dist.all_reduce(partials, op=dist.ReduceOp.SUM, group=tp_group)  # collective 2
        out = chunk_math.finalize(
            partials, max_logit, threshold, inv_t, entropy, rows_with_support, in_support
        )
        ctx.save_for_backward(
            logits2d, max_logit, threshold, out["log_norm"], local_target, owned, out["entropy"]
        )
        ctx.grad_buffer, ctx.num_valid, ctx.inv_t, ctx.inplace = grad_buffer, num_valid, inv_t, inplace
        ctx.backend = backend
        ctx.support = None
        if support2d is not None:  # the support is the caller's tensor: kept by reference, not copied
            ctx.support = (support2d, targets1d, out["forced_support"], rows_with_support, vocab_start)
        return function_outputs(ctx, out, log_rho, count)

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy, *_):
        logits2d, max_logit, threshold, log_norm, local_target, owned, entropy = ctx.saved_tensors
        no_grads = (None,) * 12
        if grad_logprobs is None and grad_entropy is None:
            return (None, *no_grads)
        # The kept exponentials become this gradient in place; a second backward through the same
        # graph (retain_graph, gradcheck) finds them consumed and recomputes from the logits.
        grad, ctx.grad_buffer = ctx.grad_buffer, None
        from_exp = grad is not None
        if grad is None:
            # in place: each chunk is read (upcast) before its gradient is written over it
            grad = logits2d if ctx.inplace else torch.empty_like(logits2d)
            grad[:, ctx.num_valid :].zero_()  # padded columns never receive gradient
        bias, scale_h, target_add = chunk_math.grad_coefficients(
            log_norm, ctx.inv_t, grad_logprobs, grad_entropy, entropy
        )
        x, g = logits2d[:, : ctx.num_valid], grad[:, : ctx.num_valid]
        sparse_bias, sparse_scale_h = bias, scale_h
        if ctx.support is not None:
            support2d, targets1d, forced, rows_with_support, vocab_start = ctx.support
            bias, scale_h = support_math.dense_coefficients(rows_with_support, bias, scale_h)
        if ctx.backend == "triton":
            per_row = dict(max_logit=max_logit, log_norm=log_norm, inv_temperature=ctx.inv_t)
            dense = dict(threshold=threshold, bias=bias, scale_h=scale_h)
            sparse = dict(
                local_target=local_target, owned=owned, bias=sparse_bias, scale_h=sparse_scale_h,
                target_add=target_add, support=ctx.support, num_valid=ctx.num_valid,
            )  # fmt: skip
            triton_backward(x, g, per_row, dense, sparse)
            return (grad, *no_grads)
        blocks = support_blocks(x.shape[0], logits2d.shape[1], x.device) if ctx.num_valid else ()
        for block in blocks:  # none on a shard of padding only: its gradient is all zero
            sparse = None
            if ctx.support is not None:  # read the block's support logits before in place overwrites them
                ids = support_math.with_forced_target(support2d[block], targets1d[block], forced[block])
                local, sup_owned = support_math.support_columns(ids, vocab_start, ctx.num_valid)
                terms = support_math.support_grad_terms(
                    x[block],
                    local,
                    sup_owned,
                    rows_with_support[block],
                    max_logit[block],
                    ctx.inv_t,
                    log_norm[block],
                    sparse_bias[block],
                    None if sparse_scale_h is None else sparse_scale_h[block],
                )
                sparse = local, terms
            for rows in row_chunks(block.stop - block.start, logits2d.shape[1], x.device):
                rows = slice(block.start + rows.start, block.start + rows.stop)
                per_row = dict(
                    max_logit=max_logit[rows],
                    threshold=threshold[rows],
                    inv_temperature=ctx.inv_t,
                    log_norm=log_norm[rows],
                    local_target=local_target[rows],
                    owned=owned[rows],
                    bias=bias[rows],
                    scale_h=None if scale_h is None else scale_h[rows],
                    target_add=target_add[rows],
                )
                chunk_math.chunk_grad(x[rows], g[rows], out_holds_exp=from_exp, **per_row)
            if sparse is not None:
                support_math.add_at_columns_(g[block], *sparse)
        return (grad, *no_grads)


def triton_backward(x: torch.Tensor, g: torch.Tensor, per_row: dict, dense: dict, sparse: dict) -> None:
    """The Triton backend's backward (`triton_grad`), of this op and of each block of the fused one with a
    sampling support (without one the fused op's blocks call the gradient kernel themselves, with global ids).
    Without a support, one launch: the gradient kernel writes the target's column in its pass
    (`triton_kernels.write_grad`'s `targets`; the dense coefficients are then the target's own). With one:
    the target and support columns' values from the logits as they are, block by block; then the dense pass
    over every row (g may be x: in place); then those columns written once each. `per_row`: max_logit,
    log_norm, inv_temperature; `dense`: the dense pass's threshold and coefficients; `sparse`:
    `triton_grad.special_columns`'s own arguments, whole rows (`support` with its columns' vocab start)."""
    support = sparse["support"]
    if support is None:
        # about 20 small torch ops fewer per call (the backward's time outside its kernel was 0.17 ms of a
        # 16k-token fwd + bwd on an H200, `bench.op_split`, 2026-12-01): the rows whose target this shard does
        # not hold get id −1, which no column has
        targets = torch.where(sparse["owned"], sparse["local_target"], -1)
        load_kernels(x.device).write_grad(
            x, g, **per_row, **dense, targets=targets, target_start=0, target_add=sparse["target_add"]
        )
        return
    ids, targets, forced, rows_with_support, vocab_start = support
    width = (ids.shape[1] + 2) ** 2  # the merge's [J, J] per row
    other = {k: v for k, v in {**per_row, **sparse}.items() if k != "support"}
    columns = []
    for block in special_blocks(x.shape[0], width) if x.shape[1] else ():
        rows = {k: v[block] if isinstance(v, torch.Tensor) else v for k, v in other.items()}
        block_support = (ids[block], targets[block], forced[block], rows_with_support[block], vocab_start)
        columns.append((block, triton_grad.special_columns(x[block], support=block_support, **rows)))
    load_kernels(x.device).write_grad(x, g, **per_row, **dense)
    for block, (cols, values, keep) in columns:
        triton_grad.write_columns_(g[block], cols, values, keep)


def vocab_parallel_masked_logprobs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    log_rho: float | None = DEFAULT_LOG_RHO,
    temperature: float = 1.0,
    vocab_size: int | None = None,
    tp_group: dist.ProcessGroup | None = None,
    compute_entropy: bool = True,
    compute_safe_set_size: bool = False,
    inplace_backward: bool = False,
    sampling_support: torch.Tensor | None = None,
    backend: str = "auto",
) -> MaskedLogprobs:
    """Log-probs and entropy of the min-p-pruned policy π^mp on vocab-parallel logits.

    Args:
        logits: `[..., V_local]` this rank's contiguous vocab shard (rank r holds global ids
            [r·V_local, (r+1)·V_local)), any float dtype. Read only: never modified.
        targets: `[...]` integer global token ids in [0, vocab_size).
        log_rho: log ρ ≤ 0 of the safe set V_S = {k : π_T(k) ≥ ρ·max π_T}; None or −inf: no pruning, and
            then `-logprobs` equals megatron's `vocab_parallel_cross_entropy`.
        temperature: T > 0; logits are divided by T before the softmax, and the rule is applied on the
            same temperature-scaled distribution π_T (raw-logit window T·|log ρ|; see `safe_vocab`). For a
            safe set on the raw logits instead, pass `log_rho.rule_log_rho(log ρ, T, "raw_logits")`.
        vocab_size: true vocab size; columns at global ids ≥ vocab_size (megatron's padding) are excluded.
            Default: V_local · tp (no padding).
        tp_group: the tensor-parallel process group the vocab is sharded over; None: unsharded.
        compute_entropy: also compute H(π^mp) (costs one extra dot product per chunk).
        compute_safe_set_size: also count |V_S| per token (`safe_set_size`), in the same pass.
        inplace_backward: the caller hands the logits over: no gradient buffer is allocated, backward
            writes the gradient over the logits' own storage (as megatron's cross-entropy does). The
            logits stay readable until backward; changing them in place after the call makes backward
            raise (autograd's version counter), and so does any op that saved them for its own backward
            and runs its backward after this one. Default: read-only logits.
        sampling_support: `[..., K]` integer global token ids (−1 padding, ids unique per row): the support
            a truncating sampler (top-k/top-p/min-p) drew the target from. Where a row has any id, its
            normaliser and entropy are over that support (plus the target, force-kept if absent) instead
            of V_S; a row of −1 keeps V_S. `in_safe_set`, `safe_mass`, `logprobs_full` keep their DVP
            meaning. Each shard gathers the ids in its range: no logits gathered, still one SUM.
        backend: "auto" (Triton kernels on CUDA, the chunked PyTorch code elsewhere), "triton" (the kernels
            on any device; on CPU under Triton's interpreter, `ops.backend.load_kernels`) or "torch".
    Returns:
        `MaskedLogprobs` of `[...]` float32 tensors (float64 for float64 logits); gradients reach
        `logits` (in its dtype) through `logprobs` and `entropy`. Reduced over the vocab (all
        shards); nothing is reduced over tokens.
    """
    log_rho = check_log_rho(log_rho)
    temperature = check_temperature(temperature)
    tp_size, tp_rank = group_size_and_rank(tp_group)
    vocab_size = _check_inputs(logits, targets, vocab_size, tp_size)
    lead_shape = targets.shape
    logits2d = logits.reshape(-1, logits.shape[-1])
    support2d = check_sampling_support(sampling_support, targets, vocab_size)
    outs = _MaskedLogprobsFunction.apply(
        logits2d,
        targets.reshape(-1).long(),
        log_rho,
        temperature,
        vocab_size,
        tp_group,
        tp_size,
        tp_rank,
        bool(compute_entropy),
        bool(compute_safe_set_size),
        bool(inplace_backward),
        support2d,
        resolve_backend(backend, logits.device),
    )
    return as_outputs(outs, lead_shape)


def check_sampling_support(
    support: torch.Tensor | None, targets: torch.Tensor, vocab_size: int
) -> torch.Tensor | None:
    """The `[..., K]` support checked against `[...]` targets, as `[N, K]` in its integer dtype (a view, not
    an int64 copy of the whole support; None passes through)."""
    if support is None:
        return None
    if not isinstance(support, torch.Tensor) or support.is_floating_point() or support.dtype == torch.bool:
        raise TypeError(
            f"sampling_support must be an integer tensor of token ids [..., K]; got {describe_value(support)}"
        )
    if support.dim() != targets.dim() + 1 or tuple(support.shape[:-1]) != tuple(targets.shape):
        raise ValueError(
            f"sampling_support must be [..., K] with [...] = targets.shape {tuple(targets.shape)}; "
            f"got {tuple(support.shape)}"
        )
    if support.device != targets.device:
        raise ValueError(f"sampling_support is on {support.device} but targets on {targets.device}")
    if support.numel():
        bad = (support < -1) | (support >= vocab_size)
        message = f"sampling_support must hold token ids in [0, vocab_size={vocab_size}) or -1 (padding)"
        assert_none(bad, support, message)
    # `targets.numel()`, not −1: a micro-batch whose rows carry no id (an empty one, a CP shard without
    # response tokens) has K = 0, and reshape cannot infer −1 for 0 elements. Its own dtype: blocks widen
    # the ids to int64 as they index.
    return support.reshape(targets.numel(), support.shape[-1])


def function_outputs(ctx, out: dict[str, torch.Tensor], log_rho: float | None, count: bool) -> tuple:
    """The flat outputs an op's autograd function returns from `chunk_math.finalize`'s dict: every target
    in the set when pruning is off, the flags / Z / unpruned log-prob / |V_S| / top log-prob
    non-differentiable."""
    if log_rho is None:
        out["in_safe_set"] = torch.ones_like(out["in_safe_set"])
    size = out["safe_set_size"] if count else None
    flat = (
        out["logprobs"],
        out["entropy"],
        out["in_safe_set"],
        out["safe_mass"],
        out["logprobs_full"],
        size,
        out["top_logprob"],
    )
    ctx.mark_non_differentiable(*(t for t in flat[2:] if t is not None))
    ctx.set_materialize_grads(False)
    return flat


def as_outputs(outs: tuple, lead_shape: torch.Size) -> MaskedLogprobs:
    """`MaskedLogprobs` of the autograd functions' flat `[N]` outputs, reshaped to `lead_shape`."""
    logprobs, entropy, in_safe, safe_mass, logprobs_full, size, top = outs
    return MaskedLogprobs(
        logprobs=logprobs.view(lead_shape),
        entropy=None if entropy is None else entropy.view(lead_shape),
        in_safe_set=in_safe.view(lead_shape),
        safe_mass=safe_mass.view(lead_shape),
        logprobs_full=logprobs_full.view(lead_shape),
        safe_set_size=None if size is None else size.view(lead_shape),
        top_logprob=top.view(lead_shape),
    )
