"""A stop signal during the demo's pretraining: it is acknowledged, the progress is saved after the step in
flight, and the next run continues from there to exactly the model an uninterrupted run makes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
import torch

from megatron_tail.demo.defaults import PRETRAIN_DIR_NAME
from megatron_tail.demo.pretrain import PretrainSettings, PretrainStopped, fit_causal_lm, make_batches

SETTINGS = PretrainSettings(steps=6, batch_size=8, num_examples=64, threads=1, warmup=2)


def _fit(progress=None, stop_after: int | None = None):
    """A fresh model (the settings' seed) fitted under `SETTINGS`; `stop_after`: this process sends itself
    SIGTERM when that step is logged."""

    def log(text: str) -> None:
        if stop_after is not None and f"step {stop_after}/" in text:
            os.kill(os.getpid(), signal.SIGTERM)

    model, tokenizer = SETTINGS.new_model()
    fit_causal_lm(model, make_batches(tokenizer, SETTINGS), SETTINGS, log=log, log_every=1, progress=progress)
    return model


def test_a_stopped_pretraining_continues_to_the_uninterrupted_model(tmp_path):
    torch.set_num_threads(SETTINGS.threads)
    progress = tmp_path / ".model.pretrain_progress.pt"
    whole = _fit()
    with pytest.raises(PretrainStopped) as stopped:
        _fit(progress, stop_after=3)
    assert (stopped.value.sig, stopped.value.step, stopped.value.steps) == (signal.SIGTERM, 3, 6)
    assert progress.is_file()
    continued = _fit(progress)
    for (name, a), (_, b) in zip(whole.state_dict().items(), continued.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    stopped_model = _fit(tmp_path / "other.pt", stop_after=None)  # no stop: no progress file left behind
    assert not (tmp_path / "other.pt").exists() and stopped_model is not None


def test_sigterm_during_the_demos_pretraining_is_acknowledged_and_saved(tmp_path):
    cache = tmp_path / "cache"
    cmd = [sys.executable, "-m", "megatron_tail.cli", "demo", "--cache-dir", str(cache)]
    cmd += ["--run-dir", str(tmp_path / "run")]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("pretraining the tiny Qwen3"):
                proc.send_signal(signal.SIGTERM)
                break
        rest, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    output = "".join(lines) + rest
    assert proc.returncode == 128 + signal.SIGTERM, output[-3000:]
    progress = cache / f".{PRETRAIN_DIR_NAME}.pretrain_progress.pt"
    last = output.strip().splitlines()[-1]
    assert last.startswith("SIGTERM: pretraining stopped after step "), output[-3000:]
    assert last.endswith(
        f"/400; its progress is saved in {progress} and the next run continues from there: "
        "rerun the demo to continue"
    ), last
    assert "Traceback" not in output
    assert torch.load(progress, weights_only=False)["step"] >= 1
