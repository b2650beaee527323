"""The contract Transformer Engine's attention needs from a packed micro-batch, checked on CPU with a
recording stand-in in the core-attention slot.

The stand-in builds TE's keyword arguments exactly as megatron-core 0.16.1's `TEDotProductAttention.forward`
does (extensions/transformer_engine.py: every `dataclasses.fields(PackedSeqParams)` but `cp_group` /
`local_cp_size`, mask type causal → padding_causal for "thd") and checks them against what TE's
`DotProductAttention.forward` asserts or needs (transformer_engine/pytorch/attention/dot_product_attention/
dot_product_attention.py; read at TE commit d0067d0, 2.20.0.dev0):
- query/key/value 3-D `[t, heads, d]`;
- `cu_seqlens_q/kv` 1-D int32 on the tensors' device, ending at t (every row covered: TE's fused THD RoPE
  leaves uncovered rows uninitialised);
- `cu_seqlens_*_padded` the same object as the unpadded ones (TE ≥ 2.18 infers "no padding between
  sequences" by identity; padding between sequences would rule out FlashAttention and the unfused backend);
- `max_seqlen_q/kv` Python ints ≥ the longest block (else TE reads them back from the device);
- `attention_mask` None (TE's unfused backend would use a given one).
Then it computes the attention with our local THD module, so the whole training step runs.
"""

from __future__ import annotations

import dataclasses
from itertools import pairwise

import torch

from tests.harness import run_distributed
from tests.model.hf_models import make_hf_model
from tests.train.common import init_rank, make_samples


def _te_contract_rank(rank, world_size, hf_dir):  # noqa: ARG001 - harness signature
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_tail.model import ModelSettings, load_hf_config, local_spec
    from megatron_tail.model.thd_attention import ThdDotProductAttention
    from megatron_tail.train import OpSettings, build_trainer, pack_micro_batches, train_step
    from tests.train.common import masked_nll_loss

    calls = []

    class RecordingTEAttention(ThdDotProductAttention):
        def forward(
            self,
            query,
            key,
            value,
            attention_mask,
            attn_mask_type=None,
            attention_bias=None,
            packed_seq_params=None,
        ):
            kept = {f.name for f in dataclasses.fields(PackedSeqParams)} - {"cp_group", "local_cp_size"}
            kwargs = {k: getattr(packed_seq_params, k) for k in kept}
            mask_type = AttnMaskType.padding_causal if attn_mask_type == AttnMaskType.causal else None
            t = query.shape[0]
            cu = kwargs["cu_seqlens_q"]
            bounds = cu.tolist()
            calls.append(
                {
                    "qkv_format": kwargs["qkv_format"],
                    "ndim": (query.dim(), key.dim(), value.dim()),
                    "cu_dtype": (cu.dtype, kwargs["cu_seqlens_kv"].dtype),
                    "cu_1d_on_device": cu.dim() == 1 and cu.device == query.device,
                    "covers_row": bounds[0] == 0 and bounds[-1] == t,
                    "padded_is_unpadded": kwargs["cu_seqlens_q_padded"] is cu
                    and kwargs["cu_seqlens_kv_padded"] is kwargs["cu_seqlens_kv"],
                    "max_seqlen_int": all(type(kwargs[k]) is int for k in ("max_seqlen_q", "max_seqlen_kv")),
                    "max_seqlen_ok": kwargs["max_seqlen_q"] >= max(b - a for a, b in pairwise(bounds)),
                    "mask_none": attention_mask is None,
                    "mask_type": mask_type,
                }
            )
            return super().forward(
                query, key, value, attention_mask, attn_mask_type, attention_bias, packed_seq_params
            )

    local_spec.ThdDotProductAttention = RecordingTEAttention  # the stand-in fills the core-attention slot
    init_rank(2, 1)
    arch = load_hf_config(hf_dir)
    trainer = build_trainer(arch, hf_dir=hf_dir, model_settings=ModelSettings(sequence_parallel=True))
    samples = make_samples(6, seed=3, min_len=2, max_len=12)
    mbs = pack_micro_batches(samples, max_tokens=24, pad_to_multiple=2)
    result = train_step(
        trainer, mbs, masked_nll_loss(sum(mb.num_loss_tokens for mb in mbs)), op=OpSettings(log_rho=-13.0)
    )
    return calls, len(mbs), arch.num_layers, result.grad_norm


def test_packed_micro_batches_meet_transformer_engines_thd_contract(tmp_path):
    make_hf_model("qwen3", tmp_path)
    calls, n_mbs, layers, grad_norm = run_distributed(_te_contract_rank, 2, str(tmp_path))[0]
    assert len(calls) == n_mbs * layers  # every layer of every micro-batch went through the THD path
    for call in calls:
        assert call["qkv_format"] == "thd"
        assert call["ndim"] == (3, 3, 3)
        assert call["cu_dtype"] == (torch.int32, torch.int32)
        assert call["cu_1d_on_device"] and call["covers_row"] and call["padded_is_unpadded"]
        assert call["max_seqlen_int"] and call["max_seqlen_ok"]
        assert call["mask_none"]
        assert call["mask_type"] is not None  # causal, which megatron turns into TE's padding_causal
    assert grad_norm > 0
