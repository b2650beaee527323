"""What `bench.step` reports besides the raw measurement: the step's model FLOPs and its share of a matmul's
rate measured in the same run (MFU), the table it prints, and the entries it records in the planner's file
of GPU-measured peaks (`megatron_tail/plan/measured_peaks.json`; `tests/plan/test_measured_peaks.py` holds
the planner to it on every commit)."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import time
from pathlib import Path

import torch

GIB = 1 << 30
MEASURED_PEAKS = Path(__file__).resolve().parents[1] / "plan" / "measured_peaks.json"
ENTRY_FIELDS = (
    "date", "gpu", "torch", "commit", "shape", "model", "tokens", "samples", "prompt_tokens",
    "response_tokens", "recompute", "fused_output_layer", "op_backend", "state", "peak_bytes", "source",
)  # fmt: skip
"""Every entry of the measured-peaks file has these keys (`model`: the config.json fields of the shape, so
an entry outlives a renamed `SHAPES` key; `state`: "cold" for a first step, "steady" for the later ones)."""


def forward_flops(model: dict, lengths: list[int]) -> int:
    """Model FLOPs of one forward over sequences of `lengths` tokens, from `model` (config.json fields of a
    dense Qwen3): 2 per weight and token for the attention projections, the MLP and the output layer, and
    2 · 2 · heads · head_dim per (query, key) pair a causal mask keeps (QKᵀ and the product with V;
    s(s+1)/2 pairs in a sequence of s). Embedding lookups, norms and softmax are not counted."""
    h, heads, kv = model["hidden_size"], model["num_attention_heads"], model["num_key_value_heads"]
    d, ffn, layers = model["head_dim"], model["intermediate_size"], model["num_hidden_layers"]
    per_layer = h * heads * d * 2 + h * kv * d * 2 + 3 * h * ffn  # q and o, k and v, gate/up/down
    weights = layers * per_layer + h * model["vocab_size"]
    pairs = sum(s * (s + 1) // 2 for s in lengths)
    return 2 * sum(lengths) * weights + layers * 4 * heads * d * pairs


def step_flops(model: dict, lengths: list[int]) -> int:
    """Model FLOPs of one RL step: θ_old is a forward, the update a forward and a backward (twice a
    forward's). Recomputed forwards (`model.recompute`) are not counted: MFU counts the model's FLOPs,
    not the hardware's."""
    return 4 * forward_flops(model, lengths)


def matmul_rate(device: str, dtype: torch.dtype, n: int, repeats: int = 5) -> float:
    """FLOP/s of `[n, n] @ [n, n]` in `dtype` on `device`: 2n³ over the median of `repeats` calls after a
    warm-up, measured now (the run's own ceiling for MFU)."""
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    times = []
    for i in range(repeats + 1):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        torch.mm(a, b)
        if device == "cuda":
            torch.cuda.synchronize()
        if i:
            times.append(time.perf_counter() - t0)
    return 2 * n**3 / statistics.median(times)


def _gib(n: int | None) -> str:
    if n is None:
        return "—"
    return f"{n / GIB:.2f} GiB" if n >= GIB / 10 else f"{n / (1 << 20):.2f} MiB"


def result_rows(r: dict) -> list[tuple[str, str]]:
    """(what, value) rows of a `bench.step` result, as printed and as the GPU check's table records them."""
    steady, cold = r["steady_steps"], r["steps"][0]
    no_peak = "— (no allocator peak on the CPU)"
    moments = r["predicted_moment_bytes"]
    ratio = r["measured_over_predicted"]
    cold_ratio = r["cold_over_predicted_less_moments"]
    return [
        ("model", f"{r['shape']} (random init), {r['tokens']} tokens = {r['samples']} × "
                  f"({r['prompt_tokens']} + {r['response_tokens']}) in {r['micro_batches']} micro-batch(es)"),
        ("device, op backend, recompute, fused output layer",
         f"{r['device']}, {r['op_backend']}, {r['recompute']}, {'yes' if r['fused_output_layer'] else 'no'}"),
        ("gradient-accumulation fusion (model.gradient_accumulation_fusion)",
         "on" if r.get("gradient_accumulation_fusion") else "off"),
        ("the output layer's weight gradient",
         "added into DDP's main_grad in the backward" if r.get("output_grad_into_main_grad")
         else "returned, then added to main_grad by DDP's hook"),
        ("steps", f"{len(r['steps'])}: the first warms up, the other {len(steady)} are measured"),
        ("plan: trainer total less reserve",
         f"{_gib(r['predicted_bytes'])} (Adam's moments {_gib(moments)})"),
        ("steady-state peak, max over the measured steps",
         no_peak if ratio is None else f"{_gib(r['peak_bytes'])} = {ratio:.3f} × the plan"),
        ("first step's peak (size a job by the larger)",
         no_peak if cold_ratio is None else
         f"{_gib(r['cold_peak_bytes'])} = {cold_ratio:.3f} × the plan less the moments: the first "
         "optimizer.step() allocates Adam's moments after the step's activation peak"),
        ("θ_old recompute, median (first step)",
         f"{r['old_policy_s'] * 1e3:.0f} ms ({cold['old_policy_s'] * 1e3:.0f} ms)"),
        ("update, median (first step)", f"{r['update_s'] * 1e3:.0f} ms ({cold['update_s'] * 1e3:.0f} ms)"),
        ("model FLOPs per step (θ_old fwd, update fwd + bwd)", f"{r['step_flops'] / 1e12:.3g} TFLOP"),
        (f"model FLOP/s, MFU against the {r['matmul_label']}",
         f"{r['flops_per_s'] / 1e12:.3g} TFLOP/s = {100 * r['mfu']:.1f}% of "
         f"{r['matmul_flops_per_s'] / 1e12:.3g} TFLOP/s"),
        ("the op alone, fwd + bwd in place" + (", unfused (the fused layer's own time is inside the update)"
                                                 if r["fused_output_layer"] else ""),
         f"{r['op_s'] * 1e3:.1f} ms ({100 * r['op_share_of_step']:.1f}% of the step)"),
    ]  # fmt: skip


def format_result(r: dict) -> str:
    return "\n".join(["| what | value |", "|---|---|", *(f"| {a} | {b} |" for a, b in result_rows(r))])


def _commit(cwd: Path = MEASURED_PEAKS.parent) -> str | None:
    """The code a measurement ran: `MT_COMMIT` where set, else git's short HEAD, with "+uncommitted" where
    tracked files differ from it. A lent GPU's copy of the working tree can sit on an older HEAD (the
    device tool's machine held the landed commit while the tree was 98ed5a5's: the 2026-12-01 record), so
    `scripts/gpu_session.sh` says to pass `MT_COMMIT` in the command."""
    if os.environ.get("MT_COMMIT"):
        return os.environ["MT_COMMIT"]

    def git(*args: str) -> str:
        done = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=10)
        return done.stdout.strip() if done.returncode == 0 else ""

    try:
        head = git("rev-parse", "--short", "HEAD")
        changed = head and git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return None
    return (head + "+uncommitted" if changed else head) or None


def measurement_entries(r: dict, model: dict, date: str) -> list[dict]:
    """The result's two peaks as entries of the measured-peaks file (`ENTRY_FIELDS`): the first step's
    ("cold") and the steady state's. `peak_bytes` is None where the device has no allocator peak."""
    gpu = torch.cuda.get_device_name() if r["device"] == "cuda" else "cpu"
    common = {
        "date": date, "gpu": gpu, "torch": torch.__version__, "commit": _commit(), "shape": r["shape"],
        "model": model, "tokens": r["tokens"], "samples": r["samples"], "prompt_tokens": r["prompt_tokens"],
        "response_tokens": r["response_tokens"], "recompute": r["recompute"],
        "fused_output_layer": r["fused_output_layer"], "op_backend": r["op_backend"],
        "source": f"bench.step, {len(r['steps'])} steps",
    }  # fmt: skip
    return [
        {**common, "state": "cold", "peak_bytes": r["cold_peak_bytes"]},
        {**common, "state": "steady", "peak_bytes": r["peak_bytes"]},
    ]


def append_entries(path: Path, entries: list[dict]) -> None:
    """Add `entries` to the measured-peaks file at `path` (created if absent), one entry per line."""
    data = json.loads(path.read_text()) if path.is_file() else {"entries": []}
    data["entries"] += entries
    path.write_text(dumps_entries(data))


def dumps_entries(data: dict) -> str:
    """The file's text: its keys, then one JSON entry per line (diffs of a new measurement stay readable)."""
    keys = {k: v for k, v in data.items() if k != "entries"}
    head = "".join(f"  {json.dumps(k)}: {json.dumps(v, ensure_ascii=False)},\n" for k, v in keys.items())
    entries = ",\n".join(f"    {json.dumps(e, ensure_ascii=False)}" for e in data["entries"])
    return "{\n" + head + f'  "entries": [\n{entries}\n  ]\n}}\n'
