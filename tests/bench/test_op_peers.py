"""The CPU half of the op's peer table (`bench.op_peers`, what `bench.op --device cuda` and the GPU check
print): the same variants on a tiny shape, the Triton rows under Triton's interpreter. It checks the code
path and the table's arithmetic (ratios to the baseline row, bandwidth shares from the bytes each pass must
move), not speed."""

from __future__ import annotations

import sys
from collections.abc import Callable

import pytest
import torch

from megatron_tail.bench.op_peers import format_rows, measure, peer_rows
from tests.triton_interpreter import UNDER_INTERPRETER

pytestmark = UNDER_INTERPRETER


def test_the_peer_table_runs_every_variant_and_relates_it_to_the_baseline():
    rows = peer_rows(6, 256, device="cpu", repeats=1, megatron=False)
    names = [r["what"] for r in rows]
    assert names[:4] == [
        "op, Triton, DVP + entropy, in place, fwd+bwd",
        "op, PyTorch, DVP + entropy, in place, fwd+bwd",
        "op, Triton, forward only",
        "op, PyTorch, forward only",
    ]
    # Liger-Kernel is a test dependency: its cross entropy runs here under Triton's interpreter, the baseline
    (baseline,) = (r for r in rows if r["what"].startswith("Liger"))
    for r in rows:
        assert r["ms"] > 0 and r["baseline"] == baseline["what"]
        assert r["ratio"] == pytest.approx(r["ms"] / baseline["ms"])
        assert (r["bandwidth"] is None) == (not r["what"].startswith("op,"))  # ours only: we count its passes
    assert rows[0]["bandwidth"] > 0
    text = format_rows(rows, 6, 256, "cpu")
    assert text.splitlines()[0] == "The op against its peers: 6 × 256 bf16 logits on cpu"
    assert f"baseline: {baseline['what']}" in text


def test_without_liger_the_baseline_is_torchs_cross_entropy(monkeypatch):
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers", None)  # its import raises ImportError
    rows = peer_rows(4, 64, device="cpu", repeats=1, megatron=False)
    (liger,) = (r for r in rows if r["what"].startswith("Liger"))
    assert liger["ms"] is None and liger["note"] == "not installed"
    assert all(r["baseline"] == "torch cross_entropy, fwd+bwd" for r in rows)
    assert "| Liger-Kernel CE, fwd+bwd (gradient in place) | — | — | — | not installed |" in format_rows(
        rows, 4, 64, "cpu"
    )


def _recorded_calls() -> tuple[list[torch.Tensor], Callable[[], torch.Tensor]]:
    """A run that returns a new 1 KiB tensor per call, and the list of what it returned."""
    calls: list[torch.Tensor] = []

    def run() -> torch.Tensor:
        calls.append(torch.full((256,), float(len(calls))))
        return calls[-1]

    return calls, run


def test_measure_keeps_the_last_calls_result_only_when_asked():
    calls, run = _recorded_calls()
    kept = measure(run, repeats=2, keep_result=True)
    assert len(calls) == 3 and kept["result"] is calls[-1]  # the counted call, then 2 timed ones
    assert kept["peak_bytes"] == 256 * 4  # the counted call's tensor, not one held from another call
    assert "result" not in measure(run, repeats=1)


def test_measure_with_no_repeats_off_cuda_is_the_counted_call_alone():
    calls, run = _recorded_calls()
    only = measure(run, repeats=0, keep_result=True)
    assert len(calls) == 1 and only["result"] is calls[0]
    assert only["peak_bytes"] == 256 * 4 and only["ms"] > 0
    with pytest.raises(ValueError, match=r"repeats ≥ 1 on CUDA \(≥ 0 elsewhere"):
        measure(run, repeats=-1)
    assert len(calls) == 1
