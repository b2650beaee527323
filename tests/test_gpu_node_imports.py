"""The GPU check's package list is complete, on every commit and in a second: every third-party module that
code reachable from tests/gpu imports (through the package, transitively; at module level or inside a
function, as `import datasets` in `data.prompts.read_records`, which failed on a bare node) belongs to a
distribution a node has (`node.NODE_PACKAGES` and what they require) or one the check carries
(`node.WHEELS`), or is optional where it is imported (`try: ... except ImportError`) or listed below with
why no GPU test needs it. A static over-approximation: `test_gpu_cpu_halves`'s slow test runs the CPU halves
under a node's packages alone, which catches what this cannot see (an import by a name built at run time).
"""

from __future__ import annotations

import ast
import importlib.metadata as md
import sys
from pathlib import Path

from tests.gpu.node_imports import node_distributions, normalized

ROOT = Path(__file__).resolve().parents[1]

NOT_ON_A_NODE = {
    "math_verify": "the math reward (rewards.math_answer); the GPU tests score toy arithmetic",
    "matplotlib": "report figures (megatron_tail.report); no GPU test draws one",
}
"""Imported by code the GPU tests can reach but never run, and absent from a node: each with its reason."""


def _file(module: str) -> Path | None:
    base = ROOT / module.replace(".", "/")
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def _optional(chain: list[ast.AST]) -> bool:
    """An import inside `try:` whose handlers catch ImportError (or ModuleNotFoundError)."""
    for node in chain:
        if isinstance(node, ast.Try):
            for handler in node.handlers:
                caught = ast.unparse(handler.type) if handler.type is not None else ""
                if "ImportError" in caught or "ModuleNotFoundError" in caught:
                    return True
    return False


def _imports(module: str, path: Path):
    """(imported module, optional) for each import of `module`, but those under `if TYPE_CHECKING:`."""
    tree = ast.parse(path.read_text())
    parent = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if not isinstance(node, ast.Import | ast.ImportFrom):
            continue
        chain, up = [], node
        while up in parent:
            up = parent[up]
            chain.append(up)
        if any(isinstance(n, ast.If) and "TYPE_CHECKING" in ast.unparse(n.test) for n in chain):
            continue
        optional = _optional(chain)
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, optional
            continue
        base = node.module or ""
        if node.level:
            up_to = package
            for _ in range(node.level - 1):
                up_to = up_to.rpartition(".")[0]
            base = f"{up_to}.{base}" if base else up_to
        for alias in node.names:
            name = f"{base}.{alias.name}"
            yield (name if _file(name) else base), optional


def third_party_imports() -> dict[str, set[tuple[str, bool]]]:
    """Top-level third-party module → {(importing module, optional)} over the modules tests/gpu reaches."""
    todo = [f"tests.gpu.{p.stem}" for p in sorted((ROOT / "tests" / "gpu").glob("*.py"))]
    seen: set[str] = set()
    found: dict[str, set[tuple[str, bool]]] = {}
    while todo:
        module = todo.pop()
        if module in seen or (path := _file(module)) is None:
            continue
        seen.add(module)
        for name, optional in _imports(module, path):
            top = name.split(".")[0]
            if top in ("megatron_tail", "tests"):
                parts = name.split(".")
                todo += [".".join(parts[: i + 1]) for i in range(len(parts))]  # packages run their __init__
            elif top not in sys.stdlib_module_names:
                found.setdefault(top, set()).add((module, optional))
    return found


def missing_from_a_node(allowed: set[str]) -> list[str]:
    by_module = md.packages_distributions()
    missing = []
    for top, where in sorted(third_party_imports().items()):
        required = sorted(module for module, optional in where if not optional)
        dists = {normalized(d) for d in by_module.get(top, [top])}
        if required and not dists & allowed and top not in NOT_ON_A_NODE:
            missing.append(
                f"{top} (distribution {', '.join(sorted(dists))}), imported by {', '.join(required)}"
            )
    return missing


def test_every_module_the_gpu_tests_reach_is_on_a_node_or_a_carried_wheel():
    missing = missing_from_a_node(node_distributions())
    assert not missing, (
        "imported by code the GPU tests reach, but neither on a node (tests/gpu/node.py NODE_PACKAGES) nor "
        "among the carried wheels (WHEELS):\n" + "\n".join(missing)
    )


def test_the_check_finds_the_wheel_a_bare_node_lacked():
    """Issue 53's failure: without `datasets` among the wheels, `data.prompts` (a lazy import in
    `read_records`) is named."""
    missing = missing_from_a_node(node_distributions() - {"datasets"})
    assert [line.split(" ")[0] for line in missing] == ["datasets"], missing
    assert "megatron_tail.data.prompts" in missing[0]


def test_each_exemption_is_still_needed():
    reached = third_party_imports()
    assert set(NOT_ON_A_NODE) <= set(reached), (
        "an exemption no code reachable from tests/gpu imports any more"
    )
