"""The megatron-core 0.16 distributed-optimizer checkpoint fixes are needed with torch's own Adam."""

import contextlib

import pytest

from tests.harness import run_distributed
from tests.model.hf_models import make_hf_model
from tests.train import test_checkpoint as resume


def _load_outcome(_rank, _world, hf, ckpt, disable):
    import megatron_tail.train.engine.checkpoint as checkpoint

    if disable == "adam_load_fixes":
        checkpoint.torch_adam_load_fixes = lambda _optimizer: contextlib.nullcontext()
    elif disable == "fresh_state":
        checkpoint.init_fresh_optimizer_state = lambda _optimizer: None
    trainer = resume._trainer(hf, 1, 1, load_weights=False)
    try:
        checkpoint.load_checkpoint(ckpt, trainer)
    except Exception as err:
        return f"{type(err).__name__}: {err}"
    states = [s for opt in trainer.optimizer.chained_optimizers for s in opt.optimizer.state.values()]
    distinct_steps = len({id(s["step"]) for s in states}) == len(states)
    return "ok" if distinct_steps else "steps shared between parameters"


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt_patches")
    make_hf_model("qwen3", root / "hf", tie=True)
    run_distributed(resume._train_rank, 1, str(root / "hf"), 1, 1, None, str(root / "ckpt"), 1)
    return str(root / "hf"), str(root / "ckpt")


def test_loading_needs_the_adam_step_fixes(saved):
    assert "KeyError" in run_distributed(_load_outcome, 1, *saved, "adam_load_fixes")[0]
    assert run_distributed(_load_outcome, 1, *saved, None)[0] == "ok"


def test_loading_into_a_fresh_optimizer_needs_its_state_initialised(saved):
    assert "AssertionError" in run_distributed(_load_outcome, 1, *saved, "fresh_state")[0]


def _results_queue_kind(_rank, _world):
    import multiprocessing
    import queue

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    from megatron_tail.patches import use_in_process_results_queue

    use_in_process_results_queue()
    use_in_process_results_queue()  # idempotent
    q = filesystem_async._get_write_results_queue()
    return isinstance(q, queue.Queue), len(multiprocessing.active_children())


def test_results_queue_stays_in_process():
    # Unpatched, megatron builds this queue through a spawn-context Manager: one extra server process
    # per rank that re-imports __main__ and outlives ranks that exit with os._exit.
    assert run_distributed(_results_queue_kind, 1)[0] == (True, 0)
