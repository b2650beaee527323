"""The suite's scheduling tables name files and folders that exist: a renamed test file would otherwise lose
its early start without a word (`tests/conftest.py`, `LONGEST_FIRST`)."""

from __future__ import annotations

from pathlib import Path

from tests.conftest import LONGEST_FIRST, SERIAL_GROUPS, unit_of_work

REPO = Path(__file__).resolve().parents[1]


def test_every_file_named_to_start_first_is_a_test_file_and_its_own_unit():
    missing = [f for f in LONGEST_FIRST if not (REPO / f).is_file()]
    assert not missing, f"LONGEST_FIRST names files that do not exist: {missing}"
    assert len(set(LONGEST_FIRST)) == len(LONGEST_FIRST)
    assert all(unit_of_work(f"{f}::test") == f for f in LONGEST_FIRST)  # none inside a serial group


def test_every_serial_group_is_a_test_folder():
    for folder in SERIAL_GROUPS:
        assert list((REPO / folder).glob("test_*.py")), f"SERIAL_GROUPS: {folder} holds no test file"
