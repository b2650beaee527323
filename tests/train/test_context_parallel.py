"""Context parallelism: the split rule (Transformer Engine's), the local CP attention against the unsplit one,
and a CP=2 RL step against the CP=1 step (loss, grad norm, every weight) with the sequence-level rules on,
at TP=1, TP=2 with sequence parallelism, PP=2, with the fused output layer, and with empty micro-batches;
a veto whose trigger lies on the other CP rank vetoes the sequence on both."""

from __future__ import annotations

from itertools import pairwise

import pytest
import torch

from megatron_tail.algorithms import AlgorithmConfig
from megatron_tail.train import Sample
from megatron_tail.train.engine.forward import SAMPLING_SUPPORT_FIELD
from megatron_tail.utils.ragged import Ragged
from tests.harness import run_distributed
from tests.model.hf_models import make_hf_model
from tests.train.common import PAD_MULTIPLE, full_hf_state, make_samples, smooth_trainer

CFG = AlgorithmConfig(
    log_rho=None,
    is_mode="tis",
    is_level="sequence_geomean",
    veto_threshold=1e-4,
    loss_aggregation="seq_mean_token_mean",
    lopti=True,
    group_size=2,
)


def test_split_index_is_transformer_engines():
    """TE's `test_thd_get_partitioned_indices_matches_dual_chunk_expected_indices` (tests/pytorch/attention/
    test_cp_utils.py): cu_seqlens [0, 8, 16] at CP = 2."""
    from megatron_tail.model.cp_attention import context_parallel_index

    assert context_parallel_index((0, 8, 16), 0, 2).tolist() == [0, 1, 6, 7, 8, 9, 14, 15]
    assert context_parallel_index((0, 8, 16), 1, 2).tolist() == [2, 3, 4, 5, 10, 11, 12, 13]
    with pytest.raises(ValueError, match="not a multiple of 2·context_parallel = 4"):
        context_parallel_index((0, 6), 0, 2)


def test_split_shards_every_per_token_field_with_its_tokens():
    """Each sample padded to 2·CP (odd length, shorter than 2·CP), every `[1, T]` tensor and every field
    (whatever its name) indexed alike, padding never a loss token, the shards' tokens partition the row."""
    from megatron_tail.train import pack_micro_batches
    from megatron_tail.train.engine.context_parallel import split_for_context_parallel

    samples = [
        Sample([1], [2, 3], {"a": torch.tensor([10.0, 11.0]), "new_field": torch.tensor([1, 2])}),
        Sample([4, 5, 6], [7, 8, 9, 10], {"a": torch.arange(4.0), "new_field": torch.arange(4)}),
    ]
    (mb,) = pack_micro_batches(samples, max_tokens=16, sequence_multiple=4, pad_to_multiple=4)
    assert mb.cu_seqlens == (0, 8, 12)  # 7 → 8, 3 → 4: padding after each sample's last token
    assert mb.padding[0].int().tolist() == [0] * 7 + [1] + [0] * 3 + [1]
    assert int(mb.loss_mask.sum()) == 6 == mb.num_loss_tokens
    shards = [split_for_context_parallel(mb, r, 2) for r in range(2)]
    seen = torch.cat([s.cp.index for s in shards]).sort().values
    assert seen.tolist() == list(range(12))
    for s in shards:
        for name in ("tokens", "targets", "loss_mask", "sample_index", "padding"):
            assert torch.equal(getattr(s, name)[0], getattr(mb, name)[0, s.cp.index])
        for name in mb.fields:
            assert torch.equal(s.fields[name][0], mb.fields[name][0, s.cp.index])
        assert s.cu_seqlens == mb.cu_seqlens  # the model gets the whole row's boundaries
    # to_samples of a shard is the whole layout with the other rank's tokens zero; owned partitions valid
    a = sum(s.to_samples(s.fields["a"]) for s in shards)
    assert torch.equal(a, mb.to_samples(mb.fields["a"]))
    owned = [s.sample_owned for s in shards]
    assert torch.equal(owned[0] | owned[1], mb.sample_valid) and not (owned[0] & owned[1]).any()
    assert sum(s.num_loss_tokens for s in shards) == mb.num_loss_tokens


def test_a_shard_on_a_device_computes_its_sample_layout_without_host_copies():
    """`MicroBatch.to` moves a CP shard's index, owned mask and the whole sample layout once; the loss's
    `to_samples` calls then copy nothing (on a GPU each copy was a pageable host→device transfer). The
    `meta` device stands in for the GPU: a tensor left on the host would be copied to it."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from megatron_tail.train import pack_micro_batches
    from megatron_tail.train.engine.context_parallel import split_for_context_parallel

    class _Copies(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in (torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default):
                self.seen.append(func)
            return func(*args, **(kwargs or {}))

    samples = [
        Sample([1], [2, 3], {"a": torch.tensor([1.0, 2.0])}),
        Sample([4, 5], [6, 7, 8], {"a": torch.ones(3)}),
    ]
    (mb,) = pack_micro_batches(samples, max_tokens=16, sequence_multiple=4, pad_to_multiple=4)
    shard = split_for_context_parallel(mb, 1, 2).to("meta")
    layout = [shard.cp.index, shard.cp.sample_owned, shard.sample_valid]
    layout += [
        getattr(shard.cp.whole, n) for n in ("sample_ids", "sample_rows", "sample_cols", "sample_valid")
    ]
    assert all(t.device.type == "meta" for t in layout)
    with _Copies() as mode:
        per_sample = shard.to_samples(shard.fields["a"])
    assert per_sample.shape == mb.to_samples(mb.fields["a"]).shape and per_sample.device.type == "meta"
    assert mode.seen == [], mode.seen


def test_shard_packed_params_are_what_te_cp_takes():
    """Transformer Engine's p2p CP attention (`AttnFuncWithCPAndKVP2P.forward`, context_parallel.py at TE
    d0067d0) takes this rank's T/CP tokens with the *global* padded cu_seqlens, which it divides by CP itself
    (`cu_seqlens_q_padded // cp_size`): every block a multiple of 2·CP, ending at CP × the local tokens;
    megatron's THD RoPE under CP reads the same global boundaries (`_apply_rotary_pos_emb_thd`)."""
    from megatron_tail.train import pack_micro_batches
    from megatron_tail.train.engine.context_parallel import split_for_context_parallel
    from megatron_tail.train.engine.forward import thd_params

    samples = make_samples(5, seed=3)
    (mb,) = pack_micro_batches(samples, max_tokens=128, sequence_multiple=8, pad_to_multiple=16)
    shard = split_for_context_parallel(mb, 3, 4)
    params = thd_params(shard)
    bounds = params.cu_seqlens_q_padded.tolist()
    assert (
        params.cu_seqlens_q_padded.dtype == torch.int32 and params.cu_seqlens_q_padded is params.cu_seqlens_q
    )
    lengths = [b - a for a, b in pairwise(bounds)]
    assert all(n % 8 == 0 for n in lengths) and bounds[-1] == 4 * shard.tokens.shape[1]
    assert isinstance(params.max_seqlen_q, int) and params.max_seqlen_q == max(lengths)


def _attention_rank(rank, world_size, bounds, seed):
    import torch.distributed as dist

    from megatron_tail.model.cp_attention import context_parallel_attention, context_parallel_index
    from megatron_tail.model.thd_attention import _packed_attention, thd_packed_seq_params

    g = torch.Generator().manual_seed(seed)
    t = bounds[-1]
    q, k, v = (torch.randn(t, h, 8, generator=g, dtype=torch.float64) for h in (4, 2, 2))
    grad = torch.randn(t, 32, generator=g, dtype=torch.float64)
    full = [x.clone().requires_grad_() for x in (q, k, v)]
    out = _packed_attention(*full, thd_packed_seq_params(bounds, "cpu"), 0.3)
    (out * grad).sum().backward()
    index = context_parallel_index(bounds, rank, world_size)
    local = [x[index].clone().requires_grad_() for x in (q, k, v)]
    got = context_parallel_attention(*local, list(bounds), 0.3, dist.group.WORLD)
    (got * grad[index]).sum().backward()
    torch.testing.assert_close(got, out[index], rtol=1e-12, atol=1e-12)
    for mine, ref in zip(local, full, strict=True):
        torch.testing.assert_close(mine.grad, ref.grad[index], rtol=1e-12, atol=1e-12)
    return True


@pytest.mark.parametrize("cp", [2, 4])
def test_cp_attention_equals_unsplit_attention(cp):
    """Forward and the q/k/v gradients (reduce-scattered) equal the CP=1 attention, GQA, three sequences."""
    m = 2 * cp
    assert all(run_distributed(_attention_rank, cp, (0, 3 * m, 4 * m, 7 * m), 5))


def _samples(seed: int) -> list[Sample]:
    """8 samples with rollout log-probs and advantages: odd lengths, one of 3 tokens (< 2·CP = 4), and one
    whose first response token's weight is far below the veto threshold (its sequence is vetoed)."""
    g = torch.Generator().manual_seed(seed)
    base = [*make_samples(7, seed=seed), Sample([5], [6, 7])]
    base[2] = Sample([3, 4], list(range(20, 30)))  # 12 tokens: 4 chunks of 3, response on both CP ranks
    out = []
    for i, s in enumerate(base):
        n = len(s.response)
        rollout = -2.0 + 0.3 * torch.randn(n, generator=g)
        if i == 2:
            rollout[0] = 40.0  # log w = old − 40 < log 1e-4: a veto trigger on the first response token
        adv = torch.full((n,), float(torch.randn((), generator=g)))
        out.append(Sample(s.prompt, s.response, {"rollout_logprobs": rollout, "advantages": adv}))
    return out


def _rl_rank(rank, world_size, hf_dir, tp, pp, cp, samples, cfg, model, max_tokens, fixed_shape=False):  # noqa: ARG001
    from megatron_tail.config.parallel import ParallelSection
    from megatron_tail.model import ModelSettings
    from megatron_tail.train import (
        OpSettings,
        init_parallel,
        pack_micro_batches,
        prepare_rl_micro_batches,
        recompute_logprobs,
        rl_loss_fn,
        train_step,
    )
    from megatron_tail.train.engine.context_parallel import split_for_context_parallel

    torch.set_num_threads(1)
    groups = init_parallel(ParallelSection(tensor_parallel=tp, pipeline_parallel=pp, context_parallel=cp))
    settings = ModelSettings(vocab_pad_multiple=PAD_MULTIPLE, **(model or {}))
    trainer = smooth_trainer(hf_dir, settings)
    seq = 2 * cp if cp > 1 else 1
    multiple = seq * (tp if settings.sequence_parallel else 1)
    if fixed_shape:  # every micro-batch max_tokens long: megatron's fixed-shape pipeline exchange
        multiple = max_tokens
        for chunk in trainer.chunks:
            chunk.config.variable_seq_lengths = False
    mbs = pack_micro_batches(
        samples,
        max_tokens=max_tokens,
        dp_rank=groups.dp_rank,
        dp_size=groups.dp_size,
        pad_to_multiple=multiple,
        sequence_multiple=seq,
    )
    mbs = [split_for_context_parallel(mb, groups.cp_rank, cp) for mb in mbs]
    op = OpSettings(log_rho=cfg.log_rho)
    old = recompute_logprobs(trainer, mbs, op=op)
    counts = prepare_rl_micro_batches(cfg, mbs, old, groups.dp, groups.cp)
    results = [
        train_step(trainer, mbs, rl_loss_fn(cfg, counts, phase=phase), op=op)
        for phase in range(cfg.num_phases)
    ]
    weights = [
        (mb.whole.sample_ids, mb.sample_owned, mb.extras["prepared"].is_weights)
        for mb in mbs
        if mb.cp is not None
    ]
    return results, full_hf_state(trainer), weights


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("cp"))
    make_hf_model("qwen3", path)
    samples = _samples(11)
    reference = run_distributed(_rl_rank, 1, path, 1, 1, 1, samples, CFG, None, 32)[0]
    return path, samples, reference


def _assert_same_steps(got, reference):
    (results, state, _), (ref_results, ref_state, _) = got, reference
    assert len(results) == len(ref_results) == 2  # Lopti: two updates
    for r, ref in zip(results, ref_results, strict=True):
        # a Lopti phase with nothing to learn (here the second: empty, or every token weighted 0) has a zero
        # gradient, and its update is skipped (`guarded_step`) under CP as without it
        assert r.update_successful == ref.update_successful == (ref.grad_norm > 0)
        counts = ("loss_tokens", "sequences", "vetoed_sequences", "counted_sequences", "phase_tokens")
        for key in (*counts, "clippable_tokens", "clipped_tokens"):
            assert r.metrics.get(key) == ref.metrics.get(key), key
        assert r.metrics["loss"] == pytest.approx(ref.metrics["loss"], rel=1e-5, abs=1e-7)
        assert r.grad_norm == pytest.approx(ref.grad_norm, rel=1e-5)
    assert ref_results[0].update_successful  # the first phase trains: the comparison has a real update
    assert ref_results[0].metrics["vetoed_sequences"] == 1
    assert ref_results[0].metrics["clippable_tokens"] > 0  # the CP ranks' owned tokens add up to these
    assert state.keys() == ref_state.keys()
    for name in ref_state:
        torch.testing.assert_close(state[name], ref_state[name], rtol=1e-5, atol=1e-5, msg=name)


@pytest.mark.parametrize(
    ("world", "tp", "pp", "model"),
    [
        (2, 1, 1, None),
        (2, 1, 1, {"fused_output_layer": True}),
        (4, 2, 1, {"sequence_parallel": True}),
        (4, 1, 2, None),
    ],
    ids=["tp1", "fused-output-layer", "tp2-sp", "pp2"],
)
def test_cp2_rl_step_equals_cp1(case, world, tp, pp, model):
    """Sequence-geomean TIS + veto + Lopti + seq-mean-token-mean: both Lopti updates equal CP=1's."""
    hf_dir, samples, reference = case
    results = run_distributed(_rl_rank, world, hf_dir, tp, pp, 2, samples, CFG, model, 32)
    assert all(r[0] == results[0][0] for r in results)  # every rank reports the same steps
    _assert_same_steps(results[0], reference)


def test_cp2_pp2_with_fixed_shapes_equals_cp1(case):
    """PP=2 × CP=2 without `variable_seq_lengths`: the stages size their exchange from `seq_length`, which
    megatron divides by CP itself; the step equals CP=1's (a shard-length `seq_length` fails the exchange)."""
    hf_dir, samples, reference = case
    results = run_distributed(_rl_rank, 4, hf_dir, 1, 2, 2, samples, CFG, None, 32, True)
    _assert_same_steps(results[0], reference)


def test_veto_on_the_other_cp_rank_vetoes_on_both(case):
    """The veto trigger (sample 2's first response token) lies on one CP rank; the other rank, which holds
    the rest of the sequence, gives the sequence weight 0 too."""
    hf_dir, samples, _ = case
    results = run_distributed(_rl_rank, 2, hf_dir, 1, 1, 2, samples, CFG, None, 32)
    holds_trigger = []
    for _, _, weights in results:
        for sample_ids, owned, is_weights in weights:
            for k, i in enumerate(sample_ids.tolist()):
                if owned[k].any():
                    assert bool((is_weights[k] == 0).all()) == (i == 2), i
                    if i == 2:
                        holds_trigger.append(bool(owned[k][0]))
    assert sorted(holds_trigger) == [False, True]  # both ranks hold the sequence, one of them the trigger


def _with_supports(samples: list[Sample], seed: int) -> list[Sample]:
    """Each response token's sampling support (ragged, as the trainer gets it): the token and up to 11 other
    ids, one token in five up to 63 (so a shard's widest row differs from the whole micro-batch's)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for s in samples:
        rows = []
        for t in s.response:
            wide = int(torch.randint(0, 5, (), generator=g)) == 0
            others = torch.randperm(200, generator=g)[
                : int(torch.randint(0, 64 if wide else 12, (), generator=g))
            ]
            rows.append(list(dict.fromkeys([t, *others.tolist()])))
        out.append(
            Sample(s.prompt, s.response, {**s.fields, SAMPLING_SUPPORT_FIELD: Ragged.from_lists(rows)})
        )
    return out


def test_cp2_with_sampling_supports_equals_cp1(case):
    """Ragged supports split with their tokens: each CP shard densifies its own rows, and the two updates
    equal CP=1's; the supports change the step (they are not dropped on the way)."""
    hf_dir, samples, plain = case
    supported = _with_supports(samples, 3)
    reference = run_distributed(_rl_rank, 1, hf_dir, 1, 1, 1, supported, CFG, None, 32)[0]
    assert reference[0][0].metrics["loss"] != pytest.approx(plain[0][0].metrics["loss"], rel=1e-3)
    results = run_distributed(_rl_rank, 2, hf_dir, 1, 1, 2, supported, CFG, None, 32)
    _assert_same_steps(results[0], reference)


def test_empty_micro_batches_dp2_cp2(case):
    """DP=2 × CP=2 with a budget that packs everything into one micro-batch: DP rank 1 runs an empty one."""
    hf_dir, samples, _ = case
    few = samples[:2] + samples[7:]
    reference = run_distributed(_rl_rank, 1, hf_dir, 1, 1, 1, few, CFG, None, 64)[0]
    results = run_distributed(_rl_rank, 4, hf_dir, 1, 1, 2, few, CFG, None, 64)
    (ref_results, ref_state, _), (got, state, _) = reference, results[0]
    for r, ref in zip(got, ref_results, strict=True):
        assert r.metrics["loss"] == pytest.approx(ref.metrics["loss"], rel=1e-5, abs=1e-7)
        assert r.grad_norm == pytest.approx(ref.grad_norm, rel=1e-5)
    for name in ref_state:
        torch.testing.assert_close(state[name], ref_state[name], rtol=1e-5, atol=1e-5, msg=name)


def _config(*overrides):
    from megatron_tail.config import load_config

    return load_config(None, list(overrides))


def test_layouts_that_cannot_exist_are_refused_naming_the_values():
    """At config load (padded layout, a budget that cannot hold 2·CP chunks or the padded longest sample)
    and before any process group (a world that is not TP × PP × CP × DP): one UserError each."""
    from megatron_tail.utils.errors import UserError

    with pytest.raises(UserError, match=r"parallel.context_parallel needs packed micro-batches.*got 2"):
        _config("parallel.context_parallel=2")
    budget = ("parallel.context_parallel=4", "train.max_tokens_per_micro_batch=4100")
    with pytest.raises(
        UserError, match=r"must be a multiple of 8 \(2·parallel.context_parallel = 8.*got 4100"
    ):
        _config(*budget)
    longest = ("data.max_prompt_tokens=101", "rollout.max_new_tokens=100")  # 201 tokens, 204 padded
    with pytest.raises(UserError, match=r"= 201, padded to a multiple of 2·context_parallel = 204; got 200"):
        _config("parallel.context_parallel=2", *longest, "train.max_tokens_per_micro_batch=200")
    cfg = _config(
        "parallel.context_parallel=2", "parallel.tensor_parallel=2", "train.max_tokens_per_micro_batch=8"
    )
    assert (cfg.sequence_multiple, cfg.micro_batch_multiple) == (4, 4)
    cfg.parallel.check_world(8)
    with pytest.raises(UserError, match=r"2 × 1 × 2 = 4 does not divide the world size 6"):
        cfg.parallel.check_world(6)
    sp = _config(
        "parallel.context_parallel=2",
        "parallel.tensor_parallel=2",
        "model.sequence_parallel=true",
        "train.max_tokens_per_micro_batch=16",
    )
    assert sp.micro_batch_multiple == 8
