"""fp16 training: megatron's Float16Module + dynamic loss scaling through our train step. The first step's
loss equals the fp32 trainer's to fp16 accuracy; an overflowing scale skips the step and halves after the
hysteresis; the scale and skips reach the step's result."""

from __future__ import annotations

import pytest
import torch

from tests.harness import run_distributed
from tests.model.hf_models import make_hf_model
from tests.train.common import PAD_MULTIPLE, global_loss_tokens, init_rank, make_samples, masked_nll_loss


def _steps_rank(rank, world_size, hf_dir, precision, initial_scale, steps):  # noqa: ARG001
    from megatron_tail.model import ModelSettings, load_hf_config
    from megatron_tail.train import OptimizerSettings, build_trainer, make_micro_batches, train_step

    init_rank(1, 1)
    trainer = build_trainer(
        load_hf_config(hf_dir),
        hf_dir=hf_dir,
        model_settings=ModelSettings(vocab_pad_multiple=PAD_MULTIPLE, precision=precision),
        optim=OptimizerSettings(lr=1e-3, initial_loss_scale=initial_scale),
    )
    dtypes = {p.dtype for p in trainer.chunks[0].parameters()}
    mbs = make_micro_batches(make_samples(4, seed=3), micro_batch_size=2, seq_len=16)
    out = []
    for _ in range(steps):
        result = train_step(trainer, mbs, masked_nll_loss(global_loss_tokens(mbs, trainer.groups.dp)))
        out.append(
            (result.metrics["loss"], result.update_successful, float(trainer.optimizer.get_loss_scale()))
        )
    return dtypes, out


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("fp16")
    make_hf_model("qwen3", path)
    return str(path)


def test_fp16_step_matches_fp32_and_keeps_its_scale(hf_dir):
    dtypes, fp16 = run_distributed(_steps_rank, 1, hf_dir, "fp16", 2.0**16, 2)[0]
    _, fp32 = run_distributed(_steps_rank, 1, hf_dir, "fp32", 2.0**16, 1)[0]
    assert dtypes == {torch.float16}
    (loss, ok, scale), (_, ok2, _) = fp16
    assert ok and ok2 and scale == 2.0**16
    assert loss == pytest.approx(fp32[0][0], rel=2e-3)  # fp16 forward vs fp32: rounding only


def test_an_overflowing_scale_skips_steps_and_halves_after_the_hysteresis(hf_dir):
    _, out = run_distributed(_steps_rank, 1, hf_dir, "fp16", 2.0**80, 3)[0]
    assert [ok for _, ok, _ in out] == [False, False, False]  # 2^80·loss overflows fp16 gradients
    # hysteresis 2: the first overflow only counts, each one after halves the scale
    assert [scale for _, _, scale in out] == [2.0**80, 2.0**79, 2.0**78]


def _resume_rank(rank, world_size, hf_dir, ckpt_in, ckpt_out, steps):  # noqa: ARG001
    from megatron_tail.model import ModelSettings, load_hf_config
    from megatron_tail.train import (
        OptimizerSettings,
        build_trainer,
        load_checkpoint,
        make_micro_batches,
        save_checkpoint,
        train_step,
    )

    init_rank(1, 1)
    trainer = build_trainer(
        load_hf_config(hf_dir),
        hf_dir=hf_dir,
        model_settings=ModelSettings(vocab_pad_multiple=PAD_MULTIPLE, precision="fp16"),
        # a scale that overflows at first: the scaler's state (scale, hysteresis) is what resume must keep
        optim=OptimizerSettings(lr=1e-3, initial_loss_scale=2.0**24, loss_scale_window=2),
    )
    start = 0 if ckpt_in is None else load_checkpoint(ckpt_in, trainer)["step"]
    out = []
    for step in range(start, start + steps):
        mbs = make_micro_batches(make_samples(4, seed=100 + step), micro_batch_size=2, seq_len=16)
        result = train_step(trainer, mbs, masked_nll_loss(global_loss_tokens(mbs, trainer.groups.dp)))
        out.append(
            (result.metrics["loss"], result.update_successful, float(trainer.optimizer.get_loss_scale()))
        )
    if ckpt_out is not None:
        save_checkpoint(ckpt_out, trainer, {"step": start + steps})
    return out


def test_fp16_resume_keeps_the_loss_scaler(hf_dir, tmp_path):
    full = run_distributed(_resume_rank, 1, hf_dir, None, None, 6)[0]
    first = run_distributed(_resume_rank, 1, hf_dir, None, str(tmp_path / "ckpt"), 3)[0]
    second = run_distributed(_resume_rank, 1, hf_dir, str(tmp_path / "ckpt"), None, 3)[0]
    assert first + second == full
    # the scale really moved (overflow skips, then growth), so a lost scaler state would show
    assert len({scale for _, _, scale in full}) > 1 and not all(ok for _, ok, _ in full)


def _nan_rank(rank, world_size, hf_dir, initial_scale, hysteresis=2):  # noqa: ARG001
    import math

    from megatron_tail.model import ModelSettings, load_hf_config
    from megatron_tail.train import OptimizerSettings, build_trainer, make_micro_batches, train_step

    init_rank(1, 1)
    trainer = build_trainer(
        load_hf_config(hf_dir),
        hf_dir=hf_dir,
        model_settings=ModelSettings(vocab_pad_multiple=PAD_MULTIPLE, precision="fp16"),
        optim=OptimizerSettings(lr=1e-3, initial_loss_scale=initial_scale, loss_scale_hysteresis=hysteresis),
    )
    mbs = make_micro_batches(make_samples(4, seed=3), micro_batch_size=2, seq_len=16)
    loss = masked_nll_loss(global_loss_tokens(mbs, trainer.groups.dp))

    def nan_loss(out, mb):
        value, metrics = loss(out, mb)
        return value * math.nan, metrics

    result = train_step(trainer, mbs, nan_loss)
    return result.update_successful, result.grad_norm


def test_an_overflow_at_the_scales_floor_is_a_nonfinite_gradient(hf_dir):
    """The scaler skips an overflow and lowers the scale; at its floor (min_loss_scale 1) it cannot, and the
    update reports a NaN norm, which the run's guard counts (`run.nonfinite`); before, an fp16 run whose
    gradients stayed NaN skipped every update at scale 1 without end."""
    import math

    ok, norm = run_distributed(_nan_rank, 1, hf_dir, 2.0**16)[0]
    assert not ok and norm is None  # room below: the scaler's own business
    ok, norm = run_distributed(_nan_rank, 1, hf_dir, 1.0)[0]
    assert not ok and math.isnan(norm)
    ok, norm = run_distributed(_nan_rank, 1, hf_dir, 2.0, 1)[0]
    assert not ok and norm is None  # backed off to the floor by this overflow: scale 1 is yet to be tried
