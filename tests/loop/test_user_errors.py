"""User errors: refused at load with one line naming the culprit (config, run directory, engine output), and
the command line prints it once, without a traceback unless MT_TRACEBACK=1."""

from __future__ import annotations

import asyncio
import errno
import os
import re
import socket
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
import torch

from megatron_tail.config import ConfigError, load_config
from megatron_tail.train.run.run_dir_lock import RunDirLocked, claim_run_dir
from megatron_tail.utils.errors import EXIT_USER_ERROR, UserError
from tests.rollout.servers import generate_groups

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONWARNINGS": "ignore"}


def test_a_yaml_syntax_error_names_the_file_and_line(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("train:\n  steps: 3\n  seq_len: [1, 2\nseed: 1\n")
    with pytest.raises(ConfigError, match=rf"{path}: line 4, column 5: invalid YAML: expected ',' or ']'"):
        load_config(path)


def test_server_urls_with_the_local_engine_is_refused():
    with pytest.raises(ConfigError, match=r"rollout.server_urls is for engine: remote; with engine: local"):
        load_config(None, ["rollout.server_urls=[http://a:1]"])
    assert (
        load_config(None, ["rollout.engine=remote", "rollout.server_urls=[http://a:1]"]).rollout.engine
        == "remote"
    )


@pytest.mark.parametrize(
    ("url", "why"),
    [
        ("http://host:port", "it does not parse (Invalid URL: port can't be converted to integer)"),
        ("http://127.0.0.1:99999", "it does not parse (Port out of range 0-65535)"),
        ("http://:8000", "it does not parse (Invalid URL: host is required for absolute urls with the http"),
        ("http://", "it names no host"),
        ("localhost:8000", "it is not an http:// or https:// URL"),
        ("http://a:1?x=1", "it has a query or fragment"),
        ("http://a :1", "it contains whitespace"),
        # before: /generate/health answered 404 for rollout.startup_timeout_s, then exit 4 blaming the server
        ("http://a:1/generate", "it ends in /generate, an endpoint (give the server's base URL"),
        ("http://a:1/v1/", "it ends in /v1, an endpoint"),
    ],
)
def test_a_server_url_that_aiohttp_cannot_use_is_refused_at_load(url, why):
    """Before: `http://host:port` (and the others aiohttp raises `InvalidURL` for) passed the config, the
    health probes failed for rollout.startup_timeout_s, and the run exited 4 as if the engines had failed;
    now exit 2, naming the key and the URL."""
    start = "rollout.server_urls must hold the engines' base URLs, http(s)://HOST[:PORT]: "
    pattern = rf"{re.escape(start + why)}.*; got {re.escape(repr(url))}$"
    with pytest.raises(ConfigError, match=pattern):
        load_config(None, ["rollout.engine=remote", f"rollout.server_urls=[http://b:2, '{url}']"])


def test_a_url_that_is_no_servers_base_is_said_after_a_short_grace(monkeypatch):
    """Something answers, but not /health (a proxy's prefix, a copied sub-path): before, the probes went on
    for rollout.startup_timeout_s (300 s) and the run exited 4, "servers not healthy". Now after 10 s of
    404s (a proxy starting up may answer 404 a moment)."""
    import asyncio

    from aiohttp import web

    from megatron_tail.rollout import launch
    from megatron_tail.rollout.launch import wait_until_healthy
    from tests.rollout.servers import serving_app

    monkeypatch.setattr(launch, "NOT_FOUND_GRACE_S", 1.0)  # 10 s in a run

    async def probe():
        async with serving_app(web.Application()) as url:
            await wait_until_healthy([f"{url}/sglang"], timeout_s=300.0)

    with pytest.raises(
        UserError, match=r"/sglang/health answered HTTP 404 for 1 s: .*/sglang is not an SGLang server"
    ):
        asyncio.run(asyncio.wait_for(probe(), 60))


def test_the_same_server_url_twice_is_refused_at_load():
    """Before: the client's ValueError traceback (exit 1)."""
    with pytest.raises(ConfigError, match=r"rollout.server_urls names http://a:1 twice"):
        load_config(None, ["rollout.engine=remote", "rollout.server_urls=[http://a:1, http://a:1/]"])


@pytest.mark.parametrize("estimator", ["grpo", "rloo"])
def test_group_size_1_is_refused_for_grpo_and_rloo(estimator):
    """Before: GRPO with group_size 1 trained with loss and grad norm exactly 0 every step."""
    with pytest.raises(
        ConfigError, match=rf"group_size must be ≥ 2 for '{estimator}'.* every advantage .* is 0"
    ):
        load_config(None, ["algorithm.group_size=1", f"algorithm.advantage_estimator={estimator}"])


def test_reward_timeout_must_be_positive():
    with pytest.raises(
        ConfigError,
        match=r"data\.reward_timeout_s must be a finite number of seconds per completion in \(0, ",
    ):
        load_config(None, ["data.reward_timeout_s=0"])


def test_resume_false_on_a_run_directory_with_checkpoints_is_refused(tmp_path):
    """Before: the new run's checkpoints were pruned, the old ones kept, and the next run resumed the old."""
    step = tmp_path / "checkpoints" / "step_000010"
    step.mkdir(parents=True)
    (step / "metadata.json").write_text("{}")
    with pytest.raises(
        UserError, match=rf"run directory {tmp_path} already holds checkpoints \(step_000010\)"
    ):
        claim_run_dir(tmp_path, resume=False)
    claim_run_dir(tmp_path, resume=True).release()
    claim_run_dir(tmp_path / "fresh", resume=False).release()


_HOLDER = """
import sys, time
from megatron_tail.train.run.run_dir_lock import claim_run_dir
lock = claim_run_dir(sys.argv[1], resume=True)
print("locked", flush=True)
time.sleep(600)
"""


def test_a_second_trainer_on_a_run_directory_is_refused_naming_the_holder_and_a_dead_holder_does_not_block(
    tmp_path,
):
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(tmp_path)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        expected = rf"in use by another trainer \(PID {holder.pid} on host {socket.gethostname()}, since "
        with pytest.raises(RunDirLocked, match=expected):
            claim_run_dir(tmp_path, resume=True)
        holder.kill()  # a crash, or the node Slurm requeues the job from: the lock file stays behind
        holder.wait(timeout=30)
        assert (tmp_path / ".lock").is_file()
        claim_run_dir(tmp_path, resume=True).release()  # the dead holder's lock does not block the resume
    finally:
        if holder.poll() is None:
            holder.kill()


@pytest.mark.parametrize("code", [errno.ENOLCK, errno.EOPNOTSUPP])
def test_a_run_directory_on_a_file_system_without_locks_is_one_line_naming_it(tmp_path, monkeypatch, code):
    """NFS without its lock service answers `lockf` with ENOLCK: one line naming the file system and what
    to do, and nothing left open; before, the OSError's traceback."""
    import fcntl

    from megatron_tail.utils.errors import UserError

    def no_locks(_fd, _how):
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(fcntl, "lockf", no_locks)
    opened = len(os.listdir("/proc/self/fd"))
    with pytest.raises(
        UserError, match=r"\.lock cannot be locked: its file system \(\S+ at /[^)]*\) refuses "
    ):
        claim_run_dir(tmp_path, resume=False)
    assert len(os.listdir("/proc/self/fd")) == opened


def test_an_engine_token_id_outside_the_vocabulary_is_named():
    """Before: an embedding IndexError in the trainer, naming neither the sample nor the id."""
    import functools

    from megatron_tail.rollout.service.engines import Engines

    engines = SimpleNamespace(vocab_size=100, model_path="m")
    engines._check_ids = functools.partial(Engines._check_ids, engines)  # the check it delegates to
    good = SimpleNamespace(
        output_ids=[1, 99], server_url="http://e:1", key=SimpleNamespace(rid="p0-s0-seed1")
    )
    bad = SimpleNamespace(
        output_ids=[3, 100], server_url="http://e:1", key=SimpleNamespace(rid="p0-s1-seed2")
    )
    Engines._check_token_ids(engines, [good])
    with pytest.raises(
        UserError, match=r"returned token id 100 \(response position 1\) in sample p0-s1-seed2, "
    ):
        Engines._check_token_ids(engines, [good, bad])


def test_a_request_that_times_out_is_tried_twice_not_four_times():
    """Before: an engine that accepts and never answers cost request_timeout_s × 4 attempts."""
    from megatron_tail.rollout import ClientConfig, RolloutClient, SamplingConfig
    from megatron_tail.rollout.protocol import RetryableServerError

    async def main():
        async def accept_and_hang(reader, writer):
            data = await reader.read(65536)
            if b"/health" in data.split(b"\r\n", 1)[0]:
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
                await writer.drain()
                writer.close()
                return
            await asyncio.sleep(3600)

        server = await asyncio.start_server(accept_and_hang, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        config = ClientConfig(request_timeout_s=0.5, retry_backoff_s=0.0)
        client = RolloutClient([url], config, processor=None)
        started = time.monotonic()
        try:
            with pytest.raises(
                RetryableServerError, match=r"failed 2 attempts \(2 timed out after request_timeout"
            ):
                await generate_groups(client, [[1, 2]], SamplingConfig(n_samples=1, max_new_tokens=2))
        finally:
            await client.close()
            server.close()
        return time.monotonic() - started, client.stats.requests

    elapsed, requests = asyncio.run(main())
    # the attempts are counted; the time only shows the limit applied (a hang would be request_timeout_s's
    # default, 600 s): a bound near 2 × 0.5 s failed on a loaded host
    assert requests == 2 and elapsed < 60


def _cli(*args, env=None):
    return subprocess.run(
        [sys.executable, "-m", "megatron_tail.cli", *args], env=env or ENV, capture_output=True, text=True
    )


def test_a_user_error_on_the_command_line_is_one_line_and_mt_traceback_shows_the_traceback(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text("algorithm:\n  group_size: 1\n")
    proc = _cli("train", str(config))
    assert proc.returncode == EXIT_USER_ERROR
    assert proc.stdout == ""
    assert proc.stderr.splitlines() == [
        "megatron-tail train: error: invalid config in algorithm: algorithm.group_size must be ≥ 2 for "
        "'grpo': its advantages compare the responses to one prompt, and with one response per prompt every "
        "advantage (and the loss) is 0; got 1"
    ]
    debug = _cli("train", str(config), env={**ENV, "MT_TRACEBACK": "1"})
    assert debug.returncode == EXIT_USER_ERROR
    assert "Traceback (most recent call last)" in debug.stderr
    assert debug.stderr.rstrip().splitlines()[-1] == proc.stderr.rstrip()
    # under torchrun, ranks other than 0 stay quiet
    quiet = _cli("train", str(config), env={**ENV, "RANK": "1"})
    assert quiet.returncode == EXIT_USER_ERROR and quiet.stderr == ""


def test_serve_local_names_a_missing_model_directory(tmp_path):
    """Before: a Hugging Face "Repo id must be ..." message for a path that does not exist."""
    proc = _cli("serve-local", "--model-path", str(tmp_path / "nope"), "--port", "1")
    assert proc.returncode == EXIT_USER_ERROR
    assert proc.stderr.splitlines() == [
        f"megatron-tail serve-local: error: --model-path: model directory '{tmp_path / 'nope'}' not found"
    ]


def test_serve_local_names_a_taken_port_or_a_bad_host_before_loading(tiny_model_dir):
    """Before: aiohttp's `OSError: [Errno 98] ... address already in use` (or `socket.gaierror`) traceback,
    exit 1, once the model had loaded (minutes for a real one)."""
    from megatron_tail.utils.net import reserve_port

    with reserve_port() as held:
        port = held.getsockname()[1]
        held.listen()
        proc = _cli("serve-local", "--model-path", str(tiny_model_dir), "--port", str(port))
    assert proc.returncode == EXIT_USER_ERROR
    assert proc.stderr.splitlines() == [
        f"megatron-tail serve-local: error: --host 127.0.0.1 --port {port}: port {port} is in use on "
        "127.0.0.1; choose another"
    ]
    assert "serving" not in proc.stdout, "refused before the model loaded and the server announced itself"
    bad = _cli("serve-local", "--model-path", str(tiny_model_dir), "--port", "1", "--host", "999.1.1.1")
    assert bad.returncode == EXIT_USER_ERROR
    (line,) = bad.stderr.splitlines()
    assert line.startswith(
        "megatron-tail serve-local: error: --host 999.1.1.1 --port 1: cannot bind port 1 on 999.1.1.1 ("
    ), line


@pytest.mark.parametrize(
    ("flags", "message"),
    [  # before: ValueError / RuntimeError tracebacks from the engine or torch (exit 1), or a bare SystemExit
        (["--port", "70000"], "--port must be in 1..65535; got 70000"),
        (["--device", "gpu"], "--device must be cpu, cuda or cuda:N; got 'gpu'"),
        (["--logit-noise", "-1"], "--logit-noise must be a finite number ≥ 0 (0: off); got -1.0"),
        (["--logit-noise", "inf"], "--logit-noise must be a finite number ≥ 0 (0: off); got inf"),
        (["--num-threads", "0"], "--num-threads must be ≥ 1; got 0"),
        (["--max-batch", "0"], "--max-batch must be ≥ 1; got 0"),
    ],
)
def test_serve_local_refuses_a_bad_flag_by_name_before_loading(flags, message):
    from megatron_tail.rollout.local_engine.cli import check_serve_args, parse_serve_local

    with pytest.raises(UserError, match=f"^{re.escape(message)}$"):
        check_serve_args(parse_serve_local(["--model-path", "/m", "--port", "1", *flags]))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal of a CUDA device needs a host without one")
def test_serve_local_on_a_cuda_device_without_cuda_is_one_line(tiny_model_dir):
    proc = _cli("serve-local", "--model-path", str(tiny_model_dir), "--port", "1", "--device", "cuda:0")
    assert proc.returncode == EXIT_USER_ERROR
    assert proc.stderr.splitlines() == [
        "megatron-tail serve-local: error: --device cuda:0 needs CUDA, and this machine has none; "
        "use --device cpu"
    ]


def test_train_given_a_directory_says_a_config_file_is_expected(tmp_path):
    """Before: "config file '<dir>' does not exist" for a directory that exists."""
    with pytest.raises(ConfigError, match=rf"'{tmp_path}' is a directory; a YAML config file is expected"):
        load_config(tmp_path)
    proc = _cli("train", str(tmp_path), env=ENV)
    assert proc.returncode == EXIT_USER_ERROR
    assert proc.stderr.strip() == (
        f"megatron-tail train: error: '{tmp_path}' is a directory; a YAML config file is expected"
    )


def test_a_path_with_a_tilde_says_it_is_not_expanded():
    """`~/data/x.jsonl` in a YAML file reaches the run as written; "not found" alone left users puzzled."""
    from megatron_tail.data.prompts import check_prompt_file
    from megatron_tail.model.directory import check_model_dir

    hint = "; `~` is not expanded here: write the full path"
    with pytest.raises(UserError, match=re.escape("prompt file '~/nope.jsonl' does not exist" + hint)):
        check_prompt_file("~/nope.jsonl", "data.train_path")
    with pytest.raises(UserError, match=re.escape("model directory '~/models/nope' not found" + hint)):
        check_model_dir("~/models/nope")
    with pytest.raises(ConfigError, match=re.escape("config file '~/run.yaml' does not exist" + hint)):
        load_config("~/run.yaml")
    with pytest.raises(UserError, match=r"model directory '/nope' not found$"):  # no tilde: no hint
        check_model_dir("/nope")
