"""`megatron-tail` command line: one argparse sub-command per job.

Each sub-command lives next to its code and registers itself with an `add_*_parser(subparsers)`
function that sets `func`; `main` parses and calls `args.func(args)`. To add one (e.g. `train`,
`demo`), write the function and append it to `SUBCOMMANDS`. Heavy imports belong inside `func`, so
`megatron-tail --help` stays fast.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from megatron_tail.demo.cli import add_demo_parser
from megatron_tail.experiments.cli import add_experiment_parser
from megatron_tail.report.cli import add_report_parser
from megatron_tail.rollout.local_engine.cli import add_serve_local_parser
from megatron_tail.train.run.cli import add_eval_parser, add_train_parser

SUBCOMMANDS: list[Callable] = [
    add_train_parser,
    add_eval_parser,
    add_demo_parser,
    add_serve_local_parser,
    add_report_parser,
    add_experiment_parser,
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="megatron-tail", description=__doc__.splitlines()[0])
    subparsers = parser.add_subparsers(dest="command", required=True)
    for add_parser in SUBCOMMANDS:
        add_parser(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
