"""The op against the float64 reference written from the paper's definition (single rank)."""

import math

import pytest
import torch

from megatron_tail.ops import vocab_parallel_masked_logprobs
from megatron_tail.ops.reference import reference_masked_logprobs

OUTPUTS = ("logprobs", "entropy", "safe_mass", "logprobs_full", "top_logprob")


def make_logits(n=24, v=97, scale=6.0, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, v, generator=gen, dtype=torch.float64) * scale
    logits[: n // 3] *= 3.0  # peaked rows: large parts of the vocab fall outside V_S
    targets = torch.randint(0, v, (n,), generator=gen)
    targets[0] = logits[0].argmin()  # surely outside V_S
    return logits.to(dtype), targets


def ours_and_grads(logits, targets, g_l, g_h, **kw):
    x = logits.detach().clone().requires_grad_()
    out = vocab_parallel_masked_logprobs(x, targets, **kw)
    loss = 0.0
    if g_l is not None:
        loss = loss + (out.logprobs * g_l).sum()
    if g_h is not None:
        loss = loss + (out.entropy * g_h).sum()
    loss.backward()
    return out, x.grad


def reference_and_grads(logits, targets, g_l, g_h, **kw):
    x = logits.detach().to(torch.float64).requires_grad_()
    ref = reference_masked_logprobs(x, targets, **kw)
    loss = 0.0
    if g_l is not None:
        loss = loss + (ref["logprobs"] * g_l.double()).sum()
    if g_h is not None:
        loss = loss + (ref["entropy"] * g_h.double()).sum()
    loss.backward()
    return ref, x.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("log_rho", [-13.0, -2.0, None])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
@pytest.mark.parametrize("grads", ["both", "logprobs", "entropy"])
def test_outputs_and_gradients_match_float64_reference(dtype, log_rho, temperature, grads):
    logits, targets = make_logits(dtype=dtype)
    gen = torch.Generator().manual_seed(1)
    g_l = torch.randn(len(targets), generator=gen) if grads in ("both", "logprobs") else None
    g_h = torch.randn(len(targets), generator=gen) if grads in ("both", "entropy") else None
    kw = dict(log_rho=log_rho, temperature=temperature)
    out, grad = ours_and_grads(logits, targets, g_l, g_h, **kw)
    ref, ref_grad = reference_and_grads(logits, targets, g_l, g_h, **kw)

    tol = 1e-12 if dtype == torch.float64 else 2e-5
    expected_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    for name in OUTPUTS:
        got = getattr(out, name)
        assert got.dtype == expected_dtype, name
        torch.testing.assert_close(got.double(), ref[name], rtol=tol, atol=tol, msg=name)
    assert torch.equal(out.in_safe_set, ref["in_safe_set"])
    if log_rho is not None:
        assert not out.in_safe_set[0], "the argmin target must fall outside V_S"
    assert grad.dtype == dtype
    grad_tol = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 1e-2}[dtype]
    torch.testing.assert_close(grad.double(), ref_grad, rtol=grad_tol, atol=grad_tol)


@pytest.mark.parametrize("log_rho", [-1.5, None])
def test_gradcheck_float64(log_rho):
    logits, targets = make_logits(n=4, v=9, scale=2.0, dtype=torch.float64)
    x = logits.clone().requires_grad_()

    def f(inp):
        out = vocab_parallel_masked_logprobs(inp, targets, log_rho=log_rho, temperature=0.8)
        return out.logprobs, out.entropy

    # nondet_tol: the first backward uses the exponentials kept by the forward, later ones (gradcheck
    # reruns backward on the same graph) recompute them; the two agree to float64 rounding.
    assert torch.autograd.gradcheck(f, (x,), eps=1e-6, atol=1e-8, nondet_tol=1e-12, check_batched_grad=False)


def test_padded_columns_are_excluded_and_get_zero_gradient():
    logits, targets = make_logits(n=10, v=50)
    padded = torch.cat([logits, torch.full((10, 14), 100.0)], dim=1)  # garbage in megatron's padding
    gen = torch.Generator().manual_seed(1)  # not the global RNG: its state is whatever ran before here
    g_l, g_h = torch.randn(10, generator=gen), torch.randn(10, generator=gen)
    out, grad = ours_and_grads(padded, targets, g_l, g_h, vocab_size=50)
    ref, ref_grad = reference_and_grads(logits, targets, g_l, g_h, log_rho=-13.0)
    for name in OUTPUTS:
        torch.testing.assert_close(getattr(out, name).double(), ref[name], rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(grad[:, :50].double(), ref_grad, rtol=2e-6, atol=2e-6)
    assert torch.count_nonzero(grad[:, 50:]) == 0


def test_target_exactly_at_the_threshold_is_safe_and_just_below_is_not():
    log_rho = -13.0
    logits = torch.zeros(2, 6)
    logits[:, 0] = 0.0  # the max
    logits[:, 1] = -30.0
    logits[0, 2] = log_rho  # exactly max + T·log ρ: kept (≥)
    logits[1, 2] = torch.nextafter(torch.tensor(log_rho), torch.tensor(-math.inf))  # one float32 below
    logits[:, 3:] = -1.0
    targets = torch.tensor([2, 2])
    out = vocab_parallel_masked_logprobs(logits, targets, log_rho=log_rho)
    assert out.in_safe_set.tolist() == [True, False]
    ref = reference_masked_logprobs(logits, targets, log_rho=log_rho)
    assert ref["in_safe_set"].tolist() == [True, False]
    torch.testing.assert_close(out.logprobs.double(), ref["logprobs"], rtol=1e-6, atol=1e-6)
    # the boundary token is in V_S for row 0 (Z counts it) and not for row 1
    assert out.safe_mass[0] > out.safe_mass[1]


def test_unsafe_target_is_force_kept_finite_and_flagged():
    logits = torch.tensor([[10.0, 9.0, -20.0, 0.0]])
    targets = torch.tensor([2])
    x = logits.clone().requires_grad_()
    out = vocab_parallel_masked_logprobs(x, targets, log_rho=-13.0)
    assert not out.in_safe_set.item()
    assert torch.isfinite(out.logprobs).all() and torch.isfinite(out.entropy).all()
    # π^mp over {0, 1, 2}: token 3 (logit 0 ≥ 10 − 13) is in V_S too, so the support is everything.
    support = logits[0, [0, 1, 2, 3]].double()
    expected = support[2] - torch.logsumexp(support, 0)
    torch.testing.assert_close(out.logprobs.double()[0], expected, rtol=1e-6, atol=1e-6)
    # Z excludes the unsafe target; logprobs_full is the plain log-softmax.
    full = torch.log_softmax(logits.double(), -1)[0]
    torch.testing.assert_close(out.safe_mass.double()[0], full[[0, 1, 3]].exp().sum(), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(out.logprobs_full.double()[0], full[2], rtol=1e-6, atol=1e-6)
    out.logprobs.sum().backward()
    assert torch.isfinite(x.grad).all()
    assert x.grad[0, 2] > 0


def test_logprobs_full_is_logprobs_plus_log_safe_mass_inside_the_safe_set():
    logits, targets = make_logits()
    targets[1::2] = logits[1::2].argmax(dim=-1)
    out = vocab_parallel_masked_logprobs(logits, targets, log_rho=-3.0)
    safe = out.in_safe_set
    assert safe.any() and (~safe).any()
    torch.testing.assert_close(
        out.logprobs_full[safe], (out.logprobs + out.safe_mass.log())[safe], rtol=1e-5, atol=1e-5
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("log_rho", [-13.0, None])
def test_logits_are_bitwise_unchanged_after_forward_and_backward(dtype, log_rho):
    logits, targets = make_logits(dtype=dtype)
    x = logits.clone().requires_grad_()
    out = vocab_parallel_masked_logprobs(x, targets, log_rho=log_rho, temperature=0.7)
    (out.logprobs.sum() + out.entropy.sum()).backward()
    as_bits = torch.int32 if dtype == torch.float32 else torch.int16
    assert torch.equal(x.detach().view(as_bits), logits.view(as_bits))


def test_nan_and_inf_propagate_and_never_become_finite_garbage():
    logits, targets = make_logits(n=6, v=20)
    logits[1, 5] = float("nan")
    logits[2, 7] = float("inf")
    logits[3, 4] = float("-inf")  # an ordinary probability-zero token
    targets[3] = 9 if targets[3] == 4 else targets[3]
    logits[4, targets[4]] = float("-inf")  # a target with probability zero
    x = logits.clone().requires_grad_()
    out = vocab_parallel_masked_logprobs(x, targets, log_rho=-13.0)
    (out.logprobs[[0, 1, 2, 3, 5]].sum() + out.entropy.sum()).backward()
    for row in (1, 2):
        for name in OUTPUTS:
            assert torch.isnan(getattr(out, name)[row]), (row, name)
        assert torch.isnan(x.grad[row]).all()
    ref = reference_masked_logprobs(logits[[0, 3, 5]], targets[[0, 3, 5]], log_rho=-13.0)
    for name in OUTPUTS:
        torch.testing.assert_close(getattr(out, name)[[0, 3, 5]].double(), ref[name], rtol=2e-5, atol=2e-5)
    assert torch.isfinite(x.grad[[0, 3, 5]]).all()
    assert x.grad[3, 4] == 0
    assert out.logprobs[4] == -math.inf and out.logprobs_full[4] == -math.inf
    assert torch.isfinite(out.entropy[4]) and not out.in_safe_set[4]


def test_without_entropy_and_under_no_grad():
    logits, targets = make_logits(dtype=torch.bfloat16)
    with_grad = vocab_parallel_masked_logprobs(logits.clone().requires_grad_(), targets)
    with torch.no_grad():
        plain = vocab_parallel_masked_logprobs(logits, targets, compute_entropy=False)
    assert plain.entropy is None
    assert torch.equal(plain.logprobs, with_grad.logprobs.detach())
    assert not plain.logprobs.requires_grad


def test_leading_dims_are_kept():
    logits, targets = make_logits(n=12)
    out = vocab_parallel_masked_logprobs(logits.view(3, 4, -1), targets.view(3, 4))
    flat = vocab_parallel_masked_logprobs(logits, targets)
    assert out.logprobs.shape == (3, 4) and out.in_safe_set.shape == (3, 4)
    assert torch.equal(out.logprobs.flatten(), flat.logprobs)


def test_second_backward_through_the_same_graph_recomputes():
    logits, targets = make_logits()
    x = logits.clone().requires_grad_()
    out = vocab_parallel_masked_logprobs(x, targets)
    (first,) = torch.autograd.grad(out.logprobs.sum() + out.entropy.sum(), x, retain_graph=True)
    first = first.clone()
    (second,) = torch.autograd.grad(out.logprobs.sum() + out.entropy.sum(), x)
    torch.testing.assert_close(second, first, rtol=1e-5, atol=1e-6)


def test_chunking_does_not_change_results(monkeypatch):
    import megatron_tail.ops.masked_logprobs as impl

    logits, targets = make_logits(n=37, v=64)
    g = torch.randn(37, generator=torch.Generator().manual_seed(1))
    base, base_grad = ours_and_grads(logits, targets, g, g)
    monkeypatch.setitem(impl.CHUNK_ELEMENTS, "cpu", 64 * 5)  # 5 rows per chunk, a ragged last chunk
    small, small_grad = ours_and_grads(logits, targets, g, g)
    for name in OUTPUTS:
        torch.testing.assert_close(getattr(small, name), getattr(base, name), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(small_grad, base_grad, rtol=1e-6, atol=1e-8)
