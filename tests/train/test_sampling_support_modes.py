"""`algorithm.sampling_support`: on truncated samples, "replay" normalises every pass over the engine's
support, and "ignore" is exactly the full-vocabulary op, as if the samples carried no support, against HF
transformers' fp32 log-probs. θ_old under "ignore" comes from the same replayed pass (`old_policy.scored`),
whose support mass is the `mismatch/outside_support_mass` diagnostic."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from megatron_tail.algorithms import AlgorithmConfig
from megatron_tail.train import Sample
from megatron_tail.train.engine.forward import SAMPLING_SUPPORT_FIELD
from megatron_tail.utils.ragged import Ragged
from tests.harness import run_distributed
from tests.model.hf_models import hf_logits, make_hf_model
from tests.train.common import PAD_MULTIPLE, VOCAB, init_rank, make_samples

IGNORE = AlgorithmConfig(
    log_rho=None, is_mode="tis", veto_threshold=0.0, group_size=2, sampling_support="ignore"
)
REPLAY = replace(IGNORE, sampling_support="replay")


def _rank(rank, world_size, hf_dir, samples):  # noqa: ARG001
    from megatron_tail.model import ModelSettings, load_hf_config
    from megatron_tail.train import (
        OpSettings,
        OptimizerSettings,
        build_trainer,
        make_micro_batches,
        prepare_rl_micro_batches,
        recompute_logprobs,
        rl_loss_fn,
        train_step,
    )
    from megatron_tail.train.rl.old_policy import scored

    groups = init_rank(1, 1)

    def trainer():
        return build_trainer(
            load_hf_config(hf_dir),
            hf_dir=hf_dir,
            model_settings=ModelSettings(vocab_pad_multiple=PAD_MULTIPLE),
            optim=OptimizerSettings(lr=0.5, adam_eps=1.0, clip_grad=1e9),
        )

    bare = [Sample(s.prompt, s.response, {k: v for k, v in s.fields.items() if k != SAMPLING_SUPPORT_FIELD})
            for s in samples]  # fmt: skip
    mbs = make_micro_batches(samples, micro_batch_size=2, seq_len=16)
    bare_mbs = make_micro_batches(bare, micro_batch_size=2, seq_len=16)
    t = trainer()
    replayed = recompute_logprobs(t, mbs, op=OpSettings(log_rho=None))
    ignored = recompute_logprobs(t, mbs, op=OpSettings(log_rho=None, replay_support=False))

    def per_sample(mbs, outs, pick):
        rows = []
        for mb, out in zip(mbs, outs, strict=True):
            values, valid = mb.to_samples(pick(out)), mb.sample_valid
            rows += [values[i][valid[i]] for i in range(len(mb.sample_ids))]
        return rows

    result = {
        "replayed": per_sample(mbs, replayed, lambda o: o.logprobs),
        "ignored": per_sample(mbs, ignored, lambda o: o.logprobs),
        "scored": per_sample(mbs, replayed, lambda o: scored(IGNORE, o).logprobs),
        "scored_replay": per_sample(mbs, replayed, lambda o: scored(REPLAY, o).logprobs),
    }
    # one RL step each: "ignore" on the truncated samples, and the same objective on samples without supports
    steps = []
    for cfg, batches in ((IGNORE, mbs), (REPLAY, bare_mbs)):
        t = trainer()
        op = OpSettings(log_rho=None, replay_support=cfg.sampling_support == "replay")
        old = [scored(cfg, o) for o in recompute_logprobs(t, batches, op=replace(op, replay_support=True))]
        counts = prepare_rl_micro_batches(cfg, batches, old, groups.dp)
        steps.append(train_step(t, batches, rl_loss_fn(cfg, counts), op=op))
    result["steps"] = steps
    return result


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    path = tmp_path_factory.mktemp("support_modes")
    hf = make_hf_model("qwen3", path)
    g = torch.Generator().manual_seed(5)
    samples, full, kept = [], [], []
    for s in make_samples(6, seed=31):
        tokens = torch.tensor([[*s.prompt, *s.response]])
        logp = torch.log_softmax(hf_logits(hf, tokens)[0, :-1].double(), dim=-1)[len(s.prompt) - 1 :]
        rows = []
        for target in s.response:
            others = torch.randperm(VOCAB, generator=g)[: int(torch.randint(4, 30, (), generator=g))]
            rows.append(sorted({target, *others.tolist()}))
        support_logp = [torch.logsumexp(logp[j, row], dim=0) for j, row in enumerate(rows)]
        target_logp = logp[torch.arange(len(s.response)), torch.tensor(s.response)]
        full.append(target_logp)
        kept.append(torch.stack(support_logp))
        fields = {
            "rollout_logprobs": (target_logp - kept[-1]).float() + 0.05 * torch.randn(len(rows), generator=g),
            "advantages": torch.full((len(rows),), float(torch.randn((), generator=g))),
            SAMPLING_SUPPORT_FIELD: Ragged.from_lists(rows),
        }
        samples.append(Sample(s.prompt, s.response, fields))
    result = run_distributed(_rank, 1, str(path), samples)[0]
    return result, full, kept


def test_ignore_is_the_full_vocabulary_op(case):
    result, full, _ = case
    for got, want in zip(result["ignored"], full, strict=True):
        torch.testing.assert_close(got.double(), want, rtol=0, atol=2e-5)
    for got, want in zip(result["scored"], full, strict=True):  # θ_old from the replayed pass
        torch.testing.assert_close(got.double(), want, rtol=0, atol=2e-5)


def test_replay_normalises_over_the_support(case):
    result, full, kept = case
    for got, lp, z in zip(result["replayed"], full, kept, strict=True):
        torch.testing.assert_close(got.double(), lp - z, rtol=0, atol=2e-5)
        assert float(z.max()) < -0.05  # the supports drop real mass: the two modes differ
    for got, replayed in zip(result["scored_replay"], result["replayed"], strict=True):
        assert torch.equal(got, replayed)


def test_ignore_updates_as_if_the_samples_had_no_support(case):
    result, _, _ = case
    ignore, bare = result["steps"]
    assert ignore.metrics["loss"] == pytest.approx(bare.metrics["loss"], rel=1e-6)
    assert ignore.grad_norm == pytest.approx(bare.grad_norm, rel=1e-6)
    assert ignore.metrics["is_log_ratio_sum"] == pytest.approx(bare.metrics["is_log_ratio_sum"], rel=1e-6)
