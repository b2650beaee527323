"""`train.run.rank_weights.RankWeights` on rank 0 when the in-memory stream fails: a failure of rank 0's own
gather raises at once (the other ranks' gathers fail with it), as an export's does; a failure of the engines'
side drains the gather and announces it. Before, a gather that raised inside the stream left rank 0 draining
a dead generator and announcing the failure in a barrier while the other ranks sat in the gather it had
left, until a collective's timeout (tens of minutes), and the user then read a timeout, not the OOM."""

from __future__ import annotations

import pytest
import torch

from megatron_tail.train.run import rank_weights
from megatron_tail.train.run.rank_weights import STREAM_FAILED, TENSORS, RankWeights


class TwoTensors(RankWeights):
    """A stand-in gather: one tensor, then `fail` (None: a second tensor)."""

    def __init__(self, fail: Exception | None):
        super().__init__(trainer=None, hf_path="", wait_group=None)
        self.fail = fail

    def _gathered(self):
        yield "w0", torch.zeros(2)
        if self.fail is not None:
            raise self.fail
        yield "w1", torch.zeros(2)


@pytest.fixture
def announced(monkeypatch):
    said = []
    monkeypatch.setattr(rank_weights, "on_rank0", lambda fn, **_k: said.append(fn()) or fn())
    return said


def test_a_gather_failing_on_rank_0_raises_there_at_once(announced):
    weights = TwoTensors(RuntimeError("CUDA out of memory"))
    stream = weights.tensors()
    assert next(stream)[0] == "w0"
    with pytest.raises(RuntimeError, match="CUDA out of memory") as raised:
        next(stream)
    with pytest.raises(RuntimeError, match="CUDA out of memory"):
        weights.finish(None, raised.value, version=3)
    assert announced == [(TENSORS, None)]  # no STREAM_FAILED barrier the other ranks never reach


def test_an_engine_failing_mid_stream_drains_the_gather_and_announces_it(announced, monkeypatch):
    from megatron_tail.rollout.weight_sync import WeightSyncError

    monkeypatch.setattr(rank_weights, "_sync_failure", lambda error, _version: error)
    weights = TwoTensors(None)
    stream = weights.tensors()
    assert next(stream)[0] == "w0"  # the engines stop taking tensors here
    failure = WeightSyncError("http://a:1/update_weights_from_distributed: timed out")
    with pytest.raises(WeightSyncError, match="timed out"):
        weights.finish(None, failure, version=3)
    assert announced == [(TENSORS, None), (STREAM_FAILED, None)]
    assert next(stream, None) is None  # drained: the other ranks' gathers ran to their end
