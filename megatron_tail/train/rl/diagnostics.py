"""Training–inference mismatch and DVP diagnostics: per-token tensors → sum-reducible statistics → scalars.

Inputs are per-sample `[N, T]` tensors of the sampled (response) tokens, `valid` marking the real ones:
- `train_logprobs`: log π_train(a) at θ_old (the trainer's recompute; with DVP, log π^mp), float.
- `infer_logprobs`: log π_infer(a) returned by the rollout engine for the same tokens, float.
- `in_safe_set` (bool), `safe_mass` (Z, float), `safe_set_size` (|V_S|, int) from the trainer's θ_old pass.
- `entropy`: H of the trainer's policy at each position, float.

Δ = log π_infer − log π_train per sampled token (the DVP paper's sign: Δ > 0 where the engine gives the
token more probability than the trainer). Two stages, like the algorithms' metrics, so micro-batches
and DP ranks combine exactly: `*_sums` return 0-d float64 sums / counts, combined like the algorithms'
metrics (`megatron_tail.algorithms.combine_metrics`: `*_min` keys by min, the rest by sum), and
`finalize_diagnostics` turns the global sums into the logged scalars:

- `mismatch/kl_infer_train_k3`: mean of k3 = r − 1 − log r with r = π_train/π_infer over tokens sampled from
  π_infer: a non-negative-per-token estimate of KL(π_infer ‖ π_train), unbiased where π_train puts no mass
  outside what π_infer samples from (E[r] = 1: DVP, a replayed support). Where it does (`sampling_support:
  ignore` with truncation: the trainer scores the full softmax) its expectation is KL − (1 − Z), far below
  the KL; `mismatch/signed_delta` (the mean of −log r) is the unbiased estimate there.
- `mismatch/abs_delta`, `mismatch/signed_delta`: mean |Δ| and mean Δ over all sampled tokens.
- `mismatch/abs_delta/p<lo>_<hi>`, `mismatch/signed_delta/...`, `mismatch/tokens/...`: the same per bucket
  of π_train(a) (edges `prob_buckets`, descending): DVP Prop. 4.2 bounds |Δ_a| ≤ 2ε(1 − p_a), so |Δ| should
  shrink towards the head (p → 1) and stay large in the tail. `..._by_infer/...`: the same per bucket of
  π_infer(a).
- `mismatch/tail_signed_delta` (+ `mismatch/tail_tokens`): mean Δ of sampled tokens with
  π_train < `tail_prob`; DVP Prop. 4.3: sampled tail tokens have π_infer > π_train systematically, i.e. a
  positive mean. Choosing the tail by low π_train biases Δ upwards by regression to the mean even with
  unbiased noise, so `mismatch/tail_signed_delta_by_infer` (+ `tail_tokens_by_infer`) chooses it by low
  π_infer, which biases it the other way: the effect is confirmed where both are positive.
- `mismatch/tail_delta_mode` (`_by_infer`): the mode of Δ over the same tail tokens, from a fixed-bin
  histogram (`TAIL_DELTA_EDGES`, sum-reducible); `tail_delta_histograms` gives the histograms themselves for
  TensorBoard (tags `mismatch/tail_delta`, `mismatch/tail_delta_by_infer`). The mean can be moved by a few
  large |Δ|; Prop. 4.3 is about where the mass of Δ lies.
- `mismatch/logit_error_max` (ε̂) and `mismatch/above_bound_fraction/<bucket>` (DVP Prop. 4.2): with the
  engine's top-1 log-prob per position, the engine's and the trainer's raw-logit gaps of the sampled token
  to the most probable one, g = (max z − z_a)/T = log π(top) − log π(a), are compared without any logits:
  ε̂ = max over the batch's tokens of |g_infer − g_train|/2, a lower bound on the (shift-free) max logit
  error max_k |ε_k − c| of the rows it comes from. The fraction is of the bucket's tokens whose
  |Δ| > 2·ε̂·(1 − π_train(a)) (`bound_sums`, a second stage once ε̂ is global). Near 0 in every bucket is
  what the proposition predicts; ε̂ under-estimates the true ε_max, so a small positive fraction does not
  contradict it.
- `dvp/safe_set_size_mean|min`, `dvp/safe_mass_mean`, `dvp/safe_mass_min` (Z_min of Prop. 5.5 over every
  scored response position, whose bias bound R_max·T·(1 − Z_min) is `dvp/bias_bound`, with R_max the
  reward's declared bound and T = `rollout.max_new_tokens` (× `rollout.env.max_turns` with an environment),
  `dvp/out_of_safe_set_fraction` (sampled
  tokens outside the trainer's V_S).
- `policy/entropy`: mean entropy over sampled positions.
- `mismatch/truncation_bias` (truncated sampling only): mean of log π^K(a) − log π(a) = −log(mass of the
  support) by the trainer's θ_old: the per-token error of every importance log-ratio had the trainer scored
  the full softmax instead of replaying the sampler's support (with the support replayed,
  `mismatch/kl_infer_train_k3` should stay far below it; with it ignored, k3 underestimates the KL and
  `mismatch/signed_delta` is the one to read).
- `mismatch/outside_support_mass` (truncated sampling only): mean of 1 − Z_support, the trainer's θ_old mass
  outside the support each token was sampled from: what a trainer that ignores the support scores but the
  engine never samples (and so never pushes down).
A mean over no tokens is left out (a gap in TensorBoard), as `algorithms.finalize_metrics` leaves out a
ratio over nothing: an empty bucket logs its `tokens` count (0) and no means, an empty tail no tail mean or
mode, a step without scored positions no `dvp/*`. Logged as 0, an empty step read as data: a mean over
steps was pulled towards 0, and an early-warning baseline (`report.collapse.WARNING_TAGS`) counted it.
Every scalar logged is finite.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence

import torch

BY_INFER = "_by_infer"
"""Suffix of the statistics whose tail / buckets are chosen by π_infer instead of π_train."""

TAIL_DELTA_EDGES: tuple[float, ...] = tuple(round(-1.0 + 0.01 * i, 2) for i in range(201))
"""Bin edges of the tail-Δ histogram (nats): 200 bins of 0.01 over [−1, 1], plus an underflow and an
overflow bin, so the counts are exact and sum-reducible across micro-batches and ranks. A bf16 engine's
tail Δ is mostly a few hundredths of a nat, so coarser bins would put the whole mode in one bin."""


def bucket_labels(prob_buckets: Sequence[float]) -> list[str]:
    """Tag suffixes of the π_train buckets: descending edges (0.5, 1e-2) → p0.5_1, p0.01_0.5, p0_0.01."""
    edges = [1.0, *prob_buckets, 0.0]
    return [f"p{_fmt(lo)}_{_fmt(hi)}" for hi, lo in itertools.pairwise(edges)]


def _bucket_members(prob: torch.Tensor, prob_buckets: Sequence[float]):
    """`(label, [n] bool)` per bucket: probabilities in [edge_k, edge_{k-1}) (the first bucket unbounded
    above, the last below), so every token lands in exactly one."""
    edges = [math.inf, *prob_buckets, -math.inf]
    for label, hi, lo in zip(bucket_labels(prob_buckets), edges[:-1], edges[1:], strict=True):
        yield label, (prob >= lo) & (prob < hi)


def mismatch_sums(
    train_logprobs: torch.Tensor,
    infer_logprobs: torch.Tensor,
    valid: torch.Tensor,
    *,
    prob_buckets: Sequence[float],
    tail_prob: float,
    train_top_logprobs: torch.Tensor | None = None,
    infer_top_logprobs: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """Sums and counts of Δ = log π_infer − log π_train over `valid` tokens, overall and per bucket of π_train
    and of π_infer.

    Args:
        train_logprobs, infer_logprobs: `[N, T]` float (any float dtype; computed in float64).
        valid: `[N, T]` bool.
        prob_buckets: descending edges in (0, 1); bucket k holds π_train in [edge_k, edge_{k-1}) (the first
            [edge_0, 1], the last [0, edge_last)).
        tail_prob: tokens with π_train < tail_prob are 'tail' for `tail_signed_sum` (π_infer for the
            `_by_infer` twin).
        train_top_logprobs, infer_top_logprobs: `[N, T]` float, each side's log-prob of its most probable
            token at the position (both or neither); they add `logit_error_max` (ε̂, module docstring).
    Returns:
        0-d float64 tensors: tokens, abs_delta_sum, delta_sum, k3_sum, tail_tokens, tail_signed_sum,
        tail_delta_hist/<i> (counts of the tail's Δ in bin i of `TAIL_DELTA_EDGES`, 0 = underflow), and per
        bucket label L: tokens/L, abs_delta_sum/L, delta_sum/L; each of the tail and bucket keys again
        with `_by_infer` after its name (tail_tokens_by_infer, tokens_by_infer/L, ...); [logit_error_max].
    """
    _check_same_shape(train_logprobs=train_logprobs, infer_logprobs=infer_logprobs, valid=valid)
    lp_train = train_logprobs.detach().double()[valid]
    lp_infer = infer_logprobs.detach().double()[valid]
    delta = lp_infer - lp_train
    k3 = torch.expm1(-delta) + delta  # r − 1 − log r with r = π_train/π_infer = exp(−Δ)
    out = {
        "tokens": _f(delta.numel()),
        "abs_delta_sum": _f(delta.abs().sum()),
        "delta_sum": _f(delta.sum()),
        "k3_sum": _f(k3.sum()),
    }
    for suffix, prob in (("", lp_train.exp()), (BY_INFER, lp_infer.exp())):
        tail = prob < tail_prob
        out[f"tail_tokens{suffix}"] = _f(tail.sum())
        out[f"tail_signed_sum{suffix}"] = _f(delta[tail].sum())
        for i, count in enumerate(_histogram(delta[tail])):
            out[f"tail_delta_hist{suffix}/{i:03d}"] = _f(count)
        for label, member in _bucket_members(prob, prob_buckets):
            out[f"tokens{suffix}/{label}"] = _f(member.sum())
            out[f"abs_delta_sum{suffix}/{label}"] = _f(delta[member].abs().sum())
            out[f"delta_sum{suffix}/{label}"] = _f(delta[member].sum())
    if (train_top_logprobs is None) != (infer_top_logprobs is None):
        raise ValueError("train_top_logprobs and infer_top_logprobs go together: pass both or neither")
    if train_top_logprobs is not None:
        _check_same_shape(valid=valid, train_top=train_top_logprobs, infer_top=infer_top_logprobs)
        gap_train = train_top_logprobs.detach().double()[valid] - lp_train
        gap_infer = infer_top_logprobs.detach().double()[valid] - lp_infer
        error = (gap_infer - gap_train).abs() / 2
        out["logit_error_max"] = _f(error.max() if error.numel() else 0.0)
    return out


def bound_sums(
    train_logprobs: torch.Tensor,
    infer_logprobs: torch.Tensor,
    valid: torch.Tensor,
    *,
    epsilon: float,
    prob_buckets: Sequence[float],
) -> dict[str, torch.Tensor]:
    """Per π_train bucket L, `above_bound/L`: the count of `valid` tokens with |Δ| > 2·ε·(1 − π_train(a))
    (DVP Prop. 4.2 with ε = the global ε̂ of `mismatch_sums`), all `[N, T]` in; 0-d float64 out."""
    _check_same_shape(train_logprobs=train_logprobs, infer_logprobs=infer_logprobs, valid=valid)
    lp_train = train_logprobs.detach().double()[valid]
    delta = infer_logprobs.detach().double()[valid] - lp_train
    prob = lp_train.exp()
    above = delta.abs() > 2 * epsilon * (1 - prob)
    return {
        f"above_bound/{label}": _f((above & member).sum())
        for label, member in _bucket_members(prob, prob_buckets)
    }


def tail_delta_histograms(
    sums: Mapping[str, float | torch.Tensor],
) -> dict[str, tuple[list[float], list[float]]]:
    """TensorBoard tag → (upper bucket limits, counts), 202 each, of the tail-Δ histograms in the global sums.
    The underflow bin's limit is the first edge; the overflow bin's (really +inf) is written as twice the last
    edge, because TensorBoard needs finite limits."""
    out = {}
    for x in ("", BY_INFER):
        counts = _histogram_counts(sums, x)
        if counts is not None:
            limits = [*TAIL_DELTA_EDGES, 2 * TAIL_DELTA_EDGES[-1]]
            out[f"mismatch/tail_delta{x}"] = (limits, counts)
    return out


def safe_set_sums(
    valid: torch.Tensor,
    *,
    in_safe_set: torch.Tensor,
    safe_mass: torch.Tensor,
    entropy: torch.Tensor | None = None,
    safe_set_size: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """Sums / counts / minima of the DVP quantities over `valid` positions (all `[N, T]`).

    Returns 0-d float64: positions, out_of_safe_set, safe_mass_sum, safe_mass_min, [entropy_sum],
    [safe_set_size_sum, safe_set_size_min]. Minima of an empty selection are +inf (the identity of min).
    """
    _check_same_shape(valid=valid, in_safe_set=in_safe_set, safe_mass=safe_mass)
    mass = safe_mass.detach().double()[valid]
    out = {
        "positions": _f(mass.numel()),
        "out_of_safe_set": _f((~in_safe_set[valid]).sum()),
        "safe_mass_sum": _f(mass.sum()),
        "safe_mass_min": _f(mass.min() if mass.numel() else math.inf),
    }
    if entropy is not None:
        _check_same_shape(valid=valid, entropy=entropy)
        out["entropy_sum"] = _f(entropy.detach().double()[valid].sum())
    if safe_set_size is not None:
        _check_same_shape(valid=valid, safe_set_size=safe_set_size)
        size = safe_set_size.detach().double()[valid]
        out["safe_set_size_sum"] = _f(size.sum())
        out["safe_set_size_min"] = _f(size.min() if size.numel() else math.inf)
    return out


def finalize_diagnostics(
    sums: Mapping[str, float | torch.Tensor],
    *,
    prob_buckets: Sequence[float],
    max_reward: float = 1.0,
    max_response_len: int = 1,
) -> dict[str, float]:
    """Global sums (of `mismatch_sums` + `safe_set_sums`, combined) → TensorBoard scalars (module docstring).

    `max_reward` (R_max) and `max_response_len` (T) scale `dvp/bias_bound` = R_max · T · (1 − Z_min).
    """
    s = {k: float(v) for k, v in sums.items()}
    out: dict[str, float] = {}
    if "tokens" in s:
        n = s["tokens"]
        _put_mean(out, "mismatch/kl_infer_train_k3", s["k3_sum"], n)
        _put_mean(out, "mismatch/abs_delta", s["abs_delta_sum"], n)
        _put_mean(out, "mismatch/signed_delta", s["delta_sum"], n)
        for x in ("", BY_INFER):
            _put_mean(out, f"mismatch/tail_signed_delta{x}", s[f"tail_signed_sum{x}"], s[f"tail_tokens{x}"])
            out[f"mismatch/tail_tokens{x}"] = s[f"tail_tokens{x}"]
            counts = _histogram_counts(s, x)
            if counts is not None and any(counts):
                out[f"mismatch/tail_delta_mode{x}"] = _mode(counts)
            for label in bucket_labels(prob_buckets):
                count = s[f"tokens{x}/{label}"]
                out[f"mismatch/tokens{x}/{label}"] = count
                _put_mean(out, f"mismatch/abs_delta{x}/{label}", s[f"abs_delta_sum{x}/{label}"], count)
                _put_mean(out, f"mismatch/signed_delta{x}/{label}", s[f"delta_sum{x}/{label}"], count)
    if "truncation_bias_sum" in s:
        n = s.get("tokens", 0.0)
        _put_mean(out, "mismatch/truncation_bias", s["truncation_bias_sum"], n)
        _put_mean(out, "mismatch/outside_support_mass", s["outside_support_mass_sum"], n)
    if "logit_error_max" in s:
        out["mismatch/logit_error_max"] = s["logit_error_max"]
        for label in bucket_labels(prob_buckets):
            above = s.get(f"above_bound/{label}")
            if above is not None:
                _put_mean(out, f"mismatch/above_bound_fraction/{label}", above, s[f"tokens/{label}"])
    if s.get("positions", 0.0) > 0:
        n = s["positions"]
        z_min = s["safe_mass_min"]
        _put_mean(out, "dvp/out_of_safe_set_fraction", s["out_of_safe_set"], n)
        _put_mean(out, "dvp/safe_mass_mean", s["safe_mass_sum"], n)
        out["dvp/safe_mass_min"] = z_min
        out["dvp/bias_bound"] = abs(max_reward) * max_response_len * (1.0 - z_min)
        if "entropy_sum" in s:
            _put_mean(out, "policy/entropy", s["entropy_sum"], n)
        if "safe_set_size_sum" in s:
            _put_mean(out, "dvp/safe_set_size_mean", s["safe_set_size_sum"], n)
            out["dvp/safe_set_size_min"] = s["safe_set_size_min"]
    return out


def _histogram(values: torch.Tensor) -> list[float]:
    """Counts of `values` in the bins of `TAIL_DELTA_EDGES`: underflow, the 200 bins, overflow (202)."""
    edges = torch.tensor(TAIL_DELTA_EDGES, dtype=values.dtype, device=values.device)
    index = torch.bucketize(values, edges, right=True)  # 0: below the first edge; 201: at/above the last
    return torch.bincount(index, minlength=len(TAIL_DELTA_EDGES) + 1).tolist()


def _histogram_counts(sums: Mapping[str, float | torch.Tensor], suffix: str) -> list[float] | None:
    keys = [f"tail_delta_hist{suffix}/{i:03d}" for i in range(len(TAIL_DELTA_EDGES) + 1)]
    if keys[0] not in sums:
        return None
    return [float(sums[k]) for k in keys]


def _mode(counts: Sequence[float]) -> float:
    """Centre of the fullest bin (the edge for the under/overflow bins) of a histogram with counts."""
    i = max(range(len(counts)), key=lambda k: counts[k])  # first fullest bin on ties
    edges = TAIL_DELTA_EDGES
    if i == 0:
        return edges[0]
    if i == len(edges):
        return edges[-1]
    return (edges[i - 1] + edges[i]) / 2


def masked_sum(values: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """0-d float64 sum of `values` over the `valid` positions (both `[N, T]`)."""
    _check_same_shape(values=values, valid=valid)
    return _f(values.detach().double()[valid].sum())


def _put_mean(out: dict[str, float], key: str, total: float, count: float) -> None:
    """`out[key] = total / count`, or nothing over no tokens (module docstring)."""
    if count > 0:
        out[key] = total / count


def _f(value) -> torch.Tensor:
    return torch.as_tensor(value, dtype=torch.float64).detach().reshape(())


def _fmt(p: float) -> str:
    return f"{p:g}"


def _check_same_shape(**tensors: torch.Tensor) -> None:
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    if len(set(shapes.values())) != 1:
        raise ValueError(f"per-token tensors must share one shape [N, T]; got {shapes}")
    for name, t in tensors.items():
        if name in ("valid", "in_safe_set") and t.dtype != torch.bool:
            raise ValueError(f"{name} must be a bool tensor; got {t.dtype}")
