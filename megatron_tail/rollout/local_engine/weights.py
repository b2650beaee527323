"""Loading HF-named tensors into a transformers model: from a safetensors directory or a broadcast.

MoE checkpoints name each expert's weights (`...mlp.experts.{e}.{gate,up,down}_proj.weight`, what HF
checkpoints and `save_pretrained` hold), while transformers 5's Qwen3-MoE keeps them fused
(`Qwen3MoeExperts.gate_up_proj` `[experts, 2·I, H]`, gate rows first as its forward's `chunk(2)` reads them,
and `down_proj` `[experts, H, I]`): such names fill their expert's slice of the fused parameter.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path

import torch


def read_safetensors_dir(model_path: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of the `*.safetensors` files in `model_path` (CPU), keyed by HF parameter name. Read by
    `read_safetensors_file`, not safetensors' `load_file`, which keeps ~56 bytes per tensor for good: the
    disk weight sync reads the whole model every step."""
    from megatron_tail.model.safetensors_io import read_safetensors_file

    path = Path(model_path)
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else []
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {str(model_path)!r}")
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        tensors.update(read_safetensors_file(file))
    return tensors


def load_named_tensors_(
    model: torch.nn.Module, named_tensors: Iterable[tuple[str, torch.Tensor]], *, require_all: bool
) -> int:
    """Copy tensors into the model's parameters/buffers of the same name (dtype-cast); return the count.

    Raises ValueError naming unknown names or shape mismatches before anything is copied; with
    `require_all`, also naming model parameters the tensors do not cover (tied weights count as covered).
    """
    targets = dict(model.named_parameters(remove_duplicate=False))
    targets.update(dict(model.named_buffers(remove_duplicate=False)))
    pairs = list(named_tensors)
    dests = {name: _destination(targets, name) for name, _ in pairs}
    unknown = [name for name, _ in pairs if dests[name] is None]
    if unknown:
        raise ValueError(f"{len(unknown)} tensor names are not in the model, e.g. {unknown[:5]}")
    bad_shapes = [
        f"{n}: {tuple(t.shape)} vs model {tuple(dests[n][1].shape)}"
        for n, t in pairs
        if t.shape != dests[n][1].shape
    ]
    if bad_shapes:
        raise ValueError(f"shape mismatch for {len(bad_shapes)} tensors, e.g. {bad_shapes[:3]}")
    if require_all:
        filled: dict[str, int] = {}
        for name, _ in pairs:
            target, view = dests[name]
            filled[target] = filled.get(target, 0) + view.numel()
        covered = {id(targets[n]) for n, count in filled.items() if count >= targets[n].numel()}
        params = dict(model.named_parameters(remove_duplicate=False))
        missing = [n for n, p in params.items() if id(p) not in covered]
        if missing:
            raise ValueError(f"{len(missing)} model parameters have no tensor, e.g. {missing[:5]}")
    with torch.no_grad():
        for name, tensor in pairs:
            dests[name][1].copy_(tensor)
    return len(pairs)


_EXPERT = re.compile(
    r"^(?P<prefix>.+\.experts)\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$"
)


def _destination(targets: dict[str, torch.Tensor], name: str) -> tuple[str, torch.Tensor] | None:
    """(the model tensor's name, the view `name` fills): the tensor itself, or for a per-expert name its
    expert's slice of the fused parameter (module docstring); None when the model has neither."""
    if name in targets:
        return name, targets[name]
    match = _EXPERT.match(name)
    if match is None:
        return None
    expert, proj = int(match["expert"]), match["proj"]
    fused = f"{match['prefix']}.{'down_proj' if proj == 'down_proj' else 'gate_up_proj'}"
    if fused not in targets or expert >= targets[fused].shape[0]:
        return None
    view = targets[fused][expert]
    if proj != "down_proj":
        half = view.shape[0] // 2
        view = view[:half] if proj == "gate_proj" else view[half:]
    return fused, view
