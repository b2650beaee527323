"""The op on CUDA at real shapes (Qwen3 vocabulary 151,936, 4k and 16k tokens per call, TP = 1, bf16 logits):
equal to the float64 reference on a slice of rows (outputs and gradient), and with DVP off equal to
megatron-core's `vocab_parallel_cross_entropy` on the same logits (loss and gradient). Time and peak memory
against megatron's cross entropy go to the ratio table (`gpu_table`), not into assertions."""

from __future__ import annotations

import pytest
import torch

from megatron_tail.ops import vocab_parallel_masked_logprobs
from megatron_tail.ops.reference import reference_masked_logprobs
from tests.gpu.common import (
    QWEN3_VOCAB,
    TOKEN_COUNTS,
    measure,
    megatron_tp1,
    ratio_row,
    real_logits,
    slice_rows,
)

pytestmark = pytest.mark.gpu

LOG_RHO = -13.0
BF16_GRAD = {"rtol": 1.6e-2, "atol": 1e-6}
"""The op's gradient is float32 math rounded to the logits' bf16: half an ulp is 2^-9 relative."""


@pytest.fixture(scope="module")
def megatron_state():
    with megatron_tp1():
        yield


def _weights(tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token loss weights of log-probs and entropy (a gradient that is not all ones)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    return (
        torch.rand(tokens, device="cuda", generator=g) + 0.5,
        torch.rand(tokens, device="cuda", generator=g),
    )


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("tokens", TOKEN_COUNTS)
def test_op_equals_the_float64_reference_on_a_slice(tokens, backend):
    logits, targets = real_logits(tokens)
    w_lp, w_h = _weights(tokens, 1)
    x = logits.detach().requires_grad_()
    out = vocab_parallel_masked_logprobs(x, targets, log_rho=LOG_RHO, vocab_size=QWEN3_VOCAB, backend=backend)
    (w_lp * out.logprobs + w_h * out.entropy).sum().backward()

    rows = slice_rows(tokens)
    ref_x = logits[rows].double().requires_grad_()
    ref = reference_masked_logprobs(ref_x, targets[rows], log_rho=LOG_RHO)
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


@pytest.mark.parametrize("tokens", TOKEN_COUNTS)
def test_op_without_dvp_equals_megatron_cross_entropy(megatron_state, tokens, record_property):  # noqa: ARG001
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    logits, targets = real_logits(tokens, seed=2)
    w, _ = _weights(tokens, 3)
    x = logits.detach().requires_grad_()
    out = vocab_parallel_masked_logprobs(x, targets, log_rho=None, compute_entropy=False)
    (-w * out.logprobs).sum().backward()

    m = logits.clone().requires_grad_()  # megatron's cross entropy overwrites its input
    loss = vocab_parallel_cross_entropy(m, targets)
    (w * loss).sum().backward()
    torch.testing.assert_close(-out.logprobs, loss.float(), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(x.grad.float(), m.grad.float(), **BF16_GRAD)
    del x, m, out, loss

    # Time and peak memory of forward + backward, against megatron's, in this run (not asserted).
    def ours(inplace: bool):
        def run(fresh=None):
            y = (fresh if inplace else logits.detach()).requires_grad_()
            o = vocab_parallel_masked_logprobs(
                y, targets, log_rho=LOG_RHO, vocab_size=QWEN3_VOCAB, inplace_backward=inplace
            )
            (o.logprobs.sum() + o.entropy.sum()).backward()

        return run

    def megatron(fresh):
        vocab_parallel_cross_entropy(fresh.requires_grad_(), targets).sum().backward()

    fresh = logits.clone
    baseline = measure(megatron, prepare=fresh)
    shape = f"{tokens}×{QWEN3_VOCAB} bf16"
    rows = [
        ratio_row("op, DVP + entropy, read-only", shape, measure(ours(False)), baseline, "megatron CE"),
        ratio_row(
            "op, DVP + entropy, in place", shape, measure(ours(True), prepare=fresh), baseline, "megatron CE"
        ),
    ]
    for row in rows:
        record_property("gpu_table", row)


def test_the_op_against_its_peers(megatron_state, record_property):  # noqa: ARG001
    """The Triton and PyTorch backends (fwd + bwd in place, forward only) against torch's, megatron's and
    Liger-Kernel's cross entropy at 16k × 151,936, with each row's share of the copy rate: `bench.op_peers`,
    the rows `python -m megatron_tail.bench.op --device cuda` prints. Recorded, not asserted."""
    from megatron_tail.bench.op_peers import peer_rows

    tokens = max(TOKEN_COUNTS)
    for r in peer_rows(tokens, QWEN3_VOCAB, device="cuda"):
        if r["ms"] is None:
            value = r["note"]
        else:
            share = "" if r["bandwidth"] is None else f", {100 * r['bandwidth']:.0f}% of the copy rate"
            value = (
                f"{r['ms']:.2f} ms = {r['ratio']:.2f}× {r['baseline']}, peak {r['peak_gib']:.2f} GiB{share}"
            )
        record_property("gpu_table", {"what": f"{r['what']} ({tokens}×{QWEN3_VOCAB} bf16)", "value": value})
