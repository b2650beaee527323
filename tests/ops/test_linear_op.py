"""The fused output layer + DVP op against a float64 reference (forward and both gradients), against the
materialized op, sharded over TP = 2 / 4 (and with sequence parallelism), with megatron's
gradient-accumulation fusion, and with the materialized op's validation errors. Also |V_S| from both ops
and the materialized op's in-place mode."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import megatron_tail.ops.linear_masked_logprobs as fused_impl
from megatron_tail.ops import (
    safe_mask,
    vocab_parallel_linear_masked_logprobs,
    vocab_parallel_masked_logprobs,
)
from megatron_tail.ops.reference import reference_masked_logprobs
from tests.harness import run_distributed

H = 16
TOL = {torch.float64: 1e-10, torch.float32: 2e-5, torch.bfloat16: 3e-2}


def problem(n, vocab_size, padded, dtype, seed=0):
    """hidden [n, H], weight [padded, H] (padding rows hold garbage), targets with one out-of-set target."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, H, generator=g, dtype=torch.float64)
    weight = torch.randn(padded, H, generator=g, dtype=torch.float64) * 1.5
    weight[vocab_size:] = 7.0
    targets = torch.randint(0, vocab_size, (n,), generator=g)
    targets[1] = (hidden[1] @ weight[:vocab_size].T).argmin()  # far outside the safe set
    grads = torch.randn(2, n, generator=g, dtype=torch.float64)
    return hidden.to(dtype), weight.to(dtype), targets, grads


def reference(hidden, weight, targets, vocab_size, log_rho, temperature):
    """float64 outputs and gradients through the plain definition on the materialized logits."""
    h = hidden.detach().double().requires_grad_()
    w = weight.detach().double().requires_grad_()
    ref = reference_masked_logprobs((h @ w[:vocab_size].T), targets, log_rho=log_rho, temperature=temperature)
    return ref, h, w


def backward_of(out, grads):
    g_l, g_h = grads
    return (out["logprobs"] * g_l.to(out["logprobs"].dtype)).sum() + (
        out["entropy"] * g_h.to(out["entropy"].dtype)
    ).sum()


def as_dict(out):
    return {
        k: getattr(out, k)
        for k in ("logprobs", "entropy", "in_safe_set", "safe_mass", "logprobs_full", "top_logprob")
    }


# one block; one pass over several row blocks; two passes over square blocks; tiny blocks
@pytest.mark.parametrize("block", [None, 300, 40, 7])
@pytest.mark.parametrize(("log_rho", "temperature"), [(-4.0, 1.0), (-3.0, 0.6), (None, 1.3)])
def test_equals_the_float64_reference(monkeypatch, block, log_rho, temperature):
    if block is not None:
        monkeypatch.setitem(fused_impl.BLOCK_ELEMENTS, "cpu", block)
        monkeypatch.setattr(fused_impl, "ONE_PASS_MIN_ROWS", 3)
    n, vocab_size, padded = 11, 61, 64
    hidden, weight, targets, grads = problem(n, vocab_size, padded, torch.float64)
    ref, h_ref, w_ref = reference(hidden, weight, targets, vocab_size, log_rho, temperature)
    backward_of(ref, grads).backward()
    h = hidden.clone().requires_grad_()
    w = weight.clone().requires_grad_()
    out = vocab_parallel_linear_masked_logprobs(
        h,
        w,
        targets,
        log_rho=log_rho,
        temperature=temperature,
        vocab_size=vocab_size,
        compute_safe_set_size=True,
    )
    assert log_rho is None or not bool(out.in_safe_set[1])  # the force-kept target
    for key, value in as_dict(out).items():
        torch.testing.assert_close(value, ref[key], rtol=1e-10, atol=1e-10, msg=key)
    expected_size = (
        safe_mask(h_ref.detach() @ w_ref.detach()[:vocab_size].T, log_rho, temperature).sum(-1)
        if log_rho is not None
        else torch.full((n,), vocab_size)
    )
    assert torch.equal(out.safe_set_size, expected_size)
    backward_of(as_dict(out), grads).backward()
    torch.testing.assert_close(h.grad, h_ref.grad, rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(w.grad, w_ref.grad, rtol=1e-9, atol=1e-10)
    assert torch.count_nonzero(w.grad[vocab_size:]) == 0  # padding rows get no gradient


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_equals_the_materialized_op(monkeypatch, dtype):
    monkeypatch.setitem(fused_impl.BLOCK_ELEMENTS, "cpu", 64)
    n, vocab_size, padded = 13, 120, 128
    hidden, weight, targets, grads = problem(n, vocab_size, padded, dtype, seed=3)
    results = []
    for fused in (True, False):
        h = hidden.clone().requires_grad_()
        w = weight.clone().requires_grad_()
        kwargs = dict(log_rho=-5.0, temperature=0.8, vocab_size=vocab_size)
        if fused:
            out = vocab_parallel_linear_masked_logprobs(h, w, targets, **kwargs)
        else:
            out = vocab_parallel_masked_logprobs(h @ w.T, targets, **kwargs)
        backward_of(as_dict(out), grads).backward()
        results.append((as_dict(out), h.grad, w.grad))
    (fo, fh, fw), (mo, mh, mw) = results
    tol = TOL[dtype]
    for key in fo:
        torch.testing.assert_close(fo[key], mo[key], rtol=tol, atol=tol, msg=key)
    scale = max(float(mh.abs().max()), float(mw.abs().max()))
    torch.testing.assert_close(fh.float(), mh.float(), rtol=tol, atol=tol * scale)
    torch.testing.assert_close(fw.float(), mw.float(), rtol=tol, atol=tol * scale)


def _sharded_rank(rank, world, dtype, sequence_parallel, log_rho):
    torch.manual_seed(0)
    s, b, vocab_size, padded = 6, 2, 61, 64
    hidden, weight, targets, grads = problem(s * b, vocab_size, padded, dtype, seed=5)
    hidden, targets, grads = hidden.view(s, b, H), targets.view(s, b), grads.view(2, s, b)
    v_local = padded // world
    w = weight[rank * v_local : (rank + 1) * v_local].clone().requires_grad_()
    h_full = hidden.clone()
    h = (h_full.chunk(world, dim=0)[rank] if sequence_parallel else h_full).clone().requires_grad_()
    calls = []
    originals = {
        name: getattr(dist, name)
        for name in ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor")
    }

    def counting(name):
        def wrapper(*args, **kwargs):
            calls.append(name)
            return originals[name](*args, **kwargs)

        return wrapper

    for name in originals:
        setattr(dist, name, counting(name))
    try:
        out = vocab_parallel_linear_masked_logprobs(
            h,
            w,
            targets,
            log_rho=log_rho,
            temperature=0.9,
            vocab_size=vocab_size,
            tp_group=dist.group.WORLD,
            sequence_parallel=sequence_parallel,
            compute_safe_set_size=True,
        )
        forward_calls = list(calls)
        backward_of(as_dict(out), grads).backward()
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
    return as_dict(out) | {
        "safe_set_size": out.safe_set_size,
        "h_grad": h.grad,
        "w_grad": w.grad,
        "forward": forward_calls,
        "backward": calls[len(forward_calls) :],
    }


@pytest.mark.parametrize(
    ("world", "dtype", "sequence_parallel", "log_rho"),
    [
        (2, torch.float64, False, -4.0),
        (4, torch.float64, False, None),
        (2, torch.float64, True, -4.0),
        (2, torch.float32, False, -13.0),
        (2, torch.bfloat16, False, -4.0),
    ],
)
def test_tensor_parallel_equals_the_reference(world, dtype, sequence_parallel, log_rho):
    results = run_distributed(_sharded_rank, world, dtype, sequence_parallel, log_rho)
    s, b, vocab_size, padded = 6, 2, 61, 64
    hidden, weight, targets, grads = problem(s * b, vocab_size, padded, dtype, seed=5)
    ref, h_ref, w_ref = reference(hidden, weight, targets, vocab_size, log_rho, 0.9)
    backward_of(ref, grads).backward()
    tol = max(TOL[dtype], 1e-9)
    v_local = padded // world
    for rank, got in enumerate(results):
        for key in ref:
            torch.testing.assert_close(
                got[key].reshape(-1).to(ref[key].dtype), ref[key], rtol=tol, atol=tol, msg=key
            )
        h_grad = h_ref.grad.view(s, b, H)
        want_h = h_grad.chunk(world, dim=0)[rank] if sequence_parallel else h_grad
        scale = float(h_ref.grad.abs().max())
        torch.testing.assert_close(got["h_grad"].double(), want_h, rtol=tol, atol=tol * scale)
        want_w = w_ref.grad[rank * v_local : (rank + 1) * v_local] if rank * v_local < vocab_size else None
        want_w = torch.zeros(v_local, H, dtype=torch.float64) if want_w is None else want_w
        pad = torch.zeros(max(0, v_local - want_w.shape[0]), H, dtype=torch.float64)
        torch.testing.assert_close(
            got["w_grad"].double(), torch.cat([want_w, pad]), rtol=tol, atol=tol * scale
        )
        # the materialized op's two forward collectives (+ the SP gather), one gradient collective back
        gather = ["all_gather_into_tensor"] if sequence_parallel else []
        assert got["forward"] == [*gather, "all_reduce", "all_reduce"]
        assert got["backward"] == (["reduce_scatter_tensor"] if sequence_parallel else ["all_reduce"])
    assert all(torch.equal(r["safe_set_size"], results[0]["safe_set_size"]) for r in results)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied-zero-out-wgrad"])
def test_gradient_accumulation_fusion_adds_into_main_grad(tied):
    vocab_size = 40
    hidden, weight, targets, grads = problem(9, vocab_size, vocab_size, torch.float32)
    h = hidden.clone().requires_grad_()
    w = torch.nn.Parameter(weight.clone())
    w.main_grad = torch.full(w.shape, 0.5, dtype=torch.float32)
    w.grad_added_to_main_grad = False
    if tied:  # megatron's LanguageModule on a tied weight at PP = 1: DDP's hook adds the returned gradient
        w.zero_out_wgrad = True
    out = vocab_parallel_linear_masked_logprobs(
        h, w, targets, log_rho=-4.0, vocab_size=vocab_size, gradient_accumulation_fusion=True
    )
    backward_of(as_dict(out), grads).backward()
    ref, _, w_ref = reference(hidden, weight, targets, vocab_size, -4.0, 1.0)
    backward_of(ref, grads).backward()
    torch.testing.assert_close(w.main_grad.double(), 0.5 + w_ref.grad, rtol=1e-5, atol=1e-5)
    # a placeholder the hook skips (its values unset, as megatron's), zeros where the hook adds it
    assert w.grad_added_to_main_grad and w.grad.shape == w.shape
    assert torch.count_nonzero(w.grad) == 0 or not tied
    with pytest.raises(ValueError, match=r"needs weight_shard\.main_grad"):
        vocab_parallel_linear_masked_logprobs(hidden, weight, targets, gradient_accumulation_fusion=True)


@pytest.mark.parametrize(
    ("change", "error", "pattern"),
    [
        (lambda h, w, t: (h, w, t + 100), ValueError, r"\[0, vocab_size=40\); got 1\d\d at index \(0,\)"),
        (lambda h, w, t: (h, w, t[:-1]), ValueError, r"hidden.shape\[:-1\] must equal targets.shape"),
        (lambda h, w, t: (h, w, t.float()), TypeError, r"targets must be an integer tensor.*torch.float32"),
        (lambda h, w, t: (h.long(), w, t), TypeError, r"hidden must be a floating-point tensor"),
        (
            lambda h, w, t: (h, w[:, :-1], t),
            ValueError,
            r"weight_shard must be \[V_local, H\] with H = hidden.shape\[-1\] = 16; got \(40, 15\)",
        ),
        (lambda h, w, t: (h, w.double(), t), ValueError, r"must share dtype and device"),
    ],
)
def test_validation_errors_match_the_materialized_op(change, error, pattern):
    hidden, weight, targets, _ = problem(5, 40, 40, torch.float32)
    h, w, t = change(hidden, weight, targets)
    with pytest.raises(error, match=pattern):
        vocab_parallel_linear_masked_logprobs(h, w, t, vocab_size=40)
    with pytest.raises(
        ValueError, match=r"vocab_size must be an int in \[1, V_local·tp = 40·1 = 40\]; got 41"
    ):
        vocab_parallel_linear_masked_logprobs(hidden, weight, targets, vocab_size=41)
    with pytest.raises(
        ValueError, match=r"vocab_size must be an int in \[1, V_local·tp = 40·1 = 40\]; got 41"
    ):
        vocab_parallel_masked_logprobs(hidden @ weight.T, targets, vocab_size=41)


# --- the materialized op's in-place mode -------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_inplace_backward_gives_the_same_gradient_in_the_logits_storage(dtype):
    hidden, weight, targets, grads = problem(10, 50, 64, dtype, seed=7)
    results = []
    for inplace in (False, True):
        w = weight.clone().requires_grad_()
        logits = hidden @ w.T  # a fresh, non-leaf tensor, as the model's output is
        seen = {}
        logits.register_hook(lambda g, seen=seen: seen.setdefault("grad", g))
        out = vocab_parallel_masked_logprobs(
            logits, targets, log_rho=-4.0, vocab_size=50, inplace_backward=inplace, compute_safe_set_size=True
        )
        backward_of(as_dict(out), grads).backward()
        results.append((as_dict(out), w.grad, seen["grad"], logits))
    (ro, rw, _, _), (io, iw, igrad, ilogits) = results
    for key in ro:
        torch.testing.assert_close(io[key], ro[key], rtol=0, atol=0, msg=key)
    torch.testing.assert_close(iw, rw, rtol=TOL[dtype], atol=TOL[dtype])
    assert igrad.data_ptr() == ilogits.data_ptr()  # no gradient buffer: the logits' own storage


def test_inplace_backward_refuses_a_later_modification_and_an_earlier_saved_read():
    hidden, weight, targets, grads = problem(6, 30, 32, torch.float32)
    w = weight.clone().requires_grad_()
    logits = hidden @ w.T
    out = vocab_parallel_masked_logprobs(logits, targets, vocab_size=30, inplace_backward=True)
    logits.mul_(2.0)  # the caller touched what it handed over
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        backward_of(as_dict(out), grads).backward()

    logits = hidden @ w.T
    squares = (logits**2).sum()  # saves the logits for its backward, which runs after the op's
    out = vocab_parallel_masked_logprobs(logits, targets, vocab_size=30, inplace_backward=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        (squares + backward_of(as_dict(out), grads)).backward()


def test_inplace_backward_leaves_the_logits_readable_until_backward():
    hidden, weight, targets, grads = problem(6, 30, 32, torch.float32)
    w = weight.clone().requires_grad_()
    logits = hidden @ w.T
    before = logits.detach().clone()
    out = vocab_parallel_masked_logprobs(logits, targets, vocab_size=30, inplace_backward=True)
    assert torch.equal(logits.detach(), before)
    later = logits.logsumexp(-1).sum()  # a read after the call sees the logits, and its backward is first
    (later + backward_of(as_dict(out), grads)).backward()
    w_ref = weight.clone().requires_grad_()
    ref_logits = hidden @ w_ref.T
    ref = vocab_parallel_masked_logprobs(ref_logits, targets, vocab_size=30)
    (ref_logits.logsumexp(-1).sum() + backward_of(as_dict(ref), grads)).backward()
    torch.testing.assert_close(w.grad, w_ref.grad, rtol=1e-6, atol=1e-6)
