"""The local engine's linear-layer formats (`rollout.quantization`): which layers each format replaces and
how they are re-quantized after a weight update. The formats: `fp8.py` (per-channel and per-tensor e4m3)
and `fp4.py` (NVFP4 W4A16)."""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn

from .fp4 import Nvfp4Linear
from .fp8 import Fp8Linear

QUANTIZATIONS = ("none", "fp8", "fp8_tensor", "nvfp4_a16")
"""The local engine's linear-layer formats: "fp8" (per-channel weights, per-token activations: SGLang's
choice on H100), "fp8_tensor" (one scale per weight and one per activation tensor: SGLang's
`fp8_utils.input_to_float8` / `scaled_fp8_quant(x, None)` path where cutlass FP8 is unavailable) and
"nvfp4_a16" (`local_engine/fp4.py`)."""


def quantize_linears_(model: nn.Module, quantization: str = "fp8") -> list[str]:
    """Replace every `nn.Linear` except the output embedding (LM head) by its `quantization`
    (`QUANTIZATIONS`) layer, in place, as SGLang quantizes every `LinearBase` and no embedding; returns the
    replaced modules' names."""
    wrap = {
        "fp8": Fp8Linear,
        "fp8_tensor": lambda m: Fp8Linear(m, per_tensor=True),
        "nvfp4_a16": Nvfp4Linear,
    }
    if quantization not in wrap:
        raise ValueError(f"quantization must be one of {sorted(wrap)}; got {quantization!r}")
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    targets = [
        (name, module)
        for name, module in model.named_modules()
        if type(module) is nn.Linear and module is not head
    ]
    for name, module in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, wrap[quantization](module))
    return [name for name, _ in targets]


def requantize_(model: nn.Module, parameter_names: Iterable[str] | None = None) -> int:
    """Re-derive the quantized weights of the layers (`Fp8Linear`, `Nvfp4Linear`) whose `weight`/`bias` is
    among `parameter_names` (all of them when None), after new weights were copied in; returns how many
    were requantized."""
    layers = {name: m for name, m in model.named_modules() if hasattr(m, "requantize")}
    if parameter_names is None:
        chosen = set(layers)
    else:
        chosen = {n.rpartition(".")[0] for n in parameter_names} & set(layers)
    for name in chosen:
        layers[name].requantize()
    return len(chosen)
