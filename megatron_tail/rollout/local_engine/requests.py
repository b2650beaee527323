"""Validation of `/generate` bodies for the local engine: SGLang's field names, a documented subset.

A body is SGLang's `GenerateReqInput`: `input_ids` (one prompt `[int]` or a batch `[[int]]`) or `text`,
`sampling_params` (a dict, or one per batch item), `rid`, `return_logprob`, `custom_logit_processor`.
Keys SGLang does not know are rejected like SGLang rejects them; SGLang features this engine does not
implement are rejected by name instead of being silently ignored.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from megatron_tail.rollout.local_engine.sglang_defaults import DEFAULT_SAMPLING_MASK_MAX_TOKENS
from megatron_tail.rollout.local_engine.truncation import TOP_K_ALL, Truncation
from megatron_tail.rollout.settings.sampling import ENGINE_GREEDY_BELOW


class BadRequest(ValueError):
    """The request is invalid; the message is returned to the client with HTTP 400."""


SGLANG_SAMPLING_KEYS = frozenset(
    "max_new_tokens stop stop_token_ids stop_regex temperature top_p top_k min_p frequency_penalty "
    "presence_penalty repetition_penalty min_new_tokens n beam_width json_schema regex ebnf structural_tag "
    "ignore_eos skip_special_tokens spaces_between_special_tokens no_stop_trim stream_interval logit_bias "
    "sampling_seed custom_params watermark choice".split()
)
"""The API fields of `sglang.srt.sampling.sampling_params.SamplingParams` (0.5.23)."""

_UNSUPPORTED_UNLESS_DEFAULT = {
    "frequency_penalty": (0.0,),
    "presence_penalty": (0.0,),
    "repetition_penalty": (1.0,),
    "min_new_tokens": (0,),
    "n": (1,),
    "beam_width": (None, 1),
    "stop": (None, [], ""),
    "stop_regex": (None, [], ""),
    "json_schema": (None,),
    "regex": (None,),
    "ebnf": (None,),
    "structural_tag": (None,),
    "logit_bias": (None, {}),
    "watermark": (None,),
    "choice": (None,),
}
"""SGLang sampling features the local engine does not implement: allowed only at their no-op value."""

SUPPORTED_TOP_LEVEL_KEYS = frozenset(
    {
        "input_ids",
        "text",
        "sampling_params",
        "rid",
        "return_logprob",
        "custom_logit_processor",
        "logprob_start_len",
        "top_logprobs_num",
        "return_text_in_logprobs",
        "return_sampling_mask",
        "sampling_logprobs_mode",
        "return_routed_experts",
        "routed_experts_start_len",
        "stream",
        "log_metrics",
    }
)

GREEDY_EPS = ENGINE_GREEDY_BELOW
"""SGLang's `_SAMPLING_EPS`: temperatures below it mean greedy decoding."""


@dataclass
class GenerateItem:
    """One sample to generate: prompt, stopping rules, sampling rule, optional custom logit processor."""

    rid: str
    input_ids: list[int]
    max_new_tokens: int
    temperature: float
    """0 = greedy (SGLang then scores at T = 1)."""
    seed: int | None
    stop_token_ids: frozenset[int]
    ignore_eos: bool
    skip_special_tokens: bool
    return_logprob: bool
    top_logprobs_num: int
    """k ≥ 0: also return the k most probable tokens' log-probs at each output position (SGLang's
    `output_top_logprobs`), from the same distribution as `output_token_logprobs`."""
    processor: str | None
    custom_params: dict[str, Any] | None
    truncation: Truncation = Truncation()  # noqa: RUF009 - frozen, so one shared default is safe
    """top_k / top_p / min_p as SGLang normalises them (`truncation.Truncation`)."""
    return_sampling_mask: bool = False
    """Return `output_token_sampling_mask` and `output_token_sampling_logprobs` ("selected" mode)."""
    return_routed_experts: bool = False
    """Return `meta_info.routed_experts` (only a server started with `--enable-return-routed-experts` has
    them: without it the field is left out, as SGLang does)."""
    routed_experts_start_len: int = 0
    """First position whose route is returned (SGLang's `routed_experts_start_len`)."""


@dataclass
class GenerateRequest:
    items: list[GenerateItem]
    batched: bool
    """True when the body was a batch (the response is then a list)."""
    return_text_in_logprobs: bool


def parse_generate_body(
    body: Any,
    *,
    tokenize,
    vocab_size: int,
    context_length: int,
    max_batch: int,
    sampling_mask_max_tokens: int = DEFAULT_SAMPLING_MASK_MAX_TOKENS,
):
    """Validate an SGLang `/generate` body; return a `GenerateRequest` or raise `BadRequest`.

    `tokenize(text) -> list[int]` is used for `text` prompts (None when the engine has no tokenizer).
    `sampling_mask_max_tokens` is the engine's `--sampling-mask-max-tokens` (SGLang's flag and default).
    """
    if not isinstance(body, dict):
        raise BadRequest(f"/generate body must be a JSON object; got {type(body).__name__}")
    unknown = sorted(set(body) - SUPPORTED_TOP_LEVEL_KEYS)
    if unknown:
        raise BadRequest(
            f"/generate fields {unknown} are not supported by the local engine; "
            f"supported: {sorted(SUPPORTED_TOP_LEVEL_KEYS)}"
        )
    if body.get("stream"):
        raise BadRequest("stream=true is not supported by the local engine")
    _require_default(body, "logprob_start_len", (None, -1))
    prompts, batched = _prompts(body, tokenize)
    if len(prompts) > max_batch:
        raise BadRequest(f"batch of {len(prompts)} prompts exceeds the engine's max batch size {max_batch}")
    n = len(prompts)
    sampling = _per_item(body.get("sampling_params") or {}, n, "sampling_params")
    rids = _per_item(body.get("rid"), n, "rid")
    return_logprob = _per_item(body.get("return_logprob") or False, n, "return_logprob")
    top_logprobs = _per_item(body.get("top_logprobs_num") or 0, n, "top_logprobs_num")
    processors = _per_item(body.get("custom_logit_processor"), n, "custom_logit_processor")
    masks = _per_item(body.get("return_sampling_mask") or False, n, "return_sampling_mask")
    modes = _per_item(body.get("sampling_logprobs_mode"), n, "sampling_logprobs_mode")
    routes = _per_item(body.get("return_routed_experts") or False, n, "return_routed_experts")
    starts = _per_item(body.get("routed_experts_start_len") or 0, n, "routed_experts_start_len")
    items = []
    for i in range(n):
        where = f"item {i}" if batched else "request"
        ids = _check_ids(prompts[i], vocab_size, where)
        params = _sampling_params(sampling[i], where)
        total = len(ids) + params["max_new_tokens"]
        if total > context_length:
            raise BadRequest(
                f"{where}: prompt ({len(ids)} tokens) + max_new_tokens ({params['max_new_tokens']}) "
                f"= {total} tokens exceeds the model's context length of {context_length} tokens"
            )
        if processors[i] is not None and not isinstance(processors[i], str):
            raise BadRequest(
                f"{where}: custom_logit_processor must be a string from CustomLogitProcessor.to_str()"
            )
        _check_sampling_mask(
            bool(masks[i]), modes[i], processors[i], params["truncation"], sampling_mask_max_tokens, where
        )
        items.append(
            GenerateItem(
                rid=str(rids[i]) if rids[i] is not None else f"local-{i}",
                input_ids=ids,
                processor=processors[i],
                return_logprob=bool(return_logprob[i]),
                top_logprobs_num=_top_logprobs_num(top_logprobs[i], vocab_size, where),
                return_sampling_mask=bool(masks[i]),
                return_routed_experts=bool(routes[i]),
                routed_experts_start_len=_routes_start(bool(routes[i]), starts[i], len(ids), where),
                **params,
            )
        )
    return GenerateRequest(items, batched, bool(body.get("return_text_in_logprobs", False)))


def _prompts(body: dict, tokenize) -> tuple[list, bool]:
    if ("input_ids" in body) == ("text" in body):
        raise BadRequest("/generate needs exactly one of 'input_ids' or 'text'")
    if "text" in body:
        if tokenize is None:
            raise BadRequest("'text' prompts need a tokenizer; this engine has none, send 'input_ids'")
        text = body["text"]
        texts = [text] if isinstance(text, str) else text
        if not isinstance(texts, list) or not texts or not all(isinstance(t, str) for t in texts):
            raise BadRequest("'text' must be a string or a non-empty list of strings")
        return [tokenize(t) for t in texts], not isinstance(text, str)
    ids = body["input_ids"]
    if not isinstance(ids, list) or not ids:
        raise BadRequest(f"'input_ids' must be a non-empty list of token ids or of lists; got {ids!r:.100}")
    if all(isinstance(x, list) for x in ids):
        return ids, True
    return [ids], False


def _per_item(value: Any, n: int, name: str) -> list:
    if isinstance(value, list):
        if len(value) != n:
            raise BadRequest(f"'{name}' has {len(value)} entries for a batch of {n}")
        return value
    return [value] * n


def _top_logprobs_num(k: Any, vocab_size: int, where: str) -> int:
    if not isinstance(k, int) or isinstance(k, bool) or not 0 <= k <= vocab_size:
        raise BadRequest(f"{where}: top_logprobs_num must be an int in [0, {vocab_size}]; got {k!r}")
    return k


def _check_ids(ids: Any, vocab_size: int, where: str) -> list[int]:
    if not isinstance(ids, list) or not ids:
        raise BadRequest(f"{where}: input_ids must be a non-empty list of ints")
    for t in ids:
        if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size:
            raise BadRequest(f"{where}: token id {t!r} is not an int in [0, {vocab_size})")
    return ids


def _sampling_params(params: Any, where: str) -> dict[str, Any]:
    if not isinstance(params, dict):
        raise BadRequest(f"{where}: sampling_params must be an object; got {type(params).__name__}")
    unknown = sorted(set(params) - SGLANG_SAMPLING_KEYS)
    if unknown:
        raise BadRequest(
            f"{where}: unknown sampling_params key(s) {unknown}; "
            f"SGLang accepts {sorted(SGLANG_SAMPLING_KEYS)}"
        )
    for key, allowed in _UNSUPPORTED_UNLESS_DEFAULT.items():
        if key in params and params[key] not in allowed:
            raise BadRequest(
                f"{where}: sampling_params.{key}={params[key]!r} is not supported by the local engine"
            )
    max_new = params.get("max_new_tokens", 128)
    if not isinstance(max_new, int) or isinstance(max_new, bool) or max_new < 1:
        raise BadRequest(f"{where}: max_new_tokens must be an int ≥ 1; got {max_new!r}")
    temperature = params.get("temperature", 1.0)
    temperature = 1.0 if temperature is None else temperature
    if not isinstance(temperature, (int, float)) or not math.isfinite(temperature) or temperature < 0:
        raise BadRequest(f"{where}: temperature must be a finite number ≥ 0; got {temperature!r}")
    seed = params.get("sampling_seed")
    if seed is not None and (
        not isinstance(seed, int) or isinstance(seed, bool) or not -(2**63) <= seed < 2**63
    ):
        raise BadRequest(f"{where}: sampling_seed must be an int in [-2**63, 2**63); got {seed!r}")
    stop_ids = params.get("stop_token_ids") or []
    if not isinstance(stop_ids, list) or not all(isinstance(t, int) and t >= 0 for t in stop_ids):
        raise BadRequest(f"{where}: stop_token_ids must be a list of token ids; got {stop_ids!r}")
    custom = params.get("custom_params")
    if custom is not None and not isinstance(custom, dict):
        raise BadRequest(f"{where}: custom_params must be an object; got {type(custom).__name__}")
    greedy = temperature < GREEDY_EPS
    return {
        "max_new_tokens": max_new,
        "temperature": 0.0 if greedy else float(temperature),
        "truncation": _truncation(params, greedy, where),
        "seed": seed,
        "stop_token_ids": frozenset(stop_ids),
        "ignore_eos": bool(params.get("ignore_eos", False)),
        "skip_special_tokens": bool(params.get("skip_special_tokens", True)),
        "custom_params": custom,
    }


def _routes_start(requested: bool, start: Any, prompt_len: int, where: str) -> int:
    """SGLang's checks of `routed_experts_start_len` (`Scheduler.handle_generate_request`, with its
    messages), made only when routes are asked for, as there."""
    if isinstance(start, bool) or not isinstance(start, int):
        raise BadRequest(f"{where}: routed_experts_start_len must be an int; got {start!r}")
    if not requested:
        return 0
    if start < 0:
        raise BadRequest(
            f"{where}: routed_experts_start_len={start} is lower than 0. "
            "Please use a non-negative routed_experts_start_len."
        )
    if start > prompt_len:
        raise BadRequest(
            f"{where}: routed_experts_start_len={start} is higher than the number of input tokens "
            f"len(req.origin_input_ids)={prompt_len}. Please use a smaller routed_experts_start_len."
        )
    return start


def _require_default(body: dict, key: str, allowed: tuple) -> None:
    if body.get(key) not in allowed:
        raise BadRequest(f"{key}={body.get(key)!r} is not supported by the local engine (only {allowed})")


def _truncation(params: dict, greedy: bool, where: str) -> Truncation:
    """top_k / top_p / min_p checked and normalised as SGLang's `SamplingParams` does (`_normalize` and
    `verify`: top_k -1 → TOP_K_ALL, a greedy request → top_k 1)."""
    top_k = params.get("top_k", -1)
    top_k = -1 if top_k is None else top_k
    top_p = params.get("top_p", 1.0)
    top_p = 1.0 if top_p is None else top_p
    min_p = params.get("min_p", 0.0)
    min_p = 0.0 if min_p is None else min_p
    if not isinstance(top_k, int) or isinstance(top_k, bool) or (top_k < 1 and top_k != -1):
        raise BadRequest(f"{where}: top_k must be -1 (disable) or at least 1, got {top_k!r}.")
    if not isinstance(top_p, (int, float)) or isinstance(top_p, bool) or not 0.0 < top_p <= 1.0:
        raise BadRequest(f"{where}: top_p must be in (0, 1], got {top_p!r}.")
    if not isinstance(min_p, (int, float)) or isinstance(min_p, bool) or not 0.0 <= min_p <= 1.0:
        raise BadRequest(f"{where}: min_p must be in [0, 1], got {min_p!r}.")
    if greedy:
        top_k = 1
    return Truncation(TOP_K_ALL if top_k == -1 else top_k, float(top_p), float(min_p))


def _check_sampling_mask(
    mask: bool, mode: Any, processor: str | None, truncation: Truncation, cap: int, where: str
) -> None:
    """SGLang's rules for `return_sampling_mask` (tokenizer_manager.py `_validate_...`, scheduler.py)."""
    if mode is not None and not mask:
        raise BadRequest(f"{where}: sampling_logprobs_mode can only be set when return_sampling_mask=true.")
    if not mask:
        return
    if mode not in (None, "selected"):
        raise BadRequest(f"{where}: sampling_logprobs_mode={mode!r} is not supported by the local engine")
    if processor is not None:
        raise BadRequest(
            f"{where}: return_sampling_mask only supports DisallowedTokensLogitsProcessor among custom "
            "logit processors."
        )
    top_k = truncation.top_k
    if top_k != 1 and not 1 < top_k <= cap:
        shown = -1 if top_k == TOP_K_ALL else top_k
        raise BadRequest(
            f"{where}: return_sampling_mask requires top_k=1 for greedy sampling or finite "
            f"1 < top_k <= {cap}; got top_k={shown}. Lower top_k or increase --sampling-mask-max-tokens."
        )
