"""The collapse experiment's truncation suite: its quick subset through `run_collapse` on the "ci" tail model
(CI), and through the CLI on the experiment's own model (slow). Each checks that the arms really differ in
the way the write-up reads them: the one-sided arm scores the full vocabulary (its raw importance log-ratio is
log Z_support < 0) and, with θ_old from the engine below top-p 0.8, PPO clips only tokens with a negative
advantage; the replay arm has no bias whatever mass the support drops. The columns are read from the tags
that the write-up names."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import yaml

from megatron_tail.demo.run import read_scalars
from megatron_tail.experiments import truncation
from megatron_tail.experiments.collapse import run_collapse

WRITE_UP_TAGS = (
    "reward/mean",
    "mismatch/outside_support_mass",
    "train/clip_fraction_pos_adv",
    "train/clip_fraction_neg_adv",
    "is/raw_ratio_mean",
    "is/raw_log_ratio_mean",
    "mismatch/kl_infer_train_k3",
    "train/grad_norm",
    "policy/entropy",
)


def _check_quick(out, steps: int) -> None:
    table = json.loads((out / "results.json").read_text())["table"]
    assert list(table) == ["ignore_engine@top_p0.5", "replay@top_p0.5"]
    assert {tag for _, tag, _, _ in truncation.COLUMNS} <= set(WRITE_UP_TAGS)
    runs = {name: read_scalars(out / name / "seed0") for name in table}
    for name, scalars in runs.items():
        for tag in WRITE_UP_TAGS:
            values = [v for _, v in scalars[tag]]
            assert len(values) == steps and all(math.isfinite(v) for v in values), (name, tag)
        cfg = yaml.safe_load((out / name / "seed0" / "config.yaml").read_text())
        sampling = cfg["rollout"]["sampling"]
        assert sampling["top_p"] == 0.5 and sampling["top_k"] == truncation.VOCAB
        assert cfg["algorithm"]["sampling_support"] == ("ignore" if name.startswith("ignore") else "replay")
    one_sided, replayed = runs["ignore_engine@top_p0.5"], runs["replay@top_p0.5"]
    first = {tag: dict(one_sided[tag])[1] for tag in WRITE_UP_TAGS}
    assert 0.05 < first["mismatch/outside_support_mass"] < 0.55  # top-p 0.5 keeps at least half the mass
    assert first["is/raw_log_ratio_mean"] < -0.05
    assert first["train/clip_fraction_pos_adv"] == 0.0 and first["train/clip_fraction_neg_adv"] > 0.5
    replay_first = {tag: dict(replayed[tag])[1] for tag in WRITE_UP_TAGS}
    assert replay_first["mismatch/outside_support_mass"] > 0.05
    assert (
        abs(replay_first["is/raw_log_ratio_mean"]) < 0.01
        and replay_first["train/clip_fraction_neg_adv"] == 0.0
    )
    assert (out / "dose_response.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    per_dial = (out / "report_top_p0.5" / "report.md").read_text()
    assert "](truncation.png)" in per_dial and "ignore_engine@top_p0.5" in per_dial
    text = (out / "results.md").read_text()
    assert "| ignore_engine@top_p0.5 | 0/1 |" in text and "1 − Z_support, last 10" in text


def test_quick_subset_on_the_ci_model(tmp_path, ci_tail_cache):
    out = tmp_path / "trunc"
    run_collapse(
        out,
        ci_tail_cache,
        suite="truncation",
        dials=truncation.QUICK["dials"],
        arms=truncation.QUICK["arms"],
        seeds=truncation.QUICK["seeds"],
        overrides=[
            *truncation.QUICK["overrides"],
            "data.prompts_per_step=4",
            "rollout.local.in_process=true",  # a test of the experiment, not of the engine's process
        ],
        jobs=1,
        model_size="ci",
        log=lambda _: None,
    )
    _check_quick(out, steps=3)


def test_default_grid_and_names():
    groups = truncation.truncation_groups()
    assert len(groups) == 16 and len(set(truncation.DEFAULT_GRID)) == 16
    for dial in truncation.DIALS:  # the dose–response: the one-sided arm and the replay at every dial
        for arm in ("ignore", "replay"):
            assert f"{arm}@{dial}" in groups
    assert {name for name in groups if name.startswith("ignore_engine@")} == {
        "ignore_engine@top_p0.7",
        "ignore_engine@top_p0.5",
        "ignore_engine@min_p_rho",
    }
    assert groups["dvp_replay@min_p_rho"][-1] == "algorithm.log_rho=-9"
    assert "rollout.sampling.min_p=0.00012341" in groups["ignore@min_p_rho"]
    assert len(truncation.truncation_groups(["top_p0.7"], None)) == len(truncation.ARMS)
    with pytest.raises(ValueError, match=r"unknown dial\(s\) \['top_p0\.3'\]; the dials are"):
        truncation.truncation_groups(["top_p0.3"], None)


@pytest.mark.slow
def test_quick_subset_from_the_command_line(tmp_path):
    out = tmp_path / "trunc"
    cmd = [sys.executable, "-m", "megatron_tail.cli", "experiment", "collapse", "--suite", "truncation"]
    cmd += ["--quick", "--out", str(out), "--cache-dir", str(tmp_path / "cache")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, env={**os.environ})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    _check_quick(out, steps=3)
