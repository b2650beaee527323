"""The GPU check's two promises about itself, held on CPU on every commit (by `tests/gpu/node_imports.py`):

1. Its wheel list is complete. Every module the GPU tests import, through the package, lazily or not, is a
   node's (`node.NODE_PACKAGES` and what they require) or a carried wheel's (`node.WHEELS`): the GPU tests'
   CPU halves run in processes that see those distributions alone, as a bare node would (issue 53: the whole
   loop failed on a node without `datasets`, which `data/prompts.py:read_records` imports when it runs).
2. No GPU run is the first to execute a line of a GPU test (issue 53: a KeyError in the MoE test's table row,
   after every check had passed). Each GPU test module names its CPU half (`CPU_HALF`); a GPU test's own body
   only passes arguments to shared code, which checks, measures and builds the table's rows; and the CPU
   halves execute every line of that shared code in tests/gpu, reporting included, but for the lines under a
   `# gpu only: <why>` comment (a CUDA API, Liger-Kernel) or a `# some runs only: <why>` one (a time-out).
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.gpu.node_imports import (
    LINES_ENV,
    NODE_ONLY_ENV,
    hidden_modules,
    node_distributions,
    node_site_packages,
)

ROOT = Path(__file__).resolve().parents[1]
GPU = ROOT / "tests" / "gpu"
NODE_SITE = GPU / "node_site"
EXEMPT = ("# gpu only:", "# some runs only:")
"""Comments that exempt the statement they head, each with its reason: a line only a GPU runs (a CUDA API,
Liger-Kernel), or one that no passing run on any device need reach (a time-out, a wait, a seed's case)."""
NOT_SHARED = {"node.py", "node_imports.py", "table.py", "results_plugin.py", "__init__.py"}
"""tests/gpu files that run before or around pytest on the node, not in a GPU test (`test_gpu_check.py`)."""
PASSING_ARGUMENTS = (
    ast.Expr, ast.Return, ast.With, ast.withitem, ast.Call, ast.Name, ast.Attribute, ast.Constant,
    ast.keyword, ast.Load, ast.Yield,
)  # fmt: skip
"""What a GPU test's (or its fixture's) own body may hold: calls of shared code with names and constants."""


def gpu_modules() -> list[Path]:
    return sorted(GPU.glob("test_*.py"))


def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def cpu_half(path: Path) -> str | None:
    """A GPU test module's `CPU_HALF = "tests/..."` (None without one)."""
    for node in _tree(path).body:
        if isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["CPU_HALF"]:
            return node.value.value if isinstance(node.value, ast.Constant) else None
    return None


def _is_fixture(fn: ast.FunctionDef) -> bool:
    return any("fixture" in ast.unparse(d) for d in fn.decorator_list)


def gpu_only_functions(tree: ast.Module, path: Path) -> list[ast.FunctionDef]:
    """The GPU test functions and their fixtures: what only a GPU runs (module level of a test_*.py)."""
    if not path.name.startswith("test_"):
        return []
    return [
        n for n in tree.body
        if isinstance(n, ast.FunctionDef) and (n.name.startswith("test_") or _is_fixture(n))
    ]  # fmt: skip


def _body(fn: ast.FunctionDef) -> list[ast.stmt]:
    docstring = fn.body and isinstance(fn.body[0], ast.Expr) and isinstance(fn.body[0].value, ast.Constant)
    return fn.body[1:] if docstring else fn.body


def _header_lines(stmt: ast.stmt) -> range:
    """The lines of a statement that hold its own code: a compound statement's header, a simple one whole."""
    first = min([stmt.lineno, *(d.lineno for d in getattr(stmt, "decorator_list", []))])
    children = [c for field in ("body", "orelse", "finalbody", "handlers") for c in getattr(stmt, field, [])]
    if children and isinstance(children[0], ast.AST) and hasattr(children[0], "lineno"):
        return range(first, min(c.lineno for c in children))
    return range(first, stmt.end_lineno + 1)


def required_lines(path: Path) -> dict[range, str]:
    """Each statement of the shared code in `path` (every function but the GPU-only ones, nested ones
    included) that a CPU half must run: its header lines → "function: first line of its code". Skipped:
    docstrings, `pass`/`global`/`nonlocal`, `try:` headers (no code of their own), and what a line holding
    an `EXEMPT` comment heads (the statement and all within it)."""
    tree, text = _tree(path), path.read_text().splitlines()
    skip = {id(fn) for fn in gpu_only_functions(tree, path)}
    out: dict[range, str] = {}

    def marked(lines: range) -> bool:
        return any(mark in text[i - 1] for i in lines for mark in EXEMPT)

    def walk(stmts, where: str) -> None:
        for stmt in stmts:
            if isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef) and id(stmt) in skip:
                continue
            lines = _header_lines(stmt)
            if marked(lines):
                continue
            if isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef):
                if where:  # a nested def is a statement of its function
                    out[lines] = f"{where}: {text[lines[0] - 1].strip()}"
                walk(_body(stmt), stmt.name if not where else f"{where}.{stmt.name}")
                continue
            if isinstance(stmt, ast.ClassDef):
                walk(stmt.body, "")
                continue
            if not where or isinstance(stmt, ast.Pass | ast.Global | ast.Nonlocal):
                continue
            if not isinstance(stmt, ast.Try):
                out[lines] = f"{where}: {text[lines[0] - 1].strip()}"
            for field in ("body", "orelse", "finalbody"):
                walk(getattr(stmt, field, []), where)
            for handler in getattr(stmt, "handlers", []):
                if not marked(_header_lines(handler)):
                    walk(handler.body, where)

    walk(tree.body, "")
    return out


def test_every_gpu_test_module_names_its_cpu_half_which_calls_its_code():
    assert len(gpu_modules()) >= 8
    for path in gpu_modules():
        half = cpu_half(path)
        assert half, f"{path.name}: no CPU_HALF = 'tests/...' (the CPU test that runs the same code)"
        assert (ROOT / half).is_file(), (path.name, half)
        assert f"from tests.gpu.{path.stem} import" in (ROOT / half).read_text(), (path.name, half)


def test_a_gpu_tests_own_body_only_passes_arguments_to_shared_code():
    for path in gpu_modules():
        tree = _tree(path)
        functions = gpu_only_functions(tree, path)
        assert any(fn.name.startswith("test_") for fn in functions), path.name
        for fn in functions:
            for stmt in _body(fn):
                bad = [n for n in ast.walk(stmt) if not isinstance(n, PASSING_ARGUMENTS)]
                assert not bad, (
                    f"{path.name}:{stmt.lineno} {fn.name}: `{ast.unparse(stmt)}` holds "
                    f"{type(bad[0]).__name__}, which only a GPU would run: move it into the shared code the "
                    "CPU half calls too"
                )


def test_every_exemption_says_why():
    for path in sorted(GPU.glob("*.py")):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            for mark in EXEMPT:
                if mark in line:
                    why = line.split(mark, 1)[1].strip()
                    assert len(why.split()) >= 3, f"{path.name}:{number}: {mark} needs its reason"


def node_view(root: Path, drop: frozenset[str] = frozenset()) -> dict[str, str]:
    """The environment of a process that sees a node's packages alone (less `drop`): `root` gets the
    folder of links, the spec and the log of hidden imports."""
    allowed = node_distributions() - drop
    site_dir = node_site_packages(root / "site", allowed)
    spec = root / "node.json"
    log = root / "hidden_imports.jsonl"
    spec.write_text(json.dumps({"site": str(site_dir), "hidden": hidden_modules(allowed), "log": str(log)}))
    path = os.pathsep.join(filter(None, [str(NODE_SITE), str(ROOT), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, NODE_ONLY_ENV: str(spec), "HF_HUB_OFFLINE": "1"}


def hidden_imports(root: Path) -> dict[str, list[str]]:
    log = root / "hidden_imports.jsonl"
    lines = log.read_text().splitlines() if log.is_file() else []
    return {e["module"]: e["distributions"] for e in map(json.loads, lines)}


READ_PROMPTS = """
import json, sys
from pathlib import Path
from megatron_tail.data.prompts import read_records
path = Path(sys.argv[1])
path.write_text(json.dumps({"prompt": "1+1=", "answer": "2"}) + "\\n")
print(len(read_records(path)))
"""


@pytest.mark.parametrize(
    "drop", [frozenset(), frozenset({"datasets"})], ids=["node", "node-without-datasets"]
)
def test_a_nodes_view_reads_prompts_only_with_the_datasets_wheel(tmp_path, drop):
    """The failure of issue 53 in small: `read_records` imports `datasets` when it runs. With the lists as
    they are it reads the file; with `datasets` taken out of them, the lazy import fails as it did on the
    node, and the view logs which distribution it hid."""
    env = node_view(tmp_path, drop)
    done = subprocess.run(
        [sys.executable, "-c", READ_PROMPTS, str(tmp_path / "p.jsonl")],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    if not drop:
        assert done.returncode == 0 and done.stdout.strip() == "1", done.stderr[-3000:]
        return
    assert done.returncode != 0 and "No module named 'datasets'" in done.stderr, done.stderr[-3000:]
    assert hidden_imports(tmp_path)["datasets"] == ["datasets"]


@pytest.mark.slow
def test_the_cpu_halves_run_every_line_of_tests_gpu_with_a_nodes_packages_alone(tmp_path):
    """Minutes: the CPU halves of every GPU test, once more, in processes that see a node's packages alone
    and record the lines of tests/gpu they run; then every required line (`required_lines`) ran."""
    halves = sorted({cpu_half(p) for p in gpu_modules()})
    lines = tmp_path / "lines"
    lines.mkdir()
    env = {**node_view(tmp_path), LINES_ENV: str(lines), "PYTHONWARNINGS": "ignore"}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfE", *halves],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800,
    )  # fmt: skip
    hidden = hidden_imports(tmp_path)
    failed = f"the CPU halves failed with a node's packages alone (imports it hid: {hidden}):"
    assert done.returncode == 0, f"{failed}\n{done.stdout[-6000:]}"
    ran: dict[str, set[int]] = {}
    for record in lines.glob("*.json"):
        for name, found in json.loads(record.read_text()).items():
            ran.setdefault(name, set()).update(found)
    missing = []
    for path in sorted(GPU.glob("*.py")):
        if path.name in NOT_SHARED:
            continue
        executed = ran.get(str(path), set())
        for span, what in required_lines(path).items():
            if not executed.intersection(span):
                missing.append(f"{path.relative_to(ROOT)}:{span[0]} {what}")
    assert not missing, "lines of tests/gpu that only a GPU would run first:\n" + "\n".join(missing)
    print("imports a node's view hid (each failed as on a node; none was needed):", sorted(hidden))
