"""The op's Triton kernels compile for the GPUs they are for, here, without one: Triton 3.7.1 (the version
torch 2.13's CUDA wheel requires) lowers each kernel, for every logits dtype, to PTX and through its bundled
`ptxas` to a cubin for Hopper (sm_90a) and Ampere (sm_80), at Qwen3's vocabulary's tile size, and `ptxas`
reports no register spills; the forward's walks over a row stay within their SASS instruction budgets. The
interpreter (the other kernel tests) checks what the kernels compute; this checks that the compiled path
accepts them, which the interpreter does not (it runs Python, not the compiler's type rules)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


MAX_WALK_BUDGET = 3.1
"""SASS instructions per bf16 element of pass 1's whole-tile loop (load, convert, max.NaN)."""
SUMS_WALK_BUDGET = 13.0
"""… and of pass 2's, with the entropy and |V_S| sums (convert, x − m, × scale, exp2, four sums, θ)."""
PIPELINED_MAX_WALK_BUDGET = 6.0
"""… and of a pipelined pass 1's (`OneProgram.pass1_stages`: the copy into shared memory, its wait, the load
back, convert, max.NaN): 5.5–5.6 at Triton 3.7.1, a memory-bound walk's."""


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
    # 2 targets × 4 dtypes × 7 kernels (the gradient with and without H, each with and without the target's
    # column, the fused backward's; the TP = 1 one-program forward)
    assert len(rows) == 2 * 4 * 7
    for row in rows:
        assert row["spill_bytes"] == 0, row
        assert 0 < row["registers"] <= 255, row
        # pass 1 propagates NaN with PTX's max.NaN (Triton's interpreter propagates it whatever the flag, so
        # only the compiled code can show it); float64 has no max.NaN: LLVM expands `maximum` there
        if "max_nan" in row and row["dtype"] != "fp64":
            assert row["max_nan"], row
        # 1/T travels as a double whatever the logits (`triton_kernels._as_compute`): a Python float would be
        # float32 (Triton's `mangle_type`), float64 logits' scaling rounded to it. The signatures are the
        # wrappers' launches as Triton's binder specializes them (`kernels_aot.launches`).
        assert set(row["float_args"].values()) <= {"fp64"}, row
        if row["kernel"] in ("partial_sums", "max_and_sums") or row["kernel"].startswith("write_grad"):
            assert row["float_args"], row
        # … and is rounded once to the compute dtype: no float64 arithmetic in a 16- or 32-bit kernel
        if row["dtype"] != "fp64":
            assert row["f64_ops"] == 0, row
        else:  # the count sees float64 arithmetic where there is some
            assert row["f64_ops"] > 100, row
    # The instruction budgets of the two walks over a row, bf16 on Hopper (the measured GPU): pass 2 is bound
    # by instructions per element on an H200 (1.81 ms against 1.10 for a read, research/op-kernels.md), and
    # in the one-program forward both walks' instructions share the SMs. At fceb974 the whole-tile loops
    # took 6.6 (row max: a mask on every tile, a NaN flag) and 14.25 (sums); now 3.06 and 12.875.
    hopper = {r["kernel"]: r["loops"] for r in rows if r["arch"] == "sm_90a" and r["dtype"] == "bf16"}

    def cheapest(kernel: str, with_exp: bool) -> float:  # pass 2's loops exponentiate, pass 1's do not
        return min(loop["per_element"] for loop in hopper[kernel] if (loop["exp"] > 0) == with_exp)

    assert cheapest("row_max", False) <= MAX_WALK_BUDGET, hopper["row_max"]
    assert cheapest("partial_sums", True) <= SUMS_WALK_BUDGET, hopper["partial_sums"]
    assert cheapest("max_and_sums", False) <= MAX_WALK_BUDGET, hopper["max_and_sums"]
    assert cheapest("max_and_sums", True) <= SUMS_WALK_BUDGET, hopper["max_and_sums"]
    # every launch bench.op times runs its persistent grid in one wave: all its programs resident at once
    launches = report["one_program"]
    assert len(launches) == 10 and all(r["fits"] and r["spill_bytes"] == 0 for r in launches), launches
    for r in launches:
        # a launch's L2 priorities reach the PTX (`createpolicy.fractional.L2::…` on its loads), and only its
        # own; a pipelined pass 1 copies its tiles into shared memory asynchronously, `pass1_stages − 1` ahead
        assert r["l2_policies"] == sorted(set(r["evictions"]) - {""}), r
        assert (r["async_copies"] > 0) == (r["pass1_stages"] > 1), r
        tile_bytes = 2 * r["launch"][0]
        assert r["shared_bytes"] >= (r["pass1_stages"] - 1) * tile_bytes, r
        # the hints' descriptors cost at most about an instruction per element in each walk (uniform
        # datapath: 12.625 → 13.375 in pass 2 at 4096 × 16, 3.06 → 3.25 in pass 1, Triton 3.7.1)
        hints = 1.0 if any(r["evictions"]) else 0.0
        pass1 = PIPELINED_MAX_WALK_BUDGET if r["pass1_stages"] > 1 else MAX_WALK_BUDGET
        for with_exp, budget in ((True, SUMS_WALK_BUDGET), (False, pass1)):
            cheapest = min(loop["per_element"] for loop in r["loops"] if (loop["exp"] > 0) == with_exp)
            assert cheapest <= budget + hints, r
