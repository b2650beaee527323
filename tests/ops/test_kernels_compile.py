"""The op's Triton kernels compile for the GPUs they are for, here, without one: Triton 3.7.1 (the version
torch 2.13's CUDA wheel requires) lowers each kernel, for every logits dtype, to PTX and through its bundled
`ptxas` to a cubin for Hopper (sm_90a) and Ampere (sm_80), at Qwen3's vocabulary's tile size, and `ptxas`
reports no register spills. The interpreter (the other kernel tests) checks what the kernels compute; this
checks that the compiled path accepts them, which the interpreter does not (it runs Python, not the
compiler's type rules)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_kernels_compile_for_hopper_and_ampere_without_spills():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, "-m", "tests.ops.kernels_aot"], env=env, cwd=ROOT, capture_output=True, text=True,
        timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["triton"] == "3.7.1"
    rows = report["kernels"]
    # 2 targets × 4 dtypes × 5 kernels (the gradient with and without H; the TP = 1 one-program forward)
    assert len(rows) == 2 * 4 * 5
    for row in rows:
        assert row["spill_bytes"] == 0, row
        assert 0 < row["registers"] <= 255, row
