"""The foundation of routing replay: `build_gpt_model(routing_replay=True)` gives every MoE router
megatron's `RouterReplay`, which records the top-k per (token, MoE layer) and replays given routes on CPU at
EP 1 and 2. (The replayed forward against a float64 reference MoE is the routing-replay step's test.)"""

from __future__ import annotations

import pytest
import torch

from tests.harness import run_distributed
from tests.model.hf_moe import make_hf_moe

TOKENS = torch.randint(0, 200, (2, 6), generator=torch.Generator().manual_seed(3))


def _record_and_replay(rank, world, hf_dir, ep):  # noqa: ARG001 - harness signature
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    from megatron_tail.model import build_gpt_model, load_hf_config, load_hf_weights
    from megatron_tail.model.moe import router_replays
    from tests.model.hf_models import causal_mask, gather_vocab
    from tests.model.hf_moe import init_megatron_ep

    init_megatron_ep(ep=ep)
    arch = load_hf_config(hf_dir)
    model = build_gpt_model(arch, routing_replay=True)
    load_hf_weights(model, hf_dir, arch)
    model.eval()
    replays = router_replays(model)

    def forward(action, routes=None):
        for r, route in zip(replays, routes or [None] * len(replays), strict=True):
            r.clear_indices()
            if route is not None:
                r.set_target_indices(route)
            r.set_router_replay_action(action)
        with torch.no_grad():
            return gather_vocab(model(TOKENS, None, causal_mask(*TOKENS.shape)), arch.vocab_size)

    free = forward(None)
    recorded_logits = forward(RouterReplayAction.RECORD)
    recorded = [r.get_recorded_indices().clone() for r in replays]
    same = forward(RouterReplayAction.REPLAY_FORWARD, recorded)
    shifted = forward(RouterReplayAction.REPLAY_FORWARD, [(t + 1) % arch.moe.num_experts for t in recorded])
    return {
        "routes": [tuple(t.shape) for t in recorded],
        "distinct": [bool((t[:, 0] != t[:, 1]).all()) for t in recorded],
        "record": (recorded_logits - free).abs().max().item(),
        "same": (same - free).abs().max().item(),
        "shifted": (shifted - free).abs().max().item(),
    }


@pytest.mark.parametrize("ep", [1, 2])
def test_routes_record_and_replay(tmp_path, ep):
    make_hf_moe(tmp_path, norm_topk_prob=True)
    for got in run_distributed(_record_and_replay, ep, str(tmp_path), ep):
        # one [tokens = s·b, k] tensor per MoE layer (layers 0 and 2; the dense layer 1 has no router)
        assert got["routes"] == [(12, 2), (12, 2)] and all(got["distinct"])
        assert got["record"] == 0.0 and got["same"] == 0.0  # recording and replaying its own routes: bitwise
        assert got["shifted"] > 0.1  # other experts: other logits, so the replay is what routes
