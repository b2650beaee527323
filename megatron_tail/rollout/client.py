"""Async `/generate` client over several SGLang servers (or one router), with exactly-once samples.

Every sample has a stable `SampleKey` (prompt index, sample index, seed). One request carries the n
samples of one prompt; a request that fails (connection error, timeout, HTTP 5xx, a sample aborted by
a weight-update pause) is retried, on another healthy server when there is one, with the *same* keys
and seeds; a request whose sampling support overflowed the servers' mask cap is generated again with
fresh seeds under the same keys, and counted (`SupportOverflowError`; `SupportOverflowsExhausted` when every
attempt overflowed). Each answer must carry its sample's `rid` with the attempt (`parse_generate_response`),
so a request's samples come back complete, in key order, or not at all.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import aiohttp

from megatron_tail.rollout import json_body
from megatron_tail.rollout.columns import BUILTIN_COLUMNS, ColumnTable
from megatron_tail.rollout.http_session import engine_session
from megatron_tail.rollout.occupancy import EngineOccupancy
from megatron_tail.rollout.processor import DVPLogitProcessor
from megatron_tail.rollout.protocol import (
    MalformedResponseError,
    RequestRejectedError,
    ResponseTooLargeError,
    RetryableServerError,
    RolloutError,
    SampleAbortedError,
    SampleKey,
    SampleResult,
    SamplingConfig,
    build_generate_payload,
    parse_generate_response,
    sample_keys,
    sample_seed,
)
from megatron_tail.utils.net import base_urls

logger = logging.getLogger(__name__)


class NoHealthyServerError(RolloutError):
    """No server passed a health check within the client's `unhealthy_wait_s`."""


class ServerHTTPError(RetryableServerError):
    """The server answered HTTP 5xx (`http_status`)."""

    def __init__(self, message: str, http_status: int):
        super().__init__(message)
        self.http_status = http_status


class RequestTimedOutError(RetryableServerError):
    """A request took longer than `request_timeout_s`."""


class ServerEndedError(RetryableServerError):
    """A request failed because its server's process ended (`RolloutClient.server_ended`); not retried."""

    def __init__(self, url: str, how: str):
        self.url, self.how = url, how
        super().__init__(f"the server on {url} {how}")


SUPPORT_OVERFLOW = "Sampling support exceeds --sampling-mask-max-tokens"
"""How SGLang 0.5.23's HTTP 400 begins when one token's realised support exceeded the mask cap (status
OVERFLOW, `batch_result_processor.get_sampling_mask_finish_reason`): flashinfer keeps every tie at the
top-k cutoff, so a support can be larger than top_k."""


class SupportOverflowError(RetryableServerError):
    """The server aborted the request because a token's sampling support exceeded its mask cap. It says
    nothing against the server: the group is generated again with fresh seeds (it is that random draw,
    not the request, that overflowed) and counted in `ClientStats.support_overflows`; when every attempt
    overflows, `SupportOverflowsExhausted`. `message` is the server's (SGLang's) text."""

    def __init__(self, url: str, message: str):
        self.message = message
        super().__init__(f"{url}/generate: {message}")


class SupportOverflowsExhausted(RolloutError):
    """Every attempt of a request overflowed the servers' mask cap, each with fresh seeds. Not retryable: a
    first token's support depends on the prompt alone, so a rerun overflows again; the settings must change
    (a larger cap, a smaller top_k). `message` is the server's last answer."""

    def __init__(self, prompt_index: int, attempts: int, last: SupportOverflowError):
        self.prompt_index, self.attempts = prompt_index, attempts
        self.message = last.message
        super().__init__(
            f"the samples of prompt {prompt_index} overflowed the servers' sampling-mask cap on all "
            f"{attempts} attempts, with fresh seeds each time; last: {last}"
        )


REPROBE_S = 10.0
"""How often servers marked unhealthy are probed again while others serve (`RolloutClient._pick_server`)."""


@dataclass(frozen=True)
class ClientConfig:
    """Transport settings of `RolloutClient`."""

    max_concurrency: int = 64
    """Requests (each = one prompt's n samples) in flight at once, over all servers."""
    request_timeout_s: float = 600.0
    """Time one request may take from when it is sent before it is abandoned and retried; a request waiting
    for one of the client's connections (`max_concurrency` + one per server) is not sent yet. Before, that
    wait counted: after a weight update aborted partial rollouts, each group's samples continued as requests
    of their own, queued behind the pool, and healthy servers were charged timeouts that failed the run."""
    health_timeout_s: float = 5.0
    """Time one `/health` probe may take."""
    max_attempts: int = 4
    """Attempts per request before the batch fails."""
    timeout_attempts: int = 2
    """Of those, attempts that may end in a timeout: each already cost `request_timeout_s`, so a server that
    accepts requests and never answers fails the batch after 2 × `request_timeout_s` (one retry, on another
    server when there is one), not 4 ×; connection errors and HTTP 5xx cost little and keep `max_attempts`."""
    retry_backoff_s: float = 0.5
    """Sleep before attempt k is `retry_backoff_s · (k - 1)`."""
    unhealthy_wait_s: float = 60.0
    """How long to keep re-probing when every server is unhealthy."""
    max_response_bytes: int = 64 * 1024 * 1024
    """Larger response bodies are rejected with `ResponseTooLargeError`."""
    prefix_affinity_slack: int | None = 4
    """A request whose prefix one server computed (`generate_group(prefix_on=...)`: an episode's next turn)
    goes to that server unless it has more than this many requests in flight beyond the least loaded healthy
    server; None: always the least loaded (`rollout.prefix_affinity_slack`)."""

    def __post_init__(self):
        for name in ("max_concurrency", "max_attempts", "timeout_attempts", "max_response_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int ≥ 1; got {value!r}")
        for name in ("request_timeout_s", "health_timeout_s", "unhealthy_wait_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0; got {getattr(self, name)!r}")
        if self.retry_backoff_s < 0:
            raise ValueError(f"retry_backoff_s must be ≥ 0; got {self.retry_backoff_s!r}")
        slack = self.prefix_affinity_slack
        if slack is not None and (isinstance(slack, bool) or not isinstance(slack, int) or slack < 0):
            raise ValueError(f"prefix_affinity_slack must be an int ≥ 0 or None; got {slack!r}")


@dataclass
class ClientStats:
    """Counters since the client was made: HTTP requests sent, retries after a server failed an attempt,
    failed attempts per server."""

    requests: int = 0
    retries: int = 0
    failures_by_server: dict[str, int] = field(default_factory=dict)
    support_overflows: int = 0
    """Requests regenerated because a token's sampling support exceeded the servers' mask cap
    (`SupportOverflowError`)."""
    prefix_requests: int = 0
    """Requests (an episode's turn, retries included in one) that named a server holding their prefix
    (`generate_group(prefix_on=...)`)."""
    prefix_hits: int = 0
    """Of those, the ones answered by that server."""


class RolloutClient:
    """Generate samples from SGLang-compatible servers.

    Args:
        server_urls: base URLs (`http://host:port`) of SGLang servers, local engines, or one router.
        config: transport settings.
        processor: serialized custom logit processor sent with every request; defaults to DVP's.
            Pass None to send none (then `SamplingConfig.log_rho` is ignored).
        server_ended: for servers whose process the caller owns (the local engine), URL → how that process
            ended ("was killed by SIGKILL") or None while it runs; may block briefly (it runs in a thread).
            A request that fails on an ended server is not retried, nor logged as an attempt: it raises
            `ServerEndedError` at once, for the caller to report the death in one line.
    Use as `async with RolloutClient(urls) as client: await client.generate_group(prompt, keys, sampling,
    partial=False)`: the one generation path (`service.episodes.episode_group` sends every request through
    it, `service.engines.Engines.generate`).
    """

    def __init__(
        self,
        server_urls: Sequence[str],
        config: ClientConfig | None = None,
        *,
        processor: str | None = DVPLogitProcessor.to_str(),
        server_ended: Callable[[str], str | None] | None = None,
        table: ColumnTable = BUILTIN_COLUMNS,
        occupancy: EngineOccupancy | None = None,
    ):
        self.urls = urls = base_urls(server_urls)
        self.table = table
        """The per-token columns the replies are parsed into (`rollout.columns`)."""
        self.config = config or ClientConfig()
        self.processor = processor
        self.server_ended = server_ended
        self.healthy = dict.fromkeys(urls, True)
        self.in_flight = dict.fromkeys(urls, 0)
        self.stats = ClientStats(failures_by_server=dict.fromkeys(urls, 0))
        self.occupancy = EngineOccupancy() if occupancy is None else occupancy
        """Sequences in flight over time (`read()` → the engines' idle fraction since the last read); one
        shared by the clients of the same engines (`Engines`: training's and greedy evaluation's) counts
        both."""
        self._session: aiohttp.ClientSession | None = None
        self._connections: asyncio.Semaphore | None = None
        """`/generate` requests hold one while sent (made with the session, on its event loop): their time
        limit starts once they have one. The session's own pool is unbounded, so a health probe never waits
        for a generation either."""
        self._reprobed = time.monotonic()
        self._reprobes: set[asyncio.Task] = set()

    async def __aenter__(self) -> RolloutClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        for task in list(self._reprobes):
            task.cancel()
        if self._session is not None:
            await self._session.close()
            self._session = None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = engine_session(limit=0)  # bounded by `_connections` (and the probes)
            self._connections = asyncio.Semaphore(self.config.max_concurrency + len(self.urls))
        return self._session

    async def check_health(self) -> dict[str, bool]:
        """Probe `GET /health` on every server; update and return `{url: healthy}`."""
        results = await asyncio.gather(*(self._probe(url) for url in self.urls))
        self.healthy = dict(zip(self.urls, results, strict=True))
        return dict(self.healthy)

    async def _probe(self, url: str) -> bool:
        try:
            timeout = aiohttp.ClientTimeout(total=self.config.health_timeout_s)
            async with self.session.get(f"{url}/health", timeout=timeout) as resp:
                return resp.status == 200
        except (TimeoutError, aiohttp.ClientError):
            return False

    async def generate_group(
        self,
        prompt: Sequence[int],
        keys: Sequence[SampleKey],
        sampling: SamplingConfig,
        *,
        partial: bool,
        log_rho: Callable[[], float | None] | None = None,
        prefix_on: str | None = None,
    ) -> list[SampleResult]:
        """The samples `keys` of one prompt, one request (with retries), in key order: the rollout manager's
        unit of work. With `partial`, a sample that a weight-update pause aborts (`/pause_generation` mode
        "abort") is continued from its tokens: prompt + tokens so far are sent again with the remaining
        `max_new_tokens` and a seed derived from (seed, tokens so far), until it stops or hits its length;
        the segments are joined, each token keeping the log-prob and version of the request that sampled
        it. Without `partial`, an aborted sample is generated again from the start.
        `log_rho` (adaptive ρ): the DVP log ρ in force, read when each continued segment is sent, so a
        segment after a weight update prunes at the ρ then in force (the first request uses
        `sampling.log_rho`; a retry resends its request unchanged).
        `prefix_on`: the server whose prefix cache holds most of `prompt` (the one that generated an
        episode's previous turn: SGLang's radix cache, `RadixCache.match_prefix` in
        srt/mem_cache/radix_cache.py, reuses the KV of a prefix it computed); the first request goes there
        within `ClientConfig.prefix_affinity_slack`. A continued segment goes to the least loaded server:
        the weight update that paused it flushed every server's cache (`flush_cache=True`, SGLang's
        `UpdateWeights*ReqInput` in srt/managers/io_struct.py)."""
        prompt = _check_prompt(keys[0].prompt_index if keys else 0, prompt)
        first = await self._request_with_retries(
            prompt, list(keys), sampling, allow_abort=partial, prefix_on=prefix_on
        )
        for result in first:
            result.log_rho = sampling.log_rho
        return list(await asyncio.gather(*(self._continue(r, sampling, log_rho) for r in first)))

    async def _continue(
        self, sample: SampleResult, sampling: SamplingConfig, log_rho: Callable[[], float | None] | None
    ) -> SampleResult:
        while sample.aborted:
            remaining = sampling.max_new_tokens - len(sample.output_ids)
            if remaining <= 0:  # aborted after its last token: it ended by length
                sample.finish_reason = {"type": "length", "length": sampling.max_new_tokens}
                break
            key = SampleKey(
                sample.key.prompt_index,
                sample.key.sample_index,
                sample_seed(sample.key.seed, len(sample.output_ids), sample.segments),
            )
            rest = dataclasses.replace(sampling, n_samples=1, max_new_tokens=remaining)
            rest = sample.columns.next_request(rest)  # only what is not held (MoE routes' rows)
            if log_rho is not None:
                rest = dataclasses.replace(rest, log_rho=log_rho())
            (segment,) = await self._request_with_retries(
                sample.prompt_ids + sample.output_ids, [key], rest, allow_abort=True
            )
            sample = join_segments(sample, segment)
        if sample.segments > 1:
            where = f"{sample.server_url}/generate sample {sample.key.rid} ({sample.segments} segments)"
            sample.columns.check_complete(len(sample.prompt_ids), len(sample.output_ids), where)
        return sample

    async def _request_with_retries(
        self, prompt, keys, sampling, allow_abort=False, prefix_on: str | None = None
    ) -> list[SampleResult]:
        last_error: Exception | None = None
        avoid: str | None = None
        timeouts = tried = overflows = 0
        if prefix_on is not None:  # a `SampleResult.server_url`: one of `self.urls` as given
            self.stats.prefix_requests += 1
        for attempt in range(1, self.config.max_attempts + 1):
            if timeouts >= self.config.timeout_attempts:
                break
            tried = attempt
            if attempt > 1:
                # a regeneration after an overflowed draw is counted in `support_overflows` alone: it says
                # nothing against the server
                self.stats.retries += not isinstance(last_error, SupportOverflowError)
                await asyncio.sleep(self.config.retry_backoff_s * (attempt - 1))
            url = await self._pick_server(avoid, prefix_on)
            sent = _reseeded(keys, overflows)
            payload = build_generate_payload(prompt, sent, sampling, self.processor, attempt)
            try:
                body = await self._post_generate(url, payload)
                results = parse_generate_response(
                    body, prompt, sent, sampling, attempt, url, allow_abort=allow_abort, table=self.table
                )
                self.stats.prefix_hits += prefix_on is not None and url == prefix_on
                if sent is keys:
                    return results
                return [dataclasses.replace(r, key=k) for r, k in zip(results, keys, strict=True)]
            except SupportOverflowError as e:  # the draw overflowed, not the server: no probe, no avoid
                last_error, overflows = e, overflows + 1
                self.stats.support_overflows += 1
                logger.warning("attempt %d of %s: %s; regenerating the group", attempt, keys[0].rid, e)
            except RetryableServerError as e:
                last_error, avoid = e, url
                timeouts += isinstance(e, RequestTimedOutError)
                self.stats.failures_by_server[url] += 1
                # a dead process drops or refuses the connection; a timeout means a live one did not answer
                # (stopped, or slow), for which waiting out the exit status's grace would only add delay
                if self.server_ended is not None and not isinstance(
                    e, (SampleAbortedError, RequestTimedOutError)
                ):
                    how = await asyncio.get_running_loop().run_in_executor(None, self.server_ended, url)
                    if how is not None:
                        raise ServerEndedError(url, how) from e
                logger.warning("attempt %d of %s failed on %s: %s", attempt, keys[0].rid, url, e)
                if not isinstance(e, SampleAbortedError):
                    self.healthy[url] = await self._probe(url)
        if overflows and overflows == tried:  # the settings, not the servers: say so, do not retry again
            raise SupportOverflowsExhausted(keys[0].prompt_index, tried, last_error) from last_error
        timed_out = (
            f" ({timeouts} timed out after request_timeout_s={self.config.request_timeout_s:g} s)"
            if timeouts
            else ""
        )
        raise RetryableServerError(
            f"samples of prompt {keys[0].prompt_index} failed {tried} attempts{timed_out}; last: {last_error}"
        ) from last_error

    def _reprobe_unhealthy(self) -> None:
        """Probe the servers marked unhealthy again in the background, at most every `REPROBE_S`: a failed
        attempt's probe marks its server unhealthy, and before, nothing probed it again while another server
        was healthy (until the next evaluation), so one transient failure took a server out of the run."""
        down = [u for u in self.urls if not self.healthy[u]]
        now = time.monotonic()
        if not down or now - self._reprobed < REPROBE_S:
            return
        self._reprobed = now
        for url in down:
            task = asyncio.ensure_future(self._reprobe(url))
            self._reprobes.add(task)
            task.add_done_callback(self._reprobes.discard)

    async def _reprobe(self, url: str) -> None:
        if await self._probe(url):
            self.healthy[url] = True
            logger.info("%s answers /health again: back among the servers requests go to", url)

    async def _pick_server(self, avoid: str | None, prefix_on: str | None = None) -> str:
        """The healthy server with the fewest requests in flight, other than `avoid` (the one the last attempt
        failed on) where there is another; `prefix_on` instead while it is among those and within
        `prefix_affinity_slack` of that load. Waits up to `unhealthy_wait_s` for a healthy server."""
        deadline = time.monotonic() + self.config.unhealthy_wait_s
        self._reprobe_unhealthy()
        while True:
            healthy = [u for u in self.urls if self.healthy[u]]
            preferred = [u for u in healthy if u != avoid] or healthy
            if preferred:
                url = min(preferred, key=lambda u: self.in_flight[u])
                slack = self.config.prefix_affinity_slack
                if (
                    slack is not None
                    and prefix_on in preferred
                    and self.in_flight[prefix_on] <= self.in_flight[url] + slack
                ):
                    return prefix_on
                return url
            if time.monotonic() > deadline:
                raise NoHealthyServerError(
                    f"no healthy server among {self.urls} after "
                    f"{self.config.unhealthy_wait_s:.0f} s of /health probes"
                )
            await asyncio.sleep(min(1.0, self.config.retry_backoff_s + 0.1))
            await self.check_health()

    async def _post_generate(self, url: str, payload: dict) -> object:
        self.stats.requests += 1
        self.in_flight[url] += 1  # counted while it waits for a connection too: the server's queue
        sequences = len(payload.get("rid") or [0])
        session = self.session
        connection = self._connections
        sent = False
        try:
            await connection.acquire()
            sent = True
            self.occupancy.add(sequences)
            timeout = aiohttp.ClientTimeout(total=self.config.request_timeout_s)
            async with session.post(f"{url}/generate", json=payload, timeout=timeout) as resp:
                raw = await _read_limited(resp, self.config.max_response_bytes, url)
                if resp.status >= 500:
                    raise ServerHTTPError(
                        f"{url}/generate answered HTTP {resp.status}: {_message(raw)}", resp.status
                    )
                if resp.status == 400 and _message(raw).startswith(SUPPORT_OVERFLOW):
                    raise SupportOverflowError(url, _message(raw))
                if resp.status != 200:
                    raise RequestRejectedError(
                        f"{url}/generate rejected the request (HTTP {resp.status}): {_message(raw)}"
                    )
        except TimeoutError as e:
            raise RequestTimedOutError(
                f"{url}/generate did not answer within request_timeout_s={self.config.request_timeout_s:g} s"
            ) from e
        except aiohttp.ClientError as e:
            raise RetryableServerError(f"{url}/generate failed: {type(e).__name__}: {e}") from e
        finally:
            self.in_flight[url] -= 1
            if sent:
                connection.release()
                self.occupancy.add(-sequences)
        try:
            return json_body.loads(raw)
        except ValueError as e:
            raise MalformedResponseError(f"{url}/generate returned invalid JSON ({e}): {raw[:200]!r}") from e


async def _read_limited(resp: aiohttp.ClientResponse, limit: int, url: str) -> bytes:
    length = resp.content_length
    if length is not None and length > limit:
        raise ResponseTooLargeError(
            f"{url}/generate response of {length} bytes exceeds max_response_bytes={limit}"
        )
    chunks, size = [], 0
    async for chunk in resp.content.iter_chunked(1 << 16):
        size += len(chunk)
        if size > limit:
            raise ResponseTooLargeError(f"{url}/generate response exceeds max_response_bytes={limit}")
        chunks.append(chunk)
    return b"".join(chunks)


def _message(raw: bytes, limit: int = 1000) -> str:
    """Error text of an SGLang error body (`{"error": {"message"}}`, `{"error"}`, `{"message"}`) or raw."""
    text = raw[:limit].decode("utf-8", errors="replace")
    try:
        body = json.loads(raw)
    except ValueError:
        return text
    if isinstance(body, dict):
        error = body.get("error", body)
        if isinstance(error, dict) and isinstance(error.get("message"), str):
            return error["message"]
        if isinstance(error, str):
            return error
    return text


def join_segments(first: SampleResult, then: SampleResult) -> SampleResult:
    """`first` (aborted) continued by `then` (a request on `first`'s prompt + tokens): one sample with
    `first`'s key and prompt, the tokens and per-token columns of both (each token keeps the log-prob and
    version of the request that sampled it; MoE routes: `then` was asked from the first position `first`
    does not hold, `columns.builtin`), `then`'s finish and version."""
    return dataclasses.replace(
        then,
        key=first.key,
        prompt_ids=first.prompt_ids,
        output_ids=first.output_ids + then.output_ids,
        columns=first.columns.then(then.columns),
        segments=first.segments + then.segments,
        log_rho=first.log_rho,
        text=None,
    )


def _reseeded(keys: list[SampleKey], overflows: int) -> list[SampleKey]:
    """The keys a request is sent with: `keys`, or after `overflows` ≥ 1 support overflows the same samples
    with seeds derived from (seed, overflows), so a seeded engine does not draw the overflowing tokens
    again. Results keep their original key (the sample's identity), as a continued segment does."""
    if not overflows:
        return keys
    # sample index −1: a stream no continued segment (`_continue`: segments ≥ 1) draws from
    return [SampleKey(k.prompt_index, k.sample_index, sample_seed(k.seed, overflows, -1)) for k in keys]


def regeneration_keys(prompt_index: int, sampling: SamplingConfig, attempt: int) -> list[SampleKey]:
    """The sample keys of a prompt's group when it is generated for the `attempt`-th time (the rollout
    manager's count of regenerations: dropped as stale, or in flight at a checkpoint and regenerated on
    resume). Attempt 0 is `sample_keys`; each later attempt gets fresh seeds derived from (seed, attempt),
    so a regenerated group does not replay the samples it replaces. A retry after an engine failure is
    not a new attempt: it reuses its keys (exactly-once)."""
    if isinstance(attempt, bool) or not isinstance(attempt, int) or attempt < 0:
        raise ValueError(f"attempt must be an int ≥ 0; got {attempt!r}")
    keys = sample_keys(prompt_index, sampling)
    if not attempt:
        return keys
    # sample index −2: a stream neither support-overflow reseeding (−1) nor continued segments (≥ 1) use
    return [SampleKey(k.prompt_index, k.sample_index, sample_seed(k.seed, attempt, -2)) for k in keys]


def _check_prompt(index: int, prompt: Sequence[int]) -> list[int]:
    ids = list(prompt)
    if not ids or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
        raise ValueError(f"prompt {index} must be a non-empty list of token ids (ints ≥ 0); got {ids[:10]!r}")
    return ids
