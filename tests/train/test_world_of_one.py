"""A trainer started as a plain process (no torchrun) is a world of one on an in-process store: no TCPStore
listens on every interface of the node (gloo's own pair listeners bind the address the host name resolves
to, or GLOO_SOCKET_IFNAME's: not this change's), and a second init after a destroy is again a world of one."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.slurm.conftest import REPO

PROBE = """
import ipaddress, json, os
import psutil
import torch
import torch.distributed as dist
from megatron_tail.train.engine.parallel import host_wait_group
from megatron_tail.train.run.loop import init_torch_distributed

assert init_torch_distributed() == 1
dist.destroy_process_group()  # e.g. `megatron-tail train` then `eval` in one Python session
world = init_torch_distributed()
t = torch.ones(3)
dist.all_reduce(t)
dist.barrier(group=host_wait_group())
pair = dist.new_group([0], backend="gloo")
dist.all_reduce(t, group=pair)
listening = [
    c.laddr.ip for c in psutil.Process().net_connections(kind="inet") if c.status == psutil.CONN_LISTEN
]
print(json.dumps({
    "world": world, "sum": t.tolist(),
    "torchrun_vars": [v for v in ("RANK", "WORLD_SIZE") if v in os.environ],
    "wildcard": [ip for ip in listening if ipaddress.ip_address(ip).is_unspecified],
}))
"""


def test_a_plain_process_is_a_world_of_one_with_no_store_on_every_interface():
    torchrun = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    env_free = {k: v for k, v in os.environ.items() if k not in torchrun}
    proc = subprocess.run(
        [sys.executable, "-c", PROBE], cwd=REPO, env=env_free, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen["world"] == 1 and seen["sum"] == [1.0, 1.0, 1.0] and seen["torchrun_vars"] == []
    # Before: torch's env rendezvous hosted a TCPStore on every interface ("0.0.0.0" / "::").
    assert seen["wildcard"] == [], seen
