"""Micro-batch layout: targets, loss mask, restarted positions, block-diagonal mask, fields, sample layout."""

from __future__ import annotations

import pytest
import torch

from megatron_tail.train import Sample, make_micro_batches, split_for_data_parallel
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
    causal = ~torch.ones(5, 5, dtype=torch.bool).tril()
    assert torch.equal(mb.attention_mask[0, 0], causal)
    assert mb.num_loss_tokens == 6


def test_packed_layout_restarts_positions_and_blocks_attention():
    (mb,) = make_micro_batches(_samples(), micro_batch_size=1, seq_len=12, packed=True)
    assert mb.shape == (1, 12)
    assert mb.tokens[0].tolist() == [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]
    assert mb.position_ids[0].tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 0, 1, 2, 3]
    # the last token of a sequence predicts nothing (not the next sequence's first token)
    assert mb.targets[0, 4].item() == 0 and not mb.loss_mask[0, 4]
    assert mb.sample_index[0].tolist() == [-1, 0, 0, 0, -1, 1, 1, -1, -1, -1, 2, -1]
    mask = mb.attention_mask[0, 0]
    assert mask[5, 4] and mask[5, 0] and not mask[5, 5]  # sample 1 sees only itself
    assert not mask[7, 5] and mask[8, 7]


def test_micro_batches_share_a_shape_and_rows_pad_empty():
    mbs = make_micro_batches(_samples(), micro_batch_size=2, seq_len=8)
    assert [mb.shape for mb in mbs] == [(2, 8), (2, 8)]
    assert not mbs[1].loss_mask[1].any()  # empty filler row


def test_sample_layout_gathers_responses_in_order():
    for packed in (False, True):
        (mb,) = make_micro_batches(_samples(), micro_batch_size=3, seq_len=12, packed=packed)
        assert mb.sample_ids.tolist() == [0, 1, 2]
        adv = mb.to_samples(mb.fields["adv"])
        assert adv.shape == (3, 3)
        assert mb.sample_valid.tolist() == [[True] * 3, [True, True, False], [True, False, False]]
        torch.testing.assert_close(adv, torch.tensor([[0.1, 0.2, 0.3], [0.4, 0.5, 0], [0.6, 0, 0]]))
        targets = mb.to_samples(mb.targets)
        assert targets.tolist() == [[3, 4, 5], [7, 8, 0], [12, 0, 0]]
        per = per_sample([mb], [mb.fields["adv"]])
        torch.testing.assert_close(per[1], torch.tensor([0.4, 0.5]))


def test_to_samples_is_differentiable():
    (mb,) = make_micro_batches(_samples(), micro_batch_size=1, seq_len=12, packed=True)
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
