"""An evaluation scores each prompt's group in its own reward batch, as training does. Before: one batch of
every completion of the evaluation (prompts × samples), where a few dozen slow answers (math-verify takes up
to ~5 s on an adversarial one) passed `data.reward_timeout_s` when it bounded a batch (it now bounds each
completion) and ended the run."""

from __future__ import annotations

import asyncio
from dataclasses import replace

from megatron_tail.rollout import SamplingConfig
from megatron_tail.rollout.envs import EpisodeLimits, Tokens
from megatron_tail.rollout.service.episodes import Example, Reward, evaluate_groups
from tests.rollout.envs.groups import episode_sampling
from tests.rollout.envs.test_env_failures import RecordingClient

PROMPTS, N = 4, 3


def test_each_groups_completions_are_one_reward_batch():
    batches: list[tuple[int, list[str]]] = []

    def score(texts, answers):
        batches.append((len(texts), sorted(set(answers))))
        return [float(a == "1") for a in answers]

    sampling = SamplingConfig(n_samples=N, max_new_tokens=4, temperature=1.0, log_rho=None, base_seed=3)
    tokens = Tokens(decode=lambda ids: " ".join(map(str, ids)), encode=lambda text: [7] * len(text.split()))
    shared = episode_sampling(
        sampling, None, None, EpisodeLimits(max_turns=1, max_observation_tokens=8), tokens,
        max_concurrency=8, episodes=PROMPTS * N,
    )  # fmt: skip
    shared = replace(shared, reward=Reward(score, correct_reward=1.0))
    examples = [Example([5, 6, i], str(i)) for i in range(PROMPTS)]
    groups = asyncio.run(evaluate_groups(RecordingClient(), examples, shared))
    assert batches == [(N, [str(i)]) for i in range(PROMPTS)]  # one batch a group, in prompt order
    assert [list(g.batch.rewards) for g in groups] == [[float(i == 1)] * N for i in range(PROMPTS)]
