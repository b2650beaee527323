"""The megatron-core 0.16 distributed-optimizer checkpoint fixes are needed with torch's own Adam."""

import contextlib

import pytest
import torch

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


def _save_unstepped_then_step(_rank, _world, hf, ckpt, disable):
    """Save before any optimizer step, then take one: the weights after it (or the save's error)."""
    import megatron_tail.train.engine.checkpoint as checkpoint
    from megatron_tail.train import make_micro_batches, train_step
    from tests.train.common import full_hf_state, global_loss_tokens, make_samples, masked_nll_loss

    if disable:
        checkpoint.init_unstepped_adam_state = lambda _optimizer: None
    trainer = resume._trainer(hf, 1, 1)
    if ckpt is not None:
        try:
            checkpoint.save_checkpoint(ckpt, trainer, {"step": 0})
        except Exception as err:
            return f"{type(err).__name__}: {err}"
    mbs = make_micro_batches(make_samples(4, seed=7), micro_batch_size=1, seq_len=16)
    train_step(trainer, mbs, masked_nll_loss(global_loss_tokens(mbs, trainer.groups.dp)))
    return full_hf_state(trainer)


def test_saving_before_any_step_needs_adam_state_and_changes_nothing(tmp_path):
    """An RL run whose steps were all skipped (dynamic sampling) checkpoints an optimizer that never
    stepped: unpatched that fails; patched, the next step is bit-identical to one that never saved."""
    make_hf_model("qwen3", tmp_path / "hf", tie=True)
    hf = str(tmp_path / "hf")
    failed = run_distributed(_save_unstepped_then_step, 1, hf, str(tmp_path / "a"), True)[0]
    assert isinstance(failed, str) and "AssertionError" in failed
    saved = run_distributed(_save_unstepped_then_step, 1, hf, str(tmp_path / "b"), False)[0]
    plain = run_distributed(_save_unstepped_then_step, 1, hf, None, False)[0]
    assert saved.keys() == plain.keys()
    for name in plain:
        assert saved[name].equal(plain[name]), name


class FusedAdam(torch.optim.Optimizer):
    """A stand-in with TE's FusedAdam's name, not torch's Adam (TE does not install on CPU)."""

    __module__ = "transformer_engine.pytorch.optimizers.fused_adam"


def _save_unstepped_fused_adam(_rank, _world, hf, ckpt):
    import megatron_tail.train.engine.checkpoint as checkpoint

    trainer = resume._trainer(hf, 1, 1)
    trainer.optimizer.optimizer.__class__ = FusedAdam  # the same empty state, another optimizer class
    try:
        checkpoint.save_checkpoint(ckpt, trainer, {"step": 0})
    except Exception as err:
        return f"{type(err).__name__}: {err}"
    return "saved"


def test_unstepped_save_with_a_fused_adam_is_refused_by_name(tmp_path):
    make_hf_model("qwen3", tmp_path / "hf", tie=True)
    out = run_distributed(_save_unstepped_fused_adam, 1, str(tmp_path / "hf"), str(tmp_path / "c"))[0]
    assert out.startswith("UnsteppedOptimizerSaveError: cannot checkpoint ")
    assert "transformer_engine.pytorch.optimizers.fused_adam.FusedAdam before its first step" in out
