"""What `scripts/gpu_check.sh` needs on a GPU node, and what it brings as wheels.

    python tests/gpu/node.py check WHEELS_DIR        # a line per requirement; exit 1 if one is not met
    python tests/gpu/node.py install WHEELS_DIR DIR  # the needed wheels into DIR, --no-index --no-deps
    python tests/gpu/node.py download WHEELS_DIR [--python-version 3.12]  # where the registry is reachable

Expected on the node (not installed by us: they decide the CUDA stack, or are compiled against numpy):
Python ≥ 3.11, PyTorch ≥ 2.11 built with CUDA (any CUDA 12/13 build, with the triton it requires),
transformers, safetensors, tensorboard, pandas and pyarrow (and what they pull in: numpy, pyyaml, tqdm,
huggingface_hub, fsspec). Everything else the GPU tests import travels as a wheel in WHEELS_DIR and is
installed with `pip install --no-index --no-deps` into a folder of the checkout that goes on PYTHONPATH,
only where the node lacks it: nothing is resolved, nothing reaches the network, nothing of the node's
environment changes. Because nothing is resolved, `check` reads each carried wheel's own Requires-Dist and
says which the node does not meet (datasets 5.2.0 needs pyarrow ≥ 24 and huggingface_hub ≥ 1.31, say).
That the two lists cover every import of the GPU tests is checked on CPU: tests/test_gpu_cpu_halves.py
runs the GPU tests' CPU halves with every other distribution refused (tests/gpu/node_imports.py).
Stdlib only (plus pip's vendored `packaging`), so it runs before anything is installed.
"""

from __future__ import annotations

import argparse
import email.parser
import importlib.metadata as md
import re
import subprocess
import sys
import zipfile
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
    Wheel("datasets", "5.2.0", "megatron_tail.data reads the prompts with it (the whole-loop test)"),
    Wheel("multiprocess", "0.70.19", "datasets' dependency (datasets 5.2.0 needs < 0.70.20)"),
    Wheel("xxhash", "4.1.0", "datasets' dependency (its fingerprints)"),
    Wheel("aiohttp", "3.14.5", "the rollout client and the local engine's server speak HTTP with it"),
    Wheel("aiohappyeyeballs", "2.7.1", "aiohttp's dependency"),
    Wheel("aiosignal", "1.4.0", "aiohttp's dependency"),
    Wheel("attrs", "26.1.0", "aiohttp's dependency"),
    Wheel("frozenlist", "1.8.0", "aiohttp's and aiosignal's dependency"),
    Wheel("multidict", "7.2.1", "aiohttp's and yarl's dependency"),
    Wheel("propcache", "0.5.4", "aiohttp's and yarl's dependency"),
    Wheel("yarl", "1.25.1", "aiohttp's dependency (URLs)"),
)
NODE_PACKAGES = (
    "torch", "transformers", "safetensors", "tensorboard", "numpy", "pyyaml", "tqdm", "triton", "pandas",
    "pyarrow",
)  # fmt: skip
"""The node's own (its CUDA stack, or compiled against its numpy), with what they require. triton comes
with torch's CUDA wheel; pandas and pyarrow are datasets' (it imports both when imported)."""


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


def use_site(site: Path | None) -> None:
    """Count what is already installed in the check's own folder (`.gpu_check/site`, first on the tests'
    PYTHONPATH) as on the node: the tests will see it, and a wheel put there by hand counts."""
    if site is not None and site.is_dir() and str(site) not in sys.path:
        sys.path.insert(0, str(site))


def wheel_requirements(path: Path) -> list[str] | None:
    """The Requires-Dist lines of a wheel file's METADATA (None: not a readable wheel)."""
    try:
        with zipfile.ZipFile(path) as archive:
            name = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
            text = archive.read(name).decode("utf-8")
    except (zipfile.BadZipFile, StopIteration, OSError, UnicodeDecodeError):
        return None
    return email.parser.Parser().parsestr(text).get_all("Requires-Dist") or []


def unmet_requirements(folder: Path) -> list[str]:
    """A line per requirement of a wheel to be installed that neither the node nor another carried wheel
    meets (`--no-deps` installs them as they are, so nothing else would notice), and per unreadable wheel."""
    try:
        from pip._vendor.packaging.requirements import Requirement
    except ImportError:
        return ["  pip is not on the node: the carried wheels' requirements cannot be read (nor installed)"]
    need = needed()
    carried = {_normalized(w.dist): w.version for w, _ in need}
    lines = []
    for wheel, _ in need:
        path = find_wheel(folder, wheel)
        requires = None if path is None else wheel_requirements(path)
        if path is not None and requires is None:
            lines.append(f"  {wheel.spec}: {path.name} is not a readable wheel")
        for raw in requires or []:
            req = Requirement(raw)
            if req.marker is not None and not req.marker.evaluate({"extra": ""}):
                continue
            have = carried.get(_normalized(req.name)) or installed(req.name)
            if have is None or not req.specifier.contains(have, prereleases=True):
                lines.append(f"  {wheel.spec} needs {req.name}{req.specifier}; the node has {have or 'none'}")
    return lines


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
    unmet = unmet_requirements(folder)
    print("What the wheels to install require themselves (their Requires-Dist, against the node):")
    print("\n".join(unmet) if unmet else "  met")
    if unmet:
        print('  → docs/operations.md, "Checking a GPU node": what to do when the node\'s packages are older')
    return node_ok and complete and not unmet


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
        if name == "check":
            p.add_argument("--site", type=Path, help="the check's own install folder (.gpu_check/site)")
        if name == "install":
            p.add_argument("target", type=Path)
        if name == "download":
            p.add_argument("--python-version", default=f"{sys.version_info[0]}.{sys.version_info[1]}")
            p.add_argument("--platform", default=PLATFORM)
    args = parser.parse_args(argv)
    if args.command == "check":
        use_site(args.site)
        return 0 if check(args.wheels) else 1
    if args.command == "install":
        use_site(args.target)
        install(args.wheels, args.target)
    else:
        download(args.wheels, args.python_version, args.platform)
    return 0


if __name__ == "__main__":
    sys.exit(main())
