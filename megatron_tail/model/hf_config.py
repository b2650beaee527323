"""Read a HF `config.json` into `HFArch`: the few architecture facts the Megatron model and the bridge need.

Supported: Qwen3 dense (`Qwen3ForCausalLM`: QK-norm, GQA, SwiGLU, RMSNorm, RoPE, tied or untied
embeddings), Qwen2 / Qwen2.5 (`Qwen2ForCausalLM`: as Qwen3 without QK-norm, with q/k/v biases) and
Llama 3 (`LlamaForCausalLM`, incl. the "llama3" RoPE scaling of Llama 3.1+) and Qwen3-MoE
(`Qwen3MoeForCausalLM`: Qwen3 attention, routed experts and dense layers mixed as the config says;
`moe_arch.py`). Everything else is refused with a `ValueError` that lists what is supported.

Both HF config generations are read: transformers 4.x (`rope_theta`, `rope_scaling` at the top level)
and 5.x (`rope_parameters = {"rope_theta", "rope_type", ...}`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .moe_arch import MoEArch, read_moe

SUPPORTED_ARCHITECTURES: dict[str, str] = {
    "Qwen3ForCausalLM": "qwen3",
    "Qwen2ForCausalLM": "qwen2",
    "LlamaForCausalLM": "llama",
    "Qwen3MoeForCausalLM": "qwen3_moe",
}
"""HF `architectures[0]` → family name. Qwen2.5 checkpoints declare `Qwen2ForCausalLM`."""

_MODEL_TYPES = {
    "qwen3": "Qwen3ForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "llama": "LlamaForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}

# Llama 3.1's RoPE scaling parameters; megatron-core's `rope_scaling` hard-codes all but `factor`.
_LLAMA3_ROPE_DEFAULTS = {
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def _supported_list() -> str:
    return ", ".join(f"{arch} ({family})" for arch, family in SUPPORTED_ARCHITECTURES.items())


@dataclass(frozen=True)
class HFArch:
    """Architecture of a supported HF causal LM, as the Megatron model and the weight bridge need it."""

    architecture: str
    """HF class name, e.g. "Qwen3ForCausalLM"."""
    family: str
    """"qwen3", "qwen2", "llama" or "qwen3_moe"."""
    vocab_size: int
    """True vocabulary size (rows of `embed_tokens`); Megatron pads beyond it."""
    hidden_size: int
    """Model width."""
    intermediate_size: int
    """SwiGLU inner width (of gate and of up, each) of the dense MLPs (MoE: of the `mlp_only_layers`)."""
    num_layers: int
    """Number of decoder layers."""
    num_attention_heads: int
    """Query heads."""
    num_key_value_heads: int
    """Key/value heads (= query groups of GQA)."""
    head_dim: int
    """Per-head width (Qwen3 sets it explicitly; otherwise hidden_size // num_attention_heads)."""
    rms_norm_eps: float
    """ε of every RMSNorm (layers, final norm, q/k norms)."""
    rope_theta: float
    """RoPE base θ."""
    tie_word_embeddings: bool
    """Whether `lm_head.weight` is `embed_tokens.weight`."""
    max_position_embeddings: int
    """Longest sequence the model is configured for."""
    qk_norm: bool
    """Per-head RMSNorm on q and k before RoPE (Qwen3)."""
    qkv_bias: bool
    """Biases on q_proj/k_proj/v_proj (Qwen2/2.5)."""
    rope_scaling_factor: float | None = None
    """Llama-3.1-style RoPE scaling factor, or None for plain RoPE."""
    initializer_range: float = 0.02
    """Std of the HF initialiser (used for Megatron's random init)."""
    torch_dtype: str | None = None
    """The checkpoint's dtype as written in config.json ("bfloat16", ...), if any."""
    moe: MoEArch | None = None
    """The routed experts (Qwen3-MoE), None for a dense model."""
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)
    """The config.json dict as read, written back (updated) on export."""

    @property
    def num_query_groups(self) -> int:
        """GQA groups: Megatron's name for the number of key/value heads."""
        return self.num_key_value_heads


def load_hf_config(source: str | Path | dict[str, Any]) -> HFArch:
    """Read `config.json` (a model dir, the file itself, or an already-parsed dict) into an `HFArch`.

    Raises:
        ValueError: the architecture is not supported (the message lists the supported ones), or a
            feature of a supported one is not (sliding-window attention, biases outside q/k/v, a RoPE
            scaling type other than "llama3", a non-SiLU activation, inconsistent head sizes).
    """
    cfg = _read_dict(source)
    architecture = _architecture(cfg)
    family = SUPPORTED_ARCHITECTURES[architecture]
    heads = int(cfg["num_attention_heads"])
    hidden = int(cfg["hidden_size"])
    head_dim = cfg.get("head_dim") or hidden // heads
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    if heads % kv_heads:
        raise ValueError(f"num_attention_heads={heads} must be a multiple of num_key_value_heads={kv_heads}")
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"hidden_act={act!r} is not supported; expected 'silu' (SwiGLU)")
    if cfg.get("attention_bias", False):
        raise ValueError(f"{architecture} with attention_bias=True (bias on o_proj too) is not supported")
    if cfg.get("mlp_bias", False):
        raise ValueError(f"{architecture} with mlp_bias=True is not supported")
    if cfg.get("use_sliding_window", False):
        raise ValueError(
            f"{architecture} with use_sliding_window=True is not supported (full attention only)"
        )
    if family == "qwen3_moe" and cfg.get("tie_word_embeddings", False):
        # SGLang 0.5.23's Qwen3MoeForCausalLM builds its own lm_head and never ties it (models/qwen3_moe.py:
        # no tie_word_embeddings), and a weight sync sends a tied model's embedding alone: the engines would
        # serve the starting lm_head for the whole run, silently (qwen3.py and qwen2.py do tie)
        raise ValueError(
            f"{architecture} with tie_word_embeddings=True is not supported: SGLang's Qwen3-MoE never ties "
            "its lm_head to the embedding, so the trained head would never reach the engines"
        )
    rope_theta, rope_factor = _rope(cfg, architecture)
    num_layers = int(cfg["num_hidden_layers"])
    moe = read_moe(cfg, num_layers, architecture) if family == "qwen3_moe" else None
    return HFArch(
        architecture=architecture,
        family=family,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(cfg["intermediate_size"]),
        num_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=int(head_dim),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=rope_theta,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
        qk_norm=family in ("qwen3", "qwen3_moe"),
        qkv_bias=family == "qwen2",
        rope_scaling_factor=rope_factor,
        initializer_range=float(cfg.get("initializer_range", 0.02)),
        torch_dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
        moe=moe,
        raw=cfg,
    )


def _read_dict(source: str | Path | dict[str, Any]) -> dict[str, Any]:
    if isinstance(source, dict):
        return dict(source)
    path = Path(source)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"no HF config.json at {path}")
    cfg = json.loads(path.read_text())
    if not isinstance(cfg, dict):
        raise ValueError(f"{path} holds a JSON {json_type(cfg)}; expected a JSON object")
    return cfg


def json_type(value: Any) -> str:
    """JSON's name for the type of a parsed value ("array", "string", "null", ...)."""
    if value is None:
        return "null"
    names = {list: "array", str: "string", bool: "boolean", int: "number", float: "number", dict: "object"}
    return names.get(type(value), type(value).__name__)


def _architecture(cfg: dict[str, Any]) -> str:
    archs = cfg.get("architectures") or []
    if not isinstance(archs, list):  # "Qwen3ForCausalLM" alone: its [0] was "Q"
        raise ValueError(
            f'architectures must be a list of class names, e.g. ["Qwen3ForCausalLM"]; got {archs!r}'
        )
    arch = archs[0] if archs else _MODEL_TYPES.get(cfg.get("model_type", ""))
    if arch not in SUPPORTED_ARCHITECTURES:
        got = arch or f"model_type={cfg.get('model_type')!r}"
        raise ValueError(f"unsupported architecture {got}; supported: {_supported_list()}")
    return arch


def _rope(cfg: dict[str, Any], architecture: str) -> tuple[float, float | None]:
    """(θ, llama3 scaling factor or None) from either config generation."""
    params = dict(cfg.get("rope_parameters") or {})
    scaling = dict(cfg.get("rope_scaling") or {})
    theta = cfg.get("rope_theta", params.get("rope_theta", 10000.0))
    rope_type = scaling.get("rope_type", scaling.get("type")) or params.get("rope_type", "default")
    if rope_type == "default":
        return float(theta), None
    if rope_type != "llama3":
        raise ValueError(
            f"{architecture}: RoPE type {rope_type!r} is not supported; expected 'default' or 'llama3'"
        )
    spec = {**params, **scaling}
    for key, expected in _LLAMA3_ROPE_DEFAULTS.items():
        if float(spec.get(key, expected)) != expected:
            raise ValueError(
                f"{architecture}: llama3 RoPE scaling with {key}={spec[key]} is not supported; "
                f"megatron-core hard-codes {key}={expected}"
            )
    return float(theta), float(spec["factor"])
