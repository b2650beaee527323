"""The package's layering, as `docs/architecture.md` draws it, checked on the import graph.

Every import counts: module level, inside functions, and the string targets of lazy package exports
(`megatron_tail.utils.lazy.lazy_exports`). `from package import Name` resolves through the package's lazy
table to the module that defines `Name`, so an edge is a real dependency. The graph must have no cycle,
and no module may import one of a higher layer, in this order (low → high):

    utils, patches → ops, data, rewards → algorithms → model, rollout → config → train.engine → plan
    → train.rl → train.run → report → demo, bench → experiments → cli
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

LAYERS: list[tuple[str, ...]] = [
    ("megatron_tail.utils", "megatron_tail.patches"),
    ("megatron_tail.ops", "megatron_tail.data", "megatron_tail.rewards"),
    ("megatron_tail.algorithms",),
    ("megatron_tail.model", "megatron_tail.rollout"),
    ("megatron_tail.config",),  # the run's settings; the trainer's own (parallel, optimizer) live here
    ("megatron_tail.train.engine",),
    ("megatron_tail.plan",),  # the preflight planner: config + config.json → bytes; no megatron
    ("megatron_tail.train.rl",),
    ("megatron_tail.train.run", "megatron_tail.train"),  # the bare `train` package: a facade over all three
    ("megatron_tail.report",),  # reads run directories (events, config.yaml); the demo writes one
    ("megatron_tail.demo", "megatron_tail.bench"),
    ("megatron_tail.experiments",),  # recipes on top of the demo's pieces (tiny models, launching runs)
    ("megatron_tail.cli",),
]

PARALLEL_STATE_OWNERS = ("megatron_tail.model", "megatron_tail.train", "megatron_tail.utils.forked")
"""Only these read megatron's global parallel state (`docs/architecture.md`); the rest receive process
groups. (The op benchmark sets it up for megatron's own cross-entropy, its baseline.)"""


def _modules() -> dict[str, Path]:
    found = {}
    for base, prefix in (
        (ROOT / "megatron_tail", "megatron_tail"),
        (ROOT / "patches", "megatron_tail.patches"),
    ):
        for path in base.rglob("*.py"):
            parts = list(path.relative_to(base).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join([prefix, *parts])] = path
    return found


MODULES = _modules()


def _is_package(name: str) -> bool:
    return MODULES[name].name == "__init__.py"


def _resolve(module: str, level: int, importer: str) -> str:
    if not level:
        return module
    package = importer if _is_package(importer) else importer.rpartition(".")[0]
    for _ in range(level - 1):
        package = package.rpartition(".")[0]
    return f"{package}.{module}" if module else package


def _lazy_table(name: str, tree: ast.Module) -> dict[str, str]:
    """Name → module of a package's `lazy_exports(__name__, {...})` call (a literal dict)."""
    table: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "lazy_exports":
            exports = node.args[1]
            if isinstance(exports, ast.Name):  # lazy_exports(__name__, _EXPORTS)
                exports = next(
                    s.value
                    for s in tree.body
                    if isinstance(s, ast.Assign) and getattr(s.targets[0], "id", None) == exports.id
                )
            for key, value in zip(exports.keys, exports.values, strict=True):
                path = value.value
                dots = len(path) - len(path.lstrip("."))
                table[key.value] = _resolve(path[dots:], dots, name)
    return table


TREES = {name: ast.parse(path.read_text(), str(path)) for name, path in MODULES.items()}
LAZY = {name: _lazy_table(name, tree) for name, tree in TREES.items() if _is_package(name)}


def _target(module: str, name: str | None) -> str | None:
    """The internal module an import of `name` from `module` depends on (None: not ours)."""
    if not module.startswith("megatron_tail"):
        return None
    if name is not None:
        if f"{module}.{name}" in MODULES:
            return f"{module}.{name}"
        if name in LAZY.get(module, {}):
            return LAZY[module][name]
    while module not in MODULES:  # `import megatron_tail.x.y` where y is a name, not a module
        module = module.rpartition(".")[0]
    return module


def _edges() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {name: set() for name in MODULES}
    for name, tree in TREES.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets = [_target(alias.name, None) for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                module = _resolve(node.module or "", node.level, name)
                targets = [_target(module, alias.name) for alias in node.names]
            else:
                continue
            graph[name].update(t for t in targets if t is not None and t != name)
        graph[name].update(t for t in LAZY.get(name, {}).values() if t != name)
    return graph


GRAPH = _edges()


def layer_of(module: str) -> int:
    """Index in LAYERS of the longest matching prefix; -1 for the root package (a version string)."""
    best, best_len = -1, -1
    for index, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best_len:
                best, best_len = index, len(prefix)
    return best


def test_every_module_has_a_layer():
    unplaced = sorted(m for m in MODULES if m != "megatron_tail" and layer_of(m) < 0)
    assert not unplaced, f"modules outside every layer: {unplaced}; add them to LAYERS (and the diagram)"


def test_no_module_imports_a_higher_layer():
    upward = sorted(
        f"{src} (layer {layer_of(src)}) imports {dst} (layer {layer_of(dst)})"
        for src, targets in GRAPH.items()
        for dst in targets
        if layer_of(dst) > layer_of(src)
    )
    assert not upward, "\n".join(upward)


def test_the_import_graph_has_no_cycle():
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(GRAPH[node]):
            if state.get(nxt) == 1:
                pytest.fail("import cycle: " + " → ".join([*stack[stack.index(nxt) :], nxt]))
            if nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for module in sorted(GRAPH):
        if module not in state:
            visit(module)


def test_only_model_and_train_read_megatrons_parallel_state():
    readers = set()
    for name, tree in TREES.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("megatron.core"):
                names = [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            if any(n.startswith("megatron.core.parallel_state") for n in names):
                readers.add(name)
    others = {m for m in readers if not m.startswith(PARALLEL_STATE_OWNERS)}
    assert others <= {"megatron_tail.bench.op"}, sorted(others)
    assert "megatron_tail.train.engine.parallel" in readers  # the scan does find them


def test_the_graph_sees_function_level_and_lazy_imports():
    """The checks above would be vacuous if the scan missed these kinds of edges."""
    assert (
        "megatron_tail.train.engine.collectives" in GRAPH["megatron_tail.train.run.signals"]
    )  # in a function
    assert "megatron_tail.train.run.loop" in GRAPH["megatron_tail.train.run"]  # a lazy export
    assert "megatron_tail.rollout.batch" in GRAPH["megatron_tail.train.run.session"]  # through a facade
    assert "megatron_tail.config.optimizer" in GRAPH["megatron_tail.train.engine"]  # an absolute lazy export
    assert layer_of("megatron_tail.train.rl.update") > layer_of("megatron_tail.config.schema")


def test_the_config_imports_nothing_of_the_trainer():
    """`config` once imported `train.engine.settings` while `train` imports `config`: the one arrow from a
    package to one above it in the tree. The trainer's settings now live in `config`."""
    edges = {t for m, targets in GRAPH.items() if m.startswith("megatron_tail.config") for t in targets}
    assert not {t for t in edges if t.startswith("megatron_tail.train")}, sorted(edges)


def test_no_lazy_export_is_shadowed_by_a_submodule():
    """Importing `pkg.name` sets the attribute `pkg.name` to the module, hiding an export of that name."""
    shadowed = sorted(
        f"{pkg}.{name}" for pkg, table in LAZY.items() for name in table if f"{pkg}.{name}" in MODULES
    )
    assert not shadowed, shadowed
