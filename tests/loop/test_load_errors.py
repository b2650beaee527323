"""Mistakes in the data and the config that the run met late (issue 50, items 4 and 7) are one line at load,
before megatron-core is imported, naming the file and line or the key, and what was expected (exit 2).

Before, on the tiny model of these tests (a context of 32 tokens):
- a prompt longer than the context: the engine's HTTP 400 at step 1, 83 lines, exit 1;
- `train.max_tokens_per_micro_batch` below one sample: a ValueError traceback at step 1, exit 1;
- `model.op_backend=triton` without CUDA: a RuntimeError traceback at the first step, 62 lines, exit 1;
- a run directory on a read-only mount: an `OSError` traceback, exit 1;
- `rollout.local.device=cuda` without CUDA: exit 4, blaming the engine, the key unnamed;
- `model.use_te=true` without Transformer Engine or CUDA: a ValueError traceback after megatron started.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

from megatron_tail.config import load_config
from megatron_tail.train.run.run_dir_lock import claim_run_dir
from megatron_tail.utils.errors import EXIT_USER_ERROR, UserError

from .conftest import loop_overrides

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="the mistake is CUDA's absence")


def _config(model_dir, prompt_file, run_dir, **extra):
    return load_config(None, loop_overrides(model_dir, prompt_file, run_dir, extra))


@pytest.fixture(scope="module")
def long_prompts(tmp_path_factory):
    """Line 3 holds a prompt of 32 tokens: with 5 new tokens, more than the tiny model's context of 32."""
    path = tmp_path_factory.mktemp("long") / "long.jsonl"
    rows = [{"prompt": "1+2=", "answer": "3"}, {"prompt": "1+2=" * 8, "answer": "3"}]
    path.write_text(json.dumps(rows[0]) + "\n\n" + json.dumps(rows[1]) + "\n")
    return path


def _too_long(path) -> str:
    return (
        f"{path} line 3: the prompt is 32 tokens; with rollout.max_new_tokens=5 that is 37, more than the "
        "model's context of 32 tokens (max_position_embeddings in "
    )


def test_a_prompt_longer_than_the_context_is_named_by_file_and_line(tiny_model_dir, long_prompts, tmp_path):
    cfg = _config(tiny_model_dir, long_prompts, tmp_path / "run")
    with pytest.raises(UserError) as caught:
        cfg.check_inputs()
    assert str(caught.value).startswith(_too_long(long_prompts))
    assert str(caught.value).endswith(
        "drop such prompts with data.max_prompt_tokens=27, or lower rollout.max_new_tokens"
    )
    # dropping them as the message says is a run that starts
    _config(tiny_model_dir, long_prompts, tmp_path / "run", **{"data.max_prompt_tokens": 27}).check_inputs()


def test_eval_prompts_are_checked_only_when_the_run_evaluates(
    tiny_model_dir, prompt_file, long_prompts, tmp_path
):
    evaluated = {"data.eval_path": long_prompts, "train.eval_every": 1}
    with pytest.raises(UserError, match=rf"^{long_prompts} line 3: the prompt is 32 tokens"):
        _config(tiny_model_dir, prompt_file, tmp_path / "run", **evaluated).check_inputs()
    _config(tiny_model_dir, prompt_file, tmp_path / "run", **{"data.eval_path": long_prompts}).check_inputs()


def test_a_token_budget_below_the_longest_sample_is_refused_at_load(tiny_model_dir, prompt_file, tmp_path):
    prompts = [json.loads(line)["prompt"] for line in prompt_file.read_text().splitlines()]
    longest = max(prompts, key=len)  # the tiny model's tokenizer: one token per character
    line = prompts.index(longest) + 1
    cfg = _config(tiny_model_dir, prompt_file, tmp_path / "run", **{"train.max_tokens_per_micro_batch": 8})
    with pytest.raises(UserError) as caught:
        cfg.check_inputs()
    assert str(caught.value) == (
        f"train.max_tokens_per_micro_batch must hold the longest sample: the longest prompt ({len(longest)} "
        f"tokens, {prompt_file} line {line}) + rollout.max_new_tokens=5 = {len(longest) + 5}; got 8"
    )
    # an episode ends at the model's context (32), however long its turns and observations could add up to
    episodes = {"rollout.env.name": "calculator", "rollout.env.max_turns": 3, "algorithm.overlong_buffer": 0}
    with pytest.raises(
        UserError, match=r"\(max_turns − 1\) × max_observation_tokens\) = the model's context, 32; got 24$"
    ):
        _config(
            tiny_model_dir,
            prompt_file,
            tmp_path / "run",
            **episodes,
            **{"train.max_tokens_per_micro_batch": 24},
        ).check_inputs()
    _config(tiny_model_dir, prompt_file, tmp_path / "run", **episodes).check_inputs()


def test_the_prompts_are_read_once_per_process_and_again_when_the_file_changes(
    tiny_model_dir, prompt_file, tmp_path
):
    """`check_inputs` reads them before megatron; the session in the same process takes the same objects."""
    from megatron_tail.config.run_inputs import run_prompts

    data = tmp_path / "prompts.jsonl"
    data.write_text(prompt_file.read_text())
    cfg = _config(tiny_model_dir, data, tmp_path / "run")
    first = run_prompts(cfg)
    assert run_prompts(cfg) is first
    data.write_text(prompt_file.read_text().splitlines(keepends=True)[0])
    assert len(run_prompts(cfg).train) == 1


@no_cuda
def test_the_triton_op_without_cuda_is_refused_naming_the_key_and_the_interpreter_still_runs_it(
    tiny_model_dir, prompt_file, tmp_path, monkeypatch
):
    cfg = _config(tiny_model_dir, prompt_file, tmp_path / "run", **{"model.op_backend": "triton"})
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(
        UserError, match=r"^model.op_backend=triton needs CUDA tensors .* and this machine has no CUDA"
    ):
        cfg.check_inputs()
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the kernels' tests on CPU
    cfg.check_inputs()


def test_a_tokenizer_that_does_not_load_or_is_not_the_models_is_named(tiny_model_dir, prompt_file, tmp_path):
    """Before: a JSONDecodeError traceback from transformers, and a tokenizer whose ids reach past the model's
    vocabulary passed load, then the engine refused the prompt at step 1."""
    from megatron_tail.config.run_inputs import _check_ids_in_vocab
    from megatron_tail.data.prompts import PromptExample

    broken = tmp_path / "model"
    shutil.copytree(tiny_model_dir, broken)
    (broken / "tokenizer.json").write_text("{")
    cfg = _config(broken, prompt_file, tmp_path / "run")
    with pytest.raises(UserError, match=rf"^model.hf_path: the tokenizer of {broken} does not load: "):
        cfg.check_inputs()
    examples = [PromptExample(0, [1, 2], "ab", "1"), PromptExample(1, [3, 100], "cd", "2")]
    with pytest.raises(
        UserError,
        match=rf"^{prompt_file} line 2: the tokenizer gives token id 100, and the model has vocab_size=100 ",
    ):
        _check_ids_in_vocab(examples, str(prompt_file), 100, str(tiny_model_dir))
    _check_ids_in_vocab(examples, str(prompt_file), 101, str(tiny_model_dir))


def test_a_model_none_of_whose_eos_tokens_it_can_emit_is_refused(tiny_model_dir, prompt_file, tmp_path):
    """Before: accepted, and every completion ran to `rollout.max_new_tokens` (transformers only warns). The
    engines stop on any of the ids, so one the model can emit is enough."""
    from types import SimpleNamespace

    from megatron_tail.config.run_inputs import _check_eos_in_vocab

    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    config = json.loads((model / "config.json").read_text())
    vocab = config["vocab_size"]
    eos = [config["eos_token_id"], vocab]
    (model / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    _config(model, prompt_file, tmp_path / "run").check_inputs()  # one valid id among them
    (model / "generation_config.json").write_text(json.dumps({"eos_token_id": [vocab, vocab + 1]}))
    with pytest.raises(
        UserError,
        match=rf"^model.hf_path: no eos_token_id of {model} is a token of the model \(0 ≤ id < "
        rf"vocab_size={vocab}\): {vocab} \(the tokenizer\), -1 \(config.json\), {vocab} "
        rf"\(generation_config.json\), {vocab + 1} \(generation_config.json\); the model could never end",
    ):
        _check_eos_in_vocab(SimpleNamespace(eos_token_id=vocab), {"eos_token_id": -1}, str(model), vocab)


def test_offline_eval_refuses_an_output_path_that_is_a_file(tiny_model_dir, prompt_file, tmp_path):
    """Before: `FileExistsError` traceback from `out.mkdir`, after the model was loaded."""
    from megatron_tail.train.run.offline_eval import check_inputs

    cfg = _config(tiny_model_dir, prompt_file, tmp_path / "run", **{"data.eval_path": prompt_file})
    (a_file := tmp_path / "results").write_text("")
    with pytest.raises(UserError, match=rf"^--out {a_file} is a file; a directory .* is expected$"):
        check_inputs(cfg, hf_dir=tiny_model_dir, out_dir=a_file)
    check_inputs(cfg, hf_dir=tiny_model_dir, out_dir=tmp_path / "new")
    # a --checkpoint that is a file: before, "does not exist", though it does
    with pytest.raises(UserError, match=rf"^--checkpoint {a_file} is not a directory \(a run's checkpoints/"):
        check_inputs(cfg, checkpoint=a_file)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (
            {"parallel.pipeline_parallel": 3},
            "parallel.pipeline_parallel=3 does not divide the model's num_hidden_layers=2 (equal stages)",
        ),
        (
            {"parallel.tensor_parallel": 3, "model.vocab_pad_multiple": 384},
            "parallel.tensor_parallel=3 does not divide the model's num_attention_heads=4",
        ),
        (
            {"parallel.tensor_parallel": 4},  # 4 heads, 2 KV heads (replicated): the FFN's 64 divides too
            None,
        ),
        (
            {"parallel.expert_parallel": 2},
            "parallel.expert_parallel=2, parallel.expert_tensor_parallel=None: Qwen3ForCausalLM is a dense",
        ),
    ],
)
def test_a_layout_the_model_cannot_take_is_refused_at_load(
    tiny_model_dir, prompt_file, tmp_path, extra, message
):
    """Before: `ValueError: num_hidden_layers=3 is not divisible by pipeline_parallel=2` as a traceback on
    every rank, after megatron-core had started (and rank 0 its engine)."""
    cfg = _config(tiny_model_dir, prompt_file, tmp_path / "run", **extra)
    if message is None:
        cfg.check_inputs()
        return
    with pytest.raises(UserError, match=re.escape(message)):
        cfg.check_inputs()


def _complete_checkpoint(tmp_path):
    step = tmp_path / "ck" / "step_000003"
    step.mkdir(parents=True)
    (step / "metadata.json").write_text("{}")
    return step


def test_offline_eval_checks_its_inputs_before_a_checkpoint_is_loaded(tiny_model_dir, prompt_file, tmp_path):
    """Before, `megatron-tail eval --checkpoint` loaded and exported the checkpoint (minutes for a large
    model, writing <checkpoint>/hf) and only then met a missing eval set ("prompt file ... does not exist",
    the key unnamed), a missing model.hf_path (`FileNotFoundError: no HF config.json`, a traceback) or a bad
    reward."""
    from megatron_tail.train.run.offline_eval import check_inputs

    step = _complete_checkpoint(tmp_path)
    good = {"data.eval_path": prompt_file}
    check_inputs(_config(tiny_model_dir, prompt_file, tmp_path / "run", **good), checkpoint=step)
    cases = [
        (
            {"data.eval_path": tmp_path / "nope.jsonl"},
            r"^data.eval_path: prompt file .*nope.jsonl.*not exist",
        ),
        ({**good, "model.hf_path": tmp_path / "nowhere"}, r"^model.hf_path: model directory .*not found"),
        ({**good, "data.reward": "no_such_module:fn"}, r"no_such_module"),
    ]
    for extra, message in cases:
        cfg = _config(tiny_model_dir, prompt_file, tmp_path / "run", **extra)
        with pytest.raises(UserError, match=message):
            check_inputs(cfg, checkpoint=step)


def test_offline_eval_needs_the_base_models_config_not_its_weights(tiny_model_dir, prompt_file, tmp_path):
    """With --checkpoint the weights come from the checkpoint: model.hf_path needs config.json and the
    tokenizer (the export copies them), not its safetensors."""
    from megatron_tail.train.run.offline_eval import check_inputs

    base = tmp_path / "base"
    shutil.copytree(tiny_model_dir, base, ignore=shutil.ignore_patterns("*.safetensors*"))
    cfg = _config(base, prompt_file, tmp_path / "run", **{"data.eval_path": prompt_file})
    check_inputs(cfg, checkpoint=_complete_checkpoint(tmp_path))
    with pytest.raises(UserError, match=r"^--hf: "):  # an --hf model is served as it is: weights needed
        check_inputs(cfg, hf_dir=base, out_dir=tmp_path / "out")


def test_offline_eval_names_where_it_cannot_write(tiny_model_dir, prompt_file, tmp_path, monkeypatch):
    """Before: a `PermissionError` traceback from `out.mkdir` or the results' write, after the model was
    loaded (a model in a read-only shared directory, evaluated without --out). `unwritable_reason` itself
    meets a real read-only mount in the run-directory test below; here it is stood in."""
    from megatron_tail.train.run.offline_eval import check_inputs
    from megatron_tail.utils import paths

    readonly = {tiny_model_dir, tmp_path / "ck"}
    monkeypatch.setattr(
        paths, "unwritable_reason", lambda p: f"{p} is not writable by this user" if p in readonly else None
    )
    cfg = _config(tiny_model_dir, prompt_file, tmp_path / "run", **{"data.eval_path": prompt_file})
    with pytest.raises(UserError, match=r"^--hf \(no --out\) .* not writable by this user; pass --out DIR$"):
        check_inputs(cfg, hf_dir=tiny_model_dir)
    check_inputs(cfg, hf_dir=tiny_model_dir, out_dir=tmp_path / "out")
    step = _complete_checkpoint(tmp_path)
    readonly.add(step)
    with pytest.raises(UserError, match=r"^--checkpoint \(its export, hf/\) .*step_000003: the evaluation"):
        check_inputs(cfg, checkpoint=step, out_dir=tmp_path / "out")


@no_cuda
def test_transformer_engine_where_it_cannot_run_is_refused_naming_the_key(
    tiny_model_dir, prompt_file, tmp_path
):
    """Before: megatron started, then a 28-line ValueError traceback from `resolved_use_te`, exit 1."""
    cfg = _config(tiny_model_dir, prompt_file, tmp_path / "run", **{"model.use_te": True})
    with pytest.raises(
        UserError, match=r"^model.use_te=true needs Transformer Engine on CUDA .* no CUDA device;"
    ):
        cfg.check_inputs()


@no_cuda
@pytest.mark.parametrize("device", ["cuda", "cuda:1"])
def test_a_cuda_local_engine_without_cuda_is_refused_naming_the_key(
    tiny_model_dir, prompt_file, tmp_path, device
):
    cfg = _config(tiny_model_dir, prompt_file, tmp_path / "run", **{"rollout.local.device": device})
    with pytest.raises(UserError, match=rf"^rollout.local.device needs a CUDA device, .*; got '{device}'$"):
        cfg.check_inputs()


@pytest.fixture
def read_only(tmp_path):
    """A directory holding `locked/.lock` (a run directory used before), on a read-only mount (as root, whom
    permissions do not stop) or without write permission."""
    source = tmp_path / "source"
    (source / "locked").mkdir(parents=True)
    (source / "locked" / ".lock").write_text("{}")
    if os.geteuid() != 0:
        os.chmod(source / "locked", 0o555)
        os.chmod(source, 0o555)
        yield source
        os.chmod(source, 0o755)
        os.chmod(source / "locked", 0o755)
        return
    target = tmp_path / "ro"
    target.mkdir()
    mounted = subprocess.run(["mount", "--bind", str(source), str(target)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot bind-mount here: {mounted.stderr.decode().strip()}")
    try:
        subprocess.run(["mount", "-o", "remount,ro,bind", str(target)], check=True, capture_output=True)
        yield target
    finally:
        subprocess.run(["umount", str(target)], check=True)


@pytest.mark.parametrize("name", ["new", "locked"])
def test_a_run_directory_that_cannot_be_written_is_named(tiny_model_dir, prompt_file, read_only, name):
    run_dir = read_only / name
    why = "read-only file system" if os.geteuid() == 0 else "not writable by this user"
    expected = (
        rf"^run_dir {run_dir} must be a writable directory \(the run writes its lock, config, checkpoints "
        rf"and logs there\): {read_only if name == 'new' else run_dir} is (on a )?{why}$"
    )
    with pytest.raises(UserError, match=expected):
        _config(tiny_model_dir, prompt_file, run_dir).check_inputs()
    # the lock itself, for callers that skip `check_inputs`
    with pytest.raises(
        UserError, match=rf"^run_dir {run_dir} must be a writable directory .*: \S.*: {run_dir}"
    ):
        claim_run_dir(run_dir, resume=True)


def _cli(tmp_path, overrides, env=None):
    """`megatron-tail train` with a `megatron` package that fails to import: a refusal printed came first."""
    fake = tmp_path / "fake" / "megatron"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text('raise ImportError("megatron-core was imported")\n')
    config = tmp_path / "run.yaml"
    config.write_text("seed: 7\n")
    cmd = [sys.executable, "-m", "megatron_tail.cli", "train", str(config)]
    for item in overrides:
        cmd += ["--set", item]
    env = {**(env or os.environ), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONWARNINGS": "ignore"}
    env["PYTHONPATH"] = os.pathsep.join([str(fake.parent), os.getcwd(), env.get("PYTHONPATH", "")])
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)


def test_the_command_line_refuses_a_long_prompt_in_one_line_before_megatron(
    tiny_model_dir, long_prompts, tmp_path
):
    proc = _cli(tmp_path, loop_overrides(tiny_model_dir, long_prompts, tmp_path / "run"))
    assert proc.returncode == EXIT_USER_ERROR, proc.stdout + proc.stderr
    lines = [line for line in proc.stderr.splitlines() if "Generating train split" not in line]
    assert len(lines) == 1 and lines[0].startswith(
        f"megatron-tail train: error: {_too_long(long_prompts)}"
    ), lines


@no_cuda
def test_the_command_line_refuses_a_cuda_local_engine_with_exit_2_naming_the_key(
    tiny_model_dir, prompt_file, tmp_path
):
    overrides = loop_overrides(
        tiny_model_dir, prompt_file, tmp_path / "run", {"rollout.local.device": "cuda"}
    )
    proc = _cli(tmp_path, overrides)
    assert proc.returncode == EXIT_USER_ERROR, proc.stdout + proc.stderr
    assert proc.stderr.strip() == (
        "megatron-tail train: error: rollout.local.device needs a CUDA device, and this machine has none "
        "(torch.cuda.is_available() is false); use \"cpu\"; got 'cuda'"
    )


def test_offline_eval_with_adaptive_rho_uses_the_checkpoints_log_rho(
    tiny_model_dir, prompt_file, tmp_path, monkeypatch
):
    """Before: `ValueError: log_rho "auto" must be resolved to a number` with a traceback, from the engines'
    start. A checkpoint keeps the log ρ its run had reached; an exported model keeps none."""
    from megatron_tail.train.engine import checkpoint as checkpoint_module
    from megatron_tail.train.run.offline_eval import check_inputs, with_checkpoint_log_rho

    extra = {"data.eval_path": prompt_file, "algorithm.log_rho": "auto"}
    cfg = _config(tiny_model_dir, prompt_file, tmp_path / "run", **extra)
    assert cfg.algorithm.adaptive_rho
    with pytest.raises(
        UserError, match=r"^algorithm.log_rho: auto has no value for .* --set algorithm.log_rho"
    ):
        check_inputs(cfg, hf_dir=tiny_model_dir)
    saved = {"log_rho": -11.5}
    monkeypatch.setattr(checkpoint_module, "read_checkpoint_meta", lambda _path: {"rl_state": saved})
    resolved = with_checkpoint_log_rho(cfg, tmp_path / "step_000003")
    assert resolved.algorithm.log_rho == -11.5 and not resolved.algorithm.adaptive_rho
    saved["log_rho"] = None  # a run with a fixed log ρ
    with pytest.raises(UserError, match=r"keeps no log ρ \(its run had a fixed one\)"):
        with_checkpoint_log_rho(cfg, tmp_path / "step_000003")


def test_model_max_sequence_length_caps_the_runs_sequences(tiny_model_dir, long_prompts, tmp_path):
    """Before, only `megatron-tail plan` read it: a prompt past it was accepted, an episode ran past it."""
    from megatron_tail.train.run.rollout_plan import rollout_plan

    # the 4-token first prompt + 5 new tokens fit in 10; the 32-token third one did not fit even the model
    capped = {"model.max_sequence_length": 8, "data.max_prompt_tokens": 27}
    cfg = _config(tiny_model_dir, long_prompts, tmp_path / "run", **capped)
    with pytest.raises(
        UserError, match=r"more than the model's context of 8 tokens \(model.max_sequence_length\)"
    ):
        cfg.check_inputs()
    cfg = _config(
        tiny_model_dir, long_prompts, tmp_path / "run", **{**capped, "model.max_sequence_length": 10}
    )
    cfg.check_inputs()
    assert rollout_plan(cfg, tmp_path / "run", note=lambda _: None).context_length == 10
    too_long = _config(
        tiny_model_dir, long_prompts, tmp_path / "run", **{**capped, "model.max_sequence_length": 33}
    )
    with pytest.raises(
        UserError, match=r"^model.max_sequence_length=33 is longer than the model's context \(32, "
    ):
        too_long.check_inputs()


def test_the_eval_file_may_name_its_own_fields_and_template(tiny_model_dir, prompt_file, tmp_path):
    """Training on one layout and evaluating on another (DAPO's `prompt` messages and
    `reward_model.ground_truth`; MATH-500's `problem` and `answer`) is the usual setup; before, the eval file
    had to use the training file's field names and template, or the run refused it at load."""
    from megatron_tail.config.run_inputs import run_prompts

    math500 = tmp_path / "math500.jsonl"
    math500.write_text(
        "".join(json.dumps({"problem": f"{i}+1=", "solution": f"{i + 1}"}) + "\n" for i in range(3))
    )
    evaluated = {"data.eval_path": math500, "train.eval_every": 1}
    with pytest.raises(UserError, match=rf"^{math500}: field 'prompt' not found; the file's fields are"):
        _config(tiny_model_dir, prompt_file, tmp_path / "run", **evaluated).check_inputs()
    own = {**evaluated, "data.eval_prompt_key": "problem", "data.eval_answer_key": "solution",
           "data.eval_prompt_template": "Q: {prompt}"}  # fmt: skip
    prompts = run_prompts(_config(tiny_model_dir, prompt_file, tmp_path / "run", **own))
    assert [(e.prompt_text, e.answer) for e in prompts.eval] == [(f"Q: {i}+1=", f"{i + 1}") for i in range(3)]
    assert not any(e.prompt_text.startswith("Q: ") for e in prompts.train)  # the training file as before
