"""The planner's promise, measured: RL steps (θ_old recompute, then an update) of a Qwen3-shaped model on one
device, their peak allocation against what `megatron-tail plan` predicts for the same config.

    python -m megatron_tail.bench.step --device cuda [--shape qwen3-1.7b] [--tokens 16384] [--samples 8]
        [--prompt-tokens 256] [--recompute none|selective|full] [--fused-output-layer] [--steps 4]
        [--record megatron_tail/plan/measured_peaks.json] [--json]

The model is random-initialised from a written `config.json` (no checkpoint needed); one packed (THD)
micro-batch of `--tokens` tokens (`--samples` sequences of `--prompt-tokens` + the rest) goes through
`recompute_logprobs` (θ_old) and `train_step` (the update: bf16 on CUDA, the distributed optimizer as the
examples run it), `--steps` times. The first step is cold: Triton compiles, the allocator grows, and Adam's
two moment buffers (8 bytes per parameter) are allocated by its `optimizer.step()`, after the step's
activation peak, so its peak lacks them and every later step's has them. Reported: the plan's trainer total
less its reserve (`plan.trainer`), the steady-state peak (`torch.cuda.max_memory_allocated`, the max over
the steps after the first) and their ratio, the first step's peak against the plan less the moments (a job
is sized by the larger), the median of each phase's time over the steady steps (the first step's beside
it), the step's model FLOPs per second and their share of a matmul's rate measured in the same run (MFU:
bf16 on CUDA; on CPU the run's fp32), and the op's share of the step (the op alone on the same logits
shape, `backend` as the run's `model.op_backend`). `tests/gpu/test_planner_cuda.py` asserts the steady
ratio within [0.85, 1.05]; on CPU the same code runs a tiny shape (its CPU half: no allocator peak there).
`--record` appends both peaks to the planner's file of GPU measurements, which a CPU test holds the
planner to (`tests/plan/test_measured_peaks.py`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from megatron_tail.bench.step_report import (
    MEASURED_PEAKS,
    append_entries,
    format_result,
    matmul_rate,
    measurement_entries,
    step_flops,
)

SHAPES = {
    # Qwen3-1.7B's config.json (Qwen/Qwen3-1.7B): the shape the H200 runs measured within 2.5% of the plan
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
    # Qwen3-8B's config.json (Qwen/Qwen3-8B) with 12 of its 36 layers: what one 141 GiB H200 holds without
    # recompute at 16k tokens (measured 2026-11-27: 103.28 GiB against 101.4 planned)
    "qwen3-8b-12l": dict(
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=12,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=151_936,
        tie_word_embeddings=False,
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
SAMPLES = 8
PROMPT_TOKENS = 256
"""8 × (256 + 1,792) at 16k tokens: the layout the H200 runs of 2026-11-28 measured."""
STEPS = 4
"""One cold step, then three steady ones (the fewest a median and a max over the steady state need)."""
MATMUL_N = {"cuda": 8192, "cpu": 512}
"""Side of the square matmul whose rate MFU is measured against (CPU: small enough for 2 cores)."""


def write_config(root: Path, model: dict, max_positions: int) -> Path:
    """A Qwen3 `config.json` of `model` (a `SHAPES` value) in `root` (what both the planner and the trainer
    read)."""
    config = {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "max_position_embeddings": max_positions,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1_000_000,
        "torch_dtype": "bfloat16",
        "hidden_act": "silu",
        "attention_bias": False,
        **model,
    }
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(config, indent=2))
    return root


def run_config(
    model_dir: Path,
    tokens: int,
    device: str,
    recompute: str = "none",
    *,
    samples: int = SAMPLES,
    prompt_tokens: int = PROMPT_TOKENS,
    fused_output_layer: bool = False,
    op_backend: str = "auto",
):
    """The run's config: one packed micro-batch of `tokens` per step (`samples` sequences of
    `prompt_tokens` + the rest), bf16 on CUDA and fp32 on CPU, DVP as the examples run it,
    `model.recompute`, `model.fused_output_layer`, `model.op_backend`."""
    from megatron_tail.config import load_config

    return load_config(
        None,
        [
            f"model.hf_path={model_dir}",
            f"model.precision={'bf16' if device == 'cuda' else 'fp32'}",
            f"train.max_tokens_per_micro_batch={tokens}",
            "data.prompts_per_step=1",
            f"algorithm.group_size={samples}",
            f"data.max_prompt_tokens={prompt_tokens}",
            f"rollout.max_new_tokens={tokens // samples - prompt_tokens}",
            f"model.recompute={recompute}",
            f"model.fused_output_layer={str(fused_output_layer).lower()}",
            f"model.op_backend={op_backend}",
        ],
    )


def predicted_bytes(cfg, gpu_memory_gib: float) -> tuple[int, dict[str, int], int]:
    """The plan's trainer total less its reserve, its terms, and of its optimizer term the moments (what a
    first step's peak lacks), on one trainer GPU."""
    from megatron_tail.plan.planner import Cluster, make_plan
    from megatron_tail.plan.trainer import optimizer_moment_bytes

    plan = make_plan(cfg, Cluster(nodes=2, gpus_per_node=1, rollout_nodes=1, gpu_memory_gib=gpu_memory_gib))
    terms = {k: v for k, v in plan.trainer.terms.items() if k != "reserve"}
    moments = optimizer_moment_bytes(plan.trainer_layout, terms["optimizer"])
    return sum(terms.values()), terms, moments


def build_step(cfg):
    """The trainer of `cfg` on this process (a world of one) and its micro-batches: `cfg`'s samples of
    random tokens (prompt + response), packed. Returns (trainer, micro-batches, op settings, loss_fn)."""
    from megatron_tail.config.parallel import ParallelSection
    from megatron_tail.model import load_hf_config
    from megatron_tail.train import (
        Sample,
        build_trainer,
        init_parallel,
        pack_micro_batches,
    )
    from megatron_tail.train.rl.old_policy import op_settings
    from megatron_tail.train.run.loop import init_torch_distributed

    init_torch_distributed(cfg.parallel)
    init_parallel(ParallelSection(tensor_parallel=1), seed=cfg.seed)
    arch = load_hf_config(cfg.model.hf_path)
    trainer = build_trainer(arch, model_settings=cfg.model, optim=cfg.optimizer)
    g = torch.Generator().manual_seed(0)
    samples = [
        Sample(
            prompt=torch.randint(0, arch.vocab_size, (cfg.data.max_prompt_tokens,), generator=g).tolist(),
            response=torch.randint(0, arch.vocab_size, (cfg.rollout.max_new_tokens,), generator=g).tolist(),
        )
        for _ in range(cfg.algorithm.group_size)
    ]
    mbs = pack_micro_batches(samples, max_tokens=cfg.train.max_tokens_per_micro_batch)
    n = sum(mb.num_loss_tokens for mb in mbs)

    def loss_fn(out, mb):
        loss = -torch.where(mb.loss_mask, out.logprobs, torch.zeros_like(out.logprobs)).sum() / n
        return loss, {"loss": loss.detach().double()}

    return trainer, mbs, op_settings(cfg), loss_fn


def measure_steps(cfg, device: str, steps: int) -> dict:
    """`steps` RL steps (θ_old recompute, then an update) on this process, each timed and, on CUDA, with its
    own `max_memory_allocated` (the peak is reset before each step)."""
    from megatron_tail.train import recompute_logprobs, train_step

    trainer, mbs, op, loss_fn = build_step(cfg)
    cuda = device == "cuda"
    out = []
    for _ in range(steps):
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
        out.append({
            "old_policy_s": t1 - t0,
            "update_s": t2 - t1,
            "peak_bytes": torch.cuda.max_memory_allocated() if cuda else None,
            "loss": float(step.metrics["loss"]),
        })  # fmt: skip
    return {
        "micro_batches": len(mbs),
        "tokens": sum(mb.tokens.numel() for mb in mbs),
        "steps": out,
        "output_grad_into_main_grad": _output_grad_into_main_grad(trainer),
    }


def _output_grad_into_main_grad(trainer) -> bool:
    """Whether the last update's backward added the output layer's weight gradient into DDP's `main_grad`
    itself (megatron's `grad_added_to_main_grad`, reset by `zero_grad_buffer` at each step's start), rather
    than returning it for DDP's hook to add: what ran, not what the settings predict."""
    from megatron.core.utils import unwrap_model

    return bool(getattr(unwrap_model(trainer.chunks[-1]).output_weight(), "grad_added_to_main_grad", False))


def _op_seconds(cfg, vocab_size: int, tokens: int, device: str) -> float:
    """The op alone, forward + backward in place, on logits of the step's shape (the update's share):
    the median of three calls."""
    from megatron_tail.ops import vocab_parallel_masked_logprobs
    from megatron_tail.train.rl.old_policy import op_settings

    op = op_settings(cfg)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    padded = -(-vocab_size // cfg.model.vocab_pad_multiple) * cfg.model.vocab_pad_multiple
    logits = torch.randn(tokens, padded, device=device, dtype=dtype)
    targets = torch.randint(0, vocab_size, (tokens,), device=device)
    times = []
    for _ in range(3):
        x = logits.clone().requires_grad_()
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = vocab_parallel_masked_logprobs(
            x, targets, log_rho=op.log_rho, temperature=op.temperature, vocab_size=vocab_size,
            inplace_backward=True, backend=op.backend,
        )  # fmt: skip
        (out.logprobs.sum() + out.entropy.sum()).backward()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench(
    shape: str,
    tokens: int,
    device: str,
    gpu_memory_gib: float,
    recompute: str = "none",
    *,
    samples: int = SAMPLES,
    prompt_tokens: int = PROMPT_TOKENS,
    steps: int = STEPS,
    fused_output_layer: bool = False,
    op_backend: str = "auto",
) -> dict:
    """Plan and measure `steps` steps of `shape` (module docstring); the result's keys are those
    `step_report.result_rows` prints. The first step is the cold one; peak and times of the state a run
    stays in are taken over the others (the peak their max, each phase's time their median)."""
    from megatron_tail.ops.backend import resolve_backend

    with tempfile.TemporaryDirectory(prefix="mt-bench-step-") as root:
        model_dir = write_config(Path(root) / shape, SHAPES[shape], max_positions=max(4096, tokens))
        cfg = run_config(
            model_dir, tokens, device, recompute, samples=samples, prompt_tokens=prompt_tokens,
            fused_output_layer=fused_output_layer, op_backend=op_backend,
        )  # fmt: skip
        predicted, terms, moments = predicted_bytes(cfg, gpu_memory_gib)
        measured = measure_steps(cfg, device, steps)
        arch_vocab = SHAPES[shape]["vocab_size"]
        op_s = _op_seconds(cfg, arch_vocab, measured["tokens"], device)
    steady = measured["steps"][1:]
    cold_peak = measured["steps"][0]["peak_bytes"]
    peak = None if cold_peak is None else max(s["peak_bytes"] for s in steady)
    old_s = statistics.median(s["old_policy_s"] for s in steady)
    update_s = statistics.median(s["update_s"] for s in steady)
    flops = step_flops(SHAPES[shape], [tokens // samples] * samples)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    rate = matmul_rate(device, dtype, MATMUL_N[device])
    return {
        "shape": shape,
        "device": device,
        "op_backend": resolve_backend(cfg.model.op_backend, torch.device(device)),
        "recompute": recompute,
        "fused_output_layer": fused_output_layer,
        # on where apex's extension is installed (`model.gradient_accumulation_fusion` null): say which ran
        "gradient_accumulation_fusion": cfg.model.resolved_gradient_accumulation_fusion(),
        "output_grad_into_main_grad": measured["output_grad_into_main_grad"],
        "samples": samples,
        "prompt_tokens": prompt_tokens,
        "response_tokens": tokens // samples - prompt_tokens,
        "predicted_bytes": predicted,
        "predicted_terms": terms,
        "predicted_moment_bytes": moments,
        **measured,
        "steady_steps": steady,
        "peak_bytes": peak,
        "cold_peak_bytes": cold_peak,
        "measured_over_predicted": None if peak is None else peak / predicted,
        "cold_over_predicted_less_moments": None if cold_peak is None else cold_peak / (predicted - moments),
        "old_policy_s": old_s,
        "update_s": update_s,
        "loss": steady[-1]["loss"],
        "op_s": op_s,
        # the op runs twice a step: forward in θ_old, forward + backward in the update
        "op_share_of_step": op_s / (old_s + update_s),
        "step_flops": flops,
        "flops_per_s": flops / (old_s + update_s),
        "matmul_label": f"{str(dtype)[6:]} matmul ({device}, {MATMUL_N[device]}³, this run)",
        "matmul_flops_per_s": rate,
        "mfu": flops / (old_s + update_s) / rate,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--shape", choices=list(SHAPES), default="qwen3-1.7b")
    parser.add_argument("--tokens", type=int, default=16384, help="tokens of the one micro-batch")
    parser.add_argument("--samples", type=int, default=SAMPLES, help="sequences it packs")
    parser.add_argument("--prompt-tokens", type=int, default=PROMPT_TOKENS, help="of each sequence")
    parser.add_argument("--steps", type=int, default=STEPS, help="the first warms up; at least 3 more")
    parser.add_argument("--gpu-memory-gib", type=float, default=80.0, help="the planner's capacity per GPU")
    parser.add_argument("--recompute", choices=["none", "selective", "full"], default="none")
    parser.add_argument("--fused-output-layer", action="store_true", help="model.fused_output_layer")
    parser.add_argument("--op-backend", choices=["auto", "torch", "triton"], default="auto")
    parser.add_argument(
        "--record", type=Path, metavar="FILE",
        help=f"append both peaks as entries of a measured-peaks file (the planner's: {MEASURED_PEAKS})",
    )  # fmt: skip
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    from megatron_tail.utils.expected_warnings import silence_expected_warnings

    silence_expected_warnings()
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device here (use --device cpu --shape tiny for the code path)")
    if args.samples < 1 or args.tokens % args.samples or args.tokens // args.samples <= args.prompt_tokens:
        parser.error(
            f"--tokens must be a multiple of {args.samples} above {args.samples * args.prompt_tokens} "
            f"(--samples × --prompt-tokens); got {args.tokens}"
        )
    if args.steps < STEPS:
        parser.error(f"--steps must be at least {STEPS} (one warm-up, then three measured); got {args.steps}")
    result = bench(
        args.shape, args.tokens, args.device, args.gpu_memory_gib, args.recompute, samples=args.samples,
        prompt_tokens=args.prompt_tokens, steps=args.steps, fused_output_layer=args.fused_output_layer,
        op_backend=args.op_backend,
    )  # fmt: skip
    if args.record is not None:
        entries = measurement_entries(result, SHAPES[args.shape], time.strftime("%Y-%m-%d"))
        append_entries(args.record, entries)
    print(json.dumps(result) if args.json else format_result(result), flush=True)


if __name__ == "__main__":
    main()
