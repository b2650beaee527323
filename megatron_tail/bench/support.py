"""Benchmark of the op's sampling support: the op and the fused op with a K-token support per token against
the same op without one, in one run.

    python -m megatron_tail.bench.support [--tokens 2048] [--vocab 32768] [--hidden 512] [--k 50]
                                          [--tp 1 2] [--dtypes fp32 bf16] [--repeats 3]

Per TP and dtype, forward + backward (loss = Σ logprobs + Σ entropy, DVP at log ρ = −13):
  op      `vocab_parallel_masked_logprobs` on `[tokens, vocab/TP]` logits, `inplace_backward` (as the
          trainer's unfused path), without / with `sampling_support` (the K most probable ids, shuffled;
          the target drawn among them, as a top-k sampler's)
  fused   `vocab_parallel_linear_masked_logprobs` from hidden `[tokens, H]` and the weight shard, without /
          with
Times: variants interleaved, median over repeats, one intra-op thread per rank; `--clock cpu` (default) counts
the CPU time of each rank's compute thread (collective waits excluded), which stays meaningful on a shared,
oversubscribed machine where wall time mostly measures the neighbours; `--clock wall` times as `bench.op`.
Memory (TP = 1): each variant in a fresh subprocess, peak RSS growth beyond its inputs; the table gives
(with − without) against the support's own bytes (`[tokens, K]` int64, what the trainer hands the op).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch
import torch.distributed as dist

from megatron_tail.ops import vocab_parallel_linear_masked_logprobs, vocab_parallel_masked_logprobs
from megatron_tail.utils.forked import run_distributed
from megatron_tail.utils.net import free_port

from .memory import peak_rss_bytes, reset_peak_rss, rss_bytes
from .op import DTYPES, make_inputs
from .output_layer import make_linear_inputs

SUITES = ("op", "fused")
VARIANTS = ("plain", "support")
LOG_RHO = -13.0


def support_ids(logits_or_scores: torch.Tensor, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(`[N, K]` int64 ids of the K largest scores per row, shuffled; `[N]` targets drawn among them)."""
    gen = torch.Generator().manual_seed(seed)
    ids = logits_or_scores.float().topk(k, dim=-1).indices
    ids = ids[:, torch.randperm(k, generator=gen)]
    pick = torch.randint(0, k, (ids.shape[0],), generator=gen)
    return ids, ids[torch.arange(ids.shape[0]), pick]


def make_suite_inputs(suite: str, tokens: int, vocab: int, hidden: int, k: int, dtype, rank: int, tp: int):
    """Inputs of a suite on this rank, with the global support (built from the full-vocab scores)."""
    if suite == "op":
        full, _ = make_inputs(tokens, vocab, dtype, 0)  # the global logits: every rank slices its shard
        local = vocab // tp
        support, targets = support_ids(full, k)
        shard = full if tp == 1 else full[:, rank * local : (rank + 1) * local].contiguous()
        return (shard,), targets, support
    h, _, _ = make_linear_inputs(tokens, hidden, vocab // tp, dtype, 0)
    weights = [make_linear_inputs(8, hidden, vocab // tp, dtype, r)[1] for r in range(tp)]
    support, targets = support_ids(h.float() @ torch.cat(weights).float().t(), k)
    return (h, weights[rank]), targets, support


def run_variant(suite: str, variant: str, tensors, targets, support, group) -> None:
    """One forward + backward (the logits are taken over by the op: pass a fresh clone)."""
    extra = {"sampling_support": support} if variant == "support" else {}
    if suite == "op":
        x = tensors[0].requires_grad_()
        out = vocab_parallel_masked_logprobs(
            x, targets, log_rho=LOG_RHO, tp_group=group, inplace_backward=True, **extra
        )
    else:
        h, w = (t.detach().requires_grad_() for t in tensors)
        out = vocab_parallel_linear_masked_logprobs(h, w, targets, log_rho=LOG_RHO, tp_group=group, **extra)
    (out.logprobs.sum() + out.entropy.sum()).backward()


def _time_rank(rank, world, suite, tokens, vocab, hidden, k, repeats, clock="cpu") -> dict:
    torch.set_num_threads(1)
    now = time.thread_time if clock == "cpu" else time.perf_counter
    group = dist.group.WORLD if world > 1 else None
    times = {}
    for dname, dtype in DTYPES.items():
        small = make_suite_inputs(suite, 8, 64 * world, 16, 4, dtype, rank, world)
        for v in VARIANTS:  # warm up kernels and the allocator
            run_variant(suite, v, [t.clone() for t in small[0]], *small[1:], group)
        tensors, targets, support = make_suite_inputs(suite, tokens, vocab, hidden, k, dtype, rank, world)
        per = {v: [] for v in VARIANTS}
        for _ in range(repeats):
            for v in VARIANTS:
                fresh = [tensors[0].clone(), *tensors[1:]] if suite == "op" else tensors
                dist.barrier()
                t0 = now()
                run_variant(suite, v, fresh, targets, support, group)
                elapsed = now() - t0
                dist.barrier()
                per[v].append(elapsed)
        times[dname] = {v: statistics.median(ts) for v, ts in per.items()}
    return times


def memory_probe(suite, variant, dname, tokens, vocab, hidden, k) -> dict:
    """In a fresh process: peak RSS growth of one forward + backward beyond the inputs."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    dtype = DTYPES[dname]
    small = make_suite_inputs(suite, 8, 64, 16, 4, dtype, 0, 1)
    run_variant(suite, variant, [t.clone() for t in small[0]], *small[1:], None)
    tensors, targets, support = make_suite_inputs(suite, tokens, vocab, hidden, k, dtype, 0, 1)
    base = rss_bytes()
    reset = reset_peak_rss()  # making the support's scores may have peaked above the inputs
    run_variant(suite, variant, tensors, targets, support, None)
    peak = peak_rss_bytes(reset=reset)
    return {"extra_bytes": max(peak - base, 0), "support_bytes": support.numel() * 8, "reset": reset}


def _probe(suite, variant, dname, args) -> dict:
    cmd = [sys.executable, "-m", "megatron_tail.bench.support", "--memory-probe", suite, variant, dname]
    cmd += ["--tokens", str(args.tokens), "--vocab", str(args.vocab), "--hidden", str(args.hidden)]
    cmd += ["--k", str(args.k), "--dtypes", dname]
    # glibc serves freed heap memory again without RSS growth, and raises its mmap threshold after frees:
    # fixed thresholds make every allocation ≥ 64 KiB an mmap returned on free, so the RSS peak is the
    # live bytes' peak (the support's effect is ~1 MiB against chunk buffers of 1 MiB)
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}
    run = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env)
    out = run.stdout.strip().splitlines()[-1]
    return json.loads(out)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--k", type=int, default=50, help="support size per token (top_k)")
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--suites", nargs="+", choices=SUITES, default=list(SUITES))
    parser.add_argument("--dtypes", nargs="+", choices=list(DTYPES), default=list(DTYPES))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--clock", choices=("cpu", "wall"), default="cpu", help="see above (default cpu)")
    parser.add_argument("--no-memory", action="store_true")
    parser.add_argument("--no-time", action="store_true", help="memory probes only")
    parser.add_argument(
        "--memory-probe", nargs=3, metavar=("SUITE", "VARIANT", "DTYPE"), help=argparse.SUPPRESS
    )
    args = parser.parse_args(argv)
    for name in list(DTYPES):
        if name not in args.dtypes:
            del DTYPES[name]  # forked ranks and probe subprocesses see the same selection
    if args.memory_probe:
        print(json.dumps(memory_probe(*args.memory_probe, args.tokens, args.vocab, args.hidden, args.k)))
        return
    header = (
        f"{args.tokens} tokens × {args.vocab} vocab (H {args.hidden} fused), support K = {args.k}, fwd+bwd"
    )
    print(f"Sampling support: {header}, 1 thread per rank, {args.clock} time of rank 0\n")
    print("| suite | TP | dtype | without ms | with ms | with/without |\n|---|---|---|---|---|---|")
    for suite in args.suites if not args.no_time else ():
        for tp in args.tp:
            times = run_distributed(
                _time_rank,
                tp,
                suite,
                args.tokens,
                args.vocab,
                args.hidden,
                args.k,
                args.repeats,
                args.clock,
                timeout=3600,
            )[0]
            for dname, t in times.items():
                plain, sup = t["plain"] * 1e3, t["support"] * 1e3
                print(
                    f"| {suite} | {tp} | {dname} | {plain:.0f} | {sup:.0f} | {sup / plain:.2f} |", flush=True
                )
    if args.no_memory:
        return
    print("\nPeak extra memory at TP=1 (MiB); the support's own bytes ([tokens, K] int64) for scale:\n")
    print("| suite | dtype | without | with | with − without | support | (with − without)/support |")
    print("|---|---|---|---|---|---|---|")
    for suite in args.suites:
        for dname in DTYPES:
            plain, sup = (_probe(suite, v, dname, args) for v in VARIANTS)
            mib = 1 << 20
            delta = sup["extra_bytes"] - plain["extra_bytes"]
            cells = [plain["extra_bytes"] / mib, sup["extra_bytes"] / mib, delta / mib]
            cells += [sup["support_bytes"] / mib, delta / sup["support_bytes"]]
            print(f"| {suite} | {dname} | " + " | ".join(f"{c:.2f}" for c in cells) + " |", flush=True)


if __name__ == "__main__":
    main()
