"""An update whose global gradient norm is NaN or ±inf is skipped (`guarded_step`): before,
megatron's step without a loss scaler applied it, and every weight became NaN. A finite step is
megatron's own, bit for bit; a skipped one leaves the weights and Adam's state exactly as they were, on
every DP rank, even where only one rank's loss was NaN; `NonfiniteUpdates` says each skip and stops the
run past its limit."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_tail.train.run.nonfinite import NonfiniteUpdates, TrainingDiverged
from tests.harness import run_distributed
from tests.model.hf_models import make_hf_model
from tests.train.common import PAD_MULTIPLE, init_rank, make_samples, masked_nll_loss


def _state(trainer) -> dict[str, torch.Tensor]:
    """Every parameter and every tensor of the optimizer's state (Adam's moments and step), cloned."""
    out = {f"param.{name}": p.detach().clone() for name, p in trainer.chunks[0].named_parameters()}
    for i, inner in enumerate(trainer.optimizer.chained_optimizers):
        for j, (param, state) in enumerate(inner.optimizer.state.items()):
            for key, value in state.items():
                out[f"opt{i}.{j}.{key}"] = torch.as_tensor(value).detach().clone()
            out[f"opt{i}.{j}.param"] = param.detach().clone()
    return out


def _build(hf_dir):
    from megatron_tail.config.optimizer import OptimizerSettings
    from megatron_tail.model import ModelSettings, load_hf_config
    from megatron_tail.train import build_trainer

    settings = ModelSettings(vocab_pad_multiple=PAD_MULTIPLE)
    # clip_grad below the gradients' norm, so that the finite steps clip (what the check sits before)
    optim = OptimizerSettings(lr=1e-2, clip_grad=0.05)
    return build_trainer(load_hf_config(hf_dir), hf_dir=hf_dir, model_settings=settings, optim=optim)


def _finite_steps_rank(rank, world_size, hf_dir, samples):  # noqa: ARG001
    """Two trainers from the same weights take the same two steps: megatron's `optimizer.step()`, ours."""
    from megatron_tail.train import pack_micro_batches, train_step
    from megatron_tail.train.engine import optimizer_step

    init_rank(2, 1)
    mbs = pack_micro_batches(samples, max_tokens=32)
    loss = masked_nll_loss(sum(mb.num_loss_tokens for mb in mbs))
    ours = optimizer_step.guarded_step
    states, norms = [], []
    for step in (lambda optimizer: optimizer.step()[:2], ours):
        optimizer_step.guarded_step = step
        trainer = _build(hf_dir)
        results = [train_step(trainer, mbs, loss) for _ in range(2)]
        assert all(r.update_successful for r in results)
        norms.append([r.grad_norm for r in results])
        states.append(_state(trainer))
    optimizer_step.guarded_step = ours
    megatron, guarded = states
    assert megatron.keys() == guarded.keys()
    different = [k for k in megatron if not torch.equal(megatron[k], guarded[k])]
    return different, norms


def test_a_finite_step_is_megatrons_own_bit_for_bit(tmp_path):
    make_hf_model("qwen3", tmp_path)
    for different, (megatron, guarded) in run_distributed(
        _finite_steps_rank, 2, str(tmp_path), make_samples(4, seed=3)
    ):
        assert different == []
        assert megatron == guarded
        assert min(megatron) > 0.05  # both steps clipped: the clip runs after the check


def _nan_on_one_rank(rank, world_size, hf_dir, samples):  # noqa: ARG001
    """DP = 2: step 1 finite, step 2 NaN on rank 1's loss only, step 3 finite; a second trainer takes steps
    1 and 3 only. Returns what each step reported and whether the states match where they should."""
    from megatron_tail.train import pack_micro_batches, train_step

    init_rank(1, 1)
    mine = samples[rank::2]
    mbs = pack_micro_batches(mine, max_tokens=32)
    loss = masked_nll_loss(sum(mb.num_loss_tokens for mb in pack_micro_batches(samples, max_tokens=32)))

    def nan_here(out, mb):
        value, metrics = loss(out, mb)
        return (value * math.nan if rank == 1 else value), metrics

    trainer = _build(hf_dir)
    first = train_step(trainer, mbs, loss)
    before = _state(trainer)
    skipped = train_step(trainer, mbs, nan_here)
    after_skip = _state(trainer)
    last = train_step(trainer, mbs, loss)

    without = _build(hf_dir)
    train_step(without, mbs, loss)
    train_step(without, mbs, loss)
    unchanged = [k for k in before if not torch.equal(before[k], after_skip[k])]
    final, reference = _state(trainer), _state(without)
    diverged = [k for k in final if not torch.equal(final[k], reference[k])]
    finite = all(bool(torch.isfinite(v).all()) for v in final.values())
    reports = [(r.update_successful, r.grad_norm) for r in (first, skipped, last)]
    return reports, unchanged, diverged, finite


def test_a_nan_gradient_on_one_dp_rank_skips_the_update_on_every_rank(tmp_path):
    make_hf_model("qwen3", tmp_path)
    for reports, unchanged, diverged, finite in run_distributed(
        _nan_on_one_rank, 2, str(tmp_path), make_samples(8, seed=5)
    ):
        (ok1, norm1), (ok2, norm2), (ok3, norm3) = reports
        assert ok1 and ok3 and math.isfinite(norm1) and math.isfinite(norm3)
        assert not ok2 and math.isnan(norm2)  # the global norm: rank 0's own gradients were finite
        assert unchanged == []  # the skipped step changed no weight and no optimizer state (Adam's step)
        assert diverged == []  # the run goes on as if that batch had never been
        assert finite


def test_each_skip_is_said_and_the_run_stops_past_the_limit():
    said: list[str] = []
    guard = NonfiniteUpdates(2, said.append)
    guard.observe(1, [True, False])
    guard.observe(2, [False, True])  # counted across steps; a finite update resets the count
    guard.observe(3, [False, False])
    assert guard.in_a_row == 2
    assert said == [
        "warning: step 1, update 2 of 2: the gradient norm is NaN or ±inf; the update is skipped (weights "
        "and optimizer state kept; 1 in a row, the run stops at 3)",
        "warning: step 2, update 1 of 2: the gradient norm is NaN or ±inf; the update is skipped (weights "
        "and optimizer state kept; 2 in a row, the run stops at 3)",
        "warning: step 3, update 1 of 2: the gradient norm is NaN or ±inf; the update is skipped (weights "
        "and optimizer state kept; 1 in a row, the run stops at 3)",
        "warning: step 3, update 2 of 2: the gradient norm is NaN or ±inf; the update is skipped (weights "
        "and optimizer state kept; 2 in a row, the run stops at 3)",
    ]
    assert guard.diverged is None
    guard.observe(4, [False, True])
    assert isinstance(guard.diverged, TrainingDiverged) and len(said) == 4  # no warning for the last one
    assert str(guard.diverged).startswith(
        "step 4, update 1 of 2: the gradient norm was NaN or ±inf in 3 updates in a row "
        "(train.max_nonfinite_updates_in_a_row=2), so the run stopped after step 4. Each was skipped"
    )


def test_limit_0_stops_at_the_first_and_a_negative_limit_is_refused_at_load():
    from megatron_tail.config import load_config
    from megatron_tail.utils.errors import UserError

    guard = NonfiniteUpdates(0, print)
    guard.observe(1, [True, False])
    assert "in 1 updates in a row" in str(guard.diverged)
    with pytest.raises(UserError, match=r"train\.max_nonfinite_updates_in_a_row"):
        load_config(None, ["train.max_nonfinite_updates_in_a_row=-1"])


def _zero_gradient_rank(rank, world_size, hf_dir, samples):  # noqa: ARG001
    """A step, then one whose loss has no weight anywhere (every token masked): its gradient is exactly 0."""
    from megatron_tail.train import pack_micro_batches, train_step

    init_rank(1, 1)
    mbs = pack_micro_batches(samples, max_tokens=32)
    loss = masked_nll_loss(sum(mb.num_loss_tokens for mb in mbs))

    def nothing_counted(out, mb):
        value, metrics = loss(out, mb)
        return value * 0.0, metrics

    trainer = _build(hf_dir)
    train_step(trainer, mbs, loss)
    before = _state(trainer)
    result = train_step(trainer, mbs, nothing_counted)
    after = _state(trainer)
    return (result.update_successful, result.grad_norm), [
        k for k in before if not torch.equal(before[k], after[k])
    ]


def test_a_zero_gradient_moves_no_weight(tmp_path):
    """Before: Adam applied its momentum (and weight decay) on no data, about as far as a real step."""
    make_hf_model("qwen3", tmp_path)
    ((report, changed),) = run_distributed(_zero_gradient_rank, 1, str(tmp_path), make_samples(4, seed=3))
    assert report == (False, 0.0)
    assert changed == []
