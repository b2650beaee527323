"""DAPO's soft overlong punishment (arXiv 2503.14476, eq. 13), a reward term by response length.

With L_max the generation limit and L_cache the buffer before it:

    R_length(L) = 0                                   for L ≤ L_max − L_cache
                = ((L_max − L_cache) − L) / L_cache   for L_max − L_cache < L ≤ L_max
                = −1                                  for L > L_max

scaled by a factor (DAPO: 1) and added to the task reward before advantages. Responses are cut at L_max,
so in practice the term falls linearly from 0 to −factor across the buffer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def overlong_penalty(
    lengths: torch.Tensor, *, max_len: int, buffer: int, factor: float = 1.0
) -> torch.Tensor:
    """`[N]` float64 penalties (≤ 0) of responses with `lengths` (`[N]` int, generated tokens).

    `buffer` = L_cache in [1, max_len]; `factor` ≥ 0 scales the term."""
    if isinstance(buffer, bool) or not isinstance(buffer, int) or not 1 <= buffer <= max_len:
        raise ValueError(f"overlong buffer must be an int in [1, max_len = {max_len}]; got {buffer!r}")
    if not factor >= 0:
        raise ValueError(f"overlong penalty factor must be ≥ 0; got {factor!r}")
    length = lengths.to(torch.float64)
    start = max_len - buffer
    inside = ((start - length) / buffer).clamp(max=0.0)
    return factor * torch.where(length > max_len, torch.full_like(length, -1.0), inside)


@dataclass(frozen=True)
class OverlongShaping:
    """The penalty as a run configures it: `max_len` = `rollout.max_new_tokens`, `buffer` =
    `algorithm.overlong_buffer` (> 0), `factor` = `algorithm.overlong_penalty`."""

    max_len: int
    buffer: int
    factor: float = 1.0

    def penalty(self, lengths: torch.Tensor) -> torch.Tensor:
        """`[N]` float64 penalties (≤ 0) of responses `lengths` (`[N]` int) tokens long."""
        return overlong_penalty(lengths, max_len=self.max_len, buffer=self.buffer, factor=self.factor)

    def shaped(self, rewards: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """`[N]` float64: the task `rewards` plus the penalty, the rewards the advantages see."""
        return rewards.to(torch.float64) + self.penalty(lengths)
