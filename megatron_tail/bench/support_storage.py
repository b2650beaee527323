"""Benchmark of how sampling supports are stored: ragged (CSR, `utils.ragged`, what the trainer does now)
against the dense layout it replaced (each sample's supports padded to its widest token, each micro-batch's
field padded to its widest sample, and an int64 copy per pass), at several top_k in one run.

    python -m megatron_tail.bench.support_storage [--k 20 256 4096] [--samples 32] [--response 512]
                                                  [--vocab 8192] [--max-tokens 4096] [--repeats 2] [--json]

Support sizes per token, a truncated sampler's typical mix: 1 + ⌊Exp(mean 3)⌋ ids, capped at K, and 1% of
the tokens (the high-entropy ones) at K itself. Per K and layout:
  host B/tok   the step's supports in a trainer rank's host memory, per response token (every rank holds the
               whole batch);
  sent B/tok   their pickled size (what `broadcast_object_list` sends each rank), per response token;
  op MiB       the largest micro-batch's support as the op gets it (dense int64 before; now dense int32 plus
               the micro-batch's ragged copy, both on the device);
  step s       the supports' part of a trainer step: pack the samples into micro-batches, then per
               micro-batch the θ_old pass (support to the op's form + op forward) and the update pass (the
               same + backward) on bf16 logits `[T, V]` taken over by the op, as the trainer's unfused path;
               the model's forward and backward, the same in both layouts, are left out.
Times: layouts interleaved, median over repeats, one thread.
"""

from __future__ import annotations

import argparse
import json
import pickle
import statistics
import time

import torch

from megatron_tail.ops import vocab_parallel_masked_logprobs
from megatron_tail.train.engine.batch import Sample, pack_micro_batches
from megatron_tail.train.engine.forward import SAMPLING_SUPPORT_FIELD, sampling_support
from megatron_tail.utils.ragged import Ragged

LAYOUTS = ("dense", "ragged")
DENSE_FIELD = "support_plus1"
"""The layout before: `[len(response), K_i]` int32 ids + 1 (0 padding), via the builder's trailing dims."""
FULL_FRACTION = 0.01
MEAN_EXTRA = 3.0
PROMPT_TOKENS = 64


def make_supports(response: list[int], k: int, vocab: int, gen: torch.Generator) -> Ragged:
    """Each token's support: the token and `size − 1` other distinct ids (an odd stride mod a power-of-2
    vocabulary never repeats), sizes as in the module docstring."""
    n = len(response)
    sizes = (1 + torch.empty(n).exponential_(1 / MEAN_EXTRA, generator=gen).floor()).clamp(max=k).long()
    sizes[torch.rand(n, generator=gen) < FULL_FRACTION] = k
    rows = [
        ((t + torch.arange(s) * 7919) % vocab).tolist() for t, s in zip(response, sizes.tolist(), strict=True)
    ]
    return Ragged.from_lists(rows)


def make_samples(samples: int, response: int, k: int, vocab: int, seed: int = 0) -> dict[str, list[Sample]]:
    """The same samples in both layouts."""
    gen = torch.Generator().manual_seed(seed)
    out: dict[str, list[Sample]] = {layout: [] for layout in LAYOUTS}
    for _ in range(samples):
        ids = torch.randint(0, vocab, (PROMPT_TOKENS + response,), generator=gen).tolist()
        prompt, resp = ids[:PROMPT_TOKENS], ids[PROMPT_TOKENS:]
        ragged = make_supports(resp, k, vocab, gen)
        out["ragged"].append(Sample(prompt, resp, {SAMPLING_SUPPORT_FIELD: ragged}))
        out["dense"].append(Sample(prompt, resp, {DENSE_FIELD: ragged.dense() + 1}))
    return out


def host_bytes(samples: list[Sample]) -> tuple[int, int]:
    """(bytes in memory, pickled bytes) of the samples' supports."""
    values = [next(iter(s.fields.values())) for s in samples]
    held = sum(v.nbytes if isinstance(v, Ragged) else v.numel() * v.element_size() for v in values)
    return held, len(pickle.dumps(values, protocol=pickle.HIGHEST_PROTOCOL))


def op_support(layout: str, mb) -> torch.Tensor:
    """The support as each layout hands it to the op (before: the field's int64 copy, ids − 1)."""
    return mb.fields[DENSE_FIELD].long() - 1 if layout == "dense" else sampling_support(mb)


def op_bytes(layout: str, mb) -> int:
    support = op_support(layout, mb)
    ragged = mb.fields[SAMPLING_SUPPORT_FIELD].nbytes if layout == "ragged" else 0
    return support.numel() * support.element_size() + ragged


def run_step(layout: str, samples: list[Sample], logits: torch.Tensor, max_tokens: int) -> float:
    """Seconds of the supports' part of one step (module docstring); logits clones are not timed."""
    t0 = time.perf_counter()
    mbs = pack_micro_batches(samples, max_tokens=max_tokens)
    elapsed = time.perf_counter() - t0
    for mb in mbs:
        t = mb.tokens.shape[1]
        old = logits[:t].clone()
        t0 = time.perf_counter()
        with torch.no_grad():
            vocab_parallel_masked_logprobs(old, mb.targets[0], sampling_support=op_support(layout, mb)[0])
        elapsed += time.perf_counter() - t0
        x = logits[:t].clone().requires_grad_()
        t0 = time.perf_counter()
        out = vocab_parallel_masked_logprobs(
            x, mb.targets[0], sampling_support=op_support(layout, mb)[0], inplace_backward=True
        )
        (out.logprobs.sum() + out.entropy.sum()).backward()
        elapsed += time.perf_counter() - t0
    return elapsed


def measure(k: int, args) -> dict:
    data = make_samples(args.samples, args.response, k, args.vocab)
    tokens = args.samples * args.response
    logits = (torch.randn(args.max_tokens, args.vocab) * 4).bfloat16()
    row = {"k": k}
    for layout in LAYOUTS:
        held, sent = host_bytes(data[layout])
        mbs = pack_micro_batches(data[layout], max_tokens=args.max_tokens)
        row[layout] = {
            "host_bytes_per_token": held / tokens,
            "sent_bytes_per_token": sent / tokens,
            "op_bytes": max(op_bytes(layout, mb) for mb in mbs),
            "step_s": [],
        }
    run_step("ragged", data["ragged"][:2], logits, args.max_tokens)  # warm up
    for _ in range(args.repeats):
        for layout in LAYOUTS:
            row[layout]["step_s"].append(run_step(layout, data[layout], logits, args.max_tokens))
    for layout in LAYOUTS:
        row[layout]["step_s"] = statistics.median(row[layout]["step_s"])
    return row


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--k", type=int, nargs="+", default=[20, 256, 4096], help="top_k: the support bound")
    parser.add_argument("--samples", type=int, default=32)
    parser.add_argument("--response", type=int, default=512, help="response tokens per sample")
    parser.add_argument("--vocab", type=int, default=8192, help="a power of 2 (the ids' stride)")
    parser.add_argument("--max-tokens", type=int, default=4096, help="packed micro-batch budget")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--json", action="store_true", help="one JSON line per K instead of the table")
    args = parser.parse_args(argv)
    if args.vocab & (args.vocab - 1) or max(args.k) > args.vocab:
        parser.error(f"--vocab must be a power of 2 ≥ every --k; got {args.vocab} and {args.k}")
    torch.set_num_threads(1)
    print(
        f"Support storage: {args.samples} samples x {args.response} response tokens, vocab {args.vocab}, "
        f"micro-batches of {args.max_tokens} tokens; sizes 1 + Exp(mean {MEAN_EXTRA:g}), {FULL_FRACTION:.0%} "
        "at K; ratios ragged / dense\n"
    )
    if not args.json:
        print("| K | host B/tok dense | ragged | ratio | sent B/tok ratio | op MiB dense | ragged | ratio "
              "| step s dense | ragged | ratio |")  # fmt: skip
        print("|---|---|---|---|---|---|---|---|---|---|---|")
    for k in args.k:
        row = measure(k, args)
        if args.json:
            print(json.dumps(row), flush=True)
            continue
        d, r = row["dense"], row["ragged"]
        mib = 1 << 20
        cells = [
            f"{d['host_bytes_per_token']:.0f}",
            f"{r['host_bytes_per_token']:.0f}",
            f"{r['host_bytes_per_token'] / d['host_bytes_per_token']:.3f}",
            f"{r['sent_bytes_per_token'] / d['sent_bytes_per_token']:.3f}",
            f"{d['op_bytes'] / mib:.1f}",
            f"{r['op_bytes'] / mib:.1f}",
            f"{r['op_bytes'] / d['op_bytes']:.2f}",
            f"{d['step_s']:.2f}",
            f"{r['step_s']:.2f}",
            f"{r['step_s'] / d['step_s']:.2f}",
        ]
        print(f"| {k} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
