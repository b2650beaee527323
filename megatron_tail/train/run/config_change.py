"""A resume never changes a run silently: every checkpoint holds the resolved config it was trained with
(`<checkpoint>/config.yaml`), and a resume compares the new config with it before the trainer is built.

    notes = resume_notes(read_checkpoint_config(checkpoint), cfg, checkpoint)  # or ConfigChangeRefused

(`loop.check_resume_config` does this on global rank 0, with the run directory locked.)

Each changed key is one of three kinds:
- `CHANGEABLE_KEYS`: how long the run goes, its checkpoint and eval cadence, what it logs, how long it
  waits, where things are, and how the same computation is laid out in memory. Accepted, one log line.
- `RESHARDABLE_KEYS`: the trainer's parallel layout, which the checkpoint loads into at any size.
  Accepted, in the same log line.
- every other key: it changes what is trained (the model, the algorithm, the optimizer, the data, the
  rollout's sampling). Refused (`ConfigChangeRefused`, one line naming each key with both values) unless
  `train.allow_config_change` is true; then accepted, and each key is logged with both values.

A key the checkpoint's config lacks (saved by an older megatron_tail) compares with its default, the value
an older run used, or where a key came with a new behaviour as its default, with the older behaviour's value
(`_older_behaviour`); a key only the checkpoint's config has (since removed) is ignored, unless it moved
(`config.loader.MOVED_KEYS`): then its value compares under its new name (`_renamed`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml

from megatron_tail.config import RunConfig, config_yaml
from megatron_tail.rollout.settings import with_moved_keys_renamed
from megatron_tail.utils.errors import UserError

from . import data_digests, run_dir

CHANGEABLE_KEYS: frozenset[str] = frozenset(
    {
        # how long the run goes and how often it checkpoints and evaluates (`train.steps` extended after a
        # run ended at η ≥ 1 is not the longer run: no group was generated past the last step, so the first
        # added step trains one version fresher; docs/rollouts.md, "Exactly once")
        "train.steps",
        "train.checkpoint_every",
        "train.keep_checkpoints",
        "train.max_nonfinite_updates_in_a_row",
        "train.resume",
        "train.allow_config_change",
        "train.eval_every",
        "train.eval_samples_per_prompt",
        # evaluation and what counts as correct in the accuracy metrics (never in the loss)
        "data.eval_path",
        "data.eval_prompts",
        "data.eval_prompt_key",
        "data.eval_answer_key",
        "data.eval_prompt_template",
        "data.correct_reward",
        # logging and diagnostics (`data.reward_max_abs` only bounds the logged DVP bias)
        "logging.tensorboard",
        "logging.progress",
        "logging.prob_buckets",
        "logging.tail_prob",
        "data.reward_max_abs",
        # timeouts and wait reports
        "parallel.distributed_timeout_minutes",
        "parallel.rank0_wait_timeout_minutes",
        "data.reward_timeout_s",
        "rollout.request_timeout_s",
        "rollout.wait_report_s",
        "rollout.startup_timeout_s",
        "rollout.weight_sync.timeout_s",
        "rollout.env.timeout_s",
        # where things are: a moved run directory, this job's engines, ports and export directory
        "run_dir",
        "rollout.server_urls",
        "rollout.local.port",
        "rollout.weight_sync.master_address",
        "rollout.weight_sync.master_port",
        "rollout.weight_sync.dir",
        # throughput and memory of the same computation: the loss is normalised by the global token count,
        # so micro-batching does not change an update; recompute is exact; the op backends and the fused
        # output layer compute the same log-probs; weight sync moves the same weights either way
        "rollout.max_concurrency",
        "rollout.prefix_affinity_slack",
        "rollout.local.num_threads",
        "rollout.local.in_process",  # the same engine, in the trainer's process or its own
        "rollout.env.workers",
        "rollout.weight_sync.mode",
        "rollout.weight_sync.bucket_mb",
        "train.max_tokens_per_micro_batch",
        "train.packed",
        "train.micro_batch_size",
        "train.seq_len",
        "model.recompute",
        "model.recompute_num_layers",
        "model.recompute_modules",
        "model.reference_offload",
        "model.use_cpu_initialization",
        "model.op_backend",
        "model.fused_output_layer",
        "model.gradient_accumulation_fusion",  # the same sum of gradients, in fp32 from the first term
        # the job's Slurm layout (`config.cluster`): where the rollout servers and the trainer run, and the
        # plan's assumptions; a requeued job may get other nodes (the trainer's own layout is `parallel.*`)
        "cluster.nodes",
        "cluster.gpus_per_node",
        "cluster.gpu_memory_gib",
        "cluster.host_memory_gib",
        "cluster.rollout_nodes",
        "cluster.rollout_backend",
        "cluster.servers_per_node",
        "cluster.trainer_procs_per_node",
        "cluster.health_timeout_s",
        "cluster.sglang.tp",
        "cluster.sglang.ep",
        "cluster.sglang.mem_fraction",
        "cluster.sglang.extra_args",
        "cluster.sglang.router",
        "cluster.sglang.router_policy",
    }
)
"""Keys a resume may change without `train.allow_config_change`: none of them changes what is trained.
`train.steps` is one, but where the learning-rate or weight-decay schedule spans it (a decay style other
than constant and `optimizer.lr_decay_steps: null`), a new `train.steps` stretches the schedule: that shows
as a change of `optimizer.lr_decay_steps`, refused like any optimizer setting; set it to the old
`train.steps` to keep the schedule."""

RESHARDABLE_KEYS: frozenset[str] = frozenset(
    {
        "parallel.tensor_parallel",
        "parallel.pipeline_parallel",
        "parallel.context_parallel",
        "parallel.expert_parallel",
        "parallel.expert_tensor_parallel",
        "model.sequence_parallel",
    }
)
"""The parallel layout, which a resume may change: a checkpoint holds the model and the optimizer state in
model space (`engine/checkpoint.py`, megatron's "fully_reshardable" format), so it loads at another TP, PP,
DP or EP (`tests/train/test_checkpoint.py`, `test_moe_checkpoint_reshard.py`; expert-TP shards experts the
way TP shards dense layers); CP and sequence parallelism split no parameter. Only the RNG states are not
restored across layouts (dropout is 0). What a checkpoint cannot load into stays refused as a change of
what is trained: another padded vocabulary (`model.vocab_pad_multiple`), the Transformer Engine spec's
parameter names (`model.use_te`), the optimizer state's kind (`optimizer.use_distributed_optimizer`)."""

Kind = Literal["changeable", "resharded", "trained"]

_SCHEDULE_STEPS = "optimizer.lr_decay_steps"
_THIS_START = ("train.resume", "train.allow_config_change")


class ConfigChangeRefused(UserError):
    """A resume whose config changes what the checkpoint was trained with; the message names each key."""


@dataclass(frozen=True)
class ConfigChange:
    """One key whose value differs between a checkpoint's config (`old`) and the run's (`new`), both as
    plain YAML values (numbers, strings, bools, None, lists)."""

    key: str
    old: Any
    new: Any
    kind: Kind
    why: str = ""
    """Said after the values, in parentheses (e.g. "same content": a data file moved)."""

    def __str__(self) -> str:
        text = f"{self.key} {_show(self.old)} → {_show(self.new)}"
        if self.key == _SCHEDULE_STEPS:
            text += " (the LR schedule's length; null follows train.steps)"
        if self.why:
            text += f" ({self.why})"
        return text + (" (resharded)" if self.kind == "resharded" else "")


def config_text(cfg: RunConfig) -> str:
    """`cfg` as the YAML that `<run_dir>/config.yaml`, the config history and checkpoints hold."""
    return config_yaml(cfg)


def config_changes(saved: Mapping[str, Any], cfg: RunConfig) -> list[ConfigChange]:
    """The keys (in schema order) where `cfg` differs from `saved`, a checkpoint's config as nested plain
    dicts (`yaml.safe_load` of its config.yaml)."""
    new = _effective(_flat(yaml.safe_load(config_text(cfg))))
    saved_flat = _renamed(_flat(saved))
    defaults = {**_flat(yaml.safe_load(config_text(RunConfig()))), **_older_behaviour(saved_flat)}
    old = _effective({**defaults, **saved_flat})
    return [ConfigChange(key, old[key], value, _kind(key)) for key, value in new.items() if old[key] != value]


def resume_notes(
    saved: Mapping[str, Any] | None,
    cfg: RunConfig,
    checkpoint: Path,
    saved_digests: Mapping[str, Any] | None = None,
) -> list[str]:
    """The lines to log when `cfg` resumes from `checkpoint`, whose config is `saved` (None: a checkpoint
    from before checkpoints stored one) and whose prompt files' digests are `saved_digests`
    (`data_digests`; None: not compared). Raises `ConfigChangeRefused` naming every change of what is
    trained, a training file whose content changed under its path included, unless
    `cfg.train.allow_config_change`."""
    if saved is None:
        return [
            f"warning: checkpoint {checkpoint} holds no config (saved before checkpoints stored theirs): "
            "the config could not be compared with the one it was trained with"
        ]
    content, same = data_digests.changes(dict(saved_digests) if saved_digests is not None else None, cfg)
    # a start's own switches are in its config file, not news about the run
    changes = [
        # a file moved with its content kept (another cluster's mount): where things are, not what is trained
        ConfigChange(c.key, c.old, c.new, "changeable", "same content") if c.key in same else c
        for c in config_changes(saved, cfg)
        if c.key not in _THIS_START
    ]
    changes += [
        ConfigChange(f"{key} ({_CONTENT[key]})", old, new, _kind(key), "SHA-256 prefixes")
        for key, (old, new) in content.items()
    ]
    kept = [c for c in changes if c.kind != "trained"]
    trained = [c for c in changes if c.kind == "trained"]
    if trained and not cfg.train.allow_config_change:
        listed = "; ".join(map(str, trained))
        raise ConfigChangeRefused(
            f"cannot resume {cfg.run_dir} from checkpoint {checkpoint.name}: the config changes what is "
            f"trained (checkpoint → now): {listed}. Restore the checkpoint's "
            f"{'value' if len(trained) == 1 else 'values'}, or accept the change with "
            "train.allow_config_change: true (--set train.allow_config_change=true)"
        )
    notes = []
    if kept:
        notes.append(
            f"resuming from {checkpoint.name} with config changes that keep what is trained: "
            + "; ".join(map(str, kept))
        )
    if trained:
        notes.append(
            f"train.allow_config_change: resuming from {checkpoint.name} with changes to what is trained "
            f"(checkpoint → now): {'; '.join(map(str, trained))}; the earlier starts' configs are in "
            f"{run_dir.configs_dir(cfg.run_dir)}"
        )
    return notes


def read_checkpoint_config(checkpoint: Path) -> dict[str, Any] | None:
    """The config stored in `checkpoint` as nested plain dicts, or None if it holds none. UserError naming
    the file if it does not read as a YAML mapping."""
    file = checkpoint / run_dir.CONFIG_NAME
    if not file.is_file():
        return None
    try:
        data = yaml.safe_load(file.read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
        why = " ".join(str(e).split())  # YAML's errors span lines; a user error is one
        raise UserError(f"checkpoint file {file} is unreadable ({type(e).__name__}: {why})") from None
    if not isinstance(data, dict):
        raise UserError(f"checkpoint file {file} is not a config (a YAML mapping); got {type(data).__name__}")
    return data


def _renamed(flat: dict[str, Any]) -> dict[str, Any]:
    """`flat` with the keys that moved since (`config.loader.MOVED_KEYS`) under their new names: the rollout
    section's flat keys under its parts (`rollout.settings.MOVED_KEYS`), and `model.bf16`
    true / false is `model.precision` bf16 / fp32 where precision was left null. Ignored as a removed key,
    a checkpoint of `bf16: false` would resume in bf16 on a GPU (null's default there) without a word."""
    flat = with_moved_keys_renamed(flat)
    bf16 = flat.pop("model.bf16", None)
    if bf16 is not None and flat.get("model.precision") is None:
        flat["model.precision"] = "bf16" if bf16 else "fp32"
    return flat


def _older_behaviour(saved: Mapping[str, Any]) -> dict[str, Any]:
    """The values that keys added with a new behaviour as their default take for a checkpoint whose config
    lacks them, where that run's behaviour differs from the new default's: what the older release did.

    `algorithm.stapo_entropy` (0a53b4a): STAPO compared the op's pruned entropy, which differs from the
    default "full_bound" only where something is pruned (DVP's `log_rho`, or a truncating sampler)."""
    out: dict[str, Any] = {}
    sampling = [saved.get(f"rollout.sampling.{k}") for k in ("top_k", "top_p", "min_p")]
    truncating = (
        sampling[0] not in (None, -1) or sampling[1] not in (None, 1.0) or sampling[2] not in (None, 0.0)
    )
    log_rho = saved.get("algorithm.log_rho", -13.0)
    pruned = not (log_rho is None or str(log_rho) in ("-inf", "-.inf")) or truncating  # −inf: no pruning
    if saved.get("algorithm.stapo") and pruned:
        out["algorithm.stapo_entropy"] = "pruned"
    return out


_CONTENT = {
    "data.train_path": "the file's content",
    "data.eval_path": "the file's content",
    "model.hf_path": "its config, tokenizer and chat template files",
}


def _kind(key: str) -> Kind:
    if key in CHANGEABLE_KEYS:
        return "changeable"
    return "resharded" if key in RESHARDABLE_KEYS else "trained"


def _flat(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested sections → {"section.key": value}; a leaf is anything but a mapping."""
    out: dict[str, Any] = {}
    for name, value in tree.items():
        if isinstance(value, Mapping):
            out.update(_flat(value, f"{prefix}{name}."))
        else:
            out[f"{prefix}{name}"] = value
    return out


def _effective(flat: dict[str, Any]) -> dict[str, Any]:
    """`flat` with `optimizer.lr_decay_steps` null replaced by the value that spans the same schedule
    (train.steps, at least the warm-up: `OptimizerSettings.schedule_steps`) where a schedule follows it: a
    longer run would otherwise stretch a decay silently; and `optimizer.min_lr` 0 under a constant rate,
    which ignores it."""
    styles = (flat.get("optimizer.lr_decay_style"), flat.get("optimizer.weight_decay_incr_style"))
    scheduled = any(style != "constant" for style in styles)
    if scheduled and flat.get(_SCHEDULE_STEPS) is None:
        steps, warmup = flat.get("train.steps"), flat.get("optimizer.lr_warmup_steps") or 0
        if isinstance(steps, int):
            flat = {**flat, _SCHEDULE_STEPS: max(steps, warmup)}
    if flat.get("optimizer.lr_decay_style") == "constant":
        # a constant rate never reaches min_lr (refused at load since; an older run's value did nothing)
        flat = {**flat, "optimizer.min_lr": 0.0}
    return flat


def _show(value: Any) -> str:
    """A value as one would write it in YAML or `--set` (null, true, 4, "math", [1, 2])."""
    return json.dumps(value, ensure_ascii=False)
