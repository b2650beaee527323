"""Deterministic prompts per RL step: a fresh permutation each epoch, from (seed, epoch).

`PromptBatches.batch(step)`: a fixed number of prompts per step, a pure function of (seed, step).
`PromptStream.take(cursor, n)`: any number of prompts from a cursor, for steps that consume a varying number
(dynamic sampling); the cursor goes into the checkpoint, so a resumed run takes the same prompts next.
"""

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


class PromptStream(Generic[T]):
    """The prompts in epoch order, each epoch a fresh permutation from (seed, epoch), as one endless stream:
    position `cursor` is prompt `order(epoch)[pos]` with `(epoch, pos) = divmod(cursor, len(examples))`. Every
    prompt is used exactly once per epoch, and nothing is dropped at an epoch's end."""

    def __init__(self, examples: Sequence[T], *, seed: int = 0, shuffle: bool = True):
        if not examples:
            raise ValueError("no prompts to stream")
        self.examples = list(examples)
        self.seed = seed
        self.shuffle = shuffle

    def take(self, cursor: int, n: int) -> tuple[list[T], int]:
        """The `n` prompts from `cursor` on, and the cursor after them."""
        if not isinstance(cursor, int) or cursor < 0 or not isinstance(n, int) or n < 0:
            raise ValueError(f"cursor and n must be ints ≥ 0; got cursor={cursor!r}, n={n!r}")
        out, orders = [], {}
        size = len(self.examples)
        for i in range(cursor, cursor + n):
            epoch, pos = divmod(i, size)
            if epoch not in orders:
                orders[epoch] = self._order(epoch)
            out.append(self.examples[int(orders[epoch][pos])])
        return out, cursor + n

    def _order(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(len(self.examples))
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.examples))
