"""A checkpoint keeps the rollout manager's state on rank 0, where it lives and is written: before, `on_rank0`
broadcast it to every rank (a pickle of every buffered group's per-token lists, the size of a step's
rollouts at η ≥ 1, at each save), where it was dropped."""

from __future__ import annotations

from megatron_tail.train.engine.checkpoint import read_rank0_object
from tests.harness import run_distributed
from tests.loop.conftest import ENGINE_IN_PROCESS, loop_overrides


def _run_rank(rank, world, overrides):  # noqa: ARG001
    import torch.distributed as dist

    from megatron_tail.config import load_config
    from megatron_tail.train.run.loop import run

    received, real = [], dist.broadcast_object_list

    def recording(objects, src=0, group=None, device=None):
        real(objects, src=src, group=group, device=device)
        received.extend(objects)

    dist.broadcast_object_list = recording
    run(load_config(None, overrides))

    def holds_manager_state(value) -> bool:
        if isinstance(value, dict):
            return "next_index" in value or any(holds_manager_state(v) for v in value.values())
        if isinstance(value, (list, tuple)):
            return any(holds_manager_state(v) for v in value)
        return False

    return any(holds_manager_state(value) for value in received)


def test_the_rollout_state_stays_on_rank_0(tiny_model_dir, prompt_file, tmp_path):
    run_dir = tmp_path / "run"
    settings = {
        "train.steps": 2,
        "train.checkpoint_every": 1,
        "rollout.max_staleness": 1,
        **ENGINE_IN_PROCESS,
    }
    got = run_distributed(_run_rank, 2, loop_overrides(tiny_model_dir, prompt_file, run_dir, settings))
    assert got == [False, False]
    state = read_rank0_object(run_dir / "checkpoints" / "step_000002", "rollout_manager")
    assert state["next_index"] > 0 and "buffer" in state  # written, by rank 0
