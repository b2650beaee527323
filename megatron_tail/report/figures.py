"""The report's figures, one function each: `f(runs, labels, out_dir) -> FigureResult` (the PNG's path, or
None when no run logged the figure's tags, and the tags no run logged).

Tags are the trainer's (`megatron_tail.train.rl.diagnostics`, `train.rl.update`, `train.run.session`):
Δ = log π_infer − log π_train per sampled token; buckets `p<lo>_<hi>` of π_train (and `_by_infer`, of
π_infer). DVP paper: Prop. 4.2 bounds |Δ| ≤ 2ε(1 − p) for a logit error ε; Prop. 4.3 says sampled tail
tokens have Δ > 0; Prop. 5.5 bounds the bias of the pruned objective by R·T·(1 − Z_min).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from megatron_tail.report.buckets import (
    AboveBoundPanel,
    AbsDeltaPanel,
    SignedDeltaPanel,
    TokensPanel,
    bucket_families_missing,
    discover_buckets,
)
from megatron_tail.report.early_warning import early_warning_figure
from megatron_tail.report.events import RunEvents
from megatron_tail.report.histograms import TailHistogramPanel
from megatron_tail.report.plotting import FigureResult, Series, draw_figure


def reward_figure(runs: Sequence[RunEvents], labels: Sequence[str], out_dir: Path) -> FigureResult:
    panels = [
        Series("mean reward of the rollouts", ("reward/mean",), ylabel="reward"),
        Series(
            "accuracy",
            ("reward/accuracy", "eval/sampled_accuracy", "eval/greedy_accuracy"),
            ylabel="fraction correct",
            from_zero=True,
            names=("rollouts (train prompts)", "eval, sampled", "eval, greedy"),
        ),
    ]
    caption = "Reward and accuracy of the step's rollouts; held-out accuracy where eval ran."
    return draw_figure(
        "reward_accuracy", "Reward and accuracy", panels, runs, labels, out_dir, caption=caption
    )


def grad_norm_figure(runs: Sequence[RunEvents], labels: Sequence[str], out_dir: Path) -> FigureResult:
    panels = [
        Series(
            "gradient norm (before clipping)",
            ("train/grad_norm", "train/grad_norm_max"),
            ylabel="‖g‖",
            scale="auto",
            names=("mean over the step's updates", "max over the step's updates"),
        )
    ]
    caption = "Gradient norm per RL step (mean and max over its optimizer updates)."
    return draw_figure("grad_norm", "Gradient norm", panels, runs, labels, out_dir, caption=caption, ncols=1)


def mismatch_buckets_figure(runs: Sequence[RunEvents], labels: Sequence[str], out_dir: Path) -> FigureResult:
    buckets = discover_buckets(runs)
    panels = [
        AbsDeltaPanel(buckets),
        SignedDeltaPanel(buckets),
        AboveBoundPanel(buckets),
        TokensPanel(buckets),
    ]
    result = draw_figure(
        "mismatch_buckets",
        "Training–inference mismatch per probability bucket (Prop. 4.2)",
        panels,
        runs,
        labels,
        out_dir,
        caption=(
            "Token-weighted means over all steps per bucket, head (p → 1) left to tail right; solid: buckets "
            "of π_train, dashed: of π_infer. Shaded: the Prop. 4.2 bound 2ε̂(1 − p) between the bucket's "
            "edges, ε̂ = mean over steps of `mismatch/logit_error_max`."
        ),
    )
    return _with_missing(result, bucket_families_missing(result.missing, buckets))


def kl_figure(runs: Sequence[RunEvents], labels: Sequence[str], out_dir: Path) -> FigureResult:
    panels = [
        Series(
            "KL(π_infer ‖ π_train), k3 estimate", ("mismatch/kl_infer_train_k3",), ylabel="nats", scale="auto"
        ),
        Series(
            "Δ over all sampled tokens",
            ("mismatch/abs_delta", "mismatch/signed_delta"),
            ylabel="nats",
            zero_line=True,
            names=("mean |Δ|", "mean Δ"),
        ),
    ]
    caption = (
        "Mismatch between the rollout engine and the trainer over steps (Δ = log π_infer − log π_train)."
    )
    return draw_figure("mismatch_kl", "Mismatch over steps", panels, runs, labels, out_dir, caption=caption)


def tail_delta_figure(runs: Sequence[RunEvents], labels: Sequence[str], out_dir: Path) -> FigureResult:
    panels = [
        TailHistogramPanel("mismatch/tail_delta", "tail chosen by π_train"),
        TailHistogramPanel("mismatch/tail_delta_by_infer", "tail chosen by π_infer"),
        Series(
            "mean Δ of sampled tail tokens",
            ("mismatch/tail_signed_delta", "mismatch/tail_signed_delta_by_infer"),
            ylabel="nats",
            zero_line=True,
            names=("tail by π_train", "tail by π_infer"),
        ),
        Series(
            "mode of the tail's Δ",
            ("mismatch/tail_delta_mode", "mismatch/tail_delta_mode_by_infer"),
            ylabel="nats",
            zero_line=True,
            names=("tail by π_train", "tail by π_infer"),
        ),
    ]
    caption = (
        "Histograms: Δ of sampled tail tokens summed over all steps, as fractions of each run's tail tokens "
        "(black line: 0; dotted: each run's mode). Prop. 4.3 predicts mass right of 0, for both choices of "
        "the tail (choosing it by π_train biases Δ up, by π_infer down)."
    )
    return draw_figure(
        "tail_delta", "Δ of sampled tail tokens (Prop. 4.3)", panels, runs, labels, out_dir, caption=caption
    )


def safe_mass_figure(runs: Sequence[RunEvents], labels: Sequence[str], out_dir: Path) -> FigureResult:
    panels = [
        Series(
            "pruned probability mass 1 − Z",
            ("dvp/safe_mass_min", "dvp/safe_mass_mean"),
            ylabel="1 − Z",
            scale="auto",
            transform=lambda z: 1.0 - z,
            names=("1 − Z_min (dvp/safe_mass_min)", "1 − mean Z (dvp/safe_mass_mean)"),
        ),
        Series("Prop. 5.5 bias bound R·T·(1 − Z_min)", ("dvp/bias_bound",), ylabel="bound", scale="auto"),
    ]
    caption = "Safe mass Z = Σ_{V_S} π, shown as the pruned mass 1 − Z, and the bias bound it implies."
    return draw_figure(
        "safe_mass",
        "Safe mass and the DVP bias bound (Prop. 5.5)",
        panels,
        runs,
        labels,
        out_dir,
        caption=caption,
    )


def importance_figure(runs: Sequence[RunEvents], labels: Sequence[str], out_dir: Path) -> FigureResult:
    fraction = "fraction"
    panels = [
        Series("IS weight", ("is/weight_max", "is/weight_mean"), scale="auto", names=("max", "mean")),
        Series("tokens with IS weight 0", ("is/zero_weight_fraction",), ylabel=fraction, from_zero=True),
        Series("vetoed sequences", ("is/vetoed_fraction",), ylabel=fraction, from_zero=True),
        Series("STAPO-masked tokens", ("stapo/masked_fraction",), ylabel=fraction, from_zero=True),
        Series("Lopti low-probability tokens", ("lopti/low_fraction",), ylabel=fraction, from_zero=True),
        Series(
            "sampled tokens outside V_S", ("dvp/out_of_safe_set_fraction",), ylabel=fraction, from_zero=True
        ),
    ]
    caption = "Importance weights and the fractions of tokens / sequences each correction touched."
    return draw_figure(
        "is_veto_masks",
        "Importance weights, veto, STAPO, Lopti",
        panels,
        runs,
        labels,
        out_dir,
        caption=caption,
        ncols=3,
        panel_size=(4.6, 3.2),
    )


def safe_set_size_figure(runs: Sequence[RunEvents], labels: Sequence[str], out_dir: Path) -> FigureResult:
    panels = [
        Series(
            "safe-set size |V_S| per position",
            ("dvp/safe_set_size_mean", "dvp/safe_set_size_min"),
            ylabel="tokens",
            scale="auto",
            names=("mean", "min"),
        )
    ]
    caption = "How many tokens DVP keeps per scored position."
    return draw_figure(
        "safe_set_size", "Safe-set size", panels, runs, labels, out_dir, caption=caption, ncols=1
    )


def truncation_figure(runs: Sequence[RunEvents], labels: Sequence[str], out_dir: Path) -> FigureResult:
    fraction = "fraction"
    panels = [
        Series(
            "trainer mass outside the engine's support 1 − Z_support",
            ("mismatch/outside_support_mass",),
            ylabel="1 − Z",
            from_zero=True,
        ),
        Series("PPO clip, A > 0", ("train/clip_fraction_pos_adv",), ylabel=fraction, from_zero=True),
        Series("PPO clip, A < 0", ("train/clip_fraction_neg_adv",), ylabel=fraction, from_zero=True),
        Series("raw IS ratio π_old/π_infer (mean)", ("is/raw_ratio_mean",), scale="auto"),
        Series("IS log-bias E[log π_old − log π_infer]", ("is/raw_log_ratio_mean",), scale="auto"),
        Series("entropy (θ_old, over the op's normaliser)", ("policy/entropy",), ylabel="nats", scale="auto"),
    ]
    caption = (
        "Truncated sampling (rollout.sampling.top_k/top_p/min_p): the trainer's mass the engine never "
        "samples, PPO's clip per sign of the advantage, and the importance ratio before any IS rule. "
        "Replayed, the ratio is 1 whatever 1 − Z_support is; ignored (algorithm.sampling_support: ignore), "
        "its log is log Z_support."
    )
    return draw_figure(
        "truncation",
        "Truncated sampling: support mass, clipping, IS bias",
        panels,
        runs,
        labels,
        out_dir,
        caption=caption,
        ncols=3,
        panel_size=(4.6, 3.2),
    )


FIGURES = (
    reward_figure,
    grad_norm_figure,
    mismatch_buckets_figure,
    kl_figure,
    tail_delta_figure,
    safe_mass_figure,
    importance_figure,
    safe_set_size_figure,
    truncation_figure,
    early_warning_figure,
)
"""Every figure of the report, in its order."""


def _with_missing(result: FigureResult, missing: list[str]) -> FigureResult:
    return FigureResult(result.name, result.title, result.path, missing, result.caption)
