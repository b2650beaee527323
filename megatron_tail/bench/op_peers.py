"""The op against its peers on one device, as the trainer runs it: the Triton and PyTorch backends, forward +
backward in place and forward only (θ_old and the reference are forward-only passes), against torch's and
megatron-core's cross entropy and, where installed, Liger-Kernel's; each row's time, peak memory and share of
the memory bandwidth (the bytes its passes must move over the copy rate measured in the same run).

    python -m megatron_tail.bench.op --device cuda [--tokens 16384] [--vocab 151936]

On a GPU this is the table the op issue's targets refer to (`tests/gpu/test_op_cuda.py` records the same
rows in `scripts/gpu_check.sh`'s table). Elsewhere it runs on the CPU (the Triton rows under Triton's
interpreter, tiny shapes: a check of the code path, not a measurement).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from .tensor_memory import LiveTensorBytes

LOG_RHO = -13.0
QWEN3_VOCAB = 151_936


def make_logits(
    tokens: int, vocab: int = QWEN3_VOCAB, *, device: str = "cuda", seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """bf16 logits `[tokens, vocab]` and int64 targets `[tokens]` on `device`.

    Three kinds of rows (row % 3), each N(0, 2²) plus 3 raised tokens: flat (+0: DVP at log ρ = −13 keeps
    nearly everything), long tail (+14: the tail below max − 13 holds a few % of the mass, the case DVP is
    for), peaked (+25: V_S is the 3 raised tokens). Targets (row % 4): the argmax, or a uniform id (then
    often outside V_S on the last two kinds, force-kept by the op).
    """
    g = torch.Generator(device=device).manual_seed(seed)
    logits = torch.randn(tokens, vocab, device=device, dtype=torch.bfloat16, generator=g) * 2
    rows = torch.arange(tokens, device=device)
    raised = torch.randint(0, vocab, (tokens, 3), device=device, generator=g)
    bump = torch.tensor([0.0, 14.0, 25.0], device=device, dtype=torch.bfloat16)[rows % 3]
    logits.scatter_add_(1, raised, bump[:, None].expand(-1, 3).contiguous())
    uniform = torch.randint(0, vocab, (tokens,), device=device, generator=g)
    targets = torch.where(rows % 4 < 2, logits.argmax(dim=1), uniform)
    return logits, targets


LAUNCH_COVER_CYCLES = 2_000_000
"""`torch.cuda._sleep`'s spin before each timed call: about 1 ms at an H100's or H200's 1.7–2 GHz."""


def measure(
    run: Callable[..., object],
    *,
    repeats: int = 5,
    prepare: Callable[[], object] | None = None,
    keep_result: bool = False,
) -> dict:
    """Median milliseconds and peak extra memory (bytes above what was allocated before) of `run()`, after one
    warm-up call; `prepare()` runs before each call, outside the timed region (a fresh clone for a variant
    that takes its input over), and its result is passed to `run`. On CUDA: CUDA events and
    `torch.cuda.max_memory_allocated`; elsewhere wall time, and the peak of the tensor storage of the warm-up
    call (`tensor_memory.LiveTensorBytes`, which slows every op, so never a timed call): `repeats` + 1 calls
    in all, as on CUDA. `repeats=0`, off CUDA only: that counted call alone, its wall time as "ms" (slowed by
    the counting: a CPU test's smoke figure, not a measurement), for tests that check a table's rows and
    each path's memory under Triton's interpreter, where every call costs seconds. `keep_result`: what the
    last call returned, under "result" (a caller that checks the values too need not run it once more; held
    only after the last call, so no measured peak includes it)."""
    cuda = torch.cuda.is_available()
    if repeats < (1 if cuda else 0):
        raise ValueError(f"measure: repeats ≥ 1 on CUDA (≥ 0 elsewhere: the counted call), got {repeats}")
    times, peak = [], 0
    result = None
    if not cuda:  # the warm-up: nothing to compile or cache off CUDA that one untimed call would not
        held = prepare() if prepare is not None else None
        t0 = time.perf_counter()
        with LiveTensorBytes() as counted:
            result = run() if held is None else run(held)
        if repeats == 0:
            times.append((time.perf_counter() - t0) * 1e3)
        peak = counted.peak
        del held
    warm_ups = 1 if cuda else 0  # CUDA's first call warms kernels and the caching allocator up
    for i in range(warm_ups + repeats):
        result = None  # the previous call's: freed before this one's base memory is read
        held = prepare() if prepare is not None else None
        if cuda:
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            # the device busy for ~1 ms before the start event, so the call's launches queue behind it and
            # only device time is timed: on an idle device, the host's launch of a call's first kernels
            # (15 small ops before our first [N, V] kernel, ~2 before Liger's) fell inside the events
            torch.cuda._sleep(LAUNCH_COVER_CYCLES)
            start.record()
        t0 = time.perf_counter()
        result = run() if held is None else run(held)
        if cuda:
            end.record()
            torch.cuda.synchronize()
        elapsed = start.elapsed_time(end) if cuda else (time.perf_counter() - t0) * 1e3
        if i >= warm_ups:
            times.append(elapsed)
            if cuda:
                peak = max(peak, torch.cuda.max_memory_allocated() - base)
        del held
    measured = {"ms": statistics.median(times), "peak_bytes": peak}
    return {**measured, "result": result} if keep_result else measured


def error_line(error: BaseException, limit: int) -> str:
    """`error` on one line for a table: its type and the first `limit` characters of its message's first line
    (a CUDA OOM's message runs to a paragraph)."""
    text = str(error)
    return f"{type(error).__name__}: {text.splitlines()[0][:limit] if text else ''}"


def copy_rate(logits: torch.Tensor) -> float:
    """Bytes per millisecond of a device copy of `logits` (one read + one write), measured now."""
    out = torch.empty_like(logits)
    ms = measure(lambda: out.copy_(logits))["ms"]
    return 2 * logits.numel() * logits.element_size() / ms


def op_run(logits, targets, backend: str, forward_only: bool):
    """One call of the op as the rows time it: forward only (no graph), or fwd + bwd in place on a fresh clone
    (`run(fresh)`), DVP at `LOG_RHO` + entropy."""
    from megatron_tail.ops import vocab_parallel_masked_logprobs

    def run(fresh=None):
        kwargs = dict(log_rho=LOG_RHO, vocab_size=logits.shape[1], backend=backend)
        if forward_only:
            with torch.no_grad():
                vocab_parallel_masked_logprobs(logits, targets, **kwargs)
            return
        out = vocab_parallel_masked_logprobs(fresh.requires_grad_(), targets, inplace_backward=True, **kwargs)
        (out.logprobs.sum() + out.entropy.sum()).backward()

    return run


def _torch_ce(targets):
    def run(fresh):
        torch.nn.functional.cross_entropy(fresh.requires_grad_(), targets).backward()

    return run


def _megatron_ce(targets):
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    def run(fresh):  # it overwrites its input, as in a trainer
        vocab_parallel_cross_entropy(fresh.requires_grad_(), targets).sum().backward()

    return run


def _liger_ce(targets):
    try:
        from liger_kernel.transformers import LigerCrossEntropyLoss
    except ImportError:
        return None
    loss = LigerCrossEntropyLoss()

    def run(fresh):  # its gradient is written over its input during forward
        loss(fresh.requires_grad_(), targets).backward()

    return run


def peer_rows(tokens: int, vocab: int, *, device: str, repeats: int = 5, megatron: bool = True) -> list[dict]:
    """The table's rows: `what`, `ms`, `peak_gib`, `bandwidth` (the share of the copy rate its passes'
    bytes reach; None for the peers, whose passes we do not count), and the ratio to the baseline row
    (Liger's cross entropy where installed, else torch's). `megatron`: include megatron-core's cross
    entropy (needs its TP state: `tests.gpu.common.megatron_tp1`, or the CPU patches)."""
    logits, targets = make_logits(tokens, vocab, device=device)
    size = logits.numel() * logits.element_size()
    rate = copy_rate(logits)
    fresh = logits.clone
    variants: list[tuple[str, Callable | None, Callable | None, float | None]] = [
        ("op, Triton, DVP + entropy, in place, fwd+bwd", op_run(logits, targets, "triton", False), fresh, 4),
        ("op, PyTorch, DVP + entropy, in place, fwd+bwd", op_run(logits, targets, "torch", False), fresh, 4),
        ("op, Triton, forward only", op_run(logits, targets, "triton", True), None, 2),
        ("op, PyTorch, forward only", op_run(logits, targets, "torch", True), None, 2),
        ("torch cross_entropy, fwd+bwd", _torch_ce(targets), fresh, None),
        ("Liger-Kernel CE, fwd+bwd (gradient in place)", _liger_ce(targets), fresh, None),
    ]
    if megatron:
        variants.append(("megatron-core CE, fwd+bwd", _megatron_ce(targets), fresh, None))
    rows = []
    for what, run, prepare, passes in variants:
        if run is None:
            rows.append(
                {"what": what, "ms": None, "peak_gib": None, "bandwidth": None, "note": "not installed"}
            )
            continue
        m = measure(run, repeats=repeats, prepare=prepare)
        bandwidth = None if passes is None else passes * size / m["ms"] / rate
        rows.append(
            {"what": what, "ms": m["ms"], "peak_gib": m["peak_bytes"] / (1 << 30), "bandwidth": bandwidth}
        )
    baseline = next((r for r in rows if r["what"].startswith("Liger") and r["ms"]), rows[4])
    for row in rows:
        row["baseline"] = baseline["what"]
        row["ratio"] = None if row["ms"] is None else row["ms"] / baseline["ms"]
    return rows


def baseline_row(rows: list[dict]) -> dict:
    """The row `peer_rows` took as its baseline (each row names it under "baseline")."""
    return next(r for r in rows if r["what"] == rows[0]["baseline"])


def format_rows(rows: list[dict], tokens: int, vocab: int, device: str, backend_note: str = "") -> str:
    header = "| what | ms | × baseline | peak GiB | share of copy rate |"
    lines = [
        f"The op against its peers: {tokens} × {vocab} bf16 logits on {device}{backend_note}",
        "",
        header,
    ]
    lines.append("|---|---|---|---|---|")
    for r in rows:
        if r["ms"] is None:
            lines.append(f"| {r['what']} | — | — | — | {r.get('note', '')} |")
            continue
        share = "—" if r["bandwidth"] is None else f"{100 * r['bandwidth']:.0f}%"
        lines.append(f"| {r['what']} | {r['ms']:.2f} | {r['ratio']:.2f} | {r['peak_gib']:.2f} | {share} |")
    lines += ["", f"baseline: {rows[0]['baseline']}"]
    return "\n".join(lines)
