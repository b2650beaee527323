"""Megatron logits of HF-loaded weights equal the HF model's logits (fp32, rel ≤ 1e-4)."""

from __future__ import annotations

import pytest
import torch

from tests.harness import run_distributed
from tests.model.hf_models import hf_logits, make_hf_model, megatron_logits_rank

REL_TOL = 1e-4


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


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
