"""What a failure while rank 0 waits for its engines is reported as (`Engines.run`).

- an outside failure (`EngineFailure`, exit 4: the last checkpoint is kept, a rerun resumes): the local engine
  ended (its signal or exit code) or is stopped, or an engine did not answer (transport errors, retries
  used up, a timeout), naming the engine, the limit `rollout.<key>` that applies and the local engine's log;
- an internal error (`LocalEngineError`, exit 1 with its traceback): an HTTP 500 from our own local engine,
  an unhandled exception in one of its handlers;
- a user error (exit 2): every attempt overflowed the engines' sampling-mask cap, which only the settings
  can change (`overflows_exhausted`);
- anything else (a user's error, a bug) as it was raised.
"""

from __future__ import annotations

import operator

import aiohttp

from megatron_tail.utils.errors import OutsideFailure, UserError

from ..client import NoHealthyServerError, SupportOverflowsExhausted
from ..local_engine.process import LocalEngineProcess
from ..protocol import RetryableServerError
from ..settings import TOP_K_HEADROOM


class EngineFailure(OutsideFailure):
    """An engine died, is stopped, or failed to answer: the message names it, how, the limit that expired and
    the local engine's log."""


class LocalEngineError(RuntimeError):
    """The local engine answered HTTP 500: an exception in one of its handlers or its batch (out of memory,
    a bug in it). An internal error (exit 1, with the traceback), not an outside failure; the message names
    its log, which holds the engine's own traceback."""


ENGINE_ERRORS = (
    RetryableServerError,
    NoHealthyServerError,
    TimeoutError,
    aiohttp.ClientConnectionError,
    aiohttp.ClientPayloadError,
)
"""What an engine that died or stopped answering makes the client raise (transport failures, not bugs; not
`aiohttp.InvalidURL`, a URL that the config refuses at load)."""

_UNHANDLED = 500
"""The HTTP status aiohttp (the local engine's server) answers when a handler raises."""


def classify(
    error: Exception, engine: LocalEngineProcess | None, rollout, waiting_for: str, limit: str
) -> Exception | None:
    """What `error`, raised while waiting for `waiting_for`, is reported as: an `EngineFailure` (outside)
    when the local engine `engine` ended or is stopped or an engine failed to answer, naming the local engine
    and its log; a `LocalEngineError` (internal) for an HTTP 500 from the live local engine, a bug in it. None
    when `error` is something else (a user's error, a bug) or is a remote engine's failure that already names
    it (`WeightSyncError`). `rollout`: the rollout settings (`RolloutSection`), `limit` its key."""
    if isinstance(error, (UserError, EngineFailure)):
        return None
    if engine is not None:
        how = engine.ended(grace_s=1.0)  # the dropped connection can come before the exit status
        if how is not None:
            return engine_ended(engine, how, waiting_for)
        if isinstance(error, (*ENGINE_ERRORS, OutsideFailure)) and engine.stopped():
            return EngineFailure(
                f"{engine.describe()} is stopped (SIGSTOP, SIGTSTP or a debugger) and did not answer within "
                f"{limit_text(rollout, limit)} while the trainer waited for {waiting_for}; its log: "
                f"{engine.log_path}"
            )
        if _http_status(error) == _UNHANDLED:
            return LocalEngineError(
                f"{engine.describe()} answered HTTP 500, an exception in it (out of memory, or a bug), "
                f"while the trainer waited for {waiting_for}; its traceback is in its log: {engine.log_path}"
            )
        failed = f"{waiting_for} failed on {engine.describe()}"
        if isinstance(error, ENGINE_ERRORS):
            return EngineFailure(
                f"{failed}: {_what(error)} ({limit_text(rollout, limit)}); its log: {engine.log_path}"
            )
        # a `WeightSyncError`: it names its own limit if one expired
        if isinstance(error, OutsideFailure):
            return EngineFailure(f"{failed}: {error}; its log: {engine.log_path}")
    if isinstance(error, ENGINE_ERRORS):
        return EngineFailure(f"{waiting_for} failed: {_what(error)} ({limit_text(rollout, limit)})")
    return None


def overflows_exhausted(error: SupportOverflowsExhausted, rollout) -> UserError:
    """Every attempt overflowed the engines' mask cap: the settings' doing, not the engines' (a rerun
    overflows again), so a user error naming the two keys and the headroom rule."""
    cap = rollout.sampling.mask_max_tokens
    return UserError(
        f"rollout.sampling.top_k={rollout.sampling.top_k} with rollout.sampling.mask_max_tokens={cap}: the "
        f"samples of prompt {error.prompt_index} overflowed the engines' sampling-mask cap on all "
        f'{error.attempts} attempts, with fresh seeds each time (the engine: "{error.message}"); a '
        "rerun repeats this (a first token's support depends on the prompt alone), since the ties at the "
        "top-k cutoff that SGLang's flashinfer sampler keeps need more than the "
        f"×{TOP_K_HEADROOM} headroom the config requires (rollout.settings.TOP_K_HEADROOM): raise "
        "rollout.sampling.mask_max_tokens or lower rollout.sampling.top_k"
    )


def engine_ended(
    engine: LocalEngineProcess, how: str, waiting_for: str, last_words: bool = False
) -> EngineFailure:
    """The local engine ended (`how`: its signal or exit code); with `last_words`, the log's last line
    too (while loading, that line is usually the engine's own error: a traceback's last line)."""
    ending = engine.last_log_line() if last_words else ""
    return EngineFailure(
        f"{engine.describe()} {how} while the trainer waited for {waiting_for}; its log: {engine.log_path}"
        + (f", ending {ending!r}" if ending else "")
    )


def limit_text(rollout, key: str) -> str:
    """`rollout.<key>=<value> s`: a limit of the engines, as the config names it (`key` may be dotted:
    "weight_sync.timeout_s")."""
    return f"rollout.{key}={operator.attrgetter(key)(rollout):g} s"


def _http_status(error: BaseException | None) -> int | None:
    """The HTTP status an engine answered with, on `error` or an error it was raised from
    (`ServerHTTPError`, `WeightSyncError`: `http_status`); None when no engine answered one."""
    for _ in range(8):  # a chain of a few wrappers (retries exhausted, a failed pause), never a cycle
        if error is None:
            return None
        if (status := getattr(error, "http_status", None)) is not None:
            return status
        error = error.__cause__
    return None


def _what(error: BaseException) -> str:
    """An error's message, or its type where it has none (aiohttp's TimeoutError)."""
    return str(error) or type(error).__name__
