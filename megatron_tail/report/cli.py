"""`megatron-tail report RUN_DIR [RUN_DIR ...] [--out DIR] [--labels L ...]`: figures of one or more RL runs.

Reads each run's TensorBoard events and config.yaml and writes one PNG per figure (reward and accuracy,
gradient norm, mismatch per probability bucket with the Prop. 4.2 bound, KL, the tail's Δ (Prop. 4.3),
safe mass and the Prop. 5.5 bound, IS weights / veto / STAPO / Lopti fractions, |V_S|) and a report.md
that embeds them with a summary table. Several runs overlay in each figure, labelled by the config keys
whose values differ between them. A figure whose tags no run logged is skipped, and report.md says so.
"""

from __future__ import annotations

import argparse


def add_report_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "report",
        help="PNG figures + report.md from the TensorBoard events of one or more runs",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run directories (with tensorboard/)")
    parser.add_argument(
        "--out",
        default=None,
        help="output directory (default: RUN_DIR/report for one run, <common parent>/report for several)",
    )
    parser.add_argument(
        "--labels",
        nargs="+",
        default=None,
        metavar="LABEL",
        help="one legend label per run, in order, instead of their config differences (put after RUN_DIRs)",
    )
    parser.set_defaults(func=report_command, uses_megatron=False)  # a missing directory: no torch import
    return parser


def report_command(args: argparse.Namespace) -> int:
    from pathlib import Path

    from megatron_tail.report.build import write_report
    from megatron_tail.utils.errors import UserError

    for run_dir in map(Path, args.run_dirs):
        if not run_dir.exists():
            raise UserError(f"run directory {str(run_dir)!r} does not exist")
        if not run_dir.is_dir():
            raise UserError(
                f"{str(run_dir)!r} is not a directory; expected a run directory (with tensorboard/)"
            )

    if args.labels is not None and len(args.labels) != len(args.run_dirs):
        raise UserError(
            f"--labels: got {len(args.labels)} labels for {len(args.run_dirs)} run directories; give one "
            "label per run directory, in order"
        )
    path = write_report(args.run_dirs, out_dir=args.out, labels=args.labels, say=print)
    print(f"report: {path.resolve()}", flush=True)
    return 0
