"""The collapse experiment's fast deterministic slice (CI): two arms (naive, DVP+MIS), two steps, seed 0, on
the "ci" tail model (hidden 32, pretrained in seconds): every run writes `reward/mean` and `train/loss`, the
table has a verdict per group, only the DVP arm runs with a log ρ, and the same command again reproduces
the naive arm's rewards exactly (the slice is deterministic: sampling seeds, one engine thread, gloo)."""

from __future__ import annotations

import json
import math

import yaml

from megatron_tail.demo.run import read_scalars
from megatron_tail.experiments.collapse import run_collapse

SLICE = [
    "train.steps=2",
    "train.checkpoint_every=2",
    "data.prompts_per_step=4",
    "rollout.max_new_tokens=4",
    "rollout.local.logit_noise=1.0",
    "rollout.local.in_process=true",  # a test of the experiment, not of the engine's process
]


def test_two_arms_two_steps_write_events_table_and_verdicts(tmp_path, ci_tail_cache, figures_not_rendered):
    cache = ci_tail_cache

    def run(out, arms=("naive", "dvp_mis")):
        return run_collapse(
            out,
            cache,
            arms=arms,
            seeds=(0,),
            overrides=SLICE,
            jobs=1,
            model_size="ci",
            log=lambda _: None,
        )

    results = run(tmp_path / "a")
    table = json.loads((tmp_path / "a" / "results.json").read_text())["table"]
    assert list(table) == ["naive", "dvp_mis"]
    for arm in table:
        scalars = read_scalars(tmp_path / "a" / arm / "seed0")
        assert len(scalars["reward/mean"]) == 2 and len(scalars["train/loss"]) == 2
        assert all(math.isfinite(v) for _, v in scalars["train/loss"])
        assert table[arm]["runs"][0]["reason"] == "too short"  # 2 steps: no verdict, not collapsed
        algorithm = yaml.safe_load((tmp_path / "a" / arm / "seed0" / "config.yaml").read_text())["algorithm"]
        assert algorithm["log_rho"] == (-9.0 if arm == "dvp_mis" else None)
    assert "| naive | 0/1 |" in results.read_text()
    report = (tmp_path / "a" / "report" / "report.md").read_text()
    assert {p.parent for p in figures_not_rendered} == {tmp_path / "a" / "report"}
    assert all(f"]({p.name})" in report for p in figures_not_rendered)  # each figure drawn is in the report
    # a second experiment directory, same seed and overrides: the same rewards step by step
    run(tmp_path / "b", arms=("naive",))
    for arm in ("naive",):
        assert (
            read_scalars(tmp_path / "a" / arm / "seed0")["reward/mean"]
            == read_scalars(tmp_path / "b" / arm / "seed0")["reward/mean"]
        )
