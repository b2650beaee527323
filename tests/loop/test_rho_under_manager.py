"""Adaptive ρ under the rollout manager: a ρ change between steps reaches the next requests the manager
sends (new groups and continued partial-rollout segments), and every sample carries the ρ it was drawn
with (`RolloutBatch.sampled_log_rho`, checkpointed with the manager's buffer, logged by `log_rho_metrics`).
`RolloutService` runs its real manager and `RolloutClient.generate_group` against a recording fake of the
client's request method: no engine, no model."""

from __future__ import annotations

import tempfile
import time
from types import SimpleNamespace

import pytest

from megatron_tail.config import load_config
from megatron_tail.rollout import RolloutClient
from megatron_tail.rollout.batch import RolloutBatch, log_rho_metrics
from megatron_tail.rollout.columns import BUILTIN_COLUMNS, LOGPROBS, TOP_LOGPROBS, VERSIONS, TokenColumns
from megatron_tail.rollout.manager import GroupResult, groups_to_batch
from megatron_tail.rollout.protocol import SampleResult, sample_seed
from megatron_tail.rollout.service.engines import Engines
from megatron_tail.rollout.service.managed import group_seeds
from megatron_tail.rollout.service.service import RolloutService
from megatron_tail.train.run.rollout_plan import plan_from
from megatron_tail.train.run.session import with_log_rho

INITIAL, LATER = -13.0, -10.5


class RecordingClient(RolloutClient):
    """Answers every request at once from the engines' current version (one token per request), recording
    (prompt index, log ρ sent, continued?) per request. With `abort_first`, a group's first request is
    aborted after its token, as a weight-update pause aborts it, and `on_abort` runs meanwhile."""

    def __init__(self, engines_version, abort_first=False, on_abort=None, index_of=None):
        super().__init__(["http://recording:1"])
        self.version = engines_version
        self.index_of = index_of or (lambda key: key.prompt_index)
        self.abort_first, self.on_abort = abort_first, on_abort
        self.sent: list[tuple[int, float | None, bool]] = []

    async def _request_with_retries(self, prompt, keys, sampling, allow_abort=False, prefix_on=None):  # noqa: ARG002
        continued = len(prompt) > 2
        self.sent.append((self.index_of(keys[0]), sampling.log_rho, continued))
        abort = self.abort_first and not continued
        if abort and self.on_abort is not None:
            self.on_abort()
        version = str(self.version())
        finish = {"type": "abort" if abort else "stop"}
        return [
            SampleResult(
                key=k,
                prompt_ids=list(prompt),
                output_ids=[5],
                finish_reason=finish,
                weight_version=version,
                server_url="http://recording:1",
                columns=TokenColumns(
                    BUILTIN_COLUMNS, {LOGPROBS: [-0.5], TOP_LOGPROBS: [-0.1], VERSIONS: [version]}
                ),
            )
            for k in keys
        ]


def _engines(overrides, **client_kw) -> RolloutService:
    cfg = load_config(
        None,
        [
            "algorithm.log_rho=auto",
            "algorithm.group_size=2",
            "data.prompts_per_step=2",
            f"run_dir={tempfile.mkdtemp()}",
            *overrides,
        ],
    )
    cfg = with_log_rho(cfg, INITIAL)  # as `RunSession` resolves "auto"
    plan = plan_from(cfg, vocab_size=100, context_length=1000)  # a dense model: no MoE routes
    # a request's group: the prompt-stream index whose first sample has this seed (a continued segment's
    # derived seed is no group's: its key's prompt position, which is the index in the first step)
    first_seeds = {sample_seed(*group_seeds(cfg.seed, i, 2), 0): i for i in range(64)}
    client = RecordingClient(
        lambda: e.manager.version if e.manager is not None else 0,
        index_of=lambda key: first_seeds.get(key.seed, key.prompt_index),
        **client_kw,
    )
    engines = Engines(
        cfg.rollout,
        client.urls,
        client,
        client,
        model_path=plan.model_path,
        vocab_size=100,
        log_rho=plan.log_rho,
        reporting=plan.reporting,
    )
    e = RolloutService.assemble(
        cfg.rollout,
        plan,
        SimpleNamespace(decode=lambda _ids, **_kw: "x"),
        engines,
        score=lambda completions, _answers: [float(i % 2) for i in range(len(completions))],
        envs=None,  # single-turn: one-turn episodes without an environment
    )
    return e


def _set_rho(e: RolloutService, log_rho: float) -> None:
    e.set_log_rho(log_rho)  # what `RunSession._use_log_rho` does on rank 0


def _stop(e: RolloutService) -> None:
    e.engines.stop_thread(e.manager)
    e.engines.loop.close()


def test_a_rho_change_between_steps_reaches_the_next_requests_and_samples_carry_their_rho():
    e = _engines(["rollout.max_staleness=2"])
    prompt = SimpleNamespace(prompt_ids=[1, 2], answer="a")
    e.start_manager(lambda _index: prompt, version=0, state=None)
    try:
        first = e.next_batch(0)  # (η + 1) · G = 6 groups admitted and sent at the initial ρ
        assert e.engines.client.sent == [(i, INITIAL, False) for i in range(6)]
        assert first.sampled_log_rho == [INITIAL] * 4
        assert log_rho_metrics(first, INITIAL) == {
            "rollout/sampled_log_rho_mean": INITIAL,
            "rollout/log_rho_lag_max": 0.0,
        }
        _set_rho(e, LATER)  # step 0's rule moved ρ; then the weight update admits G new groups
        e.after_weight_update(1)
        second = e.next_batch(1)
        assert e.engines.client.sent[6:] == [(6, LATER, False), (7, LATER, False)]
        # the groups it trains were generated ahead, at the old ρ: the step logs the lag
        assert second.sampled_log_rho == [INITIAL] * 4
        assert log_rho_metrics(second, LATER) == {
            "rollout/sampled_log_rho_mean": INITIAL,
            "rollout/log_rho_lag_max": pytest.approx(2.5),
        }
        # the buffer is checkpointed with each sample's ρ (once the 4 groups left have completed)
        deadline = time.monotonic() + 30
        while len((state := e.manager_state())["buffer"]) < 4 and time.monotonic() < deadline:
            time.sleep(0.05)
        kept = [GroupResult.from_state(g) for g in state["buffer"]]
        assert [g.index for g in kept] == [4, 5, 6, 7]
        assert groups_to_batch(kept).sampled_log_rho == [INITIAL] * 4 + [LATER] * 4
        e.after_weight_update(2)
        e.next_batch(2)
        e.after_weight_update(3)
        fourth = e.next_batch(3)  # groups 6 and 7, drawn at the new ρ: no lag
        assert fourth.sampled_log_rho == [LATER] * 4
        assert log_rho_metrics(fourth, LATER)["rollout/log_rho_lag_max"] == 0.0
    finally:
        _stop(e)


def test_a_continued_partial_segment_is_sent_at_the_rho_in_force_then():
    e = None

    def weight_update_meanwhile():  # the pause aborts the first segment; the step's rule moved ρ
        _set_rho(e, LATER)

    e = _engines(
        ["rollout.max_staleness=0", "rollout.partial_rollouts=true"],
        abort_first=True,
        on_abort=weight_update_meanwhile,
    )
    prompt = SimpleNamespace(prompt_ids=[1, 2], answer="a")
    e.start_manager(lambda _index: prompt, version=0, state=None)
    try:
        batch = e.next_batch(0)
        # group 0: first request at the initial ρ, aborted; its two samples continue at the new ρ;
        # group 1 is first sent after the change
        assert [x for x in e.engines.client.sent if x[0] == 0] == [
            (0, INITIAL, False),
            (0, LATER, True),
            (0, LATER, True),
        ]
        assert [x for x in e.engines.client.sent if x[0] == 1] == [
            (1, LATER, False),
            (1, LATER, True),
            (1, LATER, True),
        ]
        assert batch.response_ids == [[5, 5]] * 4
        # a sample carries the ρ of its first (oldest) tokens
        assert sorted(batch.sampled_log_rho) == [INITIAL, INITIAL, LATER, LATER]
    finally:
        _stop(e)


def test_without_dvp_samples_carry_no_rho_and_nothing_is_logged():
    batch = RolloutBatch(
        prompt_ids=[[1]],
        response_ids=[[2]],
        rewards=[1.0],
        correct=[True],
        truncated=[False],
        weight_versions=["0"],
        sampled_log_rho=[None],
        columns={LOGPROBS: [[-1.0]]},
    )
    assert log_rho_metrics(batch, None) == {}
    assert log_rho_metrics(batch, -13.0) == {}
    old = RolloutBatch.from_dict({k: v for k, v in vars(batch).items() if k != "sampled_log_rho"})
    assert old.sampled_log_rho is None  # a checkpoint from before the field


def test_rl_step_sets_the_next_rho_before_the_weight_sync_and_logs_the_samples_lag(monkeypatch):
    """The manager admits new groups at the weight sync: the next step's ρ must be in force by then."""
    from megatron_tail.config.schema import TrainSection
    from megatron_tail.train.run import loop

    calls = []
    batch = RolloutBatch(
        prompt_ids=[[1]] * 2,
        response_ids=[[2]] * 2,
        rewards=[1.0, 0.0],
        correct=[True, False],
        truncated=[False] * 2,
        weight_versions=["0"] * 2,
        sampled_log_rho=[-13.0, -12.0],
        columns={LOGPROBS: [[-1.0]] * 2},
    )

    class Session:
        cfg = SimpleNamespace(
            rollout=SimpleNamespace(max_staleness=2),
            train=TrainSection(steps=3, checkpoint_every=100),
        )
        trainer = SimpleNamespace(scheduler=None)
        sampling_log_rho = -11.5
        drain_s = 0.0
        nonfinite = SimpleNamespace(diverged=None)  # the updates stayed finite

        def rollout(self, _step):
            return batch

        def adapt_log_rho(self, metrics):
            calls.append(("adapt", metrics["dvp/safe_mass_min"]))
            return 0.0  # seconds its drain waited

        def sync_weights(self, version):
            calls.append(("sync", version))
            return 0.0

    monkeypatch.setattr(loop, "advance", lambda _scheduler: 1e-3)
    monkeypatch.setattr(loop, "_train_on", lambda *_a: ({"dvp/safe_mass_min": 0.75}, {}, 2))
    metrics, _, _ = loop.rl_step(Session(), 0, loop.Cadence(Session.cfg.train), SimpleNamespace(agreed=bool))
    assert calls == [("adapt", 0.75), ("sync", 1)]
    assert metrics["rollout/sampled_log_rho_mean"] == -12.5
    assert metrics["rollout/log_rho_lag_max"] == 1.5


@pytest.mark.parametrize(
    ("overrides", "want"),
    [
        (["algorithm.log_rho=-9"], -9.0),
        (
            ["algorithm.log_rho=-9", "algorithm.safe_set_on=raw_logits", "rollout.sampling.temperature=0.5"],
            -18.0,
        ),
        (["algorithm.log_rho=-inf"], None),
    ],
)
def test_the_sessions_sampling_log_rho_is_the_rule_the_engines_send(overrides, want):
    from megatron_tail.train.run.session import RunSession

    s = RunSession.__new__(RunSession)
    s.cfg = load_config(None, overrides)
    assert s.sampling_log_rho == want
