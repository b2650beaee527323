"""Rank 0's multi-turn rollouts (`rollout.env`): one `envs.run_episode` coroutine per sample over today's
engines, each turn one `RolloutClient.generate_turn` call (the first turns of a prompt's n episodes in one
request, as the single-turn path sends them, which lets SGLang share the prompt's KV cache), at most
`rollout.max_concurrency` episodes in flight; then the episodes as a `RolloutBatch` with its per-token
`policy_mask`.

Seeds: turn 0 of sample (i, j) has exactly the single-turn sample's key (`sample_seed(base_seed, i, j)`), so a
one-turn episode asks the engine for exactly what a single-turn rollout asks; turn t > 0 mixes t into it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import replace

from megatron_tail.rollout import RolloutBatch, RolloutClient, SampleKey, SamplingConfig
from megatron_tail.rollout.batch import episode_stats
from megatron_tail.rollout.envs import Episode, EpisodeLimits, Tokens, TurnOutput, run_episode
from megatron_tail.rollout.envs.host import WorkerEnv
from megatron_tail.rollout.protocol import sample_seed

IM_END = "<|im_end|>"
"""Qwen's end of turn: a stop token of every turn (Qwen3's generation config has it as an EOS already; the
demo's character tokenizer does not)."""


def turn_key(base_seed: int, prompt_index: int, sample_index: int, turn: int) -> SampleKey:
    seed = sample_seed(base_seed, prompt_index, sample_index)
    if turn:
        seed = sample_seed(seed, turn, 0)
    return SampleKey(prompt_index, sample_index, seed)


def turn_sampling(sampling: SamplingConfig, tokenizer, max_turns: int) -> SamplingConfig:
    """`sampling` for the turns: with more than one turn, `<|im_end|>` added to the stop tokens where the
    vocabulary has it (a one-turn episode asks exactly what a single-turn sample does)."""
    stops = list(sampling.stop_token_ids)
    im_end = tokenizer.convert_tokens_to_ids(IM_END) if IM_END in tokenizer.get_vocab() else None
    if max_turns > 1 and im_end is not None and im_end not in stops:
        stops.append(im_end)
    return replace(sampling, stop_token_ids=tuple(stops))


async def run_episodes(
    client: RolloutClient,
    scorer,
    env_spec: str,
    prompts: Sequence[Sequence[int]],
    answers: Sequence[str],
    sampling: SamplingConfig,
    limits: EpisodeLimits,
    tokens: Tokens,
    *,
    max_concurrency: int,
    on_episode: Callable[[Episode], None] | None = None,
) -> list[Episode]:
    """`sampling.n_samples` episodes per prompt, prompt-major (groups contiguous)."""
    await client.check_health()
    per_turn = replace(sampling, n_samples=1)
    semaphore = asyncio.Semaphore(max_concurrency)
    first_turns: dict[int, asyncio.Task] = {}  # prompt → its n first turns, one request (as single-turn)

    def first_turn(i: int) -> asyncio.Future:
        if i not in first_turns:
            keys = [turn_key(sampling.base_seed, i, j, 0) for j in range(sampling.n_samples)]
            first_turns[i] = asyncio.ensure_future(client.generate_turn(prompts[i], keys, per_turn))
        return asyncio.shield(first_turns[i])

    async def one(i: int, j: int) -> Episode:
        async def generate(input_ids: list[int], turn: int) -> TurnOutput:
            if turn == 0:
                r = (await first_turn(i))[j]
            else:
                (r,) = await client.generate_turn(
                    input_ids, [turn_key(sampling.base_seed, i, j, turn)], per_turn
                )
            return TurnOutput(
                output_ids=list(r.output_ids),
                logprobs=list(r.output_logprobs),
                finish_reason=r.finish_reason.get("type", "stop"),
                weight_version=r.weight_version,
                top_logprobs=None if r.output_top_logprobs is None else list(r.output_top_logprobs),
            )

        env = WorkerEnv(scorer, env_spec, f"b{sampling.base_seed}-p{i}-s{j}")
        async with semaphore:
            row = {"answer": answers[i], "index": i}
            episode = await run_episode(generate, env, prompts[i], row, limits, tokens)
        if on_episode is not None:
            on_episode(episode)
        return episode

    tasks = [asyncio.create_task(one(i, j)) for i in range(len(prompts)) for j in range(sampling.n_samples)]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in [*tasks, *first_turns.values()]:
            task.cancel()
        await asyncio.gather(*tasks, *first_turns.values(), return_exceptions=True)
        raise


def episodes_to_batch(
    episodes: Sequence[Episode], rewards: Sequence[float], *, correct_reward: float, elapsed_s: float
) -> RolloutBatch:
    """The episodes as samples: response = turns and observations back to back, `policy_mask` marking the
    turns; reward = the run's reward of the last turn (`rewards`) + the environment's step rewards."""
    total = [r + e.env_reward for r, e in zip(rewards, episodes, strict=True)]
    tops = [e.top_logprobs for e in episodes]
    generated = sum(sum(e.policy_mask) for e in episodes)
    return RolloutBatch(
        prompt_ids=[list(e.prompt_ids) for e in episodes],
        response_ids=[list(e.response_ids) for e in episodes],
        rollout_logprobs=[list(e.logprobs) for e in episodes],
        rewards=total,
        correct=[x >= correct_reward for x in total],
        truncated=[e.truncated for e in episodes],
        # every turn of an episode comes from one `generate` call, between two weight syncs: one version
        weight_versions=[e.turn_versions[0] for e in episodes],
        rollout_top_logprobs=None if any(t is None for t in tops) else [list(t) for t in tops],
        policy_mask=[list(e.policy_mask) for e in episodes],
        stats={"rollout_time_s": elapsed_s, "generated_tokens": float(generated), **episode_stats(episodes)},
    )
