"""The one workflow (`rollout.service.episodes.episode_group`) as the environment tests drive it: every
prompt's group over an object with the `Engines` seam (`generate`, `check_health`), as evaluation maps it
(`evaluate_groups`), and the episodes back, prompt-major."""

from __future__ import annotations

import asyncio
from dataclasses import replace

from megatron_tail.rollout.envs import Tokens
from megatron_tail.rollout.protocol import SamplingConfig
from megatron_tail.rollout.service.episodes import (
    EpisodeSampling,
    Example,
    FailureCount,
    Reward,
    evaluate_groups,
)


def tokens_of(tokenizer) -> Tokens:
    """`Tokens` of a HF tokenizer: decode without special tokens, encode without adding any."""
    return Tokens(
        decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
        encode=lambda text: tokenizer(text, add_special_tokens=False)["input_ids"],
    )


def short_turn_sampling(*, max_new_tokens: int, base_seed: int, **truncation) -> SamplingConfig:
    """Two samples a prompt at temperature 1 where every non-special token of the tiny model (ids 4..99)
    ends a turn by "stop": the (random) model's turns are short, so episodes run to their `max_turns`.
    `truncation`: SamplingConfig's top_k / top_p."""
    return SamplingConfig(
        n_samples=2,
        max_new_tokens=max_new_tokens,
        temperature=1.0,
        log_rho=None,
        base_seed=base_seed,
        stop_token_ids=tuple(range(4, 100)),
        **truncation,
    )


class ClientEngines:
    """The `Engines` seam over one `RolloutClient` (no processor, no vocabulary check)."""

    def __init__(self, client):
        self.client = client

    async def check_health(self, *, pruned):  # noqa: ARG002 - one client
        await self.client.check_health()

    async def generate(self, input_ids, keys, sampling, *, pruned, partial, prefix_on=None):  # noqa: ARG002
        return await self.client.generate_group(
            input_ids, keys, sampling, partial=partial, prefix_on=prefix_on
        )


def episode_sampling(
    sampling, env_spec, envs, limits, tokens, *, max_concurrency, episodes, failures=None, fraction=0.5
) -> EpisodeSampling:
    """What every group shares: `sampling.n_samples` episodes a group, one sample a request, at most
    `max_concurrency` episodes at once, failures counted in `failures` (or a new count over `episodes`),
    every reward 0."""
    return EpisodeSampling(
        turn=replace(sampling, n_samples=1),
        n=sampling.n_samples,
        pruned=False,
        partial=False,
        env_spec=env_spec,
        envs=envs,
        limits=limits,
        tokens=tokens,
        slots=asyncio.BoundedSemaphore(max_concurrency),
        failures=failures if failures is not None else FailureCount(env_spec, episodes, fraction),
        reward=Reward(lambda texts, _answers: [0.0] * len(texts), correct_reward=1.0),
    )


async def run_groups(
    engines, envs, env_spec, prompts, answers, sampling, limits, tokens, *, max_concurrency, failures=None
):
    """The episodes of every prompt's group (`evaluate_groups`), prompt-major."""
    shared = episode_sampling(
        sampling, env_spec, envs, limits, tokens, max_concurrency=max_concurrency,
        episodes=len(prompts) * sampling.n_samples, failures=failures,
    )  # fmt: skip
    examples = [Example(p, a) for p, a in zip(prompts, answers, strict=True)]
    groups = await evaluate_groups(engines, examples, shared)
    return [episode for group in groups for episode in group.episodes]
