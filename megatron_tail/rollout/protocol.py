"""The SGLang `/generate` subset we use: request payloads, sample identities, and response validation.

One HTTP request carries the n samples of one prompt as an SGLang batch (`input_ids` a list of lists,
one `sampling_params` dict and one `rid` per sample), because each sample needs its own `sampling_seed`
(SGLang's `n > 1` would reuse one seed). Responses are SGLang's: a list with one object per sample,
`{"text", "output_ids", "meta_info": {"id", "finish_reason", "weight_version",
"output_token_logprobs": [[logprob, token_id, text | null], ...], ...}}`.

Truncated sampling (top_k / top_p / min_p): the request sets `return_sampling_mask: true` and SGLang adds,
per output token, `output_token_sampling_mask` (the ids its sampler kept) and `output_token_sampling_logprobs`
(the sampled token's log-prob under the truncated, renormalised distribution; "selected" mode), from
`Sampler._build_sampling_mask_output` (`srt/layers/sampler.py`) via `srt/managers/tokenizer_manager.py`.
SGLang refuses `return_sampling_mask` with any custom logit processor but its DisallowedTokensLogitsProcessor
(`tokenizer_manager.py`, `custom_logit_processor.supports_sampling_mask`), so DVP's safe set is then sent as
min-p: V_S = {k : π_T(k) ≥ ρ·max π_T} is exactly min_p = ρ on the same temperature-scaled probabilities, and
min-p composes with a user's min_p as the larger of the two. Min-p moves top-p on GPU: SGLang's CUDA default
sampler (flashinfer, `Sampler._sample_from_probs` in `srt/layers/sampler.py`) runs top-k renorm → top-p renorm
→ min-p as soon as any request of its batch has min_p > 0, so with DVP on top-p is measured on the
top-k-renormalised distribution, with DVP off (min_p = 0 throughout) on the full one; the PyTorch sampler
(`--enable-deterministic-inference`) measures it on the full distribution either way and applies min-p last.
The local engine follows either (`local_engine/truncation.py`). The trainer replays the returned support, so
its importance weights are exact either way.

MoE routes (routing replay R3): with `SamplingConfig.return_routed_experts` the request sets SGLang's
`return_routed_experts` (and `routed_experts_start_len` when not 0) and each sample's
`meta_info.routed_experts` is decoded into `SampleResult.routed_experts`; the format and what SGLang covers
are in `rollout/routes.py`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from megatron_tail.rollout.processor import dvp_custom_params
from megatron_tail.rollout.routes import SERVER_FLAG, RoutesError, decode_routes, route_rows
from megatron_tail.rollout.token_fields import parse_token_fields
from megatron_tail.utils.ragged import Ragged

_MASK63 = (1 << 63) - 1


class RolloutError(RuntimeError):
    """Base class of rollout client errors."""


class MalformedResponseError(RolloutError):
    """A server answered 200 with a body that does not match the `/generate` contract. Not retried."""


class ResponseTooLargeError(MalformedResponseError):
    """A response body exceeded the client's `max_response_bytes`."""


class RequestRejectedError(RolloutError):
    """The server rejected the request (HTTP 4xx): retrying elsewhere would not help."""


class RetryableServerError(RolloutError):
    """A failure another attempt may fix: connection error, timeout, HTTP 5xx, aborted sample."""


class SampleAbortedError(RetryableServerError):
    """The server aborted a sample (`finish_reason.type == "abort"`, e.g. a weight-update pause)."""


class MissingRoutesError(MalformedResponseError):
    """Routes were requested and a finished sample came back without `meta_info.routed_experts`: the server
    was started without `--enable-return-routed-experts` (SGLang then ignores the request field). Not
    retried: every sample of that server would miss them."""


@dataclass(frozen=True, order=True)
class SampleKey:
    """Stable identity of one sample: it is what makes retries exactly-once."""

    prompt_index: int
    sample_index: int
    seed: int

    @property
    def rid(self) -> str:
        return f"p{self.prompt_index}-s{self.sample_index}-seed{self.seed}"


@dataclass
class SampleResult:
    """One generated sample.

    `output_logprobs[i]` is the engine's log-prob of `output_ids[i]` (with DVP: log π^mp, float);
    `output_top_logprobs[i]` the log-prob of the most probable token at that position, of the same
    distribution (None unless `SamplingConfig.top_logprob`).
    `weight_version` is the policy version the server reported when it returned the sample;
    `output_versions[i]` the version that sampled `output_ids[i]` (SGLang 0.5.23's `meta_info.weight_versions`
    spans where the server sends them, else `weight_version` for every token; a partial rollout continued
    after a weight update concatenates its segments' versions). `segments`: requests the sample took (1, or
    more when a weight-update pause aborted it and it was continued from its tokens).
    """

    key: SampleKey
    prompt_ids: list[int]
    output_ids: list[int]
    output_logprobs: list[float] | None
    finish_reason: dict[str, Any]
    weight_version: str | None
    server_url: str
    text: str | None = None
    meta_info: dict[str, Any] = field(default_factory=dict, repr=False)
    output_top_logprobs: list[float] | None = None
    output_supports: Ragged | None = None
    """With truncated sampling: `len(output_ids)` rows, row i the ids of token i's sampling support
    (SGLang's `output_token_sampling_mask`, in its order; `utils.ragged`, not padded); `output_logprobs`
    then holds SGLang's
    `output_token_sampling_logprobs` (log-prob under the truncated distribution). None otherwise."""
    output_versions: list[str | None] = field(default_factory=list)
    segments: int = 1
    token_fields: dict[str, list[float]] = field(default_factory=dict)
    """The declared per-token fields (`token_fields.TOKEN_FIELDS`): name → one value per output token."""
    log_rho: float | None = None
    """DVP's log ρ the sample's first request was sent with (None: no pruning); its continued segments keep
    the first's (a sample counts as old as its oldest tokens). Set by `RolloutClient.generate_group`."""
    routed_experts: np.ndarray | None = None
    """With `SamplingConfig.return_routed_experts`: int32 `[len(prompt_ids) + len(output_ids) − 1 − start,
    layers, top_k]`, row p the experts each MoE layer routed token `start + p` to, as the input of the
    forward that sampled token `start + p + 1` (`rollout/routes.py`; `start` is the request's
    `routed_experts_start_len`, 0 unless set; a joined partial rollout starts at its first request's
    start). Columns of layers without a router are 0, as SGLang's. None when not requested (or an aborted
    segment that returned none)."""

    @property
    def aborted(self) -> bool:
        return self.finish_reason.get("type") == "abort"


@dataclass(frozen=True)
class SamplingConfig:
    """Sampling settings shared by every sample of a `generate` call."""

    n_samples: int = 1
    """Samples per prompt; each gets its own seed."""
    max_new_tokens: int = 128
    """Upper bound on generated tokens per sample."""
    temperature: float = 1.0
    """Sampling temperature T; 0 is greedy."""
    stop_token_ids: tuple[int, ...] = ()
    """Extra token ids that end a sample (EOS always does unless `ignore_eos`)."""
    ignore_eos: bool = False
    """Keep generating past EOS (benchmarks)."""
    log_rho: float | None = -13.0
    """DVP log ρ; None sends no logit processor (sampling from the full softmax)."""
    return_logprob: bool = True
    """Ask for `output_token_logprobs`."""
    top_logprob: bool = False
    """Also ask for the top-1 log-prob per output token (`top_logprobs_num: 1`): with the trainer's own,
    it measures the engine–trainer logit error ε̂ of DVP Prop. 4.2 (needs `return_logprob`)."""
    base_seed: int = 0
    """Seeds are derived from (base_seed, prompt index, sample index); change it every step."""
    top_k: int = -1
    """SGLang's top_k: keep the k most probable tokens; -1 off."""
    top_p: float = 1.0
    """SGLang's top_p: keep the smallest prefix (by probability) whose mass reaches top_p; 1 off. On SGLang's
    flashinfer sampler, of the top-k mass when any request of the batch has min_p > 0 (module docstring)."""
    min_p: float = 0.0
    """SGLang's min_p: drop tokens below min_p × the top probability; 0 off."""
    return_routed_experts: bool = False
    """Ask for each token's MoE routes (SGLang's `return_routed_experts`; routing replay R3). The servers
    need `--enable-return-routed-experts`; a sample without routes fails with `MissingRoutesError`."""
    routes_shape: tuple[int, int] | None = None
    """(num_hidden_layers, num_experts_per_tok) of the served model: the layout the returned routes must
    have. Required with `return_routed_experts`."""
    routed_experts_start_len: int = 0
    """First position whose route is returned (SGLang's `routed_experts_start_len`, ≤ the prompt length).
    0: the prompt's routes too, which R3 needs (the trainer's forward routes prompt tokens as well); the
    client's continued partial-rollout segments set it so no row is shipped twice (`routes.join_routes`)."""

    @property
    def truncates(self) -> bool:
        """Any of top_k / top_p / min_p is on (at T > 0): each sample returns its per-token support."""
        return self.temperature > 0 and (self.top_k != -1 or self.top_p < 1.0 or self.min_p > 0.0)

    @property
    def sent_min_p(self) -> float:
        """The min_p sent to SGLang: the user's, or DVP's ρ (its rule as min-p) if larger."""
        rho = 0.0 if self.log_rho is None else math.exp(self.log_rho)
        return max(self.min_p, rho)

    def __post_init__(self):
        if not isinstance(self.n_samples, int) or self.n_samples < 1:
            raise ValueError(f"n_samples must be an int ≥ 1; got {self.n_samples!r}")
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an int ≥ 1; got {self.max_new_tokens!r}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be finite and ≥ 0; got {self.temperature!r}")
        dvp_custom_params(self.log_rho, self.temperature)  # validates log_rho
        bad = [t for t in self.stop_token_ids if not isinstance(t, int) or t < 0]
        if bad:
            raise ValueError(f"stop_token_ids must be non-negative ints; got {bad!r}")
        check_truncation(self.top_k, self.top_p, self.min_p)
        _check_routes(self.return_routed_experts, self.routes_shape, self.routed_experts_start_len)
        if self.truncates and self.top_k == -1:
            raise ValueError(
                f"top_p={self.top_p} / min_p={self.min_p} need a finite top_k: SGLang returns a sampling "
                "mask only for 1 ≤ top_k ≤ --sampling-mask-max-tokens (srt/managers/scheduler.py)"
            )


def check_truncation(top_k: Any, top_p: Any, min_p: Any) -> None:
    """SGLang's `SamplingParams.verify` ranges for top_k, top_p, min_p; ValueError naming the value."""
    if isinstance(top_k, bool) or not isinstance(top_k, int) or (top_k < 1 and top_k != -1):
        raise ValueError(f"top_k must be -1 (off) or an int ≥ 1; got {top_k!r}")
    if isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1]; got {top_p!r}")
    if isinstance(min_p, bool) or not isinstance(min_p, (int, float)) or not 0.0 <= min_p <= 1.0:
        raise ValueError(f"min_p must be in [0, 1]; got {min_p!r}")


def _check_routes(requested: Any, shape: Any, start: Any) -> None:
    if not isinstance(requested, bool):
        raise ValueError(f"return_routed_experts must be a bool; got {requested!r}")
    if isinstance(start, bool) or not isinstance(start, int) or start < 0:
        raise ValueError(f"routed_experts_start_len must be an int ≥ 0; got {start!r}")
    if not requested:
        return
    ok = isinstance(shape, tuple) and len(shape) == 2
    if not ok or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in shape):
        raise ValueError(
            f"routes_shape must be (num_hidden_layers, num_experts_per_tok), two ints ≥ 1, when "
            f"return_routed_experts is set; got {shape!r}"
        )


def sample_seed(base_seed: int, prompt_index: int, sample_index: int) -> int:
    """A 63-bit seed mixed from the three ints (splitmix64), so nearby indices get unrelated streams."""
    x = (base_seed * 0x9E3779B97F4A7C15 + prompt_index * 0xBF58476D1CE4E5B9 + sample_index) & ((1 << 64) - 1)
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & ((1 << 64) - 1)
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & ((1 << 64) - 1)
    return (x ^ (x >> 31)) & _MASK63


def sample_keys(prompt_index: int, config: SamplingConfig) -> list[SampleKey]:
    return [
        SampleKey(prompt_index, j, sample_seed(config.base_seed, prompt_index, j))
        for j in range(config.n_samples)
    ]


def build_generate_payload(
    prompt_ids: list[int],
    keys: list[SampleKey],
    config: SamplingConfig,
    processor: str | None,
    attempt: int,
) -> dict[str, Any]:
    """SGLang batch `/generate` body for the samples `keys` of one prompt.

    The processor (with its `custom_params`) is sent only when `config.log_rho` is set: without
    pruning there is nothing for it to do, and servers then need no `--enable-custom-logit-processor`.

    The rid carries the attempt number so that a retry on the same server (one server, or a router) never
    collides with a request of the same sample that the server may still be running.
    """
    if config.log_rho is None or config.truncates:
        processor = None  # truncating: DVP goes as min_p (SGLang allows no processor with a sampling mask)
    sampling_params = []
    for key in keys:
        params: dict[str, Any] = {
            "max_new_tokens": config.max_new_tokens,
            "temperature": config.temperature,
            "sampling_seed": key.seed,
        }
        if config.stop_token_ids:
            params["stop_token_ids"] = list(config.stop_token_ids)
        if config.ignore_eos:
            params["ignore_eos"] = True
        if config.truncates:
            params.update(top_k=config.top_k, top_p=config.top_p, min_p=config.sent_min_p)
        if processor is not None:
            params["custom_params"] = dvp_custom_params(config.log_rho, config.temperature)
        sampling_params.append(params)
    payload: dict[str, Any] = {
        "input_ids": [list(prompt_ids) for _ in keys],
        "sampling_params": sampling_params,
        "rid": [f"{key.rid}-a{attempt}" for key in keys],
        "return_logprob": config.return_logprob,
    }
    if config.return_logprob and config.top_logprob:
        payload["top_logprobs_num"] = 1  # SGLang `GenerateReqInput.top_logprobs_num` (int or per item)
    if processor is not None:
        payload["custom_logit_processor"] = [processor for _ in keys]
    if config.truncates:
        payload["return_sampling_mask"] = True  # SGLang's GenerateReqInput; "selected" log-prob mode
    if config.return_routed_experts:  # SGLang's GenerateReqInput: one value for the whole batch request
        payload["return_routed_experts"] = True
        if config.routed_experts_start_len:
            payload["routed_experts_start_len"] = config.routed_experts_start_len
    return payload


def parse_generate_response(
    body: Any,
    prompt_ids: list[int],
    keys: list[SampleKey],
    config: SamplingConfig,
    attempt: int,
    server_url: str,
    *,
    allow_abort: bool = False,
) -> list[SampleResult]:
    """Validate a batch `/generate` response against what was asked; return one `SampleResult` per key.

    Raises `MalformedResponseError` (naming the sample and the field) on a contract violation and
    `RetryableServerError` when a sample was aborted (e.g. by a weight update's pause), unless
    `allow_abort`: then an aborted sample is returned with what it generated before the abort.
    """
    if isinstance(body, dict) and len(keys) == 1:
        body = [body]
    if not isinstance(body, list) or len(body) != len(keys):
        got = f"a list of {len(body)}" if isinstance(body, list) else type(body).__name__
        raise MalformedResponseError(
            f"{server_url}/generate: expected a JSON list of {len(keys)} samples, got {got}: {_clip(body)}"
        )
    return [
        _parse_one(item, prompt_ids, key, config, attempt, server_url, allow_abort)
        for item, key in zip(body, keys, strict=True)
    ]


def _parse_one(
    item, prompt_ids, key: SampleKey, config: SamplingConfig, attempt: int, url: str, allow_abort: bool
) -> SampleResult:
    where = f"{url}/generate sample {key.rid}"
    if not isinstance(item, dict):
        raise MalformedResponseError(f"{where}: expected an object, got {_clip(item)}")
    meta = item.get("meta_info")
    output_ids = item.get("output_ids")
    if not isinstance(meta, dict):
        raise MalformedResponseError(f"{where}: missing 'meta_info' object; keys are {sorted(item)}")
    expected_rid = f"{key.rid}-a{attempt}"
    if meta.get("id") != expected_rid:
        raise MalformedResponseError(
            f"{where}: meta_info.id is {meta.get('id')!r}, expected {expected_rid!r}"
        )
    finish = meta.get("finish_reason")
    if not isinstance(finish, dict) or finish.get("type") not in ("stop", "length", "abort"):
        raise MalformedResponseError(
            f"{where}: meta_info.finish_reason {finish!r} is not {{'type': stop|length|abort}}"
        )
    if finish["type"] == "abort" and not allow_abort:
        raise SampleAbortedError(f"{where}: sample aborted by the server: {finish.get('message')!r}")
    if output_ids is None and finish["type"] == "abort":
        output_ids = []  # aborted in the waiting queue: SGLang may send no tokens at all
    if not isinstance(output_ids, list) or not all(isinstance(t, int) and t >= 0 for t in output_ids):
        raise MalformedResponseError(
            f"{where}: 'output_ids' must be a list of token ids, got {_clip(output_ids)}"
        )
    if len(output_ids) > config.max_new_tokens:
        raise MalformedResponseError(
            f"{where}: {len(output_ids)} output tokens exceed max_new_tokens={config.max_new_tokens}"
        )
    if config.return_logprob and not output_ids and finish["type"] == "abort":
        logprobs = []
    else:
        logprobs = _parse_logprobs(meta, output_ids, where) if config.return_logprob else None
    top = None
    if logprobs is not None and config.top_logprob:
        top = _parse_top_logprobs(meta, logprobs, where) if logprobs else []
    supports = None
    if config.truncates and output_ids:
        supports, selected = _parse_sampling_masks(meta, output_ids, where)
        if top is not None:  # the same shift as the sampled token's: onto the truncated normaliser
            top = [t + s - f for t, s, f in zip(top, selected, logprobs, strict=True)]
        logprobs = selected
    elif config.truncates:  # aborted before its first token
        supports = Ragged.empty_rows(0)
    version = None if meta.get("weight_version") is None else str(meta["weight_version"])
    return SampleResult(
        key=key,
        prompt_ids=list(prompt_ids),
        output_ids=output_ids,
        output_logprobs=logprobs,
        finish_reason=finish,
        weight_version=version,
        server_url=url,
        text=item.get("text"),
        meta_info=meta,
        output_top_logprobs=top,
        output_supports=supports,
        output_versions=_token_versions(meta, len(output_ids), version, where),
        token_fields=_declared_fields(meta, output_ids, finish, where),
        routed_experts=_parse_routes(meta, len(prompt_ids), len(output_ids), config, finish, where),
    )


def _declared_fields(meta: dict, output_ids: list[int], finish: dict, where: str) -> dict[str, list[float]]:
    try:
        aborted_empty = not output_ids and finish.get("type") == "abort"
        return parse_token_fields(meta, len(output_ids), aborted_empty, where)
    except ValueError as e:
        raise MalformedResponseError(str(e)) from None


def _parse_routes(
    meta: dict, prompt_len: int, output_len: int, config: SamplingConfig, finish: dict, where: str
) -> np.ndarray | None:
    """`meta_info.routed_experts` as int32 `[rows, layers, top_k]` (`routes.decode_routes`); the string leaves
    `meta` (at 48 layers × top-8 it is ≈ 2 KB per token). An aborted sample may come without: SGLang collects
    routes only for a request that ends in a forward batch, not one aborted in the waiting queue."""
    if not config.return_routed_experts:
        return None
    encoded = meta.pop("routed_experts", None)
    if encoded is None:
        if finish.get("type") == "abort":
            return None
        raise MissingRoutesError(
            f"{where}: the reply has no meta_info.routed_experts though the request set "
            f"return_routed_experts (routing replay r3): start the servers with {SERVER_FLAG} "
            f"(SGLang's flag; the local engine's `megatron-tail serve-local {SERVER_FLAG}`)"
        )
    layers, top_k = config.routes_shape
    rows = route_rows(prompt_len, output_len, config.routed_experts_start_len)
    try:
        return decode_routes(encoded, rows, layers, top_k, where)
    except RoutesError as e:
        raise MalformedResponseError(str(e)) from None


def _token_versions(meta: dict, n: int, version: str | None, where: str) -> list[str | None]:
    """Per output token, the weight version that sampled it: SGLang 0.5.23 sends
    `meta_info.weight_versions = [{"version", "start", "end"}, ...]` (`utils/weight_versions.py`,
    `add_weight_versions_to_meta_info`) when the version changed while the request ran (an in-place or
    retract pause); otherwise every token has `weight_version`."""
    spans = meta.get("weight_versions")
    if not spans:
        return [version] * n
    out: list[str | None] = [version] * n
    for span in spans:
        try:
            start, end, value = int(span["start"]), int(span["end"]), str(span["version"])
        except (KeyError, TypeError, ValueError) as e:
            bad = f"{where}: meta_info.weight_versions entry {_clip(span)}"
            raise MalformedResponseError(f"{bad}: {e}") from e
        out[max(start, 0) : min(end, n)] = [value] * max(0, min(end, n) - max(start, 0))
    return out


def _parse_sampling_masks(meta: dict, output_ids: list[int], where: str) -> tuple[Ragged, list[float]]:
    """`(n rows of support ids, ragged; n selected log-probs)` from SGLang's sampling-mask fields. The raw
    lists leave `meta` once parsed: at top_k in the thousands they are the response's largest part."""
    masks = meta.get("output_token_sampling_mask")
    selected = meta.get("output_token_sampling_logprobs")
    for name, value in (("output_token_sampling_mask", masks), ("output_token_sampling_logprobs", selected)):
        if not isinstance(value, list) or len(value) != len(output_ids):
            n = len(value) if isinstance(value, list) else _clip(value)
            raise MalformedResponseError(
                f"{where}: meta_info.{name} must hold one entry per output token ({len(output_ids)}); "
                f"got {n} (an SGLang without return_sampling_mask support?)"
            )
    for i, (mask, value, token) in enumerate(zip(masks, selected, output_ids, strict=True)):
        if (
            not isinstance(mask, list)
            or token not in mask
            or not all(isinstance(t, int) and t >= 0 for t in mask)
        ):
            raise MalformedResponseError(
                f"{where}: output_token_sampling_mask[{i}] = {_clip(mask)} is not a list of token ids "
                f"holding the sampled token {token}"
            )
        if not isinstance(value, (int, float)) or math.isnan(value) or value > 1e-4:
            raise MalformedResponseError(
                f"{where}: output_token_sampling_logprobs[{i}] = {_clip(value)} is not ≤ 0"
            )
    del meta["output_token_sampling_mask"]
    return Ragged.from_lists(masks), [float(v) for v in selected]


def _parse_logprobs(meta: dict, output_ids: list[int], where: str) -> list[float]:
    triples = meta.get("output_token_logprobs")
    if not isinstance(triples, list) or len(triples) != len(output_ids):
        n = len(triples) if isinstance(triples, list) else _clip(triples)
        raise MalformedResponseError(
            f"{where}: meta_info.output_token_logprobs must hold one [logprob, token_id, text] "
            "per output token "
            f"({len(output_ids)}); got {n}"
        )
    logprobs = []
    for i, (triple, token) in enumerate(zip(triples, output_ids, strict=True)):
        ok = isinstance(triple, (list, tuple)) and len(triple) >= 2 and triple[1] == token
        value = triple[0] if ok else None
        if not ok or not isinstance(value, (int, float)) or math.isnan(value) or value > 1e-4:
            raise MalformedResponseError(
                f"{where}: output_token_logprobs[{i}] = {_clip(triple)} is not [logprob ≤ 0, {token}, text]"
            )
        logprobs.append(float(value))
    return logprobs


_TOP_TOLERANCE = 1e-4
"""The top-1 log-prob may fall short of the sampled token's by rounding only (both come from one
log-softmax on the server)."""


def _parse_top_logprobs(meta: dict, logprobs: list[float], where: str) -> list[float]:
    """The top-1 log-prob per output position from SGLang's nested `output_top_logprobs`
    (`[[[logprob, token_id, text], ...], ...]`, one list per output token)."""
    rows = meta.get("output_top_logprobs")
    if not isinstance(rows, list) or len(rows) != len(logprobs):
        n = len(rows) if isinstance(rows, list) else _clip(rows)
        raise MalformedResponseError(
            f"{where}: meta_info.output_top_logprobs must hold one list of [logprob, token_id, text] per "
            f"output token ({len(logprobs)}); got {n}"
        )
    top = []
    for i, (row, own) in enumerate(zip(rows, logprobs, strict=True)):
        first = row[0] if isinstance(row, list) and row else None
        value = first[0] if isinstance(first, (list, tuple)) and len(first) >= 2 else None
        if (
            not isinstance(value, (int, float))
            or math.isnan(value)
            or not own - _TOP_TOLERANCE <= value <= _TOP_TOLERANCE
        ):
            raise MalformedResponseError(
                f"{where}: output_top_logprobs[{i}] = {_clip(row)} does not start with "
                f"[logprob in [{own:.6g}, 0], token_id, text] (the sampled token's log-prob is {own:.6g})"
            )
        top.append(float(value))
    return top


def _clip(value: Any, limit: int = 200) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + f"... ({len(text)} chars)"
