"""`megatron-tail plan` against hand arithmetic, its refusals, its JSON, and what it reads and imports."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_tail.cli import main

ROOT = Path(__file__).resolve().parents[2]
QWEN3_8B = ROOT / "tests/plan/configs/qwen3_8b"
EXAMPLE_8B = ROOT / "examples/qwen3_8b_grpo_dvp.yaml"
GIB = 1 << 30


def _plan_json(capsys, *args) -> tuple[int, dict]:
    rc = main(["plan", *map(str, args), "--json"])
    return rc, json.loads(capsys.readouterr().out)


def test_qwen3_8b_example_by_hand(capsys):
    rc, out = _plan_json(capsys, EXAMPLE_8B, "--set", f"model.hf_path={QWEN3_8B}", "--nodes", 2)
    t = out["trainer"]
    assert rc == 0 and out["fits"] is True
    assert (t["tensor_parallel"], t["pipeline_parallel"], t["data_parallel"]) == (2, 1, 4)
    # Per TP=2 rank: a layer = qkv 4096·(16+8)·128 + proj 16·128·4096 + SwiGLU 3·4096·6144 + norms
    # 2·4096 + q/k norms 2·128 = 96,477,440; × 36 layers, + embedding and untied lm_head 2 · 152576/2 · 4096
    # (vocab 151936 padded to 1024s), + the final norm 4096.
    params = 36 * 96_477_440 + 2 * 76_288 * 4096 + 4096
    assert params == 4_098_143_232 == t["params_per_gpu"]
    assert t["weights_bytes"] == 2 * params  # bf16
    assert t["grads_bytes"] == 4 * params  # fp32 main grads
    assert t["optimizer_bytes"] == 12 * params // 4  # fp32 master + m + v over DP = 4
    # Per token per layer (bf16, TP = 2; h = 4096, f/TP = 6144, a/TP = 16, g/TP = 4, d = 128):
    #   norm inputs + outputs 4·4096·2 = 32768; qkv projection (16 + 8)·128·2 = 6144; q's copy 16·128·2 =
    #   4096 and k's 4·128·2 = 1024 (TE's q/k norms save contiguous inputs); RoPE'd q, k (16 + 4)·128·2 =
    #   5120; attention output 4096; fc1 output 2·6144·2 = 24576;
    #   up copy, SiLU output, SwiGLU output 3·6144·2 = 36864; RoPE tables 4·128·2 = 1024;
    #   fp32: norms' 1/rms (2 + 20)·4 = 88, log-sum-exp 16·4 = 64
    per_token_layer = 32768 + 6144 + 4096 + 1024 + 5120 + 4096 + 24576 + 36864 + 1024 + 88 + 64
    assert per_token_layer == 115_864 == t["activation_bytes_per_token_per_layer"]["none"]
    # the example runs sequence parallelism: the four h-sized norm tensors and the two layer norms' 1/rms
    # are split over TP = 2
    per_token_layer_sp = per_token_layer - 32768 // 2 - 8 // 2
    assert per_token_layer_sp == 99_476 == t["activation_bytes_per_token_per_layer"]["none_sp"]
    assert t["activations_bytes"] == per_token_layer_sp * 36 * 5120  # one 5120-token THD micro-batch
    # logits [5120, 76288] bf16 (gradient in place) + final norm in/out 2·2048·2 and its 1/rms 4/2 (SP) +
    # the op's 4 fp32 per token + the Triton kernels' 7 fp32 partial sums per token ("auto" on CUDA)
    assert t["logits_bytes"] == 5120 * 76288 * 2 + 5120 * (8192 + 2 + 16) + 7 * 4 * 5120
    assert t["reference_bytes"] == 0
    assert t["capacity_bytes"] == 80 * GIB
    assert t["supports_bytes"] == 0 and out["supports"]["host_bytes_per_rank"] == 0  # no truncated sampling
    terms = ("weights", "grads", "optimizer", "activations", "logits", "reference", "supports", "reserve")
    assert t["total_bytes"] == sum(t[f"{k}_bytes"] for k in terms)
    # SGLang TP = 1: bf16 weights 2 · 8,190,735,360; KV 2 · 36 · 8 · 128 · 2 B per token
    r = out["rollout"]
    assert r["weights_bytes_per_gpu"] == 2 * 8_190_735_360
    assert r["kv_bytes_per_token"] == 147_456
    assert r["kv_tokens_per_server"] == (int(0.85 * 80 * GIB) - 2 * 8_190_735_360) // 147_456
    assert r["sequences_per_server"] == r["kv_tokens_per_server"] // 5120
    # checkpoint: each TP shard, (2 + 12) B per parameter, is written whole by its DP rank 0 (ranks 0 and 1,
    # both on the one trainer node: megatron writes main replicas), which first gathers the shard's fp32
    # optimizer state (12 B per parameter) over gloo into host memory
    c = out["checkpoint"]
    assert c["bytes_per_rank"] == 14 * params
    assert c["bytes_per_node"] == 2 * 14 * params and c["host_gather_bytes_per_node"] == 2 * 12 * params
    assert c["save_seconds"] == round(2 * 14 * params / 2e9, 1)  # at the assumed 2 GB/s per node


def test_recompute_pipeline_and_reference_terms(capsys):
    base = [EXAMPLE_8B, "--set", f"model.hf_path={QWEN3_8B}", "--nodes", 3]
    _, plain = _plan_json(capsys, *base)
    _, pp = _plan_json(capsys, *base, "--set", "parallel.pipeline_parallel=2")
    # 1F1B: the first stage keeps 2 micro-batches of its 18 layers in flight = all 36 layers' worth
    assert pp["trainer"]["stage"] == 0
    assert pp["trainer"]["activations_bytes"] == plain["trainer"]["activations_bytes"]
    assert pp["trainer"]["logits_bytes"] == 0
    _, kl = _plan_json(
        capsys, *base, "--set", "algorithm.kl_coef=0.01", "--set", "model.reference_offload=false"
    )
    assert kl["trainer"]["reference_bytes"] == plain["trainer"]["weights_bytes"]
    _, no_sp = _plan_json(capsys, *base, "--set", "model.sequence_parallel=false")
    # SP shards the four h-sized norm tensors (4·4096·2 B) and the norms' 1/rms (2·4 B) over TP = 2
    assert no_sp["trainer"]["activations_bytes"] - plain["trainer"]["activations_bytes"] == 16388 * 36 * 5120
    _, full = _plan_json(capsys, *base, "--set", "model.recompute=full")
    # full recompute, 1 layer per chunk: 36 kept layer inputs of h/TP (SP) + one layer recomputed
    assert full["trainer"]["activations_bytes"] == 5120 * (36 * 2048 * 2 + 99_476)
    _, sel = _plan_json(capsys, *base, "--set", "model.recompute=selective")
    # selective over core_attn and mlp: the log-sum-exp and SwiGLU's 2f + 3f (TP = 2) values go
    assert sel["trainer"]["activations_bytes"] == 5120 * 36 * (99_476 - 64 - 5 * 6144 * 2)


def test_refuses_a_layout_that_cannot_fit(capsys):
    rc = main(
        [
            "plan",
            str(EXAMPLE_8B),
            "--set",
            f"model.hf_path={QWEN3_8B}",
            "--set",
            "parallel.tensor_parallel=1",
            "--set",
            "train.max_tokens_per_micro_batch=16384",
            "--set",
            "model.max_sequence_length=16384",
        ]
    )
    captured = capsys.readouterr()
    assert rc == 1
    assert "does not fit" in captured.out
    assert "exceeds the GPU's 80.0 GiB by" in captured.err and "largest term: activations" in captured.err


def test_refuses_rollout_weights_that_do_not_fit(capsys):
    rc = main(["plan", str(EXAMPLE_8B), "--set", f"model.hf_path={QWEN3_8B}", "--gpu-memory-gib", "16"])
    err = capsys.readouterr().err
    assert rc == 1 and "rollout weights: 15.3 GiB per GPU exceed the static budget 13.6 GiB" in err


def test_warns_when_concurrency_exceeds_the_kv_cache(capsys):
    rc, out = _plan_json(
        capsys, EXAMPLE_8B, "--set", f"model.hf_path={QWEN3_8B}", "--set", "rollout.max_concurrency=128"
    )
    assert rc == 0 and out["fits"]
    assert any(
        "128 sequences per server in flight" in w and "max_concurrency ≤ 75" in w for w in out["warnings"]
    )


def test_bad_layout_is_one_clear_error(capsys):
    rc = main(
        [
            "plan",
            str(EXAMPLE_8B),
            "--set",
            f"model.hf_path={QWEN3_8B}",
            "--set",
            "parallel.tensor_parallel=4",
            "--set",
            "parallel.pipeline_parallel=3",
        ]
    )
    err = capsys.readouterr().err
    assert (
        rc == 2
        and "not a multiple of tensor_parallel × pipeline_parallel × context_parallel = 4 × 3 × 1" in err
    )
    rc = main(["plan", str(EXAMPLE_8B)])  # models/Qwen3-8B is not in the repository
    assert rc == 2 and "model.hf_path: model directory 'models/Qwen3-8B' not found" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flags", "message"),
    [  # before: an OverflowError traceback, an unclear "cannot convert float NaN", or a plan printed
        (["--gpu-memory-gib", "inf"], "gpu_memory_gib must be finite and > 0; got inf"),
        (["--reserve-gib", "nan"], "reserve_gib must be finite and ≥ 0; got nan"),
        (
            ["--quantization", "int3"],
            "quantization must be 'none' or 'fp8' (the SGLang weights the plan counts)",
        ),
        (  # `train` refuses it too, but only once its engines start
            ["--set", "algorithm.routing_replay=r3"],
            "algorithm.routing_replay=r3 needs a mixture-of-experts model; Qwen3ForCausalLM is dense",
        ),
        (  # before: the plan said nothing of the heads, and `train` raised once megatron had started
            ["--set", "parallel.tensor_parallel=64", "--nodes", "9"],
            "parallel.tensor_parallel=64 does not divide the model's num_attention_heads=32 "
            "(Qwen3ForCausalLM, config.json)",
        ),
        (
            ["--set", "parallel.pipeline_parallel=5", "--nodes", "6"],
            "parallel.pipeline_parallel=5 does not divide the model's num_hidden_layers=36 (equal stages)",
        ),
    ],
    ids=["inf_memory", "nan_reserve", "quantization", "replay_on_dense", "tp_heads", "pp_layers"],
)
def test_a_bad_flag_or_setting_is_one_line(capsys, flags, message):
    rc = main(["plan", str(EXAMPLE_8B), "--set", f"model.hf_path={QWEN3_8B}", *flags])
    err = capsys.readouterr().err
    assert rc == 2 and message in err and len(err.splitlines()) == 1, err


def _bad_model_dirs(tmp_path) -> dict[str, tuple[Path, str]]:
    """Broken model directories → (model.hf_path, what `plan` must say about it)."""
    no_heads = tmp_path / "no_heads"
    no_heads.mkdir()
    config = json.loads((QWEN3_8B / "config.json").read_text())
    del config["num_attention_heads"]
    (no_heads / "config.json").write_text(json.dumps(config))
    edited = {}  # before: "unsupported architecture Q", and a ZeroDivisionError traceback
    for name, change in (
        ("arch_string", {"architectures": "Qwen3ForCausalLM"}),
        ("zero_heads", {"num_attention_heads": 0}),
    ):
        edited[name] = tmp_path / name
        edited[name].mkdir()
        changed = {k: v for k, v in config.items() if not (name == "zero_heads" and k == "head_dim")}
        (edited[name] / "config.json").write_text(json.dumps({**changed, **change}))
    bad_json = tmp_path / "bad_json"
    bad_json.mkdir()
    (bad_json / "config.json").write_text("{\n")
    a_file = tmp_path / "model.safetensors"
    a_file.write_bytes(b"\xb8\x01")
    not_objects = {}
    for kind, text in (("array", "[]"), ("null", "null"), ("string", '"x"')):
        not_objects[kind] = tmp_path / f"json_{kind}"
        not_objects[kind].mkdir()
        (not_objects[kind] / "config.json").write_text(text)
    return {
        "missing field": (
            no_heads,
            f"{no_heads}/config.json has no 'num_attention_heads', a field its architecture needs",
        ),
        "bad JSON": (bad_json, f"{bad_json}/config.json is not valid JSON: Expecting property name"),
        "architectures a string": (
            edited["arch_string"],
            f"{edited['arch_string']}/config.json: architectures must be a list of class names, "
            "e.g. [\"Qwen3ForCausalLM\"]; got 'Qwen3ForCausalLM'",
        ),
        "zero heads": (
            edited["zero_heads"],
            f"{edited['zero_heads']}/config.json: a size field is 0 (num_attention_heads, head counts, ...)",
        ),
        "a file": (a_file, f"'{a_file}' is not a directory (expected a HF checkpoint directory)"),
        **{
            f"JSON {kind}": (where, f"{where}/config.json holds a JSON {kind}; expected a JSON object")
            for kind, where in not_objects.items()
        },
    }


def test_a_bad_model_directory_is_one_line_naming_the_file(tmp_path, capsys):
    """Before: a KeyError traceback for a config.json without num_attention_heads, and "Expecting value…"
    without a path for a file or bad JSON; now the reader `train` uses, with its messages."""
    for hf_path, message in _bad_model_dirs(tmp_path).values():
        rc = main(["plan", str(EXAMPLE_8B), "--set", f"model.hf_path={hf_path}"])
        err = capsys.readouterr().err
        assert rc == 2 and err.startswith(f"megatron-tail plan: error: model.hf_path: {message}"), err
        assert len(err.splitlines()) == 1, err


def test_plan_checks_that_the_environment_imports(capsys):
    """Before: `plan` passed a `rollout.env.name` that `train` then refused."""
    rc = main(
        [
            "plan",
            str(EXAMPLE_8B),
            "--set",
            f"model.hf_path={QWEN3_8B}",
            "--set",
            "rollout.env.name=nowhere:Env",
        ]
    )
    assert rc == 2
    assert capsys.readouterr().err == (
        "megatron-tail plan: error: rollout.env.name 'nowhere:Env': cannot import module 'nowhere': "
        "No module named 'nowhere'\n"
    )


def test_reads_only_config_json_and_imports_no_megatron(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    shutil.copy(QWEN3_8B / "config.json", model / "config.json")
    code = (
        "import sys; from megatron_tail.cli import main; "
        f"rc = main(['plan', {str(EXAMPLE_8B)!r}, '--set', 'model.hf_path={model}', '--json']); "
        "assert not any(m == 'megatron' or m.startswith('megatron.') for m in sys.modules), "
        "'megatron imported'; "
        "sys.exit(rc)"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["fits"] is True


def test_fp8_rollout_weights(capsys):
    example = ROOT / "examples/qwen3_8b_grpo_dvp_fp8.yaml"
    rc, out = _plan_json(capsys, example, "--set", f"model.hf_path={QWEN3_8B}")
    # e4m3 linear weights 36 · 192,937,984 B + an fp32 scale per output channel 36 · 38,912 · 4 B
    # ((32 + 16)·128 + 2·4096 + 2·12288 channels per layer), the rest (embeddings, norms) in bf16
    linear = 36 * 192_937_984
    expected = linear + 36 * 38_912 * 4 + (8_190_735_360 - linear) * 2
    assert rc == 0 and out["rollout"]["weights_bytes_per_gpu"] == expected == 9_441_306_624


def test_context_parallel_divides_activations_and_logits_per_gpu(capsys):
    """CP=2 on the same 8 trainer GPUs: DP halves, activations and logits are those of tokens / 2 per GPU
    (the per-token-per-layer bytes are unchanged), the distributed optimizer still shards over DP × CP."""
    base = (EXAMPLE_8B, "--set", f"model.hf_path={QWEN3_8B}", "--nodes", 2)
    _, one = _plan_json(capsys, *base)
    rc, two = _plan_json(capsys, *base, "--set", "parallel.context_parallel=2")
    t1, t2 = one["trainer"], two["trainer"]
    assert rc == 0 and (t2["context_parallel"], t2["data_parallel"], t1["context_parallel"]) == (2, 2, 1)
    assert t2["tokens_per_gpu"] == t1["tokens_per_micro_batch"] // 2 == 2560
    per = t1["activation_bytes_per_token_per_layer"]["none_sp"]
    assert t2["activations_bytes"] == per * 36 * 2560 == t1["activations_bytes"] // 2
    # logits [2560, 76288] bf16 + final norm and the op's state for 2560 tokens + its partial sums
    assert t2["logits_bytes"] == 2560 * 76288 * 2 + 2560 * (8192 + 2 + 16) + 7 * 4 * 2560
    assert t2["optimizer_bytes"] == t1["optimizer_bytes"]  # DP=2 × CP=2 shards as DP=4 did
    text = main(["plan", *map(str, base), "--set", "parallel.context_parallel=2"])
    out = capsys.readouterr().out
    assert text == 0 and "TP=2 PP=1 CP=2 DP=2" in out and "1 x 5120/CP=2560 tokens x 36 layers" in out
    # it fits at CP=1 without recompute, so at CP=1 with full recompute too: CP is flagged as optional
    assert any("context_parallel=2 is not needed" in w and "recompute=none fit" in w for w in two["warnings"])


def test_sampling_supports_are_counted_ragged_at_the_top_k_bound(capsys):
    """top_k = 4096 with top_p: each in-flight micro-batch's ragged supports (4 B per id + 8 B per token) on
    every stage, the op's dense int32 [tokens, K] on the last; every rank's host copy of the step's batch."""
    base = (EXAMPLE_8B, "--set", f"model.hf_path={QWEN3_8B}", "--nodes", 2)
    _, plain = _plan_json(capsys, *base)
    truncated = ("--set", "rollout.sampling.top_k=4096", "--set", "rollout.sampling.top_p=0.95")
    truncated += ("--set", "rollout.sampling.mask_max_tokens=8192")  # top_k's headroom for flashinfer's ties
    rc, out = _plan_json(capsys, *base, *truncated)
    t = out["trainer"]
    tokens, k, cap = 5120, 4096, 8192  # one THD micro-batch, the last stage (PP = 1: one in flight)
    # the op's dense width at worst is the mask cap: flashinfer keeps ties at the top-k cutoff
    assert t["supports_bytes"] == tokens * (k * 4 + 8) + tokens * cap * 4
    assert t["total_bytes"] == plain["trainer"]["total_bytes"] + t["supports_bytes"]
    samples, response = 128 * 8, 4096  # prompts_per_step x group_size, max_new_tokens of the example
    host = samples * response * (k * 4 + 8)
    assert host > 64 * GIB
    assert out["supports"] == {"width": k, "dense_width": cap, "host_bytes_per_rank": host}
    # 8 ranks per node x 64 GiB is over a quarter of the assumed 1 TiB of host memory per node: warned
    (warning,) = [w for w in out["warnings"] if "sampling supports" in w]
    assert "512.2 GiB per node" in warning and "rollout.sampling.top_k=4096" in warning
    main(["plan", *map(str, base), *truncated])
    text = capsys.readouterr().out
    assert "supports" in text and "ids ragged" in text and "GiB of host memory per trainer rank" in text
    assert rc == 0
    _, small = _plan_json(
        capsys, *base, "--set", "rollout.sampling.top_k=20", "--set", "rollout.sampling.top_p=0.95"
    )
    assert not [w for w in small["warnings"] if "sampling supports" in w]
    # the seeded PyTorch sampler refuses min-p, and with it DVP's safe set sent as min-p
    exact = [
        f"--set={kv}"
        for kv in ("rollout.sampling.top_k=20", "rollout.sampling.top_p=0.95", "rollout.deterministic=true")
    ]
    exact.append("--set=algorithm.log_rho=null")
    _, deterministic = _plan_json(capsys, *base, *exact)
    assert deterministic["supports"]["dense_width"] == 20  # the PyTorch sampler keeps exactly top_k ranks


def test_the_op_backends_working_memory_is_what_the_op_allocates():
    """The planner's copies of the ops' chunk sizes are the ops' own, and its logits term follows the backend:
    the PyTorch code's fp32 chunks, the Triton kernels' per-row sums (unfused) or one bf16 token chunk
    (fused)."""
    from megatron_tail.model.hf_config import load_hf_config
    from megatron_tail.ops import linear_masked_logprobs, masked_logprobs, masked_logprobs_math
    from megatron_tail.plan import activations
    from megatron_tail.plan.shapes import ModelShape

    assert activations.UNFUSED_CHUNK_ELEMENTS == masked_logprobs.CHUNK_ELEMENTS["cuda"]
    assert activations.FUSED_BLOCK_ELEMENTS == linear_masked_logprobs.BLOCK_ELEMENTS["cuda"]
    assert activations.TRITON_CHUNK_ELEMENTS == linear_masked_logprobs.TRITON_CHUNK_ELEMENTS["cuda"]
    assert activations.NUM_PARTIALS == masked_logprobs_math.NUM_PARTIALS
    shape = ModelShape.from_arch(load_hf_config(QWEN3_8B), 128)
    kw = dict(tp=2, tokens=16384, dtype_bytes=2, sequence_parallel=False)
    v_local, fp32 = shape.padded_vocab // 2, 4
    for fused in (False, True):
        torch_term = activations.logits_bytes(shape, fused_output_layer=fused, op_backend="torch", **kw)
        triton_term = activations.logits_bytes(shape, fused_output_layer=fused, op_backend="triton", **kw)
        if fused:  # 4 fp32 copies of a 2^24 block against one bf16 chunk of 2^28 logits (capped by the call)
            chunk = min(16384 * v_local, 1 << 28)
            assert torch_term - triton_term == 4 * fp32 * (1 << 24) - 2 * chunk
        else:  # 4 fp32 copies of a 2^25 chunk against 7 fp32 sums per token
            assert torch_term - triton_term == 4 * fp32 * (1 << 25) - 7 * fp32 * 16384


def test_the_plan_refuses_a_layout_the_job_cannot_start(capsys):
    """The section's layout as rl.sbatch would start it: servers and trainer ranks on the node's GPUs, and
    only SGLang servers are planned (rl.sbatch starts local CPU engines without a plan)."""
    model = ("--set", f"model.hf_path={QWEN3_8B}")
    cases = [
        (
            ("--set", "cluster.servers_per_node=8", "--set", "cluster.sglang.tp=2"),
            "cluster.servers_per_node × cluster.sglang.tp=2 must fit cluster.gpus_per_node=8",
        ),
        (
            ("--set", "cluster.trainer_procs_per_node=16"),
            "trainer_procs_per_node must be ≤ cluster.gpus_per_node=8",
        ),
        (
            ("--gpus-per-node", "4", "--set", "cluster.trainer_procs_per_node=8"),
            "must be ≤ cluster.gpus_per_node=4",
        ),
        (("--set", "cluster.rollout_backend=local"), "cluster.rollout_backend=local: the plan is of GPUs"),
    ]
    for args, says in cases:
        rc = main(["plan", str(EXAMPLE_8B), *model, *args])
        err = capsys.readouterr().err
        assert rc == 2 and says in err and len(err.strip().splitlines()) == 1, (args, err)


def test_the_fused_output_layer_plans_less_than_unfused_with_no_warning_as_a_gpu_measured(capsys):
    """Until a GPU measured the fused path after issue 51's fix, the plan warned to size jobs with it off (it
    had peaked 45% above its plan). The H200 run of 2026-12-01 (`measured_peaks.json`, commit df0017b) held
    48.06 GiB fused against 51.46 unfused, each within 2% of its plan (`test_measured_peaks`): the plan now
    counts the fused layer as saving memory, with no warning."""
    base = (EXAMPLE_8B, "--set", f"model.hf_path={QWEN3_8B}", "--nodes", 2)
    _, plain = _plan_json(capsys, *base)
    _, fused = _plan_json(capsys, *base, "--set", "model.fused_output_layer=true")
    assert not any("fused_output_layer" in w for w in plain["warnings"] + fused["warnings"])
    assert fused["trainer"]["total_bytes"] < plain["trainer"]["total_bytes"]


def test_a_local_only_quantization_in_the_config_is_refused_as_the_flag_is(capsys):
    """Before: `rollout.quantization: nvfp4_a16` (the local engine's emulation, which `train` refuses with
    remote servers) was planned as bf16 weights, "fits", exit 0; `--quantization nvfp4_a16` was refused."""
    args = ["plan", str(EXAMPLE_8B), "--set", f"model.hf_path={QWEN3_8B}", "--nodes", "2"]
    assert main([*args, "--set", "rollout.quantization=nvfp4_a16"]) == 2
    assert capsys.readouterr().err == (
        "megatron-tail plan: error: rollout.quantization='nvfp4_a16' is the local engine's emulation: the "
        "SGLang servers the plan sizes take 'none' or 'fp8'\n"
    )


def test_an_offloaded_reference_counts_what_its_pass_peaks_above_the_update(capsys):
    """The offloaded reference's weights come onto the GPU for its own pass, before the update's activations
    exist: that pass is the step's peak where the weights outweigh the activations (full recompute). Before:
    counted 0, so the plan said 47.0 GiB where the reference pass needs ≈ 50.6."""
    long = ROOT / "examples/qwen3_8b_grpo_dvp_long.yaml"
    base = (long, "--set", f"model.hf_path={QWEN3_8B}", "--set", "algorithm.kl_coef=0.001")
    _, out = _plan_json(capsys, *base, "--set", "model.reference_offload=true")
    t = out["trainer"]
    assert t["reference_bytes"] == 2 * t["params_per_gpu"] - t["activations_bytes"] > 0
    _, resident = _plan_json(capsys, *base)
    assert resident["trainer"]["reference_bytes"] == 2 * t["params_per_gpu"]  # resident: all of it
