"""Command-line arguments that name a run config: `CONFIG.yaml` and repeatable `--set KEY=VALUE` overrides,
shared by every sub-command that loads one (`train`, `demo`)."""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence

from megatron_tail.utils.errors import UserError


def add_config_arguments(parser: argparse.ArgumentParser, *, required: bool) -> None:
    """The positional `config` (a YAML path) and `--set` overrides."""
    parser.add_argument(
        "config", nargs=None if required else "?", default=None, help="YAML run config (see examples/)"
    )
    add_overrides_argument(parser, "override a config value, e.g. --set algorithm.log_rho=-13")


def add_overrides_argument(parser: argparse.ArgumentParser, help_text: str) -> None:
    """`--set KEY=VALUE` (repeatable) into `args.overrides`, the form `load_config` takes."""
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help=f"{help_text} (repeatable)",
    )


def refuse_owned_overrides(overrides: Sequence[str], owned: Mapping[str, str], command: str) -> None:
    """UserError naming the first `--set KEY=VALUE` whose key `command` sets itself for each of its runs
    (`owned`: key → how to choose it instead). Its overrides come last, so such a `--set` won silently: a
    demo's `run_dir` trained elsewhere than `--run-dir` said, an experiment's `seed` made every seed's run
    the same."""
    for override in overrides:
        key = override.partition("=")[0].strip()
        if key in owned:
            raise UserError(f"--set {key}: {command} sets {key} for each of its runs; {owned[key]}")
