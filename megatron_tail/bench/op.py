"""Benchmark of the DVP op against megatron-core's cross entropy and a naive torch version, and of the
fused output layer + op against megatron's output layer + cross entropy.

    python -m megatron_tail.bench.op [--tokens 2048] [--vocab 32768] [--hidden 1024] [--tp 1 2]
                                     [--suites logits output_layer] [--repeats 3]
    python -m megatron_tail.bench.op --device cuda     # the GPU report: `bench.op_report` (issue 51)
    TRITON_INTERPRET=1 python -m megatron_tail.bench.op --peers --tokens 8 --vocab 512 --hidden 32 \
        --fused-tokens 16 8 --repeats 1                 # the same report on a CPU at a tiny shape

Suite "logits": each variant forward + backward on `[tokens, vocab/TP]` logits per rank:
  ours      `vocab_parallel_masked_logprobs` with DVP (log ρ = −13) and entropy; loss = Σ logprobs + Σ entropy
  ours_ip   the same with `inplace_backward=True` (the logits' storage becomes their gradient)
  megatron  megatron-core's `vocab_parallel_cross_entropy` (no mask, no entropy); it overwrites its
            input in place
  naive     `reference_masked_logprobs` in float32: log_softmax over the masked logits + gather + entropy
  Variants that take their input over (megatron, ours_ip) get a fresh clone each call, outside the timed
  region, as they would get fresh logits from the output layer inside a trainer.
Suite "output_layer": from hidden states `[tokens, H]` and the weight shard `[vocab/TP, H]`; see
`bench.output_layer` (fused, megatron linear + CE, linear + ours read-only / in place).
Times: one run, variants interleaved, median over repeats (naive: one run), one intra-op thread per rank.
Memory (TP=1): each variant in a fresh subprocess; peak extra = ru_maxrss − RSS after allocating the
inputs, reported as a multiple of the logits tensor's size ([tokens, vocab] in the dtype), for both suites.
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

from megatron_tail.ops import vocab_parallel_masked_logprobs
from megatron_tail.ops.reference import reference_masked_logprobs
from megatron_tail.utils.forked import run_distributed
from megatron_tail.utils.net import free_port

from .memory import peak_rss_bytes, rss_bytes
from .output_layer import LINEAR_VARIANTS, make_linear_inputs, run_linear_variant

VARIANTS = ("ours", "ours_ip", "megatron", "naive")
TAKES_INPUT_OVER = ("megatron", "ours_ip")
SUITES = ("logits", "output_layer")
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
    if name in ("ours", "ours_ip"):
        x = logits.detach().requires_grad_() if name == "ours" else logits.requires_grad_()
        out = vocab_parallel_masked_logprobs(
            x, targets, log_rho=LOG_RHO, tp_group=group, inplace_backward=name == "ours_ip"
        )
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


def _suite(suite: str, tokens: int, vocab_local: int, hidden: int, dtype: torch.dtype, rank: int):
    """(variant names, inputs, runner) of a suite."""
    if suite == "logits":
        return VARIANTS, make_inputs(tokens, vocab_local, dtype, rank), run_variant
    return LINEAR_VARIANTS, make_linear_inputs(tokens, hidden, vocab_local, dtype, rank), run_linear_variant


def _time_rank(rank: int, world: int, suite: str, tokens: int, vocab: int, hidden: int, repeats: int) -> dict:
    torch.set_num_threads(1)
    _init_megatron_tp(world)
    group = dist.group.WORLD if world > 1 else None
    times: dict[str, dict[str, list[float]]] = {}
    for dname, dtype in DTYPES.items():
        variants, small, runner = _suite(suite, 8, max(vocab // world, 1), hidden, dtype, rank)
        for v in variants:  # warm up kernels and allocator on a small shape
            runner(v, *[x.clone() for x in small], group)
        _, inputs, _ = _suite(suite, tokens, vocab // world, hidden, dtype, rank)
        times[dname] = {v: [] for v in variants}
        for i in range(repeats):
            for v in variants:
                if v == "naive" and i:
                    continue  # 15-30× slower than the others: once is enough for its ratio
                args = [inputs[0].clone(), *inputs[1:]] if v in TAKES_INPUT_OVER else inputs
                dist.barrier()
                t0 = time.perf_counter()
                runner(v, *args, group)
                dist.barrier()
                times[dname][v].append(time.perf_counter() - t0)
    return {d: {v: statistics.median(ts) for v, ts in per.items()} for d, per in times.items()}


def time_all(suite: str, tokens: int, vocab: int, hidden: int, tp: int, repeats: int) -> dict:
    return run_distributed(_time_rank, tp, suite, tokens, vocab, hidden, repeats, timeout=3600)[0]


def memory_probe(suite: str, variant: str, dtype_name: str, tokens: int, vocab: int, hidden: int) -> dict:
    """In a fresh process: peak RSS growth of one fwd+bwd beyond the inputs, in logits-sizes."""
    torch.set_num_threads(1)
    import megatron.core.tensor_parallel  # noqa: F401 - imports before the baseline RSS

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    _init_megatron_tp(1)
    dtype = DTYPES[dtype_name]
    _, small, runner = _suite(suite, 8, 64, hidden, dtype, 0)
    runner(variant, *small, None)  # warm allocator and kernels
    _, inputs, _ = _suite(suite, tokens, vocab, hidden, dtype, 0)
    base = rss_bytes()
    runner(variant, *inputs, None)
    peak = peak_rss_bytes()  # the lifetime peak: this process only makes the inputs before
    return {"extra_bytes": max(peak - base, 0), "logits_bytes": tokens * vocab * inputs[0].element_size()}


def memory_all(suite: str, tokens: int, vocab: int, hidden: int) -> dict:
    variants = VARIANTS if suite == "logits" else LINEAR_VARIANTS
    result: dict[str, dict[str, float]] = {}
    for dname in DTYPES:
        result[dname] = {}
        for v in variants:
            cmd = [sys.executable, "-m", "megatron_tail.bench.op", "--memory-probe", suite, v, dname]
            cmd += [
                "--tokens",
                str(tokens),
                "--vocab",
                str(vocab),
                "--hidden",
                str(hidden),
                "--dtypes",
                dname,
            ]
            out = (
                subprocess.run(cmd, check=True, capture_output=True, text=True)
                .stdout.strip()
                .splitlines()[-1]
            )
            probe = json.loads(out)
            result[dname][v] = probe["extra_bytes"] / probe["logits_bytes"]
    return result


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    """A markdown table's lines."""
    return [
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
        *("| " + " | ".join(row) + " |" for row in rows),
    ]


def _time_rows(
    times: dict[int, dict], variants: tuple[str, ...], ratios: list[tuple[int, int]]
) -> list[list[str]]:
    """Per TP and dtype: each variant's ms, then the ratios (numerator index, denominator index)."""
    rows = []
    for tp, per_dtype in times.items():
        for d, t in per_dtype.items():
            ms = [t[v] * 1e3 for v in variants]
            rows.append([str(tp), d, *(f"{x:.0f}" for x in ms), *(f"{ms[i] / ms[j]:.2f}" for i, j in ratios)])
    return rows


def _memory_rows(memory: dict, variants: tuple[str, ...]) -> list[list[str]]:
    return [[d, *(f"{mem[v]:.2f}×" for v in variants)] for d, mem in memory.items()]


def format_logits_tables(tokens: int, vocab: int, times: dict[int, dict], memory: dict | None) -> str:
    names = ["ours", "ours in-place", "megatron CE", "naive"]
    lines = [f"DVP op on logits: {tokens} tokens × {vocab} vocab, fwd+bwd, 1 thread per rank", ""]
    lines += _table(
        ["TP", "dtype", *(f"{n} ms" for n in names), "ours/megatron", "in-place/megatron", "ours/naive"],
        _time_rows(times, VARIANTS, [(0, 2), (1, 2), (0, 3)]),
    )
    if memory:
        lines += ["", "Peak extra memory at TP=1, as a multiple of the logits tensor's size:", ""]
        lines += _table(["dtype", *names], _memory_rows(memory, VARIANTS))
    return "\n".join(lines)


def format_output_layer_tables(
    tokens: int, vocab: int, hidden: int, times: dict[int, dict], memory: dict | None
) -> str:
    names = ["fused", "(a) megatron linear+CE", "linear+ours", "linear+ours in-place"]
    lines = [
        f"Output layer + log-probs: {tokens} tokens × H {hidden} × {vocab} vocab, fwd+bwd (both gradients), "
        "1 thread per rank",
        "",
    ]
    lines += _table(
        [
            "TP",
            "dtype",
            *(f"{n} ms" for n in names),
            "fused/(a)",
            "linear+ours/(a)",
            "linear+ours in-place/(a)",
        ],
        _time_rows(times, LINEAR_VARIANTS, [(0, 1), (2, 1), (3, 1)]),
    )
    if memory:
        lines += [
            "",
            "Peak extra memory at TP=1 beyond hidden, weight and targets, as a multiple of the logits' size",
            f"(each variant also makes the weight gradient, {hidden / tokens:.2f}× of it):",
            "",
        ]
        lines += _table(["dtype", *names], _memory_rows(memory, LINEAR_VARIANTS))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--suites", nargs="+", choices=SUITES, default=list(SUITES))
    parser.add_argument(
        "--repeats",
        type=int,
        default=None,
        help=f"timed calls per row (3; {CUDA_REPEATS} with --device cuda)",
    )
    parser.add_argument(
        "--dtypes",
        nargs="+",
        choices=list(DTYPES),
        default=list(DTYPES),
        help="dtypes to run (bf16 GEMMs are ~8× slower than fp32 on CPUs without native bf16)",
    )
    parser.add_argument("--no-memory", action="store_true", help="skip the per-variant memory subprocesses")
    parser.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default="cpu",
        help="cuda: the op at TP = 1 and shard widths and the fused output layer against torch / megatron "
        "/ Liger on one GPU, with issue 51's targets (`bench.op_report`; --tokens, --vocab and --hidden "
        "default to 16384, 151936 and 4096 there)",
    )
    parser.add_argument(
        "--peers",
        action="store_true",
        help="on a CPU: the same report as --device cuda at the shapes given (tiny: Triton's interpreter, "
        "TRITON_INTERPRET=1)",
    )
    parser.add_argument(
        "--fused-tokens",
        type=int,
        nargs="+",
        default=[8192, 4096],
        help="token counts of the fused output layer's rows in the --device cuda / --peers report",
    )
    parser.add_argument(
        "--memory-probe", nargs=3, metavar=("SUITE", "VARIANT", "DTYPE"), help=argparse.SUPPRESS
    )
    args = parser.parse_args(argv)
    for name in list(DTYPES):
        if name not in args.dtypes:
            del DTYPES[name]  # forked ranks and probe subprocesses see the same selection
    if args.device == "cuda" or args.peers:
        _report(parser, argv, args)
        return
    if args.memory_probe:
        print(json.dumps(memory_probe(*args.memory_probe, args.tokens, args.vocab, args.hidden)))
        return
    for tp in args.tp:
        if args.vocab % tp:
            parser.error(f"--vocab {args.vocab} must be divisible by every --tp; got tp={tp}")
    for suite in args.suites:
        times = {
            tp: time_all(suite, args.tokens, args.vocab, args.hidden, tp, args.repeats or 3) for tp in args.tp
        }
        memory = None if args.no_memory else memory_all(suite, args.tokens, args.vocab, args.hidden)
        if suite == "logits":
            print(format_logits_tables(args.tokens, args.vocab, times, memory), flush=True)
        else:
            print(format_output_layer_tables(args.tokens, args.vocab, args.hidden, times, memory), flush=True)
        print(flush=True)


CUDA_REPEATS = 10
"""Timed calls per row of the `--device cuda` report unless `--repeats` says otherwise."""


def _report(parser, argv, args) -> None:
    """`--device cuda` (or `--peers` on this CPU): `bench.op_report`, the one command a GPU run of the op
    needs. On CUDA its shapes are the issue's unless --tokens / --vocab / --hidden / --fused-tokens say
    otherwise; megatron's TP = 1 state (its cross entropy reads the TP group from it) on NCCL (gloo on a
    CPU)."""
    from megatron.core import parallel_state

    from .op_peers import QWEN3_VOCAB
    from .op_report import op_report

    device = args.device
    if device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device here")
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        parser.error("--peers on a CPU runs the Triton rows under Triton's interpreter: start Python with "
                     "TRITON_INTERPRET=1 (tiny shapes only)")  # fmt: skip
    given = argv if argv is not None else sys.argv[1:]
    tokens = args.tokens if "--tokens" in given else 16384
    vocab = args.vocab if "--vocab" in given else QWEN3_VOCAB
    hidden = args.hidden if "--hidden" in given else 4096
    widths = tuple(dict.fromkeys(max(1, vocab // tp) for tp in (1, 2, 4, 8)))
    fused = tuple((n, hidden, vocab) for n in args.fused_tokens)
    # a median of 3 cannot carry a 2% choice (`op_designs`) or a ≤ 1.0× verdict; a call is ≤ 0.2 s on CUDA
    repeats = args.repeats if args.repeats is not None else CUDA_REPEATS if device == "cuda" else 3
    if device == "cuda":
        torch.cuda.set_device(0)
    backend = "nccl" if device == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    if device == "cpu":
        from megatron_tail.patches import apply_cpu_patches

        apply_cpu_patches()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    import triton

    versions = f"torch {torch.__version__}, triton {triton.__version__}"
    print(f"{versions}, megatron_tail.bench.op on {device}, repeats {repeats}\n", flush=True)
    try:
        op_report(
            device=device, tokens=tokens, widths=widths, fused=fused, repeats=repeats,
            print_fn=lambda text: print(text, flush=True),
        )  # fmt: skip
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
