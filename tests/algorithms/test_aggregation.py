import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_tail.algorithms.aggregation import AGGREGATION_MODES, LossCounts, aggregate, local_counts
from tests.algorithms.references import ref_aggregate

MAX_LEN = 11


def _data(seed, B=8, T=7):
    g = torch.Generator().manual_seed(seed)
    loss = torch.randn(B, T, generator=g, dtype=torch.float64)
    lengths = torch.randint(0, T + 1, (B,), generator=g)
    lengths[0] = T
    mask = torch.arange(T)[None] < lengths[:, None]
    return loss, mask


@pytest.mark.parametrize("mode", AGGREGATION_MODES)
def test_modes_match_float64_reference(mode):
    loss, mask = _data(0)
    counts = local_counts(mask)
    got = aggregate(loss, mask, mode, counts=counts, max_len=MAX_LEN)
    want = ref_aggregate(
        loss.tolist(), mask.tolist(), mode, int(mask.sum()), int(mask.any(-1).sum()), MAX_LEN
    )
    assert got.item() == pytest.approx(want, rel=1e-14)


def test_known_values():
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[True, True, True], [True, False, False]])
    c = local_counts(mask)
    assert (int(c.tokens), int(c.sequences)) == (4, 2)
    assert aggregate(loss, mask, "token_mean", counts=c).item() == pytest.approx(10 / 4)
    assert aggregate(loss, mask, "seq_mean_token_mean", counts=c).item() == pytest.approx((2 + 4) / 2)
    assert aggregate(loss, mask, "seq_mean_token_sum", counts=c, max_len=5).item() == pytest.approx(
        10 / (2 * 5)
    )


def _split_pieces(B, ranks, micro):
    """Contiguous row ranges: `ranks` DP ranks × `micro` micro-batches (uneven sizes allowed)."""
    bounds = torch.linspace(0, B, ranks * micro + 1).round().long().tolist()
    return [slice(a, b) for a, b in itertools.pairwise(bounds)]


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 10_000), st.sampled_from(AGGREGATION_MODES), st.integers(1, 3), st.integers(1, 3))
def test_dp_ranks_times_micro_batches_reproduce_single_batch(seed, mode, ranks, micro):
    loss, mask = _data(seed, B=9)
    weights = loss.clone().requires_grad_(True)  # the leaf we differentiate
    full = aggregate(weights * 1.5, mask, mode, counts=local_counts(mask), max_len=MAX_LEN)
    (g_full,) = torch.autograd.grad(full, weights)

    pieces = _split_pieces(mask.shape[0], ranks, micro)
    total_counts = LossCounts(0, 0)
    for rows in pieces:
        total_counts = total_counts + local_counts(mask[rows])
    # as the trainer does over DP: one all-reduce of the stacked counts
    total_counts = LossCounts.from_tensor(total_counts.to_tensor())
    summed = torch.zeros((), dtype=torch.float64)
    grads = torch.zeros_like(loss)
    for rows in pieces:
        # each micro-batch is padded to its own width: trailing all-invalid columns are cut off
        width = int(mask[rows].sum(-1).max()) if mask[rows].numel() else 0
        leaf = loss[rows, :width].clone().requires_grad_(True)
        part = aggregate(leaf * 1.5, mask[rows, :width], mode, counts=total_counts, max_len=MAX_LEN)
        part.backward()
        summed = summed + part.detach()
        grads[rows, :width] = leaf.grad if leaf.grad is not None else 0.0
    torch.testing.assert_close(summed, full.detach(), rtol=1e-13, atol=1e-15)
    torch.testing.assert_close(grads, g_full, rtol=1e-13, atol=1e-15)


def test_masked_positions_get_exactly_zero_gradient_even_with_nan():
    loss, mask = _data(3)
    loss = torch.where(mask, loss, torch.nan).requires_grad_(True)
    for mode in AGGREGATION_MODES:
        out = aggregate(loss * 2.0, mask, mode, counts=local_counts(mask), max_len=MAX_LEN)
        (g,) = torch.autograd.grad(out, loss)
        assert torch.isfinite(out)
        assert (g[~mask] == 0).all() and (g[mask] != 0).all()


def test_empty_mask_gives_zero_loss_not_nan():
    loss = torch.randn(2, 3, requires_grad=True)
    mask = torch.zeros(2, 3, dtype=torch.bool)
    for mode in AGGREGATION_MODES:
        out = aggregate(loss, mask, mode, counts=local_counts(mask), max_len=4)
        assert out.item() == 0.0


def test_counts_tensor_round_trip():
    c = local_counts(torch.tensor([[True, False], [False, False], [True, True]]))
    t = c.to_tensor()
    assert t.dtype == torch.float64 and t.tolist() == [3.0, 2.0]
    back = LossCounts.from_tensor(t)
    assert (float(back.tokens), float(back.sequences)) == (3.0, 2.0)
    with pytest.raises(ValueError, match=r"shape \(2,\)"):
        LossCounts.from_tensor(torch.zeros(3))


def test_bad_inputs_raise():
    loss, mask = _data(1)
    c = local_counts(mask)
    with pytest.raises(ValueError, match="must be one of"):
        aggregate(loss, mask, "mean", counts=c)
    with pytest.raises(ValueError, match="max_len must be an int ≥ 1 for 'seq_mean_token_sum'; got None"):
        aggregate(loss, mask, "seq_mean_token_sum", counts=c)
    with pytest.raises(ValueError, match="mask has shape"):
        aggregate(loss, mask[:, :3], "token_mean", counts=c)
    with pytest.raises(ValueError, match="mask must be a bool tensor"):
        aggregate(loss, mask.float(), "token_mean", counts=c)
    with pytest.raises(ValueError, match=r"counts\.tokens must be a scalar"):
        aggregate(loss, mask, "token_mean", counts=LossCounts(torch.ones(2), 1))
