"""Expert parallelism with uneven samples: megatron's allgather MoE dispatcher (CPU) gathers tokens over the
TP×EP group without split sizes, so the EP ranks (different DP ranks, different samples) must run equal
micro-batch shapes. `equalize_micro_batch_shapes` pads each micro-batch to the group's largest shape; the
EP = 2 step on uneven samples (padded and THD-packed) then equals the EP = 1 step on the same samples, the
load-balancing loss included (the added padding stays out of it: `forward.router_padding_mask`)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from megatron_tail.train.engine.batch import Sample, make_micro_batches, pack_micro_batches, pad_micro_batch
from megatron_tail.utils.ragged import Ragged
from tests.harness import run_distributed
from tests.model.hf_moe import make_hf_moe
from tests.train.common import PAD_MULTIPLE, full_hf_state, global_loss_tokens, make_samples, masked_nll_loss

MAX_TOKENS = 24


def _micro_batches(samples, groups, packed: bool):
    from megatron_tail.train import split_for_data_parallel

    if packed:
        return pack_micro_batches(
            samples, max_tokens=MAX_TOKENS, dp_rank=groups.dp_rank, dp_size=groups.dp_size
        )
    return make_micro_batches(
        split_for_data_parallel(samples, groups.dp_rank, groups.dp_size), micro_batch_size=2
    )


def _one_step_rank(rank, world_size, hf_dir, ep, packed):  # noqa: ARG001 - harness signature
    from megatron_tail.config.parallel import ParallelSection
    from megatron_tail.model import ModelSettings, load_hf_config
    from megatron_tail.train import OpSettings, OptimizerSettings, build_trainer, train_step
    from megatron_tail.train.engine.batch import equalize_micro_batch_shapes
    from megatron_tail.train.engine.parallel import comm_device, init_parallel
    from megatron_tail.train.rl.samples import moe_shape_group

    groups = init_parallel(ParallelSection(expert_parallel=ep), seed=1234)
    arch = load_hf_config(hf_dir)
    # as tests/model/test_moe_parallel.py: Adam with ε = 1 (first update ≈ lr·g). The load-balancing loss is
    # on: both layouts put the same samples in each micro-batch (padded: pairs in order; packed: the same
    # bins, dealt to the DP ranks), and the padding `equalize_micro_batch_shapes` adds stays out of it
    optim = OptimizerSettings(lr=0.5, adam_eps=1.0, clip_grad=1e9)
    settings = ModelSettings(vocab_pad_multiple=PAD_MULTIPLE, moe_aux_loss_coeff=0.05)
    trainer = build_trainer(arch, hf_dir=hf_dir, model_settings=settings, optim=optim)
    samples = make_samples(8, seed=11, min_len=2, max_len=9)
    mbs = _micro_batches(samples, groups, packed)
    before = [mb.shape for mb in mbs]
    group = moe_shape_group(trainer.groups)
    assert (group is None) == (ep == 1)
    if group is not None:
        mbs = equalize_micro_batch_shapes(mbs, group, comm_device())
    result = train_step(trainer, mbs, masked_nll_loss(global_loss_tokens(mbs, groups.dp)), op=OpSettings())
    return (
        full_hf_state(trainer),
        result.grad_norm,
        result.update_successful,
        before,
        [mb.shape for mb in mbs],
    )


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_ep2_step_on_uneven_samples_equals_ep1(tmp_path, packed):
    make_hf_moe(tmp_path, norm_topk_prob=True)
    (ref_state, ref_norm, ok1, *_), *_ = run_distributed(_one_step_rank, 1, str(tmp_path), 1, packed)
    got = run_distributed(_one_step_rank, 2, str(tmp_path), 2, packed)
    (state, norm, ok2, before0, after0), (_, norm1, _, before1, after1) = got
    # the ranks' own shapes differ (same micro-batch count), and were padded to the larger of each pair
    assert len(before0) == len(before1) and before0 != before1
    assert (
        after0
        == after1
        == [
            tuple(max(a, b) for a, b in zip(x, y, strict=True)) for x, y in zip(before0, before1, strict=True)
        ]
    )
    assert ok1 and ok2
    assert norm == pytest.approx(ref_norm, rel=1e-5) and norm1 == norm
    initial = load_file(tmp_path / "model.safetensors")
    assert sorted(state) == sorted(ref_state) == sorted(initial)
    for name, ref in ref_state.items():
        moved = (ref - initial[name]).abs().max()
        assert (state[name] - ref).abs().max() <= 1e-4 * moved + 1e-7, name


def test_pad_micro_batch_layout():
    """Padding grows the tensors with pad values, appends a causal block to a packed row, moves a ragged
    field's rows to their new row-major positions, and leaves the per-sample layout."""
    samples = [
        Sample([5, 6], [7, 8], {"lp": torch.tensor([0.5, 0.25]), "sup": Ragged.from_lists([[7, 1], [8]])}),
        Sample(
            [9],
            [10, 11, 12],
            {"lp": torch.tensor([1.0, 2.0, 3.0]), "sup": Ragged.from_lists([[10], [], [12]])},
        ),
    ]
    padded = make_micro_batches(samples, micro_batch_size=2)[0]  # [2, 4]
    grown = pad_micro_batch(padded, 3, 6, pad_id=99)
    assert grown.tokens.tolist() == [[5, 6, 7, 8, 99, 99], [9, 10, 11, 12, 99, 99], [99] * 6]
    assert grown.loss_mask.tolist() == [[0, 1, 1, 0, 0, 0], [1, 1, 1, 0, 0, 0], [0] * 6]
    assert grown.padding.tolist() == [[0, 0, 0, 0, 1, 1], [0, 0, 0, 0, 1, 1], [1] * 6]
    assert (
        grown.sample_index[:2, :4].tolist() == padded.sample_index.tolist()
        and grown.sample_index[2].eq(-1).all()
    )
    assert grown.fields["lp"][1].tolist() == [1.0, 2.0, 3.0, 0, 0, 0]
    sup = grown.fields["sup"]
    assert len(sup) == 18
    assert [sup.row(r).tolist() for r in (1, 2, 6, 7, 8)] == [[7, 1], [8], [10], [], [12]]
    assert sum(len(sup.row(r)) for r in range(18)) == 5
    x = torch.arange(18.0).reshape(3, 6)
    assert grown.to_samples(x).tolist() == [[1.0, 2.0, 0.0], [6.0, 7.0, 8.0]]
    packed = pack_micro_batches(samples, max_tokens=16, pad_to_multiple=4)[0]  # 8 tokens: 4 + 4
    assert packed.cu_seqlens == (0, 4, 8) and pad_micro_batch(packed, 1, 12).cu_seqlens == (0, 4, 8, 12)
    assert pad_micro_batch(packed, 1, 12).padding.tolist() == [[0] * 8 + [1] * 4]
    with pytest.raises(ValueError, match=r"cannot pad a micro-batch of shape \(1, 8\)"):
        pad_micro_batch(packed, 2, 12)
