"""Peak host memory of a checkpoint save at DP = 2 on CPU: megatron's default optimizer exchange (the
state all-gathered to every rank) against the memory-efficient one the trainer uses (gathered over gloo
onto each shard's DP rank 0 only).

    python -m megatron_tail.bench.checkpoint_memory [--hidden 768 --layers 8 ...]

Each mode runs in fresh forked ranks (freed memory is not reused across modes). Per rank: the peak RSS
above the RSS just before `save_checkpoint`, as a multiple of the optimizer state's size, which is what
the gather materializes: fp32 param + Adam m + v = 12 B per parameter of the TP × PP shard (here the
whole model: TP = PP = 1).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from megatron_tail.utils.forked import run_distributed

from .memory import peak_rss_bytes, reset_peak_rss, rss_bytes


def _save_rank(_rank, _world, shape: dict, out: str, gather_all: bool) -> dict:
    from megatron_tail.config.parallel import ParallelSection
    from megatron_tail.model import ModelSettings, load_hf_config
    from megatron_tail.train import OptimizerSettings, build_trainer, init_parallel
    from megatron_tail.train.engine.checkpoint import save_checkpoint

    init_parallel(ParallelSection(tensor_parallel=1, pipeline_parallel=1))
    arch = load_hf_config({"architectures": ["Qwen3ForCausalLM"], **shape})
    trainer = build_trainer(
        arch,
        model_settings=ModelSettings(precision="fp32", vocab_pad_multiple=128),
        optim=OptimizerSettings(),
    )
    params = sum(p.numel() for c in trainer.chunks for p in c.parameters())
    before = rss_bytes()
    exact = reset_peak_rss()
    save_checkpoint(Path(out) / "ckpt", trainer, {"step": 0}, gather_optimizer_on_every_rank=gather_all)
    peak = peak_rss_bytes(reset=exact)
    return {"params": params, "extra": peak - before, "exact": exact}


def measure(shape: dict) -> dict[str, list[dict]]:
    results = {}
    for name, gather_all in (("gather to every rank (megatron default)", True), ("memory-efficient", False)):
        with tempfile.TemporaryDirectory() as out:
            results[name] = run_distributed(_save_rank, 2, shape, out, gather_all, timeout=900)
    return results


def format_table(results: dict[str, list[dict]]) -> str:
    lines = [
        "| optimizer exchange at save | DP rank | peak extra RSS | × optimizer state (12 B/param) |",
        "|---|---|---|---|",
    ]
    for name, ranks in results.items():
        for rank, r in enumerate(ranks):
            state = 12 * r["params"]
            lines.append(f"| {name} | {rank} | {r['extra'] / 2**20:,.0f} MiB | {r['extra'] / state:.2f} |")
    base, eff = (sum(r["extra"] for r in rs) for rs in results.values())
    params = next(iter(results.values()))[0]["params"]
    lines.append(
        f"\n{params:,} parameters; optimizer state {12 * params / 2**20:,.0f} MiB; both ranks together: "
        f"memory-efficient / default = {eff / base:.2f}"
    )
    if not all(r["exact"] for rs in results.values() for r in rs):
        lines.append("(peak RSS over the process lifetime: /proc/self/clear_refs was not writable)")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--vocab", type=int, default=8192)
    args = p.parse_args(argv)
    shape = {
        "vocab_size": args.vocab,
        "hidden_size": args.hidden,
        "intermediate_size": 4 * args.hidden,
        "num_hidden_layers": args.layers,
        "num_attention_heads": args.hidden // 64,
        "num_key_value_heads": max(1, args.hidden // 192),
        "head_dim": 64,
        "max_position_embeddings": 512,
        "tie_word_embeddings": False,
    }
    print(format_table(measure(shape)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
