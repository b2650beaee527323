"""Command-line arguments that name a run config: `CONFIG.yaml` and repeatable `--set KEY=VALUE` overrides,
shared by every sub-command that loads one (`train`, `demo`)."""

from __future__ import annotations

import argparse


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
