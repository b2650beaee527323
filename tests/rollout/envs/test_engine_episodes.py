"""Episodes over a real local engine (a subprocess speaking SGLang's `/generate`): the engine's log-probs of
every policy token equal an independent HF forward over the finished sample, so each turn saw exactly the
concatenated ids; and through rank 0's `RolloutService` (its rollout manager), a one-turn episode is the
single-turn sample."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
import torch

from megatron_tail.rollout import ClientConfig, RolloutClient
from megatron_tail.rollout.envs import EpisodeLimits
from megatron_tail.rollout.envs.pool import EnvWorkers
from tests.rollout.envs.groups import ClientEngines, run_groups, short_turn_sampling, tokens_of
from tests.rollout.servers import start_servers

PROMPTS = [[5, 6, 76, 7, 84], [8, 9, 76, 10, 84]]
ANSWERS = ["1", "2"]


@pytest.fixture(scope="module")
def fp32_server(tiny_model_dir, tmp_path_factory):
    (server,) = start_servers(tiny_model_dir, tmp_path_factory.mktemp("fp32_logs"), 1, dtype="float32")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model_dir))


def _three_turn_episodes(server, tokenizer, **truncation) -> list:
    """Two episodes for each of `PROMPTS` with the scripted environment, up to 3 turns each: every
    non-special token ends a turn by "stop", so the (random) model's turns are short and episodes run to
    max_turns. `truncation`: SamplingConfig's top_k / top_p."""
    sampling = short_turn_sampling(max_new_tokens=6, base_seed=3, **truncation)
    tokens = tokens_of(tokenizer)

    async def go():
        pool = EnvWorkers(2, timeout_s=30, timeout_name="data.reward_timeout_s")
        try:
            async with RolloutClient([server.url], ClientConfig(request_timeout_s=60), processor=None) as c:
                return await run_groups(
                    ClientEngines(c), pool, "tests.rollout.envs.fault_envs:AlwaysContinues", PROMPTS, ANSWERS,
                    sampling, EpisodeLimits(max_turns=3, max_observation_tokens=64), tokens,
                    max_concurrency=4,
                )  # fmt: skip
        finally:
            pool.close()

    return asyncio.run(go())


def test_every_turn_sees_the_concatenated_ids(fp32_server, tiny_model_dir, tokenizer):
    from transformers import AutoModelForCausalLM

    episodes = _three_turn_episodes(fp32_server, tokenizer)
    assert len(episodes) == 4 and all(e.turns == 3 and e.truncated_by_turns for e in episodes)
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    for e in episodes:
        ids = torch.tensor([[*e.prompt_ids, *e.response_ids]])
        with torch.no_grad():
            logp = torch.log_softmax(model(ids).logits[0, :-1].double(), dim=-1)
        p = len(e.prompt_ids)
        hf = logp[p - 1 :].gather(-1, ids[0, p:, None])[:, 0]
        mask = torch.tensor(e.policy_mask)
        assert 0 < int((~mask).sum()) and e.env_tokens == int((~mask).sum())
        logprobs = e.columns["rollout_logprobs"]
        torch.testing.assert_close(
            torch.tensor(logprobs, dtype=torch.float64)[mask], hf[mask], rtol=0, atol=1e-4
        )
        assert all(x == 0.0 for x, m in zip(logprobs, e.policy_mask, strict=True) if not m)


def _engines(cfg_overrides, url, model_dir, run_dir, tokenizer):
    from megatron_tail.config import load_config
    from megatron_tail.train.run.rollout_plan import start_rollout

    cfg = load_config(
        None,
        [
            f"model.hf_path={model_dir}",
            "rollout.engine=remote",
            f"rollout.server_urls=[{url}]",
            "rollout.max_new_tokens=8",
            "rollout.max_concurrency=1",
            "algorithm.group_size=2",
            "algorithm.log_rho=-4.0",
            f"data.prompts_per_step={len(PROMPTS)}",
            f"run_dir={run_dir}",
            "data.reward=arithmetic",
            *cfg_overrides,
        ],
    )
    engines = start_rollout(cfg, run_dir, tokenizer)
    engines.wait_ready()
    return engines


TOP_P = ["rollout.sampling.top_p=0.95", "rollout.sampling.top_k=20"]


@pytest.mark.parametrize("truncation", [[], TOP_P], ids=["full", "top_p"])
def test_one_turn_episode_is_the_single_turn_sample(
    fp32_server, tiny_model_dir, tokenizer, tmp_path, truncation
):
    batches = {}
    for name, extra in (
        ("single", []),
        ("episode", ["rollout.env.name=calculator", "rollout.env.max_turns=1"]),
    ):
        engines = _engines([*extra, *truncation], fp32_server.url, tiny_model_dir, tmp_path / name, tokenizer)
        try:
            pairs = zip(PROMPTS, ANSWERS, strict=True)
            examples = [SimpleNamespace(prompt_ids=p, answer=a) for p, a in pairs]
            engines.start_manager(examples.__getitem__, 0, None)  # η = 0: the first step's 2 groups
            batches[name] = engines.next_batch(0)
        finally:
            engines.close()
    single, episode = batches["single"], batches["episode"]
    for name in ("prompt_ids", "response_ids", "rewards", "truncated"):
        assert getattr(episode, name) == getattr(single, name), name
    for name in ("rollout_logprobs", "rollout_top_logprobs", "token_versions"):
        assert episode.column(name) == single.column(name), name
    # with truncated sampling, the episode carries the single-turn sample's supports, token for token
    if truncation:
        supports = single.column("sampling_support"), episode.column("sampling_support")
        assert supports[0] is not None and supports[1] is not None
        for a, b in zip(*supports, strict=True):
            assert torch.equal(a.values, b.values) and torch.equal(a.offsets, b.offsets)
    else:
        assert single.column("sampling_support") is None and episode.column("sampling_support") is None
    assert single.policy_mask is None and episode.policy_mask == [
        [True] * len(r) for r in single.response_ids
    ]
    assert episode.stats["turns"] == episode.stats["episodes"] == 4 and episode.stats["env_tokens"] == 0


def test_multi_turn_episodes_carry_their_supports_under_top_p(fp32_server, tokenizer):
    """Every policy token lies in its own support row, every environment token has an empty row."""
    from megatron_tail.rollout.service.episodes import episodes_to_batch

    episodes = _three_turn_episodes(fp32_server, tokenizer, top_k=20, top_p=0.95)
    batch = episodes_to_batch(
        episodes, [0.0] * 4, correct_reward=1.0, elapsed_s=0.0, required=("sampling_support",)
    )
    supports = batch.column("sampling_support")
    assert supports is not None and all(e.turns == 3 for e in episodes)
    for ids, mask, rows in zip(batch.response_ids, batch.policy_mask, supports, strict=True):
        assert len(rows) == len(ids) and not all(mask)
        for j, (token, policy) in enumerate(zip(ids, mask, strict=True)):
            row = rows.row(j).tolist()
            assert (token in row and 0 < len(row) <= 20) if policy else row == []
