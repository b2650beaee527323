"""The output layer fused with the op on CUDA (Qwen3-8B's hidden size 4096 and vocabulary 151,936, bf16)
against the materialized path, `hidden @ weight.T` then the op: values and gradients of hidden and weight;
time and peak memory of both (and of the materialized path with `inplace_backward`, what the trainer's
unfused path runs) go to the ratio table. The fused layer exists to save memory, so its peak extra memory
must lie below the materialized path's: its backward holds the weight gradient and O(chunk) blocks, no
other [V, H] tensor (issue 51; before that fix it held a float32 [V, H] accumulator and per-chunk [V, H]
products, 7.52 GiB extra at 4,096 × 4,096 @ 151,936 against 2.35 GiB for matmul + op).

Its CPU half, the same code on a tiny shape with H = N as here (several token chunks, the Triton backend
under Triton's interpreter, the peak counted by `bench.tensor_memory`): tests/ops/test_linear_op_device.py."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_tail.ops import vocab_parallel_linear_masked_logprobs, vocab_parallel_masked_logprobs
from tests.gpu.common import QWEN3_8B_HIDDEN, QWEN3_VOCAB, measure, ratio_row, record_rows

pytestmark = pytest.mark.gpu

CPU_HALF = "tests/ops/test_linear_op_device.py"
TOKENS = 4096
LOG_RHO = -13.0
TOL = 3e-2
"""Gradients, as the CPU test of the same equality in bf16 (`tests/ops/test_linear_op.py`)."""
LAST_BIT = 0.13
"""Both paths compute bf16 logits with float32 accumulation, in blocks here and in one GEMM there, so a logit
can come out one bf16 ulp apart (rarely: the float32 sums differ in their last bits). The logits stay below
16 but for a few raised ones (an ulp is 0.0625 below 16, 0.125 up to 32), and one logit's change moves a
token's log-prob by at most that much: per-token values agree to `LAST_BIT` everywhere and to 1e-2 on 99.9%
of the tokens."""


def make_problem(device: str, tokens: int, hidden: int, vocab: int, seed: int = 0):
    """hidden `[N, H]` and weight `[V, H]` (bf16, on `device`) whose logits are N(0, 1) with, on every third
    row, one token raised by 14 (hidden += 14·w_j: |w_j|² ≈ 1): the long tail below max − 13 then holds a
    few % of the mass at Qwen3's vocabulary (a few ‰ at a tiny one), which DVP prunes. Targets: half the
    argmax of the row, half uniform; per-token weights of log-probs and entropy."""
    g = torch.Generator(device=device).manual_seed(seed)
    weight = torch.randn(vocab, hidden, device=device, generator=g) / math.sqrt(hidden)
    x = torch.randn(tokens, hidden, device=device, generator=g)
    raised = torch.randint(0, vocab, (tokens,), device=device, generator=g)
    tail_rows = torch.arange(tokens, device=device) % 3 == 1
    x += torch.where(tail_rows[:, None], 14.0 * weight[raised], torch.zeros_like(x))
    x, weight = x.to(torch.bfloat16), weight.to(torch.bfloat16)
    with torch.no_grad():
        argmax = (x @ weight.T).argmax(dim=1)
    uniform = torch.randint(0, vocab, (tokens,), device=device, generator=g)
    targets = torch.where(torch.arange(tokens, device=device) % 2 == 0, argmax, uniform)
    w_lp = torch.rand(tokens, device=device, generator=g) + 0.5
    w_h = torch.rand(tokens, device=device, generator=g)
    return x, weight, targets, w_lp, w_h


def run_path(
    fused: bool, hidden, weight, targets, w_lp, w_h, *, inplace: bool = False, backend: str = "auto"
):
    """Forward and backward of the fused op (`fused`) or `hidden @ weight.T` then the op (its gradient in
    place when `inplace`), on the weighted sum of log-probs and entropies; (outputs, dhidden, dweight)."""
    h, w = hidden.detach().requires_grad_(), weight.detach().requires_grad_()
    kwargs = dict(log_rho=LOG_RHO, vocab_size=weight.shape[0], backend=backend)
    if fused:
        out = vocab_parallel_linear_masked_logprobs(h, w, targets, **kwargs)
    else:
        out = vocab_parallel_masked_logprobs(h @ w.T, targets, inplace_backward=inplace, **kwargs)
    (w_lp * out.logprobs + w_h * out.entropy).sum().backward()
    return out, h.grad, w.grad


def _shape(problem) -> str:
    hidden, weight = problem[:2]
    return f"{hidden.shape[0]}×{hidden.shape[1]} @ {weight.shape[0]} bf16"


def check_fused_equals_matmul_then_op(
    problem, record_property, backend: str = "auto", repeats: int = 5, measured: dict | None = None
) -> list[dict]:
    """Values and gradients agree (module docstring, `LAST_BIT`, `TOL`); time and peak memory of the fused
    op and of matmul + op in place against matmul + op, and against Liger's fused linear cross entropy where
    it is installed, into the table (`measure`'s median of `repeats`). The op's `backend` for both paths.
    Returns the rows; `measured` (a module's dict) keeps the fused op's and matmul + op's measurements for
    `check_fused_saves_memory`, which would otherwise make the same two. The values compared are those of
    the measured calls (`keep_result`), so each path runs only as often as it is measured."""
    baseline = measure(lambda: run_path(False, *problem, backend=backend), repeats=repeats, keep_result=True)
    fused = measure(lambda: run_path(True, *problem, backend=backend), repeats=repeats, keep_result=True)
    (ref, rh, rw), (fused_out, fh, fw) = baseline.pop("result"), fused.pop("result")
    _check_equal(fused_out, fh, fw, ref, rh, rw)
    del fused_out, ref, fh, fw, rh, rw

    shape = _shape(problem)
    inplace = measure(lambda: run_path(False, *problem, inplace=True, backend=backend), repeats=repeats)
    if measured is not None:
        measured.update(fused=fused, matmul=baseline)
    rows = [
        ratio_row("fused output layer + op", shape, fused, baseline, "matmul + op"),
        ratio_row("matmul + op, in place", shape, inplace, baseline, "matmul + op"),
    ]
    liger = _liger_fused(*problem)
    if liger is not None:
        peer = measure(liger, repeats=repeats)  # as often as ours: 6 interpreted calls in the CPU half were 2
        rows.append(ratio_row("fused output layer + op", shape, fused, peer, "Liger fused linear CE"))
    record_rows(record_property, rows)
    return rows


def _check_equal(fused, fh, fw, ref, rh, rw) -> None:
    """The fused op's outputs and gradients (`fused`, d hidden, d weight) against matmul + op's (`ref`, ...),
    to the module docstring's tolerances; DVP prunes part of the vocabulary on the problem."""
    assert float(ref.safe_mass.min()) < 0.999 and not bool(ref.in_safe_set.all())  # DVP prunes
    for key in ("logprobs", "entropy", "safe_mass", "logprobs_full", "top_logprob"):
        diff = (getattr(fused, key) - getattr(ref, key)).abs().float()
        assert float(diff.max()) < LAST_BIT, (key, float(diff.max()))
        assert float(torch.quantile(diff, 0.999)) < 1e-2, (key, float(torch.quantile(diff, 0.999)))
    mismatched = (fused.in_safe_set != ref.in_safe_set).float().mean().item()
    assert mismatched < 1e-3  # a target exactly at the threshold may flip with its last bf16 bit
    for got, want in ((fh, rh), (fw, rw)):
        scale = float(want.float().abs().max())
        torch.testing.assert_close(got.float(), want.float(), rtol=TOL, atol=TOL * scale)


def shared_measurements() -> dict:
    """Where `check_fused_equals_matmul_then_op` leaves the fused op's and matmul + op's measurements for
    `check_fused_saves_memory` (a module fixture's, in each half), which would otherwise make the same two."""
    return {}


def check_fused_saves_memory(
    problem, record_property, backend: str = "auto", repeats: int = 5, measured: dict | None = None
) -> dict:
    """The fused op's peak extra memory (forward + backward) below matmul + op's on the same problem, both
    measured by `measure` (CUDA's allocator; the storage counter elsewhere) with the op's `backend`, or taken
    from `measured` where `check_fused_equals_matmul_then_op` left them; the row goes to the table whatever
    the outcome. Returns both measurements."""
    if not measured or not {"fused", "matmul"} <= measured.keys():  # some runs only: this test alone (-k)
        measured = {
            "matmul": measure(lambda: run_path(False, *problem, backend=backend), repeats=repeats),
            "fused": measure(lambda: run_path(True, *problem, backend=backend), repeats=repeats),
        }
    matmul, fused = measured["matmul"], measured["fused"]
    row = ratio_row("fused output layer + op, peak memory", _shape(problem), fused, matmul, "matmul + op")
    record_rows(record_property, [row])
    assert fused["peak_bytes"] < matmul["peak_bytes"], (fused["peak_bytes"], matmul["peak_bytes"])
    return {"fused": fused, "matmul": matmul}


def _liger_fused(hidden, weight, targets, *_):
    """Liger-Kernel's fused linear cross entropy on the same inputs (None where it is not installed)."""
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
    except ImportError:  # some runs only: a node without the carried Liger-Kernel wheel
        return None
    return _liger_run(LigerFusedLinearCrossEntropyLoss(), hidden, weight, targets)


def _liger_run(loss, hidden, weight, targets):
    def run():
        h, w = hidden.detach().requires_grad_(), weight.detach().requires_grad_()
        loss(w, h, targets).backward()

    return run


@pytest.fixture(scope="module")
def problem():
    return make_problem("cuda", TOKENS, QWEN3_8B_HIDDEN, QWEN3_VOCAB)


@pytest.fixture(scope="module")
def measured() -> dict:
    return shared_measurements()


def test_fused_output_layer_equals_matmul_then_op(problem, record_property, measured):
    check_fused_equals_matmul_then_op(problem, record_property, measured=measured)


def test_the_fused_output_layer_takes_less_memory_than_matmul_then_op(problem, record_property, measured):
    check_fused_saves_memory(problem, record_property, measured=measured)
