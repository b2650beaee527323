"""Export → HF: tensors are bitwise the originals and HF logits are unchanged, for TP and PP shardings."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from megatron_tail.model.safetensors_io import SafetensorsReader
from tests.harness import run_distributed
from tests.model.hf_models import hf_logits, make_hf_model


def _load_and_export_rank(rank, world_size, hf_dir, out_dir, tp, pp, max_shard_bytes):  # noqa: ARG001
    from megatron_tail.model import build_gpt_model, export_hf, load_hf_config, load_hf_weights
    from tests.harness import init_megatron

    init_megatron(tensor_parallel=tp, pipeline_parallel=pp)
    arch = load_hf_config(hf_dir)
    model = build_gpt_model(arch)
    load_hf_weights(model, hf_dir, arch)
    return str(export_hf(model, out_dir, arch, max_shard_bytes=max_shard_bytes, copy_files_from=hf_dir))


def _all_tensors(model_dir) -> dict[str, torch.Tensor]:
    with SafetensorsReader(model_dir) as reader:
        return {name: reader.get(name) for name in reader.weight_map}


@pytest.mark.parametrize(
    ("family", "tie", "tp", "pp", "max_shard_bytes"),
    [
        ("qwen3", False, 2, 1, 5 * 2**30),
        ("qwen2", False, 1, 2, 40_000),  # several shards + index
        ("qwen3", True, 2, 2, 5 * 2**30),
    ],
)
def test_export_round_trip_is_bitwise(tmp_path, family, tie, tp, pp, max_shard_bytes):
    src, out = tmp_path / "hf", tmp_path / "exported"
    hf = make_hf_model(family, src, tie=tie)
    results = run_distributed(_load_and_export_rank, tp * pp, str(src), str(out), tp, pp, max_shard_bytes)
    assert results[0] == str(out) and all(r == "None" for r in results[1:])

    original, exported = _all_tensors(src), _all_tensors(out)
    assert sorted(exported) == sorted(original)
    for name, tensor in original.items():
        assert exported[name].dtype == tensor.dtype
        assert torch.equal(exported[name], tensor), name
    if max_shard_bytes < 2**20:
        assert (out / "model.safetensors.index.json").is_file()
    else:
        assert load_file(out / "model.safetensors").keys() == original.keys()

    from transformers import AutoModelForCausalLM

    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    tokens = torch.randint(0, 200, (2, 10), generator=torch.Generator().manual_seed(3))
    assert torch.equal(hf_logits(reloaded, tokens), hf_logits(hf, tokens))


def test_export_replaces_existing_dir_atomically(tmp_path):
    src, out = tmp_path / "hf", tmp_path / "exported"
    make_hf_model("qwen3", src)
    out.mkdir()
    (out / "stale.txt").write_text("old export")
    run_distributed(_load_and_export_rank, 1, str(src), str(out), 1, 1, 5 * 2**30)
    assert not (out / "stale.txt").exists()
    assert (out / "config.json").is_file()
    assert [p.name for p in tmp_path.iterdir() if ".tmp-" in p.name or ".old-" in p.name] == []
