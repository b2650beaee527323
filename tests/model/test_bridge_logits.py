"""Megatron logits of HF-loaded weights equal the HF model's logits (fp32, rel ≤ 1e-4)."""

from __future__ import annotations

import pytest
import torch

from tests.harness import run_distributed
from tests.model.hf_models import LLAMA31_ROPE, hf_logits, make_hf_model, megatron_logits_rank

REL_TOL = 1e-4


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def test_llama31_rope_scaling_logits_equal_hf(tmp_path):
    """Scaling on vs off changes these logits by ≈ 2e-3 (rel), 20× the tolerance."""
    hf = make_hf_model("llama", tmp_path, rope_parameters=LLAMA31_ROPE, max_position_embeddings=16384)
    tokens = torch.randint(0, 200, (1, 16), generator=torch.Generator().manual_seed(2))
    got = run_distributed(megatron_logits_rank, 1, str(tmp_path), 1, tokens)[0]
    assert _rel_err(got, hf_logits(hf, tokens)) <= REL_TOL


@pytest.mark.parametrize(
    ("family", "tie", "tp"),
    [
        ("qwen3", False, 1),
        ("qwen3", False, 2),
        ("qwen3", True, 2),
        ("qwen2", False, 1),
        ("qwen2", False, 2),
        ("llama", True, 2),
    ],
)
def test_megatron_logits_equal_hf(tmp_path, family, tie, tp):
    hf = make_hf_model(family, tmp_path, tie=tie)
    tokens = torch.randint(0, 200, (2, 12), generator=torch.Generator().manual_seed(1))
    expected = hf_logits(hf, tokens)
    got = run_distributed(megatron_logits_rank, tp, str(tmp_path), tp, tokens)
    for rank_logits in got:
        assert rank_logits.shape == expected.shape
        assert _rel_err(rank_logits, expected) <= REL_TOL
