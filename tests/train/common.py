"""Shared pieces of the trainer tests: deterministic samples and rank functions."""

from __future__ import annotations

import torch

from megatron_tail.train import Sample

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


def init_rank(tp: int = 1, pp: int = 1, seed: int = 1234):
    """Inside a forked rank: megatron parallel state via the trainer's own init."""
    from megatron_tail.train import ParallelConfig, init_parallel

    return init_parallel(ParallelConfig(tensor_parallel=tp, pipeline_parallel=pp, seed=seed))


def full_hf_state(trainer) -> dict[str, torch.Tensor] | None:
    """All parameters as full HF tensors on rank 0 (None elsewhere); collective."""
    from megatron_tail.model import iter_hf_tensors

    state = {name: t.detach().clone().cpu() for name, t in iter_hf_tensors(trainer.chunks, trainer.arch)}
    return state or None
