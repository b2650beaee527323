"""(prompt, response) samples → micro-batches for megatron: packed (THD, by a token budget) or padded.

Layout of a `MicroBatch` (b rows, s positions; every tensor CPU until `.to(device)`):
- Packed (THD): b = 1 and s = T, the micro-batch's tokens: its samples back to back, then padding up to a
  multiple of `pad_to_multiple` (TP with sequence parallelism). `cu_seqlens` (n + 1 ints) holds the
  sequence boundaries, the trailing padding (if any) being one more sequence of its own, so every token
  belongs to exactly one causal block and the padded boundaries equal the unpadded ones. The model gets
  them as megatron's `PackedSeqParams(qkv_format="thd")` (`model.thd_packed_seq_params`).
- Padded: b samples, one per row from position 0, right-padded to the longest (rounded up to
  `pad_to_multiple`); `cu_seqlens` is None and attention is causal over the row.
- `tokens [b, s]` int64: prompt + response ids (pad id where empty).
- `targets [b, s]` int64: the next token, `tokens[:, t + 1]` within a sequence; 0 where there is none.
- `loss_mask [b, s]` bool: `targets[:, t]` is a response token the policy generated, i.e. position t
  predicts the response (minus the environment's tokens of a multi-turn sample, `Sample.policy_mask`: they
  are context only).
- `padding [b, s]` bool: True at the positions no sample's token takes (a row's end, an empty row, a packed
  row's trailing block, a sample's own padding to `sequence_multiple`); megatron's MoE router leaves them
  out of its load-balancing loss (`forward.router_padding_mask`).
- `sample_index [b, s]` int64: which sample (index into the list given to the builder) the target at t
  belongs to; -1 off the loss mask.
- `fields {name: [b, s, ...]}`: per-response-token values of the samples (rollout log-probs, advantages, ...)
  aligned with `targets` (value of response token j at the position that predicts it); 0 elsewhere. A field
  with trailing dims (a sample's `[len(response), K_i]`) is zero-padded to the micro-batch's largest
  trailing shape. A ragged field (a sample's `Ragged` of `len(response)` rows, e.g. the sampling support,
  `utils.ragged`) becomes a `Ragged` of `b·s` rows in position order (row `r·s + t` at position t of row
  r), empty off the response: each token keeps its own ids, and a consumer densifies it at the
  micro-batch's widest row (`Ragged.dense`).
- Per-position fields (`Sample.position_fields`, e.g. the engine's MoE routes `[len(sample), layers, k]`):
  one value per token of the sample, prompt included, placed at the token's own position (not at the
  position that predicts it) in `fields` as `[b, s, ...]`, 0 at padding. They ride with `fields` through
  the CP split and `.to(device)`.
- `extras`: free-form per-micro-batch objects for the loss callback (e.g. the algorithms' PreparedTokens).
- Per-sample layout `[n, T]` (n samples of this micro-batch in order, T = their longest response):
  `to_samples(x)` gathers any per-token `[b, s]` tensor (differentiably) so that row k holds sample
  `sample_ids[k]`'s policy tokens (its response tokens, minus environment tokens) in order, `sample_valid
  [n, T]` marking the real ones. Sequence-level
  losses (sequence IS weights, veto, seq-mean aggregation) use this layout, in which a row is one sample
  whether the micro-batch is padded or packed.

An empty micro-batch (no samples; `pad_to_multiple` pad tokens) is what a DP rank with fewer packed
micro-batches than the others runs, so that every rank runs the same count.

Equal shapes across ranks (MoE on CPU): `equalize_micro_batch_shapes` pads micro-batch i of every rank of a
group to the group's largest `[b, s]` (`pad_micro_batch`: more padding, a packed row's as one more causal
block), as megatron's allgather MoE dispatcher needs over its TP×EP group.

Context parallelism (`context_parallel.split_for_context_parallel`): a packed micro-batch is built whole,
each sample padded to `sequence_multiple` (2·CP) tokens, then every CP rank keeps its chunks of each
sequence; the shard's `cp` (a `CpShard`) keeps the whole micro-batch, and its `to_samples` places the
shard's tokens in the whole per-sample layout (zeros at the tokens of the other CP ranks).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from itertools import accumulate
from typing import Any

import torch
import torch.distributed as dist

from megatron_tail.utils.device_copy import to_device
from megatron_tail.utils.ragged import Ragged, cat_rows, scatter_rows

from .packing import balance_over_data_parallel, pack_by_token_budget


@dataclass(frozen=True)
class Sample:
    """One (prompt, response) pair of token ids, with optional per-response-token fields `[len(response)]`
    and per-position fields `[len(prompt) + len(response), ...]`."""

    prompt: Sequence[int]
    response: Sequence[int]
    fields: Mapping[str, torch.Tensor | Ragged] = field(default_factory=dict)
    policy_mask: Sequence[bool] | None = None
    """Per response token: True where the policy generated it, False for a multi-turn episode's environment
    tokens (observations), which stay in the sequence as context but leave the loss mask, and with it every
    per-token quantity (loss, log-probs, IS weights, safe-set checks, masks, metrics). None: all True."""
    position_fields: Mapping[str, torch.Tensor] = field(default_factory=dict)
    """Per token of prompt + response (row p belongs to token p itself), e.g. MoE routes; names distinct
    from `fields`'."""

    def __len__(self) -> int:
        return len(self.prompt) + len(self.response)


@dataclass
class MicroBatch:
    """One micro-batch; see the module docstring for the layout."""

    tokens: torch.Tensor
    targets: torch.Tensor
    loss_mask: torch.Tensor
    sample_index: torch.Tensor
    fields: dict[str, torch.Tensor | Ragged] = field(default_factory=dict)
    extras: dict[str, Any] = field(default_factory=dict)
    padding: torch.Tensor | None = None
    """`[b, s]` bool: True where no sample token is (the module docstring); None: not known (all real)."""
    cu_seqlens: tuple[int, ...] | None = None
    """`n_blocks + 1` boundaries of the causal blocks of a packed (THD) row, as ints (the model gets them as
    an int32 tensor on its device, and the local attention loops over the ints without a device sync);
    None when padded."""
    num_loss_tokens: int = 0
    """Positions in the loss mask (counted when built, so no device sync reads it)."""
    num_sample_tokens: int = 0
    """Tokens of the samples (prompt + response); the rest of the `b × s` slots is padding."""
    sample_ids: torch.Tensor | None = None
    """`[n]` int64: the samples of this micro-batch, in order (indices into the builder's list)."""
    sample_rows: torch.Tensor | None = None
    """`[n, T]` int64: row (in `tokens`) of sample k's j-th response-token target; 0 where invalid."""
    sample_cols: torch.Tensor | None = None
    """`[n, T]` int64: column of that target; 0 where invalid."""
    sample_valid: torch.Tensor | None = None
    """`[n, T]` bool: j < len(response of sample k)."""
    cp: CpShard | None = None
    """Under context parallelism: this CP rank's share of a whole packed micro-batch (None otherwise)."""

    @property
    def whole(self) -> MicroBatch:
        """The whole micro-batch this one is a CP shard of (itself without CP)."""
        return self if self.cp is None else self.cp.whole

    @property
    def sample_owned(self) -> torch.Tensor | None:
        """`[n, T]` bool: the per-sample positions whose tokens this CP rank computes (None without CP)."""
        return None if self.cp is None else self.cp.sample_owned

    @property
    def packed(self) -> bool:
        """THD layout (one row of back-to-back sequences)."""
        return self.cu_seqlens is not None

    @property
    def shape(self) -> tuple[int, int]:
        """(rows, sequence length)."""
        return tuple(self.tokens.shape)

    @property
    def num_slots(self) -> int:
        """Token positions the model computes (rows × length), padding included."""
        return self.tokens.numel()

    def to(self, device: torch.device | str) -> MicroBatch:
        """Tensors moved to `device` (extras untouched), a CP shard's index and sample layout included, so
        the loss's many `to_samples` calls find them there instead of copying them from the host each time."""
        move = {
            name: _moved(getattr(self, name), device) for name in _TENSORS if getattr(self, name) is not None
        }
        cp = None if self.cp is None else self.cp.to(device)
        fields = {k: _moved(v, device) for k, v in self.fields.items()}
        return replace(self, **move, fields=fields, cp=cp)

    def to_samples(self, x: torch.Tensor) -> torch.Tensor:
        """Per-token `[b, s]` → per-sample `[n, T]` (row k = sample `sample_ids[k]`'s response targets,
        0 where `sample_valid` is False). Differentiable; any dtype. On a CP shard, `x` is the shard's
        `[1, s/CP]` and the result the whole layout, 0 at the other CP ranks' tokens."""
        if self.cp is not None:
            return self.cp.whole.to_samples(self.cp.to_whole_row(x))
        rows, cols = self.sample_rows.to(x.device), self.sample_cols.to(x.device)
        valid = self.sample_valid.to(x.device)
        return torch.where(valid, x[rows, cols], torch.zeros((), dtype=x.dtype, device=x.device))


def _moved(value: torch.Tensor | Ragged, device: torch.device | str) -> torch.Tensor | Ragged:
    return value.to(device) if isinstance(value, Ragged) else to_device(value, device)


_SAMPLE_LAYOUT = ("sample_ids", "sample_rows", "sample_cols", "sample_valid")
_TENSORS = (
    "tokens",
    "targets",
    "loss_mask",
    "sample_index",
    "padding",
    "sample_ids",
    "sample_rows",
    "sample_cols",
    "sample_valid",
)


@dataclass(frozen=True)
class CpShard:
    """What a CP shard of a packed micro-batch knows of the whole one."""

    whole: MicroBatch
    """The whole micro-batch (every CP rank has the same), with its per-sample layout."""
    index: torch.Tensor
    """`[T/CP]` int64: this rank's positions in the whole row (`context_parallel_index`)."""
    indices: tuple[torch.Tensor, ...]
    """Every CP rank's `index`, in rank order (for the gather)."""
    sample_owned: torch.Tensor
    """`[n, T]` bool: the whole layout's valid positions whose tokens this rank computes."""
    rank: int
    size: int

    def to(self, device: torch.device | str) -> CpShard:
        """What `to_samples` reads on the device: the index, the owned mask and the whole micro-batch's sample
        layout (its tokens and fields stay where they are: the shard never reads their values). `indices`
        stay on the host, where `context_parallel.gather_whole_row` assembles the whole row."""
        layout = {name: to_device(getattr(self.whole, name), device) for name in _SAMPLE_LAYOUT}
        whole = replace(self.whole, **layout)
        return replace(
            self,
            whole=whole,
            index=to_device(self.index, device),
            sample_owned=to_device(self.sample_owned, device),
        )

    def to_whole_row(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's `[1, T/CP]` → the whole row `[1, T]`, zeros elsewhere (differentiable in `x`)."""
        index = self.index.to(x.device)
        full = torch.zeros((x.shape[0], self.whole.tokens.shape[1]), dtype=x.dtype, device=x.device)
        return full.index_copy(1, index, x)


def take_positions(value: torch.Tensor | Ragged, index: torch.Tensor) -> torch.Tensor | Ragged:
    """The positions `index` (`[m]` int64) of a one-row (packed) micro-batch's per-token value: `[1, m, ...]`
    of a `[1, s, ...]` tensor, or the `m` rows of a `Ragged` field."""
    return value.index_select(index) if isinstance(value, Ragged) else value[:, index]


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
    pad_to_multiple: int = 1,
    pad_id: int = 0,
) -> list[MicroBatch]:
    """Padded micro-batches: `samples` (in order) in groups of `micro_batch_size` rows, one per row.

    Args:
        samples: this rank's samples.
        micro_batch_size: samples (rows) per micro-batch; a last, smaller group is filled with empty rows.
        seq_len: row length; default the longest sample. Rounded up to `pad_to_multiple`.
        pad_to_multiple: row length multiple (TP with sequence parallelism: megatron splits the sequence).
        pad_id: token id of padding.
    Raises:
        ValueError: a sample longer than `seq_len`, an empty prompt/response, a field of the wrong length.
    """
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size must be ≥ 1; got {micro_batch_size}")
    _check_samples(samples)
    seq_len = _round_up(seq_len or max(len(s) for s in samples), pad_to_multiple)
    too_long = [i for i, s in enumerate(samples) if len(s) > seq_len]
    if too_long:
        raise ValueError(f"samples {too_long[:5]} are longer than seq_len={seq_len}")
    out = []
    for start in range(0, len(samples), micro_batch_size):
        rows = [[i] for i in range(start, min(start + micro_batch_size, len(samples)))]
        rows += [[]] * (micro_batch_size - len(rows))
        out.append(_build(samples, rows, seq_len, pad_id))
    return out


def pack_micro_batches(
    samples: Sequence[Sample],
    *,
    max_tokens: int,
    dp_rank: int = 0,
    dp_size: int = 1,
    pad_to_multiple: int = 1,
    pad_id: int = 0,
    sequence_multiple: int = 1,
) -> list[MicroBatch]:
    """This DP rank's packed (THD) micro-batches of the global `samples`, each ≤ `max_tokens` tokens.

    All ranks pass the same `samples`; they are packed first-fit decreasing into the fewest micro-batches
    (`pack_by_token_budget`), dealt to the DP ranks balancing tokens, and padded with empty micro-batches
    so every rank runs the same count (`balance_over_data_parallel`). `sample_ids`/`sample_index` index
    into `samples`. A micro-batch's length is its tokens rounded up to `pad_to_multiple`, capped at
    `max_tokens` (so `max_tokens` must be a multiple of it). With `sequence_multiple` > 1 (2·CP under
    context parallelism) every sample takes its length rounded up to it, the padding after its last token
    being part of its causal block (never a loss token), so each block splits into 2·CP equal chunks;
    `pad_to_multiple` must then be a multiple of `sequence_multiple`.
    Raises ValueError naming a sample longer than `max_tokens` (padded).
    """
    if max_tokens % pad_to_multiple or pad_to_multiple % sequence_multiple:
        raise ValueError(
            f"max_tokens={max_tokens} must be a multiple of pad_to_multiple={pad_to_multiple} (TP with "
            f"sequence parallelism), itself a multiple of sequence_multiple={sequence_multiple} (2·CP)"
        )
    _check_samples(samples)
    lengths = [_round_up(len(s), sequence_multiple) for s in samples]
    bins = pack_by_token_budget(lengths, max_tokens)
    mine = balance_over_data_parallel(bins, lengths, dp_size)[dp_rank]
    out = []
    for members in mine:
        length = _round_up(max(sum(lengths[i] for i in members), 1), pad_to_multiple)
        out.append(_build(samples, [members], length, pad_id, packed=True, slots=lengths))
    return out


def equalize_micro_batch_shapes(
    mbs: Sequence[MicroBatch], group: dist.ProcessGroup, device: torch.device, *, pad_id: int = 0
) -> list[MicroBatch]:
    """`mbs` padded so that every rank of `group` has the same `[b, s]` for each micro-batch index.

    Why: megatron-core 0.16.1's allgather MoE dispatcher (`MoEAllGatherTokenDispatcher.token_dispatch`,
    transformer/moe/token_dispatcher.py) gathers the `[s·b, h]` tokens over the TP×EP group with
    `gather_from_sequence_parallel_region` → `all_gather_into_tensor`, without split sizes: every rank of
    that group must run the same shapes in the same order, and its ranks may hold different samples (EP
    spans dense DP). One collective for all the micro-batches (a MAX of their `[n, 2]` shapes over
    `group`, on `device`, e.g. `parallel.comm_device()`); the caller guarantees the same count `n` on every
    rank (the builders give every DP rank the same count). Whole micro-batches only (before the CP split,
    whose shards then have equal shapes too). `pad_micro_batch` says how the padding is laid out.
    """
    shapes = torch.tensor([mb.shape for mb in mbs], dtype=torch.int64, device=device).reshape(-1, 2)
    dist.all_reduce(shapes, op=dist.ReduceOp.MAX, group=group)
    return [pad_micro_batch(mb, b, s, pad_id=pad_id) for mb, (b, s) in zip(mbs, shapes.tolist(), strict=True)]


def pad_micro_batch(mb: MicroBatch, rows: int, length: int, *, pad_id: int = 0) -> MicroBatch:
    """`mb` grown to `[rows, length]` with padding, as the builders pad: pad tokens off the loss mask,
    `sample_index` -1, fields 0 (MoE routes: expert 0, `ROUTED_FIELD` False; a ragged field's rows empty).
    Padded layout: new empty rows and positions after each row's end (causal attention: no real token
    sees them). Packed (THD, one row): the new positions are one more causal block of their own at the end
    of `cu_seqlens`, so the samples' blocks are unchanged (a multiple of `pad_to_multiple` when both lengths
    are, which keeps a CP split's 2·CP chunks). The per-sample layout (row, column of each target) stays."""
    b, s = mb.shape
    if (b, s) == (rows, length):
        return mb
    if mb.cp is not None or rows < b or length < s or (mb.packed and rows != 1):
        raise ValueError(
            f"cannot pad a micro-batch of shape {(b, s)} (cp={mb.cp is not None}) to {(rows, length)}"
        )

    def grow(x: torch.Tensor, fill) -> torch.Tensor:
        out = torch.full((rows, length, *x.shape[2:]), fill, dtype=x.dtype, device=x.device)
        out[:b, :s] = x
        return out

    fields = {}
    for name, value in mb.fields.items():
        if isinstance(value, Ragged):  # row r·s + t → r·length + t
            parts = []
            for r in range(b):
                parts += [value.index_select(torch.arange(r * s, (r + 1) * s)), Ragged.empty_rows(length - s)]
            parts.append(Ragged.empty_rows((rows - b) * length))
            fields[name] = cat_rows(parts)
        else:
            fields[name] = grow(value, 0)
    cu = None if mb.cu_seqlens is None else (*mb.cu_seqlens, length)
    return replace(
        mb,
        tokens=grow(mb.tokens, pad_id),
        targets=grow(mb.targets, 0),
        loss_mask=grow(mb.loss_mask, False),
        sample_index=grow(mb.sample_index, -1),
        padding=None if mb.padding is None else grow(mb.padding, True),
        fields=fields,
        cu_seqlens=cu,
    )


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _check_samples(samples: Sequence[Sample]) -> None:
    if not samples:
        raise ValueError("no samples")
    for i, s in enumerate(samples):
        _check_sample(i, s)


def _check_sample(i: int, s: Sample) -> None:
    if len(s.response) == 0:
        raise ValueError(f"sample {i} has an empty response")
    if len(s.prompt) == 0:
        raise ValueError(f"sample {i} has an empty prompt (the first response token needs a context)")
    if s.policy_mask is not None:
        if len(s.policy_mask) != len(s.response):
            raise ValueError(
                f"sample {i}: policy_mask has {len(s.policy_mask)} entries, expected {len(s.response)}"
            )
        if not any(s.policy_mask):
            raise ValueError(f"sample {i} has no policy token (policy_mask is all False)")
    for name, value in s.position_fields.items():
        if value.dim() < 1 or value.shape[0] != len(s):
            raise ValueError(
                f"sample {i}: position field {name!r} has shape {tuple(value.shape)}, expected "
                f"({len(s)}, ...)"
            )
    for name, value in s.fields.items():
        if isinstance(value, Ragged):
            if len(value) != len(s.response):
                raise ValueError(
                    f"sample {i}: ragged field {name!r} has {len(value)} rows, expected {len(s.response)}"
                )
        elif value.dim() < 1 or value.shape[0] != len(s.response):
            raise ValueError(
                f"sample {i}: field {name!r} has shape {tuple(value.shape)}, expected "
                f"({len(s.response)}, ...)"
            )


def _widest(dtypes: list[torch.dtype]) -> torch.dtype:
    """The dtype every one of `dtypes` casts into losslessly (`torch.promote_types`): samples' routes are
    compacted each to its own largest id (`rollout.routes.compact_routes`), so a micro-batch of uint8 and
    int16 routes took the first sample's uint8, and expert 300 became expert 44."""
    return functools.reduce(torch.promote_types, dtypes)


def _build(samples, rows, seq_len, pad_id, *, packed: bool = False, slots=None) -> MicroBatch:
    """`rows[r]`: the sample ids laid back to back in row r (one per row when padded); `slots[i]`: the
    positions sample i takes in a packed row (its length, or more with per-sequence padding)."""
    b = len(rows)
    field_names = sorted(n for n, v in samples[0].fields.items() if not isinstance(v, Ragged))
    ragged_names = sorted(n for n, v in samples[0].fields.items() if isinstance(v, Ragged))
    ragged_parts: dict[str, list[tuple[int, Ragged]]] = {name: [] for name in ragged_names}
    tokens = torch.full((b, seq_len), pad_id, dtype=torch.long)
    targets = torch.zeros((b, seq_len), dtype=torch.long)
    loss_mask = torch.zeros((b, seq_len), dtype=torch.bool)
    sample_index = torch.full((b, seq_len), -1, dtype=torch.long)
    padding = torch.ones((b, seq_len), dtype=torch.bool)
    members = [i for row in rows for i in row] or [0]
    fields = {
        name: torch.zeros(
            (b, seq_len, *_trailing(samples, members, name)),
            dtype=_widest([samples[i].fields[name].dtype for i in members]),
        )
        for name in field_names
    }
    position_names = sorted(samples[0].position_fields)
    for name in position_names:
        value = samples[0].position_fields[name]
        dtype = _widest([samples[i].position_fields[name].dtype for i in members])
        fields[name] = torch.zeros((b, seq_len, *value.shape[1:]), dtype=dtype)
    for r, members in enumerate(rows):
        start = 0
        for i in members:
            s = samples[i]
            n, p = len(s), len(s.prompt)
            ids = torch.tensor([*s.prompt, *s.response], dtype=torch.long)
            tokens[r, start : start + n] = ids
            padding[r, start : start + n] = False
            targets[r, start : start + n - 1] = ids[1:]
            resp = slice(start + p - 1, start + n - 1)  # positions predicting response tokens
            if s.policy_mask is None:
                loss_mask[r, resp] = True
                sample_index[r, resp] = i
            else:  # environment tokens: context only
                policy = torch.tensor(list(s.policy_mask), dtype=torch.bool)
                loss_mask[r, resp] = policy
                sample_index[r, resp] = torch.where(policy, i, -1)
            for name in field_names:
                value = s.fields[name]
                corner = (r, resp, *(slice(0, d) for d in value.shape[1:]))
                fields[name][corner] = value.to(fields[name].dtype)
            for name in ragged_names:
                ragged_parts[name].append((r * seq_len + resp.start, s.fields[name]))
            for name in position_names:
                fields[name][r, start : start + n] = s.position_fields[name].to(fields[name].dtype)
            start += n if slots is None else slots[i]
    for name, parts in ragged_parts.items():
        fields[name] = scatter_rows(parts, b * seq_len)
    mb = MicroBatch(
        tokens,
        targets,
        loss_mask,
        sample_index,
        fields,
        padding=padding,
        num_loss_tokens=int(loss_mask.sum()),
        num_sample_tokens=sum(len(samples[i]) for row in rows for i in row),
    )
    if packed:  # one row: its samples' boundaries, and the trailing padding as a causal block of its own
        taken = (len(samples[i]) if slots is None else slots[i] for i in rows[0])
        bounds = list(accumulate(taken, initial=0))
        if bounds[-1] < seq_len:
            bounds.append(seq_len)
        mb.cu_seqlens = tuple(bounds)
    _add_sample_layout(mb, samples, rows)
    return mb


def _trailing(samples, members, name) -> tuple[int, ...]:
    """The largest trailing shape of field `name` over the samples `members` (() for `[len(response)]`)."""
    shapes = [tuple(samples[i].fields[name].shape[1:]) for i in members]
    return tuple(max(dims) for dims in zip(*shapes, strict=True)) if shapes and shapes[0] else ()


def _add_sample_layout(mb: MicroBatch, samples, rows) -> None:
    """Index tensors of the per-sample `[n, T]` layout (see `MicroBatch.to_samples`)."""
    members = [(r, i) for r, row in enumerate(rows) for i in row]
    longest = max((_policy_tokens(samples[i]) for _, i in members), default=0)
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


def _policy_tokens(sample: Sample) -> int:
    return len(sample.response) if sample.policy_mask is None else sum(map(bool, sample.policy_mask))
