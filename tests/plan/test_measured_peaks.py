"""The planner against every peak a GPU measured (`megatron_tail/plan/measured_peaks.json`, appended by
`bench.step --record`), on every commit: `megatron-tail plan`'s trainer total less its reserve, for each
entry's config, within 5% of each steady-state peak (what a run's GPU holds from its second step on); and
that total less the optimizer's moments within 5% of each cold peak (a first step's: Adam's m and v are
allocated by its `optimizer.step()`, after the step's activation peak, so that peak never holds them).

An entry the planner is known to miss names its issue in `planner_misses`: a strict xfail, so the day the
plan meets it the test fails and the note goes. Nothing here needs a GPU or megatron: the plan reads the
entry's `config.json` fields alone."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from megatron_tail.bench.step import PROMPT_TOKENS, SAMPLES, predicted_bytes, run_config, write_config
from megatron_tail.bench.step_report import ENTRY_FIELDS, MEASURED_PEAKS, dumps_entries

TOLERANCE = 0.05
"""|measured / planned − 1| at most this: over it a plan lets a job OOM, under it a plan wastes GPUs."""
DATA = json.loads(MEASURED_PEAKS.read_text())


def _id(e: dict) -> str:
    fused = "-fused" if e["fused_output_layer"] else ""
    return f"{e['date']}-{e['shape']}-{e['recompute']}-{e['op_backend']}{fused}-{e['state']}"


def _cases() -> list:
    cases = []
    for e in DATA["entries"]:
        miss = e.get("planner_misses")
        marks = [pytest.mark.xfail(strict=True, reason=miss)] if miss else []
        cases.append(pytest.param(e, id=_id(e), marks=marks))
    return cases


def planned(entry: dict, root: Path) -> tuple[int, int]:
    """(the plan's trainer total less its reserve, its optimizer moments) for `entry`'s config, as
    `bench.step` builds it (the sample layout is not in the plan's terms, only the micro-batch's tokens:
    an entry that did not record it takes bench.step's)."""
    model_dir = write_config(root / "model", entry["model"], max_positions=max(4096, entry["tokens"]))
    cfg = run_config(
        model_dir, entry["tokens"], "cuda", entry["recompute"], samples=entry["samples"] or SAMPLES,
        prompt_tokens=entry["prompt_tokens"] or PROMPT_TOKENS, fused_output_layer=entry["fused_output_layer"],
        op_backend=entry["op_backend"],
    )  # fmt: skip
    predicted, _terms, moments = predicted_bytes(cfg, gpu_memory_gib=141.0)
    return predicted, moments


def test_the_file_holds_gpu_measurements_in_the_format_bench_step_appends():
    assert DATA["entries"], "no measurement recorded"
    for e in DATA["entries"]:
        assert set(ENTRY_FIELDS) <= e.keys(), (_id(e), set(ENTRY_FIELDS) - e.keys())
        assert e["state"] in ("cold", "steady") and e["gpu"] != "cpu", _id(e)
        assert isinstance(e["peak_bytes"], int) and e["peak_bytes"] > 0, _id(e)
    assert dumps_entries(DATA) == MEASURED_PEAKS.read_text()  # an append leaves the other lines alone


@pytest.mark.parametrize("entry", _cases())
def test_the_plan_holds_for_a_measured_peak(entry, tmp_path):
    predicted, moments = planned(entry, tmp_path)
    expected = predicted if entry["state"] == "steady" else predicted - moments
    ratio = entry["peak_bytes"] / expected
    gib = 1 << 30
    measured = entry["peak_bytes"] / gib
    print(f"{_id(entry)}: {measured:.2f} GiB measured / {expected / gib:.2f} planned = {ratio:.3f}")
    assert abs(ratio - 1) <= TOLERANCE, (ratio, entry["peak_bytes"] / gib, expected / gib)


def test_a_record_names_the_commit_it_ran(tmp_path, tmp_path_factory, monkeypatch):
    """A lent GPU's copy of the tree sat on an older git HEAD than its files (2026-12-01: two peaks of
    98ed5a5 recorded as df0017b's). `MT_COMMIT` names the commit; without it a tree that differs from its
    HEAD says so."""
    from megatron_tail.bench.step_report import _commit

    def git(*args):
        subprocess.run(["git", *args], cwd=tmp_path, check=True, capture_output=True)

    monkeypatch.delenv("MT_COMMIT", raising=False)
    git("init", "-q")
    (tmp_path / "f.txt").write_text("a\n")
    git("add", "f.txt")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "one")
    head = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=tmp_path, capture_output=True, text=True, check=True
    ).stdout.strip()
    assert _commit(tmp_path) == head
    (tmp_path / "f.txt").write_text("b\n")
    assert _commit(tmp_path) == f"{head}+uncommitted"
    monkeypatch.setenv("MT_COMMIT", "98ed5a5")
    assert _commit(tmp_path) == "98ed5a5"
    monkeypatch.delenv("MT_COMMIT")
    assert _commit(tmp_path_factory.mktemp("not-a-repo")) is None
