"""The local engine's `--enable-return-routed-experts`: each token's top-k experts per MoE layer, recorded
from the HF model's own routers, returned as SGLang 0.5.23 returns them (`rollout/routes.py`).

HF transformers' Qwen3-MoE (`models/qwen3_moe/modeling_qwen3_moe.py`): the decoder layers whose
`mlp` is a `Qwen3MoeSparseMoeBlock` (those not in `mlp_only_layers` with `(i + 1) % decoder_sparse_step == 0`)
route through `mlp.gate`, a `Qwen3MoeTopKRouter` whose forward returns `(router_logits, router_scores,
router_indices)`: softmax in fp32, `torch.topk` → `router_indices` `[tokens, num_experts_per_tok]`, the
experts that block then runs. A forward hook on each router takes those indices, so the recorded route is
the one the engine's forward used, in its dtype. Layers without a router keep 0 in their column, as
SGLang's zero-initialised capture buffer does for layers that never capture.
"""

from __future__ import annotations

import torch


class RouteRecorder:
    """Forward hooks on every MoE router of `model`. Used by the batcher thread only: `take` after each
    forward returns that forward's routes.

    Raises ValueError when the model has no router (SGLang's capturer needs an MoE config too).
    """

    def __init__(self, model):
        config = model.config
        layers = _decoder_layers(model)
        self.num_layers = int(config.num_hidden_layers)
        self.top_k = int(getattr(config, "num_experts_per_tok", 0) or 0)
        self._captured: dict[int, torch.Tensor] = {}
        self.moe_layers: list[int] = []
        """Indices of the decoder layers with a router."""
        for index, layer in enumerate(layers):
            gate = getattr(getattr(layer, "mlp", None), "gate", None)
            if gate is not None and hasattr(gate, "top_k") and not isinstance(gate, torch.nn.Linear):
                gate.register_forward_hook(self._hook(index))
                self.moe_layers.append(index)
        if not self.moe_layers or not self.top_k:
            raise ValueError(
                f"--enable-return-routed-experts needs an MoE model with top-k routers (Qwen3-MoE); "
                f"{type(model).__name__} has none"
            )

    def _hook(self, index: int):
        def record(_module, _inputs, output) -> None:
            indices = output[2]  # Qwen3MoeTopKRouter: (router_logits, router_scores, router_indices)
            self._captured[index] = indices.detach().to("cpu", torch.int32)

        return record

    def take(self, batch: int, length: int) -> torch.Tensor:
        """int32 `[batch, length, num_layers, top_k]`: the last forward's routes (inputs `[batch, length]`),
        0 for layers without a router; clears them."""
        routes = torch.zeros(batch, length, self.num_layers, self.top_k, dtype=torch.int32)
        for index in self.moe_layers:
            captured = self._captured.pop(index, None)
            if captured is None:
                raise RuntimeError(f"MoE layer {index}'s router did not run in the last forward")
            routes[:, :, index] = captured.view(batch, length, self.top_k)
        return routes


def _decoder_layers(model) -> list:
    inner = getattr(model, "model", model)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise ValueError(f"cannot find the decoder layers of {type(model).__name__} (expected model.layers)")
    return list(layers)
