"""A GPU node's packages alone, on any machine, and a record of the lines of tests/gpu that ran: what lets
the CPU suite show that the GPU check's wheel list is complete and that no GPU run is the first to execute a
line of a GPU test (`tests/test_gpu_cpu_halves.py` runs the GPU tests' CPU halves under both).

- `node_site_packages` builds a folder of links to what a node has: its own packages (`node.NODE_PACKAGES`)
  and everything they require (a node installs them with their dependencies), and the wheels the check
  carries (`node.WHEELS`, installed without theirs), each with its `.dist-info`. A process under it sees
  that folder instead of this environment's site-packages: every other distribution is absent, for
  `import` (a lazy one inside a function, as `import datasets` in `read_records`, included),
  `importlib.util.find_spec`, `importlib.metadata` and pytest's plugin entry points alike, as on a node.
  `HiddenImports`, last on `sys.meta_path`, logs each import of a module it hid (and lets it fail).
- `record_lines` traces the lines of tests/gpu that run and writes them at exit.

Both switch on from the environment (`NODE_ONLY_ENV`, `LINES_ENV`) in every Python process that has
`tests/gpu/node_site` on its PYTHONPATH (its `sitecustomize`), so the processes a CPU half starts (trainer
workers, torchrun and its ranks, the local engine) are held to them too.
"""

from __future__ import annotations

import atexit
import importlib
import importlib.abc
import importlib.metadata as md
import json
import os
import re
import site
import sys
import threading
from pathlib import Path

NODE_ONLY_ENV = "MT_NODE_ONLY_IMPORTS"
"""Path of a JSON file {"site": folder, "hidden": {module: [distributions]}, "log": file}: switches a
node's view on."""
LINES_ENV = "MT_GPU_LINES"
"""A folder: switches `record_lines` on; each process writes `<pid>.json` there at exit."""
GPU_DIR = Path(__file__).resolve().parent


def normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_closure(names) -> set[str]:
    """`names` and every distribution they require, transitively, as installed here (markers evaluated for
    this interpreter, extras not taken): what `pip install NAME` brings to a node. Normalized names."""
    from packaging.requirements import Requirement

    seen: set[str] = set()
    todo = [normalized(n) for n in names]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        try:
            requires = md.requires(name) or []
        except md.PackageNotFoundError:
            continue
        for raw in requires:
            req = Requirement(raw)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(normalized(req.name))
    return seen


def node_distributions() -> set[str]:
    """What a GPU node running the check has: its own packages with their requirements, the carried wheels
    (without theirs: `--no-deps`), pip (the check installs the wheels with it) and the checkout itself
    (megatron_tail, on PYTHONPATH)."""
    from tests.gpu import node

    carried = {normalized(w.dist) for w in node.WHEELS}
    return requirement_closure(node.NODE_PACKAGES) | carried | {"pip", "megatron-tail"}


def hidden_modules(allowed: set[str]) -> dict[str, list[str]]:
    """Top-level module → its distributions, for every module installed here none of whose distributions
    is in `allowed`."""
    out = {}
    for module, dists in md.packages_distributions().items():
        if not any(normalized(d) in allowed for d in dists):
            out[module] = sorted(set(dists))
    return out


def node_site_packages(folder: Path, allowed: set[str]) -> Path:
    """`folder` filled with links to the top-level entries (packages, modules, `.dist-info`) of the
    distributions in `allowed` installed here (megatron-tail excepted: the checkout is on PYTHONPATH); an
    entry shared with another distribution (a namespace package) is linked when one of its owners is
    allowed."""
    owners: dict[str, set[str]] = {}
    where: dict[str, Path] = {}
    for dist in md.distributions():
        name = normalized(dist.metadata["Name"])
        for file in dist.files or []:
            top = file.parts[0]
            if top in ("..", "__pycache__") or top.endswith(".pth") or name == "megatron-tail":
                continue
            owners.setdefault(top, set()).add(name)
            where[top] = Path(dist.locate_file(top))
    folder.mkdir(parents=True, exist_ok=True)
    for top, names in owners.items():
        if names & allowed and where[top].exists():
            (folder / top).symlink_to(where[top])
    return folder


class HiddenImports(importlib.abc.MetaPathFinder):
    """Last on `sys.meta_path`: asked only for what no other finder found. Appends a JSON line to `log`
    for each top-level module of `hidden` (module → distributions) asked for, and finds nothing."""

    def __init__(self, hidden: dict[str, list[str]], log: Path):
        self.hidden = hidden
        self.log = log

    def find_spec(self, fullname, path, target=None):  # noqa: ARG002 - the finder's signature
        if path is None and fullname in self.hidden:
            entry = {"module": fullname, "distributions": self.hidden[fullname], "pid": os.getpid()}
            with open(self.log, "a") as f:
                f.write(json.dumps(entry) + "\n")
        return None


def use_node_site(folder: Path, hidden: dict[str, list[str]], log: Path) -> None:
    """This process sees `folder` instead of this environment's site-packages, and logs hidden imports."""
    own = set(site.getsitepackages()) | {site.getusersitepackages()}
    before = list(sys.path)
    at = next((i for i, p in enumerate(before) if p in own), len(before))
    sys.path[:] = [*before[:at], str(folder), *(p for p in before[at:] if p not in own)]
    importlib.invalidate_caches()
    sys.meta_path.append(HiddenImports(hidden, log))


def record_lines(folder: Path, under: Path = GPU_DIR) -> None:
    """Trace the lines run in files under `under` in this process (every thread started from now on) and
    write {file: [lines]} to `folder/<pid>.json` at exit."""
    prefix = str(under) + os.sep
    lines: dict[str, set[int]] = {}

    def local(frame, event, arg):  # noqa: ARG001 - the trace function's signature
        if event == "line":
            lines[frame.f_code.co_filename].add(frame.f_lineno)
        return local

    def global_(frame, event, arg):  # noqa: ARG001 - the trace function's signature
        filename = frame.f_code.co_filename
        if not filename.startswith(prefix):
            return None
        lines.setdefault(filename, set())
        return local

    def write():
        data = {name: sorted(found) for name, found in lines.items()}
        (folder / f"{os.getpid()}.json").write_text(json.dumps(data))

    global _write_lines
    _write_lines = write
    atexit.register(write)
    threading.settrace(global_)
    sys.settrace(global_)


_write_lines = None
"""`record_lines`'s writer, where it runs (a forked child that ends by `os._exit` runs no atexit hook)."""


def flush_recorded_lines() -> None:
    """In a forked child about to `os._exit`: write the lines recorded so far (a no-op unless recording)."""
    if _write_lines is not None:
        _write_lines()


def install_from_environment() -> None:
    """What `sitecustomize` calls: a node's view where `NODE_ONLY_ENV` names its file, the line record where
    `LINES_ENV` names a folder; nothing otherwise."""
    spec = os.environ.get(NODE_ONLY_ENV)
    if spec:
        data = json.loads(Path(spec).read_text())
        use_node_site(Path(data["site"]), data["hidden"], Path(data["log"]))
    folder = os.environ.get(LINES_ENV)
    if folder:
        record_lines(Path(folder))
