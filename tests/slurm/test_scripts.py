"""Every shell script of slurm/ and tests/slurm/ is shellcheck-clean; the Python helper behind rl.sbatch
(config-get, torchrun-flags, wait-healthy) does what the script relies on. No cluster needed."""

from __future__ import annotations

import http.server
import json
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from tests.slurm.conftest import REPO

HELPER = REPO / "slurm" / "mt_slurm.py"
SCRIPTS = sorted(
    [
        *REPO.glob("slurm/*.sh"),
        *REPO.glob("slurm/*.sbatch"),
        *REPO.glob("tests/slurm/*.sh"),
        *REPO.glob("scripts/*.sh"),
    ],
)


def shellcheck() -> str | None:
    """Path of shellcheck, installing Debian's package when missing and possible; None otherwise."""
    found = shutil.which("shellcheck")
    if found or os.geteuid() != 0 or shutil.which("apt-get") is None:
        return found
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    apt = ["apt-get", "-o", "DPkg::Lock::Timeout=300"]
    subprocess.run([*apt, "update", "-qq"], env=env, capture_output=True, timeout=600)
    subprocess.run([*apt, "install", "-y", "-qq", "shellcheck"], env=env, capture_output=True, timeout=600)
    return shutil.which("shellcheck")


def test_there_are_scripts_to_check():
    names = {p.name for p in SCRIPTS}
    assert {"rl.sbatch", "lib.sh", "local_slurm.sh"} <= names, names


def test_shellcheck_is_clean():
    exe = shellcheck()
    if exe is None:
        pytest.skip("shellcheck is not installed and cannot be installed here (needs root and apt-get)")
    proc = subprocess.run([exe, *map(str, SCRIPTS)], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def helper(*args: str, timeout: float = 60, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(HELPER), *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **env},
    )


def test_config_get_prints_resolved_values_one_per_line(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("run_dir: runs/x\nmodel:\n  hf_path: m\nparallel:\n  tensor_parallel: 2\n")
    proc = helper(
        "config-get", str(config), "run_dir", "model.hf_path", "parallel.tensor_parallel",
        "data.eval_path", "rollout.server_urls", "cluster.sglang.extra_args", "--set", "run_dir=/abs/run",
        "--set", "rollout.server_urls=http://a:1,http://b:2", "--set", "rollout.engine=remote",
        "--set", "cluster.sglang.extra_args=[--json-model-override-args, '{\"a\": 1}']",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [
        "/abs/run", "m", "2", "", "http://a:1,http://b:2", "--json-model-override-args '{\"a\": 1}'",
    ]  # fmt: skip
    bad = helper("config-get", str(config), "run_dir", "--set", "parallel.tensor_paralel=2")
    assert bad.returncode == 2 and "tensor_parallel" in bad.stderr and len(bad.stderr.splitlines()) == 1


def test_torchrun_flags_agree_with_torchruns_own_parser():
    from torch.distributed.run import get_args_parser

    defined = {o for action in get_args_parser()._actions for o in action.option_strings}
    names = ("signals-to-handle", "shutdown-timeout", "nproc-per-node", "no-such-flag")
    proc = helper("torchrun-flags", *names)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == [f"--{n}" for n in names if f"--{n}" in defined]
    assert "--nproc-per-node" in proc.stdout and "--no-such-flag" not in proc.stdout


class _Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, *args):
        pass


def test_wait_healthy_exit_codes():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        assert helper("wait-healthy", "--timeout", "10", url).returncode == 0
        # a port nobody listens on: timeout (1), or 3 when the watched process (the servers' srun) is gone
        with socket_port() as dead_port:
            dead = f"http://127.0.0.1:{dead_port}"
            slow = helper("wait-healthy", "--timeout", "1", "--interval", "0.2", url, dead)
            assert slow.returncode == 1 and dead in slow.stdout
            gone = subprocess.Popen(["true"])
            gone.wait()
            watched = helper("wait-healthy", "--timeout", "30", "--watch-pid", str(gone.pid), dead)
            assert watched.returncode == 3, watched.stdout
    finally:
        server.shutdown()


class socket_port:
    """A free TCP port, held (bound, not listening) while in use so that nothing else takes it."""

    def __enter__(self) -> int:
        import socket

        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        return self.sock.getsockname()[1]

    def __exit__(self, *exc) -> None:
        self.sock.close()


@pytest.mark.parametrize(("flag", "backend"), [([], None), (["--deterministic"], "pytorch")])
def test_serve_local_maps_deterministic_to_the_pytorch_sampler(monkeypatch, flag, backend):
    """`rollout.deterministic` reaches local engines as SGLang's flag reaches SGLang: their sampler keeps
    exactly top_k ranks (the config's headroom rule relies on it), not flashinfer's ties."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("mt_slurm_under_test", HELPER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    started = []
    monkeypatch.setattr(os, "execv", lambda _path, cmd: started.append(cmd))
    argv = ["serve", "--backend", "local", "--model-path", "/m", "--port-base", "9000", "--host", "127.0.0.1"]
    module.main([*argv, *flag])
    (cmd,) = started
    if backend is None:
        assert "--sampling-backend" not in cmd  # the local engine's default: flashinfer, as SGLang on CUDA
    else:
        assert cmd[cmd.index("--sampling-backend") + 1] == backend


def test_check_ports_sees_a_server_on_any_address_of_the_node():
    """`mt_slurm.py check-ports` (run on every node by rl.sbatch): a port something listens on, on an
    address other than 127.0.0.1 (the servers bind the node's name), is taken; the rl.sbatch probe of
    127.0.0.1 alone missed it. The same check running at once on another node of the same host (a local
    test cluster) is not mistaken for a server."""
    import socket

    server = socket.socket()
    server.bind(("127.0.0.2", 0))  # a loopback address that is not 127.0.0.1
    server.listen()
    port = server.getsockname()[1]
    # as check-ports binds, at this moment on the other "node"
    checker = socket.socket(socket.AF_INET6 if socket.has_ipv6 else socket.AF_INET)
    checker.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if socket.has_ipv6:
        checker.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
    checker.bind(("::" if socket.has_ipv6 else "0.0.0.0", 0))
    free = checker.getsockname()[1]
    try:
        taken = helper("check-ports", str(port), "1")
        assert taken.returncode == 2, taken.stdout + taken.stderr
        assert (
            f"port {port} (the router, of this job's block {port}..{port}) is already in use on "
            in taken.stderr
        )
        assert "set MT_PORT_BASE to another block" in taken.stderr
        assert helper("check-ports", str(free), "1").returncode == 0
        for first, count in (("70000", "1"), ("65530", "16"), ("9000", "0")):  # a bad block: one line
            bad = helper("check-ports", first, count)
            assert bad.returncode == 2 and bad.stderr == (
                f"check-ports {first} {count}: expected a block of ports within 1..65535\n"
            ), bad.stderr
    finally:
        server.close()
        checker.close()


def test_check_ports_checks_only_the_share_of_the_block_its_node_uses():
    """rl.sbatch names each node's share (`--node NAME=OFFSETS`): a port held on a node that does not use it
    does not stop the job, one it uses does, named with what it is for; a node named twice checks both
    shares; a bad share, or a node missing from them, is one line."""
    import socket

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    port = server.getsockname()[1]
    first = port - 1  # the server holds the block's offset 1, the rendezvous; a block of 3 stays ≤ 65535

    def check(*shares: str) -> subprocess.CompletedProcess:
        return helper(
            "check-ports",
            str(first),
            "3",
            *(a for s in shares for a in ("--node", s)),
            SLURMD_NODENAME="here",
        )

    try:
        free = check("here=", "gpu2=1")
        assert free.returncode == 0, free.stderr  # the held port is gpu2's to use
        unnamed = check("gpu2=1,2")
        assert unnamed.returncode == 2, unnamed.stderr
        assert unnamed.stderr == "check-ports: this node, here, is not among --node's (gpu2)\n"
        for shares in (("here=1,2",), ("here=2", "gpu2=0", "here=1")):  # its own share; two roles on one node
            taken = check(*shares)
            assert taken.returncode == 2
            assert taken.stderr == (
                f"port {port} (the torchrun rendezvous, of this job's block {first}..{first + 2}) is already "
                "in use on here; set MT_PORT_BASE to another block\n"
            )
        for share in ("here=1,x", "here=3", "here=-1", "here=\u00b2", "=1", "here"):
            bad = check(share)
            assert bad.returncode == 2 and bad.stderr == (
                f"check-ports: --node {share}: expected NAME=OFFSETS, offsets of the block (0..2)\n"
            ), bad.stderr
    finally:
        server.close()


def test_an_sglang_server_gets_the_jobs_api_key_in_a_file_only_its_user_reads(monkeypatch, tmp_path):
    """`serve --key-dir` (rl.sbatch's, removed when the job ends), else a new temporary directory: a 0600
    file of SGLang flags in a 0700 directory; the key never on the command line."""
    import importlib.util
    import stat
    import tempfile

    spec = importlib.util.spec_from_file_location("mt_slurm_key_under_test", HELPER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    started = []
    monkeypatch.setattr(os, "execv", lambda _path, cmd: started.append(cmd))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    argv = ["serve", "--backend", "sglang", "--model-path", "/m", "--port-base", "9000", "--host", "::1"]
    monkeypatch.setenv("MT_ROLLOUT_API_KEY", "5ecret")
    module.main([*argv, "--key-dir", str(tmp_path / "keys")])
    module.main(argv)
    monkeypatch.delenv("MT_ROLLOUT_API_KEY")
    module.main(argv)
    (in_key_dir, in_temp, plain) = started
    for cmd, parent in ((in_key_dir, tmp_path / "keys"), (in_temp, None)):
        path = Path(cmd[cmd.index("--config") + 1])
        assert path.read_text() == 'api-key: "5ecret"\n' and not any("5ecret" in a for a in cmd)
        assert (
            stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE(path.parent.stat().st_mode) == 0o700
        )
        assert path.parent == parent if parent else path.parent.parent == tmp_path / "tmp"
    assert "--config" not in plain


def test_the_router_gets_the_jobs_api_key_from_its_environment_not_its_command_line(tmp_path):
    """`mt_slurm.py router` with the job's key: sglang-router's own entry point (`launch_router.main`, which
    parses `sys.argv[1:]`) sees `--api-key KEY` appended from the environment; the exec'd command line
    (`/proc/PID/cmdline`, what `ps` shows) and the helper's log line never hold the key. A stand-in
    `sglang_router` package records the argv: the real one (a 30 MB Rust wheel, the servers' environment
    only) is not installed here. Checked by hand against sglang-router 0.3.2 in front of a keyed local
    engine: 401 on `/workers` without the key, 200 with it, and the worker's model discovered."""
    package = tmp_path / "stand_in" / "sglang_router"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    record = tmp_path / "argv.json"
    (package / "launch_router.py").write_text(
        "import json, os, sys\n"
        "def main():\n"
        f"    open({str(record)!r}, 'w').write(json.dumps(\n"
        "        {'argv': sys.argv[1:],\n"
        "         'cmdline': open(f'/proc/{os.getpid()}/cmdline').read().split('\\0')}))\n"
        "if __name__ == '__main__':\n"
        "    main()\n"
    )
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "stand_in")}
    base = [sys.executable, str(HELPER), "router", "--port", "17000", "--host", "127.0.0.1"]
    base += ["http://n1:17003", "http://n2:17003"]
    for key in ("5ecret", ""):
        env["MT_ROLLOUT_API_KEY"] = key
        proc = subprocess.run(base, cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        seen = json.loads(record.read_text())
        tail = ["--worker-urls", "http://n1:17003", "http://n2:17003", "--host", "127.0.0.1"]
        assert seen["argv"][: len(tail)] == tail, seen
        if key:
            assert seen["argv"][-2:] == ["--api-key", key], seen
            assert not any(key in a for a in seen["cmdline"]) and key not in proc.stdout + proc.stderr
        else:  # no key for the job: none for the router, and its plain module entry
            assert "--api-key" not in seen["argv"] and "sglang_router.launch_router" in seen["cmdline"]
