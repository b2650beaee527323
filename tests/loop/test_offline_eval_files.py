"""Where `megatron-tail eval` writes and what it keeps: results per eval set outside a checkpoint's export,
the export made once and reused under a lock, and a broken checkpoint named before anything reads it.

Before: the results went into `<checkpoint>/hf`, which each evaluation's export replaced, so a second
evaluation (another eval set, or a failed one) deleted the first one's `eval.json`; two evaluations started
together each replaced the export the other's engine was loading; and with `algorithm.log_rho: auto` a
checkpoint without its `common.pt` was a traceback (exit 1) instead of one line naming the file."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from megatron_tail.config import load_config
from megatron_tail.train.run import offline_eval
from megatron_tail.utils.errors import UserError
from tests.loop.conftest import loop_overrides


def _config(model_dir, prompt_file, run_dir, **extra):
    return load_config(
        None, loop_overrides(model_dir, prompt_file, run_dir, {"data.eval_path": prompt_file, **extra})
    )


def test_results_go_per_eval_set_beside_the_model_or_checkpoint(tiny_model_dir, prompt_file, tmp_path):
    cfg = _config(tiny_model_dir, prompt_file, tmp_path / "run")
    ckpt = tmp_path / "step_000004"
    here = offline_eval.results_dir(cfg, checkpoint=ckpt)
    assert here.parent == ckpt / "eval" and here.name.startswith(Path(prompt_file).stem + "-")
    assert offline_eval.results_dir(cfg, hf_dir=tiny_model_dir) == Path(tiny_model_dir) / "eval" / here.name
    assert offline_eval.results_dir(cfg, checkpoint=ckpt, out_dir=tmp_path / "o") == tmp_path / "o"
    # another eval set of the same file name: its own directory
    other = tmp_path / "other" / Path(prompt_file).name
    other.parent.mkdir()
    other.write_text(Path(prompt_file).read_text())
    elsewhere = _config(tiny_model_dir, prompt_file, tmp_path / "run", **{"data.eval_path": other})
    assert offline_eval.results_dir(elsewhere, checkpoint=ckpt) not in (
        here,
        ckpt / "eval" / Path(prompt_file).stem,
    )


def test_a_checkpoints_export_is_made_once_then_reused(tmp_path, monkeypatch):
    ckpt = tmp_path / "step_000004"
    ckpt.mkdir()
    made, notes = [], []

    def export(_cfg, checkpoint, out):
        made.append(checkpoint)
        (tmp := ckpt / "hf.tmp").mkdir()
        (tmp / "config.json").write_text("{}")
        tmp.rename(out)

    monkeypatch.setattr(offline_eval, "_export", export)
    assert offline_eval.export_checkpoint(None, ckpt, notes.append) == ckpt / "hf"
    assert notes == []
    (ckpt / "eval").mkdir()
    (ckpt / "eval" / "eval.json").write_text("{}")  # an earlier evaluation's results
    # a finished export is read without the lock (a checkpoint the evaluator may not write to)
    monkeypatch.setattr(offline_eval, "export_lock", lambda *_a: pytest.fail("locked to read an export"))
    assert offline_eval.export_checkpoint(None, ckpt, notes.append) == ckpt / "hf"
    assert made == [ckpt], "exported once"
    assert notes == [f"eval: reusing {ckpt / 'hf'}, this checkpoint's export by an earlier evaluation "
                     "(delete it to export again)"]  # fmt: skip
    assert (ckpt / "eval" / "eval.json").is_file()


HOLD = """
import fcntl, os, sys
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o644)
fcntl.lockf(fd, fcntl.LOCK_EX)
print("held", flush=True)
sys.stdin.readline()
"""


def test_a_second_evaluation_says_it_waits_for_the_first_ones_export(tmp_path):
    ckpt = tmp_path / "step_000004"
    ckpt.mkdir()
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(ckpt / offline_eval.EXPORT_LOCK)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout.readline() == "held\n"
        notes, inside = [], threading.Event()

        def second():
            with offline_eval.export_lock(ckpt, notes.append):
                inside.set()

        thread = threading.Thread(target=second, daemon=True)
        thread.start()
        deadline = time.monotonic() + 60
        while not notes and time.monotonic() < deadline:
            time.sleep(0.01)
        assert notes == [f"eval: waiting for another evaluation of {ckpt} to finish its export "
                         f"({ckpt / offline_eval.EXPORT_LOCK} is locked)"]  # fmt: skip
        assert not inside.is_set()
        holder.stdin.write("\n")
        holder.stdin.flush()
        thread.join(60)
        assert inside.is_set(), "the lock is taken once its holder lets go"
    finally:
        holder.kill()
        holder.wait()


def test_a_broken_checkpoint_is_one_line_before_its_log_rho_is_read(tiny_model_dir, prompt_file, tmp_path):
    cfg = _config(tiny_model_dir, prompt_file, tmp_path / "run", **{"algorithm.log_rho": "auto"})
    ckpt = tmp_path / "step_000004"
    ckpt.mkdir()
    (ckpt / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist"}))
    with pytest.raises(UserError, match=r"^checkpoint file .*common.pt is missing$"):
        offline_eval.evaluate_offline(cfg, checkpoint=ckpt)


def test_an_evaluation_refuses_the_servers_of_a_run_training_now(tiny_model_dir, prompt_file, tmp_path):
    """Evaluating a checkpoint with the run's own config.yaml while the run trains: before, the evaluation
    loaded its model into the run's servers (weight version "eval"), and the run went on sampling from it."""
    from megatron_tail.train.run.config_change import config_text

    run_dir, out = tmp_path / "run", tmp_path / "out"
    remote = {"rollout.engine": "remote", "rollout.server_urls": "http://gpu1:30000,http://gpu1:30001"}
    cfg = _config(tiny_model_dir, prompt_file, run_dir, **remote)
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text(config_text(cfg))  # what the running trainer wrote
    offline_eval.check_inputs(cfg, hf_dir=tiny_model_dir, out_dir=out)  # nobody trains there: fine
    (run_dir / ".lock").write_text("")
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(run_dir / ".lock")],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline() == "held\n"
        with pytest.raises(
            UserError, match=r"^rollout.server_urls http://gpu1:30000, http://gpu1:30001 serve the "
        ):
            offline_eval.check_inputs(cfg, hf_dir=tiny_model_dir, out_dir=out)
        own = _config(
            tiny_model_dir, prompt_file, run_dir, **{**remote, "rollout.server_urls": "http://gpu9:30000"}
        )
        offline_eval.check_inputs(own, hf_dir=tiny_model_dir, out_dir=out)  # servers of its own: fine
    finally:
        holder.kill()
        holder.wait()
