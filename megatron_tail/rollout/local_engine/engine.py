"""The local engine's model side: HF transformers on CPU (or a CUDA device, `device=`), a KV-cached
sampling loop, weight loading.

Per decoding step, mirroring SGLang's sampler order: raw logits (cast to fp32) → custom logit processor
(the DVP safe set) → divide by T → log-softmax → sample with the sample's own `torch.Generator`
(seeded by `sampling_seed`) → return the log-prob of the sampled token. Greedy requests (T = 0) take
the argmax and return log-softmax of the processed logits at T = 1, as SGLang does. A request with
top_k / top_p / min_p draws from SGLang's truncation (`truncation.py`) and, with `return_sampling_mask`,
also returns each token's support and its log-prob under the truncated distribution.
The model runs in the dtype given (bf16 by default), so its log-probs differ from the trainer's fp32
ones the way a real inference engine's do; with `quantization="fp8"` its linear layers also run in FP8 as
SGLang's `--quantization fp8` does (`local_engine/fp8.py`), re-quantized after every weight update;
"fp8_tensor" and "nvfp4_a16" (`local_engine/fp4.py`) are SGLang's per-tensor FP8 and NVFP4 weight formats,
`kv_cache_dtype="fp8_e4m3"` its FP8 KV cache (`local_engine/kv_cache.py`), and `logit_noise` a synthetic
mismatch (`local_engine/logit_noise.py`) added to the raw logits before the processor.
"""

from __future__ import annotations

import secrets
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from megatron_tail.rollout.local_engine.control import PauseControl
from megatron_tail.rollout.local_engine.formats import QUANTIZATIONS, quantize_linears_, requantize_
from megatron_tail.rollout.local_engine.kv_cache import KV_CACHE_DTYPES, Fp8KVCache
from megatron_tail.rollout.local_engine.logit_noise import add_tail_logit_noise_
from megatron_tail.rollout.local_engine.requests import GenerateItem
from megatron_tail.rollout.local_engine.truncation import DEFAULT_SAMPLING_MASK_MAX_TOKENS, sample_truncated
from megatron_tail.rollout.local_engine.weights import load_named_tensors_, read_safetensors_dir
from megatron_tail.rollout.processor import load_custom_logit_processor

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


class LocalEngine:
    """A causal LM from a local HF directory (config.json + safetensors [+ tokenizer files]).

    Thread-safe: generations from several threads interleave step by step under `model_lock`;
    weight updates take the same lock, so no forward step ever sees half-loaded weights.
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
        self.kv_cache_dtype = kv_cache_dtype
        self.logit_noise = float(logit_noise)
        self.model_path = str(model_path)
        self.dtype_name = dtype
        config = AutoConfig.from_pretrained(self.model_path, local_files_only=True)
        self.model = AutoModelForCausalLM.from_pretrained(
            self.model_path, config=config, dtype=DTYPES[dtype], local_files_only=True
        ).eval()
        self.model.to(self.device)
        self.quantization = quantization
        if not isinstance(sampling_mask_max_tokens, int) or sampling_mask_max_tokens <= 0:
            raise ValueError(
                f"--sampling-mask-max-tokens must be positive (got {sampling_mask_max_tokens!r})."
            )
        self.sampling_mask_max_tokens = sampling_mask_max_tokens
        if quantization != "none":
            quantize_linears_(self.model, quantization)
        self.tokenizer = _load_tokenizer(self.model_path)
        self.vocab_size = int(config.vocab_size)
        self.context_length = int(config.max_position_embeddings)
        self.eos_token_ids = _eos_ids(self.model, self.tokenizer)
        self.weight_version = str(weight_version)
        self.model_lock = threading.Lock()
        self.control = PauseControl()

    def tokenize(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    @torch.inference_mode()
    def generate(self, items: list[GenerateItem]) -> list[dict[str, Any]]:
        """Generate every item; return SGLang-shaped outputs `{"text", "output_ids", "meta_info"}`."""
        started = time.monotonic()
        epoch = self.control.wait_until_running()
        try:
            state = self._decode(items, epoch)
        finally:
            self.control.done()
        return [self._output(item, state, i, started) for i, item in enumerate(items)]

    def _decode(self, items: list[GenerateItem], epoch: int) -> _DecodeState:
        state = _DecodeState(items, self.eos_token_ids)
        ids, mask = (t.to(self.device) for t in _left_pad(items))
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        past = Fp8KVCache() if self.kv_cache_dtype == "fp8_e4m3" else None
        while not state.all_finished():
            if self.control.checkpoint(epoch):
                state.abort_unfinished()
                break
            with self.model_lock:
                out = self.model(
                    input_ids=ids,
                    attention_mask=mask,
                    position_ids=positions,
                    past_key_values=past,
                    use_cache=True,
                )
            past = out.past_key_values
            logits = out.logits[:, -1, : self.vocab_size].float()
            if self.logit_noise:  # synthetic mismatch, where numerical error sits: before the processor
                for i in range(len(items)):
                    if not state.finished[i]:
                        add_tail_logit_noise_(logits[i], self.logit_noise, state.generators[i])
            _apply_processors(items, logits, state)  # on the model's device, as SGLang's processors run
            # Sampling on the host, with each request's CPU generator: the same seed draws the same tokens
            # from the same probabilities on any device (a CUDA generator would draw differently).
            state.step(self._sample(items, logits.cpu(), state))
            ids = state.last_tokens().unsqueeze(-1).to(self.device)
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=-1)
            positions = positions[:, -1:] + 1
        return state

    def _sample(self, items: list[GenerateItem], logits: torch.Tensor, state: _DecodeState):
        """`(tokens [B] int64, logprobs [B] fp32, top [B] of [[logprob, id], ...] | None)` of one step;
        `logits` `[B, V]` fp32 on the host, after the custom logit processors. `top[i]` holds item i's
        `top_logprobs_num` most probable tokens of the same distribution the token was drawn from (None
        for k = 0)."""
        tokens = torch.empty(len(items), dtype=torch.long)
        logprobs = torch.empty(len(items), dtype=torch.float32)
        top: list[list[list] | None] = [None] * len(items)
        masks: list[tuple[list[int], float] | None] = [None] * len(items)
        for i, item in enumerate(items):
            if state.finished[i]:
                tokens[i], logprobs[i] = 0, 0.0
                continue
            if item.temperature == 0.0:
                row_logprobs = torch.log_softmax(logits[i], dim=-1)
                token = int(torch.argmax(logits[i]))
                masks[i] = ([token], 0.0)  # SGLang's `_build_greedy_sampling_mask_output`
            elif item.truncation.active:
                row_logprobs = torch.log_softmax(logits[i] / item.temperature, dim=-1)
                probs = torch.softmax(logits[i] / item.temperature, dim=-1)
                token, support, selected = sample_truncated(probs, item.truncation, state.generators[i])
                masks[i] = (support, selected)
            else:
                row_logprobs = torch.log_softmax(logits[i] / item.temperature, dim=-1)
                token = int(torch.multinomial(row_logprobs.exp(), 1, generator=state.generators[i]))
            tokens[i], logprobs[i] = token, row_logprobs[token]
            if item.top_logprobs_num:
                values, ids = torch.topk(row_logprobs, item.top_logprobs_num)
                top[i] = [[float(v), int(t)] for v, t in zip(values, ids, strict=True)]
        return tokens, logprobs, top, masks

    def _output(self, item: GenerateItem, state: _DecodeState, i: int, started: float) -> dict[str, Any]:
        output_ids = state.outputs[i]
        meta: dict[str, Any] = {
            "id": item.rid,
            "finish_reason": state.finish_reasons[i],
            "prompt_tokens": len(item.input_ids),
            "completion_tokens": len(output_ids),
            "cached_tokens": 0,
            "weight_version": self.weight_version,
            "e2e_latency": time.monotonic() - started,
        }
        if item.return_logprob:
            meta["input_token_logprobs"] = []
            meta["output_token_logprobs"] = [
                [lp, tok, None] for lp, tok in zip(state.logprobs[i], output_ids, strict=True)
            ]
            meta["output_token_logprobs_length"] = len(output_ids)
            if item.top_logprobs_num:
                # SGLang's nested format: per output position, [[logprob, token_id, text], ...]
                meta["input_top_logprobs"] = []
                meta["output_top_logprobs"] = [
                    [[lp, tok, None] for lp, tok in row] for row in state.top_logprobs[i]
                ]
        if item.return_sampling_mask:  # SGLang's tokenizer_manager.py: three meta_info fields
            meta["output_token_sampling_mask"] = [support for support, _ in state.masks[i]]
            meta["output_token_sampling_logprobs"] = [selected for _, selected in state.masks[i]]
            meta["output_token_sampling_mask_length"] = len(state.masks[i])
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


class _DecodeState:
    """Per-sample outputs, log-probs, finish reasons and generators of one `generate` call."""

    def __init__(self, items: list[GenerateItem], eos_ids: frozenset[int]):
        self.items = items
        self.eos_ids = eos_ids
        self.outputs: list[list[int]] = [[] for _ in items]
        self.logprobs: list[list[float]] = [[] for _ in items]
        self.top_logprobs: list[list[list]] = [[] for _ in items]
        self.masks: list[list[tuple[list[int], float]]] = [[] for _ in items]
        self.finished = [False] * len(items)
        self.finish_reasons: list[dict | None] = [None] * len(items)
        self.generators = [
            torch.Generator().manual_seed((secrets.randbits(63) if it.seed is None else it.seed) % (1 << 63))
            for it in items
        ]

    def step(self, sampled) -> None:
        tokens, logprobs, top, masks = sampled
        for i, item in enumerate(self.items):
            if self.finished[i]:
                continue
            token = int(tokens[i])
            self.outputs[i].append(token)
            self.logprobs[i].append(float(logprobs[i]))
            if top[i] is not None:
                self.top_logprobs[i].append(top[i])
            if item.return_sampling_mask:
                self.masks[i].append(masks[i])
            if token in item.stop_token_ids or (not item.ignore_eos and token in self.eos_ids):
                self._finish(i, {"type": "stop", "matched": token})
            elif len(self.outputs[i]) >= item.max_new_tokens:
                self._finish(i, {"type": "length", "length": item.max_new_tokens})

    def _finish(self, i: int, reason: dict) -> None:
        self.finished[i] = True
        self.finish_reasons[i] = reason

    def abort_unfinished(self) -> None:
        for i in range(len(self.items)):
            if not self.finished[i]:
                self._finish(i, {"type": "abort", "message": "Abort before generation finished (paused)."})

    def all_finished(self) -> bool:
        return all(self.finished)

    def last_tokens(self) -> torch.Tensor:
        return torch.tensor([out[-1] for out in self.outputs], dtype=torch.long)


def _apply_processors(items: list[GenerateItem], logits: torch.Tensor, state: _DecodeState) -> None:
    """Run each request's custom logit processor on its rows, as SGLang's `apply_custom_logit_processor`."""
    rows_by_processor: dict[str, list[int]] = {}
    for i, item in enumerate(items):
        if item.processor is not None and not state.finished[i]:
            rows_by_processor.setdefault(item.processor, []).append(i)
    for serialized, rows in rows_by_processor.items():
        processor = load_custom_logit_processor(serialized)
        params = [_with_request(items[i], state.outputs[i]) for i in rows]
        index = torch.tensor(rows, dtype=torch.long, device=logits.device)
        result = processor(logits.index_select(0, index), params)
        logits.index_copy_(0, index, result.to(logits.dtype))


def _with_request(item: GenerateItem, output_ids: list[int]) -> dict[str, Any] | None:
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


def _check_device(device: str) -> torch.device:
    """`device` as a torch.device; a CUDA device where CUDA is absent is refused by name."""
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device must be a torch device such as 'cpu' or 'cuda:0'; got {device!r}") from None
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r}: CUDA is not available on this host")
    return resolved


def _left_pad(items: list[GenerateItem]) -> tuple[torch.Tensor, torch.Tensor]:
    """`input_ids [B, L]` and `attention_mask [B, L]` (int64), prompts right-aligned."""
    length = max(len(it.input_ids) for it in items)
    ids = torch.zeros(len(items), length, dtype=torch.long)
    mask = torch.zeros(len(items), length, dtype=torch.long)
    for i, it in enumerate(items):
        n = len(it.input_ids)
        ids[i, length - n :] = torch.tensor(it.input_ids, dtype=torch.long)
        mask[i, length - n :] = 1
    return ids, mask


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
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    return frozenset(ids)
