"""`megatron-tail plan CONFIG [--set k=v ...] [--nodes N --gpus-per-node G ...] [--json]`.

Exit 0 when the run fits, 1 when a term does not (the message names it and by how much), 2 for a config or
layout that cannot be planned. The layout is the config's `cluster:` section, the one `slurm/rl.sbatch`
starts (`config.cluster`); the flags below override a key of it for one check (`--rollout-tp 2` is
`--set cluster.sglang.tp=2`), and where the section leaves a value unset the plan assumes 2 nodes of
8 GPUs and SGLang's memory fraction 0.85 (`config.cluster.PLAN_*`). The environment variables that
carried the layout before are refused by name (`config.cluster.MOVED_ENVIRONMENT`).
"""

from __future__ import annotations

import argparse
import json
import sys

from megatron_tail.config.cluster import PLAN_GPUS_PER_NODE, PLAN_MEM_FRACTION, PLAN_NODES
from megatron_tail.plan.rollout import KV_DTYPE_BYTES

_CLUSTER_FLAGS = (
    "nodes",
    "gpus_per_node",
    "gpu_memory_gib",
    "host_memory_gib",
    "rollout_nodes",
    "rollout_tp",
    "rollout_ep",
    "mem_fraction",
)
"""The layout flags (argparse names); each overrides the `cluster.*` key its help names."""


def add_plan_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "plan",
        help="preflight: memory per trainer GPU and rollout server, checkpoint size; exit 1: no fit",
        description=__doc__.splitlines()[0],
    )
    p.add_argument("config")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override")
    p.add_argument("--nodes", type=int, default=None, help=f"[cluster.nodes, else {PLAN_NODES}]")
    p.add_argument(
        "--gpus-per-node", type=int, default=None, help=f"[cluster.gpus_per_node, else {PLAN_GPUS_PER_NODE}]"
    )
    p.add_argument("--gpu-memory-gib", type=float, default=None, help="per GPU [cluster.gpu_memory_gib]")
    p.add_argument(
        "--host-memory-gib", type=float, default=None, help="per trainer node [cluster.host_memory_gib]"
    )
    p.add_argument("--rollout-nodes", type=int, default=None, help="[cluster.rollout_nodes]")
    p.add_argument("--rollout-tp", type=int, default=None, help="GPUs per SGLang server [cluster.sglang.tp]")
    p.add_argument("--rollout-ep", type=int, default=None, help="SGLang --ep-size (MoE) [cluster.sglang.ep]")
    p.add_argument(
        "--mem-fraction",
        type=float,
        default=None,
        help=f"[cluster.sglang.mem_fraction, else {PLAN_MEM_FRACTION}]",
    )
    p.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=KV_DTYPE_BYTES,
        help="the SGLang servers' --kv-cache-dtype the plan counts ('auto': the engine's dtype)",
    )
    p.add_argument(
        "--quantization",
        default=None,
        help="SGLang --quantization (fp8: e4m3 linear layers) [rollout.quantization]",
    )
    p.add_argument("--reserve-gib", type=float, default=6.0, help="per trainer GPU: context, NCCL, allocator")
    p.add_argument("--fs-write-gbps", type=float, default=2.0, help="assumed write bandwidth per node (GB/s)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.set_defaults(func=run_plan, uses_megatron=False)  # nor torch: it reads config.json files


def cluster_from_args(args: argparse.Namespace, section=None):
    """The `Cluster` of the config's `cluster:` section (`config.cluster.ClusterSection`; None: its
    defaults) with the parsed `plan` flags over it (ValueError naming a bad value)."""
    from megatron_tail.config.cluster import ClusterSection

    from .planner import Cluster

    section = section or ClusterSection()
    from_section = {
        "nodes": section.nodes or PLAN_NODES,
        "gpus_per_node": PLAN_GPUS_PER_NODE if section.gpus_per_node is None else section.gpus_per_node,
        "gpu_memory_gib": section.gpu_memory_gib,
        "host_memory_gib": section.host_memory_gib,
        "rollout_nodes": section.rollout_nodes,
        "rollout_tp": section.sglang.tp,
        "rollout_ep": section.sglang.ep,
        "mem_fraction": section.sglang.mem_fraction or PLAN_MEM_FRACTION,
    }
    given = {name: getattr(args, name) for name in _CLUSTER_FLAGS if getattr(args, name) is not None}
    return Cluster(
        **{**from_section, **given},
        servers_per_node=section.servers_per_node,
        trainer_procs_per_node=section.trainer_procs_per_node,
        kv_cache_dtype=args.kv_cache_dtype,
        quantization=args.quantization,
        reserve_gib=args.reserve_gib,
        fs_write_gbps=args.fs_write_gbps,
    )


def run_plan(args: argparse.Namespace) -> int:
    from megatron_tail.config import load_config
    from megatron_tail.config.cluster import refuse_moved_environment, refuse_sglang_environment
    from megatron_tail.rollout.envs.registry import load_env_class
    from megatron_tail.utils.errors import UserError

    from .planner import make_plan
    from .report import format_plan, plan_json

    refuse_moved_environment()  # a layout variable of earlier versions would be ignored here
    try:
        config = load_config(args.config, args.set)
        if config.cluster.rollout_backend != "sglang":  # rl.sbatch skips the plan there too
            raise UserError(
                f"cluster.rollout_backend={config.cluster.rollout_backend}: the plan is of GPUs and SGLang "
                "servers; the local CPU engines are not planned (rl.sbatch starts them without a plan)"
            )
        refuse_sglang_environment()  # what the servers will inherit
        if config.rollout.env.name is not None:  # as `train` does: the environment fails here, by name
            load_env_class(config.rollout.env.name)
        plan = make_plan(config, cluster_from_args(args, config.cluster))
    except (ValueError, FileNotFoundError) as exc:  # one line, exit 2 (`megatron_tail.cli.main`)
        raise UserError(str(exc)) from exc
    print(json.dumps(plan_json(plan), indent=2) if args.json else format_plan(plan))
    if not plan.fits:
        for problem in plan.problems:
            print(f"megatron-tail plan: does not fit: {problem}", file=sys.stderr)
        return 1
    return 0
