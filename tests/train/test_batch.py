"""Micro-batch layout: targets, loss mask, THD boundaries, fields, sample layout; packing by a token budget
balanced over DP ranks."""

from __future__ import annotations

import pytest
import torch

from megatron_tail.train import Sample, make_micro_batches, pack_micro_batches, split_for_data_parallel
from megatron_tail.train.engine.forward import thd_params
from megatron_tail.train.engine.packing import balance_over_data_parallel, pack_by_token_budget
from tests.train.common import per_sample


def _samples():
    return [
        Sample([1, 2], [3, 4, 5], {"adv": torch.tensor([0.1, 0.2, 0.3])}),
        Sample([6], [7, 8], {"adv": torch.tensor([0.4, 0.5])}),
        Sample([9, 10, 11], [12], {"adv": torch.tensor([0.6])}),
    ]


def test_padded_layout():
    (mb,) = make_micro_batches(_samples(), micro_batch_size=3)
    assert mb.shape == (3, 5)
    assert mb.tokens[0].tolist() == [1, 2, 3, 4, 5]
    assert mb.targets[0].tolist() == [2, 3, 4, 5, 0]
    assert mb.loss_mask[0].tolist() == [False, True, True, True, False]  # positions predicting 3, 4, 5
    assert mb.fields["adv"][0].tolist() == pytest.approx([0, 0.1, 0.2, 0.3, 0])
    assert mb.loss_mask[2].tolist() == [False, False, True, False, False]
    # padding: the positions no sample token takes (the routers' `padding_mask`)
    assert mb.padding.int().tolist() == [[0, 0, 0, 0, 0], [0, 0, 0, 1, 1], [0, 0, 0, 0, 1]]
    assert mb.cu_seqlens is None and not mb.packed
    assert mb.num_loss_tokens == 6 and mb.num_sample_tokens == 12 and mb.num_slots == 15


def test_packed_layout_is_one_thd_row_with_boundaries():
    # longest first (first-fit decreasing): sample 0 (5 tokens), then 2 (4), then 1 (3)
    (mb,) = pack_micro_batches(_samples(), max_tokens=14, pad_to_multiple=7)
    assert mb.shape == (1, 14) and mb.packed
    assert mb.sample_ids.tolist() == [0, 2, 1]
    assert mb.tokens[0].tolist() == [1, 2, 3, 4, 5, 9, 10, 11, 12, 6, 7, 8, 0, 0]
    # trailing padding is a block of its own; the boundaries are int32, also kept as ints
    assert mb.cu_seqlens == (0, 5, 9, 12, 14)
    params = thd_params(mb)
    assert params.cu_seqlens_q.tolist() == [0, 5, 9, 12, 14] and params.cu_seqlens_q.dtype == torch.int32
    assert params.cu_seqlens_host == (0, 5, 9, 12, 14) and params.max_seqlen_q == 5
    # the last token of a sequence predicts nothing (not the next sequence's first token)
    assert mb.targets[0, 4].item() == 0 and not mb.loss_mask[0, 4]
    assert mb.sample_index[0].tolist() == [-1, 0, 0, 0, -1, -1, -1, 2, -1, 1, 1, -1, -1, -1]
    assert mb.num_sample_tokens == 12 and mb.num_slots == 14
    assert mb.padding[0].int().tolist() == [0] * 12 + [1, 1]


def test_token_budget_packing_is_first_fit_decreasing():
    lengths = [9, 2, 7, 3, 5, 4]
    bins = pack_by_token_budget(lengths, 10)
    assert bins == [[0], [2, 3], [4, 5], [1]]
    assert all(sum(lengths[i] for i in b) <= 10 for b in bins)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    with pytest.raises(ValueError, match=r"sample 0 takes 9 tokens.*max_tokens_per_micro_batch=8"):
        pack_by_token_budget(lengths, 8)


def test_skewed_lengths_give_every_dp_rank_the_same_micro_batch_count():
    # one long sample and many short ones: the long one fills a micro-batch alone
    lengths = [60] + [3] * 9
    bins = pack_by_token_budget(lengths, 64)
    assert len(bins) == 2
    per_rank = balance_over_data_parallel(bins, lengths, 4)
    assert [len(r) for r in per_rank] == [1, 1, 1, 1]  # two ranks get an empty micro-batch
    assert sum(1 for r in per_rank for b in r if not b) == 2
    # every sample exactly once over the ranks
    assert sorted(i for r in per_rank for b in r for i in b) == list(range(len(lengths)))
    # balanced by tokens: 10 bins over 3 ranks, loads within the largest bin
    lengths = [7, 6, 6, 5, 5, 4, 4, 3, 2, 1]
    per_rank = balance_over_data_parallel([[i] for i in range(10)], lengths, 3)
    assert [len(r) for r in per_rank] == [4, 4, 4]
    loads = [sum(lengths[i] for b in r for i in b) for r in per_rank]
    assert max(loads) - min(loads) <= max(lengths)
    samples = [Sample([1] * (n - 1), [2]) for n in [60] + [3] * 9]
    counts = [len(pack_micro_batches(samples, max_tokens=64, dp_rank=r, dp_size=4)) for r in range(4)]
    assert counts == [1, 1, 1, 1]
    empty = pack_micro_batches(samples, max_tokens=64, dp_rank=3, dp_size=4, pad_to_multiple=2)[0]
    assert empty.shape == (1, 2) and empty.num_loss_tokens == 0 and len(empty.sample_ids) == 0
    assert empty.padding.all()


def test_padded_micro_batches_share_a_shape_and_rows_pad_empty():
    mbs = make_micro_batches(_samples(), micro_batch_size=2, seq_len=7, pad_to_multiple=4)
    assert [mb.shape for mb in mbs] == [(2, 8), (2, 8)]
    assert not mbs[1].loss_mask[1].any()  # empty filler row
    assert mbs[1].padding[1].all() and int((~mbs[0].padding).sum()) == mbs[0].num_sample_tokens


def test_sample_layout_gathers_responses_in_order():
    for mb in (
        *make_micro_batches(_samples(), micro_batch_size=3),
        *pack_micro_batches(_samples(), max_tokens=99),
    ):
        order = mb.sample_ids.tolist()
        assert sorted(order) == [0, 1, 2]
        mb.sample_ids, perm = torch.tensor([0, 1, 2]), torch.tensor([order.index(i) for i in range(3)])
        mb.sample_rows, mb.sample_cols, mb.sample_valid = (
            x[perm] for x in (mb.sample_rows, mb.sample_cols, mb.sample_valid)
        )
        adv = mb.to_samples(mb.fields["adv"])
        assert adv.shape == (3, 3)
        assert mb.sample_valid.tolist() == [[True] * 3, [True, True, False], [True, False, False]]
        torch.testing.assert_close(adv, torch.tensor([[0.1, 0.2, 0.3], [0.4, 0.5, 0], [0.6, 0, 0]]))
        targets = mb.to_samples(mb.targets)
        assert targets.tolist() == [[3, 4, 5], [7, 8, 0], [12, 0, 0]]
        per = per_sample([mb], [mb.fields["adv"]])
        torch.testing.assert_close(per[1], torch.tensor([0.4, 0.5]))


def test_to_samples_is_differentiable():
    (mb,) = pack_micro_batches(_samples(), max_tokens=12)
    x = torch.randn(mb.shape, requires_grad=True)
    mb.to_samples(x).sum().backward()
    assert torch.equal(x.grad.bool(), mb.loss_mask)


def test_errors_name_the_problem():
    with pytest.raises(ValueError, match="longer than seq_len=4"):
        make_micro_batches(_samples(), micro_batch_size=1, seq_len=4)
    with pytest.raises(ValueError, match="empty response"):
        make_micro_batches([Sample([1], [])], micro_batch_size=1)
    with pytest.raises(ValueError, match="field 'adv' has shape"):
        make_micro_batches([Sample([1], [2, 3], {"adv": torch.zeros(3)})], micro_batch_size=1)
    with pytest.raises(ValueError, match="not divisible by data_parallel=2"):
        split_for_data_parallel(_samples(), 0, 2)
    assert [s.prompt for s in split_for_data_parallel(_samples()[:2], 1, 2)] == [[6]]


def test_a_per_token_support_field_is_padded_to_the_micro_batchs_widest():
    """A `[len(response), K_i]` field (the sampling support, ids + 1) lands at the positions predicting its
    tokens, zero-padded to the widest K and zero off the response, padded or packed."""
    samples = [
        Sample([1, 2], [3, 4], {"support": torch.tensor([[4, 5], [6, 0]], dtype=torch.int32)}),
        Sample([6], [7, 8, 9], {"support": torch.tensor([[8], [9], [10]], dtype=torch.int32)}),
    ]
    (padded,) = make_micro_batches(samples, micro_batch_size=2)
    (packed,) = pack_micro_batches(samples, max_tokens=16)
    assert padded.fields["support"].shape == (2, 4, 2) and packed.fields["support"].shape == (1, 8, 2)
    assert padded.fields["support"][0].tolist() == [[0, 0], [4, 5], [6, 0], [0, 0]]
    assert padded.fields["support"][1].tolist() == [[8, 0], [9, 0], [10, 0], [0, 0]]
    rows = packed.to_samples(packed.fields["support"][..., 0])
    order = packed.sample_ids.tolist()
    assert rows[order.index(0)].tolist()[:2] == [4, 6] and rows[order.index(1)].tolist() == [8, 9, 10]
    with pytest.raises(ValueError, match=r"field 'support' has shape \(3, 1\), expected \(2, \.\.\.\)"):
        make_micro_batches([Sample([1], [2, 3], {"support": torch.zeros(3, 1)})], micro_batch_size=1)


def test_a_ragged_field_lands_row_by_position_at_the_micro_batchs_width():
    """A `Ragged` field (the sampling support) becomes `b·s` rows in position order, each token's own ids at
    the position predicting it and no row elsewhere; densified at the micro-batch's widest row. A CP shard
    takes its positions' rows and densifies at its own widest."""
    from megatron_tail.train.engine.context_parallel import split_for_context_parallel
    from megatron_tail.train.engine.forward import SAMPLING_SUPPORT_FIELD, sampling_support
    from megatron_tail.utils.ragged import Ragged

    rows0, rows1 = [[3, 40, 41], [4]], [[7], [8, 9], [9, 50, 51, 52, 53]]
    samples = [
        Sample([1, 2], [3, 4], {SAMPLING_SUPPORT_FIELD: Ragged.from_lists(rows0)}),
        Sample([6], [7, 8, 9], {SAMPLING_SUPPORT_FIELD: Ragged.from_lists(rows1)}),
    ]
    (padded,) = make_micro_batches(samples, micro_batch_size=2)
    dense = sampling_support(padded)
    assert dense.shape == (2, 4, 5) and dense.dtype == torch.int32
    assert dense[0].tolist() == [[-1] * 5, [3, 40, 41, -1, -1], [4, -1, -1, -1, -1], [-1] * 5]
    assert dense[1].tolist() == [[7, -1, -1, -1, -1], [8, 9, -1, -1, -1], [9, 50, 51, 52, 53], [-1] * 5]
    (packed,) = pack_micro_batches(samples, max_tokens=16, sequence_multiple=4, pad_to_multiple=4)
    whole = sampling_support(packed)[0]
    assert packed.fields[SAMPLING_SUPPORT_FIELD].nnz == 12 and whole.shape == (8, 5)
    assert whole[packed.loss_mask[0]].tolist() == sampling_support(padded)[padded.loss_mask].tolist()
    for r in range(2):
        shard = split_for_context_parallel(packed, r, 2)
        mine = sampling_support(shard)[0]
        width = mine.shape[1]
        assert width == int((whole[shard.cp.index] >= 0).sum(dim=1).max())  # its own widest row
        assert torch.equal(mine, whole[shard.cp.index, :width])
        assert bool((whole[shard.cp.index, width:] == -1).all())
    with pytest.raises(ValueError, match="ragged field 'support' has 1 rows, expected 2"):
        make_micro_batches([Sample([1], [2, 3], {"support": Ragged.from_lists([[2]])})], micro_batch_size=1)


def test_micro_batches_without_a_support_id_reach_the_op():
    """A DP rank's empty micro-batch and a CP shard holding no response token densify to K = 0, and the op
    takes that: its rows keep the safe set (before, reshape(-1, 0) raised in the op)."""
    from megatron_tail.ops import vocab_parallel_masked_logprobs
    from megatron_tail.train.engine.context_parallel import split_for_context_parallel
    from megatron_tail.train.engine.forward import SAMPLING_SUPPORT_FIELD, sampling_support
    from megatron_tail.utils.ragged import Ragged

    one = [Sample([1, 2, 3, 4, 5, 6, 7], [8], {SAMPLING_SUPPORT_FIELD: Ragged.from_lists([[8, 9]])})]
    (empty,) = pack_micro_batches(
        one, max_tokens=8, dp_rank=1, dp_size=2, pad_to_multiple=4, sequence_multiple=4
    )
    (whole,) = pack_micro_batches(one, max_tokens=8, pad_to_multiple=4, sequence_multiple=4)
    shards = [split_for_context_parallel(whole, r, 2) for r in range(2)]
    without = [mb for mb in (empty, *shards) if not mb.num_loss_tokens]
    assert len(without) == 2  # the empty micro-batch and the shard without the response token
    for mb in without:
        support = sampling_support(mb)
        assert support.shape == (*mb.shape, 0)
        logits = torch.randn(*mb.shape, 16)
        out = vocab_parallel_masked_logprobs(logits, mb.targets, log_rho=-2.0, sampling_support=support)
        plain = vocab_parallel_masked_logprobs(logits, mb.targets, log_rho=-2.0)
        assert torch.equal(out.logprobs, plain.logprobs)


def test_routes_compacted_to_different_dtypes_keep_every_expert_id_in_a_micro_batch():
    """Each sample's routes take the smallest dtype of its own largest id (uint8 below 256, int16 above:
    `compact_routes`). Before, a micro-batch took its first sample's dtype, so in a model of more than 256
    experts expert 300 of a later sample became expert 44 (300 − 256), in both layouts, silently."""
    import numpy as np

    from megatron_tail.rollout.routes import RoutesError, compact_routes

    def sample(prompt, response, top):
        n = len(prompt) + len(response)
        ids = np.tile(np.array([[[0, top]]], dtype=np.int32), (n, 2, 1))  # [positions, layers, k]
        return Sample(
            prompt, response, {"adv": torch.zeros(len(response))}, position_fields={"r": compact_routes(ids)}
        )

    samples = [sample([1, 2], [3, 4], 100), sample([5], [6, 7], 300)]
    assert [s.position_fields["r"].dtype for s in samples] == [torch.uint8, torch.int16]
    padded = make_micro_batches(samples, micro_batch_size=2)[0].fields["r"]
    packed = pack_micro_batches(samples, max_tokens=16)[0].fields["r"]
    assert padded.dtype == packed.dtype == torch.int16
    assert padded[1, :3, :, 1].unique().tolist() == [300] and padded[0, :4, :, 1].unique().tolist() == [100]
    assert packed[0, 4:7, :, 1].unique().tolist() == [300]
    with pytest.raises(RoutesError, match=r"expert ids must be ≥ 0; got -1"):  # uint8 would make it 255
        compact_routes(np.full((2, 1, 2), -1, dtype=np.int32))
