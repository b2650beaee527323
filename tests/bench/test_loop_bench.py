"""`bench.loop`'s summaries: steady-state means, the `--json` line, and the arms' overrides."""

import json
from pathlib import Path

import pytest

from megatron_tail.bench import loop
from megatron_tail.config import load_config


def _history(step_times, staleness):
    return [
        {"perf/step_time_s": t, "perf/engine_idle_fraction": 0.5, "rollout/staleness_max": s}
        for t, s in zip(step_times, staleness, strict=True)
    ]


def test_steady_state_means_skip_the_first_and_last_step_and_the_json_line_has_the_issue_keys():
    arms = {
        "sync": loop.summarize_loop(_history([9.0, 2.0, 2.0, 9.0], [0, 0, 0, 0])),
        "eta4_partial": loop.summarize_loop(_history([9.0, 1.0, 0.5, 9.0], [0, 3, 4, 9])),
    }
    assert arms["sync"]["steps_per_s"] == pytest.approx(0.5)
    assert arms["eta4_partial"]["steps_per_s"] == pytest.approx(1 / 0.75)
    assert arms["eta4_partial"]["rollout/staleness_max"] == 4  # the last step is not steady
    assert arms["eta4_partial"]["engine_idle_s"] == pytest.approx(0.5 * 0.75)
    line = json.loads(json.dumps(loop.arms_json(arms)))
    got = line["arms"]["eta4_partial"]
    assert (got["max_staleness"], got["partial_rollouts"]) == (4, True)
    assert got["speedup_vs_sync"] == pytest.approx((1 / 0.75) / 0.5)
    assert line["arms"]["sync"]["speedup_vs_sync"] == 1.0
    with pytest.raises(ValueError, match="need ≥ 3 steps"):
        loop.summarize_loop(_history([1.0, 1.0], [0, 0]))


def test_every_arm_loads_as_a_valid_config_with_packing_and_the_concurrency_cap(tmp_path: Path):
    for name, (staleness, partial) in loop.ARMS.items():
        overrides = loop.loop_overrides(
            tmp_path, tmp_path / "p.jsonl", tmp_path / name, staleness, 5, partial
        )
        cfg = load_config(None, [*overrides, "rollout.max_concurrency=7"])
        assert (cfg.rollout.max_staleness, cfg.rollout.partial_rollouts) == (staleness, partial)
        assert cfg.train.max_tokens_per_micro_batch == loop.LOOP_TOKENS_PER_MICRO_BATCH
        assert cfg.rollout.max_concurrency == 7  # --set comes after the benchmark's own settings


def test_a_bad_set_is_refused_in_one_line_before_any_arm_runs(capsys):
    with pytest.raises(SystemExit) as exit_info:
        loop.main(["--suites", "loop", "--arms", "sync", "--set", "rollout.max_concurrency=zero"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "--set: rollout.max_concurrency must be an integer; got 'zero'" in err
    assert "Traceback" not in err
