"""Shared pytest set-up: GPU tests skip with a reason where no CUDA device is present; without one, Triton's
interpreter is on for the session (`tests/triton_interpreter.py` says why it must be set this early).

`make test` runs the suite on two pytest-xdist workers (`-n 2 --dist loadgroup`). Each test file is one unit
of work, kept on one worker, so a module-scoped set-up (an engine, a trained run) is made once, as in a
serial run; the Slurm tests are one unit, since their session-scoped local cluster is one per machine
(fixed daemons and ports, `tests/slurm/local_slurm.sh`). Units start in collection order
(`--no-loadscope-reorder`), the Slurm unit first: it is the longest (4–5 min on 2 cores), and started last
it would run alone at the end."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"


SERIAL_GROUPS = {"tests/slurm/": "slurm"}
"""Folders whose tests share one worker whatever their file: a set-up that exists once per machine."""
FIRST_GROUPS = ("slurm",)
"""Units of work started first (the longest)."""


def xdist_group_of(nodeid: str) -> str:
    """The xdist group of a test: its folder's in `SERIAL_GROUPS`, else its file's."""
    path = nodeid.split("::", 1)[0]
    for folder, group in SERIAL_GROUPS.items():
        if path.startswith(folder):
            return group
    return path


@pytest.hookimpl(tryfirst=True)  # before xdist's worker hook, which reads the groups into the node ids
def pytest_collection_modifyitems(config, items):  # noqa: ARG001 - pytest hook signature
    for item in items:
        item.add_marker(pytest.mark.xdist_group(xdist_group_of(item.nodeid)))
    items.sort(key=lambda item: xdist_group_of(item.nodeid) not in FIRST_GROUPS)  # stable: files keep order
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(
        reason="needs a CUDA GPU; this host has none (torch.cuda.is_available() is False)"
    )
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
