"""`patches/router_replay_observe.py` on a real megatron `RouterReplay`: the router's own top-k is kept in the
same call while the class's replay returns the target indices (which megatron alone computes no own choice
for), a free call returns (and RECORD records) the router's own choice, installing twice is one install,
and removing it restores the class's method."""

from __future__ import annotations

import torch
from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

from megatron_tail.patches.router_replay_observe import (
    observe_router_replay,
    own_topk,
    unobserve_router_replay,
)


def _topk(scores, topk, num_groups=None, group_topk=None):  # noqa: ARG001 - megatron's signature
    return torch.topk(scores, topk, dim=-1)


def test_the_replay_keeps_the_routers_own_choice_while_it_replays():
    scores = torch.tensor([[0.1, 0.7, 0.2, 0.0], [0.5, 0.1, 0.0, 0.4]])
    own = torch.topk(scores, 2, dim=-1).indices
    targets = torch.tensor([[2, 3], [1, 2]])
    replay = RouterReplay()
    RouterReplay.global_router_replay_instances.remove(replay)  # megatron's global list: model layers only
    calls = []
    counting = lambda *a, **k: calls.append(1) or _topk(*a, **k)  # noqa: E731

    replay.set_target_indices(targets)
    replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
    _, plain = replay.get_replay_topk(scores, 2, default_compute_topk=counting)
    assert torch.equal(plain, targets) and calls == [] and not hasattr(replay, "_mt_own")

    observe_router_replay(replay)
    observe_router_replay(replay)  # idempotent: one shadow, one own top-k per call
    replay.set_target_indices(targets)
    _, got = replay.get_replay_topk(scores, 2, default_compute_topk=counting)
    assert torch.equal(got, targets) and calls == [1] and torch.equal(own_topk(replay), own)

    replay.clear_router_replay_action()  # free routing: the router's own choice
    _, free = replay.get_replay_topk(scores, 2, default_compute_topk=_topk)
    assert torch.equal(free, own)
    replay.set_router_replay_action(RouterReplayAction.RECORD)
    replay.get_replay_topk(scores, 2, default_compute_topk=_topk)
    assert torch.equal(replay.get_recorded_indices(), own)

    unobserve_router_replay(replay)
    assert "get_replay_topk" not in replay.__dict__ and not hasattr(replay, "_mt_own")
    replay.set_target_indices(targets)
    replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
    _, again = replay.get_replay_topk(scores, 2, default_compute_topk=counting)
    assert torch.equal(again, targets) and calls == [1]
