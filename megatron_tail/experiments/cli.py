"""`megatron-tail experiment NAME`: experiments that reproduce the papers' effects on CPU.

    megatron-tail experiment tail-mismatch [--variant bf16|fp8] [--out DIR] [--cache-dir DIR]
        [--seeds 0 1 2] [--arms naive mis ...] [--set key=value ...]

tail-mismatch: a tiny Qwen3 over an 8192-id Zipf language (real long tails), bf16 engine vs fp32 trainer;
arms naive, TIS, MIS, DVP+MIS, STAPO and Lopti over 3 seeds (about 20 min on 2 cores, pretraining
included). Writes a results table (results.md), every run's TensorBoard logs and a figure report.
--variant fp8: the engine's linear layers in FP8 (SGLang's --quantization fp8 scheme), 60 steps per run
(about 50 min), into runs/tail_mismatch_fp8 by default.

collapse: the same model and task over 100 steps with a mismatch dial (engine formats, then a synthetic
tail-shaped logit noise); --suite arms (default: six arms × seeds at --level), dose (the naive arm at each
level), rho (DVP+MIS at log ρ -3 … -20 and auto) or truncation (engine top-p 0.98 … 0.5 and min-p at ρ,
scored one-sided, replayed or with DVP, 80 steps; --quick: a 3-step subset). Into runs/collapse by default;
see megatron_tail/experiments/collapse.py, truncation.py and docs/results/collapse/.
"""

from __future__ import annotations

import argparse

from megatron_tail.config.arguments import add_overrides_argument
from megatron_tail.utils.errors import UserError

EXPERIMENTS = ("tail-mismatch", "collapse")


def add_experiment_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "experiment",
        help="run a paper-reproduction experiment on CPU (tail-mismatch: 6 stability arms × 3 seeds)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("name", choices=EXPERIMENTS)
    parser.add_argument(
        "--variant",
        default="bf16",
        choices=["bf16", "fp8"],
        help="the engine: bf16 (20 steps) or fp8 linear layers (60 steps) (default bf16)",
    )
    parser.add_argument(
        "--model-size",
        default="tiny",
        choices=["tiny", "small"],
        help="the tail model: tiny (hidden 64, 2 layers) or small (hidden 256, 4 layers) (default tiny)",
    )
    parser.add_argument(
        "--out",
        default=None,
        help="(default runs/tail_mismatch; runs/tail_mismatch_fp8 with --variant fp8; runs/collapse)",
    )
    parser.add_argument(
        "--suite",
        default="arms",
        choices=["arms", "dose", "rho", "truncation"],
        help="collapse only (default arms)",
    )
    parser.add_argument(
        "--dials",
        nargs="+",
        default=None,
        help="collapse --suite truncation: engine dials (top_p0.98 top_p0.9 top_p0.7 top_p0.5 min_p_rho); "
        "with --arms, every arm at every dial (default: the 16-group grid of truncation.DEFAULT_GRID)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="collapse --suite truncation: one dial, two arms, one seed, 3 steps (a smoke run)",
    )
    parser.add_argument("--level", default=None, help="collapse only: the mismatch level of arms/rho")
    parser.add_argument(
        "--levels", nargs="+", default=None, help="collapse --suite dose: levels (default all)"
    )
    parser.add_argument(
        "--rhos",
        nargs="+",
        default=None,
        help="collapse --suite rho: log ρ values or auto (default -3 … -20, auto)",
    )
    parser.add_argument("--jobs", type=int, default=2, help="collapse only: runs at once (default 2)")
    parser.add_argument(
        "--cache-dir", default="runs/tail_cache", help="pretrained model + prompts (default runs/tail_cache)"
    )
    parser.add_argument(
        "--seeds", type=int, nargs="+", default=None, help="(default 0 1 2; 1 2 3 for --suite truncation)"
    )
    parser.add_argument("--arms", nargs="+", default=None, help="a subset of the arms (default: all)")
    add_overrides_argument(parser, "a config override for every run, e.g. train.steps=40")
    parser.set_defaults(func=_run)
    return parser


FLAG_SCOPES = {
    "suite": ("collapse", None, "arms"),
    "level": ("collapse", ("arms", "rho"), None),
    "levels": ("collapse", ("dose",), None),
    "rhos": ("collapse", ("rho",), None),
    "dials": ("collapse", ("truncation",), None),
    "quick": ("collapse", ("truncation",), False),
    "jobs": ("collapse", None, 2),
    "variant": ("tail-mismatch", None, "bf16"),
    "arms": (None, ("arms", "truncation"), None),
}
"""A flag's destination → (the experiment it is for, None: both; the collapse suites it is for, None: all; its
default): a flag given where it does nothing is refused (`suite_groups` reads each only for its suites)."""


def check_flag_scopes(args) -> None:
    """UserError naming a flag given to an experiment or suite that ignores it."""
    for dest, (experiment, suites, default) in FLAG_SCOPES.items():
        if getattr(args, dest) == default:
            continue
        flag = f"--{dest}"
        if experiment is not None and args.name != experiment:
            raise UserError(f"{flag} is for `experiment {experiment}`; `experiment {args.name}` ignores it")
        if args.name == "collapse" and suites is not None and args.suite not in suites:
            raise UserError(f"{flag} is for --suite {' or '.join(suites)}; --suite {args.suite} ignores it")


def _run(args) -> int:
    check_flag_scopes(args)
    if args.name == "collapse":
        return _run_collapse(args)
    from megatron_tail.experiments.tail_mismatch import ARMS, DEFAULT_OUT, DEFAULT_SEEDS, run_experiment

    results = run_experiment(
        args.out or DEFAULT_OUT[args.variant],
        args.cache_dir,
        seeds=args.seeds or DEFAULT_SEEDS,
        arms=args.arms or tuple(ARMS),
        overrides=args.overrides,
        variant=args.variant,
        model_size=args.model_size,
    )
    print(results.read_text())
    return 0


def _run_collapse(args) -> int:
    from megatron_tail.experiments import truncation
    from megatron_tail.experiments.collapse import (
        DEFAULT_LEVEL,
        DEFAULT_OUT,
        DEFAULT_SEEDS,
        LEVELS,
        RHO_GRID,
        run_collapse,
    )

    quick = truncation.QUICK if args.quick else {}
    results = run_collapse(
        args.out or DEFAULT_OUT,
        args.cache_dir,
        suite=args.suite,
        level=args.level or DEFAULT_LEVEL,
        arms=args.arms or quick.get("arms"),  # None: the suite's default (truncation: its grid)
        levels=args.levels or tuple(LEVELS),
        rhos=args.rhos or RHO_GRID,
        dials=args.dials or quick.get("dials"),
        seeds=args.seeds
        or quick.get("seeds")
        or (truncation.SEEDS if args.suite == "truncation" else DEFAULT_SEEDS),
        overrides=[*quick.get("overrides", ()), *args.overrides],
        jobs=args.jobs,
        model_size=args.model_size,
    )
    print(results.read_text())
    return 0
