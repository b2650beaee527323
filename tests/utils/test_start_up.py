"""`utils.start_up.collector_paused`: the collector off inside, the objects alive at its end frozen, the
collector back on; a nested or already-disabled use changes nothing; an exception inside still restores it."""

from __future__ import annotations

import gc

import pytest

from megatron_tail.utils.start_up import collector_paused


@pytest.fixture(autouse=True)
def _restore_collector():
    enabled = gc.isenabled()
    yield
    gc.enable() if enabled else gc.disable()


class _Cycle:
    def __init__(self):
        self.me = self


def test_the_collector_is_on_for_the_tests_and_what_collection_imported_is_frozen():
    """tests/conftest.py keeps it off while collection imports, then freezes and switches it on."""
    assert gc.isenabled() and gc.get_freeze_count() > 100_000


def test_inside_the_collector_is_off_and_what_was_made_is_frozen_after():
    gc.enable()
    frozen = gc.get_freeze_count()
    with collector_paused():
        assert not gc.isenabled()
        kept = [_Cycle() for _ in range(1000)]
    assert gc.isenabled()
    assert gc.get_freeze_count() >= frozen + len(kept)
    assert not any(gc.is_tracked(k) and k in gc.get_objects(generation=2) for k in kept[:3])


def test_nested_and_already_disabled_uses_leave_the_collector_as_they_found_it():
    gc.enable()
    with collector_paused():
        with collector_paused():
            pass
        assert not gc.isenabled()  # the inner one does not switch it back on early
    assert gc.isenabled()
    gc.disable()
    frozen = gc.get_freeze_count()
    with collector_paused():
        _Cycle()
    assert not gc.isenabled() and gc.get_freeze_count() == frozen


def test_an_error_inside_still_switches_the_collector_back_on():
    gc.enable()
    with pytest.raises(ValueError), collector_paused():
        raise ValueError("a user's mistake at load")
    assert gc.isenabled()
