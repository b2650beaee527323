"""The run's rollout service: the decisions of this run that it follows (`RolloutPlan`), from the config and
the model, and the service itself on rank 0 (`start_rollout`). The rollout side lives in
`megatron_tail.rollout.service`; this is all the run layer tells it."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from megatron_tail.config import RunConfig
from megatron_tail.config.run_inputs import context_limit
from megatron_tail.model.hf_config import load_hf_config
from megatron_tail.rollout.columns import BUILTIN_COLUMNS, ColumnTable
from megatron_tail.rollout.service import Reporting, RewardPlan, RolloutPlan, RolloutService

from ..rl.routing import engine_routes_shape
from . import signals


def token_columns(cfg: RunConfig) -> ColumnTable:  # noqa: ARG001 - the one place a run adds its columns
    """The per-token columns of `cfg`'s run (`rollout.columns`), one table for the rollout service's parser
    and the trainer's samples: the built-in ones (each request carries those it wants). A run that reads
    more from its engines' replies adds them here (`BUILTIN_COLUMNS.with_columns(declared(...))`)."""
    return BUILTIN_COLUMNS


def rollout_plan(cfg: RunConfig, run_dir: Path, note: Callable[[str], None] = print) -> RolloutPlan:
    """What `cfg` and its model (`model.hf_path`'s config.json: vocabulary, context length, MoE routes'
    shape) decide for the rollout service; wait reports go to `note` and name the stop signals."""
    arch = load_hf_config(cfg.model.hf_path)
    return plan_from(
        cfg,
        vocab_size=arch.vocab_size,
        context_length=context_limit(cfg, arch)[0],
        routes_shape=engine_routes_shape(cfg, arch),
        run_dir=Path(run_dir),
        note=note,
    )


def plan_from(
    cfg: RunConfig,
    *,
    vocab_size: int,
    context_length: int,
    routes_shape: tuple[int, int] | None = None,
    run_dir: Path | None = None,
    note: Callable[[str], None] = print,
) -> RolloutPlan:
    """The plan of `cfg` for a model of `vocab_size` tokens and `context_length` positions: group size and
    groups per step, seeds, the reward, DVP's log ρ at the rollout temperature (None without DVP), the
    routes' shape (MoE), the run directory (`run_dir`, None: `cfg.run_dir`) and the disk weight sync's
    export directory in it; wait reports go to `note` and name the stop signals (`signals`). The one place
    the run's config becomes the service's: every field of the plan is required."""
    a, d = cfg.algorithm, cfg.data
    run_dir = Path(run_dir if run_dir is not None else cfg.run_dir)
    return RolloutPlan(
        model_path=cfg.model.hf_path,
        vocab_size=vocab_size,
        context_length=context_length,
        group_size=a.group_size,
        groups_per_step=d.prompts_per_step,
        seed=cfg.seed,
        log_rho=a.sampling_log_rho(cfg.rollout.sampling.temperature),
        reward=RewardPlan(name=d.reward, timeout_s=d.reward_timeout_s, correct_reward=d.correct_reward),
        routes_shape=routes_shape,
        columns=token_columns(cfg),
        filter_zero_variance_groups=d.filter_zero_variance_groups,
        filter_shaping=cfg.overlong_shaping() if d.filter_reward == "shaped" else None,
        max_sampling_rounds=d.max_sampling_rounds,
        total_steps=cfg.train.steps,
        eval_samples_per_prompt=cfg.train.eval_samples_per_prompt,
        run_dir=run_dir,
        weight_sync_dir=weight_sync_dir(cfg, run_dir),
        reporting=Reporting(note=note, waiting=signals.waiting, stop_hint=signals.stop_hint),
    )


def weight_sync_dir(cfg: RunConfig, run_dir: str | Path) -> Path:
    """Where the disk weight sync exports: `rollout.weight_sync.dir`, else `<run_dir>/rollout_weights`."""
    return Path(cfg.rollout.weight_sync.dir or Path(run_dir) / "rollout_weights")


def start_rollout(
    cfg: RunConfig, run_dir: Path, tokenizer, note: Callable[[str], None] = print
) -> RolloutService:
    """Rank 0's rollout service for `cfg` (a local engine starts loading now)."""
    return RolloutService(cfg.rollout, rollout_plan(cfg, run_dir, note), tokenizer)
