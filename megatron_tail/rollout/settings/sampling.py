"""`rollout.sampling`: the engines' sampling parameters for training samples (SGLang's `SamplingParams`:
temperature and truncation), and the cap on the per-token support they return."""

from __future__ import annotations

import math
from dataclasses import dataclass

from megatron_tail.utils.settings_checks import bad as _bad
from megatron_tail.utils.settings_checks import positive_int as _positive_int

ENGINE_GREEDY_BELOW = 1e-6
"""SGLang 0.5.23's `_SAMPLING_EPS` (`sampling/sampling_params.py`): a temperature below it means greedy
decoding at T = 1, in the local engine too (`local_engine.requests.GREEDY_EPS`). Above the op's own limit
(`ops.log_rho.MIN_TEMPERATURE`, 1/T finite in float32)."""

SECTION = "rollout.sampling"
TOP_K_HEADROOM = 2
"""`rollout.sampling.mask_max_tokens` ≥ this × `top_k` (without `rollout.deterministic`). SGLang's flashinfer
top-k keeps every probability ≥ the k-th largest, and bf16 logits tie often: on rows of 151,936 bf16 logits
(N(μ, σ²), σ 1–4, μ 0–20; 20 rows each) the ties past rank k added 2–10 % of k at μ = 0 and up to 60 % at
μ = 20, σ = 1 (bf16 steps 1/8 there). Twice top_k covers all of it; the cap costs SGLang an `[batch, cap]`
int32 buffer per step, little."""


@dataclass(frozen=True)
class SamplingSection:
    """Temperature and truncation of training samples, and of evaluation's sampled half (`eval/pass@k`,
    `eval/sampled_accuracy`); its greedy half (`eval/greedy_accuracy`) uses neither."""

    temperature: float = 1.0
    """Sampling temperature T (> 0); the trainer scores log-probs at the same T."""
    top_k: int = -1
    """SGLang's top_k (-1 off). With any of top_k / top_p / min_p on, every sample carries each token's
    sampling support as the engine returned it (`return_sampling_mask`), the behaviour log-prob is the
    engine's log-prob under that truncated distribution, and the trainer normalises θ_old, the update and the
    reference over the same support (the op's `sampling_support`), so the importance weights stay exact.
    SGLang returns a mask only for a finite top_k ≤ `mask_max_tokens`, so top_p / min_p need one."""
    top_p: float = 1.0
    """SGLang's top_p in (0, 1] (1 off): keep the most probable tokens until their mass reaches top_p. On
    SGLang's default (flashinfer) sampler, the mass is of the top-k tokens renormalised when any request of
    the engine's batch has min_p > 0, which DVP's min-p always is: so DVP on/off also moves top-p
    (docs/rollouts.md, "Truncated sampling")."""
    min_p: float = 0.0
    """SGLang's min_p in [0, 1] (0 off): drop tokens below min_p × the top probability. With DVP on and
    truncation, the engine gets max(min_p, ρ): DVP's safe set is min-p at ρ (docs/rollouts.md, "Truncated
    sampling", "DVP as min-p")."""
    mask_max_tokens: int = 4096
    """The engines' `--sampling-mask-max-tokens` (SGLang's default): the most ids in one token's support.
    SGLang's flashinfer sampler keeps every tie at the top-k cutoff, so a support can exceed top_k, and SGLang
    rejects the request when it exceeds this cap: it must be ≥ `TOP_K_HEADROOM` × `top_k`, or ≥ `top_k` with
    `rollout.deterministic` (the PyTorch sampler keeps exactly top_k ranks). A rejected group is generated
    again and counted (`rollout.client.SupportOverflowError`); one rejected on every attempt is a user error
    naming both keys (`rollout.client.SupportOverflowsExhausted`)."""

    @property
    def truncates(self) -> bool:
        """Any of top_k / top_p / min_p is on: samples carry their per-token sampling support."""
        return self.top_k != -1 or self.top_p < 1.0 or self.min_p > 0.0

    def __post_init__(self) -> None:
        """SGLang's ranges (`SamplingParams.verify`) and its mask rule: a finite top_k ≤ the mask cap."""
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not t > 0:
            _bad(SECTION, "temperature", t, "must be > 0 (training samples; greedy is eval only)")
        if not ENGINE_GREEDY_BELOW <= t < math.inf:
            _bad(
                SECTION,
                "temperature",
                t,
                f"must be finite and ≥ {ENGINE_GREEDY_BELOW:g}: below it the engines decode greedily and "
                "return log-probs at T = 1 (SGLang's SamplingParams, _SAMPLING_EPS), which the trainer would "
                "score at T",
            )
        _positive_int(SECTION, "mask_max_tokens", self.mask_max_tokens)
        if self.top_k != -1:
            _positive_int(SECTION, "top_k", self.top_k, otherwise=", or -1 (off)")
        if (
            isinstance(self.top_p, bool)
            or not isinstance(self.top_p, (int, float))
            or not 0 < self.top_p <= 1
        ):
            _bad(SECTION, "top_p", self.top_p, "must be in (0, 1] (1: off)")
        if (
            isinstance(self.min_p, bool)
            or not isinstance(self.min_p, (int, float))
            or not 0 <= self.min_p <= 1
        ):
            _bad(SECTION, "min_p", self.min_p, "must be in [0, 1] (0: off)")
        cap = self.mask_max_tokens
        if self.truncates and self.top_k == -1:
            _bad(
                SECTION,
                "top_k",
                self.top_k,
                f"must be set with {SECTION}.top_p={self.top_p} / {SECTION}.min_p={self.min_p}: the engine "
                "returns each token's sampling support, which SGLang bounds by --sampling-mask-max-tokens "
                f"({SECTION}.mask_max_tokens={cap}) and refuses without a finite top_k; set {SECTION}.top_k "
                "(prime-rl bounds masks with 512)",
            )
        if self.top_k > cap:
            _bad(
                SECTION,
                "top_k",
                self.top_k,
                f"must be ≤ {SECTION}.mask_max_tokens={cap} (SGLang refuses a sampling mask request above "
                "it)",
            )

    def check_headroom(self, deterministic: bool) -> None:
        """Without `rollout.deterministic`, flashinfer's ties: top_k ≤ mask_max_tokens / `TOP_K_HEADROOM`."""
        cap = self.mask_max_tokens
        if not deterministic and self.top_k * TOP_K_HEADROOM > cap:
            _bad(
                SECTION,
                "top_k",
                self.top_k,
                f"must be ≤ {cap // TOP_K_HEADROOM} with {SECTION}.mask_max_tokens={cap} (headroom "
                f"×{TOP_K_HEADROOM}): SGLang's flashinfer sampler keeps every tie at the top-k cutoff and "
                f"rejects a request whose support exceeds the cap; raise {SECTION}.mask_max_tokens to "
                f"{self.top_k * TOP_K_HEADROOM}, lower top_k, or set rollout.deterministic (no ties kept)",
            )
