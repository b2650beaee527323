"""The plan as a table for people (`format_plan`) and as one JSON object for scripts (`plan_json`)."""

from __future__ import annotations

from typing import Any

from .planner import GIB, Plan

TERM_NOTES = {
    "weights": "{params:,} params on this rank x {b} B",
    "grads": "fp32 main grads (megatron's grad buffer, not sharded)",
    "optimizer": "{opt}",
    "activations": "{act}",
    "logits": "{logits}",
    "reference": "{ref}",
    "supports": "{supports}",
    "routes": "{routes}",
    "reserve": "CUDA context, NCCL, allocator (assumed)",
}


def _gib(n: float) -> str:
    return f"{n / GIB:6.1f} GiB"


def _notes(plan: Plan) -> dict[str, str]:
    lay, shape = plan.trainer_layout, plan.shape
    b = 4 if lay.precision == "fp32" else 2
    cp = lay.context_parallel
    cp_times = f" x CP={cp}" if cp > 1 else ""
    tokens = f"{lay.tokens_per_micro_batch}/CP={lay.tokens_per_gpu}" if cp > 1 else lay.tokens_per_micro_batch
    opt = (
        f"{lay.optimizer}: {'fp32 master + ' if lay.precision != 'fp32' else ''}"
        f"{'m, v' if lay.optimizer == 'adam' else 'momentum'}"
        + (
            f", / DP={lay.data_parallel}{cp_times}"
            + (f", experts / EDP={lay.expert_data_parallel}" if shape.is_moe else "")
            + " (distributed optimizer)"
            if lay.distributed_optimizer
            else ", not sharded"
        )
    )
    in_flight = min(lay.pipeline_parallel - plan.trainer.stage, lay.micro_batches)
    recompute = lay.recompute
    if lay.recompute == "full":
        recompute += f" ({lay.recompute_num_layers or 1} layers/chunk)"
    elif lay.recompute == "selective":
        recompute += f" ({', '.join(lay.recompute_modules)})"
    act = (
        f"{in_flight} x {tokens} tokens x "
        f"{shape.layers // lay.pipeline_parallel} layers, "
        f"recompute {recompute}{', SP' if lay.sequence_parallel else ''}"
    )
    if shape.is_moe:
        act += f"; MoE: top-{shape.top_k} experts' MLPs, router, alltoall buffers"
    if plan.trainer.stage != lay.pipeline_parallel - 1:
        logits = "(last stage only)"
    elif lay.fused_output_layer:
        chunk = f"{b} B token chunks" if lay.op_backend == "triton" else "fp32 blocks"
        logits = f"fused op ({lay.op_backend}): final norm + {chunk}, no logits"
    else:
        v_local = shape.padded_vocab // lay.tensor_parallel
        logits = f"[{lay.tokens_per_gpu}, {v_local}] x {b} B, grad in place; op backend {lay.op_backend}"
    ref_gib = f"{plan.trainer.params * b / GIB:.1f} GiB"
    ref = {
        "none": "no reference policy (kl_coef 0)",
        "resident": f"reference policy's weights ({b} B/param), resident",
        "offloaded": f"reference policy offloaded: {ref_gib} of pinned host memory per GPU, on the GPU "
        "only for its forward pass, before the update's activations exist (counted: what its weights "
        "exceed the update's activations by)",
    }[lay.reference]
    weights = TERM_NOTES["weights"].format(params=plan.trainer.params, b=b)
    if shape.is_moe:
        experts = plan.trainer.expert_params
        weights += f" ({experts:,} expert: {shape.experts // lay.expert_parallel} experts/layer, I/ETP)"
    routes = (
        f"RouterReplay indices ({lay.routing_replay}): {in_flight} x [tokens, MoE layers, k] int64"
        if "routes" in plan.trainer.terms
        else ""
    )
    return {
        "routes": routes,
        "weights": weights,
        "grads": TERM_NOTES["grads"],
        "optimizer": opt,
        "activations": act,
        "logits": logits,
        "reference": ref,
        "supports": _supports_note(plan, in_flight),
        "reserve": TERM_NOTES["reserve"],
    }


def _supports_note(plan: Plan, in_flight: int) -> str:
    lay = plan.trainer_layout
    if not lay.support_width:
        return "no truncated sampling (rollout.sampling.top_k/top_p/min_p off)"
    k, tokens, w = lay.support_width, lay.tokens_per_gpu, lay.support_dense_width
    dense = (
        f" + dense [{tokens}, <= {w}] int32 for the op"
        if plan.trainer.stage == lay.pipeline_parallel - 1
        else ""
    )
    return f"{in_flight} x {tokens} tokens x <= {k} ids ragged (4 B/id + 8 B/token){dense}; worst case"


def format_plan(plan: Plan) -> str:
    """Human-readable: per trainer GPU, per rollout server, checkpoint, verdict."""
    lay, shape, ro, rl = plan.trainer_layout, plan.shape, plan.rollout, plan.rollout_layout
    c = plan.cluster
    p = plan.per_token_per_layer
    moe = (
        f"; experts={shape.experts} top-{shape.top_k} I={shape.moe_ffn} in {shape.moe_layers()} layers, "
        f"{shape.active_params():,} active"
        if shape.is_moe
        else ""
    )
    lines = [
        f"model: {shape.total_params():,} params, {shape.layers} layers, h={shape.hidden} f={shape.ffn} "
        f"heads={shape.heads}/{shape.kv_heads}x{shape.head_dim} vocab={shape.vocab} "
        f"(padded {shape.padded_vocab}){moe}",
        f"cluster: {c.nodes} nodes x {c.gpus_per_node} GPUs of {c.gpu_memory_gib:g} GiB; rollout "
        f"{c.rollout_nodes} node(s), trainer {c.nodes - c.rollout_nodes}",
        f"trainer: TP={lay.tensor_parallel} PP={lay.pipeline_parallel} "
        + (f"CP={lay.context_parallel} " if lay.context_parallel > 1 else "")
        + f"DP={lay.data_parallel}, "
        + (
            f"EP={lay.expert_parallel} ETP={lay.expert_tensor_parallel} EDP={lay.expert_data_parallel}, "
            if shape.is_moe
            else ""
        )
        + f"{lay.precision}, per GPU (pipeline stage {plan.trainer.stage}, the fullest):",
    ]
    notes = _notes(plan)
    for term, value in plan.trainer.terms.items():
        lines.append(f"  {term:<12} {_gib(value)}   {notes[term]}")
    lines.append(f"  {'total':<12} {_gib(plan.trainer.total)}   of {_gib(lay.capacity_bytes).strip()}")
    dense_layers = not shape.is_moe or shape.moe_layers() < shape.layers
    if dense_layers:
        lines.append(
            f"  activation per token per {'dense ' if shape.is_moe else ''}layer: {p['none']:,} B (selective "
            f"recompute {p['selective']:,} B, full recompute keeps {p['full_kept']:,} B); with SP "
            f"{p['none_sp']:,} B (full: {p['full_kept_sp']:,} B)"
        )
    if shape.is_moe:
        copies = shape.top_k * lay.expert_tensor_parallel / lay.tensor_parallel
        lines.append(
            f"  activation per token per MoE layer: {p['moe_none']:,} B (selective recompute "
            f"{p['moe_selective']:,} B, full recompute keeps {p['full_kept']:,} B); with SP "
            f"{p['moe_none_sp']:,} B (full: {p['full_kept_sp']:,} B); k x ETP/TP = {copies:g} routed copies "
            "per token"
        )
    kv_pool = ro.budget_bytes - ro.weights_bytes - ro.routes_device_bytes
    lines += [
        f"rollout: {rl.servers} SGLang servers x TP={rl.tp_per_server}"
        + (f" EP={rl.ep_per_server}" if shape.is_moe else "")
        + f", mem fraction {rl.mem_fraction}, per GPU:",
        f"  weights      {_gib(ro.weights_bytes)}"
        + (f"   all {shape.experts} experts x {shape.layers} layers, / TP" if shape.is_moe else ""),
        *(
            [
                f"  routes       {_gib(ro.routes_device_bytes)}   r3 capture buffer [max(chunked prefill, "
                f"running), {shape.layers}, {shape.top_k}] int32; host cache "
                f"{ro.routes_host_bytes / GIB:.1f} GiB per GPU (KV tokens x layers x k x 4 B)"
            ]
            if ro.routes_device_bytes
            else []
        ),
        f"  KV cache     {_gib(kv_pool)}   {ro.kv_bytes_per_token:,} B/token "
        f"-> {ro.kv_tokens_per_server:,} tokens per server",
        f"  sequences    {ro.sequences_per_server} of {rl.sequence_tokens} tokens fit per server; "
        f"in flight {ro.in_flight_per_server} (max_concurrency {rl.max_concurrency} x group {rl.group_size} "
        f"/ {rl.servers} servers)",
        *([f"  {plan.episode}"] if plan.episode else []),
        *(
            [
                f"sampling supports: <= {plan.support_host_bytes_per_rank / GIB:.1f} GiB of host memory per "
                f"trainer rank (the step's batch, <= top_k={lay.support_width} ids per response token, "
                "ragged; the real size is logged as rollout/support_size_mean)"
            ]
            if lay.support_width
            else []
        ),
        *(
            [
                f"routes (r3): <= {plan.routes_host_bytes_per_rank / GIB:.1f} GiB of host memory per trainer "
                f"rank (the step's batch, {shape.layers} layers x k={shape.top_k} x 4 B per token)"
            ]
            if plan.routes_host_bytes_per_rank
            else []
        ),
        _checkpoint_line(plan),
    ]
    lines += [f"WARNING: {w}" for w in plan.warnings]
    lines += [f"DOES NOT FIT: {p}" for p in plan.problems]
    lines.append("fits" if plan.fits else "does not fit")
    return "\n".join(lines)


def plan_json(plan: Plan) -> dict[str, Any]:
    """One object: trainer.{tensor,pipeline,context,data}_parallel, trainer.<term>_bytes, total/capacity,
    rollout.kv_tokens_per_server, checkpoint, fits, problems, warnings."""
    lay, ro, rl = plan.trainer_layout, plan.rollout, plan.rollout_layout
    trainer = {
        "tensor_parallel": lay.tensor_parallel,
        "pipeline_parallel": lay.pipeline_parallel,
        "expert_parallel": lay.expert_parallel,
        "expert_tensor_parallel": lay.expert_tensor_parallel,
        "expert_data_parallel": lay.expert_data_parallel,
        "context_parallel": lay.context_parallel,
        "data_parallel": lay.data_parallel,
        "stage": plan.trainer.stage,
        "params_per_gpu": plan.trainer.params,
        "expert_params_per_gpu": plan.trainer.expert_params,
        "tokens_per_micro_batch": lay.tokens_per_micro_batch,
        "tokens_per_gpu": lay.tokens_per_gpu,
        **{f"{term}_bytes": value for term, value in plan.trainer.terms.items()},
        "total_bytes": plan.trainer.total,
        "capacity_bytes": lay.capacity_bytes,
        "activation_bytes_per_token_per_layer": dict(plan.per_token_per_layer),
    }
    rollout = {
        "servers": rl.servers,
        "tp_per_server": rl.tp_per_server,
        "weights_bytes_per_gpu": ro.weights_bytes,
        "kv_bytes_per_token": ro.kv_bytes_per_token,
        "kv_tokens_per_server": ro.kv_tokens_per_server,
        "sequences_per_server": ro.sequences_per_server,
        "in_flight_per_server": ro.in_flight_per_server,
        "ep_per_server": rl.ep_per_server,
        "routes_device_bytes": ro.routes_device_bytes,
        "routes_host_bytes_per_gpu": ro.routes_host_bytes,
    }
    shape = plan.shape
    model = {
        "total_params": shape.total_params(),
        "active_params": shape.active_params(),
        "experts": shape.experts,
        "top_k": shape.top_k,
        "moe_layers": shape.moe_layers(),
    }
    checkpoint = {
        "bytes_per_rank": plan.checkpoint.rank_bytes,
        "bytes_per_node": plan.checkpoint.node_bytes,
        "host_gather_bytes_per_node": plan.checkpoint.node_host_bytes,
        "save_seconds": round(plan.checkpoint_seconds, 1),
        "assumed_fs_write_gbps_per_node": plan.cluster.fs_write_gbps,
    }
    return {
        "model": model,
        "trainer": trainer,
        "rollout": rollout,
        "checkpoint": checkpoint,
        "supports": {
            "width": plan.trainer_layout.support_width,
            "dense_width": plan.trainer_layout.support_dense_width,
            "host_bytes_per_rank": plan.support_host_bytes_per_rank,
        },
        "routes_host_bytes_per_rank": plan.routes_host_bytes_per_rank,
        "fits": plan.fits,
        "problems": list(plan.problems),
        "warnings": list(plan.warnings),
    }


def _checkpoint_line(plan) -> str:
    ckpt, c = plan.checkpoint, plan.cluster
    return (
        f"checkpoint: {ckpt.rank_bytes / 1e9:.1f} GB from each shard's writing rank (its DP rank 0), "
        f"{ckpt.node_bytes / 1e9:.0f} GB from the busiest node, ~{plan.checkpoint_seconds:.0f} s at an "
        f"assumed {c.fs_write_gbps:g} GB/s per node; {ckpt.node_host_bytes / GIB:.1f} GiB of optimizer state "
        "gathered in that node's host memory first"
    )
