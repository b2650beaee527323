"""What a run decides for its rollout service, beyond the `rollout:` settings (`rollout.settings`): the model,
group size and groups per step, seeds, the reward, the DVP ρ, the model's vocabulary, context and MoE routes'
shape, where the trained prompts are logged, and how the service reports waits. The trainer's run layer
builds it in one function (`train.run.rollout_plan.plan_from`), tests too: every field is required, so a
plan states each decision instead of inheriting a default that disagrees with the run's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ..columns import ColumnTable

if TYPE_CHECKING:
    from megatron_tail.algorithms.overlong import OverlongShaping


def _no_stop_hint() -> str:
    return "send SIGTERM twice to stop now"


@dataclass(frozen=True, kw_only=True)
class RewardPlan:
    """The reward every sample is scored with (`rewards.scorer.RewardScorer`, in a worker process)."""

    name: str
    """`data.reward`: a built-in reward's name or "package.module:function"."""
    timeout_s: float
    """`data.reward_timeout_s`: per completion scored; with an environment, its calls' limit too unless
    `rollout.env.timeout_s` is set."""
    correct_reward: float
    """`data.correct_reward`: a sample is correct when its final answer's reward is at least this."""


@dataclass(frozen=True)
class Reporting:
    """How the service tells the run what it waits for (rank 0's console, the stop signals)."""

    note: Callable[[str], None] = print
    """Where wait-progress lines go."""
    waiting: Callable[[str], contextlib.AbstractContextManager] = lambda _what: contextlib.nullcontext()
    """Around each wait of the caller: a stop signal meanwhile names what is waited for
    (`train.run.signals.waiting`)."""
    stop_hint: Callable[[], str] = _no_stop_hint
    """How to stop now, for a line that reports a long wait (`train.run.signals.stop_hint`)."""


@dataclass(frozen=True, kw_only=True)
class RolloutPlan:
    """The run's decisions the rollout service follows (the settings are `RolloutSection`'s)."""

    model_path: str
    """The HF model directory the local engine loads (and every sample's vocabulary)."""
    vocab_size: int
    """Token ids an engine may return: [0, vocab_size)."""
    context_length: int
    """The engines' context length; a multi-turn episode whose next turn would exceed it ends."""
    group_size: int
    """Samples per prompt (`algorithm.group_size`)."""
    groups_per_step: int
    """Prompts per training batch (`data.prompts_per_step`)."""
    seed: int
    """The run's seed: group `index`'s sample seeds derive from it (`managed.group_seeds`)."""
    log_rho: float | None
    """DVP's log ρ the engines prune with at the start (the trainer's rule at the rollout temperature,
    `AlgorithmConfig.rule_log_rho`); None: no DVP. `RolloutService.set_log_rho` changes it (log ρ auto)."""
    reward: RewardPlan
    routes_shape: tuple[int, int] | None
    """MoE: `(num_hidden_layers, top_k)` of the routes the engines return (routing replay), else None."""
    columns: ColumnTable
    """The per-token columns the replies are parsed into (`rollout.columns`; the trainer's table too)."""
    filter_zero_variance_groups: bool
    """Dynamic sampling: drop groups whose rewards are all equal (DAPO)."""
    filter_shaping: OverlongShaping | None
    """Dynamic sampling: the overlong shaping added to the task rewards it compares (`data.filter_reward:
    shaped` with `algorithm.overlong_buffer` > 0); None: the task rewards, as DAPO."""
    max_sampling_rounds: int
    """Dynamic sampling: at most this many × `groups_per_step` groups filtered per batch."""
    total_steps: int
    """Training steps of the run: the manager generates no group past the last step's."""
    eval_samples_per_prompt: int
    """Sampled evaluation: n samples per prompt (pass@k, mean@n)."""
    run_dir: Path | None
    """Where `logs/local_engine.log` and `logs/trained_prompts.jsonl` go (None: nowhere, tests)."""
    weight_sync_dir: Path
    """Disk weight sync: where the trainer's weights are exported for the engines to load
    (`rollout.weight_sync.dir`, else `<run_dir>/rollout_weights`)."""
    reporting: Reporting

    @property
    def local_engine_log(self) -> Path:
        return Path(self.run_dir or ".") / "logs" / "local_engine.log"

    @property
    def trained_prompts_path(self) -> Path | None:
        """`<run_dir>/logs/trained_prompts.jsonl`: per step, the prompt-stream indices it trained."""
        return None if self.run_dir is None else trained_prompts_path(self.run_dir)


def trained_prompts_path(run_dir: str | Path) -> Path:
    """`<run_dir>/logs/trained_prompts.jsonl` (`managed.record_trained_prompts`)."""
    return Path(run_dir) / "logs" / "trained_prompts.jsonl"
