"""`read_safetensors_file`: every tensor safetensors' own `load_file` reads, bit for bit (each dtype the
format names and torch has, scalars, empty tensors, mixed dtypes at unaligned offsets), named errors for a
file that is not one, and no memory kept per read: safetensors 0.8's torch path keeps ~56 bytes per tensor
for good, and the local engine's disk weight sync reads the whole model every step through this."""

from __future__ import annotations

import gc
import tracemalloc

import pytest
import torch
from safetensors.torch import load_file, save_file

from megatron_tail.model.safetensors_io import read_safetensors_file


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    out = {
        "bf16": torch.randn(3, 5, generator=g).bfloat16(),  # 30 bytes: what follows starts unaligned
        "f32": torch.randn(7, generator=g),
        "f16": torch.randn(2, 3, generator=g).half(),
        "f64": torch.randn(4, generator=g).double(),
        "fp8": torch.randn(3, 3, generator=g).to(torch.float8_e4m3fn),
        "fp8_e5m2": torch.randn(5, generator=g).to(torch.float8_e5m2),
        "i64": torch.arange(-3, 6),
        "i32": torch.arange(5, dtype=torch.int32),
        "i16": torch.arange(3, dtype=torch.int16),
        "i8": torch.arange(-2, 2, dtype=torch.int8),
        "u8": torch.arange(250, 256, dtype=torch.uint8),
        "u16": torch.tensor([1, 2, 65535], dtype=torch.uint16),
        "u32": torch.tensor([1, 2, 2**32 - 1], dtype=torch.uint32),
        "u64": torch.tensor([1, 2, 3], dtype=torch.uint64),
        "bool": torch.tensor([True, False, True]),
        "scalar": torch.tensor(2.5),
        "empty": torch.empty(0, 4),
    }
    if hasattr(torch, "float8_e8m0fnu"):  # torch ≥ 2.7
        out["e8m0"] = torch.tensor([0.5, 2.0, 8.0]).to(torch.float8_e8m0fnu)
    return out


def test_it_reads_what_safetensors_reads_bit_for_bit(tmp_path):
    path = tmp_path / "mixed.safetensors"
    save_file(_tensors(), path, metadata={"format": "pt"})
    ours, theirs = read_safetensors_file(path), load_file(path)
    assert ours.keys() == theirs.keys()
    for name, tensor in theirs.items():
        assert ours[name].dtype == tensor.dtype and ours[name].shape == tensor.shape, name
        assert torch.equal(ours[name].reshape(-1).view(torch.uint8), tensor.reshape(-1).view(torch.uint8)), (
            name
        )
    ours["f32"].add_(1.0)  # a private copy: the file stays as it was
    assert torch.equal(read_safetensors_file(path)["f32"], theirs["f32"])


def test_a_file_that_is_not_safetensors_is_named(tmp_path):
    empty, text = tmp_path / "empty.safetensors", tmp_path / "text.safetensors"
    empty.write_bytes(b"")
    text.write_bytes(b"\x05\x00\x00\x00\x00\x00\x00\x00nope!")
    with pytest.raises(ValueError, match=r"empty\.safetensors: not a safetensors file \(0 bytes\)"):
        read_safetensors_file(empty)
    with pytest.raises(ValueError, match=r"text\.safetensors: not a safetensors file \(its header: "):
        read_safetensors_file(text)
    no_dtype = tmp_path / "no_dtype.safetensors"
    header = b'{"w":{"shape":[1],"data_offsets":[0,4]}}'
    no_dtype.write_bytes(len(header).to_bytes(8, "little") + header + b"\0" * 4)
    with pytest.raises(
        ValueError, match=r"no_dtype\.safetensors: not a safetensors file \(its header: KeyError"
    ):
        read_safetensors_file(no_dtype)
    odd = tmp_path / "odd.safetensors"
    header = b'{"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4,8]}}'
    odd.write_bytes(len(header).to_bytes(8, "little") + header + b"\0" * 8)
    with pytest.raises(ValueError, match=r"odd\.safetensors: not a safetensors file \(its header: "):
        read_safetensors_file(odd)


def test_reading_again_and_again_keeps_nothing(tmp_path):
    path = tmp_path / "many.safetensors"
    save_file({f"layers.{i}.weight": torch.zeros(4) for i in range(500)}, path)
    for _ in range(3):
        read_safetensors_file(path)
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for _ in range(30):
            read_safetensors_file(path)
        gc.collect()
        kept = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert kept / (30 * 500) < 2.0, f"{kept} bytes kept over 30 reads of 500 tensors"
