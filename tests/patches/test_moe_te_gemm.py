"""`patches/moe_te_gemm.py` is needed on megatron-core 0.16.x without Transformer Engine: a MoE forward
raises NameError without it and runs with it; applying it twice changes nothing."""

import importlib.util

import pytest
import torch

from tests.harness import run_distributed
from tests.model.hf_models import causal_mask
from tests.model.hf_moe import make_hf_moe

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("transformer_engine") is not None,
    reason="with Transformer Engine megatron defines te_general_gemm itself; the shim is a no-op",
)


def _forward_with_and_without(rank, world, hf_dir):  # noqa: ARG001 - harness signature
    from megatron.core.transformer.moe import moe_utils

    from megatron_tail.model import build_gpt_model, load_hf_config
    from megatron_tail.patches import (
        apply_moe_te_gemm_shim,
        moe_te_gemm_shim_applied,
        remove_moe_te_gemm_shim,
    )
    from tests.model.hf_moe import init_megatron_ep

    init_megatron_ep()
    model = build_gpt_model(load_hf_config(hf_dir)).eval()  # applies the shim itself
    tokens = torch.zeros(1, 4, dtype=torch.long)

    def forward() -> str:
        try:
            with torch.no_grad():
                model(tokens, None, causal_mask(1, 4))
        except NameError as err:
            return f"NameError: {err}"
        return "ok"

    applied_by_build = moe_te_gemm_shim_applied()
    remove_moe_te_gemm_shim()
    without = forward()
    first, second = apply_moe_te_gemm_shim(), apply_moe_te_gemm_shim()
    return applied_by_build, without, forward(), first, second, moe_utils.te_general_gemm


def test_moe_forward_needs_the_te_general_gemm_shim(tmp_path):
    make_hf_moe(tmp_path, norm_topk_prob=True)
    applied_by_build, without, with_shim, first, second, bound = run_distributed(
        _forward_with_and_without, 1, str(tmp_path)
    )[0]
    assert applied_by_build
    assert without == "NameError: name 'te_general_gemm' is not defined"
    assert with_shim == "ok"
    assert first and second and bound is None
