"""The op on CUDA at real shapes (Qwen3 vocabulary 151,936, 4k and 16k tokens per call, TP = 1, bf16 logits):
equal to the float64 reference on a slice of rows (outputs and gradient), a NaN row poisoned and −inf
logits of probability zero (both with each design of the Triton forward), and with DVP off equal to
megatron-core's `vocab_parallel_cross_entropy` on the same logits (loss and gradient). Time and peak memory
against megatron's cross entropy go to the ratio table (`gpu_table`), not into assertions, and so does the
op against its peers (`bench.op_peers`) and the TP = 1 forward's designs (`bench.op_designs`).

Its CPU half, the same cases on tiny shapes (the Triton backend under Triton's interpreter, megatron on gloo
with the CPU patches): `tests/ops/test_op_device.py`."""

from __future__ import annotations

import contextlib

import pytest
import torch

from megatron_tail.ops import vocab_parallel_masked_logprobs
from megatron_tail.ops.reference import reference_masked_logprobs
from megatron_tail.ops.triton_kernels import ONE_PROGRAM_CANDIDATES
from tests.gpu.common import (
    QWEN3_VOCAB,
    TOKEN_COUNTS,
    measure,
    megatron_tp1,
    ratio_row,
    real_logits,
    record_rows,
    slice_rows,
)

pytestmark = pytest.mark.gpu

CPU_HALF = "tests/ops/test_op_device.py"
LOG_RHO = -13.0
BF16_GRAD = {"rtol": 1.6e-2, "atol": 1e-6}
"""The op's gradient is float32 math rounded to the logits' bf16: half an ulp is 2^-9 relative."""


def _weights(tokens: int, seed: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token loss weights of log-probs and entropy (a gradient that is not all ones)."""
    g = torch.Generator(device=device).manual_seed(seed)
    return (
        torch.rand(tokens, device=device, generator=g) + 0.5,
        torch.rand(tokens, device=device, generator=g),
    )


BACKENDS = ("triton", "torch", *(f"triton-one-program-{i}" for i in range(len(ONE_PROGRAM_CANDIDATES))))
"""The op's backends, and the Triton backend with its TP = 1 forward as one program per row in each launch
`bench.op` may recommend (`triton_kernels.ONE_PROGRAM_CANDIDATES[i]`, whatever `ONE_PROGRAM` says; on a CPU
the interpreter's launch, so the CPU half takes one of them)."""


def _op_on(backend: str, logits, targets, **kwargs):
    """`vocab_parallel_masked_logprobs` on `backend`, one of `BACKENDS`: a one-program name runs the Triton
    backend with its TP = 1 forward as that candidate launch."""
    design = contextlib.nullcontext()
    if backend.startswith("triton-one-program-"):
        from megatron_tail.ops import triton_kernels

        design = triton_kernels.forward_design(ONE_PROGRAM_CANDIDATES[int(backend.rsplit("-", 1)[1])])
    with design:
        return vocab_parallel_masked_logprobs(logits, targets, backend=backend.split("-")[0], **kwargs)


def check_against_float64(device: str, tokens: int, vocab: int, backend: str, log_rho: float) -> None:
    """The op on `backend` (`BACKENDS`) against the float64 reference on the first and last 32 rows: outputs
    and the bf16 gradient; both in- and out-of-safe-set targets occur and DVP really prunes."""
    logits, targets = real_logits(tokens, vocab, device=device)
    w_lp, w_h = _weights(tokens, 1, device)
    x = logits.detach().requires_grad_()
    out = _op_on(backend, x, targets, log_rho=log_rho, vocab_size=vocab)
    (w_lp * out.logprobs + w_h * out.entropy).sum().backward()

    rows = slice_rows(tokens, device=device)
    ref_x = logits[rows].double().requires_grad_()
    ref = reference_masked_logprobs(ref_x, targets[rows], log_rho=log_rho)
    (w_lp[rows].double() * ref["logprobs"] + w_h[rows].double() * ref["entropy"]).sum().backward()

    assert not bool(ref["in_safe_set"].all()) and bool(ref["in_safe_set"].any())  # both cases occur
    assert float(ref["safe_mass"].min()) < 0.999  # DVP really prunes on the flat rows
    assert torch.equal(out.in_safe_set[rows].cpu(), ref["in_safe_set"].cpu())
    for key in ("logprobs", "entropy", "logprobs_full", "top_logprob"):
        torch.testing.assert_close(
            getattr(out, key)[rows].double(), ref[key], rtol=1e-5, atol=2e-4, msg=lambda m, k=key: f"{k}: {m}"
        )
    torch.testing.assert_close(out.safe_mass[rows].double(), ref["safe_mass"], rtol=1e-5, atol=1e-6)
    assert x.grad.dtype == torch.bfloat16
    torch.testing.assert_close(x.grad[rows].double(), ref_x.grad, **BF16_GRAD)


def check_nan_and_minus_inf_rows(device: str, vocab: int, backend: str) -> None:
    """A NaN logit poisons every output and the gradient of its row; a row whose first half is −inf keeps
    finite outputs, with a zero gradient there. The contract on the compiled kernels: Triton's interpreter
    propagates NaN through any max, so only a GPU shows that pass 1 keeps it (`max.NaN`)."""
    logits, targets = real_logits(64, vocab, device=device)
    logits[5, vocab // 3] = float("nan")
    logits[9, : vocab // 2] = float("-inf")
    targets[9] = vocab - 1
    x = logits.requires_grad_()
    out = _op_on(backend, x, targets, log_rho=LOG_RHO, vocab_size=vocab)
    (out.logprobs.sum() + out.entropy.sum()).backward()
    others = torch.ones(64, dtype=torch.bool, device=device)
    others[5] = False
    for key in ("logprobs", "entropy", "safe_mass", "logprobs_full", "top_logprob"):
        value = getattr(out, key)
        assert bool(torch.isnan(value[5])), key
        assert bool(torch.isfinite(value[others]).all()), key
    assert bool(torch.isnan(x.grad[5]).all())
    assert bool(torch.isfinite(x.grad[others]).all())
    assert int(torch.count_nonzero(x.grad[9, : vocab // 2])) == 0


def check_against_megatron_ce(
    device: str, tokens: int, vocab: int, log_rho: float, record_property, repeats: int = 5
) -> list[dict]:
    """With DVP off, the op's loss and gradient equal megatron's cross entropy (in megatron's TP = 1 state);
    then time and peak memory of the op with DVP at `log_rho` (read-only and in place) against megatron's,
    into the table. Returns the rows."""
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    logits, targets = real_logits(tokens, vocab, seed=2, device=device)
    w, _ = _weights(tokens, 3, device)
    x = logits.detach().requires_grad_()
    out = vocab_parallel_masked_logprobs(x, targets, log_rho=None, compute_entropy=False)
    (-w * out.logprobs).sum().backward()

    m = logits.clone().requires_grad_()  # megatron's cross entropy overwrites its input
    loss = vocab_parallel_cross_entropy(m, targets)
    (w * loss).sum().backward()
    torch.testing.assert_close(-out.logprobs, loss.float(), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(x.grad.float(), m.grad.float(), **BF16_GRAD)
    del x, m, out, loss

    def ours(inplace: bool):
        def run(fresh=None):
            y = (fresh if inplace else logits.detach()).requires_grad_()
            o = vocab_parallel_masked_logprobs(
                y, targets, log_rho=log_rho, vocab_size=vocab, inplace_backward=inplace
            )
            (o.logprobs.sum() + o.entropy.sum()).backward()

        return run

    def megatron(fresh):
        vocab_parallel_cross_entropy(fresh.requires_grad_(), targets).sum().backward()

    fresh = logits.clone
    baseline = measure(megatron, prepare=fresh, repeats=repeats)
    shape = f"{tokens}×{vocab} bf16"
    read_only = measure(ours(False), repeats=repeats)
    in_place = measure(ours(True), prepare=fresh, repeats=repeats)
    rows = [
        ratio_row("op, DVP + entropy, read-only", shape, read_only, baseline, "megatron CE"),
        ratio_row("op, DVP + entropy, in place", shape, in_place, baseline, "megatron CE"),
    ]
    record_rows(record_property, rows)
    return rows


def record_peers(device: str, tokens: int, vocab: int, record_property, repeats: int = 5) -> list[dict]:
    """The Triton and PyTorch backends (fwd + bwd in place, forward only) against torch's, megatron's and
    Liger-Kernel's cross entropy (`bench.op_peers`, the rows `python -m megatron_tail.bench.op --device
    cuda` prints), with each row's share of the copy rate, then the TP = 1 forward's designs against the
    same baseline and the `ONE_PROGRAM` entry they support (`bench.op_designs`), and where each design's
    time goes (`bench.op_split`), into the table. Recorded, not asserted."""
    from megatron_tail.bench.op_designs import design_rows, recommendation
    from megatron_tail.bench.op_peers import baseline_row, peer_rows
    from megatron_tail.bench.op_split import split_rows

    rows = []
    peers = peer_rows(tokens, vocab, device=device, repeats=repeats)
    for r in peers:
        if r["ms"] is None:  # some runs only: a node without the carried Liger-Kernel wheel
            value = r["note"]
        else:
            share = "" if r["bandwidth"] is None else f", {100 * r['bandwidth']:.0f}% of the copy rate"
            value = (
                f"{r['ms']:.2f} ms = {r['ratio']:.2f}× {r['baseline']}, peak {r['peak_gib']:.2f} GiB{share}"
            )
        rows.append({"what": f"{r['what']} ({tokens}×{vocab} bf16)", "value": value})
    designs = design_rows(tokens, vocab, baseline_row(peers), device=device, repeats=repeats)
    for r in designs:
        value = (
            f"not measured: {r['error']}"
            if "error" in r  # some runs only: a launch the node's Triton cannot compile
            else f"forward {r['forward_ms']:.2f} ms = {r['forward_ratio']:.2f}×, fwd+bwd in place "
            f"{r['ms']:.2f} ms = {r['ratio']:.2f}× {r['baseline']}"
        )
        rows.append({"what": f"TP = 1 forward: {r['what']} ({tokens}×{vocab} bf16)", "value": value})
    rows.append({"what": "TP = 1 forward: the ONE_PROGRAM entry", "value": recommendation(designs, device)})
    for r in split_rows(designs, tokens, vocab, device=device, repeats=repeats):
        value = (
            f"forward {r['forward_ms']:.2f} ms, its kernels alone {r['forward_kernels_ms']:.2f} ms, outside "
            f"them {r['forward_outside_ms']:.2f} ms; fwd+bwd {r['ms']:.2f} ms, gradient kernel alone "
            f"{r['grad_kernel_ms']:.2f} ms, outside the kernels {r['outside_ms']:.2f} ms"
        )
        rows.append({"what": f"TP = 1 time split: {r['what']} ({tokens}×{vocab} bf16)", "value": value})
    record_rows(record_property, rows)
    return rows


@pytest.fixture(scope="module")
def megatron_state():
    with megatron_tp1("cuda"):
        yield


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("tokens", TOKEN_COUNTS)
def test_op_equals_the_float64_reference_on_a_slice(tokens, backend):
    check_against_float64("cuda", tokens, QWEN3_VOCAB, backend, LOG_RHO)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_nan_poisons_its_row_and_minus_inf_is_probability_zero(backend):
    check_nan_and_minus_inf_rows("cuda", QWEN3_VOCAB, backend)


@pytest.mark.parametrize("tokens", TOKEN_COUNTS)
def test_op_without_dvp_equals_megatron_cross_entropy(megatron_state, tokens, record_property):  # noqa: ARG001
    check_against_megatron_ce("cuda", tokens, QWEN3_VOCAB, LOG_RHO, record_property)


def test_the_op_against_its_peers(megatron_state, record_property):  # noqa: ARG001
    record_peers("cuda", max(TOKEN_COUNTS), QWEN3_VOCAB, record_property)
