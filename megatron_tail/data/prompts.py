"""Prompt sets from local jsonl / parquet files (via `datasets`, never the hub), tokenized for rollout.

Field names are configurable and may be dotted paths into nested records, so both common shapes load:
- DAPO-Math-17k: `{"prompt": [{"role": "user", "content": ...}], "reward_model": {"ground_truth": ...}}`
  → `prompt_key="prompt", answer_key="reward_model.ground_truth"` (`DAPO_MATH_FIELDS`);
- DeepScaleR: `{"problem": ..., "answer": ..., "solution": ...}` → `prompt_key="problem"`
  (`DEEPSCALER_FIELDS`).
A string prompt becomes one user message (after `prompt_template`); a list of `{"role", "content"}`
messages is used as is. With `apply_chat_template`, the tokenizer's chat template renders the messages
with the generation prompt appended; without it (toy tasks), the string prompt is tokenized raw.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

DAPO_MATH_FIELDS = {"prompt_key": "prompt", "answer_key": "reward_model.ground_truth"}
DEEPSCALER_FIELDS = {"prompt_key": "problem", "answer_key": "answer"}
SUFFIXES = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}


@dataclass(frozen=True)
class PromptFormat:
    """How the records of a prompt set are read and rendered (the run config's `data` section extends it)."""

    prompt_key: str = "prompt"
    """Field (dotted path) holding the prompt: a string, or a list of chat messages."""
    answer_key: str = "answer"
    """Field (dotted path) holding the ground-truth answer (stringified)."""
    apply_chat_template: bool = True
    """Render messages with the tokenizer's chat template (False: raw string prompts, e.g. the toy task)."""
    prompt_template: str = "{prompt}"
    """Format string applied to string prompts, e.g. "{prompt} Put the final answer in \\\\boxed{{}}."."""
    system_prompt: str | None = None
    """Prepended as a system message (chat template only) unless the prompt already has one."""
    max_prompt_tokens: int | None = None
    """Longer prompts are dropped (and counted in the log); None keeps all."""

    def __post_init__(self):
        if "{prompt}" not in self.prompt_template:
            raise ValueError(f"prompt_template must contain '{{prompt}}'; got {self.prompt_template!r}")
        if self.max_prompt_tokens is not None and self.max_prompt_tokens < 1:
            raise ValueError(f"max_prompt_tokens must be ≥ 1 or None; got {self.max_prompt_tokens!r}")


@dataclass(frozen=True)
class PromptDataConfig(PromptFormat):
    """Where a prompt set is (`path`, keyword-only) and how to read it (the `PromptFormat` fields)."""

    path: str = field(default="", kw_only=True)
    """Local .jsonl / .json / .parquet file."""
    cache_dir: str | None = field(default=None, kw_only=True)
    """`datasets` cache directory (None: its default)."""

    @classmethod
    def of(cls, path: str, fmt: PromptFormat, cache_dir: str | None = None) -> PromptDataConfig:
        """The prompt set at `path` read with `fmt` (any `PromptFormat`, e.g. the run config's `data`)."""
        shared = {f.name: getattr(fmt, f.name) for f in fields(PromptFormat)}
        return cls(path=path, cache_dir=cache_dir, **shared)

    def __post_init__(self):
        if Path(self.path).suffix not in SUFFIXES:
            raise ValueError(f"prompt file must end in one of {sorted(SUFFIXES)}; got {self.path!r}")
        super().__post_init__()


@dataclass(frozen=True)
class PromptExample:
    """One prompt ready for rollout: `index` is its row in the file."""

    index: int
    prompt_ids: list[int]
    prompt_text: str
    answer: str


def read_records(path: str | Path, cache_dir: str | None = None):
    """A `datasets.Dataset` of the rows of a local jsonl/json/parquet file (no network)."""
    import datasets

    path = Path(path)
    if path.suffix not in SUFFIXES:
        raise ValueError(f"prompt file must end in one of {sorted(SUFFIXES)}; got {str(path)!r}")
    if not path.is_file():
        raise FileNotFoundError(f"prompt file {str(path)!r} does not exist")
    reader = datasets.Dataset.from_json if SUFFIXES[path.suffix] == "json" else datasets.Dataset.from_parquet
    return reader(str(path), cache_dir=cache_dir, keep_in_memory=True)


def get_field(record: dict[str, Any], dotted: str, where: str) -> Any:
    """`record["a"]["b"]` for `dotted="a.b"`; ValueError naming the missing field and the fields present."""
    value: Any = record
    walked = []
    for part in dotted.split("."):
        if not isinstance(value, dict) or part not in value:
            present = sorted(value) if isinstance(value, dict) else f"a {type(value).__name__}, not a record"
            at = ".".join(walked) or "the top level"
            raise ValueError(
                f"{where}: field {dotted!r} not found: no {part!r} at {at}; fields there: {present}"
            )
        value = value[part]
        walked.append(part)
    return value


def load_prompts(config: PromptDataConfig, tokenizer) -> list[PromptExample]:
    """Read, render and tokenize every row of `config.path` (dropping over-long prompts if configured)."""
    dataset = read_records(config.path, config.cache_dir)
    for key in (config.prompt_key, config.answer_key):
        if key.split(".")[0] not in dataset.column_names:
            raise ValueError(
                f"{config.path}: field {key!r} not found; the file's fields are "
                f"{sorted(dataset.column_names)}"
            )
    examples, dropped = [], 0
    for index, record in enumerate(dataset):
        where = f"{config.path} row {index}"
        text = render_prompt(get_field(record, config.prompt_key, where), config, tokenizer, where)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if config.max_prompt_tokens is not None and len(ids) > config.max_prompt_tokens:
            dropped += 1
            continue
        answer = get_field(record, config.answer_key, where)
        examples.append(PromptExample(index, ids, text, str(answer)))
    if dropped:
        logger.warning(
            "%s: dropped %d of %d prompts longer than %d tokens",
            config.path,
            dropped,
            len(dataset),
            config.max_prompt_tokens,
        )
    if not examples:
        raise ValueError(
            f"{config.path}: no prompts left (rows: {len(dataset)}, dropped as too long: {dropped})"
        )
    return examples


def render_prompt(prompt: Any, config: PromptDataConfig, tokenizer, where: str) -> str:
    """The prompt text the model sees: chat-templated messages, or the formatted raw string."""
    if not config.apply_chat_template:
        if not isinstance(prompt, str):
            raise ValueError(
                f"{where}: without a chat template the prompt must be a string; got {type(prompt).__name__}"
            )
        return config.prompt_template.format(prompt=prompt)
    messages = _messages(prompt, config, where)
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("apply_chat_template=True but the tokenizer has no chat_template")
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def _messages(prompt: Any, config: PromptDataConfig, where: str) -> list[dict[str, str]]:
    if isinstance(prompt, str):
        messages = [{"role": "user", "content": config.prompt_template.format(prompt=prompt)}]
    elif isinstance(prompt, list) and prompt and all(_is_message(m) for m in prompt):
        messages = [{"role": m["role"], "content": m["content"]} for m in prompt]
    else:
        raise ValueError(
            f"{where}: the prompt must be a string or a non-empty list of {{'role', 'content'}} messages; "
            f"got {str(prompt)[:100]!r}"
        )
    if config.system_prompt is not None and messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": config.system_prompt})
    return messages


def _is_message(m: Any) -> bool:
    return isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
