"""Bad input raises ValueError/TypeError naming the bad value."""

import math

import pytest
import torch

from megatron_tail.ops import vocab_parallel_masked_logprobs

LOGITS = torch.randn(3, 10)
TARGETS = torch.tensor([1, 2, 3])


@pytest.mark.parametrize(
    ("kwargs", "error", "pattern"),
    [
        ({"log_rho": 0.5}, ValueError, r"log_rho must be ≤ 0.*0\.5"),
        ({"log_rho": math.nan}, ValueError, r"log_rho.*nan"),
        ({"log_rho": "low"}, TypeError, r"log_rho.*'low'"),
        ({"temperature": 0.0}, ValueError, r"temperature.*> 0.*0\.0"),
        ({"temperature": -1.0}, ValueError, r"temperature.*-1\.0"),
        ({"temperature": math.inf}, ValueError, r"temperature.*inf"),
        # 1/T = inf in float32: before, every output NaN, no error
        (
            {"temperature": 1e-320},
            ValueError,
            r"temperature must be ≥ 2\.94e-39 \(1/T finite in float32\); got 1e-320",
        ),
        ({"vocab_size": 11}, ValueError, r"vocab_size must be an int in \[1, .*10\]; got 11"),
        ({"vocab_size": 0}, ValueError, r"vocab_size.*got 0"),
        ({"vocab_size": 9.5}, ValueError, r"vocab_size.*9\.5"),
    ],
)
def test_bad_arguments(kwargs, error, pattern):
    with pytest.raises(error, match=pattern):
        vocab_parallel_masked_logprobs(LOGITS, TARGETS, **kwargs)


def test_targets_out_of_range_name_the_value_and_index():
    with pytest.raises(ValueError, match=r"\[0, vocab_size=10\); got 10 at index \(2,\)"):
        vocab_parallel_masked_logprobs(LOGITS, torch.tensor([1, 2, 10]))
    with pytest.raises(ValueError, match=r"got -1 at index \(0,\)"):
        vocab_parallel_masked_logprobs(LOGITS, torch.tensor([-1, 2, 3]))
    with pytest.raises(ValueError, match=r"vocab_size=8\); got 9"):
        vocab_parallel_masked_logprobs(LOGITS, torch.tensor([1, 9, 3]), vocab_size=8)


def test_shape_mismatch():
    with pytest.raises(ValueError, match=r"logits \(3, 10\) and targets \(4,\)"):
        vocab_parallel_masked_logprobs(LOGITS, torch.tensor([1, 2, 3, 4]))


def test_integer_logits_and_float_targets_are_type_errors():
    with pytest.raises(TypeError, match=r"logits must be a floating-point tensor.*torch.int64"):
        vocab_parallel_masked_logprobs(torch.ones(3, 10, dtype=torch.long), TARGETS)
    with pytest.raises(TypeError, match=r"targets must be an integer tensor.*torch.float32"):
        vocab_parallel_masked_logprobs(LOGITS, TARGETS.float())
    with pytest.raises(TypeError, match=r"targets.*torch.bool"):
        vocab_parallel_masked_logprobs(LOGITS, torch.tensor([True, False, True]))


def test_no_pruning_spellings_are_equivalent():
    a = vocab_parallel_masked_logprobs(LOGITS, TARGETS, log_rho=None)
    b = vocab_parallel_masked_logprobs(LOGITS, TARGETS, log_rho=-math.inf)
    assert torch.equal(a.logprobs, b.logprobs) and a.in_safe_set.all() and (a.safe_mass == 1).all()
