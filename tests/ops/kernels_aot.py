"""Compile the op's Triton kernels ahead of time for NVIDIA targets, without a GPU (Triton's own compiler and
its bundled `ptxas`), and report `ptxas -v`'s registers and spills per kernel, and for bf16 on Hopper the
SASS instructions per element of each inner loop (`inner_loops`), as one JSON line.

    python -m tests.ops.kernels_aot          # TRITON_INTERPRET unset: the compiled path, not the interpreter

Run by `test_kernels_compile.py` in a process of its own: the test session runs Triton's interpreter, and a
JIT function made under it cannot be compiled."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile

import torch
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from megatron_tail.ops import triton_kernels as k

TARGETS = {"sm_90a": GPUTarget("cuda", 90, 32), "sm_80": GPUTarget("cuda", 80, 32)}
"""Hopper (H100, H200) and Ampere (A100)."""
DTYPES = {"bf16": tl.float32, "fp16": tl.float32, "fp32": tl.float32, "fp64": tl.float64}
"""Logits' dtype → the kernels' compute dtype (`triton_kernels._compute_dtype`)."""
TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "fp64": torch.float64}


def launch_tile(kernel: str, x: str, target: GPUTarget) -> k.Tile:
    """The tile `triton_kernels.tile` launches `kernel` with on `target` at Qwen3's vocabulary: the table's
    entry for that capability, or its default (the capability lookup, without a GPU to ask)."""
    key = (kernel, k._width_class(TORCH_DTYPES[x]))
    return k.TILES.get((*key, divmod(target.arch, 10)), k.TILES[(*key, None)])


def one_program_launch(x: str, target: GPUTarget) -> k.Tile:
    """The one-program forward's tile on `target` at Qwen3's vocabulary: the table's entry, or while none is
    measured the candidate with the most threads per program (`ONE_PROGRAM_CANDIDATES`), which leaves each
    the fewest registers."""
    measured = k.ONE_PROGRAM.get((k._width_class(TORCH_DTYPES[x]), divmod(target.arch, 10)))
    launch = measured or max(k.ONE_PROGRAM_CANDIDATES, key=lambda c: c.tile.num_warps)
    return k.one_program_tile(launch, TORCH_DTYPES[x], 151_936)


def kernels(x: str, compute, target: GPUTarget) -> list[tuple[str, object, dict, dict, int]]:
    """(name, kernel, signature, constexprs, warps) of every kernel for logits of dtype `x`, as the wrappers
    launch them on `target` at Qwen3's vocabulary (`launch_tile`)."""
    row_max, sums, grad = (launch_tile(name, x, target) for name in k.KERNELS)
    c = "fp64" if compute == tl.float64 else "fp32"
    cols = k.PARTIAL_COLUMNS
    out = [
        ("row_max", k._row_max_kernel, {"X": f"*{x}", "stride_x": "i32", "n_cols": "i32", "OUT": f"*{c}"},
         {"BLOCK": row_max.block, "COMPUTE": compute}, row_max.num_warps),
        ("partial_sums", k._partials_kernel,
         {"X": f"*{x}", "stride_x": "i32", "n_cols": "i32", "MAX": f"*{c}", "THRESHOLD": f"*{c}",
          "TARGET_COL": "*i64", "OWNED": "*i8", "exp2_scale": "fp32", "OUT": f"*{c}", "stride_out": "i32"},
         {"WITH_ENTROPY": True, "WITH_COUNT": True, "BLOCK": sums.block, "COMPUTE": compute, **cols},
         sums.num_warps),
    ]  # fmt: skip
    launch = one_program_launch(x, target)
    out.append(
        ("max_and_sums", k._max_and_sums_kernel,
         {"X": f"*{x}", "stride_x": "i32", "n_rows": "i32", "n_cols": "i32", "OFFSET": f"*{c}",
          "TARGET_COL": "*i64", "OWNED": "*i8", "exp2_scale": "fp32", "MAX": f"*{c}", "THRESHOLD": f"*{c}",
          "OUT": f"*{c}", "stride_out": "i32"},
         {"PRUNE": True, "WITH_ENTROPY": True, "WITH_COUNT": True, "BLOCK": launch.block,
          "COMPUTE": compute, **cols, "MAX_FLOAT": torch.finfo(TORCH_DTYPES[c]).max},
         launch.num_warps)
    )  # fmt: skip
    for has_scale_h in (True, False):
        out.append(
            (f"write_grad{'' if has_scale_h else ' (no entropy gradient)'}", k._grad_kernel,
             {"X": f"*{x}", "stride_x": "i32", "G": f"*{x}", "stride_g": "i32", "n_cols": "i32",
              "MAX": f"*{c}", "THRESHOLD": f"*{c}", "LOG_NORM": f"*{c}", "BIAS": f"*{c}", "SCALE_H": f"*{c}",
              "inv_t": "fp32"},
             {"HAS_SCALE_H": has_scale_h, "BLOCK": grad.block, "COMPUTE": compute}, grad.num_warps)
        )  # fmt: skip
    return out


ALIGNED_INTS = ("stride_x", "stride_g", "n_cols")
"""Integer arguments that are multiples of 16 at Qwen3's vocabulary (151,936 columns, whole or split over
TP = 2, 4, 8): the JIT specializes them, and every pointer from torch's allocator, as 16-divisible
(`BaseBackend.get_int_specialization`), which is what lets it vectorize the loads."""


def compile_kernel(fn, signature: dict, constexprs: dict, warps: int, target: GPUTarget):
    """`triton.compile` of one kernel for `target` as the JIT compiles it for Qwen3-sized rows (`ALIGNED_INTS`
    and the pointers divisible by 16)."""
    names = list(signature)
    attrs = {
        (fn.arg_names.index(name),): [["tt.divisibility", 16]]
        for name in names
        if signature[name].startswith("*") or name in ALIGNED_INTS
    }
    source = ASTSource(fn=fn, signature={**signature, **dict.fromkeys(constexprs, "constexpr")},
                       constexprs=constexprs, attrs=attrs)  # fmt: skip
    return triton.compile(source, target=target, options={"num_warps": warps})


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


HOPPER_SM = {"threads": 2048, "registers": 65_536, "shared_bytes": 228 * 1024}
"""What one H100 / H200 SM holds at once (CUDA C Programming Guide, compute capability 9.0)."""
LOOPS_OF = ("sm_90a", "bf16")
"""The target and logits dtype whose SASS loops are reported: the measured GPU and the training dtype
(`cuobjdump` takes half a second a kernel)."""
LOAD_BYTES = {"128": 16, "64": 8, "U16": 2, "S16": 2, "U8": 1, "S8": 1}
"""Bytes one thread loads per `LDG.E[.suffix]` (no suffix: 4)."""
SASS_LINE = re.compile(r"\s+/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);")


def inner_loops(cubin: bytes, element_bytes: int) -> list[dict]:
    """The innermost loops of a kernel's SASS (`cuobjdump -sass`; a loop is a branch back to an earlier
    address, innermost when no other loop lies inside it): `instructions` per iteration, the logits
    `elements` one thread loads per iteration (its `LDG`s' bytes over `element_bytes`), `per_element`, and
    its `exp`onentials (`MUFU.EX2`: pass 2's loops have them, pass 1's do not). In a pass bound by
    instructions, not memory, `per_element` is its cost."""
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        sass = subprocess.run([cuobjdump, "-sass", f.name], capture_output=True, text=True, check=True).stdout
    code = [(int(m[1], 16), m[2], m[3]) for m in SASS_LINE.finditer(sass)]
    loops = []
    for address, op, rest in code:
        target = re.search(r"0x([0-9a-f]+)", rest) if op.startswith("BRA") else None
        if target and int(target[1], 16) < address:
            loops.append((int(target[1], 16), address))
    out = []
    for start, end in loops:
        if any(start <= s and e <= end and (s, e) != (start, end) for s, e in loops):
            continue  # an outer loop
        body = [op for address, op, _ in code if start <= address <= end]
        loaded = sum(LOAD_BYTES.get(op.split(".")[-1], 4) for op in body if op.startswith("LDG"))
        elements = loaded // element_bytes
        if elements:
            out.append({"instructions": len(body), "elements": elements,
                        "per_element": round(len(body) / elements, 3),
                        "exp": sum(op.startswith("MUFU.EX2") for op in body)})  # fmt: skip
    return out


def main() -> None:
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("kernels_aot: unset TRITON_INTERPRET (the interpreter's functions cannot be compiled)")
    rows = []
    for arch, target in TARGETS.items():
        for x, compute in DTYPES.items():
            for name, fn, signature, constexprs, warps in kernels(x, compute, target):
                compiled = compile_kernel(fn, signature, constexprs, warps, target)
                row = {"arch": arch, "dtype": x, "kernel": name, "tile": [constexprs["BLOCK"], warps],
                       **ptxas_report(compiled.asm["ptx"], arch)}  # fmt: skip
                if name in ("row_max", "max_and_sums"):  # pass 1's max keeps a NaN (`_walk_max`)
                    row["max_nan"] = "max.NaN." in compiled.asm["ptx"]
                if (arch, x) == LOOPS_OF:
                    row["loops"] = inner_loops(compiled.asm["cubin"], TORCH_DTYPES[x].itemsize)
                rows.append(row)
    print(json.dumps({"triton": triton.__version__, "kernels": rows, "one_program": one_program_rows()}))


def one_program_rows() -> list[dict]:
    """Each `ONE_PROGRAM_CANDIDATES` launch of the one-program forward, compiled for Hopper at bf16: its
    registers and shared memory, and whether `programs_per_sm` of its programs fit one SM at once (registers
    allocated per thread in multiples of 8, `HOPPER_SM`). A persistent grid whose programs do not all fit runs
    as two waves: twice the time, and the rows in flight are not what the launch says."""
    _, fn, signature, constexprs, _ = next(
        r for r in kernels("bf16", DTYPES["bf16"], TARGETS["sm_90a"]) if r[0] == "max_and_sums"
    )
    rows = []
    for launch in k.ONE_PROGRAM_CANDIDATES:
        tile = k.one_program_tile(launch, torch.bfloat16, 151_936)
        compiled = compile_kernel(fn, signature, {**constexprs, "BLOCK": tile.block}, tile.num_warps,
                                  TARGETS["sm_90a"])  # fmt: skip
        report = ptxas_report(compiled.asm["ptx"], "sm_90a")
        threads = 32 * tile.num_warps * launch.programs_per_sm
        registers = -(-report["registers"] // 8) * 8 * threads
        shared = compiled.metadata.shared * launch.programs_per_sm
        rows.append(
            {"launch": [tile.block, tile.num_warps, launch.programs_per_sm], **report,
             "fits": threads <= HOPPER_SM["threads"] and registers <= HOPPER_SM["registers"]
             and shared <= HOPPER_SM["shared_bytes"]}
        )  # fmt: skip
    return rows


if __name__ == "__main__":
    main()
