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
`meta_info.routed_experts` is decoded into the sample's `routed_experts` column (`rollout.columns`); the
format and what SGLang covers are in `rollout/routes.py`.

Every per-token quantity of a reply is a column of the table the client was given (`rollout.columns`): the
parser validates the sample and hands `meta_info` to each wanted column's parser.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from megatron_tail.rollout.columns import BUILTIN_COLUMNS, ColumnTable, Reply, TokenColumns
from megatron_tail.rollout.columns.builtin import clip as _clip
from megatron_tail.rollout.columns.fast_checks import token_ids
from megatron_tail.rollout.errors import (  # noqa: F401 - the client's errors, importable from here too
    MalformedResponseError,
    MissingRoutesError,
    RequestRejectedError,
    ResponseTooLargeError,
    RetryableServerError,
    RolloutError,
    SampleAbortedError,
)
from megatron_tail.rollout.processor import dvp_custom_params
from megatron_tail.rollout.settings.sampling import ENGINE_GREEDY_BELOW

_MASK63 = (1 << 63) - 1


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

    `columns`: its per-token columns (`rollout.columns`, the table the client was given): by default
    `rollout_logprobs` (the engine's log-prob of each output token; with DVP log π^mp), `token_versions`
    (the weight version that sampled each token), and where the request wanted them
    `rollout_top_logprobs`, `sampling_support` and `routed_experts`.
    `weight_version` is the policy version the server reported when it returned the sample. `segments`:
    requests the sample took (1, or more when a weight-update pause aborted it and it was continued from
    its tokens, `client.join_segments`).
    """

    key: SampleKey
    prompt_ids: list[int]
    output_ids: list[int]
    finish_reason: dict[str, Any]
    weight_version: str | None
    server_url: str
    columns: TokenColumns
    text: str | None = None
    meta_info: dict[str, Any] = field(default_factory=dict, repr=False)
    segments: int = 1
    log_rho: float | None = None
    """DVP's log ρ the sample's first request was sent with (None: no pruning); its continued segments keep
    the first's (a sample counts as old as its oldest tokens). Set by `RolloutClient.generate_group`."""

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
    """First position whose route is returned (SGLang's `routed_experts_start_len`, ≤ the prompt length). 0:
    the prompt's routes too, which R3 needs (the trainer's forward routes prompt tokens as well); the client's
    continued partial-rollout segments set it so no row is shipped twice (`columns.builtin`, the routes'
    `request` hook)."""

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
        if 0 < self.temperature < ENGINE_GREEDY_BELOW:
            raise ValueError(
                f"temperature must be 0 (greedy) or ≥ {ENGINE_GREEDY_BELOW:g}: the engines decode greedily "
                f"at T = 1 below it, while the trainer scores at T; got {self.temperature!r}"
            )
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
    table: ColumnTable = BUILTIN_COLUMNS,
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
        _parse_one(item, prompt_ids, key, config, attempt, server_url, allow_abort, table)
        for item, key in zip(body, keys, strict=True)
    ]


def _parse_one(
    item,
    prompt_ids,
    key: SampleKey,
    config: SamplingConfig,
    attempt: int,
    url: str,
    allow_abort: bool,
    table: ColumnTable,
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
    if not token_ids(output_ids):
        raise MalformedResponseError(
            f"{where}: 'output_ids' must be a list of token ids, got {_clip(output_ids)}"
        )
    if not output_ids and finish["type"] != "abort":  # a stop token or the length limit is a token
        raise MalformedResponseError(
            f"{where}: finish_reason {finish['type']!r} with no output tokens (a finished sample holds at "
            "least the token it ended on)"
        )
    if len(output_ids) > config.max_new_tokens:
        raise MalformedResponseError(
            f"{where}: {len(output_ids)} output tokens exceed max_new_tokens={config.max_new_tokens}"
        )
    version = None if meta.get("weight_version") is None else str(meta["weight_version"])
    reply = Reply(meta, output_ids, len(prompt_ids), config, finish, version, where)
    try:
        columns = table.parse(reply)
    except ValueError as e:  # a declared column's parser's own error
        raise MalformedResponseError(str(e)) from None
    return SampleResult(
        key=key,
        prompt_ids=list(prompt_ids),
        output_ids=output_ids,
        finish_reason=finish,
        weight_version=version,
        server_url=url,
        columns=columns,
        text=item.get("text"),
        meta_info=meta,
    )
