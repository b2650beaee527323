"""Helpers that `slurm/rl.sbatch` runs with the job's Python (the one that has megatron_tail installed).

    mt_slurm.py config-get CONFIG KEY... [--set a.b=v ...]  print resolved config values, one per line
                                                             (refuses the layout variables of earlier
                                                             versions: `config.cluster.MOVED_ENVIRONMENT`)
    mt_slurm.py check-inputs CONFIG [--set a.b=v ...]       check what the trainer reads (data, reward,
                                                             model directory, layout) as `train` does
    mt_slurm.py serve --backend {sglang,local} --model-path DIR --port-base P [--tp N] [...]
                                                             exec one rollout server (one per srun task)
    mt_slurm.py router --port P URL...                       exec the SGLang router in front of URL...
    mt_slurm.py wait-healthy --timeout S [--watch-pid PID] URL...
                                                             poll GET URL/health until all answer 200
    mt_slurm.py torchrun-flags NAME...                       print those of --NAME... that this Python's
                                                             torchrun accepts, one per line
    mt_slurm.py check-ports FIRST COUNT [--node NAME=OFFSETS]...
                                                             exit 2 naming the first port of the block
                                                             that something on this node holds (with
                                                             --node: only the offsets this node uses)

`serve` is meant to run as an srun task: task `SLURM_LOCALID` = i on a node listens on `port_base + i`
and drives tp GPUs: the GPUs `[i·tp, (i+1)·tp)` of those it sees, or, where the site binds GPUs per task
(it sees only tp of them), its own from 0 (SGLang's `--base-gpu-id`, counted in `CUDA_VISIBLE_DEVICES`).
A local engine on `--device cuda` takes one GPU the same way (tp = 1: `--device cuda:i`).
It binds `--host`, else this node's Slurm name unless that resolves to a loopback address (some
clusters map the node's own name to 127.0.1.1 in /etc/hosts), then all interfaces. SGLang itself may
run in another Python (`--server-python`: its own environment, see `scripts/setup_envs.sh`). The
command lines come from
`megatron_tail.rollout.launch` (the same builders the Python API uses), so the flags the DVP processor needs
(`--enable-custom-logit-processor`, deterministic inference) are set in one place. This file imports only
the standard library at module level, so `wait-healthy` starts in well under a second.
"""

from __future__ import annotations

import argparse
import errno
import os
import shlex
import socket
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence


def _node_host() -> str:
    """The name other nodes use for this one (Slurm's node name; the hostname outside Slurm)."""
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


def base_gpu_id(local_id: int, tp: int, visible: str | None) -> int:
    """First GPU (index into what this task sees) of server task `local_id` with `tp` GPUs.

    `visible` is the task's `CUDA_VISIBLE_DEVICES`: when it lists no more than `tp` devices the site bound
    this task's GPUs to it, so they start at 0; otherwise the task sees the node's GPUs and takes its
    slice. Raises ValueError when the slice is not there."""
    devices = [d for d in (visible or "").split(",") if d.strip()]
    if visible is not None and len(devices) <= tp:
        if len(devices) < tp:
            raise ValueError(f"server task {local_id} needs {tp} GPUs; CUDA_VISIBLE_DEVICES={visible!r}")
        return 0
    if devices and (local_id + 1) * tp > len(devices):
        raise ValueError(
            f"server task {local_id} needs GPUs {local_id * tp}..{(local_id + 1) * tp - 1}, but "
            f"CUDA_VISIBLE_DEVICES={visible!r} has {len(devices)}"
        )
    return local_id * tp


def bind_host(requested: str = "") -> str:
    """The address a server binds: `requested` (MT_BIND_HOST), else this node's Slurm name, unless it
    resolves to a loopback address, which other nodes cannot reach; then 0.0.0.0 (all interfaces)."""
    if requested:
        return requested
    name = _node_host()
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(name, None)}
    except OSError:
        return "0.0.0.0"
    if any(a.startswith("127.") or a == "::1" for a in addresses):
        return "0.0.0.0"
    return name


def _format_value(key: str, value) -> str:
    if value is None:
        return ""
    if isinstance(value, (list, tuple)):
        if key.endswith("extra_args"):  # argv items: `serve --extra-args` splits them back (shlex)
            return shlex.join(str(v) for v in value)
        return ",".join(str(v) for v in value)
    return str(value)


def config_get(args: argparse.Namespace) -> int:
    """One line per key: the resolved value ("" for None, lists comma-separated, `*.extra_args` as one
    shell-quoted command line). A bad config, a moved environment variable, or one that would change the
    SGLang servers' log-probs (`REFUSED_SGLANG_ENVIRONMENT`): one line on stderr, exit 2."""
    from megatron_tail.config import load_config
    from megatron_tail.config.cluster import refuse_moved_environment, refuse_sglang_environment
    from megatron_tail.utils.errors import UserError

    try:
        refuse_moved_environment()
        cfg = load_config(args.config, args.set)
        if cfg.cluster.rollout_backend == "sglang":  # the servers inherit the job's environment
            refuse_sglang_environment()
    except UserError as exc:
        print(f"mt_slurm.py config-get: {exc}", file=sys.stderr)
        return 2
    for key in args.keys:
        value = cfg
        for part in key.split("."):
            value = getattr(value, part)
        print(_format_value(key, value))
    return 0


def check_inputs(args: argparse.Namespace) -> int:
    """What the trainer reads, checked as its `train` checks it at load (`RunConfig.check_inputs`: the run
    directory, the reward and environment, the prompt files and every prompt, the model directory and the
    layout it can take) but for the machine (CUDA, the local engine's device: that is the trainer nodes'
    business). rl.sbatch runs it before any server starts, so a user's mistake costs no servers' start-up.
    A mistake: one line on stderr, exit 2."""
    from megatron_tail.config import load_config
    from megatron_tail.utils.errors import UserError

    try:
        load_config(args.config, args.set).check_inputs(host=False)
    except UserError as exc:
        print(f"mt_slurm.py check-inputs: {exc}", file=sys.stderr)
        return 2
    return 0


def torchrun_flags(args: argparse.Namespace) -> int:
    """Each `--NAME` of `args.names` that `torch.distributed.run` defines, read from its source: its
    argparse spells each flag out (`add_argument("--signals-to-handle", ...)`, torch/distributed/run.py
    `get_args_parser`). `python -m torch.distributed.run --help` tells the same after importing torch
    (3 s of CPU per job start here); `find_spec` locates the package without importing it."""
    import importlib.util

    spec = importlib.util.find_spec("torch")
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    source = ""
    for location in locations:
        path = os.path.join(location, "distributed", "run.py")
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as f:
                source = f.read()
            break
    for name in args.names:
        if f'"--{name}"' in source:
            print(f"--{name}")
    return 0


def local_engine_device(device: str, local_id: int, visible: str | None) -> str:
    """The torch device of local-engine task `local_id` for `rollout.local.device`: a bare "cuda" is this
    task's own GPU (one per task, counted as `base_gpu_id` counts them), so the servers of a node do not all
    load on cuda:0; any other value ("cpu", an explicit "cuda:N") is kept."""
    return f"cuda:{base_gpu_id(local_id, 1, visible)}" if device == "cuda" else device


def serve(args: argparse.Namespace) -> int:
    from megatron_tail.rollout.launch import (
        LocalEngineConfig,
        SGLangServerConfig,
        build_local_engine_command,
        build_sglang_server_command,
    )

    local_id = int(os.environ.get("SLURM_LOCALID", "0"))
    port = args.port_base + local_id
    host = bind_host(args.host)
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    try:
        device = local_engine_device(args.device, local_id, visible) if args.backend == "local" else None
        first_gpu = base_gpu_id(local_id, args.tp, visible) if args.backend == "sglang" else 0
    except ValueError as e:
        print(f"[mt_slurm] {_node_host()} task {local_id}: ERROR: {e}", file=sys.stderr, flush=True)
        return 2
    if args.backend == "local":
        cfg = LocalEngineConfig(
            model_path=args.model_path,
            host=host,
            port=port,
            dtype=args.dtype,
            num_threads=args.num_threads,
            device=device,
            quantization=args.quantization,
            sampling_mask_max_tokens=args.sampling_mask_max_tokens,
            # as SGLang: --enable-deterministic-inference forces its PyTorch sampler (rollout.deterministic)
            sampling_backend="pytorch" if args.deterministic else "flashinfer",
            return_routed_experts=args.return_routed_experts,
        )
        cmd = build_local_engine_command(cfg, python=sys.executable)
    else:
        cfg = SGLangServerConfig(
            model_path=args.model_path,
            host=host,
            port=port,
            tp_size=args.tp,
            ep_size=args.ep,
            dtype=args.dtype,
            mem_fraction_static=args.mem_fraction_static,
            context_length=args.context_length,
            random_seed=args.random_seed,
            base_gpu_id=first_gpu,
            quantization=args.quantization,
            deterministic_inference=args.deterministic,
            sampling_mask_max_tokens=args.sampling_mask_max_tokens,
            return_routed_experts=args.return_routed_experts,
            extra_args=tuple(shlex.split(args.extra_args)),
            args_file=_api_key_file(args.key_dir),
        )
        cmd = build_sglang_server_command(cfg, python=args.server_python or sys.executable)
    print(f"[mt_slurm] {_node_host()} task {local_id}: {' '.join(cmd)}", flush=True)
    os.execv(cmd[0], cmd)
    return 1  # not reached


def _api_key_file(key_dir: str) -> str | None:
    """Where the job has an API key for its engines (`http_session.API_KEY_ENV`, exported by rl.sbatch), a
    file of SGLang flags holding it (`--config`: `api-key`), readable by this user alone (0600, in a 0700
    directory): in `key_dir` (rl.sbatch's, which it removes when the job ends), else a new temporary
    directory; None without a key. A local engine reads the variable itself."""
    import json
    import tempfile

    from megatron_tail.rollout.http_session import api_key

    key = api_key()
    if key is None:
        return None
    if key_dir:
        os.makedirs(key_dir, mode=0o700, exist_ok=True)
    fd, path = tempfile.mkstemp(
        prefix="api_key.", suffix=".yaml", dir=key_dir or tempfile.mkdtemp(prefix="mt-")
    )
    with os.fdopen(fd, "w") as f:
        f.write(f"api-key: {json.dumps(key)}\n")  # a JSON string is a YAML one
    return path


def router(args: argparse.Namespace) -> int:
    from megatron_tail.rollout.http_session import API_KEY_ENV, api_key
    from megatron_tail.rollout.launch import RouterConfig, build_router_command

    cfg = RouterConfig(
        worker_urls=tuple(args.urls),
        host=bind_host(args.host),
        port=args.port,
        policy=args.policy,
        extra_args=tuple(args.extra_args.split()),
        key_env=None if api_key() is None else API_KEY_ENV,
    )
    cmd = build_router_command(cfg, python=args.server_python or sys.executable)
    print(f"[mt_slurm] router on {_node_host()}: {' '.join(cmd)}", flush=True)
    os.execv(cmd[0], cmd)
    return 1  # not reached


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url.rstrip('/')}/health", timeout=5) as resp:
            return resp.status == 200
    except (OSError, urllib.error.URLError):
        return False


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def wait_healthy(args: argparse.Namespace) -> int:
    """0: all healthy; 1: timeout; 3: the watched process (the servers' srun) exited first."""
    pending = list(dict.fromkeys(args.urls))
    t0 = time.monotonic()
    last_report = t0
    while pending:
        pending = [u for u in pending if not _healthy(u)]
        if not pending:
            break
        now = time.monotonic()
        if args.watch_pid is not None and not _alive(args.watch_pid):
            print(f"[mt_slurm] server step (pid {args.watch_pid}) exited; not healthy: {pending}", flush=True)
            return 3
        if now - t0 > args.timeout:
            print(f"[mt_slurm] not healthy after {args.timeout:.0f} s: {pending}", flush=True)
            return 1
        if now - last_report > 30:
            print(f"[mt_slurm] waiting for {pending} ({now - t0:.0f} s)", flush=True)
            last_report = now
        time.sleep(args.interval)
    urls = list(dict.fromkeys(args.urls))
    print(f"[mt_slurm] healthy after {time.monotonic() - t0:.1f} s: {urls}", flush=True)
    return 0


def port_in_use(port: int) -> OSError | None:
    """The error of binding `port` on every interface of this node (IPv6 and IPv4), or None where nothing
    holds it. Something listening on any address (a server bound to the node's name, 127.0.0.1 or all)
    or holding the port bound makes the bind fail; SO_REUSEADDR lets it through connections lingering in
    TIME_WAIT and this check run at once on another node of the same host (a test's local cluster), as
    neither listens. A probe of 127.0.0.1 alone missed a server on the node's own address."""
    for family, address in ((socket.AF_INET6, ("::", port)), (socket.AF_INET, ("0.0.0.0", port))):
        try:
            sock = socket.socket(family)
        except OSError as e:
            if e.errno == errno.EAFNOSUPPORT:  # no IPv6 on this host
                continue
            raise
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
            sock.bind(address)
            return None
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                return e
            if family == socket.AF_INET6 and e.errno in (errno.EADDRNOTAVAIL, errno.EAFNOSUPPORT):
                continue
            raise
        finally:
            sock.close()
    return None


def port_role(offset: int) -> str:
    """What rl.sbatch uses the port at `offset` of a job's block for (its MT_PORT_BASE layout)."""
    roles = {0: "the router", 1: "the torchrun rendezvous", 2: "the weight-sync group"}
    return roles.get(offset, f"rollout server {offset - 3}" if offset <= 10 else "a spare port")


def node_offsets(specs: Sequence[str], count: int) -> dict[str, list[int]]:
    """`--node NAME=OFFSETS` values (`gpu1=0,3,4`; `gpu2=` for none) → {name: offsets}; a name given twice
    (a node with two roles) checks both shares. Raises ValueError naming a value that is not
    NAME=comma-separated offsets within the block."""
    nodes: dict[str, list[int]] = {}
    for spec in specs:
        name, equals, listed = spec.partition("=")
        offsets = listed.split(",") if listed else []
        if not (name and equals and all(o.isascii() and o.isdigit() and int(o) < count for o in offsets)):
            raise ValueError(f"--node {spec}: expected NAME=OFFSETS, offsets of the block (0..{count - 1})")
        nodes.setdefault(name, []).extend(int(o) for o in offsets)
    return nodes


def check_ports(args: argparse.Namespace) -> int:
    """0 where every port of the block this node uses is free on it; 2, naming the first taken, where not.
    Which ports a node uses: its `--node` entry, looked up by its Slurm name (a node missing from them is an
    error, not a node with nothing to check: a name that does not match would check nothing anywhere);
    without any `--node`, the whole block."""
    last = args.first + args.count - 1
    if not (args.count >= 1 and 1 <= args.first and last <= 65535):
        print(
            f"check-ports {args.first} {args.count}: expected a block of ports within 1..65535",
            file=sys.stderr,
        )
        return 2
    try:
        nodes = node_offsets(args.node, args.count)
    except ValueError as e:
        print(f"check-ports: {e}", file=sys.stderr)
        return 2
    host = _node_host()
    if nodes and host not in nodes:
        print(f"check-ports: this node, {host}, is not among --node's ({', '.join(nodes)})", file=sys.stderr)
        return 2
    offsets = nodes[host] if nodes else range(args.count)
    for offset in offsets:
        port = args.first + offset
        if port_in_use(port) is not None:
            print(
                f"port {port} ({port_role(offset)}, of this job's block {args.first}..{last}) is already in "
                f"use on {host}; set MT_PORT_BASE to another block",
                file=sys.stderr,
                flush=True,
            )
            return 2
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mt_slurm.py", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("config-get", help="print values of the resolved run config, one per line")
    p.add_argument("config")
    p.add_argument("keys", nargs="+", metavar="KEY", help="dotted key, e.g. model.hf_path")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override (repeatable)")
    p.set_defaults(func=config_get)

    p = sub.add_parser("serve", help="exec one rollout server (SGLang or the local CPU engine)")
    p.add_argument("--backend", choices=("sglang", "local"), required=True)
    p.add_argument("--model-path", required=True)
    p.add_argument("--port-base", type=int, required=True, help="task i listens on port_base + i")
    p.add_argument("--host", default="", help="address to bind (default: this node's Slurm name)")
    p.add_argument("--tp", type=int, default=1, help="SGLang tensor parallel size (GPUs per server)")
    p.add_argument("--ep", type=int, default=1, help="SGLang expert parallel size (cluster.sglang.ep)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--mem-fraction-static", type=float, default=None)
    p.add_argument("--context-length", type=int, default=None)
    p.add_argument("--random-seed", type=int, default=None)
    p.add_argument("--num-threads", type=int, default=None, help="local engine: torch threads")
    p.add_argument("--device", default="cpu", help="local engine: torch device of its model")
    p.add_argument(
        "--quantization", choices=("none", "fp8"), default="none", help="rollout.quantization (default none)"
    )
    p.add_argument("--extra-args", default="", help="further SGLang flags, one shell-quoted string")
    p.add_argument(
        "--sampling-mask-max-tokens", type=int, default=None, help="rollout.sampling.mask_max_tokens"
    )
    p.add_argument(
        "--deterministic",
        action="store_true",
        help="SGLang: --enable-deterministic-inference; local: --sampling-backend pytorch",
    )
    p.add_argument(
        "--return-routed-experts",
        action="store_true",
        help="--enable-return-routed-experts on either backend (algorithm.routing_replay r3)",
    )
    p.add_argument("--server-python", default="", help="the Python that runs SGLang [this one]")
    p.add_argument(
        "--key-dir", default="", help="where SGLang's file holding the job's API key goes [a new temp dir]"
    )
    p.set_defaults(func=serve)

    p = sub.add_parser("router", help="exec the SGLang router")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--host", default="")
    p.add_argument("--policy", default="cache_aware")
    p.add_argument("--extra-args", default="")
    p.add_argument("--server-python", default="", help="the Python that runs the router [this one]")
    p.add_argument("urls", nargs="+")
    p.set_defaults(func=router)

    p = sub.add_parser("check-inputs", help="check what the trainer reads (data, model, reward) as train")
    p.add_argument("config")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.set_defaults(func=check_inputs)

    p = sub.add_parser("torchrun-flags", help="which of --NAME... this Python's torchrun accepts")
    p.add_argument("names", nargs="+", metavar="NAME", help="a flag without its dashes")
    p.set_defaults(func=torchrun_flags)

    p = sub.add_parser("check-ports", help="exit 2 naming the first port of the block held on this node")
    p.add_argument("first", type=int)
    p.add_argument("count", type=int)
    p.add_argument(
        "--node", action="append", default=[], metavar="NAME=OFFSETS",
        help="the offsets into the block node NAME uses (repeatable; none given: every node checks all)",
    )  # fmt: skip
    p.set_defaults(func=check_ports)

    p = sub.add_parser("wait-healthy", help="wait until every URL answers GET /health with 200")
    p.add_argument("--timeout", type=float, default=900.0)
    p.add_argument("--interval", type=float, default=1.0)
    p.add_argument("--watch-pid", type=int, default=None, help="give up (exit 3) when this process is gone")
    p.add_argument("urls", nargs="+")
    p.set_defaults(func=wait_healthy)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
