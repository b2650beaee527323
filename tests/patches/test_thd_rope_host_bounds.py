"""megatron's unfused THD RoPE from the boundaries' host copy (`patches/thd_rope_host_bounds.py`): the same
numbers as megatron's own function, with boundaries that hold no data (so nothing is read back from them),
and megatron's function itself for a tensor without the copy."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from megatron.core.models.common.embeddings import rope_utils

from megatron_tail.patches import stop_using_host_rope_bounds, use_host_rope_bounds
from megatron_tail.patches.thd_rope_host_bounds import HOST_BOUNDS

BOUNDS = (0, 4, 12, 14, 20)  # sequences of 4, 8, 2 and 6 tokens
CONFIG = SimpleNamespace(apply_rope_fusion=False, rotary_interleaved=False, multi_latent_attention=False)


@pytest.fixture
def patched():
    original = rope_utils._apply_rotary_pos_emb_thd
    use_host_rope_bounds()
    yield original
    stop_using_host_rope_bounds()
    assert rope_utils._apply_rotary_pos_emb_thd is original


def _group(size: int, rank: int):
    return SimpleNamespace(size=lambda: size, rank=lambda: rank)


def _inputs(bounds, cp_size: int, freq_rows: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    tokens = bounds[-1] // cp_size
    t = torch.randn(tokens, 3, 8, generator=g, dtype=torch.float64)
    freqs = torch.randn(freq_rows, 1, 1, 8, generator=g, dtype=torch.float64)
    return t, freqs


@pytest.mark.parametrize("cp", [(1, 0), (2, 0), (2, 1)])
@pytest.mark.parametrize("whole_batch_freqs", [False, True])  # megatron's CASE 1 (offsets) and CASE 2
def test_the_same_numbers_as_megatrons_and_no_read_of_the_boundaries(patched, cp, whole_batch_freqs):
    bounds = (0, 4, 12, 16, 24) if cp[0] == 2 else BOUNDS  # CP splits each sequence into 2 · CP chunks
    t, freqs = _inputs(bounds, cp[0], bounds[-1] if whole_batch_freqs else 16)
    group = _group(*cp)
    on_host = torch.tensor(bounds, dtype=torch.int32)
    expected = patched(t, on_host, freqs, cp_group=group)  # megatron's own, reading the tensor
    no_data = torch.empty(len(bounds), dtype=torch.int32, device="meta")  # any read raises
    setattr(no_data, HOST_BOUNDS, bounds)
    got = rope_utils.apply_rotary_pos_emb(t, freqs, CONFIG, cu_seqlens=no_data, cp_group=group)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    with pytest.raises(NotImplementedError, match="meta"):  # megatron's own does read it
        patched(t, no_data, freqs, cp_group=group)


def test_a_tensor_without_its_host_copy_goes_to_megatrons_function(patched, monkeypatch):
    t, freqs = _inputs(BOUNDS, 1, 16)
    calls = []
    monkeypatch.setattr(
        "megatron_tail.patches.thd_rope_host_bounds._original",
        lambda *args: calls.append(args) or patched(*args),
    )
    rope_utils._apply_rotary_pos_emb_thd(
        t, torch.tensor(BOUNDS, dtype=torch.int32), freqs, cp_group=_group(1, 0)
    )
    assert len(calls) == 1


def test_the_trainers_boundaries_carry_their_host_copy():
    from megatron_tail.model.thd_attention import thd_packed_seq_params

    params = thd_packed_seq_params(BOUNDS, "cpu")
    assert getattr(params.cu_seqlens_q, HOST_BOUNDS) == BOUNDS and params.cu_seqlens_kv is params.cu_seqlens_q
