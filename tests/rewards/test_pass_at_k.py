"""pass@k against its definition by enumeration: the fraction of all k-subsets of the n samples that hold a
correct one; and the exact binomial formula."""

from __future__ import annotations

import itertools
import math

import pytest

from megatron_tail.rewards.pass_at_k import default_ks, eval_statistics, pass_at_k


@pytest.mark.parametrize("n", [1, 2, 5, 8])
def test_pass_at_k_is_the_fraction_of_k_subsets_with_a_correct_sample(n):
    for c in range(n + 1):
        samples = [True] * c + [False] * (n - c)
        for k in range(1, n + 1):
            subsets = list(itertools.combinations(samples, k))
            want = sum(any(s) for s in subsets) / len(subsets)
            assert pass_at_k(n, c, k) == pytest.approx(want, abs=1e-12), (n, c, k)


def test_large_n_matches_the_binomial_formula_and_stays_in_range():
    for n, c, k in [(200, 3, 10), (200, 150, 64), (1000, 1, 1)]:
        want = 1 - math.comb(n - c, k) / math.comb(n, k)
        assert pass_at_k(n, c, k) == pytest.approx(want, rel=1e-12)
    assert pass_at_k(1000, 0, 512) == 0.0 and pass_at_k(10, 9, 2) == 1.0


def test_statistics_average_over_prompts():
    rows = [[True, False, False, False], [False, False, False, False], [True, True, True, True]]
    got = eval_statistics(rows)
    assert set(got) == {"pass@1", "pass@2", "pass@4", "mean@4"}
    assert got["pass@1"] == pytest.approx((0.25 + 0 + 1) / 3) == got["mean@4"]
    assert got["pass@2"] == pytest.approx((0.5 + 0 + 1) / 3)
    assert got["pass@4"] == pytest.approx((1 + 0 + 1) / 3)
    assert default_ks(6) == [1, 2, 4, 6] and default_ks(1) == [1]


@pytest.mark.parametrize(
    ("args", "message"),
    [((4, 5, 1), r"0 ≤ c ≤ n and 1 ≤ k ≤ n; got n=4, c=5, k=1"), ((4, 1, 0), r"got n=4, c=1, k=0")],
)
def test_bad_counts_name_the_values(args, message):
    with pytest.raises(ValueError, match=message):
        pass_at_k(*args)
    with pytest.raises(ValueError, match=r"same number ≥ 1 of samples each; got \[2, 1\]"):
        eval_statistics([[True, False], [True]])
