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
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.runtime.jit import create_function_from_signature

from megatron_tail.ops import triton_kernels as k

TARGETS = {"sm_90a": GPUTarget("cuda", 90, 32), "sm_80": GPUTarget("cuda", 80, 32)}
"""Hopper (H100, H200) and Ampere (A100)."""
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


SAMPLE_ROWS, SAMPLE_COLS = 6, 160
"""The wrappers' sample launch (`launches`): no integer argument is 1 (the JIT would make it a constexpr)."""
WRAPPERS = {"row_max": "_row_max_kernel", "partial_sums": "_partials_kernel",
            "max_and_sums": "_max_and_sums_kernel", "write_grad": "_grad_kernel"}  # fmt: skip


class _Recorded:
    """A recording stand-in for one JIT kernel: `kernel[grid](*args, **kwargs)` keeps the call."""

    def __init__(self, calls: list):
        self.calls = calls

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.calls.append((args, kwargs))


def launches(x: str, target: GPUTarget) -> dict[str, tuple[object, dict, dict]]:
    """What each wrapper of `triton_kernels` launches for `x` logits, as `JITFunction.run` would specialize it
    on `target`: {name: (kernel, signature, constexprs)}. The wrappers run on CPU tensors with each kernel
    replaced by a recording stand-in, and the recorded call goes through Triton's own binder
    (`triton.runtime.jit.create_function_from_signature`, what `JITFunction.run` calls first), so the
    signature is the launch's (a float argument's type included), not one written here."""
    dtype = TORCH_DTYPES[x]
    compute = torch.float64 if dtype == torch.float64 else torch.float32
    n, v = SAMPLE_ROWS, SAMPLE_COLS
    logits = torch.randn(n, v, dtype=torch.float32).to(dtype)
    rows = torch.zeros(n, dtype=compute)
    target_col, owned = torch.zeros(n, dtype=torch.int64), torch.ones(n, dtype=torch.bool)
    calls: dict[str, list] = {name: [] for name in WRAPPERS}
    saved = {name: getattr(k, fn) for name, fn in WRAPPERS.items()}
    try:
        for name, fn in WRAPPERS.items():
            setattr(k, fn, _Recorded(calls[name]))
        k.row_max(logits, compute)
        k.partial_sums(logits, rows, rows, 0.7, target_col, owned, True, True)
        k.max_and_sums(
            logits,
            compute,
            offset=-1.5,
            prune=True,
            inv_temperature=0.7,
            local_target=target_col,
            owned=owned,
            with_entropy=True,
            with_count=True,
            launch=k.ONE_PROGRAM_CANDIDATES[0],
        )
        k.write_grad(logits, logits, max_logit=rows, threshold=rows, log_norm=rows, bias=rows, scale_h=rows,
                     inv_temperature=0.7, targets=target_col, target_start=3, target_add=rows)  # fmt: skip
    finally:
        for name, fn in WRAPPERS.items():
            setattr(k, fn, saved[name])
    backend = make_backend(target)
    out = {}
    for name in WRAPPERS:
        [(args, kwargs)] = calls[name]
        kernel = saved[name]
        binder = create_function_from_signature(kernel.signature, kernel.params, backend)
        _, specialization, _ = binder(*args, **kwargs)
        signature, constexprs = {}, {}
        for param, (ty, value) in zip(kernel.params, specialization, strict=True):
            if ty == "constexpr":
                constexprs[param.name] = value
            else:
                signature[param.name] = ty
        out[name] = (kernel, signature, constexprs)
    return out


def kernels(x: str, target: GPUTarget) -> list[tuple[str, object, dict, dict, int]]:
    """(name, kernel, signature, constexprs, warps) of every kernel for logits of dtype `x`, as the wrappers
    launch them (`launches`) on `target` at Qwen3's vocabulary (`launch_tile`, `one_program_launch`)."""
    launched = launches(x, target)
    out = []
    for name, (fn, signature, constexprs) in launched.items():
        if name == "max_and_sums":
            tile = one_program_launch(x, target)
        else:
            tile = launch_tile("grad" if name == "write_grad" else name, x, target)
        constexprs = {**constexprs, "BLOCK": tile.block}
        if name != "write_grad":
            out.append((name, fn, signature, constexprs, tile.num_warps))
            continue
        for has_scale_h in (True, False):
            for has_target in (False, True):  # the fused backward's blocks without a support: the target too
                variant = f"write_grad{'' if has_scale_h else ' (no entropy gradient)'}"
                variant += " (the target's column)" if has_target else ""
                flags = {**constexprs, "HAS_SCALE_H": has_scale_h, "HAS_TARGET": has_target}
                out.append((variant, fn, signature, flags, tile.num_warps))
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
F64_OP = re.compile(r"^\s*(?:@!?%\w+\s+)?(?!cvt\.rn\.f32\.f64)[a-z][\w.]*\.f64\b", re.M)
"""A PTX instruction on float64 values, predicated or not, other than the one rounding of a float64 argument
to float32 (`cvt.rn.f32.f64`; the argument's own load is `ld.param.b64`)."""
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
        # LDG and a pipelined loop's LDGSTS (global into shared) load; LDGDEPBAR only fences the latter
        loaded = sum(
            LOAD_BYTES.get(op.split(".")[-1], 4) for op in body if op.startswith("LDG") and op != "LDGDEPBAR"
        )
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
        for x in TORCH_DTYPES:
            for name, fn, signature, constexprs, warps in kernels(x, target):
                compiled = compile_kernel(fn, signature, constexprs, warps, target)
                row = {"arch": arch, "dtype": x, "kernel": name, "tile": [constexprs["BLOCK"], warps],
                       **ptxas_report(compiled.asm["ptx"], arch)}  # fmt: skip
                if name in ("row_max", "max_and_sums"):  # pass 1's max keeps a NaN (`_walk_max`)
                    row["max_nan"] = "max.NaN." in compiled.asm["ptx"]
                # a float64 scalar argument (`triton_kernels._as_compute`) must not turn a 16- / 32-bit
                # kernel's arithmetic into float64: only its rounding to float32 may name f64
                row["f64_ops"] = len(F64_OP.findall(compiled.asm["ptx"]))
                row["float_args"] = {n: t for n, t in signature.items() if t[:2] in ("fp", "bf")}
                if (arch, x) == LOOPS_OF:
                    row["loops"] = inner_loops(compiled.asm["cubin"], TORCH_DTYPES[x].itemsize)
                rows.append(row)
    print(json.dumps({"triton": triton.__version__, "kernels": rows, "one_program": one_program_rows()}))


L2_POLICY = re.compile(r"createpolicy\.fractional\.L2::(evict_first|evict_last)\.b64")
"""An L2 eviction priority in PTX: what `tl.load(eviction_policy=…)` lowers to on sm_80+ (with the load's
`.L2::cache_hint` operand)."""


def one_program_rows() -> list[dict]:
    """Each `ONE_PROGRAM_CANDIDATES` launch of the one-program forward, compiled for Hopper at bf16: its
    registers and shared memory, whether `programs_per_sm` of its programs fit one SM at once (registers
    allocated per thread in multiples of 8, `HOPPER_SM`), the L2 priorities its PTX asks for, its
    asynchronous copies into shared memory (a pipelined loop's loads), and its inner loops' SASS
    instructions per element. A persistent grid whose programs do not all fit runs as two waves:
    twice the time, and the rows in flight are not what the launch says."""
    _, fn, signature, constexprs, _ = next(
        r for r in kernels("bf16", TARGETS["sm_90a"]) if r[0] == "max_and_sums"
    )
    rows = []
    for launch in k.ONE_PROGRAM_CANDIDATES:
        tile = k.one_program_tile(launch, torch.bfloat16, 151_936)
        flags = {**constexprs, "BLOCK": tile.block, "PASS1_EVICTION": launch.pass1_eviction,
                 "PASS2_EVICTION": launch.pass2_eviction, "PASS1_STAGES": launch.pass1_stages}  # fmt: skip
        compiled = compile_kernel(fn, signature, flags, tile.num_warps, TARGETS["sm_90a"])
        report = ptxas_report(compiled.asm["ptx"], "sm_90a")
        threads = 32 * tile.num_warps * launch.programs_per_sm
        registers = -(-report["registers"] // 8) * 8 * threads
        shared = compiled.metadata.shared * launch.programs_per_sm
        rows.append(
            {"launch": [tile.block, tile.num_warps, launch.programs_per_sm], **report,
             "evictions": [launch.pass1_eviction, launch.pass2_eviction], "pass1_stages": launch.pass1_stages,
             "l2_policies": sorted(set(L2_POLICY.findall(compiled.asm["ptx"]))),
             "async_copies": compiled.asm["ptx"].count("cp.async.cg.shared.global"),
             "shared_bytes": compiled.metadata.shared,
             "loops": inner_loops(compiled.asm["cubin"], 2),
             "fits": threads <= HOPPER_SM["threads"] and registers <= HOPPER_SM["registers"]
             and shared <= HOPPER_SM["shared_bytes"]}
        )  # fmt: skip
    return rows


if __name__ == "__main__":
    main()
