"""fp16 training: megatron's Float16Module + dynamic loss scaling through our train step. The first step's
loss equals the fp32 trainer's to fp16 accuracy; an overflowing scale skips the step and halves after the
hysteresis; the scale and skips reach the step's result."""

from __future__ import annotations

import pytest
import torch

from tests.harness import run_distributed
from tests.model.hf_models import make_hf_model
from tests.train.common import PAD_MULTIPLE, global_loss_tokens, init_rank, make_samples, masked_nll_loss


def _trainer(hf_dir, precision: str = "fp16", **optim):
    """A trainer of the tiny model at `precision`, Adam at lr 1e-3 with `optim`'s loss-scale settings."""
    from megatron_tail.model import ModelSettings, load_hf_config
    from megatron_tail.train import OptimizerSettings, build_trainer

    return build_trainer(
        load_hf_config(hf_dir),
        hf_dir=hf_dir,
        model_settings=ModelSettings(vocab_pad_multiple=PAD_MULTIPLE, precision=precision),
        optim=OptimizerSettings(lr=1e-3, **optim),
    )


def _steps_rank(rank, world_size, hf_dir, precision, initial_scale, steps):  # noqa: ARG001
    from megatron_tail.train import make_micro_batches, train_step

    init_rank(1, 1)
    trainer = _trainer(hf_dir, precision, initial_loss_scale=initial_scale)
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
    from megatron_tail.train import (
        load_checkpoint,
        make_micro_batches,
        save_checkpoint,
        train_step,
    )

    init_rank(1, 1)
    # a scale that overflows at first: the scaler's state (scale, hysteresis) is what resume must keep
    trainer = _trainer(hf_dir, initial_loss_scale=2.0**24, loss_scale_window=2)
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

    from megatron_tail.train import make_micro_batches, train_step

    init_rank(1, 1)
    trainer = _trainer(hf_dir, initial_loss_scale=initial_scale, loss_scale_hysteresis=hysteresis)
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


def _moe_overflow_rank(rank, world_size, hf_dir):  # noqa: ARG001
    from megatron_tail.patches import cpu_device_scope
    from megatron_tail.train import make_micro_batches
    from megatron_tail.train.engine.forward import OpSettings, run_micro_batches
    from megatron_tail.train.engine.optimizer_step import guarded_step

    init_rank(1, 1)
    trainer = _trainer(hf_dir, initial_loss_scale=2.0**10, loss_scale_hysteresis=1)
    chain = trainer.optimizer.chained_optimizers  # dense, expert: a scaler each
    mbs = make_micro_batches(make_samples(4, seed=3), micro_batch_size=2, seq_len=16)
    loss = masked_nll_loss(global_loss_tokens(mbs, trainer.groups.dp))

    def backward():
        for chunk in trainer.chunks:
            chunk.train()
            chunk.zero_grad_buffer()
        trainer.optimizer.zero_grad()
        run_micro_batches(
            trainer.chunks, mbs, lambda out, mb: (loss(out, mb)[0], {}), groups=trainer.groups,
            vocab_size=trainer.vocab_size, op=OpSettings(), forward_only=False,
        )  # fmt: skip

    def unscaled_norms():  # of the dense and the expert main gradients, after prepare_grads unscaled them
        return [
            float(torch.stack([g.float().norm() for g in inner.get_main_grads_for_grad_norm()]).norm())
            for inner in chain
        ]

    with cpu_device_scope():
        backward()
        trainer.optimizer.prepare_grads()  # unscaled at 2^10 (a clean step: the scales do not move)
        before = unscaled_norms()
        backward()  # an overflow in one dense gradient alone (as the output layer's can), then skipped
        dense = next(p for p in trainer.chunks[0].parameters() if getattr(p, "allreduce", True))
        dense.main_grad.view(-1)[0] = float("inf")
        skipped = not guarded_step(trainer.optimizer)[0]
        scales = [float(inner.grad_scaler.scale) for inner in chain]
        backward()  # the same batch at the same weights: the same gradients, scaled by the lower scale
        trainer.optimizer.prepare_grads()
        after = unscaled_norms()
    return len(chain), skipped, scales, float(trainer.optimizer.get_loss_scale()), before, after


def test_an_fp16_moe_runs_dense_and_expert_gradients_share_one_loss_scale(tmp_path):
    """megatron's chain of a dense and an expert optimizer holds a scaler each, and the loss is scaled by
    the dense one's: an overflow in the dense gradients alone lowered only its scale, and from then on
    every expert gradient was unscaled by the wrong factor (halved). Both scales follow the chain's
    overflow now (`optimizer_step._prepare_grads`)."""
    from tests.model.hf_moe import make_hf_moe

    make_hf_moe(tmp_path, norm_topk_prob=True)
    chained, skipped, scales, loss_scale, before, after = run_distributed(
        _moe_overflow_rank, 1, str(tmp_path)
    )[0]
    assert chained == 2 and skipped
    assert scales == [2.0**9, 2.0**9] and loss_scale == 2.0**9  # hysteresis 1: halved at once, both
    assert after == pytest.approx(before, rel=1e-2)  # fp16 rounding at another scale; the bug halved one


def _moe_scales_resume_rank(rank, world_size, hf_dir, ckpt):  # noqa: ARG001
    from megatron_tail.train import load_checkpoint, save_checkpoint

    def trainer():
        return _trainer(hf_dir, initial_loss_scale=2.0**10)

    init_rank(1, 1)
    saved = trainer()
    expert = saved.optimizer.chained_optimizers[1].grad_scaler
    expert._scale = expert._scale / 2  # as a checkpoint saved while each scaler moved alone left them
    save_checkpoint(ckpt, saved, {"step": 1})
    resumed = trainer()
    load_checkpoint(ckpt, resumed)
    return [float(inner.grad_scaler.scale) for inner in resumed.optimizer.chained_optimizers]


def test_a_resume_gives_an_fp16_moe_runs_scalers_the_scale_that_multiplies_the_loss(tmp_path):
    """A checkpoint saved before the scalers were kept together may hold two scales: after the load both
    take the dense one's (the loss's), so the expert gradients are unscaled right from the first step."""
    from tests.model.hf_moe import make_hf_moe

    make_hf_moe(tmp_path / "hf", norm_topk_prob=True)
    scales = run_distributed(_moe_scales_resume_rank, 1, str(tmp_path / "hf"), str(tmp_path / "ckpt"))[0]
    assert scales == [2.0**10, 2.0**10]
