"""`megatron-tail train CONFIG.yaml [--set section.key=value ...]`: the RL loop on this process's rank.

Launch one process per rank with torchrun (`torchrun --nproc-per-node 2 -m megatron_tail.cli train
CONFIG.yaml`), or run it plainly for a world of one. Exit code 0 also after a graceful stop (SIGTERM /
SIGUSR1: the step finishes, a checkpoint is written); rerunning resumes at the next step.
"""

from __future__ import annotations

import argparse

from megatron_tail.config.arguments import add_config_arguments


def add_train_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "train",
        help="run (or resume) RL training from a YAML config; launch with torchrun for several ranks",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_config_arguments(parser, required=True)
    parser.add_argument(
        "--print-config", action="store_true", help="print the resolved config (YAML) and exit"
    )
    parser.set_defaults(func=train_command)
    return parser


def train_command(args: argparse.Namespace) -> int:
    import yaml

    from megatron_tail.config import ConfigError, config_to_dict, load_config

    try:
        cfg = load_config(args.config, args.overrides)
        if not args.print_config:
            cfg.check_runnable()
    except (ConfigError, ValueError) as e:
        raise SystemExit(f"megatron-tail train: {e}") from None
    if args.print_config:
        print(yaml.safe_dump(config_to_dict(cfg), sort_keys=False, allow_unicode=True), end="")
        return 0
    import torch.distributed as dist

    from megatron_tail.train.run.loop import run

    try:
        run(cfg)
    finally:
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    return 0
