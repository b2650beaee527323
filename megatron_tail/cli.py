"""`megatron-tail` command line: one argparse sub-command per job.

Each sub-command lives next to its code and registers itself with an `add_*_parser(subparsers)`
function that sets `func`; `main` parses and calls `args.func(args)`. To add one (e.g. `train`,
`demo`), write the function and append it to `SUBCOMMANDS`. Heavy imports belong inside `func`, so
`megatron-tail --help` stays fast.
"""

from __future__ import annotations

import argparse
import signal
import sys
from collections.abc import Callable, Sequence

from megatron_tail.demo.cli import add_demo_parser
from megatron_tail.experiments.cli import add_experiment_parser
from megatron_tail.plan.cli import add_plan_parser
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
    add_plan_parser,
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="megatron-tail", description=__doc__.splitlines()[0])
    subparsers = parser.add_subparsers(dest="command", required=True)
    for add_parser in SUBCOMMANDS:
        add_parser(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one sub-command. A `UserError` prints one line (global rank 0 only; `MT_TRACEBACK=1` adds the
    traceback) and exits `EXIT_USER_ERROR`, an `OutsideFailure` likewise with `EXIT_OUTSIDE_FAILURE`; a step
    abandoned on a second stop signal exits `EXIT_ABANDONED`; a collective that failed because another rank
    died exits `EXIT_PEER_LOST` (quietly under our launcher, which names the rank; else one line); Ctrl-C
    outside a run's stop handler exits 130 without a traceback; anything else keeps Python's traceback
    (exit 1)."""
    from megatron_tail.utils import errors
    from megatron_tail.utils.expected_warnings import silence_expected_warnings

    args = build_parser().parse_args(argv)
    # the warnings expected only without CUDA come from megatron-core; a command that never imports it
    # (`uses_megatron=False`, e.g. plan) need not import torch to ask for CUDA
    silence_expected_warnings(cuda=None if getattr(args, "uses_megatron", True) else True)
    errors.PROG = f"megatron-tail {args.command}"
    try:
        return int(args.func(args) or 0)
    except (errors.UserError, errors.OutsideFailure) as e:
        return errors.report_user_error(e)
    except (errors.StepAbandoned, errors.PeerLost) as e:
        return e.exit_code
    except Exception as e:
        if not errors.lost_peer(e):
            raise
        from megatron_tail.train.run.launch_marks import report_lost_peer

        return report_lost_peer(e)
    except KeyboardInterrupt:  # Ctrl-C before the run's own handler is installed (or after it is gone)
        print(f"{errors.PROG}: interrupted", file=sys.stderr, flush=True)
        return 128 + signal.SIGINT


if __name__ == "__main__":
    sys.exit(main())
