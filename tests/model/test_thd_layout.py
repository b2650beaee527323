"""The packed THD layout on the local spec: one row of sequences of very different lengths (1, 3 and 60
tokens) plus trailing padding gives, for every sequence, the logits HF computes on that sequence alone —
at TP=1, TP=2 with and without sequence parallelism, tied and untied — and the log-probs of megatron's
schedule at PP=2 equal the padded layout's and HF's."""

from __future__ import annotations

import pytest
import torch

from tests.harness import run_distributed
from tests.model.hf_models import gather_vocab, hf_logits, make_hf_model

LENGTHS = (1, 3, 60)
PADDING = 4
REL_TOL = 1e-4


def _sequences() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(0, 200, (n,), generator=g) for n in LENGTHS]


def _thd_logits_rank(rank, world_size, hf_dir, tp, sp, seqs):  # noqa: ARG001 - harness signature
    from megatron_tail.model import ModelSettings, build_gpt_model, load_hf_config, load_hf_weights
    from megatron_tail.model.thd_attention import thd_packed_seq_params
    from tests.harness import init_megatron

    init_megatron(tensor_parallel=tp)
    arch = load_hf_config(hf_dir)
    model = build_gpt_model(arch, ModelSettings(sequence_parallel=sp))
    assert model.config.sequence_parallel == (sp and tp > 1)
    load_hf_weights(model, hf_dir, arch)
    model.eval()
    tokens = torch.cat([*seqs, torch.zeros(PADDING, dtype=torch.long)])[None]
    bounds = [0]
    for n in [*LENGTHS, PADDING]:
        bounds.append(bounds[-1] + n)
    params = thd_packed_seq_params(bounds, tokens.device)
    with torch.no_grad():
        logits = model(tokens, None, None, packed_seq_params=params)
    return gather_vocab(logits, arch.vocab_size)[0]


@pytest.mark.parametrize(
    ("tp", "sp", "tie"),
    [(1, False, False), (2, False, False), (2, True, False), (2, True, True)],
    ids=["tp1", "tp2", "tp2-sp", "tp2-sp-tied"],
)
def test_thd_row_logits_equal_hf_per_sequence(tmp_path, tp, sp, tie):
    hf = make_hf_model("qwen3", tmp_path, tie=tie)
    seqs = _sequences()
    got = run_distributed(_thd_logits_rank, tp, str(tmp_path), tp, sp, seqs)
    for row in got:
        assert row.shape[0] == sum(LENGTHS) + PADDING
        start = 0
        for seq in seqs:
            expected = hf_logits(hf, seq[None])[0]
            part = row[start : start + len(seq)]
            rel = ((part - expected).abs().max() / expected.abs().max()).item()
            assert rel <= REL_TOL, (len(seq), rel)
            start += len(seq)
        assert torch.isfinite(row).all()  # the padding block is a sequence of its own: finite, unused


def _schedule_logprobs_rank(rank, world_size, hf_dir, tp, pp, sp, fused, samples, packed):  # noqa: ARG001
    from megatron_tail.model import ModelSettings, load_hf_config
    from megatron_tail.train import (
        OpSettings,
        build_trainer,
        make_micro_batches,
        pack_micro_batches,
        recompute_logprobs,
    )
    from tests.train.common import init_rank, per_sample

    init_rank(tp, pp)
    arch = load_hf_config(hf_dir)
    trainer = build_trainer(
        arch, hf_dir=hf_dir, model_settings=ModelSettings(sequence_parallel=sp, fused_output_layer=fused)
    )
    multiple = tp if sp else 1
    if packed:
        mbs = pack_micro_batches(samples, max_tokens=64, pad_to_multiple=multiple)
        assert len(mbs) < len(samples) and all(mb.packed and mb.shape[0] == 1 for mb in mbs)
    else:
        mbs = make_micro_batches(samples, micro_batch_size=2, pad_to_multiple=multiple)
    outs = recompute_logprobs(trainer, mbs, op=OpSettings(log_rho=None))
    return per_sample(mbs, [o.logprobs for o in outs])


@pytest.mark.parametrize(
    ("tp", "pp", "sp", "fused"),
    [(1, 2, False, False), (2, 1, True, False), (2, 1, True, True)],
    ids=["pp2", "tp2-sp", "tp2-sp-fused-output-layer"],
)
def test_schedule_logprobs_thd_equal_padded_and_hf(tmp_path, tp, pp, sp, fused):
    from megatron_tail.train import Sample

    hf = make_hf_model("qwen3", tmp_path, tie=True)
    seqs = [*_sequences()[1:], torch.arange(2, 40), torch.arange(5, 7)]  # 3, 60, 38, 2 tokens
    samples = [Sample(s[: max(1, len(s) // 2)].tolist(), s[max(1, len(s) // 2) :].tolist()) for s in seqs]
    packed = run_distributed(
        _schedule_logprobs_rank, tp * pp, str(tmp_path), tp, pp, sp, fused, samples, True
    )[0]
    padded = run_distributed(
        _schedule_logprobs_rank, tp * pp, str(tmp_path), tp, pp, sp, fused, samples, False
    )[0]
    for i, (s, seq) in enumerate(zip(samples, seqs, strict=True)):
        logp = torch.log_softmax(hf_logits(hf, seq[None])[0].double(), dim=-1)
        p = len(s.prompt)
        expected = logp[p - 1 : len(seq) - 1].gather(-1, seq[p:, None])[:, 0]
        torch.testing.assert_close(packed[i].double(), expected, rtol=0, atol=2e-5)
        torch.testing.assert_close(padded[i], packed[i], rtol=0, atol=2e-5)
