"""Benchmark of the RL loop's throughput features (CPU): bounded staleness with partial rollouts, and
in-memory weight sync.

    python -m megatron_tail.bench.loop [--steps 10] [--bucket-mb 64] [--repeats 2] [--suites loop sync]
                                       [--workdir DIR] [--json]

Suite "loop": the real RL loop (`train.run.loop.run`, TP = 1) with one continuously batching local engine,
each arm in a fresh process (`ARMS`). Single-turn: synchronous (`rollout.max_staleness: 0`), one step ahead
(η = 1), and the rollout manager at η = 2 and η = 4 with `rollout.partial_rollouts`, the η = 2 arm once per
`rollout.pause_mode` (abort / in_place / retract). Agentic: the calculator environment, ≤ 3 turns, top-p 0.95
and top-k 20, synchronous and at η = 2 / 4 with partial rollouts. The trainer and the engine get one torch
thread each (one core each on a 2-core machine); the trainer packs its micro-batches (THD, a token budget),
and the manager keeps at most `LOOP_MAX_CONCURRENCY` groups generating. `--set KEY=VALUE` overrides any of
these for every arm. Steps/s and seconds per step by phase are means over steps 2..N−1 (step 1 waits for a
first batch in every arm); `speedup_vs_sync` is against the synchronous arm of the same workload.

The workload (`loop_model`): a tiny random Qwen3 (hidden 64, 2 layers) whose response length is driven by
the prompt's difficulty, by construction of its weights: half the prompts end with a "hard" marker, and a
response continues in its prompt's mode, where the end-of-sequence token has probability 0.01 per token
(hard) or 0.04 (easy), whatever else the context holds. Lengths are geometric per mode, capped at
`max_new_tokens`: most responses short, hard prompts ≈ 4× longer, and in a step of 64 samples the longest
usually near the cap. This is the shape RL produces (a few long chains of thought, on the hard problems); a
synchronous step waits for its longest response while the continuously batching engine runs nearly empty,
and an asynchronous one could train the short (easy) ones first. So each arm also reports, over every
trained sample of the run, the mean length of the longest decile and the fraction from hard prompts: they
should match the synchronous arm's (the trained distribution is not biased against long responses), and
`dropped_samples` (the sum of `rollout/dropped_stale`) should be 0.

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
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from megatron_tail.utils.parent_watch import PARENT_PID_ENV, die_with_parent

from .loop_model import (
    EASY_EOS_P,
    HARD_EOS_P,
    length_stats,
    record_trained_samples,
    save_long_tail_model,
    write_prompt_mix,
)
from .memory import peak_rss_bytes, reset_peak_rss, rss_bytes

SYNC_MODEL = dict(
    hidden_size=1024, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=16,
    num_key_value_heads=8, head_dim=64, vocab_size=32768, max_position_embeddings=256,
)  # fmt: skip
LONG_TAIL_MAX_NEW_TOKENS = 256
AGENTIC_MAX_NEW_TOKENS = 96
"""The agentic arm's longest model turn (3 turns, observations of ≤ `AGENTIC_MAX_OBSERVATION_TOKENS`)."""
AGENTIC_MAX_TURNS = 3
AGENTIC_MAX_OBSERVATION_TOKENS = 160
"""The calculator's error observation (with the chat tags around it) is ≈ 120 tokens."""
LOOP_TOKENS_PER_MICRO_BATCH = 4096
"""The trainer's packed micro-batch (`train.max_tokens_per_micro_batch`): a step's ~4k tokens, one or
two micro-batches."""
LOOP_MAX_CONCURRENCY = 32
"""Groups generating at once under the rollout manager (`rollout.max_concurrency`): 4 steps' worth, which
keeps ≈ 40–80 sequences decoding; more only slows each sequence, fewer leaves the engine's batch small.
Chosen by measurement (16 / 24 / 32 / 48: the partial-rollouts bench write-up in docs/results). With an
environment it counts episodes: the agentic arms get `LOOP_MAX_CONCURRENCY × group_size`, the same groups."""
GROUP_SIZE = 8


@dataclass(frozen=True)
class Arm:
    staleness: int
    """`rollout.max_staleness` (η)."""
    partial: bool = False
    """`rollout.partial_rollouts`."""
    env: str | None = None
    """`rollout.env.name` (the agentic workload) or None (single-turn)."""
    pause_mode: str = "retract"
    """`rollout.pause_mode` (matters with `partial` only): the config's default unless the arm compares
    modes."""
    baseline: str = "sync"
    """The synchronous arm of the same workload: `speedup_vs_sync` is against it."""

    def label(self) -> str:
        extra = [", partial" if self.partial else "", f", {self.pause_mode}" if self.partial else ""]
        return f"η={self.staleness}{''.join(extra)}"


ARMS = {
    "sync": Arm(0),
    "eta1": Arm(1),
    "eta2_abort": Arm(2, True, pause_mode="abort"),
    "eta2_in_place": Arm(2, True, pause_mode="in_place"),
    "eta2_retract": Arm(2, True, pause_mode="retract"),
    "eta4_partial": Arm(4, True),
    "agentic_sync": Arm(0, env="calculator", baseline="agentic_sync"),
    "agentic_eta2_partial": Arm(2, True, env="calculator", baseline="agentic_sync"),
    "agentic_eta4_partial": Arm(4, True, env="calculator", baseline="agentic_sync"),
}
"""The loop suite's arms. The η = 2 arms differ only in `rollout.pause_mode` (the others use the config's
default, retract); the agentic arms run the calculator environment, multi-turn, with Qwen3's recommended
truncation (top-p 0.95, top-k 20)."""


# --- suite "loop" -------------------------------------------------------------------------------------


def loop_overrides(model_dir: Path, prompts: Path, run_dir: Path, arm: Arm, steps: int) -> list[str]:
    settings = {
        "run_dir": run_dir,
        "seed": 3,
        "model.hf_path": model_dir,
        "model.precision": "fp32",
        "model.vocab_pad_multiple": 128,
        "rollout.engine": "local",
        "rollout.local.num_threads": 1,
        "rollout.max_new_tokens": LONG_TAIL_MAX_NEW_TOKENS,
        "rollout.max_staleness": arm.staleness,
        "rollout.partial_rollouts": arm.partial,
        "rollout.pause_mode": arm.pause_mode,
        "algorithm.group_size": GROUP_SIZE,
        "algorithm.log_rho": -13.0,
        "algorithm.is_mode": "mis",
        "optimizer.lr": 1e-4,
        "data.train_path": prompts,
        "data.apply_chat_template": False,
        "data.reward": "arithmetic",
        "data.prompts_per_step": 8,
        "train.steps": steps,
        "train.micro_batch_size": 16,
        # THD packing by token budget, as a production run trains: padded micro-batches of this long-tail
        # mix are ~4× padding (each padded to its longest response), which made the trainer, not
        # generation, the larger part of a synchronous step
        "train.max_tokens_per_micro_batch": LOOP_TOKENS_PER_MICRO_BATCH,
        "rollout.max_concurrency": LOOP_MAX_CONCURRENCY,
        "train.checkpoint_every": 10_000,  # the last step only: the loop's phases are what is compared
        "logging.progress": "never",
        "logging.tensorboard": False,
    }
    if arm.env is not None:
        settings.update({
            "rollout.env.name": arm.env,
            "rollout.env.max_turns": AGENTIC_MAX_TURNS,
            "rollout.max_new_tokens": AGENTIC_MAX_NEW_TOKENS,
            "rollout.env.max_observation_tokens": AGENTIC_MAX_OBSERVATION_TOKENS,
            "rollout.sampling.top_p": 0.95,
            "rollout.sampling.top_k": 20,
            "rollout.max_concurrency": LOOP_MAX_CONCURRENCY * GROUP_SIZE,  # episodes: the same groups
        })  # fmt: skip
    return [f"{k}={v}" for k, v in settings.items()]


def loop_arm(model_dir: str, prompts: str, run_dir: str, arm: Arm, steps: int, extra: list[str]) -> dict:
    """In this (fresh) process: the loop with one trainer thread; its per-step perf history and, per step,
    the trained samples' (hard prompt?, response tokens). `extra`: `--set` overrides, after the benchmark's
    own."""
    import torch

    from megatron_tail.config import load_config
    from megatron_tail.train.run.loop import run

    torch.set_num_threads(1)
    trained: list[list[tuple[bool, int]]] = []
    record_trained_samples(trained)
    cfg = load_config(
        None, [*loop_overrides(Path(model_dir), Path(prompts), Path(run_dir), arm, steps), *extra]
    )
    started = time.perf_counter()
    result = run(cfg)
    return {"history": result.history, "wall_s": time.perf_counter() - started, "trained": trained}


PHASES = [
    ("trainer waits for rollout", "perf/rollout_wait_s"),
    ("log-prob recompute", "perf/logprob_time_s"),
    ("train (recompute + update)", "perf/train_time_s"),
    ("weight sync", "perf/weight_sync_time_s"),
    ("step", "perf/step_time_s"),
]
ROLLOUT = [
    ("engine idle fraction", "perf/engine_idle_fraction", ".2f"),
    ("sequences in flight (time mean)", "perf/engine_sequences_mean", ".1f"),
    ("response length mean", "response/length_mean", ".1f"),
    ("response length max", "response/length_max", ".0f"),
    ("staleness mean", "rollout/staleness_mean", ".2f"),
    ("staleness max", "rollout/staleness_max", ".0f"),
    ("partial fraction", "rollout/partial_fraction", ".2f"),
    ("versions per sample", "rollout/versions_per_sample_mean", ".2f"),
    ("dropped stale (samples / step)", "rollout/dropped_stale", ".1f"),
    ("model turns per episode", "rollout/turns_mean", ".2f"),
]
TRAINED = [
    ("dropped samples (all steps)", "dropped_samples", ".0f"),
    ("trained length, longest-decile mean (all steps)", "length_top_decile_mean", ".1f"),
    ("trained length mean (all steps)", "length_trained_mean", ".1f"),
    ("hard-prompt fraction of trained samples", "hard_fraction", ".3f"),
]


def summarize_loop(history: list[dict], trained: list[list] | None = None) -> dict[str, float]:
    """Means over the steady steps 2..N−1 (step 1 waits for a first batch in every arm; after the last
    step an ahead-running arm's generation is thrown away); steps/s = 1 / mean step time;
    `rollout/staleness_max` is the maximum over them. Over all steps: `dropped_samples` (the sum of
    `rollout/dropped_stale`) and, given `trained` (per step, the trained samples' (hard?, length)), the
    trained lengths' statistics (`loop_model.length_stats`)."""
    if len(history) < 3:
        raise ValueError(f"need ≥ 3 steps for steady-state means; got {len(history)}")
    steady = history[1:-1]
    # a rollout metric no steady step logged (turns without an environment) stays out: the table shows "–"
    keys = {key for _, key in PHASES} | {key for _, key, _ in ROLLOUT if any(key in h for h in steady)}
    out = {key: statistics.fmean(h.get(key, 0.0) for h in steady) for key in keys}
    out["rollout/staleness_max"] = max(h.get("rollout/staleness_max", 0.0) for h in steady)
    out["steps_per_s"] = 1.0 / out["perf/step_time_s"]
    out["engine_idle_s"] = out["perf/engine_idle_fraction"] * out["perf/step_time_s"]
    out["dropped_samples"] = float(sum(h.get("rollout/dropped_stale", 0.0) for h in history))
    if trained is not None:
        out.update(length_stats([(bool(h), int(n)) for step in trained for h, n in step]))
    return out


def arms_json(arms: dict[str, dict[str, float]]) -> dict:
    """The `--json` line: per arm its settings (`env`, `max_staleness`, `partial_rollouts`, `pause_mode`),
    steps/s, `speedup_vs_sync` against the synchronous arm of its workload (null if that arm did not run),
    `dropped_samples`, and the rest."""
    out = {}
    for name, summary in arms.items():
        arm = ARMS[name]
        base = arms.get(arm.baseline)
        out[name] = {
            "env": arm.env,
            "max_staleness": arm.staleness,
            "partial_rollouts": arm.partial,
            "pause_mode": arm.pause_mode,
            "steps_per_s": summary["steps_per_s"],
            "speedup_vs_sync": None if base is None else summary["steps_per_s"] / base["steps_per_s"],
            **{k: v for k, v in summary.items() if k != "steps_per_s"},
        }
    return {"arms": out}


def format_loop(arms: dict[str, dict[str, float]], cores: str) -> str:
    """One table per workload (single-turn, then agentic), each arm against its workload's synchronous arm."""
    lines = [
        "Loop (tiny Qwen3 hidden 64 × 2 layers, TP = 1, trainer and engine one torch thread each; "
        f"{cores}; packed micro-batches of {LOOP_TOKENS_PER_MICRO_BATCH} tokens; ≤ {LOOP_MAX_CONCURRENCY} "
        "groups generating at once under the manager), prompt-driven lengths (half the prompts hard: EOS "
        f"p = {EASY_EOS_P} per token on easy prompts, {HARD_EOS_P} on hard ones, `bench/loop_model.py`), "
        f"{GROUP_SIZE} samples × 8 prompts per step; single-turn max_new_tokens {LONG_TAIL_MAX_NEW_TOKENS}; "
        f"agentic: calculator, ≤ {AGENTIC_MAX_TURNS} turns of ≤ {AGENTIC_MAX_NEW_TOKENS} tokens, top-p 0.95, "
        "top-k 20; means of steps 2..N−1 unless marked:",
    ]
    for baseline in dict.fromkeys(ARMS[n].baseline for n in arms):
        names = [n for n in arms if ARMS[n].baseline == baseline]
        lines += ["", _table(arms, names, arms.get(baseline))]
    return "\n".join(lines)


def _table(arms: dict[str, dict[str, float]], names: list[str], base: dict | None) -> str:
    header = " | ".join(f"{n} ({ARMS[n].label()})" for n in names)
    lines = [f"| seconds per step | {header} |", "|---|" + "---|" * len(names)]
    lines += [
        f"| {label} | " + " | ".join(f"{arms[n].get(key, 0.0):.3f}" for n in names) + " |"
        for label, key in PHASES
    ]
    for label, key, fmt in ROLLOUT + TRAINED:
        cells = [format(arms[n][key], fmt) if key in arms[n] else "–" for n in names]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines += [
        "| engine idle s per step | " + " | ".join(f"{arms[n]['engine_idle_s']:.3f}" for n in names) + " |",
        "| **steps/s** | " + " | ".join(f"{arms[n]['steps_per_s']:.3f}" for n in names) + " |",
    ]
    if base is not None:
        speedups = [f"**{arms[n]['steps_per_s'] / base['steps_per_s']:.2f}×**" for n in names]
        lines.append("| **speedup vs sync** | " + " | ".join(speedups) + " |")
    return "\n".join(lines)


# Generation's share of a synchronous step in long-CoT GRPO on GPUs (assumptions, not measurements): the
# range reported for synchronous systems in AReaL (arXiv 2505.24298, §1 and Fig. 1: generation dominates
# the step) and verl's fully-async recipe; we tabulate 0.5, 0.7 and 0.9 instead of picking one.
GENERATION_SHARES = (0.5, 0.7, 0.9)


def project_staleness(arms: dict[str, dict[str, float]]) -> str:
    """The Qwen3-8B recipe's gain, projected from the measured engine occupancy: in the synchronous arm the
    engines hold `seq_sync = sequences_mean / (1 − idle)` sequences on average while they generate (the
    long tail); the best partial arm keeps `seq_async` in flight. Decode on a GPU is memory-bound, so its
    step time is nearly flat in the batch: generating a step's tokens takes ≈ `seq_sync / seq_async` of the
    synchronous time. With generation a share g of the synchronous step and training the rest (overlapped
    when asynchronous), the projected speedup is 1 / max(g · seq_sync / seq_async, 1 − g)."""
    if "sync" not in arms:
        return ""
    sync = arms["sync"]
    busy = max(1.0 - sync["perf/engine_idle_fraction"], 1e-9)
    seq_sync = sync["perf/engine_sequences_mean"] / busy
    singles = [n for n in arms if ARMS[n].partial and ARMS[n].env is None]
    best = max(singles, key=lambda n: arms[n]["steps_per_s"], default=None)
    if best is None:
        return ""
    a = arms[best]
    seq_async = a["perf/engine_sequences_mean"] / max(1.0 - a["perf/engine_idle_fraction"], 1e-9)
    ratio = seq_sync / max(seq_async, 1e-9)
    lines = [
        "**Projection** (not a measurement) for the Qwen3-8B recipe (`examples/qwen3_8b_grpo_dvp`): measured "
        f"here, the synchronous engines generate with {seq_sync:.1f} sequences in flight on average (idle "
        f"{sync['perf/engine_idle_fraction']:.0%} of the step), `{best}` with {seq_async:.1f}; on a GPU, "
        "decode is memory-bound and its step time nearly flat in the batch, so a step's tokens take "
        f"≈ {ratio:.2f}× the synchronous generation time. With generation a share g of the synchronous "
        "step (assumed, not measured on GPUs here) and training overlapped:",
        "",
        "| g (generation share of a sync step) | " + " | ".join(f"{g:.1f}" for g in GENERATION_SHARES) + " |",
        "|---|" + "---|" * len(GENERATION_SHARES),
        "| projected speedup vs sync | "
        + " | ".join(f"{1.0 / max(g * ratio, 1.0 - g):.2f}×" for g in GENERATION_SHARES)
        + " |",
    ]
    return "\n".join(lines)


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
    env[PARENT_PID_ENV] = str(os.getpid())  # an arm trains with its own engines: it dies with the benchmark
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


def _check_overrides(
    parser: argparse.ArgumentParser, work: Path, arms: list[str], overrides: list[str]
) -> None:
    """A bad `--set` is refused here, in one line, before any arm starts its subprocess."""
    from megatron_tail.config import load_config

    for name in arms:
        arm = loop_overrides(work, work / "prompts.jsonl", work / f"run_{name}", ARMS[name], 3)
        try:
            load_config(None, [*arm, *overrides])
        except ValueError as e:
            parser.error(f"--set: {e}")


def run_loop_suite(
    work: Path, steps: int, arms: list[str], extra: list[str] = ()
) -> dict[str, dict[str, float]]:
    models = {None: work / "long_tail_model", "calculator": work / "agentic_model"}
    prompts = work / "prompts.jsonl"
    write_prompt_mix(prompts)
    out = {}
    for name in arms:
        arm = ARMS[name]
        save_long_tail_model(models[arm.env], tool_calls=arm.env is not None)
        # a kept --workdir holds the last run's checkpoint, which the loop would resume from
        shutil.rmtree(work / f"run_{name}", ignore_errors=True)
        args = [str(models[arm.env]), str(prompts), str(work / f"run_{name}"), name, str(steps)]
        result = _subprocess_json(["--loop-arm", *args, json.dumps(list(extra))])
        out[name] = summarize_loop(result["history"], result["trained"])
        print(f"loop {name}: {out[name]['steps_per_s']:.3f} steps/s", file=sys.stderr, flush=True)
    return out


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
    parser.add_argument("--steps", type=int, default=10, help="RL steps per loop arm")
    parser.add_argument("--arms", nargs="+", choices=list(ARMS), default=list(ARMS), help="loop arms to run")
    parser.add_argument("--json", action="store_true", help="last line: the loop arms as JSON")
    parser.add_argument("--repeats", type=int, default=2, help="timed syncs per path (after one warm-up)")
    parser.add_argument("--bucket-mb", type=float, default=64.0, help="bucket of the distributed sync")
    parser.add_argument("--workdir", help="keep models and runs here (default: a temp dir)")
    parser.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
        help="config override for every loop arm, after the benchmark's own (repeatable)",
    )  # fmt: skip
    parser.add_argument("--loop-arm", nargs=6, help=argparse.SUPPRESS)
    parser.add_argument("--sync-probe", nargs=7, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if (args.loop_arm or args.sync_probe) and (parent := os.environ.pop(PARENT_PID_ENV, None)):
        die_with_parent(int(parent))  # a benchmark killed (kill -9, OOM) leaves no arm training under PID 1
    if args.loop_arm:
        model, prompts, run_dir, name, steps, extra = args.loop_arm
        result = loop_arm(model, prompts, run_dir, ARMS[name], int(steps), json.loads(extra))
        print(json.dumps(result))
        return
    if args.sync_probe:
        path, model, url, out, repeats, bucket, source_dtype = args.sync_probe
        print(json.dumps(sync_probe(path, model, url, out, int(repeats), float(bucket), source_dtype)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.workdir or tmp)
        work.mkdir(parents=True, exist_ok=True)
        arms = None
        if "loop" in args.suites:
            missing = sorted({ARMS[n].baseline for n in args.arms} - set(args.arms))
            if missing:
                parser.error(
                    f"--arms must include {', '.join(missing)} (the baseline of their workload's ratios)"
                )
            _check_overrides(parser, work, args.arms, args.overrides)
            arms = run_loop_suite(work, args.steps, args.arms, args.overrides)
            cores = f"{os.cpu_count()} cores"
            print(format_loop(arms, cores), flush=True)
            print(flush=True)
            print(project_staleness(arms), flush=True)
            print(flush=True)
        if "sync" in args.suites:
            print(run_sync_suite(work, args.repeats, args.bucket_mb), flush=True)
        if args.json and arms is not None:
            print(json.dumps(arms_json(arms)), flush=True)


if __name__ == "__main__":
    main()
