"""Continuous batching for the local engine, as SGLang's scheduler does it: sequences join and leave the
running batch between decoding steps, so a finished sequence stops costing compute at once and a new one
starts without waiting for the batch's longest.

One scheduler thread owns the running batch: a left-padded KV cache (HF `DynamicCache`, `[B, heads, T,
head_dim]` per layer) with its `[B, T]` attention mask. Each loop: admit waiting sequences (one prefill
of their prompt + what they already generated, left-padded, merged into the running cache along the
batch), run one decoding step for every running sequence, sample each row with its own generator, and
drop finished rows (`batch_select`) and left columns no row uses any more.

Pause modes (SGLang 0.5.23 `PauseGenerationReqInput`, `managers/io_struct.py`; scheduler
`Scheduler.pause_generation`, `managers/scheduler.py`):
- `abort`: every sequence running or waiting ends now with `finish_reason {"type": "abort"}` and what it
  generated so far (with its log-probs); new requests wait until `/continue_generation`.
- `in_place`: the loop stops stepping; the running batch keeps its KV cache (computed with the weights of
  before the pause) and resumes with it.
- `retract`: the running sequences go back to the waiting queue and their KV cache is dropped; after
  `/continue_generation` they are prefilled again (prompt + tokens so far) with the weights of then.
"""

from __future__ import annotations

import functools
import inspect
import logging
import secrets
import threading
import time
from collections import deque
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import torch

from megatron_tail.rollout.local_engine.control import PauseControl
from megatron_tail.rollout.local_engine.kv_cache import Fp8KVCache
from megatron_tail.rollout.local_engine.logit_noise import add_tail_logit_noise_
from megatron_tail.rollout.local_engine.requests import GenerateItem
from megatron_tail.rollout.local_engine.routes import RouteRecorder
from megatron_tail.rollout.local_engine.sglang_defaults import DEFAULT_SAMPLING_MASK_MAX_TOKENS
from megatron_tail.rollout.local_engine.truncation import batch_rule, sample_truncated
from megatron_tail.rollout.processor import load_dvp_processor

logger = logging.getLogger(__name__)

GHOST_FRACTION = 8
"""Finished rows stay in the running batch until they are 1/8 of it (`ContinuousBatcher._compact`)."""
ADMIT_WITHIN_STEPS = 8
"""A waiting row is prefilled at most this many decoding steps after it arrived (`_prefill_now`)."""
STATS_INTERVAL_S = 10.0
"""How often the scheduler logs its throughput while it works (SGLang logs a "Decode batch" line)."""


class Row:
    """One sequence: its request item, what it generated (ids, log-probs, top log-probs), its generator,
    and its finish reason once finished. `epoch`: the abort epoch it was submitted in."""

    def __init__(self, item: GenerateItem, epoch: int, on_finish: Callable[[], None]):
        self.item = item
        self.epoch = epoch
        self.outputs: list[int] = []
        self.logprobs: list[float] = []
        self.top_logprobs: list[list] = []
        self.masks: list[tuple[list[int], float]] = []
        """With `return_sampling_mask`: per output token, (the sampler's support, the token's log-prob
        under the truncated distribution), as SGLang's sampling-mask fields."""
        self.spans: list[list] = []
        """`[[weight_version, first output index], ...]`: which weights sampled which tokens (a row held by
        an in-place or retract pause across a weight update spans two), as SGLang's `WeightVersionSpan`s."""
        self.routes: list[torch.Tensor] = []
        """With a route recorder: int32 `[n, layers, top_k]` chunks, together one row per position fed to a
        forward so far (prompt + outputs but the last; `rollout/routes.py`). A prefill replaces them."""
        self.finish_reason: dict | None = None
        self.error: str | None = None
        """Why the engine could not generate this row (its request is answered with it)."""
        self.error_status = 400
        """The HTTP status of `error`: 400 for the request's own fault, 500 for the engine's."""
        self.processor_error: Exception | None = None
        """What its request's custom logit processor raised at this step (`_apply_processors`): the row
        ends with it, and the batch goes on."""
        self.generator = torch.Generator().manual_seed(
            (secrets.randbits(63) if item.seed is None else item.seed) % (1 << 63)
        )
        self._on_finish = on_finish
        self.cancelled = False
        """Its client went away (`ContinuousBatcher.cancel`): aborted at the next step."""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def finish(self, reason: dict) -> None:
        self.finish_reason = reason
        self._on_finish()

    def append(
        self, token: int, logprob: float, top: list | None, mask, eos_ids: frozenset[int], version: str
    ) -> None:
        if not self.spans or self.spans[-1][0] != version:
            self.spans.append([version, len(self.outputs)])
        self.outputs.append(token)
        self.logprobs.append(logprob)
        if top is not None:
            self.top_logprobs.append(top)
        if self.item.return_sampling_mask:
            self.masks.append(mask)
        item = self.item
        # SGLang's `Req._check_token_based_finish`: ignore_eos ignores the stop token ids too
        if not item.ignore_eos and (token in item.stop_token_ids or token in eos_ids):
            self.finish({"type": "stop", "matched": token})
        elif len(self.outputs) >= item.max_new_tokens:
            self.finish({"type": "length", "length": item.max_new_tokens})


ABORTED = {"type": "abort", "message": "Abort before generation finished (paused)."}


class BatcherStats:
    """The scheduler's counters since its last log line: decoding steps and the rows they ran, prefill
    forwards with their real and padded tokens, and the seconds spent in each."""

    def __init__(self):
        self.logged_at = time.perf_counter()
        self.reset()

    def reset(self) -> None:
        self.decode_steps = self.decode_rows = 0
        self.prefill_forwards = self.prefill_tokens = self.prefill_padded = 0
        self.decode_s = self.prefill_s = 0.0

    def maybe_log(self, running: int, waiting: int) -> None:
        now = time.perf_counter()
        span = now - self.logged_at
        if span < STATS_INTERVAL_S:
            return
        steps = max(self.decode_steps, 1)
        logger.info(
            "decode: %d steps, %.1f rows/step, %.0f tok/s, %.2f ms/step; prefill: %d forwards, %d tokens "
            "(%d padded), %.2f s; busy %.0f%% of %.1f s; #running-req %d, #queue-req %d",
            self.decode_steps, self.decode_rows / steps, self.decode_rows / span,
            1e3 * self.decode_s / steps, self.prefill_forwards, self.prefill_tokens, self.prefill_padded,
            self.prefill_s, 100 * (self.decode_s + self.prefill_s) / span, span, running, waiting,
        )  # fmt: skip
        self.logged_at = now
        self.reset()


class ContinuousBatcher:
    """The scheduler thread. `submit(rows)` queues sequences (the caller waits on its own `on_finish`);
    `close()` stops the thread and aborts what is left."""

    def __init__(self, model, vocab_size: int, eos_ids: frozenset[int], model_lock, control: PauseControl,
                 max_running: int = 256, *, device: torch.device | None = None, fp8_kv_cache: bool = False,
                 logit_noise: float = 0.0, sampling_backend: str = "flashinfer",
                 sampling_mask_max_tokens: int = DEFAULT_SAMPLING_MASK_MAX_TOKENS,
                 recorder: RouteRecorder | None = None,
                 load_processor: Callable[[str], Any] = load_dvp_processor):  # fmt: skip
        self.model = model
        self._cache_kwarg = cache_kwarg(model)
        self.recorder = recorder
        """`--enable-return-routed-experts`: every forward's MoE routes go to its rows (`Row.routes`)."""
        self.device = torch.device("cpu") if device is None else device
        """The model's device: inputs, KV cache and logits live there; sampling runs on the host."""
        self.fp8_kv_cache = fp8_kv_cache
        """SGLang's `--kv-cache-dtype fp8_e4m3` (`kv_cache.py`): every prefill starts an `Fp8KVCache`."""
        self.logit_noise = logit_noise
        """SYNTHETIC mismatch σ (`logit_noise.py`), added to the raw logits before the processor."""
        self.vocab_size = vocab_size
        self.eos_ids = eos_ids
        self.model_lock = model_lock
        self.control = control
        self.max_running = max_running
        self.waiting: deque[Row] = deque()
        self.running: list[Row] = []
        self._cache = None
        self._mask: torch.Tensor | None = None
        """`[B, T]` int64: which cache columns of each running row hold tokens (left padding = 0)."""
        self._closed = False
        batch_rule(sampling_backend, [])  # refuses an unknown backend by name, here and not at the first step
        self.sample = functools.partial(sample_rows, backend=sampling_backend, load_processor=load_processor)
        """`sample_rows` under the engine's sampling backend (`truncation.batch_rule`), or a test's recording
        wrapper of it."""
        self.sampling_mask_max_tokens = sampling_mask_max_tokens
        """SGLang's `--sampling-mask-max-tokens`: a row whose realised support exceeds it is aborted with
        SGLang's message (`_over_cap`)."""
        self.held = False
        """True while a pause holds the loop between decoding steps."""
        self.held_for = 0
        """The `control.pauses` count the loop last held for (after a retract pause, retracted): the current
        pause is in force when it equals the control's and `held` is True (`pause_in_force`)."""
        self.steps = 0
        """Decoding steps run (a step = one forward of the whole running batch)."""
        self.weight_version = ""
        """The loaded weights' version (the engine sets it with each update, under `model_lock`): each
        sampled token records it."""
        self.stats = BatcherStats()
        self._waited_steps = 0
        """Decoding steps run since a row has been waiting (reset at each admission)."""
        self._thread = threading.Thread(target=self._loop, name="local-engine-batcher", daemon=True)
        self._thread.start()

    def submit(self, rows: list[Row]) -> None:
        """Queue `rows`; once closed, they end at once as aborted (nothing would run them)."""
        with self.control.cond:
            if self._closed:
                for row in rows:
                    row.finish(dict(ABORTED))
                return
            self.waiting.extend(rows)
            self.control.cond.notify_all()

    @property
    def alive(self) -> bool:
        """The batch loop runs (not closed, its thread not ended)."""
        return not self._closed and self._thread.is_alive()

    def cancel(self, rows: list[Row]) -> None:
        """End `rows` as aborted at the next step (or now, while paused or idle): their client is gone.
        SGLang aborts a disconnected request too (`TokenizerManager`: "Request is disconnected from the
        client side")."""
        with self.control.cond:
            for row in rows:
                row.cancelled = True
            self.control.cond.notify_all()

    def close(self) -> None:
        with self.control.cond:
            self._closed = True
            self.control.cond.notify_all()
        self._thread.join(timeout=30)

    # --- the scheduler thread -----------------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            with self.control.cond:
                admit = self._next_admissions()
                if admit is None:
                    return
            with torch.inference_mode():
                started = time.perf_counter()
                for chunk in prefill_chunks(admit):
                    try:
                        self._prefill(chunk)
                    except Exception as e:  # e.g. a processor refusing its custom_params: those rows fail
                        self._fail(chunk, e)
                prefilled = time.perf_counter()
                self.stats.prefill_s += prefilled - started
                if self.running:
                    self.stats.decode_rows += len(self.running)
                    try:
                        self._decode_step()
                    except Exception as e:  # the batch's state is unknown now: every running row fails
                        rows, self.running, self._cache, self._mask = self.running, [], None, None
                        self._fail(rows, e)
                    self.stats.decode_s += time.perf_counter() - prefilled
                    self.stats.decode_steps += 1
                self.stats.maybe_log(len(self.running), len(self.waiting))

    def _fail(self, rows: list[Row], error: Exception) -> None:
        """End `rows` with `error`; the loop goes on. A ValueError is a request's fault (a processor refusing
        its custom_params): HTTP 400 with its message. Anything else (the allocator, a bug) is the engine's:
        HTTP 500, which the client retries and the run reports as the engine's, its traceback logged."""
        ours = not isinstance(error, ValueError)
        if ours:
            logger.error("the local engine failed %d rows", len(rows), exc_info=error)
        with self.control.cond:
            for row in rows:
                if not row.finished:
                    row.error = f"{type(error).__name__}: {error}" if ours else str(error)
                    row.error_status = 500 if ours else 400
                    row.finish({"type": "abort", "message": row.error})

    def _next_admissions(self) -> list[Row] | None:
        """Under the control's lock: wait for work while idle or paused (in place / retract); abort what
        an abort pause ends; return the waiting rows to admit now (None: closed)."""
        cond = self.control.cond
        while True:
            if self._closed:
                self._abort_all(lambda _row: True)
                return None
            self._abort_all(lambda row: row.epoch != self.control.abort_epoch or row.cancelled)
            if self.control.paused:
                if self.control.mode == "retract" and self.running:
                    self._retract()
                self.held_for = self.control.pauses  # first: `held` with a stale count is never in force
                self.held = True
                cond.wait()
                self.held = False
                continue
            if self.running or self.waiting:
                break
            cond.wait()
        admit = []
        if self._prefill_now():
            while self.waiting and len(self.running) + len(admit) < self.max_running:
                admit.append(self.waiting.popleft())
            self._waited_steps = 0
        elif self.waiting:
            self._waited_steps += 1
        return admit

    def _prefill_now(self) -> bool:
        """Admit the waiting rows at this step? At once when nothing runs, or when they are at least a
        quarter of the running batch; else after `ADMIT_WITHIN_STEPS` decoding steps. A prefill forward has
        a fixed cost; rows arriving one by one (partial rollouts resubmitted after a weight update, groups
        finishing at different times) would otherwise each pay it between two decoding steps."""
        if not self.waiting:
            return False
        return (
            not self.running
            or 4 * len(self.waiting) >= len(self.running)
            or self._waited_steps >= ADMIT_WITHIN_STEPS
        )

    def _abort_all(self, which) -> None:
        doomed = [r for r in self.running if not r.finished and which(r)]
        if doomed:
            self._keep([i for i, r in enumerate(self.running) if not r.finished and not which(r)])
        for row in doomed + [r for r in self.waiting if which(r)]:
            row.finish(dict(ABORTED))
        self.waiting = deque(r for r in self.waiting if not r.finished)

    def pause_in_force(self) -> bool:
        """The loop holds for the latest pause, having acted on its mode. A pause over a batch another pause
        already holds (an update's `retract` after an `in_place` hold) is not in force until the loop wakes
        and retracts: `held` alone was still True from the first, and a `/continue_generation` before the
        loop woke would have let the rows decode on their old KV cache under the new weights."""
        return self.held and self.held_for == self.control.pauses

    def _retract(self) -> None:
        """Running rows back to the front of the queue; their KV cache is dropped (recomputed at admission
        under whatever weights are loaded then)."""
        self.waiting.extendleft(reversed([r for r in self.running if not r.finished]))
        self.running, self._cache, self._mask = [], None, None

    def _prefill(self, rows: list[Row]) -> None:
        """One left-padded forward of the rows' prompt + generated tokens; sample each row's next token and
        merge the surviving rows' cache into the running batch."""
        sequences = [r.item.input_ids + r.outputs for r in rows]
        length = max(len(s) for s in sequences)
        self.stats.prefill_forwards += 1
        self.stats.prefill_tokens += sum(len(s) for s in sequences)
        self.stats.prefill_padded += length * len(sequences)
        ids = torch.zeros(len(rows), length, dtype=torch.long)
        mask = torch.zeros(len(rows), length, dtype=torch.long)
        for i, s in enumerate(sequences):
            ids[i, length - len(s) :] = torch.tensor(s, dtype=torch.long)
            mask[i, length - len(s) :] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        past = Fp8KVCache() if self.fp8_kv_cache else None
        with self.model_lock:  # the version of the weights this forward ran (an update takes the lock)
            out = self.model(
                input_ids=ids,
                attention_mask=mask,
                position_ids=positions,
                use_cache=True,
                **{self._cache_kwarg: past},
            )
            version = self.weight_version
        if self.recorder is not None:  # every position of the sequence is (re)routed by this forward
            routed = self.recorder.take(len(rows), length)
            for i, (row, s) in enumerate(zip(rows, sequences, strict=True)):
                row.routes = [routed[i, length - len(s) :]]
        self._sample_into(rows, out.logits[:, -1, : self.vocab_size].float(), version)
        alive = [i for i, r in enumerate(rows) if not r.finished]
        if not alive:
            return
        cache = cache_out(out)
        if len(alive) < len(rows):
            cache.batch_select_indices(torch.tensor(alive, device=self.device))
            mask = mask[alive]
        self._merge(cache, mask, [rows[i] for i in alive])

    def _merge(self, cache, mask: torch.Tensor, rows: list[Row]) -> None:
        if not self.running:
            self._cache, self._mask, self.running = cache, mask, rows
            return
        width = max(self._mask.shape[1], mask.shape[1])
        for mine, theirs in zip(self._cache.layers, cache.layers, strict=True):
            mine.keys = torch.cat([_left_pad(mine.keys, width), _left_pad(theirs.keys, width)])
            mine.values = torch.cat([_left_pad(mine.values, width), _left_pad(theirs.values, width)])
        self._mask = torch.cat([_left_pad_mask(self._mask, width), _left_pad_mask(mask, width)])
        self.running = self.running + rows

    def _decode_step(self) -> None:
        rows = self.running
        ids = torch.tensor([[r.outputs[-1]] for r in rows], dtype=torch.long, device=self.device)
        positions = self._mask.sum(-1, keepdim=True)  # each row's next position: its tokens so far
        self._mask = torch.cat([self._mask, torch.ones_like(self._mask[:, :1])], dim=-1)
        with self.model_lock:
            out = self.model(
                input_ids=ids,
                attention_mask=self._mask,
                position_ids=positions,
                use_cache=True,
                **{self._cache_kwarg: self._cache},
            )
            version = self.weight_version
        self._cache = cache_out(out)
        self.steps += 1
        if self.recorder is not None:  # the route of each row's last token, the input of this step
            routed = self.recorder.take(len(rows), 1)
            for i, row in enumerate(rows):
                if not row.finished:
                    row.routes.append(routed[i])
        logits = out.logits[:, -1, : self.vocab_size].float()
        with self.control.cond:  # a row finishing wakes its waiter: under the lock, like every state change
            live = [i for i, r in enumerate(rows) if not r.finished]
            if len(live) == len(rows):
                self._sample_into(rows, logits, version)
            else:  # finished rows still in the batch (`_compact`): computed, not sampled
                live_logits = logits[torch.tensor(live, device=logits.device)]
                self._sample_into([rows[i] for i in live], live_logits, version)
            self._compact()

    def _compact(self) -> None:
        """Drop finished rows from the batch once they are `1 / GHOST_FRACTION` of it (or all of it). Each
        compaction copies the whole KV cache (`batch_select_indices`); doing it whenever one row finished
        cost about a millisecond per decoding step at 80 rows, a finished row left in the batch for a few
        steps costs one row of compute."""
        live = [i for i, r in enumerate(self.running) if not r.finished]
        ghosts = len(self.running) - len(live)
        if ghosts and (not live or ghosts * GHOST_FRACTION >= len(self.running)):
            self._keep(live)

    def _keep(self, indices: list[int]) -> None:
        """Keep only these running rows; drop the cache's left columns no kept row uses."""
        if len(indices) == len(self.running):
            return
        self.running = [self.running[i] for i in indices]
        if not self.running:
            self._cache, self._mask = None, None
            return
        index = torch.tensor(indices, device=self.device)
        self._cache.batch_select_indices(index)
        self._mask = self._mask[index]
        unused = int((self._mask.sum(0) == 0).long().cumprod(0).sum())
        if unused:
            for layer in self._cache.layers:
                layer.keys, layer.values = layer.keys[..., unused:, :], layer.values[..., unused:, :]
            self._mask = self._mask[:, unused:]

    def _sample_into(self, rows: list[Row], logits: torch.Tensor, version: str) -> None:
        """Sample each row's next token from `logits`, which weights `version` computed (read with the
        forward, under `model_lock`: an update between the forward and here must not stamp it)."""
        if self.logit_noise:  # synthetic mismatch, where numerical error sits: before the processor
            for i, row in enumerate(rows):
                add_tail_logit_noise_(logits[i], self.logit_noise, row.generator)
        tokens, logprobs, top, masks = self.sample(rows, logits)
        for row, token, logprob, best, mask in zip(rows, tokens, logprobs, top, masks, strict=True):
            if row.processor_error is not None:
                self._processor_failed(row)
                continue
            if (
                mask is not None
                and row.item.return_sampling_mask
                and len(mask[0]) > self.sampling_mask_max_tokens
            ):
                self._over_cap(row)
                continue
            row.append(token, logprob, best, mask, self.eos_ids, version)

    def _processor_failed(self, row: Row) -> None:
        """End `row` whose request's processor raised (HTTP 400: the request's fault). The message names
        the exception's type only: its text may hold the parameters of every row the processor was given,
        other requests' among them (SGLang's DisallowedTokensLogitsProcessor asserts with the whole list),
        so it goes to the engine's log."""
        error = row.processor_error
        logger.warning("a custom logit processor raised on request %s: %r", row.item.rid, error)
        row.error = (
            f"the request's custom_logit_processor raised {type(error).__name__} (its message is in the "
            "engine's log)"
        )
        row.finish({"type": "abort", "message": row.error, "status_code": 400, "err_type": "BadRequestError"})

    def _over_cap(self, row: Row) -> None:
        """End `row` as SGLang ends a request whose support exceeds the cap (status OVERFLOW): the token is
        not appended and the request answers HTTP 400 with SGLang's message
        (`batch_result_processor.get_sampling_mask_finish_reason`)."""
        row.error = (
            f"Sampling support exceeds --sampling-mask-max-tokens={self.sampling_mask_max_tokens}, commonly "
            "because of cutoff ties. Lower top_k to leave more headroom or increase the server limit."
        )
        row.finish({"type": "abort", "message": row.error, "status_code": 400, "err_type": "BadRequestError"})


PREFILL_FORWARD_TOKENS = 256
"""The fixed cost of one prefill forward, in padded tokens' worth of compute: measured on CPU with the
benchmark's model, a forward costs ≈ 2.4 ms before its tokens and ≈ 10 µs per (padded) token."""


def prefill_chunks(rows: list[Row], forward_tokens: int = PREFILL_FORWARD_TOKENS) -> list[list[Row]]:
    """The admitted rows in prefill forwards of the least cost: sorted by length (prompt + tokens so far)
    and cut where `forward_tokens` + Σ over chunks of rows × longest is smallest (exact, by dynamic
    programming over the cut points). SGLang's prefill is ragged (no padding); a left-padded one that put
    every admitted row in one forward would pad them all to the longest, e.g. partial rollouts resubmitted
    with 250 tokens beside new 12-token prompts, and one forward per row would pay the fixed cost each."""
    ordered = sorted(rows, key=lambda r: len(r.item.input_ids) + len(r.outputs))
    lengths = [len(r.item.input_ids) + len(r.outputs) for r in ordered]
    n = len(ordered)
    best = [0.0] + [float("inf")] * n  # best[j]: the cost of the first j rows
    cut = [0] * (n + 1)
    for j in range(1, n + 1):
        for i in range(j):  # rows i..j-1 in one forward, padded to lengths[j-1]
            cost = best[i] + forward_tokens + (j - i) * lengths[j - 1]
            if cost < best[j]:
                best[j], cut[j] = cost, i
    chunks = []
    j = n
    while j > 0:
        chunks.append(ordered[cut[j] : j])
        j = cut[j]
    return chunks[::-1]


def _left_pad(x: torch.Tensor, width: int) -> torch.Tensor:
    """`[B, H, T, D]` → `[B, H, width, D]` with zeros on the left."""
    missing = width - x.shape[-2]
    if missing == 0:
        return x
    return torch.cat([x.new_zeros(*x.shape[:-2], missing, x.shape[-1]), x], dim=-2)


def _left_pad_mask(mask: torch.Tensor, width: int) -> torch.Tensor:
    missing = width - mask.shape[1]
    return mask if missing == 0 else torch.cat([mask.new_zeros(mask.shape[0], missing), mask], dim=1)


def sample_rows(
    rows: list[Row],
    logits: torch.Tensor,
    backend: str = "flashinfer",
    load_processor: Callable[[str], Any] = load_dvp_processor,
):
    """`(tokens [B] list of int, logprobs [B] list of float, top [B] of [[logprob, id], ...] | None,
    masks [B] of (support ids, truncated log-prob) | None)` of one step, in SGLang's sampler order: custom
    logit processor → ÷ T → log-softmax → sample with the row's own generator (greedy, T = 0: argmax,
    log-probs of the processed logits at T = 1; top_k / top_p / min_p: SGLang's truncation under
    `backend`, `truncation.py`). The rows are one SGLang forward batch: under flashinfer, one row with
    min_p > 0 moves every truncating row to the "renorm" rule (`truncation.batch_rule`). `logits` `[B, V]`
    fp32 on the model's device, processed in place there; the draw runs on the host with each row's CPU
    generator, so a seed draws the same tokens on any device. Row-wise math runs batched; only the draw
    is per row."""
    rule = batch_rule(backend, [r.item.truncation for r in rows])
    _apply_processors(rows, logits, load_processor)
    logits = logits.cpu()
    temperatures = torch.tensor([[r.item.temperature or 1.0] for r in rows], dtype=logits.dtype)
    row_logprobs = torch.log_softmax(logits / temperatures, dim=-1)
    tokens = torch.argmax(logits, dim=-1)
    probs = None
    masks: list[tuple[list[int], float] | None] = [None] * len(rows)
    plain: list[int] = []
    for i, row in enumerate(rows):
        if row.item.temperature == 0.0:
            masks[i] = ([int(tokens[i])], 0.0)  # SGLang's `_build_greedy_sampling_mask_output`
            continue
        probs = row_logprobs.exp() if probs is None else probs
        if row.item.truncation.active:
            token, support, selected = sample_truncated(probs[i], row.item.truncation, row.generator, rule)
            tokens[i], masks[i] = token, (support, selected)
        else:
            plain.append(i)
    if plain:
        index = torch.tensor(plain)
        tokens[index] = draw_categorical(probs[index], [rows[i].generator for i in plain])
    # SGLang's `compute_logprobs` clamps to the dtype's min: a pruned token's −inf is no JSON number
    row_logprobs.clamp_(min=torch.finfo(row_logprobs.dtype).min)
    logprobs = row_logprobs.gather(1, tokens[:, None])[:, 0]
    top: list[list[list] | None] = [None] * len(rows)
    k = max(r.item.top_logprobs_num for r in rows)
    if k:
        values, ids = (t.tolist() for t in torch.topk(row_logprobs, k, dim=-1))
        for i, row in enumerate(rows):
            n = row.item.top_logprobs_num
            if n:
                top[i] = [[v, t] for v, t in zip(values[i][:n], ids[i][:n], strict=True)]
    return tokens.tolist(), logprobs.tolist(), top, masks


def draw_categorical(probs: torch.Tensor, generators: list[torch.Generator]) -> torch.Tensor:
    """`[B]` int64: row b's token drawn from `probs[b]` (`[B, V]`, zeros where the processor masked) with
    `generators[b]`, exactly as `torch.multinomial(probs[b], 1, generator=generators[b])` draws it (ATen's
    single-sample path: argmax of p / q with q ~ Exp(1) from the generator, the Gumbel-max trick; the same
    tokens for the same seeds), but with one division and one argmax for the whole batch, as SGLang's
    sampler is one kernel for the batch. A `torch.multinomial` per row made the local engine's decoding
    step grow ~25 µs per running sequence (most of the step at 64 sequences), which a GPU sampler does not."""
    q = torch.empty_like(probs)
    for row, generator in zip(q, generators, strict=True):
        row.exponential_(1, generator=generator)
    return torch.argmax(probs / q, dim=-1)


def _apply_processors(rows: list[Row], logits: torch.Tensor, load_processor: Callable[[str], Any]) -> None:
    """Run each request's custom logit processor (`load_processor(its to_str() string)`) on its rows, as
    SGLang's `apply_custom_logit_processor`."""
    rows_by_processor: dict[str, list[int]] = {}
    for i, row in enumerate(rows):
        if row.item.processor is not None:
            rows_by_processor.setdefault(row.item.processor, []).append(i)
    for serialized, indices in rows_by_processor.items():
        index = torch.tensor(indices, dtype=torch.long, device=logits.device)
        try:
            processor = load_processor(serialized)
            params = [with_request(rows[i].item, rows[i].outputs) for i in indices]
            result = processor(logits.index_select(0, index), params)
            if not isinstance(result, torch.Tensor) or result.shape != (len(indices), logits.shape[1]):
                raise TypeError(f"it returned {type(result).__name__}, not [{len(indices)}, V] logits")
            logits.index_copy_(0, index, result.to(logits.dtype))
        except torch.OutOfMemoryError:  # the engine's memory, not the request's fault: the batch's error
            raise
        # A processor is the request's code: what it raises ends the rows it was given (`Row.
        # processor_error`), not every row of the batch; their logits stay as they were.
        except Exception as e:
            for i in indices:
                rows[i].processor_error = e


def with_request(item: GenerateItem, output_ids: list[int]) -> dict[str, Any] | None:
    """custom_params plus the `__req__` view SGLang passes (prompt, output so far, sampling params)."""
    if item.custom_params is None:
        return None
    temperature = 1.0 if item.temperature == 0.0 else item.temperature
    req = SimpleNamespace(
        origin_input_ids=item.input_ids,
        output_ids=output_ids,
        sampling_params=SimpleNamespace(temperature=temperature, custom_params=item.custom_params),
    )
    return {**item.custom_params, "__req__": req}


def cache_kwarg(model) -> str:
    """The name the model's forward takes its KV cache by: "cache" from transformers 5.2x (its models mark
    `past_key_values` deprecated, to be removed in 5.40: `deprecate_kwarg("past_key_values", "5.40.0",
    new_name="cache")`), "past_key_values" before."""
    return "cache" if "cache" in inspect.signature(type(model).forward).parameters else "past_key_values"


def cache_out(out):
    """The KV cache a forward returned: `cache` in transformers 5.2x's outputs, `past_key_values` before."""
    return out["cache"] if "cache" in out.keys() else out.past_key_values
