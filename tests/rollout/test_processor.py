"""The DVP processor on its own: the shared safe-set rule per row, SGLang's wire format, clear errors."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_tail.ops import safe_mask
from megatron_tail.rollout.processor import DVPLogitProcessor, dvp_custom_params, load_custom_logit_processor


def test_rows_with_different_settings_each_get_their_own_safe_set():
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0)) * 5
    settings = [(-13.0, 1.0), (-2.0, 1.0), (-2.0, 0.5), (None, 1.0), (-2.0, 1.0), (-5.0, 2.0)]
    params = [dvp_custom_params(lr, t) for lr, t in settings]
    out = DVPLogitProcessor()(logits.clone(), params)
    for row, (log_rho, temperature) in enumerate(settings):
        keep = safe_mask(logits[row], log_rho, temperature)
        assert torch.equal(out[row][keep], logits[row][keep])
        assert bool(torch.isneginf(out[row][~keep]).all())
        # Independent of safe_vocab: the rule written out, z ≥ max z + T·log ρ.
        if log_rho is not None:
            expected = logits[row] >= logits[row].max() + temperature * log_rho
            assert torch.equal(keep, expected)
    assert int((~safe_mask(logits[1], -2.0, 1.0)).sum()) > 10


def test_wire_format_is_sglangs_and_loads_with_sglangs_from_str():
    serialized = DVPLogitProcessor.to_str()
    assert isinstance(load_custom_logit_processor(serialized), DVPLogitProcessor)
    sglang_clp = pytest.importorskip(
        "sglang.srt.sampling.custom_logit_processor",
        reason="sglang (sglang-cpu extra) checks its own from_str",
    )
    assert isinstance(sglang_clp.CustomLogitProcessor.from_str(serialized), DVPLogitProcessor)


def test_greedy_is_scored_at_temperature_one():
    assert dvp_custom_params(-13.0, 0.0) == {"log_rho": -13.0, "temperature": 1.0}
    assert dvp_custom_params(-math.inf, 0.7) == {"log_rho": None, "temperature": 0.7}


@pytest.mark.parametrize(
    ("params", "error", "message"),
    [
        ([None], ValueError, r"needs sampling_params.custom_params = \{'log_rho'"),
        ([{"temperature": 1.0}], ValueError, "needs sampling_params.custom_params"),
        ([{"log_rho": 0.5, "temperature": 1.0}], ValueError, "log_rho must be ≤ 0"),
        ([{"log_rho": "-13", "temperature": 1.0}], TypeError, "log_rho must be a float"),
        ([{"log_rho": -13.0, "temperature": 0.0}], ValueError, "temperature must be finite and > 0"),
        ([{"log_rho": -13.0}], ValueError, "has no 'temperature'"),
        (
            [{"log_rho": -13.0, "temperature": 1.0}] * 2,
            ValueError,
            "one custom_params dict per row: 1 rows, got 2",
        ),
    ],
)
def test_bad_custom_params_raise_clear_errors(params, error, message):
    with pytest.raises(error, match=message):
        DVPLogitProcessor()(torch.zeros(1, 8), params)


def test_unloadable_processor_string_is_a_clear_error():
    with pytest.raises(ValueError, match=r"must be the string CustomLogitProcessor\.to_str"):
        load_custom_logit_processor('{"callable": "zz"}')
