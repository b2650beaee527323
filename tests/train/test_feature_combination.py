"""Every algorithm feature at once through the real trainer: DVP pruning that bites (log ρ = −3 at T = 0.5),
STAPO with the entropy quantile, AR, Lopti's two phases, MIS with a veto, KL against another model, an entropy
bonus and seq-mean-token-mean aggregation; PPO's clip bites in the second phase, after the first one's
update (dual clip is on but needs a negative-advantage token whose ratio rose past c, which this step has
none of: its own tests cover it). Phase 0 on one rank equals a float64 reference written from the papers'
formulas with HF transformers' logits; both phases at DP 2 (packed), PP 2 with the fused output layer and
TP 2 + SP + CP 2, and a Qwen3-MoE replaying its routes at EP 2, equal one rank (loss, gradient norm, counts,
updated weights). Each feature has its own tests; these check that they compose, in each parallel layout."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from megatron_tail.algorithms import AlgorithmConfig, grpo
from megatron_tail.train import Sample
from tests.harness import run_distributed
from tests.model.hf_models import make_hf_model
from tests.train.common import PAD_MULTIPLE, full_hf_state, smooth_trainer

T = 0.5
LOG_RHO = -3.0
CFG = AlgorithmConfig(
    group_size=2,
    log_rho=LOG_RHO,
    is_mode="mis",
    is_level="token",
    mis_low=0.5,
    mis_high=2.0,
    veto_threshold=1e-4,
    stapo=True,
    stapo_tau_p=0.3,
    stapo_tau_h_quantile=0.5,
    advantage_reweighting=True,
    ar_alpha=0.3,
    lopti=True,
    lopti_eta=0.05,  # the tiny model's tokens have π < 0.3: both phases get tokens (24 and 10)
    kl_coef=0.1,
    entropy_coef=0.01,
    dual_clip=3.0,
    loss_aggregation="seq_mean_token_mean",
)
VETOED = 5
"""The sample whose second rollout log-prob is 12 above the trainer's: w = e^−12 < the veto threshold."""


def _rank(rank, world, hf_dir, ref_dir, layout, samples, packed, model_opts):  # noqa: ARG001
    """`layout`: (tp, pp, cp, ep). An MoE model replays the θ_old pass's routes in the reference and in both
    updates (`routing_replay: r2`)."""
    from megatron_tail.config.parallel import ParallelSection
    from megatron_tail.model import ModelSettings
    from megatron_tail.train import (
        OpSettings,
        init_parallel,
        make_micro_batches,
        pack_micro_batches,
        prepare_rl_micro_batches,
        recompute_logprobs,
        rl_loss_fn,
        split_for_data_parallel,
        train_step,
    )
    from megatron_tail.train.engine.batch import equalize_micro_batch_shapes
    from megatron_tail.train.engine.context_parallel import split_for_context_parallel
    from megatron_tail.train.engine.parallel import comm_device
    from megatron_tail.train.engine.reference import build_reference
    from megatron_tail.train.rl.routing import OLD_ACTION, REFERENCE_ACTION, UPDATE_ACTION, routing_pass
    from megatron_tail.train.rl.samples import moe_shape_group

    tp, pp, cp, ep = layout
    groups = init_parallel(
        ParallelSection(tensor_parallel=tp, pipeline_parallel=pp, context_parallel=cp, expert_parallel=ep)
    )
    settings = ModelSettings(vocab_pad_multiple=PAD_MULTIPLE, **model_opts)
    trainer = smooth_trainer(hf_dir, settings)
    seq = 2 * cp if cp > 1 else 1
    if packed:
        mbs = pack_micro_batches(
            samples,
            max_tokens=32,
            dp_rank=groups.dp_rank,
            dp_size=groups.dp_size,
            pad_to_multiple=seq * (tp if settings.sequence_parallel else 1),
            sequence_multiple=seq,
        )
    else:
        mine = split_for_data_parallel(samples, groups.dp_rank, groups.dp_size)
        mbs = make_micro_batches(mine, micro_batch_size=2, seq_len=16)
    moe = moe_shape_group(trainer.groups)
    if moe is not None:  # expert-parallel ranks run the same number of micro-batches, as the trainer does
        mbs = equalize_micro_batch_shapes(mbs, moe, comm_device())
    if packed:
        mbs = [split_for_context_parallel(mb, groups.cp_rank, cp) for mb in mbs]
    replay = trainer.arch.moe is not None

    def routes(chunks, action):
        return routing_pass(chunks, action["r2"]) if replay else None

    op = OpSettings(log_rho=CFG.rule_log_rho(T), temperature=T, compute_entropy=True)
    old = recompute_logprobs(trainer, mbs, op=op, routing=routes(trainer.chunks, OLD_ACTION))
    reference = build_reference(trainer, ref_dir)
    ref_out = recompute_logprobs(
        trainer, mbs, op=op, chunks=reference.chunks, routing=routes(reference.chunks, REFERENCE_ACTION)
    )
    for mb, out in zip(mbs, ref_out, strict=True):
        mb.extras["ref_logprobs"] = out.logprobs
    counts = prepare_rl_micro_batches(CFG, mbs, old, groups.dp, groups.cp)
    phases = []
    for phase in range(CFG.num_phases):
        loss_fn = rl_loss_fn(CFG, counts, phase=phase)
        result = train_step(trainer, mbs, loss_fn, op=op, routing=routes(trainer.chunks, UPDATE_ACTION))
        phases.append((result.metrics, result.grad_norm))
    return phases, full_hf_state(trainer)


def _token_stats(hf, prompt, response) -> list[dict]:
    """Per response token, in float64 from HF's logits: log π^mp of the token (its safe set at T, the token
    kept in it), the entropy of π^mp, the safe set's mass Z under π_T, and whether the safe set held it."""
    tokens = torch.tensor([[*prompt, *response]])
    with torch.no_grad():
        z = hf(input_ids=tokens).logits[0, :-1].double()[len(prompt) - 1 :] / T
    stats = []
    for row, target in zip(z, response, strict=True):
        safe = row >= row.max() + LOG_RHO
        in_safe = bool(safe[target])
        safe[target] = True
        p = torch.softmax(row, -1)
        mass = float(p[safe].sum())
        q = p[safe] / mass
        stats.append(
            {
                "lp": math.log(float(p[target]) / mass),
                "entropy": float(-(q * q.log()).sum()),
                "mass": mass,
                "in_safe": in_safe,
                "size": int(safe.sum()),
            }
        )
    return stats


def _full_bound_entropy(s: dict) -> float:
    """STAPO's entropy of π_T bounded from the safe set: H_b(Z) + Z·H(π^mp)."""
    z = s["mass"]
    binary = -z * math.log(z) - ((1 - z) * math.log(1 - z) if z < 1 else 0.0)
    return binary + z * max(s["entropy"], 0.0)


def _reference_phase0(policy, ref, samples) -> dict:
    """Lopti's first update (tokens with π < η) at θ = θ_old (ratio 1), float64."""
    rows = [
        (s, _token_stats(policy, s.prompt, s.response), _token_stats(ref, s.prompt, s.response))
        for s in samples
    ]
    tau_h = float(
        np.quantile([_full_bound_entropy(t) for _, st, _ in rows for t in st], CFG.stapo_tau_h_quantile)
    )
    pg = kl = entropy = 0.0
    sequences = masked = vetoed = 0
    for sample, stats, ref_stats in rows:
        advantage = float(sample.fields["advantages"][0])
        rollout = sample.fields["rollout_logprobs"].double().tolist()
        log_w = [t["lp"] - r if t["in_safe"] else -math.inf for t, r in zip(stats, rollout, strict=True)]
        veto = any(math.exp(x) < CFG.veto_threshold for x in log_w)
        vetoed += veto
        terms, counted = [], 0
        for t, r, lw in zip(stats, ref_stats, log_w, strict=True):
            p = math.exp(t["lp"])
            a = (CFG.ar_alpha * p + 1 - CFG.ar_alpha) * advantage  # AR
            spurious = a > 0 and p < CFG.stapo_tau_p and _full_bound_entropy(t) < tau_h  # STAPO
            masked += spurious
            w = math.exp(lw)
            rejected = veto or not CFG.mis_low <= w <= CFG.mis_high  # MIS
            counted += not spurious and not rejected
            if not spurious and p < CFG.lopti_eta and not rejected:  # Lopti's low-probability phase
                d = t["lp"] - r["lp"]
                terms.append((w * -a, w * (math.exp(-d) - 1 + d), t["entropy"]))
        if counted == 0:
            continue
        sequences += 1
        pg += sum(x[0] for x in terms) / counted
        kl += sum(x[1] for x in terms) / counted
        entropy += sum(x[2] for x in terms) / counted
    pg, kl, entropy = pg / sequences, CFG.kl_coef * kl / sequences, -CFG.entropy_coef * entropy / sequences
    return {
        "loss": pg + kl + entropy,
        "pg_loss": pg,
        "kl_loss": kl,
        "entropy_loss": entropy,
        "masked": masked,
        "mean_safe_set": float(np.mean([t["size"] for _, stats, _ in rows for t in stats])),
    }


def _samples(policy) -> list[Sample]:
    """Eight responses sampled from π^mp at T (DVP on the sampled side) in groups of 2, with rollout
    log-probs from an engine that disagrees (σ 0.25), one of them enough for the veto."""
    g = torch.Generator().manual_seed(11)
    advantages = grpo(torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.5, 0.0], dtype=torch.float64), 2)
    samples = []
    for i, advantage in enumerate(advantages.tolist()):
        prompt = torch.randint(0, 200, (int(torch.randint(3, 7, (), generator=g)),), generator=g).tolist()
        response = []
        with torch.no_grad():
            for _ in range(int(torch.randint(3, 8, (), generator=g))):
                row = policy(input_ids=torch.tensor([prompt + response])).logits[0, -1].double() / T
                row = row.masked_fill(row < row.max() + LOG_RHO, -torch.inf)
                response.append(int(torch.multinomial(torch.softmax(row, -1), 1, generator=g)))
        lp = torch.tensor([s["lp"] for s in _token_stats(policy, prompt, response)], dtype=torch.float32)
        rollout = lp + 0.25 * torch.randn(lp.shape, generator=g)
        if i == VETOED:
            rollout[1] = lp[1] + 12.0
        fields = {"rollout_logprobs": rollout, "advantages": torch.full(lp.shape, advantage)}
        samples.append(Sample(prompt, response, fields))
    return samples


def _run(path, world, layout, samples, packed, model_opts=None):
    """The (phases, weights) of rank 0 (which gathers the weights), after both Lopti phases."""
    results = run_distributed(
        _rank, world, str(path / "policy"), str(path / "ref"), layout, samples, packed, model_opts or {}
    )
    return results[0]


def _assert_same_steps(got, expected):
    (phases, state), (ref_phases, ref_state) = got, expected
    for (metrics, grad_norm), (ref_metrics, ref_grad_norm) in zip(phases, ref_phases, strict=True):
        assert metrics["loss"] == pytest.approx(ref_metrics["loss"], rel=1e-5, abs=1e-7)
        assert grad_norm == pytest.approx(ref_grad_norm, rel=1e-5)
        counts = ("stapo_masked_tokens", "vetoed_sequences", "phase_tokens", "clipped_tokens")
        for count in counts:  # the first two: phase 0 only
            assert metrics.get(count) == ref_metrics.get(count), count
    for name in ref_state:
        torch.testing.assert_close(state[name], ref_state[name], rtol=1e-5, atol=1e-6, msg=name)


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    path = tmp_path_factory.mktemp("combination")
    policy = make_hf_model("qwen3", path / "policy", seed=0).double()
    ref = make_hf_model("qwen3", path / "ref", seed=5).double()
    samples = _samples(policy)
    reference = _reference_phase0(policy, ref, samples)
    return path, samples, reference, _run(path, 1, (1, 1, 1, 1), samples, packed=False)


def test_one_rank_equals_the_float64_reference(case):
    _, _, reference, (phases, _) = case
    metrics, _ = phases[0]
    for key in ("loss", "pg_loss", "kl_loss", "entropy_loss"):
        # float32 trainer: terms of ~0.1 that partly cancel (phase 0 loss −0.02), so an absolute bound too
        assert metrics[key] == pytest.approx(reference[key], rel=1e-5, abs=1e-6), key
    assert metrics["stapo_masked_tokens"] == reference["masked"] > 0
    assert metrics["vetoed_sequences"] == 1
    # every feature bites: DVP prunes most of the 200 tokens, STAPO masks tokens, one sequence is vetoed,
    # a KL and an entropy term, two phases
    assert reference["mean_safe_set"] < 100
    assert reference["kl_loss"] > 0 and reference["entropy_loss"] < 0
    (first, _), (second, _) = phases
    assert first["phase_tokens"] > 0 and second["phase_tokens"] > 0 and second["clipped_tokens"] > 0


@pytest.mark.parametrize(
    ("world", "layout", "model_opts"),
    [
        (2, (1, 1, 1, 1), {}),
        (2, (1, 2, 1, 1), {"fused_output_layer": True}),
        (4, (2, 1, 2, 1), {"sequence_parallel": True}),
    ],
    ids=["dp2-packed", "pp2-fused", "tp2-sp-cp2"],
)
def test_every_layout_equals_one_rank(case, world, layout, model_opts):
    path, samples, _, single = case
    _assert_same_steps(_run(path, world, layout, samples, True, model_opts), single)


def test_moe_with_routing_replay_at_ep2_and_cp2_equals_one_rank(tmp_path):
    """The same features on a tiny Qwen3-MoE replaying θ_old's routes (r2) in the reference pass and in both
    Lopti updates: EP 2 × DP 2 (padded) and EP 2 × CP 2 (packed) equal one rank."""
    from transformers import AutoModelForCausalLM

    from tests.model.hf_moe import make_hf_moe

    make_hf_moe(tmp_path / "policy", norm_topk_prob=True, seed=0)
    make_hf_moe(tmp_path / "ref", norm_topk_prob=True, seed=4)
    # float32: its grouped GEMM takes no float64 (the samples' log-probs are float64 from its logits)
    policy = AutoModelForCausalLM.from_pretrained(tmp_path / "policy", dtype=torch.float32)
    samples = _samples(policy)
    # No load-balancing loss: it is a loss per micro-batch (expert counts over its tokens), and the padded
    # pairs and the packed bins group the samples differently, so their steps differ by design. (Padding
    # itself no longer counts: `test_moe_aux_loss_scale.py`.)
    no_aux = {"moe_aux_loss_coeff": 0.0}
    single = _run(tmp_path, 1, (1, 1, 1, 1), samples, packed=False, model_opts=no_aux)
    _assert_same_steps(_run(tmp_path, 2, (1, 1, 1, 2), samples, packed=False, model_opts=no_aux), single)
    _assert_same_steps(_run(tmp_path, 4, (1, 1, 2, 2), samples, packed=True, model_opts=no_aux), single)
