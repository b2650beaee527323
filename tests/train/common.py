"""Shared pieces of the trainer tests: deterministic samples, rank functions, and a plain masked NLL loss
(the simplest `train_step` callback, independent of the RL objective)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from megatron_tail.train import MicroBatch, Sample

VOCAB = 200
PAD_MULTIPLE = 128
"""Tests pad the vocab of 200 to 256 (not the default 1024), so that, as with real vocabularies, every
TP=2 shard holds real tokens (the bridge tests and `test_bf16_step_runs` keep the default)."""


def make_samples(n: int, seed: int, *, min_len: int = 3, max_len: int = 7) -> list[Sample]:
    """`n` random (prompt, response) samples with prompt/response lengths in [min_len, max_len]."""
    g = torch.Generator().manual_seed(seed)

    def ids(k: int) -> list[int]:
        return torch.randint(0, VOCAB, (k,), generator=g).tolist()

    def length() -> int:
        return int(torch.randint(min_len, max_len + 1, (), generator=g))

    return [Sample(prompt=ids(length()), response=ids(length())) for _ in range(n)]


def tiny_qwen3_dir(tmp_path_factory, *, tie: bool) -> str:
    """A tiny random Qwen3 (`tests.model.hf_models`) saved in a new directory; its path."""
    from tests.model.hf_models import make_hf_model

    path = tmp_path_factory.mktemp("qwen3_tied" if tie else "qwen3")
    make_hf_model("qwen3", path, tie=tie)
    return str(path)


def smooth_trainer(hf_dir: str, settings):
    """A trainer of `hf_dir` with model `settings` whose update is ≈ lr·g (Adam with eps 1, no clipping):
    smooth in the gradient, so layouts that sum the same gradient in another order give the same weights to
    float32 rounding."""
    from megatron_tail.model import load_hf_config
    from megatron_tail.train import OptimizerSettings, build_trainer

    return build_trainer(
        load_hf_config(hf_dir),
        hf_dir=hf_dir,
        model_settings=settings,
        optim=OptimizerSettings(lr=0.5, adam_eps=1.0, clip_grad=1e9),
    )


def init_rank(tp: int = 1, pp: int = 1, seed: int = 1234):
    """Inside a forked rank: megatron parallel state via the trainer's own init."""
    from megatron_tail.config.parallel import ParallelSection
    from megatron_tail.train import init_parallel

    return init_parallel(ParallelSection(tensor_parallel=tp, pipeline_parallel=pp), seed=seed)


def full_hf_state(trainer) -> dict[str, torch.Tensor] | None:
    """All parameters as full HF tensors on rank 0 (None elsewhere); collective."""
    from megatron_tail.model import iter_hf_tensors

    state = {name: t.detach().clone().cpu() for name, t in iter_hf_tensors(trainer.chunks, trainer.arch)}
    return state or None


def masked_nll_loss(global_num_tokens):
    """`train_step` callback: masked negative log-likelihood of the response tokens, normalised by
    `global_num_tokens`. Metrics: `loss` (this micro-batch's share of the global loss), `loss_tokens`."""

    def loss_fn(out, mb):
        mask = mb.loss_mask
        nll = -torch.where(mask, out.logprobs, torch.zeros_like(out.logprobs)).sum()
        loss = nll / global_num_tokens
        return loss, {"loss": loss.detach().double(), "loss_tokens": mask.sum().double()}

    return loss_fn


def global_loss_tokens(micro_batches: Sequence[MicroBatch], dp_group) -> int:
    """Loss-mask positions over all micro-batches and DP ranks (one all-reduce)."""
    from megatron_tail.train.engine.collectives import all_reduce_scalars

    local = float(sum(mb.num_loss_tokens for mb in micro_batches))
    return int(all_reduce_scalars({"loss_tokens": local}, dp_group)["loss_tokens"])


def per_sample(
    micro_batches: Sequence[MicroBatch], values: Sequence[torch.Tensor]
) -> dict[int, torch.Tensor]:
    """Per-token values `[b, s]` per micro-batch → {sample index: its response tokens' values, in order}."""
    out: dict[int, torch.Tensor] = {}
    for mb, v in zip(micro_batches, values, strict=True):
        idx = mb.sample_index.to(v.device)
        for i in idx[idx >= 0].unique().tolist():
            out[i] = v[idx == i]
    return out
