"""MoE routing replay: megatron-core's own `RouterReplay` driven around the forward passes of a schedule.

    routing = RoutingPass(chunks, "replay_field")           # or "record", "replay_recorded", "free"
    run_micro_batches(chunks, mbs, on_outputs, ..., routing=routing)   # calls before / after per micro-batch
    stats = routing.stats                                    # RoutingStats of the observed pass, or None

megatron-core 0.16.1 (`transformer/moe/router_replay.py`): with `moe_enable_routing_replay` every router holds
a `RouterReplay`, and `topk_routing_with_score_function` (`transformer/moe/moe_utils.py`) asks it for the
top-k: RECORD keeps the router's own choice (`recorded_topk_idx`), REPLAY_FORWARD uses `target_topk_idx`
and REPLAY_BACKWARD pops `replay_backward_list` (one entry appended by every `set_target_indices`), the
gate's probabilities being gathered at the replayed experts either way. megatron-core itself never switches
to REPLAY_BACKWARD; a recomputed forward (activation checkpointing, `TransformerBlock._checkpointed_forward`
→ `tensor_parallel.checkpoint`, re-run inside backward) must find it set. Here `after` registers a gradient
hook on the micro-batch's model output: the backward of that micro-batch reaches it before any layer's
recompute and switches this chunk's replays to REPLAY_BACKWARD; the next `before` switches back to
REPLAY_FORWARD. Micro-batches enter backward in the order they entered forward (megatron's schedules), the
order in which `replay_backward_list` pops. The model's own instances are driven (`model.moe.router_replays`),
never megatron's process-wide list, which a reference model extends.

Token order (what a router sees): hidden states are `[s, b, h]`, the router's logits `.view(-1, E)`, so
token `t·b + r` is position t of row r; under context parallelism s is this CP rank's shard (the
micro-batch's fields are already split by `context_parallel.split_for_context_parallel`), and under sequence
parallelism each TP rank routes its contiguous `s/TP` slice of that (megatron's
`scatter_to_sequence_parallel_region` splits dim 0 in rank order). `router_order` does this for any
per-position `[b, s, ...]` field; pipeline stages take the columns of their own MoE layers.

Routes live in a micro-batch as the per-position field `ROUTES_FIELD` (`[b, s, layers, k]`, integer, one
column per decoder layer as the engines return them, dense layers' unused) with `ROUTED_FIELD` (`[b, s]`
bool: positions that have an engine route: not the last token of a sample, not padding). Padding positions
and each sample's last token replay `spread_routes` (k distinct experts each, spread over all experts); a
token's MoE output is its own, and these tokens' outputs predict nothing in the loss (nothing attends to
padding; the last token has no target).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.transformer.moe.router_replay import RouterReplayAction
from megatron.core.utils import unwrap_model

from megatron_tail.model.moe import router_replays
from megatron_tail.patches.router_replay_observe import (
    observe_router_replay,
    own_topk,
    unobserve_router_replay,
)
from megatron_tail.rollout.routes import ROUTED_FIELD, ROUTES_FIELD

from .batch import MicroBatch
from .parallel import comm_device

RECORDED = "recorded_routes"
"""`MicroBatch.extras` key: a RECORD pass's routes, {chunk index: one `[s·b, k]` int64 per MoE layer of the
chunk}, in router token order."""

Action = Literal["free", "record", "replay_field", "replay_recorded"]


def moe_layer_replays(chunk: torch.nn.Module) -> list[tuple[int, object]]:
    """`(global decoder-layer id, RouterReplay)` of this chunk's MoE layers (this pipeline stage's), in layer
    order; empty for a dense model or one built without `routing_replay`. The id is the column of
    `ROUTES_FIELD` (the engines' layout: every decoder layer, dense ones 0)."""
    model = unwrap_model(chunk)
    replays = router_replays(model)  # the model's own instances, never megatron's process-wide list
    ids = [
        layer.layer_number - 1
        for layer in model.decoder.layers
        if getattr(getattr(layer.mlp, "router", None), "router_replay", None) is not None
    ]
    return list(zip(ids, replays, strict=True))


def router_order(value: torch.Tensor, *, sequence_parallel: bool) -> torch.Tensor:
    """A micro-batch's per-position `[b, s, ...]` (a CP shard's own) → `[s'·b, ...]` in this rank's router
    token order: sequence-major, and with `sequence_parallel` this TP rank's contiguous slice of s."""
    x = value.transpose(0, 1)
    tp = parallel_state.get_tensor_model_parallel_world_size()
    if tp > 1 and sequence_parallel:
        n = x.shape[0] // tp
        rank = parallel_state.get_tensor_model_parallel_rank()
        x = x[rank * n : (rank + 1) * n]
    return x.reshape(-1, *value.shape[2:])


def spread_routes(tokens: int, k: int, num_experts: int, device) -> torch.Tensor:
    """`[tokens, k]` int64 routes for positions without an engine route (padding, each sample's last
    token): k distinct experts per token, consecutive tokens on the next k, so they spread evenly over the
    experts and the expert-parallel ranks. Their outputs predict nothing; before, all of them went to expert 0
    (the field's zeros), one expert-parallel rank receiving every padding token (~4× the others' tokens in a
    padded Qwen3-30B-A3B batch of long-tailed lengths), and the aux loss counting them on expert 0."""
    t = torch.arange(tokens, device=device)[:, None] * k + torch.arange(k, device=device)
    return t % num_experts


@dataclass
class RoutingStats:
    """Sum-reducible routing counts per global MoE layer (over real, routed positions), float64."""

    agree: torch.Tensor
    """`[L]`: positions whose router's own top-k set equals the engine's."""
    tokens: torch.Tensor
    """`[L]`: positions counted."""
    per_expert: torch.Tensor
    """`[L, E]`: tokens sent to each expert by the routes the pass used."""
    layer_ids: tuple[int, ...]
    """The global decoder-layer id of each MoE layer (the tag suffix)."""
    sequence_parallel: bool = False
    """TP ranks route different tokens (sum over TP too)."""

    def reduce(self, groups) -> RoutingStats:
        """Summed over the ranks that hold different tokens (DP × CP; TP under sequence parallelism) and over
        pipeline stages (each holds its own layers' rows). Collective over all ranks."""
        flat = torch.cat([self.agree[:, None], self.tokens[:, None], self.per_expert], 1).to(comm_device())
        dist.all_reduce(flat, group=groups.dp_cp_group)
        if self.sequence_parallel and groups.tp_size > 1:
            dist.all_reduce(flat, group=groups.tp)
        if groups.pp_size > 1:
            dist.all_reduce(flat, group=groups.pp)
        flat = flat.cpu()
        return RoutingStats(flat[:, 0], flat[:, 1], flat[:, 2:], self.layer_ids, self.sequence_parallel)

    def scalars(self) -> dict[str, float]:
        """`moe/routing_agreement` (fraction of counted (position, layer) pairs whose top-k sets agree;
        overall and `/layer_{i}`, i the global decoder-layer id) and `moe/load_imbalance_cv` (mean over MoE
        layers of the population std / mean of tokens per expert)."""
        out: dict[str, float] = {}
        total = float(self.tokens.sum())
        if total > 0:
            out["moe/routing_agreement"] = float(self.agree.sum()) / total
            for i, a, n in zip(self.layer_ids, self.agree.tolist(), self.tokens.tolist(), strict=True):
                if n > 0:
                    out[f"moe/routing_agreement/layer_{i}"] = a / n
        counts = self.per_expert
        used = counts.sum(1) > 0
        if used.any():
            mean = counts[used].mean(1)
            cv = counts[used].std(1, unbiased=False) / mean
            out["moe/load_imbalance_cv"] = float(cv.mean())
        return out


class RoutingPass:
    """Drives the chunks' `RouterReplay`s through one `run_micro_batches` pass (module docstring).

    `action`: "free" (the routers choose; with `observe` their choice is compared with the engine's),
    "record" (RECORD; each micro-batch's routes land in `mb.extras[RECORDED]`), "replay_field" (REPLAY the
    engine's routes of `ROUTES_FIELD`), "replay_recorded" (REPLAY a RECORD pass's routes of the same
    micro-batches). `observe`: accumulate `RoutingStats` (needs `ROUTES_FIELD` for the agreement; the load
    counts use the routes the pass used).
    """

    def __init__(self, chunks: Sequence[torch.nn.Module], action: Action, *, observe: bool = False):
        self.action = action
        self.observe = observe
        self.layers = {id(c): moe_layer_replays(c) for c in chunks}
        self.chunk_index = {id(c): i for i, c in enumerate(chunks)}
        config = unwrap_model(chunks[0]).config
        self.config = config
        self.sequence_parallel = bool(config.sequence_parallel)
        pattern = config.moe_layer_freq if isinstance(config.moe_layer_freq, list) else []
        layer_ids = tuple(i for i, m in enumerate(pattern) if m)
        self.row = {g: j for j, g in enumerate(layer_ids)}
        self.num_experts = config.num_moe_experts or 0
        self._in_flight = {id(c): 0 for c in chunks}
        """Per chunk: micro-batches replayed with a backward to come whose backward has not begun."""
        self._sums: RoutingStats | None = None
        if observe:
            n = len(layer_ids)
            zeros = torch.zeros(n, dtype=torch.float64)
            per_expert = torch.zeros(n, self.num_experts, dtype=torch.float64)
            self._sums = RoutingStats(
                zeros.clone(), zeros.clone(), per_expert, layer_ids, self.sequence_parallel
            )

    @property
    def active(self) -> bool:
        """The model's routers hold replays (`moe_enable_routing_replay`) in some MoE layer of any pipeline
        stage: from the config, so that every stage agrees, a stage of dense layers only too (the pass's
        statistics reduce over the pipeline group: a stage that left the pass out would leave the others
        waiting in that all-reduce)."""
        return bool(self.row) and bool(getattr(self.config, "moe_enable_routing_replay", False))

    def __enter__(self) -> RoutingPass:
        self._in_flight = dict.fromkeys(self._in_flight, 0)
        for layers in self.layers.values():
            for _, replay in layers:
                replay.clear_indices()
                replay.set_router_replay_action(_ACTIONS[self.action])
                if self.observe:
                    observe_router_replay(replay)
        return self

    def __exit__(self, *exc) -> None:
        for layers in self.layers.values():
            for _, replay in layers:
                replay.clear_indices()
                replay.clear_router_replay_action()
                unobserve_router_replay(replay)

    def before(self, model: torch.nn.Module, mb: MicroBatch) -> None:
        """Before micro-batch `mb`'s forward on `model` (one of the chunks)."""
        layers = self.layers.get(id(model), [])
        if not layers:
            return
        self._drop_unused(model, layers)
        targets = None
        if self.action == "replay_field":
            if ROUTES_FIELD not in mb.fields:
                raise ValueError(
                    f"routing replay of the engine's routes: the micro-batch has no {ROUTES_FIELD!r}"
                )
            routes = router_order(mb.fields[ROUTES_FIELD], sequence_parallel=self.sequence_parallel)
            routed = router_order(mb.fields[ROUTED_FIELD], sequence_parallel=self.sequence_parallel)
            filler = spread_routes(routes.shape[0], routes.shape[-1], self.num_experts, routes.device)
            keep = routed.to(torch.bool)[:, None]
            targets = [torch.where(keep, routes[:, j].long(), filler) for j, _ in layers]
        elif self.action == "replay_recorded":
            targets = mb.extras[RECORDED][self.chunk_index[id(model)]]
        for i, (_, replay) in enumerate(layers):
            if targets is not None:
                replay.set_target_indices(targets[i])
                replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)

    def after(self, model: torch.nn.Module, mb: MicroBatch, output: torch.Tensor) -> None:
        """After `mb`'s forward on `model`: keep recorded routes, count statistics, and arm REPLAY_BACKWARD
        for the recompute of this micro-batch's backward."""
        layers = self.layers.get(id(model), [])
        if not layers:
            return
        if self.action == "record":
            recorded = mb.extras.setdefault(RECORDED, {})
            recorded[self.chunk_index[id(model)]] = [r.get_recorded_indices().detach() for _, r in layers]
        if self.observe:
            self._count(layers, mb)
        if not self.action.startswith("replay"):
            return
        if not output.requires_grad:  # no backward, so no recompute will pop what `before` appended
            for _, r in layers:
                r.replay_backward_list.pop()
            return
        replays = [r for _, r in layers]
        key = id(model)
        self._in_flight[key] += 1

        def to_backward(grad):
            self._in_flight[key] -= 1
            for r in replays:
                r.set_router_replay_action(RouterReplayAction.REPLAY_BACKWARD)
            return grad

        output.register_hook(to_backward)

    def _drop_unused(self, model: torch.nn.Module, layers) -> None:
        """Drop the replay entries that no recompute will pop: those of micro-batches whose backward is over
        (a schedule runs each backward to its end before the next forward) in layers it did not recompute.

        megatron's `RouterReplay.set_target_indices` appends every micro-batch's `[tokens, k]` int64 to
        `replay_backward_list`, which only a recomputed forward pops (REPLAY_BACKWARD) and only
        `clear_indices` empties. Before, a pass kept every micro-batch's entry of every layer it did not
        recompute to its end: ~3 KB per token for Qwen3-30B-A3B (48 layers × 8 × 8 B), ~3 GB for a rank's
        million-token mini-batch, where the plan counts the micro-batches in flight."""
        waiting = self._in_flight[id(model)]
        for _, replay in layers:
            stale = len(replay.replay_backward_list) - waiting
            if stale > 0:
                del replay.replay_backward_list[:stale]

    def _count(self, layers, mb: MicroBatch) -> None:
        has_routes = ROUTES_FIELD in mb.fields
        if not has_routes:
            return
        sp = self.sequence_parallel
        sums = self._sums
        # counted on the model's device with fixed-size ops (no boolean-mask indexing, no bincount, no
        # .item()): no host sync per micro-batch and layer; `RoutingStats.reduce` reads them once per pass
        valid = router_order(mb.fields[ROUTED_FIELD], sequence_parallel=sp)
        engine = router_order(mb.fields[ROUTES_FIELD], sequence_parallel=sp)
        for g, replay in layers:
            own = own_topk(replay)  # kept by the observing patch
            if sums.agree.device != own.device:
                sums.agree, sums.tokens = sums.agree.to(own.device), sums.tokens.to(own.device)
                sums.per_expert = sums.per_expert.to(own.device)
            counted = valid.to(own.device).bool()
            theirs = engine[:, g].to(device=own.device, dtype=own.dtype)
            same = (own.sort(-1).values == theirs.sort(-1).values).all(-1)
            used = theirs if self.action == "replay_field" else own
            j = self.row[g]
            sums.agree[j] += (same & counted).sum(dtype=torch.float64)
            sums.tokens[j] += counted.sum(dtype=torch.float64)
            weight = counted[:, None].expand_as(used).reshape(-1).double()
            sums.per_expert[j].scatter_add_(0, used.reshape(-1).long(), weight)

    @property
    def stats(self) -> RoutingStats | None:
        """This rank's sums (before `RoutingStats.reduce`), None unless observed."""
        return self._sums


_ACTIONS = {
    "free": None,
    "record": RouterReplayAction.RECORD,
    "replay_field": RouterReplayAction.REPLAY_FORWARD,
    "replay_recorded": RouterReplayAction.REPLAY_FORWARD,
}
