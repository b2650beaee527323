"""Loading HF-named tensors into a transformers model: from a safetensors directory or a broadcast."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import torch


def read_safetensors_dir(model_path: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of the `*.safetensors` files in `model_path` (CPU), keyed by HF parameter name."""
    from safetensors.torch import load_file

    path = Path(model_path)
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else []
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {str(model_path)!r}")
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        tensors.update(load_file(str(file)))
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
    unknown = [name for name, _ in pairs if name not in targets]
    if unknown:
        raise ValueError(f"{len(unknown)} tensor names are not in the model, e.g. {unknown[:5]}")
    bad_shapes = [
        f"{n}: {tuple(t.shape)} vs model {tuple(targets[n].shape)}"
        for n, t in pairs
        if t.shape != targets[n].shape
    ]
    if bad_shapes:
        raise ValueError(f"shape mismatch for {len(bad_shapes)} tensors, e.g. {bad_shapes[:3]}")
    if require_all:
        covered = {id(targets[n]) for n, _ in pairs}
        params = dict(model.named_parameters(remove_duplicate=False))
        missing = [n for n, p in params.items() if id(p) not in covered]
        if missing:
            raise ValueError(f"{len(missing)} model parameters have no tensor, e.g. {missing[:5]}")
    with torch.no_grad():
        for name, tensor in pairs:
            targets[name].copy_(tensor)
    return len(pairs)
