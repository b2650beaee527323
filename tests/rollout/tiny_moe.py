"""A tiny random Qwen3-MoE (HF transformers, char tokenizer) on disk, and its routers' top-k in float64: the
independent reference for the routes an engine returns."""

from __future__ import annotations

from pathlib import Path

import torch

from megatron_tail.data.char_tokenizer import build_char_tokenizer
from tests.rollout.tiny_model import CONTEXT_LENGTH, VOCAB_SIZE

NUM_LAYERS = 3
TOP_K = 2
DENSE_LAYER = 1
"""In `mlp_only_layers`: its column of the routes is 0, as SGLang leaves layers that never capture."""


def tiny_qwen3_moe_config():
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        vocab_size=VOCAB_SIZE, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
        num_hidden_layers=NUM_LAYERS, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        num_experts=4, num_experts_per_tok=TOP_K, norm_topk_prob=True, decoder_sparse_step=1,
        mlp_only_layers=[DENSE_LAYER], max_position_embeddings=CONTEXT_LENGTH, tie_word_embeddings=False,
        pad_token_id=0, eos_token_id=1, bos_token_id=None,
    )  # fmt: skip


def write_tiny_qwen3_moe(path: Path, *, seed: int = 0, router_std: float = 1.0) -> Path:
    """Save a seeded random Qwen3-MoE + tokenizer to `path`. The routers get a large std so that router
    probabilities are far apart (no near-ties that fp32 and float64 could order differently) and the
    lm_head one so that sampled tokens vary."""
    from transformers import Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(tiny_qwen3_moe_config())
    with torch.no_grad():
        model.lm_head.weight.normal_(0.0, 0.6)
        for layer in model.model.layers:
            if hasattr(layer.mlp, "gate"):
                layer.mlp.gate.weight.normal_(0.0, router_std)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(path))
    build_char_tokenizer(path)
    return path


def perturbed_moe_copy(source: Path, dest: Path, *, seed: int, scale: float = 1.0) -> Path:
    """`source` with noise on every weight (a 'trained' checkpoint whose routes differ), saved to `dest`."""
    from transformers import Qwen3MoeForCausalLM

    model = Qwen3MoeForCausalLM.from_pretrained(str(source))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * scale * p.std().clamp(min=1e-3))
    model.save_pretrained(str(dest))
    build_char_tokenizer(dest)
    return dest


def reference_routes(model_dir: Path, ids: list[int]) -> torch.Tensor:
    """int32 `[len(ids), NUM_LAYERS, TOP_K]`: each MoE layer's top-k experts per position from one full,
    uncached float64 forward of `ids`, recomputed from the router input (softmax → top-k, as
    `Qwen3MoeTopKRouter`), in ascending expert order; 0 for the dense layer."""
    from transformers import Qwen3MoeForCausalLM

    model = Qwen3MoeForCausalLM.from_pretrained(
        str(model_dir), dtype=torch.float64, experts_implementation="eager"
    ).eval()  # grouped_mm has no float64
    routes = torch.zeros(len(ids), NUM_LAYERS, TOP_K, dtype=torch.int32)
    inputs: dict[int, torch.Tensor] = {}
    hooks = [
        layer.mlp.register_forward_hook(lambda _m, args, _o, i=i: inputs.__setitem__(i, args[0]))
        for i, layer in enumerate(model.model.layers)
        if hasattr(layer.mlp, "gate")
    ]
    with torch.no_grad():
        model(input_ids=torch.tensor([ids]))
        for i, hidden in inputs.items():
            probs = torch.softmax(hidden[0] @ model.model.layers[i].mlp.gate.weight.T, dim=-1)
            routes[:, i] = torch.topk(probs, TOP_K, dim=-1).indices.sort(dim=-1).values.int()
    for hook in hooks:
        hook.remove()
    return routes


def generate_across_an_update(
    engine, prompt: list[int], sampling, new_weights: Path, table=None, pause_mode: str | None = None
) -> list:
    """`sampling`'s samples of `prompt` (`RolloutClient.generate_group`, partial rollouts) from the local
    `engine` served over HTTP: held in place after 5 tokens while `new_weights` load as version 1 (the
    update aborting them), then continued; or with `pause_mode`, paused and updated in that mode. Closes
    `engine`."""
    import asyncio

    from megatron_tail.rollout import DiskWeightSync, RolloutClient
    from megatron_tail.rollout.local_engine.server import build_app
    from megatron_tail.rollout.protocol import sample_keys
    from tests.rollout.servers import serving_app
    from tests.rollout.test_partial_rollouts import _hold, _pause_at_tokens

    async def main():
        async with (
            serving_app(build_app(engine)) as url,
            RolloutClient([url], processor=None, **({} if table is None else {"table": table})) as client,
        ):
            _pause_at_tokens(engine, 5, pause_mode or "in_place")
            task = asyncio.ensure_future(
                client.generate_group(prompt, sample_keys(0, sampling), sampling, partial=True)
            )
            await asyncio.to_thread(_hold, engine, None)  # the pause at 5 tokens, held
            sync = DiskWeightSync([url], pause_mode=pause_mode or "abort", partial_rollouts=True)
            await sync.update(str(new_weights), weight_version="1")
            return await task

    try:
        return asyncio.run(main())
    finally:
        engine.close()
