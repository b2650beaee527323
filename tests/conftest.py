"""Shared pytest set-up: GPU tests skip with a reason where no CUDA device is present; without one, Triton's
interpreter is on for the session (`tests/triton_interpreter.py` says why it must be set this early), patching
the language once per launch (`patches/triton_interpreter_patch_once.py`).

`make test` runs the suite on three pytest-xdist workers (`-n 3`, the Makefile says why) with the scheduler
below: each test file is one unit of work, kept on one worker, so a module-scoped set-up (an engine, a
trained run) is made once, as in a serial run; the Slurm tests are one unit, since their session-scoped
local cluster is one per machine (fixed daemons and ports, `tests/slurm/local_slurm.sh`). Units start in
collection order (`--no-loadscope-reorder`), the Slurm unit first, then the longest files (`LONGEST_FIRST`):
started last, one would run alone at the end. (xdist's own `--dist loadgroup` cannot group here: it renames
the items' `_nodeid`, which pytest 9.2's `Node.nodeid` no longer reads, so each test became its own unit and
module fixtures were made once per worker.)"""

import gc
import os

# Off until collection has imported what the session keeps (`pytest_collection_finish`): a full collection
# walks torch's, megatron-core's and transformers' objects again each time (collection: ~18 → ~14 CPU-s).
gc.disable()

import pytest  # noqa: E402 - after the collector is off
import torch  # noqa: E402

INTERPRETER_PATCH = "not applied: CUDA is present (compiled kernels)"
"""What became of `patches/triton_interpreter_patch_once.py` in this session (pytest's header says it; the
end of the run too, where it was not applied)."""
INTERPRETER_UNPATCHED = "not applied, Triton's own interpreter runs"

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
    from megatron_tail.patches import PatchVersionError
    from megatron_tail.patches.triton_interpreter_patch_once import (
        use_one_language_patch_per_launch,
    )

    # The kernels' CPU tests, faster (patches/README.md). Speed only: on a Triton it was not verified on (or
    # none) the suite runs with Triton's own interpreter rather than not at all.
    try:
        use_one_language_patch_per_launch()
        INTERPRETER_PATCH = "applied (a jit helper patches triton.language once per launch)"
    except PatchVersionError as unpinned:
        INTERPRETER_PATCH = f"{INTERPRETER_UNPATCHED}: {unpinned}"


SERIAL_GROUPS = {"tests/slurm/": "slurm"}
"""Folders whose tests share one worker whatever their file: a set-up that exists once per machine. They
are the longest units of work, so they start first."""


LONGEST_FIRST = (
    "tests/loop/test_engine_failures.py",
    "tests/loop/test_end_to_end.py",
    "tests/loop/test_demo_launch.py",
    "tests/loop/test_process_death.py",
    "tests/loop/test_resume.py",
    "tests/experiments/test_truncation_suite.py",
    "tests/loop/test_one_generation_path.py",
    "tests/ops/test_linear_op_device.py",
    "tests/loop/test_multiturn_loop.py",
    "tests/loop/test_resume_config.py",
    "tests/bench/test_op_report.py",
    "tests/experiments/test_collapse_slice.py",
    "tests/test_gpu_check.py",
    "tests/loop/test_user_errors.py",
    "tests/loop/test_agentic_exactly_once.py",
    "tests/loop/test_stop_signals.py",
    "tests/report/test_report.py",
    "tests/loop/test_cli_signal.py",
    "tests/loop/test_truncated_sampling_loop.py",
    "tests/loop/test_reliability.py",
    "tests/ops/test_kernels_compile.py",
)
"""The longest units after `SERIAL_GROUPS`, longest first (each file's time in two `make test` runs on 2
cores, 2026-12-02; every file of 30 s or more): a worker that starts one of them last would run alone at the
end. Only the order depends on it: a file it does not name (a new or renamed one) runs after these, in
collection order."""


def unit_of_work(nodeid: str) -> str:
    """The xdist unit of work of a test: its folder's in `SERIAL_GROUPS`, else its file."""
    path = nodeid.split("::", 1)[0]
    for folder, group in SERIAL_GROUPS.items():
        if path.startswith(folder):
            return group
    return path


@pytest.hookimpl(optionalhook=True)  # an xdist hook: unknown where xdist is not installed
def pytest_xdist_make_scheduler(config, log):
    """xdist's file scheduler (`LoadScopeScheduling`) with `unit_of_work` as the scope, for `-n N` (another
    `--dist` mode asked for by name keeps its own scheduler)."""
    if config.getvalue("dist") != "load":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class UnitScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return unit_of_work(nodeid)

    return UnitScheduling(config, log)


def pytest_report_header(config):  # noqa: ARG001 - pytest hook signature
    return f"patches/triton_interpreter_patch_once: {INTERPRETER_PATCH}"


def pytest_terminal_summary(terminalreporter):
    """`make test`'s `-q` prints no header: a run without the patch says so at its end too."""
    if INTERPRETER_PATCH.startswith(INTERPRETER_UNPATCHED):
        terminalreporter.write_line(f"patches/triton_interpreter_patch_once: {INTERPRETER_PATCH}")


def pytest_configure(config):
    if config.getoption("numprocesses", None) and "PYTEST_XDIST_WORKER" not in os.environ:
        gc.enable()  # xdist's controller: its workers collect, it never does


def pytest_collection_finish(session):  # noqa: ARG001 - pytest hook signature
    """What collection imported (torch, megatron-core, transformers, sglang, every test module) lives as long
    as the worker: frozen out of the collector's full collections, which would walk it again and again
    (`megatron_tail/utils/start_up.py` does the same for a run's processes, and says what it costs); the
    collector on again for the tests."""
    gc.freeze()
    gc.enable()


def pytest_collection_modifyitems(config, items):  # noqa: ARG001 - pytest hook signature
    rank = {unit: i for i, unit in enumerate([*SERIAL_GROUPS.values(), *LONGEST_FIRST])}
    items.sort(key=lambda item: rank.get(unit_of_work(item.nodeid), len(rank)))  # stable: the rest in order
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(
        reason="needs a CUDA GPU; this host has none (torch.cuda.is_available() is False)"
    )
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture
def figures_not_rendered(monkeypatch):
    """For a test of what a report says, not of its figures: matplotlib's `Figure.savefig` records the path
    and leaves an empty file there instead of laying the figure out and rendering its PNG (about 0.7 s a
    figure on one CI core; a report draws up to ten). The figures themselves are tested where a test reads
    them (`tests/report/test_report.py`'s `_assert_png_not_blank`). Returns the paths saved, in order."""
    from pathlib import Path

    from matplotlib.figure import Figure

    saved: list[Path] = []

    def record(self, fname, **kwargs):  # noqa: ARG001 - Figure.savefig's signature
        saved.append(Path(fname))
        Path(fname).touch()

    monkeypatch.setattr(Figure, "savefig", record)
    return saved
