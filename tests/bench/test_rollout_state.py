"""The rollout-state benchmark's CPU run: both layouts round-trip the groups (`measure` checks it) and the
table holds both rows and their ratios."""

from __future__ import annotations

from megatron_tail.bench import rollout_state


def test_both_layouts_round_trip_and_print_their_ratios(capsys):
    argv = ["--groups", "2", "--samples", "2", "--tokens", "64", "--repeats", "1"]
    assert rollout_state.main(argv) == 0
    out = capsys.readouterr().out
    for row in ("| lists |", "| packed |", "| lists ÷ packed |", "projected, not measured"):
        assert row in out, out
