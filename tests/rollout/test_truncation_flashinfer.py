"""The local engine's truncation under SGLang 0.5.23's flashinfer branch (the CUDA default) equals SGLang's
own `Sampler` running that branch on CPU tensors, with the flashinfer kernels replaced by float64 stand-ins of
their documented semantics (`flashinfer_reference.py`): SGLang's control flow (the batch-level
`need_min_p_sampling` switch) and its mask capture are SGLang's code. When any request of a batch has
min_p > 0, as DVP's ρ always is, top-p is measured on the top-k-renormalised distribution."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_tail.rollout.local_engine.batcher import Row, sample_rows
from megatron_tail.rollout.local_engine.requests import GenerateItem
from megatron_tail.rollout.local_engine.truncation import (
    TOP_K_ALL,
    Truncation,
    batch_rule,
    flashinfer_weights,
    truncated_weights,
)

pytest.importorskip(
    "sglang", reason="sglang (installed with --no-deps, see pyproject's sglang-cpu) is needed"
)

from tests.rollout.flashinfer_reference import STAND_INS
from tests.rollout.sglang_sampler import import_sglang_sampler, sample_with_masks

RHO = math.exp(-13.0)


@pytest.fixture(scope="module")
def sg():
    return import_sglang_sampler()


@pytest.fixture
def flashinfer(sg, monkeypatch):
    """SGLang's sampler module with its CUDA-only kernel names bound to the float64 stand-ins."""
    for name, fn in STAND_INS.items():
        monkeypatch.setattr(sg.sampler, name, fn, raising=False)
    return sg


def sglang_masks(sg, logits: torch.Tensor, params: list[Truncation], backend: str, temperature: float = 1.0):
    """SGLang's `Sampler.forward` on `[B, V]` logits, row b truncated by `params[b]`, every row asking for its
    mask; the `need_*` flags as `SamplingBatchInfo.from_schedule_batch` sets them (any row of the batch).
    Returns `(token ids [B], list of B supports as sorted lists, selected logprobs [B])`."""
    batch, vocab = logits.shape
    info = sg.SamplingBatchInfo(
        temperatures=torch.full((batch, 1), temperature),
        top_ps=torch.tensor([p.top_p for p in params]),
        top_ks=torch.tensor([p.top_k for p in params], dtype=torch.int32),
        min_ps=torch.tensor([p.min_p for p in params]),
        is_all_greedy=False,
        is_any_greedy=False,
        need_top_p_sampling=any(p.top_p != 1.0 for p in params),
        need_top_k_sampling=any(p.top_k != sg.TOP_K_ALL for p in params),
        need_min_p_sampling=any(p.min_p > 0 for p in params),
        vocab_size=vocab,
        return_sampling_masks=[True] * batch,
        sampling_mask_batch_indices=torch.arange(batch),
        sampling_mask_top_ks=[p.top_k for p in params],
        device="cpu",
    )
    ids, mask = sample_with_masks(sg, logits, info, backend)
    assert mask.statuses.tolist() == [0] * batch, "SGLang's status OK: its token is in its support"
    supports = [sorted(mask.token_ids[i, : int(mask.lengths[i])].tolist()) for i in range(batch)]
    return ids, supports, mask.selected_logprobs


def rows_of(params: list[Truncation], temperature: float = 1.0) -> list[Row]:
    """Local-engine rows (one per truncation) as the batcher holds them, seeds 0, 1, ..."""
    rows = []
    for i, truncation in enumerate(params):
        item = GenerateItem(
            rid=f"r{i}", input_ids=[1], max_new_tokens=4, temperature=temperature, seed=i,
            stop_token_ids=frozenset(), ignore_eos=False, skip_special_tokens=True, return_logprob=True,
            top_logprobs_num=0, processor=None, custom_params=None, truncation=truncation,
            return_sampling_mask=True,
        )  # fmt: skip
        rows.append(Row(item, 0, lambda: None))
    return rows


PROBS = [0.40, 0.25, 0.15, 0.10, 0.06, 0.04]
"""Six tokens: top_k = 3 keeps mass 0.80; top_p = 0.7 on it keeps 0.40 + 0.25 (0.65 ≥ 0.7 · 0.80 = 0.56),
top_p = 0.7 on the full distribution keeps 0.40 + 0.25 + 0.15 (the head before 0.15 holds 0.65 ≤ 0.7)."""


@pytest.mark.parametrize(
    ("neighbour_min_p", "backend", "kept"),
    [
        (0.0, "flashinfer", [0, 1, 2]),  # joint: top-p on the full distribution
        (RHO, "flashinfer", [0, 1]),  # a DVP request in the batch: top-p after top-k's renormalisation
        (0.0, "pytorch", [0, 1, 2]),
        (RHO, "pytorch", [0, 1, 2]),  # the PyTorch sampler: min-p never moves top-p
    ],
)
def test_a_min_p_request_in_the_batch_moves_top_p_on_flashinfer(flashinfer, neighbour_min_p, backend, kept):
    """Row 0 (top_k 3, top_p 0.7, min_p 0) beside row 1 (its neighbour, min_p as given): row 0's support and
    selected log-prob, SGLang's and the local engine's, against the hand-computed sets and masses."""
    logits = torch.tensor(PROBS).log().expand(2, -1).contiguous()
    params = [Truncation(3, 0.7, 0.0), Truncation(3, 0.7, neighbour_min_p)]
    torch.manual_seed(0)
    ids, supports, selected = sglang_masks(flashinfer, logits, params, backend)
    mass = sum(PROBS[t] for t in kept)
    assert supports == [kept, kept]
    for b in range(2):
        assert float(selected[b]) == pytest.approx(math.log(PROBS[int(ids[b])] / mass), abs=1e-6)
    tokens, _, _, masks = sample_rows(rows_of(params), logits.clone(), backend=backend)
    for b in range(2):
        support, logprob = masks[b]
        assert sorted(support) == kept and tokens[b] in kept
        assert logprob == pytest.approx(math.log(PROBS[tokens[b]] / mass), abs=1e-6)


def test_the_same_token_falls_in_different_supports_with_dvp_on_and_off(flashinfer):
    """The numbers the issue names: token 0's selected log-prob is log(0.40 / 0.80) = −0.6931 with DVP off and
    log(0.40 / 0.65) = −0.4855 with DVP on (min_p = ρ), through SGLang's code and the local engine."""
    logits = torch.tensor(PROBS).log()[None]
    probs = torch.softmax(logits[0], dim=-1)
    for min_p, want in ((0.0, -0.693147), (RHO, -0.485508)):
        rule = batch_rule("flashinfer", [Truncation(3, 0.7, min_p)])
        weights, _ = flashinfer_weights(probs, Truncation(3, 0.7, min_p), rule)
        assert float(torch.log(weights[0] / weights.sum())) == pytest.approx(want, abs=1e-5)
        for seed in range(40):  # SGLang draws: when it draws token 0, its selected log-prob is `want`
            torch.manual_seed(seed)
            token, _, selected = sglang_masks(flashinfer, logits, [Truncation(3, 0.7, min_p)], "flashinfer")
            if int(token[0]) == 0:
                assert float(selected[0]) == pytest.approx(want, abs=1e-5)
                break
        else:
            raise AssertionError("token 0 (p = 0.5 or 0.62) was never drawn in 40 tries")


def test_ties_at_the_top_k_cutoff_are_kept_by_flashinfer_only(flashinfer):
    """logits [4, 3, 2, 2, 2, 1, 0, −1], top_k = 3: flashinfer keeps every probability ≥ the third (5 ids,
    more than top_k: what overflows SGLang's mask cap), the PyTorch sampler ranks 0..2."""
    logits = torch.tensor([[4.0, 3.0, 2.0, 2.0, 2.0, 1.0, 0.0, -1.0]])
    params = [Truncation(3, 1.0, 0.0)]
    for backend, size in (("flashinfer", 5), ("pytorch", 3)):
        torch.manual_seed(0)
        _, supports, _ = sglang_masks(flashinfer, logits, params, backend)
        _, _, _, masks = sample_rows(rows_of(params), logits.clone(), backend=backend)
        assert len(supports[0]) == len(masks[0][0]) == size
        if backend == "flashinfer":
            assert supports[0] == sorted(masks[0][0]) == [0, 1, 2, 3, 4]
        else:  # which of the tied three the sort puts first is the sort's: the same sort on both sides
            assert supports[0] == sorted(masks[0][0])


BATCHES = {  # (top_k, top_p, min_p) per group of rows: the flashinfer rule is one per batch
    "joint": [(20, 0.8, 0.0), (50, 1.0, 0.0), (64, 0.5, 0.0), (TOP_K_ALL, 0.9, 0.0)],
    "renorm-dvp": [(20, 0.8, RHO), (50, 0.95, RHO), (300, 0.9, RHO), (8, 1.0, 0.05)],
    "renorm-mixed": [(20, 0.8, 0.0), (64, 0.5, 0.0), (30, 0.9, RHO), (TOP_K_ALL, 0.7, 0.0)],
}


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("batch", sorted(BATCHES))
def test_supports_and_selected_logprobs_equal_sglangs_flashinfer_branch(flashinfer, batch, temperature):
    """64 rows of 300 random logits, 16 per truncation of the batch: per row the same support as SGLang's
    capture, and the local engine's log-prob of SGLang's token equals SGLang's selected one."""
    gen = torch.Generator().manual_seed(len(batch))
    logits = torch.randn(64, 300, generator=gen) * 3.0
    logits[:4, :3] += 12.0  # peaked rows: top-p keeps one or two tokens
    params = [Truncation(*BATCHES[batch][i % 4]) for i in range(64)]
    torch.manual_seed(0)
    ids, supports, selected = sglang_masks(flashinfer, logits, params, "flashinfer", temperature)
    rule = batch_rule("flashinfer", params)
    assert rule == ("joint" if batch == "joint" else "renorm")
    tokens, _, _, masks = sample_rows(rows_of(params, temperature), logits.clone(), backend="flashinfer")
    moved = 0
    for i in range(64):
        support = masks[i][0]
        assert sorted(support) == supports[i], f"row {i}: support"
        probs = torch.softmax(logits[i] / temperature, dim=-1)
        weights, order = flashinfer_weights(probs, params[i], rule)
        pos = order.tolist().index(int(ids[i]))
        ours = torch.log(weights[pos] / weights.sum(dtype=torch.float32))
        torch.testing.assert_close(ours, selected[i], rtol=0, atol=1e-6)
        assert tokens[i] in support
        pytorch_weights, pytorch_order = truncated_weights(probs.clone(), params[i])
        moved += sorted(pytorch_order[pytorch_weights > 0].tolist()) != supports[i]
    if batch == "joint":
        assert moved == 0, "without min-p flashinfer keeps what the PyTorch sampler keeps (no ties here)"
    else:
        assert moved >= 8, "with min-p in the batch, top-p < 1 rows keep other supports than PyTorch's"


def test_an_unknown_backend_is_refused_by_name():
    with pytest.raises(
        ValueError, match=r"sampling backend must be one of \('flashinfer', 'pytorch'\); got 'x'"
    ):
        batch_rule("x", [])
