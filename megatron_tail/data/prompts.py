"""Prompt sets from local jsonl / parquet files (via `datasets`, never the hub), tokenized for rollout.

Field names are configurable and may be dotted paths into nested records, so both common shapes load:
- DAPO-Math-17k: `{"prompt": [{"role": "user", "content": ...}], "reward_model": {"ground_truth": ...}}`
  → `prompt_key="prompt", answer_key="reward_model.ground_truth"` (`DAPO_MATH_FIELDS`);
- DeepScaleR: `{"problem": ..., "answer": ..., "solution": ...}` → `prompt_key="problem"`
  (`DEEPSCALER_FIELDS`).
A string prompt becomes one user message (after `prompt_template`); a list of `{"role", "content"}`
messages is used as is, but for `prompt_template`, applied to its last user message (DAPO-Math-17k's
prompts ask for an `Answer:` line; a template that asks for a box makes them fit the `math` reward).
With `apply_chat_template`, the tokenizer's chat template renders the messages with the generation prompt
appended; without it (toy tasks), the string prompt is tokenized raw.

Errors name a record as an editor would find it, counting from 1: `line N` of a .jsonl file (blank lines
count, as they do in an editor, though they hold no record), `record N` of a .json array, `row N` of a
parquet file.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import string
from dataclasses import dataclass, field, fields
from decimal import Decimal
from pathlib import Path
from typing import Any

from megatron_tail.utils.errors import UserError
from megatron_tail.utils.file_digest import file_digest
from megatron_tail.utils.paths import tilde_hint

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
    """Field (dotted path) holding the ground-truth answer: a string, or a number (`answer_text`)."""
    apply_chat_template: bool = True
    """Render messages with the tokenizer's chat template (False: raw string prompts, e.g. the toy task)."""
    prompt_template: str = "{prompt}"
    """Format string applied to a string prompt, or to the content of a chat prompt's last user message,
    e.g. "{prompt} Put the final answer in \\\\boxed{{}}."."""
    system_prompt: str | None = None
    """Prepended as a system message (chat template only) unless the prompt already has one."""
    enable_thinking: bool | None = None
    """Passed to the chat template as `enable_thinking` (Qwen3's switch: false renders the empty think
    block after the generation prompt, a non-thinking run); None: the template's default (Qwen3: thinking).
    A multi-turn environment's later turns follow its own `enable_thinking`."""
    max_prompt_tokens: int | None = None
    """Longer prompts are dropped (and counted in the log); None keeps all. A kept prompt that leaves no room
    for the response in the model's context is refused at load, naming its file and line (`PromptLimit`)."""

    def __post_init__(self):
        if problem := prompt_template_problem(self.prompt_template):
            raise UserError(f"prompt_template {problem}; got {self.prompt_template!r}")
        if self.enable_thinking is not None and not self.apply_chat_template:
            raise UserError(
                "enable_thinking is a chat template's switch: it needs apply_chat_template=true; got "
                f"enable_thinking={json.dumps(self.enable_thinking)}"
            )
        if self.system_prompt is not None and not self.apply_chat_template:  # before: silently dropped
            raise UserError(
                "system_prompt is a chat message: it needs apply_chat_template=true (without a chat "
                "template, put the instructions in prompt_template)"
            )
        if self.max_prompt_tokens is not None and self.max_prompt_tokens < 1:
            raise UserError(f"max_prompt_tokens must be ≥ 1 or None; got {self.max_prompt_tokens!r}")


def prompt_template_problem(template: str) -> str | None:
    """Why `template` cannot format a prompt (`str.format(prompt=...)`), or None: it must name `{prompt}` and
    no other field, with literal braces doubled."""
    try:
        fields = {name for _, name, _, _ in string.Formatter().parse(template) if name is not None}
    except ValueError as e:  # a lone "{" or "}"
        return f"is no format string ({e}): write a literal brace as {{{{ or }}}}, e.g. \\boxed{{{{}}}}"
    if "prompt" not in fields:
        return "must contain '{prompt}'"
    if other := sorted(fields - {"prompt"}):
        return (
            f"may name only {{prompt}}, not {{{other[0]}}}: write a literal brace as {{{{ or }}}}, "
            "e.g. \\boxed{{}}"
        )
    return None


@dataclass(frozen=True)
class PromptDataConfig(PromptFormat):
    """Where a prompt set is (`path`, keyword-only) and how to read it (the `PromptFormat` fields)."""

    path: str = field(default="", kw_only=True)
    """Local .jsonl / .json / .parquet file."""
    cache_dir: str | None = field(default=None, kw_only=True)
    """`datasets` cache directory (None: its default); `read_records` keeps one directory per file content
    under it."""

    @classmethod
    def of(cls, path: str, fmt: PromptFormat, cache_dir: str | None = None) -> PromptDataConfig:
        """The prompt set at `path` read with `fmt` (any `PromptFormat`, e.g. the run config's `data`)."""
        shared = {f.name: getattr(fmt, f.name) for f in fields(PromptFormat)}
        return cls(path=path, cache_dir=cache_dir, **shared)

    def __post_init__(self):
        if Path(self.path).suffix not in SUFFIXES:
            raise UserError(f"prompt file must end in one of {sorted(SUFFIXES)}; got {self.path!r}")
        super().__post_init__()


@dataclass(frozen=True)
class PromptExample:
    """One prompt ready for rollout: `index` is its record's position in the file, from 0 (`record_place`
    names it as an editor counts)."""

    index: int
    prompt_ids: list[int]
    prompt_text: str
    answer: str


def check_prompt_file(path: str | Path, key: str | None = None) -> Path:
    """What can be told of a prompt file without reading it: its suffix, that it exists, that it is not
    empty. UserError naming the file (and the config `key` that names it)."""
    path = Path(path)
    named = f"{key}: " if key else ""
    if path.suffix not in SUFFIXES:
        raise UserError(f"{named}prompt file must end in one of {sorted(SUFFIXES)}; got {str(path)!r}")
    if not path.is_file():
        what = "is a directory; a file of records is expected" if path.is_dir() else "does not exist"
        what += tilde_hint(path)
        raise UserError(f"{named}prompt file {str(path)!r} {what}")
    if path.stat().st_size == 0:
        raise UserError(f"{named}prompt file {path} is empty (expected one record per prompt)")
    return path


@contextlib.contextmanager
def _datasets_quiet(datasets):
    """Without `datasets`' "Generating train split" bar and its own error log of a bad file ("Failed to
    load JSON from file ..."): the file is named once, by the UserError below, and a run's console is its
    progress lines."""
    bars_were_off, verbosity = datasets.are_progress_bars_disabled(), datasets.logging.get_verbosity()
    datasets.disable_progress_bars()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)
    try:
        yield
    finally:
        datasets.logging.set_verbosity(verbosity)
        if not bars_were_off:
            datasets.enable_progress_bars()


def read_records(path: str | Path, cache_dir: str | None = None):
    """A `datasets.Dataset` of the rows of a local jsonl/json/parquet file (no network). UserError naming
    the file (and for JSON the line) if it is missing, empty, or not what its suffix says."""
    import datasets

    path = check_prompt_file(path)
    kind = SUFFIXES[path.suffix]
    if kind == "json":
        # pyarrow reads undecodable bytes into the table and the error surfaces only when a row is read,
        # naming neither the file nor the line
        _check_utf8(path)
    reader = datasets.Dataset.from_json if kind == "json" else datasets.Dataset.from_parquet
    # `datasets` keys its cache of a local file by path and mtime alone
    # (`data_files._get_single_origin_metadata`), so a file rewritten with its mtime kept (`cp -p`,
    # `rsync -t`, or twice within one timestamp tick) gave the old file's rows without a word
    base = Path(cache_dir) if cache_dir is not None else Path(datasets.config.HF_DATASETS_CACHE)
    content_cache = base / f"megatron_tail-content-{file_digest(path)[:16]}"
    try:
        with _datasets_quiet(datasets):
            dataset = reader(str(path), cache_dir=str(content_cache), keep_in_memory=True)
    except Exception as e:  # datasets/pyarrow errors name neither the file nor the row: find them
        if kind == "json":
            _check_json(path)
        raise UserError(
            f"prompt file {path} is not readable as {path.suffix[1:]}: {type(e).__name__}: {e}"
        ) from None
    if len(dataset) == 0:
        raise UserError(f"prompt file {path} holds no records")
    return dataset


def _check_utf8(path: Path) -> None:
    """UserError naming the first line of `path` that is not UTF-8, and where in it."""
    with path.open("rb") as f:
        for number, raw in enumerate(f, start=1):
            try:
                raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise UserError(
                    f"prompt file {path} line {number}: not UTF-8 text (byte 0x{raw[e.start]:02x}, byte "
                    f"{e.start + 1} of the line); prompt files must be UTF-8: convert it, e.g. with iconv"
                ) from None


def record_place(path: str | Path, index: int) -> str:
    """`<path> line N` (jsonl), `record N` (a .json array) or `row N` (parquet) of the record at position
    `index` (from 0) of a prompt file, counted from 1 as an editor does. Rereads a JSON file, so it is
    meant for error messages."""
    return _place(path, index, _record_lines(path))


def _check_json(path: Path) -> None:
    """UserError naming the first line of `path` that is not a JSON object (a .jsonl line, or the .json
    document), or that the file holds no records."""
    text = path.read_text(encoding="utf-8", errors="replace")
    if not text.strip():
        raise UserError(f"prompt file {path} is empty (expected one record per prompt)")
    if path.suffix == ".json" and text.lstrip().startswith("["):
        try:
            json.loads(text)
        except ValueError as e:
            raise UserError(f"prompt file {path} line {e.lineno}: invalid JSON: {e.msg}") from None
        return
    # split at "\n" only: `splitlines` also splits at characters that a JSON string may hold raw (U+2028,
    # form feeds), and would then count lines an editor does not
    for number, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError as e:
            raise UserError(
                f"prompt file {path} line {number}: invalid JSON: {e.msg} (column {e.colno}): {line[:80]!r}"
            ) from None
        if not isinstance(record, dict):
            raise UserError(
                f"prompt file {path} line {number}: expected a JSON object per line; "
                f"got {type(record).__name__}"
            )


def get_field(record: dict[str, Any], dotted: str, where: str) -> Any:
    """`record["a"]["b"]` for `dotted="a.b"`; ValueError naming the missing field and the fields present.

    A null on the way counts as missing, and the fields named are those with a value: `datasets` gives every
    row each key the file has anywhere, null where the row has none. A null at the end is returned, for the
    caller to say what it needed (`answer_text`, `prompt_of`)."""
    value: Any = record
    walked = []
    parts = dotted.split(".")
    for i, part in enumerate(parts):
        inside = isinstance(value, dict) and part in value
        if not inside or (value[part] is None and i < len(parts) - 1):
            present = (
                sorted(k for k, v in value.items() if v is not None)
                if isinstance(value, dict)
                else f"a {type(value).__name__}, not a record"
            )
            at = ".".join(walked) or "the top level"
            raise UserError(
                f"{where}: field {dotted!r} not found: no {part!r} at {at}; fields there: {present}"
            )
        value = value[part]
        walked.append(part)
    return value


def prompt_of(record: dict[str, Any], key: str, where: str) -> Any:
    """The prompt field `key` of `record` (`get_field`); UserError naming the row where it is missing or null
    (a row of a file whose other rows have it: `datasets` fills it with null)."""
    prompt = get_field(record, key, where)
    if prompt is None:
        present = sorted(k for k, v in record.items() if v is not None)
        raise UserError(f"{where}: no prompt ({key!r} is missing or null); the row's fields: {present}")
    return prompt


def answer_text(value: Any, key: str, where: str) -> str:
    """The answer a reward gets, `(completion, answer: str)`, as the file spells it: a string as is; an
    integer, or a float that is one, as digits (`12`, `12.0` → "12": a JSON reader turns a column of integers
    and decimals into floats, so a file's `12` arrives as 12.0, which an integer reward refuses); another
    finite float as its shortest digits, positional ("3.5", 1e-07 → "0.0000001": math-verify reads an "e"
    as Euler's number); true/false as JSON writes them (not Python's "True").
    UserError naming the row for what no reward can compare with: a missing or empty answer, a non-finite
    number, an integer past 2^53 held as a float (its digits may be lost), a list or a record."""
    if value is None or (isinstance(value, str) and not value.strip()):
        state = "empty" if value is not None else "missing or null"
        raise UserError(
            f"{where}: no answer ({key!r} is {state}); every prompt needs the ground truth its reward "
            "compares with"
        )
    if isinstance(value, str):
        return value
    if isinstance(value, bool):
        return json.dumps(value)
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float) and math.isfinite(value):
        if value.is_integer() and abs(value) >= 2**53:  # a double: its last digits may be gone
            raise UserError(
                f"{where}: the answer ({key!r}) is the number {value:.17g}, an integer past 2^53 that the "
                "file's reader holds as a float, whose last digits may be lost; quote it (a string)"
            )
        # positional, not repr's 1e-07: math-verify reads "e" as Euler's number (1e-07 → −7 + e)
        return str(int(value)) if value.is_integer() else format(Decimal(repr(value)), "f")
    raise UserError(
        f"{where}: the answer ({key!r}) is {json.dumps(value, default=str)[:80]}; a reward takes a string "
        "or a finite number (write the one string, quoted, that the reward compares with)"
    )


def load_prompts(config: PromptDataConfig, tokenizer) -> list[PromptExample]:
    """Read, render and tokenize every row of `config.path` (dropping over-long prompts if configured)."""
    dataset = read_records(config.path, config.cache_dir)
    for key in (config.prompt_key, config.answer_key):
        if key.split(".")[0] not in dataset.column_names:
            raise UserError(
                f"{config.path}: field {key!r} not found; the file's fields are "
                f"{sorted(dataset.column_names)}"
            )
    examples, dropped = [], 0
    lines = _record_lines(config.path)
    for index, record in enumerate(dataset):
        where = _place(config.path, index, lines)
        answer = answer_text(get_field(record, config.answer_key, where), config.answer_key, where)
        text = render_prompt(prompt_of(record, config.prompt_key, where), config, tokenizer, where)
        ids = tokenize_known(tokenizer, text, where)
        if config.max_prompt_tokens is not None and len(ids) > config.max_prompt_tokens:
            dropped += 1
            continue
        examples.append(PromptExample(index, ids, text, answer))
    if dropped:
        logger.warning(
            "%s: dropped %d of %d prompts longer than %d tokens",
            config.path,
            dropped,
            len(dataset),
            config.max_prompt_tokens,
        )
    if not examples:
        raise UserError(
            f"{config.path}: no prompts left (rows: {len(dataset)}, dropped as too long: {dropped})"
        )
    repeats, first = _repeats(examples)
    if repeats:
        earlier, later = first
        logger.warning(
            "%s: %d of %d prompts repeat an earlier one (the same rendered prompt and answer; the first: %s "
            "repeats %s): an epoch trains each copy, and a step may draw one problem twice; deduplicate the "
            "file if that is not meant",
            config.path,
            repeats,
            len(examples),
            _place(config.path, later, lines),
            _place(config.path, earlier, lines),
        )
    return examples


def _repeats(examples: list[PromptExample]) -> tuple[int, tuple[int, int] | None]:
    """How many examples repeat an earlier (prompt, answer), and the first such pair (the earlier record
    index, the repeating one), in one pass; (0, None) without repeats."""
    seen: dict[tuple[str, str], int] = {}
    count, first = 0, None
    for e in examples:
        key = (e.prompt_text, e.answer)
        if key in seen:
            count += 1
            first = first or (seen[key], e.index)
        else:
            seen[key] = e.index
    return count, first


def _record_lines(path: str | Path) -> list[int] | None:
    """The line of each record of a JSON-lines file, from 1 (None for parquet and a .json array), so that
    per-row messages cost no rereading."""
    path = Path(path)
    if SUFFIXES.get(path.suffix) != "json":
        return None
    with path.open("rb") as f:
        lines = [number for number, raw in enumerate(f, start=1) if raw.strip()]
    if lines and _line(path, lines[0]).lstrip().startswith(b"["):
        return None
    return lines


def _line(path: Path, number: int) -> bytes:
    with path.open("rb") as f:
        for n, raw in enumerate(f, start=1):
            if n == number:
                return raw
    return b""


def _place(path: str | Path, index: int, lines: list[int] | None) -> str:
    if lines is not None and index < len(lines):
        return f"{path} line {lines[index]}"
    kind = "record" if SUFFIXES.get(Path(path).suffix) == "json" else "row"
    return f"{path} {kind} {index + 1}"


@dataclass(frozen=True)
class PromptLimit:
    """The longest prompt a run takes: a request asks for `new_tokens` more and must fit in `context`, the
    model's (SGLang and the local engine answer HTTP 400 otherwise) or `model.max_sequence_length`."""

    context: int
    context_source: str
    """Where `context` comes from, for messages (e.g. "max_position_embeddings in <dir>/config.json")."""
    new_tokens: int
    new_tokens_key: str = "rollout.max_new_tokens"

    @property
    def longest_prompt(self) -> int:
        return self.context - self.new_tokens

    def check(self, examples: list[PromptExample], path: str | Path) -> None:
        """UserError naming the first of `examples` (read from `path`) longer than `longest_prompt`, and how
        many more are."""
        if self.longest_prompt < 1:
            raise UserError(
                f"{self.new_tokens_key}={self.new_tokens} leaves no room for a prompt in the model's context "
                f"of {self.context} tokens ({self.context_source})"
            )
        over = [e for e in examples if len(e.prompt_ids) > self.longest_prompt]
        if not over:
            return
        first, n = over[0], len(over[0].prompt_ids)
        k = len(over) - 1
        more = f" (and {k} more prompt{'s' if k > 1 else ''} too long)" if k else ""
        raise UserError(
            f"{record_place(path, first.index)}: the prompt is {n} tokens; with {self.new_tokens_key}="
            f"{self.new_tokens} that is {n + self.new_tokens}, more than the model's context of "
            f"{self.context} tokens ({self.context_source}){more}. Shorten it, "
            f"drop such prompts with data.max_prompt_tokens={self.longest_prompt}, or lower "
            f"{self.new_tokens_key}"
        )


def tokenize_known(tokenizer, text: str, where: str) -> list[int]:
    """`text`'s token ids; UserError naming the characters the tokenizer can only map to its unknown token
    (the demo's character tokenizer maps them to the pad id), instead of training on them silently."""
    unk = unknown_token(tokenizer)
    if unk is None:
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    unk_id = tokenizer.convert_tokens_to_ids(unk)
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = encoded["input_ids"]
    pieces = [text[a:b] for t, (a, b) in zip(ids, encoded["offset_mapping"], strict=True) if t == unk_id]
    unknown = sorted({c for piece in pieces if piece != unk for c in piece})
    if unknown:
        named = ", ".join(repr(c) for c in unknown[:10])
        raise UserError(
            f"{where}: the tokenizer has no token for {named} (it would map them to {unk!r}); remove them "
            "from the data or use a tokenizer that covers them"
        )
    return ids


def unknown_token(tokenizer) -> str | None:
    """The token a tokenizer maps what it cannot represent to: its `unk_token`, else its backend model's
    (a fast tokenizer's WordLevel / WordPiece model); None for byte-level tokenizers, which have none."""
    unk = getattr(tokenizer, "unk_token", None)
    if unk is None:
        model = getattr(getattr(tokenizer, "backend_tokenizer", None), "model", None)
        unk = getattr(model, "unk_token", None)
    return unk or None


def render_prompt(prompt: Any, config: PromptDataConfig, tokenizer, where: str) -> str:
    """The prompt text the model sees: chat-templated messages, or the formatted raw string."""
    # before: accepted, then the engine refused it at step 1
    if isinstance(prompt, str) and not prompt.strip():
        raise UserError(f"{where}: the prompt is empty")
    if not config.apply_chat_template:
        if not isinstance(prompt, str):
            raise UserError(
                f"{where}: without a chat template the prompt must be a string; got {type(prompt).__name__}"
            )
        return config.prompt_template.format(prompt=prompt)
    messages = _messages(prompt, config, where)
    if getattr(tokenizer, "chat_template", None) is None:
        model = getattr(tokenizer, "name_or_path", "?")
        raise UserError(
            f"data.apply_chat_template is true, and the tokenizer of {model} has no chat_template; set "
            "data.apply_chat_template=false for raw string prompts"
        )
    try:
        switches = {} if config.enable_thinking is None else {"enable_thinking": config.enable_thinking}
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **switches)
    except Exception as e:  # jinja2's TemplateError ("Unexpected message role."), naming no row
        raise UserError(f"{where}: the chat template refused the messages: {type(e).__name__}: {e}") from None


def _messages(prompt: Any, config: PromptDataConfig, where: str) -> list[dict[str, str]]:
    if isinstance(prompt, str):
        messages = [{"role": "user", "content": config.prompt_template.format(prompt=prompt)}]
    elif isinstance(prompt, list) and prompt and all(_is_message(m) for m in prompt):
        messages = [{"role": m["role"], "content": m["content"]} for m in prompt]
        if empty := next((m for m in messages if m["role"] == "user" and not m["content"].strip()), None):
            raise UserError(f"{where}: the prompt's user message {messages.index(empty) + 1} is empty")
        if config.prompt_template != "{prompt}":  # before: ignored for chat prompts, without a word
            users = [i for i, m in enumerate(messages) if m["role"] == "user"]
            if not users:
                raise UserError(
                    f"{where}: data.prompt_template applies to the prompt's last user message, and its "
                    f"messages have none (roles: {[m['role'] for m in messages]})"
                )
            last = messages[users[-1]]
            last["content"] = config.prompt_template.format(prompt=last["content"])
    else:
        raise UserError(
            f"{where}: the prompt must be a string or a non-empty list of {{'role', 'content'}} messages; "
            f"got {str(prompt)[:100]!r}"
        )
    if config.system_prompt is not None and messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": config.system_prompt})
    return messages


def _is_message(m: Any) -> bool:
    return isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
