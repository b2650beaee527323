"""`eos_id_entries` reads an `eos_token_id` as the load check and the local engine need it."""

from __future__ import annotations

import pytest

from megatron_tail.utils.eos import eos_id_entries


@pytest.mark.parametrize(
    ("value", "entries"),
    [(None, []), (7, [7]), ([7, 9], [7, 9]), ((7,), [7]), ([None], []), ([None, 5], [5]), ("2", ["2"])],
)
def test_eos_id_entries(value, entries):
    assert eos_id_entries(value) == entries
