"""Benchmark of the DVP op against megatron-core's cross entropy and a naive torch version.

    python -m megatron_tail.bench.op [--tokens 2048] [--vocab 32768] [--tp 1 2] [--repeats 5]

Variants, each forward + backward on `[tokens, vocab/TP]` logits per rank:
  ours      `vocab_parallel_masked_logprobs` with DVP (log ρ = −13) and entropy; loss = Σ logprobs + Σ entropy
  megatron  megatron-core's `vocab_parallel_cross_entropy` (no mask, no entropy); it overwrites fp32
            inputs in place, so it gets a fresh clone each call (the clone is outside the timed region)
  naive     `reference_masked_logprobs` in float32: log_softmax over the masked logits + gather + entropy
Times: one run, variants interleaved, median over repeats (naive: one run), one intra-op thread per rank.
Memory (TP=1): each variant in a fresh subprocess; peak extra = ru_maxrss − RSS after allocating the
inputs, reported as a multiple of the logits tensor's size.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

import torch
import torch.distributed as dist

from megatron_tail.ops import vocab_parallel_masked_logprobs
from megatron_tail.ops.reference import reference_masked_logprobs
from megatron_tail.utils.forked import run_distributed

VARIANTS = ("ours", "megatron", "naive")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
LOG_RHO = -13.0


def make_inputs(tokens: int, vocab_local: int, dtype: torch.dtype, rank: int, seed: int = 0):
    """Logits `[tokens, vocab_local]` (N(0, 4²), a peaked first quarter of rows) and targets `[tokens]`.

    Filled in row blocks straight into `dtype`, so making them never holds more than the logits plus a
    small block (the memory probe subtracts the RSS after this call and reads the peak after the run).
    """
    gen = torch.Generator().manual_seed(seed + rank)
    logits = torch.empty(tokens, vocab_local, dtype=dtype)
    block = max(1, (1 << 20) // max(vocab_local, 1))
    for start in range(0, tokens, block):
        rows = logits[start : start + block]
        rows.copy_(torch.randn(rows.shape, generator=gen) * (12.0 if start < tokens // 4 else 4.0))
    targets = torch.randint(
        0, vocab_local * _tp_size(), (tokens,), generator=torch.Generator().manual_seed(seed)
    )
    return logits, targets


def _tp_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def run_variant(name: str, logits: torch.Tensor, targets: torch.Tensor, group) -> None:
    """One forward + backward of a variant; the input's gradient is produced in every case."""
    if name == "ours":
        x = logits.detach().requires_grad_()
        out = vocab_parallel_masked_logprobs(x, targets, log_rho=LOG_RHO, tp_group=group)
        (out.logprobs.sum() + out.entropy.sum()).backward()
    elif name == "megatron":
        from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

        x = logits.requires_grad_()  # the caller passes a fresh clone: megatron overwrites it
        vocab_parallel_cross_entropy(x, targets).sum().backward()
    elif name == "naive":
        if group is not None and dist.get_world_size(group) > 1:
            full = [torch.empty_like(logits) for _ in range(dist.get_world_size(group))]
            dist.all_gather(full, logits, group=group)
            logits = torch.cat(full, dim=-1)
        x = logits.detach().requires_grad_()
        out = reference_masked_logprobs(x, targets, log_rho=LOG_RHO, dtype=torch.float32)
        (out["logprobs"].sum() + out["entropy"].sum()).backward()
    else:
        raise ValueError(f"unknown variant {name!r}; expected one of {VARIANTS}")


def _init_megatron_tp(tp: int) -> None:
    from megatron.core import parallel_state

    from megatron_tail.patches import apply_cpu_patches

    apply_cpu_patches()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)


def _time_rank(rank: int, world: int, tokens: int, vocab: int, repeats: int) -> dict:
    torch.set_num_threads(1)
    _init_megatron_tp(world)
    group = dist.group.WORLD if world > 1 else None
    times: dict[str, dict[str, list[float]]] = {}
    for dname, dtype in DTYPES.items():
        for v in VARIANTS:  # warm up kernels and allocator on a small shape
            small, small_targets = make_inputs(8, max(vocab // world, 1), dtype, rank)
            run_variant(v, small, small_targets, group)
        logits, targets = make_inputs(tokens, vocab // world, dtype, rank)
        times[dname] = {v: [] for v in VARIANTS}
        for i in range(repeats):
            for v in VARIANTS:
                if v == "naive" and i:
                    continue  # 15-30× slower than the others: once is enough for its ratio
                x = logits.clone() if v == "megatron" else logits
                dist.barrier()
                t0 = time.perf_counter()
                run_variant(v, x, targets, group)
                dist.barrier()
                times[dname][v].append(time.perf_counter() - t0)
    return {d: {v: statistics.median(ts) for v, ts in per.items()} for d, per in times.items()}


def time_all(tokens: int, vocab: int, tp: int, repeats: int) -> dict:
    return run_distributed(_time_rank, tp, tokens, vocab, repeats, timeout=1800)[0]


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def memory_probe(variant: str, dtype_name: str, tokens: int, vocab: int) -> dict:
    """In a fresh process: peak RSS growth of one fwd+bwd beyond the inputs, in logits-sizes."""
    torch.set_num_threads(1)
    import megatron.core.tensor_parallel  # noqa: F401 - imports before the baseline RSS

    _init_single_process_group()
    _init_megatron_tp(1)
    run_variant(variant, *make_inputs(8, 64, DTYPES[dtype_name], 0), None)  # warm allocator and kernels
    logits, targets = make_inputs(tokens, vocab, DTYPES[dtype_name], 0)
    base = _rss_bytes()
    run_variant(variant, logits, targets, None)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    size = logits.numel() * logits.element_size()
    return {"extra_bytes": max(peak - base, 0), "logits_bytes": size}


def _init_single_process_group() -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)


def memory_all(tokens: int, vocab: int) -> dict:
    result: dict[str, dict[str, float]] = {}
    for dname in DTYPES:
        result[dname] = {}
        for v in VARIANTS:
            cmd = [sys.executable, "-m", "megatron_tail.bench.op", "--memory-probe", v, dname]
            cmd += ["--tokens", str(tokens), "--vocab", str(vocab)]
            out = (
                subprocess.run(cmd, check=True, capture_output=True, text=True)
                .stdout.strip()
                .splitlines()[-1]
            )
            probe = json.loads(out)
            result[dname][v] = probe["extra_bytes"] / probe["logits_bytes"]
    return result


def format_tables(tokens: int, vocab: int, times: dict[int, dict], memory: dict | None) -> str:
    lines = [f"DVP op benchmark: {tokens} tokens × {vocab} vocab, fwd+bwd, 1 thread per rank", ""]
    lines.append("| TP | dtype | ours ms | megatron CE ms | naive ms | ours/megatron | ours/naive |")
    lines.append("|---|---|---|---|---|---|---|")
    for tp, per_dtype in times.items():
        for d, t in per_dtype.items():
            o, m, n = (t[v] * 1e3 for v in VARIANTS)
            lines.append(f"| {tp} | {d} | {o:.0f} | {m:.0f} | {n:.0f} | {o / m:.2f} | {o / n:.2f} |")
    if memory:
        lines += ["", "Peak extra memory at TP=1, as a multiple of the logits tensor's size:", ""]
        lines.append("| dtype | ours | megatron CE | naive | ours/megatron | ours/naive |")
        lines.append("|---|---|---|---|---|---|")
        for d, mem in memory.items():
            o, m, n = (mem[v] for v in VARIANTS)
            ratio_m = f"{o / m:.2f}" if m > 0.05 else "n/a (megatron ≈ 0: in place)"
            lines.append(f"| {d} | {o:.2f}× | {m:.2f}× | {n:.2f}× | {ratio_m} | {o / n:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-memory", action="store_true", help="skip the per-variant memory subprocesses")
    parser.add_argument("--memory-probe", nargs=2, metavar=("VARIANT", "DTYPE"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.memory_probe:
        print(json.dumps(memory_probe(*args.memory_probe, args.tokens, args.vocab)))
        return
    for tp in args.tp:
        if args.vocab % tp:
            parser.error(f"--vocab {args.vocab} must be divisible by every --tp; got tp={tp}")
    times = {tp: time_all(args.tokens, args.vocab, tp, args.repeats) for tp in args.tp}
    memory = None if args.no_memory else memory_all(args.tokens, args.vocab)
    print(format_tables(args.tokens, args.vocab, times, memory))


if __name__ == "__main__":
    main()
