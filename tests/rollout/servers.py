"""Start `megatron-tail serve-local` subprocesses on free ports, and always tear them down."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

STARTUP_TIMEOUT_S = 90.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalServer:
    def __init__(self, model_dir: Path, log_dir: Path, *, dtype: str = "bfloat16", name: str = "server"):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_dir / f"{name}-{self.port}.log"
        self._log = open(self.log_path, "w")
        cmd = [sys.executable, "-m", "megatron_tail.cli", "serve-local", "--model-path", str(model_dir)]
        cmd += ["--port", str(self.port), "--dtype", dtype, "--num-threads", "1"]
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env)

    def wait_healthy(self, timeout_s: float = STARTUP_TIMEOUT_S) -> LocalServer:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"server exited with {self.proc.returncode}:\n{self.log_path.read_text()[-3000:]}"
                )
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=1) as resp:
                    if resp.status == 200:
                        return self
            except OSError:
                time.sleep(0.2)
        raise TimeoutError(
            f"{self.url} not healthy after {timeout_s} s:\n{self.log_path.read_text()[-3000:]}"
        )

    def kill(self) -> None:
        """SIGKILL, as a crashed node would die."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()
        self._log.close()


def start_servers(model_dir: Path, log_dir: Path, count: int, **kwargs) -> list[LocalServer]:
    servers = []
    try:
        for i in range(count):
            servers.append(LocalServer(model_dir, log_dir, name=f"server{i}", **kwargs))
        for server in servers:
            server.wait_healthy()
    except BaseException:
        for server in servers:
            server.stop()
        raise
    return servers
