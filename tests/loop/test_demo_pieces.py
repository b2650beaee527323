"""The demo's pieces that CI can afford: embedded config, reproducible pretraining (a few steps), the
comparison table from TensorBoard events, graceful-stop handlers, progress-bar switch."""

from __future__ import annotations

import json
import math
import os
import signal
from pathlib import Path

import pytest
import torch

from megatron_tail.config import load_config
from megatron_tail.demo import run as demo_run
from megatron_tail.demo.defaults import DEMO_CONFIG_YAML
from megatron_tail.demo.pretrain import PretrainSettings, pretrain
from megatron_tail.train.run.console import progress_enabled
from megatron_tail.train.run.signals import GracefulStop
from megatron_tail.train.run.tensorboard import ScalarLog

REPO = Path(__file__).resolve().parents[2]


def test_embedded_config_is_the_shipped_example():
    assert (REPO / "examples" / "demo" / "demo.yaml").read_text() == DEMO_CONFIG_YAML


def test_demo_config_is_the_issue_setup(tmp_path):
    path = tmp_path / "demo.yaml"
    path.write_text(DEMO_CONFIG_YAML)
    cfg = load_config(path, ["model.hf_path=x", "data.train_path=y.jsonl"])
    cfg.check_runnable()
    assert cfg.parallel.tensor_parallel == 2 and cfg.rollout.engine == "local"
    assert (
        cfg.rollout.local.dtype == "bfloat16" and cfg.model.precision == "fp32"
    )  # bf16 engine, fp32 trainer
    assert cfg.algorithm.log_rho == -13.0 and cfg.algorithm.is_mode == "mis"  # DVP + MIS (+ veto)
    naive = load_config(path, demo_run.COMPARE_VARIANTS["naive"])
    assert naive.algorithm.log_rho is None and naive.algorithm.is_mode == "none"
    dvp = load_config(path, demo_run.COMPARE_VARIANTS["dvp_mis"])
    assert dvp.algorithm == cfg.algorithm
    fp16 = load_config(path, demo_run.COMPARE_VARIANTS["fp16"])  # fp16 on both sides, no other remedy
    assert fp16.model.resolved_precision() == "fp16" and fp16.rollout.local_engine_dtype == "float16"
    assert fp16.algorithm.log_rho is None and fp16.algorithm.is_mode == "none"
    fp8 = load_config(path, demo_run.COMPARE_VARIANTS["fp8_dvp_mis"])  # FP8 rollouts, remedied
    assert fp8.rollout.quantization == "fp8" and fp8.algorithm == cfg.algorithm
    assert cfg.rollout.quantization == "none"


def test_pretraining_is_reproducible(tmp_path):
    settings = PretrainSettings(steps=3, batch_size=8, num_examples=64, threads=1)
    rows = [{"prompt": "1+2=", "answer": "3"}, {"prompt": "10+5=", "answer": "15"}]
    a = pretrain(tmp_path / "a", settings, eval_rows=rows, log=None)
    b = pretrain(tmp_path / "b", settings, eval_rows=rows, log=None)
    assert a["settings"] == b["settings"] and a["greedy_accuracy"] == b["greedy_accuracy"]
    from safetensors.torch import load_file

    wa, wb = load_file(tmp_path / "a" / "model.safetensors"), load_file(tmp_path / "b" / "model.safetensors")
    assert wa.keys() == wb.keys()
    for name in wa:
        assert torch.equal(wa[name], wb[name]), name
    fresh = pretrain(
        tmp_path / "c", PretrainSettings(steps=0, batch_size=8, num_examples=64, threads=1), log=None
    )
    del fresh
    wc = load_file(tmp_path / "c" / "model.safetensors")
    assert any(not torch.equal(wa[n], wc[n]) for n in wa)  # the 3 steps did change the weights


def test_demo_data_files_are_deterministic(tmp_path):
    train, test = demo_run.ensure_data(tmp_path / "x")
    again = demo_run.ensure_data(tmp_path / "y")
    assert train.read_text() == again[0].read_text() and test.read_text() == again[1].read_text()
    assert len(train.read_text().splitlines()) == 2000 and len(test.read_text().splitlines()) == 200
    # held out: before, 94 of the 200 evaluation prompts were training prompts
    prompts = [{json.loads(line)["prompt"] for line in f.read_text().splitlines()} for f in (train, test)]
    assert len(prompts[1]) == 200 and not prompts[0] & prompts[1]


def test_comparison_table_reads_tensorboard(tmp_path, capsys):
    for name, scale in (("naive", 10.0), ("dvp_mis", 1.0)):
        log = ScalarLog(tmp_path / name / "tensorboard")
        for step in (1, 2, 3):
            log.write(step, {"train/grad_norm": scale * step, "eval/greedy_accuracy": 0.1 * step})
        log.close()
    demo_run.print_comparison({"naive": tmp_path / "naive", "dvp_mis": tmp_path / "dvp_mis"})
    out = capsys.readouterr().out
    grad_row = next(line for line in out.splitlines() if line.startswith("gradient norm (max)"))
    assert grad_row.split()[-2:] == ["30", "3"]
    acc_row = next(line for line in out.splitlines() if line.startswith("eval accuracy, greedy (last)"))
    assert acc_row.split()[-2:] == ["0.3", "0.3"]
    missing = next(line for line in out.splitlines() if line.startswith("IS weight (max)"))
    assert missing.split()[-2:] == ["—", "—"]


@pytest.mark.parametrize(("how", "expected"), [("last", 4), ("last5", 2.5), ("mean", 2.5), ("max", 4),
                                                ("min", 1), ("sum", 10)])  # fmt: skip
def test_summarise(how, expected):
    assert demo_run.summarise([1.0, 2.0, 3.0, 4.0], how) == expected


def test_the_max_and_min_of_steps_skip_a_nan_wherever_it_is():
    """Python's `max([nan, 1, 3])` is nan and `max([1, nan, 3])` is 3: a seed's peak depended on its NaN's
    place."""
    nan = float("nan")
    for values in ([nan, 1.0, 3.0], [1.0, nan, 3.0], [1.0, 3.0, nan]):
        assert demo_run.summarise(values, "max") == 3.0 and demo_run.summarise(values, "min") == 1.0
    assert math.isnan(demo_run.summarise([nan], "max"))


def test_graceful_stop_sets_a_flag_and_restores_handlers():
    before = signal.getsignal(signal.SIGUSR1)
    with GracefulStop() as stop:
        assert not stop.requested and not stop.agreed()
        os.kill(os.getpid(), signal.SIGUSR1)
        assert stop.requested and stop.received == signal.SIGUSR1 and stop.agreed()
        os.kill(os.getpid(), signal.SIGTERM)  # a second signal does not overwrite the first
        assert stop.received == signal.SIGUSR1
    assert signal.getsignal(signal.SIGUSR1) == before


def test_progress_bars_only_on_a_terminal(monkeypatch):
    monkeypatch.setattr("sys.stdout.isatty", lambda: False)
    assert not progress_enabled("auto") and progress_enabled("always") and not progress_enabled("never")
    monkeypatch.setattr("sys.stdout.isatty", lambda: True)
    assert progress_enabled("auto")
