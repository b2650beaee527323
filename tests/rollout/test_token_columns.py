"""A per-token column of the engine's is one table entry (`rollout.columns`): declared in one line and passed
in with the table, it goes from the real local engine's replies (HTTP) through the parser, a partial rollout's
joined segments, one-turn and multi-turn episodes (the context value at an observation's tokens), the
converter, `RolloutBatch` (concatenation, selection, a checkpoint's round trip), `build_samples`, packing and
the context-parallel split, to a trainer micro-batch, where it equals what the engine sent.

The column here re-reads the engine's own log-probs (`meta_info.output_token_logprobs`, entry [logprob, id,
text]) under another name, so every stage's output has an independent reference: `rollout_logprobs`, the
built-in column of the same table."""

from __future__ import annotations

import dataclasses
import io

import pytest
import torch

from megatron_tail.rollout.batch import RolloutBatch, concat_batches, select_samples
from megatron_tail.rollout.columns import BUILTIN_COLUMNS, VERSIONS, ColumnTable, Reply, TokenColumn, declared
from megatron_tail.rollout.envs import EpisodeLimits, StepResult, Tokens, run_episode
from megatron_tail.rollout.local_engine.engine import LocalEngine
from megatron_tail.rollout.protocol import MalformedResponseError, SamplingConfig
from megatron_tail.rollout.service.episodes import NoEnvironment, episodes_to_batch, turn_output
from tests.rollout.tiny_moe import generate_across_an_update

CONTEXT = -1.0
"""The declared field's value at observation tokens: not 0.0, so it is told apart from `rollout_logprobs`'
placeholder there."""
PROMPT = [5, 6, 84, 7]


NAME = "engine_logprob"
TABLE = BUILTIN_COLUMNS.with_columns(declared(NAME, "output_token_logprobs", lambda e: e[0], CONTEXT))


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


def test_a_declared_column_arrives_in_a_trainer_micro_batch(tiny_model_dir, perturbed_model_dir):
    from megatron_tail.config import load_config
    from megatron_tail.train.engine.batch import pack_micro_batches
    from megatron_tail.train.engine.context_parallel import split_for_context_parallel
    from megatron_tail.train.rl.samples import build_samples

    name = NAME
    engine = LocalEngine(tiny_model_dir, dtype="float32", weight_version="0")
    sampling = SamplingConfig(n_samples=2, max_new_tokens=12, temperature=1.0, log_rho=-4.0, base_seed=5)
    results = generate_across_an_update(engine, PROMPT, sampling, perturbed_model_dir, TABLE)
    assert any(r.segments > 1 for r in results), "a partial rollout must join segments here"
    for r in results:  # parsed and joined as the built-in log-probs are
        assert r.columns[name] == r.columns["rollout_logprobs"] and len(r.output_ids) == 12

    single = episodes_to_batch(
        _episodes(results, False), [1.0, 0.0], correct_reward=1.0, elapsed_s=0.0, environment=False
    )
    multi = episodes_to_batch(_episodes(results, True), [0.0, 1.0], correct_reward=1.0, elapsed_s=0.0)
    for batch in (single, multi):
        for values, logprobs in zip(batch.column(name), batch.column("rollout_logprobs"), strict=True):
            assert len(values) == len(logprobs)
    mask = torch.tensor(multi.policy_mask[0])
    assert (~mask).sum() == 3 and torch.all(torch.tensor(multi.column(name)[0])[~mask] == CONTEXT)

    batch = select_samples(concat_batches([single, multi]), [0, 1, 2, 3])
    buffer = io.BytesIO()  # the rollout manager's checkpointed buffers: plain dicts, weights_only
    torch.save(dataclasses.asdict(batch), buffer)
    buffer.seek(0)
    batch = RolloutBatch.from_dict(torch.load(buffer, weights_only=True), TABLE)

    cfg = load_config(None, ["algorithm.group_size=2"])
    samples = build_samples(cfg, batch, TABLE).samples
    for s in samples:
        assert s.fields[name].dtype == torch.float32 and s.fields[name].shape == (len(s.response),)
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


def _reply(meta_extra: dict | None = None):
    meta = {"id": "p0-s0-seed1-a1", "finish_reason": {"type": "length"}, "weight_version": "0"}
    meta["output_token_logprobs"] = [[-0.5, 10, "a"], [-0.25, 11, "b"]]
    return {"output_ids": [10, 11], "meta_info": {**meta, **(meta_extra or {})}}


def test_a_reply_without_a_declared_column_is_malformed_naming_it():
    from megatron_tail.rollout.protocol import SampleKey, parse_generate_response

    key = SampleKey(0, 0, 1)
    cfg = SamplingConfig(max_new_tokens=2, log_rho=None)
    lacking = TABLE.with_columns(declared("entropy_x", "output_token_entropy"))  # a key the reply lacks
    with pytest.raises(MalformedResponseError, match=r"meta_info.output_token_entropy must hold one entry"):
        parse_generate_response(_reply(), [5], [key], cfg, 1, "http://h:1", table=lacking)
    (got,) = parse_generate_response(_reply(), [5], [key], cfg, 1, "http://h:1", table=TABLE)
    assert dict(got.columns) == {
        "rollout_logprobs": [-0.5, -0.25], "token_versions": ["0", "0"], NAME: [-0.5, -0.25]
    }  # fmt: skip
    bad = {"output_token_logprobs": [[-0.5, 10, "a"], []]}
    with pytest.raises(MalformedResponseError, match=r"output_token_logprobs\[1\] = \[\] is not a value of"):
        TABLE[NAME].parse(Reply(bad, [10, 11], 1, cfg, {"type": "stop"}, "0", "h"), {})
    aborted = Reply({}, [], 1, cfg, {"type": "abort"}, "0", "h")
    assert TABLE[NAME].parse(aborted, {}) == []


def test_a_table_refuses_a_name_twice_or_one_the_trainer_sets():
    with pytest.raises(ValueError, match=r"token columns \['rollout_logprobs'\] are declared twice"):
        BUILTIN_COLUMNS.with_columns(declared("rollout_logprobs", "x"))
    with pytest.raises(ValueError, match="shadow the trainer's own sample field"):
        BUILTIN_COLUMNS.with_columns(declared("advantages", "x"))
    assert NAME not in BUILTIN_COLUMNS and NAME in TABLE  # a table is a value: declaring changes no other
    with pytest.raises(KeyError, match="is not in the table"):
        BUILTIN_COLUMNS[NAME]


def test_a_column_with_hooks_of_its_own_needs_no_code_elsewhere():
    """A column whose value is not a list (here: the count of tokens and the sum of one meta entry's
    values, per stretch) rides through a partial rollout's join, an episode's observation and the batch by
    its hooks alone: what `routed_experts` needs, in miniature."""
    counted = TokenColumn(
        "counted",
        parse=lambda reply, _parsed: (len(reply.output_ids), float(sum(reply.meta["output_token_x"]))),
        join=lambda a, b: (a[0] + b[0], a[1] + b[1]),
        context=lambda _held, n: (n, 0.0),
        to_batch=lambda values: [torch.tensor([float(n), s]) for n, s in values],
        to_sample=lambda entry, shape: (
            {},
            {"counted": entry.expand(shape.prompt_len + shape.response_len, 2)},
        ),
    )
    table = ColumnTable((counted,))
    cfg = SamplingConfig(max_new_tokens=4, log_rho=None)
    first = table.parse(Reply({"output_token_x": [1, 2]}, [3, 4], 2, cfg, {"type": "abort"}, "0", "h"))
    then = table.parse(Reply({"output_token_x": [5]}, [6], 4, cfg, {"type": "stop"}, "0", "h"))
    episode = first.then(then).with_context(3)
    assert episode["counted"] == (6, 8.0)
    (entry,) = table.to_batch([episode])["counted"]
    from megatron_tail.rollout.columns import SampleShape

    fields, positions = table.sample_fields({"counted": [entry]}, 0, SampleShape(2, 6, "sample 0"))
    assert (
        fields == {}
        and positions["counted"].shape == (8, 2)
        and positions["counted"][0].tolist() == [6.0, 8.0]
    )


def test_token_versions_become_ints_per_sample_or_no_column():
    """`token_versions` into a batch (each distinct version checked and converted once): ints where
    every version is an integer, no column where an engine sent another (its "default")."""
    to_batch = BUILTIN_COLUMNS[VERSIONS].to_batch
    values = [["3", "3", "4"], [], ["-1"], ["12"] * 5]
    got = to_batch(values)
    assert got == [[int(v) for v in sample] for sample in values] == [[3, 3, 4], [], [-1], [12] * 5]
    assert all(type(v) is int for sample in got for v in sample)
    assert to_batch([["3"], ["default"]]) is None
    assert to_batch([["3", None]]) is None  # a reply without a version
    assert to_batch([]) == []
