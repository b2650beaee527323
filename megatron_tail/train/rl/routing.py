"""Routing replay in the RL step (`algorithm.routing_replay`): which pass records, replays or routes freely,
the engine's routes as per-position sample fields, and the `moe/*` scalars.

| pass       | none | r2                          | r3                      |
|------------|------|-----------------------------|-------------------------|
| θ_old      | free | RECORD (its own choice)     | replay the engine's     |
| update     | free | replay θ_old's recorded     | replay the engine's     |
| reference  | free | free                        | replay the engine's     |

Under r2 the reference routes freely: it is another model, whose own routing is what π_ref means.

The engine's routes (the `routed_experts` column of a `RolloutBatch`, `[prompt + response − 1,
num_hidden_layers, k]`, row p = token p's route as a forward's input) become two per-position fields of the
sample (`rollout.routes.ROUTES_FIELD` / `ROUTED_FIELD`): the last token gets an all-0 row and `routed` False
(it was sampled but never fed to the engine; its outputs predict nothing in the loss). From there they follow
their tokens through packing, the CP split and micro-batches like any other per-token field (`engine.batch`).

Scalars: `moe/routing_agreement` (+ `/layer_{i}`) and `moe/load_imbalance_cv` from the θ_old pass (whenever
the batch has engine routes: the agreement of the trainer's *own* router with the engine's, even while it
replays them), `moe/aux_loss` from megatron's tracker over the update passes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from megatron_tail.rollout.routes import SERVER_FLAG
from megatron_tail.utils.errors import UserError

if TYPE_CHECKING:
    from ..engine.routing import RoutingPass

OLD_ACTION = {"none": "free", "r2": "record", "r3": "replay_field"}
UPDATE_ACTION = {"none": None, "r2": "replay_recorded", "r3": "replay_field"}
REFERENCE_ACTION = {"none": None, "r2": None, "r3": "replay_field"}


def engine_routes_shape(cfg, arch) -> tuple[int, int] | None:
    """`(num_hidden_layers, top_k)` when the engines should return routes, else None: under r3 (replayed),
    and for a MoE model on the local engine (for `moe/routing_agreement`: free there), for single-turn
    samples and multi-turn episodes alike. SGLang servers return them only when started with the flag, which
    the launchers pass under r3."""
    if arch.moe is None:
        return None
    if cfg.algorithm.routing_replay == "r3" or cfg.rollout.engine == "local":
        return (arch.num_layers, arch.moe.top_k)
    return None


def missing_routes(mode: str) -> UserError:
    return UserError(
        f"algorithm.routing_replay={mode} replays the engine's routes, but the rollout batch has none: start "
        f"the servers with {SERVER_FLAG} (the local engine: serve-local {SERVER_FLAG})"
    )


def routing_pass(chunks, action: str | None, *, observe: bool = False) -> RoutingPass | None:
    """A `RoutingPass` on `chunks` for `action` (None: routers free and unobserved → no pass at all), or
    None for a model without routers."""
    if action is None and not observe:
        return None
    from ..engine.routing import RoutingPass

    routing = RoutingPass(chunks, action or "free", observe=observe)
    return routing if routing.active else None


def aux_loss_scalars(num_moe_layers: int, forwards: int, dp_group) -> dict[str, float]:
    """`moe/aux_loss`: megatron's load-balancing loss (without its coefficient) per MoE layer and forward,
    averaged over the MoE layers and this step's training forwards of micro-batches with sample tokens
    (`forwards` on this rank; an empty one adds nothing to the tracker:
    `engine.forward.EmptyMicroBatchAuxLogs`), from megatron's tracker (`moe_utils.
    get_moe_layer_wise_logging_tracker`, filled by the router's `attach_and_log_load_balancing_loss` in
    training forwards), reduced by megatron's own
    `reduce_aux_losses_tracker_across_ranks` (sum over PP and TP × CP, mean over DP) as its
    `track_moe_metrics` does, then times the DP size over the forwards of every DP rank (ranks may run
    different numbers of non-empty micro-batches); the tracker is cleared. Collective over the trainer's
    groups and `dp_group`. {} when nothing was tracked."""
    from megatron.core.transformer.moe.moe_utils import (
        clear_aux_losses_tracker,
        get_moe_layer_wise_logging_tracker,
        reduce_aux_losses_tracker_across_ranks,
    )

    from ..engine.collectives import all_reduce_scalars

    tracker = get_moe_layer_wise_logging_tracker()
    if "load_balancing_loss" not in tracker:
        return {}
    total = all_reduce_scalars({"forwards": float(forwards)}, dp_group)["forwards"]
    reduce_aux_losses_tracker_across_ranks(["load_balancing_loss"])
    values = tracker["load_balancing_loss"]["values"].double().cpu()
    clear_aux_losses_tracker()
    if total == 0:
        return {}
    import torch.distributed as dist

    dp = dist.get_world_size(dp_group)
    return {"moe/aux_loss": float(values.sum()) * dp / total / max(num_moe_layers, 1)}


def clear_aux_loss() -> None:
    """Zero megatron's aux-loss tracker (before the update passes it should cover)."""
    from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker

    clear_aux_losses_tracker()
