"""Benchmark of rank 0's per-token host work on an engine's reply, decoding and parsing, as it is now
against as it was, on the same replies, in one run (CPU; no server).

    python -m megatron_tail.bench.reply_parse [--tokens 32768] [--supports 0 20 200 2000] [--repeats 3]

Replies shaped as SGLang 0.5.23 sends them (`output_ids`; `meta_info.output_token_logprobs` as
[logprob, id, null], `output_top_logprobs` top-1, and with a support of K ids per token
`output_token_sampling_mask` and `output_token_sampling_logprobs`), as JSON bytes.
- decode: `json.loads` (before) against `rollout.json_body.loads` (now: orjson where installed);
- parse: `protocol.parse_generate_response` of the decoded replies with its fast checks (now) and with
  them made to refuse, so each parser runs its per-token loop (before).
Times: ns per response token, best of `--repeats` with the garbage collector off; ratios before ÷ now.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import json
import random
import sys
import time

from megatron_tail.rollout import json_body, protocol
from megatron_tail.rollout.columns import builtin
from megatron_tail.rollout.protocol import SamplingConfig, parse_generate_response, sample_keys

VOCAB = 151_936
REPLY_TOKENS = 1024


def make_replies(tokens: int, support: int, seed: int = 0) -> tuple[list[list[dict]], SamplingConfig]:
    """`tokens // REPLY_TOKENS` one-sample `/generate` bodies and the config that asks for what they hold."""
    rng = random.Random(seed)
    config = SamplingConfig(
        n_samples=1, max_new_tokens=REPLY_TOKENS, top_logprob=True, top_k=support or -1, log_rho=None
    )
    key = sample_keys(0, config)[0]
    bodies = []
    for _ in range(max(1, tokens // REPLY_TOKENS)):
        ids = [rng.randrange(VOCAB) for _ in range(REPLY_TOKENS)]
        full = [-3 * rng.random() for _ in ids]
        meta = {
            "id": f"{key.rid}-a1",
            "finish_reason": {"type": "length", "length": REPLY_TOKENS},
            "output_token_logprobs": [[lp, t, None] for lp, t in zip(full, ids, strict=True)],
            "output_top_logprobs": [[[max(lp, -0.01), t, None]] for lp, t in zip(full, ids, strict=True)],
        }
        if support:
            masks = [[*rng.sample(range(VOCAB), support - 1), t] for t in ids]
            meta["output_token_sampling_mask"] = masks
            meta["output_token_sampling_logprobs"] = [lp / 2 for lp in full]
        bodies.append(json.loads(json.dumps([{"output_ids": ids, "meta_info": meta}])))
    return bodies, config


@contextlib.contextmanager
def loops_only():
    """The fast checks refuse everything: each parser runs its per-token loop."""
    names = ("transposed", "firsts", "numbers", "logprob_values", "support_ids")
    saved = [getattr(builtin, n) for n in names], protocol.token_ids
    for name in names:
        setattr(builtin, name, lambda *_a: None)
    protocol.token_ids = lambda ids: isinstance(ids, list) and all(isinstance(t, int) and t >= 0 for t in ids)
    try:
        yield
    finally:
        for name, fn in zip(names, saved[0], strict=True):
            setattr(builtin, name, fn)
        protocol.token_ids = saved[1]


def time_parse(bodies: list, config: SamplingConfig, repeats: int) -> tuple[float, list]:
    """Best seconds over `repeats` to parse every body (each repeat on fresh copies: a parser pops the
    lists it consumed), and the last repeat's results."""
    keys = sample_keys(0, config)
    best, results = float("inf"), []
    for _ in range(repeats):
        fresh = copy.deepcopy(bodies)
        gc.collect()
        gc.disable()
        try:
            start = time.perf_counter()
            results = [parse_generate_response(b, [1], keys, config, 1, "http://bench") for b in fresh]
            best = min(best, time.perf_counter() - start)
        finally:
            gc.enable()
    return best, results


DECODERS = {"json": json.loads, "now": json_body.loads}


def time_decode(raws: list[bytes], decode, repeats: int) -> float:
    """Best seconds over `repeats` to decode every reply."""
    best = float("inf")
    for _ in range(repeats):
        gc.collect()
        gc.disable()
        try:
            start = time.perf_counter()
            for raw in raws:
                decode(raw)
            best = min(best, time.perf_counter() - start)
        finally:
            gc.enable()
    return best


def same_results(a: list, b: list) -> bool:
    """Whether two arms parsed to equal columns (supports compared id for id)."""
    for (x,), (y,) in zip(a, b, strict=True):
        for name, value in x.columns.items():
            other = y.columns[name]
            if hasattr(value, "values"):
                if (
                    value.values.tolist() != other.values.tolist()
                    or value.offsets.tolist() != other.offsets.tolist()
                ):
                    return False
            elif value != other:
                return False
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", type=int, default=32_768, help="response tokens per support size")
    parser.add_argument("--supports", type=int, nargs="+", default=[0, 20, 200, 2000],
                        help="ids per token's sampling support (0: no truncated sampling)")  # fmt: skip
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    decoder = "orjson" if json_body.orjson is not None else "json (orjson absent)"
    print(f"now decodes with {decoder}")
    print("| support K | tokens | decode before | decode now | parse before | parse now | total before | "
          "total now | before ÷ now | same columns |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|")
    for support in args.supports:
        tokens = args.tokens if support < 200 else max(REPLY_TOKENS, args.tokens * 20 // support)
        bodies, config = make_replies(tokens, support)
        raws = [json.dumps(body).encode() for body in bodies]
        n = len(bodies) * REPLY_TOKENS
        decode = {name: time_decode(raws, fn, args.repeats) for name, fn in DECODERS.items()}
        fast, fast_out = time_parse(bodies, config, args.repeats)
        with loops_only():
            slow, slow_out = time_parse(bodies, config, args.repeats)
        same = same_results(fast_out, slow_out) and all(json_body.loads(r) == json.loads(r) for r in raws)
        before, now = decode["json"] + slow, decode["now"] + fast
        ns = [f"{1e9 * t / n:,.0f}" for t in (decode["json"], decode["now"], slow, fast, before, now)]
        verdict = "yes" if same else "NO"
        print(
            f"| {support or '—'} | {n:,} | {' | '.join(ns)} | {before / now:.2f}× | {verdict} |", flush=True
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
