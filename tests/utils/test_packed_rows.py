"""`utils.packed_rows`: number lists as two tensors for a checkpoint, back exactly (values and Python
types) through `torch.save` / `torch.load(weights_only=True)`; what cannot come back exactly stays lists."""

from __future__ import annotations

import io

import pytest
import torch

from megatron_tail.utils.packed_rows import MARK, pack_rows, unpack_rows


def _through_a_checkpoint(state):
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


@pytest.mark.parametrize(
    "rows, dtype",
    [
        ([[151_935, 0, 7], [], [2**63 - 1, -(2**63)]], torch.int64),
        ([[-0.5, -0.0, 5e-324, float("inf"), float("nan")], [1e308]], torch.float64),
        ([[True, False], [False]], torch.bool),
        ([[], []], torch.int64),
        ([], torch.int64),
    ],
)
def test_number_lists_come_back_exactly(rows, dtype):
    packed = pack_rows(rows)
    assert packed[MARK].dtype == dtype and packed["sizes"].tolist() == [len(r) for r in rows]
    back = unpack_rows(_through_a_checkpoint(packed))
    assert repr(back) == repr(rows)  # values, signs of zero, NaN, and each entry's Python type
    assert [type(x) for r in back for x in r] == [type(x) for r in rows for x in r]


@pytest.mark.parametrize(
    "rows",
    [
        [[1, 2.5]],  # mixed int and float: tolist() would give floats
        [[1], None],  # a sample without the field
        [["3", "4"]],  # versions the engines sent as text
        [[2**63]],  # past int64
        [[[1, 2]]],  # nested
        [(1, 2)],  # tuples are not lists
        [1.0, 0.0],  # one number per sample (rewards): nothing to gain
        None,
    ],
)
def test_what_cannot_come_back_exactly_stays_as_it_is(rows):
    assert pack_rows(rows) is rows
    assert unpack_rows(rows) is rows
