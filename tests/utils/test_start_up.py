"""`utils.start_up.collector_paused`: the collector off inside, the objects alive at its end frozen, the
collector back on; a nested or already-disabled use changes nothing; an exception inside still restores it."""

from __future__ import annotations

import gc

import pytest

from megatron_tail.utils import start_up
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


class _Collector:
    """The `gc` functions `collector_paused` calls, on a state of their own: the real collector is the
    process's, and a thread another test left running (an engine's, a server's) may freeze or switch it
    meanwhile (a clean clone's suite once saw the freeze count move by 2 inside this test)."""

    def __init__(self, enabled: bool):
        self.enabled, self.calls = enabled, []

    def isenabled(self):
        return self.enabled

    def disable(self):
        self.calls.append("disable")
        self.enabled = False

    def enable(self):
        self.calls.append("enable")
        self.enabled = True

    def freeze(self):
        self.calls.append("freeze")


def test_nested_and_already_disabled_uses_leave_the_collector_as_they_found_it(monkeypatch):
    fake = _Collector(enabled=True)
    monkeypatch.setattr(start_up, "gc", fake)
    with collector_paused():
        with collector_paused():
            pass
        assert not fake.enabled  # the inner one does not switch it back on early
    assert fake.enabled and fake.calls == ["disable", "freeze", "enable"]  # the outer one only
    fake = _Collector(enabled=False)
    monkeypatch.setattr(start_up, "gc", fake)
    with collector_paused():
        _Cycle()
    assert not fake.enabled and fake.calls == []  # a caller's own disable: nothing frozen, nothing switched


def test_an_error_inside_still_switches_the_collector_back_on():
    gc.enable()
    with pytest.raises(ValueError), collector_paused():
        raise ValueError("a user's mistake at load")
    assert gc.isenabled()
