"""The megatron-core `GPTModel` of an HF architecture, for this rank's pipeline stage.

Packed micro-batches use megatron's own THD path on both layer specs: `PackedSeqParams(qkv_format="thd")`
makes `GPTModel._preprocess` build RoPE for the longest sequence (`RotaryEmbedding.get_rotary_seq_len`)
and `SelfAttention.forward` rotate every sequence from position 0 (`apply_rotary_pos_emb(...,
cu_seqlens=...)`), so positions restart per sequence without any override of ours. Padded micro-batches
start every row at position 0, which is megatron's default RoPE. `position_ids` are therefore never
needed (None).
"""

from __future__ import annotations

import torch
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.transformer_block import get_num_layers_to_build

from megatron_tail.patches import apply_moe_te_gemm_shim, cpu_device_scope, use_host_rope_bounds

from .config import ModelSettings, layer_spec, padded_vocab_size, transformer_config
from .hf_config import HFArch
from .local_spec import local_block_spec
from .moe import moe_block_spec


class TailGPTModel(GPTModel):
    """`GPTModel` that can hand the final-norm hidden states to the fused output-layer op.

    `forward(input_ids [b, s] int64, None, None, packed_seq_params=...)` returns vocab-parallel logits
    `[b, s, V_padded / tp]` on the last stage (hidden states `[s, b, h]` elsewhere, and on the last stage
    too with `fused_output_layer`). Packed: b = 1 and s = the micro-batch's tokens (THD).
    """

    fused_output_layer: bool = False
    """On the last stage, return the final-norm hidden states `[s, b, h]` instead of the logits, for the
    fused output-layer + log-prob op; `output_weight()` is the weight it must use."""
    uses_te_spec: bool = False
    """Built with the Transformer Engine layer spec (TE's attention on THD `PackedSeqParams`)."""

    def output_weight(self) -> torch.Tensor:
        """The output layer's weight `[V_padded/tp, h]`: the (tied) embedding's where megatron ties them,
        which on PP > 1 is the last stage's copy that megatron keeps in sync with the first stage's."""
        if self.share_embeddings_and_output_weights:
            return self.shared_embedding_or_output_weight()
        return self.output_layer.weight

    def _postprocess(self, hidden_states, *args, **kwargs):
        if self.fused_output_layer and self.post_process:
            if kwargs.get("labels") is not None or self.config.mtp_num_layers is not None:
                raise NotImplementedError("fused_output_layer returns hidden states: no labels, no MTP")
            return hidden_states  # [s, b, h] (this rank's sequence shard with sequence parallelism)
        return super()._postprocess(hidden_states, *args, **kwargs)


def build_gpt_model(
    arch: HFArch,
    settings: ModelSettings | None = None,
    *,
    pre_process: bool | None = None,
    post_process: bool | None = None,
    routing_replay: bool = False,
) -> TailGPTModel:
    """This rank's stage of the Megatron model of `arch` (randomly initialised; load weights with the bridge).

    Needs megatron's parallel state (TP/PP) initialised. Logits stay vocab-parallel (`parallel_output=True`)
    over `padded_vocab_size(arch.vocab_size, tp, settings.vocab_pad_multiple)` columns; columns at and
    beyond `arch.vocab_size` are padding (zero weights) that the log-prob op masks via `vocab_size`.
    On PP > 1 the tied output layer of the last stage is a copy of the embedding that megatron keeps in
    sync through the embedding group. `routing_replay` (MoE): each router gets megatron's `RouterReplay`
    (`moe.router_replays(model)` lists them in layer order).
    """
    settings = settings or ModelSettings()
    if arch.moe is not None:
        # megatron's router reads an undefined name without TE (patches/moe_te_gemm.py)
        apply_moe_te_gemm_shim()
    config = transformer_config(arch, settings, routing_replay=routing_replay)
    if not config.apply_rope_fusion:  # megatron's unfused THD RoPE reads the boundaries back per layer
        use_host_rope_bounds()
    if pre_process is None:
        pre_process = parallel_state.is_pipeline_first_stage()
    if post_process is None:
        post_process = parallel_state.is_pipeline_last_stage()
    # cpu_device_scope: with tied embeddings on PP > 1 megatron moves the last stage's output weight with
    # `.cuda()` before syncing it from the first stage (language_module.py); a no-op where CUDA exists.
    with cpu_device_scope():
        model = _construct(arch, settings, config, pre_process, post_process)
    model.uses_te_spec = settings.resolved_use_te()
    model.fused_output_layer = settings.fused_output_layer
    if torch.cuda.is_available():
        model.cuda(torch.cuda.current_device())
    return model


def _construct(arch, settings, config, pre_process, post_process) -> TailGPTModel:
    tp = parallel_state.get_tensor_model_parallel_world_size()
    if arch.moe is not None:
        spec = moe_block_spec(arch, settings, config)
    else:
        spec = layer_spec(arch, settings)
        if not settings.resolved_use_te():
            spec = local_block_spec(spec, get_num_layers_to_build(config))
    return TailGPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=padded_vocab_size(arch.vocab_size, tp, settings.vocab_pad_multiple),
        max_sequence_length=settings.max_sequence_length or arch.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        parallel_output=True,
        share_embeddings_and_output_weights=arch.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_base=arch.rope_theta,
        rope_scaling=arch.rope_scaling_factor is not None,
        rope_scaling_factor=arch.rope_scaling_factor or 8.0,
    )
