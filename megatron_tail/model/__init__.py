"""Qwen3 / Qwen2.5 / Llama-3 as megatron-core `GPTModel`, and the HF ⇄ Megatron weight bridge.

    arch = load_hf_config(hf_dir)                       # refuses unsupported architectures
    model = build_gpt_model(arch, ModelSettings())      # this rank's TP×PP stage; needs parallel_state
    load_hf_weights(model, hf_dir, arch)                # HF safetensors → sharded parameters
    export_hf(model, out_dir, arch)                     # sharded parameters → HF safetensors + config.json

Only this package and `megatron_tail.train` read megatron's global `parallel_state`.
"""

from .config import (
    DEFAULT_VOCAB_PAD_MULTIPLE,
    ModelSettings,
    layer_spec,
    padded_vocab_size,
    transformer_config,
)
from .export import export_hf, iter_hf_tensors
from .gpt import TailGPTModel, build_gpt_model
from .hf_config import SUPPORTED_ARCHITECTURES, HFArch, load_hf_config
from .load import load_hf_weights
from .naming import ParamMapping, hf_tensor_shapes, megatron_to_hf

__all__ = [
    "DEFAULT_VOCAB_PAD_MULTIPLE",
    "SUPPORTED_ARCHITECTURES",
    "HFArch",
    "ModelSettings",
    "ParamMapping",
    "TailGPTModel",
    "build_gpt_model",
    "export_hf",
    "hf_tensor_shapes",
    "iter_hf_tensors",
    "layer_spec",
    "load_hf_config",
    "load_hf_weights",
    "megatron_to_hf",
    "padded_vocab_size",
    "transformer_config",
]
