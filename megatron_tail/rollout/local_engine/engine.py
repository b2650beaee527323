"""The local engine's model side: HF transformers on CPU (or a CUDA device, `device=`), a KV-cached
sampling loop, weight loading.

Sequences are batched continuously (`batcher.py`). Per decoding step, mirroring SGLang's sampler order:
raw logits (cast to fp32) → custom logit processor (the DVP safe set) → divide by T → log-softmax →
sample with the sample's own `torch.Generator` (seeded by `sampling_seed`) → return the log-prob of the
sampled token. Greedy requests (T = 0) take the argmax and return log-softmax of the processed logits
at T = 1, as SGLang does. A request with top_k / top_p / min_p draws from SGLang's truncation
(`truncation.py`) under `sampling_backend` ("flashinfer", SGLang's CUDA default, or "pytorch", what
`--enable-deterministic-inference` forces: they keep different supports when top-p meets min-p in a batch)
and, with `return_sampling_mask`, also returns each token's support and its log-prob under the truncated
distribution; a support above `sampling_mask_max_tokens` fails its request as SGLang's does.
The model runs in the dtype given (bf16 by default), so its log-probs differ from the trainer's fp32
ones the way a real inference engine's do; with `quantization="fp8"` its linear layers also run in FP8 as
SGLang's `--quantization fp8` does (`local_engine/fp8.py`), re-quantized after every weight update;
"fp8_tensor" and "nvfp4_a16" (`local_engine/fp4.py`) are SGLang's per-tensor FP8 and NVFP4 weight formats,
`kv_cache_dtype="fp8_e4m3"` its FP8 KV cache (`local_engine/kv_cache.py`), and `logit_noise` a synthetic
mismatch (`local_engine/logit_noise.py`) added to the raw logits before the processor.
`enable_return_routed_experts` (SGLang's `--enable-return-routed-experts`) records an MoE model's routes in
every forward (`local_engine/routes.py`) and returns them as SGLang's `meta_info.routed_experts`.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import torch

from megatron_tail.rollout.local_engine.attention import ROW_INVARIANT_SDPA
from megatron_tail.rollout.local_engine.batcher import ContinuousBatcher, Row
from megatron_tail.rollout.local_engine.control import PauseControl
from megatron_tail.rollout.local_engine.formats import QUANTIZATIONS, quantize_linears_, requantize_
from megatron_tail.rollout.local_engine.kv_cache import KV_CACHE_DTYPES
from megatron_tail.rollout.local_engine.requests import GenerateItem
from megatron_tail.rollout.local_engine.routes import RouteRecorder
from megatron_tail.rollout.local_engine.sglang_defaults import (
    DEFAULT_SAMPLING_MASK_MAX_TOKENS,
    SAMPLING_BACKENDS,
)
from megatron_tail.rollout.local_engine.weights import load_named_tensors_, read_safetensors_dir
from megatron_tail.rollout.processor import load_custom_logit_processor, load_dvp_processor
from megatron_tail.rollout.routes import encode_routes
from megatron_tail.utils.eos import eos_id_entries

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


class LocalEngine:
    """A causal LM from a local HF directory (config.json + safetensors [+ tokenizer files]).

    Thread-safe: generations from any thread join one continuously batched decode (`batcher.py`, up to
    `max_running` sequences per step); its forwards and the weight updates take `model_lock`, so no
    forward step ever sees half-loaded weights.
    """

    def __init__(
        self,
        model_path: str | Path,
        dtype: str = "bfloat16",
        weight_version: str = "default",
        quantization: str = "none",
        device: str = "cpu",
        sampling_mask_max_tokens: int = DEFAULT_SAMPLING_MASK_MAX_TOKENS,
        kv_cache_dtype: str = "auto",
        logit_noise: float = 0.0,
        max_running: int = 256,
        sampling_backend: str = "flashinfer",
        enable_return_routed_experts: bool = False,
        enable_custom_logit_processor: bool = False,
    ):
        from transformers import AutoConfig, AutoModelForCausalLM

        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}; got {dtype!r}")
        if quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {QUANTIZATIONS}; got {quantization!r}")
        self.device = _check_device(device)
        if kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}; got {kv_cache_dtype!r}")
        if not logit_noise >= 0.0:
            raise ValueError(f"logit_noise must be ≥ 0; got {logit_noise!r}")
        if sampling_backend not in SAMPLING_BACKENDS:
            raise ValueError(f"sampling_backend must be one of {SAMPLING_BACKENDS}; got {sampling_backend!r}")
        if not isinstance(sampling_mask_max_tokens, int) or sampling_mask_max_tokens <= 0:
            raise ValueError(
                f"--sampling-mask-max-tokens must be positive (got {sampling_mask_max_tokens!r})."
            )
        self.sampling_mask_max_tokens = sampling_mask_max_tokens
        self.model_path = str(model_path)
        self.dtype_name = dtype
        config = AutoConfig.from_pretrained(self.model_path, local_files_only=True)
        self.model = AutoModelForCausalLM.from_pretrained(
            self.model_path,
            config=config,
            dtype=DTYPES[dtype],
            local_files_only=True,
            attn_implementation=ROW_INVARIANT_SDPA,  # a row's tokens do not depend on its batch
        ).eval()
        self.model.to(self.device)
        self.quantization = quantization
        if quantization != "none":
            quantize_linears_(self.model, quantization)
        self.tokenizer = _load_tokenizer(self.model_path)
        self.vocab_size = int(config.vocab_size)
        self.context_length = int(config.max_position_embeddings)
        self.eos_token_ids = _eos_ids(self.model, self.tokenizer)
        self.model_lock = threading.Lock()
        self.control = PauseControl()
        self.load_processor = (
            load_custom_logit_processor if enable_custom_logit_processor else load_dvp_processor
        )
        """How a request's `custom_logit_processor` is loaded, at admission (`server._check_processors`) and
        at each step (the batcher): `enable_custom_logit_processor`'s choice."""
        self.batcher = ContinuousBatcher(
            self.model,
            self.vocab_size,
            self.eos_token_ids,
            self.model_lock,
            self.control,
            max_running,
            device=self.device,
            fp8_kv_cache=kv_cache_dtype == "fp8_e4m3",
            logit_noise=float(logit_noise),
            sampling_backend=sampling_backend,
            sampling_mask_max_tokens=sampling_mask_max_tokens,
            recorder=RouteRecorder(self.model) if enable_return_routed_experts else None,
            load_processor=self.load_processor,
        )
        self.enable_custom_logit_processor = enable_custom_logit_processor
        """SGLang's `--enable-custom-logit-processor`: run any processor a request sends (its class is
        unpickled and run); without it only the DVP processor (`processor.load_dvp_processor`)."""
        self.weight_version = str(weight_version)

    @property
    def weight_version(self) -> str:
        """The loaded weights' version (SGLang's `weight_version`); the batcher stamps each token with it."""
        return self.batcher.weight_version

    @weight_version.setter
    def weight_version(self, version: str) -> None:
        self.batcher.weight_version = str(version)

    def close(self) -> None:
        """Stop the batcher thread (what is still generating ends as aborted)."""
        self.batcher.close()

    def tokenize(self, text: str) -> list[int]:
        """A `text` prompt's ids as SGLang makes them (`TokenizerManager._tokenize_texts`: `encode`, whose
        special tokens are on: a Llama tokenizer's BOS; Qwen's add none)."""
        return self.tokenizer.encode(text)

    def generate(self, items: list[GenerateItem]) -> list[dict[str, Any]]:
        """Generate every item (blocking); return SGLang-shaped `{"text", "output_ids", "meta_info"}`."""
        started = time.monotonic()
        done = threading.Event()
        rows = self.submit(items, self.control.wait_until_running(), done.set)
        done.wait()
        raise_row_errors(rows)
        return [self.output(row, started) for row in rows]

    def submit(self, items: list[GenerateItem], epoch: int, on_done) -> list[Row]:
        """Queue `items` in the continuous batch as one generation of abort epoch `epoch` (from
        `control.wait_until_running()`, which registered it); `on_done()` runs on the batcher's thread
        once every row has finished (or was aborted)."""
        remaining = [len(items)]

        def finished_one() -> None:  # on the batcher's thread only
            remaining[0] -= 1
            if remaining[0] == 0:
                self.control.done()
                on_done()

        rows = [Row(item, epoch, finished_one) for item in items]
        self.batcher.submit(rows)
        return rows

    def output(self, row: Row, started: float) -> dict[str, Any]:
        """A finished row as SGLang returns it (an aborted row: what it generated before the abort)."""
        item, output_ids = row.item, row.outputs
        meta: dict[str, Any] = {
            "id": item.rid,
            "finish_reason": row.finish_reason,
            "prompt_tokens": len(item.input_ids),
            "completion_tokens": len(output_ids),
            "cached_tokens": 0,
            # the version that made its last token, as SGLang's add_weight_versions_to_meta_info reports it
            # (utils/weight_versions.py); the engine's version now only for a row without tokens. Before, a
            # row finished just before an update and answered after it read as the new version's
            "weight_version": row.spans[-1][0] if row.spans else self.weight_version,
            "e2e_latency": time.monotonic() - started,
        }
        if len(row.spans) > 1:  # SGLang's add_weight_versions_to_meta_info (utils/weight_versions.py)
            ends = [start for _, start in row.spans[1:]] + [len(output_ids)]
            meta["weight_versions"] = [
                {"version": v, "start": start, "end": end}
                for (v, start), end in zip(row.spans, ends, strict=True)
            ]
            meta["weight_version"] = row.spans[-1][0]
        if item.return_logprob:
            meta["input_token_logprobs"] = []
            meta["output_token_logprobs"] = [
                [lp, tok, None] for lp, tok in zip(row.logprobs, output_ids, strict=True)
            ]
            meta["output_token_logprobs_length"] = len(output_ids)
            if item.top_logprobs_num:
                # SGLang's nested format: per output position, [[logprob, token_id, text], ...]
                meta["input_top_logprobs"] = []
                meta["output_top_logprobs"] = [
                    [[lp, tok, None] for lp, tok in top] for top in row.top_logprobs
                ]
        if item.return_sampling_mask:  # SGLang's tokenizer_manager.py: three meta_info fields
            meta["output_token_sampling_mask"] = [support for support, _ in row.masks]
            meta["output_token_sampling_logprobs"] = [selected for _, selected in row.masks]
            meta["output_token_sampling_mask_length"] = len(row.masks)
        if item.return_routed_experts and self.batcher.recorder is not None:
            routes = _routes_of(row)
            if routes is not None:
                meta["routed_experts"] = encode_routes(routes)
        text = None
        if self.tokenizer is not None:
            text = self.tokenizer.decode(output_ids, skip_special_tokens=item.skip_special_tokens)
        return {"text": text, "output_ids": output_ids, "meta_info": meta}

    def update_weights_from_disk(self, model_path: str, weight_version: str | None = None) -> str:
        """Load every safetensors file of `model_path` into the model; return a message."""
        tensors = read_safetensors_dir(model_path)
        with self.model_lock:
            load_named_tensors_(self.model, tensors.items(), require_all=True)
            if self.quantization != "none":
                requantize_(self.model)
            self.model_path = str(model_path)
            if weight_version is not None:
                self.weight_version = str(weight_version)
        return f"Loaded {len(tensors)} tensors from {model_path}."

    def load_named_tensors(self, named_tensors, weight_version: str | None = None) -> None:
        """Copy `(hf_name, tensor)` pairs into the model (a partial update is allowed)."""
        named_tensors = list(named_tensors)
        with self.model_lock:
            load_named_tensors_(self.model, named_tensors, require_all=False)
            if self.quantization != "none":
                requantize_(self.model, [name for name, _ in named_tensors])
            if weight_version is not None:
                self.weight_version = str(weight_version)


def _routes_of(row: Row):
    """int32 `[seqlen − 1 − start, layers, k]` for SGLang's `meta_info.routed_experts` (start clamped to
    seqlen − 1, as `BaseTopkCapturer.get_topk`); None for a row aborted before its first forward (SGLang
    returns none for a request aborted in its waiting queue)."""
    seqlen = len(row.item.input_ids) + len(row.outputs)
    routes = torch.cat(row.routes) if row.routes else None
    if routes is None or len(routes) != seqlen - 1:
        return None
    start = min(row.item.routed_experts_start_len, seqlen - 1)
    return routes[start:].numpy()


class RowError(ValueError):
    """A row the engine could not generate: `status` 400 (the request's fault) or 500 (the engine's)."""

    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status


def raise_row_errors(rows: list[Row]) -> None:
    """`RowError` with the first failed row's error and status, if the engine could not generate a row."""
    failed = [row for row in rows if row.error is not None]
    if failed:
        raise RowError(failed[0].error, failed[0].error_status)


def _load_tokenizer(path: str):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError):
        return None


def _eos_ids(model, tokenizer) -> frozenset[int]:
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), model.config, tokenizer):
        value = getattr(source, "eos_token_id", None) if source is not None else None
        if isinstance(value, (list, tuple)):
            ids.update(int(v) for v in eos_id_entries(value))
        elif isinstance(value, int):
            ids.add(value)
    return frozenset(ids)


def _check_device(device: str) -> torch.device:
    """`device` as a torch.device; a CUDA device where CUDA is absent is refused by name."""
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device must be a torch device such as 'cpu' or 'cuda:0'; got {device!r}") from None
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r}: CUDA is not available on this host")
    return resolved
