"""`megatron-tail plan CONFIG [--nodes N --gpus-per-node G --gpu-memory-gib M] [--set k=v ...] [--json]`.

Exit 0 when the run fits, 1 when a term does not (the message names it and by how much), 2 for a config or
layout that cannot be planned. The rollout settings default to `slurm/rl.sbatch`'s environment variables
(`MT_ROLLOUT_NODES`, `MT_SGLANG_TP`, `MT_SGLANG_MEM_FRACTION`, and SGLang's `--ep-size` inside
`MT_SGLANG_EXTRA_ARGS`), so the script and a login-node check agree.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys


def _env(name: str, default, cast):
    value = os.environ.get(name)
    return cast(value) if value not in (None, "") else default


def sglang_ep_size(extra_args: str) -> int:
    """SGLang's `--ep-size N` (or `--ep-size=N`, `--ep N`) in `MT_SGLANG_EXTRA_ARGS`; 1 without one."""
    match = re.search(r"--ep(?:-size)?[= ](\d+)", extra_args or "")
    return int(match.group(1)) if match else 1


def add_plan_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "plan",
        help="preflight: memory per trainer GPU and rollout server, checkpoint size; exit 1: no fit",
        description=__doc__.splitlines()[0],
    )
    p.add_argument("config")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override")
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--gpu-memory-gib", type=float, default=80.0, help="per GPU [80: H100 80GB]")
    p.add_argument("--rollout-nodes", type=int, default=_env("MT_ROLLOUT_NODES", 1, int))
    p.add_argument("--rollout-tp", type=int, default=_env("MT_SGLANG_TP", 1, int))
    p.add_argument(
        "--rollout-ep",
        type=int,
        default=sglang_ep_size(os.environ.get("MT_SGLANG_EXTRA_ARGS", "")),
        help="SGLang --ep-size (MoE) [--ep-size in MT_SGLANG_EXTRA_ARGS, else 1]",
    )
    p.add_argument("--mem-fraction", type=float, default=_env("MT_SGLANG_MEM_FRACTION", 0.85, float))
    p.add_argument("--kv-cache-dtype", default="auto")
    p.add_argument(
        "--quantization",
        default=None,
        help="SGLang --quantization (fp8: e4m3 linear layers) [rollout.quantization]",
    )
    p.add_argument("--reserve-gib", type=float, default=6.0, help="per trainer GPU: context, NCCL, allocator")
    p.add_argument("--fs-write-gbps", type=float, default=2.0, help="assumed write bandwidth per node (GB/s)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.set_defaults(func=run_plan)


def cluster_from_args(args: argparse.Namespace):
    """The `Cluster` the parsed `plan` arguments describe (ValueError naming a bad value)."""
    from .planner import Cluster

    return Cluster(
        nodes=args.nodes,
        gpus_per_node=args.gpus_per_node,
        gpu_memory_gib=args.gpu_memory_gib,
        rollout_nodes=args.rollout_nodes,
        rollout_tp=args.rollout_tp,
        rollout_ep=args.rollout_ep,
        mem_fraction=args.mem_fraction,
        kv_cache_dtype=args.kv_cache_dtype,
        quantization=args.quantization,
        reserve_gib=args.reserve_gib,
        fs_write_gbps=args.fs_write_gbps,
    )


def run_plan(args: argparse.Namespace) -> int:
    from megatron_tail.config import load_config
    from megatron_tail.rollout.envs.registry import load_env_class
    from megatron_tail.utils.errors import UserError

    from .planner import make_plan
    from .report import format_plan, plan_json

    try:
        config = load_config(args.config, args.set)
        if config.rollout.env is not None:  # as `train` does: the environment fails here, by name
            load_env_class(config.rollout.env)
        plan = make_plan(config, cluster_from_args(args))
    except (ValueError, FileNotFoundError) as exc:  # one line, exit 2 (`megatron_tail.cli.main`)
        raise UserError(str(exc)) from exc
    print(json.dumps(plan_json(plan), indent=2) if args.json else format_plan(plan))
    if not plan.fits:
        for problem in plan.problems:
            print(f"megatron-tail plan: does not fit: {problem}", file=sys.stderr)
        return 1
    return 0
