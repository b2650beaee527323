"""Multi-turn episodes (`rollout.env.name`) under the rollout manager, with partial rollouts and truncated
sampling: `RolloutService` runs its real manager, the one workflow (`episodes.episode_group`) with a real
environment worker, and `RolloutClient.generate_group` against a scripted fake of the client's request
method (no engine, no model). A weight update during a turn aborts it; the turn continues under the new
weights, and every policy token keeps the version and log-prob of the request that sampled it, every
environment token stays context, and the sample's staleness is its oldest policy token's."""

from __future__ import annotations

import tempfile
from types import SimpleNamespace

import pytest

from megatron_tail.config import load_config
from megatron_tail.rollout import RolloutClient
from megatron_tail.rollout.batch import rollout_metrics
from megatron_tail.rollout.columns import (
    BUILTIN_COLUMNS,
    LOGPROBS,
    SUPPORT,
    TOP_LOGPROBS,
    VERSIONS,
    TokenColumns,
)
from megatron_tail.rollout.envs.pool import EnvWorkers
from megatron_tail.rollout.protocol import SampleResult
from megatron_tail.rollout.service.engines import Engines
from megatron_tail.rollout.service.episodes import turn_key
from megatron_tail.rollout.service.managed import group_seeds
from megatron_tail.rollout.service.service import RolloutService
from megatron_tail.train.run.rollout_plan import plan_from
from megatron_tail.utils.ragged import Ragged

PROMPT = [1, 2]
ENV = "tests.rollout.envs.fault_envs:AlwaysContinues"
OBSERVATION = [90, 91]  # what the fake tokenizer encodes any observation to
TURN = [10, 11, 12]  # what every turn generates (one token per request segment, or all three)


def logprob(version: int, position: int) -> float:
    """The fake engine's log-prob of the token at `position` of a turn under weights `version`."""
    return -0.1 * (version + 1) - 0.01 * position


def support(token: int) -> list[int]:
    return [token, 40, 41]


class TurnEngine(RolloutClient):
    """Generates `TURN` for every sample of every request at the engines' current `version`. The first
    request of sample 0's second turn is aborted after one token, and the weights move to version 1
    meanwhile (a weight update's pause, `/pause_generation` mode abort); the client continues it."""

    def __init__(self):
        super().__init__(["http://turns:1"])
        self.version = 0
        self.sent: list[tuple[int, list[int], int, int]] = []  # (len input, sample indices, seed, version)

    async def _request_with_retries(self, prompt, keys, sampling, allow_abort=False, prefix_on=None):  # noqa: ARG002
        self.sent.append((len(prompt), [k.sample_index for k in keys], keys[0].seed, self.version))
        second_turn = len(prompt) == len(PROMPT) + len(TURN) + len(OBSERVATION)
        out = []
        for k in keys:
            abort = second_turn and k.sample_index == 0 and self.version == 0
            done = len(prompt) - len(PROMPT) - len(TURN) - len(OBSERVATION) if len(prompt) > 7 else 0
            ids = TURN[done : done + 1] if abort else TURN[done:]
            version = str(self.version)
            out.append(
                SampleResult(
                    key=k,
                    prompt_ids=list(prompt),
                    output_ids=ids,
                    finish_reason={"type": "abort" if abort else "stop"},
                    weight_version=version,
                    server_url="http://turns:1",
                    columns=TokenColumns(
                        BUILTIN_COLUMNS,
                        {
                            LOGPROBS: [logprob(self.version, done + p) for p in range(len(ids))],
                            TOP_LOGPROBS: [-0.05] * len(ids),
                            SUPPORT: Ragged.from_lists([support(t) for t in ids]),
                            VERSIONS: [version] * len(ids),
                        },
                    ),
                )
            )
            if abort:
                self.version = 1  # the weights are updated while the turn waits to continue
        return out


class Tokenizer:
    def get_vocab(self):
        return {}

    def decode(self, _ids, **_kw):
        return "turn"

    def __call__(self, _text, **_kw):
        return {"input_ids": list(OBSERVATION)}


def _engines(*overrides, score=None):
    """`RolloutService` without an engine or a model: `TurnEngine` answers, one real environment worker."""
    base = ["algorithm.group_size=2", "data.prompts_per_step=1", "rollout.env.max_turns=2"]
    base.append(f"run_dir={tempfile.mkdtemp()}")  # the manager records the prompts each step trains there
    cfg = load_config(None, [*base, "rollout.partial_rollouts=true", "rollout.max_concurrency=2", *overrides])
    plan = plan_from(cfg, vocab_size=100, context_length=1000)  # a dense model: no MoE routes
    client = TurnEngine()
    engines = Engines(
        cfg.rollout, ["http://turns:1"], client, client, model_path=plan.model_path, vocab_size=100,
        log_rho=plan.log_rho, reporting=plan.reporting,
    )  # fmt: skip
    e = RolloutService.assemble(
        cfg.rollout, plan, Tokenizer(), engines,
        score=score or (lambda completions, _answers: [float(i % 2) for i in range(len(completions))]),
        envs=EnvWorkers(1, timeout_s=60.0, timeout_name="data.reward_timeout_s"),
    )  # fmt: skip
    e.cfg = cfg  # the run's config, for the trainer's side of the checks below
    return e


def _stop(e: RolloutService) -> None:
    e.engines.stop_thread(e.manager)
    e.engines.loop.close()
    e.envs.close()


@pytest.fixture
def engines():
    e = _engines(
        "rollout.env.name=" + ENV,
        "rollout.max_staleness=2",
        "rollout.sampling.top_p=0.95",
        "rollout.sampling.top_k=20",
    )
    yield e
    _stop(e)


def test_a_turn_interrupted_by_a_weight_update_continues_and_every_token_keeps_its_version(engines):
    e = engines
    example = SimpleNamespace(prompt_ids=PROMPT, answer="a")
    e.start_manager(lambda _index: example, version=0, state=None)
    # rollout.max_concurrency counts episodes: 2 episodes of groups of 2 are one group at a time
    assert e.manager.max_in_flight == 1 and e._manager_sampling.slots._bound_value == 2
    batch = e.next_batch(0)  # the first group completed (sample 0's second turn crossed the update)

    assert len(batch) == 2 and batch.policy_mask is not None
    policy = [True] * 3 + [False] * 2 + [True] * 3
    assert batch.policy_mask == [policy, policy]  # environment tokens are context
    assert batch.response_ids == [TURN + OBSERVATION + TURN] * 2
    # sample 0: turn 0 under v0; its second turn's first token under v0, the rest under v1 after the
    # update; the observation takes the version of the policy token before it
    assert batch.column(VERSIONS)[0] == [0, 0, 0, 0, 0, 0, 1, 1]
    # behaviour log-probs: each policy token the log-prob of the request that sampled it; 0.0 at the
    # environment's tokens
    turn0 = [logprob(0, p) for p in range(3)]
    turn1 = [logprob(0, 0), logprob(1, 1), logprob(1, 2)]
    assert batch.column(LOGPROBS)[0] == pytest.approx([*turn0, 0.0, 0.0, *turn1])
    # the supports ride with their tokens: one row per response token, empty at the environment's
    rows = [r.tolist() for r in (batch.column(SUPPORT)[0].row(i) for i in range(8))]
    assert rows == [support(t) for t in TURN] + [[], []] + [support(t) for t in TURN]
    assert all(len(s) == len(r) for s, r in zip(batch.column(SUPPORT), batch.response_ids, strict=True))
    # the turn was continued from its tokens: input + the aborted segment's token, under the new weights
    continued = [s for s in e.engines.client.sent if s[0] == 8]
    assert continued and continued[0][1] == [0] and continued[0][3] == 1
    # first turns of the group's episodes in one request, with the single-turn keys' seeds
    first = [s for s in e.engines.client.sent if s[0] == len(PROMPT)]
    seed = turn_key(*group_seeds(e.cfg.seed, 0, 1), 0, 0).seed
    assert first[0][1] == [0, 1] and first[0][2] == seed
    # the sample's staleness is its oldest policy token's
    metrics = rollout_metrics(batch, policy_version=1)
    assert metrics["rollout/staleness_max"] == 1.0
    # sample 1's second turn went out before or after the update
    assert batch.column(VERSIONS)[1] in ([0] * 8, [0] * 5 + [1] * 3)
    assert metrics["rollout/turns_mean"] == 2.0
    assert metrics["rollout/support_size_mean"] == 3.0  # per policy token: observations have no support
    assert metrics["rollout/env_failures"] == 0.0

    # the trainer lays them out: environment tokens off the loss mask, each policy token's support at the
    # position that predicts it, empty rows elsewhere
    from megatron_tail.train import pack_micro_batches
    from megatron_tail.train.engine.forward import SAMPLING_SUPPORT_FIELD
    from megatron_tail.train.rl.samples import build_samples

    (mb,) = pack_micro_batches(build_samples(e.cfg, batch).samples, max_tokens=64)
    first = slice(len(PROMPT) - 1, len(PROMPT) - 1 + 8)  # sample 0's positions predicting its response
    assert mb.loss_mask[0, first].tolist() == policy
    laid = mb.fields[SAMPLING_SUPPORT_FIELD]
    assert [laid.row(r).tolist() for r in range(first.start, first.stop)] == rows


@pytest.fixture
def failing(tmp_path):
    """Engines whose environment fails the first episode of prompt 0 to step once (`fault_envs.FailsOnce`)."""
    e = _engines(
        "rollout.env.name=tests.rollout.envs.fault_envs:FailsOnce",
        "rollout.max_staleness=0",
        score=lambda completions, _answers: [0.0] * len(completions),
    )
    yield e, tmp_path / "marker"
    _stop(e)


def test_an_environment_failure_under_the_manager_regenerates_its_group_with_fresh_seeds(failing):
    """Counted in the batch's `rollout/env_failures`; the group runs again inside its unit of work with the
    next environment attempt's seeds, and a group the manager regenerates (attempt a) starts at environment
    attempt a · MAX_ENV_ATTEMPTS: no two attempts share seeds."""
    from megatron_tail.rollout.service.episodes import MAX_ENV_ATTEMPTS

    e, marker = failing
    examples = {1: SimpleNamespace(prompt_ids=PROMPT, answer=f"raise:{marker}")}
    fine = SimpleNamespace(prompt_ids=PROMPT, answer="fine")
    # a resumed checkpoint: prompt 0 was in flight, so it is regenerated first, as its attempt 1
    state = {"next_index": 1, "queued": [0], "admitted": 0, "wasted": 0, "base_version": 0, "buffer": []}
    state["attempts"] = [[0, 1]]
    e.start_manager(lambda index: examples.get(index, fine), version=0, state=state)
    base = [group_seeds(e.cfg.seed, index, 1)[0] for index in (0, 1)]  # one prompt per step: position 0
    first = e.next_batch(0)  # prompt 0, regenerated by the manager
    assert e.engines.client.sent[0][2] == turn_key(base[0], 0, 0, 0, attempt=MAX_ENV_ATTEMPTS).seed
    assert first.metrics["rollout/env_failures"] == 0.0
    e.after_weight_update(1)
    second = e.next_batch(1)  # prompt 1: its first attempt failed in the environment, the second trained
    seeds = [s[2] for s in e.engines.client.sent if s[0] == len(PROMPT)]
    assert seeds[1:] == [turn_key(base[1], 0, 0, 0).seed, turn_key(base[1], 0, 0, 0, attempt=1).seed]
    assert second.metrics["rollout/env_failures"] == 1.0
    assert second.rewards == [1.0, 1.0]  # FailsOnce's reward of the regenerated episodes


def test_environment_failures_since_the_last_batch_survive_a_checkpoint(failing):
    """A failure counted after the last batch (a group generated ahead, η ≥ 1, whose checkpointed samples a
    resume restores) is in the checkpoint's manager state and counts in the resumed run's next batch, as in
    the uninterrupted one; before, it died with the process (the resume audit: 10 failures logged as 8)."""
    from megatron_tail.rollout.envs.registry import EnvironmentError_
    from megatron_tail.rollout.service.service import PENDING_ENV_FAILURES

    e, _ = failing
    fine = SimpleNamespace(prompt_ids=PROMPT, answer="fine")
    e.start_manager(lambda _index: fine, version=0, state=None)
    e.engines.call(lambda: e._manager_sampling.failures.add(EnvironmentError_("a group ahead failed once")))
    state = e.manager_state()
    assert state[PENDING_ENV_FAILURES] == [1, 0]
    resumed = _engines(
        "rollout.env.name=tests.rollout.envs.fault_envs:FailsOnce",
        "rollout.max_staleness=0",
        score=lambda completions, _answers: [0.0] * len(completions),
    )
    try:
        resumed.start_manager(lambda _index: fine, version=0, state=state)
        assert resumed.next_batch(0).metrics["rollout/env_failures"] == 1.0
    finally:
        _stop(resumed)
