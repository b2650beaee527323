"""The tail-mismatch experiment: six stability arms × several seeds on a model whose next-token
distributions have real tails (8192-id Zipf language), bf16 engine against fp32 trainer.

    megatron-tail experiment tail-mismatch [--variant bf16|fp8] [--out DIR] [--seeds 0 1 2] [--arms ...]

Writes `<out>/<arm>/seed<k>/` (ordinary run directories), `<out>/results.md` + `results.json` (the table:
mean ± std over seeds) and `<out>/report/` (`megatron-tail report` over each arm's first seed). Finished
runs are reused, so an interrupted experiment resumes where it stopped.
"""

from __future__ import annotations

import functools
import json
import math
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from megatron_tail.demo.run import launch_training, read_scalars, reusable_run, summarise, training_failed
from megatron_tail.demo.scalars import per_token_mean
from megatron_tail.train.run.run_dir import diverged_at
from megatron_tail.train.run.supervise import StopRelay, run_at_once
from megatron_tail.utils.errors import UserError

from .tail_config import TAIL_CONFIG_YAML
from .tail_model import ensure_tail_model, ensure_tail_prompts

ARMS: dict[str, list[str]] = {
    "naive": [],
    "tis": ["algorithm.is_mode=tis"],
    "mis": ["algorithm.is_mode=mis", "algorithm.veto_threshold=1e-4"],
    "dvp_mis": ["algorithm.log_rho=-9", "algorithm.is_mode=mis", "algorithm.veto_threshold=1e-4"],
    "stapo": ["algorithm.stapo=true"],
    "lopti": ["algorithm.lopti=true"],
}
"""Each arm = the config's naive baseline (no DVP, no IS correction, no veto) + one remedy. DVP's log ρ is
−9 here, not the paper's −13: the pretrained model's logits span about 10.6 nats from the most to the least
probable word (9.7 at least, measured on 64 contexts), so e^−13 prunes nothing at T = 1 and DVP would be the
naive arm; e^−8 would prune up to 21% of the mass (Z_min 0.79) and e^−10 under 1% (|V_S| ≈ 8112 of 8192)."""
DEFAULT_SEEDS = (0, 1, 2)

VARIANTS: dict[str, list[str]] = {
    "bf16": [],
    "fp8": ["rollout.quantization=fp8", "train.steps=60", "train.checkpoint_every=60"],
}
"""The engine's precision (added to every arm): "bf16", the config as written (bf16 engine, fp32 trainer,
20 steps); "fp8", the same engine with FP8 linear layers (SGLang's `--quantization fp8` scheme,
`rollout/local_engine/fp8.py`) over 60 steps: the mismatch FP8 users create, over a longer horizon."""
DEFAULT_OUT = {"bf16": "runs/tail_mismatch", "fp8": "runs/tail_mismatch_fp8"}

# (column, tag, how over steps, format)
COLUMNS: list[tuple[str, str, str, str]] = [
    ("reward (last 5 steps)", "reward/mean", "last5", ".3f"),
    ("accuracy (last 5)", "reward/accuracy", "last5", ".3f"),
    ("grad-norm peak", "train/grad_norm_max", "max", ".3g"),
    ("KL(π_infer‖π_train) k3 (mean)", "mismatch/kl_infer_train_k3", "mean", ".2e"),
    ("tail |Δ|, π<1e-4 (per token)", "mismatch/abs_delta/p0_0.0001", "per_token", ".3g"),
    ("vetoed fraction (mean)", "is/vetoed_fraction", "mean", ".3g"),
    ("IS weight 0 (mean)", "is/zero_weight_fraction", "mean", ".3g"),
    ("STAPO masked (mean)", "stapo/masked_fraction", "mean", ".3g"),
    ("|V_S| (mean)", "dvp/safe_set_size_mean", "mean", ".4g"),
]


def run_experiment(
    out_dir: str | Path,
    cache_dir: str | Path,
    *,
    seeds: Sequence[int] = DEFAULT_SEEDS,
    arms: Sequence[str] = tuple(ARMS),
    overrides: Sequence[str] = (),
    variant: str = "bf16",
    model_size: str = "tiny",
    log: Callable[[str], None] = print,
) -> Path:
    """Every (arm, seed) run of the `variant` (`VARIANTS`) on the tail model of `model_size`
    (`tail_model.MODEL_SIZES`), then the table and the report; returns `<out>/results.md`. `overrides`
    come after the variant's, so they win.

    Raises `RuntimeError` naming the run and its log if a training run fails.
    """
    unknown = sorted(set(arms) - set(ARMS))
    if unknown:
        raise UserError(f"unknown arm(s) {unknown}; the arms are {list(ARMS)}")
    if variant not in VARIANTS:
        raise UserError(f"unknown variant {variant!r}; the variants are {list(VARIANTS)}")
    out, cache = Path(out_dir), Path(cache_dir)
    started = time.monotonic()
    groups = {arm: [*ARMS[arm], *VARIANTS[variant], *overrides] for arm in arms}
    runs = run_grid(out, cache, groups, seeds=seeds, model_size=model_size, log=log)
    table = summarise_arms(runs)
    label = variant if model_size == "tiny" else f"{variant}, {model_size} model"
    results = write_results(out, table, seeds=seeds, minutes=(time.monotonic() - started) / 60, variant=label)
    from megatron_tail.report.build import write_report

    report = write_report([paths[0] for paths in runs.values()], out / "report", labels=list(runs), say=log)
    log(f"results: {results}\nreport (seed {seeds[0]} of each arm): {report}")
    return results


def check_grid(
    out: Path, cache: Path, groups: dict[str, list[str]], *, seeds: Sequence[int], base_yaml: str, jobs: int
) -> None:
    """UserError for what `run_grid` would otherwise find only after pretraining, or never: every group's
    config (`base_yaml` + its overrides) loads, the seeds are distinct and each a seed the config takes,
    `jobs` ≥ 1, and neither `out` nor `cache` is a file."""
    from megatron_tail.config.arguments import refuse_owned_overrides
    from megatron_tail.config.loader import config_from_yaml

    owned = {"run_dir": "each run's is under --out", "seed": "choose them with --seeds"}
    for knobs in groups.values():
        refuse_owned_overrides(knobs, owned, "experiment")
    for name, knobs in groups.items():
        try:
            config_from_yaml(base_yaml, knobs)
        except UserError as e:
            raise UserError(f"arm {name!r}: {e}") from None
    if len(set(seeds)) != len(seeds):  # one run directory per seed: a repeat would train it twice over
        raise UserError(f"--seeds must be distinct; got {list(seeds)}")
    for seed in seeds:  # each is a run's `seed`: one the config refuses, refused before the pretraining
        try:
            config_from_yaml(base_yaml, [f"seed={seed}"])
        except UserError as e:
            raise UserError(f"--seeds {seed}: {e}") from None
    if jobs < 1:
        raise UserError(f"--jobs must be ≥ 1; got {jobs}")
    for flag, path in (("--out", out), ("--cache-dir", cache)):
        if Path(path).exists() and not Path(path).is_dir():
            raise UserError(f"{flag} {path} is a file; a directory is expected")


def run_grid(
    out: Path,
    cache: Path,
    groups: dict[str, list[str]],
    *,
    seeds: Sequence[int],
    base_yaml: str = TAIL_CONFIG_YAML,
    model_size: str = "tiny",
    jobs: int = 1,
    log: Callable[[str], None] = print,
) -> dict[str, list[Path]]:
    """Train every (group, seed) on the tail model into `<out>/<group>/seed<k>/` (config `base_yaml` + the
    model and prompts + the group's overrides); returns group → its run directories in seed order.
    Finished runs are reused, so an interrupted grid resumes where it stopped; `jobs` runs train at once.

    Raises `RuntimeError` naming the run and its log if a training run fails, and UserError, before the tail
    model is made (minutes of pretraining on a fresh cache), for a bad override, seed list, job count or path.
    """
    check_grid(out, cache, groups, seeds=seeds, base_yaml=base_yaml, jobs=jobs)
    model_dir = ensure_tail_model(cache, log=log, size=model_size)
    train_file, _ = ensure_tail_prompts(cache)
    base = [f"model.hf_path={model_dir}", f"data.train_path={train_file}"]
    runs: dict[str, list[Path]] = {}
    pending: list[tuple[str, int, Path, list[str]]] = []
    for name, knobs in groups.items():
        for seed in seeds:
            target = out / name / f"seed{seed}"
            overrides = [*base, f"run_dir={target}", f"seed={seed}", *knobs]
            runs.setdefault(name, []).append(target)
            if reusable_run(target, overrides, base_yaml=base_yaml):
                log(f"[{name} seed {seed}] finished earlier: {target}")
            else:
                pending.append((name, seed, target, overrides))

    def train(job: tuple[str, int, Path, list[str]], relay: StopRelay | None = None) -> None:
        name, seed, target, overrides = job
        t0 = time.monotonic()
        outcome = launch_training(target, overrides, base_yaml=base_yaml, quiet=True, relay=relay)
        if outcome.stopped_by is None and (step := diverged_at(target)) is not None:
            # a result, not a failure: collapsed by its non-finite loss (the table's verdict reads it)
            log(f"[{name} seed {seed}] diverged after step {step}, counted as collapsed: {target}")
            return
        if (code := training_failed(outcome, f" [{name} seed {seed}], see {target}/train.log,")) is not None:
            raise SystemExit(code)
        log(f"[{name} seed {seed}] {time.monotonic() - t0:.0f} s: {target}")

    if jobs <= 1:
        for job in pending:
            train(job)
    else:  # each run is its own torchrun process tree; threads wait for them, stop signals reach them all
        run_at_once([functools.partial(train, job) for job in pending], workers=jobs)
    return runs


def summarise_arms(runs: dict[str, list[Path]]) -> dict[str, dict[str, tuple[float, float]]]:
    """arm → column → (mean, std over seeds) of each run's summary (`COLUMNS`); NaN where a tag is absent."""
    table = {}
    for arm, paths in runs.items():
        per_run = []
        for path in paths:
            scalars = read_scalars(path)
            per_run.append([_column(scalars, tag, how) for _, tag, how, _ in COLUMNS])
        table[arm] = {col[0]: _mean_std([r[i] for r in per_run]) for i, col in enumerate(COLUMNS)}
    return table


def _column(scalars: dict, tag: str, how: str) -> float:
    """One run's value of a column: `summarise` over its steps, or "per_token": `per_token_mean`."""
    if how == "per_token":
        return per_token_mean(scalars, tag)
    return summarise([v for _, v in scalars.get(logged_tag(scalars, tag), [])], how)


def logged_tag(scalars: dict, tag: str) -> str:
    """`tag`, or what a run logged before it: `train/grad_norm` (a step's mean over its updates) for
    `train/grad_norm_max`, the peak that Lopti's two updates a step would otherwise halve."""
    return "train/grad_norm" if tag == "train/grad_norm_max" and tag not in scalars else tag


def write_results(out: Path, table, *, seeds: Sequence[int], minutes: float, variant: str = "bf16") -> Path:
    """`results.md` (markdown table, mean ± std over seeds) and `results.json` (the same numbers)."""
    header = ["arm", *(c[0] for c in COLUMNS)]
    lines = [
        f"# Tail-mismatch experiment ({variant} engine): {len(table)} arms × {len(seeds)} seeds "
        f"({minutes:.1f} min)",
        "",
        "Mean ± std over seeds " + ", ".join(map(str, seeds)) + ". Runs: `<arm>/seed<k>/`; figures: "
        "[report/report.md](report/report.md).",
        "",
        "| " + " | ".join(h.replace("|", "\\|") for h in header) + " |",
        "|" + "---|" * len(header),
    ]
    for arm, row in table.items():
        cells = [arm] + [_cell(*row[c[0]], c[3]) for c in COLUMNS]
        lines.append("| " + " | ".join(cells) + " |")
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(
        json.dumps({"variant": variant, "seeds": list(seeds), "table": table}, indent=2)
    )
    path = out / "results.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def _mean_std(values: list[float]) -> tuple[float, float]:
    """Mean and sample std over the seeds whose value is a number; the std is NaN for one such seed (no
    spread to tell: a cell says so, not "± 0")."""
    values = [v for v in values if not math.isnan(v)]
    if not values:
        return math.nan, math.nan
    mean = sum(values) / len(values)
    if len(values) == 1:
        return mean, math.nan
    return mean, math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))


def _cell(mean: float, std: float, fmt: str) -> str:
    if math.isnan(mean):
        return "—"
    if math.isnan(std):
        return f"{mean:{fmt}} (one seed)"
    return f"{mean:{fmt}} ± {std:{fmt}}"
