"""The collapse experiment's "truncation" suite (issue 37): truncated sampling that the trainer does not
replay, against the replay and DVP, over a dial of how much the engine cuts.

    megatron-tail experiment collapse --suite truncation [--dials ...] [--arms ...] [--seeds 1 2 3] [--quick]

The engine samples with top-p (`DIALS`: 0.98 … 0.5) or with min-p at DVP's ρ ("min_p_rho": DVP's rule on
the engine's side only). Each arm (`ARMS`) scores those samples its own way:
- "ignore": over the full vocabulary (`algorithm.sampling_support: ignore`), the naive objective, as a stack
  without replay does: every sampled token's engine probability is inflated by 1/Z_support over the
  trainer's;
- "ignore_tis": the same with truncated IS (weights π_θold/π_infer = Z_support, capped at 2);
- "ignore_engine": the same with θ_old := the engine's log-probs (`algorithm.old_logprobs: engine`), as stacks
  that skip the recompute do: PPO's ratio then starts at Z_support, so below top-p 1 − ε_low = 0.8 every
  token with a negative advantage is clipped away ("phantom clipping"), where the literature's collapses
  are;
- "replay": the trainer normalises over the engine's support (the default);
- "dvp_replay": replay with DVP at log ρ = −9 (the tail-mismatch experiment's ρ; the engine then also gets
  min-p ρ).
`TRUNCATION_SETTINGS` (on top of the collapse settings) set a top-k of the whole vocabulary, so that top-p
alone decides the support, and the mask cap that SGLang's sampler needs for it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

from megatron_tail.rollout.settings import TOP_K_HEADROOM
from megatron_tail.utils.errors import UserError

VOCAB = 8192
"""The tail model's vocabulary (`zipf_language`)."""
LOG_RHO = -9.0
"""DVP's log ρ in this experiment (as `tail_mismatch.ARMS["dvp_mis"]`, and why there)."""

TRUNCATION_SETTINGS: list[str] = [
    f"rollout.sampling.top_k={VOCAB}",
    f"rollout.sampling.mask_max_tokens={TOP_K_HEADROOM * VOCAB}",
    "train.steps=80",
    "train.checkpoint_every=40",
]
"""Every run of the suite: top-k = the vocabulary (SGLang returns a support only under a finite top-k; at
the whole vocabulary it cuts nothing, so top-p / min-p alone set the support) with the mask cap
TOP_K_HEADROOM × top-k that the config requires; 80 steps (chosen on seed 0, whose 200-step runs at top-p 0.5
had the arms apart by step 60 and the support gap shrinking from the first step to the last; the write-up
shows them)."""

DIALS: dict[str, list[str]] = {
    "top_p0.98": ["rollout.sampling.top_p=0.98"],
    "top_p0.9": ["rollout.sampling.top_p=0.9"],
    "top_p0.7": ["rollout.sampling.top_p=0.7"],
    "top_p0.5": ["rollout.sampling.top_p=0.5"],
    "min_p_rho": [f"rollout.sampling.min_p={math.exp(LOG_RHO):.6g}"],
}
"""How much the engine cuts, in order: top-p from 0.98 to 0.5, then min-p at ρ = e^−9 (DVP's rule applied on
the engine's side only)."""

ARMS: dict[str, list[str]] = {
    "ignore": ["algorithm.sampling_support=ignore"],
    "ignore_tis": ["algorithm.sampling_support=ignore", "algorithm.is_mode=tis"],
    "ignore_engine": ["algorithm.sampling_support=ignore", "algorithm.old_logprobs=engine"],
    "replay": [],
    "dvp_replay": [f"algorithm.log_rho={LOG_RHO:g}"],
}
"""The arms (module docstring), each on top of the tail config's naive objective (no IS, no veto)."""

SEEDS = (1, 2, 3)
"""The reported seeds; seed 0 is the one the settings were chosen on (never reported)."""

DEFAULT_GRID: tuple[tuple[str, str], ...] = (
    *((arm, dial) for dial in DIALS for arm in ("ignore", "replay")),
    *(("ignore_engine", dial) for dial in ("top_p0.7", "top_p0.5", "min_p_rho")),
    ("ignore_tis", "top_p0.5"),
    *(("dvp_replay", dial) for dial in ("top_p0.5", "min_p_rho")),
)
"""(arm, dial) of the default suite, 16 groups × 3 seeds:
- the one-sided arm and the replay at every dial (the dose–response);
- θ_old from the engine where PPO can clip on the bias: below top-p 1 − ε_low = 0.8, and at min-p ρ. At
  top-p 0.98 and 0.9, Z_support ≥ top-p > 0.8, so with one update per batch no token can be clipped and the
  arm is the one-sided arm with per-token weight Z_support, i.e. TIS (weights Z ≤ 1 never reach the cap);
- TIS at top-p 0.5 only (on seed 0 there, 200 steps, it stayed within noise of the one-sided arm);
- DVP with replay at top-p 0.5 and at min-p ρ, where the engine-only min-p is DVP's rule on one side.
`--arms` / `--dials` run any product. The wide supports of top-p 0.98 and min-p ρ (about 6,000 ids per token
on this 8192-word model) cost each of their steps about twice a narrow dial's."""

QUICK: dict[str, object] = {
    "dials": ("top_p0.5",),
    "arms": ("ignore_engine", "replay"),
    "seeds": (0,),
    "overrides": ("train.steps=3", "train.checkpoint_every=3"),
}
"""`--quick`: one dial, the one-sided arm that clips and the replay, one seed, 3 steps (CI's slow tests)."""

# (column, tag, how over steps, format)
COLUMNS: list[tuple[str, str, str, str]] = [
    ("reward, last 10", "reward/mean", "last10", ".3f"),
    ("reward, best 10-step window", "reward/mean", "best10", ".3f"),
    ("1 − Z_support, first 10", "mismatch/outside_support_mass", "first10", ".3g"),
    ("1 − Z_support, last 10", "mismatch/outside_support_mass", "last10", ".3g"),
    ("clip fraction A>0 (mean)", "train/clip_fraction_pos_adv", "mean", ".3g"),
    ("clip fraction A<0 (mean)", "train/clip_fraction_neg_adv", "mean", ".3g"),
    ("IS ratio π_old/π_infer (mean)", "is/raw_ratio_mean", "mean", ".3g"),
    ("IS log-bias (mean)", "is/raw_log_ratio_mean", "mean", ".3g"),
    ("KL(π_infer‖π_train) k3 (mean)", "mismatch/kl_infer_train_k3", "mean", ".2e"),
    ("grad-norm peak", "train/grad_norm", "max", ".3g"),
    ("entropy, last 10", "policy/entropy", "last10", ".3g"),
]
"""The suite's table (`collapse.summarise_run` computes each column)."""


def truncation_groups(
    dials: Sequence[str] | None = None, arms: Sequence[str] | None = None
) -> dict[str, list[str]]:
    """`<arm>@<dial>` → its overrides (after the collapse settings): `DEFAULT_GRID` when neither is given,
    else every given (or known) arm at every given (or known) dial."""
    for kind, names, known in (("dial", dials or (), DIALS), ("arm", arms or (), ARMS)):
        unknown = sorted(set(names) - set(known))
        if unknown:
            raise UserError(f"unknown {kind}(s) {unknown}; the {kind}s are {list(known)}")
    if dials is None and arms is None:
        pairs = DEFAULT_GRID
    else:
        pairs = tuple((arm, dial) for dial in dials or DIALS for arm in arms or ARMS)
    return {f"{arm}@{dial}": [*TRUNCATION_SETTINGS, *DIALS[dial], *ARMS[arm]] for arm, dial in pairs}


DOSE_PANELS: tuple[tuple[str, str], ...] = (
    ("reward, last 10", "reward, mean of the last 10 steps"),
    ("1 − Z_support, last 10", "1 − Z_support, last 10 steps"),
    ("clip fraction A<0 (mean)", "PPO clip fraction, A < 0"),
    ("KL(π_infer‖π_train) k3 (mean)", "KL(π_infer‖π_train), k3"),
)
"""The dose–response figure's panels: (table column, panel title)."""


def dose_figure(table: dict, out: Path) -> Path | None:
    """`<out>/dose_response.png`: each `DOSE_PANELS` column (mean ± std over seeds) against the dial, one line
    per arm, from `collapse.summarise_groups`' table of `<arm>@<dial>` groups; None if no group is."""
    from matplotlib.figure import Figure

    cells: dict[str, dict[str, dict]] = {}
    for name, entry in table.items():
        arm, _, dial = name.partition("@")
        if arm in ARMS and dial in DIALS:
            cells.setdefault(arm, {})[dial] = entry["columns"]
    if not cells:
        return None
    dials = [d for d in DIALS if any(d in by_dial for by_dial in cells.values())]
    fig = Figure(figsize=(11, 7.5), layout="constrained")
    axes = fig.subplots(2, 2).ravel()
    for ax, (column, title) in zip(axes, DOSE_PANELS, strict=True):
        for k, (arm, by_dial) in enumerate(cells.items()):
            xs = [i for i, d in enumerate(dials) if d in by_dial]
            mean = [by_dial[dials[i]][column][0] for i in xs]
            std = [by_dial[dials[i]][column][1] for i in xs]
            ax.errorbar(xs, mean, yerr=std, marker="o", capsize=3, color=f"C{k}", label=arm)
        ax.set_xticks(range(len(dials)), dials)
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle("Truncation suite: dose–response over the engine's dial (mean ± std over seeds)")
    path = Path(out) / "dose_response.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return path
