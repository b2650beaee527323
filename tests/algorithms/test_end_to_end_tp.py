"""End to end: gradient of the full RL loss w.r.t. the logits, through the op, at TP=2 equals TP=1.

The whole step is run as the trainer runs it: θ_old recompute (op, no grad) -> rollout log-probs with a
mismatch -> GRPO advantages -> `prepare_tokens` (STAPO, AR, Lopti, MIS, veto) -> current θ (op, grad) ->
`rl_loss` for each Lopti phase -> backward into this rank's vocab shard of the logits. TP=2 runs on two
forked gloo ranks, each holding columns [r·V_local, (r+1)·V_local); TP=1 runs unsharded. Both are also
checked against a float64 reference built from the formulas (π^mp by hand, `ref_loss`).
"""

import pytest
import torch
import torch.distributed as dist

from megatron_tail.algorithms import AlgorithmConfig, grpo, prepare_tokens, rl_loss
from megatron_tail.ops import vocab_parallel_masked_logprobs
from tests.algorithms.references import ref_loss
from tests.harness import run_distributed

B, T, V_PADDED, VOCAB = 6, 5, 16, 15  # megatron pads the vocab: column 15 is padding
LOG_RHO = -13.0
CFG = AlgorithmConfig(
    group_size=3, is_mode="mis", mis_low=0.5, mis_high=2.0, veto_threshold=1e-4, stapo=True,
    stapo_tau_p=0.3, stapo_tau_h_quantile=0.5, advantage_reweighting=True, lopti=True, lopti_eta=0.5,
    dual_clip=3.0, kl_coef=0.05, kl_estimator="k3", loss_aggregation="seq_mean_token_mean", log_rho=LOG_RHO,
)  # fmt: skip


def _problem(dtype):
    g = torch.Generator().manual_seed(1234)
    old = 6.0 * torch.randn(B, T, V_PADDED, generator=g, dtype=torch.float64)  # wide: the tail is pruned
    cur = old + 0.3 * torch.randn(B, T, V_PADDED, generator=g, dtype=torch.float64)
    ref = old + 0.5 * torch.randn(B, T, V_PADDED, generator=g, dtype=torch.float64)
    probs = torch.softmax(old[..., :VOCAB], dim=-1)
    targets = torch.multinomial(probs.reshape(-1, VOCAB), 1, generator=g).reshape(B, T)
    targets[1, 2] = int(old[1, 2, :VOCAB].argmin())  # outside V_S at θ_old: vetoes sequence 1
    targets[3, 0] = int(cur[3, 0, :VOCAB].argmin())  # outside V_S at θ (and likely θ_old)
    # a spurious token for STAPO: a confident (low-entropy) position of a positive-advantage sequence,
    # sampled off its mode: low π, low H, A > 0
    targets[0, 2] = int(old[0, 2, :VOCAB].topk(2).indices[1])
    valid = torch.arange(T)[None] < torch.tensor([5, 5, 3, 4, 5, 2])[:, None]
    noise = 0.2 * torch.randn(B, T, generator=g, dtype=torch.float64)
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0, 0.0, 1.0], dtype=torch.float64)
    return {
        "old": old.to(dtype), "cur": cur.to(dtype), "ref": ref.to(dtype), "targets": targets,
        "valid": valid, "noise": noise.to(dtype), "rewards": rewards,
    }  # fmt: skip


def _step(p, shard: slice, tp_group):
    """One RL step on this rank's shard; returns (loss per phase, grad of the shard per phase, metrics)."""

    def op(logits, **kw):
        return vocab_parallel_masked_logprobs(
            logits[..., shard].contiguous(),
            p["targets"],
            log_rho=LOG_RHO,
            vocab_size=VOCAB,
            tp_group=tp_group,
            **kw,
        )

    with torch.no_grad():
        old = op(p["old"])
        ref = op(p["ref"], compute_entropy=False)
    rollout = old.logprobs + p["noise"].to(old.logprobs.dtype)  # the inference engine's mismatch
    advantages = grpo(p["rewards"], CFG.group_size).to(old.logprobs.dtype)
    prepared = prepare_tokens(
        CFG, old_logprobs=old.logprobs, rollout_logprobs=rollout, advantages=advantages, valid=p["valid"],
        old_entropy=old.entropy, old_in_safe_set=old.in_safe_set,
    )  # fmt: skip
    counts = prepared.counts  # one DP rank, one micro-batch: local = global
    losses, grads, metrics = [], [], []
    for phase in range(CFG.num_phases):
        leaf = p["cur"].clone().requires_grad_(True)
        out = op(leaf)
        loss, m = rl_loss(CFG, prepared, out.logprobs, counts, phase=phase, in_safe_set=out.in_safe_set,
                          entropy=out.entropy, ref_logprobs=ref.logprobs)  # fmt: skip
        loss.backward()
        losses.append(loss.detach())
        grads.append(leaf.grad[..., shard].clone())
        metrics.append({**prepared.metrics, **m} if phase == 0 else m)
    return losses, grads, metrics


def _tp2_rank(rank, world_size, dtype):
    p = _problem(dtype)
    v_local = V_PADDED // world_size
    return _step(p, slice(rank * v_local, (rank + 1) * v_local), dist.group.WORLD)


def _ref_logprobs(logits, targets, log_rho=LOG_RHO):
    """Hand-written float64 π^mp: log-softmax over V_S ∪ {target}, V_S = {z ≥ max z + log ρ}, T = 1."""
    z = logits[..., :VOCAB].to(torch.float64)
    safe = z >= z.amax(-1, keepdim=True) + log_rho
    onehot = torch.nn.functional.one_hot(targets, VOCAB).bool()
    support = safe | onehot
    logp = torch.log_softmax(z.masked_fill(~support, float("-inf")), dim=-1)
    ent = -(logp.exp() * logp.masked_fill(~support, 0.0)).sum(-1)
    return logp.gather(-1, targets[..., None])[..., 0], ent, safe.gather(-1, targets[..., None])[..., 0]


def _reference(p):
    with torch.no_grad():
        old_lp, old_ent, old_safe = _ref_logprobs(p["old"], p["targets"])
        ref_lp, _, _ = _ref_logprobs(p["ref"], p["targets"])
    losses, grads = [], []
    for phase in range(CFG.num_phases):
        leaf = p["cur"].to(torch.float64).requires_grad_(True)
        lp, _, safe = _ref_logprobs(leaf, p["targets"])
        d = {
            "logprobs": lp, "old_logprobs": old_lp, "rollout_logprobs": old_lp + p["noise"].to(torch.float64),
            "valid": p["valid"], "advantages": grpo(p["rewards"], CFG.group_size), "old_entropy": old_ent,
            "old_in_safe_set": old_safe, "in_safe_set": safe, "ref_logprobs": ref_lp,
        }  # fmt: skip
        loss, _ = ref_loss(CFG, d, phase=phase)
        (g,) = torch.autograd.grad(loss, leaf)
        losses.append(loss.detach())
        grads.append(g)
    return losses, grads


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float64, 1e-11), (torch.float32, 2e-5)])
def test_full_loss_gradient_through_op_tp2_equals_tp1(dtype, tol):
    p = _problem(dtype)
    tp1_losses, tp1_grads, tp1_metrics = _step(p, slice(None), None)
    ranks = run_distributed(_tp2_rank, 2, dtype)

    m = tp1_metrics[0]  # the problem exercises every mask
    assert m["stapo_masked_tokens"] > 0 and m["vetoed_sequences"] > 0 and m["old_safe_set_violations"] > 0
    assert m["lopti_low_tokens"] > 0 and m["lopti_high_tokens"] > 0
    for phase in range(CFG.num_phases):
        tp2_grad = torch.cat([ranks[0][1][phase], ranks[1][1][phase]], dim=-1)
        assert tp1_grads[phase].abs().sum() > 0
        assert (tp1_grads[phase][..., VOCAB:] == 0).all() and (tp2_grad[..., VOCAB:] == 0).all()
        for rank in range(2):
            torch.testing.assert_close(ranks[rank][0][phase], tp1_losses[phase], rtol=tol, atol=tol)
            for key, value in tp1_metrics[phase].items():
                torch.testing.assert_close(ranks[rank][2][phase][key], value, rtol=tol, atol=tol, msg=key)
        torch.testing.assert_close(tp2_grad, tp1_grads[phase], rtol=tol, atol=tol)

    ref_losses, ref_grads = _reference(p)
    for phase in range(CFG.num_phases):
        torch.testing.assert_close(
            tp1_losses[phase].double(), ref_losses[phase], rtol=tol * 10, atol=tol * 10
        )
        torch.testing.assert_close(tp1_grads[phase].double(), ref_grads[phase], rtol=tol * 10, atol=tol * 10)
