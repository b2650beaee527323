"""`bench.loop`'s summaries (steady-state means, trained-length statistics, the `--json` line, the tables),
the arms' overrides, and the workload's model (`bench.loop_model`): its EOS probability per prompt difficulty
from an HF forward."""

import json
import os
from pathlib import Path

import pytest
import torch

from megatron_tail.bench import loop, loop_model
from megatron_tail.config import load_config


def _history(step_times, staleness, dropped=None):
    dropped = dropped or [0.0] * len(step_times)
    return [
        {
            "perf/step_time_s": t,
            "perf/engine_idle_fraction": 0.5,
            "rollout/staleness_max": s,
            "rollout/dropped_stale": d,
        }
        for t, s, d in zip(step_times, staleness, dropped, strict=True)
    ]


def test_steady_state_means_skip_the_first_and_last_step_and_the_json_line_has_the_issue_keys():
    arms = {
        "sync": loop.summarize_loop(_history([9.0, 2.0, 2.0, 9.0], [0, 0, 0, 0])),
        "eta4_partial": loop.summarize_loop(_history([9.0, 1.0, 0.5, 9.0], [0, 3, 4, 9], [0, 8, 0, 16])),
        "agentic_sync": loop.summarize_loop(_history([9.0, 4.0, 4.0, 9.0], [0, 0, 0, 0])),
        "agentic_eta2_partial": loop.summarize_loop(_history([9.0, 1.0, 1.0, 9.0], [0, 2, 2, 2])),
    }
    assert arms["sync"]["steps_per_s"] == pytest.approx(0.5)
    assert arms["eta4_partial"]["steps_per_s"] == pytest.approx(1 / 0.75)
    assert arms["eta4_partial"]["rollout/staleness_max"] == 4  # the last step is not steady
    assert arms["eta4_partial"]["engine_idle_s"] == pytest.approx(0.5 * 0.75)
    assert arms["eta4_partial"]["dropped_samples"] == 24  # summed over every step, the last included
    line = json.loads(json.dumps(loop.arms_json(arms)))
    got = line["arms"]["eta4_partial"]
    assert (got["env"], got["max_staleness"], got["partial_rollouts"]) == (None, 4, True)
    assert got["speedup_vs_sync"] == pytest.approx((1 / 0.75) / 0.5)
    assert got["dropped_samples"] == 24
    assert line["arms"]["sync"]["speedup_vs_sync"] == 1.0
    # the agentic arm against the agentic synchronous arm, not the single-turn one
    agentic = line["arms"]["agentic_eta2_partial"]
    assert agentic["env"] == "calculator" and agentic["speedup_vs_sync"] == pytest.approx(4.0)
    with pytest.raises(ValueError, match="need ≥ 3 steps"):
        loop.summarize_loop(_history([1.0, 1.0], [0, 0]))


def test_trained_length_statistics_take_the_longest_decile_and_the_hard_fraction():
    # 20 samples over two steps: lengths 1..20, the hard ones the even lengths ≥ 12 (5 of 20)
    steps = [
        [(n >= 12 and n % 2 == 0, n) for n in range(1, 11)],
        [(n >= 12 and n % 2 == 0, n) for n in range(11, 21)],
    ]
    summary = loop.summarize_loop(_history([1.0, 1.0, 1.0], [0, 0, 0]), steps)
    assert summary["length_top_decile_mean"] == pytest.approx((20 + 19) / 2)  # ⌈20 / 10⌉ = 2 samples
    assert summary["length_trained_mean"] == pytest.approx(10.5)
    assert summary["hard_fraction"] == pytest.approx(5 / 20)
    assert loop_model.length_stats([(True, 7)])["length_top_decile_mean"] == 7  # ⌈1 / 10⌉ = 1
    with pytest.raises(ValueError, match="no trained samples"):
        loop_model.length_stats([])


def test_the_table_has_one_block_per_workload_with_the_new_length_rows():
    summary = loop.summarize_loop(_history([1.0, 1.0, 1.0], [0, 0, 0]), [[(True, 5), (False, 3)]])
    table = loop.format_loop({"sync": summary, "eta2_in_place": summary, "agentic_sync": summary}, "2 cores")
    assert table.count("| **speedup vs sync** |") == 2
    assert "eta2_in_place (η=2, partial, in_place)" in table
    assert "| hard-prompt fraction of trained samples | 0.500 | 0.500 |" in table
    assert "| trained length, longest-decile mean (all steps) | 5.0 | 5.0 |" in table


def test_every_arm_loads_as_a_valid_config_with_packing_and_the_concurrency_cap(tmp_path: Path):
    for name, arm in loop.ARMS.items():
        overrides = loop.loop_overrides(tmp_path, tmp_path / "p.jsonl", tmp_path / name, arm, 5)
        cfg = load_config(None, [*overrides, "rollout.max_concurrency=7"])
        r = cfg.rollout
        assert (r.max_staleness, r.partial_rollouts, r.pause_mode, r.env.name) == (
            arm.staleness, arm.partial, arm.pause_mode, arm.env,
        )  # fmt: skip
        assert cfg.train.max_tokens_per_micro_batch == loop.LOOP_TOKENS_PER_MICRO_BATCH
        assert r.max_concurrency == 7  # --set comes after the benchmark's own settings
        if arm.env is not None:
            assert (r.sampling.top_p, r.sampling.top_k, r.env.max_turns) == (0.95, 20, loop.AGENTIC_MAX_TURNS)
    assert {a.pause_mode for n, a in loop.ARMS.items() if n.startswith("eta2")} == {
        "abort",
        "in_place",
        "retract",
    }


def test_a_bad_set_is_refused_in_one_line_before_any_arm_runs(capsys):
    with pytest.raises(SystemExit) as exit_info:
        loop.main(["--suites", "loop", "--arms", "sync", "--set", "rollout.max_concurrency=zero"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "--set: rollout.max_concurrency must be an integer; got 'zero'" in err
    assert "Traceback" not in err


def test_an_arm_without_its_workloads_synchronous_arm_is_refused(capsys):
    with pytest.raises(SystemExit):
        loop.main(["--suites", "loop", "--arms", "sync", "agentic_eta2_partial"])
    assert "--arms must include agentic_sync" in capsys.readouterr().err


@pytest.fixture(scope="module")
def long_tail_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("long_tail") / "model"
    loop_model.save_long_tail_model(path)
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


@pytest.mark.parametrize(("marker", "want"), [(loop_model.EASY_MARKER, 0.04), (loop_model.HARD_MARKER, 0.01)])
def test_the_prompts_marker_sets_the_eos_probability_of_the_whole_response(long_tail_model, marker, want):
    """An HF forward over prompt + 200 response tokens drawn from the marker's class (as the model's own
    samples are, up to ~e^-12): P(EOS) at every response position is the intended value; the other class's
    tokens are ≈ 12 nats down."""
    tok = loop_model.tokenizer()
    classes = loop_model.token_classes(tok)
    mode, other = ("easy", "hard") if marker == loop_model.EASY_MARKER else ("hard", "easy")
    prompt = tok("673+34=" + marker, add_special_tokens=False)["input_ids"]
    pool = torch.tensor(classes[mode])
    gen = torch.Generator().manual_seed(0)
    ids = torch.cat([torch.tensor([prompt] * 4), pool[torch.randint(len(pool), (4, 200), generator=gen)]], 1)
    with torch.no_grad():
        probs = long_tail_model(input_ids=ids).logits[:, len(prompt) - 1 : -1].double().softmax(-1)
    eos = probs[..., tok.eos_token_id]
    assert float(eos.mean()) == pytest.approx(want, rel=0.1)
    assert float(eos.max()) < 2 * want and float(eos.min()) > want / 2  # every position, not just on average
    assert float(probs[..., classes[other]].sum(-1).max()) < 1e-3  # the mode sticks
    assert float(probs[..., classes["never"]].sum(-1).max()) < 1e-9


def test_an_arm_dies_with_the_benchmark_that_started_it(monkeypatch):
    """Before: an arm (a whole training run with its own engine) started without a tie to the benchmark, so
    a benchmark killed by `kill -9` or the OOM killer left it training under PID 1. Recording stand-ins: the
    parent's pid goes in the child's environment, and the child's first act is to die with that parent."""
    from megatron_tail.bench import loop
    from megatron_tail.utils.parent_watch import PARENT_PID_ENV

    sent = {}

    def run(_cmd, **kwargs):
        sent.update(kwargs["env"])
        return type("Done", (), {"returncode": 0, "stdout": '{"ok": 1}\n', "stderr": ""})()

    monkeypatch.setattr(loop.subprocess, "run", run)
    assert loop._subprocess_json(["--loop-arm"]) == {"ok": 1}
    assert sent[PARENT_PID_ENV] == str(os.getpid())

    calls = []
    monkeypatch.setattr(loop, "die_with_parent", lambda pid: calls.append(("die_with", pid)))
    monkeypatch.setattr(loop, "loop_arm", lambda *_a: calls.append(("arm",)) or {})
    monkeypatch.setenv(PARENT_PID_ENV, "4242")
    loop.main(["--loop-arm", "m", "p", "r", next(iter(loop.ARMS)), "1", "[]"])
    assert calls == [("die_with", 4242), ("arm",)] and PARENT_PID_ENV not in os.environ
