"""`megatron-tail train` under torchrun (2 ranks, TP = 2, gloo) against a local engine subprocess: every
TensorBoard metric of the issue exists, is finite and consistent; the resolved config and a checkpoint
are in the run directory; exit code 0."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_tail.config import load_config
from megatron_tail.demo.run import read_scalars
from megatron_tail.train.rl.diagnostics import bucket_labels
from tests.loop.conftest import loop_overrides

BUCKETS = bucket_labels((0.5, 1e-2, 1e-4))
REQUIRED = [
    # reward and accuracy, response length, entropy, clip fraction
    "reward/mean", "reward/accuracy", "response/length_mean", "policy/entropy", "train/entropy",
    "train/pg_token_fraction", "train/loss", "train/grad_norm", "train/lr", "train/entropy_loss",
    "reward/overlong_penalty_mean", "reward/overlong_penalized_fraction", "train/kl_ref", "train/kl_loss",
    # KL(π_infer‖π_train), |Δ| per π_train bucket (Prop. 4.2), signed Δ of sampled tail tokens (Prop. 4.3)
    # (their means over a bucket or the tail: `MEANS_WHERE_COUNTED`)
    "mismatch/kl_infer_train_k3", *[f"mismatch/tokens/{b}" for b in BUCKETS], "mismatch/tail_tokens",
    "mismatch/tail_tokens_by_infer",
    # ε̂ (the fraction of tokens above Prop. 4.2's bound 2ε̂(1 − p): `MEANS_WHERE_COUNTED`)
    "mismatch/logit_error_max",
    # safe-set size, min safe mass Z (Prop. 5.5), out-of-safe-set fraction
    "dvp/safe_set_size_mean", "dvp/safe_set_size_min", "dvp/safe_mass_min", "dvp/bias_bound",
    "dvp/out_of_safe_set_fraction",
    # IS weights, vetoed fraction, STAPO masked fraction
    "is/weight_mean", "is/weight_max", "is/zero_weight_fraction", "is/vetoed_fraction",
    "stapo/masked_fraction",
    # throughput and step time
    "perf/rollout_tokens_per_s", "perf/train_tokens_per_s", "perf/step_time_s",
    # THD packing by the token budget
    "perf/packing_efficiency", "perf/micro_batches",
]  # fmt: skip
MEANS_WHERE_COUNTED = {
    **{
        f"mismatch/{family}/{b}": f"mismatch/tokens/{b}"
        for b in BUCKETS
        for family in ("abs_delta", "above_bound_fraction")
    },
    "mismatch/tail_signed_delta": "mismatch/tail_tokens",
    "mismatch/tail_delta_mode": "mismatch/tail_tokens",
    "mismatch/tail_delta_mode_by_infer": "mismatch/tail_tokens_by_infer",
}
"""Mean tag → the count it is over: logged at exactly the steps where the count is > 0 (a mean over no
tokens is left out)."""
CLIP_FRACTIONS = ("train/clip_fraction", "train/dual_clip_fraction")
"""Over the tokens with a policy gradient: logged at exactly the steps where `train/pg_token_fraction` > 0.
At lr 1e-2 the tiny policy can collapse by the third step (on an AMD EPYC every group's rewards were equal
there: no token had a policy gradient), and whether it does depends on the CPU's float rounding."""
STEPS, PROMPTS, GROUP = 3, 4, 4


@pytest.fixture(scope="module")
def cli_run(tiny_model_dir, prompt_file, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("e2e") / "run"
    extra = {
        "algorithm.stapo": True,
        "algorithm.stapo_tau_p": 0.5,  # a random model has few confident tokens; make STAPO reachable
        "algorithm.advantage_reweighting": True,
        "algorithm.lopti": True,
        "algorithm.is_mode": "mis",
        "algorithm.entropy_coef": 1e-3,
        "algorithm.overlong_buffer": 2,
        "algorithm.kl_coef": 0.05,  # a frozen reference model and its pass
        "data.eval_path": prompt_file,
        "train.eval_every": 2,
        "train.eval_samples_per_prompt": 4,
        "train.checkpoint_every": 2,
    }
    overrides = loop_overrides(tiny_model_dir, prompt_file, run_dir, extra)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    config = run_dir.parent / "run.yaml"
    config.write_text("seed: 7\nrollout:\n  sampling:\n    temperature: 1.0\n")  # the rest comes from --set
    cmd += ["-m", "megatron_tail.cli", "train", str(config)]
    for item in overrides:
        cmd += ["--set", str(item)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=420)
    return proc, run_dir, overrides


def test_exit_code_and_run_directory(cli_run):
    proc, run_dir, overrides = cli_run
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert f"TensorBoard logs: {(run_dir / 'tensorboard').resolve()}" in proc.stdout
    # the resolved config is saved and loads back to the config the run used
    assert load_config(run_dir / "config.yaml") == load_config(run_dir.parent / "run.yaml", overrides)
    checkpoints = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert checkpoints == ["step_000002", "step_000003"]  # every 2 steps + the last; keep_checkpoints=2
    assert (run_dir / "rollout_weights" / "config.json").is_file()


def test_every_metric_is_logged_finite_each_step(cli_run):
    proc, run_dir, _ = cli_run
    assert proc.returncode == 0, proc.stderr[-5000:]
    scalars = read_scalars(run_dir)
    missing = [tag for tag in REQUIRED if tag not in scalars]
    assert not missing, f"missing TensorBoard tags: {missing}"
    for tag in REQUIRED:
        steps = [s for s, _ in scalars[tag]]
        assert steps == [1, 2, 3], (tag, steps)
        bad = [v for _, v in scalars[tag] if not math.isfinite(v)]
        assert not bad, (tag, bad)
    for tag, count_tag in MEANS_WHERE_COUNTED.items():
        counted = [step for step, count in scalars[count_tag] if count > 0]
        assert [step for step, _ in scalars.get(tag, [])] == counted, (tag, scalars[count_tag])
        assert all(math.isfinite(v) for _, v in scalars.get(tag, [])), tag
    with_gradient = [step for step, share in scalars["train/pg_token_fraction"] if share > 0]
    assert 1 in with_gradient  # the first step, from the initial policy, has a group whose rewards differ
    for tag in CLIP_FRACTIONS:
        assert [step for step, _ in scalars[tag]] == with_gradient, (tag, scalars["train/pg_token_fraction"])
        assert all(0 <= v <= 1 for _, v in scalars[tag]), tag
    # the head bucket and the tail are filled at some step: their means are really logged
    assert scalars["mismatch/abs_delta/p0.5_1"] and scalars["mismatch/tail_signed_delta"]
    eval_tags = ("eval/sampled_accuracy", "eval/greedy_accuracy", "eval/pass@1", "eval/pass@2", "eval/pass@4")
    for tag in (*eval_tags, "eval/mean@4"):
        assert [s for s, _ in scalars[tag]] == [0, 2], tag  # before training, then every 2 steps
    for i in range(2):
        p1, p2, p4 = (scalars[f"eval/pass@{k}"][i][1] for k in (1, 2, 4))
        # pass@1 of 4 samples is their mean accuracy; more attempts never pass less often
        assert (
            p1
            == pytest.approx(scalars["eval/mean@4"][i][1])
            == pytest.approx(scalars["eval/sampled_accuracy"][i][1])
        )
        assert p1 <= p2 <= p4 <= 1


def test_logged_values_are_consistent(cli_run):
    """Cross-checks between independently computed metrics (the rollout's lengths vs the trainer's token
    buckets, bucket edges vs the tail threshold, the Lopti update count, ranges)."""
    _, run_dir, _ = cli_run
    s = {tag: [v for _, v in values] for tag, values in read_scalars(run_dir).items()}
    for i in range(STEPS):
        bucket_tokens = sum(s[f"mismatch/tokens/{b}"][i] for b in BUCKETS)
        # every sampled response token lands in exactly one π_train bucket
        assert bucket_tokens == pytest.approx(s["response/length_mean"][i] * PROMPTS * GROUP, abs=1e-6)
        # tail_prob = 1e-2 is a bucket edge: tail tokens = the two lowest buckets
        tail = s["mismatch/tokens/p0.0001_0.01"][i] + s["mismatch/tokens/p0_0.0001"][i]
        assert s["mismatch/tail_tokens"][i] == tail
        assert s["train/updates"][i] == 2  # Lopti: two sequential updates
        assert s["mismatch/kl_infer_train_k3"][i] >= 0
        assert 1 <= s["dvp/safe_set_size_min"][i] <= s["dvp/safe_set_size_mean"][i] < 100  # log ρ = -4 prunes
        assert 0 < s["dvp/safe_mass_min"][i] <= s["dvp/safe_mass_mean"][i] <= 1
        assert 0 <= s["reward/accuracy"][i] <= 1 and 0 <= s["stapo/masked_fraction"][i] < 1
        assert s["rollout/stale_fraction"][i] == 0  # every sample came from the current weights
        # packed by a 128-token budget without sequence parallelism: no padding at all, and the batch
        # (16 samples) takes a whole number of micro-batches
        assert s["perf/packing_efficiency"][i] == 1.0
        micro_batches = s["perf/micro_batches"][i]
        assert micro_batches >= 1 and micro_batches == int(micro_batches)
    # the bf16 engine and the fp32 trainer really disagree, a little
    assert 0 < max(s["mismatch/abs_delta/p0.01_0.5"]) < 0.5
    assert all(0 <= v <= 1 for b in BUCKETS for v in s.get(f"mismatch/above_bound_fraction/{b}", []))
    for i in range(STEPS):
        # the entropy bonus −β_H·H: at most β_H·log |V| (H of π^mp ≤ log of its support), and 0 only where
        # the policy has collapsed (at lr 1e-2 on an AMD EPYC its third step's tokens all had p = 1)
        assert -1e-3 * math.log(100) <= s["train/entropy_loss"][i] <= 0
        assert (s["train/entropy_loss"][i] == 0) == (s["train/entropy"][i] == 0)
        # DAPO's soft punishment over the last 2 of 5 tokens: −1 at 5, −0.5 at 4, 0 up to 3
        assert -1 <= s["reward/overlong_penalty_mean"][i] <= 0
        assert (s["reward/overlong_penalty_mean"][i] < 0) == (s["reward/overlong_penalized_fraction"][i] > 0)
    # KL(π_θ‖π_ref), k3 ≥ 0 per token; the policy leaves the reference as it trains
    assert all(v >= 0 for v in s["train/kl_ref"]) and s["train/kl_ref"][-1] > 0
    assert s["train/lr"] == pytest.approx([1e-2] * STEPS, rel=1e-6)  # no schedule: the constant peak rate
    # ε̂ from the engine's top-1 log-probs: bf16 logits differ from fp32 ones by a little, not by nothing
    assert 0 < max(s["mismatch/logit_error_max"]) < 1
    # the optimizer moved the policy: entropy changes between steps; the bonus applied from the start
    assert s["policy/entropy"][0] != s["policy/entropy"][-1]
    assert s["train/entropy_loss"][0] < 0


def test_tail_delta_histograms_are_logged_and_count_the_tail(cli_run):
    """The tail-Δ histograms (Prop. 4.3's distribution) read back from the event files: one per step with a
    tail, the counts add up to the tail's token count, and the logged mode is the fullest bin's centre."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _, run_dir, _ = cli_run
    acc = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"histograms": 0, "scalars": 0})
    acc.Reload()
    s = {tag: dict((e.step, e.value) for e in acc.Scalars(tag)) for tag in acc.Tags()["scalars"]}
    for x in ("", "_by_infer"):
        events = acc.Histograms(f"mismatch/tail_delta{x}")
        # a step whose tail is empty writes no histogram (TensorBoard cannot show one)
        assert [e.step for e in events] == [k for k in (1, 2, 3) if s[f"mismatch/tail_tokens{x}"][k] > 0]
        assert events, x
        for e in events:
            h = e.histogram_value
            assert h.num == pytest.approx(s[f"mismatch/tail_tokens{x}"][e.step]) and h.num > 0
            counts, limits = list(h.bucket), list(h.bucket_limit)
            fullest = max(range(len(counts)), key=lambda k: counts[k])
            assert 0 < fullest < len(counts) - 1
            centre = (limits[fullest - 1] + limits[fullest]) / 2
            assert s[f"mismatch/tail_delta_mode{x}"][e.step] == pytest.approx(centre)


def test_offline_eval_of_the_checkpoint_equals_the_exported_models(cli_run, prompt_file, tmp_path):
    """`megatron-tail eval` on the last checkpoint (TP = 2, loaded in one process and exported) and on the
    weights the loop last synced (the same step): bit-identical weights, so identical evaluations."""
    import json

    from safetensors.torch import load_file

    _, run_dir, _ = cli_run
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONWARNINGS": "ignore"}
    config = str(run_dir / "config.yaml")
    results = {}
    for flag, path in (
        ("--checkpoint", run_dir / "checkpoints" / "step_000003"),
        ("--hf", run_dir / "rollout_weights"),
    ):
        cmd = [sys.executable, "-m", "megatron_tail.cli", "eval", config, flag, str(path)]
        # the engine in the evaluating process: the evaluations are compared here, not the engine's process
        cmd += ["--set", "rollout.local.in_process=true"]
        # the checkpoint's results beside its export, per eval set; --out: elsewhere than the model
        out = tmp_path / "hf_eval"
        if flag == "--hf":
            cmd += ["--out", str(out)]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
        if flag == "--checkpoint":
            (out,) = (path / "eval").glob(f"{Path(prompt_file).stem}-*")
        results[flag] = json.loads((out / "eval.json").read_text())
        assert "eval/pass@4" in proc.stdout
    exported = load_file(str(run_dir / "checkpoints" / "step_000003" / "hf" / "model.safetensors"))
    synced = load_file(str(run_dir / "rollout_weights" / "model.safetensors"))
    assert exported.keys() == synced.keys()
    for name in synced:
        assert torch.equal(exported[name], synced[name]), name
    assert results["--checkpoint"] == results["--hf"]
    assert set(results["--hf"]) >= {
        "eval/pass@1",
        "eval/pass@2",
        "eval/pass@4",
        "eval/mean@4",
        "eval/greedy_accuracy",
    }


def test_offline_eval_refuses_bad_input_with_a_message(cli_run, tmp_path):
    _, run_dir, _ = cli_run
    cmd = [sys.executable, "-m", "megatron_tail.cli", "eval", str(run_dir / "config.yaml"), "--checkpoint"]
    proc = subprocess.run([*cmd, str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "is not a complete checkpoint (no metadata.json)" in proc.stderr
    proc = subprocess.run([*cmd, str(tmp_path / "step_000009")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.endswith(
        "step_000009 does not exist (a run's checkpoints/step_NNNNNN directory)\n"
    ), proc.stderr
    proc = subprocess.run(
        [*cmd[:-1], "--hf", str(tmp_path), "--set", "data.eval_path=null"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0 and "data.eval_path is required to evaluate" in proc.stderr
    proc = subprocess.run([*cmd[:-1], "--hf", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr == (
        f"megatron-tail eval: error: --hf: {tmp_path} has no config.json "
        "(expected a HF checkpoint directory)\n"
    )
