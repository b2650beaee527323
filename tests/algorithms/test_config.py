import dataclasses
import inspect
import math
import re
import sys

import pytest

from megatron_tail.algorithms.config import AlgorithmConfig


def test_defaults_come_from_the_papers():
    cfg = AlgorithmConfig()
    assert cfg.log_rho == -13.0  # DVP
    assert cfg.veto_threshold == 1e-4  # DVP
    assert cfg.stapo_tau_p == 0.01  # STAPO
    assert cfg.ar_alpha == 0.3  # AR
    assert cfg.lopti_eta == 0.5  # Lopti
    assert cfg.lopti_reverse is False
    assert cfg.num_phases == 1
    assert AlgorithmConfig(lopti=True).num_phases == 2
    assert cfg.sampling_support == "replay"  # the ablation switches default to today's behaviour
    assert cfg.old_logprobs == "recompute"


def test_every_field_has_a_doc_line():
    source = inspect.getsource(sys.modules[AlgorithmConfig.__module__])
    for f in dataclasses.fields(AlgorithmConfig):
        assert re.search(rf"\n    {f.name}: [^\n]+\n    \"\"\"", source), f"field {f.name} has no doc line"


def test_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        AlgorithmConfig().kl_coef = 1.0


BAD = [
    ("advantage_estimator", "ppo"),
    ("group_size", 0),
    ("group_size", 1),
    ("group_size", 2.0),
    ("group_size", True),
    ("scale_advantages_by_std", 1),
    ("advantage_eps", -1e-6),
    ("advantage_eps", 0.0),  # rounding noise (0.1 + 0.2 against 0.3) would become ±0.71 advantages
    ("log_rho", 1.0),
    ("log_rho", math.nan),
    ("is_mode", "foo"),
    ("is_level", "seq"),
    ("tis_cap", 0.5),
    ("mis_low", -0.1),
    ("mis_low", 1.5),
    ("mis_high", 0.5),
    ("veto_threshold", 1.0),
    ("veto_threshold", -1e-4),
    ("veto_threshold", math.inf),
    ("stapo", "yes"),
    ("stapo_tau_p", 0.0),
    ("stapo_tau_p", 1.01),
    ("stapo_tau_h", -0.5),
    ("stapo_tau_h_quantile", 1.5),
    ("ar_alpha", -0.1),
    ("ar_alpha", 1.1),
    ("lopti_eta", 0.0),
    ("lopti_eta", 1.5),
    ("clip_eps_low", 1.0),
    ("clip_eps_low", -0.2),
    ("clip_eps_high", -0.1),
    ("dual_clip", 1.0),
    ("kl_coef", -0.01),
    ("kl_coef", "0.1"),
    ("kl_estimator", "k2"),
    ("loss_aggregation", "sum"),
    ("loss_max_len", 0),
    ("sampling_support", "full"),
    ("old_logprobs", "rollout"),
]


@pytest.mark.parametrize(("field", "value"), BAD, ids=[f"{f}={v!r}" for f, v in BAD])
def test_bad_values_raise_naming_field_and_value(field, value):
    with pytest.raises(ValueError) as err:
        AlgorithmConfig(**{field: value})
    msg = str(err.value)
    assert f"algorithm.{field}" in msg
    assert f"got {value!r}" in msg


def test_mis_bounds_must_be_ordered():
    with pytest.raises(ValueError, match=r"algorithm.mis_low must be < mis_high"):
        AlgorithmConfig(mis_low=1.0, mis_high=1.0)


def test_seq_mean_token_sum_needs_max_len():
    with pytest.raises(ValueError, match=r"algorithm.loss_max_len is required .*got None"):
        AlgorithmConfig(loss_aggregation="seq_mean_token_sum")
    assert AlgorithmConfig(loss_aggregation="seq_mean_token_sum", loss_max_len=4096).loss_max_len == 4096


def test_optional_fields_accept_none():
    cfg = AlgorithmConfig(log_rho=None, stapo_tau_h=None, dual_clip=None, loss_max_len=None)
    assert cfg.log_rho is None
    assert AlgorithmConfig(log_rho=-math.inf).log_rho == -math.inf
    assert AlgorithmConfig(dual_clip=3.0, stapo_tau_h=0.5).dual_clip == 3.0
