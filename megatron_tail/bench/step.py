"""The planner's promise, measured: one RL step's θ_old recompute and update of a Qwen3-shaped model on one
device, its peak allocation against what `megatron-tail plan` predicts for the same config.

    python -m megatron_tail.bench.step --device cuda [--shape qwen3-1.7b] [--tokens 16384] [--json]

The model is random-initialised from a written `config.json` (no checkpoint needed); one packed (THD)
micro-batch of `--tokens` tokens (4 samples of a short prompt and a long response) goes through
`recompute_logprobs` (θ_old) and `train_step` (the update: bf16 on CUDA, the distributed optimizer as the
examples run it). Reported: the plan's trainer total less its reserve (`plan.trainer`), the measured peak
(`torch.cuda.max_memory_allocated` over both phases, weights, gradients and optimizer state included),
their ratio, each phase's seconds, and the op's share of the step (the op alone on the same logits shape,
`backend` as the run's `model.op_backend`). `tests/gpu/test_planner_cuda.py` asserts the ratio within
[0.85, 1.05]; on CPU the same code runs a tiny shape (the CPU half: no allocator peak to compare there).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

SHAPES = {
    # Qwen3-1.7B's config.json (Qwen/Qwen3-1.7B): the shape the H200 run measured within 2% of the plan
    "qwen3-1.7b": dict(
        hidden_size=2048,
        intermediate_size=6144,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=151_936,
        tie_word_embeddings=True,
    ),
    "tiny": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=512,
        tie_word_embeddings=False,
    ),
}
SAMPLES = 4
PROMPT_TOKENS = 64


def write_config(root: Path, shape: str, max_positions: int) -> Path:
    """A Qwen3 `config.json` of `shape` in `root` (what both the planner and the trainer read)."""
    config = {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "max_position_embeddings": max_positions,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1_000_000,
        "torch_dtype": "bfloat16",
        "hidden_act": "silu",
        "attention_bias": False,
        **SHAPES[shape],
    }
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(config, indent=2))
    return root


def run_config(model_dir: Path, tokens: int, device: str, recompute: str = "none"):
    """The run's config: one packed micro-batch of `tokens` per step (`SAMPLES` samples of the longest
    length), bf16 on CUDA and fp32 on CPU, DVP as the examples run it, `model.recompute`."""
    from megatron_tail.config import load_config

    return load_config(
        None,
        [
            f"model.hf_path={model_dir}",
            f"model.precision={'bf16' if device == 'cuda' else 'fp32'}",
            f"train.max_tokens_per_micro_batch={tokens}",
            "data.prompts_per_step=1",
            f"algorithm.group_size={SAMPLES}",
            f"data.max_prompt_tokens={PROMPT_TOKENS}",
            f"rollout.max_new_tokens={tokens // SAMPLES - PROMPT_TOKENS}",
            f"model.recompute={recompute}",
        ],
    )


def predicted_bytes(cfg, gpu_memory_gib: float) -> tuple[int, dict[str, int]]:
    """The plan's trainer total less its reserve, and its terms, on one trainer GPU."""
    from megatron_tail.plan.planner import Cluster, make_plan

    plan = make_plan(cfg, Cluster(nodes=2, gpus_per_node=1, rollout_nodes=1, gpu_memory_gib=gpu_memory_gib))
    terms = {k: v for k, v in plan.trainer.terms.items() if k != "reserve"}
    return sum(terms.values()), terms


def measure_step(cfg, device: str) -> dict:
    """θ_old recompute and one update on this process (a world of one), timed; the peak allocation on CUDA."""
    from megatron_tail.model import load_hf_config
    from megatron_tail.train import (
        ParallelConfig,
        Sample,
        build_trainer,
        init_parallel,
        pack_micro_batches,
        recompute_logprobs,
        train_step,
    )
    from megatron_tail.train.rl.old_policy import op_settings
    from megatron_tail.train.run.loop import init_torch_distributed

    init_torch_distributed(cfg.parallel)
    init_parallel(ParallelConfig(tensor_parallel=1, seed=cfg.seed))
    arch = load_hf_config(cfg.model.hf_path)
    trainer = build_trainer(arch, model_settings=cfg.model, optim=cfg.optimizer)
    g = torch.Generator().manual_seed(0)
    length = cfg.rollout.max_new_tokens
    samples = [
        Sample(
            prompt=torch.randint(0, arch.vocab_size, (PROMPT_TOKENS,), generator=g).tolist(),
            response=torch.randint(0, arch.vocab_size, (length,), generator=g).tolist(),
        )
        for _ in range(SAMPLES)
    ]
    mbs = pack_micro_batches(samples, max_tokens=cfg.train.max_tokens_per_micro_batch)
    op = op_settings(cfg)
    n = sum(mb.num_loss_tokens for mb in mbs)

    def loss_fn(out, mb):
        loss = -torch.where(mb.loss_mask, out.logprobs, torch.zeros_like(out.logprobs)).sum() / n
        return loss, {"loss": loss.detach().double()}

    cuda = device == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    recompute_logprobs(trainer, mbs, op=op)
    if cuda:
        torch.cuda.synchronize()
    t1 = time.perf_counter()
    step = train_step(trainer, mbs, loss_fn, op=op)
    if cuda:
        torch.cuda.synchronize()
    t2 = time.perf_counter()
    return {
        "micro_batches": len(mbs),
        "tokens": sum(mb.tokens.numel() for mb in mbs),
        "old_policy_s": t1 - t0,
        "update_s": t2 - t1,
        "peak_bytes": torch.cuda.max_memory_allocated() if cuda else None,
        "loss": float(step.metrics["loss"]),
        "op_s": _op_seconds(cfg, arch, sum(mb.tokens.numel() for mb in mbs), device),
    }


def _op_seconds(cfg, arch, tokens: int, device: str) -> float:
    """The op alone, forward + backward in place, on logits of the step's shape (the update's share)."""
    from megatron_tail.ops import vocab_parallel_masked_logprobs
    from megatron_tail.train.rl.old_policy import op_settings

    op = op_settings(cfg)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    padded = -(-arch.vocab_size // cfg.model.vocab_pad_multiple) * cfg.model.vocab_pad_multiple
    logits = torch.randn(tokens, padded, device=device, dtype=dtype)
    targets = torch.randint(0, arch.vocab_size, (tokens,), device=device)
    times = []
    for _ in range(3):
        x = logits.clone().requires_grad_()
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = vocab_parallel_masked_logprobs(
            x, targets, log_rho=op.log_rho, temperature=op.temperature, vocab_size=arch.vocab_size,
            inplace_backward=True, backend=op.backend,
        )  # fmt: skip
        (out.logprobs.sum() + out.entropy.sum()).backward()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return sorted(times)[1]


def bench(shape: str, tokens: int, device: str, gpu_memory_gib: float, recompute: str = "none") -> dict:
    from megatron_tail.ops.backend import resolve_backend

    with tempfile.TemporaryDirectory(prefix="mt-bench-step-") as root:
        model_dir = write_config(Path(root) / shape, shape, max_positions=max(4096, tokens))
        cfg = run_config(model_dir, tokens, device, recompute)
        predicted, terms = predicted_bytes(cfg, gpu_memory_gib)
        measured = measure_step(cfg, device)
    step_s = measured["old_policy_s"] + measured["update_s"]
    peak = measured["peak_bytes"]
    return {
        "shape": shape,
        "device": device,
        "op_backend": resolve_backend(cfg.model.op_backend, torch.device(device)),
        "recompute": recompute,
        "predicted_bytes": predicted,
        "predicted_terms": terms,
        **measured,
        "measured_over_predicted": None if peak is None else peak / predicted,
        # the op runs twice a step: forward in θ_old, forward + backward in the update
        "op_share_of_step": measured["op_s"] / step_s,
    }


def format_result(r: dict) -> str:
    gib = 1 << 30
    measured = "—" if r["peak_bytes"] is None else f"{r['peak_bytes'] / gib:.2f} GiB"
    ratio = "—" if r["measured_over_predicted"] is None else f"{r['measured_over_predicted']:.3f}"
    rows = [
        (
            "model",
            f"{r['shape']} (random init), {r['tokens']} tokens in {r['micro_batches']} micro-batch(es)",
        ),
        ("device, op backend, recompute", f"{r['device']}, {r['op_backend']}, {r['recompute']}"),
        ("plan: trainer total less reserve", f"{r['predicted_bytes'] / gib:.2f} GiB"),
        ("measured: max_memory_allocated", measured),
        ("measured / predicted", ratio),
        ("θ_old recompute", f"{r['old_policy_s'] * 1e3:.0f} ms"),
        ("update", f"{r['update_s'] * 1e3:.0f} ms"),
        (
            "the op, fwd + bwd in place",
            f"{r['op_s'] * 1e3:.1f} ms ({100 * r['op_share_of_step']:.0f}% of the step)",
        ),
    ]
    return "\n".join(["| what | value |", "|---|---|", *(f"| {a} | {b} |" for a, b in rows)])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--shape", choices=list(SHAPES), default="qwen3-1.7b")
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--gpu-memory-gib", type=float, default=80.0, help="the planner's capacity per GPU")
    parser.add_argument("--recompute", choices=["none", "selective", "full"], default="none")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    from megatron_tail.utils.expected_warnings import silence_expected_warnings

    silence_expected_warnings()
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device here (use --device cpu --shape tiny for the code path)")
    if args.tokens % SAMPLES or args.tokens // SAMPLES <= PROMPT_TOKENS:
        parser.error(
            f"--tokens must be a multiple of {SAMPLES} above {SAMPLES * PROMPT_TOKENS}; got {args.tokens}"
        )
    result = bench(args.shape, args.tokens, args.device, args.gpu_memory_gib, args.recompute)
    print(json.dumps(result) if args.json else format_result(result), flush=True)


if __name__ == "__main__":
    main()
