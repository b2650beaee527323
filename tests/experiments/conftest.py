"""The experiments' tests share one pretrained "ci" tail model and its prompt files per test run: the first
test to ask pretrains it (seconds, deterministic: `tail_model.pretrain_tail_model`), under a file lock, in the
directory every pytest-xdist worker of the run shares; the others read it, as a second run of an experiment
reads its `--cache-dir`."""

from __future__ import annotations

import os

import pytest
from filelock import FileLock

from megatron_tail.experiments.tail_model import ensure_tail_model, ensure_tail_prompts


@pytest.fixture(scope="session")
def ci_tail_cache(tmp_path_factory):
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):  # each worker's base is <run>/popen-gwN: share <run>
        root = root.parent
    cache = root / "ci_tail_cache"
    with FileLock(f"{cache}.lock"):
        ensure_tail_model(cache, log=lambda _: None, size="ci")
        ensure_tail_prompts(cache)
    return cache
