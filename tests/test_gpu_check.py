"""`scripts/gpu_check.sh` on a CPU host: `--dry-run` exits 0, lists every gpu test (collected by pytest) and
the wheels, saying which the folder lacks; the gpu tests are skipped with a reason, and the results plugin
and table of the real run report them so. (The GPU run itself: docs/operations.md, "Checking a GPU node".)"""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
import zipfile
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


def _wheel(folder: Path, dist: str, version: str, requires: list[str]) -> Path:
    """A wheel file holding only its METADATA, with `requires` as Requires-Dist lines."""
    path = folder / f"{dist}-{version}-py3-none-any.whl"
    lines = [
        f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n",
        *(f"Requires-Dist: {r}\n" for r in requires),
    ]
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr(f"{dist}-{version}.dist-info/METADATA", "".join(lines))
    return path


@pytest.mark.parametrize("node_versions", ["the 2026-11-28 node", "an older node"])
def test_the_node_check_holds_the_carried_wheels_to_their_own_requirements(
    tmp_path, monkeypatch, capsys, node_versions
):
    """`--no-deps` installs a wheel as it is, so the check reads each one's Requires-Dist (datasets 5.2.0's
    own, from this environment's metadata) against the node and the other carried wheels: the H200 node of
    2026-11-28 (pyarrow 25.0.1, fsspec 2026.7.0, huggingface_hub 1.33.0) meets datasets'; one with an older
    pyarrow and huggingface_hub, and no pandas, is told so, by name, before anything runs."""
    versions = {"pyarrow": "25.0.1", "fsspec": "2026.7.0", "huggingface-hub": "1.33.0", "pandas": "2.2.3"}
    if node_versions == "an older node":
        versions = {"pyarrow": "19.0.1", "fsspec": "2026.7.0", "huggingface-hub": "0.35.3"}
    versions |= {
        "numpy": "2.1.0",
        "tqdm": "4.67.1",
        "pyyaml": "6.0.2",
        "filelock": "3.16.1",
        "packaging": "26.3",
    }
    monkeypatch.setattr(node, "installed", lambda dist: versions.get(dist.lower().replace("_", "-")))
    datasets = next(w for w in node.WHEELS if w.dist == "datasets")
    _wheel(tmp_path, "datasets", datasets.version, importlib.metadata.requires("datasets"))
    for wheel in node.WHEELS:
        if wheel.dist != "datasets":
            _wheel(tmp_path, wheel.dist, wheel.version, [])
    unmet = node.unmet_requirements(tmp_path)
    if node_versions == "the 2026-11-28 node":
        assert unmet == []
        return
    assert sorted(unmet) == [
        "  datasets==5.2.0 needs huggingface-hub<3.0,>=1.31.0; the node has 0.35.3",
        "  datasets==5.2.0 needs pandas; the node has none",
        "  datasets==5.2.0 needs pyarrow>=24.0.0; the node has 19.0.1",
    ]
    assert node.check(tmp_path) is False
    assert "what to do when the node's packages are older" in capsys.readouterr().out


def test_an_expected_failure_is_its_own_outcome_in_the_table():
    data = {
        "tests": [
            {"test": "tests/gpu/test_a.py::test_x", "outcome": "passed", "seconds": 1.0, "reason": "",
             "rows": []},
            {"test": "tests/gpu/test_a.py::test_y", "outcome": "xfailed", "seconds": 2.0,
             "reason": "known failure: issue 51: ...", "rows": []},
        ]
    }  # fmt: skip
    text, ok = render(data)
    assert ok and "1 passed, 1 xfailed" in text and "known failure: issue 51" in text


@pytest.mark.parametrize("flag", ["--wheels", "--limit-s", "--platform", "--python-version"])
def test_a_flag_without_its_value_is_one_line(flag):
    """Before: bash's "$2: unbound variable", exit 1."""
    proc = subprocess.run(
        ["bash", "scripts/gpu_check.sh", "--dry-run", flag],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and proc.stderr == f"gpu_check: {flag} needs a value (see --help)\n"


def test_the_gpu_session_script_runs_the_benches_and_the_check_with_flags_they_take(tmp_path):
    """`scripts/gpu_session.sh` is the one prepared command of a lent GPU's few minutes (issue 51): each part
    under 600 s in all, every bench command one its own parser takes (checked here with --help after it:
    argparse refuses a bad flag or choice before it gets there), the record into OUT (only OUT comes back)."""
    import re
    import shlex

    env = {**ENV, "OUT": str(tmp_path / "out")}
    benches = subprocess.run(
        ["bash", "scripts/gpu_session.sh", "benches", "--dry-run"], cwd=ROOT, env=env, capture_output=True,
        text=True, timeout=60,
    )  # fmt: skip
    assert benches.returncode == 0, benches.stderr
    steps = re.findall(r"^== (\w+) \(at most (\d+) s\): (.*)$", benches.stdout, re.MULTILINE)
    assert [name for name, _, _ in steps] == ["bench_op", "bench_step", "bench_step_fused"]
    assert sum(int(limit) for _, limit, _ in steps) < 600 - 30  # the prepare step's share
    record = f"--record {tmp_path / 'out' / 'measured_peaks.json'}"
    assert all(record in cmd for name, _, cmd in steps if name.startswith("bench_step"))
    assert "--fused-output-layer" in steps[2][2] and "--fused-output-layer" not in steps[1][2]
    for _, _, cmd in steps:
        argv = shlex.split(cmd)
        assert argv[1] == "-m" and argv[2].startswith("megatron_tail.bench.")
        parsed = subprocess.run(
            [sys.executable, *argv[1:], "--help"], cwd=ROOT, env=env, capture_output=True, text=True,
            timeout=300,
        )  # fmt: skip
        assert parsed.returncode == 0, (cmd, parsed.stderr[-2000:])
    check = subprocess.run(
        ["bash", "scripts/gpu_session.sh", "check", "--dry-run"], cwd=ROOT, env=env, capture_output=True,
        text=True, timeout=60,
    )  # fmt: skip
    assert check.stdout.startswith(
        "== gpu_check (at most 560 s): env MT_GPU_LIMIT_S=400 bash scripts/gpu_check.sh"
    )
    assert not (tmp_path / "out").exists()  # a dry run writes nothing
    refused = subprocess.run(
        ["bash", "scripts/gpu_session.sh"], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert refused.returncode == 2 and "benches or check" in refused.stderr
    # a mistyped --dry-run is refused, not a real run
    typo = subprocess.run(
        ["bash", "scripts/gpu_session.sh", "benches", "--dry-rum"], cwd=ROOT, env=env, capture_output=True,
        text=True,
    )  # fmt: skip
    assert typo.returncode == 2 and "unknown argument '--dry-rum' after 'benches'" in typo.stderr
    assert not typo.stdout and not (tmp_path / "out").exists()
