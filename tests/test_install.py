"""The install resolves: each constraints file holds the pins its environment must have, read from the
pinned SGLang wheel's own metadata (installed in .venv with --no-deps) and from pyproject.toml."""

from __future__ import annotations

import importlib.metadata as metadata
import re
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]


def pins(path: Path) -> dict[str, str]:
    """name → version of every `name==version` line (comments and blank lines skipped)."""
    out = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            req = Requirement(line)
            (spec,) = req.specifier
            assert spec.operator == "==", f"{path.name}: {line!r} is not an exact pin"
            out[_norm(req.name)] = spec.version
    return out


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def sglang_exact_pins() -> dict[str, str]:
    """The exact pins of the installed sglang wheel's unconditional requirements."""
    try:
        requires = metadata.requires("sglang") or []
    except metadata.PackageNotFoundError:
        pytest.skip("sglang is not installed (make install puts sglang==0.5.23 in .venv with --no-deps)")
    out = {}
    for raw in requires:
        req = Requirement(raw)
        if req.marker is not None and "extra" in str(req.marker):
            continue
        specs = list(req.specifier)
        if len(specs) == 1 and specs[0].operator == "==":
            out[_norm(req.name)] = specs[0].version
    return out


def test_sglang_constraints_hold_the_wheels_own_pins():
    sglang = pins(ROOT / "constraints-sglang.txt")
    assert sglang["sglang"] == metadata.version("sglang") == "0.5.23"
    wheel = sglang_exact_pins()
    for name in ("torch", "transformers"):
        assert name in sglang, f"constraints-sglang.txt must pin {name} (sglang pins {name}=={wheel[name]})"
    for name, version in sglang.items():
        if name in wheel:
            assert version == wheel[name], (
                f"constraints-sglang.txt pins {name}=={version}, sglang {wheel[name]}"
            )


def test_the_router_policies_the_config_accepts_are_those_of_the_pinned_router():
    """`ROUTER_POLICIES` were read from sglang-router 0.3.2's `--policy` choices: a new pin, a new read."""
    from megatron_tail.config.cluster import ROUTER_POLICIES, ROUTER_VERSION

    assert pins(ROOT / "constraints-sglang.txt")["sglang-router"] == ROUTER_VERSION
    assert "cache_aware" in ROUTER_POLICIES  # the default of `cluster.sglang.router_policy`


def test_trainer_constraints_agree_and_need_their_own_environment():
    cpu, gpu = pins(ROOT / "constraints.txt"), pins(ROOT / "constraints-gpu.txt")
    assert cpu["torch"] == gpu["torch"] and cpu["megatron-core"] == gpu["megatron-core"]
    assert cpu["triton"] == gpu["triton"] == "3.7.1"  # torch 2.13.0's CUDA wheel: Requires-Dist triton==3.7.1
    assert metadata.version("triton") == cpu["triton"]  # the kernels' CPU tests run this Triton's interpreter
    assert metadata.version("torch").split("+")[0] == cpu["torch"]
    assert metadata.version("megatron-core") == cpu["megatron-core"]
    assert cpu["transformers"] == gpu["transformers"] == metadata.version("transformers")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    core = next(Requirement(r) for r in project["dependencies"] if r.startswith("megatron-core"))
    assert core.specifier.contains(cpu["megatron-core"])
    # the reason for two environments: SGLang's torch is not the trainer's
    assert sglang_exact_pins()["torch"] != cpu["torch"]


def test_the_liger_kernel_the_cpu_tests_run_is_the_one_a_gpu_node_gets():
    """The bench's Liger rows run on CPU (Triton's interpreter) with the wheel the GPU check carries."""
    from tests.gpu import node

    (carried,) = (w for w in node.WHEELS if w.dist == "liger-kernel")
    pinned = pins(ROOT / "constraints.txt")["liger-kernel"]
    assert pinned == carried.version == metadata.version("liger-kernel")


def test_extras_resolve():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert not any(Requirement(r).name == "apex" for r in extras["gpu"]), "PyPI's apex is not NVIDIA apex"
    (sglang,) = (Requirement(r) for r in extras["sglang"])
    assert str(sglang.specifier) == "==" + pins(ROOT / "constraints-sglang.txt")["sglang"]


def test_setup_script_builds_both_environments_with_their_constraints():
    script = (ROOT / "scripts" / "setup_envs.sh").read_text()
    assert "-c constraints-gpu.txt" in script and "-c constraints-sglang.txt" in script
    assert "cluster-envs:" in (ROOT / "Makefile").read_text()
    sbatch = (ROOT / "slurm" / "rl.sbatch").read_text()
    assert ".venv-sglang/bin/python" in sbatch and "MT_SGLANG_PYTHON" in sbatch
