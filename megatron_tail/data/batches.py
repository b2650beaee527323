"""Deterministic prompt batches per RL step: a fresh permutation each epoch, from (seed, epoch)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Generic, TypeVar

import numpy as np

T = TypeVar("T")


class PromptBatches(Generic[T]):
    """`batch(step)` is the step's prompts; the same (seed, step) always gives the same batch, so a
    resumed run sees exactly the prompts it would have seen. The last partial batch of an epoch is dropped."""

    def __init__(self, examples: Sequence[T], batch_size: int, *, seed: int = 0, shuffle: bool = True):
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be an int ≥ 1; got {batch_size!r}")
        if len(examples) < batch_size:
            raise ValueError(f"batch_size {batch_size} exceeds the {len(examples)} prompts available")
        self.examples = list(examples)
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle = shuffle

    @property
    def batches_per_epoch(self) -> int:
        return len(self.examples) // self.batch_size

    def batch(self, step: int) -> list[T]:
        if step < 0:
            raise ValueError(f"step must be ≥ 0; got {step}")
        epoch, position = divmod(step, self.batches_per_epoch)
        order = np.arange(len(self.examples))
        if self.shuffle:
            order = np.random.default_rng([self.seed, epoch]).permutation(len(self.examples))
        start = position * self.batch_size
        return [self.examples[i] for i in order[start : start + self.batch_size]]
