"""Bytes per trainer GPU, term by term, for one pipeline stage at its training peak.

weights      the stage's parameters on this TP rank, in the model dtype (megatron's `Float16Module`);
             MoE: a MoE layer's experts split over EP × expert-TP (`shapes.ModelShape.stage_params`)
grads        the same count in the main-grad dtype: fp32 (`grad_reduce_in_fp32=True`,
             `train/engine/setup.py`), never sharded (megatron's DDP grad buffer, experts' included)
optimizer    Adam: fp32 master params (half precision only) + m + v; SGD: master + momentum;
             divided by DP × CP under the distributed optimizer, the experts' share by the expert-data-
             parallel size instead: world / (ETP × EP × PP). megatron's DDP puts expert parameters in
             their own buffers (`DistributedDataParallel.__init__`: `expert_parallel_buffers` over the
             expert-DP group, `parallel_state.get_expert_data_parallel_group()`; dense ones over DP × CP),
             and `DistributedOptimizer` shards each bucket over its buffer's `data_parallel_group`
             (`_build_gbuf_range_map`, optimizer/distrib_optimizer.py)
activations  `activations.stage_activation_bytes` (1F1B: stage s keeps min(PP − s, M) micro-batches),
             of this CP rank's tokens: tokens per micro-batch / CP under context parallelism; MoE layers
             add the router, the top-k experts' MLPs and one layer's alltoall dispatch buffers
logits       the last stage's logits (or the fused op's blocks) for one micro-batch (its tokens / CP)
reference    π_ref's weights (model dtype), when `algorithm.kl_coef` > 0 and it is not offloaded; an
             offloaded reference is on the GPU only for its forward-only pass, when no training
             activations are alive, so it adds nothing to the training peak
supports     truncated sampling (`rollout.sampling.top_k/top_p/min_p`): each micro-batch in flight carries its
             supports ragged (≤ K int32 ids + one int64 offset per token, `utils.ragged`; K = `rollout.
             top_k`); the last stage also holds the op's dense int32 `[tokens/CP, W]` copy from forward to
             backward (`train.engine.forward.sampling_support`), W the micro-batch's widest support: one
             token whose top-k cutoff ties (SGLang's flashinfer sampler keeps ties) can make it the mask
             cap `rollout.sampling.mask_max_tokens`; `rollout.sampling.top_k` under `rollout.deterministic`
routes       routing replay (MoE, `algorithm.routing_replay` r2/r3): megatron's `RouterReplay` holds each
             MoE layer's [tokens, k] expert indices (int64, as `torch.topk` returns them; router_replay.py)
             for every micro-batch in flight, of this GPU's router tokens (tokens / TP under SP); only
             present for a MoE model with replay
reserve      CUDA context, NCCL communicators and buffers, allocator fragmentation (an assumption)
"""

from __future__ import annotations

from dataclasses import dataclass

from .activations import (
    layer_activation_terms,
    logits_bytes,
    moe_layer_activation_terms,
    stage_activation_bytes,
)
from .shapes import ModelShape

DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
TERMS = ("weights", "grads", "optimizer", "activations", "logits", "reference", "supports", "reserve")


@dataclass(frozen=True)
class TrainerLayout:
    """What the trainer's memory depends on besides the model's shape."""

    tensor_parallel: int
    pipeline_parallel: int
    data_parallel: int
    precision: str
    """"bf16", "fp16" or "fp32"."""
    optimizer: str
    """"adam" or "sgd"."""
    sgd_momentum: bool
    distributed_optimizer: bool
    tokens_per_micro_batch: int
    micro_batches: int
    """Training micro-batches per optimizer step on one DP rank (bounds 1F1B's in-flight count)."""
    recompute: str
    """"none", "selective" or "full"."""
    recompute_num_layers: int | None
    recompute_modules: tuple[str, ...]
    sequence_parallel: bool
    fused_output_layer: bool
    reference: str
    """π_ref: "none" (kl_coef 0), "offloaded" (pinned host memory between its passes) or "resident"."""
    reserve_bytes: int
    capacity_bytes: int
    context_parallel: int = 1
    """CP: each GPU holds 1/CP of every sequence's tokens (activations, logits); the distributed optimizer
    shards over DP × CP."""
    op_backend: str = "triton"
    """The op's backend on the GPU (`model.op_backend`: "auto" is Triton there): its working memory differs
    (`activations.logits_bytes`)."""
    support_width: int = 0
    """Truncated sampling: support ids per token, all but a few tied tokens (`rollout.sampling.top_k`); 0
    without."""
    support_dense_width: int = 0
    """Truncated sampling: the widest one token's support can be, the op's dense width (module docstring)."""
    expert_parallel: int = 1
    """EP: each rank holds num_experts / EP experts of every MoE layer."""
    expert_tensor_parallel: int = 1
    """ETP: each expert's intermediate dimension split over ETP ranks."""
    expert_data_parallel: int = 1
    """Expert DP: world / (ETP × EP × PP), the group the distributed optimizer shards expert state over."""
    routing_replay: str = "none"
    """MoE: "none", "r2" or "r3" (`algorithm.routing_replay`)."""

    @property
    def tokens_per_gpu(self) -> int:
        """Tokens of one micro-batch on one GPU: `tokens_per_micro_batch` / CP."""
        return -(-self.tokens_per_micro_batch // self.context_parallel)


@dataclass(frozen=True)
class StageMemory:
    """One pipeline stage's bytes per GPU, by term (`TERMS`)."""

    stage: int
    params: int
    terms: dict[str, int]
    expert_params: int = 0
    """Of `params`, the MoE experts' (sharded over EP × ETP; optimizer state over expert DP)."""

    @property
    def total(self) -> int:
        return sum(self.terms.values())


def optimizer_bytes_per_param(layout: TrainerLayout) -> int:
    """Bytes of optimizer state per parameter before DP sharding."""
    master = 4 if layout.precision != "fp32" else 0
    if layout.optimizer == "adam":
        return master + 8
    return master + (4 if layout.sgd_momentum else 0)


def optimizer_moment_bytes(layout: TrainerLayout, optimizer: int) -> int:
    """Of a stage's `optimizer` term, the moments (Adam's m and v, SGD's momentum). The first
    `optimizer.step()` allocates them, after that step's activation peak; the fp32 master weights exist
    from the start. So a run's first step peaks this much lower than every later one."""
    per = optimizer_bytes_per_param(layout)
    moments = 8 if layout.optimizer == "adam" else 4 if layout.sgd_momentum else 0
    return optimizer * moments // per if per else 0


def stage_memory(shape: ModelShape, layout: TrainerLayout, stage: int) -> StageMemory:
    """Bytes per GPU of pipeline stage `stage` at its training peak."""
    tp, pp = layout.tensor_parallel, layout.pipeline_parallel
    b = DTYPE_BYTES[layout.precision]
    ep, etp = layout.expert_parallel, layout.expert_tensor_parallel
    params = shape.stage_params(tp, pp, stage, ep=ep, etp=etp)
    experts = shape.stage_expert_params(pp, stage, ep=ep, etp=etp)
    per_stage = shape.layers // pp
    in_flight = min(pp - stage, max(layout.micro_batches, 1))
    activations = stage_activation_bytes(
        shape,
        tp=tp,
        stage_layers=shape.layers // pp,
        tokens=layout.tokens_per_gpu,
        in_flight=in_flight,
        sequence_parallel=layout.sequence_parallel,
        dtype_bytes=b,
        recompute=layout.recompute,
        recompute_num_layers=layout.recompute_num_layers,
        recompute_modules=layout.recompute_modules,
        stage_moe_layers=shape.moe_layers(stage * per_stage, per_stage) if shape.is_moe else 0,
        etp=etp,
    )
    last = stage == pp - 1
    logits = (
        logits_bytes(
            shape,
            tp=tp,
            tokens=layout.tokens_per_gpu,
            dtype_bytes=b,
            fused_output_layer=layout.fused_output_layer,
            sequence_parallel=layout.sequence_parallel,
            op_backend=layout.op_backend,
        )
        if last
        else 0
    )
    optimizer = optimizer_state_bytes(layout, params - experts, experts)
    terms = {
        "weights": params * b,
        "grads": params * 4,
        "optimizer": optimizer,
        "activations": activations,
        "logits": logits,
        # offloaded: on the GPU for its own pass only, before the update's activations exist, with the
        # logits of a forward like the update's: that pass peaks above the update where its weights
        # outweigh the update's activations (full recompute keeps few)
        "reference": {"resident": params * b, "offloaded": max(0, params * b - activations)}.get(
            layout.reference, 0
        ),
        "supports": support_device_bytes(layout, in_flight, last),
        "reserve": layout.reserve_bytes,
    }
    if shape.is_moe and layout.routing_replay != "none":
        moe_layers = shape.moe_layers(stage * per_stage, per_stage)
        router_tokens = layout.tokens_per_gpu // (tp if layout.sequence_parallel else 1)
        routes = in_flight * router_tokens * moe_layers * shape.top_k * REPLAY_INDEX_BYTES
        terms = {
            **{k: v for k, v in terms.items() if k != "reserve"},
            "routes": routes,
            "reserve": terms["reserve"],
        }
    return StageMemory(stage=stage, params=params, terms=terms, expert_params=experts)


REPLAY_INDEX_BYTES = 8
"""int64 expert indices per (token, k) in megatron's `RouterReplay` (trainer GPU)."""


def routes_host_bytes(shape: ModelShape, layout: TrainerLayout, samples: int, sequence_tokens: int) -> int:
    """r3: the step's engine routes in one trainer rank's host memory (every rank holds the whole batch),
    int32 [tokens, layers, k] per sample at the longest sample (SGLang's `meta_info.routed_experts`)."""
    if not shape.is_moe or layout.routing_replay != "r3":
        return 0
    return samples * sequence_tokens * shape.layers * shape.top_k * 4


SUPPORT_OFFSET_BYTES = 8
"""One int64 offset per token of a ragged support (`utils.ragged.Ragged.offsets`)."""
SUPPORT_ID_BYTES = 4
"""int32 ids, ragged and dense."""


def optimizer_state_bytes(layout: TrainerLayout, dense: int, experts: int) -> int:
    """Optimizer state of `dense` + `experts` parameters on one rank: the dense share over DP × CP, the
    experts' over the expert-data-parallel group (distributed optimizer; else not sharded)."""
    per = optimizer_bytes_per_param(layout)
    if not layout.distributed_optimizer:
        return (dense + experts) * per
    return -(-dense * per // (layout.data_parallel * layout.context_parallel)) + -(
        -experts * per // layout.expert_data_parallel
    )


def support_device_bytes(layout: TrainerLayout, in_flight: int, last: bool) -> int:
    """The sampling supports on one GPU of a stage: the ragged supports of the `in_flight` micro-batches
    (every id at the bound K: the worst case) and, on the last stage, the op's dense `[tokens/CP, K]`."""
    k, tokens = layout.support_width, layout.tokens_per_gpu
    if not k:
        return 0
    ragged = tokens * (k * SUPPORT_ID_BYTES + SUPPORT_OFFSET_BYTES)
    return in_flight * ragged + (tokens * layout.support_dense_width * SUPPORT_ID_BYTES if last else 0)


def support_host_bytes(support_width: int, samples: int, response_tokens: int) -> int:
    """A step's supports in host memory on each trainer rank (every rank holds the whole batch), ragged,
    at most `support_width` ids per response token."""
    if not support_width:
        return 0
    return samples * response_tokens * (support_width * SUPPORT_ID_BYTES + SUPPORT_OFFSET_BYTES)


def trainer_peak(shape: ModelShape, layout: TrainerLayout) -> StageMemory:
    """The stage with the largest total (the first stage, or the last one with the logits)."""
    stages = [stage_memory(shape, layout, s) for s in range(layout.pipeline_parallel)]
    return max(stages, key=lambda m: (m.total, -m.stage))


def activation_per_token_per_layer(shape: ModelShape, layout: TrainerLayout) -> dict[str, int]:
    """Per-token per-layer bytes without recompute, with selective and full recompute, and with SP."""
    b, tp = DTYPE_BYTES[layout.precision], layout.tensor_parallel

    def per(sp: bool, recompute: str) -> int:
        return layer_activation_terms(
            shape,
            tp=tp,
            sequence_parallel=sp,
            dtype_bytes=b,
            recompute=recompute,
            recompute_modules=layout.recompute_modules,
        ).total

    out = {
        "none": per(False, "none"),
        "selective": per(False, "selective"),
        "full_kept": shape.hidden * b,
        "none_sp": per(True, "none"),
        "full_kept_sp": shape.hidden // tp * b,
    }
    if shape.is_moe:

        def moe(sp: bool, recompute: str) -> int:
            return moe_layer_activation_terms(
                shape,
                tp=tp,
                etp=layout.expert_tensor_parallel,
                sequence_parallel=sp,
                dtype_bytes=b,
                recompute=recompute,
                recompute_modules=layout.recompute_modules,
            ).total

        out.update(
            moe_none=moe(False, "none"), moe_selective=moe(False, "selective"), moe_none_sp=moe(True, "none")
        )
    return out


@dataclass(frozen=True)
class CheckpointWrites:
    """What a save asks of the busiest rank and node (`checkpoint_writes`)."""

    rank_bytes: int
    """Bytes the busiest rank writes: a whole TP×PP shard (and its experts)."""
    node_bytes: int
    """Bytes the busiest trainer node writes (its writing ranks together)."""
    node_host_bytes: int
    """fp32 optimizer state the save gathers into that node's host memory first."""


def checkpoint_writes(shape: ModelShape, layout: TrainerLayout, procs_per_node: int) -> CheckpointWrites:
    """Per save, who writes what. Each TP×PP shard is written by one rank, its main replica: DP×CP rank 0
    (megatron's torch_dist strategy writes main replicas only, `strategies/torch.py`, and we do not wrap it
    in the fully parallel strategy), which first gathers the shard's optimizer state over gloo into host
    memory (`distrib_optim_fully_reshardable_mem_efficient`, `train/engine/checkpoint.py`;
    `DistributedOptimizer.sharded_param_state_fully_reshardable`). A MoE layer's experts are written the
    same way by expert-DP rank 0 of each ETP×EP×PP shard. Ranks are placed in megatron's default order
    (dense tp-cp-dp-pp, experts tp-ep-dp-pp, TP fastest), `procs_per_node` to a node."""
    b = DTYPE_BYTES[layout.precision]
    opt = optimizer_bytes_per_param(layout)
    tp, pp, cp, dp = (
        layout.tensor_parallel,
        layout.pipeline_parallel,
        layout.context_parallel,
        layout.data_parallel,
    )
    ep, etp, edp = layout.expert_parallel, layout.expert_tensor_parallel, layout.expert_data_parallel
    stages = []  # (dense, expert) parameters on a rank of each pipeline stage
    for s in range(pp):
        experts = shape.stage_expert_params(pp, s, ep=ep, etp=etp)
        stages.append((shape.stage_params(tp, pp, s, ep=ep, etp=etp) - experts, experts))
    nodes: dict[int, list[int]] = {}
    rank_bytes = 0
    for rank in range(tp * cp * dp * pp):
        dense, experts = stages[rank // (tp * cp * dp)]
        params = dense if (rank // tp) % (cp * dp) == 0 else 0  # dense main replica: cp = dp = 0
        params += experts if experts and (rank // (etp * ep)) % edp == 0 else 0  # expert-DP rank 0
        if params:
            rank_bytes = max(rank_bytes, params * (b + opt))
            written, host = nodes.get(rank // procs_per_node, [0, 0])
            nodes[rank // procs_per_node] = [written + params * (b + opt), host + params * opt]
    return CheckpointWrites(
        rank_bytes,
        max((w for w, _ in nodes.values()), default=0),
        max((h for _, h in nodes.values()), default=0),
    )
