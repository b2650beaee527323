"""The MoE demo's tiny Qwen3-MoE (`megatron-tail demo --moe`): the dense demo's shapes with every MLP replaced
by 8 experts, top-2, and its routing statistics in bf16 against fp32.

The routers are pretrained with the task (and Qwen3's load-balancing loss), so their top-k is a learned
decision rather than a random projection's; `routing_stats` measures how close that decision is (the gap
between the k-th and the (k+1)-th router logit: what bf16's rounding of the logits competes with) and how
often bf16 picks another top-k set than fp32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_tail.data.char_tokenizer import build_char_tokenizer
from megatron_tail.demo.model import TINY_SHAPE

NUM_EXPERTS = 8
TOP_K = 2
CLOSE_GAP = 0.05
"""A router-logit gap below this counts as a near-tie in `RoutingStats.close_fraction`."""


def tiny_qwen3_moe_config(**overrides):
    """A Qwen3-MoE of the dense demo model's size class: 3 layers, all MoE, 8 experts of width 64, top-2
    renormalised (`norm_topk_prob`, as Qwen3-30B-A3B), Qwen3's aux-loss coefficient 1e-3; heads divisible
    by TP = 2."""
    from transformers import Qwen3MoeConfig

    experts = dict(
        moe_intermediate_size=64,
        num_experts=NUM_EXPERTS,
        num_experts_per_tok=TOP_K,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],  # so TINY_SHAPE's intermediate_size is unused: no dense layer
        router_aux_loss_coef=1e-3,
    )
    return Qwen3MoeConfig(**{**TINY_SHAPE, **experts, **overrides})


def new_tiny_qwen3_moe(seed: int, **overrides):
    """A freshly initialised `Qwen3MoeForCausalLM` (seeded) and the character tokenizer."""
    from transformers import Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    return Qwen3MoeForCausalLM(tiny_qwen3_moe_config(**overrides)), build_char_tokenizer()


@dataclass(frozen=True)
class RoutingStats:
    """bf16 against fp32 routing of one model on the same tokens, over every (token, MoE layer)."""

    pairs: int
    """(token, MoE layer) pairs compared."""
    agreement: float
    """Fraction of pairs whose top-k expert *sets* are equal in bf16 and fp32 (as `moe/routing_agreement`)."""
    median_gap: float
    """Median of z_k − z_{k+1} (fp32 router logits, k-th minus (k+1)-th largest; softmax is monotone, so
    this decides the top-k)."""
    close_fraction: float
    """Fraction of pairs with that gap below `CLOSE_GAP` (near-ties, where bf16's rounding of logits of
    magnitude ~1-10, relative 2^-8, can swap the order)."""


@torch.no_grad()
def routing_stats(model, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> RoutingStats:
    """Route `input_ids [N, L]` (mask `[N, L]`, 1 = real token) through `model` (a HF Qwen3-MoE) in fp32 and
    a bf16 copy; compare each MoE layer's top-k per real token. Each copy routes its *own* hidden states (as
    engine and trainer do), so bf16 differences accumulate over layers."""
    import copy

    def router_logits(m, dtype) -> list[torch.Tensor]:
        """Per MoE layer: the router logits `[tokens, E]` of real tokens, as fp32."""
        m = copy.deepcopy(m).to(dtype).eval()
        out = m(input_ids=input_ids, attention_mask=attention_mask, output_router_logits=True)
        real = attention_mask.reshape(-1).bool()
        return [logits.float()[real] for logits in out.router_logits]

    k = model.config.num_experts_per_tok
    exact, rounded = router_logits(model, torch.float32), router_logits(model, torch.bfloat16)
    agree, gaps = [], []
    for p32, p16 in zip(exact, rounded, strict=True):
        top32 = p32.topk(k, dim=-1).indices.sort(-1).values
        top16 = p16.topk(k, dim=-1).indices.sort(-1).values
        agree.append((top32 == top16).all(-1))
        top = p32.topk(k + 1, dim=-1).values
        gaps.append(top[:, k - 1] - top[:, k])
    agree_all, gap_all = torch.cat(agree), torch.cat(gaps)
    return RoutingStats(
        pairs=int(agree_all.numel()),
        agreement=float(agree_all.double().mean()),
        median_gap=float(gap_all.median()),
        close_fraction=float((gap_all < CLOSE_GAP).double().mean()),
    )


def _pretrain_settings_class():
    from megatron_tail.demo.pretrain import PretrainSettings

    @dataclass(frozen=True)
    class MoePretrainSettings(PretrainSettings):
        """The MoE demo's pretraining: the dense demo's data, fewer and smaller steps (HF's expert loop is
        ~10× the dense MLP's time on CPU), the load-balancing loss on (`fit_causal_lm`)."""

        experts: int = NUM_EXPERTS
        top_k: int = TOP_K

        def new_model(self):
            model, tokenizer = new_tiny_qwen3_moe(
                self.seed, num_experts=self.experts, num_experts_per_tok=self.top_k
            )
            model.set_experts_implementation("grouped_mm")  # 2× eager's speed on CPU (torch 2.13)
            return model, tokenizer

    return MoePretrainSettings


MoePretrainSettings = _pretrain_settings_class()


def load_routing_stats(model_dir, prompts_file, *, limit: int = 200) -> dict:
    """`routing_stats` of the HF Qwen3-MoE in `model_dir` on the prompts + answers (EOS-terminated) of the
    first `limit` rows of a `{prompt, answer}` jsonl: a dict for `pretrain.json`."""
    import json
    from dataclasses import asdict
    from pathlib import Path

    from transformers import AutoTokenizer, Qwen3MoeForCausalLM

    from megatron_tail.demo.pretrain import encode

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    model = Qwen3MoeForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    rows = [json.loads(line) for line in Path(prompts_file).read_text().splitlines() if line.strip()][:limit]
    seqs = [encode(tokenizer, r["prompt"], r["answer"])[0] for r in rows]
    width = max(len(s) for s in seqs)
    ids = torch.zeros((len(seqs), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, s in enumerate(seqs):
        ids[i, : len(s)], mask[i, : len(s)] = torch.tensor(s), 1
    return asdict(routing_stats(model, ids, mask))
