"""MoE routes returned by the engines (routing replay R3): SGLang 0.5.23's format, decoding, joining.

What SGLang 0.5.23 returns, read from its source (`.venv/.../sglang/srt/`):

- The server captures routes only when started with `--enable-return-routed-experts`
  (`arg_groups/fields/exec_.py`, `enable_return_routed_experts`; `state_capturer/routed_experts.py`,
  `RoutedExpertsCapturer.create` returns None without it). Without the flag a request that asks for routes
  is NOT refused: `batch_result_processor._maybe_collect_routed_experts` finds no capturer and the reply
  simply has no `meta_info.routed_experts`. The client therefore checks for it (`MissingRoutesError`).
- Request fields (`managers/io_struct.py`, `GenerateReqInput`): `return_routed_experts: bool` and
  `routed_experts_start_len: int` (one value for a whole batch request). The scheduler refuses a start
  below 0 or above the prompt length (`managers/scheduler.py`, the request aborts with that message).
- Positions covered: `[start_len, seqlen - 1)` with seqlen = prompt + output tokens (through the stop
  token) (`state_capturer/base.py`, `BaseTopkCapturer.get_topk`; `_maybe_collect_routed_experts`). Row p is
  the route of token p as the *input* of a forward pass: the capturer writes a forward's top-k into the host
  buffer at that forward's KV-cache slots (`BaseTopkCapturer.on_forward_end`:
  `host_cache.buffer[out_cache_loc] = topk`), and `get_topk` reads them back through
  `req_to_token[start_len : seqlen - 1]`. The last token has no row: it was sampled but never fed back.
  So a reply has `prompt + output - 1 - start_len` rows, and row p is the routing that produced the logits
  which sampled token p + 1. A cached prefix (radix cache) keeps the rows written by the request that
  computed that KV.
- Layout and dtype: int32, shape `[rows, num_hidden_layers, num_experts_per_tok]`, C order
  (`BaseHostCache`, `RoutedExpertsCapturer.__init__` from `hf_text_config`). Layer index = the decoder
  layer's global id (`capture(layer_id, ...)` via `layers/moe/topk.py`, `capture_routed_experts_if_allowed`);
  a layer without a router never writes its column, which stays 0 (the zero-initialised buffers).
  SGLang's Qwen3-MoE declares every layer sparse (`models/qwen3_moe.py`, `Qwen3MoeDecoderLayer.stage_facts`,
  ignoring `mlp_only_layers` / `decoder_sparse_step`). Expert ids are logical (captured before
  `topk_ids_logical_to_physical`), fused shared-expert columns are dropped (`[:topk_size]`).
- Encoding: `meta_info["routed_experts"]` = base64 of the array's raw bytes, as a str
  (`managers/detokenizer_manager.py`, `_b64_encode_per_request`; `managers/tokenizer_manager.py` encodes the
  same way on the skip-tokenizer path). SGLang's own decoder, `extract_routed_experts_from_meta_info`
  (`state_capturer/routed_experts.py`), returns the flat int32 vector: the shape is the caller's to know.

Partial rollouts (the `routed_experts` column's `join`, `columns.builtin`): row p pairs with the sampling of
token p + 1, so a joined sample keeps, for every position, the row of the request that sampled the next token.
An aborted segment that returned r rows (positions [0, r)) is continued by a request for prompt + tokens so
far with `routed_experts_start_len = r`: it returns positions [r, seqlen - 1), which its own forwards computed
(its prefill re-routes position r, the previously unfed last token, and its decode steps the rest). Rows [0,
r) stay those of the first segment, whose forwards sampled tokens 1..r. The continuation's re-routing of
positions < r (under new weights) is not shipped (nor replayable: one forward has one route per position).
"""

from __future__ import annotations

import base64
import binascii

import numpy as np

ROUTES_DTYPE = np.int32
"""SGLang's (`BaseHostCache`, torch.int32)."""

SERVER_FLAG = "--enable-return-routed-experts"


class RoutesError(ValueError):
    """A reply's `meta_info.routed_experts` does not decode to the shape that was asked for."""


ROUTES_FIELD = "routed_experts"
"""The routes' name everywhere after the engine: the `routed_experts` column (`rollout.columns`) and the
per-position sample field (`[n, num_layers, k]` integer, column = layer id) that the trainer's routers replay
(`train.engine.routing`)."""
ROUTED_FIELD = "routed"
"""Per-position field beside `ROUTES_FIELD`: bool, True where it holds a real route (not the last token)."""


def compact_routes(routes):
    """An engine's int32 `[rows, layers, k]` (numpy or torch) → a torch tensor in the smallest dtype that
    holds the ids: uint8 below 256 experts (Qwen3-MoE has 128), int16 below 32768, else int32. The
    rollout buffer holds layers × k bytes per token instead of 4×. Each sample's dtype is its own largest
    id's; a micro-batch takes the widest of its samples' (`engine.batch._build`). RoutesError for a
    negative id."""
    import torch

    t = torch.from_numpy(np.ascontiguousarray(routes)) if isinstance(routes, np.ndarray) else routes
    if t.numel() and int(t.min()) < 0:  # uint8 would make -1 expert 255
        raise RoutesError(f"expert ids must be ≥ 0; got {int(t.min())}")
    top = int(t.max()) if t.numel() else 0
    dtype = torch.uint8 if top < 256 else torch.int16 if top < 32768 else torch.int32
    return t.to(dtype)


def route_rows(prompt_len: int, output_len: int, start_len: int = 0) -> int:
    """Rows SGLang returns: positions `[start_len, prompt_len + output_len - 1)` (0 if that is empty)."""
    return max(0, prompt_len + output_len - 1 - start_len)


def encode_routes(routes: np.ndarray) -> str:
    """`[rows, layers, k]` expert ids → SGLang's `meta_info.routed_experts` string (base64 of int32 bytes)."""
    array = np.ascontiguousarray(routes, dtype=ROUTES_DTYPE)
    return base64.b64encode(array.tobytes()).decode("ascii")


def decode_routes(encoded: object, rows: int, layers: int, top_k: int, where: str) -> np.ndarray:
    """SGLang's `meta_info.routed_experts` → int32 `[rows, layers, top_k]`; `RoutesError` naming `where`
    (server and sample) when it is not a base64 string of exactly that many int32 values."""
    if not isinstance(encoded, str):
        raise RoutesError(
            f"{where}: meta_info.routed_experts must be a base64 string; got {type(encoded).__name__}"
        )
    try:
        raw = base64.b64decode(encoded, validate=True)
    except (binascii.Error, ValueError) as e:
        raise RoutesError(f"{where}: meta_info.routed_experts is not valid base64 ({e})") from None
    expected = rows * layers * top_k
    itemsize = np.dtype(ROUTES_DTYPE).itemsize
    if len(raw) != expected * itemsize:
        got = len(raw) / itemsize
        raise RoutesError(
            f"{where}: meta_info.routed_experts holds {got:g} int32 values; expected {rows} tokens × "
            f"{layers} layers × top-{top_k} = {expected} (prompt + output − 1 − routed_experts_start_len "
            "tokens, num_hidden_layers, num_experts_per_tok of the served model)"
        )
    return np.frombuffer(raw, dtype=ROUTES_DTYPE).reshape(rows, layers, top_k).copy()


def route_fields(routes, n: int, where: str) -> dict:
    """A sample's engine routes `[n − 1, layers, k]` (n = prompt + response tokens) → its per-position
    fields: routes `[n, layers, k]` (the last row 0) and `routed [n]` bool. ValueError naming `where` when
    the rows do not cover the sample."""
    if routes.dim() != 3 or routes.shape[0] != n - 1:
        raise ValueError(
            f"{where}: routed_experts has shape {tuple(routes.shape)}, expected ({n - 1}, layers, top_k) for "
            f"{n} tokens (one route per position but the last)"
        )
    import torch

    last = torch.zeros((1, *routes.shape[1:]), dtype=routes.dtype)
    routed = torch.ones(n, dtype=torch.bool)
    routed[-1] = False
    return {ROUTES_FIELD: torch.cat([routes, last]), ROUTED_FIELD: routed}
