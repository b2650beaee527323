"""The Qwen3-8B / 14B example configs: they load with the run-config schema, their launch line gives the
layout their header states (rl.sbatch's dry run, with a stand-in `scontrol`), and the memory estimate's
parameter counts and KV-cache bytes are those of the real architectures. No cluster needed."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_tail.config import load_config
from tests.slurm.conftest import REPO, RL_SBATCH

EXAMPLES = sorted((REPO / "examples").glob("qwen3_*.yaml"))
# the architectures (Qwen/Qwen3-8B and Qwen/Qwen3-14B config.json); vocab 151936, untied embeddings
ARCH = {
    "qwen3_8b": dict(num_hidden_layers=36, hidden_size=4096, num_attention_heads=32, num_key_value_heads=8,
                     head_dim=128, intermediate_size=12288),
    "qwen3_14b": dict(num_hidden_layers=40, hidden_size=5120, num_attention_heads=40, num_key_value_heads=8,
                      head_dim=128, intermediate_size=17408),
    # Qwen/Qwen3-30B-A3B and Qwen/Qwen3-235B-A22B: 128 experts, top-8, no dense layers
    "qwen3_30b": dict(num_hidden_layers=48, hidden_size=2048, num_attention_heads=32, num_key_value_heads=4,
                      head_dim=128, intermediate_size=6144, moe_intermediate_size=768, num_experts=128,
                      num_experts_per_tok=8),
    "qwen3_235b": dict(num_hidden_layers=94, hidden_size=4096, num_attention_heads=64, num_key_value_heads=4,
                       head_dim=128, intermediate_size=12288, moe_intermediate_size=1536, num_experts=128,
                       num_experts_per_tok=8),
}  # fmt: skip
GPUS_PER_NODE = 8


def header(path: Path) -> str:
    return "".join(line for line in path.read_text().splitlines(keepends=True) if line.startswith("#"))


def model_key(path: Path) -> str:
    return "_".join(path.stem.split("_")[:2])


def test_there_are_examples_for_both_models_estimators_and_methods():
    names = {p.stem for p in EXAMPLES}
    assert any(n.startswith("qwen3_8b_") for n in names) and any(n.startswith("qwen3_14b_") for n in names)
    for part in ("grpo", "rloo", "dvp", "stapo"):
        assert any(part in n for n in names), f"no example with {part}: {sorted(names)}"


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_rl_sbatch_waits_for_the_servers_as_long_as_the_example_means_to(path):
    """Under rl.sbatch the servers' start is timed by `cluster.health_timeout_s` (its wait-healthy), before
    the trainer and its `rollout.startup_timeout_s` exist: the MoE examples raised only the latter (30 and
    60 min for their weights), so a server loading for over 15 min ended the job."""
    cfg = load_config(path)
    assert cfg.cluster.health_timeout_s >= cfg.rollout.startup_timeout_s


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_example_matches_the_config_schema(path):
    cfg = load_config(path)  # unknown keys or bad values raise ConfigError naming the key
    cfg.check_runnable()
    stem = path.stem
    assert cfg.run_dir == f"runs/{stem}"
    assert cfg.algorithm.advantage_estimator == ("grpo" if "grpo" in stem else "rloo")
    if "dvp" in stem:
        assert cfg.algorithm.log_rho == -13.0 and cfg.algorithm.is_mode == "mis"
        assert cfg.algorithm.veto_threshold == 1e-4 and not cfg.algorithm.stapo
    if "stapo" in stem:
        assert cfg.algorithm.stapo and cfg.algorithm.log_rho is None
    # FP8 rollouts only where the name says so, and never without an importance correction
    assert (cfg.rollout.quantization == "fp8") == stem.endswith("_fp8")
    if cfg.rollout.quantization == "fp8":
        assert cfg.algorithm.is_mode != "none" and "projection" in header(path)
    # packed THD micro-batches by a token budget that holds the longest sample
    assert cfg.train.is_packed and cfg.train.seq_len is None
    longest = cfg.data.max_prompt_tokens + cfg.rollout.max_response_tokens  # turns + observations
    assert longest <= cfg.train.max_tokens_per_micro_batch and longest <= cfg.model.max_sequence_length
    assert cfg.model.resolved_precision() == "bf16" and cfg.optimizer.use_distributed_optimizer
    # warm-up everywhere; KL only in the example named for it, with the reference offloaded
    assert cfg.optimizer.lr_warmup_steps > 0 and cfg.data.filter_zero_variance_groups
    if stem.endswith("_kl"):
        assert cfg.algorithm.kl_coef > 0 and cfg.model.reference_offload
        assert "reference policy" in header(path)
    else:
        assert cfg.algorithm.kl_coef == 0.0


def launch_line(path: Path) -> list[str]:
    match = re.search(r"^# Launch.*\n#\s+(.*sbatch .*)$", header(path), re.M)
    assert match, f"{path.name}: no launch line under '# Launch'"
    return shlex.split(match.group(1))


def stated_layout(path: Path) -> dict[str, int]:
    text = header(path)
    roll = re.search(r"#\s+rollout: (\d+) nodes? x (\d+) SGLang servers, TP=(\d+)", text)
    train = re.search(
        r"#\s+trainer: (\d+) nodes? x (\d+) GPUs, TP=(\d+) PP=(\d+)(?: CP=(\d+))? DP=(\d+)", text
    )
    assert roll and train, f"{path.name}: no 'rollout:'/'trainer:' layout lines"
    keys = ("rollout_nodes", "servers_per_node", "sglang_tp")
    out = dict(zip(keys, map(int, roll.groups()), strict=True))
    keys = ("train_nodes", "gpus", "tp", "pp", "cp", "dp")
    out.update(zip(keys, (int(g or 1) for g in train.groups()), strict=True))
    return out


def dry_run(argv: list[str], tmp_path: Path) -> str:
    """rl.sbatch as the launch line would start it, with MT_DRY_RUN=1 and a stand-in `scontrol`."""
    sbatch_opts = argv[argv.index("sbatch") + 1 : argv.index("slurm/rl.sbatch")]
    script_args = argv[argv.index("slurm/rl.sbatch") + 1 :]
    opts = dict(o.lstrip("-").split("=", 1) for o in sbatch_opts if "=" in o)
    nodes, gpus = int(opts["nodes"]), int(opts["gpus-per-node"])
    bindir = tmp_path / "bin"
    bindir.mkdir()
    scontrol = bindir / "scontrol"
    scontrol.write_text('#!/bin/sh\nif [ "$1 $2" = "show hostnames" ]; then echo "$3" | tr , "\\n"; fi\n')
    scontrol.chmod(0o755)
    env = {
        **os.environ,
        "PATH": f"{bindir}:{os.environ['PATH']}",
        "MT_DRY_RUN": "1",
        "MT_ROOT": str(REPO),
        "MT_PYTHON": sys.executable,
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NODELIST": ",".join(f"gpu{i}" for i in range(1, nodes + 1)),
        "SLURM_GPUS_ON_NODE": str(gpus),
    }
    proc = subprocess.run(
        ["bash", str(RL_SBATCH), *script_args], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_launch_line_gives_the_stated_layout(path, tmp_path):
    argv = launch_line(path)
    assert argv[0] == "sbatch" and argv[-1] == f"examples/{path.name}"  # the layout is the config's
    assert "--exclusive" in argv and any(a.startswith("--signal=B:USR1@") for a in argv)
    lay = stated_layout(path)
    cfg = load_config(path)
    p = cfg.parallel
    assert (p.tensor_parallel, p.pipeline_parallel, p.context_parallel) == (lay["tp"], lay["pp"], lay["cp"])
    assert lay["train_nodes"] * lay["gpus"] == lay["tp"] * lay["pp"] * lay["cp"] * lay["dp"]
    assert lay["servers_per_node"] * lay["sglang_tp"] == GPUS_PER_NODE
    c = cfg.cluster  # what rl.sbatch starts and the header's plan checked
    assert (c.nodes, c.gpus_per_node) == (lay["rollout_nodes"] + lay["train_nodes"], lay["gpus"])
    assert (c.rollout_nodes, c.sglang.tp) == (lay["rollout_nodes"], lay["sglang_tp"])
    assert f"--nodes={c.nodes}" in argv and f"--gpus-per-node={c.gpus_per_node}" in argv

    out = dry_run(argv, tmp_path)
    rollout = " ".join(f"gpu{i}" for i in range(1, lay["rollout_nodes"] + 1))
    n_all = lay["rollout_nodes"] + lay["train_nodes"]
    trainer = " ".join(f"gpu{i}" for i in range(lay["rollout_nodes"] + 1, n_all + 1))
    expected = (
        f"layout: rollout {rollout} (sglang, {lay['servers_per_node']}/node), trainer {trainer} "
        f"({lay['train_nodes']} x {lay['gpus']}, TP {lay['tp']} PP {lay['pp']})"
    )
    assert expected in out, out
    assert f"--tp {lay['sglang_tp']} " in out, out
    if c.sglang.mem_fraction is not None:
        assert f"--mem-fraction-static {c.sglang.mem_fraction}" in out, out
    assert f"--quantization {cfg.rollout.quantization}" in out, out
    urls = re.search(r"^urls: (.*)$", out, re.M).group(1).split()
    assert len(urls) == lay["rollout_nodes"] * lay["servers_per_node"] == len(set(urls))
    assert f"--nnodes={lay['train_nodes']} --nproc-per-node={lay['gpus']} --rdzv-backend=c10d" in out
    assert "rollout.server_urls=" + ",".join(urls) in out


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_memory_estimate_uses_the_real_parameter_count_and_kv_bytes(path):
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3MoeConfig

    arch = ARCH[model_key(path)]
    config_class = Qwen3MoeConfig if "num_experts" in arch else Qwen3Config
    config = config_class(vocab_size=151936, tie_word_embeddings=False, **arch)
    with torch.device("meta"):
        params = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    text = header(path)  # the planner's output (tests/plan/test_example_headers.py keeps it so)
    assert f"model: {params:,} params" in text
    # each SGLang GPU holds kv_heads / TP heads, one (replicated) when TP exceeds them
    kv_heads = max(1, arch["num_key_value_heads"] // lay_sglang_tp(path))
    kv = 2 * arch["num_hidden_layers"] * kv_heads * arch["head_dim"] * 2
    assert f"{kv:,} B/token" in text
    for item in ("weights", "grads", "optimizer", "activations", "logits", "KV cache", "checkpoint"):
        assert item in text, f"{path.name}: the memory plan lacks {item!r}"


def lay_sglang_tp(path: Path) -> int:
    return stated_layout(path)["sglang_tp"]
