"""`RewardScorer`: a run's reward applied to a batch, in one worker process, with a time limit per completion.

    score = RewardScorer("math", timeout_s=600)    # starts the worker (call from the main thread)
    rewards = score(completions, answers)          # from any thread; RewardTimeoutError after timeout_s
    score.close()                                  #   without a completion scored

Why a worker process, for every batch:
- a bound: a reward that never returns (an infinite loop, a regex that backtracks forever, a deadlock) is
  killed after `timeout_s` and the step fails with an error naming the reward and the limit, instead of
  blocking every trainer rank without a word. A thread cannot be killed; a process can. The limit runs from
  the last completion the worker reported scored (`PROGRESS_EVERY_S`), not from the batch's start: a group of
  many slow but bounded answers (math-verify stops each parse at 5 s; a policy that writes pathological
  LaTeX writes it in every sample of a group) takes as long as it takes, where a limit per batch ended the
  run once about 60 such answers shared a batch.
- math-verify's timeouts use `signal.alarm`, which only a main thread may set: the worker scores on its
  main thread whichever trainer thread asks (rank 0's rollout manager thread, `rollout.max_staleness` ≥ 1),
  and a pure-Python reward there does not take the GIL from rank 0's training.
The worker is spawned (no forked copy of the trainer's threads and CUDA state), ignores the job's stop
signals (the trainer decides what a stop means) and dies with the trainer (`utils.parent_watch`), so a
`kill -9` of the trainer leaves no worker behind. It leads a process group of its own, killed whole once it
is gone (`parent_watch.lead_reaped_group`): a process a reward or an environment tool starts (a sandbox)
dies with it too. Such a process inherits the ignored stop signals: end it with SIGKILL or a subprocess
timeout (`subprocess.run(timeout=...)` kills), not SIGTERM. After a timeout the worker is killed and a new
one starts with the next batch.

Environments of multi-turn rollouts (`rollout.env.name`) run in workers of the same kind for the same reasons,
a pool of their own (`megatron_tail.rollout.envs.pool`, `rollout.env.workers`), without a reward loaded
(`_Worker(None)`); `call` runs any handler in this scorer's worker.
"""

from __future__ import annotations

import dataclasses
import importlib
import multiprocessing
import multiprocessing.util
import os
import signal
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from megatron_tail.rewards.registry import RewardFunctionError, compute_rewards, load_reward_fn
from megatron_tail.utils.errors import UserError
from megatron_tail.utils.user_code import raised_at

DEFAULT_TIMEOUT_S = 600.0
"""`data.reward_timeout_s`'s default, per completion; see `DataSection.reward_timeout_s` for why."""

PROGRESS = "progress"
"""The tag of the worker's progress report, `(PROGRESS, completions scored)`, sent while it scores a batch."""

PROGRESS_EVERY_S = 0.1
"""How often the worker reports how many of a batch's completions it has scored, when that changed
(`_ProgressReports`): the limit runs from a report at most this long after the last completion scored."""


class RewardTimeoutError(UserError):
    """The reward function scored no completion of its batch within the time limit."""


@dataclass(frozen=True)
class Busy:
    """What the worker is doing now, for wait reports: `what` (e.g. "a batch of 4 completions"), since
    `since` (`time.monotonic()`); a batch's completions `scored` so far (None: a handler's call)."""

    what: str
    since: float
    scored: int | None = None


class RewardScorer:
    """`scorer(completions, answers) -> rewards` for the reward named `spec` (see `load_reward_fn`)."""

    busy: Busy | None = None
    """The request in the worker now (None when it is idle): a wait report names it."""

    def __init__(self, spec: str, timeout_s: float = DEFAULT_TIMEOUT_S):
        if not timeout_s > 0:
            raise UserError(f"data.reward_timeout_s must be > 0; got {timeout_s!r}")
        self.spec = spec
        self.timeout_s = float(timeout_s)
        self.fn = load_reward_fn(spec)  # fails here, by name, if the spec is bad
        self.name = getattr(self.fn, "__name__", spec)
        self._lock = threading.Lock()
        self._closed = False
        self._worker: _Worker | None = _Worker(spec)  # now, from the constructing (main) thread

    def __call__(self, completions: Sequence[str], answers: Sequence[str]) -> list[float]:
        n = len(completions)
        return self._request(
            ("score", list(completions), list(answers)),
            doing=f"a batch of {n} completions",
            timed_out=f"reward function {self.spec!r} did not score a completion",
            died=f"the reward worker scoring {self.spec!r} died",
            while_=f" while scoring a batch of {n} completions",
            error=RewardFunctionError,
            batch=n,
        )

    def call(
        self,
        handler: str,
        request: object,
        *,
        what: str,
        error: type[Exception] = UserError,
        timeout_error: type[Exception] = UserError,
        start: bool = True,
    ) -> object:
        """Run `handler` ("package.module:function", imported in the worker) on `request` in the same worker,
        under the same lock, within `timeout_s` per call (a call sends no progress reports):
        `handler(state, request)`, where `state` is a dict the worker keeps for that handler between requests
        (rollout environments keep their live episodes there: `rollout.envs.registry.handle_env_request`).
        The handler raises `UserError` with a message naming what failed; `call` raises it as `error`, and
        `timeout_error` after `timeout_s` (`what` says what did not answer). With `start=False`, nothing is
        sent when no worker runs (after a timeout killed it): a request that only releases state, whose state
        died with the worker; the worker also dies with the thread that starts it (`PR_SET_PDEATHSIG`), so a
        cleanup on a short-lived thread must not."""
        if not start and self._worker is None:
            return None
        return self._request(
            ("call", handler, request),
            doing=what,
            timed_out=f"{what} did not answer",
            died=f"the worker running {what} died",
            while_="",
            error=error,
            timeout_error=timeout_error,
        )

    def _request(
        self,
        message,
        *,
        doing: str,
        timed_out: str,
        died: str,
        while_: str,
        error,
        timeout_error=None,
        batch: int | None = None,
    ):
        """`message`'s reply from the worker. `batch`: a batch of that many completions, whose progress
        reports (`_Worker.request`) restart the time limit and update `busy`."""

        def progress(scored: int) -> None:
            self.busy = dataclasses.replace(self.busy, scored=scored)

        with self._lock:
            if self._closed:  # a thread a stale group left queued on the lock: no worker nothing would close
                raise RuntimeError(f"the reward scorer of {self.spec!r} is closed; {doing} was not scored")
            if self._worker is None:
                self._worker = _Worker(self.spec)
            worker = self._worker
            self.busy = Busy(doing, time.monotonic(), None if batch is None else 0)
            try:
                reply = worker.request(message, self.timeout_s, None if batch is None else progress)
            except TimeoutError as e:
                worker.kill()
                self._worker = None
                scored = [] if batch is None else [f"{self.busy.scored} of its batch of {batch} scored"]
                reason = timeout_reason(e, *scored)
                raise (timeout_error or RewardTimeoutError)(
                    f"{timed_out} within data.reward_timeout_s={self.timeout_s:g} s{reason}; "
                    "it was stopped. Make it faster or bounded, or raise data.reward_timeout_s"
                ) from None
            except EOFError:  # the worker died (killed, out of memory): start a new one next time
                # its own exit code (-9 of the OOM killer, -11, os._exit's), not our kill's
                worker.wait_exit(2.0)
                worker.kill()
                self._worker = None
                raise error(f"{died} (exit code {worker.exitcode}){while_}") from None
            finally:
                self.busy = None
        status, payload = reply
        if status == "user_error":
            raise error(payload)
        if status == "error":
            raise RuntimeError(f"reward worker failed:\n{payload}")
        return payload

    @property
    def worker_pid(self) -> int | None:
        """The worker process's pid (None after a timeout killed it, until the next batch)."""
        return None if self._worker is None else self._worker.pid

    def close(self) -> None:
        """Stop the worker. A batch being scored on another thread is not waited for: the worker is killed
        first, so that thread's call ends at once ("the worker ... died") and closing (a run failing, or a
        stop abandoning its step) takes a kill, not up to `data.reward_timeout_s` for the lock."""
        worker = self._worker
        self._closed = True
        if self.busy is not None and worker is not None:
            worker.kill_process()
        with self._lock:
            if self._worker is not None:
                self._worker.stop()
                self._worker = None


# The job's stop signals: Slurm delivers `scancel --signal` to every process of the step, and the trainer
# (not this worker) decides what to do with them; a worker killed by one would fail the rollout.
_STOP_SIGNALS = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2}


class _Worker:
    """One spawned process scoring batches sent over a pipe, one at a time (`spec` None: no reward loaded,
    only handlers' calls)."""

    def __init__(self, spec: str | None):
        spawn = multiprocessing.get_context("spawn")
        self._conn, child = spawn.Pipe(duplex=True)
        # blocked in this thread while the worker and multiprocessing's resource tracker start, so both
        # inherit the block and a stop signal in their first instants does not kill them
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)
        try:
            self._proc = spawn.Process(
                target=_serve, args=(spec, child, os.getpid()), name="reward-worker", daemon=True
            )
            self._proc.start()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        child.close()
        self.pid = self._proc.pid
        self._ready = False
        """The worker said it is ready (`_serve`'s first message), so it reads every request at once."""
        self._starting = "its worker was still starting" + (", importing the reward" if spec else "")
        """Why a request timed out before the worker was ready (`timeout_reason`)."""
        self._closing = threading.Lock()
        # killed at interpreter exit before multiprocessing's own exit hook runs (`_exit_function`: it
        # terminates a daemonic child with SIGTERM, which the worker ignores, then joins it without a
        # limit): a scorer nobody closed (a run failing at start-up) no longer hangs its process's exit
        multiprocessing.util.Finalize(self, self._proc.kill, exitpriority=10)

    @property
    def exitcode(self) -> int | None:
        return self._proc.exitcode

    def request(self, message: tuple, timeout_s: float, on_progress: Callable[[int], None] | None = None):
        """The worker's reply to `message` ("score" or "call", see `_serve`); TimeoutError after `timeout_s`,
        EOFError if the worker died (a worker killed mid-call resets the socket pair instead of closing it:
        ConnectionResetError, or BrokenPipeError on the send, are its death too). A "score" request's
        progress reports (`_answer`) go to `on_progress(completions scored)` and give the rest of the batch
        `timeout_s` again from each.

        The first request waits, within the same `timeout_s`, for the worker to say it is ready (its reward
        imported): a send has no time limit, and a batch larger than the socket's buffer (tens of MB of
        long-CoT completions) blocked in it for as long as the worker's start-up hung. Once ready, the
        worker reads each request whole before it works on it, so a send only waits for the reading."""
        deadline = time.monotonic() + timeout_s
        try:
            if not self._ready:
                if not self._conn.poll(timeout_s):
                    raise TimeoutError(self._starting)
                self._conn.recv()  # ("ready", None)
                self._ready = True
            self._conn.send(message)
            while True:
                if not self._conn.poll(max(deadline - time.monotonic(), 0.0)):
                    raise TimeoutError
                reply = self._conn.recv()
                if reply[0] != PROGRESS:
                    return reply
                deadline = time.monotonic() + timeout_s
                if on_progress is not None:
                    on_progress(reply[1])
        except (ConnectionResetError, BrokenPipeError) as e:
            raise EOFError(f"the worker's pipe: {e}") from None

    def wait_exit(self, timeout_s: float) -> None:
        """Give a worker whose pipe closed up to `timeout_s` to finish exiting, so `exitcode` is its own."""
        self._proc.join(timeout=timeout_s)

    def kill_process(self) -> None:
        """SIGKILL the worker and leave the pipe alone: a thread waiting in `request` (another thread than
        the caller's) then reads EOF and ends its call itself. Closing the pipe under that thread instead
        raced its own close (EBADF) or left its `poll` on a closed descriptor (a hang)."""
        if self._proc.is_alive():
            self._proc.kill()

    def kill(self) -> None:
        """Kill the worker and close the pipe (by the thread that uses it; idempotent)."""
        self.kill_process()
        self._proc.join(timeout=10)
        with self._closing:
            if not self._conn.closed:
                self._conn.close()

    def stop(self) -> None:
        try:
            self._conn.send(None)  # "no more batches"
        except OSError:
            pass
        self._proc.join(timeout=5)
        self.kill()


def timeout_reason(error: TimeoutError, *known: str) -> str:
    """ " (why)" for a `_Worker.request` timeout: what the caller `known`s, then why it timed out when it
    says (its worker still starting), joined by "; "; "" when neither."""
    why = [*known, *([str(error)] if str(error) else [])]
    return f" ({'; '.join(why)})" if why else ""


def _serve(spec: str | None, conn, parent_pid: int) -> None:
    """The worker's main: a process group of its own that dies with it (`lead_reaped_group`: a sandbox a
    reward or an environment tool starts is killed with the worker, after a timeout too), ignore the stop
    signals (so do the processes it starts: SIGKILL, or a subprocess timeout, stops those), die with the
    trainer, score batches until told to stop."""
    from megatron_tail.utils.parent_watch import die_with_parent, lead_reaped_group

    lead_reaped_group()  # first: while the worker has one thread
    for sig in _STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOP_SIGNALS)
    die_with_parent(parent_pid)
    fn = None if spec is None else load_reward_fn(spec)  # None: environments only (`rollout.envs.pool`)
    conn.send(("ready", None))  # from now on every request is read whole at once (`_Worker.request`)
    states: dict[str, dict] = {}  # handler → the state it keeps between requests (`RewardScorer.call`)
    while True:
        try:
            request = conn.recv()
        except EOFError:
            return
        if request is None:
            return
        conn.send(_answer(request, fn, spec, states, conn.send))


def _answer(request: tuple, fn, spec: str, states: dict, send: Callable[[tuple], None]) -> tuple[str, object]:
    """("score", completions, answers) → rewards, with progress reports `send` while it scores
    (`_ProgressReports`); ("call", "module:function", payload) → that handler's answer. Replies ("ok",
    value), ("user_error", message) or ("error", traceback)."""
    if request[0] == "call":
        _, handler, payload = request
        try:
            module, _, name = handler.partition(":")
            function = getattr(importlib.import_module(module), name)
            return ("ok", function(states.setdefault(handler, {}), payload))
        except UserError as e:
            return ("user_error", str(e))
        except Exception:
            return ("error", traceback.format_exc())
    _, completions, answers = request
    progress = _ProgressReports(send)
    try:
        return ("ok", compute_rewards(fn, completions, answers, on_scored=progress.scored))
    except RewardFunctionError as e:
        return ("user_error", str(e))
    except (Exception, SystemExit) as e:  # the user's function raised (or exited): name it, the sample, where
        return ("user_error", _raised_message(spec, e, answers))
    finally:
        progress.stop()


class _ProgressReports:
    """The worker's reports of a batch's progress: a thread sends `(PROGRESS, completions scored)` every
    `PROGRESS_EVERY_S` while that count moves, and none once `stop` returns (before the batch's reply, which
    a late report would otherwise precede). A thread, not a send per completion: the count a timeout names
    is the one reached, whether the next completion hangs or not, and a batch of thousands of fast rewards
    is not thousands of messages. A reward that hangs holding the GIL (a backtracking regex) stops the
    reports too: that is the hang the limit is for."""

    def __init__(self, send: Callable[[tuple], None]):
        self._send = send
        self._count = self._sent = 0
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="reward-progress", daemon=True)
        self._thread.start()

    def scored(self, count: int) -> None:
        self._count = count

    def _run(self) -> None:
        while not self._stopped.wait(PROGRESS_EVERY_S):
            with self._lock:
                if self._stopped.is_set():
                    return
                if (count := self._count) != self._sent:
                    self._send((PROGRESS, count))
                    self._sent = count

    def stop(self) -> None:
        with self._lock:
            self._stopped.set()
        self._thread.join()


def _raised_message(spec: str, error: Exception, answers: list[str]) -> str:
    where = raised_at(error)
    sample = getattr(error, "mt_sample", None)
    # the answer finds the row in the prompt file, which the batch's sample index does not
    on = f" on sample {sample} (answer {str(answers[sample])[:80]!r})" if sample is not None else ""
    if isinstance(error, SystemExit):  # not the worker's death: what the function did, and where
        return (
            f"reward function {spec!r} called sys.exit({error.code!r}){on}{where}; a reward returns a number"
        )
    return f"reward function {spec!r} raised {type(error).__name__}: {error}{on}{where}"
