"""`megatron-tail demo --moe [--compare]`: the MoE demo's settings, and the table that sets routing replay
`none` / `r2` / `r3` side by side (same seed, data and steps; bf16 local engine, fp32 trainer)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

MOE_PRETRAIN_DIR_NAME = "tiny_qwen3_moe_arith"
"""The MoE demo's pretrained model in the cache, apart from the dense demo's."""

MOE_PRETRAIN = {"steps": 400, "batch_size": 64, "lr": 5e-3, "warmup": 20, "num_examples": 8000}
"""`MoePretrainSettings` of the demo's tiny Qwen3-MoE (one-off: 525 s on 2 heavily shared cores; greedy
accuracy 0.47 after it, 0.15 after 200 steps)."""

MOE_OVERRIDES = [
    "parallel.tensor_parallel=1",  # one trainer rank: the MoE layers (8 experts each) cost the CPU time
    # no load-balancing loss in RL: the pretrained routers are what the engine serves, and the comparison is
    # of routing replay alone (the tables in docs/results/moe were measured so; before 8413e10 the trainer
    # also over-weighted that loss by the micro-batch's token count)
    "model.moe_aux_loss_coeff=0",
    "train.mini_batches=2",  # two optimizer steps per batch: the second one's routers have moved (r2 ≠ none)
    "data.eval_prompts=100",
    "train.steps=20",
    "train.eval_every=10",
]
"""`demo --moe` on top of the dense demo's config (the user's own `--set`s come after and win)."""

MOE_SINGLE = {"": ["algorithm.routing_replay=r3"]}
"""`demo --moe` without --compare: one run with r3, the fix (trainer passes replay the engine's routes); the
variants' knobs come before the overrides, so `--set algorithm.routing_replay=...` wins."""

MOE_COMPARE_VARIANTS: dict[str, list[str]] = {
    "none": ["algorithm.routing_replay=none"],
    "r2": ["algorithm.routing_replay=r2"],
    "r3": ["algorithm.routing_replay=r3"],
}
"""--moe --compare: the same seed, data and steps; only the routing replay differs."""

# (tag, summary, label): summaries as `run.summarise`
MOE_ROWS: list[tuple[str, str, str]] = [
    ("moe/routing_agreement", "mean", "routing agreement, engine vs trainer (mean)"),
    ("moe/routing_agreement", "min", "routing agreement (min)"),
    ("mismatch/kl_infer_train_k3", "mean", "KL(π_infer‖π_train), k3 (mean)"),
    ("mismatch/kl_infer_train_k3", "max", "KL(π_infer‖π_train), k3 (max)"),
    ("train/grad_norm", "mean", "gradient norm (mean)"),
    ("train/grad_norm", "max", "gradient norm (max)"),
    ("reward/accuracy", "mean", "reward, sampled accuracy (mean)"),
    ("reward/accuracy", "last5", "reward (last 5 steps)"),
    ("eval/greedy_accuracy", "last", "eval accuracy, greedy (last)"),
    ("moe/aux_loss", "mean", "load-balancing loss (mean)"),
    ("moe/load_imbalance_cv", "mean", "expert load CV (mean)"),
    ("perf/train_time_s", "mean", "trainer time per step, s (mean)"),
]
PER_STEP_TAGS: list[tuple[str, str]] = [
    ("moe/routing_agreement", "routing agreement"),
    ("mismatch/kl_infer_train_k3", "KL(π_infer‖π_train) k3"),
    ("train/grad_norm", "grad norm"),
    ("reward/accuracy", "reward"),
]


def comparison_lines(scalars: Mapping[str, Mapping[str, list[tuple[int, float]]]]) -> list[str]:
    """The summary table, then one per-step table per `PER_STEP_TAGS` entry. `scalars`: arm → tag →
    [(step, value)] (as `run.read_scalars`), arms in column order. A missing value prints as —."""
    from megatron_tail.demo.scalars import fmt as _fmt
    from megatron_tail.demo.scalars import summarise

    arms = list(scalars)
    width = max(len(label) for _, _, label in MOE_ROWS) + 2
    lines = ["".ljust(width) + "".join(a.rjust(12) for a in arms)]
    for tag, how, label in MOE_ROWS:
        cells = [_fmt(summarise([v for _, v in scalars[a].get(tag, [])], how)).rjust(12) for a in arms]
        lines.append(label.ljust(width) + "".join(cells))
    for tag, label in PER_STEP_TAGS:
        series = {a: dict(scalars[a].get(tag, [])) for a in arms}
        steps = sorted({s for values in series.values() for s in values})
        if not steps:
            continue
        lines += ["", f"{label} by step".ljust(8 + 2) + "".join(a.rjust(12) for a in arms)]
        for step in steps:
            cells = [_fmt(series[a].get(step, float("nan"))).rjust(12) for a in arms]
            lines.append(f"{step:>8}  " + "".join(cells))
    return lines


def print_moe_comparison(dirs: Mapping[str, Path], *, say=print) -> None:
    """Read each run's TensorBoard scalars and print `comparison_lines`."""
    from megatron_tail.demo.scalars import read_scalars

    say("\n== MoE routing replay, same seed: " + " vs ".join(dirs) + "  (bf16 engine, fp32 trainer)")
    for line in comparison_lines({name: read_scalars(path) for name, path in dirs.items()}):
        say(line)


def moe_refusals(overrides: Sequence[str]) -> str | None:
    """Why `--moe` cannot run with these overrides (a one-line message), or None."""
    from megatron_tail.demo.scalars import uses_environment

    if uses_environment(overrides):
        return (
            "demo --moe with rollout.env.name: the MoE demo model is pretrained without the calculator tool"
        )
    return None
