"""The MoE load-balancing loss's weight in a training step. The trainer normalises its loss itself and
turns megatron's 1/num_tokens gradient division off (`calculate_per_token_loss`), while megatron's router
attaches each micro-batch's aux loss times its token count for that division to undo; the training pass
sets the aux loss's backward scale to 1 / the step's router tokens instead (`forward.moe_aux_loss_scale`).

Padding stays out of it (`forward.router_padding_mask`): the loss covers a micro-batch's sample tokens only,
and a micro-batch without any (a DP rank's empty packed one) adds nothing.

Check: with the RL loss zeroed, the last MoE layer's router-weight gradient (the aux loss is its only
path: the earlier layers' aux losses do not depend on it) equals coeff × ∇ of the token-weighted mean over
micro-batches and DP ranks of megatron's Switch loss (`switch_load_balancing_loss_func`:
E / (k·T²) · Σ_e (Σ_x p_xe) · count_e over the T non-padding tokens), recomputed in float64 from the
router's captured inputs at the non-padding positions; and more padding leaves it unchanged."""

from __future__ import annotations

import pytest
import torch

from megatron_tail.train.engine.batch import make_micro_batches, pack_micro_batches
from tests.harness import run_distributed
from tests.model.hf_moe import TINY_MOE, make_hf_moe
from tests.train.common import PAD_MULTIPLE, make_samples

COEFF = 0.01


def _switch_aux(x: torch.Tensor, weight: torch.Tensor, topk: int) -> torch.Tensor:
    """megatron's per-micro-batch aux loss without its coefficient, float64: `x [N, h]` router inputs at the
    micro-batch's non-padding tokens, `weight [E, h]`; softmax scores over all experts, top-k counts (no
    gradient through the counts)."""
    scores = torch.softmax(x @ weight.t(), dim=-1)
    counts = torch.zeros_like(scores).scatter(1, scores.topk(topk, dim=1).indices, 1.0).sum(0)
    num_tokens, num_experts = scores.shape
    return num_experts / (topk * num_tokens**2) * (scores.sum(0) * counts).sum()


def _layouts(dp: int) -> list[tuple]:
    """(kind, argument) of each train step: one padded micro-batch per rank; micro-batches of 2 (uneven
    shapes); the same in rows of 32 positions (more padding); packed rows where one rank runs an empty
    micro-batch (three one-sample bins dealt to two DP ranks: the rank given the largest gets an empty one
    too; with one DP rank, DP rank 0's share of two is taken); the first layout's samples packed in one
    row."""
    return [
        ("padded", (8 // dp, None)),
        ("padded", (2, None)),
        ("padded", (2, 32)),
        ("packed", 18),
        ("packed", None),
    ]


def _aux_grad_rank(rank, world_size, hf_dir, tp, layouts, cp=1, recompute="none"):  # noqa: ARG001
    from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker
    from megatron.core.transformer.moe.router import TopKRouter

    from megatron_tail.config.parallel import ParallelSection
    from megatron_tail.model import ModelSettings, load_hf_config
    from megatron_tail.train import OptimizerSettings, build_trainer, split_for_data_parallel, train_step
    from megatron_tail.train.engine.batch import make_micro_batches, pack_micro_batches
    from megatron_tail.train.engine.context_parallel import split_for_context_parallel
    from megatron_tail.train.engine.parallel import init_parallel
    from megatron_tail.train.rl.routing import aux_loss_scalars

    groups = init_parallel(ParallelSection(tensor_parallel=tp, context_parallel=cp), seed=1234)
    arch = load_hf_config(hf_dir)
    settings = ModelSettings(
        vocab_pad_multiple=PAD_MULTIPLE,
        precision="fp32",
        moe_aux_loss_coeff=COEFF,
        sequence_parallel=tp > 1,
        recompute=recompute,
    )
    # lr far below float32 rounding of the weights: every step sees the same weights (lr must be > 0)
    optim = OptimizerSettings(lr=1e-12, clip_grad=1e9, use_distributed_optimizer=False)
    trainer = build_trainer(arch, hf_dir=hf_dir, model_settings=settings, optim=optim)
    router = [m for m in trainer.chunks[0].modules() if isinstance(m, TopKRouter)][-1]
    inputs: list[torch.Tensor] = []
    router.register_forward_pre_hook(
        lambda _m, args: inputs.append(args[0].detach().reshape(-1, args[0].shape[-1]))
    )

    def zero_loss(out, mb):  # noqa: ARG001 - the RL loss contributes no gradient
        return (out.logprobs * 0.0).sum(), {}

    samples = split_for_data_parallel(
        make_samples(8, seed=5, min_len=3, max_len=9), groups.dp_rank, groups.dp_size
    )
    results = []
    for kind, arg in layouts:
        if kind == "padded":
            rows, seq_len = arg
            mbs = make_micro_batches(samples, micro_batch_size=rows, seq_len=seq_len, pad_to_multiple=tp)
        elif kind == "cp":  # each sample padded to 2·CP, then each CP rank's chunks of it
            whole = pack_micro_batches(
                samples, max_tokens=arg, pad_to_multiple=2 * cp, sequence_multiple=2 * cp
            )
            mbs = [split_for_context_parallel(mb, groups.cp_rank, cp) for mb in whole]
        elif arg is None:
            mbs = pack_micro_batches(samples, max_tokens=256, pad_to_multiple=tp)
        elif kind == "one":  # one sample over two DP ranks: DP rank 1's only micro-batch is empty
            one = make_samples(1, seed=6, min_len=6, max_len=9)
            mbs = pack_micro_batches(
                one, max_tokens=arg, dp_rank=groups.dp_rank, dp_size=2, pad_to_multiple=tp
            )
        else:
            bins = make_samples(3, seed=6, min_len=6, max_len=9)  # 12–18 tokens: one sample per bin
            dp_rank = groups.dp_rank if groups.dp_size > 1 else 0
            mbs = pack_micro_batches(bins, max_tokens=arg, dp_rank=dp_rank, dp_size=2, pad_to_multiple=tp)
        weight = router.weight.detach().double().clone()
        inputs.clear()
        result = train_step(trainer, mbs, zero_loss)
        if recompute == "full":
            # each micro-batch's routers run in its forward, then in its backward's recompute
            first, again = inputs[::2], inputs[1::2]
            assert len(again) == len(mbs) and all(map(torch.equal, first, again))
            inputs[:] = first
        assert result.update_successful and len(inputs) == len(mbs)
        # the router sees every position, padding included (this TP rank's 1/tp under sequence parallelism)
        assert [x.shape[0] * tp for x in inputs] == [mb.tokens.numel() for mb in mbs]
        # megatron's aux-loss tracker (per layer, this rank's sum over its forwards), then `moe/aux_loss`
        tracker = get_moe_layer_wise_logging_tracker()["load_balancing_loss"]["values"].double().clone()
        real = sum(1 for mb in mbs if mb.num_sample_tokens)
        metric = aux_loss_scalars(sum(arch.moe.layer_is_moe), real, groups.dp).get("moe/aux_loss")
        results.append(
            (
                router.weight.main_grad.detach().double().clone(),
                weight,
                [x.double() for x in inputs],
                [mb.padding for mb in mbs],
                {name: p.main_grad.detach().clone() for name, p in trainer.chunks[0].named_parameters()},
                (tracker, router.layer_number - 1, real, metric),
            )
        )
    return results


def _expected(per_rank, k: int, tp: int, dp: int, topk: int, cp: int = 1) -> torch.Tensor:
    """coeff × ∇ of Σ over micro-batches of N·aux / Σ N, N a micro-batch's non-padding tokens (float64)."""
    weight = per_rank[0][k][1].clone().requires_grad_(True)
    weighted, tokens = 0.0, 0
    for d in range(dp):  # megatron's rank order: TP fastest, then CP, then DP
        shards = range(d * tp * cp, (d + 1) * tp * cp)
        for m in range(len(per_rank[shards[0]][k][3])):
            # megatron's router order: position-major [s, b], each TP rank a contiguous 1/tp of the positions
            # of its CP shard (whose padding is its own)
            parts = []
            for r in shards:
                real = ~per_rank[r][k][3][m].t().reshape(tp, -1)
                parts.append(per_rank[r][k][2][m][real[r % tp]])
            x = torch.cat(parts)
            if x.shape[0] == 0:
                continue  # an empty micro-batch balances nothing
            weighted = weighted + x.shape[0] * _switch_aux(x, weight, topk)
            tokens += x.shape[0]
    (grad,) = torch.autograd.grad(weighted, weight)
    return COEFF * grad / tokens


@pytest.mark.parametrize("tp, world_size", [(1, 1), (1, 2), (2, 2)], ids=["dp1", "dp2", "tp2_sp"])
def test_aux_loss_gradient_is_the_token_weighted_mean_over_real_tokens(tmp_path, tp, world_size):
    make_hf_moe(tmp_path, norm_topk_prob=True)
    dp = world_size // tp
    layouts = _layouts(dp)
    per_rank = run_distributed(_aux_grad_rank, world_size, str(tmp_path), tp, layouts)
    topk = TINY_MOE["num_experts_per_tok"]
    grads = []
    for k in range(len(layouts)):
        got = per_rank[0][k][0]
        # reduced over DP (and TP: the router's weight is a sequence-parallel one): the same on every rank
        assert all(torch.equal(r[k][0], got) for r in per_rank)
        expected = _expected(per_rank, k, tp, dp, topk)
        assert expected.norm() > 1e-6 and torch.isfinite(got).all()
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-6 * expected.abs().max().item())
        grads.append(got)
    assert [len(per_rank[0][k][2]) for k in range(2)] == [1, 4 // dp]
    # the packed step has a micro-batch without a sample token
    assert any(not (~padding).any() for r in per_rank for padding in r[3][3])
    if tp == 1:
        for k in range(len(layouts)):
            _assert_logged_aux_is_the_real_micro_batches(per_rank, k, topk)
    # more padding, same samples in the same micro-batches: the same gradient
    torch.testing.assert_close(grads[2], grads[1], rtol=1e-4, atol=1e-6 * grads[1].abs().max().item())
    # one padded micro-batch and one packed row of the same samples: the same gradient of every parameter
    padded, packed = per_rank[0][0][4], per_rank[0][4][4]
    assert len(per_rank[0][4][2]) == 1 and padded.keys() == packed.keys()
    for name, grad in padded.items():
        torch.testing.assert_close(
            packed[name], grad, rtol=1e-4, atol=1e-6 * grad.abs().max().item(), msg=name
        )


def _assert_logged_aux_is_the_real_micro_batches(per_rank, k: int, topk: int) -> None:
    """Step `k` at TP = CP = 1: each rank's tracker holds, for the last MoE layer, the sum of its non-empty
    micro-batches' aux losses (float64 recomputation), and `moe/aux_loss` (the same on every rank) is the
    tracker's sum over ranks and layers over the MoE layers and the non-empty forwards of every rank."""
    weight = per_rank[0][k][1]
    total, forwards = 0.0, 0
    for r in per_rank:
        tracker, layer, real, metric = r[k][5]
        parts = [x[~padding.t().reshape(-1)] for x, padding in zip(r[k][2], r[k][3], strict=True)]
        want = sum(
            (_switch_aux(x, weight, topk) for x in parts if x.shape[0]), torch.zeros((), dtype=torch.float64)
        )
        assert float(tracker[layer]) == pytest.approx(float(want), rel=1e-4), (k, float(tracker[layer]))
        total, forwards = total + float(tracker.sum()), forwards + real
        assert metric == per_rank[0][k][5][3]
    layers = int((per_rank[0][k][5][0] != 0).sum())
    assert per_rank[0][k][5][3] == pytest.approx(total / layers / forwards, rel=1e-6)


def test_under_full_recompute_the_empty_micro_batchs_backward_logs_nothing_either(tmp_path):
    """Full activation recompute: the routers log in the backward's recompute, not in the first forward
    (run without grad); an empty micro-batch's backward is kept out of the tracker as its forward is."""
    make_hf_moe(tmp_path, norm_topk_prob=True)
    per_rank = run_distributed(_aux_grad_rank, 1, str(tmp_path), 1, [("packed", 18)], 1, "full")
    assert len(per_rank[0][0][3]) == 2 and per_rank[0][0][5][2] == 1  # one of the two is empty
    _assert_logged_aux_is_the_real_micro_batches(per_rank, 0, TINY_MOE["num_experts_per_tok"])
    expected = _expected(per_rank, 0, 1, 1, TINY_MOE["num_experts_per_tok"])
    torch.testing.assert_close(
        per_rank[0][0][0], expected, rtol=1e-4, atol=1e-6 * expected.abs().max().item()
    )


def test_a_dp_rank_whose_only_micro_batch_is_empty_logs_nothing_and_waits_for_no_one(tmp_path):
    """One sample over two DP ranks: rank 1 runs one empty micro-batch. Its routers log nothing (its
    tracker stays 0), and `moe/aux_loss` is rank 0's forward's, on both ranks (a collective both reach)."""
    make_hf_moe(tmp_path, norm_topk_prob=True)
    per_rank = run_distributed(_aux_grad_rank, 2, str(tmp_path), 1, [("one", 18)])
    assert [r[0][5][2] for r in per_rank] == [1, 0]
    assert not per_rank[1][0][5][0].any() and per_rank[0][0][5][0].any()
    _assert_logged_aux_is_the_real_micro_batches(per_rank, 0, TINY_MOE["num_experts_per_tok"])
    expected = _expected(per_rank, 0, 1, 2, TINY_MOE["num_experts_per_tok"])
    torch.testing.assert_close(
        per_rank[0][0][0], expected, rtol=1e-4, atol=1e-6 * expected.abs().max().item()
    )


def test_under_context_parallelism_each_samples_own_padding_stays_out(tmp_path):
    """CP = 2: every sample padded to 2·CP tokens, each CP rank's router seeing its chunks and their padding;
    the gradient is the token-weighted mean over the non-padding tokens of both shards."""
    make_hf_moe(tmp_path, norm_topk_prob=True)
    per_rank = run_distributed(_aux_grad_rank, 2, str(tmp_path), 1, [("cp", 64)], 2)
    got = per_rank[0][0][0]
    assert torch.equal(per_rank[1][0][0], got) and len(per_rank[0][0][2]) > 1
    # the shards hold some of their samples' own padding
    assert sum(int(padding.sum()) for r in per_rank for padding in r[0][3]) > 0
    expected = _expected(per_rank, 0, 1, 1, TINY_MOE["num_experts_per_tok"], cp=2)
    assert expected.norm() > 1e-6
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-6 * expected.abs().max().item())


def test_the_routers_mask_is_the_padding_cut_as_each_stage_needs_it():
    """A first stage gets the whole `[b, s]` mask (megatron's `GPTModel._preprocess` scatters it under
    sequence parallelism); a later stage gets this TP rank's contiguous 1/tp of the positions, the cut of
    megatron's `scatter_to_sequence_parallel_region` on `[s, b]`; a dense model or an empty micro-batch
    none."""
    from types import SimpleNamespace

    from megatron_tail.train.engine.forward import router_padding_mask

    mb = make_micro_batches(
        make_samples(3, seed=2, min_len=2, max_len=6), micro_batch_size=4, pad_to_multiple=4
    )[0]
    moe = SimpleNamespace(num_moe_experts=4, sequence_parallel=True)
    first, later = SimpleNamespace(pre_process=True), SimpleNamespace(pre_process=False)
    cuts = []
    for rank in range(2):
        groups = SimpleNamespace(tp_rank=rank, tp_size=2)
        assert router_padding_mask(mb, first, moe, groups) is mb.padding
        cuts.append(router_padding_mask(mb, later, moe, groups))
        expected = mb.padding.t().tensor_split(2)[rank].t()
        assert torch.equal(cuts[-1], expected)
    assert (
        torch.equal(torch.cat(cuts, dim=1), mb.padding)
        and mb.padding[3].all()
        and not mb.padding[:3, 0].any()
    )
    groups = SimpleNamespace(tp_rank=0, tp_size=2)
    assert router_padding_mask(mb, first, SimpleNamespace(num_moe_experts=None), groups) is None
    empty = pack_micro_batches(make_samples(1, seed=2), max_tokens=16, dp_rank=1, dp_size=2)[0]
    assert empty.num_sample_tokens == 0 and router_padding_mask(empty, first, moe, groups) is None


def test_an_empty_micro_batchs_windows_under_a_pipeline_schedule():
    """The order a pipeline stage sees under 1F1B with full recompute (MoE at PP > 1 needs CUDA, so this
    drives megatron's own `save_to_aux_losses_tracker` through the windows by hand): F0 (empty) and F1 log
    nothing under recompute, then B0 (empty) and B1 log their recompute. Only B1's loss stays; without the
    backward's window, B0's would (it runs after F1 opened a real micro-batch's window)."""
    from megatron.core.transformer.moe.moe_utils import (
        clear_aux_losses_tracker,
        get_moe_layer_wise_logging_tracker,
        save_to_aux_losses_tracker,
    )

    from megatron_tail.train.engine.forward import EmptyMicroBatchAuxLogs

    def log(value: float) -> None:
        save_to_aux_losses_tracker("load_balancing_loss", torch.tensor(value), 2, 3)

    tracker = get_moe_layer_wise_logging_tracker()
    tracker.pop("load_balancing_loss", None)
    windows = EmptyMicroBatchAuxLogs()
    windows.at(True)  # F0, empty: its first forward runs without grad (recompute) and logs nothing
    windows.at(False)  # F1
    windows.at(True)  # B0 starts (the hook on its output): its recompute logs
    log(16.0)
    windows.at(False)  # B1
    log(1.5)
    windows.at(False)  # the schedule returns
    assert tracker["load_balancing_loss"]["values"].tolist() == [0.0, 1.5, 0.0]
    # a name first logged by an empty micro-batch stays, zeroed (every rank reduces the same names)
    tracker.pop("load_balancing_loss")
    windows.at(True)
    log(16.0)
    windows.at(False)
    assert tracker["load_balancing_loss"]["values"].tolist() == [0.0, 0.0, 0.0]
    clear_aux_losses_tracker()
