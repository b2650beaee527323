"""A resume never changes a run silently (issue 50, item 3): every checkpoint stores its resolved config; a
resume that changes what is trained is refused at load naming each key with both values, unless
`train.allow_config_change`; steps, cadence, logging, timeouts and the layout may change with one log line;
every start's config is kept in `<run_dir>/configs/`.

Before: rerunning a run with `--set algorithm.group_size=8` resumed with exit 0 and no word, and
`<run_dir>/config.yaml` said 8 with nothing left to record that the earlier steps used 4."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from megatron_tail.config import ConfigError, all_keys, load_config
from megatron_tail.train.run import data_digests
from megatron_tail.train.run import run_dir as layout
from megatron_tail.train.run.config_change import (
    CHANGEABLE_KEYS,
    RESHARDABLE_KEYS,
    ConfigChangeRefused,
    config_changes,
    config_text,
    read_checkpoint_config,
    resume_notes,
)
from megatron_tail.utils.errors import EXIT_USER_ERROR, UserError
from tests.loop.conftest import loop_overrides

CKPT = Path("runs/r/checkpoints/step_000010")
HOW = "or accept the change with train.allow_config_change: true (--set train.allow_config_change=true)"


def _saved(*overrides: str) -> dict:
    """A checkpoint's stored config, as `read_checkpoint_config` returns it."""
    return yaml.safe_load(config_text(load_config(None, ["run_dir=runs/r", *overrides])))


def _now(*overrides: str):
    return load_config(None, ["run_dir=runs/r", *overrides])


def test_an_older_runs_min_lr_under_a_constant_rate_resumes_at_0():
    """`optimizer.min_lr` with `lr_decay_style: constant` did nothing and is refused at load since; a run that
    set it resumes with min_lr 0 and no refusal (the rate was constant either way)."""
    saved = _saved()
    saved["optimizer"]["min_lr"] = 1e-7  # as the run's config.yaml held it
    assert resume_notes(saved, _now(), CKPT) == []
    saved["optimizer"]["lr_decay_style"] = "cosine"  # a decaying schedule did reach it: a change
    with pytest.raises(ConfigChangeRefused, match=r"optimizer\.min_lr 1e-07 → 0\.0"):
        resume_notes(saved, _now("optimizer.lr_decay_style=cosine"), CKPT)


def test_a_change_of_what_is_trained_is_refused_naming_each_key_with_both_values():
    with pytest.raises(ConfigChangeRefused) as err:
        resume_notes(_saved("algorithm.group_size=4"), _now("algorithm.group_size=8", "seed=3"), CKPT)
    assert str(err.value) == (
        "cannot resume runs/r from checkpoint step_000010: the config changes what is trained (checkpoint → "
        f"now): seed 1234 → 3; algorithm.group_size 4 → 8. Restore the checkpoint's values, {HOW}"
    )


def test_steps_logging_timeouts_addresses_and_the_layout_may_change_with_one_line():
    now = _now(
        "train.steps=200",
        "logging.progress=never",
        "rollout.request_timeout_s=30",
        "model.recompute=full",
        "parallel.tensor_parallel=2",
        "train.allow_config_change=false",
    )
    assert resume_notes(_saved(), now, CKPT) == [
        'resuming from step_000010 with config changes that keep what is trained: model.recompute "none" → '
        '"full"; parallel.tensor_parallel 1 → 2 (resharded); rollout.request_timeout_s 600.0 → 30.0; '
        'train.steps 100 → 200; logging.progress "auto" → "never"'
    ]
    assert resume_notes(_saved(), _now(), CKPT) == []


def test_allow_config_change_accepts_and_logs_each_key():
    now = _now("algorithm.group_size=2", "train.steps=5", "train.allow_config_change=true")
    assert resume_notes(_saved(), now, CKPT) == [
        "resuming from step_000010 with config changes that keep what is trained: train.steps 100 → 5",
        "train.allow_config_change: resuming from step_000010 with changes to what is trained (checkpoint → "
        "now): algorithm.group_size 8 → 2; the earlier starts' configs are in runs/r/configs",
    ]


def test_more_steps_that_would_stretch_the_lr_schedule_are_refused_until_it_is_pinned():
    """`optimizer.lr_decay_steps: null` spans `train.steps`: a longer run would decay more slowly."""
    cosine = "optimizer.lr_decay_style=cosine"
    with pytest.raises(ConfigChangeRefused, match=r"optimizer.lr_decay_steps 100 → 300 \(the LR schedule"):
        resume_notes(_saved(cosine), _now(cosine, "train.steps=300"), CKPT)
    pinned = _now(cosine, "train.steps=300", "optimizer.lr_decay_steps=100")
    assert resume_notes(_saved(cosine), pinned, CKPT) == [
        "resuming from step_000010 with config changes that keep what is trained: train.steps 100 → 300"
    ]
    assert resume_notes(_saved(), _now("train.steps=300"), CKPT)  # a constant rate: steps alone


def test_a_checkpoint_without_a_config_resumes_with_a_warning():
    assert resume_notes(None, _now("algorithm.group_size=2"), CKPT) == [
        f"warning: checkpoint {CKPT} holds no config (saved before checkpoints stored theirs): the config "
        "could not be compared with the one it was trained with"
    ]


def test_a_key_an_older_config_lacks_compares_with_its_default_and_a_removed_key_is_ignored():
    saved = _saved()
    del saved["algorithm"]["lopti"]
    saved["algorithm"]["retired_knob"] = 1
    assert config_changes(saved, _now()) == []
    assert [c.key for c in config_changes(saved, _now("algorithm.lopti=true"))] == ["algorithm.lopti"]


@pytest.mark.parametrize(
    ("saved", "refused"),
    [
        (["algorithm.stapo=true"], True),  # DVP at its default log ρ: the older run compared H^mp
        (["algorithm.stapo=true", "algorithm.log_rho=null", "rollout.sampling.top_k=20"], True),
        (["algorithm.stapo=true", "algorithm.log_rho=null"], False),  # nothing pruned: the same entropy
        (["algorithm.stapo=false"], False),  # STAPO off: the key changes nothing
        (["algorithm.stapo=true", "algorithm.log_rho=-.inf"], False),  # −inf: no pruning either
    ],
)
def test_a_stapo_run_from_before_stapo_entropy_resumes_only_as_it_trained(saved, refused):
    """A checkpoint's config from before `algorithm.stapo_entropy` (default full_bound) ran STAPO on the
    op's pruned entropy: where that differs (DVP or truncated sampling on), a resume with the new default
    would change what is trained, so it is refused unless the config says `pruned`."""
    old = _saved(*saved)
    del old["algorithm"]["stapo_entropy"]
    changes = [c for c in config_changes(old, _now(*saved)) if c.key == "algorithm.stapo_entropy"]
    assert [(c.old, c.new, c.kind) for c in changes] == (
        [("pruned", "full_bound", "trained")] if refused else []
    )
    if refused:  # the config that says how the older run trained resumes it
        assert config_changes(old, _now(*saved, "algorithm.stapo_entropy=pruned")) == []


@pytest.mark.parametrize(("bf16", "precision"), [(False, "fp32"), (True, "bf16")])
def test_a_checkpoint_of_the_earlier_bf16_key_compares_as_the_precision_it_trained_in(bf16, precision):
    """`model.bf16` moved to `model.precision` (`config.loader.MOVED_KEYS`). A checkpoint that set it and left
    precision null trained in `precision`; resuming with null (bf16 on a GPU, fp32 elsewhere) is a change
    of what is trained, named, not a removed key ignored."""
    from megatron_tail.config.loader import MOVED_KEYS
    from megatron_tail.rollout.settings import MOVED_KEYS as ROLLOUT_MOVED_KEYS

    # another moved key: `config_change._renamed` must read it too
    assert set(MOVED_KEYS) == {"model.bf16", *ROLLOUT_MOVED_KEYS}
    saved = _saved()
    saved["model"]["bf16"] = bf16
    refused = rf"now\): model.precision \"{precision}\" → null\. Restore"
    with pytest.raises(ConfigChangeRefused, match=refused):
        resume_notes(saved, _now(), CKPT)
    assert resume_notes(saved, _now(f"model.precision={precision}"), CKPT) == []
    saved["model"]["precision"] = "fp16"  # an explicit precision was what trained
    assert config_changes(saved, _now("model.precision=fp16")) == []


def _flat_rollout(saved: dict) -> dict:
    """`saved` with its rollout section as the flat section before its parts had their own: every key of
    `rollout.settings.MOVED_KEYS` at its old name."""
    from megatron_tail.rollout.settings import MOVED_KEYS as ROLLOUT_MOVED_KEYS

    rollout = dict(saved["rollout"])
    parts = {name: rollout.pop(name) for name in ("local", "weight_sync", "env", "sampling")}
    for old, new in ROLLOUT_MOVED_KEYS.items():
        _, part, leaf = new.split(".")
        rollout[old.split(".", 1)[1]] = parts[part].pop(leaf)
    assert not any(parts.values()), parts  # every key of the parts has an old name
    return {**saved, "rollout": rollout}


def test_a_checkpoint_of_the_flat_rollout_section_compares_under_the_new_names():
    """A checkpoint written before the rollout section was nested (`rollout.top_k`, `rollout.weight_sync:
    disk`) resumes as the same run, and a change is named under the key a user sets now."""
    saved = _flat_rollout(_saved("rollout.sampling.top_k=8", "rollout.env.name=calculator"))
    assert saved["rollout"]["top_k"] == 8 and saved["rollout"]["weight_sync"] == "disk"
    now = _now("rollout.sampling.top_k=8", "rollout.env.name=calculator")
    assert config_changes(saved, now) == []
    changes = config_changes(saved, _now("rollout.sampling.top_k=16", "rollout.env.name=calculator"))
    assert [(c.key, c.old, c.new) for c in changes] == [("rollout.sampling.top_k", 8, 16)]
    assert resume_notes(saved, _now("rollout.sampling.top_k=8", "rollout.env.name=calculator",
                                    "rollout.env.workers=2"), CKPT)  # fmt: skip


def test_the_documented_lists_name_real_keys_and_the_model_algorithm_and_data_are_not_on_them():
    keys = set(all_keys())
    assert CHANGEABLE_KEYS <= keys and RESHARDABLE_KEYS <= keys
    assert not CHANGEABLE_KEYS & RESHARDABLE_KEYS
    free = CHANGEABLE_KEYS | RESHARDABLE_KEYS
    assert not {k for k in free if k.startswith(("algorithm.", "optimizer."))}
    for key in ("model.hf_path", "model.use_te", "model.vocab_pad_multiple", "data.train_path", "seed"):
        assert key not in free


def _with_file(tmp_path, name: str, text: str) -> str:
    (path := tmp_path / name).write_text(text)
    return str(path)


def test_a_training_file_changed_under_its_path_is_refused_and_a_moved_one_accepted(tmp_path):
    """Before: the config names the file, not its rows, so a file regenerated in place resumed silently on
    other prompts (the stream is read at the checkpoint's cursor)."""
    train = _with_file(tmp_path, "train.jsonl", '{"prompt": "1+1=", "answer": "2"}\n')
    saved = _saved(f"data.train_path={train}")
    digests = data_digests.current(_now(f"data.train_path={train}"))
    assert resume_notes(saved, _now(f"data.train_path={train}"), CKPT, digests) == []
    Path(train).write_text('{"prompt": "2+2=", "answer": "4"}\n')
    with pytest.raises(
        ConfigChangeRefused, match=r"data\.train_path \(the file's content\) \"[0-9a-f]{12}\" → "
    ):
        resume_notes(saved, _now(f"data.train_path={train}"), CKPT, digests)
    allowed = resume_notes(
        saved, _now(f"data.train_path={train}", "train.allow_config_change=true"), CKPT, digests
    )
    assert "data.train_path (the file's content)" in allowed[0] and "SHA-256 prefixes" in allowed[0]
    # moved, the same bytes: where things are, not what is trained (before: refused as a changed path)
    moved = _with_file(tmp_path, "elsewhere.jsonl", '{"prompt": "1+1=", "answer": "2"}\n')
    (note,) = resume_notes(saved, _now(f"data.train_path={moved}"), CKPT, digests)
    assert note == (
        f'resuming from step_000010 with config changes that keep what is trained: data.train_path "{train}" '
        f'→ "{moved}" (same content)'
    )


def test_a_model_directory_whose_tokenizer_changed_under_its_path_is_refused_and_a_moved_one_too(tmp_path):
    """Before: only `model.hf_path`'s string was compared, so a directory re-downloaded or replaced in place
    with another chat template (which every start tokenizes the prompts with) resumed silently. The
    weights are not hashed, so a moved directory is not taken as the same model either."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "qwen3"}')
    (model / "tokenizer_config.json").write_text('{"chat_template": "A"}')
    (model / "model.safetensors").write_bytes(b"weights")
    sets = (f"model.hf_path={model}",)
    saved, digests = _saved(*sets), data_digests.current(_now(*sets))
    assert resume_notes(saved, _now(*sets), CKPT, digests) == []
    (model / "model.safetensors").write_bytes(b"other weights")  # not hashed: every start would read them
    assert resume_notes(saved, _now(*sets), CKPT, digests) == []
    (model / "tokenizer_config.json").write_text('{"chat_template": "B"}')
    with pytest.raises(
        ConfigChangeRefused,
        match=r"model\.hf_path \(its config, tokenizer and chat template files\) \"[0-9a-f]{12}\" → ",
    ):
        resume_notes(saved, _now(*sets), CKPT, digests)
    (model / "tokenizer_config.json").write_text('{"chat_template": "A"}')
    moved = tmp_path / "moved"  # the same files elsewhere: still refused, as a changed path always was
    moved.mkdir()
    for f in model.iterdir():
        (moved / f.name).write_bytes(f.read_bytes())
    assert data_digests.current(_now(f"model.hf_path={moved}"))["model.hf_path"] == digests["model.hf_path"]
    with pytest.raises(ConfigChangeRefused, match=r"model\.hf_path \".*model\" → \".*moved\""):
        resume_notes(saved, _now(f"model.hf_path={moved}"), CKPT, digests)


def test_an_evaluation_file_changed_under_its_path_is_logged_and_old_checkpoints_compare_nothing(tmp_path):
    train = _with_file(tmp_path, "train.jsonl", '{"prompt": "1+1=", "answer": "2"}\n')
    held = _with_file(tmp_path, "eval.jsonl", '{"prompt": "3+4=", "answer": "7"}\n')
    sets = (f"data.train_path={train}", f"data.eval_path={held}")
    digests = data_digests.current(_now(*sets))
    Path(held).write_text('{"prompt": "5+4=", "answer": "9"}\n')
    (note,) = resume_notes(_saved(*sets), _now(*sets), CKPT, digests)
    assert "keep what is trained: data.eval_path (the file's content) \"" in note
    assert resume_notes(_saved(*sets), _now(*sets), CKPT, None) == []  # a checkpoint from before: as before


def test_allow_config_change_is_validated():
    with pytest.raises(ConfigError, match=r"train.allow_config_change must be true or false; got 'maybe'"):
        load_config(None, ["train.allow_config_change=maybe"])


def test_a_checkpoint_config_that_does_not_read_is_one_line_naming_the_file(tmp_path):
    (tmp_path / "config.yaml").write_text("train: [1,\n")
    with pytest.raises(UserError, match=rf"^checkpoint file {tmp_path}/config.yaml is unreadable \(") as err:
        read_checkpoint_config(tmp_path)
    assert "\n" not in str(err.value)
    assert read_checkpoint_config(tmp_path / "none") is None


def test_each_start_writes_its_own_config_file(tmp_path):
    first = layout.save_start_config(tmp_path, "a: 1\n", 0)
    second = layout.save_start_config(tmp_path, "a: 2\n", 10)
    assert [first.name, second.name] == ["start_0001_step_000000.yaml", "start_0002_step_000010.yaml"]
    assert first.read_text() == "a: 1\n" and second.read_text() == "a: 2\n"


# --- end to end: the real `train` command --------------------------------------------------------------

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONWARNINGS": "ignore"}


def _train(model_dir, prompt_file, engine, run_dir, config, extra: dict) -> subprocess.CompletedProcess:
    """`megatron-tail train` as a world of one (TP = 1) on the module's engine."""
    settings = {"parallel.tensor_parallel": 1, "rollout.engine": "remote"}
    settings["rollout.server_urls"] = f"[{engine.url}]"
    settings.update(extra)
    cmd = [sys.executable, "-m", "megatron_tail.cli", "train", str(config)]
    for item in loop_overrides(model_dir, prompt_file, run_dir, settings):
        cmd += ["--set", item]
    return subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=600)


def _group_size(path: Path) -> int:
    return yaml.safe_load(path.read_text())["algorithm"]["group_size"]


def test_train_refuses_a_changed_group_size_and_resumes_allowed_changes(
    tiny_model_dir, prompt_file, engine, tmp_path
):
    run_dir, config = tmp_path / "run", tmp_path / "run.yaml"
    config.write_text("seed: 7\n")

    def train(**extra):
        return _train(tiny_model_dir, prompt_file, engine, run_dir, config, extra)

    def starts() -> list[str]:
        return sorted(p.name for p in layout.configs_dir(run_dir).iterdir())

    first = train(**{"train.steps": 1})
    assert first.returncode == 0, first.stderr[-3000:]
    ckpt = layout.checkpoint_path(run_dir, 1)
    assert _group_size(ckpt / "config.yaml") == 4
    digests = json.loads((ckpt / data_digests.DIGESTS_NAME).read_text())
    assert digests["data.train_path"] == hashlib.sha256(Path(prompt_file).read_bytes()).hexdigest()
    assert starts() == ["start_0001_step_000000.yaml"]

    refused = train(**{"train.steps": 1, "algorithm.group_size": 2})
    assert refused.returncode == EXIT_USER_ERROR
    assert "Traceback" not in refused.stderr
    assert [line for line in refused.stderr.splitlines() if "error" in line] == [
        f"megatron-tail train: error: cannot resume {run_dir} from checkpoint step_000001: the config "
        "changes what is trained (checkpoint → now): algorithm.group_size 4 → 2. Restore the checkpoint's "
        f"value, {HOW}"
    ]
    assert _group_size(run_dir / "config.yaml") == 4  # the run's record is untouched
    assert starts() == ["start_0001_step_000000.yaml"]

    longer = train(**{"train.steps": 2})
    assert longer.returncode == 0, longer.stderr[-3000:]
    assert (
        "resuming from step_000001 with config changes that keep what is trained: train.steps 1 → 2"
        in longer.stdout.splitlines()
    )
    assert f"resumed from {ckpt} (step 1)" in longer.stdout
    assert starts() == ["start_0001_step_000000.yaml", "start_0002_step_000001.yaml"]

    allowed = train(**{"train.steps": 3, "algorithm.group_size": 2, "train.allow_config_change": "true"})
    assert allowed.returncode == 0, allowed.stderr[-3000:]
    assert (
        "train.allow_config_change: resuming from step_000002 with changes to what is trained (checkpoint → "
        f"now): algorithm.group_size 4 → 2; the earlier starts' configs are in {run_dir / 'configs'}"
        in allowed.stdout.splitlines()
    )
    assert f"resumed from {layout.checkpoint_path(run_dir, 2)} (step 2)" in allowed.stdout
    assert _group_size(layout.checkpoint_path(run_dir, 3) / "config.yaml") == 2
    assert _group_size(run_dir / "config.yaml") == 2
    history = [_group_size(layout.configs_dir(run_dir) / name) for name in starts()]
    assert starts()[-1] == "start_0003_step_000002.yaml" and history == [4, 4, 2]
