"""Shared pytest set-up: GPU tests skip with a reason where no CUDA device is present; without one, Triton's
interpreter is on for the session (`tests/triton_interpreter.py` says why it must be set this early)."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"


def pytest_collection_modifyitems(config, items):  # noqa: ARG001 - pytest hook signature
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(
        reason="needs a CUDA GPU; this host has none (torch.cuda.is_available() is False)"
    )
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
