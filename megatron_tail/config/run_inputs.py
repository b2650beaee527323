"""What a run reads before it trains, on global rank 0: the tokenizer and the prompt sets, every prompt
tokenized and checked against what the engines and the trainer accept.

    prompts = run_prompts(cfg)    # .tokenizer, .train, .eval; UserError naming the file and line

`RunConfig.check_inputs` calls it before megatron is imported, so a mistake in the data (a prompt the engines
would refuse, one the token budget cannot hold, bytes that are not UTF-8) is one line at load, not a
traceback at the step that first meets it; the session, in the same process, takes the same objects instead
of reading the files again. Every prompt is tokenized once, at load, as verl and slime filter over-long
prompts at load: the run tokenizes them all anyway, and seconds at load are cheap next to a run that fails at
step 1000 on the one prompt that is too long.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_tail.data.prompts import (
    PromptDataConfig,
    PromptExample,
    PromptLimit,
    load_prompts,
    record_place,
)
from megatron_tail.utils.eos import eos_id_entries
from megatron_tail.utils.errors import UserError

RunConfig = Any
"""`config.schema.RunConfig`, not imported: schema's `check_inputs` imports this module (no cycle, not even
for type checkers, as `tests/test_architecture.py` counts them)."""


@dataclass(frozen=True)
class RunPrompts:
    tokenizer: Any
    train: list[PromptExample]
    eval: list[PromptExample]
    """The first `data.eval_prompts` of `data.eval_path` when the run evaluates (`train.eval_every`), else
    none."""


_loaded: tuple[tuple, RunPrompts] | None = None
"""The last load and what it was loaded from: `check_inputs` and the session share it."""


def run_prompts(cfg: RunConfig) -> RunPrompts:
    """The tokenizer and prompts of `cfg` (loaded once per process for the same settings and files)."""
    global _loaded
    key = _key(cfg)
    if _loaded is None or _loaded[0] != key:
        _loaded = None  # a failed load keeps nothing
        _loaded = (key, _load(cfg))
    return _loaded[1]


def _key(cfg: RunConfig) -> tuple:
    # `algorithm` is left out: the session rewrites log ρ (`log_rho: auto`), which no prompt depends on
    files = tuple(_stat(p) for p in (cfg.data.train_path, cfg.data.eval_path))
    return (cfg.model, cfg.data, cfg.rollout, cfg.train, cfg.parallel, files)


def _stat(path: str | None) -> tuple | None:
    try:
        st = Path(path).stat() if path else None
    except OSError:
        return None
    return None if st is None else (path, st.st_mtime_ns, st.st_size)


def _load(cfg: RunConfig) -> RunPrompts:
    from transformers import AutoTokenizer

    from megatron_tail.model.hf_config import load_hf_config

    hf_path, d = cfg.model.hf_path, cfg.data
    try:
        tokenizer = AutoTokenizer.from_pretrained(hf_path, local_files_only=True)
    except Exception as e:  # transformers names neither the directory nor the file (JSONDecodeError, ...)
        raise UserError(
            f"model.hf_path: the tokenizer of {hf_path} does not load: {type(e).__name__}: {str(e)[:300]}"
        ) from None
    arch = load_hf_config(hf_path)
    context, context_source = context_limit(cfg, arch)
    limit = PromptLimit(context=context, context_source=context_source, new_tokens=cfg.rollout.max_new_tokens)
    train = load_prompts(PromptDataConfig.of(d.train_path, d), tokenizer)
    limit.check(train, d.train_path)
    _check_ids_in_vocab(train, d.train_path, arch.vocab_size, hf_path)
    _check_eos_in_vocab(tokenizer, arch.raw, hf_path, arch.vocab_size)
    longest = max(train, key=lambda e: len(e.prompt_ids))
    n = len(longest.prompt_ids)
    cfg.check_longest_prompt(
        n, f"the longest prompt ({n} tokens, {record_place(d.train_path, longest.index)})", limit.context
    )
    evaluated: list[PromptExample] = []
    if d.eval_path is not None and cfg.train.eval_every:
        evaluated = load_eval_examples(d, tokenizer)
        limit.check(evaluated, d.eval_path)
        _check_ids_in_vocab(evaluated, d.eval_path, arch.vocab_size, hf_path)
    return RunPrompts(tokenizer, train, evaluated)


def load_eval_examples(data, tokenizer) -> list[PromptExample]:
    """The first `data.eval_prompts` prompts of `data.eval_path` (a `DataSection`), tokenized: the loop's
    evaluation and `megatron-tail eval` read them here."""
    return load_prompts(data.eval_prompt_data(), tokenizer)[: data.eval_prompts]


def _check_ids_in_vocab(examples: list[PromptExample], path: str, vocab_size: int, hf_path: str) -> None:
    """UserError naming the first prompt whose token ids reach past the model's vocabulary (a tokenizer that
    is not the model's); before, the engine refused it at step 1."""
    for example in examples:
        if (top := max(example.prompt_ids, default=-1)) >= vocab_size:
            raise UserError(
                f"{record_place(path, example.index)}: the tokenizer gives token id {top}, and the model has "
                f"vocab_size={vocab_size} ({hf_path}/config.json): are the tokenizer files the model's?"
            )


def context_limit(cfg: Any, arch: Any) -> tuple[int, str]:
    """The longest sequence the run makes (prompt, every turn and observation): `model.max_sequence_length`
    where set, else the model's `max_position_embeddings` (`arch`, `model.load_hf_config`), and where that
    comes from, for messages. UserError where `max_sequence_length` exceeds the model's context, which the
    engines serve no further."""
    positions = arch.max_position_embeddings
    source = f"max_position_embeddings in {Path(cfg.model.hf_path) / 'config.json'}"
    wanted = cfg.model.max_sequence_length
    if wanted is None:
        return positions, source
    if wanted > positions:
        raise UserError(
            f"model.max_sequence_length={wanted} is longer than the model's context ({positions}, {source}), "
            "past which the engines do not generate; set at most that, or null"
        )
    return wanted, "model.max_sequence_length"


def _check_eos_in_vocab(tokenizer: Any, config: dict, hf_path: str, vocab_size: int) -> None:
    """UserError where no end-of-sequence id an engine stops on (the tokenizer's, `config.json`'s,
    `generation_config.json`'s: the engines stop on any of them, `local_engine.engine._eos_ids` and SGLang
    alike) is a token of the model: it could never emit one, so every completion would silently run to
    `rollout.max_new_tokens`. One valid id among invalid ones still ends completions."""
    sources: dict[str, Any] = {"the tokenizer": tokenizer.eos_token_id}
    sources["config.json"] = config.get("eos_token_id")
    generation = Path(hf_path) / "generation_config.json"
    if generation.is_file():
        try:
            sources[generation.name] = json.loads(generation.read_text()).get("eos_token_id")
        except (ValueError, AttributeError, OSError) as e:
            raise UserError(f"{generation} is not a JSON object ({type(e).__name__}: {e})") from None
    given = [(t, where) for where, v in sources.items() for t in eos_id_entries(v)]
    if given and not any(isinstance(t, int) and 0 <= t < vocab_size for t, _ in given):
        named = ", ".join(f"{t!r} ({where})" for t, where in given)
        raise UserError(
            f"model.hf_path: no eos_token_id of {hf_path} is a token of the model (0 ≤ id < vocab_size="
            f"{vocab_size}): {named}; the model could never end a completion"
        )
