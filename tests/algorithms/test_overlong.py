"""DAPO's soft overlong punishment against its formula evaluated by hand at every boundary."""

from __future__ import annotations

import pytest
import torch

from megatron_tail.algorithms.overlong import overlong_penalty


def test_penalty_by_hand_at_the_boundaries():
    # L_max = 8, L_cache = 4: no penalty up to 4 tokens, then −1/4 per token, −1 at 8 (and beyond)
    lengths = torch.tensor([0, 3, 4, 5, 6, 7, 8, 9])
    got = overlong_penalty(lengths, max_len=8, buffer=4)
    assert got.tolist() == [0.0, 0.0, 0.0, -0.25, -0.5, -0.75, -1.0, -1.0]
    assert got.dtype == torch.float64
    scaled = overlong_penalty(lengths, max_len=8, buffer=4, factor=0.5)
    assert scaled.tolist() == [0.5 * v for v in got.tolist()]
    # the whole range as buffer: linear from the first token
    assert overlong_penalty(torch.tensor([0, 2, 4]), max_len=4, buffer=4).tolist() == [0.0, -0.5, -1.0]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"buffer": 0}, r"overlong buffer must be an int in \[1, max_len = 8\]; got 0"),
        ({"buffer": 9}, r"overlong buffer must be an int in \[1, max_len = 8\]; got 9"),
        ({"buffer": 2, "factor": -1.0}, r"overlong penalty factor must be ≥ 0; got -1.0"),
    ],
)
def test_bad_settings_name_the_value(kwargs, message):
    with pytest.raises(ValueError, match=message):
        overlong_penalty(torch.tensor([1]), max_len=8, **kwargs)
