"""Start / stop `megatron-tail serve-local` subprocesses (the embedded default for laptops, CI, the demo)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from megatron_tail.rollout.launch import LocalEngineConfig, build_local_engine_command
from megatron_tail.utils.errors import signal_name
from megatron_tail.utils.net import reserve_port
from megatron_tail.utils.parent_watch import PARENT_PID_ENV

_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


class LocalEngineProcess:
    """One local engine subprocess; its stdout/stderr go to `log_path` (appended, so a resumed run keeps the
    earlier log). Use as a context manager, or `wait_healthy()` / `check_alive()` / `stop()`.

    The child runs in its own session (`start_new_session`): a Ctrl-C or a signal sent to the trainer's
    process group does not kill it mid-step; the trainer stops it. It is not a member of the trainer's
    torch.distributed world, so torchrun's rendezvous variables are removed from its environment, and
    `config.num_threads` also sets its OMP_NUM_THREADS. It dies with the process that started it
    (`utils.parent_watch`, through `MT_PARENT_PID`), even when that one is killed with SIGKILL; start it
    from a thread that lives as long as it should (the main thread).

    The port is held from before the child starts until it exits: `listen_socket` (`utils.net.
    reserve_port`, bound to the config's host and port), or one bound here (OSError when the port is
    taken), is inherited by the child, which listens on it once its model is loaded. Bound by the engine
    itself after loading, the port could go meanwhile to any socket the OS numbers (a connection, gloo's
    listeners) and the engine would exit "address already in use".
    """

    def __init__(
        self, config: LocalEngineConfig, log_path: str | Path, listen_socket: socket.socket | None = None
    ):
        if listen_socket is not None and (bound := listen_socket.getsockname()[1]) != config.port:
            raise ValueError(f"listen_socket is bound to port {bound}, the config to {config.port}")
        sock = listen_socket or reserve_port(config.host, config.port)
        try:
            self._start(config, log_path, sock)
        finally:
            sock.close()  # the child holds the port now (or nothing was started)

    def _start(self, config: LocalEngineConfig, log_path: str | Path, sock: socket.socket) -> None:
        self.config = config
        self.url = config.url
        self.log_path = Path(log_path)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "a")
        env = {
            **os.environ,
            "HF_HUB_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false",
            PARENT_PID_ENV: str(os.getpid()),
        }
        for var in _TORCHRUN_VARS:
            env.pop(var, None)
        if config.num_threads is not None:
            env["OMP_NUM_THREADS"] = str(config.num_threads)
        self.proc = subprocess.Popen(
            build_local_engine_command(config, python=sys.executable, listen_fd=sock.fileno()),
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
            pass_fds=(sock.fileno(),),
        )

    def describe(self) -> str:
        """Which engine this is, for messages: "the local engine on URL (pid N)"."""
        return f"the local engine on {self.url} (pid {self.proc.pid})"

    def ended(self, grace_s: float = 0.0) -> str | None:
        """How the process ended ("was killed by SIGKILL", "exited with code 1"), waiting up to `grace_s`
        for it to end; None while it runs. A connection it dropped can arrive before its exit status, hence
        the grace."""
        try:
            code = self.proc.wait(timeout=grace_s) if grace_s > 0 else self.proc.poll()
        except subprocess.TimeoutExpired:
            return None
        if code is None:
            return None
        if code < 0:  # Popen's way of saying "killed by signal -code"
            return f"was killed by {signal_name(-code)}"
        return f"exited with code {code}"

    def stopped(self) -> bool:
        """Alive but stopped (SIGSTOP, SIGTSTP, a debugger): the process cannot answer until continued."""
        import psutil

        try:
            return psutil.Process(self.proc.pid).status() in (
                psutil.STATUS_STOPPED,
                psutil.STATUS_TRACING_STOP,
            )
        except psutil.Error:
            return False

    def last_log_line(self, limit: int = 300) -> str:
        """The last non-blank line of the log (its engine's own last words, e.g. the error it exited with),
        shortened to `limit` characters; "" if there is none."""
        return last_line_of(self.log_path, limit)

    def check_alive(self) -> None:
        """RuntimeError with the log tail if the process has exited."""
        if self.proc.poll() is not None:
            raise RuntimeError(
                f"local engine on {self.url} exited with code {self.proc.returncode}; log tail:\n"
                f"{self._log_tail()}"
            )

    def wait_healthy(self, timeout_s: float = 120.0) -> LocalEngineProcess:
        """Block until `/health` answers 200; RuntimeError (with the log tail) if the process exits."""
        if answers_health(self.url, self.check_alive, timeout_s, interval_s=0.2):
            return self
        raise TimeoutError(f"local engine on {self.url} not healthy after {timeout_s} s:\n{self._log_tail()}")

    def kill(self) -> None:
        """SIGKILL: the way a node crashes."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=30)

    def stop(self, timeout_s: float = 15.0) -> None:
        """SIGTERM, then SIGKILL after `timeout_s`; closes the log."""
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.send_signal(signal.SIGCONT)  # a stopped engine handles the SIGTERM only once continued
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.kill()
        if not self._log.closed:
            self._log.close()

    def __enter__(self) -> LocalEngineProcess:
        return self.wait_healthy()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _log_tail(self, chars: int = 3000) -> str:
        self._log.flush()
        return self.log_path.read_text()[-chars:]


def last_line_of(path: Path, limit: int = 300) -> str:
    """The last non-blank line of the file `path` (read from its last 8 KiB), shortened to `limit`
    characters; "" if there is none or no file."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - 8192))
            lines = f.read().decode("utf-8", errors="replace").splitlines()
    except OSError:
        return ""
    line = next((x.strip() for x in reversed(lines) if x.strip()), "")
    return line if len(line) <= limit else line[: limit - 1] + "…"


def answers_health(url: str, check_alive, timeout_s: float, *, interval_s: float) -> bool:
    """Whether `url`/health answers 200 within `timeout_s`, asked every `interval_s`; `check_alive()` runs
    before each try and raises when the engine has ended (no waiting out the limit on a dead engine)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        check_alive()
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=1) as resp:
                if resp.status == 200:
                    return True
        except OSError:
            time.sleep(interval_s)
    return False


def start_local_engines(
    configs: list[LocalEngineConfig],
    log_dir: str | Path,
    listen_sockets: list[socket.socket] | None = None,
) -> list[LocalEngineProcess]:
    """Start every engine (on its socket of `listen_sockets`, `LocalEngineProcess`), then wait for all to be
    healthy; on any failure stop them all and re-raise."""
    engines: list[LocalEngineProcess] = []
    sockets = listen_sockets or [None] * len(configs)
    try:
        for cfg, sock in zip(configs, sockets, strict=True):
            log = Path(log_dir) / f"local-engine-{cfg.port}.log"
            engines.append(LocalEngineProcess(cfg, log, listen_socket=sock))
        for engine in engines:
            engine.wait_healthy()
    except BaseException:
        for engine in engines:
            engine.stop()
        raise
    return engines
