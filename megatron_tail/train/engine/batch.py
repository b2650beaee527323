"""(prompt, response) samples → fixed-shape micro-batches for megatron, padded or packed.

Layout of a `MicroBatch` (b rows, s positions; every tensor CPU until `.to(device)`):
- `tokens [b, s]` int64: prompt + response ids (pad id where empty).
- `targets [b, s]` int64: the next token, `tokens[:, t + 1]` within a sequence; 0 where there is none.
- `loss_mask [b, s]` bool: `targets[:, t]` is a response token, i.e. position t predicts the response.
- `position_ids [b, s]` int64: 0.. within each sequence (restarted per sequence when packed).
- `attention_mask [b, 1, s, s]` bool, True = masked: causal; block-diagonal causal when packed (a
  sequence never sees another one). Trailing padding is its own block, so no row is fully masked.
- `sample_index [b, s]` int64: which sample (index into the list given to `make_micro_batches`) the
  target at t belongs to; -1 off the loss mask.
- `fields {name: [b, s]}`: per-response-token values of the samples (rollout log-probs, advantages, ...)
  aligned with `targets` (value of response token j at the position that predicts it); 0 elsewhere.
- `extras`: free-form per-micro-batch objects for the loss callback (e.g. the algorithms' PreparedTokens).
- Per-sample layout `[n, T]` (n samples of this micro-batch in order, T = their longest response):
  `to_samples(x)` gathers any per-token `[b, s]` tensor (differentiably) so that row k holds sample
  `sample_ids[k]`'s response tokens in order, `sample_valid [n, T]` marking the real ones. Sequence-level
  losses (sequence IS weights, veto, seq-mean aggregation) use this layout, in which a row is one sample
  whether the micro-batch is padded or packed.

All micro-batches of one `make_micro_batches` call have the same shape (pipeline parallelism sends
fixed-shape activations); missing rows are empty (all pad, nothing in the loss).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch


@dataclass(frozen=True)
class Sample:
    """One (prompt, response) pair of token ids, with optional per-response-token fields `[len(response)]`."""

    prompt: Sequence[int]
    response: Sequence[int]
    fields: Mapping[str, torch.Tensor] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.prompt) + len(self.response)


@dataclass
class MicroBatch:
    """One micro-batch; see the module docstring for the layout."""

    tokens: torch.Tensor
    targets: torch.Tensor
    loss_mask: torch.Tensor
    position_ids: torch.Tensor
    attention_mask: torch.Tensor
    sample_index: torch.Tensor
    fields: dict[str, torch.Tensor] = field(default_factory=dict)
    extras: dict[str, Any] = field(default_factory=dict)
    packed: bool = False
    sample_ids: torch.Tensor | None = None
    """`[n]` int64: the samples of this micro-batch, in order (indices into the `make_micro_batches` list)."""
    sample_rows: torch.Tensor | None = None
    """`[n, T]` int64: row (in `tokens`) of sample k's j-th response-token target; 0 where invalid."""
    sample_cols: torch.Tensor | None = None
    """`[n, T]` int64: column of that target; 0 where invalid."""
    sample_valid: torch.Tensor | None = None
    """`[n, T]` bool: j < len(response of sample k)."""

    @property
    def shape(self) -> tuple[int, int]:
        """(rows, sequence length)."""
        return tuple(self.tokens.shape)

    @property
    def num_loss_tokens(self) -> int:
        """Positions in the loss mask."""
        return int(self.loss_mask.sum())

    def to(self, device: torch.device | str) -> MicroBatch:
        """Tensors moved to `device` (extras untouched)."""
        move = {name: getattr(self, name).to(device) for name in _TENSORS if getattr(self, name) is not None}
        return replace(self, **move, fields={k: v.to(device) for k, v in self.fields.items()})

    def to_samples(self, x: torch.Tensor) -> torch.Tensor:
        """Per-token `[b, s]` → per-sample `[n, T]` (row k = sample `sample_ids[k]`'s response targets,
        0 where `sample_valid` is False). Differentiable; any dtype."""
        rows, cols = self.sample_rows.to(x.device), self.sample_cols.to(x.device)
        valid = self.sample_valid.to(x.device)
        return torch.where(valid, x[rows, cols], torch.zeros((), dtype=x.dtype, device=x.device))


_TENSORS = (
    "tokens",
    "targets",
    "loss_mask",
    "position_ids",
    "attention_mask",
    "sample_index",
    "sample_ids",
    "sample_rows",
    "sample_cols",
    "sample_valid",
)


def split_for_data_parallel(samples: Sequence[Sample], dp_rank: int, dp_size: int) -> list[Sample]:
    """This DP rank's contiguous share of the global batch (rank r gets samples [r·n/dp, (r+1)·n/dp))."""
    if len(samples) % dp_size:
        raise ValueError(
            f"global batch of {len(samples)} samples is not divisible by data_parallel={dp_size}"
        )
    n = len(samples) // dp_size
    return list(samples[dp_rank * n : (dp_rank + 1) * n])


def make_micro_batches(
    samples: Sequence[Sample],
    *,
    micro_batch_size: int,
    seq_len: int | None = None,
    packed: bool = False,
    pad_id: int = 0,
) -> list[MicroBatch]:
    """Group `samples` (in order) into micro-batches of `micro_batch_size` rows, all of one shape.

    Args:
        samples: this rank's samples.
        micro_batch_size: rows per micro-batch (padded: samples per micro-batch; packed: packed rows).
        seq_len: row length. Padded: default the longest sample. Packed: required; samples are packed
            greedily in order, a new row starting when the next sample does not fit.
        packed: pack several samples per row (block-diagonal mask, restarted positions).
        pad_id: token id of padding.
    Raises:
        ValueError: a sample longer than `seq_len`, an empty prompt/response, a field of the wrong length.
    """
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size must be ≥ 1; got {micro_batch_size}")
    if not samples:
        raise ValueError("no samples")
    for i, s in enumerate(samples):
        _check_sample(i, s)
    if packed and seq_len is None:
        raise ValueError("packed micro-batches need seq_len")
    seq_len = seq_len or max(len(s) for s in samples)
    too_long = [i for i, s in enumerate(samples) if len(s) > seq_len]
    if too_long:
        raise ValueError(f"samples {too_long[:5]} are longer than seq_len={seq_len}")
    rows = _pack_rows(samples, seq_len) if packed else [[i] for i in range(len(samples))]
    field_names = sorted(samples[0].fields)
    out = []
    for start in range(0, len(rows), micro_batch_size):
        group = rows[start : start + micro_batch_size]
        group += [[]] * (micro_batch_size - len(group))
        out.append(_build(samples, group, seq_len, pad_id, field_names, packed))
    return out


def _check_sample(i: int, s: Sample) -> None:
    if len(s.response) == 0:
        raise ValueError(f"sample {i} has an empty response")
    if len(s.prompt) == 0:
        raise ValueError(f"sample {i} has an empty prompt (the first response token needs a context)")
    for name, value in s.fields.items():
        if value.shape != (len(s.response),):
            raise ValueError(
                f"sample {i}: field {name!r} has shape {tuple(value.shape)}, expected ({len(s.response)},)"
            )


def _pack_rows(samples: Sequence[Sample], seq_len: int) -> list[list[int]]:
    rows: list[list[int]] = []
    used = seq_len  # forces a new row for the first sample
    for i, s in enumerate(samples):
        if used + len(s) > seq_len:
            rows.append([])
            used = 0
        rows[-1].append(i)
        used += len(s)
    return rows


def _build(samples, rows, seq_len, pad_id, field_names, packed) -> MicroBatch:
    b = len(rows)
    tokens = torch.full((b, seq_len), pad_id, dtype=torch.long)
    targets = torch.zeros((b, seq_len), dtype=torch.long)
    loss_mask = torch.zeros((b, seq_len), dtype=torch.bool)
    position_ids = torch.zeros((b, seq_len), dtype=torch.long)
    sample_index = torch.full((b, seq_len), -1, dtype=torch.long)
    block = torch.zeros((b, seq_len), dtype=torch.long)  # block id per position (for the mask)
    fields = {name: torch.zeros((b, seq_len), dtype=samples[0].fields[name].dtype) for name in field_names}
    for r, members in enumerate(rows):
        start = 0
        for k, i in enumerate(members):
            s = samples[i]
            n, p = len(s), len(s.prompt)
            ids = torch.tensor([*s.prompt, *s.response], dtype=torch.long)
            tokens[r, start : start + n] = ids
            targets[r, start : start + n - 1] = ids[1:]
            resp = slice(start + p - 1, start + n - 1)  # positions predicting response tokens
            loss_mask[r, resp] = True
            sample_index[r, resp] = i
            position_ids[r, start : start + n] = torch.arange(n)
            block[r, start : start + n] = k
            for name in field_names:
                fields[name][r, resp] = s.fields[name].to(fields[name].dtype)
            start += n
        pad = seq_len - start
        position_ids[r, start:] = torch.arange(pad)
        block[r, start:] = len(members)
    causal = torch.ones(seq_len, seq_len, dtype=torch.bool).tril()
    same_block = block[:, :, None] == block[:, None, :]
    attention_mask = ~(causal & same_block)[:, None]
    mb = MicroBatch(
        tokens, targets, loss_mask, position_ids, attention_mask, sample_index, fields, {}, packed
    )
    _add_sample_layout(mb, samples, rows)
    return mb


def _add_sample_layout(mb: MicroBatch, samples, rows) -> None:
    """Index tensors of the per-sample `[n, T]` layout (see `MicroBatch.to_samples`)."""
    members = [(r, i) for r, row in enumerate(rows) for i in row]
    longest = max((len(samples[i].response) for _, i in members), default=0)
    n = len(members)
    sample_rows = torch.zeros((n, longest), dtype=torch.long)
    sample_cols = torch.zeros((n, longest), dtype=torch.long)
    sample_valid = torch.zeros((n, longest), dtype=torch.bool)
    for k, (r, i) in enumerate(members):
        cols = (mb.sample_index[r] == i).nonzero()[:, 0]  # this sample's target positions, in order
        sample_rows[k, : len(cols)] = r
        sample_cols[k, : len(cols)] = cols
        sample_valid[k, : len(cols)] = True
    mb.sample_ids = torch.tensor([i for _, i in members], dtype=torch.long)
    mb.sample_rows, mb.sample_cols, mb.sample_valid = sample_rows, sample_cols, sample_valid
