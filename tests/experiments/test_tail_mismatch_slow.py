"""The whole tail-mismatch experiment from the command line (6 arms × 3 seeds, pretraining included; about
20 min on 2 cores): slow. It checks that the experiment ran and reports what it should, not the papers'
claims (those are read off its table and figures: docs/experiments.md, "The tail experiment", and
docs/results/tail_mismatch)."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest

from megatron_tail.demo.run import read_scalars
from megatron_tail.experiments.tail_mismatch import ARMS, COLUMNS


@pytest.mark.slow
def test_tail_mismatch_experiment_runs_every_arm_and_writes_table_and_report(tmp_path):
    out = tmp_path / "exp"
    cmd = [sys.executable, "-m", "megatron_tail.cli", "experiment", "tail-mismatch", "--out", str(out)]
    cmd += ["--cache-dir", str(tmp_path / "cache")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=2400, env={**os.environ})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = (out / "results.md").read_text()
    rows = [line for line in results.splitlines() if line.startswith("| ") and not line.startswith("| arm")]
    assert [r.split("|")[1].strip() for r in rows] == list(ARMS)
    for arm in ARMS:
        for seed in (0, 1, 2):
            scalars = read_scalars(out / arm / f"seed{seed}")
            rewards = [v for _, v in scalars["reward/mean"]]
            assert len(rewards) == 20 and all(math.isfinite(r) for r in rewards), (arm, seed)
            size = max(v for _, v in scalars["dvp/safe_set_size_mean"])
            # DVP prunes only in its arm; |V_S| is the whole 8192-id vocabulary elsewhere
            assert (size < 8192) == (arm == "dvp_mis"), (arm, size)
            if arm == "stapo":
                assert max(v for _, v in scalars["stapo/masked_fraction"]) > 0
            if arm == "lopti":
                assert {v for _, v in scalars["train/updates"]} == {2.0}
    for figure in ("reward_accuracy", "mismatch_buckets", "tail_delta", "safe_mass", "is_veto_masks"):
        png = out / "report" / f"{figure}.png"
        assert png.is_file() and png.stat().st_size > 10_000, figure
    assert len(COLUMNS) + 2 == rows[0].count("|")


@pytest.mark.slow
def test_fp8_variant_is_deterministic_and_widens_the_mismatch(tmp_path):
    """`--variant fp8` (8 steps here, naive arm, seed 0) twice gives the same rewards and mismatch step by
    step (fixed seeds: sampling seeds, one engine thread, gloo); its KL(π_infer‖π_train) is several times the
    bf16 engine's on the same model and prompts."""
    cache = tmp_path / "cache"

    def run(name: str, variant: str) -> dict:
        out = tmp_path / name
        cmd = [sys.executable, "-m", "megatron_tail.cli", "experiment", "tail-mismatch", "--variant", variant]
        cmd += ["--out", str(out), "--cache-dir", str(cache), "--arms", "naive", "--seeds", "0"]
        cmd += ["--set", "train.steps=8", "--set", "train.checkpoint_every=8"]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, env={**os.environ})
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        return read_scalars(out / "naive" / "seed0")

    first, again, bf16 = run("fp8_a", "fp8"), run("fp8_b", "fp8"), run("bf16", "bf16")
    for tag in ("reward/mean", "mismatch/kl_infer_train_k3", "train/grad_norm"):
        assert first[tag] == again[tag] and len(first[tag]) == 8, tag
    kl_fp8 = sum(v for _, v in first["mismatch/kl_infer_train_k3"]) / 8
    kl_bf16 = sum(v for _, v in bf16["mismatch/kl_infer_train_k3"]) / 8
    assert kl_fp8 > 2 * kl_bf16, (kl_fp8, kl_bf16)
