"""Hand-written float64 references for `megatron_tail.algorithms`, written from the formulas, not the code.

Scalar loops over Python floats (or float64 scalar tensors where a gradient is needed), so they share no
vectorised code path with the implementation. Sizes in the tests are small enough for this to be fast.
"""

from __future__ import annotations

import math

import numpy as np
import torch

# ---------------------------------------------------------------- advantages


def ref_grpo(rewards: list[float], n: int, scale_by_std: bool = True, eps: float = 1e-6) -> list[float]:
    out = []
    for g in range(len(rewards) // n):
        group = rewards[g * n : (g + 1) * n]
        if max(group) == min(group):
            out += [0.0] * n
            continue
        mean = sum(group) / n
        std = math.sqrt(sum((r - mean) ** 2 for r in group) / (n - 1))
        out += [(r - mean) / (std + eps) if scale_by_std else r - mean for r in group]
    return out


def ref_rloo(rewards: list[float], n: int) -> list[float]:
    out = []
    for g in range(len(rewards) // n):
        group = rewards[g * n : (g + 1) * n]
        if n == 1 or max(group) == min(group):
            out += [0.0] * n
            continue
        out += [group[i] - sum(group[j] for j in range(n) if j != i) / (n - 1) for i in range(n)]
    return out


# ---------------------------------------------------------------- importance weights


def _apply_mode(w: float, mode: str, cap: float, lo: float, hi: float) -> float:
    if mode == "none":
        return 0.0 if w == 0.0 else 1.0
    if mode == "tis":
        return min(w, cap)
    return w if lo <= w <= hi else 0.0


def ref_importance(old, roll, valid, safe, *, mode, level, cap, lo, hi, veto):
    """Lists of lists in, (weights [B][T], vetoed [B]) out."""
    B, T = len(old), len(old[0])
    weights = [[0.0] * T for _ in range(B)]
    vetoed = []
    for b in range(B):
        logw = [(old[b][t] - roll[b][t]) if (safe is None or safe[b][t]) else -math.inf for t in range(T)]
        ts = [t for t in range(T) if valid[b][t]]
        raw = [math.exp(logw[t]) for t in ts]  # exp(-inf) = 0
        is_vetoed = veto > 0 and any(w < veto for w in raw)
        vetoed.append(is_vetoed)
        if is_vetoed:
            continue
        if level == "token" or mode == "none":
            for t in ts:
                weights[b][t] = _apply_mode(math.exp(logw[t]), mode, cap, lo, hi)
            continue
        s = sum(logw[t] for t in ts)
        if level == "sequence_geomean" and ts:
            s = s / len(ts)
        seq_w = _apply_mode(math.exp(s) if s < 700 else math.inf, mode, cap, lo, hi)
        for t in ts:
            weights[b][t] = seq_w
    return weights, vetoed


# ---------------------------------------------------------------- token masks


def ref_quantile(values: list[float], q: float) -> float:
    return float(np.quantile(np.asarray(values, dtype=np.float64), q))  # numpy's default "linear"


def ref_stapo(adv, probs, ent, valid, tau_p, tau_h, q):
    B, T = len(adv), len(adv[0])
    if tau_h is None:
        vals = [ent[b][t] for b in range(B) for t in range(T) if valid[b][t]]
        tau_h = ref_quantile(vals, q) if vals else -math.inf
    return [
        [bool(valid[b][t] and adv[b][t] > 0 and probs[b][t] < tau_p and ent[b][t] < tau_h) for t in range(T)]
        for b in range(B)
    ]


# ---------------------------------------------------------------- PPO, KL, aggregation (scalar)


def _f(x) -> float:
    return float(x.detach()) if isinstance(x, torch.Tensor) else float(x)


def ref_ppo(lp, old, a, eps_low, eps_high, dual):
    """One token; `lp` a float or a 0-d float64 tensor (for gradients). Returns (loss, clipped, dual)."""
    exp = torch.exp if isinstance(lp, torch.Tensor) else math.exp
    r = exp(lp - old)
    unclipped = r * a
    rc = min(max(_f(r), 1 - eps_low), 1 + eps_high)
    clipped_val = rc * a
    if clipped_val < _f(unclipped):
        loss, clipped = -clipped_val + 0 * r, True  # constant w.r.t. lp
    else:
        loss, clipped = -unclipped, False
    is_dual = False
    if dual is not None and a < 0 and _f(loss) > -dual * a:
        loss, is_dual = -dual * a + 0 * r, True
    return loss, clipped, is_dual


def ref_kl(lp, ref, estimator):
    exp = torch.exp if isinstance(lp, torch.Tensor) else math.exp
    d = lp - ref
    return d if estimator == "k1" else exp(-d) - 1 + d


def ref_aggregate(tok, mask, mode, n_tokens, n_seqs, max_len):
    """tok: [B][T] of scalars (floats or 0-d tensors); mask [B][T] bool."""
    total = 0.0
    if mode == "token_mean":
        for b, row in enumerate(tok):
            for t, v in enumerate(row):
                if mask[b][t]:
                    total = total + v
        return total / max(n_tokens, 1)
    if mode == "seq_mean_token_mean":
        for b, row in enumerate(tok):
            n_b = sum(mask[b])
            if n_b:
                total = total + sum((v for t, v in enumerate(row) if mask[b][t]), 0.0) / n_b
        return total / max(n_seqs, 1)
    for b, row in enumerate(tok):
        for t, v in enumerate(row):
            if mask[b][t]:
                total = total + v
    return total / (max(n_seqs, 1) * max_len)


# ---------------------------------------------------------------- the composed loss


def ref_loss(cfg, d: dict, *, phase: int = 0, tau_h=None, counts=None):
    """The whole objective from the issue's formulas. `d` holds float64 tensors `[B, T]` (advantages `[B]`);
    d["logprobs"] may require grad. Returns (loss 0-d tensor, info dict of lists)."""
    lp_t = d["logprobs"]
    old, roll = d["old_logprobs"].tolist(), d["rollout_logprobs"].tolist()
    valid = d["valid"].tolist()
    B, T = len(old), len(old[0])
    old_safe = d["old_in_safe_set"].tolist() if d.get("old_in_safe_set") is not None else None
    safe = d["in_safe_set"].tolist() if d.get("in_safe_set") is not None else None
    ref_lp = d["ref_logprobs"].tolist() if d.get("ref_logprobs") is not None else None
    adv_seq = d["advantages"].tolist()

    adv = [[adv_seq[b] if valid[b][t] else 0.0 for t in range(T)] for b in range(B)]
    if cfg.advantage_reweighting:
        adv = [
            [(cfg.ar_alpha * math.exp(old[b][t]) + 1 - cfg.ar_alpha) * adv[b][t] for t in range(T)]
            for b in range(B)
        ]
    spur = [[False] * T for _ in range(B)]
    if cfg.stapo:
        probs = [[math.exp(x) for x in row] for row in old]
        th = tau_h if tau_h is not None else cfg.stapo_tau_h
        spur = ref_stapo(
            adv, probs, d["old_entropy"].tolist(), valid, cfg.stapo_tau_p, th, cfg.stapo_tau_h_quantile
        )
    lm = [[valid[b][t] and not spur[b][t] for t in range(T)] for b in range(B)]
    weights, vetoed = ref_importance(
        old, roll, valid, old_safe, mode=cfg.is_mode, level=cfg.is_level, cap=cfg.tis_cap,
        lo=cfg.mis_low, hi=cfg.mis_high, veto=cfg.veto_threshold,
    )  # fmt: skip
    if cfg.lopti:
        low = [[lm[b][t] and math.exp(old[b][t]) < cfg.lopti_eta for t in range(T)] for b in range(B)]
        high = [[lm[b][t] and not low[b][t] for t in range(T)] for b in range(B)]
        order = [high, low] if cfg.lopti_reverse else [low, high]
        pmask = order[phase]
    else:
        pmask = lm
    # the normalisers count the loss mask, minus the rejected (weight-0) tokens unless asked to keep them
    cm = (
        lm
        if cfg.rejected_in_denominator
        else [[lm[b][t] and weights[b][t] > 0 for t in range(T)] for b in range(B)]
    )
    n_tokens = sum(sum(r) for r in cm) if counts is None else counts[0]
    n_seqs = sum(any(r) for r in cm) if counts is None else counts[1]

    tok = [[0.0] * T for _ in range(B)]
    contrib = [[False] * T for _ in range(B)]
    clipped = 0
    for b in range(B):
        for t in range(T):
            ok = lm[b][t] and pmask[b][t] and weights[b][t] > 0 and (safe is None or safe[b][t])
            if not ok:
                continue
            contrib[b][t] = True
            loss_t, c, _ = ref_ppo(
                lp_t[b, t], old[b][t], adv[b][t], cfg.clip_eps_low, cfg.clip_eps_high, cfg.dual_clip
            )
            clipped += c
            if cfg.kl_coef > 0:
                loss_t = loss_t + cfg.kl_coef * ref_kl(lp_t[b, t], ref_lp[b][t], cfg.kl_estimator)
            tok[b][t] = weights[b][t] * loss_t
    loss = ref_aggregate(tok, cm, cfg.loss_aggregation, n_tokens, n_seqs, cfg.loss_max_len)
    if cfg.entropy_coef > 0:  # −β_H·H on the contributing tokens, aggregated alike, not IS-weighted
        ent = d["entropy"]
        bonus = [
            [-cfg.entropy_coef * ent[b, t] if contrib[b][t] else 0.0 for t in range(T)] for b in range(B)
        ]
        loss = loss + ref_aggregate(bonus, cm, cfg.loss_aggregation, n_tokens, n_seqs, cfg.loss_max_len)
    if not isinstance(loss, torch.Tensor):  # nothing contributes: a constant
        loss = torch.tensor(float(loss), dtype=torch.float64)
    info = {"loss_mask": lm, "count_mask": cm, "spurious": spur, "weights": weights, "vetoed": vetoed,
            "contrib": contrib, "clipped": clipped, "phase_mask": pmask}  # fmt: skip
    return loss, info
