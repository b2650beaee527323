"""Which samples go into which packed micro-batch on which DP rank: pure integer planning, no tensors.

    bins = pack_by_token_budget(lengths, max_tokens)          # [[sample ids], ...], each ≤ max_tokens
    per_rank = balance_over_data_parallel(bins, lengths, dp)  # dp lists of bins, all the same length

Every rank runs the same plan on the same global lengths, so all ranks agree without a collective.
"""

from __future__ import annotations

from collections.abc import Sequence


def pack_by_token_budget(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """First-fit decreasing: sample ids (indices into `lengths`) grouped into bins of ≤ `max_tokens` tokens.

    Samples are placed longest first (ties by id), each into the first bin with room; a bin's members are
    listed in placement order. FFD uses at most 11/9·OPT + 1 bins. Deterministic.
    Raises ValueError naming the first sample longer than the budget.
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be ≥ 1; got {max_tokens}")
    too_long = [(i, n) for i, n in enumerate(lengths) if n > max_tokens]
    if too_long:
        i, n = too_long[0]
        raise ValueError(
            f"sample {i} takes {n} tokens (prompt + response, each sequence padded to a multiple of "
            "2·parallel.context_parallel under context parallelism), more than "
            f"train.max_tokens_per_micro_batch={max_tokens}"
            + (f" ({len(too_long)} samples are)" if len(too_long) > 1 else "")
        )
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda k: (-lengths[k], k)):
        for b, free in enumerate(room):
            if lengths[i] <= free:
                bins[b].append(i)
                room[b] -= lengths[i]
                break
        else:
            bins.append([i])
            room.append(max_tokens - lengths[i])
    return bins


def balance_over_data_parallel(
    bins: Sequence[Sequence[int]], lengths: Sequence[int], dp_size: int
) -> list[list[list[int]]]:
    """Bins dealt to `dp_size` ranks: every rank gets the same number, ⌈len(bins)/dp⌉ (empty bins `[]`
    where there are too few, as megatron's schedule runs one micro-batch count on every rank), and the
    ranks' token totals are balanced greedily (largest bin to the least-loaded rank with a free slot).
    Each rank's bins keep the order in which it received them (largest first)."""
    if dp_size < 1:
        raise ValueError(f"dp_size must be ≥ 1; got {dp_size}")
    per_rank = max(1, -(-len(bins) // dp_size))
    tokens = [sum(lengths[i] for i in b) for b in bins]
    out: list[list[list[int]]] = [[] for _ in range(dp_size)]
    load = [0] * dp_size
    for b in sorted(range(len(bins)), key=lambda k: (-tokens[k], k)):
        rank = min((r for r in range(dp_size) if len(out[r]) < per_rank), key=lambda r: (load[r], r))
        out[rank].append(list(bins[b]))
        load[rank] += tokens[b]
    for rank_bins in out:
        rank_bins.extend([] for _ in range(per_rank - len(rank_bins)))
    return out
