"""Mismatch / DVP diagnostics against float64 references written token by token, and the k3 estimator
against the exact KL of a categorical distribution."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_tail.algorithms import combine_metrics
from megatron_tail.train.rl import diagnostics

BUCKETS = (0.5, 1e-2, 1e-4)


def _random_tokens(seed: int, n: int = 5, t: int = 7):
    g = torch.Generator().manual_seed(seed)
    # log-probs in every bucket, cycling: log p uniform in [-0.69, 0], [-4.6, -0.69], [-9.2, -4.6], ...
    ranges = torch.tensor([[-0.69, 0.0], [-4.6, -0.69], [-9.2, -4.6], [-14.0, -9.2]], dtype=torch.float64)
    which = torch.arange(n * t).reshape(n, t) % 4
    lo, hi = ranges[which, 0], ranges[which, 1]
    train = lo + (hi - lo) * torch.rand(n, t, generator=g, dtype=torch.float64)
    infer = train + 0.3 * torch.randn(n, t, generator=g, dtype=torch.float64)
    infer = infer.clamp(max=0.0)
    valid = torch.rand(n, t, generator=g) < 0.8
    valid[0] = False  # an empty row
    in_safe = torch.rand(n, t, generator=g) < 0.9
    mass = 1.0 - 0.01 * torch.rand(n, t, generator=g, dtype=torch.float64)
    entropy = torch.rand(n, t, generator=g, dtype=torch.float64) * 3
    size = torch.randint(1, 50, (n, t), generator=g)
    # garbage at invalid positions must not leak in
    train[~valid] = float("nan")
    return train, infer, valid, in_safe, mass, entropy, size


def _reference(train, infer, valid, in_safe, mass, entropy, size, tail_prob):
    rows = [
        (float(train[i, j]), float(infer[i, j]), bool(in_safe[i, j]), float(mass[i, j]), float(entropy[i, j]),
         int(size[i, j]))
        for i in range(train.shape[0]) for j in range(train.shape[1]) if valid[i, j]
    ]  # fmt: skip
    deltas = [b - a for a, b, *_ in rows]  # log π_infer − log π_train, the paper's sign
    n = len(rows)
    ref = {
        # r = π_train / π_infer = e^{−Δ}: r − 1 − log r
        "mismatch/kl_infer_train_k3": sum(math.exp(-d) - 1 + d for d in deltas) / n,
        "mismatch/abs_delta": sum(abs(d) for d in deltas) / n,
        "mismatch/signed_delta": sum(deltas) / n,
        "dvp/out_of_safe_set_fraction": sum(not r[2] for r in rows) / n,
        "dvp/safe_mass_mean": sum(r[3] for r in rows) / n,
        "dvp/safe_mass_min": min(r[3] for r in rows),
        "policy/entropy": sum(r[4] for r in rows) / n,
        "dvp/safe_set_size_mean": sum(r[5] for r in rows) / n,
        "dvp/safe_set_size_min": min(r[5] for r in rows),
    }
    edges = [
        (0.5, 2.0, "p0.5_1"),
        (1e-2, 0.5, "p0.01_0.5"),
        (1e-4, 1e-2, "p0.0001_0.01"),
        (-1, 1e-4, "p0_0.0001"),
    ]
    for suffix, side in (("", 0), ("_by_infer", 1)):  # buckets and tail by π_train, then by π_infer
        probs = [math.exp(r[side]) for r in rows]
        tail = [d for d, p in zip(deltas, probs, strict=True) if p < tail_prob]
        ref[f"mismatch/tail_tokens{suffix}"] = len(tail)
        ref[f"mismatch/tail_signed_delta{suffix}"] = sum(tail) / len(tail) if tail else 0.0
        for lo, hi, label in edges:
            member = [d for d, p in zip(deltas, probs, strict=True) if lo <= p < hi]
            ref[f"mismatch/tokens{suffix}/{label}"] = len(member)
            ref[f"mismatch/abs_delta{suffix}/{label}"] = (
                sum(abs(d) for d in member) / len(member) if member else 0.0
            )
            ref[f"mismatch/signed_delta{suffix}/{label}"] = sum(member) / len(member) if member else 0.0
    return ref


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_diagnostics_match_token_by_token_reference(seed):
    train, infer, valid, in_safe, mass, entropy, size = _random_tokens(seed)
    sums = diagnostics.mismatch_sums(train, infer, valid, prob_buckets=BUCKETS, tail_prob=1e-2)
    sums.update(
        diagnostics.safe_set_sums(
            valid, in_safe_set=in_safe, safe_mass=mass, entropy=entropy, safe_set_size=size
        )
    )
    got = diagnostics.finalize_diagnostics(sums, prob_buckets=BUCKETS, max_reward=2.0, max_response_len=7)
    ref = _reference(train, infer, valid, in_safe, mass, entropy, size, 1e-2)
    for key, value in ref.items():
        assert got[key] == pytest.approx(value, rel=1e-12, abs=1e-12), key
    assert got["dvp/bias_bound"] == pytest.approx(2.0 * 7 * (1 - ref["dvp/safe_mass_min"]), rel=1e-12)
    assert all(math.isfinite(v) for v in got.values())
    # every bucket is populated by this data, so the test really checks each one
    assert all(got[f"mismatch/tokens/{label}"] > 0 for label in diagnostics.bucket_labels(BUCKETS))


def test_split_into_pieces_combines_to_the_whole():
    train, infer, valid, in_safe, mass, _, size = _random_tokens(5, n=8)

    def sums(sl):
        s = diagnostics.mismatch_sums(train[sl], infer[sl], valid[sl], prob_buckets=BUCKETS, tail_prob=1e-2)
        s.update(
            diagnostics.safe_set_sums(
                valid[sl], in_safe_set=in_safe[sl], safe_mass=mass[sl], safe_set_size=size[sl]
            )
        )
        return s

    whole = diagnostics.finalize_diagnostics(sums(slice(None)), prob_buckets=BUCKETS)
    combined = combine_metrics([sums(slice(0, 3)), sums(slice(3, 4)), sums(slice(4, 8))])
    parts = diagnostics.finalize_diagnostics(combined, prob_buckets=BUCKETS)
    assert parts.keys() == whole.keys()
    for key in whole:
        assert parts[key] == pytest.approx(whole[key], rel=1e-12, abs=1e-15), key


def test_a_mean_over_no_tokens_is_left_out_and_every_logged_value_is_finite():
    """An empty bucket logs its count (0) and no mean; an empty tail no tail mean or mode; a step without
    scored positions no dvp/*. A 0 there read as data: a plain mean over steps, an early-warning baseline."""
    lp = torch.full((2, 3), -0.1)  # every token in the head bucket
    valid = torch.ones(2, 3, dtype=torch.bool)
    got = diagnostics.finalize_diagnostics(
        diagnostics.mismatch_sums(lp, lp - 0.25, valid, prob_buckets=BUCKETS, tail_prob=1e-2),
        prob_buckets=BUCKETS,
    )
    assert got["mismatch/tokens/p0.5_1"] == 6 and got["mismatch/tokens/p0_0.0001"] == 0
    assert got["mismatch/abs_delta/p0.5_1"] == pytest.approx(0.25)
    assert "mismatch/abs_delta/p0_0.0001" not in got and "mismatch/signed_delta/p0_0.0001" not in got
    assert got["mismatch/tail_tokens"] == 0 and "mismatch/tail_signed_delta" not in got
    assert "mismatch/tail_delta_mode" not in got
    none = torch.zeros(2, 3, dtype=torch.bool)
    s = diagnostics.safe_set_sums(
        none, in_safe_set=valid, safe_mass=torch.ones(2, 3), safe_set_size=torch.ones(2, 3)
    )
    s.update(diagnostics.mismatch_sums(lp, lp, none, prob_buckets=BUCKETS, tail_prob=1e-2))
    got = diagnostics.finalize_diagnostics(s, prob_buckets=BUCKETS)
    assert not [k for k in got if k.startswith("dvp/")]
    assert "mismatch/abs_delta" not in got and "mismatch/kl_infer_train_k3" not in got
    assert got["mismatch/tokens/p0.5_1"] == 0
    assert all(math.isfinite(v) for v in got.values())


def test_k3_estimates_kl_infer_to_train_on_samples_from_infer():
    """Tokens sampled from q = π_infer: mean k3 with r = p/q → KL(q ‖ p) (and not KL(p ‖ q))."""
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(50, generator=g, dtype=torch.float64) * 2, dim=0)  # train
    q = torch.softmax(torch.log(p) + 1.5 * torch.randn(50, generator=g, dtype=torch.float64), dim=0)  # infer
    tokens = torch.multinomial(q, 200_000, replacement=True, generator=g)
    train_lp, infer_lp = torch.log(p)[tokens][None], torch.log(q)[tokens][None]
    valid = torch.ones_like(train_lp, dtype=torch.bool)
    got = diagnostics.finalize_diagnostics(
        diagnostics.mismatch_sums(train_lp, infer_lp, valid, prob_buckets=BUCKETS, tail_prob=1e-2),
        prob_buckets=BUCKETS,
    )["mismatch/kl_infer_train_k3"]
    kl_q_p = float((q * (q.log() - p.log())).sum())
    kl_p_q = float((p * (p.log() - q.log())).sum())
    assert got == pytest.approx(kl_q_p, rel=0.03)
    assert abs(kl_p_q - kl_q_p) > 0.1 * kl_q_p  # the two directions really differ here


def test_shape_and_dtype_errors():
    lp = torch.zeros(2, 3)
    with pytest.raises(ValueError, match=r"share one shape"):
        diagnostics.mismatch_sums(
            lp, torch.zeros(2, 4), torch.ones(2, 3, dtype=torch.bool), prob_buckets=BUCKETS, tail_prob=0.1
        )
    with pytest.raises(ValueError, match=r"valid must be a bool tensor"):
        diagnostics.mismatch_sums(lp, lp, torch.ones(2, 3), prob_buckets=BUCKETS, tail_prob=0.1)


def test_bucket_labels():
    assert diagnostics.bucket_labels((0.5, 1e-2, 1e-4)) == [
        "p0.5_1",
        "p0.01_0.5",
        "p0.0001_0.01",
        "p0_0.0001",
    ]


def _tail_histogram_reference(train, infer, valid, tail_prob, by_infer):
    edges = diagnostics.TAIL_DELTA_EDGES
    counts = [0] * (len(edges) + 1)
    for i, j in zip(*torch.nonzero(valid, as_tuple=True), strict=True):
        lp_t, lp_i = float(train[i, j]), float(infer[i, j])
        if math.exp(lp_i if by_infer else lp_t) >= tail_prob:
            continue
        d = lp_i - lp_t
        k = sum(1 for e in edges if e <= d)  # 0: below the first edge; len(edges): at/above the last
        counts[k] += 1
    return counts


@pytest.mark.parametrize("seed", [0, 1])
def test_tail_delta_histogram_and_mode_match_a_token_by_token_count(seed):
    train, infer, valid, *_ = _random_tokens(seed, n=40, t=30)
    g = torch.Generator().manual_seed(100 + seed)
    noise = 0.05 * torch.randn(train.shape, generator=g, dtype=torch.float64)
    infer = torch.where(valid, train + 0.4 + noise, infer)
    sums = diagnostics.mismatch_sums(train, infer, valid, prob_buckets=BUCKETS, tail_prob=1e-2)
    got = diagnostics.finalize_diagnostics(sums, prob_buckets=BUCKETS)
    hists = diagnostics.tail_delta_histograms(sums)
    edges = diagnostics.TAIL_DELTA_EDGES
    for x, by_infer in (("", False), ("_by_infer", True)):
        ref = _tail_histogram_reference(train, infer, valid, 1e-2, by_infer)
        limits, counts = hists[f"mismatch/tail_delta{x}"]
        assert counts == ref
        assert sum(counts) == got[f"mismatch/tail_tokens{x}"] > 50
        assert len(limits) == len(counts) and limits[: len(edges)] == list(edges)
        fullest = max(range(len(ref)), key=lambda k: ref[k])
        assert 0 < fullest < len(edges)
        assert got[f"mismatch/tail_delta_mode{x}"] == pytest.approx((edges[fullest - 1] + edges[fullest]) / 2)
    # Δ was shifted by +0.4 (± 0.05): the mode sees it
    assert 0.3 < got["mismatch/tail_delta_mode"] < 0.5


def test_tail_delta_mode_of_an_empty_tail_is_not_logged_and_out_of_range_values_land_in_the_end_bins():
    train = torch.log(torch.tensor([[1e-3, 1e-3, 1e-3, 0.9]], dtype=torch.float64))
    infer = train + torch.tensor([[5.0, 5.0, -3.0, 0.0]], dtype=torch.float64)
    infer = infer.clamp(max=0.0)
    valid = torch.ones(1, 4, dtype=torch.bool)
    sums = diagnostics.mismatch_sums(train, infer, valid, prob_buckets=BUCKETS, tail_prob=1e-2)
    counts = diagnostics.tail_delta_histograms(sums)["mismatch/tail_delta"][1]
    assert counts[0] == 1 and counts[-1] == 2 and sum(counts) == 3
    got = diagnostics.finalize_diagnostics(sums, prob_buckets=BUCKETS)
    assert got["mismatch/tail_delta_mode"] == diagnostics.TAIL_DELTA_EDGES[-1]
    empty = diagnostics.mismatch_sums(train, infer, valid & False, prob_buckets=BUCKETS, tail_prob=1e-2)
    assert "mismatch/tail_delta_mode" not in diagnostics.finalize_diagnostics(empty, prob_buckets=BUCKETS)


def _engine_and_trainer(seed: int, rows: int = 200, vocab: int = 50, noise: float = 0.05):
    """Float64 logits of a 'trainer' and of an 'engine' = trainer + bounded per-logit errors, a token sampled
    from the engine per row, and each side's log-probs (sampled token, top token) at T = 0.7."""
    g = torch.Generator().manual_seed(seed)
    temperature = 0.7
    x = 3 * torch.randn(rows, vocab, generator=g, dtype=torch.float64)
    eps = noise * (2 * torch.rand(rows, vocab, generator=g, dtype=torch.float64) - 1)
    x_infer = x + eps
    lp = torch.log_softmax(x / temperature, dim=-1)
    lp_infer = torch.log_softmax(x_infer / temperature, dim=-1)
    tokens = torch.multinomial(lp_infer.exp(), 1, generator=g).squeeze(1)
    r = torch.arange(rows)
    return {
        "x": x,
        "x_infer": x_infer,
        "eps": eps,
        "temperature": temperature,
        "tokens": tokens,
        "train": lp[r, tokens][None],
        "infer": lp_infer[r, tokens][None],
        "train_top": lp.max(dim=-1).values[None],
        "infer_top": lp_infer.max(dim=-1).values[None],
    }


@pytest.mark.parametrize("seed", [0, 1])
def test_logit_error_and_prop_4_2_fraction_match_the_logits(seed):
    d = _engine_and_trainer(seed)
    valid = torch.ones_like(d["train"], dtype=torch.bool)
    sums = diagnostics.mismatch_sums(
        d["train"],
        d["infer"],
        valid,
        prob_buckets=BUCKETS,
        tail_prob=1e-2,
        train_top_logprobs=d["train_top"],
        infer_top_logprobs=d["infer_top"],
    )
    # ε̂ from the raw logits: half the change of the sampled token's gap to the row max, in units of x/T
    r = torch.arange(d["x"].shape[0])
    gap = d["x"].max(dim=1).values - d["x"][r, d["tokens"]]
    gap_infer = d["x_infer"].max(dim=1).values - d["x_infer"][r, d["tokens"]]
    eps_hat = float(((gap_infer - gap).abs() / 2 / d["temperature"]).max())
    assert float(sums["logit_error_max"]) == pytest.approx(eps_hat, rel=1e-9)
    # a lower bound on the true shift-free max logit error (half the spread of ε/T per row)
    spread = (d["eps"].max(dim=1).values - d["eps"].min(dim=1).values) / 2 / d["temperature"]
    assert eps_hat <= float(spread.max()) + 1e-12
    # Prop. 4.2 itself: with each row's true error, no token exceeds the bound
    delta = (d["infer"] - d["train"])[0]
    p = d["train"][0].exp()
    assert bool((delta.abs() <= 2 * spread * (1 - p) + 1e-12).all())
    # the fraction with ε̂, counted token by token
    sums.update(diagnostics.bound_sums(d["train"], d["infer"], valid, epsilon=eps_hat, prob_buckets=BUCKETS))
    got = diagnostics.finalize_diagnostics(sums, prob_buckets=BUCKETS)
    assert got["mismatch/logit_error_max"] == pytest.approx(eps_hat, rel=1e-9)
    edges = [1.0, *BUCKETS, 0.0]
    checked = 0
    for k, label in enumerate(diagnostics.bucket_labels(BUCKETS)):
        hi, lo = edges[k], edges[k + 1]
        member = [
            (abs(float(dl)), float(pp))
            for dl, pp in zip(delta, p, strict=True)
            if lo <= pp < hi or (k == 0 and pp == 1.0)
        ]
        above = sum(1 for dl, pp in member if dl > 2 * eps_hat * (1 - pp))
        if not member:  # a fraction of no tokens is not logged
            assert f"mismatch/above_bound_fraction/{label}" not in got, label
            continue
        assert got[f"mismatch/above_bound_fraction/{label}"] == pytest.approx(above / len(member), abs=1e-12)
        checked += bool(member)
    assert checked >= 3


def test_top_logprobs_go_together():
    lp = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="both or neither"):
        diagnostics.mismatch_sums(
            lp,
            lp,
            torch.ones(1, 2, dtype=torch.bool),
            prob_buckets=BUCKETS,
            tail_prob=0.1,
            train_top_logprobs=lp,
        )
