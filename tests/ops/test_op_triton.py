"""The op's Triton kernels (`ops.triton_kernels`, `backend="triton"`) on CPU under Triton's interpreter: the
same kernels the GPU runs, against the float64 reference and against the PyTorch backend, forward and
gradient, read-only and in place, with temperature, padded vocab, NaN rows, −inf logits, sampling supports
(−1 padding, a forced target) and TP = 2 over gloo with uneven valid columns. Small shapes: the interpreter
is slow.

Tolerances: the interpreter truncates float32 → bf16 stores (the GPU rounds), so bf16 gradients are compared
within one bf16 ulp relative (2^-7 < 1e-2), as the PyTorch backend's are."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from megatron_tail.ops import masked_logprobs, vocab_parallel_masked_logprobs
from megatron_tail.ops.reference import reference_masked_logprobs
from tests.harness import run_distributed
from tests.triton_interpreter import UNDER_INTERPRETER

pytestmark = UNDER_INTERPRETER
OUTPUTS = ("logprobs", "entropy", "safe_mass", "logprobs_full", "top_logprob")
GRAD_TOL = {torch.float64: 1e-12, torch.float32: 2e-5, torch.bfloat16: 1e-2}
OUT_TOL = {torch.float64: 1e-12, torch.float32: 2e-5, torch.bfloat16: 2e-5}


def make_problem(n=12, v=300, vocab_size=290, scale=4.0, seed=0, dtype=torch.float32):
    """Logits `[n, v]` whose last `v − vocab_size` columns are padding holding large values (megatron's padded
    columns may hold anything), peaked rows, an argmin target (outside V_S), upstream gradients."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, v, generator=gen, dtype=torch.float64) * scale
    logits[: n // 3] *= 3.0
    logits[:, vocab_size:] = 60.0
    targets = torch.randint(0, vocab_size, (n,), generator=gen)
    targets[0] = logits[0, :vocab_size].argmin()
    g_l, g_h = torch.randn(2, n, generator=gen)
    return logits.to(dtype), targets, g_l, g_h


def run_op(logits, targets, g_l, g_h, *, inplace=False, **kw):
    x = logits.detach().clone().requires_grad_()
    source = x * 1 if inplace else x  # in place needs a non-leaf: the gradient is written over it
    out = vocab_parallel_masked_logprobs(
        source, targets, inplace_backward=inplace, compute_safe_set_size=True, **kw
    )
    ((out.logprobs * g_l).sum() + (out.entropy * g_h).sum()).backward()
    return out, x.grad


def reference(logits, targets, g_l, g_h, vocab_size, **kw):
    x = logits[:, :vocab_size].detach().double().requires_grad_()
    ref = reference_masked_logprobs(x, targets, **kw)
    ((ref["logprobs"] * g_l.double()).sum() + (ref["entropy"] * g_h.double()).sum()).backward()
    return ref, x.grad


@pytest.mark.usefixtures("forward")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize(("log_rho", "temperature"), [(-13.0, 1.0), (-2.0, 0.6), (None, 0.8)])
@pytest.mark.parametrize("inplace", [False, True], ids=["read-only", "in-place"])
def test_kernels_match_the_float64_reference(dtype, log_rho, temperature, inplace):
    logits, targets, g_l, g_h = make_problem(dtype=dtype)
    kw = dict(log_rho=log_rho, temperature=temperature)
    out, grad = run_op(logits, targets, g_l, g_h, inplace=inplace, vocab_size=290, backend="triton", **kw)
    ref, ref_grad = reference(logits, targets, g_l, g_h, 290, **kw)
    for name in OUTPUTS:
        tol = OUT_TOL[dtype]
        torch.testing.assert_close(getattr(out, name).double(), ref[name], rtol=tol, atol=tol, msg=name)
    assert torch.equal(out.in_safe_set, ref["in_safe_set"])
    if log_rho is not None:
        assert not out.in_safe_set[0]  # the argmin target was force-kept
    assert grad.dtype == dtype
    tol = GRAD_TOL[dtype]
    torch.testing.assert_close(grad[:, :290].double(), ref_grad, rtol=tol, atol=tol)
    assert torch.count_nonzero(grad[:, 290:]) == 0  # padded columns: no gradient


@pytest.mark.usefixtures("forward")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernels_equal_the_torch_backend(dtype):
    """Same sets, counts and flags exactly; floats to float32 rounding; the gradient of the PyTorch backend
    within a bf16 ulp (it adds g_L/T to the target's bf16 value, the kernels write it once in float32)."""
    logits, targets, g_l, g_h = make_problem(n=9, dtype=dtype, seed=3)
    kw = dict(log_rho=-3.0, temperature=0.7, vocab_size=290)
    a, grad_a = run_op(logits, targets, g_l, g_h, backend="torch", **kw)
    b, grad_b = run_op(logits, targets, g_l, g_h, backend="triton", **kw)
    assert torch.equal(a.in_safe_set, b.in_safe_set) and torch.equal(a.safe_set_size, b.safe_set_size)
    for name in OUTPUTS:
        torch.testing.assert_close(getattr(a, name), getattr(b, name), rtol=2e-6, atol=2e-6, msg=name)
    torch.testing.assert_close(grad_a.float(), grad_b.float(), rtol=GRAD_TOL[dtype], atol=GRAD_TOL[dtype])


@pytest.mark.usefixtures("forward")
def test_nan_poisons_its_row_and_minus_inf_is_probability_zero():
    logits, targets, g_l, g_h = make_problem(n=6)
    logits[2, 17] = float("nan")
    logits[4, :100] = float("-inf")  # probability-zero tokens
    targets[4] = 150
    out, grad = run_op(logits, targets, g_l, g_h, log_rho=-4.0, vocab_size=290, backend="triton")
    torch_out, torch_grad = run_op(logits, targets, g_l, g_h, log_rho=-4.0, vocab_size=290, backend="torch")
    for name in OUTPUTS:
        value = getattr(out, name)
        assert torch.isnan(value[2]), name
        assert torch.isfinite(value[[0, 1, 3, 4, 5]]).all(), name
        torch.testing.assert_close(value, getattr(torch_out, name), equal_nan=True, rtol=2e-6, atol=2e-6)
    assert torch.isnan(grad[2, :290]).all()
    assert torch.isfinite(grad[[0, 1, 3, 4, 5]]).all()
    assert torch.count_nonzero(grad[4, :100]) == 0
    torch.testing.assert_close(grad, torch_grad, equal_nan=True, rtol=2e-5, atol=2e-5)


@pytest.mark.usefixtures("forward")
@pytest.mark.parametrize("inplace", [False, True], ids=["read-only", "in-place"])
def test_a_nan_upstream_gradient_poisons_its_row_even_where_the_target_has_probability_zero(inplace):
    # Without a support the gradient kernel writes the target's column itself (`triton_backward`): one
    # launch, where the columns written after the dense pass took about 20 small torch ops. A NaN upstream
    # gradient makes the whole row NaN, the target's column too when its p is 0, as the PyTorch backend has it
    # (the column pass wrote the target's log-prob term alone there, finite).
    logits, targets, g_l, g_h = make_problem(n=6)
    logits[1, 40] = float("-inf")
    targets[1] = 40  # p = 0
    g_h[1] = float("nan")
    out, grad = run_op(
        logits, targets, g_l, g_h, log_rho=-4.0, vocab_size=290, backend="triton", inplace=inplace
    )
    _, torch_grad = run_op(logits, targets, g_l, g_h, log_rho=-4.0, vocab_size=290, backend="torch")
    assert torch.isnan(grad[1, :290]).all()
    assert torch.isfinite(grad[[0, 2, 3, 4, 5]]).all()
    torch.testing.assert_close(grad, torch_grad, equal_nan=True, rtol=2e-5, atol=2e-5)
    assert torch.isfinite(out.logprobs[[0, 2, 3, 4, 5]]).all()


@pytest.mark.usefixtures("forward")
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_a_target_at_minus_inf_gets_only_its_log_prob_term(backend):
    # A force-kept target of probability 0 adds no p·(bias + scale_h·log p) term (p log p → 0), not
    # 0·(−inf) = NaN: its column's gradient is g_L/T alone. (Autograd through the float64 reference gives
    # NaN on that row, so the other rows are checked against it and this one against the limit.)
    logits, targets, g_l, g_h = make_problem(n=6)
    logits[1, 40] = float("-inf")
    targets[1] = 40
    kw = dict(log_rho=-4.0, vocab_size=290, temperature=0.7)
    out, grad = run_op(logits, targets, g_l, g_h, backend=backend, **kw)
    assert out.logprobs[1] == float("-inf")
    assert torch.isfinite(grad).all()
    torch.testing.assert_close(grad[1, 40], g_l[1] / 0.7, rtol=1e-6, atol=0)
    _, ref_grad = reference(logits, targets, g_l, g_h, 290, log_rho=-4.0, temperature=0.7)
    rows = [0, 2, 3, 4, 5]
    torch.testing.assert_close(
        grad[rows, :290].double(), ref_grad[rows], rtol=GRAD_TOL[torch.float32], atol=2e-6
    )


@pytest.mark.usefixtures("forward")
@pytest.mark.parametrize("inplace", [False, True], ids=["read-only", "in-place"])
@pytest.mark.parametrize("block_rows", [None, 3], ids=["one-block", "blocks-of-3"])
def test_sampling_support_with_padding_and_a_forced_target(monkeypatch, inplace, block_rows):
    if block_rows is not None:  # the support's torch work in several row blocks, as on a long call
        monkeypatch.setattr(masked_logprobs, "SPECIAL_ELEMENTS", block_rows * 8 * 8)
    logits, targets, g_l, g_h = make_problem(n=8, dtype=torch.bfloat16, seed=5)
    support = torch.full((8, 6), -1, dtype=torch.int32)
    for row in range(6):  # rows 6 and 7: no support, the safe set
        ids = logits[row, :290].float().topk(5).indices
        support[row, : 5 - row % 2] = ids[: 5 - row % 2].int()
    support[0, 0] = targets[0]  # the target in its support, among others
    targets[1] = logits[1, :290].argmin()  # a target outside its support: force-kept
    kw = dict(log_rho=-5.0, temperature=0.9)
    out, grad = run_op(
        logits,
        targets,
        g_l,
        g_h,
        inplace=inplace,
        vocab_size=290,
        sampling_support=support,
        backend="triton",
        **kw,
    )
    ref, ref_grad = reference(logits, targets, g_l, g_h, 290, sampling_support=support.long(), **kw)
    for name in OUTPUTS:
        torch.testing.assert_close(getattr(out, name).double(), ref[name], rtol=2e-5, atol=2e-5, msg=name)
    torch.testing.assert_close(grad[:, :290].double(), ref_grad, rtol=1e-2, atol=1e-2)


def _sharded(rank, _world, backend):
    logits, targets, g_l, g_h = make_problem(n=7, v=128, vocab_size=121, dtype=torch.bfloat16, seed=7)
    shard = logits[:, rank * 64 : (rank + 1) * 64].clone().requires_grad_()
    out = vocab_parallel_masked_logprobs(
        shard,
        targets,
        log_rho=-4.0,
        temperature=0.7,
        vocab_size=121,
        tp_group=dist.group.WORLD,
        backend=backend,
    )
    ((out.logprobs * g_l).sum() + (out.entropy * g_h).sum()).backward()
    return {name: getattr(out, name) for name in OUTPUTS} | {"grad": shard.grad}


def test_tp2_over_gloo_with_uneven_valid_columns_equals_one_rank():
    """Shard 1 holds 57 real columns and 7 padded ones; the same kernels on each shard, the op's collectives
    between them."""
    ranks = run_distributed(_sharded, 2, "triton")
    logits, targets, g_l, g_h = make_problem(n=7, v=128, vocab_size=121, dtype=torch.bfloat16, seed=7)
    out, grad = run_op(
        logits, targets, g_l, g_h, log_rho=-4.0, temperature=0.7, vocab_size=121, backend="torch"
    )
    for rank, result in enumerate(ranks):
        for name in OUTPUTS:
            torch.testing.assert_close(result[name], getattr(out, name), rtol=2e-6, atol=2e-6, msg=name)
        expected = grad[:, rank * 64 : (rank + 1) * 64].float()
        torch.testing.assert_close(result["grad"].float(), expected, rtol=1e-2, atol=1e-2)


def test_backend_names_are_checked_and_cpu_kernels_need_the_interpreter():
    logits, targets, *_ = make_problem(n=2)
    with pytest.raises(ValueError, match=r"backend must be one of \('auto', 'triton', 'torch'\); got 'cuda'"):
        vocab_parallel_masked_logprobs(logits, targets, backend="cuda")
    program = (
        "import torch\n"
        "from megatron_tail.ops import vocab_parallel_masked_logprobs as op\n"
        "try:\n"
        "    op(torch.randn(2, 8), torch.tensor([1, 2]), backend='triton')\n"
        "except RuntimeError as e:\n"
        "    print(e)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "-c", program], env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.stdout.startswith("backend='triton' on a cpu tensor needs Triton's interpreter"), proc.stderr


@pytest.mark.parametrize(
    ("valid", "padded"),
    [(512, 512), (700, 720), (200, 200)],
    ids=["whole-tiles", "whole-tiles-and-a-tail", "one-narrowed-tile"],
)
@pytest.mark.usefixtures("forward")
@pytest.mark.parametrize(("entropy", "count"), [(True, False), (False, True)], ids=["entropy", "count"])
def test_tile_boundaries_and_optional_sums(valid, padded, entropy, count):
    """The partial sums walk whole tiles unmasked and the last partial one masked (`INTERPRETER_TILE`: 256
    columns here): rows that end on a tile boundary, past it, and inside a single narrowed tile; the entropy
    and |V_S| sums only when asked for. Against float64 and the PyTorch backend."""
    logits, targets, g_l, g_h = make_problem(n=5, v=padded, vocab_size=valid, seed=11)
    kw = dict(log_rho=-3.0, temperature=0.8, vocab_size=valid, compute_entropy=entropy)
    outs = {}
    for backend in ("triton", "torch"):
        x = logits.detach().clone().requires_grad_()
        out = vocab_parallel_masked_logprobs(x, targets, compute_safe_set_size=count, backend=backend, **kw)
        loss = (out.logprobs * g_l).sum() + ((out.entropy * g_h).sum() if entropy else 0)
        loss.backward()
        outs[backend] = (out, x.grad)
    ref, ref_grad = reference(logits, targets, g_l, g_h if entropy else torch.zeros_like(g_h), valid,
                              log_rho=-3.0, temperature=0.8)  # fmt: skip
    out, grad = outs["triton"]
    names = [n for n in OUTPUTS if entropy or n != "entropy"]
    for name in names:
        got = getattr(out, name).double()
        torch.testing.assert_close(got, ref[name], rtol=2e-5, atol=2e-5, msg=name)
        torch.testing.assert_close(got, getattr(outs["torch"][0], name).double(), rtol=2e-6, atol=2e-6)
    assert (out.entropy is None) == (not entropy) and (out.safe_set_size is None) == (not count)
    if count:
        assert torch.equal(out.safe_set_size, outs["torch"][0].safe_set_size)
    torch.testing.assert_close(grad[:, :valid].double(), ref_grad, rtol=2e-5, atol=2e-5)
    assert torch.count_nonzero(grad[:, valid:]) == 0


def test_the_tile_table_picks_the_measured_tiles_and_narrows_them(monkeypatch):
    from megatron_tail.ops import triton_kernels as k

    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(k, "_capability", lambda _index: (9, 0))
    assert k.tiles(torch.bfloat16, 151_936, cuda) == {
        "row_max": k.Tile(1024, 4), "partial_sums": k.Tile(1024, 4), "grad": k.Tile(4096, 16),
    }  # fmt: skip
    for width in (75_968, 37_984, 18_992):  # the shards at TP = 2, 4, 8: the same tiles
        assert k.tiles(torch.bfloat16, width, cuda) == k.tiles(torch.bfloat16, 151_936, cuda)
    assert k.tile("grad", torch.bfloat16, 1000, cuda) == k.Tile(1024, 4)  # one narrowed tile, 8 per thread
    assert k.tile("grad", torch.float64, 151_936, cuda) == k.Tile(2048, 8)
    monkeypatch.setattr(k, "_capability", lambda _index: (8, 0))  # unmeasured: the projected default
    assert k.tile("partial_sums", torch.float32, 151_936, cuda) == k.Tile(1024, 4)
    assert k.tile("grad", torch.bfloat16, 151_936, torch.device("cpu")) == k.INTERPRETER_TILE
    assert k.tile("row_max", torch.bfloat16, 61, torch.device("cpu")) == k.Tile(64, 1)


# −1e39 rounds to −inf in float32: numpy says so where the interpreter makes the kernel's offset a float32
@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
def test_the_one_program_forward_takes_the_samplers_safe_set_bit_for_bit(dtype):
    """`max_and_sums` computes each row's max and θ itself: the max equals torch's, θ equals `op_threshold`
    of it bit for bit, so its safe set is the one the rollout sampler applies (`safe_vocab.safe_mask`) for
    ρ and T whose product is not exact in the compute dtype; its partial sums equal the two kernels'."""
    from megatron_tail.ops import triton_kernels as k
    from megatron_tail.ops.masked_logprobs import op_threshold, threshold_offset
    from megatron_tail.ops.masked_logprobs_math import S_SUPPORT, SAFE_COUNT, target_columns
    from megatron_tail.ops.safe_vocab import rule_dtype, safe_mask

    gen = torch.Generator().manual_seed(13)
    x = (torch.randn(7, 600, generator=gen, dtype=torch.float64) * 9 + 37).to(dtype)  # large, near-tied
    targets = torch.randint(0, 600, (7,), generator=gen)
    local, owned = target_columns(targets, 0, 600)
    compute = rule_dtype(dtype)
    # −1e39: T·log ρ beyond float32's range, which `max_logit + T·log ρ` takes as −inf (float64: finite)
    for log_rho, temperature in [
        (-2.302585092994046, 0.7),
        (-13.0, 1.3),
        (-0.1, 0.6),
        (-1e39, 1.0),
        (None, 0.9),
    ]:
        offset, prune = threshold_offset(log_rho, temperature, compute)
        kw = dict(inv_temperature=1 / temperature, local_target=local, owned=owned, with_entropy=True,
                  with_count=True)  # fmt: skip
        m, theta, sums = k.max_and_sums(
            x, compute, offset=offset, prune=prune, launch=k.INTERPRETER_ONE_PROGRAM, **kw
        )
        assert torch.equal(m, x.amax(dim=1).to(compute))
        assert torch.equal(theta, op_threshold(m, log_rho, temperature))
        if log_rho is not None:
            assert torch.equal(x.to(compute) >= theta[:, None], safe_mask(x, log_rho, temperature))
        two = k.partial_sums(x, m, theta, 1 / temperature, local, owned, True, True)
        torch.testing.assert_close(sums, two, rtol=1e-12 if dtype == torch.float64 else 2e-6, atol=0)
        assert torch.equal(sums[:, S_SUPPORT:], torch.zeros_like(sums[:, S_SUPPORT:]))
        if log_rho == -1e39 and dtype != torch.float64:  # θ = −max_float: every finite logit, no masked lane
            assert torch.equal(theta, torch.full_like(theta, -torch.finfo(compute).max))
            assert torch.equal(sums[:, SAFE_COUNT], torch.full_like(theta, 600))


def test_the_forward_design_is_the_measured_table_or_the_one_asked_for(monkeypatch):
    from megatron_tail.ops import triton_kernels as k

    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    monkeypatch.setattr(k, "_capability", lambda _index: (9, 0))
    assert k.one_program(torch.bfloat16, cpu) is None  # the interpreter runs as an unmeasured GPU
    launch = k.ONE_PROGRAM_CANDIDATES[0]
    monkeypatch.setattr(k, "ONE_PROGRAM", {("16-bit", (9, 0)): launch})
    assert k.one_program(torch.bfloat16, cuda) == launch
    assert k.one_program(torch.float32, cuda) is None  # measured for 16-bit logits only
    assert "one program, 2048×8, 4 per SM" in k.describe_tiles(torch.bfloat16, 151_936, cuda)
    with k.forward_design(k.TWO_KERNELS):
        assert k.one_program(torch.bfloat16, cuda) is None
        assert "TP = 1 forward: two kernels" in k.describe_tiles(torch.bfloat16, 151_936, cuda)
    other = k.OneProgram(k.Tile(8192, 32), 1, "evict_last", "evict_first", 3)
    with k.forward_design(other):
        assert k.one_program(torch.float32, cuda) == other
        # off CUDA the interpreter's tile and grid, with the choice's loads
        on_cpu = k.one_program(torch.float32, cpu)
        assert on_cpu == k.OneProgram(k.INTERPRETER_TILE, 1, "evict_last", "evict_first", 3)
        words = (
            "TP = 1 forward: one program, 8192×32, 1 per SM, L2 evict_last / evict_first, pass 1 in 3 stages"
        )
        assert words in k.describe_tiles(torch.bfloat16, 151_936, cuda)
    assert k.one_program(torch.bfloat16, cuda) == launch  # the block's choice ended with it
    with pytest.raises(ValueError, match="forward_design takes a OneProgram or 'two kernels'; got 'fast'"):
        with k.forward_design("fast"):
            pass
    with pytest.raises(ValueError, match="evictions are one of"):
        with k.forward_design(launch._replace(pass2_eviction="evict_never")):
            pass
    with pytest.raises(ValueError, match="pass 1 stages are 1 to 4"):
        with k.forward_design(launch._replace(pass1_stages=0)):
            pass
    # float64 (gradcheck) keeps 8 × 256 columns per program whatever the launch: 32 warps would spill
    assert k.one_program_tile(other, torch.float64, 151_936) == k.Tile(2048, 8)
    assert k.one_program_tile(other, torch.bfloat16, 151_936) == k.Tile(8192, 32)
    assert k.one_program_tile(other, torch.bfloat16, 1000) == k.Tile(1024, 4)
