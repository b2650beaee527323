"""rl.sbatch runs `megatron-tail plan` before it starts anything on GPUs and stops with the plan's message
when the run does not fit; MT_SKIP_PLAN=1 skips it. The layout is the config's `cluster:` section, checked
against the allocation; the environment variables that carried it before are refused by name. Also: the
port block, the stop budget, SGLang's own Python, GPU ids and bind addresses of the helper."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.slurm.conftest import REPO, RL_SBATCH

QWEN3_8B = REPO / "tests/plan/configs/qwen3_8b"
EXAMPLE = "examples/qwen3_8b_grpo_dvp.yaml"


def _run(
    tmp_path: Path,
    *args: str,
    dry: bool,
    config: str | Path = EXAMPLE,
    gpu_mib: int | None = None,
    srun_then: str = "",
    **env_over: str,
) -> subprocess.CompletedProcess:
    """rl.sbatch outside Slurm with stand-ins: `scontrol` lists the nodes, `srun`/`squeue` record calls
    (`srun_then`: shell lines `srun` runs after recording); with `gpu_mib`, `nvidia-smi` reports 8 GPUs of
    that memory."""
    bindir = tmp_path / "bin"
    bindir.mkdir(exist_ok=True)
    smi = bindir / "nvidia-smi"
    if gpu_mib is not None:
        smi.write_text(f"#!/bin/sh\nfor i in 1 2 3 4 5 6 7 8; do echo {gpu_mib}; done\n")
    elif smi.exists():
        smi.unlink()
    calls = tmp_path / "calls"
    (bindir / "scontrol").write_text(
        '#!/bin/sh\nif [ "$1 $2" = "show hostnames" ]; then echo "$3" | tr , "\\n"; fi\n'
    )
    for name in ("srun", "squeue"):
        then = srun_then if name == "srun" else ""
        (bindir / name).write_text(f'#!/bin/sh\necho "{name} $*" >> {calls}\n{then}')
    for f in bindir.iterdir():
        f.chmod(0o755)
    where = ["--set", f"run_dir={tmp_path / 'run'}", "--set", f"model.hf_path={QWEN3_8B}"]
    env = {
        **os.environ,
        "PATH": f"{bindir}:{os.environ['PATH']}",
        "MT_ROOT": str(REPO),
        "MT_PYTHON": sys.executable,
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NODELIST": "gpu1,gpu2",
        "SLURM_GPUS_ON_NODE": "8",
        "MT_DRY_RUN": "1" if dry else "0",
        **env_over,
    }
    proc = subprocess.run(
        ["bash", str(RL_SBATCH), str(config), *where, *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    proc.srun_calls = (
        [c for c in calls.read_text().splitlines() if c.startswith("srun")] if calls.exists() else []
    )
    return proc


@pytest.mark.parametrize("var", ["MT_DRY_RUN", "MT_SKIP_PLAN", "MT_DEBUG", "MT_REQUEUE"])
def test_a_switch_that_is_neither_1_nor_0_is_refused_before_anything_starts(tmp_path, var):
    """Before: anything but 1 was off, so `MT_DRY_RUN=true` started the servers and the trainer."""
    proc = _run(tmp_path, dry=True, **{var: "true"})
    assert (
        proc.returncode == 1 and f"ERROR: {var}=true: expected 1 (on) or 0 (off)" in proc.stdout + proc.stderr
    )
    assert proc.srun_calls == []


def test_dry_run_prints_the_plan_and_the_new_settings(tmp_path):
    proc = _run(tmp_path, dry=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "trainer: TP=2 PP=1 DP=4, bf16" in out and "\nfits\n" in out
    assert "stop budget: 1800s before the time limit; torchrun --shutdown-timeout 1680s" in out
    assert "--shutdown-timeout=1680" in out
    assert f"sglang python: {sys.executable}" in out and f"--server-python {sys.executable}" in out
    # ports: 10000 + (4242 % 750) · 16 = 17872: below SGLang's 22000..29999 and the ephemeral range
    assert "--port-base 17875" in out and "--rdzv-endpoint=gpu2:17873" in out
    assert "--deterministic" not in out
    det = _run(tmp_path, "--set", "rollout.deterministic=true", dry=True)
    assert "--deterministic" in det.stdout
    # the local engines too (they map it to their PyTorch sampler, as SGLang does)
    local_engines = ("--set", "rollout.deterministic=true", "--set", "cluster.rollout_backend=local")
    local = _run(tmp_path, *local_engines, dry=True)
    assert "--backend local" in local.stdout and "--deterministic" in local.stdout


def test_the_layout_is_the_configs_and_checked_against_the_allocation(tmp_path):
    moe_servers = (
        "--set", "cluster.sglang.tp=4", "--set", "cluster.sglang.ep=2",
        "--set", "cluster.sglang.router=false",
        "--set", "cluster.sglang.extra_args=[--chunked-prefill-size, '8192']",
    )  # fmt: skip
    proc = _run(tmp_path, *moe_servers, dry=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "layout: rollout gpu1 (sglang, 2/node), trainer gpu2 (1 x 8, TP 2 PP 1)" in out, out
    assert "--tp 4 --ep 2 --dtype bfloat16 --extra-args=--chunked-prefill-size 8192" in out, out
    assert "router:" not in out and "--mem-fraction-static 0.85" in out  # the example's mem_fraction
    # the plan read the same section (through the same --set): EP on the dense 8B is refused by its key
    assert "plan: error: cluster.sglang.ep=2 (SGLang --ep-size) needs a mixture-of-experts model" in out, out
    # the allocation disagrees with the config: one line naming the key, nothing started
    wrong = _run(tmp_path, "--set", "cluster.nodes=3", dry=False)
    assert wrong.returncode == 1 and wrong.srun_calls == []
    assert "ERROR: cluster.nodes=3, but the job has 2 nodes (sbatch --nodes)" in wrong.stdout, wrong.stdout
    gpus = _run(tmp_path, dry=False, SLURM_GPUS_ON_NODE="4")
    assert "ERROR: cluster.gpus_per_node=8, but the job has 4 GPUs per node" in gpus.stdout, gpus.stdout
    # GPUs from Slurm alone (no cluster.gpus_per_node): the servers must still fit them
    slurm_gpus = ("--set", "cluster.gpus_per_node=null", "--set", "cluster.sglang.tp=2")
    crowded = _run(tmp_path, *slurm_gpus, "--set", "cluster.servers_per_node=8", dry=False)
    assert "ERROR: 8 servers x cluster.sglang.tp=2 need more than the node's 8 GPUs" in crowded.stdout
    assert crowded.returncode == 1 and crowded.srun_calls == []


def test_a_layout_variable_of_an_earlier_version_is_refused_by_name(tmp_path):
    proc = _run(tmp_path, dry=True, MT_SGLANG_TP="2")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert (
        "MT_SGLANG_TP=2 is no longer read: the run's layout is in its config; set cluster.sglang.tp there "
        "(or pass --set cluster.sglang.tp=...) and unset MT_SGLANG_TP"
    ) in proc.stderr, proc.stderr


def test_a_run_that_does_not_fit_stops_before_starting_anything(tmp_path):
    too_big = ["--set", "parallel.tensor_parallel=1", "--set", "train.max_tokens_per_micro_batch=65536"]
    proc = _run(tmp_path, *too_big, dry=False)
    assert proc.returncode == 1
    assert "megatron-tail plan: this run does not fit (rc 1)" in proc.stdout
    assert "largest term: activations" in proc.stdout
    assert proc.srun_calls == []  # no server, router or trainer step was started
    skipped = _run(tmp_path, *too_big, dry=True, MT_SKIP_PLAN="1")
    assert skipped.returncode == 0 and "does not fit" not in skipped.stdout


def _helper():
    spec = importlib.util.spec_from_file_location("mt_slurm", REPO / "slurm" / "mt_slurm.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_base_gpu_id_follows_what_the_task_sees():
    base_gpu_id = _helper().base_gpu_id
    assert base_gpu_id(3, 2, None) == 6  # no binding information: the node's GPUs
    assert base_gpu_id(3, 2, "0,1,2,3,4,5,6,7") == 6  # the task sees the whole node
    assert base_gpu_id(3, 2, "6,7") == 0  # the site bound this task's two GPUs to it
    with pytest.raises(ValueError, match=r"server task 3 needs GPUs 6\.\.7"):
        base_gpu_id(3, 2, "0,1,2,3")
    with pytest.raises(ValueError, match="needs 2 GPUs"):
        base_gpu_id(0, 2, "5")


@pytest.mark.parametrize(
    ("local_id", "visible", "device", "want"),
    [
        (0, None, "cuda", "cuda:0"),
        (3, None, "cuda", "cuda:3"),  # before: every task of the node on cuda:0
        (3, "0,1,2,3,4,5,6,7", "cuda", "cuda:3"),
        (3, "5", "cuda", "cuda:0"),  # the site bound this task's GPU to it
        (3, None, "cpu", "cpu"),
        (1, None, "cuda:2", "cuda:2"),  # explicit: kept (rl.sbatch allows it with one server a node)
    ],
)
def test_each_local_engine_task_gets_its_own_gpu(monkeypatch, local_id, visible, device, want):
    """`serve --backend local --device cuda` as the srun task SLURM_LOCALID=local_id: the engine's
    `--device` is that task's GPU."""
    helper = _helper()
    started = []
    monkeypatch.setattr(os, "execv", lambda _path, cmd: started.append(cmd))
    monkeypatch.setenv("SLURM_LOCALID", str(local_id))
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    helper.main(["serve", "--backend", "local", "--model-path", "/m", "--port-base", "9000", "--host",
                 "127.0.0.1", "--device", device])  # fmt: skip
    (cmd,) = started
    assert cmd[cmd.index("--device") + 1] == want if want != "cpu" else "--device" not in cmd
    assert cmd[cmd.index("--port") + 1] == str(9000 + local_id)


def test_a_server_task_without_its_gpus_is_one_line(monkeypatch, capsys):
    """Before: a ValueError traceback in the server's log."""
    helper = _helper()
    monkeypatch.setattr(os, "execv", lambda *_a: pytest.fail("started without its GPUs"))
    monkeypatch.setenv("SLURM_LOCALID", "3")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    argv = ["serve", "--model-path", "/m", "--port-base", "9000", "--host", "127.0.0.1"]
    assert helper.main([*argv, "--backend", "local", "--device", "cuda"]) == 2
    assert "task 3: ERROR: server task 3 needs GPUs 3..3, but CUDA_VISIBLE_DEVICES='0,1' has 2" in (
        capsys.readouterr().err
    )
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")
    assert helper.main([*argv, "--backend", "sglang", "--tp", "2"]) == 2
    assert "server task 3 needs GPUs 6..7" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        (
            ("cluster.servers_per_node=2", "rollout.local.device=cuda:0"),
            "rollout.local.device=cuda:0 would load all 2 local engines of a node on one GPU",
        ),
        (
            ("cluster.servers_per_node=8", "rollout.local.device=cuda", "cluster.gpus_per_node=4"),
            "8 local engines per node on rollout.local.device=cuda need a GPU each; the node has 4",
        ),
    ],
)
def test_local_engines_sharing_a_gpu_are_refused_before_any_server(tmp_path, sets, message):
    sets = (*sets, "cluster.rollout_backend=local")
    args = [a for s in sets for a in ("--set", s)]
    proc = _run(tmp_path, *args, dry=False, SLURM_GPUS_ON_NODE="4" if "gpus_per_node=4" in str(sets) else "8")
    assert proc.returncode == 1 and proc.srun_calls == [], proc.stdout + proc.stderr
    assert message in proc.stdout + proc.stderr


def test_local_engines_on_cuda_one_gpu_each_start(tmp_path):
    sets = ("cluster.rollout_backend=local", "cluster.servers_per_node=4", "rollout.local.device=cuda")
    proc = _run(tmp_path, *[a for s in sets for a in ("--set", s)], dry=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "--device cuda " in proc.stdout and "--ntasks-per-node=4" in proc.stdout


def test_bind_host_avoids_loopback_names(monkeypatch):
    helper = _helper()
    assert helper.bind_host("10.1.2.3") == "10.1.2.3"
    monkeypatch.setenv("SLURMD_NODENAME", "localhost")
    assert helper.bind_host() == "0.0.0.0"
    monkeypatch.setattr(helper.socket, "getaddrinfo", lambda *_a, **_k: [(0, 0, 0, "", ("10.0.0.7", 0))])
    monkeypatch.setenv("SLURMD_NODENAME", "gpu7")
    assert helper.bind_host() == "gpu7"


def test_the_local_backend_gets_its_device_and_the_trainers_refusals_come_before_any_server(tmp_path):
    """Before: rollout.local.device never reached `serve` (a CUDA local engine ran on CPU), and the keys the
    trainer refuses with rollout.engine=remote (what rl.sbatch gives it) failed only once the servers ran."""
    local = ("--set", "cluster.rollout_backend=local", "--set", "rollout.local.device=cuda:0")
    proc = _run(tmp_path, *local, dry=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "--backend local" in proc.stdout and "--device cuda:0" in proc.stdout
    noisy = _run(tmp_path, *local, "--set", "rollout.local.logit_noise=0.5", dry=False)
    assert noisy.returncode == 1 and noisy.srun_calls == []
    assert "local.kv_cache_dtype/local.logit_noise/local.in_process" in noisy.stderr, noisy.stderr
    assert "as the trainer will, with rollout.engine=remote" in noisy.stdout, noisy.stdout


def test_what_the_trainer_reads_is_checked_before_any_server_starts(tmp_path, tiny_model_dir, prompt_file):
    """Before: the plan read only config.json, so a missing prompt file or reward started the servers, waited
    for them (up to cluster.health_timeout_s), and failed in the trainer's log."""
    from tests.slurm.test_rl_sbatch import write_config

    tiny = write_config(tmp_path, tiny_model_dir, prompt_file, steps=1)
    model = ("--set", f"model.hf_path={tiny_model_dir}")  # after _run's own
    missing = _run(
        tmp_path, *model, "--set", f"data.train_path={tmp_path / 'no.jsonl'}", dry=False, config=tiny
    )
    assert missing.returncode == 1 and missing.srun_calls == [], missing.stdout + missing.stderr
    assert "ERROR: the trainer would refuse this run: mt_slurm.py check-inputs: " in missing.stdout
    assert "data.train_path" in missing.stdout and "no.jsonl" in missing.stdout, missing.stdout
    reward = _run(tmp_path, *model, "--set", "data.reward=nope:f", dry=False, config=tiny)
    assert reward.returncode == 1 and reward.srun_calls == [] and "data.reward" in reward.stdout, (
        reward.stdout
    )
    # a dry run says the check's verdict too (before: it exited before the check, and said nothing of it)
    dry = _run(tmp_path, *model, "--set", f"data.train_path={tmp_path / 'no.jsonl'}", dry=True, config=tiny)
    assert dry.returncode == 0 and dry.srun_calls == [], dry.stdout + dry.stderr
    assert "inputs: the trainer would refuse this run: mt_slurm.py check-inputs: " in dry.stdout, dry.stdout
    assert "no.jsonl" in dry.stdout
    readable = _run(tmp_path, *model, dry=True, config=tiny)
    assert readable.returncode == 0 and readable.srun_calls == [], readable.stdout + readable.stderr
    assert "inputs: the trainer reads them" in readable.stdout, readable.stdout
    started = _run(tmp_path, *model, dry=False, config=tiny)  # all of it readable: the servers start
    assert any("mt-servers" in c for c in started.srun_calls), started.stdout + started.stderr


@pytest.mark.parametrize(
    ("env", "message"),
    [  # before: "30m: value too great for base", "abc: unbound variable"; 70000 passed, ports 70003..
        ({"MT_STOP_BUDGET": "30m"}, "MT_STOP_BUDGET=30m: expected a whole number"),
        ({"MT_PORT_BASE": "abc"}, "MT_PORT_BASE=abc: expected a whole number"),
        ({"MT_STOP_TIMEOUT": "010"}, "MT_STOP_TIMEOUT=010: expected a whole number"),  # bash: octal
        ({"MT_PORT_BASE": "70000"}, "MT_PORT_BASE=70000: the job's 16 ports must lie in 1024..65535"),
    ],
)
def test_a_bad_environment_number_is_one_line(tmp_path, env, message):
    proc = _run(tmp_path, dry=True, **env)
    assert proc.returncode == 1 and message in proc.stdout, proc.stdout + proc.stderr


def test_setting_what_rl_sbatch_sets_for_the_trainer_is_refused_by_name(tmp_path):
    """Before: the refusal named the script's placeholder URL and told the user to remove a key they never
    wrote."""
    proc = _run(tmp_path, "--set", "rollout.engine=local", dry=False)
    assert proc.returncode == 1 and proc.srun_calls == []
    assert (
        "ERROR: --set rollout.engine=local: rl.sbatch starts the rollout servers and gives the trainer "
        "rollout.engine=remote and their URLs; drop it"
    ) in proc.stdout, proc.stdout


def test_gpus_smaller_than_the_config_says_are_planned_with_their_memory(tmp_path):
    """Before: the plan took cluster.gpu_memory_gib (80) on any node, so a config copied to 40 GiB GPUs
    passed the preflight and the trainer ran out of memory after the servers had started."""
    small = _run(tmp_path, dry=True, gpu_mib=40960)
    assert small.returncode == 0, small.stdout + small.stderr
    assert (
        "the nodes' GPUs have 40.0 GiB (nvidia-smi), less than cluster.gpu_memory_gib=80.0: planned "
        in small.stdout
    )
    assert "x 8 GPUs of 40 GiB" in small.stdout, small.stdout
    h100 = _run(tmp_path, dry=True, gpu_mib=81559)  # an "80GB" H100: its 79.6 GiB is the config's 80
    assert "nvidia-smi" not in h100.stdout and "x 8 GPUs of 80 GiB" in h100.stdout, h100.stdout


def test_one_sglang_flag_in_extra_args_reaches_the_servers(tmp_path):
    """`cluster.sglang.extra_args: [--disable-radix-cache]`: given as `--extra-args VALUE`, a value that
    starts with `--` and holds no space was read by argparse as a flag of its own, and every server task
    exited 2 once the job ran; `--extra-args=VALUE` is one argument whatever it holds."""
    proc = _run(tmp_path, "--set", "cluster.sglang.extra_args=[--disable-radix-cache]", dry=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "--extra-args=--disable-radix-cache --server-python" in proc.stdout
    spec = importlib.util.spec_from_file_location("mt_slurm_extra", REPO / "slurm" / "mt_slurm.py")
    helper = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(helper)
    for value in ("--disable-radix-cache", "--chunked-prefill-size=8192", ""):
        argv = [
            "serve",
            "--backend",
            "sglang",
            "--model-path",
            "/m",
            "--port-base",
            "9000",
            f"--extra-args={value}",
        ]
        assert helper.build_parser().parse_args(argv).extra_args == value


def test_a_missing_slurm_variable_is_one_line(tmp_path):
    for var in ("SLURM_JOB_ID", "SLURM_JOB_NODELIST"):
        proc = _run(tmp_path, dry=True, **{var: ""})
        said = (proc.stdout + proc.stderr).strip().splitlines()
        why = f"ERROR: {var} is not set: submit this script with sbatch (a dry run sets it: slurm/README.md)"
        assert proc.returncode == 1 and len(said) == 1 and said[0].endswith(why), said


def test_the_router_binds_where_the_servers_do(tmp_path):
    proc = _run(tmp_path, dry=True, MT_BIND_HOST="0.0.0.0")
    (router,) = [line for line in proc.stdout.splitlines() if line.startswith("router: ")]
    assert " router --port 17872 " in router and "--host 0.0.0.0 http://gpu1:17875" in router, router


def test_every_node_checks_the_jobs_ports_before_anything_starts(tmp_path, tiny_model_dir, prompt_file):
    """The port check runs on every node (`mt_slurm.py check-ports`, one srun task per node), each for its
    share of the block: the servers' nodes their servers' ports (and the router's, with one), the trainer's
    first node the rendezvous and weight sync. A taken port is one line, nothing started."""
    from tests.slurm.test_rl_sbatch import write_config

    tiny = ("--set", f"model.hf_path={tiny_model_dir}")  # after _run's, which names a config-only 8B
    config = write_config(tmp_path, tiny_model_dir, prompt_file, steps=1)
    proc = _run(tmp_path, *tiny, dry=False, config=config, SLURM_GPUS_ON_NODE="0")
    check = [c for c in proc.srun_calls if " check-ports " in c]
    assert len(check) == 1 and "--nodes=2 --ntasks=2 --ntasks-per-node=1" in check[0], proc.srun_calls
    assert check[0].endswith("check-ports 17872 16 --node gpu1=3 --node gpu2=1,2")  # one local server
    assert proc.srun_calls.index(check[0]) == 0  # before the servers' step
    # a node where a port is taken: its helper's line, and no other step
    said = (
        "port 17873 (the torchrun rendezvous, of this job's block 17872..17887) is already in use on gpu2; "
        "set MT_PORT_BASE to another block"
    )
    fails = (
        'case "$*" in *check-ports*) echo "srun: error: gpu2: task 1: Exited with exit code 2" >&2; '
        f'echo "{said}" >&2; exit 2;; esac\n'
    )
    (tmp_path / "calls").unlink()
    taken = _run(tmp_path, *tiny, dry=False, config=config, SLURM_GPUS_ON_NODE="0", srun_then=fails)
    assert taken.returncode == 1 and f"ERROR: {said}" in taken.stdout, taken.stdout + taken.stderr
    assert [c for c in taken.srun_calls if " check-ports " not in c] == []


@pytest.mark.parametrize(
    ("nodes", "rollout_nodes", "shares"),
    [
        ("gpu1,gpu2", 1, "--node gpu1=0,3,4 --node gpu2=1,2"),
        ("gpu1,gpu2,gpu3,gpu4", 2, "--node gpu1=0,3,4 --node gpu2=3,4 --node gpu3=1,2 --node gpu4=2"),
    ],
)
def test_the_first_rollout_node_checks_the_routers_port_every_trainer_node_the_weight_syncs(
    tmp_path, tiny_model_dir, prompt_file, nodes, rollout_nodes, shares
):
    """The router's port on the first rollout node, every server's on each; the rendezvous on the first
    trainer node, the weight-sync group's on every trainer node (rank 0's node is torchrun's choice)."""
    from tests.slurm.test_rl_sbatch import write_config

    config = write_config(tmp_path, tiny_model_dir, prompt_file, steps=1)
    sets = (
        "cluster.rollout_backend=sglang",
        "cluster.servers_per_node=2",
        "cluster.sglang.router=true",
        f"cluster.nodes={nodes.count(',') + 1}",
        f"cluster.rollout_nodes={rollout_nodes}",
    )
    stop = (
        'case "$*" in *check-ports*) echo "port 17872 (...) is already in use on gpu1" >&2; exit 2;; esac\n'
    )
    args = [a for s in (*sets, f"model.hf_path={tiny_model_dir}") for a in ("--set", s)]
    proc = _run(
        tmp_path, *args, config=config, dry=False, MT_SKIP_PLAN="1", srun_then=stop, SLURM_JOB_NODELIST=nodes
    )
    assert proc.returncode == 1 and "is already in use on gpu1" in proc.stdout, proc.stdout + proc.stderr
    (check,) = proc.srun_calls
    assert check.endswith(f"check-ports 17872 16 {shares}"), check


def test_the_api_key_is_the_jobs_own_never_printed_and_a_bad_one_is_refused(tmp_path):
    """rl.sbatch exports `MT_ROLLOUT_API_KEY` (a new one per job start unless given) to every step: the
    servers require it, the trainer sends it. Never in the output, not even traced (MT_DEBUG=1); a given
    key SGLang's argument parser would misread (a leading "-") is refused in one line."""
    traced = _run(tmp_path, dry=True, MT_DEBUG="1", MT_ROLLOUT_API_KEY="given-k3y")
    assert traced.returncode == 0, traced.stdout + traced.stderr
    assert "given-k3y" not in traced.stdout + traced.stderr and "set -x" not in traced.stdout
    assert "+ PORT_BASE=" in traced.stderr and "+ ROUTER=0" in traced.stderr  # traced before and after it
    assert "--key-dir " in traced.stdout and "/.api_keys" in traced.stdout
    bad = _run(tmp_path, dry=True, MT_ROLLOUT_API_KEY="-oops")
    assert bad.returncode == 1 and "ERROR: MT_ROLLOUT_API_KEY: expected letters, digits" in bad.stdout


def test_a_job_that_asked_for_no_gpus_is_refused_where_its_node_shows_too_few(tmp_path):
    """`SLURM_GPUS_ON_NODE` unset (no GPU request) and `cluster.gpus_per_node: 8`: the node's own count
    (`nvidia-smi -L`) decides; before, the plan and 8 servers went ahead on the config's word."""
    smi_dir = tmp_path / "smi"  # `_run` manages its own bin's nvidia-smi
    smi_dir.mkdir()
    smi = smi_dir / "nvidia-smi"

    def shows(gpus: int) -> subprocess.CompletedProcess:
        lines = "".join(f"echo 'GPU {i}: NVIDIA H100 80GB HBM3 (UUID: GPU-{i})'; " for i in range(gpus))
        smi.write_text(f'#!/bin/sh\nif [ "$1" = -L ]; then {lines}:; fi\n')
        smi.chmod(0o755)
        path = f"{tmp_path / 'bin'}:{smi_dir}:{os.environ['PATH']}"
        return _run(tmp_path, dry=True, SLURM_GPUS_ON_NODE="", PATH=path)

    none = shows(0)
    assert (
        none.returncode == 1
        and (
            "ERROR: cluster.gpus_per_node=8, but this job asked Slurm for no GPUs and its node shows 0 "
            "(nvidia-smi -L); submit with sbatch --gpus-per-node=8"
        )
        in none.stdout
    ), none.stdout + none.stderr
    eight = shows(8)
    assert eight.returncode == 0, eight.stdout + eight.stderr
