"""A weight update and a checkpoint while an environment call (a tool call) is in flight lose nothing: under
the rollout manager with partial rollouts the episode waits in its tool call across the update, its next
turn is sampled under the new weights, and the group trains once with every token's version and log-prob;
the checkpoint taken meanwhile lists the group as in flight, so a run resumed from it regenerates it (fresh
seeds) and trains it once too. Without partial rollouts the update waits for the tool call and the episode.
`RolloutService` with its real manager, the episode runner and four real environment workers; the engines
are a scripted fake of the client's request method (as in `test_episodes_under_manager`)."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest

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
from megatron_tail.rollout.service.episodes import MAX_ENV_ATTEMPTS, turn_key
from megatron_tail.rollout.service.managed import group_seeds, read_trained_prompts
from megatron_tail.utils.ragged import Ragged
from tests.loop.test_episodes_under_manager import (
    OBSERVATION,
    PROMPT,
    TURN,
    TurnEngine,
    _engines,
    _stop,
    logprob,
    support,
)

ENV = "rollout.env.name=tests.rollout.envs.fault_envs:BlocksOneCall"
SETTINGS = [
    "rollout.max_staleness=2",
    "rollout.sampling.top_p=0.95",
    "rollout.sampling.top_k=20",
    "rollout.max_concurrency=4",
]


class SteadyEngine(TurnEngine):
    """Generates `TURN` for every sample at the engines' current `version`, never aborting."""

    async def _request_with_retries(self, prompt, keys, sampling, allow_abort=False, prefix_on=None):  # noqa: ARG002
        self.sent.append((len(prompt), [k.sample_index for k in keys], keys[0].seed, self.version))
        return [
            SampleResult(
                key=k,
                prompt_ids=list(prompt),
                output_ids=list(TURN),
                finish_reason={"type": "stop"},
                weight_version=str(self.version),
                server_url="http://turns:1",
                columns=TokenColumns(
                    BUILTIN_COLUMNS,
                    {
                        LOGPROBS: [logprob(self.version, p) for p in range(len(TURN))],
                        TOP_LOGPROBS: [-0.05] * len(TURN),
                        SUPPORT: Ragged.from_lists([support(t) for t in TURN]),
                        VERSIONS: [str(self.version)] * len(TURN),
                    },
                ),
            )
            for k in keys
        ]


def _start(tmp_path, *overrides, state=None, version=0):
    """Engines whose prompt 1 is the one whose first tool call blocks until `tmp_path/release` exists."""
    e = _engines(ENV, *SETTINGS, *overrides)
    e.engines.client = e.engines.eval_client = SteadyEngine()  # the wait report reads both
    e.engines.client.version = version
    e.envs.close()
    # one worker per live episode (2 groups of 2): an episode is pinned to its worker, and only the blocked
    # call's episode may wait for it
    e.envs = EnvWorkers(4, timeout_s=60.0, timeout_name="data.reward_timeout_s")
    blocking = SimpleNamespace(prompt_ids=PROMPT, answer=str(tmp_path))
    quick = SimpleNamespace(prompt_ids=PROMPT, answer="")
    e.start_manager(lambda index: blocking if index == 1 else quick, version=version, state=state)
    return e


def _wait_for(path, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.01)


def _wait_until(condition, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def _train_until(e, index, first_step, batches):
    """Take batches from step `first_step` on (a weight update after each) until prompt `index` trained."""
    for step in range(first_step, first_step + 6):
        batch = e.next_batch(step)
        batches[read_trained_prompts(e.cfg.run_dir)[step + 1][0]] = batch
        e.before_weight_update()
        e.engines.client.version = step + 1
        e.after_weight_update(step + 1)
        if index in batches:
            return
    raise AssertionError(f"prompt {index} was not trained within 6 steps")


@pytest.fixture
def paused_mid_call(tmp_path):
    """Step 0 trained prompt 0; prompt 1's episode is in its tool call across the weight update to
    version 1 and the checkpoint after it (`state`); then the call returns and the run goes on."""
    e = _start(tmp_path, "rollout.partial_rollouts=true", "data.prompts_per_step=1")
    try:
        batches = {0: e.next_batch(0)}  # prompt 0: prompt 2 is admitted only once it is done
        _wait_for(tmp_path / "calling")
        e.before_weight_update()  # partial rollouts: nothing waits for the tool call
        e.engines.client.version = 1
        e.after_weight_update(1)
        state = e.manager_state()  # the checkpoint after step 1, the tool call still in flight
        (tmp_path / "release").touch()
        _wait_until(lambda: 1 in e.manager.buffer)  # the episode's next turn, then the group, completed
        _train_until(e, 1, 1, batches)
        after = e.manager_state()
        yield e, state, batches, after
    finally:
        (tmp_path / "release").touch()
        _stop(e)


def test_a_weight_update_and_a_checkpoint_during_a_tool_call_lose_nothing(paused_mid_call, tmp_path):
    e, state, batches, after = paused_mid_call
    # the checkpoint lists the group as in flight (regenerated on resume with the same keys), not done
    assert 1 in state["queued"] and 1 not in [g["index"] for g in state["buffer"]]
    assert 1 not in [i for i, _ in state["attempts"]]
    # the live run: the episode came back from its tool call and finished its next turn under version 1
    group = batches[1]
    assert group.response_ids == [TURN + OBSERVATION + TURN] * 2
    policy = [True] * 3 + [False] * 2 + [True] * 3
    assert group.policy_mask == [policy, policy]
    # the episode in the tool call (either sample): its second turn sampled by the new weights; the other
    # episode's tool call returned at once, its second turn went out before or after the update
    crossing = [0] * 5 + [1] * 3
    versions = group.column(VERSIONS)
    assert crossing in versions and all(v in (crossing, [0] * 8) for v in versions)
    crossed = versions.index(crossing)
    turn0, turn1 = [logprob(0, p) for p in range(3)], [logprob(1, p) for p in range(3)]
    assert group.column(LOGPROBS)[crossed] == pytest.approx([*turn0, 0.0, 0.0, *turn1])
    rows = [r.tolist() for r in (group.column(SUPPORT)[crossed].row(i) for i in range(8))]
    assert rows == [support(t) for t in TURN] + [[], []] + [support(t) for t in TURN]
    # trained once each: the steps' prompts are distinct, and nothing trained is still owed
    trained = [p for s, ps in sorted(read_trained_prompts(e.cfg.run_dir).items()) for p in ps]
    assert len(trained) == len(set(trained)) and {0, 1} <= set(trained), trained
    untrained = [g["index"] for g in after["buffer"]] + after["queued"]
    assert sorted(trained + untrained) == list(range(after["next_index"])), (trained, after)
    assert 1 not in [i for i, _ in after["attempts"]]  # forgotten once trained

    # a run resumed from the checkpoint taken during the call: prompt 1 is regenerated with its seeds and
    # trained once; what the checkpoint held completed is trained as it was, nothing twice
    resumed = _start(
        tmp_path, "rollout.partial_rollouts=true", "data.prompts_per_step=1", state=state, version=1
    )
    try:
        again = {}
        _wait_until(lambda: 1 in resumed.manager.buffer)  # regenerated first: it was in flight
        _train_until(resumed, 1, 1, again)
        base, position = group_seeds(resumed.cfg.seed, 1, 1)
        first_turns = {s[2] for s in resumed.engines.client.sent if s[0] == len(PROMPT)}
        # the seeds of the lost attempt (nobody saw it): what the uninterrupted run drew
        assert turn_key(base, position, 0, 0).seed in first_turns
        assert turn_key(base, position, 0, 0, attempt=MAX_ENV_ATTEMPTS).seed not in first_turns
        # regenerated under the resumed weights
        regenerated = again[1].column(VERSIONS)
        assert all(len(v) == 8 and min(v) >= 1 for v in regenerated), regenerated
        later = [p for _, ps in sorted(read_trained_prompts(resumed.cfg.run_dir).items()) for p in ps]
        history = [0, *later]  # step 1 trained prompt 0 before the checkpoint
        assert len(history) == len(set(history)), history
        left = resumed.manager_state()
        untrained = [g["index"] for g in left["buffer"]] + left["queued"]
        assert sorted(history + untrained) == list(range(left["next_index"])), (history, left)
    finally:
        _stop(resumed)


def test_without_partial_rollouts_the_update_waits_for_the_tool_call_and_its_episode(tmp_path):
    e = _start(tmp_path, "rollout.partial_rollouts=false", "data.prompts_per_step=1")
    try:
        e.next_batch(0)
        _wait_for(tmp_path / "calling")
        threading.Timer(0.5, (tmp_path / "release").touch).start()
        started = time.monotonic()
        e.before_weight_update()  # drains: the tool call returns, the episode's last turn runs under v0
        assert time.monotonic() - started >= 0.3
        assert e.manager.in_flight == {} and 1 in e.manager.buffer
        assert e.manager.buffer[1].batch.column(VERSIONS) == [[0] * 8] * 2
        e.engines.client.version = 1
        e.after_weight_update(1)
        batches = {}
        _train_until(e, 1, 1, batches)
        trained = [p for _, ps in sorted(read_trained_prompts(e.cfg.run_dir).items()) for p in ps]
        assert len(trained) == len(set(trained)), trained
    finally:
        (tmp_path / "release").touch()
        _stop(e)
