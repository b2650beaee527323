"""The kernels' CPU tests run them under Triton's interpreter. Triton reads `TRITON_INTERPRET` when a module
that defines kernels is imported, triton's own `triton.language.standard` (`tl.max`, `tl.sum`) included,
and any test module may import triton first (sglang's sampler does), so `tests/conftest.py` sets it for the
whole session, before anything is collected, on a host without CUDA. With CUDA the same kernels run
compiled (`tests/gpu`), and one process cannot hold both modes: there these tests skip, naming why.

    pytestmark = UNDER_INTERPRETER
"""

from __future__ import annotations

import os

import pytest
import torch

UNDER_INTERPRETER = [
    pytest.mark.skipif(
        torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "1",
        reason="the kernels' CPU tests need Triton's interpreter for the whole session (tests/conftest.py "
        "sets it where no CUDA device is present); with CUDA, tests/gpu runs the kernels compiled",
    ),
    # numpy's warning for the 0·(−inf) lanes the kernels compute and `tl.where` then discards
    pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning"),
]
