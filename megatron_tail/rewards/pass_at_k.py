"""Evaluation statistics over n samples per prompt: the unbiased pass@k estimator (Chen et al. 2021,
arXiv 2107.03374) and mean@n.

    pass_at_k(n=8, c=3, k=4)     # P(a random 4 of the 8 samples contain a correct one) = 1 − C(5,4)/C(8,4)
    eval_statistics([[True, False, ...], ...], ks=(1, 2, 4, 8))   # averaged over prompts
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence


def pass_at_k(n: int, c: int, k: int) -> float:
    """1 − C(n − c, k) / C(n, k): the chance that k of the n samples, drawn without replacement, include one
    of the c correct ones. Computed as 1 − Π_{i=n−c+1}^{n} (1 − k/i), stable for large n."""
    if (
        not (isinstance(n, int) and isinstance(c, int) and isinstance(k, int))
        or not 0 <= c <= n
        or not 1 <= k <= n
    ):
        raise ValueError(f"pass@k needs ints 0 ≤ c ≤ n and 1 ≤ k ≤ n; got n={n!r}, c={c!r}, k={k!r}")
    if n - c < k:
        return 1.0
    miss = 1.0
    for i in range(n - c + 1, n + 1):
        miss *= 1.0 - k / i
    return 1.0 - miss


def default_ks(n: int) -> list[int]:
    """The k of pass@k to report for n samples: 1, 2, 4, ... below n, and n."""
    ks, k = [], 1
    while k < n:
        ks.append(k)
        k *= 2
    return [*ks, n]


def eval_statistics(correct: Iterable[Sequence[bool]], ks: Sequence[int] | None = None) -> dict[str, float]:
    """Per prompt a list of its n samples' correctness (n equal for all) → `pass@k` for each k (default
    `default_ks(n)`) and `mean@n` (the mean accuracy over all samples), averaged over prompts."""
    rows = [list(map(bool, r)) for r in correct]
    if not rows or len({len(r) for r in rows}) != 1 or not rows[0]:
        raise ValueError(
            f"need ≥ 1 prompt with the same number ≥ 1 of samples each; got {[len(r) for r in rows]}"
        )
    n = len(rows[0])
    out = {}
    for k in ks or default_ks(n):
        out[f"pass@{k}"] = sum(pass_at_k(n, sum(r), k) for r in rows) / len(rows)
    out[f"mean@{n}"] = sum(sum(r) for r in rows) / (n * len(rows))
    return out
