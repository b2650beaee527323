"""Timeouts sized for the work: the configured timeout reaches the world group and megatron's groups, and
ranks wait for a rank-0 phase longer than the collective timeout in a CPU barrier, not in a collective."""

from __future__ import annotations

import os
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from megatron_tail.config import load_config
from megatron_tail.utils.net import free_port
from tests.harness import run_distributed, run_forked

COLLECTIVE_TIMEOUT = timedelta(seconds=1)
RANK0_PHASE_S = 2.5  # longer than the collective timeout
# A rank's late arrival: longer than the TCPStore client's whole connect window under the collective timeout
# (a 1 s try, a random back-off of about a second, a second 1 s try: "retrying (try=0, ...)"), so the old
# start-up fails every time rather than sometimes.
ARRIVES_LATE_S = 5.0


def _fresh_world(
    rank: int, world: int, port: int, markers: Path, late: int = 0, wait_timeout: float = 60.0
) -> float:
    """Replace the harness's world group by one that `init_distributed` makes, with short timeouts (the
    rank-0 wait's `wait_timeout` seconds); rank `late` (-1: none) arrives at the new rendezvous
    ARRIVES_LATE_S after every other rank is in it. Returns the seconds this rank spent from then to a
    working group."""
    from megatron_tail.train.engine import parallel

    dist.barrier()
    dist.destroy_process_group()
    os.environ.update(
        {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank), "WORLD_SIZE": str(world)}
    )
    parallel._host_wait_group = None
    if rank == late:
        while len(list(markers.iterdir())) < world - 1:
            time.sleep(0.01)
        time.sleep(ARRIVES_LATE_S)  # e.g. still importing on a slow shared filesystem
    else:
        (markers / str(rank)).touch()
    started = time.monotonic()
    waits = timedelta(seconds=wait_timeout)
    parallel.init_distributed("gloo", timeout=COLLECTIVE_TIMEOUT, wait_timeout=waits)
    return time.monotonic() - started


def _wait_through_rank0_phase(rank, world, port, markers):
    from megatron_tail.train.engine.collectives import on_rank0
    from megatron_tail.train.engine.parallel import host_wait_group

    arrival = _fresh_world(rank, world, port, markers)
    phase_started = []  # rank 0's, on the machine's monotonic clock (one clock for every process)

    def rank0_phase():
        phase_started.append(time.monotonic())
        time.sleep(RANK0_PHASE_S)
        return 42

    value = on_rank0(rank0_phase, wait_group=host_wait_group())
    ended = time.monotonic()
    # the same phase without the CPU barrier: the rank waiting inside the broadcast hits the world group's
    # 1 s timeout (so that timeout is the one the group got)
    failed_without_barrier = None
    if rank == 1:
        try:
            on_rank0(lambda: None)
            failed_without_barrier = False
        except RuntimeError as e:
            failed_without_barrier = "timed out" in str(e).lower() or "timeout" in str(e).lower()
    else:
        try:
            on_rank0(lambda: time.sleep(RANK0_PHASE_S))
        except RuntimeError:
            pass  # rank 1 left; whatever gloo says here does not matter
    return value, arrival, phase_started, ended, failed_without_barrier


def test_ranks_wait_through_a_rank0_phase_longer_than_the_collective_timeout(tmp_path):
    results = run_distributed(_wait_through_rank0_phase, 2, free_port(), tmp_path, timeout=60)
    (v0, _, (phase_started,), _, _), (v1, arrival1, _, ended1, failed1) = results
    assert v0 == v1 == 42
    # rank 1 was in the rendezvous before rank 0 slept: arriving waits the wait timeout, where
    # `init_process_group` alone waited the 1 s collective timeout ("timed out ... trying to connect")
    assert arrival1 >= ARRIVES_LATE_S
    # rank 1 waited out rank 0's whole phase, longer than the collective timeout (measured from the phase's
    # start on the shared clock: rank 1's own start may trail it, which made a per-rank duration flaky)
    assert ended1 - phase_started >= RANK0_PHASE_S
    assert failed1 is True, "rank 1 should time out in the broadcast without the barrier"


def _held_up(rank, world, port, markers, told):
    """Rank 0's phase lasts until rank 1 has given up waiting for it (past the 2 s wait timeout)."""
    import contextlib
    import io

    from megatron_tail.train.engine.collectives import on_rank0
    from megatron_tail.train.engine.parallel import host_wait_group
    from megatron_tail.utils import errors
    from megatron_tail.utils.errors import OutsideFailure

    _fresh_world(rank, world, port, markers, late=-1, wait_timeout=2.0)
    said, raised = io.StringIO(), None

    def phase():
        deadline = time.monotonic() + 60
        while not told.exists() and time.monotonic() < deadline:
            time.sleep(0.05)

    with contextlib.redirect_stderr(said):
        try:
            on_rank0(phase, wait_group=host_wait_group(), what="the step's rollout")
        except OutsideFailure as e:
            raised = str(e)
            told.write_text(raised)
        except RuntimeError:
            pass  # rank 0, whose peer left: what gloo says here does not matter
    return raised, said.getvalue().replace(errors.PROG, "PROG")  # the command's name, which a test may set


def test_a_rank0_phase_past_the_wait_timeout_is_one_line_naming_the_phase_and_the_setting(tmp_path):
    """Before: gloo's "Timed out waiting 2000ms for recv operation" traceback, on every other rank."""
    (markers := tmp_path / "markers").mkdir()
    results = run_distributed(_held_up, 2, free_port(), markers, tmp_path / "told", timeout=60)
    line = (
        "the ranks waited for global rank 0 to finish the step's rollout within 0:00:02 "
        "(parallel.rank0_wait_timeout_minutes, or distributed_timeout_minutes where it is null), and not "
        "every rank came: rank 0 still in it, or another rank stuck before it. Rank 0's lines above say what "
        "it was waiting for; if the phase was slow but alive, raise the limit and rerun to resume from the "
        "last checkpoint"
    )
    assert results[1] == (line, f"PROG: error: {line}\n")  # said once, by rank 1
    assert results[0] == (None, "")


def _late_under_an_agent_store(rank, world, port, markers):
    os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "True"  # as torchrun sets it: every rank a store client
    arrival = _fresh_world(rank, world, port, markers, late=world - 1)
    dist.barrier()
    return arrival


def test_a_late_rank_under_torchruns_agent_store_is_waited_for(tmp_path):
    """Under torchrun the agent hosts the store before any rank starts, so connecting never waits; before, the
    early ranks' world group then timed out in gloo's connect after the 1 s collective timeout."""
    port = free_port()
    agent_store = dist.TCPStore("127.0.0.1", port, 3, is_master=True, wait_for_workers=False)
    arrivals = run_distributed(_late_under_an_agent_store, 3, port, tmp_path, timeout=60)
    assert min(arrivals[:2]) >= ARRIVES_LATE_S, arrivals
    del agent_store


def _never_complete(_rank, _world, port):
    from megatron_tail.train.engine import parallel
    from megatron_tail.utils.errors import OutsideFailure

    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0", "WORLD_SIZE": "2"})
    os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "True"
    try:
        parallel.init_distributed("gloo", timeout=COLLECTIVE_TIMEOUT, wait_timeout=timedelta(seconds=2))
    except OutsideFailure as e:
        return str(e)
    return None


def _never_complete_reported(_rank, _world, port):
    import contextlib
    import io

    from megatron_tail.train.engine import parallel
    from megatron_tail.utils.errors import OutsideFailure

    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0", "WORLD_SIZE": "2"})
    os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "True"
    parallel.ARRIVAL_REPORT_S = 0.5
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.suppress(OutsideFailure):
        parallel.init_distributed("gloo", timeout=COLLECTIVE_TIMEOUT, wait_timeout=timedelta(seconds=6))
    return out.getvalue()


def test_while_a_rank_is_missing_the_first_says_how_many_arrived():
    """Before: the ranks waited silently up to the longer timeout (120 minutes by default)."""
    port = free_port()
    agent_store = dist.TCPStore("127.0.0.1", port, 2, is_master=True, wait_for_workers=False)
    said = run_forked(_never_complete_reported, port, timeout=60).splitlines()
    assert len(said) >= 2, said  # every half second over 6 s: twice unless the process is starved 5 s
    assert said[0].startswith(f"start-up: 1 of 2 trainer ranks at the rendezvous 127.0.0.1:{port} after ")
    assert said[0].endswith(
        " s; waiting for the others up to 0:00:06 (the longer of parallel.distributed_timeout_minutes and "
        "rank0_wait_timeout_minutes)"
    )
    del agent_store


def test_a_rank_that_never_arrives_is_named_by_count_after_the_longer_timeout():
    port = free_port()
    agent_store = dist.TCPStore("127.0.0.1", port, 2, is_master=True, wait_for_workers=False)
    said = run_forked(_never_complete, port, timeout=60)
    assert said == (
        f"start-up: 1 of 2 trainer ranks reached the rendezvous at 127.0.0.1:{port} within 0:00:02 "
        "(the longer of parallel.distributed_timeout_minutes and rank0_wait_timeout_minutes); the others did "
        "not start, or cannot reach it"
    )
    del agent_store


def _megatron_timeout(_rank, _world):
    from megatron.core import parallel_state

    from megatron_tail.config.parallel import ParallelSection
    from megatron_tail.train.engine.parallel import init_parallel

    seen = {}
    original = parallel_state.initialize_model_parallel

    def recording(*args, **kwargs):
        seen.update(kwargs)
        return original(*args, **kwargs)

    parallel_state.initialize_model_parallel = recording
    try:
        init_parallel(ParallelSection(distributed_timeout_minutes=7.5))
    finally:
        parallel_state.initialize_model_parallel = original
    return seen["distributed_timeout_minutes"]


def test_megatron_groups_get_the_timeout():
    assert run_distributed(_megatron_timeout, 1) == [8]  # whole minutes, rounded up


def test_config_validates_and_defaults():
    cfg = load_config(None)
    assert cfg.parallel.distributed_timeout_minutes == 120.0
    assert cfg.parallel.wait_timeout_minutes == 120.0
    cfg = load_config(None, ["parallel.rank0_wait_timeout_minutes=240"])
    assert cfg.parallel.wait_timeout_minutes == 240
    with pytest.raises(Exception, match="distributed_timeout_minutes"):
        load_config(None, ["parallel.distributed_timeout_minutes=0"])
