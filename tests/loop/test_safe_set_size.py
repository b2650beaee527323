"""|V_S| per position from the op: the vocab-parallel count (TP = 1, 2) equals the shared rule on the full
logits, and the θ_old recompute's counts (unfused and fused output layer) match HF's logits of the model."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_tail.ops import safe_mask
from tests.harness import run_distributed

V, PADDED = 13, 16


def _full_logits(dtype):
    g = torch.Generator().manual_seed(0)
    full = (torch.randn(3, 5, PADDED, generator=g) * 6).to(dtype)
    full[..., V:] = 1e4  # Megatron's padded columns: garbage that must never count
    full[0, 0, 3] = -math.inf  # a probability-zero token
    return full


def _count_rank(rank, world, dtype, log_rho, temperature):
    from megatron_tail.ops import vocab_parallel_masked_logprobs

    full = _full_logits(dtype)
    shard = full.chunk(world, dim=-1)[rank]
    group = torch.distributed.group.WORLD if world > 1 else None
    targets = torch.zeros(full.shape[:-1], dtype=torch.int64)
    out = vocab_parallel_masked_logprobs(
        shard,
        targets,
        log_rho=log_rho,
        temperature=temperature,
        vocab_size=V,
        tp_group=group,
        compute_safe_set_size=True,
    )
    return out.safe_set_size


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize(
    ("dtype", "log_rho", "temperature"),
    [
        (torch.float32, -13.0, 1.0),
        (torch.bfloat16, -5.0, 0.7),
        (torch.float32, -2.0, 1.3),
        (torch.float32, None, 1.0),
    ],
)
def test_count_equals_rule_on_full_logits(world, dtype, log_rho, temperature):
    full = _full_logits(dtype)[..., :V]
    expected = safe_mask(full, log_rho, temperature).sum(-1)
    if log_rho is None:
        expected = torch.isfinite(full).sum(-1)  # no pruning: every token that has probability
    results = run_distributed(_count_rank, world, dtype, log_rho, temperature)
    for counts in results:
        assert counts.dtype == torch.int64
        torch.testing.assert_close(counts, expected, rtol=0, atol=0)
    assert 1 <= int(expected.min()) < V  # pruning really bites for these cases, or log_rho is None
    if log_rho is not None:
        assert int(expected.max()) < V or log_rho == -13.0


def _recompute_rank(rank, world, hf_dir, tokens, log_rho, fused):  # noqa: ARG001
    from megatron_tail.model import ModelSettings, load_hf_config
    from megatron_tail.train import OpSettings, Sample, build_trainer, make_micro_batches, recompute_logprobs
    from tests.train.common import init_rank

    init_rank(world, 1)
    settings = ModelSettings(vocab_pad_multiple=64, fused_output_layer=fused)
    trainer = build_trainer(load_hf_config(hf_dir), hf_dir=hf_dir, model_settings=settings)
    samples = [Sample(t[:3], t[3:]) for t in tokens]
    mbs = make_micro_batches(samples, micro_batch_size=2)
    outs = recompute_logprobs(trainer, mbs, op=OpSettings(log_rho=log_rho, compute_safe_set_size=True))
    # per sample id: |V_S| at the positions that predict its response tokens, in order
    out = {}
    for mb, o in zip(mbs, outs, strict=True):
        per_sample, valid = mb.to_samples(o.safe_set_size), mb.sample_valid
        for k, sample_id in enumerate(mb.sample_ids.tolist()):
            out[sample_id] = per_sample[k][valid[k]]
    return out


@pytest.mark.parametrize("fused", [False, True])
def test_recompute_sizes_match_hf_logits(tmp_path, fused):
    from transformers import Qwen3ForCausalLM

    from megatron_tail.demo.model import new_tiny_qwen3, save_hf

    model, tok = new_tiny_qwen3(3, hidden_size=32, intermediate_size=64, num_hidden_layers=2, head_dim=8)
    with torch.no_grad():
        model.lm_head.weight.normal_(0.0, 0.8)  # spread logits so that ρ = e^-4 prunes part of the vocab
    save_hf(model, tok, tmp_path)
    g = torch.Generator().manual_seed(1)
    tokens = [torch.randint(5, 100, (n,), generator=g).tolist() for n in (7, 9, 6)]
    log_rho = -4.0
    got = run_distributed(_recompute_rank, 2, str(tmp_path), tokens, log_rho, fused)[0]
    hf = Qwen3ForCausalLM.from_pretrained(str(tmp_path)).eval()
    assert sorted(got) == [0, 1, 2]
    sizes = []
    for i, t in enumerate(tokens):
        with torch.no_grad():
            logits = hf(torch.tensor([t])).logits[0, 2:-1]  # positions predicting t[3:]
        expected = safe_mask(logits, log_rho).sum(-1)
        torch.testing.assert_close(got[i], expected, rtol=0, atol=0)
        sizes += expected.tolist()
    assert len(set(sizes)) > 3 and max(sizes) < 100  # pruning bites, by different amounts per position
