"""The CPU half of the local engine's GPU check (`tests/gpu/test_local_engine_cuda.py`): the same case
(`check_engine_logprobs`) with the engine on the CPU, for each of its temperatures."""

from __future__ import annotations

import pytest

from tests.gpu.test_local_engine_cuda import TEMPERATURES, check_engine_logprobs, engine_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return engine_model(tmp_path_factory)


@pytest.mark.parametrize("temperature", TEMPERATURES)
def test_the_engine_returns_the_trainer_ops_logprobs_on_the_cpu(model_dir, temperature):
    check_engine_logprobs(model_dir, "cpu", temperature)
