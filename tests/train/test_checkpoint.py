"""Resume: 3 steps + save, a fresh process group loads and trains 2 more = an uninterrupted 5-step run
(same layout: exactly; into TP=1 or PP=2: to fp32 tolerance). A different model is refused untouched."""

from __future__ import annotations

import hashlib

import pytest
import torch

from tests.harness import run_distributed
from tests.model.hf_models import make_hf_model
from tests.train.common import (
    PAD_MULTIPLE,
    full_hf_state,
    global_loss_tokens,
    init_rank,
    make_samples,
    masked_nll_loss,
)

BATCH = 4


def _trainer(hf_dir, tp, pp, *, load_weights=True):
    from megatron_tail.model import ModelSettings, load_hf_config
    from megatron_tail.train import OptimizerSettings, build_trainer

    init_rank(tp, pp)
    arch = load_hf_config(hf_dir)
    return build_trainer(
        arch,
        hf_dir=hf_dir if load_weights else None,
        model_settings=ModelSettings(vocab_pad_multiple=PAD_MULTIPLE),
        optim=OptimizerSettings(lr=1e-2, clip_grad=1.0),
    )


def _train_rank(rank, world_size, hf_dir, tp, pp, ckpt_in, ckpt_out, steps):  # noqa: ARG001
    from megatron_tail.train import (
        load_checkpoint,
        make_micro_batches,
        save_checkpoint,
        split_for_data_parallel,
        train_step,
    )

    # On resume the weights come from the checkpoint only (random init first), not from hf_dir.
    trainer = _trainer(hf_dir, tp, pp, load_weights=ckpt_in is None)
    state = {"step": 0, "data_cursor": 0}
    if ckpt_in is not None:
        state = load_checkpoint(ckpt_in, trainer)
    losses = []
    for _ in range(steps):
        samples = make_samples(BATCH, seed=1000 + state["data_cursor"])
        mine = split_for_data_parallel(samples, trainer.groups.dp_rank, trainer.groups.dp_size)
        mbs = make_micro_batches(mine, micro_batch_size=1, seq_len=16)
        result = train_step(trainer, mbs, masked_nll_loss(global_loss_tokens(mbs, trainer.groups.dp)))
        losses.append(result.metrics["loss"])
        state = {"step": state["step"] + 1, "data_cursor": state["data_cursor"] + BATCH}
    if ckpt_out is not None:
        save_checkpoint(ckpt_out, trainer, state)
    return losses, state


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("resume")
    make_hf_model("qwen3", root / "hf", tie=True)
    hf = str(root / "hf")
    uninterrupted = run_distributed(_train_rank, 2, hf, 2, 1, None, None, 5)[0][0]
    assert len(set(uninterrupted)) == 5  # the loss really moves
    first = run_distributed(_train_rank, 2, hf, 2, 1, None, str(root / "ckpt"), 3)
    assert first[0] == first[1] and first[0][1] == {"step": 3, "data_cursor": 3 * BATCH}
    assert first[0][0] == uninterrupted[:3]
    return hf, str(root / "ckpt"), uninterrupted


@pytest.mark.parametrize(
    ("tp", "pp", "world", "rel"),
    [(2, 1, 2, 0.0), (1, 1, 1, 1e-5), (1, 2, 2, 1e-5)],
    ids=["same-layout", "into-tp1", "into-pp2"],
)
def test_resume_equals_uninterrupted(setup, tp, pp, world, rel):
    hf, ckpt, uninterrupted = setup
    losses, state = run_distributed(_train_rank, world, hf, tp, pp, ckpt, None, 2)[0]
    assert state == {"step": 5, "data_cursor": 5 * BATCH}
    assert losses == pytest.approx(uninterrupted[3:], rel=rel, abs=0.0)


def _changed_settings_rank(rank, world_size, hf_dir, ckpt):  # noqa: ARG001
    from megatron_tail.model import ModelSettings, load_hf_config
    from megatron_tail.train import OptimizerSettings, build_trainer, load_checkpoint
    from megatron_tail.train.engine.lr_schedule import advance, restore_progress

    init_rank(1, 1)
    settings = OptimizerSettings(
        lr=2e-2, min_lr=1e-3, lr_decay_style="linear", lr_decay_steps=10, adam_beta2=0.99, adam_eps=1e-6
    )
    trainer = build_trainer(
        load_hf_config(hf_dir), model_settings=ModelSettings(vocab_pad_multiple=PAD_MULTIPLE), optim=settings
    )
    load_checkpoint(ckpt, trainer)
    restore_progress(trainer.scheduler, {"num_steps": 3})
    lr = advance(trainer.scheduler)
    steps = {float(s["step"]) for s in trainer.optimizer.optimizer.state.values()}
    groups = [
        {k: g[k] for k in ("max_lr", "min_lr", "betas", "eps", "lr")} for g in trainer.optimizer.param_groups
    ]
    return lr, groups, steps


def test_a_resume_trains_with_its_own_configs_rates_and_adam_settings(setup):
    """The checkpoint trained at lr 1e-2 with Adam's defaults; a resume configured otherwise (a change
    `train.allow_config_change` accepts) trains with its own peak, floor, betas and eps, not the
    checkpoint's parameter groups (before, its log said the change was accepted while the old ones held);
    Adam's progress (its step count) is the checkpoint's."""
    hf, ckpt, _ = setup
    lr, groups, steps = run_distributed(_changed_settings_rank, 1, hf, ckpt)[0]
    assert lr == pytest.approx(1e-3 + (2e-2 - 1e-3) * (1 - 4 / 11), rel=1e-12)  # RL step 3 of 10 decaying
    assert groups and all(
        g == {"max_lr": 2e-2, "min_lr": 1e-3, "betas": (0.9, 0.99), "eps": 1e-6, "lr": lr} for g in groups
    )
    assert steps == {3.0}


@pytest.fixture(scope="module")
def setup_dp2(tmp_path_factory):
    """Saved at DP = 2 (TP = PP = 1): the optimizer state is sharded over DP, and the memory-efficient
    format gathers it onto DP rank 0 only at the save."""
    root = tmp_path_factory.mktemp("resume_dp2")
    make_hf_model("qwen3", root / "hf", tie=True)
    hf = str(root / "hf")
    uninterrupted = run_distributed(_train_rank, 2, hf, 1, 1, None, None, 5)[0][0]
    first = run_distributed(_train_rank, 2, hf, 1, 1, None, str(root / "ckpt"), 3)
    assert first[0][0] == uninterrupted[:3]
    return hf, str(root / "ckpt"), uninterrupted


@pytest.mark.parametrize(
    ("tp", "world", "rel"),
    [(1, 2, 0.0), (2, 2, 1e-5), (1, 1, 1e-5)],
    ids=["same-dp2", "into-tp2", "into-dp1"],
)
def test_dp_sharded_optimizer_resumes_and_reshards(setup_dp2, tp, world, rel):
    hf, ckpt, uninterrupted = setup_dp2
    losses, state = run_distributed(_train_rank, world, hf, tp, 1, ckpt, None, 2)[0]
    assert state == {"step": 5, "data_cursor": 5 * BATCH}
    assert losses == pytest.approx(uninterrupted[3:], rel=rel, abs=0.0)


def _digest(path) -> dict[str, str]:
    return {
        str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(path.rglob("*"))
        if p.is_file()
    }


def _load_other_model_rank(rank, world_size, other_hf, ckpt):  # noqa: ARG001
    from megatron_tail.train import CheckpointMismatchError, load_checkpoint, save_checkpoint

    trainer = _trainer(other_hf, 1, 1)
    before = full_hf_state(trainer)
    with pytest.raises(CheckpointMismatchError) as err:
        load_checkpoint(ckpt, trainer)
    after = full_hf_state(trainer)
    unchanged = all(torch.equal(before[k], after[k]) for k in before)
    with pytest.raises(FileExistsError):
        save_checkpoint(ckpt, trainer, {"step": 0})
    return str(err.value), unchanged


def test_different_model_is_refused_and_nothing_is_overwritten(setup, tmp_path):
    _, ckpt, _ = setup
    from pathlib import Path

    make_hf_model("qwen3", tmp_path / "other", tie=True, hidden_size=32, intermediate_size=48)
    before = _digest(Path(ckpt))
    message, unchanged = run_distributed(_load_other_model_rank, 1, str(tmp_path / "other"), ckpt)[0]
    assert "hidden_size: checkpoint 64 vs model 32" in message
    assert "intermediate_size: checkpoint 96 vs model 48" in message
    assert unchanged
    assert _digest(Path(ckpt)) == before
