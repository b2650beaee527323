"""Benchmark: one long sequence, one optimizer step at context parallelism CP=1 against CP=2 (CPU, gloo).

    python -m megatron_tail.bench.context_parallel [--tokens 4096] [--repeats 2]

A small random Qwen3 (hidden 256, 4 layers, 4 query / 2 key-value heads of 64) on the local spec trains one
packed sequence of `--tokens` tokens (prompt 64, the rest response) with the masked-NLL loss, in forked
gloo processes: 1 rank at CP=1, 2 ranks at CP=2 (each rank computes chunks r and 3−r of the sequence, the
attention all-gathers K/V and reduce-scatters their gradients). Per rank: seconds per step (median of
`--repeats` after a warm-up step, 1 thread per rank) and the peak RSS above the RSS after the warm-up
(the step's activations and temporaries; weights, gradients and Adam's state exist before it), and the
bytes autograd saves for backward in the warm-up step (the activations, exactly: a pack hook). Ratios
are CP=2 ÷ CP=1, measured in the same run. The communication is counted, not timed: each layer's
all-gather of K/V (forward) and reduce-scatter of their gradients (backward) move
(CP−1)/CP · tokens · 2 · kv_heads · head_dim values per rank each.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from .memory import peak_rss_bytes, reset_peak_rss, rss_bytes

MODEL = dict(
    hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
    head_dim=64,
)  # fmt: skip
PROMPT = 64


def _arm_rank(rank, world_size, hf_dir, tokens, repeats):  # noqa: ARG001
    from megatron_tail.config.parallel import ParallelSection
    from megatron_tail.model import ModelSettings, load_hf_config
    from megatron_tail.train import (
        OptimizerSettings,
        Sample,
        build_trainer,
        init_parallel,
        pack_micro_batches,
        train_step,
    )
    from megatron_tail.train.engine.context_parallel import split_for_context_parallel

    torch.set_num_threads(1)
    cp = world_size
    groups = init_parallel(ParallelSection(context_parallel=cp), seed=1)
    arch = load_hf_config(hf_dir)
    trainer = build_trainer(
        arch, hf_dir=hf_dir, model_settings=ModelSettings(), optim=OptimizerSettings(lr=1e-5)
    )
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, arch.vocab_size, (tokens,), generator=g).tolist()
    seq = 2 * cp if cp > 1 else 1
    (mb,) = pack_micro_batches(
        [Sample(ids[:PROMPT], ids[PROMPT:])], max_tokens=tokens, sequence_multiple=seq, pad_to_multiple=seq
    )
    n = mb.num_loss_tokens
    mbs = [split_for_context_parallel(mb, groups.cp_rank, cp)]

    def loss_fn(out, mb):
        loss = -torch.where(mb.loss_mask, out.logprobs, torch.zeros_like(out.logprobs)).sum() / n
        return loss, {"loss": loss.detach().double()}

    params = {p.untyped_storage().data_ptr() for c in trainer.chunks for p in c.parameters()}
    with _SavedBytes(params) as saved:  # warm-up: Adam's state and every buffer exist after it
        result = train_step(trainer, mbs, loss_fn)
    base = rss_bytes()
    reset = reset_peak_rss()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        result = train_step(trainer, mbs, loss_fn)
        times.append(time.perf_counter() - start)
    return {
        "tokens_per_rank": mbs[0].num_slots,
        "step_s": statistics.median(times),
        "peak_mib": (peak_rss_bytes(reset) - base) / 2**20,
        "saved_mib": saved.bytes / 2**20,
        "loss": result.metrics["loss"],
    }


class _SavedBytes:
    """Bytes of the floating-point storages autograd saves for backward (activations: parameters left out,
    each storage once), through a `saved_tensors_hooks` pack hook."""

    def __init__(self, params: set[int]):
        self._params, self._seen, self.bytes = params, set(), 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if t.is_floating_point() and ptr not in self._params and ptr not in self._seen:
            self._seen.add(ptr)
            self.bytes += t.untyped_storage().nbytes()
        return t

    def __enter__(self) -> _SavedBytes:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)


def run_arm(hf_dir: str, cp: int, tokens: int, repeats: int) -> list[dict]:
    from megatron_tail.utils.forked import run_distributed

    return run_distributed(_arm_rank, cp, hf_dir, tokens, repeats, timeout=3600)


def format_table(one: dict, two: list[dict]) -> str:
    worst = {key: max(r[key] for r in two) for key in ("step_s", "peak_mib", "saved_mib", "tokens_per_rank")}
    rows = [
        ("tokens per rank", "tokens_per_rank", "{:,.0f}"),
        ("step time (s)", "step_s", "{:.2f}"),
        ("activations saved for backward, per rank (MiB)", "saved_mib", "{:.1f}"),
        ("peak RSS above the warm-up step, per rank (MiB)", "peak_mib", "{:.0f}"),
    ]
    out = ["| | CP=1 | CP=2 (max over ranks) | CP=2 ÷ CP=1 |", "|---|---|---|---|"]
    for name, key, fmt in rows:
        ratio = worst[key] / one[key] if one[key] else float("nan")
        out.append(f"| {name} | {fmt.format(one[key])} | {fmt.format(worst[key])} | {ratio:.2f}× |")
    return "\n".join(out)


def communication(tokens: int, cp: int = 2) -> str:
    """The K/V exchange of one step at `cp`, per rank, in fp32 values (a count, not a timing)."""
    values = (cp - 1) * tokens // cp * 2 * MODEL["num_key_value_heads"] * MODEL["head_dim"]
    layers = MODEL["num_hidden_layers"]
    return (
        f"communication per rank and step at CP={cp}: {layers} layers × (all-gather of K/V forward + "
        f"reduce-scatter of their gradients backward) × {values:,} values = "
        f"{2 * layers * values * 4 / 2**20:.1f} MiB in fp32 (the θ_old gather of the RL step adds ~6 values "
        "per token once per step)"
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", type=int, default=4096, help="prompt + response (a multiple of 4)")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args(argv)
    if args.tokens % 4:
        raise SystemExit(f"--tokens must be a multiple of 4 (2·CP chunks at CP=2); got {args.tokens}")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory() as work:
        from .loop import _save_model

        _save_model({**MODEL, "max_position_embeddings": args.tokens}, Path(work))
        one = run_arm(work, 1, args.tokens, args.repeats)[0]
        two = run_arm(work, 2, args.tokens, args.repeats)
    print(f"one sequence of {args.tokens:,} tokens; one optimizer step, local spec, 1 thread per rank")
    print(format_table(one, two))
    print(f"loss CP=1 {one['loss']:.6f}, CP=2 {two[0]['loss']:.6f}")
    print(communication(args.tokens))
    print(json.dumps({"cp1": one, "cp2": two}), file=sys.stderr)


if __name__ == "__main__":
    main()
