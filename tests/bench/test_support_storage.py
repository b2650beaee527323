"""The support-storage benchmark: both layouts hand the op the same ids, and its byte columns are the layouts'
real sizes (computed here independently)."""

from __future__ import annotations

import argparse

import torch

from megatron_tail.bench.support_storage import make_samples, measure, op_support
from megatron_tail.train.engine.batch import pack_micro_batches


def test_both_layouts_give_the_op_the_same_support():
    data = make_samples(samples=4, response=40, k=64, vocab=256, seed=1)
    dense = pack_micro_batches(data["dense"], max_tokens=128)
    ragged = pack_micro_batches(data["ragged"], max_tokens=128)
    for a, b in zip(dense, ragged, strict=True):
        x, y = op_support("dense", a), op_support("ragged", b)
        assert x.dtype == torch.int64 and y.dtype == torch.int32
        assert y.shape[-1] <= x.shape[-1] and torch.equal(x[..., : y.shape[-1]], y.long())
        assert bool((x[..., y.shape[-1] :] == -1).all())


def test_byte_columns_are_the_layouts_sizes():
    args = argparse.Namespace(samples=4, response=40, vocab=256, max_tokens=128, repeats=1)
    row = measure(64, args)
    data = make_samples(4, 40, 64, 256)
    tokens = 4 * 40
    dense = sum(s.fields["support_plus1"].numel() * 4 for s in data["dense"])
    ids = sum(len(s.fields["sampling_support"].values) for s in data["ragged"])
    assert row["dense"]["host_bytes_per_token"] == dense / tokens
    assert row["ragged"]["host_bytes_per_token"] == (4 * ids + 8 * (tokens + 4)) / tokens
    assert row["ragged"]["host_bytes_per_token"] < row["dense"]["host_bytes_per_token"]
    assert row["dense"]["step_s"] > 0 and row["ragged"]["step_s"] > 0
