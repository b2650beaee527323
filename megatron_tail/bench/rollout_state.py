"""Benchmark of the rollout manager's checkpointed groups (the samples generated ahead, which a resume
trains on): number lists packed into tensors (`utils.packed_rows`, what `RolloutBatch.to_dict` writes)
against the plain lists written before, in one run (CPU).

    python -m megatron_tail.bench.rollout_state [--groups 64] [--samples 8] [--tokens 2048] [--repeats 2]

Each group is a `RolloutBatch` of `--samples` samples with `--tokens` response tokens (256 prompt tokens),
its log-probs, top-1 log-probs and token versions: the manager state's `buffer` as `GroupResult.to_state`
makes it. Per layout: `torch.save` to a file, `torch.load(weights_only=True)` (as
`checkpoint.read_rank0_object` reads it on resume) and `RolloutBatch.from_dict` of every group, best of
`--repeats`; the file's size. Ratios: lists ÷ packed.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

from megatron_tail.rollout.batch import RolloutBatch, _plain
from megatron_tail.rollout.columns import LOGPROBS, TOP_LOGPROBS, VERSIONS


def make_groups(groups: int, samples: int, tokens: int, seed: int = 0) -> list[RolloutBatch]:
    rng = random.Random(seed)
    out = []
    for _ in range(groups):
        responses = [[rng.randrange(151_936) for _ in range(tokens)] for _ in range(samples)]
        logprobs = [[-3 * rng.random() for _ in range(tokens)] for _ in range(samples)]
        out.append(
            RolloutBatch(
                prompt_ids=[[rng.randrange(151_936) for _ in range(256)]] * samples,
                response_ids=responses,
                rewards=[float(rng.random() < 0.5) for _ in range(samples)],
                correct=[False] * samples,
                truncated=[False] * samples,
                weight_versions=["3"] * samples,
                columns={
                    LOGPROBS: logprobs,
                    TOP_LOGPROBS: [[max(v, -0.01) for v in row] for row in logprobs],
                    VERSIONS: [[3] * tokens for _ in range(samples)],
                },
            )
        )
    return out


LAYOUTS = {"lists": _plain, "packed": RolloutBatch.to_dict}
"""How a group's batch is written: as before packing (`_plain`, the lists themselves) and as now."""


def measure(groups: list[RolloutBatch], layout: str, repeats: int, directory: Path) -> dict[str, float]:
    """Best seconds of save, load and from_dict over `repeats`, and the file's MB; checks the round trip."""
    file = directory / f"{layout}.pt"
    best = {"save_s": float("inf"), "load_s": float("inf"), "from_dict_s": float("inf")}
    for _ in range(repeats):
        start = time.perf_counter()
        state = {
            "buffer": [{"index": i, "batch": LAYOUTS[layout](g), "version": 3} for i, g in enumerate(groups)]
        }
        torch.save(state, file)
        saved = time.perf_counter()
        loaded = torch.load(file, weights_only=True)
        read = time.perf_counter()
        back = [RolloutBatch.from_dict(g["batch"]) for g in loaded["buffer"]]
        done = time.perf_counter()
        for key, value in zip(best, (saved - start, read - saved, done - read), strict=True):
            best[key] = min(best[key], value)
    if [b.response_ids for b in back] != [g.response_ids for g in groups] or [b.columns for b in back] != [
        g.columns for g in groups
    ]:
        raise AssertionError(f"the {layout} layout did not round-trip")
    return {**best, "file_mb": file.stat().st_size / 2**20}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--groups", type=int, default=64)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=2048, help="response tokens per sample")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args(argv)
    groups = make_groups(args.groups, args.samples, args.tokens)
    tokens = args.groups * args.samples * args.tokens
    with tempfile.TemporaryDirectory() as tmp:
        rows = {layout: measure(groups, layout, args.repeats, Path(tmp)) for layout in LAYOUTS}
    print(
        f"{args.groups} groups × {args.samples} samples × {args.tokens} response tokens ({tokens:,} tokens)"
    )
    print("| layout | save s | load s (weights_only) | from_dict s | resume total s | file MB |")
    print("|---|---|---|---|---|---|")
    for layout, r in rows.items():
        print(
            f"| {layout} | {r['save_s']:.2f} | {r['load_s']:.2f} | {r['from_dict_s']:.2f} | "
            f"{r['load_s'] + r['from_dict_s']:.2f} | {r['file_mb']:.0f} |"
        )
    lists, packed = rows["lists"], rows["packed"]
    resume = {layout: r["load_s"] + r["from_dict_s"] for layout, r in rows.items()}
    ratios = [lists[k] / packed[k] for k in ("save_s", "load_s", "from_dict_s")]
    print(
        f"| lists ÷ packed | {ratios[0]:.2f}× | {ratios[1]:.1f}× | {ratios[2]:.2f}× | "
        f"{resume['lists'] / resume['packed']:.1f}× | {lists['file_mb'] / packed['file_mb']:.2f}× |"
    )
    scale = 16e6 / tokens
    print(
        f"projected, not measured (linear in tokens): a resume reading a step buffered ahead of 16M tokens "
        f"spends {scale * resume['lists']:.0f} s with lists, {scale * resume['packed']:.1f} s packed"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
