"""The fused output layer + DVP op on the Triton backend (token chunks of whole rows: one GEMM into a chunk
buffer, the kernels' passes over it; backward the GEMM again, the gradient kernel in place, then the two
matmuls), under Triton's interpreter: against the float64 reference at TP = 1 over several chunks (each
design of the forward's kernels, `tests/ops/conftest.py`), with a sampling support, sharded over TP = 2
with and without sequence parallelism (the same collectives as the PyTorch backend), and with megatron's
gradient-accumulation fusion."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import megatron_tail.ops.linear_masked_logprobs as fused_impl
from megatron_tail.ops import vocab_parallel_linear_masked_logprobs
from megatron_tail.ops.reference import reference_masked_logprobs
from tests.harness import run_distributed
from tests.ops.test_linear_op import TOL, H, as_dict, backward_of, problem, reference
from tests.triton_interpreter import UNDER_INTERPRETER

pytestmark = UNDER_INTERPRETER


@pytest.mark.usefixtures("forward")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk_rows", [3, 64], ids=["several-chunks", "one-chunk"])
def test_equals_the_float64_reference(monkeypatch, dtype, chunk_rows):
    vocab_size, padded = 61, 64
    monkeypatch.setitem(fused_impl.TRITON_CHUNK_ELEMENTS, "cpu", chunk_rows * vocab_size)
    hidden, weight, targets, grads = problem(10, vocab_size, padded, dtype, seed=2)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    out = vocab_parallel_linear_masked_logprobs(
        h, w, targets, log_rho=-3.0, temperature=0.8, vocab_size=vocab_size, backend="triton"
    )
    backward_of(as_dict(out), grads).backward()
    ref, h_ref, w_ref = reference(hidden, weight, targets, vocab_size, -3.0, 0.8)
    backward_of(ref, grads).backward()
    tol = TOL[dtype]
    for key in ref:
        torch.testing.assert_close(out_value(out, key), ref[key], rtol=tol, atol=tol, msg=key)
    scale = float(h_ref.grad.abs().max())
    torch.testing.assert_close(h.grad.double(), h_ref.grad, rtol=tol, atol=tol * scale)
    torch.testing.assert_close(w.grad.double(), w_ref.grad, rtol=tol, atol=tol * scale)
    assert torch.count_nonzero(w.grad[vocab_size:]) == 0  # padded rows of the weight: no gradient


def out_value(out, key):
    value = getattr(out, key)
    return value if value.dtype == torch.bool else value.double()


@pytest.mark.usefixtures("forward")
def test_a_sampling_support_in_the_fused_triton_op():
    vocab_size = 50
    hidden, weight, targets, grads = problem(8, vocab_size, vocab_size, torch.float32, seed=4)
    logits = hidden.double() @ weight.double().T
    support = torch.full((8, 5), -1, dtype=torch.int32)
    support[:6, :4] = logits[:6].topk(4).indices.int()
    targets[2] = logits[2].argmin()  # outside its support: force-kept
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    out = vocab_parallel_linear_masked_logprobs(
        h, w, targets, log_rho=-4.0, vocab_size=vocab_size, sampling_support=support, backend="triton"
    )
    backward_of(as_dict(out), grads).backward()
    hr, wr = hidden.double().requires_grad_(), weight.double().requires_grad_()
    ref = reference_masked_logprobs(hr @ wr.T, targets, log_rho=-4.0, sampling_support=support.long())
    backward_of(ref, grads).backward()
    for key in ("logprobs", "entropy", "safe_mass", "logprobs_full"):
        torch.testing.assert_close(getattr(out, key).double(), ref[key], rtol=2e-5, atol=2e-5, msg=key)
    torch.testing.assert_close(h.grad.double(), hr.grad, rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(w.grad.double(), wr.grad, rtol=2e-5, atol=2e-5)


def _sharded_rank(rank, world, dtype, sequence_parallel, fusion=False):
    s, b, vocab_size, padded = 6, 2, 61, 64
    hidden, weight, targets, grads = problem(s * b, vocab_size, padded, dtype, seed=5)
    hidden, targets, grads = hidden.view(s, b, H), targets.view(s, b), grads.view(2, s, b)
    v_local = padded // world
    w = torch.nn.Parameter(weight[rank * v_local : (rank + 1) * v_local].clone())
    if fusion:  # megatron's float32 main_grad, holding an earlier micro-batch's gradient
        w.main_grad = torch.full(w.shape, 0.5, dtype=torch.float32)
    h = (hidden.chunk(world, dim=0)[rank] if sequence_parallel else hidden).clone().requires_grad_()
    calls = []
    real = dist.all_reduce

    def counting(*args, **kwargs):
        calls.append("all_reduce")
        return real(*args, **kwargs)

    dist.all_reduce = counting
    try:
        out = vocab_parallel_linear_masked_logprobs(
            h, w, targets, log_rho=-4.0, temperature=0.9, vocab_size=vocab_size, tp_group=dist.group.WORLD,
            sequence_parallel=sequence_parallel, gradient_accumulation_fusion=fusion, backend="triton",
        )  # fmt: skip
        forward = len(calls)
        backward_of(as_dict(out), grads).backward()
    finally:
        dist.all_reduce = real
    w_grad = w.main_grad - 0.5 if fusion else w.grad
    return as_dict(out) | {"h_grad": h.grad, "w_grad": w_grad, "reduces": (forward, len(calls) - forward)}


@pytest.mark.parametrize(
    ("dtype", "sequence_parallel", "fusion"),
    [(torch.float32, False, False), (torch.bfloat16, True, False), (torch.bfloat16, True, True)],
    ids=["tp2", "tp2-sp", "tp2-sp-main_grad"],
)
def test_tp2_with_and_without_sequence_parallelism_equals_the_reference(dtype, sequence_parallel, fusion):
    results = run_distributed(_sharded_rank, 2, dtype, sequence_parallel, fusion)
    s, b, vocab_size, padded = 6, 2, 61, 64
    hidden, weight, targets, grads = problem(s * b, vocab_size, padded, dtype, seed=5)
    ref, h_ref, w_ref = reference(hidden, weight, targets, vocab_size, -4.0, 0.9)
    backward_of(ref, grads).backward()
    tol, scale = TOL[dtype], float(h_ref.grad.abs().max())
    for rank, got in enumerate(results):
        for key in ref:
            torch.testing.assert_close(out_value_flat(got[key]), ref[key], rtol=tol, atol=tol, msg=key)
        h_grad = h_ref.grad.view(s, b, H)
        want_h = h_grad.chunk(2, dim=0)[rank] if sequence_parallel else h_grad
        torch.testing.assert_close(got["h_grad"].double(), want_h, rtol=tol, atol=tol * scale)
        want_w = w_ref.grad[rank * 32 : (rank + 1) * 32]  # the padded rows' gradient: zero in both
        torch.testing.assert_close(got["w_grad"].double(), want_w, rtol=tol, atol=tol * scale)
        # MAX and SUM forward; backward the hidden gradient's all-reduce (SP: a reduce-scatter instead)
        assert got["reduces"] == (2, 0 if sequence_parallel else 1)


def out_value_flat(value):
    return value.reshape(-1) if value.dtype == torch.bool else value.reshape(-1).double()


def test_gradient_accumulation_fusion_adds_into_main_grad():
    vocab_size = 40
    hidden, weight, targets, grads = problem(9, vocab_size, vocab_size, torch.bfloat16)
    h = hidden.clone().requires_grad_()
    w = torch.nn.Parameter(weight.clone())
    w.main_grad = torch.full(w.shape, 0.5, dtype=torch.float32)
    w.grad_added_to_main_grad = False
    w.zero_out_wgrad = True  # a tied weight at PP = 1: the returned gradient is added, so it is zeros
    out = vocab_parallel_linear_masked_logprobs(
        h,
        w,
        targets,
        log_rho=-4.0,
        vocab_size=vocab_size,
        gradient_accumulation_fusion=True,
        backend="triton",
    )
    backward_of(as_dict(out), grads).backward()
    ref, _, w_ref = reference(hidden, weight, targets, vocab_size, -4.0, 1.0)
    backward_of(ref, grads).backward()
    scale = float(w_ref.grad.abs().max())
    torch.testing.assert_close(w.main_grad.double(), 0.5 + w_ref.grad, rtol=3e-2, atol=3e-2 * scale)
    assert w.main_grad.dtype == torch.float32
    assert w.grad_added_to_main_grad and torch.count_nonzero(w.grad) == 0


@pytest.mark.parametrize("entropy", [True, False], ids=["entropy", "no-entropy"])
def test_the_gradient_kernel_writes_the_target_column_as_the_pytorch_backend_does(entropy):
    """Without a support the gradient kernel writes the target's column in its one pass (`write_grad(targets=
    …)`: the op's backward and the fused op's blocks). On the same logits it gives the PyTorch backend's
    gradient (`masked_logprobs_math.chunk_grad`), including a target at −inf (p = 0: its term is 0, not
    0·(−inf) = NaN), a target outside V_S (its own term all the same), one these columns do not hold (the
    dense value), and a row with a NaN (all NaN)."""
    from megatron_tail.ops.backend import load_kernels
    from megatron_tail.ops.masked_logprobs_math import chunk_grad, target_columns

    g = torch.Generator().manual_seed(11)
    n, width, start = 6, 37, 100
    x = torch.randn(n, width, generator=g) * 3
    targets = start + torch.randint(0, width, (n,), generator=g)
    x[0, targets[0] - start] = float("-inf")
    x[1, targets[1] - start] = x[1].max() - 3.5  # just outside V_S (θ = max − 3): a sizeable own term
    targets[2] = start + width + 5  # not in these columns
    x[3, 4] = float("nan")
    max_logit = x.amax(dim=1)
    threshold = max_logit - 3.0
    inv_t = 1 / 0.8
    safe = torch.where(x >= threshold[:, None], (x - max_logit[:, None]) * inv_t, float("-inf"))
    log_norm = torch.logsumexp(safe, dim=1)
    bias, target_add = torch.randn(n, generator=g), torch.randn(n, generator=g)
    scale_h = torch.randn(n, generator=g) * 5 if entropy else None
    per_row = dict(max_logit=max_logit, log_norm=log_norm, inv_temperature=inv_t)
    dense = dict(threshold=threshold, bias=bias, scale_h=scale_h)
    in_kernel = x.clone()
    load_kernels(x.device).write_grad(
        in_kernel, in_kernel, **per_row, **dense, targets=targets, target_start=start, target_add=target_add
    )
    local, owned = target_columns(targets, start, width)
    by_torch = torch.empty_like(x)
    chunk_grad(
        x, by_torch, out_holds_exp=False, **per_row, **dense, local_target=local, owned=owned,
        target_add=target_add,
    )  # fmt: skip
    # the two round log p differently ((x − m)/T − log S against (x − (m + T·log S))/T): a few float32 ulps
    torch.testing.assert_close(in_kernel, by_torch, rtol=1e-5, atol=1e-6, equal_nan=True)
    assert torch.isnan(in_kernel[3]).all() and torch.isfinite(in_kernel[[0, 1, 2, 4, 5]]).all()
    assert in_kernel[0, targets[0] - start] == target_add[0]


@pytest.mark.parametrize("choice", [*fused_impl.BACKWARD_BLOCK_CHOICES, 1], ids=str)
def test_every_backward_block_choice_equals_the_reference(choice):
    """`backward_blocks` (what `bench.op` sweeps): the forward's chunks, or any number of row blocks, give
    the reference's gradients; the block shapes are the choice's."""
    vocab_size, n = 61, 10
    hidden, weight, targets, grads = problem(n, vocab_size, 64, torch.float32, seed=3)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    with fused_impl.backward_blocks(choice):
        blocks = fused_impl._backward_blocks(n, vocab_size, H, h.device, (n, vocab_size), "triton", False)
        out = vocab_parallel_linear_masked_logprobs(
            h, w, targets, log_rho=-3.0, vocab_size=vocab_size, backend="triton"
        )
        backward_of(as_dict(out), grads).backward()
    if choice == fused_impl.FORWARD_CHUNKS:
        want = (n, vocab_size)
    else:
        count, width = choice if isinstance(choice, tuple) else (choice, 1)
        want = (-(-n // count), width * H)
    assert blocks == want
    ref, h_ref, w_ref = reference(hidden, weight, targets, vocab_size, -3.0, 1.0)
    backward_of(ref, grads).backward()
    scale = float(h_ref.grad.abs().max())
    torch.testing.assert_close(
        h.grad.double(), h_ref.grad, rtol=TOL[torch.float32], atol=TOL[torch.float32] * scale
    )
    torch.testing.assert_close(
        w.grad.double(), w_ref.grad, rtol=TOL[torch.float32], atol=TOL[torch.float32] * scale
    )
    for bad in (0, 2.5, True, "chunks", (4, 0), (4,), (4, 2, 1), (True, 2)):
        with pytest.raises(ValueError, match="backward_blocks takes a row-block count"):
            fused_impl.backward_blocks(bad)
