"""The MoE load-balancing loss's weight in a training step. The trainer normalises its loss itself and
turns megatron's 1/num_tokens gradient division off (`calculate_per_token_loss`), while megatron's router
attaches each micro-batch's aux loss times its token count for that division to undo; the training pass
sets the aux loss's backward scale to 1 / the step's router tokens instead (`forward.moe_aux_loss_scale`).

Check: with the RL loss zeroed, the last MoE layer's router-weight gradient (the aux loss is its only
path: the earlier layers' aux losses do not depend on it) equals coeff × ∇ of the token-weighted mean over
micro-batches and DP ranks of megatron's Switch loss (`switch_load_balancing_loss_func`:
E / (k·T²) · Σ_e (Σ_x p_xe) · count_e), recomputed in float64 from the router's captured inputs."""

from __future__ import annotations

import pytest
import torch

from tests.harness import run_distributed
from tests.model.hf_moe import TINY_MOE, make_hf_moe
from tests.train.common import PAD_MULTIPLE, make_samples

COEFF = 0.01


def _switch_aux(x: torch.Tensor, weight: torch.Tensor, topk: int) -> torch.Tensor:
    """megatron's per-micro-batch aux loss without its coefficient, float64: `x [T, h]` router inputs,
    `weight [E, h]`; softmax scores over all experts, top-k counts (no gradient through the counts)."""
    scores = torch.softmax(x @ weight.t(), dim=-1)
    counts = torch.zeros_like(scores).scatter(1, scores.topk(topk, dim=1).indices, 1.0).sum(0)
    num_tokens, num_experts = scores.shape
    return num_experts / (topk * num_tokens**2) * (scores.sum(0) * counts).sum()


def _aux_grad_rank(rank, world_size, hf_dir, tp, micro_batch_sizes):  # noqa: ARG001 - harness signature
    from megatron.core.transformer.moe.router import TopKRouter

    from megatron_tail.config.parallel import ParallelSection
    from megatron_tail.model import ModelSettings, load_hf_config
    from megatron_tail.train import OptimizerSettings, build_trainer, split_for_data_parallel, train_step
    from megatron_tail.train.engine.batch import make_micro_batches
    from megatron_tail.train.engine.parallel import init_parallel

    groups = init_parallel(ParallelSection(tensor_parallel=tp), seed=1234)
    arch = load_hf_config(hf_dir)
    settings = ModelSettings(
        vocab_pad_multiple=PAD_MULTIPLE, precision="fp32", moe_aux_loss_coeff=COEFF, sequence_parallel=tp > 1
    )
    optim = OptimizerSettings(lr=1e-3, clip_grad=1e9, use_distributed_optimizer=False)
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
    for mbs_size in micro_batch_sizes:
        mbs = make_micro_batches(samples, micro_batch_size=mbs_size, pad_to_multiple=tp)
        weight = router.weight.detach().double().clone()
        inputs.clear()
        result = train_step(trainer, mbs, zero_loss)
        assert result.update_successful and len(inputs) == len(mbs)
        # padding included: the router sees it (this TP rank's 1/tp of it under sequence parallelism)
        assert [x.shape[0] * tp for x in inputs] == [mb.tokens.numel() for mb in mbs]
        results.append(
            (router.weight.main_grad.detach().double().clone(), weight, [x.double() for x in inputs])
        )
    return results


@pytest.mark.parametrize("tp, world_size", [(1, 1), (1, 2), (2, 2)], ids=["dp1", "dp2", "tp2_sp"])
def test_aux_loss_gradient_is_the_token_weighted_mean(tmp_path, tp, world_size):
    make_hf_moe(tmp_path, norm_topk_prob=True)
    dp = world_size // tp
    # 8 samples over the DP ranks; one micro-batch per rank, then micro-batches of 2 (uneven shapes)
    sizes = (8 // dp, 2)
    per_rank = run_distributed(_aux_grad_rank, world_size, str(tmp_path), tp, sizes)
    topk = TINY_MOE["num_experts_per_tok"]
    for k in range(len(sizes)):
        got, weight, _ = per_rank[0][k]
        assert len(per_rank[0][k][2]) == (1 if k == 0 else 4 // dp)
        # reduced over DP (and TP: the router's weight is a sequence-parallel one): the same on every rank
        assert all(torch.equal(r[k][0], got) for r in per_rank)
        weight = weight.clone().requires_grad_(True)
        weighted, tokens = 0.0, 0
        for d in range(dp):  # ranks are TP-major: rank = d·tp + t
            for m, _ in enumerate(per_rank[d * tp][k][2]):
                # the micro-batch's router inputs: its TP ranks' sequence shards together
                x = torch.cat([per_rank[d * tp + t][k][2][m] for t in range(tp)])
                weighted = weighted + x.shape[0] * _switch_aux(x, weight, topk)
                tokens += x.shape[0]
        (grad,) = torch.autograd.grad(weighted, weight)
        expected = COEFF * grad / tokens
        assert expected.norm() > 1e-6
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-6 * expected.abs().max().item())
