"""The local engine's top-k / top-p / min-p equals SGLang 0.5.23's own `Sampler` (PyTorch backend, CPU
tensors) with `return_sampling_mask`: the same support per row, in the same order, and the same selected
log-prob of the token SGLang drew; and the trainer op replays that log-prob from the support."""

from __future__ import annotations

import pytest
import torch

from megatron_tail.ops import vocab_parallel_masked_logprobs
from megatron_tail.rollout.local_engine.truncation import Truncation, sample_truncated, truncated_weights

pytest.importorskip(
    "sglang", reason="sglang (installed with --no-deps, see pyproject's sglang-cpu) is needed"
)

from tests.rollout.sglang_sampler import import_sglang_sampler, sample_with_masks


@pytest.fixture(scope="module")
def sg():
    return import_sglang_sampler()


def sglang_masks(sg, logits, temperature, top_k, top_p, min_p):
    """SGLang's `Sampler.forward` on `[B, V]` logits with every row asking for its sampling mask:
    `(token ids [B], list of B supports, selected logprobs [B])`."""
    batch, vocab = logits.shape
    info = sg.SamplingBatchInfo(
        temperatures=torch.full((batch, 1), temperature),
        top_ps=torch.full((batch,), top_p),
        top_ks=torch.full((batch,), top_k, dtype=torch.int32),
        min_ps=torch.full((batch,), min_p),
        is_all_greedy=False,
        is_any_greedy=False,
        need_top_p_sampling=top_p < 1.0,
        need_top_k_sampling=top_k < sg.TOP_K_ALL,
        need_min_p_sampling=min_p > 0.0,
        vocab_size=vocab,
        return_sampling_masks=[True] * batch,
        sampling_mask_batch_indices=torch.arange(batch),
        sampling_mask_top_ks=[top_k] * batch,
        device="cpu",
    )
    ids, mask = sample_with_masks(sg, logits, info, "pytorch")
    assert bool((mask.statuses == 0).all()), "SGLang's status OK"
    supports = [mask.token_ids[i, : int(mask.lengths[i])].long().tolist() for i in range(batch)]
    return ids, supports, mask.selected_logprobs


CASES = [  # (top_k, top_p, min_p, temperature)
    (20, 0.8, 0.0, 1.0),  # the demo's setting
    (50, 1.0, 0.0, 0.7),
    (8, 0.95, 0.05, 1.3),
    (64, 0.5, 0.0, 1.0),
    (300, 1.0, float(torch.tensor(-13.0).exp()), 1.0),  # DVP's rule as min_p (see rollout docs)
]


@pytest.mark.parametrize(("top_k", "top_p", "min_p", "temperature"), CASES)
def test_support_and_selected_logprob_equal_sglangs_sampler(sg, top_k, top_p, min_p, temperature):
    gen = torch.Generator().manual_seed(top_k)
    logits = torch.randn(64, 300, generator=gen) * 3.0
    logits[:4, :3] += 12.0  # peaked rows: top-p keeps one or two tokens
    torch.manual_seed(0)
    ids, supports, selected = sglang_masks(sg, logits, temperature, top_k, top_p, min_p)
    truncation = Truncation(top_k, top_p, min_p)
    sizes = []
    for i in range(logits.shape[0]):
        probs = torch.softmax(logits[i] / temperature, dim=-1)
        weights, order = truncated_weights(probs, truncation)
        length = int((weights > 0).sum())
        assert order[:length].tolist() == supports[i], f"row {i}: support"
        pos = order.tolist().index(int(ids[i]))
        ours = torch.log(weights[pos] / weights.sum(dtype=torch.float32))
        torch.testing.assert_close(ours, selected[i], rtol=0, atol=1e-6)
        sizes.append(length)
        token, support, logprob = sample_truncated(probs, truncation, torch.Generator().manual_seed(i))
        assert token in support and support == supports[i]
        assert logprob == pytest.approx(
            float(torch.log(weights[support.index(token)] / weights.sum())), abs=1e-6
        )
    assert max(sizes) <= top_k < logits.shape[1] or max(sizes) < logits.shape[1], "the case truncates"
    if top_p < 1.0 or min_p > 0.0:
        assert min(sizes) < max(sizes), "top-p / min-p: a support per row"
    # The trainer replays SGLang's support: its log-prob of SGLang's token equals SGLang's selected one.
    k = max(len(s) for s in supports)
    padded = torch.tensor([s + [-1] * (k - len(s)) for s in supports])
    op = vocab_parallel_masked_logprobs(
        logits, ids, log_rho=None, temperature=temperature, sampling_support=padded
    )
    torch.testing.assert_close(op.logprobs, selected, rtol=0, atol=2e-5)
    full = vocab_parallel_masked_logprobs(logits, ids, log_rho=None, temperature=temperature)
    bias = 1e-6 if top_k == 300 else 1e-3  # ρ = e^-13 drops little mass
    assert float((op.logprobs - full.logprobs).mean()) > bias, "scoring the full softmax would be biased"
