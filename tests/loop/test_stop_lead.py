"""The trainer's warning when a step plus its checkpoint outgrew the stop lead rl.sbatch gave it."""

from __future__ import annotations

from megatron_tail.train.run.signals import STOP_LEAD_ENV, stop_lead_s, stop_lead_warning


def test_stop_lead_comes_from_the_environment():
    assert stop_lead_s({STOP_LEAD_ENV: "1680"}) == 1680.0
    assert stop_lead_s({}) is None
    assert stop_lead_s({STOP_LEAD_ENV: "soon"}) is None
    assert stop_lead_s({STOP_LEAD_ENV: "0"}) is None


def test_warns_only_when_step_plus_checkpoint_exceed_the_lead():
    assert stop_lead_warning(600.0, 100.0, 900.0) is None
    assert stop_lead_warning(600.0, 100.0, None) is None
    warning = stop_lead_warning(850.0, 120.0, 900.0)
    assert warning is not None
    assert "(850 s) plus its checkpoint (120 s) took 970 s, more than the 900 s" in warning
    assert "MT_STOP_BUDGET" in warning
