"""Benchmark: padded micro-batches against THD micro-batches packed by a token budget (CPU, TP = 1).

    python -m megatron_tail.bench.packing [--samples 64] [--max-len 512] [--budget 1024] [--repeats 2]

A long-tail mix of lengths shaped like RL traces (prompts 16–64 tokens; responses log-normal around a
short median, 10% cut at the maximum, as truncated responses are), one optimizer step of a small random
Qwen3 (hidden 256, 4 layers) on the local spec with the masked-NLL loss, in two layouts:
  padded  `train.packed: false`: 8 samples per micro-batch, every row padded to the longest sample
  packed  `train.max_tokens_per_micro_batch: --budget`: THD rows, first-fit decreasing
Each arm runs in a fresh forked process: token slots (rows × length the model computes), packing efficiency
(sample tokens ÷ slots), seconds per step (median of `--repeats` after one warm-up step) and the peak RSS
above the RSS before the first step. Ratios are padded ÷ packed, measured in the same run.

Then a projection (not a measurement) of the token slots on the Qwen3-8B recipe's length mix (prompts ≤
1024, responses ≤ 4096, the same long-tail shape), padded to the longest sample vs packed by the
recipe's 5120-token budget: pure arithmetic of the packing plan.
"""

from __future__ import annotations

import argparse
import json
import math
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
    head_dim=64, max_position_embeddings=1024,
)  # fmt: skip


def rl_lengths(n: int, max_prompt: int, max_response: int, seed: int) -> list[tuple[int, int]]:
    """(prompt, response) lengths: prompts uniform in [max_prompt/4, max_prompt]; responses log-normal with
    median max_response/8 (σ = 1), 10% of them at max_response (truncated), all in [1, max_response]."""
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(max(1, max_prompt // 4), max_prompt + 1, (n,), generator=g)
    responses = (
        torch.exp(math.log(max_response / 8) + torch.randn(n, generator=g)).round().clamp(1, max_response)
    )
    truncated = torch.rand(n, generator=g) < 0.1
    responses = torch.where(truncated, torch.full_like(responses, max_response), responses)
    return [(int(p), int(r)) for p, r in zip(prompts, responses, strict=True)]


def _arm_rank(rank, world_size, hf_dir, lengths, packed, budget, repeats):  # noqa: ARG001
    from megatron_tail.model import ModelSettings, load_hf_config
    from megatron_tail.train import (
        OptimizerSettings,
        Sample,
        build_trainer,
        init_parallel,
        make_micro_batches,
        pack_micro_batches,
        train_step,
    )

    torch.set_num_threads(1)
    init_parallel(seed=1)
    arch = load_hf_config(hf_dir)
    trainer = build_trainer(
        arch, hf_dir=hf_dir, model_settings=ModelSettings(), optim=OptimizerSettings(lr=1e-5)
    )
    g = torch.Generator().manual_seed(0)
    samples = [
        Sample(torch.randint(0, arch.vocab_size, (p,), generator=g).tolist(),
               torch.randint(0, arch.vocab_size, (r,), generator=g).tolist())
        for p, r in lengths
    ]  # fmt: skip
    if packed:
        mbs = pack_micro_batches(samples, max_tokens=budget)
    else:
        mbs = make_micro_batches(samples, micro_batch_size=8)
    n = sum(mb.num_loss_tokens for mb in mbs)

    def loss_fn(out, mb):
        loss = -torch.where(mb.loss_mask, out.logprobs, torch.zeros_like(out.logprobs)).sum() / n
        return loss, {"loss": loss.detach().double()}

    base = rss_bytes()
    reset = reset_peak_rss()
    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        train_step(trainer, mbs, loss_fn)
        times.append(time.perf_counter() - start)
    slots = sum(mb.num_slots for mb in mbs)
    return {
        "micro_batches": len(mbs),
        "slots": slots,
        "efficiency": sum(mb.num_sample_tokens for mb in mbs) / slots,
        "step_s": statistics.median(times[1:]),
        "peak_mib": (peak_rss_bytes(reset) - base) / 2**20,
    }


def run_arm(hf_dir: str, lengths, packed: bool, budget: int, repeats: int) -> dict:
    from megatron_tail.utils.forked import run_distributed

    return run_distributed(_arm_rank, 1, hf_dir, lengths, packed, budget, repeats, timeout=3600)[0]


def format_table(padded: dict, packed: dict) -> str:
    rows = [
        ("micro-batches", "micro_batches", "{:.0f}"),
        ("token slots", "slots", "{:,.0f}"),
        ("packing efficiency", "efficiency", "{:.3f}"),
        ("step time (s)", "step_s", "{:.2f}"),
        ("peak RSS above start (MiB)", "peak_mib", "{:.0f}"),
    ]
    out = ["| | padded | packed (THD) | padded ÷ packed |", "|---|---|---|---|"]
    for name, key, fmt in rows:
        ratio = padded[key] / packed[key] if packed[key] else float("nan")
        out.append(f"| {name} | {fmt.format(padded[key])} | {fmt.format(packed[key])} | {ratio:.2f}× |")
    return "\n".join(out)


def project_8b(samples: int = 1024, seed: int = 0) -> str:
    """Token slots of one Qwen3-8B step (128 prompts × 8), padded vs packed by 5120 tokens: a projection."""
    from megatron_tail.train.engine.packing import pack_by_token_budget

    lengths = [p + r for p, r in rl_lengths(samples, 1024, 4096, seed)]
    bins = pack_by_token_budget(lengths, 5120)
    padded = len(lengths) * max(lengths)
    packed = sum(lengths)  # THD rows hold exactly their tokens (no sequence-parallel rounding at TP=2: ≤ 1)
    return "\n".join(
        [
            "Projection (arithmetic of the packing plan, not a measurement): Qwen3-8B recipe, 1024 samples,",
            "prompts ≤ 1024 and responses ≤ 4096 tokens in the long-tail mix above (an assumed shape, not a",
            "measured trace):",
            f"  padded to the longest sample: {padded:,} token slots",
            f"  packed by 5120 tokens:        {packed:,} token slots in {len(bins)} micro-batches "
            f"(mean fill {packed / (len(bins) * 5120):.3f})",
            f"  slots saved: {padded / packed:.2f}×",
        ]
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--max-len", type=int, default=512, help="longest prompt + response")
    parser.add_argument("--budget", type=int, default=1024, help="tokens per packed micro-batch")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    lengths = rl_lengths(args.samples, args.max_len // 8, args.max_len - args.max_len // 8, seed=1)
    with tempfile.TemporaryDirectory() as work:
        from .loop import _save_model

        _save_model({**MODEL, "max_position_embeddings": args.max_len}, Path(work))
        padded = run_arm(work, lengths, False, args.budget, args.repeats)
        packed = run_arm(work, lengths, True, args.budget, args.repeats)
    total = sum(p + r for p, r in lengths)
    print(
        f"{args.samples} samples, {total:,} tokens (longest {max(p + r for p, r in lengths)}), "
        f"budget {args.budget}; one optimizer step, TP=1, 1 thread"
    )
    print(format_table(padded, packed))
    print()
    print(project_8b())
    print(json.dumps({"padded": padded, "packed": packed}), file=sys.stderr)


if __name__ == "__main__":
    main()
