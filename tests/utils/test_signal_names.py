"""How a process ended, named in messages: `utils.errors.signal_name`, which every "killed by" line uses
(the launcher's, the local engine's, the demo's, the checkpoint writers')."""

from __future__ import annotations

import signal

from megatron_tail.demo.run import training_failed
from megatron_tail.train.run.supervise import TrainingOutcome
from megatron_tail.utils.errors import signal_name


def test_signals_are_named_real_time_ones_by_their_offset_and_other_numbers_as_numbers():
    assert signal_name(9) == "SIGKILL" and signal_name(int(signal.SIGTERM)) == "SIGTERM"
    assert signal_name(int(signal.SIGRTMIN)) == "SIGRTMIN"  # its own name, as SIGRTMAX
    assert signal_name(int(signal.SIGRTMIN) + 3) == "SIGRTMIN+3"  # the launcher's death (`launch_marks`)
    assert signal_name(int(signal.SIGRTMAX) + 1) == f"signal {int(signal.SIGRTMAX) + 1}"


def test_a_demo_whose_launcher_a_real_time_signal_killed_says_so_and_exits_as_a_shell_would(capsys):
    number = int(signal.SIGRTMIN) + 3
    assert training_failed(TrainingOutcome(code=-number, stopped_by=None), " (dvp)") == 128 + number
    assert capsys.readouterr().out == (
        "the training (dvp) launcher was killed by SIGRTMIN+3; its ranks stop after their current step and "
        "save a checkpoint (rerun the command to resume)\n"
    )
    assert training_failed(TrainingOutcome(code=-9, stopped_by=None)) == 137
    assert "launcher was killed by SIGKILL;" in capsys.readouterr().out
