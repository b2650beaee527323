"""`make_plan(config, cluster)`: the run config + the cluster → every memory term, checkpoint size and the
verdict. Reads the model's `config.json` only (never weights, prompts or a GPU), imports no megatron."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from megatron_tail.config.cluster import PLAN_GPUS_PER_NODE, PLAN_MEM_FRACTION, PLAN_NODES
from megatron_tail.config.schema import RunConfig
from megatron_tail.model.directory import load_model_config
from megatron_tail.model.layout import check_parallel_layout
from megatron_tail.model.moe_arch import check_routing_replay

from .rollout import ENGINE_DTYPE_BYTES, KV_DTYPE_BYTES, RolloutLayout, RolloutMemory, rollout_memory
from .shapes import ModelShape
from .trainer import (
    CheckpointWrites,
    StageMemory,
    TrainerLayout,
    activation_per_token_per_layer,
    checkpoint_writes,
    routes_host_bytes,
    support_host_bytes,
    trainer_peak,
)

GIB = 1 << 30


PLANNED_QUANTIZATIONS = (None, "none", "fp8")
"""`plan --quantization` values: SGLang's own ("fp8": e4m3 linear weights), or none. The local engine's
emulated formats (`rollout.quantization`'s fp8_tensor, nvfp4_a16) have no SGLang server to plan."""


@dataclass(frozen=True)
class Cluster:
    """The allocation and the assumptions the plan rests on: the run's `cluster:` section
    (`config.cluster.ClusterSection`) with the plan's defaults where it leaves a value unset
    (`plan.cli.cluster_from_args`)."""

    nodes: int = PLAN_NODES
    gpus_per_node: int = PLAN_GPUS_PER_NODE
    gpu_memory_gib: float = 80.0
    """Capacity of one GPU (an H100 "80GB" has 80 GiB)."""
    rollout_nodes: int = 1
    """`cluster.rollout_nodes`."""
    rollout_tp: int = 1
    """`cluster.sglang.tp`: GPUs per SGLang server."""
    rollout_ep: int = 1
    """`cluster.sglang.ep`, SGLang's `--ep-size` (MoE): expert-parallel ranks of a server, dividing its
    TP."""
    servers_per_node: int | None = None
    """`cluster.servers_per_node`; None: gpus_per_node / rollout_tp."""
    trainer_procs_per_node: int | None = None
    """`cluster.trainer_procs_per_node`: trainer GPUs per trainer node; None: gpus_per_node."""
    mem_fraction: float = PLAN_MEM_FRACTION
    """`cluster.sglang.mem_fraction`: SGLang's `--mem-fraction-static`."""
    kv_cache_dtype: str = "auto"
    """SGLang's `--kv-cache-dtype` ("auto": the model dtype)."""
    quantization: str | None = None
    """SGLang's `--quantization` ("fp8": 1 B per weight on the servers)."""
    reserve_gib: float = 6.0
    """Per trainer GPU: CUDA context (~0.5-1 GiB), NCCL communicators and buffers (~1-2 GiB),
    allocator fragmentation (an assumption, not a measurement)."""
    host_memory_gib: float = 1024.0
    """`cluster.host_memory_gib`: host memory of a trainer node (a DGX H100 has 2 TiB; the plan only warns
    against it)."""
    fs_write_gbps: float = 2.0
    """Assumed filesystem write bandwidth per node, GB/s (for the checkpoint's save time)."""

    def __post_init__(self) -> None:
        for name in (
            "nodes",
            "gpus_per_node",
            "rollout_nodes",
            "rollout_tp",
            "rollout_ep",
            "servers_per_node",
            "trainer_procs_per_node",
        ):
            value = getattr(self, name)
            if value is None and name in ("servers_per_node", "trainer_procs_per_node"):
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int ≥ 1; got {value!r}")
        if self.rollout_nodes >= self.nodes:
            raise ValueError(
                f"cluster.rollout_nodes={self.rollout_nodes} leaves no trainer node of "
                f"cluster.nodes={self.nodes}"
            )
        if self.servers_per_node is not None and self.servers_per_node * self.rollout_tp > self.gpus_per_node:
            raise ValueError(
                f"cluster.servers_per_node={self.servers_per_node} × cluster.sglang.tp={self.rollout_tp} "
                f"must fit cluster.gpus_per_node={self.gpus_per_node}"
            )
        if self.trainer_procs_per_node is not None and self.trainer_procs_per_node > self.gpus_per_node:
            raise ValueError(
                f"cluster.trainer_procs_per_node={self.trainer_procs_per_node} must be ≤ "
                f"cluster.gpus_per_node={self.gpus_per_node} (one trainer rank per GPU)"
            )
        if self.gpus_per_node % self.rollout_tp:
            raise ValueError(
                f"cluster.sglang.tp={self.rollout_tp} must divide cluster.gpus_per_node={self.gpus_per_node}"
            )
        if self.rollout_tp % self.rollout_ep:
            raise ValueError(
                f"cluster.sglang.ep={self.rollout_ep} (SGLang --ep-size) must divide "
                f"cluster.sglang.tp={self.rollout_tp}"
            )
        for name in ("gpu_memory_gib", "fs_write_gbps", "host_memory_gib"):
            if not 0 < getattr(self, name) < math.inf:
                raise ValueError(f"{name} must be finite and > 0; got {getattr(self, name)!r}")
        if not 0 < self.mem_fraction < 1:
            raise ValueError(f"cluster.sglang.mem_fraction must be in (0, 1); got {self.mem_fraction!r}")
        if not 0 <= self.reserve_gib < math.inf:
            raise ValueError(f"reserve_gib must be finite and ≥ 0; got {self.reserve_gib!r}")
        if self.quantization not in PLANNED_QUANTIZATIONS:
            raise ValueError(
                "quantization must be 'none' or 'fp8' (the SGLang weights the plan counts); "
                f"got {self.quantization!r}"
            )
        if self.kv_cache_dtype not in KV_DTYPE_BYTES:
            raise ValueError(
                f"kv_cache_dtype must be one of {sorted(KV_DTYPE_BYTES)}; got {self.kv_cache_dtype!r}"
            )


@dataclass(frozen=True)
class Plan:
    shape: ModelShape
    cluster: Cluster
    trainer_layout: TrainerLayout
    trainer: StageMemory
    per_token_per_layer: dict[str, int]
    rollout_layout: RolloutLayout
    rollout: RolloutMemory
    checkpoint: CheckpointWrites
    checkpoint_seconds: float
    """The busiest trainer node's writes at `cluster.fs_write_gbps`."""
    problems: list[str] = field(default_factory=list)
    """Why it does not fit (empty: it fits)."""
    warnings: list[str] = field(default_factory=list)
    episode: str = ""
    """With `rollout.env.name`: how the longest sample is counted (turns and observations)."""
    support_host_bytes_per_rank: int = 0
    """Truncated sampling: the step's supports in each trainer rank's host memory, at most (`supports`
    of `plan.trainer`)."""
    routes_host_bytes_per_rank: int = 0
    """Routing replay r3: the step's engine routes in each trainer rank's host memory, at most."""

    @property
    def fits(self) -> bool:
        return not self.problems


def episode_line(config: RunConfig) -> str:
    """The longest multi-turn sample, term by term ("" without `rollout.env.name`)."""
    r = config.rollout
    if not r.env.on:
        return ""
    prompt = config.data.max_prompt_tokens
    total = "?" if prompt is None else prompt + r.max_response_tokens
    return (
        f"episode: prompt {'?' if prompt is None else prompt} + {r.env.max_turns} turns x {r.max_new_tokens} "
        f"+ {r.env.max_turns - 1} observations x {r.env.max_observation_tokens} = {total} tokens per sample "
        f"({r.max_policy_tokens} of them the policy's; env {r.env.name})"
    )


def sequence_tokens(config: RunConfig, max_positions: int) -> int:
    """Longest sample: prompt + response (with `rollout.env.name`, every turn and the observations between
    them: `rollout.max_response_tokens`), capped by the model's context."""
    limit = config.model.max_sequence_length or max_positions
    if config.data.max_prompt_tokens is None:
        return limit
    return min(limit, config.data.max_prompt_tokens + config.rollout.max_response_tokens)


def tokens_per_micro_batch(config: RunConfig, longest: int) -> int:
    """Tokens of one training micro-batch: the token budget of packed (THD) micro-batches, or
    `micro_batch_size` rows of `seq_len` (else the longest sample) tokens."""
    if config.train.is_packed:
        return config.train.max_tokens_per_micro_batch
    return config.train.micro_batch_size * (config.train.seq_len or longest)


def make_plan(config: RunConfig, cluster: Cluster) -> Plan:
    """Every term for `config` on `cluster`. Raises ValueError for a layout that cannot exist
    (a world that TP × PP does not divide, a config.json that cannot be read)."""
    hf_path = config.model.hf_path
    if not hf_path:
        raise ValueError("model.hf_path is empty: the plan needs the model's config.json")
    arch = load_model_config(hf_path)  # train's reader of it: a UserError naming the file and the problem
    shape = ModelShape.from_arch(arch, config.model.vocab_pad_multiple)
    tp, pp = config.parallel.tensor_parallel, config.parallel.pipeline_parallel
    cp = config.parallel.context_parallel
    ep, etp = config.parallel.expert_parallel, config.parallel.expert_tensor_parallel
    # one line naming the values, as `train` refuses them: TP ∤ heads or FFN, PP ∤ layers, the expert layout
    check_parallel_layout(
        arch, tensor_parallel=tp, pipeline_parallel=pp, expert_parallel=ep, expert_tensor_parallel=etp
    )
    check_routing_replay(routing_replay(config), arch.moe, arch.architecture)  # as `train` refuses it
    etp = etp or tp
    procs = cluster.trainer_procs_per_node or cluster.gpus_per_node  # trainer ranks per trainer node
    trainer_gpus = (cluster.nodes - cluster.rollout_nodes) * procs
    if trainer_gpus % (tp * pp * cp):
        raise ValueError(
            f"{trainer_gpus} trainer GPUs are not a multiple of "
            f"tensor_parallel × pipeline_parallel × context_parallel = {tp} × {pp} × {cp}"
        )
    if trainer_gpus % (etp * ep * pp):
        raise ValueError(
            f"{trainer_gpus} trainer GPUs are not a multiple of "
            f"expert_tensor_parallel × expert_parallel × pipeline_parallel = {etp} × {ep} × {pp}"
        )
    _check_moe_layout(shape, config, cluster)
    dp = trainer_gpus // (tp * pp * cp)
    precision = config.model.precision_on(cuda=True)  # the plan is of GPUs
    longest = sequence_tokens(config, arch.max_position_embeddings)
    tokens = tokens_per_micro_batch(config, longest)
    samples = config.data.prompts_per_step * config.algorithm.group_size
    per_rank_tokens = samples * longest // (config.train.mini_batches * dp)
    capacity = int(cluster.gpu_memory_gib * GIB)
    layout = TrainerLayout(
        tensor_parallel=tp,
        pipeline_parallel=pp,
        data_parallel=dp,
        precision=precision,
        optimizer=config.optimizer.optimizer,
        sgd_momentum=config.optimizer.sgd_momentum > 0,
        distributed_optimizer=config.optimizer.use_distributed_optimizer,
        tokens_per_micro_batch=tokens,
        micro_batches=max(1, per_rank_tokens // max(tokens, 1)),
        recompute=config.model.recompute,
        recompute_num_layers=config.model.recompute_num_layers,
        recompute_modules=tuple(config.model.recompute_modules),
        sequence_parallel=config.model.sequence_parallel and tp > 1,
        fused_output_layer=config.model.fused_output_layer,
        op_backend="torch" if config.model.op_backend == "torch" else "triton",  # "auto": Triton on CUDA
        reference=(
            "none"
            if config.algorithm.kl_coef == 0
            else "offloaded"
            if config.model.reference_offload
            else "resident"
        ),
        reserve_bytes=int(cluster.reserve_gib * GIB),
        capacity_bytes=capacity,
        context_parallel=cp,
        support_width=config.rollout.sampling.top_k if config.rollout.sampling.truncates else 0,
        support_dense_width=_support_dense_width(config),
        expert_parallel=ep,
        expert_tensor_parallel=etp,
        expert_data_parallel=trainer_gpus // (etp * ep * pp),
        routing_replay=routing_replay(config) if shape.is_moe else "none",
    )
    peak = trainer_peak(shape, layout)
    engine_dtype = config.rollout.dtype or "bfloat16"
    quantization = cluster.quantization or getattr(config.rollout, "quantization", None)
    if quantization not in PLANNED_QUANTIZATIONS:  # as `train` with rollout.engine: remote refuses it
        raise ValueError(
            f"rollout.quantization={quantization!r} is the local engine's emulation: the SGLang servers the "
            "plan sizes take 'none' or 'fp8'"
        )
    rollout_layout = RolloutLayout(
        servers=cluster.rollout_nodes
        * (cluster.servers_per_node or cluster.gpus_per_node // cluster.rollout_tp),
        tp_per_server=cluster.rollout_tp,
        ep_per_server=cluster.rollout_ep,
        routes=layout.routing_replay == "r3",
        mem_fraction=cluster.mem_fraction,
        weight_bytes_per_param=ENGINE_DTYPE_BYTES[engine_dtype],
        fp8_linear=quantization == "fp8",
        kv_dtype_bytes=KV_DTYPE_BYTES[cluster.kv_cache_dtype] or ENGINE_DTYPE_BYTES[engine_dtype],
        capacity_bytes=capacity,
        sequence_tokens=longest,
        max_concurrency=config.rollout.max_concurrency,
        # multi-turn: `max_concurrency` bounds episodes (sequences), not requests of a prompt's group
        group_size=1 if config.rollout.env.name is not None else config.algorithm.group_size,
    )
    rollout = rollout_memory(shape, rollout_layout)
    ckpt = checkpoint_writes(shape, layout, procs)
    ckpt_seconds = ckpt.node_bytes / (cluster.fs_write_gbps * 1e9)  # the busiest node's writes
    problems, warnings = _verdict(peak, layout, rollout, rollout_layout)
    warnings += _context_parallel_warnings(shape, layout, peak)
    host_supports = support_host_bytes(layout.support_width, samples, config.rollout.max_response_tokens)
    warnings += _support_host_warnings(host_supports, layout.support_width, cluster)
    host_routes = routes_host_bytes(shape, layout, samples, longest)
    warnings += _routes_host_warnings(host_routes, rollout, cluster)
    warnings += _checkpoint_host_warnings(ckpt, (host_supports + host_routes) * procs, cluster)
    return Plan(
        shape=shape,
        cluster=cluster,
        trainer_layout=layout,
        trainer=peak,
        per_token_per_layer=activation_per_token_per_layer(shape, layout),
        rollout_layout=rollout_layout,
        rollout=rollout,
        checkpoint=ckpt,
        checkpoint_seconds=ckpt_seconds,
        problems=problems,
        warnings=warnings,
        episode=episode_line(config),
        support_host_bytes_per_rank=host_supports,
        routes_host_bytes_per_rank=host_routes,
    )


def routing_replay(config: RunConfig) -> str:
    """`algorithm.routing_replay` ("none" while the key does not exist)."""
    return getattr(config.algorithm, "routing_replay", None) or "none"


def _check_moe_layout(shape: ModelShape, config: RunConfig, cluster: Cluster) -> None:
    """ValueError for a MoE layout megatron or SGLang refuses."""
    tp = config.parallel.tensor_parallel
    if not shape.is_moe:
        if cluster.rollout_ep > 1:
            raise ValueError(
                f"cluster.sglang.ep={cluster.rollout_ep} (SGLang --ep-size) needs a mixture-of-experts model"
            )
        return
    if tp > 1 and not config.model.sequence_parallel:
        # megatron-core 0.16.1 MoELayer.forward raises in training with TP > 1 and no SP
        raise ValueError(
            f"parallel.tensor_parallel={tp} with a mixture-of-experts model needs "
            "model.sequence_parallel=true "
            "(megatron's MoELayer refuses TP without SP in training)"
        )
    if shape.experts % cluster.rollout_ep:
        raise ValueError(
            f"cluster.sglang.ep={cluster.rollout_ep} (SGLang --ep-size) does not divide "
            f"num_experts={shape.experts}"
        )


RECOMPUTE_COST = ("none", "selective", "full")
"""Recompute settings from the cheapest to the dearest in compute."""


def _context_parallel_warnings(shape: ModelShape, layout: TrainerLayout, peak: StageMemory) -> list[str]:
    """CP where recompute alone fits: the same GPUs at CP = 1 (DP × CP data-parallel ranks) with the
    layout's own recompute or a cheaper one. Then CP buys nothing: it exchanges K/V in every layer and
    takes CP GPUs per sequence for memory that is not needed. (CP that replaces a dearer recompute, e.g.
    CP=2 with selective where CP=1 needs full, trades the K/V exchange for ~1/3 of the step's compute: a
    choice, not a mistake, so no warning.)"""
    cp = layout.context_parallel
    if cp == 1 or peak.total > layout.capacity_bytes:
        return []
    for recompute in RECOMPUTE_COST[: RECOMPUTE_COST.index(layout.recompute) + 1]:
        alone = replace(
            layout,
            context_parallel=1,
            data_parallel=layout.data_parallel * cp,
            recompute=recompute,
            recompute_num_layers=layout.recompute_num_layers if recompute == "full" else None,
        )
        without = trainer_peak(shape, alone)
        if without.total <= layout.capacity_bytes:
            return [
                f"parallel.context_parallel={cp} is not needed: the same GPUs at context_parallel=1 with "
                f"model.recompute={recompute} fit ({_gib(without.total)} of {_gib(layout.capacity_bytes)} "
                f"per GPU, vs {_gib(peak.total)}) without CP's K/V exchange in every layer"
            ]
    return []


def _support_dense_width(config: RunConfig) -> int:
    """The op's dense support width at worst: SGLang's mask cap, since flashinfer keeps ties at the top-k
    cutoff (`rollout.settings.TOP_K_HEADROOM`); top_k with the PyTorch sampler (`rollout.deterministic`)."""
    s = config.rollout.sampling
    if not s.truncates:
        return 0
    return s.top_k if config.rollout.deterministic else s.mask_max_tokens


def _checkpoint_host_warnings(ckpt: CheckpointWrites, step_bytes: int, cluster: Cluster) -> list[str]:
    """Warn where a save's gather of optimizer state, with the step's supports and routes that the node's
    ranks hold meanwhile (`step_bytes`), could need over half of a trainer node's host memory (the gather
    lasts the save; the ranks' own processes need the rest)."""
    need = ckpt.node_host_bytes + step_bytes
    if need <= cluster.host_memory_gib * GIB / 2:
        return []
    return [
        f"checkpoint: each save gathers up to {_gib(ckpt.node_host_bytes)} of fp32 optimizer state into one "
        f"trainer node's host memory before writing it, {_gib(need)} with the step's supports and routes "
        f"(assumed {cluster.host_memory_gib:g} GiB, cluster.host_memory_gib): each TP×PP shard's state "
        "onto its DP rank 0 (megatron's memory-efficient fully reshardable save)"
    ]


def _support_host_warnings(per_rank: int, width: int, cluster: Cluster) -> list[str]:
    """Every trainer rank holds the step's supports: warn where a node's ranks could need over a quarter of
    its host memory if every token's support were full."""
    per_node = per_rank * cluster.gpus_per_node
    if per_node <= cluster.host_memory_gib * GIB / 4:
        return []
    return [
        f"sampling supports: up to {_gib(per_rank)} per rank, {_gib(per_node)} per node of host memory if "
        f"every response token kept rollout.sampling.top_k={width} ids (over a quarter of the assumed "
        f"{cluster.host_memory_gib:g} GiB); the real size is rollout/support_size_mean x 4 B per token: "
        "watch it, or lower rollout.sampling.top_k"
    ]


def _routes_host_warnings(per_rank: int, rollout: RolloutMemory, cluster: Cluster) -> list[str]:
    """r3: warn where a trainer node's copies of the step's routes, or a rollout node's SGLang host caches,
    could need over a quarter of its host memory."""
    out = []
    quarter = cluster.host_memory_gib * GIB / 4
    if per_rank * cluster.gpus_per_node > quarter:
        out.append(
            f"routing replay r3: up to {_gib(per_rank)} of routes per trainer rank, "
            f"{_gib(per_rank * cluster.gpus_per_node)} per node of host memory (over a quarter of the "
            f"assumed {cluster.host_memory_gib:g} GiB)"
        )
    if rollout.routes_host_bytes * cluster.gpus_per_node > quarter:
        out.append(
            f"routing replay r3: SGLang's routed-experts host caches take "
            f"{_gib(rollout.routes_host_bytes * cluster.gpus_per_node)} per rollout node (over a quarter of "
            f"the assumed {cluster.host_memory_gib:g} GiB)"
        )
    return out


def _gib(n: float) -> str:
    return f"{n / GIB:.1f} GiB"


def _verdict(
    peak: StageMemory, layout: TrainerLayout, rollout: RolloutMemory, rollout_layout: RolloutLayout
) -> tuple[list[str], list[str]]:
    problems, warnings = [], []
    over = peak.total - layout.capacity_bytes
    if over > 0:
        term = max((t for t in peak.terms if t != "reserve"), key=peak.terms.__getitem__)
        problems.append(
            f"trainer stage {peak.stage}: total {_gib(peak.total)} exceeds the GPU's "
            f"{_gib(layout.capacity_bytes)} by {_gib(over)}; largest term: {term} = {_gib(peak.terms[term])}"
        )
    if rollout.weights_bytes >= rollout.budget_bytes:
        problems.append(
            f"rollout weights: {_gib(rollout.weights_bytes)} per GPU exceed the static budget "
            f"{_gib(rollout.budget_bytes)} (mem fraction {rollout_layout.mem_fraction}) by "
            f"{_gib(rollout.weights_bytes - rollout.budget_bytes)}"
        )
    elif rollout.sequences_per_server < 1:
        problems.append(
            f"rollout KV cache: {rollout.kv_tokens_per_server} tokens per server hold no full "
            f"{rollout_layout.sequence_tokens}-token sequence (short by "
            f"{rollout_layout.sequence_tokens - rollout.kv_tokens_per_server} tokens)"
        )
    elif rollout.in_flight_per_server > rollout.sequences_per_server:
        fitting = rollout.sequences_per_server * rollout_layout.servers // rollout_layout.group_size
        in_flight, held = rollout.in_flight_per_server, rollout.sequences_per_server
        warnings.append(
            f"rollout: max_concurrency × group_size = {rollout_layout.max_concurrency} × "
            f"{rollout_layout.group_size} puts {in_flight} sequences per server in flight, but its KV cache "
            f"holds {held} of {rollout_layout.sequence_tokens} tokens (exceeded by {in_flight / held:.2f}×): "
            f"SGLang queues or retracts the rest; rollout.max_concurrency ≤ {fitting} keeps every request "
            "resident"
        )
    return problems, warnings
