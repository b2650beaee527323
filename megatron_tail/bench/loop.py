"""Benchmark of the RL loop's throughput features (CPU): rollout one step ahead, and in-memory weight sync.

    python -m megatron_tail.bench.loop [--steps 8] [--sync-layers 12] [--bucket-mb 64] [--repeats 2]
                                       [--suites loop sync] [--workdir DIR]

Suite "loop": the real RL loop (`train.run.loop.run`, TP = 1) on a tiny random Qwen3 with one local engine,
`rollout.max_staleness` 0 (sync) against 1 (async), each arm in a fresh process. The trainer and the engine
get one torch thread each (one core each on a 2-core machine). Steps/s and seconds per step by phase are
means over the steps after the first (which samples synchronously in both arms).

Suite "sync": a synthetic Qwen3 of ~200M parameters (hidden 1024, 12 layers, vocab 32768) served by one bf16
local engine; its HF tensors (what `model.iter_hf_tensors` yields on rank 0: bf16 from a bf16 trainer, fp32
from an fp32 one; both are measured) reach the engine
  disk         written as bf16 safetensors (`StreamingSafetensorsWriter`, as `export_hf`) and reloaded by
               the engine (`/update_weights_from_disk`)
  distributed  streamed in buckets of `--bucket-mb`, cast to bf16 on the sender (`DistributedWeightSync`,
               gloo over loopback)
Each path runs in a fresh process: seconds per sync (median of `--repeats`, after one untimed warm-up), and
the sender's peak extra memory = peak RSS − RSS after its source tensors exist (as `bench.op` measures
memory, with the peak restarted at that point through /proc/self/clear_refs so that earlier transients do
not count; glibc's mmap threshold fixed at 1 MiB so that freed buckets leave the RSS), as a multiple of the
bucket size and against the bound "one bucket + the largest tensor". The "disk" here is this machine's
page cache, not a shared filesystem: the projection below is where the disk path's real cost shows.

Then a projection for Qwen3-8B / 14B on the example layouts, from these measurements and published
bandwidths (see `project`): labelled as a projection, not a measurement.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .memory import peak_rss_bytes, reset_peak_rss, rss_bytes

SYNC_MODEL = dict(
    hidden_size=1024, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=16,
    num_key_value_heads=8, head_dim=64, vocab_size=32768, max_position_embeddings=256,
)  # fmt: skip
LOOP_MODEL = dict(
    hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
    head_dim=64, max_position_embeddings=96,
)  # fmt: skip


# --- suite "loop" -------------------------------------------------------------------------------------


def loop_overrides(model_dir: Path, prompts: Path, run_dir: Path, staleness: int, steps: int) -> list[str]:
    settings = {
        "run_dir": run_dir,
        "seed": 3,
        "model.hf_path": model_dir,
        "model.precision": "fp32",
        "model.vocab_pad_multiple": 128,
        "rollout.engine": "local",
        "rollout.local_num_threads": 1,
        "rollout.max_new_tokens": 8,
        "rollout.max_staleness": staleness,
        "algorithm.group_size": 8,
        "algorithm.log_rho": -13.0,
        "algorithm.is_mode": "mis",
        "optimizer.lr": 1e-4,
        "data.train_path": prompts,
        "data.apply_chat_template": False,
        "data.reward": "arithmetic",
        "data.prompts_per_step": 8,
        "train.steps": steps,
        "train.micro_batch_size": 16,
        "train.checkpoint_every": 10_000,  # the last step only: the loop's phases are what is compared
        "logging.progress": "never",
        "logging.tensorboard": False,
    }
    return [f"{k}={v}" for k, v in settings.items()]


def loop_arm(model_dir: str, prompts: str, run_dir: str, staleness: int, steps: int) -> dict:
    """In this (fresh) process: the loop with one trainer thread; its per-step perf history."""
    import torch

    from megatron_tail.config import load_config
    from megatron_tail.train.run.loop import run

    torch.set_num_threads(1)
    cfg = load_config(None, loop_overrides(Path(model_dir), Path(prompts), Path(run_dir), staleness, steps))
    started = time.perf_counter()
    result = run(cfg)
    return {"history": result.history, "wall_s": time.perf_counter() - started}


PHASES = [
    ("rollout (generation)", "perf/rollout_time_s"),
    ("trainer waits for rollout", "perf/rollout_wait_s"),
    ("log-prob recompute", "perf/logprob_time_s"),
    ("train (recompute + update)", "perf/train_time_s"),
    ("weight sync", "perf/weight_sync_time_s"),
    ("rollout ∥ training overlap", "perf/overlap_s"),
    ("step", "perf/step_time_s"),
]


def summarize_loop(history: list[dict], ahead: bool) -> dict[str, float]:
    """Means over the steady steps (all but the first, which samples synchronously in both arms, and the
    last, after which an async run generates nothing); steps/s = 1 / mean step time. "rollout" is the
    generation that ran during the step: the step's own batch (sync) or the next step's (async)."""
    if len(history) < 3:
        raise ValueError(f"need ≥ 3 steps for steady-state means; got {len(history)}")
    steady = range(1, len(history) - 1)
    out = {key: statistics.fmean(history[k].get(key, 0.0) for k in steady) for _, key in PHASES}
    during = [history[k + 1 if ahead else k]["perf/rollout_time_s"] for k in steady]
    out["perf/rollout_time_s"] = statistics.fmean(during)
    out["steps_per_s"] = 1.0 / out["perf/step_time_s"]
    # the engine only generates: the rest of the step it is idle
    out["engine_idle_s"] = out["perf/step_time_s"] - out["perf/rollout_time_s"]
    return out


def format_loop(arms: dict[str, dict[str, float]]) -> str:
    sync, ahead = arms["sync"], arms["async"]
    lines = [
        "Loop (tiny Qwen3, TP = 1, trainer and engine one core each), seconds per step, mean of steps "
        "2..N−1:",
        "",
        "| phase | sync (max_staleness 0) | async (max_staleness 1) |",
        "|---|---|---|",
    ]
    lines += [f"| {name} | {sync[key]:.3f} | {ahead[key]:.3f} |" for name, key in PHASES]
    lines += [
        f"| engine idle (step − generation) | {sync['engine_idle_s']:.3f} | {ahead['engine_idle_s']:.3f} |",
        f"| **steps/s** | {sync['steps_per_s']:.3f} | {ahead['steps_per_s']:.3f} |",
        "",
        f"async / sync throughput: **{ahead['steps_per_s'] / sync['steps_per_s']:.2f}×** (target ≥ 1.5× "
        "where rollout and training take similar time; perfect overlap of the sync arm's phases would give "
        f"step / (max(rollout, train) + the rest) = {ideal_speedup(sync):.2f}×)",
    ]
    return "\n".join(lines)


def ideal_speedup(sync: dict[str, float]) -> float:
    rollout, train = sync["perf/rollout_time_s"], sync["perf/train_time_s"]
    rest = sync["perf/step_time_s"] - rollout - train
    return sync["perf/step_time_s"] / (max(rollout, train) + rest)


# --- suite "sync" -------------------------------------------------------------------------------------


def _shapes(model_dir: str | Path) -> dict[str, tuple[int, ...]]:
    from megatron_tail.model.safetensors_io import SafetensorsReader

    with SafetensorsReader(model_dir) as reader:
        return {name: reader.shape(name) for name in reader.weight_map}


def _source_tensors(model_dir: str, dtype_name: str) -> dict:
    """HF tensors of `model_dir`'s shapes in `dtype_name` ("bf16": a bf16 trainer's model parameters, as
    `iter_hf_tensors` yields them; "fp32": an fp32 trainer's, cast by the sender), made in place, seeded."""
    import torch

    gen = torch.Generator().manual_seed(0)
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype_name]
    shapes = _shapes(model_dir)
    return {
        name: torch.empty(shape, dtype=dtype).normal_(0.0, 0.02, generator=gen)
        for name, shape in sorted(shapes.items())
    }


def sync_probe(
    path: str, model_dir: str, url: str, out_dir: str, repeats: int, bucket_mb: float, source_dtype: str
) -> dict:
    """In this (fresh) process: `repeats` + 1 syncs of the source tensors to the engine at `url` by `path`;
    seconds of the timed ones and the peak RSS growth beyond the source tensors. Each tensor is yielded as
    a fresh copy, as the trainer's TP gather allocates every full parameter it yields."""
    import asyncio

    import torch

    from megatron_tail.rollout import DiskWeightSync, DistributedWeightSync
    from megatron_tail.utils.net import free_port

    torch.set_num_threads(1)
    source = _source_tensors(model_dir, source_dtype)
    # "one full parameter" as the trainer holds it (its dtype), next to the bucket in the engines' bf16
    largest = max(t.numel() * t.element_size() for t in source.values())
    total = sum(t.numel() for t in source.values()) * 2
    if path == "distributed":
        sync = DistributedWeightSync(
            [url], master_address="127.0.0.1", master_port=free_port(), backend="gloo",
            bucket_mb=bucket_mb, dtype=torch.bfloat16, engine_tp_sizes=[1],
        )  # fmt: skip
        asyncio.run(sync.init_group())
    else:
        sync = DiskWeightSync([url])
    base = rss_bytes()
    # a transient before this point (imports, reading the shapes) must not count as the sync's peak
    reset = reset_peak_rss()
    times = []
    for i in range(repeats + 1):
        started = time.perf_counter()
        if path == "distributed":
            asyncio.run(sync.update(_gathered(source), weight_version=str(i)))
        else:
            shapes = {n: tuple(t.shape) for n, t in source.items()}
            _write_bf16_dir(shapes, _gathered(source), model_dir, Path(out_dir))
            asyncio.run(sync.update(out_dir, weight_version=str(i)))
        times.append(time.perf_counter() - started)
    peak = peak_rss_bytes(reset)
    if path == "distributed":
        asyncio.run(sync.destroy_group())
    return {
        "seconds": statistics.median(times[1:]),
        "extra_bytes": max(peak - base, 0),
        "largest_bytes": largest,
        "total_bytes": total,
        "bucket_bytes": int(bucket_mb * 2**20),
        "accounted_peak_bytes": getattr(sync, "last_update", {}).get("peak_bytes", 0),
    }


def _gathered(source: dict):
    """(name, a new copy of the tensor) in order: what `iter_hf_tensors` yields after each gather."""
    for name, tensor in source.items():
        yield name, tensor.clone()


def _write_bf16_dir(shapes: dict, tensors, model_dir: str, out: Path) -> None:
    """What `export_hf` does on rank 0: stream bf16 tensors into safetensors, with the config beside them."""
    import shutil

    import torch

    from megatron_tail.model.safetensors_io import StreamingSafetensorsWriter

    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    writer = StreamingSafetensorsWriter(tmp, shapes, torch.bfloat16)
    for name, tensor in tensors:
        writer.write(name, tensor.to(torch.bfloat16))
    writer.close()
    for f in Path(model_dir).iterdir():
        if not f.name.endswith(".safetensors") and not f.name.endswith(".index.json") and f.is_file():
            shutil.copy2(f, tmp / f.name)
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)


def format_sync(results: dict[str, dict], params: int, source_dtype: str) -> str:
    disk, dist_ = results["disk"], results["distributed"]
    bucket = dist_["bucket_bytes"]
    lines = [
        f"Weight sync of a synthetic Qwen3 ({params / 1e6:.0f}M parameters, "
        f"{disk['total_bytes'] / 2**20:.0f} MiB in bf16) from {source_dtype} trainer tensors to one bf16 "
        f"local engine, bucket {bucket / 2**20:.0f} MiB:",
        "",
        "| path | seconds per sync | sender peak extra | ÷ bucket | bound: bucket + largest source tensor |",
        "|---|---|---|---|---|",
    ]
    for name, r in results.items():
        bound, extra = r["bucket_bytes"] + r["largest_bytes"], r["extra_bytes"]
        lines.append(
            f"| {name} | {r['seconds']:.2f} | {extra / 2**20:.0f} MiB | {extra / bucket:.2f}× | "
            f"{bound / 2**20:.0f} MiB ({(extra - bound) / 2**20:+.1f} MiB) |"
        )
    lines += [
        "",
        f"disk / distributed time: **{disk['seconds'] / dist_['seconds']:.2f}×** (target ≥ 3×); the streamed "
        f"sender's own accounting of what it held at once: {dist_['accounted_peak_bytes'] / 2**20:.0f} MiB",
    ]
    return "\n".join(lines)


# --- projection ---------------------------------------------------------------------------------------

# Published figures (assumptions, not measurements): H100 SXM NVLink 4 is 450 GB/s per direction per GPU;
# an NDR InfiniBand HCA is 400 Gb/s = 50 GB/s per direction, taken at 80 % for a large NCCL broadcast.
# Shared filesystems vary by an order of magnitude: 2 GB/s for one client's write and 2 GB/s per reading
# server (both capped by the filesystem's aggregate, 20 GB/s) is a mid-range Lustre/GPFS figure.
IB_BYTES_PER_S = 50e9 * 0.8
FS_WRITE_BYTES_PER_S = 2e9
FS_READ_BYTES_PER_S = 2e9
FS_AGGREGATE_BYTES_PER_S = 20e9
MODELS = {
    # parameters, the largest tensor (embedding / lm_head rows × hidden), servers of the example layout
    "Qwen3-8B": {"params": 8.19e9, "largest": 151_936 * 4096, "servers": 8, "example": "qwen3_8b_grpo_dvp"},
    "Qwen3-14B": {"params": 14.8e9, "largest": 151_936 * 5120, "servers": 8, "example": "qwen3_14b_*"},
}


def project(sync: dict[str, dict], bucket_mb: float) -> str:
    """Seconds per sync and rank 0's extra memory for Qwen3-8B / 14B in bf16: the bytes over the assumed
    bandwidths, plus the per-bucket overhead measured here (HTTP round trip + pause/flush, from the
    distributed run: its time beyond its bytes at the loopback rate it reached)."""
    dist_ = sync["distributed"]
    buckets_here = max(1, -(-dist_["total_bytes"] // dist_["bucket_bytes"]))
    lines = [
        "**Projection** (not a measurement): bf16 weights, H100 nodes, rollout nodes apart from the "
        f"trainer's; InfiniBand {IB_BYTES_PER_S / 1e9:.0f} GB/s effective for the broadcast (one NDR HCA at "
        f"80 %), shared filesystem {FS_WRITE_BYTES_PER_S / 1e9:.0f} GB/s write from rank 0, "
        f"{FS_READ_BYTES_PER_S / 1e9:.0f} GB/s read per server up to "
        f"{FS_AGGREGATE_BYTES_PER_S / 1e9:.0f} GB/s in all; per-bucket overhead "
        f"≤ {dist_['seconds'] / buckets_here * 1e3:.0f} ms (this machine's whole distributed time per "
        "bucket, an upper bound).",
        "",
        "| model | bytes | disk: write + reload | distributed: broadcast | disk / distributed | rank 0 extra "
        f"memory (bucket {bucket_mb:.0f} MiB + largest tensor) |",
        "|---|---|---|---|---|---|",
    ]
    per_bucket_s = dist_["seconds"] / buckets_here
    for name, m in MODELS.items():
        nbytes = m["params"] * 2
        read = nbytes * m["servers"] / min(FS_READ_BYTES_PER_S * m["servers"], FS_AGGREGATE_BYTES_PER_S)
        disk = nbytes / FS_WRITE_BYTES_PER_S + read
        buckets = -(-nbytes // (bucket_mb * 2**20))
        distributed = nbytes / IB_BYTES_PER_S + buckets * per_bucket_s
        extra = bucket_mb * 2**20 + m["largest"] * 2
        lines.append(
            f"| {name} ({m['servers']} servers, `{m['example']}`) | {nbytes / 1e9:.1f} GB | {disk:.1f} s | "
            f"{distributed:.1f} s | {disk / distributed:.1f}× | {extra / 2**30:.2f} GiB |"
        )
    return "\n".join(lines)


# --- driver -------------------------------------------------------------------------------------------


def _subprocess_json(args: list[str]) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
    # glibc raises its mmap threshold as large blocks are freed, then keeps freed buckets in the heap, so
    # the peak RSS would count dead buckets (measured: ~3 buckets instead of ~2 live); a fixed threshold
    # returns each freed block, so the peak is what the sync holds at once. (On GPU the buckets live in
    # the CUDA caching allocator, which reuses same-size blocks.)
    env["MALLOC_MMAP_THRESHOLD_"] = str(2**20)
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_tail.bench.loop", *args], capture_output=True, text=True, env=env
    )
    if proc.returncode != 0:
        raise RuntimeError(
            f"bench subprocess {args[:2]} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        )
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _save_model(config_overrides: dict, path: Path) -> int:
    import math

    from transformers import Qwen3ForCausalLM

    from megatron_tail.data.char_tokenizer import build_char_tokenizer
    from megatron_tail.demo.model import save_hf, tiny_qwen3_config

    if not (path / "config.json").is_file():
        model = Qwen3ForCausalLM(tiny_qwen3_config(**config_overrides))
        save_hf(model, build_char_tokenizer(), path)
    return sum(math.prod(s) for s in _shapes(path).values())


def run_loop_suite(work: Path, steps: int) -> str:
    from megatron_tail.data.toy_arithmetic import make_arithmetic_examples, write_jsonl

    model = work / "loop_model"
    _save_model(LOOP_MODEL, model)
    prompts = work / "prompts.jsonl"
    write_jsonl(make_arithmetic_examples(256, seed=0), prompts)
    arms = {}
    for name, staleness in (("sync", 0), ("async", 1)):
        out = _subprocess_json(
            ["--loop-arm", str(model), str(prompts), str(work / f"run_{name}"), str(staleness), str(steps)]
        )
        arms[name] = summarize_loop(out["history"], ahead=staleness > 0)
        print(f"loop {name}: {arms[name]['steps_per_s']:.3f} steps/s", file=sys.stderr, flush=True)
    return format_loop(arms)


def run_sync_suite(work: Path, repeats: int, bucket_mb: float) -> str:
    from megatron_tail.rollout.launch import LocalEngineConfig
    from megatron_tail.rollout.local_engine.process import LocalEngineProcess
    from megatron_tail.utils.net import free_port

    model = work / "sync_model"
    params = _save_model(SYNC_MODEL, model)
    config = LocalEngineConfig(model_path=str(model), port=free_port(), dtype="bfloat16", num_threads=1)
    results: dict[str, dict[str, dict]] = {"bf16": {}, "fp32": {}}
    with LocalEngineProcess(config, work / "engine.log") as engine:
        engine.wait_healthy(timeout_s=600)
        for source_dtype, by_path in results.items():
            for path in ("disk", "distributed"):
                args = [path, str(model), engine.url, str(work / "exported"), str(repeats), str(bucket_mb)]
                by_path[path] = _subprocess_json(["--sync-probe", *args, source_dtype])
                print(f"sync {path} ({source_dtype}): {by_path[path]['seconds']:.2f} s", file=sys.stderr)
    tables = [format_sync(by_path, params, dtype) for dtype, by_path in results.items()]
    # the projection's per-bucket overhead from the bf16 source: a bf16 trainer's sender casts nothing
    return "\n\n".join([*tables, project(results["bf16"], 512.0)])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--suites", nargs="+", choices=("loop", "sync"), default=["loop", "sync"])
    parser.add_argument("--steps", type=int, default=8, help="RL steps per loop arm")
    parser.add_argument("--repeats", type=int, default=2, help="timed syncs per path (after one warm-up)")
    parser.add_argument("--bucket-mb", type=float, default=64.0, help="bucket of the distributed sync")
    parser.add_argument("--workdir", help="keep models and runs here (default: a temp dir)")
    parser.add_argument("--loop-arm", nargs=5, help=argparse.SUPPRESS)
    parser.add_argument("--sync-probe", nargs=7, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.loop_arm:
        model, prompts, run_dir, staleness, steps = args.loop_arm
        print(json.dumps(loop_arm(model, prompts, run_dir, int(staleness), int(steps))))
        return
    if args.sync_probe:
        path, model, url, out, repeats, bucket, source_dtype = args.sync_probe
        print(json.dumps(sync_probe(path, model, url, out, int(repeats), float(bucket), source_dtype)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.workdir or tmp)
        work.mkdir(parents=True, exist_ok=True)
        if "loop" in args.suites:
            print(run_loop_suite(work, args.steps), flush=True)
            print(flush=True)
        if "sync" in args.suites:
            print(run_sync_suite(work, args.repeats, args.bucket_mb), flush=True)


if __name__ == "__main__":
    main()
