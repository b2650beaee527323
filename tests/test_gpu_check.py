"""`scripts/gpu_check.sh` on a CPU host: `--dry-run` exits 0, lists every gpu test (collected by pytest) and
the wheels, saying which the folder lacks; the gpu tests are skipped with a reason, and the results plugin
and table of the real run report them so. (The GPU run itself: README, "Checking a GPU node".)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.gpu import node
from tests.gpu.table import render

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "MT_PYTHON": sys.executable, "HF_HUB_OFFLINE": "1", "PYTHONWARNINGS": "ignore"}


@pytest.fixture(scope="module")
def gpu_test_ids(tmp_path_factory) -> tuple[list[str], dict | None]:
    """The gpu tests' ids, and (on a host without CUDA) the results JSON of running them: all skipped.
    One pytest process serves both tests below (each costs a torch import)."""
    if torch.cuda.is_available():
        done = subprocess.run(
            [sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "gpu", "tests/gpu",
             "-p", "no:cacheprovider"],
            cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        return [line for line in done.stdout.splitlines() if "::" in line], None
    results = tmp_path_factory.mktemp("gpu_results") / "results.json"
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "tests/gpu", "-p", "tests.gpu.results_plugin",
         "-p", "no:cacheprovider"],
        cwd=ROOT, env={**ENV, "MT_GPU_RESULTS": str(results)}, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:]
    data = json.loads(results.read_text())
    return [t["test"] for t in data["tests"]], data


def test_dry_run_lists_the_gpu_tests_and_the_wheels_and_exits_0(tmp_path, gpu_test_ids):
    (tmp_path / "dill-0.4.1-py3-none-any.whl").write_bytes(b"")
    done = subprocess.run(
        ["bash", "scripts/gpu_check.sh", "--dry-run", "--wheels", str(tmp_path)],
        cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    ids = gpu_test_ids[0]
    assert len(ids) >= 10 and all(i.startswith("tests/gpu/test_") for i in ids)
    for test_id in ids:
        assert f"  {test_id}\n" in out, test_id
    for wheel in node.WHEELS:
        assert wheel.spec in out
    assert "dill==0.4.1" in out and "in the folder" in out
    assert "Transformer Engine" in out and "SGLang" in out and "NCCL" in out


def test_the_node_check_names_the_wheels_missing_from_the_folder(tmp_path, monkeypatch, capsys):
    """On a node without any of them: every wheel is needed; one in the folder is found, the rest MISSING."""
    monkeypatch.setattr(node, "installed", lambda _dist: None)
    (tmp_path / "dill-0.4.1-py3-none-any.whl").write_bytes(b"")
    (tmp_path / "dill-0.3.0-py3-none-any.whl").write_bytes(b"")  # another version: not it
    assert [w.dist for w, _ in node.needed()] == [w.dist for w in node.WHEELS]
    assert node.find_wheel(tmp_path, node.WHEELS[2]).name == "dill-0.4.1-py3-none-any.whl"
    assert node.check(tmp_path) is False
    out = capsys.readouterr().out
    assert "needed: from dill-0.4.1-py3-none-any.whl" in out
    assert out.count("MISSING from the folder") == len(node.WHEELS) - 1
    assert all(w.spec in out for w in node.WHEELS)
    with pytest.raises(SystemExit, match=r"wheels missing from .*megatron-core==0\.16\.1"):
        node.install(tmp_path, tmp_path / "site")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the skips of a host without CUDA")
def test_gpu_tests_are_skipped_with_a_reason_and_the_table_says_so(gpu_test_ids):
    ids, data = gpu_test_ids
    assert len(data["tests"]) == len(ids) >= 10
    for t in data["tests"]:
        assert t["outcome"] == "skipped" and t["reason"].startswith("needs a CUDA GPU; this host has none"), t
    text, ok = render(data)
    assert ok and f"{len(ids)} skipped" in text and "needs a CUDA GPU" in text
