"""Expert parallelism in the trainer: `init_parallel` builds megatron's EP groups, refuses a world the
expert layout does not divide, and one training step at EP = 2 (DP = 2) equals the step at EP = DP = 1.

On CPU the allgather dispatcher (`MoEAllGatherTokenDispatcher.dispatch_preprocess`/`token_dispatch`,
transformer/moe/token_dispatcher.py: `gather_from_sequence_parallel_region` over the TP×EP group, no split
sizes) needs every EP rank's micro-batch to have the same shape, and every EP rank to run the same number
of forwards. The step below uses equal-length samples and builds its micro-batches itself; the trainer's
layout pads uneven ones to the EP group's shape (`train.engine.batch.equalize_micro_batch_shapes`,
`tests/train/test_moe_uneven_shapes.py`).
"""

from __future__ import annotations

import pytest
from safetensors.torch import load_file

from tests.harness import run_distributed
from tests.model.hf_moe import make_hf_moe
from tests.train.common import PAD_MULTIPLE, full_hf_state, global_loss_tokens, make_samples, masked_nll_loss


def _groups_rank(rank, world):  # noqa: ARG001 - harness signature
    from megatron_tail.config.parallel import ParallelSection
    from megatron_tail.train.engine.parallel import init_parallel

    g = init_parallel(ParallelSection(tensor_parallel=2, expert_parallel=2, expert_tensor_parallel=1))
    return (g.tp_size, g.dp_size, g.ep_size, g.etp_size, g.edp_size, g.ep_rank, g.tp_rank)


def test_init_parallel_builds_expert_groups():
    """TP 2 × DP 2 and, over the same 4 ranks, ETP 1 × EP 2 × expert-DP 2 (megatron's tp-ep-dp-pp order:
    EP is the fastest-varying after ETP, so ranks 0 and 1 are one EP group)."""
    got = run_distributed(_groups_rank, 4)
    assert [g[:5] for g in got] == [(2, 2, 2, 1, 2)] * 4
    assert [g[5] for g in got] == [0, 1, 0, 1]


def _one_step_rank(rank, world_size, hf_dir, ep):  # noqa: ARG001 - harness signature
    from megatron_tail.config.parallel import ParallelSection
    from megatron_tail.model import ModelSettings, load_hf_config
    from megatron_tail.train import (
        OpSettings,
        OptimizerSettings,
        build_trainer,
        make_micro_batches,
        split_for_data_parallel,
        train_step,
    )
    from megatron_tail.train.engine.parallel import init_parallel

    groups = init_parallel(ParallelSection(expert_parallel=ep), seed=1234)
    arch = load_hf_config(hf_dir)
    # Adam with ε = 1: the first update ≈ lr·g, smooth in g (see test_step_equivalence); no aux loss, whose
    # value depends on how tokens are split into micro-batches
    optim = OptimizerSettings(lr=0.5, adam_eps=1.0, clip_grad=1e9)
    settings = ModelSettings(vocab_pad_multiple=PAD_MULTIPLE, moe_aux_loss_coeff=0.0)
    trainer = build_trainer(arch, hf_dir=hf_dir, model_settings=settings, optim=optim)
    # equal lengths: the allgather dispatcher (CPU) all-gathers [s·b, h] over the EP group without split
    # sizes, so the EP ranks' micro-batches must have one shape (see the module docstring; the layout this
    # test skips pads them)
    samples = make_samples(8, seed=7, min_len=5, max_len=5)
    samples = split_for_data_parallel(samples, groups.dp_rank, groups.dp_size)
    mbs = make_micro_batches(samples, micro_batch_size=2)
    result = train_step(trainer, mbs, masked_nll_loss(global_loss_tokens(mbs, groups.dp)), op=OpSettings())
    return full_hf_state(trainer), result.grad_norm, result.update_successful


def test_ep2_step_equals_ep1_step(tmp_path):
    make_hf_moe(tmp_path, norm_topk_prob=True)
    (ref_state, ref_norm, ok1), *_ = run_distributed(_one_step_rank, 1, str(tmp_path), 1)
    (state, norm, ok2), _ = run_distributed(_one_step_rank, 2, str(tmp_path), 2)
    assert ok1 and ok2
    assert norm == pytest.approx(ref_norm, rel=1e-5)
    initial = load_file(tmp_path / "model.safetensors")
    assert sorted(state) == sorted(ref_state) == sorted(initial)
    for name, ref in ref_state.items():
        moved = (ref - initial[name]).abs().max()
        assert (state[name] - ref).abs().max() <= 1e-4 * moved + 1e-7, name
    # the step moved the experts of both EP ranks and the router
    for name in (
        "model.layers.2.mlp.experts.0.down_proj.weight",
        "model.layers.2.mlp.experts.3.down_proj.weight",
        "model.layers.0.mlp.gate.weight",
    ):
        assert (ref_state[name] - initial[name]).abs().max() > 1e-3, name
