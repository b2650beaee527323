"""MoE routes of multi-turn episodes (routing replay R3) on the local engine with a tiny Qwen3-MoE: each
position of the episode's sample keeps the row of the first request that fed it to a forward
(`envs/episode.py`), checked against the HF routers' top-k recomputed in float64 under the weights that
served each turn (a weight update between turns makes the turns' routes differ); each turn asks only for the
rows not held yet; a turn continued after an abort (partial rollouts) joins its rows from that start; the
routes reach the batch and the trainer's per-position fields."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from megatron_tail.config import config_from_dict
from megatron_tail.rollout import DiskWeightSync, RolloutClient, SamplingConfig
from megatron_tail.rollout.columns import BUILTIN_COLUMNS, Routes
from megatron_tail.rollout.envs import Episode, EpisodeLimits, Tokens
from megatron_tail.rollout.envs.pool import EnvWorkers
from megatron_tail.rollout.local_engine.engine import LocalEngine
from megatron_tail.rollout.local_engine.server import build_app
from megatron_tail.rollout.routes import ROUTED_FIELD, ROUTES_FIELD
from megatron_tail.rollout.service.episodes import Example, GroupKeys, episode_group, episodes_to_batch
from megatron_tail.train.rl.samples import build_samples
from tests.rollout.envs.groups import episode_sampling
from tests.rollout.servers import serving_app
from tests.rollout.tiny_moe import (
    DENSE_LAYER,
    NUM_LAYERS,
    TOP_K,
    generate_across_an_update,
    perturbed_moe_copy,
    reference_routes,
    write_tiny_qwen3_moe,
)

SHAPE = (NUM_LAYERS, TOP_K)
PROMPT = [5, 6, 84, 7]
ENV = "tests.rollout.envs.fault_envs:ShortObservation"  # "\nok\n" after each turn, done after the third


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return write_tiny_qwen3_moe(tmp_path_factory.mktemp("tiny_moe") / "model", seed=0)


@pytest.fixture(scope="module")
def moe_step1_dir(moe_dir, tmp_path_factory):
    return perturbed_moe_copy(moe_dir, tmp_path_factory.mktemp("tiny_moe_step1") / "model", seed=1)


def test_added_routes_keep_the_first_requests_row_and_refuse_a_gap():
    def turn(routes):
        return BUILTIN_COLUMNS.values(routed_experts=routes)

    e = Episode([1, 2, 3])
    first = np.arange(2 * 3 * 2, dtype=np.int32).reshape(2, 3, 2)
    e.add([4], policy=True, columns=turn(Routes(0, first)))
    e.add([5], policy=False)  # an observation: its positions are routed by the next turn's prefill
    e.add([6], policy=True, columns=turn(Routes(1, np.full((4, 3, 2), 7, np.int32))))  # 1 held, 2..4 new
    held = e.columns["routed_experts"]
    assert held.start == 0 and held.end == 5
    np.testing.assert_array_equal(held.rows, np.concatenate([first, np.full((3, 3, 2), 7)]))
    with pytest.raises(
        ValueError, match=r"start at position 6, but the sample holds routes for positions \[0, 5\)"
    ):
        e.add([7], policy=True, columns=turn(Routes(6, np.zeros((1, 3, 2), np.int32))))
    e.add([7], policy=True, columns=BUILTIN_COLUMNS.values())  # a turn without routes: the episode has none
    assert "routed_experts" not in e.columns


def test_each_position_keeps_the_route_of_the_first_request_that_fed_it(moe_dir, moe_step1_dir):
    """One episode per seed, 3 turns: turn 0 served by model A, turn 1 by B, turn 2 by A again. Positions
    before turn 0's last token are A's (prompt: turn 0's prefill; turn 0's tokens: its decode steps), from
    there to turn 1's last token B's (turn 0's last token and the observation: turn 1's prefill), then A's.
    B routes some earlier positions differently when it re-prefills them, so keeping a later request's rows
    would fail; each turn asked from the rows held, so no row came twice."""
    engine = LocalEngine(moe_dir, dtype="float32", weight_version="0", enable_return_routed_experts=True)
    models = [moe_dir, moe_step1_dir, moe_dir]
    sampling = SamplingConfig(
        n_samples=1, max_new_tokens=8, temperature=1.0, log_rho=None,
        stop_token_ids=tuple(range(4, 128, 2)),  # about one token in two ends a turn: turns of 1-8 tokens
        return_routed_experts=True, routes_shape=SHAPE,
    )  # fmt: skip
    tokens = Tokens(decode=lambda ids: "x" * len(ids), encode=lambda text: [10 + ord(c) % 50 for c in text])
    starts: list[int] = []

    async def main():
        pool = EnvWorkers(1, timeout_s=30, timeout_name="data.reward_timeout_s")
        try:
            async with serving_app(build_app(engine)) as url, RolloutClient([url], processor=None) as client:
                sync = DiskWeightSync([url])

                class Engines:
                    """Each turn on the weights that serve it (a trainer step between turns)."""

                    async def generate(self, input_ids, keys, now, *, pruned, partial, prefix_on=None):  # noqa: ARG002
                        turn = len(starts)
                        if turn:
                            await sync.update(str(models[turn]), weight_version=str(turn))
                        starts.append(now.routed_experts_start_len)
                        return await client.generate_group(input_ids, keys, now, partial=True)

                episodes = []
                for seed in (1, 2):
                    starts.clear()
                    await sync.update(str(moe_dir), weight_version="0")
                    shared = episode_sampling(
                        sampling, ENV, pool, EpisodeLimits(3, 8), tokens, max_concurrency=1, episodes=1
                    )
                    group = await episode_group(Engines(), Example(PROMPT, ""), GroupKeys(0, seed, 0), shared)
                    (episode,) = group.episodes
                    episodes.append((episode, list(starts)))
                return episodes
        finally:
            pool.close()

    try:
        episodes = asyncio.run(main())
    finally:
        engine.close()
    multi_token_turns = 0
    for episode, asked in episodes:
        assert episode.turns == 3 and not episode.truncated, episode
        ids = [*episode.prompt_ids, *episode.response_ids]
        routes = episode.columns["routed_experts"].rows
        assert routes.dtype == np.int32 and routes.shape == (len(ids) - 1, NUM_LAYERS, TOP_K)
        mask = episode.policy_mask
        # each turn's last token (position in prompt + response): the first position the next turn feeds
        ends = [
            len(PROMPT) + i for i in range(len(mask)) if mask[i] and (i + 1 == len(mask) or not mask[i + 1])
        ]
        assert len(ends) == 3 and asked == [0, ends[0], ends[1]]  # each row shipped once
        multi_token_turns += sum(1 for i in range(len(mask)) if mask[i] and i > 0 and mask[i - 1])
        a = reference_routes(moe_dir, ids)[:-1].numpy()
        b = reference_routes(moe_step1_dir, ids)[:-1].numpy()
        want = np.concatenate([a[: ends[0]], b[ends[0] : ends[1]], a[ends[1] :]])
        np.testing.assert_array_equal(np.sort(routes, axis=-1), want)
        assert (routes[:, DENSE_LAYER] == 0).all()
        assert (
            a[: ends[0]] != b[: ends[0]]
        ).any()  # B re-prefilling turn 0's positions routes them otherwise
        assert (a[ends[0] : ends[1]] != b[ends[0] : ends[1]]).any()  # turn 1's rows are B's, not A's
    assert multi_token_turns > 0  # some policy tokens' rows come from decode steps, not a prefill

    # the batch carries them as the single-turn path does: uint8 [prompt + response − 1, layers, k]
    batch = episodes_to_batch([e for e, _ in episodes], [0.0, 1.0], correct_reward=1.0, elapsed_s=0.0)
    for (episode, _), got in zip(episodes, batch.column("routed_experts"), strict=True):
        assert got.dtype == torch.uint8
        np.testing.assert_array_equal(got.numpy(), episode.columns["routed_experts"].rows)
    cfg = config_from_dict({"algorithm": {"group_size": 2, "routing_replay": "r3"}})
    samples = build_samples(cfg, batch)
    for (episode, _), sample in zip(episodes, samples.samples, strict=True):
        fields = sample.position_fields
        n = len(episode.prompt_ids) + len(episode.response_ids)
        assert fields[ROUTES_FIELD].shape == (n, NUM_LAYERS, TOP_K) and fields[ROUTED_FIELD].tolist() == [
            True
        ] * (n - 1) + [False]
        np.testing.assert_array_equal(
            fields[ROUTES_FIELD][:-1].numpy(), episode.columns["routed_experts"].rows
        )


def test_a_turn_continued_after_an_abort_joins_its_rows_from_the_rows_held(moe_dir, moe_step1_dir):
    """A later turn (input = an earlier turn's sequence + more, routes asked from position `held`) that a
    weight update aborts mid-generation: the continuation asks from `held` + the rows the first segment
    returned, and the joined rows cover `[held, input + output − 1)`: the old model's up to the cut, the
    new one's after (each position's row from the forward that sampled the next token)."""
    engine = LocalEngine(moe_dir, dtype="float32", weight_version="0", enable_return_routed_experts=True)
    turn_input = [*PROMPT, 9, 11, 13, 20, 21, 17]  # prompt, an earlier turn's tokens, an observation
    held = len(PROMPT) + 2 - 1  # the earlier turn's input + output − 1
    sampling = SamplingConfig(
        n_samples=2, max_new_tokens=24, temperature=1.0, log_rho=None, ignore_eos=True, base_seed=3,
        return_routed_experts=True, routes_shape=SHAPE, routed_experts_start_len=held,
    )  # fmt: skip

    samples = generate_across_an_update(engine, turn_input, sampling, moe_step1_dir)
    for s in samples:
        ids = turn_input + s.output_ids
        cut = s.columns["token_versions"].index("1")
        routes = s.columns["routed_experts"]
        assert s.segments == 2 and cut >= 5 and routes.start == held
        assert routes.rows.shape == (len(ids) - 1 - held, NUM_LAYERS, TOP_K)
        edge = len(turn_input) + cut - 1  # positions < edge fed the forwards that sampled old tokens
        old = reference_routes(moe_dir, ids)[:-1].numpy()
        new = reference_routes(moe_step1_dir, ids)[:-1].numpy()
        got = np.sort(routes.rows, axis=-1)
        np.testing.assert_array_equal(got[: edge - held], old[held:edge])
        np.testing.assert_array_equal(got[edge - held :], new[edge:])
        assert (old[edge:] != new[edge:]).any()
