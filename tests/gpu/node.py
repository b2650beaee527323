"""What `scripts/gpu_check.sh` needs on a GPU node, and what it brings as wheels.

    python tests/gpu/node.py check WHEELS_DIR        # a line per requirement; exit 1 if one is not met
    python tests/gpu/node.py install WHEELS_DIR DIR  # the needed wheels into DIR, --no-index --no-deps
    python tests/gpu/node.py download WHEELS_DIR [--python-version 3.12]  # where the registry is reachable

Expected on the node (not installed by us: they decide the CUDA stack): Python ≥ 3.11, PyTorch ≥ 2.11 built
with CUDA (any CUDA 12/13 build), transformers, safetensors, tensorboard (and what they pull in: numpy,
pyyaml, tqdm). Everything else the GPU tests import travels as a wheel in WHEELS_DIR and is installed with
`pip install --no-index --no-deps` into a folder of the checkout that goes on PYTHONPATH, only where the
node lacks it: nothing is resolved, nothing reaches the network, nothing of the node's environment changes.
Stdlib only (plus pip's vendored `packaging` for wheel tags), so it runs before anything is installed.
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

MIN_TORCH = (2, 11)
MIN_PYTHON = (3, 11)
PLATFORM = "manylinux_2_28_x86_64"
"""The platform `download` fetches binary wheels for (megatron-core 0.16.1 and psutil ship manylinux_2_28
x86_64 wheels; an aarch64 node needs `--platform manylinux_2_28_aarch64`)."""


@dataclass(frozen=True)
class Wheel:
    """One wheel: `dist` at `version`, needed unless the node has `dist` satisfying `ok_if_present`."""

    dist: str
    version: str
    why: str
    ok_if_present: str = "any"
    """"any": any installed version will do; "exact": only `version`; ">=X.Y": at least that."""
    with_pytest: bool = False
    """Needed only where pytest itself is missing (pytest's own dependencies)."""

    @property
    def spec(self) -> str:
        return f"{self.dist}=={self.version}"


WHEELS = (
    Wheel("megatron-core", "0.16.1", "the trainer (patches are pinned to 0.16.x)", "exact"),
    Wheel("psutil", "7.2.2", "megatron's dist_checkpointing imports it without declaring it"),
    Wheel("dill", "0.4.1", "the DVP logit processor is serialized with dill (local engine test)"),
    Wheel("packaging", "26.3", "megatron-core needs packaging>=24.2", ">=24.2"),
    Wheel("pytest", "9.2.0", "runs the tests", ">=8"),
    Wheel("liger-kernel", "0.8.5", "Liger's cross entropy: the op's speed baseline (needs torch, triton)"),
    Wheel("pluggy", "1.7.0", "pytest's dependency", ">=1.6", with_pytest=True),
    Wheel("iniconfig", "2.3.1", "pytest's dependency", "any", with_pytest=True),
    Wheel("pygments", "2.21.0", "pytest's dependency", ">=2.15", with_pytest=True),
)
NODE_PACKAGES = ("torch", "transformers", "safetensors", "tensorboard", "numpy", "pyyaml", "tqdm")


def _version_tuple(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", text.split("+")[0])[:3])


def installed(dist: str) -> str | None:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


def satisfied(wheel: Wheel, version: str | None) -> bool:
    if version is None:
        return False
    if wheel.ok_if_present == "any":
        return True
    if wheel.ok_if_present == "exact":
        return version == wheel.version
    return _version_tuple(version) >= _version_tuple(wheel.ok_if_present.removeprefix(">="))


def needed() -> list[tuple[Wheel, str | None]]:
    """(wheel, the node's version or None) of every wheel the node needs."""
    have_pytest = satisfied(WHEELS[4], installed("pytest"))
    out = []
    for wheel in WHEELS:
        if wheel.with_pytest and have_pytest:
            continue
        version = installed(wheel.dist)
        if not satisfied(wheel, version):
            out.append((wheel, version))
    return out


def _normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


def find_wheel(folder: Path, wheel: Wheel) -> Path | None:
    """A file in `folder` that is `wheel` and installs on this interpreter (by pip's own tag rules)."""
    installable = _tag_checker()
    for path in sorted(folder.glob("*.whl")) if folder.is_dir() else []:
        parts = path.name.split("-")
        if len(parts) < 5 or _normalized(parts[0]) != _normalized(wheel.dist) or parts[1] != wheel.version:
            continue
        if installable(path.name):
            return path
    return None


def _tag_checker():
    """name → whether a wheel of that file name installs here (pip's vendored packaging; without pip, any)."""
    try:
        from pip._vendor.packaging.tags import sys_tags
        from pip._vendor.packaging.utils import parse_wheel_filename
    except ImportError:
        return lambda name: True  # noqa: ARG005
    supported = set(sys_tags())
    return lambda name: any(tag in supported for tag in parse_wheel_filename(name)[3])


def node_report() -> tuple[list[str], bool]:
    """Lines about the interpreter, torch/CUDA and the node packages; whether the GPU run can go ahead."""
    lines, ok = [], True
    py = sys.version_info[:2]
    good = py >= MIN_PYTHON
    ok &= good
    lines.append(f"  python {sys.version.split()[0]} ({sys.executable}){'' if good else '  ← need ≥ 3.11'}")
    try:
        import torch

        cuda = torch.version.cuda
        count = torch.cuda.device_count() if cuda else 0
        name = torch.cuda.get_device_name(0) if count else "no CUDA device visible"
        good = _version_tuple(torch.__version__) >= MIN_TORCH and bool(cuda) and count > 0
        lines.append(
            f"  torch {torch.__version__}, CUDA {cuda or 'none (CPU build)'}, {count} GPU(s): {name}"
            + ("" if good else "  ← need torch ≥ 2.11 built with CUDA and a visible GPU")
        )
    except ImportError:
        good = False
        lines.append("  torch: not installed  ← the node must bring PyTorch ≥ 2.11 with CUDA")
    ok &= good
    for dist in NODE_PACKAGES[1:]:
        version = installed(dist)
        ok &= version is not None
        lines.append(f"  {dist} {version or 'MISSING  ← the node must bring it'}")
    return lines, ok


def check(folder: Path) -> bool:
    """Print what the node has and which wheels it needs (found in `folder` or MISSING); True if complete."""
    lines, node_ok = node_report()
    print("Node:")
    print("\n".join(lines))
    print(
        f"Wheels (installed with pip install --no-index --no-deps from {folder}, where the node lacks them):"
    )
    complete = True
    need = {w.dist for w, _ in needed()}
    for wheel in WHEELS:
        version = installed(wheel.dist)
        found = find_wheel(folder, wheel)
        if wheel.dist in need:
            complete &= found is not None
            state = "needed: " + (f"from {found.name}" if found else "MISSING from the folder")
        else:
            state = "not needed: the node has it" if version else "not needed: pytest is on the node"
            state += f"; {'in the folder' if found else 'not in the folder'}"
        node = f"node {version}" if version else "node: absent"
        print(f"  {wheel.spec:22} {node:17} {state}  ({wheel.why})")
    if not complete:
        print(f"  → with the registry at hand: scripts/gpu_check.sh --download (into {folder}), then copy it")
    return node_ok and complete


def install(folder: Path, target: Path) -> None:
    files = [find_wheel(folder, w) for w, _ in needed()]
    missing = [w.spec for (w, _), f in zip(needed(), files, strict=True) if f is None]
    if missing:
        raise SystemExit(f"gpu_check: wheels missing from {folder}: {', '.join(missing)}")
    if not files:
        print("gpu_check: every wheel's package is already on the node; nothing to install")
        return
    target.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "install", "--no-index", "--no-deps", "--upgrade", "--quiet",
           "--disable-pip-version-check", "--target", str(target), *map(str, files)]  # fmt: skip
    print("gpu_check: " + " ".join(cmd[1:4]) + f" ... --target {target} " + " ".join(f.name for f in files))
    subprocess.run(cmd, check=True)


def download(folder: Path, python_version: str, platform: str) -> None:
    """`pip download` every wheel (all of them: the node's packages are not known here) for the node's
    Python and platform, binary only and without dependencies (the list above is complete)."""
    folder.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--dest", str(folder),
           "--python-version", python_version, "--platform", platform, *(w.spec for w in WHEELS)]  # fmt: skip
    print("gpu_check: " + " ".join(cmd[1:]))
    subprocess.run(cmd, check=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("check", "install", "download"):
        p = sub.add_parser(name)
        p.add_argument("wheels", type=Path)
        if name == "install":
            p.add_argument("target", type=Path)
        if name == "download":
            p.add_argument("--python-version", default=f"{sys.version_info[0]}.{sys.version_info[1]}")
            p.add_argument("--platform", default=PLATFORM)
    args = parser.parse_args(argv)
    if args.command == "check":
        return 0 if check(args.wheels) else 1
    if args.command == "install":
        install(args.wheels, args.target)
    else:
        download(args.wheels, args.python_version, args.platform)
    return 0


if __name__ == "__main__":
    sys.exit(main())
