"""The job's layout on a Slurm cluster (the `cluster:` section of a run's YAML): which nodes roll out and
which train, how the rollout servers split their GPUs, what one GPU holds. `slurm/rl.sbatch` starts that
layout (it reads this section through `slurm/mt_slurm.py config-get`) and `megatron-tail plan` checks the
same section, so the script and a check on the login node agree. `megatron-tail train` checks it at load
and saves it with the run's config, but does not use it: under rl.sbatch the trainer gets its engines'
URLs, and a run on one host starts its own engine.

    cluster:
      nodes: 3                 # checked against the allocation (sbatch --nodes)
      gpus_per_node: 8
      rollout_nodes: 1
      sglang: {tp: 2, ep: 2, mem_fraction: 0.85}

What belongs to the machine rather than the run (virtualenvs, the socket interface, debug switches, the
port block) stays in `MT_*` environment variables (`slurm/README.md`). Each variable that used to carry a
key of this section is refused by name (`MOVED_ENVIRONMENT`), never read under two names.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal, get_args

from megatron_tail.utils.errors import UserError
from megatron_tail.utils.settings_checks import bad as _bad
from megatron_tail.utils.settings_checks import choice as _choice
from megatron_tail.utils.settings_checks import positive_int as _positive_int

RolloutBackend = Literal["sglang", "local"]
ROLLOUT_BACKENDS: tuple[str, ...] = get_args(RolloutBackend)
MAX_SERVERS_PER_NODE = 8
"""rl.sbatch's port block holds 8 server ports per node (`slurm/lib.sh`: 16 ports, +3..+10)."""
PLAN_NODES, PLAN_GPUS_PER_NODE, PLAN_MEM_FRACTION = 2, 8, 0.85
"""What `megatron-tail plan` assumes where the section leaves `nodes`, `gpus_per_node` or
`sglang.mem_fraction` unset (rl.sbatch takes the allocation's, and SGLang picks its own fraction)."""

ROUTER_VERSION = "0.3.2"
"""The sglang-router that `constraints-sglang.txt` pins (the servers' environment, `setup_envs.sh`)."""
ROUTER_POLICIES = ("cache_aware", "round_robin", "random", "power_of_two", "manual")
"""Its `--policy` choices (sglang_router 0.3.2, `router_args.py`, `RouterArgs.add_cli_args`): another name
would end the router at start, in `router.log` only, since the run goes on without it."""

OWNED_SGLANG_FLAGS: Mapping[str, str] = {
    "--tp-size": "cluster.sglang.tp",
    "--tensor-parallel-size": "cluster.sglang.tp",
    "--ep-size": "cluster.sglang.ep",
    "--expert-parallel-size": "cluster.sglang.ep",
    "--ep": "cluster.sglang.ep",
    "--mem-fraction-static": "cluster.sglang.mem_fraction",
    "--dtype": "rollout.dtype",
    "--quantization": "rollout.quantization",
    "--load-format": "rollout.quantization (fp8: flash_rl)",
    "--model-path": "model.hf_path",
    "--model": "model.hf_path",
    "--sampling-mask-max-tokens": "rollout.sampling.mask_max_tokens",
    "--enable-deterministic-inference": "rollout.deterministic",
    "--enable-return-routed-experts": "algorithm.routing_replay (r3)",
    "--enable-custom-logit-processor": "rl.sbatch (DVP's logit processor)",
    "--weight-version": "rl.sbatch (the trainer's weight versions)",
    "--base-gpu-id": "rl.sbatch (each server task's GPUs)",
    "--host": "MT_BIND_HOST (the machine's)",
    "--config": "MT_ROLLOUT_API_KEY (the engines' API key, in a file of flags)",
    "--api-key": "MT_ROLLOUT_API_KEY (the engines' API key)",
    "--admin-api-key": "MT_ROLLOUT_API_KEY (SGLang's --api-key alone covers its weight endpoints)",
    "--port": "the job's port block (MT_PORT_BASE)",
}
"""SGLang flags that rl.sbatch sets (`rollout.launch.build_sglang_server_command`; a test keeps this
table a superset of what it can emit, with SGLang's aliases): in `sglang.extra_args` they would be given
twice, and SGLang's argparse keeps the last one silently. Its abbreviations (`--mem-fraction` for
`--mem-fraction-static`) are refused too."""

REFUSED_SGLANG_FLAGS: Mapping[str, str] = {
    "--speculative-": "speculative decoding's verify step (EAGLE, NGRAM: SGLang 0.5.23's "
    "speculative/eagle_utils.eagle_sample) samples without the custom logit processor and returns the "
    "log-probs of the unprocessed logits (layers/logprob_processor.compute_spec_logprobs): DVP would be off "
    "in the engine, and the sampler's log-probs not of the distribution the trainer scores",
    "--rl-on-policy-target": "it turns on deterministic inference (arg_groups/attention_hook.py), whose "
    "seeded PyTorch sampler asserts against min-p (DVP sent with truncation), and returns log-probs "
    "rounded to bf16; rollout.deterministic is the setting for deterministic sampling",
    "--preferred-sampling-params": "it fills in the sampling parameters a request leaves out "
    "(TokenizerManager._create_tokenized_object), e.g. a top_k or min_p the trainer never replays; the "
    "run's sampling is rollout.sampling",
    "--enable-watermark": "a watermark changes the logits the engine samples from after the log-probs it "
    "returns were taken (model_executor/model_runner.py `sample`: `watermark_state.force` after the "
    "`logprob_logits` copy), and SGLang refuses it beside DVP's --enable-custom-logit-processor anyway",
    "--watermark-": "the watermark's settings (see --enable-watermark)",
}
"""SGLang flags that change what the engine samples, or the log-probs it returns, against what the trainer
scores; refused in `cluster.sglang.extra_args` (a name ending in "-": every flag it begins)."""

MOVED_ENVIRONMENT: Mapping[str, str] = {
    "MT_ROLLOUT_NODES": "cluster.rollout_nodes",
    "MT_ROLLOUT_BACKEND": "cluster.rollout_backend",
    "MT_GPUS_PER_NODE": "cluster.gpus_per_node",
    "MT_SERVERS_PER_NODE": "cluster.servers_per_node",
    "MT_TRAIN_NPROC_PER_NODE": "cluster.trainer_procs_per_node",
    "MT_GPU_MEMORY_GIB": "cluster.gpu_memory_gib",
    "MT_HEALTH_TIMEOUT": "cluster.health_timeout_s",
    "MT_SGLANG_TP": "cluster.sglang.tp",
    "MT_SGLANG_MEM_FRACTION": "cluster.sglang.mem_fraction",
    "MT_SGLANG_EXTRA_ARGS": "cluster.sglang.extra_args (and --ep-size: cluster.sglang.ep)",
    "MT_ROUTER": "cluster.sglang.router",
    "MT_ROUTER_POLICY": "cluster.sglang.router_policy",
    "MT_SGLANG_DTYPE": "rollout.dtype",
    "MT_LOCAL_DTYPE": "rollout.dtype (local engines: else rollout.local.dtype)",
    "MT_LOCAL_THREADS": "rollout.local.num_threads",
    "MT_MODEL_PATH": "model.hf_path",
    "MT_RUN_DIR": "run_dir",
}
"""`slurm/rl.sbatch`'s environment variables of earlier versions → the config key that holds the setting
now. Set, such a variable is refused in one line naming its key (`refuse_moved_environment`): read
silently it would be a second home, ignored it would change a layout without a word."""


REFUSED_SGLANG_ENVIRONMENT: Mapping[str, str] = {
    "SGLANG_RETURN_ORIGINAL_LOGPROB": "SGLang 0.5.23 then returns the log-probs of the logits before the "
    "temperature (layers/sampler.py `Sampler.forward`, layers/logprob_processor.py), while the engine "
    "samples, and the trainer scores, at rollout.sampling.temperature",
}
"""Environment variables the SGLang servers inherit from the job that change the log-probs they return
against what the trainer scores; refused when set to a value SGLang reads as true (its `EnvBool`: true, 1,
yes, y; `get_bool_env_var`: true, 1) by `refuse_sglang_environment`."""


def refuse_sglang_environment(environ: Mapping[str, str] | None = None) -> None:
    """UserError naming the first variable of `REFUSED_SGLANG_ENVIRONMENT` that SGLang would read as true."""
    environ = os.environ if environ is None else environ
    for name, why in REFUSED_SGLANG_ENVIRONMENT.items():
        if environ.get(name, "").strip().lower() in ("true", "1", "yes", "y"):
            raise UserError(f"{name}={environ[name]} is set for the SGLang servers: {why}; unset it")


def refuse_moved_environment(environ: Mapping[str, str] | None = None) -> None:
    """UserError naming the first moved variable that is set (non-empty) and the key to set instead."""
    environ = os.environ if environ is None else environ
    for name, key in MOVED_ENVIRONMENT.items():
        if environ.get(name, "") != "":
            leaf = key.split(" ")[0]
            raise UserError(
                f"{name}={environ[name]} is no longer read: the run's layout is in its config; set {key} "
                f"there (or pass --set {leaf}=...) and unset {name}"
            )


@dataclass(frozen=True)
class SGLangServers:
    """How each SGLang server of the rollout nodes is started (`cluster.rollout_backend: sglang`)."""

    tp: int = 1
    """GPUs per server (SGLang's `--tp-size`); servers per node = GPUs per node / tp."""
    ep: int = 1
    """Expert-parallel ranks of a server (SGLang's `--ep-size`, MoE only): a GPU holds 1/ep of the experts,
    each split tp/ep ways (SGLang's `moe_tp_size = tp_size // ep_size`); must divide `tp`."""
    mem_fraction: float | None = None
    """SGLang's `--mem-fraction-static`: the fraction of a GPU for weights and KV cache; None: SGLang's own
    choice (the plan then assumes 0.85)."""
    extra_args: tuple[str, ...] = ()
    """Further SGLang flags, one argv item per list item (e.g. [--chunked-prefill-size, "8192"]). Flags
    that a key sets (`OWNED_SGLANG_FLAGS`: --tp-size, --ep-size, --dtype, ...) are refused here, and those
    that would make the engine sample or score otherwise than the trainer (`REFUSED_SGLANG_FLAGS`:
    --speculative-*, --rl-on-policy-target, --preferred-sampling-params)."""
    router: bool = True
    """Start an SGLang router on the first rollout node (for inspection and external clients; the trainer
    talks to the servers itself)."""
    router_policy: str = "cache_aware"
    """The router's `--policy`, one of `ROUTER_POLICIES` (those of the pinned sglang-router)."""

    def __post_init__(self) -> None:
        _positive_int("cluster.sglang", "tp", self.tp)
        _positive_int("cluster.sglang", "ep", self.ep)
        if self.tp % self.ep:
            _bad(
                "cluster.sglang",
                "ep",
                self.ep,
                f"must divide cluster.sglang.tp={self.tp} (SGLang's --ep-size)",
            )
        f = self.mem_fraction
        if f is not None and (isinstance(f, bool) or not isinstance(f, (int, float)) or not 0 < f < 1):
            _bad("cluster.sglang", "mem_fraction", f, "must be in (0, 1) or null (SGLang's choice)")
        if not isinstance(self.router, bool):
            _bad("cluster.sglang", "router", self.router, "must be true or false")
        if self.router_policy not in ROUTER_POLICIES:
            _bad(
                "cluster.sglang",
                "router_policy",
                self.router_policy,
                f"must be one of {ROUTER_POLICIES} (the --policy of sglang-router {ROUTER_VERSION})",
            )
        for item in self.extra_args:
            self._check_extra_arg(item)

    def _check_extra_arg(self, item: str) -> None:
        """One argv item: not a flag a key owns (nor its abbreviation), not a flag with its value in one
        item (SGLang would get "--x 2" as one token), no line break (rl.sbatch reads values by line)."""
        args = list(self.extra_args)
        if "\n" in item or "\r" in item:
            _bad("cluster.sglang", "extra_args", args, "must not contain a line break")
        if not item.startswith("--"):
            return
        flag = item.split("=", 1)[0]
        if any(c.isspace() for c in flag):
            _bad(
                "cluster.sglang",
                "extra_args",
                args,
                f"holds {item!r}: one argv item per list item, e.g. [{flag.split()[0]}, "
                f"{' '.join(flag.split()[1:])!r}]",
            )
        owner = _flag_entry(flag, OWNED_SGLANG_FLAGS)
        if owner is not None:
            _bad("cluster.sglang", "extra_args", args, f"must not set {flag}: {owner} sets it")
        why = _flag_entry(flag, REFUSED_SGLANG_FLAGS)
        if why is not None:
            _bad("cluster.sglang", "extra_args", args, f"must not set {flag}: {why}")


def _flag_entry(flag: str, table: Mapping[str, str]) -> str | None:
    """The value of the flag of `table` that `flag` is or abbreviates (SGLang's argparse takes a prefix
    longer than `--x`), or, for a name of `table` ending in "-", that `flag` begins with; None if none."""
    if flag in table:
        return table[flag]
    return next(
        (
            value
            for name, value in table.items()
            if (flag.startswith(name) if name.endswith("-") else len(flag) > 3 and name.startswith(flag))
        ),
        None,
    )


@dataclass(frozen=True)
class ClusterSection:
    """The Slurm layout of the run: `slurm/rl.sbatch` starts it, `megatron-tail plan` checks it."""

    nodes: int | None = None
    """Nodes of the job, rollout and trainer together; rl.sbatch stops when the allocation (`sbatch --nodes`)
    has another number. None: the allocation's (the plan assumes 2)."""
    gpus_per_node: int | None = None
    """GPUs of each node; rl.sbatch stops when Slurm's `SLURM_GPUS_ON_NODE` says otherwise. None: Slurm's
    (0 without GPUs; the plan assumes 8)."""
    gpu_memory_gib: float = 80.0
    """Memory of one GPU, GiB, for the plan (an H100 "80GB" has 80, an H200 141)."""
    host_memory_gib: float = 1024.0
    """Host memory of a trainer node, GiB, for the plan's warnings (a DGX H100 has 2,048): what a save
    gathers there, the step's supports and routes."""
    rollout_nodes: int = 1
    """The first this many nodes of the job run the rollout servers; the others train."""
    rollout_backend: RolloutBackend = "sglang"
    """What the rollout nodes run: "sglang" servers, or "local", the CPU engine `megatron-tail serve-local`
    (tests, and clusters without GPUs)."""
    servers_per_node: int | None = None
    """Rollout servers per rollout node (at most 8: the port block). None: GPUs per node / sglang.tp with
    sglang, 1 with local."""
    trainer_procs_per_node: int | None = None
    """Trainer processes (torchrun's `--nproc-per-node`) per trainer node. None: GPUs per node."""
    health_timeout_s: float = 900.0
    """How long rl.sbatch waits for every server's `/health` before it stops the job (loading a large
    checkpoint and capturing CUDA graphs takes minutes)."""
    sglang: SGLangServers = field(default_factory=SGLangServers)

    def __post_init__(self) -> None:
        for name in ("nodes", "gpus_per_node", "servers_per_node", "trainer_procs_per_node"):
            if getattr(self, name) is not None:
                _positive_int(
                    "cluster", name, getattr(self, name), minimum=0 if name == "gpus_per_node" else 1
                )
        _positive_int("cluster", "rollout_nodes", self.rollout_nodes)
        _choice("cluster", "rollout_backend", self.rollout_backend, ROLLOUT_BACKENDS)
        if self.nodes is not None and self.rollout_nodes >= self.nodes:
            _bad(
                "cluster",
                "rollout_nodes",
                self.rollout_nodes,
                f"must leave a trainer node of cluster.nodes={self.nodes}",
            )
        if self.servers_per_node is not None and self.servers_per_node > MAX_SERVERS_PER_NODE:
            _bad(
                "cluster",
                "servers_per_node",
                self.servers_per_node,
                f"must be ≤ {MAX_SERVERS_PER_NODE} (ports)",
            )
        if self.gpus_per_node:
            self._check_gpus(self.gpus_per_node)
        for name in ("gpu_memory_gib", "host_memory_gib", "health_timeout_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
                _bad("cluster", name, value, "must be a finite number > 0")

    def _check_gpus(self, gpus: int) -> None:
        """What `gpus` GPUs per node must hold: the servers' GPUs (with sglang) and the trainer's ranks."""
        tp, servers = self.sglang.tp, self.servers_per_node
        if self.rollout_backend == "sglang" and gpus % tp:
            _bad(
                "cluster",
                "gpus_per_node",
                gpus,
                f"must be a multiple of cluster.sglang.tp={tp} (GPUs per server)",
            )
        if self.rollout_backend == "sglang" and servers is not None and servers * tp > gpus:
            _bad(
                "cluster",
                "servers_per_node",
                servers,
                f"× cluster.sglang.tp={tp} must fit cluster.gpus_per_node={gpus}",
            )
        if self.trainer_procs_per_node is not None and self.trainer_procs_per_node > gpus:
            _bad(
                "cluster",
                "trainer_procs_per_node",
                self.trainer_procs_per_node,
                f"must be ≤ cluster.gpus_per_node={gpus} (one trainer rank per GPU)",
            )
