"""`observe_router_replay(replay)`: a megatron `RouterReplay` also keeps the router's own top-k choice while
it replays given routes (or routes freely), for `moe/routing_agreement`: the agreement of the trainer's own
router with the engine's routes, in the same forward (`train.engine.routing.RoutingPass`, `observe=True`).

megatron-core 0.16.1 (`transformer/moe/router_replay.py`, `RouterReplay.get_replay_topk`) computes the
router's own top-k (`default_compute_topk`) only under RECORD; under REPLAY_FORWARD it returns the target
indices without it, and it has no hook. So an instance attribute shadows the method: it calls the same
`default_compute_topk` on the same scores in the same call (no second forward), keeps its indices as
`replay._mt_own`, and hands the call on to the class's method (replay), or records (RECORD) and returns its
own choice (free routing, no action). Unlike the CPU shims this one runs on GPUs too.
"""

from __future__ import annotations

from .pinning import check_pinned

OWN = "_mt_own"
"""The attribute holding the router's own top-k indices `[tokens, k]` of its last forward."""


def observe_router_replay(replay) -> None:
    """Install the observing `get_replay_topk` on `replay` (a `RouterReplay`); a no-op if installed."""
    check_pinned()
    if "get_replay_topk" in replay.__dict__:
        return
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    original = type(replay).get_replay_topk.__get__(replay)

    def get_replay_topk(scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
        own = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        setattr(replay, OWN, own[1].detach())
        if replay.router_replay_action in (None, RouterReplayAction.RECORD):
            if replay.router_replay_action is not None:
                replay.record_indices(own[1])
            return own
        return original(scores, topk, num_groups, group_topk, default_compute_topk)

    replay.get_replay_topk = get_replay_topk


def unobserve_router_replay(replay) -> None:
    """Remove what `observe_router_replay` installed (and the kept indices); a no-op if nothing was."""
    replay.__dict__.pop("get_replay_topk", None)
    replay.__dict__.pop(OWN, None)


def own_topk(replay):
    """The router's own top-k indices of its last observed forward."""
    return getattr(replay, OWN)
