"""The CPU half of the planner's GPU check (`tests/gpu/test_planner_cuda.py`): the same case (`bench.step`
in a process of its own, its checks, its table rows and its record) on a tiny Qwen3 shape on CPU (fp32, one
1024-token THD micro-batch of 4 × (64 + 192), four steps). The plan is computed from the written
`config.json`, θ_old and the update run, the op and a matmul are timed; only the allocator's peak, which a
CPU does not have, is absent (the record says so with null peaks)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.gpu.test_planner_cuda import planner_case

ROOT = Path(__file__).resolve().parents[2]


def test_the_step_bench_runs_the_plan_and_the_step_on_cpu(tmp_path, record_property):
    r = planner_case(
        "cpu", "tiny", 1024, tmp_path, record_property, "--samples", "4", "--prompt-tokens", "64"
    )
    assert (r["op_backend"], r["samples"], r["prompt_tokens"], r["response_tokens"]) == ("torch", 4, 64, 192)
    assert set(r["predicted_terms"]) >= {"weights", "grads", "optimizer", "activations", "logits"}
    # fp32 weights of the tiny shape: embedding and output layer (512 padded to 1024 rows × 64), 2 layers
    assert r["predicted_terms"]["weights"] > 2 * 1024 * 64 * 4
    # fp32: no master copy, so the optimizer term is Adam's two moments alone
    assert r["predicted_moment_bytes"] == r["predicted_terms"]["optimizer"]
    # 4 · 2 · (2 layers · (64·64·2 + 64·32·2 + 3·64·128) + 64·512) per token, + 4 · 4 · 4·16 per causal pair
    per_token = 2 * (2 * (64 * 64 * 2 + 64 * 32 * 2 + 3 * 64 * 128) + 64 * 512)
    assert r["step_flops"] == 4 * (1024 * per_token + 2 * 4 * 4 * 16 * 4 * (256 * 257 // 2))
    assert r["matmul_label"] == "float32 matmul (cpu, 512³, this run)"
    assert r["gradient_accumulation_fusion"] is False  # no CUDA, no apex: the setting's null resolves off
    assert r["output_grad_into_main_grad"] is False  # megatron's output linear, without the fusion
    cold, steady = r["recorded"]
    assert (cold["state"], steady["state"], cold["gpu"], cold["peak_bytes"]) == (
        "cold",
        "steady",
        "cpu",
        None,
    )
    assert cold["model"]["hidden_size"] == 64 and steady["tokens"] == 1024


def test_a_bad_token_count_or_too_few_steps_is_one_line():
    for args, message in (
        (["--tokens", "100"], "--tokens must be a multiple of 8 above 2048 (--samples × --prompt-tokens)"),
        (
            ["--tokens", "4096", "--steps", "3"],
            "--steps must be at least 4 (one warm-up, then three measured)",
        ),
    ):
        cmd = [sys.executable, "-m", "megatron_tail.bench.step", "--device", "cpu", *args]
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert done.returncode == 2 and message in done.stderr and "Traceback" not in done.stderr, done.stderr
