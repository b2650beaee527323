"""The local engine's port is held from the moment it is chosen until the engine exits: the launcher binds it
(`utils.net.reserve_port`) and the engine, once its model is loaded, listens on the inherited socket
(`serve-local --listen-fd`). Before, the engine bound the port itself after loading, seconds after
`free_port` had named it, and CI saw it taken meanwhile ("address already in use", the whole-loop test)."""

from __future__ import annotations

import argparse
import errno
import os
import socket
import urllib.request

import pytest

from megatron_tail.rollout.launch import LocalEngineConfig
from megatron_tail.rollout.local_engine.cli import _inherited_socket
from megatron_tail.rollout.local_engine.process import LocalEngineProcess
from megatron_tail.rollout.weight_sync import DistributedWeightSync
from megatron_tail.utils.net import listen_on, reserve_port


def _bind_fails(port: int, host: str = "127.0.0.1", reuse: bool = False) -> bool:
    """Whether another socket fails to bind `port`; with `reuse`, one with SO_REUSEADDR, as servers bind."""
    with socket.socket() as other:
        if reuse:
            other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            other.bind((host, port))
        except OSError as e:
            assert e.errno == errno.EADDRINUSE, e
            return True
        return False


def test_a_reserved_port_is_taken_by_no_other_socket_and_refuses_connections_until_listened_on():
    held = reserve_port()
    port = held.getsockname()[1]
    try:
        assert _bind_fails(port) and _bind_fails(port, reuse=True)
        with socket.socket() as probe, pytest.raises(ConnectionRefusedError):  # as /health while loading
            probe.connect(("127.0.0.1", port))
    finally:
        held.close()
    assert not _bind_fails(port)


def test_a_given_port_is_held_against_servers_too_and_taken_again_at_once_after_its_last_run():
    """A given port (`rollout.local.port`, `rollout.weight_sync.master_port`) is bound with SO_REUSEADDR, so
    that a rerun takes it although the last run's connections wait in TIME_WAIT, and is listened on at once:
    with SO_REUSEADDR, only a listening socket keeps another server's socket off it."""
    server = reserve_port()  # the last run: served a connection and closed it first (TIME_WAIT on its side)
    port = server.getsockname()[1]
    listen_on(server).listen()
    with socket.create_connection(("127.0.0.1", port)):
        accepted, _ = server.accept()
        accepted.close()
    server.close()
    held = reserve_port("127.0.0.1", port)
    try:
        assert _bind_fails(port) and _bind_fails(port, reuse=True)
    finally:
        held.close()


def test_a_port_reserved_on_every_interface_is_held_on_the_loopback_too():
    """The weight group's rendezvous port (`rollout.weight_sync.master_port`) is held on every interface,
    where the trainer's TCPStore listens."""
    held = reserve_port("")
    try:
        assert _bind_fails(held.getsockname()[1], "127.0.0.1")
    finally:
        held.close()


def test_the_local_engine_holds_its_port_while_it_loads_and_serves_on_it(tiny_model_dir, tmp_path):
    held = reserve_port()
    port = held.getsockname()[1]
    config = LocalEngineConfig(model_path=str(tiny_model_dir), port=port, dtype="float32", num_threads=1)
    engine = LocalEngineProcess(config, tmp_path / "engine.log", listen_socket=held)
    try:
        assert held.fileno() == -1  # handed to the child: the launcher keeps no copy
        assert _bind_fails(port) and _bind_fails(port, reuse=True)  # from the child's start, loading or not
        engine.wait_healthy(timeout_s=300)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=30) as resp:
            assert resp.status == 200
        assert _bind_fails(port)
    finally:
        engine.stop()
    # released with the engine: a run restarted on this port (`rollout.local.port`) takes it at once, though
    # the connections it served linger in TIME_WAIT
    reserve_port("127.0.0.1", port).close()


def test_a_local_engine_without_a_socket_binds_its_configured_port_at_once(tiny_model_dir, tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        config = LocalEngineConfig(model_path=str(tiny_model_dir), port=taken.getsockname()[1])
        with pytest.raises(OSError) as raised:
            LocalEngineProcess(config, tmp_path / "engine.log")
    assert raised.value.errno == errno.EADDRINUSE
    assert not (tmp_path / "engine.log").exists()  # nothing started


def test_a_socket_of_another_port_is_refused():
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        config = LocalEngineConfig(model_path="/m", port=other.getsockname()[1] % 60000 + 1)
        with pytest.raises(ValueError, match="listen_socket is bound to port"):
            LocalEngineProcess(config, "/nonexistent/engine.log", listen_socket=other)
        args = argparse.Namespace(listen_fd=os.dup(other.fileno()), port=config.port)  # the CLI's to close
        with pytest.raises(SystemExit, match=f"is bound to port {other.getsockname()[1]}, not --port"):
            _inherited_socket(args)
    with pytest.raises(SystemExit, match="--listen-fd 987 is not an open socket"):
        _inherited_socket(argparse.Namespace(listen_fd=987, port=1))


def test_the_engine_and_the_weight_group_cannot_be_given_one_port():
    from megatron_tail.config import load_config
    from megatron_tail.utils.errors import UserError

    with pytest.raises(
        UserError, match=r"rollout.weight_sync.master_port must differ from rollout.local.port; got 30000$"
    ):
        load_config(None, ["rollout.local.port=30000", "rollout.weight_sync.master_port=30000"])


def test_the_weight_group_takes_a_port_or_a_socket_bound_to_one():
    with pytest.raises(ValueError, match="give master_port or listen_socket"):
        DistributedWeightSync(["http://127.0.0.1:1"], master_address="127.0.0.1")
    held = reserve_port("")
    try:
        sync = DistributedWeightSync(["http://127.0.0.1:1"], master_address="127.0.0.1", listen_socket=held)
        assert sync.master_port == held.getsockname()[1]
        with pytest.raises(ValueError, match="not both"):
            DistributedWeightSync(
                ["http://127.0.0.1:1"], master_address="h", master_port=5, listen_socket=held
            )
    finally:
        held.close()
