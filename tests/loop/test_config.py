"""Run config: YAML + overrides → typed dataclasses, coercion, typo errors naming the nearest key."""

from __future__ import annotations

import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from megatron_tail.config import (
    ConfigError,
    RunConfig,
    all_keys,
    config_to_dict,
    load_config,
    save_resolved_config,
)
from megatron_tail.utils.errors import UserError

REPO = Path(__file__).resolve().parents[2]


def write_yaml(tmp_path, data) -> str:
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


def test_yaml_sections_map_onto_dataclasses(tmp_path):
    path = write_yaml(
        tmp_path,
        {
            "run_dir": "runs/x",
            "seed": 7,
            "parallel": {"tensor_parallel": 2},
            "algorithm": {"advantage_estimator": "rloo", "group_size": 4, "log_rho": -10, "is_mode": "tis"},
            "optimizer": {"lr": 3e-4},
            "rollout": {"max_new_tokens": 5, "sampling": {"temperature": 0.7}},
            "logging": {"prob_buckets": [0.6, 0.001]},
        },
    )
    cfg = load_config(path)
    assert cfg.run_dir == "runs/x" and cfg.seed == 7
    assert cfg.parallel.tensor_parallel == 2 and cfg.parallel.pipeline_parallel == 1
    assert cfg.algorithm.advantage_estimator == "rloo" and cfg.algorithm.group_size == 4
    # YAML's int -10 becomes the float field's float
    assert cfg.algorithm.log_rho == -10.0 and isinstance(cfg.algorithm.log_rho, float)
    assert cfg.optimizer.lr == 3e-4 and cfg.rollout.sampling.temperature == 0.7
    assert cfg.logging.prob_buckets == (0.6, 0.001)
    # untouched fields keep their defaults
    assert cfg.algorithm.mis_high == RunConfig().algorithm.mis_high


def test_overrides_are_coerced_to_the_field_types(tmp_path):
    path = write_yaml(tmp_path, {"algorithm": {"log_rho": -13}})
    cfg = load_config(
        path,
        [
            "algorithm.log_rho=-inf",  # YAML would read "-inf" as a string
            "algorithm.veto_threshold=1e-3",  # and "1e-3" too (no dot)
            "algorithm.stapo=true",
            "algorithm.dual_clip=3",
            "algorithm.stapo_tau_h=null",
            "train.steps=12",
            "rollout.engine=remote",
            "rollout.server_urls=[http://a:1, http://b:2]",
            "logging.prob_buckets=0.5,0.01",
            "run_dir=1234",  # a str field keeps the raw text
            "model.precision=none",
        ],
    )
    assert cfg.algorithm.log_rho == -math.inf
    assert cfg.algorithm.veto_threshold == 1e-3
    assert cfg.algorithm.stapo is True
    assert cfg.algorithm.dual_clip == 3.0 and isinstance(cfg.algorithm.dual_clip, float)
    assert cfg.algorithm.stapo_tau_h is None
    assert cfg.train.steps == 12
    assert cfg.rollout.server_urls == ("http://a:1", "http://b:2")
    assert cfg.logging.prob_buckets == (0.5, 0.01)
    assert cfg.run_dir == "1234"
    assert cfg.model.precision is None


def test_later_override_wins_and_overrides_beat_the_file(tmp_path):
    path = write_yaml(tmp_path, {"train": {"steps": 3}})
    cfg = load_config(path, ["train.steps=4", "train.steps=5"])
    assert cfg.train.steps == 5


@pytest.mark.parametrize(
    ("override", "named", "suggested"),
    [
        ("algorithm.log_roh=-13", "'algorithm.log_roh'", "algorithm.log_rho"),
        ("train.stpes=3", "'train.stpes'", "train.steps"),
        ("algoritm.log_rho=-13", "'algoritm'", "algorithm"),
        ("algorithm.lr=1e-3", "'algorithm.lr'", "optimizer.lr"),  # right key, wrong section
    ],
)
def test_typo_in_override_names_key_and_nearest_valid_one(override, named, suggested):
    with pytest.raises(ConfigError) as info:
        load_config(None, [override])
    message = str(info.value)
    assert named in message
    assert f"did you mean {suggested}?" in message


def test_typo_in_yaml_file_names_dotted_key_and_nearest(tmp_path):
    path = write_yaml(tmp_path, {"algorithm": {"stapo_tau_pp": 0.02}})
    expected = r"'algorithm\.stapo_tau_pp'.*did you mean algorithm\.stapo_tau_p\?"
    with pytest.raises(ConfigError, match=expected):
        load_config(path)


def test_a_moved_key_is_refused_in_one_line_naming_its_new_place(tmp_path):
    """`model.bf16`, the earlier spelling of `model.precision`: one name per setting, read once."""
    want = r"^config key 'model\.bf16' has moved: set model\.precision \(bf16: true → precision: bf16; "
    with pytest.raises(ConfigError, match=want):
        load_config(None, ["model.bf16=false"])
    with pytest.raises(ConfigError, match=want):
        load_config(write_yaml(tmp_path, {"model": {"bf16": True}}))


def test_a_key_of_the_flat_rollout_section_is_refused_naming_its_part(tmp_path):
    """The rollout section's parts own their keys (`rollout.settings.MOVED_KEYS`): an old flat key, in a
    file or on the command line, is one line naming where it lives now."""
    want = r"^config key 'rollout\.local_num_threads' has moved: set rollout\.local\.num_threads$"
    with pytest.raises(ConfigError, match=want):
        load_config(None, ["rollout.local_num_threads=2"])
    with pytest.raises(ConfigError, match=want):
        load_config(write_yaml(tmp_path, {"rollout": {"local_num_threads": 2}}))
    with pytest.raises(
        ConfigError,
        match=r"'rollout\.sampling_mask_max_tokens' has moved: set rollout\.sampling\.mask_max_tokens$",
    ):
        load_config(None, ["rollout.sampling_mask_max_tokens=64"])


@pytest.mark.parametrize(
    ("key", "value", "new"),
    [("weight_sync", "distributed", "rollout.weight_sync.mode"), ("env", "calculator", "rollout.env.name")],
)
def test_a_value_where_a_rollout_part_now_is_names_the_key_to_set(tmp_path, key, value, new):
    """`rollout.weight_sync: disk` and `rollout.env: calculator` were values; they are sections now."""
    want = rf"^config key 'rollout\.{key}' is a section now: set {re.escape(new)}"
    with pytest.raises(ConfigError, match=rf"{want}: '{value}'$"):
        load_config(write_yaml(tmp_path, {"rollout": {key: value}}))
    with pytest.raises(ConfigError, match=rf"{want}$"):
        load_config(None, [f"rollout.{key}={value}"])
    assert load_config(None, [f"{new}={value}"]) == load_config(
        write_yaml(tmp_path, {"rollout": {key: {new.rsplit(".", 1)[1]: value}}})
    )


def test_unknown_key_without_near_match_lists_valid_keys():
    with pytest.raises(ConfigError, match="valid keys here: run_dir, seed, model"):
        load_config(None, ["zzzzzz=1"])


@pytest.mark.parametrize(
    ("override", "pattern"),
    [
        ("train.steps=many", r"train\.steps must be an integer; got 'many'"),
        ("algorithm.log_rho=abc", r"log_rho must be a number ≤ 0, null or \"auto\"; got 'abc'"),
        ("algorithm.stapo=maybe", r"algorithm\.stapo must be true or false; got 'maybe'"),
        ("algorithm.log_rho=0.5", r"log_rho must be ≤ 0.*0\.5"),  # the section's own validation
        ("rollout.engine=cloud", r"rollout\.engine must be one of \('local', 'remote'\); got 'cloud'"),
        ("algorithm=3", r"algorithm is a section"),
        ("train.steps", r"must look like section\.key=value"),
        (
            "rollout.sampling.top_p=0.8",
            r"rollout\.sampling\.top_k must be set with rollout\.sampling\.top_p=0\.8 .* got -1",
        ),
        (
            "rollout.sampling.top_k=5000",
            r"rollout\.sampling\.top_k must be ≤ rollout\.sampling\.mask_max_tokens=4096.*got 5000",
        ),
        ("rollout.sampling.top_k=0", r"rollout\.sampling\.top_k must be an int ≥ 1, or -1 \(off\); got 0"),
        ("rollout.sampling.temperature=0", r"rollout\.sampling\.temperature must be > 0 .*; got 0"),
        (  # 1/T overflows float32: the op's every row would be NaN
            "rollout.sampling.temperature=1e-320",
            r"rollout\.sampling\.temperature must be finite and ≥ 1e-06: .*; got 1e-320",
        ),
        (  # the engines decode greedily at T = 1 below SGLang's _SAMPLING_EPS; the trainer would score at T
            "rollout.sampling.temperature=5e-7",
            r"rollout\.sampling\.temperature must be finite and ≥ 1e-06: below it the engines decode "
            r"greedily and return log-probs at T = 1 .*; got 5e-07",
        ),
        ("rollout.sampling.temperature=inf", r"rollout\.sampling\.temperature must be finite .*; got inf"),
        ("rollout.sampling.min_p=2", r"rollout\.sampling\.min_p must be in \[0, 1\] \(0: off\); got 2"),
        # an unset shell variable (`--set algorithm.log_rho=$RHO`): before, null, so DVP was silently off
        ("algorithm.log_rho=", r"override 'algorithm.log_rho=' has no value; .* algorithm\.log_rho=null"),
        ("model.hf_path=", r"^override 'model.hf_path=' has no value; give one$"),  # null is no str's value
        ("data.correct_reward=.nan", r"data\.correct_reward must be a number; got nan"),  # YAML's NaN
        ("algorithm.rho_bias_budget=inf", r"rho_bias_budget must be finite and > 0; got inf"),
        ("seed=-1", r"seed must be an integer in \[0, 2\^63\); got -1"),  # numpy refused it at step 1
        ("seed=9223372036854775808", r"seed must be an integer in \[0, 2\^63\); got 9223372036854775808"),
        ("optimizer.adam_beta1=1.5", r"adam_beta1 must be in \[0, 1\); got 1\.5"),
        ("optimizer.adam_beta2=-1", r"adam_beta2 must be in \[0, 1\); got -1"),
        ("optimizer.sgd_momentum=-2", r"sgd_momentum must be in \[0, 1\); got -2"),
        ("optimizer.adam_eps=0", r"adam_eps must be finite and > 0; got 0"),  # torch's AdamW refused -1
        ("optimizer.lr=inf", r"lr must be finite and > 0; got inf"),
        ("optimizer.clip_grad=.nan", r"optimizer\.clip_grad must be a number; got nan"),
        ("optimizer.weight_decay=inf", r"weight_decay must be finite and ≥ 0; got inf"),
    ],
)
def test_bad_values_name_the_key(override, pattern):
    with pytest.raises(ConfigError, match=pattern):
        load_config(None, [override])


def test_missing_file_and_non_mapping_file(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "list.yaml"
    bad.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="must be a mapping"):
        load_config(bad)


def test_a_file_that_is_no_utf8_text_or_repeats_a_key_is_refused_naming_it(tmp_path):
    binary = tmp_path / "utf16.yaml"
    binary.write_bytes("seed: 1\n".encode("utf-16"))
    with pytest.raises(ConfigError, match=r"utf16\.yaml: not UTF-8 text \(byte 0\)"):
        load_config(binary)
    twice = tmp_path / "twice.yaml"  # PyYAML alone keeps the last one
    twice.write_text("seed: 1\noptimizer:\n  lr: 1.0e-5\n  lr: 1.0e-3\n")
    with pytest.raises(ConfigError, match=r"line 4, column 3: .*key 'lr' is given twice \(first on line 3\)"):
        load_config(twice)
    merged = tmp_path / "merged.yaml"  # a merge key's keys may be overridden: that is no repeat
    merged.write_text("optimizer:\n  <<: {lr: 1.0e-5, clip_grad: 0.5}\n  lr: 2.0e-5\n")
    assert (load_config(merged).optimizer.lr, load_config(merged).optimizer.clip_grad) == (2.0e-5, 0.5)
    # an anchored mapping with its own merge, aliased into another merge before its own turn: PyYAML merges it
    # in place first, which a check at construction took for a repeat (review)
    merged.write_text("x-a: {b: &M {<<: {lr: 1.0e-5}, lr: 2.0e-5}}\noptimizer: {<<: *M}\n")
    with pytest.raises(ConfigError, match=r"^unknown config key 'x-a' in the top level"):  # the schema
        load_config(merged)


def test_an_override_does_not_hide_the_files_bad_section(tmp_path):
    path = tmp_path / "scalar.yaml"
    path.write_text("model: 5\n")
    with pytest.raises(ConfigError, match=r"^model must be a mapping of keys; got int 5$"):
        load_config(path, ["model.precision=fp32"])  # before: the 5 was replaced by {precision: fp32}


def test_resolved_config_round_trips(tmp_path):
    cfg = load_config(None, ["algorithm.log_rho=-inf", "algorithm.stapo=true", "logging.prob_buckets=[0.3]"])
    path = save_resolved_config(cfg, tmp_path / "run")
    assert path == tmp_path / "run" / "config.yaml"
    saved = yaml.safe_load(path.read_text())
    # every leaf key is spelled out in the saved file
    flat = {k for k in all_keys() if _get(saved, k) is not _MISSING}
    assert flat == set(all_keys())
    assert load_config(path) == cfg
    assert config_to_dict(load_config(path)) == config_to_dict(cfg)


def test_top_k_leaves_the_mask_cap_headroom_for_ties():
    """SGLang's flashinfer keeps every tie at the top-k cutoff and rejects a support over the cap: top_k must
    be at most half of `rollout.sampling.mask_max_tokens`, one line naming both values and the fix; the
    PyTorch sampler (`rollout.deterministic`) keeps exactly top_k ids, so there top_k = the cap is fine."""
    pattern = (
        r"rollout\.sampling\.top_k must be ≤ 2048 with rollout\.sampling\.mask_max_tokens=4096 \(headroom "
        r"×2\): .* raise rollout\.sampling\.mask_max_tokens to 6000, lower top_k, or set "
        r"rollout\.deterministic \(no ties kept\); got 3000$"
    )
    with pytest.raises(ConfigError, match=pattern):
        load_config(None, ["rollout.sampling.top_k=3000"])
    assert load_config(None, ["rollout.sampling.top_k=2048"]).rollout.sampling.top_k == 2048
    assert load_config(None, ["rollout.sampling.top_k=3000", "rollout.sampling.mask_max_tokens=6000"])
    on_pytorch = ["rollout.deterministic=true", "algorithm.log_rho=null", "rollout.sampling.top_k=4096"]
    assert load_config(None, on_pytorch).rollout.sampling.top_k == 4096


def test_ignored_support_is_refused_with_dvp_and_warned_otherwise():
    """`algorithm.sampling_support: ignore` is the one-sided ablation: DVP prunes both sides with one rule,
    so the two are refused together, by name; alone, it is a valid config that warns."""
    pattern = (
        r"algorithm\.sampling_support cannot combine with DVP \(algorithm\.log_rho=-9\.0\).*set "
        r"algorithm\.log_rho=null, or sampling_support=replay; got 'ignore'$"
    )
    with pytest.raises(ConfigError, match=pattern):
        load_config(None, ["algorithm.sampling_support=ignore", "algorithm.log_rho=-9"])
    assert load_config(None, []).warnings() == []
    cfg = load_config(
        None, ["algorithm.sampling_support=ignore", "algorithm.log_rho=null", "rollout.sampling.top_k=20"]
    )
    (warning,) = cfg.warnings()
    assert (
        warning.startswith("algorithm.sampling_support=ignore: samples drawn with")
        and "no truncation" not in warning
    )
    untruncated = load_config(None, ["algorithm.sampling_support=ignore", "algorithm.log_rho=null"])
    assert untruncated.warnings()[0].endswith("(no truncation is on: it changes nothing here)")
    (unread,) = load_config(None, ["algorithm.loss_max_len=512"]).warnings()
    assert unread == (
        "algorithm.loss_max_len=512 is read only by loss_aggregation=seq_mean_token_sum; with token_mean it "
        "changes nothing"
    )
    assert (
        load_config(
            None, ["algorithm.loss_max_len=512", "algorithm.loss_aggregation=seq_mean_token_sum"]
        ).warnings()
        == []
    )


def test_cross_section_checks():
    with pytest.raises(ConfigError, match=r"vocab_pad_multiple.*divisible by parallel\.tensor_parallel=4"):
        load_config(None, ["parallel.tensor_parallel=4", "model.vocab_pad_multiple=6"])
    with pytest.raises(ConfigError, match=r"train\.mini_batches.*must divide data\.prompts_per_step=6"):
        load_config(None, ["data.prompts_per_step=6", "train.mini_batches=4"])
    with pytest.raises(ConfigError, match=r"rollout\.deterministic cannot combine with min-p"):
        load_config(None, ["rollout.deterministic=true", "rollout.sampling.top_k=20"])  # DVP is on by default
    assert load_config(
        None, ["rollout.deterministic=true", "rollout.sampling.top_k=20", "algorithm.log_rho=null"]
    )
    with pytest.raises(ValueError, match=r"model\.hf_path is required"):
        load_config(None).check_runnable()
    r3 = ["algorithm.routing_replay=r3", "rollout.partial_rollouts=true"]
    refused = (
        r"rollout\.pause_mode \(retract unless set\) cannot combine with algorithm\.routing_replay=r3.*"
        r"got 'retract'$"
    )
    with pytest.raises(ConfigError, match=refused):
        load_config(None, r3)  # retract is the default pause mode
    for mode in ("abort", "in_place"):
        assert load_config(None, [*r3, f"rollout.pause_mode={mode}"]).rollout.pause_mode == mode


def test_sections_are_their_owners_settings():
    """One class per setting: the config's sections are (or extend) the owners' dataclasses."""
    from megatron_tail.config.optimizer import OptimizerSettings
    from megatron_tail.data.prompts import PromptDataConfig, PromptFormat
    from megatron_tail.model.settings import ModelSettings

    cfg = load_config(
        None,
        ["optimizer.lr=0.25", "optimizer.clip_grad=0", "model.precision=fp32", "data.prompt_key=problem"],
    )
    assert type(cfg.optimizer) is OptimizerSettings
    assert cfg.optimizer.lr == 0.25 and cfg.optimizer.clip_grad == 0.0
    assert isinstance(cfg.model, ModelSettings) and cfg.model.precision == "fp32"
    assert isinstance(cfg.data, PromptFormat)
    prompts = PromptDataConfig.of("x.jsonl", cfg.data)
    assert prompts.path == "x.jsonl" and prompts.prompt_key == "problem"
    assert prompts.apply_chat_template == cfg.data.apply_chat_template


def test_loading_a_config_and_the_command_line_import_no_megatron():
    code = (
        "import sys; from megatron_tail.config import load_config; load_config(None, ['optimizer.lr=0.5']); "
        "import megatron_tail.train, megatron_tail.train.run.run_dir, megatron_tail.model; "
        "import megatron_tail.demo.run; "
        "from megatron_tail.cli import build_parser; build_parser(); "
        "bad = sorted(m for m in sys.modules if m == 'megatron' or m.startswith('megatron.')); "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_loading_a_config_and_planning_a_run_import_no_torch():
    """rl.sbatch reads the config (`mt_slurm.py config-get`) and plans the run on every job start, and
    `megatron-tail plan` runs on login nodes: neither pays torch's import (1.5 s of CPU here)."""
    code = (
        "import sys; from megatron_tail.config import load_config; "
        "cfg = load_config('examples/qwen3_8b_grpo_dvp.yaml', ['algorithm.log_rho=auto']); "
        "from megatron_tail.cli import main; "
        "rc = main(['plan', 'examples/qwen3_30b_a3b_grpo_dvp_r3.yaml', "
        "'--set', 'model.hf_path=tests/plan/configs/qwen3_30b_a3b']); "
        "assert rc == 0, rc; "
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'triton', 'megatron')); "
        "assert not bad, bad[:5]"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "fits" in proc.stdout


@pytest.mark.parametrize(
    ("override", "pattern"),
    [
        (
            "optimizer.optimizer=rmsprop",
            r"optimizer\.optimizer must be one of \('adam', 'sgd'\); got 'rmsprop'",
        ),
        (
            "algorithm.is_mode=bogus",
            r"algorithm\.is_mode must be one of \('none', 'tis', 'mis'\); got 'bogus'",
        ),
        ("optimizer.lr=0", r"lr must be finite and > 0; got 0"),
        (
            "algorithm.entropy_coef=-0.1",
            r"algorithm\.entropy_coef must be finite and in \[0\.0, inf\]; got -0\.1",
        ),
        (
            "optimizer.lr_decay_style=step",
            r"lr_decay_style must be one of \('constant', 'linear', 'cosine'\)",
        ),
        ("rollout.dtype=int8", r"rollout\.dtype must be one of \('bfloat16', 'float16', 'float32'\)"),
        ("rollout.weight_sync.bucket_mb=0", r"rollout\.weight_sync\.bucket_mb must be > 0; got 0"),
        (
            "rollout.quantization=int8",
            r"rollout\.quantization must be one of \('none', 'fp8', 'fp8_tensor', 'nvfp4_a16'\); "
            r"got 'int8'",
        ),
        (
            "rollout.weight_sync.mode=nccl",
            r"rollout\.weight_sync\.mode must be one of \('disk', 'distributed'\)",
        ),
        ("rollout.max_staleness=-1", r"rollout\.max_staleness must be an int ≥ 0 .*; got -1"),
        ("rollout.partial_rollouts=maybe", r"rollout\.partial_rollouts must be true or false; got 'maybe'"),
        ("rollout.local.in_process=maybe", r"rollout\.local\.in_process must be true or false; got 'maybe'"),
        ("data.max_sampling_rounds=0", r"data\.max_sampling_rounds must be an int ≥ 1; got 0"),
        ("data.max_sampling_rounds=65", r"data\.max_sampling_rounds must be ≤ 64; got 65"),
        ("algorithm.safe_set_on=probs", r"algorithm\.safe_set_on must be one of \('sampled', 'raw_logits'\)"),
    ],
)
def test_choices_and_what_the_loop_cannot_run_are_refused_at_load(override, pattern):
    with pytest.raises(ConfigError, match=pattern):
        load_config(None, [override])


_MISSING = object()


def _get(data, dotted):
    for part in dotted.split("."):
        if not isinstance(data, dict) or part not in data:
            return _MISSING
        data = data[part]
    return data


@pytest.mark.parametrize(
    ("overrides", "pattern"),
    [
        (
            [
                "train.max_tokens_per_micro_batch=1000",
                "data.max_prompt_tokens=900",
                "rollout.max_new_tokens=200",
            ],
            r"train\.max_tokens_per_micro_batch must hold the longest sample: data\.max_prompt_tokens=900 \+ "
            r"rollout\.max_new_tokens=200 = 1100; got 1000",
        ),
        (["train.packed=true"], r"train\.max_tokens_per_micro_batch.*required when train\.packed is true"),
        (
            ["train.max_tokens_per_micro_batch=512", "train.seq_len=64"],
            r"train\.seq_len.*padded micro-batches only",
        ),
        (
            [
                "train.max_tokens_per_micro_batch=511",
                "parallel.tensor_parallel=2",
                "model.sequence_parallel=true",
                "model.vocab_pad_multiple=128",
            ],
            r"max_tokens_per_micro_batch must be a multiple of parallel\.tensor_parallel=2.*got 511",
        ),
        (
            ["model.recompute=partial"],
            r"model\.recompute must be one of \('none', 'selective', 'full'\); got 'partial'",
        ),
        (["model.recompute_num_layers=2"], r"recompute_num_layers.*recompute 'full'.*got 2"),
        (  # before: accepted; the first step whose samples were longer failed after its rollout
            ["train.seq_len=64", "data.max_prompt_tokens=100", "rollout.max_new_tokens=100"],
            r"train\.seq_len must hold the longest sample: data\.max_prompt_tokens=100 \+ "
            r"rollout\.max_new_tokens=100 = 200; got 64",
        ),
        (["model.recompute_modules=[attn]"], r"recompute_modules must be a non-empty subset"),
        (
            ["rollout.local.in_process=true", "rollout.weight_sync.mode=distributed"],
            r"rollout\.local\.in_process needs rollout\.weight_sync\.mode: disk \(got .distributed.: .*\); "
            r"got True$",
        ),
    ],
)
def test_packing_and_recompute_settings_are_checked_at_load(overrides, pattern):
    with pytest.raises((ConfigError, ValueError), match=pattern):
        load_config(None, overrides)


@pytest.mark.parametrize(
    ("override", "limit"),
    [
        ("parallel.distributed_timeout_minutes=inf", "minutes in \\(0, 33333.3\\]"),
        ("parallel.rank0_wait_timeout_minutes=1e30", "minutes in \\(0, 33333.3\\]"),
        ("data.reward_timeout_s=inf", "seconds per completion in \\(0, 2e\\+06\\]"),
        ("rollout.env.timeout_s=1e7", "seconds per environment call in \\(0, 2e\\+06\\]"),
        ("rollout.weight_sync.timeout_s=inf", "seconds in \\(0, 2e\\+06\\]"),
        ("rollout.request_timeout_s=inf", "seconds in \\(0, 2e\\+06\\]"),
    ],
)
def test_a_time_limit_past_what_a_wait_can_hold_is_refused_at_load(override, limit):
    """Before: accepted; `timedelta(minutes=inf)` at the process group's start, or the reward worker's pipe
    `poll(inf)` at step 1, then failed with an OverflowError traceback (exit 1)."""
    key = override.split("=")[0].replace(".", "\\.")
    with pytest.raises(ConfigError, match=rf"{key} must be a finite number of {limit}"):
        load_config(None, [override])


@pytest.mark.parametrize("key", ["run_dir", "rollout.weight_sync.dir"])
def test_a_directory_the_run_creates_may_not_start_with_a_tilde(key):
    """Before: `run_dir: ~/runs/qwen` passed every check and the run wrote `./~/runs/qwen`."""
    with pytest.raises(
        ConfigError, match=rf"{re.escape(key)} '~/runs/x' starts with `~`, which is not expanded"
    ):
        load_config(None, [f"{key}=~/runs/x"])


def test_numbers_are_read_as_yaml_1_2_reads_them_and_printed_configs_load_back(tmp_path):
    """Before (PyYAML's YAML 1.1): `seed: 010` trained with seed 8 (octal), `train.steps=1:30` ran 90 steps
    (sexagesimal), both silently; an integer of 5,000 digits or one past a float's range was a traceback."""
    path = write_yaml(tmp_path, {})
    path_text = "seed: 010\ntrain:\n  steps: 0x10\n"
    (tmp_path / "numbers.yaml").write_text(path_text)
    cfg = load_config(str(tmp_path / "numbers.yaml"))
    assert (cfg.seed, cfg.train.steps) == (10, 16)
    assert load_config(path, ["seed=010", "optimizer.lr=1e-6"]).seed == 10
    with pytest.raises(ConfigError, match=r"train\.steps must be an integer; got '1:30'"):
        load_config(path, ["train.steps=1:30"])
    with pytest.raises(ConfigError, match=r"optimizer\.lr must be a number of at most ~1\.8e308"):
        load_config(path, ["optimizer.lr=1" + "0" * 400])
    with pytest.raises(ConfigError, match=r"Exceeds the limit \(4300 digits\)"):
        load_config(path, ["train.steps=" + "9" * 5000])
    # a text setting that reads as a number in YAML 1.1 or 1.2 is printed quoted: it loads back as text
    from megatron_tail.config import config_yaml
    from megatron_tail.config.loader import config_from_yaml

    for text in ("1e-6", "010", "1:30", "yes", "1_000"):
        cfg = load_config(path, [f"data.system_prompt={text}"])
        assert config_from_yaml(config_yaml(cfg)) == cfg, text


def test_a_padded_layout_whose_mini_batches_do_not_split_over_dp_is_refused_before_any_process_group():
    """Before: accepted, and step 1 failed after its rollout ("global batch of 9 samples is not divisible by
    data_parallel=2"). A packed layout balances any count."""
    nine = ["data.prompts_per_step=3", "algorithm.group_size=3"]
    with pytest.raises(UserError, match=r"over the 2 data-parallel ranks .* = 9 samples do not divide by it"):
        load_config(None, nine).check_world(2)
    load_config(None, nine).check_world(1)
    load_config(None, [*nine, "train.max_tokens_per_micro_batch=4096"]).check_world(2)
    with pytest.raises(UserError, match=r"does not divide the world size 3"):  # the layout's own check
        load_config(None, ["parallel.tensor_parallel=2", "model.vocab_pad_multiple=128"]).check_world(3)


def test_a_list_setting_takes_one_number_as_it_takes_one_word():
    """Before: `--set logging.prob_buckets=0.5` was refused ("must be a list; got float 0.5") while
    `--set model.recompute_modules=mlp` became ["mlp"]."""
    assert load_config(None, ["logging.prob_buckets=0.5"]).logging.prob_buckets == (0.5,)
    assert load_config(None, ["model.recompute_modules=mlp"]).model.recompute_modules == ("mlp",)


def test_packed_false_overrides_a_token_budget():
    cfg = load_config(None, ["train.max_tokens_per_micro_batch=512"])
    assert cfg.train.is_packed
    cfg = load_config(None, ["train.max_tokens_per_micro_batch=512", "train.packed=false"])
    assert not cfg.train.is_packed and cfg.train.micro_batch_size == 8
    assert not load_config(None).train.is_packed  # no budget: padded, as before


@pytest.mark.parametrize(
    ("overrides", "pattern"),
    [
        (["cluster.rollout_backend=k8s"], r"cluster\.rollout_backend must be one of \('sglang', 'local'\)"),
        (["cluster.nodes=2", "cluster.rollout_nodes=2"], r"cluster\.rollout_nodes must leave a trainer node"),
        (
            ["cluster.sglang.tp=3", "cluster.gpus_per_node=8"],
            r"cluster\.gpus_per_node must be a multiple of ",
        ),
        (
            ["cluster.sglang.tp=2", "cluster.sglang.ep=4"],
            r"cluster\.sglang\.ep must divide cluster\.sglang\.tp=2",
        ),
        (["cluster.sglang.mem_fraction=1.2"], r"cluster\.sglang\.mem_fraction must be in \(0, 1\)"),
        (
            ["cluster.sglang.router_policy=cache-aware"],
            r"cluster\.sglang\.router_policy must be one of \('cache_aware', .* \(the --policy of "
            r"sglang-router 0\.3\.2\); got 'cache-aware'",
        ),
        (["cluster.servers_per_node=9"], r"cluster\.servers_per_node must be ≤ 8 \(ports\); got 9"),
        (["cluster.health_timeout_s=0"], r"cluster\.health_timeout_s must be a finite number > 0; got 0"),
        (
            ["cluster.sglang.extra_args=[--ep-size, '2']"],
            r"cluster\.sglang\.extra_args must not set --ep-size: cluster\.sglang\.ep sets it",
        ),
        (["cluster.sglang.extra_args=[--dtype=half]"], r"must not set --dtype: rollout\.dtype sets it"),
        (
            ["cluster.sglang.extra_args=[--mem-fraction, '0.5']"],
            r"must not set --mem-fraction: cluster\.sglang",
        ),
        (
            ["cluster.sglang.extra_args=[--tensor-parallel-size, '2']"],
            r"--tensor-parallel-size: cluster\.sglang\.tp",
        ),
        (
            ["cluster.sglang.extra_args=[--speculative-algorithm, EAGLE]"],
            r"must not set --speculative-algorithm: speculative decoding's verify step .* without the custom "
            r"logit processor",
        ),
        (
            ["cluster.sglang.extra_args=[--speculative-num-steps=3]"],
            r"must not set --speculative-num-steps: speculative decoding",
        ),
        (
            ["cluster.sglang.extra_args=[--rl-on-policy-target, fsdp]"],
            r"must not set --rl-on-policy-target: .*rollout\.deterministic is the setting",
        ),
        (
            ["cluster.sglang.extra_args=[--preferred-sampling-params, '{\"top_k\": 20}']"],
            r"must not set --preferred-sampling-params: .*the run's sampling is rollout\.sampling",
        ),
        (
            ["cluster.sglang.extra_args=[--enable-watermark]"],
            r"must not set --enable-watermark: a watermark changes the logits the engine samples from after",
        ),
        (
            ["cluster.sglang.extra_args=[--watermark-config, w.json]"],
            r"must not set --watermark-config: the watermark's settings",
        ),
        (
            ["cluster.sglang.extra_args=--chunked-prefill-size 8192"],
            r"one argv item per list item, e\.g\. \[",
        ),
        (
            ["cluster.gpus_per_node=8", "cluster.servers_per_node=8", "cluster.sglang.tp=2"],
            r"must fit cluster\.gpus",
        ),
        (
            ["cluster.gpus_per_node=8", "cluster.trainer_procs_per_node=9"],
            r"must be ≤ cluster\.gpus_per_node=8",
        ),
        (["cluster.health_timeout_s=inf"], r"cluster\.health_timeout_s must be a finite number > 0; got inf"),
        (
            ["cluster.sglang.tp_size=2"],
            r"unknown config key 'cluster\.sglang\.tp_size' in cluster\.sglang; valid keys here: tp, ep",
        ),
    ],
)
def test_the_cluster_layout_is_checked_at_load(overrides, pattern):
    with pytest.raises(ConfigError, match=pattern):
        load_config(None, overrides)


def test_an_sglang_variable_that_changes_the_returned_logprobs_is_refused_in_one_line(
    tmp_path, capsys, monkeypatch
):
    """`SGLANG_RETURN_ORIGINAL_LOGPROB`, which the pinned SGLang still reads, makes the servers return
    log-probs before the temperature: refused where SGLang reads it as true, by rl.sbatch's first read of
    the config (`mt_slurm.py config-get`) for SGLang servers, not for local engines."""
    import importlib.util

    from megatron_tail.config.cluster import REFUSED_SGLANG_ENVIRONMENT, refuse_sglang_environment

    sglang = Path(importlib.util.find_spec("sglang").origin).parent
    sampler = (sglang / "srt" / "layers" / "sampler.py").read_text()
    for name in REFUSED_SGLANG_ENVIRONMENT:
        assert f'get_bool_env_var("{name}")' in sampler, name
    for value in ("", "0", "false", "No"):
        refuse_sglang_environment({"SGLANG_RETURN_ORIGINAL_LOGPROB": value})
    for value in ("1", "true", "Yes", "y"):
        with pytest.raises(UserError, match=rf"^SGLANG_RETURN_ORIGINAL_LOGPROB={value} is set for the SGLang "
                           r"servers: .* before the temperature .*; unset it$"):  # fmt: skip
            refuse_sglang_environment({"SGLANG_RETURN_ORIGINAL_LOGPROB": value})
    spec = importlib.util.spec_from_file_location(
        "mt_slurm", Path(__file__).parents[2] / "slurm" / "mt_slurm.py"
    )
    mt_slurm = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mt_slurm)
    config = tmp_path / "c.yaml"
    config.write_text("run_dir: runs/x\n")
    monkeypatch.setenv("SGLANG_RETURN_ORIGINAL_LOGPROB", "1")
    assert mt_slurm.main(["config-get", str(config), "run_dir"]) == 2
    err = capsys.readouterr().err
    assert (
        err.startswith("mt_slurm.py config-get: SGLANG_RETURN_ORIGINAL_LOGPROB=1 is set")
        and err.count("\n") == 1
    )
    local = ["config-get", str(config), "run_dir", "--set", "cluster.rollout_backend=local"]
    assert mt_slurm.main(local) == 0 and capsys.readouterr().out.strip().endswith("runs/x")


def test_the_layout_variables_of_earlier_versions_are_refused_by_name():
    from megatron_tail.config.cluster import MOVED_ENVIRONMENT, refuse_moved_environment

    refuse_moved_environment({"MT_PYTHON": "/x/python", "MT_SGLANG_TP": ""})  # the machine's; unset
    for name, key in MOVED_ENVIRONMENT.items():
        assert key.split(" ")[0] in all_keys() or key.split(" ")[0] == "run_dir", key
        with pytest.raises(UserError, match=rf"^{name}=7 is no longer read: .* set {re.escape(key)} there"):
            refuse_moved_environment({name: "7"})
