"""Multi-turn samples in the trainer: environment tokens are context only. The RL step on samples whose
responses interleave policy turns and observations equals `compute_loss` on the policy tokens alone (HF
log-probs; the observations' rollout log-probs are garbage that would blow up any IS weight they entered),
padded at TP=1 and packed at TP=2 alike; no IS weight, DVP safe-set check, STAPO mask, entropy or count
touches an environment token; and a one-turn sample is the single-turn sample, bit for bit."""

from __future__ import annotations

import pytest
import torch

from megatron_tail.algorithms import AlgorithmConfig, compute_loss
from megatron_tail.train import Sample, make_micro_batches, pack_micro_batches
from tests.harness import run_distributed
from tests.model.hf_models import hf_logits, make_hf_model
from tests.train.common import make_samples
from tests.train.test_rl_objective import CFG, _rl_step_rank

GARBAGE = -1000.0
"""Rollout log-prob put on environment tokens: an IS weight exp(old − rollout) there would be e^1000."""


def _multiturn(samples: list[Sample], seed: int) -> list[Sample]:
    """Each response split into turn | observation | turn (observation ids random, 2-4 of them)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for s in samples:
        cut = max(1, len(s.response) // 2)
        obs = torch.randint(0, 200, (int(torch.randint(2, 5, (), generator=g)),), generator=g).tolist()
        response = [*s.response[:cut], *obs, *s.response[cut:]]
        mask = [True] * cut + [False] * len(obs) + [True] * (len(s.response) - cut)
        out.append(Sample(s.prompt, response, policy_mask=mask))
    return out


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    path = tmp_path_factory.mktemp("multiturn")
    hf = make_hf_model("qwen3", path)
    g = torch.Generator().manual_seed(3)
    samples, policy_lp = [], []
    for s in _multiturn(make_samples(8, seed=21), seed=4):
        tokens = torch.tensor([[*s.prompt, *s.response]])
        lp = torch.log_softmax(hf_logits(hf, tokens)[0, :-1], dim=-1).gather(1, tokens[0, 1:, None])[:, 0]
        lp = lp[len(s.prompt) - 1 :]
        mask = torch.tensor(s.policy_mask)
        rollout = torch.where(mask, lp + 0.3 * torch.randn(lp.shape, generator=g), torch.tensor(GARBAGE))
        adv = torch.full(lp.shape, float(torch.randn((), generator=g)))
        fields = {"rollout_logprobs": rollout, "advantages": adv}
        samples.append(Sample(s.prompt, s.response, fields, policy_mask=s.policy_mask))
        policy_lp.append((lp[mask], rollout[mask], adv[mask]))
    t = max(len(x[0]) for x in policy_lp)

    def pad(xs):
        return torch.stack([torch.cat([x, x.new_zeros(t - len(x))]) for x in xs]).double()

    lp = pad([x[0] for x in policy_lp])
    valid = pad([torch.ones(len(x[0])) for x in policy_lp]).bool()
    loss, metrics = compute_loss(
        CFG,
        logprobs=lp,
        old_logprobs=lp,
        rollout_logprobs=pad([x[1] for x in policy_lp]),
        advantages=pad([x[2] for x in policy_lp]),
        valid=valid,
    )
    assert abs(float(metrics["is_weight_sum"]) - float(valid.sum())) > 0.5  # the weights are not all 1
    return str(path), samples, float(loss), int(valid.sum())


@pytest.mark.parametrize(
    ("world", "tp", "packed"), [(1, 1, False), (2, 2, True)], ids=["padded", "tp2-packed"]
)
def test_rl_step_on_multiturn_samples_trains_the_policy_tokens_only(case, world, tp, packed):
    hf_dir, samples, ref_loss, policy_tokens = case
    result, _ = run_distributed(_rl_step_rank, world, hf_dir, tp, samples, packed)[0]
    assert result.metrics["loss"] == pytest.approx(ref_loss, rel=1e-5)
    assert result.metrics["loss_sequences"] == len(samples)
    assert result.metrics["loss_tokens"] == policy_tokens


def test_micro_batches_keep_environment_tokens_as_context_only():
    samples = _multiturn(make_samples(5, seed=2), seed=1)
    for mbs in (
        pack_micro_batches(samples, max_tokens=64, pad_to_multiple=2),
        make_micro_batches(samples, micro_batch_size=2, pad_to_multiple=2),
    ):
        seen = {}
        for mb in mbs:
            for k, i in enumerate(mb.sample_ids.tolist()):
                seen[i] = mb.to_samples(mb.targets)[k][mb.sample_valid[k]].tolist()
            # every sample's tokens are in the row (context), only its policy tokens are targets of the loss
            assert mb.num_loss_tokens == int(mb.loss_mask.sum()) == int(mb.sample_valid.sum())
            assert bool((mb.sample_index >= 0).eq(mb.loss_mask).all())
        for i, s in enumerate(samples):
            assert seen[i] == [t for t, m in zip(s.response, s.policy_mask, strict=True) if m]


def _prepare_rank(rank, world_size, cfg, samples, multiturn):  # noqa: ARG001 - harness signature
    """Stage 1 of the loss on `samples`, with θ_old outputs that condemn the environment positions of the
    same samples with their policy masks (`multiturn`): same lengths, so the same packing."""
    from megatron_tail.train import prepare_rl_micro_batches
    from tests.train.common import init_rank

    groups = init_rank(1, 1)
    mbs = pack_micro_batches(samples, max_tokens=128)
    policy = pack_micro_batches(multiturn, max_tokens=128)
    old = [_old_outputs(mb, ~p.loss_mask) for mb, p in zip(mbs, policy, strict=True)]
    counts = prepare_rl_micro_batches(cfg, mbs, old, groups.dp)
    p = mbs[0].extras["prepared"]
    return counts, p.is_weights, p.loss_mask, p.count_mask, {k: float(v) for k, v in p.metrics.items()}


def _old_outputs(mb, env):
    """θ_old outputs that condemn every environment position `env`: far from the rollout log-probs, outside
    the safe set, zero entropy, tiny probability (STAPO's spurious-token profile)."""
    from megatron_tail.ops import MaskedLogprobs

    lp = torch.where(env, torch.tensor(-30.0), mb.fields["rollout_logprobs"])
    return MaskedLogprobs(
        logprobs=lp,
        entropy=torch.where(env, torch.tensor(0.0), torch.tensor(1.0)),
        in_safe_set=~env,
        safe_mass=torch.ones_like(lp),
        logprobs_full=lp,
    )


def test_environment_tokens_get_no_is_weight_no_safe_set_check_no_stapo_mask():
    cfg = AlgorithmConfig(
        log_rho=-13.0,
        is_mode="mis",
        veto_threshold=1e-4,
        stapo=True,
        stapo_tau_p=0.5,
        stapo_tau_h=0.5,
        group_size=3,
    )
    base = _multiturn(make_samples(3, seed=5), seed=6)
    samples = [
        Sample(
            s.prompt,
            s.response,
            {
                "rollout_logprobs": torch.full((len(s.response),), -0.1),
                "advantages": torch.ones(len(s.response)),
            },
            policy_mask=s.policy_mask,
        )
        for s in base
    ]
    counts, weights, loss_mask, count_mask, metrics = run_distributed(
        _prepare_rank, 1, cfg, samples, samples
    )[0]
    policy = sum(sum(s.policy_mask) for s in samples)
    # identical θ_old and rollout log-probs on the policy tokens: every weight 1, nothing vetoed or masked
    assert bool((weights[loss_mask] == 1.0).all()) and int(loss_mask.sum()) == int(count_mask.sum()) == policy
    assert metrics["vetoed_sequences"] == metrics["stapo_masked_tokens"] == 0.0
    assert metrics["old_safe_set_violations"] == 0.0 and metrics["valid_tokens"] == policy
    assert float(counts.tokens) == policy
    # and the same samples without the mask (every token the policy's) are vetoed and STAPO-masked
    unmasked = [Sample(s.prompt, s.response, s.fields) for s in samples]
    _, _, _, _, metrics = run_distributed(_prepare_rank, 1, cfg, unmasked, samples)[0]
    env = sum(len(s.response) for s in samples) - policy
    assert metrics["vetoed_sequences"] == len(samples) and metrics["old_safe_set_violations"] == env
    assert metrics["stapo_masked_tokens"] == env


def test_one_turn_sample_is_the_single_turn_sample_bit_for_bit():
    single = make_samples(6, seed=8)
    g = torch.Generator().manual_seed(0)
    single = [
        Sample(s.prompt, s.response, {"rollout_logprobs": -torch.rand(len(s.response), generator=g)})
        for s in single
    ]
    one_turn = [Sample(s.prompt, s.response, s.fields, policy_mask=[True] * len(s.response)) for s in single]
    for build in (
        lambda xs: pack_micro_batches(xs, max_tokens=32, pad_to_multiple=2),
        lambda xs: make_micro_batches(xs, micro_batch_size=4),
    ):
        for a, b in zip(build(single), build(one_turn), strict=True):
            for name in ("tokens", "targets", "loss_mask", "sample_index", "sample_ids", "sample_rows"):
                assert torch.equal(getattr(a, name), getattr(b, name)), name
            assert torch.equal(a.sample_cols, b.sample_cols) and torch.equal(a.sample_valid, b.sample_valid)
            assert a.cu_seqlens == b.cu_seqlens and a.num_loss_tokens == b.num_loss_tokens
            assert all(torch.equal(a.fields[k], b.fields[k]) for k in a.fields)


def test_a_sample_without_policy_tokens_or_with_a_wrong_mask_is_refused():
    with pytest.raises(ValueError, match="no policy token"):
        make_micro_batches([Sample([1], [2, 3], policy_mask=[False, False])], micro_batch_size=1)
    with pytest.raises(ValueError, match="policy_mask has 1 entries, expected 2"):
        make_micro_batches([Sample([1], [2, 3], policy_mask=[True])], micro_batch_size=1)
