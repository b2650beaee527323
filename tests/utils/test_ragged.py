"""`utils.ragged.Ragged` against dense references: every constructor, densify, row selection, joining, and the
trips a support makes (`dataclasses.asdict` into a checkpoint and back, `torch.save`/`load(weights_only)`)."""

from __future__ import annotations

import dataclasses
import io
import random

import pytest
import torch

from megatron_tail.utils.ragged import Ragged, cat_rows, scatter_rows
from tests.ops.test_no_scalar_reads import _NoScalarReads


def _rows(seed: int, n: int, widest: int = 9) -> list[list[int]]:
    rng = random.Random(seed)
    return [rng.sample(range(1000), rng.randint(0, widest)) for _ in range(n)]


def _dense_reference(rows: list[list[int]], width: int, fill: int = -1) -> torch.Tensor:
    out = torch.full((len(rows), width), fill, dtype=torch.int32)
    for r, ids in enumerate(rows):
        out[r, : len(ids)] = torch.tensor(ids, dtype=torch.int32)
    return out


def test_from_lists_dense_and_rows_match_the_lists():
    rows = _rows(0, 40)
    ragged = Ragged.from_lists(rows)
    assert len(ragged) == 40 and ragged.nnz == sum(map(len, rows)) and ragged.width == max(map(len, rows))
    assert torch.equal(ragged.dense(), _dense_reference(rows, ragged.width))
    assert torch.equal(ragged.dense(12, fill=0, dtype=torch.int64), _dense_reference(rows, 12, 0).long())
    assert [ragged.row(r).tolist() for r in range(40)] == rows
    assert ragged.sizes.tolist() == [len(r) for r in rows]
    assert ragged.nbytes == 4 * ragged.nnz + 8 * 41
    with pytest.raises(ValueError, match=f"width 2 cannot hold the longest row \\({ragged.width} ids\\)"):
        ragged.dense(2)
    assert ragged.values.dtype == torch.int32 and len(Ragged.from_lists([])) == 0
    with pytest.raises(OverflowError):  # an id past int32 is refused, not wrapped
        Ragged.from_lists([[1, 2**31]])


def test_from_dense_drops_the_padding():
    rows = _rows(1, 25)
    dense = _dense_reference(rows, 11)
    ragged = Ragged.from_dense(dense)
    assert [ragged.row(r).tolist() for r in range(25)] == rows and ragged.width == max(map(len, rows))
    assert Ragged.from_dense(torch.zeros((0, 5), dtype=torch.int32)).width == 0


def test_empty_rows_and_an_empty_densify():
    ragged = Ragged.empty_rows(3)
    assert len(ragged) == 3 and ragged.nnz == 0 and ragged.dense().shape == (3, 0)
    assert torch.equal(ragged.dense(2), torch.full((3, 2), -1, dtype=torch.int32))


def test_index_select_takes_rows_in_the_given_order():
    rows = _rows(2, 30)
    index = torch.tensor([5, 0, 29, 5, 17, 3])
    picked = Ragged.from_lists(rows).index_select(index)
    assert [picked.row(r).tolist() for r in range(len(index))] == [rows[i] for i in index.tolist()]
    assert picked.width == max(len(rows[i]) for i in index.tolist())


def test_cat_rows_and_scatter_rows():
    a, b = _rows(3, 7), _rows(4, 5)
    joined = cat_rows([Ragged.from_lists(a), Ragged.from_lists(b)])
    assert [joined.row(r).tolist() for r in range(12)] == a + b
    scattered = scatter_rows([(2, Ragged.from_lists(a)), (10, Ragged.from_lists(b))], 20)
    expected = [[]] * 2 + a + [[]] + b + [[]] * 5
    assert [scattered.row(r).tolist() for r in range(20)] == expected
    with pytest.raises(ValueError, match="overlap"):
        scatter_rows([(2, Ragged.from_lists(a)), (5, Ragged.from_lists(b))], 20)
    with pytest.raises(ValueError, match="exceed 12 rows"):
        scatter_rows([(10, Ragged.from_lists(b))], 12)


def test_a_checkpoint_round_trip():
    ragged = Ragged.from_lists(_rows(5, 10))
    buffer = io.BytesIO()
    torch.save({"supports": [dataclasses.asdict(ragged)]}, buffer)
    buffer.seek(0)
    (state,) = torch.load(buffer, weights_only=True)["supports"]
    back = Ragged.from_dict(state)
    assert torch.equal(back.values, ragged.values) and torch.equal(back.offsets, ragged.offsets)
    assert back.width == ragged.width and Ragged.from_dict(back) is back
    # a checkpoint written before the ragged layout held `[rows, K]` int32 ids padded with −1
    old = Ragged.from_dict(_dense_reference(_rows(5, 10), 12))
    assert torch.equal(old.values, ragged.values) and torch.equal(old.offsets, ragged.offsets)


def test_dense_reads_nothing_back():
    """Densifying runs in the forward step on the device: no `.item()`/`nonzero` (each a sync on CUDA)."""
    ragged = Ragged.from_lists(_rows(6, 50))
    with _NoScalarReads():
        out = ragged.dense()
    assert torch.equal(out, _dense_reference(_rows(6, 50), ragged.width))
