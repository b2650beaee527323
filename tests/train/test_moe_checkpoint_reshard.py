"""A Qwen3-MoE checkpoint saved at one expert-parallel size resumes at another (EP 2 ⇄ EP 1, world 2, with
and without the distributed optimizer), weights and Adam state (m, v, fp32 main params) included.

Per case: one step at EP = a, save; load at EP = b and save again at once; one more step, save. Checked:
- the reload at EP = b saves the same tensors, bit for bit, as the EP = a save (a reshard moves numbers,
  it must not change them);
- the resumed second step equals an uninterrupted run at EP = b to 1e-5 of what the step moved: the
  EP = a first step sums its gradients in another order than EP = b's (expert-DP 1 vs 2), so the runs
  agree to fp32 rounding, not bit for bit (`test_moe_parallel.test_ep2_step_equals_ep1_step`).
The saved tensors are read back as plain full tensors with torch's own DCP reader (megatron's torch_dist
format is a DCP checkpoint), independent of the code under test.
"""

from __future__ import annotations

import pytest
import torch

from tests.harness import run_distributed
from tests.model.hf_moe import make_hf_moe
from tests.train.common import PAD_MULTIPLE, full_hf_state, global_loss_tokens, make_samples, masked_nll_loss

BATCH = 4


def _run_rank(rank, world, hf_dir, ep, distopt, ckpt_in, out_dir, steps, bf16):  # noqa: ARG001
    from megatron_tail.config.parallel import ParallelSection
    from megatron_tail.model import ModelSettings, load_hf_config
    from megatron_tail.train import (
        OptimizerSettings,
        build_trainer,
        load_checkpoint,
        make_micro_batches,
        save_checkpoint,
        split_for_data_parallel,
        train_step,
    )
    from megatron_tail.train.engine.parallel import init_parallel

    groups = init_parallel(ParallelSection(expert_parallel=ep), seed=1234)
    arch = load_hf_config(hf_dir)
    settings = ModelSettings(
        vocab_pad_multiple=PAD_MULTIPLE, moe_aux_loss_coeff=0.0, precision="bf16" if bf16 else "fp32"
    )
    optim = OptimizerSettings(lr=1e-2, clip_grad=1e9, use_distributed_optimizer=distopt)
    trainer = build_trainer(
        arch, hf_dir=hf_dir if ckpt_in is None else None, model_settings=settings, optim=optim
    )
    state = {"step": 0, "cursor": 0}
    if ckpt_in is not None:
        state = load_checkpoint(ckpt_in, trainer)
        save_checkpoint(f"{out_dir}/reload", trainer, state)
    for _ in range(steps):
        # equal lengths: the CPU allgather dispatcher needs one micro-batch shape on every EP rank
        samples = make_samples(BATCH, seed=100 + state["cursor"], min_len=5, max_len=5)
        mine = split_for_data_parallel(samples, groups.dp_rank, groups.dp_size)
        mbs = make_micro_batches(mine, micro_batch_size=1)
        result = train_step(trainer, mbs, masked_nll_loss(global_loss_tokens(mbs, groups.dp)))
        assert result.update_successful
        state = {"step": state["step"] + 1, "cursor": state["cursor"] + BATCH}
        save_checkpoint(f"{out_dir}/step{state['step']}", trainer, state)
    return full_hf_state(trainer)


def _plain(path) -> dict[str, torch.Tensor]:
    """Every tensor of a torch_dist checkpoint as a full plain tensor, by key (torch DCP's own reader)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    out: dict = {}
    reader = FileSystemReader(str(path))
    _load_state_dict(out, storage_reader=reader, planner=_EmptyStateDictLoadPlanner(), no_dist=True)
    return {k: v for k, v in out.items() if isinstance(v, torch.Tensor)}


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe_hf")
    make_hf_moe(root, norm_topk_prob=True)
    return str(root)


@pytest.fixture(scope="module", params=[False, True], ids=["adam", "distopt"])
def runs(request, hf_dir, tmp_path_factory):
    """Two uninterrupted fp32 steps at EP 1 and at EP 2 (world 2), a checkpoint after each."""
    root = tmp_path_factory.mktemp("moe_reshard")
    for ep in (1, 2):
        run_distributed(_run_rank, 2, hf_dir, ep, request.param, None, str(root / f"ep{ep}"), 2, False)
    return hf_dir, root, request.param


def _assert_equal(saved: dict, reloaded: dict) -> None:
    assert sorted(saved) == sorted(reloaded)
    assert any(".experts." in k and "exp_avg_sq" in k for k in saved)  # the experts' Adam state is there
    for key, value in saved.items():
        assert torch.equal(value, reloaded[key]), key


@pytest.mark.parametrize(("ep_a", "ep_b"), [(2, 1), (1, 2)], ids=["ep2-to-ep1", "ep1-to-ep2"])
def test_moe_checkpoint_resumes_at_another_ep(runs, tmp_path, ep_a, ep_b):
    hf, root, distopt = runs
    first = root / f"ep{ep_a}" / "step1"
    run_distributed(_run_rank, 2, hf, ep_b, distopt, str(first), str(tmp_path), 1, False)
    _assert_equal(_plain(first), _plain(tmp_path / "reload"))
    # Tolerance per tensor: 1e-4 of its largest entry. The first steps at EP a and EP b sum gradients in
    # another order (rel. ~1e-7), which Adam's m/√v turns into ~1e-5 on entries whose gradient is near 0;
    # Adam state not restored would differ by ~lr / |w| ≈ 1e-2.
    resumed, ref = _plain(tmp_path / "step2"), _plain(root / f"ep{ep_b}" / "step2")
    assert sorted(resumed) == sorted(ref)
    for key, value in ref.items():
        scale = value.abs().max().item()
        assert (resumed[key] - value).abs().max().item() <= 1e-4 * scale, key
    # the second step moved the weights by far more than the tolerance
    step1 = _plain(root / f"ep{ep_b}" / "step1")
    key = "decoder.layers.2.mlp.experts.experts.linear_fc1.weight"
    assert (ref[key] - step1[key]).abs().max() > 100 * 1e-4 * ref[key].abs().max()


def test_bf16_main_params_reshard_from_ep2_to_ep1(hf_dir, tmp_path):
    """bf16 with the distributed optimizer: the fp32 main params ("optimizer.state.param") reshard too, bit
    for bit. (A second step is not compared: the EP 1 and EP 2 first steps differ by bf16 rounding.)"""
    run_distributed(_run_rank, 2, hf_dir, 2, True, None, str(tmp_path / "ep2"), 1, True)
    run_distributed(
        _run_rank, 2, hf_dir, 1, True, str(tmp_path / "ep2" / "step1"), str(tmp_path / "ep1"), 0, True
    )
    saved = _plain(tmp_path / "ep2" / "step1")
    assert any(k.startswith("optimizer.state.param.") and ".experts." in k for k in saved)
    _assert_equal(saved, _plain(tmp_path / "ep1" / "reload"))


def _rng_rank(rank, world, hf_dir, ckpt):  # noqa: ARG001
    import random

    from megatron_tail.config.parallel import ParallelSection
    from megatron_tail.model import ModelSettings, load_hf_config
    from megatron_tail.train import build_trainer, load_checkpoint, save_checkpoint
    from megatron_tail.train.engine.parallel import init_parallel

    init_parallel(ParallelSection(expert_parallel=2), seed=1234)
    settings = ModelSettings(vocab_pad_multiple=PAD_MULTIPLE)
    trainer = build_trainer(load_hf_config(hf_dir), hf_dir=hf_dir, model_settings=settings)
    random.seed(rank)  # a state of this rank's own, like its expert tracker on a GPU
    save_checkpoint(ckpt, trainer, {"step": 0})
    saved = random.random()
    random.seed(99)
    load_checkpoint(ckpt, trainer)
    return saved, random.random()


def test_each_ep_rank_restores_its_own_rng_state(hf_dir, tmp_path):
    """EP 2, world 2: the two ranks are dense-DP replicas, but their expert RNG trackers differ (megatron
    seeds them by EP rank, `model_parallel_cuda_manual_seed`), so each rank's RNG states must be saved,
    not rank 0's alone. On CPU the tracker is megatron's inference tracker, which keeps no states, so a
    per-rank Python RNG state stands for it: the same object carries both."""
    (saved0, loaded0), (saved1, loaded1) = run_distributed(_rng_rank, 2, hf_dir, str(tmp_path / "ckpt"))
    assert saved0 != saved1
    assert (loaded0, loaded1) == (saved0, saved1)
