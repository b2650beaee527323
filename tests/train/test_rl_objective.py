"""The algorithms' RL loss through the trainer: the step's loss equals `compute_loss` on HF log-probs of the
whole batch, with sequence-level knobs on (sequence IS weights, veto, seq-mean aggregation), for padded and
packed micro-batches, and the update is the same at TP=2 and DP=2 as on one rank."""

from __future__ import annotations

import pytest
import torch

from megatron_tail.algorithms import AlgorithmConfig, compute_loss
from megatron_tail.train import Sample
from tests.harness import run_distributed
from tests.model.hf_models import hf_logits, make_hf_model
from tests.train.common import PAD_MULTIPLE, full_hf_state, init_rank, make_samples, smooth_trainer

CFG = AlgorithmConfig(
    log_rho=None,
    is_mode="tis",
    is_level="sequence_geomean",
    veto_threshold=1e-4,
    loss_aggregation="seq_mean_token_mean",
    group_size=2,
)


def _rl_step_rank(rank, world_size, hf_dir, tp, samples, packed, cfg=CFG):  # noqa: ARG001
    from megatron_tail.model import ModelSettings
    from megatron_tail.train import (
        OpSettings,
        make_micro_batches,
        pack_micro_batches,
        prepare_rl_micro_batches,
        recompute_logprobs,
        rl_loss_fn,
        split_for_data_parallel,
        train_step,
    )

    groups = init_rank(tp, 1)
    trainer = smooth_trainer(hf_dir, ModelSettings(vocab_pad_multiple=PAD_MULTIPLE))
    if packed:
        mbs = pack_micro_batches(samples, max_tokens=32, dp_rank=groups.dp_rank, dp_size=groups.dp_size)
    else:
        mine = split_for_data_parallel(samples, groups.dp_rank, groups.dp_size)
        mbs = make_micro_batches(mine, micro_batch_size=2, seq_len=16)
    op = OpSettings(log_rho=cfg.log_rho, compute_entropy=cfg.stapo)
    old = recompute_logprobs(trainer, mbs, op=op)
    counts = prepare_rl_micro_batches(cfg, mbs, old, groups.dp)
    result = train_step(trainer, mbs, rl_loss_fn(cfg, counts), op=op)
    return result, full_hf_state(trainer)


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    path = tmp_path_factory.mktemp("rl")
    hf = make_hf_model("qwen3", path)
    g = torch.Generator().manual_seed(3)
    base = make_samples(8, seed=21)
    ref_lp = []
    for s in base:
        tokens = torch.tensor([[*s.prompt, *s.response]])
        lp = torch.log_softmax(hf_logits(hf, tokens)[0, :-1], dim=-1).gather(1, tokens[0, 1:, None])[:, 0]
        ref_lp.append(lp[len(s.prompt) - 1 :])
    samples = []
    for s, lp in zip(base, ref_lp, strict=True):
        rollout = lp + 0.3 * torch.randn(lp.shape, generator=g)  # a real train/inference mismatch
        adv = torch.full(lp.shape, float(torch.randn((), generator=g)))
        samples.append(Sample(s.prompt, s.response, {"rollout_logprobs": rollout, "advantages": adv}))
    # Reference: compute_loss on the whole batch in the per-sample layout [N, T].
    t = max(len(lp) for lp in ref_lp)

    def pad(xs):
        return torch.stack([torch.cat([x, x.new_zeros(t - len(x))]) for x in xs])

    valid = pad([torch.ones(len(lp), dtype=torch.bool) for lp in ref_lp])
    lp = pad(ref_lp).double()
    loss, metrics = compute_loss(
        CFG,
        logprobs=lp,
        old_logprobs=lp,
        rollout_logprobs=pad([s.fields["rollout_logprobs"] for s in samples]).double(),
        advantages=pad([s.fields["advantages"] for s in samples]).double(),
        valid=valid,
    )
    assert abs(float(metrics["is_weight_sum"]) - float(valid.sum())) > 0.5  # weights are not all 1
    single = run_distributed(_rl_step_rank, 1, str(path), 1, samples, False)[0]
    return str(path), samples, float(loss), single


def test_padded_step_loss_equals_compute_loss_reference(case):
    _, _, ref_loss, (result, _) = case
    assert result.metrics["loss"] == pytest.approx(ref_loss, rel=1e-5)


@pytest.mark.parametrize(
    ("world", "tp", "packed"),
    [(1, 1, True), (2, 2, True), (2, 1, False), (2, 1, True)],
    ids=["packed", "tp2-packed", "dp2", "dp2-packed"],
)
def test_rl_step_matches_single_rank_padded(case, world, tp, packed):
    hf_dir, samples, ref_loss, (ref_result, ref_state) = case
    result, state = run_distributed(_rl_step_rank, world, hf_dir, tp, samples, packed)[0]
    assert result.metrics["loss"] == pytest.approx(ref_loss, rel=1e-5)
    assert result.metrics["loss_sequences"] == ref_result.metrics["loss_sequences"] == len(samples)
    assert result.grad_norm == pytest.approx(ref_result.grad_norm, rel=1e-5)
    for name in ref_state:
        torch.testing.assert_close(state[name], ref_state[name], rtol=1e-5, atol=1e-6, msg=name)


def test_untrainable_samples_leave_the_loss_and_its_counts(case):
    """A `trainable` field of 0 (`algorithm.mask_truncated` on a cut response) removes a sample from the
    loss and from the normalising counts: the step's loss equals `compute_loss` with those rows invalid."""
    hf_dir, samples, _, _ = case
    masked = {1, 4}
    marked = [
        Sample(
            s.prompt,
            s.response,
            {**s.fields, "trainable": torch.full((len(s.response),), float(i not in masked))},
        )
        for i, s in enumerate(samples)
    ]
    result, _ = run_distributed(_rl_step_rank, 1, hf_dir, 1, marked, False)[0]
    # the reference, as the module fixture's, with the masked rows invalid
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    t = max(len(s.response) for s in samples)
    rows = {"lp": [], "roll": [], "adv": [], "valid": []}
    for i, s in enumerate(samples):
        tokens = torch.tensor([[*s.prompt, *s.response]])
        lp = torch.log_softmax(hf_logits(hf, tokens)[0, :-1], dim=-1).gather(1, tokens[0, 1:, None])[:, 0]
        lp = lp[len(s.prompt) - 1 :]
        pad = t - len(lp)
        rows["lp"].append(torch.cat([lp, lp.new_zeros(pad)]))
        rows["roll"].append(torch.cat([s.fields["rollout_logprobs"], lp.new_zeros(pad)]))
        rows["adv"].append(torch.cat([s.fields["advantages"], lp.new_zeros(pad)]))
        rows["valid"].append(
            torch.cat([torch.full((len(lp),), i not in masked), torch.zeros(pad, dtype=torch.bool)])
        )
    lp = torch.stack(rows["lp"]).double()
    ref, _ = compute_loss(
        CFG,
        logprobs=lp,
        old_logprobs=lp,
        rollout_logprobs=torch.stack(rows["roll"]).double(),
        advantages=torch.stack(rows["adv"]).double(),
        valid=torch.stack(rows["valid"]),
    )
    assert result.metrics["loss"] == pytest.approx(float(ref), rel=1e-5)
    assert result.metrics["loss_sequences"] == len(samples) - len(masked)


def test_a_mini_batch_with_no_trainable_token_under_stapos_quantile_is_a_zero_step(case):
    """Every response cut (`mask_truncated`) under STAPO's quantile τ_h: the global quantile of no entropy
    was −inf and the step raised `tau_h must be finite`; the loss is 0 and so is the gradient, as
    `compute_loss` gives for an all-masked batch."""
    import dataclasses

    hf_dir, samples, _, _ = case
    cut = [
        Sample(s.prompt, s.response, {**s.fields, "trainable": torch.zeros(len(s.response))}) for s in samples
    ]
    cfg = dataclasses.replace(CFG, stapo=True, stapo_tau_h=None)
    result, _ = run_distributed(_rl_step_rank, 1, hf_dir, 1, cut, False, cfg)[0]
    assert result.metrics["loss"] == 0.0 and result.grad_norm == 0.0
    assert result.metrics["loss_sequences"] == 0


def _global_tau_h_rank(rank, world_size, entropies):  # noqa: ARG001
    from types import SimpleNamespace

    from megatron_tail.train.rl.objective import _global_stapo_tau_h

    valid = torch.ones(entropies.shape, dtype=torch.bool)
    mb = SimpleNamespace(sample_valid=valid, fields={}, to_samples=lambda x: x)
    cfg = AlgorithmConfig(stapo=True, stapo_tau_h=None, stapo_tau_h_quantile=0.05, group_size=2)
    return _global_stapo_tau_h(cfg, [mb], [entropies], None)


def test_the_global_stapo_quantile_is_a_valid_tau_h_where_rounding_made_entropies_negative():
    """The op's entropy over a one-token sampling support (the engine's runner-up in a near tie) rounds to
    ≈ −3e-8 about half the time (seen on this CPU with 512 such rows, temperature 0.7); their 5% quantile
    was a negative τ_h, which the step refused. The entropies are written here, not left to rounding."""
    from megatron_tail.algorithms import prepare_tokens

    entropies = torch.tensor([[-3.3e-8, 0.0, -2.7e-8, 1e-9] * 64, [0.5, -3.0e-8, 0.0, 2.0] * 64])
    tau_h = run_distributed(_global_tau_h_rank, 1, entropies)[0]
    assert tau_h == 0.0
    logprobs = torch.full((2, 256), -3.0)
    prepare_tokens(  # accepted (it raised `tau_h must be finite and in [0.0, inf]`)
        AlgorithmConfig(stapo=True, group_size=2),
        old_logprobs=logprobs,
        rollout_logprobs=logprobs,
        advantages=torch.tensor([1.0, -1.0]),
        valid=torch.ones(2, 256, dtype=torch.bool),
        old_entropy=entropies,
        stapo_tau_h=tau_h,
    )
