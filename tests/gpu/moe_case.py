"""The rollout batch of the MoE routing-replay check (`test_moe_cuda.py` and its CPU half
`tests/train/test_moe_rl_device.py`): a tiny random Qwen3-MoE on disk (`tests.rollout.tiny_moe`: 3 layers,
the middle one dense, 4 experts, top-2) for the trainer, and `PROMPTS × GROUP` responses that the local
engine sampled on `device` in fp32 with DVP at the trainer's log ρ, with their log-probs and MoE routes as
SGLang returns them (`meta_info.routed_experts`, decoded by `rollout.routes.decode_routes`).

The engine serves the trainer's weights with its routers moved (`ROUTER_NOISE`), as an engine a version
behind would: its routes differ from the trainer's own choice on a sixth of the (position, MoE layer) pairs,
so replaying them (r3) changes the trainer's forward and a replay that did not happen would show, while the
log-probs stay within ≈ 0.25 nats of the trainer's (MIS weights far inside [0.5, 2]).

Every engine route is checked here against the float64 recomputation of the engine's HF routers' top-k
(`tiny_moe.reference_routes`), on every position, as `tests/rollout/test_routes.py` does on CPU. The
independent reference for the trainer (`forced_reference`) is one float64 HF forward per sample of the
trainer's weights with the engine's routes forced into every MoE layer: the log-probs an r3 pass must give,
and per pair the router's own top-k there (what `moe/routing_agreement` counts) with its margin. Rewards are
fixed per sample, so both trainer runs of a comparison see exactly the same `RolloutBatch`.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import torch

PROMPTS = ([5, 6, 84, 7], [9, 84, 12], [40, 41, 42, 43, 44], [77, 3])
"""Character-token prompts (the tiny model's char tokenizer), of different lengths."""
GROUP = 4
MAX_NEW_TOKENS = 10
LOG_RHO = -13.0
"""DVP's default ρ = e^-13, the engine's and the trainer's: every sampled token lies in the safe set with a
margin far beyond bf16 rounding (a token within 0.1 nats of the threshold has π ≈ e^-13 · max π)."""
ROUTER_NOISE = 0.3
"""The engine's router weights: the trainer's plus N(0, (0.3·std)²) noise. Measured on the CPU case: 17% of
the pairs routed otherwise than the trainer's own routers, log-probs at most 0.24 nats apart."""
PAD_ID = 0
"""The char tokenizer's padding id. HF zeroes its embedding row (`pad_token_id`) and keeps it out of the
gradient (`nn.Embedding(padding_idx=0)`); megatron's embedding has no padding index, and a zero input's
gradient through the first RMSNorm is scaled by 1/sqrt(ε) = 10³: one sampled pad token made the embedding's
gradient 100× the rest of the model's. Responses are drawn again where they hold one."""


def build_moe_case(root: Path, device: str) -> dict:
    """{'hf_dir' (the trainer's model), 'engine_dir', 'batch' (RolloutBatch), 'engine_device', 'pairs'
    (routed (position, MoE layer) pairs, each checked against the float64 routers), and `forced_reference`'s
    'reference_logprobs', 'own_agrees', 'margins'}."""
    from megatron_tail.rollout.batch import RolloutBatch
    from megatron_tail.rollout.columns import LOGPROBS, ROUTES
    from megatron_tail.rollout.local_engine.engine import LocalEngine
    from megatron_tail.rollout.routes import compact_routes, decode_routes
    from tests.rollout.test_local_engine import item
    from tests.rollout.tiny_moe import (
        DENSE_LAYER,
        NUM_LAYERS,
        TOP_K,
        reference_routes,
        write_tiny_qwen3_moe,
    )

    model_dir = write_tiny_qwen3_moe(root / "model", seed=0)
    engine_dir = _moved_routers(model_dir, root / "engine", seed=1)

    def request(p: int, s: int):
        plain = item(f"p{p}-s{s}", PROMPTS[p], temperature=1.0, log_rho=LOG_RHO, seed=100 * p + s,
                     max_new_tokens=MAX_NEW_TOKENS)  # fmt: skip
        return dataclasses.replace(plain, return_routed_experts=True)

    items = [request(p, s) for p in range(len(PROMPTS)) for s in range(GROUP)]
    engine = LocalEngine(engine_dir, dtype="float32", device=device, enable_return_routed_experts=True)
    try:
        assert next(engine.model.parameters()).device.type == torch.device(device).type
        outs = engine.generate(items)
        for attempt in range(1, 6):  # no padding token among the responses (PAD_ID), by drawing again
            again = [i for i, out in enumerate(outs) if PAD_ID in out["output_ids"]]
            if not again:
                break
            redrawn = [dataclasses.replace(items[i], seed=items[i].seed + 1000 * attempt) for i in again]
            for i, it, out in zip(again, redrawn, engine.generate(redrawn), strict=True):
                items[i], outs[i] = it, out
    finally:
        engine.close()
    assert not any(PAD_ID in out["output_ids"] for out in outs)
    routes, logprobs, pairs = [], [], 0
    for it, out in zip(items, outs, strict=True):
        ids = it.input_ids + out["output_ids"]
        got = decode_routes(out["meta_info"]["routed_experts"], len(ids) - 1, NUM_LAYERS, TOP_K, it.rid)
        want = reference_routes(engine_dir, ids)[:-1].numpy()  # the last token never went through a forward
        np.testing.assert_array_equal(np.sort(got, axis=-1), want, err_msg=it.rid)
        assert (got[:, DENSE_LAYER] == 0).all()
        pairs += got.shape[0] * (NUM_LAYERS - 1)
        routes.append(compact_routes(got))
        logprobs.append([lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]])
    g = torch.Generator().manual_seed(3)
    rewards = [round(float(r), 2) for r in torch.rand(len(items), generator=g)]  # fixed: both runs see them
    batch = RolloutBatch(
        prompt_ids=[it.input_ids for it in items],
        response_ids=[out["output_ids"] for out in outs],
        rewards=rewards,
        correct=[r > 0.5 for r in rewards],
        truncated=[len(out["output_ids"]) == MAX_NEW_TOKENS for out in outs],
        weight_versions=["0"] * len(items),
        columns={LOGPROBS: logprobs, ROUTES: routes},
    )
    case = {
        "hf_dir": str(model_dir),
        "engine_dir": str(engine_dir),
        "batch": batch,
        "engine_device": device,
        "pairs": pairs,
    }
    case.update(forced_reference(model_dir, batch))
    assert case["margins"].numel() == pairs
    return case


def _moved_routers(source: Path, dest: Path, *, seed: int) -> Path:
    """`source` with N(0, (ROUTER_NOISE·std)²) added to each router weight (nothing else), saved to `dest`."""
    from transformers import Qwen3MoeForCausalLM

    from megatron_tail.data.char_tokenizer import build_char_tokenizer

    model = Qwen3MoeForCausalLM.from_pretrained(str(source), dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in model.model.layers:
            if hasattr(layer.mlp, "gate"):
                w = layer.mlp.gate.weight
                w.add_(torch.randn(w.shape, generator=gen) * ROUTER_NOISE * w.std())
    model.save_pretrained(str(dest))
    build_char_tokenizer(dest)
    return dest


def forced_reference(model_dir: Path, batch) -> dict:
    """One float64 HF forward per sample of `model_dir` whose MoE layers take the batch's engine routes
    (each gate returns the given experts with weights softmax(logits) at them, renormalised, as HF's router
    does with `norm_topk_prob` and megatron's replay does with `moe_router_pre_softmax=False`):
    'reference_logprobs' {sample: float64 [len(response)]}, and per routed pair (sample-major, then
    position, then MoE layer) 'own_agrees' (bool: the gate's own top-k set there equals the engine's) and
    'margins' (float64: its k-th minus (k+1)-th largest logit; softmax is monotone, so a router whose logits
    are off by less than half of it picks the same set)."""
    from transformers import Qwen3MoeForCausalLM

    from megatron_tail.rollout.columns import ROUTES
    from tests.rollout.tiny_moe import TOP_K

    model = Qwen3MoeForCausalLM.from_pretrained(
        str(model_dir), dtype=torch.float64, experts_implementation="eager"
    ).eval()  # grouped_mm has no float64
    gates = {i: layer.mlp.gate for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "gate")}
    logits_of: dict[int, torch.Tensor] = {}
    logprobs, agrees, margins = {}, [], []
    for s, (prompt, response) in enumerate(zip(batch.prompt_ids, batch.response_ids, strict=True)):
        routes = batch.column(ROUTES)[s].long()  # [n − 1, layers, k]; the last token: any distinct experts
        routes = torch.cat([routes, torch.arange(TOP_K).expand(1, routes.shape[1], TOP_K)])
        for i, gate in gates.items():

            def forward(hidden, gate=gate, i=i, idx=routes[:, i]):
                logits = torch.nn.functional.linear(hidden.reshape(-1, gate.weight.shape[1]), gate.weight)
                logits_of[i] = logits
                probs = torch.softmax(logits, dim=-1).gather(1, idx)
                return logits, probs / probs.sum(-1, keepdim=True), idx

            gate.forward = forward
        ids = torch.tensor([prompt + response])
        with torch.no_grad():
            logp = torch.log_softmax(model(ids).logits[0], -1)[:-1].gather(1, ids[0, 1:, None])[:, 0]
        logprobs[s] = logp[len(prompt) - 1 :]
        per_layer = []
        for i in gates:
            z = logits_of[i][:-1]  # [n − 1, E]
            top = z.topk(TOP_K + 1, dim=-1)
            own = top.indices[:, :TOP_K].sort(-1).values
            per_layer.append(
                (
                    (own == routes[:-1, i].sort(-1).values).all(-1),
                    top.values[:, TOP_K - 1] - top.values[:, TOP_K],
                )
            )
        agrees.append(torch.stack([a for a, _ in per_layer], 1).reshape(-1))
        margins.append(torch.stack([m for _, m in per_layer], 1).reshape(-1))
    return {"reference_logprobs": logprobs, "own_agrees": torch.cat(agrees), "margins": torch.cat(margins)}
