"""A per-token field from the engine is one declaration (`rollout.token_fields`): declared in one line, it
goes from the real local engine's replies (HTTP) through the parser, a partial rollout's joined segments,
one-turn and multi-turn episodes (the context value at an observation's tokens), the converter,
`RolloutBatch` (concatenation, selection, a checkpoint's round trip), `build_samples`, packing and the
context-parallel split, to a trainer micro-batch, where it equals what the engine sent.

The field here re-reads the engine's own log-probs (`meta_info.output_token_logprobs`, entry [logprob, id,
text]) under another name, so every stage's output has an independent reference: `rollout_logprobs`, which
the built-in path carries."""

from __future__ import annotations

import dataclasses
import io

import pytest
import torch

from megatron_tail.rollout.batch import RolloutBatch, concat_batches, select_samples
from megatron_tail.rollout.envs import EpisodeLimits, StepResult, Tokens, run_episode
from megatron_tail.rollout.local_engine.engine import LocalEngine
from megatron_tail.rollout.protocol import MalformedResponseError, SamplingConfig
from megatron_tail.rollout.service.episodes import NoEnvironment, episodes_to_batch, turn_output
from megatron_tail.rollout.token_fields import TokenField, declare, forget, parse_token_fields
from tests.rollout.tiny_moe import generate_across_an_update

CONTEXT = -1.0
"""The declared field's value at observation tokens: not 0.0, so it is told apart from `rollout_logprobs`'
placeholder there."""
PROMPT = [5, 6, 84, 7]


@pytest.fixture
def engine_logprob():
    field = declare(TokenField("engine_logprob", "output_token_logprobs", lambda e: e[0], CONTEXT))
    yield field
    forget(field.name)


class OneObservation:
    """An environment that answers the first turn with an observation and ends the episode at the second."""

    def __init__(self):
        self.steps = 0

    async def reset(self, row) -> None:  # noqa: ARG002
        return None

    async def step(self, turn: str) -> StepResult:  # noqa: ARG002
        self.steps += 1
        return StepResult(observation="obs" if self.steps == 1 else None, done=self.steps > 1)

    async def close(self) -> None:
        return None


def _episodes(results, environment):
    """One episode per result: one turn without an environment, else that turn, an observation of 3 ids
    and the next result's tokens as the second turn."""
    import asyncio

    tokens = Tokens(decode=lambda _ids: "x", encode=lambda _text: [7, 8, 9])
    limits = EpisodeLimits(max_turns=2, max_observation_tokens=8)

    async def one(j):
        turns = [results[j], results[(j + 1) % len(results)]]

        async def generate(_input_ids, turn):  # the first turn as if it stopped: the episode goes on
            out = turn_output(turns[turn])
            return dataclasses.replace(out, finish_reason="stop") if environment and turn == 0 else out

        env = OneObservation() if environment else NoEnvironment()
        return await run_episode(generate, env, PROMPT, {}, limits, tokens)

    async def every():
        return await asyncio.gather(*(one(j) for j in range(len(results))))

    return asyncio.run(every())


def test_a_declared_field_arrives_in_a_trainer_micro_batch(
    engine_logprob, tiny_model_dir, perturbed_model_dir
):
    from megatron_tail.config import load_config
    from megatron_tail.train.engine.batch import pack_micro_batches
    from megatron_tail.train.engine.context_parallel import split_for_context_parallel
    from megatron_tail.train.rl.samples import build_samples

    name = engine_logprob.name
    engine = LocalEngine(tiny_model_dir, dtype="float32", weight_version="0")
    sampling = SamplingConfig(n_samples=2, max_new_tokens=12, temperature=1.0, log_rho=-4.0, base_seed=5)
    results = generate_across_an_update(engine, PROMPT, sampling, perturbed_model_dir)
    assert any(r.segments > 1 for r in results), "a partial rollout must join segments here"
    for r in results:  # parsed and joined as the built-in log-probs are
        assert r.token_fields[name] == r.output_logprobs and len(r.output_ids) == 12

    single = episodes_to_batch(
        _episodes(results, False), [1.0, 0.0], correct_reward=1.0, elapsed_s=0.0, environment=False
    )
    multi = episodes_to_batch(_episodes(results, True), [0.0, 1.0], correct_reward=1.0, elapsed_s=0.0)
    for batch in (single, multi):
        for values, logprobs in zip(batch.token_fields, batch.rollout_logprobs, strict=True):
            assert values[name].dtype == torch.float32 and values[name].shape == (len(logprobs),)
    mask = torch.tensor(multi.policy_mask[0])
    assert (~mask).sum() == 3 and torch.all(multi.token_fields[0][name][~mask] == CONTEXT)

    batch = select_samples(concat_batches([single, multi]), [0, 1, 2, 3])
    buffer = io.BytesIO()  # the rollout manager's checkpointed buffers: plain dicts, weights_only
    torch.save(dataclasses.asdict(batch), buffer)
    buffer.seek(0)
    batch = RolloutBatch.from_dict(torch.load(buffer, weights_only=True))

    cfg = load_config(None, ["algorithm.group_size=2"])
    samples = build_samples(cfg, batch).samples
    for s in samples:
        policy = torch.tensor([True] * len(s.response) if s.policy_mask is None else s.policy_mask)
        expected = torch.where(policy, s.fields["rollout_logprobs"], torch.tensor(CONTEXT))
        torch.testing.assert_close(s.fields[name], expected, rtol=0, atol=0)

    mbs = pack_micro_batches(samples, max_tokens=128, pad_to_multiple=4, sequence_multiple=4)
    for mb in mbs:
        torch.testing.assert_close(
            mb.to_samples(mb.fields[name]), mb.to_samples(mb.fields["rollout_logprobs"]), rtol=0, atol=0
        )
        observations = sum(samples[i].policy_mask.count(False) for i in mb.sample_ids.tolist())
        assert observations in (0, 3, 6) and int((mb.fields[name] == CONTEXT).sum()) == observations
        shards = [split_for_context_parallel(mb, rank, 2) for rank in range(2)]
        summed = sum(shard.to_samples(shard.fields[name]) for shard in shards)
        torch.testing.assert_close(summed, mb.to_samples(mb.fields[name]), rtol=0, atol=0)
    assert sum(mb.sample_ids.numel() for mb in mbs) == 4
    assert sum(int((mb.fields[name] == CONTEXT).sum()) for mb in mbs) == 6  # both episodes' observations


def test_a_reply_without_a_declared_field_is_malformed_naming_it(engine_logprob):
    from megatron_tail.rollout.protocol import SampleKey, parse_generate_response

    declare(TokenField("entropy_x", "output_token_entropy"))  # a key the reply below lacks
    try:
        key = SampleKey(0, 0, 1)
        meta = {"id": "p0-s0-seed1-a1", "finish_reason": {"type": "length"}, "weight_version": "0"}
        meta["output_token_logprobs"] = [[-0.5, 10, "a"], [-0.25, 11, "b"]]
        reply = {"output_ids": [10, 11], "meta_info": meta}
        cfg = SamplingConfig(max_new_tokens=2, log_rho=None)
        with pytest.raises(
            MalformedResponseError, match=r"meta_info.output_token_entropy must hold one entry"
        ):
            parse_generate_response(dict(reply, meta_info=dict(meta)), [5], [key], cfg, 1, "http://h:1")
        forget("entropy_x")
        (got,) = parse_generate_response(dict(reply, meta_info=dict(meta)), [5], [key], cfg, 1, "http://h:1")
        assert got.token_fields == {engine_logprob.name: [-0.5, -0.25]}
    finally:
        forget("entropy_x")
    assert parse_token_fields({}, 0, True, "aborted")[engine_logprob.name] == []
    with pytest.raises(ValueError, match=r"output_token_logprobs\[1\] = \[\] is not a value of token field"):
        parse_token_fields({"output_token_logprobs": [[-0.5, 3, "a"], []]}, 2, False, "here")


def test_a_declaration_may_not_shadow_the_trainers_fields_or_change():
    with pytest.raises(ValueError, match="shadow the trainer's own sample field"):
        declare(TokenField("rollout_logprobs", "x"))
    declare(TokenField("entropy_x", "output_token_entropy"))
    try:
        declare(TokenField("entropy_x", "output_token_entropy"))  # the same again: fine
        with pytest.raises(ValueError, match="already declared"):
            declare(TokenField("entropy_x", "other_key"))
    finally:
        forget("entropy_x")
