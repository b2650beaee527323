"""Compile the op's Triton kernels ahead of time for NVIDIA targets, without a GPU (Triton's own compiler and
its bundled `ptxas`), and report `ptxas -v`'s registers and spills per kernel, as one JSON line.

    python -m tests.ops.kernels_aot          # TRITON_INTERPRET unset: the compiled path, not the interpreter

Run by `test_kernels_compile.py` in a process of its own: the test session runs Triton's interpreter, and a
JIT function made under it cannot be compiled."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from megatron_tail.ops import masked_logprobs_math as math_cols
from megatron_tail.ops import triton_kernels as k

TARGETS = {"sm_90a": GPUTarget("cuda", 90, 32), "sm_80": GPUTarget("cuda", 80, 32)}
"""Hopper (H100, H200) and Ampere (A100)."""
DTYPES = {"bf16": tl.float32, "fp16": tl.float32, "fp32": tl.float32, "fp64": tl.float64}
"""Logits' dtype → the kernels' compute dtype (`triton_kernels._compute_dtype`)."""


def kernels(x: str, compute) -> list[tuple[str, object, dict, dict]]:
    """(name, kernel, signature, constexprs) of every kernel for logits of dtype `x`, as the wrappers launch
    them at Qwen3's vocabulary (block `triton_kernels._block(151936)`)."""
    block = k._block(151_936, compute == tl.float64)
    c = "fp64" if compute == tl.float64 else "fp32"
    cols = dict(
        COL_ALL=math_cols.S_ALL, COL_SAFE=math_cols.S_SAFE, COL_SAFE_EZ=math_cols.S_SAFE_EZ,
        COL_TARGET=math_cols.TARGET_LOGIT, COL_COUNT=math_cols.SAFE_COUNT,
    )  # fmt: skip
    out = [
        ("row_max", k._row_max_kernel, {"X": f"*{x}", "stride_x": "i32", "n_cols": "i32", "OUT": f"*{c}"},
         {"BLOCK": block, "COMPUTE": compute}),
        ("partial_sums", k._partials_kernel,
         {"X": f"*{x}", "stride_x": "i32", "n_cols": "i32", "MAX": f"*{c}", "THRESHOLD": f"*{c}",
          "TARGET_COL": "*i64", "OWNED": "*i8", "inv_t": "fp32", "OUT": f"*{c}", "stride_out": "i32"},
         {"WITH_ENTROPY": True, "WITH_COUNT": True, "BLOCK": block, "COMPUTE": compute, **cols}),
    ]  # fmt: skip
    for has_scale_h in (True, False):
        out.append(
            (f"write_grad{'' if has_scale_h else ' (no entropy gradient)'}", k._grad_kernel,
             {"X": f"*{x}", "stride_x": "i32", "G": f"*{x}", "stride_g": "i32", "n_cols": "i32",
              "MAX": f"*{c}", "THRESHOLD": f"*{c}", "LOG_NORM": f"*{c}", "BIAS": f"*{c}", "SCALE_H": f"*{c}",
              "inv_t": "fp32"},
             {"HAS_SCALE_H": has_scale_h, "BLOCK": block, "COMPUTE": compute})
        )  # fmt: skip
    return out


def ptxas_report(ptx: str, arch: str) -> dict:
    """Registers and spill bytes `ptxas -v` reports for one kernel's PTX."""
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(ptx)
        f.flush()
        done = subprocess.run(
            [ptxas, "-v", "--gpu-name", arch, f.name, "-o", os.devnull], capture_output=True, text=True
        )
    text = done.stdout + done.stderr
    regs = int(text.split("Used ")[1].split(" registers")[0])
    spills = [int(text.split(f" bytes spill {kind}")[0].rsplit(" ", 1)[1]) for kind in ("stores", "loads")]
    return {"registers": regs, "spill_bytes": sum(spills)}


def main() -> None:
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("kernels_aot: unset TRITON_INTERPRET (the interpreter's functions cannot be compiled)")
    rows = []
    for arch, target in TARGETS.items():
        for x, compute in DTYPES.items():
            for name, fn, signature, constexprs in kernels(x, compute):
                source = ASTSource(fn=fn, signature={**signature, **dict.fromkeys(constexprs, "constexpr")},
                                   constexprs=constexprs)  # fmt: skip
                compiled = triton.compile(
                    source, target=target, options={"num_warps": k._warps(constexprs["BLOCK"])}
                )
                rows.append(
                    {"arch": arch, "dtype": x, "kernel": name, **ptxas_report(compiled.asm["ptx"], arch)}
                )
    print(json.dumps({"triton": triton.__version__, "kernels": rows}))


if __name__ == "__main__":
    main()
