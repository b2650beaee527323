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
from tests.model.hf_moe import make_hf_moe
from tests.train.common import PAD_MULTIPLE, make_samples

COEFF = 0.01


def _switch_aux(x: torch.Tensor, weight: torch.Tensor, topk: int) -> torch.Tensor:
    """megatron's per-micro-batch aux loss without its coefficient, float64: `x [T, h]` router inputs,
    `weight [E, h]`; softmax scores over all experts, top-k counts (no gradient through the counts)."""
    scores = torch.softmax(x @ weight.t(), dim=-1)
    counts = torch.zeros_like(scores).scatter(1, scores.topk(topk, dim=1).indices, 1.0).sum(0)
    num_tokens, num_experts = scores.shape
    return num_experts / (topk * num_tokens**2) * (scores.sum(0) * counts).sum()


def _aux_grad_rank(rank, world_size, hf_dir, micro_batch_sizes):  # noqa: ARG001 - harness signature
    from megatron.core.transformer.moe.router import TopKRouter

    from megatron_tail.model import ModelSettings, load_hf_config
    from megatron_tail.train import OptimizerSettings, build_trainer, split_for_data_parallel, train_step
    from megatron_tail.train.engine.batch import make_micro_batches
    from megatron_tail.train.engine.parallel import ParallelConfig, init_parallel

    groups = init_parallel(ParallelConfig(seed=1234))
    arch = load_hf_config(hf_dir)
    settings = ModelSettings(vocab_pad_multiple=PAD_MULTIPLE, precision="fp32", moe_aux_loss_coeff=COEFF)
    optim = OptimizerSettings(lr=1e-3, clip_grad=1e9, use_distributed_optimizer=False)
    trainer = build_trainer(arch, hf_dir=hf_dir, model_settings=settings, optim=optim)
    router = [m for m in trainer.chunks[0].modules() if isinstance(m, TopKRouter)][-1]
    inputs: list[torch.Tensor] = []
    router.register_forward_pre_hook(
        lambda _m, args: inputs.append(args[0].detach().reshape(-1, arch.hidden_size))
    )

    def zero_loss(out, mb):  # noqa: ARG001 - the RL loss contributes no gradient
        return (out.logprobs * 0.0).sum(), {}

    samples = split_for_data_parallel(
        make_samples(8, seed=5, min_len=3, max_len=9), groups.dp_rank, groups.dp_size
    )
    results = []
    for mbs_size in micro_batch_sizes:
        mbs = make_micro_batches(samples, micro_batch_size=mbs_size)
        weight = router.weight.detach().double().clone().requires_grad_(True)
        inputs.clear()
        result = train_step(trainer, mbs, zero_loss)
        assert result.update_successful and len(inputs) == len(mbs)
        # Σ over this rank's micro-batches of T · ∇aux (float64) and Σ T: the test sums them over DP ranks
        weighted = sum(x.shape[0] * _switch_aux(x.double(), weight, arch.moe.top_k) for x in inputs)
        (grad,) = torch.autograd.grad(weighted, weight)
        tokens = sum(x.shape[0] for x in inputs)
        assert tokens == sum(mb.tokens.numel() for mb in mbs)  # padding included: the router sees it
        results.append((router.weight.main_grad.detach().double().clone(), grad, tokens, len(mbs)))
    return results


@pytest.mark.parametrize("world_size", [1, 2], ids=["dp1", "dp2"])
def test_aux_loss_gradient_is_the_token_weighted_mean(tmp_path, world_size):
    make_hf_moe(tmp_path, norm_topk_prob=True)
    # 8 samples over the DP ranks; one micro-batch per rank, then micro-batches of 2 (uneven shapes)
    sizes = (8 // world_size, 2)
    per_rank = run_distributed(_aux_grad_rank, world_size, str(tmp_path), sizes)
    for k in range(len(sizes)):
        got = per_rank[0][k][0]
        assert all(torch.equal(r[k][0], got) for r in per_rank)  # DP-reduced: the same on every rank
        expected = COEFF * sum(r[k][1] for r in per_rank) / sum(r[k][2] for r in per_rank)
        assert per_rank[0][k][3] == (1 if k == 0 else 4 // world_size)
        assert expected.norm() > 1e-6
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-6 * expected.abs().max().item())
