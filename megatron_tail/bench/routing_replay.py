"""What MoE routing replay costs: trainer step time under `algorithm.routing_replay` r2 / r3 against none,
and the bytes per token the engine's routes take on the wire and in the trainer's rollout buffer.

    python -m megatron_tail.bench.routing_replay [--json] [--steps 4] [--repeats 2]

Time (measured, one run of this module): `megatron-tail train` on a random CPU-sized Qwen3-MoE (16 experts,
top-4, 4 layers; bf16 local engine, fp32 trainer, TP 1) once per arm and repeat, interleaved (none, r2, r3,
r3, r2, none, ...) because the machine is shared. Per arm: the mean over steps after the first of
`perf/logprob_time_s` (θ_old's recompute: under r2 it records, under r3 it replays) and `perf/train_time_s`
minus it (the update: r2 and r3 replay), and their sum; each as a ratio to `none`'s, with the standard error
of the sum over the timed steps (the spread a shared machine adds).

Bytes (arithmetic, not measurement, except the tiny model's row, which is checked against
`rollout.routes.encode_routes` and `rollout.routes.compact_routes` on a real array): a token's route is
layers × k expert ids. SGLang's `meta_info.routed_experts` is base64 of int32, 4/3 × 4 bytes per id on the
wire; the trainer's buffer keeps uint8 below 256 experts (Qwen3-MoE has 128), 1 byte per id.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

ARMS = ("none", "r2", "r3")

BENCH_MODEL = {
    "hidden_size": 128,
    "moe_intermediate_size": 64,
    "num_experts": 16,
    "num_experts_per_tok": 4,
    "num_hidden_layers": 4,
}
"""`demo.moe.tiny_qwen3_moe_config` overrides: big enough that the trainer's passes take measurable time."""

PROMPTS_PER_STEP = 64
"""× group size 8 = 512 samples per step: the trainer's passes take long enough to time."""

MODELS = [
    # (name, MoE layers, k, experts, how the row is known)
    ("bench model (16 experts, top-4)", 4, 4, 16, "measured"),
    ("Qwen3-30B-A3B", 48, 8, 128, "arithmetic"),
    ("Qwen3-235B-A22B", 94, 8, 128, "arithmetic"),
]


@dataclass(frozen=True)
class RouteBytes:
    """Bytes of one token's route (`layers × k` expert ids)."""

    name: str
    layers: int
    k: int
    wire: float
    """SGLang's reply: base64 of int32, 16/3 bytes per id (before base64's end padding)."""
    int32: int
    """Decoded int32, 4 bytes per id (what `decode_routes` returns)."""
    buffer: int
    """The trainer's rollout buffer (`compact_routes`): 1 byte per id below 256 experts."""
    source: str


def route_bytes(name: str, layers: int, k: int, experts: int, source: str) -> RouteBytes:
    ids = layers * k
    per_id = 1 if experts < 256 else 2 if experts < 32768 else 4
    return RouteBytes(name, layers, k, ids * 4 * 4 / 3, ids * 4, ids * per_id, source)


def measured_route_bytes(layers: int, k: int, experts: int, tokens: int = 3000) -> tuple[float, int]:
    """(wire bytes per token of `encode_routes`, buffer bytes per token of `compact_routes`) for random
    routes `[tokens, layers, k]` over `experts` experts."""
    import numpy as np

    from megatron_tail.rollout.routes import compact_routes, encode_routes

    routes = np.random.default_rng(0).integers(0, experts, (tokens, layers, k), dtype=np.int32)
    return len(encode_routes(routes)) / tokens, compact_routes(routes).nbytes // tokens


def bytes_lines(rows: list[RouteBytes], response_tokens: int = 32768) -> list[str]:
    """The bytes table: per token and per response of `response_tokens` tokens."""
    head = f"{'model':<34}{'layers×k':>9}{'wire B/tok':>12}{'int32 B/tok':>12}{'buffer B/tok':>13}"
    head += f"{'wire MB/resp':>13}{'buffer MB/resp':>15}  source"
    lines = [head]
    for r in rows:
        lines.append(
            f"{r.name:<34}{f'{r.layers}×{r.k}':>9}{r.wire:>12.1f}{r.int32:>12d}{r.buffer:>13d}"
            f"{r.wire * response_tokens / 1e6:>13.2f}{r.buffer * response_tokens / 1e6:>15.2f}  {r.source}"
        )
    return lines


def time_lines(times: dict[str, dict[str, list[float]]]) -> list[str]:
    """The time table. `times`: arm → {"old": [s per step], "update": [...]} (one list entry per measured
    step over every repeat), arms with `none` first; ratios to `none`'s mean."""
    means = {a: {p: _mean(v) for p, v in t.items()} for a, t in times.items()}
    for arm, m in means.items():
        m["step"] = m["old"] + m["update"]
        totals = [o + u for o, u in zip(times[arm]["old"], times[arm]["update"], strict=True)]
        m["se"] = _stderr(totals)
    base = means["none"]
    lines = [f"{'arm':<6}{'θ_old s':>10}{'update s':>10}{'total s':>10}{'θ_old ×':>10}{'update ×':>10}"
             f"{'total ×':>10}{'steps':>7}{'total s.e.':>12}"]  # fmt: skip
    for arm, m in means.items():
        ratios = [m[p] / base[p] if base[p] > 0 else float("nan") for p in ("old", "update", "step")]
        lines.append(
            f"{arm:<6}{m['old']:>10.3f}{m['update']:>10.3f}{m['step']:>10.3f}"
            + "".join(f"{r:>10.3f}" for r in ratios)
            + f"{len(times[arm]['old']):>7d}{m['se']:>12.3f}"
        )
    return lines


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def _stderr(values: list[float]) -> float:
    """Standard error of the mean (sample standard deviation / √n); nan below 2 values."""
    n = len(values)
    if n < 2:
        return float("nan")
    mean = _mean(values)
    return (sum((v - mean) ** 2 for v in values) / (n - 1) / n) ** 0.5


def _bench_model(root: Path) -> Path:
    from megatron_tail.demo.model import save_hf
    from megatron_tail.demo.moe import new_tiny_qwen3_moe

    model, tokenizer = new_tiny_qwen3_moe(0, **BENCH_MODEL)
    return save_hf(model, tokenizer, root / "bench_moe")


def measure_times(steps: int, repeats: int, *, log=print) -> dict[str, dict[str, list[float]]]:
    """Train `steps` steps per arm and repeat (interleaved, order reversed every other repeat); return the
    per-step θ_old and update seconds of every step but each run's first (warm-up)."""
    from megatron_tail.demo.run import ensure_data, launch_training, read_scalars, training_failed

    times = {a: {"old": [], "update": []} for a in ARMS}
    with tempfile.TemporaryDirectory(prefix="bench_routing_") as tmp:
        root = Path(tmp)
        model = _bench_model(root)
        train_file, _ = ensure_data(root / "cache")
        base = [
            f"model.hf_path={model}",
            f"data.train_path={train_file}",
            "data.eval_path=null",
            "parallel.tensor_parallel=1",
            f"data.prompts_per_step={PROMPTS_PER_STEP}",
            f"train.steps={steps}",
            "train.eval_every=0",
            f"train.checkpoint_every={steps}",
            "logging.progress=never",
        ]
        for rep in range(repeats):
            for arm in ARMS if rep % 2 == 0 else ARMS[::-1]:
                run_dir = root / f"{arm}_{rep}"
                log(f"  {arm} (repeat {rep + 1}/{repeats}) ...")
                knobs = [f"run_dir={run_dir}", f"algorithm.routing_replay={arm}"]
                outcome = launch_training(run_dir, [*base, *knobs], quiet=True)
                if (code := training_failed(outcome, f" {arm}, see {run_dir / 'train.log'},")) is not None:
                    raise SystemExit(code)
                scalars = read_scalars(run_dir)
                old = dict(scalars["perf/logprob_time_s"])
                train = dict(scalars["perf/train_time_s"])
                for step in sorted(old)[1:]:
                    times[arm]["old"].append(old[step])
                    times[arm]["update"].append(train[step] - old[step])
    return times


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    parser.add_argument("--steps", type=int, default=4, help="RL steps per run (the first is not timed)")
    parser.add_argument("--repeats", type=int, default=2, help="runs per arm, interleaved")
    args = parser.parse_args(argv)
    if args.steps < 2 or args.repeats < 1:
        print(f"need --steps ≥ 2 and --repeats ≥ 1; got {args.steps}, {args.repeats}", file=sys.stderr)
        return 2
    rows = [route_bytes(*m) for m in MODELS]
    wire, buffer = measured_route_bytes(*MODELS[0][1:4])
    if abs(wire - rows[0].wire) > 0.01 or buffer != rows[0].buffer:
        raise RuntimeError(
            f"encoded {wire} / {buffer} B per token; arithmetic {rows[0].wire} / {rows[0].buffer}"
        )
    say = (lambda _: None) if args.json else print
    times = measure_times(args.steps, args.repeats, log=say)
    if args.json:
        print(json.dumps({"times": times, "bytes": [r.__dict__ for r in rows]}))
        return 0
    print("\ntrainer time per step by routing replay (θ_old = recompute; update = optimizer step's passes):")
    print("\n".join(time_lines(times)))
    print("\nroutes per token (wire = SGLang's base64 int32; buffer = the trainer's uint8):")
    print("\n".join(bytes_lines(rows)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
