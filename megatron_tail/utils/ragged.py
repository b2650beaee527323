"""`Ragged`: rows of integer ids of varying length in one flat tensor (CSR), e.g. per-token sampling supports.

A truncating sampler's support varies per token: a few ids where the policy is confident, thousands where it
is not. Padding every token to the widest one (`[tokens, K_max]`) makes one high-entropy token cost a whole
sample or micro-batch `K_max` ids per token; in CSR a token costs its own ids (4 B each) plus one 8 B offset.
Rows are densified only where an op needs a rectangle, per micro-batch at the smallest width that holds it
(`dense`), with no host sync on an accelerator: the width and the id count are host ints.

`Ragged` is a dataclass of tensors and an int, so `torch.save` / `torch.load(weights_only=True)` and
`broadcast_object_list` carry it, and `dataclasses.asdict` turns it into a plain dict (`from_dict` back).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from megatron_tail.utils.device_copy import to_device

ID_DTYPE = torch.int32
"""Ids are token ids: int32 holds any vocabulary, at half the bytes of int64."""


@dataclass(frozen=True)
class Ragged:
    """`len(offsets) − 1` rows; row r is `values[offsets[r] : offsets[r + 1]]`.

    values: `[nnz]` int32. offsets: `[rows + 1]` int64, non-decreasing from 0 to nnz. width: the longest
    row (a host int, so densifying needs no device→host read)."""

    values: torch.Tensor
    offsets: torch.Tensor
    width: int

    @classmethod
    def from_lists(cls, rows: Sequence[Sequence[int]]) -> Ragged:
        """From Python lists of ids (one list per row)."""
        sizes = [len(r) for r in rows]
        # numpy's fromiter over the chained rows, not torch.tensor of a flattened list: 3–4× faster at
        # thousands of ids per token (top-p near 1), and it still raises OverflowError past int32
        flat = np.fromiter(itertools.chain.from_iterable(rows), dtype=np.int32, count=sum(sizes))
        return cls.from_flat(flat, np.asarray(sizes, dtype=np.int64))

    @classmethod
    def from_flat(cls, values: np.ndarray, sizes: np.ndarray) -> Ragged:
        """From the rows' ids back to back (int32 `[nnz]`) and the rows' lengths (int64 `[rows]`), both
        shared, not copied."""
        sizes_t = torch.from_numpy(sizes)
        return cls(torch.from_numpy(values), _offsets(sizes_t), int(sizes.max(initial=0)))

    @classmethod
    def from_dense(cls, dense: torch.Tensor, pad: int = -1) -> Ragged:
        """From `[rows, K]` ids padded with `pad` after each row's ids (a `pad` inside a row is dropped)."""
        keep = dense != pad
        sizes = keep.sum(dim=1, dtype=torch.int64)
        return cls(dense[keep].to(ID_DTYPE), _offsets(sizes), int(sizes.max()) if len(sizes) else 0)

    @classmethod
    def from_dict(cls, state: dict | Ragged | torch.Tensor) -> Ragged:
        """From `dataclasses.asdict(ragged)` (a checkpoint's plain dict); a `Ragged` passes through, and a
        `[rows, K]` tensor padded with −1 (the dense layout checkpoints held before) is converted."""
        if isinstance(state, Ragged):
            return state
        if isinstance(state, torch.Tensor):
            return cls.from_dense(state)
        return cls(state["values"], state["offsets"], int(state["width"]))

    @classmethod
    def empty_rows(cls, rows: int) -> Ragged:
        """`rows` rows without ids."""
        return cls(torch.zeros(0, dtype=ID_DTYPE), torch.zeros(rows + 1, dtype=torch.int64), 0)

    def __len__(self) -> int:
        return self.offsets.numel() - 1

    @property
    def nnz(self) -> int:
        """Ids over all rows (tensor metadata: no device read)."""
        return self.values.numel()

    @property
    def sizes(self) -> torch.Tensor:
        """`[rows]` int64 row lengths."""
        return self.offsets[1:] - self.offsets[:-1]

    @property
    def nbytes(self) -> int:
        """Bytes of the two tensors."""
        return self.values.numel() * self.values.element_size() + self.offsets.numel() * 8

    def to(self, device: torch.device | str) -> Ragged:
        return Ragged(to_device(self.values, device), to_device(self.offsets, device), self.width)

    def row(self, r: int) -> torch.Tensor:
        """Row r's ids `[size]` (reads two offsets: for tests and host code, not hot loops)."""
        return self.values[int(self.offsets[r]) : int(self.offsets[r + 1])]

    def dense(self, width: int | None = None, fill: int = -1, dtype: torch.dtype = ID_DTYPE) -> torch.Tensor:
        """`[rows, width]` (default `self.width`), row r's ids first then `fill`; on the tensors' device.

        No host sync: the scatter's indices come from `repeat_interleave` with its output size given."""
        width = self.width if width is None else width
        if width < self.width:
            raise ValueError(f"width {width} cannot hold the longest row ({self.width} ids)")
        device = self.values.device
        out = torch.full((len(self), width), fill, dtype=dtype, device=device)
        if self.nnz:
            rows = torch.repeat_interleave(
                torch.arange(len(self), device=device), self.sizes, output_size=self.nnz
            )
            cols = torch.arange(self.nnz, device=device) - self.offsets[rows]
            out[rows, cols] = self.values.to(dtype)
        return out

    def index_select(self, index: torch.Tensor) -> Ragged:
        """The rows `index` (`[m]` int64), in that order. On the host: its width is read back."""
        sizes = self.sizes[index]
        offsets = _offsets(sizes)
        total = int(offsets[-1])
        take = torch.repeat_interleave(self.offsets[index] - offsets[:-1], sizes, output_size=total)
        values = self.values[take + torch.arange(total, device=take.device)]
        return Ragged(values, offsets, int(sizes.max()) if len(sizes) else 0)


def cat_rows(parts: Sequence[Ragged]) -> Ragged:
    """The rows of `parts` one after the other."""
    if not parts:
        return Ragged.empty_rows(0)
    starts = torch.tensor([0] + [p.nnz for p in parts[:-1]], dtype=torch.int64).cumsum(0)
    offsets = [parts[0].offsets[:1]] + [
        p.offsets[1:] + s for p, s in zip(parts, starts.tolist(), strict=True)
    ]
    return Ragged(torch.cat([p.values for p in parts]), torch.cat(offsets), max(p.width for p in parts))


def scatter_rows(parts: Sequence[tuple[int, Ragged]], rows: int) -> Ragged:
    """`rows` rows, empty but for each `(start, part)`: the part's rows at `start, start + 1, …`.

    The parts must not overlap and must be in increasing `start` order (ids stay in row order)."""
    ends = [0] + [start + len(part) for start, part in parts]
    if any(start < end for (start, _), end in zip(parts, ends, strict=False)) or ends[-1] > rows:
        raise ValueError(
            f"parts at {[(s, len(p)) for s, p in parts]} overlap, are out of order or exceed {rows} rows"
        )
    sizes = torch.zeros(rows, dtype=torch.int64)
    for start, part in parts:
        sizes[start : start + len(part)] = part.sizes
    values = torch.cat([p.values for _, p in parts]) if parts else torch.zeros(0, dtype=ID_DTYPE)
    return Ragged(values, _offsets(sizes), max((p.width for _, p in parts), default=0))


def _offsets(sizes: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(sizes.numel() + 1, dtype=torch.int64, device=sizes.device)
    torch.cumsum(sizes, 0, out=out[1:])
    return out
