"""An episode's later turns go to the server that generated its previous turn (whose prefix cache holds the
episode so far), within `rollout.prefix_affinity_slack` of the least loaded server: the choice itself, and
episodes over two real local engines."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from megatron_tail.rollout import ClientConfig, RolloutClient, SamplingConfig
from megatron_tail.rollout.client import ClientStats
from megatron_tail.rollout.envs import EpisodeLimits
from megatron_tail.rollout.envs.pool import EnvWorkers
from megatron_tail.rollout.errors import RetryableServerError
from megatron_tail.rollout.protocol import sample_keys
from megatron_tail.rollout.service.engines import Engines
from tests.rollout.envs.groups import ClientEngines, run_groups, short_turn_sampling, tokens_of

A, B, C = "http://a:1", "http://b:1", "http://c:1"


def _pick(in_flight, prefix_on, *, slack=4, avoid=None, unhealthy=()):
    client = RolloutClient([A, B, C], ClientConfig(prefix_affinity_slack=slack), processor=None)
    client.in_flight.update(in_flight)
    client.healthy.update(dict.fromkeys(unhealthy, False))
    return asyncio.run(client._pick_server(avoid, prefix_on))


@pytest.mark.parametrize(
    ("in_flight", "kwargs", "want"),
    [
        ({A: 4, B: 0, C: 1}, {}, A),  # 4 above the least loaded: within the slack
        ({A: 5, B: 0, C: 1}, {}, B),  # 5 above: the least loaded
        ({A: 1, B: 0, C: 1}, {"slack": 0}, B),
        ({A: 0, B: 0, C: 0}, {"slack": None}, A),  # off: the least loaded (A by order)
        ({A: 1, B: 0, C: 0}, {"slack": None}, B),
        ({A: 0, B: 2, C: 2}, {"unhealthy": (A,)}, B),  # an unhealthy server sheds its turns
        ({A: 0, B: 2, C: 1}, {"avoid": A}, C),  # the last attempt failed there
    ],
    ids=["within", "beyond", "slack0", "off-tie", "off", "unhealthy", "avoided"],
)
def test_a_turn_goes_to_its_prefix_server_within_the_slack(in_flight, kwargs, want):
    assert _pick(in_flight, A, **kwargs) == want


def test_a_request_without_a_prefix_server_goes_to_the_least_loaded():
    assert _pick({A: 1, B: 0, C: 1}, None) == B


class FailsOnce(RolloutClient):
    """The first attempt fails on its server, the next is answered (no HTTP: the transport is stood in)."""

    async def _post_generate(self, url, payload):  # noqa: ARG002
        self.sent = [*getattr(self, "sent", []), url]
        if len(self.sent) == 1:
            raise RetryableServerError(f"{url}: HTTP 503")
        return "body"

    async def _probe(self, url):  # noqa: ARG002
        return True


@pytest.mark.parametrize(("fails", "hits"), [(False, 1), (True, 0)], ids=["kept", "moved-by-a-failure"])
def test_a_turn_is_counted_once_and_kept_only_when_its_server_answered(monkeypatch, fails, hits):
    """Counted per turn, not per attempt: a turn that failed on its prefix server and was answered by
    another is one request and no hit (counted per attempt, it read 1 of 2)."""
    from megatron_tail.rollout import client as client_module

    monkeypatch.setattr(client_module, "parse_generate_response", lambda *_args, **_kwargs: ["sample"])
    client = (FailsOnce if fails else RolloutClient)([A, B], ClientConfig(retry_backoff_s=0), processor=None)
    if not fails:
        client._post_generate = lambda url, payload: asyncio.sleep(0, "body")  # noqa: ARG005
    sampling = SamplingConfig(n_samples=1, max_new_tokens=2, temperature=1.0, log_rho=None)
    keys = sample_keys(0, sampling)
    got = asyncio.run(client._request_with_retries([1, 2], keys, sampling, prefix_on=A))
    assert got == ["sample"]
    assert (client.stats.prefix_requests, client.stats.prefix_hits) == (1, hits)
    if fails:
        assert client.sent == [A, B]


def test_the_hit_fraction_is_logged_per_batch():
    engines = Engines.__new__(Engines)
    stats = ClientStats()
    engines.client = SimpleNamespace(
        stats=stats, occupancy=SimpleNamespace(read=dict), urls=[A, B], healthy={A: True, B: False}
    )
    engines.eval_client = SimpleNamespace(stats=ClientStats())
    engines._counted = {}
    stats.prefix_requests, stats.prefix_hits = 8, 6
    first = engines.client_metrics()
    assert first["rollout/prefix_affinity_hits"] == 0.75
    assert first["rollout/unhealthy_servers"] == 1.0  # B, until a probe answers again
    stats.prefix_requests, stats.prefix_hits = 10, 6  # this batch: 2 asked, none kept
    assert engines.client_metrics()["rollout/prefix_affinity_hits"] == 0.0
    assert "rollout/prefix_affinity_hits" not in engines.client_metrics()  # single-turn: none asked


class RecordingEngines(ClientEngines):
    """Each request's `prefix_on` and the server its samples came from."""

    def __init__(self, client):
        super().__init__(client)
        self.calls: list[tuple[str | None, list[str]]] = []

    async def generate(self, input_ids, keys, sampling, *, pruned, partial, prefix_on=None):
        results = await super().generate(
            input_ids, keys, sampling, pruned=pruned, partial=partial, prefix_on=prefix_on
        )
        self.calls.append((prefix_on, [r.server_url for r in results]))
        return results


@pytest.mark.parametrize("slack", [4, None], ids=["affine", "off"])
def test_three_turn_episodes_over_two_engines_stay_on_their_server(server_pair, tiny_model_dir, slack):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    sampling = short_turn_sampling(max_new_tokens=4, base_seed=5)
    tokens = tokens_of(tokenizer)
    urls = [s.url for s in server_pair]

    async def go():
        pool = EnvWorkers(2, timeout_s=30, timeout_name="data.reward_timeout_s")
        config = ClientConfig(request_timeout_s=60, prefix_affinity_slack=slack)
        try:
            async with RolloutClient(urls, config, processor=None) as client:
                engines = RecordingEngines(client)
                episodes = await run_groups(
                    engines, pool, "tests.rollout.envs.fault_envs:AlwaysContinues", [[5, 6, 7], [8, 9, 10]],
                    ["1", "2"], sampling, EpisodeLimits(max_turns=3, max_observation_tokens=64), tokens,
                    max_concurrency=4,
                )  # fmt: skip
                return episodes, engines.calls, client.stats
        finally:
            pool.close()

    episodes, calls, stats = asyncio.run(go())
    assert len(episodes) == 4 and all(e.turns == 3 for e in episodes)
    later = [(prefix_on, servers) for prefix_on, servers in calls if prefix_on is not None]
    assert len(later) == 4 * 2 and all(p in urls for p, _ in later)  # turns 2 and 3 of each episode
    assert stats.prefix_requests == 8
    kept = sum(servers == [prefix_on] for prefix_on, servers in later)
    assert stats.prefix_hits == kept  # off, the least loaded server is sometimes the prefix's too
    if slack is not None:  # 4 requests in flight at most: always within the slack
        assert kept == 8


def test_one_server_logs_no_hit_fraction():
    engines = Engines.__new__(Engines)
    stats = ClientStats(prefix_requests=3, prefix_hits=3)
    engines.client = SimpleNamespace(
        stats=stats, occupancy=SimpleNamespace(read=dict), urls=[A], healthy={A: True}
    )
    engines.eval_client = SimpleNamespace(stats=ClientStats())
    engines._counted = {}
    assert "rollout/prefix_affinity_hits" not in engines.client_metrics()


@pytest.mark.parametrize("value", [-1, True, 2.5])
def test_a_bad_slack_is_refused_naming_the_key(value):
    from megatron_tail.rollout.settings import RolloutSection
    from megatron_tail.utils.errors import UserError

    with pytest.raises(UserError, match=r"^rollout\.prefix_affinity_slack must be an int ≥ 0, or null "):
        RolloutSection(prefix_affinity_slack=value)
    with pytest.raises(ValueError, match=r"^prefix_affinity_slack must be an int ≥ 0 or None"):
        ClientConfig(prefix_affinity_slack=value)
