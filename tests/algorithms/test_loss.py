"""The composed objective (`prepare_tokens` + `rl_loss`) against the float64 reference `ref_loss`."""

import math
from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_tail.algorithms import (
    AlgorithmConfig,
    LossCounts,
    combine_metrics,
    compute_loss,
    finalize_metrics,
    masked_quantile,
    prepare_tokens,
    reduce_op_of,
    rl_loss,
)
from tests.algorithms.batches import random_batch, slice_batch
from tests.algorithms.references import ref_loss

MAX_LEN = 9

configs = st.builds(
    AlgorithmConfig,
    is_mode=st.sampled_from(["none", "tis", "mis"]),
    is_level=st.sampled_from(["token", "sequence_product", "sequence_geomean"]),
    tis_cap=st.floats(1.0, 3.0),
    mis_low=st.floats(0.0, 0.9),
    mis_high=st.floats(1.1, 3.0),
    veto_threshold=st.sampled_from([0.0, 1e-4]),
    rejected_in_denominator=st.booleans(),
    stapo=st.booleans(),
    stapo_tau_p=st.sampled_from([0.01, 0.1]),
    stapo_tau_h=st.one_of(st.none(), st.floats(0.5, 2.5)),
    stapo_tau_h_quantile=st.floats(0.0, 1.0),
    advantage_reweighting=st.booleans(),
    ar_alpha=st.floats(0.0, 1.0),
    lopti=st.booleans(),
    lopti_eta=st.floats(0.05, 1.0),
    lopti_reverse=st.booleans(),
    clip_eps_low=st.floats(0.0, 0.5),
    clip_eps_high=st.floats(0.0, 0.5),
    dual_clip=st.one_of(st.none(), st.floats(1.5, 4.0)),
    kl_coef=st.sampled_from([0.0, 0.1]),
    kl_estimator=st.sampled_from(["k1", "k3"]),
    entropy_coef=st.sampled_from([0.0, 0.05]),
    loss_aggregation=st.sampled_from(["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"]),
    loss_max_len=st.just(MAX_LEN),
)

INPUT_KEYS = (
    "old_logprobs", "rollout_logprobs", "advantages", "valid", "entropy", "in_safe_set", "old_entropy",
    "old_in_safe_set", "ref_logprobs",
)  # fmt: skip
PREPARE_KEYS = ("old_logprobs", "rollout_logprobs", "advantages", "valid", "old_entropy", "old_in_safe_set")


def _run(cfg, batch, **kw):
    lp = batch["logprobs"].clone().requires_grad_(True)
    loss, metrics = compute_loss(cfg, logprobs=lp, **{k: batch[k] for k in INPUT_KEYS}, **kw)
    (grad,) = torch.autograd.grad(loss, lp)
    return loss.detach(), grad, metrics


def _run_ref(cfg, batch, **kw):
    lp = batch["logprobs"].clone().requires_grad_(True)
    loss, info = ref_loss(cfg, {**batch, "logprobs": lp}, **kw)
    grad = torch.autograd.grad(loss, lp)[0] if loss.requires_grad else torch.zeros_like(lp)
    return loss.detach(), grad, info


@settings(max_examples=60, deadline=None)
@given(configs, st.integers(0, 100_000), st.integers(0, 1))
def test_full_loss_and_gradient_match_float64_reference(cfg, seed, phase):
    if phase >= cfg.num_phases:
        phase = 0
    batch = random_batch(seed, groups=2, group_size=3, T=5)
    loss, grad, _ = _run(cfg, batch, phase=phase)
    want, want_grad, _ = _run_ref(cfg, batch, phase=phase)
    torch.testing.assert_close(loss, want, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(grad, want_grad, rtol=1e-12, atol=1e-14)


@settings(max_examples=40, deadline=None)
@given(configs, st.integers(0, 100_000), st.integers(0, 1))
def test_entropy_bonus_and_its_gradient_match_float64_reference(cfg, seed, phase):
    """−β_H·H aggregated like the loss over the contributing tokens: the loss and its gradient w.r.t. both
    the log-probs and the entropy (which the op differentiates further) equal the float64 reference's."""
    cfg = replace(cfg, entropy_coef=0.05)
    phase = phase if phase < cfg.num_phases else 0
    batch = random_batch(seed, groups=2, group_size=3, T=5)
    grads = []
    for compute in ("ours", "reference"):
        lp = batch["logprobs"].clone().requires_grad_(True)
        ent = batch["entropy"].clone().requires_grad_(True)
        if compute == "ours":
            inputs = {k: batch[k] for k in INPUT_KEYS if k != "entropy"}
            loss, metrics = compute_loss(cfg, logprobs=lp, entropy=ent, phase=phase, **inputs)
            without, _ = compute_loss(
                replace(cfg, entropy_coef=0.0), logprobs=lp, entropy=ent, phase=phase, **inputs
            )
            torch.testing.assert_close(metrics["entropy_loss"], (loss - without).detach(), rtol=1e-12, atol=0)
        else:
            loss, info = ref_loss(cfg, {**batch, "logprobs": lp, "entropy": ent}, phase=phase)
        if not loss.requires_grad:  # nothing contributes
            grads.append((loss.detach(), torch.zeros_like(lp), torch.zeros_like(ent)))
            continue
        g_lp, g_ent = torch.autograd.grad(loss, (lp, ent), allow_unused=True)
        grads.append((loss.detach(), g_lp, torch.zeros_like(ent) if g_ent is None else g_ent))
    for got, want in zip(*grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)
    # the bonus pushes entropy up on exactly the contributing tokens
    g_ent = grads[0][2]
    contrib = torch.tensor(info["contrib"])
    assert bool((g_ent[contrib] < 0).all()) and bool((g_ent[~contrib] == 0).all())


def _plain_ppo_token_mean(lp, old, adv, valid, eps_low, eps_high):
    ratio = torch.exp(lp - old)
    a = adv[:, None].expand_as(lp)
    per_token = -torch.min(ratio * a, torch.clamp(ratio, 1 - eps_low, 1 + eps_high) * a)
    return per_token[valid].sum() / valid.sum()


@settings(max_examples=25, deadline=None)
@given(
    st.integers(0, 100_000),
    st.sampled_from(["none", "tis", "mis"]),
    st.sampled_from(["token", "sequence_product"]),
)
def test_no_masks_and_unit_is_weight_is_plain_ppo(seed, mode, level):
    b = random_batch(seed, groups=2, group_size=4, T=6, padding_value=0.0)
    if mode != "none":
        b["rollout_logprobs"] = b["old_logprobs"].clone()  # weight exactly 1
    cfg = AlgorithmConfig(
        is_mode=mode, is_level=level, veto_threshold=0.0, clip_eps_low=0.2, clip_eps_high=0.3
    )
    lp = b["logprobs"].clone().requires_grad_(True)
    loss, _ = compute_loss(
        cfg, logprobs=lp, old_logprobs=b["old_logprobs"], rollout_logprobs=b["rollout_logprobs"],
        advantages=b["advantages"], valid=b["valid"],
    )  # fmt: skip
    (grad,) = torch.autograd.grad(loss, lp)
    lp2 = b["logprobs"].clone().requires_grad_(True)
    want = _plain_ppo_token_mean(lp2, b["old_logprobs"], b["advantages"], b["valid"], 0.2, 0.3)
    (want_grad,) = torch.autograd.grad(want, lp2)
    torch.testing.assert_close(loss, want.detach(), rtol=1e-13, atol=1e-15)
    torch.testing.assert_close(grad, want_grad, rtol=1e-13, atol=1e-15)


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 100_000), st.integers(0, 1), st.sampled_from(["tis", "mis"]))
def test_masked_and_vetoed_tokens_get_exactly_zero_gradient(seed, phase, mode):
    cfg = AlgorithmConfig(
        is_mode=mode, stapo=True, stapo_tau_p=0.3, stapo_tau_h=2.0, lopti=True, kl_coef=0.1,
        loss_aggregation="seq_mean_token_mean",
    )  # fmt: skip
    batch = random_batch(seed, groups=3, group_size=3, T=6, unsafe_prob=0.1, veto_prob=0.05)
    _, grad, _ = _run(cfg, batch, phase=phase)
    _, _, info = _run_ref(cfg, batch, phase=phase)
    contrib = torch.tensor(info["contrib"])
    assert torch.isfinite(grad).all()
    assert (grad[~contrib] == 0).all()  # padding, STAPO, vetoed, MIS-masked, unsafe, other Lopti phase
    vetoed = torch.tensor(info["vetoed"])
    spurious = torch.tensor(info["spurious"])
    assert (grad[vetoed] == 0).all() and (grad[spurious] == 0).all()
    assert (grad[~batch["valid"]] == 0).all() and (grad[~batch["in_safe_set"]] == 0).all()
    # and the loss is not trivially zero: tokens that contribute and are not clipped move
    assert (grad != 0).sum() > 0 or contrib.sum() == 0


@pytest.mark.parametrize("mode", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"])
@pytest.mark.parametrize("features", ["plain", "all"])
def test_dp_ranks_times_micro_batches_reproduce_single_batch(mode, features):
    """2 DP ranks × 2 micro-batches, each padded to its own width; counts summed (the all-reduce); every
    phase: Σ piece losses == single-batch loss and the gradients agree, in float64."""
    if features == "all":
        cfg = AlgorithmConfig(
            is_mode="tis", is_level="sequence_geomean", stapo=True, stapo_tau_p=0.2, stapo_tau_h_quantile=0.5,
            advantage_reweighting=True, lopti=True, dual_clip=3.0, kl_coef=0.05, loss_aggregation=mode,
            loss_max_len=MAX_LEN,
        )  # fmt: skip
    else:
        cfg = AlgorithmConfig(loss_aggregation=mode, loss_max_len=MAX_LEN)
    batch = random_batch(11, groups=4, group_size=3, T=7, unsafe_prob=0.05)
    B = batch["valid"].shape[0]
    rows = [slice(0, 2), slice(2, 6), slice(6, 9), slice(9, B)]  # rank 0: pieces 0, 1; rank 1: pieces 2, 3
    # STAPO's quantile threshold over the *global* batch, as the trainer computes it once
    tau_h = float(masked_quantile(batch["old_entropy"], batch["valid"], cfg.stapo_tau_h_quantile))

    pieces, prepared = [], []
    for r in rows:
        width = max(int(batch["valid"][r].sum(-1).max()), 1)
        piece = slice_batch(batch, r, width)
        pieces.append(piece)
        prepared.append(prepare_tokens(cfg, **{k: piece[k] for k in PREPARE_KEYS}, stapo_tau_h=tau_h))
    per_rank = [prepared[0].counts + prepared[1].counts, prepared[2].counts + prepared[3].counts]
    counts = LossCounts.from_tensor(per_rank[0].to_tensor() + per_rank[1].to_tensor())  # all-reduce SUM

    for phase in range(cfg.num_phases):
        full, full_grad, full_metrics = _run(cfg, batch, phase=phase)
        total = torch.zeros((), dtype=torch.float64)
        grad = torch.zeros_like(batch["logprobs"])
        metric_dicts = []
        for r, piece, prep in zip(rows, pieces, prepared, strict=True):
            lp = piece["logprobs"].clone().requires_grad_(True)
            loss, m = rl_loss(cfg, prep, lp, counts, phase=phase, in_safe_set=piece["in_safe_set"],
                              entropy=piece["entropy"], ref_logprobs=piece["ref_logprobs"])  # fmt: skip
            loss.backward()
            total += loss.detach()
            grad[r, : lp.shape[1]] = lp.grad
            metric_dicts.append({**prep.metrics, **m} if phase == 0 else m)
        torch.testing.assert_close(total, full, rtol=1e-12, atol=1e-15)
        torch.testing.assert_close(grad, full_grad, rtol=1e-12, atol=1e-15)
        combined = combine_metrics(metric_dicts)
        assert combined.keys() == full_metrics.keys()
        for key, value in full_metrics.items():
            torch.testing.assert_close(combined[key], value, rtol=1e-12, atol=1e-15, msg=key)
    assert float(full) != 0.0


def test_metrics_against_reference_counts():
    cfg = AlgorithmConfig(
        is_mode="mis", stapo=True, stapo_tau_p=0.3, stapo_tau_h=2.0, lopti=True, lopti_eta=0.2, kl_coef=0.1
    )
    batch = random_batch(5, groups=3, group_size=4, T=6, unsafe_prob=0.1, veto_prob=0.04)
    _, _, m = _run(cfg, batch, phase=0)
    _, _, info = _run_ref(cfg, batch, phase=0)
    valid, lm = batch["valid"], torch.tensor(info["loss_mask"])
    weights = torch.tensor(info["weights"], dtype=torch.float64)
    probs = torch.exp(batch["old_logprobs"])
    assert m["valid_tokens"].item() == valid.sum().item()
    assert m["sequences"].item() == valid.any(-1).sum().item()
    assert m["loss_tokens"].item() == lm.sum().item()
    assert m["stapo_masked_tokens"].item() == torch.tensor(info["spurious"]).sum().item() > 0
    vetoed = torch.tensor(info["vetoed"]) & lm.any(-1)
    assert m["vetoed_sequences"].item() == vetoed.sum().item() > 0
    assert m["is_weight_sum"].item() == pytest.approx(weights[lm].sum().item(), rel=1e-12)
    assert m["is_weight_max"].item() == pytest.approx(weights[lm].max().item(), rel=1e-12)
    assert m["is_zero_weight_tokens"].item() == (lm & (weights == 0)).sum().item()
    assert m["lopti_low_tokens"].item() == (lm & (probs < 0.2)).sum().item() > 0
    assert m["lopti_high_tokens"].item() == (lm & (probs >= 0.2)).sum().item() > 0
    assert m["old_safe_set_violations"].item() == (valid & ~batch["old_in_safe_set"]).sum().item() > 0
    phase_mask = torch.tensor(info["phase_mask"])
    assert m["phase_tokens"].item() == phase_mask.sum().item()
    assert m["clipped_tokens"].item() == info["clipped"]
    assert m["safe_set_violations"].item() == (phase_mask & ~batch["in_safe_set"]).sum().item()
    ent = torch.where(phase_mask, batch["entropy"], 0.0).sum().item()
    assert m["entropy_sum"].item() == pytest.approx(ent, rel=1e-12)
    assert m["loss"].item() == pytest.approx(m["pg_loss"].item() + m["kl_loss"].item(), rel=1e-12)
    assert all(v.dtype == torch.float64 and v.dim() == 0 and not v.requires_grad for v in m.values())

    final = finalize_metrics(m)
    assert final["stapo_masked_fraction"] == pytest.approx(
        m["stapo_masked_tokens"].item() / valid.sum().item()
    )
    assert final["vetoed_fraction"] == pytest.approx(vetoed.sum().item() / lm.any(-1).sum().item())
    assert final["is_weight_mean"] == pytest.approx(weights[lm].sum().item() / lm.sum().item())
    # the KL mean is over the tokens the KL term covers (contributing: not vetoed, weight > 0, safe)
    contrib = torch.tensor(info["contrib"])
    assert m["kl_tokens"].item() == contrib.sum().item() < phase_mask.sum().item()
    assert final["kl_mean"] == pytest.approx(m["kl_sum"].item() / contrib.sum().item(), rel=1e-12)
    # so are the clip fractions: a token with no gradient cannot be clipped (before: / phase tokens, which
    # read low by the rejected share)
    assert m["clippable_tokens"].item() == contrib.sum().item()
    assert final["clip_fraction"] == pytest.approx(info["clipped"] / contrib.sum().item())
    assert {k for k in m if reduce_op_of(k) != "sum"} == {"is_weight_max"}
    assert reduce_op_of("is_weight_max") == "max"
    # phase 1 of compute_loss reports only per-step metrics (batch ones come with phase 0)
    _, _, m1 = _run(cfg, batch, phase=1)
    assert "vetoed_sequences" not in m1 and "clipped_tokens" in m1


def test_combine_metrics_sums_and_maxes():
    a = {"clipped_tokens": torch.tensor(2.0), "is_weight_max": torch.tensor(1.5)}
    b = {"clipped_tokens": torch.tensor(3.0), "is_weight_max": torch.tensor(0.5), "kl_sum": torch.tensor(1.0)}
    out = combine_metrics([a, b])
    assert {k: v.item() for k, v in out.items()} == {
        "clipped_tokens": 5.0,
        "is_weight_max": 1.5,
        "kl_sum": 1.0,
    }
    # a ratio over nothing is left out (a gap in TensorBoard), not logged as 0
    over_nothing = finalize_metrics(
        {"clipped_tokens": torch.tensor(0.0), "clippable_tokens": torch.tensor(0.0)}
    )
    assert over_nothing == {"clipped_tokens": 0.0, "clippable_tokens": 0.0}
    some = finalize_metrics({"clipped_tokens": torch.tensor(1.0), "clippable_tokens": torch.tensor(4.0)})
    assert some["clip_fraction"] == 0.25


def test_ar_alpha_zero_leaves_the_loss_unchanged():
    batch = random_batch(2)
    base, g_base, _ = _run(AlgorithmConfig(), batch)
    ar, g_ar, _ = _run(AlgorithmConfig(advantage_reweighting=True, ar_alpha=0.0), batch)
    assert torch.equal(base, ar) and torch.equal(g_base, g_ar)
    ar3, _, _ = _run(AlgorithmConfig(advantage_reweighting=True, ar_alpha=0.3), batch)
    assert not torch.equal(base, ar3)


def test_lopti_phases_add_up_to_the_single_update_gradient():
    # at θ = θ_old with token-mean, the two phases' gradients sum to the one-phase gradient
    batch = random_batch(4, groups=3)
    batch["logprobs"] = batch["old_logprobs"].clone()
    _, g_all, _ = _run(AlgorithmConfig(), batch)
    _, g0, _ = _run(AlgorithmConfig(lopti=True), batch, phase=0)
    _, g1, _ = _run(AlgorithmConfig(lopti=True), batch, phase=1)
    assert (g0 != 0).any() and (g1 != 0).any()
    assert not ((g0 != 0) & (g1 != 0)).any()
    torch.testing.assert_close(g0 + g1, g_all, rtol=1e-13, atol=0)


def _inputs(batch):
    return {k: batch[k] for k in ("logprobs", "old_logprobs", "rollout_logprobs", "advantages", "valid")}


def test_bad_inputs_raise():
    b = random_batch(0)
    cfg = AlgorithmConfig()
    with pytest.raises(
        ValueError, match=r"rollout_logprobs has shape \(6, 5\) but old_logprobs has shape \(6, 6\)"
    ):
        compute_loss(cfg, **{**_inputs(b), "rollout_logprobs": b["rollout_logprobs"][:, :5]})
    with pytest.raises(ValueError, match=r"logprobs has shape \(6, 5\)"):
        compute_loss(cfg, **{**_inputs(b), "logprobs": b["logprobs"][:, :5]})
    with pytest.raises(ValueError, match="advantages has shape"):
        compute_loss(cfg, **{**_inputs(b), "advantages": torch.zeros(6, 4, dtype=torch.float64)})
    with pytest.raises(ValueError, match="same B"):
        compute_loss(cfg, **{**_inputs(b), "advantages": torch.zeros(5, dtype=torch.float64)})
    bad = b["old_logprobs"].clone()
    bad[0, 0] = math.nan
    with pytest.raises(ValueError, match="old_logprobs must be finite at valid positions"):
        compute_loss(cfg, **{**_inputs(b), "old_logprobs": bad})
    bad_adv = b["advantages"].clone()
    bad_adv[0] = math.nan
    with pytest.raises(ValueError, match=r"advantages contains 6 NaN value\(s\) at valid positions"):
        compute_loss(cfg, **{**_inputs(b), "advantages": bad_adv[:, None].expand(6, 6).contiguous()})
    with pytest.raises(ValueError, match="valid must be a bool tensor"):
        compute_loss(cfg, **{**_inputs(b), "valid": b["valid"].long()})
    with pytest.raises(ValueError, match=r"old_entropy .* is required when cfg\.stapo"):
        compute_loss(AlgorithmConfig(stapo=True), **_inputs(b))
    with pytest.raises(ValueError, match=r"ref_logprobs is required when kl_coef > 0 \(kl_coef=0.1\)"):
        compute_loss(AlgorithmConfig(kl_coef=0.1), **_inputs(b))
    with pytest.raises(ValueError, match=r"phase must be an int in \[0, 1\); got 1"):
        compute_loss(cfg, **_inputs(b), phase=1)
    with pytest.raises(ValueError, match="in_safe_set has shape"):
        compute_loss(cfg, **_inputs(b), in_safe_set=torch.ones(6, 5, dtype=torch.bool))


@pytest.mark.parametrize("mode", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"])
def test_a_vetoed_sequence_is_discarded_unless_rejected_tokens_stay_counted(mode):
    """Sequence 1 has a token whose rollout log-prob is far above θ_old's (weight e^-12 < 1e-4): it is vetoed.
    By default the loss equals the loss of sequence 0 alone; with `rejected_in_denominator` it shrinks."""
    g = torch.Generator().manual_seed(0)
    old = -torch.rand(2, 4, generator=g, dtype=torch.float64) - 0.1
    rollout = old.clone()
    rollout[1, 2] = old[1, 2] + 12.0  # π_old/π_infer = e^-12 < 1e-4: veto
    batch = {
        "logprobs": old + 0.05 * torch.randn(2, 4, generator=g, dtype=torch.float64),
        "old_logprobs": old,
        "rollout_logprobs": rollout,
        "advantages": torch.tensor([1.0, -0.5], dtype=torch.float64),
        "valid": torch.tensor([[True, True, True, False], [True, True, True, True]]),
    }
    only_first = {k: v[:1] for k, v in batch.items()}
    for rejected_counted in (False, True):
        cfg = AlgorithmConfig(
            is_mode="tis", veto_threshold=1e-4, loss_aggregation=mode, loss_max_len=MAX_LEN,
            rejected_in_denominator=rejected_counted,
        )  # fmt: skip
        both, metrics = compute_loss(cfg, **batch)
        alone, _ = compute_loss(cfg, **only_first)
        assert metrics["vetoed_sequences"].item() == 1 and metrics["loss_sequences"].item() == 2
        ref, _ = ref_loss(cfg, batch)
        assert both.item() == pytest.approx(ref.item(), rel=1e-12)
        if rejected_counted:
            shrink = 3 / 7 if mode == "token_mean" else 1 / 2
            assert both.item() == pytest.approx(alone.item() * shrink, rel=1e-12)
            assert metrics["counted_sequences"].item() == 2
        else:
            assert both.item() == pytest.approx(alone.item(), rel=1e-12)
            assert metrics["counted_tokens"].item() == 3 and metrics["counted_sequences"].item() == 1


def test_a_tis_weight_that_underflows_float32_stays_counted_as_in_float64():
    """Sequence-level TIS truncates W = Π w_t, it never rejects: a sequence with log W = −104 (every w_t
    ≈ 0.95, far above the veto) has W = 7e-46, 0 in float32. Counted as rejected there, it left the token
    count and doubled the other sequence's loss and gradient against float64."""
    cfg = AlgorithmConfig(
        group_size=2,
        is_mode="tis",
        is_level="sequence_product",
        veto_threshold=1e-4,
        loss_aggregation="token_mean",
    )
    valid = torch.ones(2, 2000, dtype=torch.bool)
    old = torch.full((2, 2000), -0.5, dtype=torch.float64)
    rollout = old.clone()
    rollout[1] += 0.052
    advantages = torch.tensor([1.0, -1.0], dtype=torch.float64)
    results = {}
    for dtype in (torch.float64, torch.float32):
        current = old.to(dtype).clone().requires_grad_(True)
        loss, metrics = compute_loss(
            cfg,
            logprobs=current,
            old_logprobs=old.to(dtype),
            rollout_logprobs=rollout.to(dtype),
            advantages=advantages.to(dtype),
            valid=valid,
        )
        loss.backward()
        results[dtype] = (int(metrics["counted_tokens"]), float(loss), float(current.grad[0, 0]))
    assert results[torch.float32][0] == results[torch.float64][0] == 4000
    assert results[torch.float32][1:] == pytest.approx(results[torch.float64][1:], rel=1e-5)
    assert results[torch.float64][1] == pytest.approx(-0.5, rel=1e-6)


def test_the_clip_fractions_count_only_tokens_with_a_policy_gradient():
    """Every token of a group whose rewards are equal has advantage 0: no gradient, never clipped. Before, the
    clip fraction's denominator counted them, so with the same ratio e^0.5 on every token it read 1.0 when
    all four sequences had an advantage and 0.5 when two had none."""
    old = torch.full((4, 3), -1.0, dtype=torch.float64)
    batch = {
        "logprobs": old + 0.5,
        "old_logprobs": old,
        "rollout_logprobs": old,
        "valid": torch.ones(4, 3, dtype=torch.bool),
    }
    cfg = AlgorithmConfig(is_mode="none", veto_threshold=0.0, clip_eps_low=0.2, clip_eps_high=0.2)
    for advantages, clippable in (([1.0, 1.0, 1.0, 1.0], 12), ([1.0, 1.0, 0.0, 0.0], 6)):
        adv = torch.tensor(advantages, dtype=torch.float64)
        _, m = compute_loss(cfg, **batch, advantages=adv)
        assert m["clippable_tokens"].item() == clippable
        assert finalize_metrics(m)["clip_fraction"] == 1.0
