"""The op and the fused op with a sampling support (`sampling_support=[..., K]` ids, −1 padding) against
a float64 reference that builds the support as a `[N, V]` mask, at TP = 1/2/4, gradients included."""

import pytest
import torch
import torch.distributed as dist

from megatron_tail.ops import vocab_parallel_linear_masked_logprobs, vocab_parallel_masked_logprobs
from megatron_tail.ops.reference import reference_masked_logprobs
from megatron_tail.ops.safe_vocab import safe_mask
from tests.harness import run_distributed

OUTPUTS = ("logprobs", "entropy", "in_safe_set", "safe_mass", "logprobs_full", "top_logprob")


def top_k_support(logits: torch.Tensor, k: int) -> torch.Tensor:
    """`[N, k]` ids of the k largest logits, in a shuffled order, −1 padded for a few rows."""
    ids = logits.topk(k, dim=-1).indices
    return ids[:, torch.randperm(k, generator=torch.Generator().manual_seed(1))]


def problem(n=24, vocab_size=37, padded=40, k=6, seed=0):
    """Logits, targets sampled inside the support, a support with the kinds of rows the op must handle."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, padded, generator=gen, dtype=torch.float64) * 4.0
    logits[:, vocab_size:] = 50.0  # megatron's padded columns may hold anything
    support = top_k_support(logits[:, :vocab_size], k)
    pick = torch.randint(0, k, (n,), generator=gen)
    targets = support[torch.arange(n), pick].clone()
    support[0, 2:] = -1  # a short support
    targets[0] = support[0, 0]
    support[1] = -1  # no support: the safe set's normaliser
    targets[2] = logits[2, :vocab_size].argmin()  # a target outside its support: force-kept
    support[3, 0] = targets[3] = int(logits[3, :vocab_size].argmin())  # sampled from deep in the tail
    grads = torch.randn(2, n, generator=gen, dtype=torch.float64)
    return logits, targets, support, grads


def check_against_reference(
    out, logits, targets, support, grads, vocab_size, log_rho, temperature, grad, tol
):
    ref_logits = logits[:, :vocab_size].clone().requires_grad_()
    ref = reference_masked_logprobs(
        ref_logits, targets, log_rho=log_rho, temperature=temperature, sampling_support=support
    )
    ((ref["logprobs"] * grads[0]).sum() + (ref["entropy"] * grads[1]).sum()).backward()
    for name in OUTPUTS:
        expected = ref[name].to(getattr(out, name).dtype)
        if name == "in_safe_set":
            assert torch.equal(
                getattr(out, name), expected if log_rho is not None else torch.ones_like(expected)
            )
        else:
            torch.testing.assert_close(getattr(out, name), expected, rtol=tol, atol=tol, msg=name)
    torch.testing.assert_close(grad[:, :vocab_size], ref_logits.grad.to(grad.dtype), rtol=tol, atol=tol)
    assert torch.all(grad[:, vocab_size:] == 0)


@pytest.mark.parametrize("log_rho", [-13.0, -2.0, None])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("inplace", [False, True])
def test_equals_the_float64_reference(log_rho, temperature, inplace):
    logits, targets, support, grads = problem()
    x = logits.clone().requires_grad_()
    out = vocab_parallel_masked_logprobs(
        x * 1.0 if inplace else x,
        targets,
        log_rho=log_rho,
        temperature=temperature,
        vocab_size=37,
        sampling_support=support,
        inplace_backward=inplace,
    )
    ((out.logprobs * grads[0]).sum() + (out.entropy * grads[1]).sum()).backward()
    check_against_reference(out, logits, targets, support, grads, 37, log_rho, temperature, x.grad, 1e-10)
    assert not out.in_safe_set[3] or log_rho is None, "the tail target is flagged outside the safe set"
    # a deep-tail target inside its support has a finite log-prob under the support, unlike under V_S
    assert torch.isfinite(out.logprobs).all()


@pytest.mark.parametrize("id_dtype", [torch.int64, torch.int32], ids=["int64", "int32"])
@pytest.mark.parametrize("inplace", [False, True])
def test_support_blocks_of_several_dense_chunks(monkeypatch, inplace, id_dtype):
    """Blocks of 4 rows, each two dense chunks of 2 rows: the same outputs and gradient. int32 ids (what the
    trainer densifies) are widened a block at a time, with the same result as int64."""
    import megatron_tail.ops.masked_logprobs as op_module

    monkeypatch.setitem(op_module.CHUNK_ELEMENTS, "cpu", 80)
    monkeypatch.setattr(op_module, "SUPPORT_BLOCK_ROWS", 4)
    logits, targets, support, grads = problem(n=22)
    x = logits.clone().requires_grad_()
    out = vocab_parallel_masked_logprobs(
        x * 1.0 if inplace else x,
        targets,
        log_rho=-2.0,
        vocab_size=37,
        sampling_support=support.to(id_dtype),
        inplace_backward=inplace,
    )
    ((out.logprobs * grads[0]).sum() + (out.entropy * grads[1]).sum()).backward()
    check_against_reference(out, logits, targets, support, grads, 37, -2.0, 1.0, x.grad, 1e-10)


def test_gradcheck():
    logits, targets, support, _ = problem(n=6, vocab_size=11, padded=12, k=3)
    x = logits.clone().requires_grad_()

    def f(t):
        out = vocab_parallel_masked_logprobs(
            t, targets, log_rho=-2.0, vocab_size=11, sampling_support=support
        )
        return out.logprobs, out.entropy

    assert torch.autograd.gradcheck(f, (x,))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_low_precision_logits(dtype):
    logits, targets, support, grads = problem()
    x = logits.to(dtype).requires_grad_()
    out = vocab_parallel_masked_logprobs(x, targets, log_rho=-13.0, vocab_size=37, sampling_support=support)
    ((out.logprobs * grads[0].float()).sum() + (out.entropy * grads[1].float()).sum()).backward()
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    check_against_reference(out, x.detach().double(), targets, support, grads, 37, -13.0, 1.0, x.grad, tol)


def test_full_support_equals_the_op_without_one():
    """top_k = V, top_p = 1: the support is every id (no pruning) or, after DVP's processor, exactly V_S."""
    logits, targets, _, grads = problem()
    v = 37
    x = logits[:, :v].float()
    everything = torch.arange(v).expand(x.shape[0], v)
    safe = safe_mask(x, -4.0, 1.0)
    safe_ids = torch.where(safe, torch.arange(v), torch.full_like(everything, -1))
    targets = torch.where(safe[torch.arange(x.shape[0]), targets], targets, x.argmax(dim=-1))
    for log_rho, support in ((None, everything), (-4.0, safe_ids)):
        results = []
        for s in (None, support):
            xi = x.clone().requires_grad_()
            out = vocab_parallel_masked_logprobs(xi, targets, log_rho=log_rho, sampling_support=s)
            ((out.logprobs * grads[0].float()).sum() + (out.entropy * grads[1].float()).sum()).backward()
            results.append((out, xi.grad))
        (plain, g_plain), (with_support, g_support) = results
        for name in OUTPUTS:
            torch.testing.assert_close(
                getattr(with_support, name), getattr(plain, name), rtol=1e-6, atol=1e-6
            )
        torch.testing.assert_close(g_support, g_plain, rtol=1e-6, atol=1e-6)


def test_fused_op_equals_the_reference(monkeypatch):
    """Small blocks, so the support's ids fall in different column blocks of the fused op."""
    import megatron_tail.ops.linear_masked_logprobs as fused

    monkeypatch.setitem(fused.BLOCK_ELEMENTS, "cpu", 64)
    logits, targets, support, grads = problem()
    gen = torch.Generator().manual_seed(3)
    hidden = torch.randn(24, 8, generator=gen, dtype=torch.float64).requires_grad_()
    weight = torch.randn(40, 8, generator=gen, dtype=torch.float64).requires_grad_()
    out = vocab_parallel_linear_masked_logprobs(
        hidden, weight, targets, log_rho=-3.0, temperature=0.8, vocab_size=37, sampling_support=support
    )
    ((out.logprobs * grads[0]).sum() + (out.entropy * grads[1]).sum()).backward()
    logits = (hidden @ weight.t()).detach().requires_grad_()
    dense = vocab_parallel_masked_logprobs(
        logits, targets, log_rho=-3.0, temperature=0.8, vocab_size=37, sampling_support=support
    )
    ((dense.logprobs * grads[0]).sum() + (dense.entropy * grads[1]).sum()).backward()
    check_against_reference(out, logits.detach(), targets, support, grads, 37, -3.0, 0.8, logits.grad, 1e-10)
    for name in OUTPUTS:
        torch.testing.assert_close(getattr(out, name), getattr(dense, name), rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(hidden.grad, logits.grad @ weight.detach(), rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(weight.grad, logits.grad.t() @ hidden.detach(), rtol=1e-10, atol=1e-10)


def _sharded(rank, world, fused):
    logits, targets, support, grads = problem()
    v_local = 40 // world
    calls = []
    real = dist.all_reduce

    def counting(*args, **kwargs):
        calls.append(kwargs.get("op"))
        return real(*args, **kwargs)

    dist.all_reduce = counting
    try:
        if fused:
            gen = torch.Generator().manual_seed(3)
            hidden = torch.randn(24, 8, generator=gen, dtype=torch.float64)
            weight = torch.randn(40, 8, generator=gen, dtype=torch.float64)
            h = hidden.clone().requires_grad_()
            w = weight[rank * v_local : (rank + 1) * v_local].clone().requires_grad_()
            out = vocab_parallel_linear_masked_logprobs(
                h,
                w,
                targets,
                log_rho=-3.0,
                vocab_size=37,
                tp_group=dist.group.WORLD,
                sampling_support=support,
            )
        else:
            shard = logits[:, rank * v_local : (rank + 1) * v_local].clone().requires_grad_()
            out = vocab_parallel_masked_logprobs(
                shard,
                targets,
                log_rho=-3.0,
                vocab_size=37,
                tp_group=dist.group.WORLD,
                sampling_support=support,
            )
        forward_calls = len(calls)
        ((out.logprobs * grads[0]).sum() + (out.entropy * grads[1]).sum()).backward()
    finally:
        dist.all_reduce = real
    grad = (h.grad, w.grad) if fused else shard.grad
    return {name: getattr(out, name) for name in OUTPUTS} | {"grad": grad, "forward_calls": forward_calls}


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("fused", [False, True])
def test_tensor_parallel_equals_the_reference(world, fused):
    results = run_distributed(_sharded, world, fused)
    logits, targets, support, grads = problem()
    if fused:
        gen = torch.Generator().manual_seed(3)
        hidden = torch.randn(24, 8, generator=gen, dtype=torch.float64)
        weight = torch.randn(40, 8, generator=gen, dtype=torch.float64)
        logits = hidden @ weight.t()
    ref_logits = logits[:, :37].clone().requires_grad_()
    ref = reference_masked_logprobs(ref_logits, targets, log_rho=-3.0, sampling_support=support)
    ((ref["logprobs"] * grads[0]).sum() + (ref["entropy"] * grads[1]).sum()).backward()
    v_local = 40 // world
    full_grad = torch.cat([ref_logits.grad, torch.zeros(24, 3, dtype=torch.float64)], dim=1)
    for rank, res in enumerate(results):
        assert res["forward_calls"] == 2, "a MAX and one SUM: the support adds no collective"
        for name in OUTPUTS:
            if name == "in_safe_set":
                assert torch.equal(res[name], ref[name])
            else:
                torch.testing.assert_close(res[name], ref[name], rtol=1e-10, atol=1e-10, msg=name)
        local = full_grad[:, rank * v_local : (rank + 1) * v_local]
        if fused:
            torch.testing.assert_close(res["grad"][0], full_grad @ weight, rtol=1e-10, atol=1e-10)
            torch.testing.assert_close(res["grad"][1], local.t() @ hidden, rtol=1e-10, atol=1e-10)
        else:
            torch.testing.assert_close(res["grad"], local, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize(
    ("support", "error", "pattern"),
    [
        (torch.zeros(4, 2), TypeError, "integer tensor"),
        (torch.zeros(4, dtype=torch.long), ValueError, r"\[\.\.\., K\]"),
        (torch.full((4, 2), -2), ValueError, "got -2 at index"),
        (torch.full((4, 2), 9), ValueError, "vocab_size=9"),
    ],
)
def test_bad_support_is_one_clear_error(support, error, pattern):
    with pytest.raises(error, match=pattern):
        vocab_parallel_masked_logprobs(
            torch.randn(4, 9), torch.zeros(4, dtype=torch.long), sampling_support=support
        )


@pytest.mark.parametrize("fused", [False, True], ids=["op", "fused-op"])
def test_a_support_without_ids_is_the_safe_set(fused):
    """K = 0 (a micro-batch whose rows carry no support: an empty one, a CP shard without response tokens):
    every row keeps the safe set's normaliser, outputs and gradient as without a support."""
    logits, targets, _, _ = problem()
    empty = torch.zeros((*targets.shape, 0), dtype=torch.int32)
    outs = []
    for support in (None, empty):
        if fused:
            g = torch.Generator().manual_seed(3)
            h = torch.randn(targets.shape[0], 8, generator=g, dtype=torch.float64).requires_grad_()
            w = torch.randn(37, 8, generator=g, dtype=torch.float64)
            out = vocab_parallel_linear_masked_logprobs(h, w, targets, log_rho=-2.0, sampling_support=support)
            leaf = h
        else:
            leaf = logits[:, :37].clone().requires_grad_()
            out = vocab_parallel_masked_logprobs(leaf, targets, log_rho=-2.0, sampling_support=support)
        (out.logprobs.sum() + out.entropy.sum()).backward()
        outs.append((out, leaf.grad))
    (plain, g_plain), (zero, g_zero) = outs
    for name in ("logprobs", "entropy", "safe_mass"):
        torch.testing.assert_close(getattr(zero, name), getattr(plain, name), rtol=0, atol=0)
    torch.testing.assert_close(g_zero, g_plain, rtol=0, atol=0)
