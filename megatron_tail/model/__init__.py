"""Qwen3 / Qwen2.5 / Llama-3 / Qwen3-MoE as megatron-core `GPTModel`, and the HF ⇄ Megatron weight bridge.

    arch = load_hf_config(hf_dir)                       # refuses unsupported architectures
    model = build_gpt_model(arch, ModelSettings())      # this rank's TP×PP stage; needs parallel_state
    load_hf_weights(model, hf_dir, arch)                # HF safetensors → sharded parameters
    export_hf(model, out_dir, arch)                     # sharded parameters → HF safetensors + config.json

Only this package and `megatron_tail.train` read megatron's global `parallel_state`. Exports are lazy:
`ModelSettings` and `load_hf_config` do not import megatron.
"""

from megatron_tail.utils.lazy import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(
    __name__,
    {
        "DEFAULT_VOCAB_PAD_MULTIPLE": ".settings",
        "ModelSettings": ".settings",
        "layer_spec": ".config",
        "padded_vocab_size": ".config",
        "transformer_config": ".config",
        "export_hf": ".export",
        "iter_hf_tensors": ".export",
        "TailGPTModel": ".gpt",
        "build_gpt_model": ".gpt",
        "SUPPORTED_ARCHITECTURES": ".hf_config",
        "HFArch": ".hf_config",
        "load_hf_config": ".hf_config",
        "load_hf_weights": ".load",
        "ParamMapping": ".naming",
        "hf_tensor_shapes": ".naming",
        "megatron_to_hf": ".naming",
        "router_replays": ".moe",
        "MoEArch": ".moe_arch",
    },
)
