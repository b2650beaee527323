"""Prompt loading: jsonl and parquet, DAPO and DeepScaleR shapes, chat templates, clear field errors."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from megatron_tail.data import (
    DAPO_MATH_FIELDS,
    DEEPSCALER_FIELDS,
    PromptDataConfig,
    build_char_tokenizer,
    load_prompts,
    make_arithmetic_examples,
    read_records,
)
from megatron_tail.data.toy_arithmetic import (
    TEST_SEED,
    TEST_SIZE,
    TRAIN_SEED,
    TRAIN_SIZE,
    make_held_out_examples,
)
from megatron_tail.rewards import arithmetic_reward, math_reward
from megatron_tail.utils.errors import UserError

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "data"
BOX = " Please reason step by step, and put your final answer within \\boxed{{}}."


@pytest.fixture(scope="module")
def tokenizer():
    return build_char_tokenizer()


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def to_parquet(jsonl: Path) -> Path:
    out = jsonl.with_suffix(".parquet")
    read_records(jsonl).to_parquet(str(out))
    return out


def test_deepscaler_shape_with_template_and_system_prompt(tokenizer, tmp_path):
    cfg = PromptDataConfig(
        path=str(EXAMPLES / "math_sample.jsonl"), prompt_template="{prompt}" + BOX, system_prompt="Be brief.",
        cache_dir=str(tmp_path), **DEEPSCALER_FIELDS,
    )  # fmt: skip
    examples = load_prompts(cfg, tokenizer)
    assert len(examples) == 24 and [e.index for e in examples] == list(range(24))
    first = examples[0]
    expected = (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is $\\frac{1}{2} + \\frac{1}{3}$? "
        "Please reason step by step, and put your final answer within \\boxed{}.<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert first.prompt_text == expected and first.answer == "\\frac{5}{6}"
    assert first.prompt_ids == tokenizer(expected, add_special_tokens=False)["input_ids"]
    assert first.prompt_ids[:2] == [
        tokenizer.convert_tokens_to_ids("<|im_start|>"),
        tokenizer.convert_tokens_to_ids("s"),
    ]


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_dapo_shape_nested_answer_and_chat_messages(tokenizer, tmp_path, fmt):
    path = EXAMPLES / "math_sample_dapo.jsonl"
    if fmt == "parquet":
        path = to_parquet(
            write_jsonl(tmp_path / "dapo.jsonl", [json.loads(x) for x in path.read_text().splitlines()])
        )
    examples = load_prompts(
        PromptDataConfig(path=str(path), cache_dir=str(tmp_path), **DAPO_MATH_FIELDS), tokenizer
    )
    assert [e.answer for e in examples] == ["\\frac{5}{6}", "50", "6", "720", "9", "42", "5\\sqrt{2}", "2"]
    assert examples[2].prompt_text.startswith(
        "<|im_start|>user\nSolve for $x$: $2x + 5 = 17$.\n\nPlease reason"
    )
    assert examples[2].prompt_text.endswith("<|im_end|>\n<|im_start|>assistant\n")


def test_a_prompt_template_applies_to_a_chat_prompts_last_user_message(tokenizer, tmp_path):
    """DAPO-Math-17k's prompts ask for an `Answer:` line; its README says to give them a template that asks
    for a box. Before: the template was ignored for chat prompts, without a word (every reward 0)."""
    rows = [
        {"prompt": [{"role": "system", "content": "S"}, {"role": "user", "content": "Q1"},
                    {"role": "assistant", "content": "A"}, {"role": "user", "content": "Q2"}], "answer": "1"},
        {"prompt": [{"role": "system", "content": "only a system message"}], "answer": "2"},
    ]  # fmt: skip
    path = write_jsonl(tmp_path / "chat.jsonl", rows[:1])
    cfg = PromptDataConfig(path=str(path), prompt_template="{prompt}" + BOX, cache_dir=str(tmp_path))
    (example,) = load_prompts(cfg, tokenizer)
    assert "<|im_start|>user\nQ1<|im_end|>" in example.prompt_text  # an earlier user turn as written
    assert f"<|im_start|>user\nQ2{BOX.format()}<|im_end|>\n<|im_start|>assistant\n" in example.prompt_text
    untouched = load_prompts(PromptDataConfig(path=str(path), cache_dir=str(tmp_path)), tokenizer)[0]
    assert BOX.format() not in untouched.prompt_text
    bad = write_jsonl(tmp_path / "nouser.jsonl", rows[1:])
    with pytest.raises(UserError, match=r"line 1: data.prompt_template applies to the prompt's last user "):
        load_prompts(
            PromptDataConfig(path=str(bad), prompt_template="{prompt}" + BOX, cache_dir=str(tmp_path)),
            tokenizer,
        )


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_custom_field_names_and_raw_prompts(tokenizer, tmp_path, fmt):
    rows = [{"q": {"text": "1+2="}, "meta": {"gold": 3}}, {"q": {"text": "10+5="}, "meta": {"gold": 15}}]
    path = write_jsonl(tmp_path / "toy.jsonl", rows)
    path = to_parquet(path) if fmt == "parquet" else path
    cfg = PromptDataConfig(
        path=str(path),
        prompt_key="q.text",
        answer_key="meta.gold",
        apply_chat_template=False,
        cache_dir=str(tmp_path),
    )
    examples = load_prompts(cfg, tokenizer)
    assert [(e.prompt_text, e.answer) for e in examples] == [("1+2=", "3"), ("10+5=", "15")]
    assert tokenizer.decode(examples[1].prompt_ids) == "10+5="


@pytest.mark.parametrize(
    ("rows", "fields", "message"),
    [
        (
            [{"question": "x", "answer": "1"}],
            {"prompt_key": "problem"},
            r"field 'problem' not found; the file's fields are \['answer', 'question'\]",
        ),
        (
            [{"prompt": "x", "reward_model": {"style": "rule"}}],
            {"answer_key": "reward_model.ground_truth"},
            r"bad.jsonl line 1: field 'reward_model.ground_truth' not found: no 'ground_truth' at "
            r"reward_model; fields there: \['style'\]",
        ),
        ([{"prompt": 7, "answer": "1"}], {}, "the prompt must be a string or a non-empty list of"),
        (
            [{"prompt": [{"role": "user"}], "answer": "1"}],
            {},
            "the prompt must be a string or a non-empty list of",
        ),
    ],
)
def test_missing_or_bad_fields_are_named(tokenizer, tmp_path, rows, fields, message):
    path = write_jsonl(tmp_path / "bad.jsonl", rows)
    with pytest.raises(ValueError, match=message):
        load_prompts(PromptDataConfig(path=str(path), cache_dir=str(tmp_path), **fields), tokenizer)


def test_bad_paths_and_configs(tmp_path):
    with pytest.raises(
        ValueError, match=r"must end in one of \['.json', '.jsonl', '.parquet'\]; got 'data.csv'"
    ):
        PromptDataConfig(path="data.csv")
    with pytest.raises(UserError, match="does not exist"):
        read_records(tmp_path / "missing.jsonl")
    (a_dir := tmp_path / "prompts.jsonl").mkdir()  # before: "does not exist"
    with pytest.raises(
        UserError, match=rf"prompt file '{a_dir}' is a directory; a file of records is expected"
    ):
        read_records(a_dir)
    with pytest.raises(ValueError, match="prompt_template must contain"):
        PromptDataConfig(path="a.jsonl", prompt_template="no placeholder")


@pytest.mark.parametrize(
    ("template", "problem"),
    [  # before: accepted, then IndexError / KeyError / ValueError tracebacks at the first prompt
        (
            "{prompt} Put it in \\boxed{}.",
            "may name only {prompt}, not {}: write a literal brace as {{ or }}",
        ),
        ("{prompt} (answer: {answer})", "may name only {prompt}, not {answer}"),
        ("{prompt}}", "is no format string (Single '}' encountered in format string)"),
    ],
)
def test_a_prompt_template_str_format_cannot_run_is_refused_at_load(template, problem):
    from megatron_tail.config import load_config

    with pytest.raises(UserError, match=re.escape(f"prompt_template {problem}")):
        PromptDataConfig(path="a.jsonl", prompt_template=template)
    with pytest.raises(UserError, match=re.escape(f"data.prompt_template {problem}")):
        load_config(None, [f"data.prompt_template={template}"])
    doubled = "{prompt} Put it in \\boxed{{}}."  # the documented spelling (examples/data/README.md)
    assert PromptDataConfig(path="a.jsonl", prompt_template=doubled).prompt_template.format(prompt="Q") == (
        "Q Put it in \\boxed{}."
    )


def test_long_prompts_are_dropped(tokenizer, tmp_path):
    path = write_jsonl(
        tmp_path / "p.jsonl", [{"prompt": "1+1=", "answer": "2"}, {"prompt": "123456+1=", "answer": "123457"}]
    )
    cfg = PromptDataConfig(
        path=str(path), apply_chat_template=False, max_prompt_tokens=5, cache_dir=str(tmp_path)
    )
    assert [e.index for e in load_prompts(cfg, tokenizer)] == [0]


def test_shipped_math_solutions_score_one_with_the_math_reward():
    for line in (EXAMPLES / "math_sample.jsonl").read_text().splitlines():
        row = json.loads(line)
        assert math_reward(row["solution"], row["answer"]) == 1.0, row


def test_shipped_toy_files_match_the_generator_and_the_reward():
    """The test file holds no training prompt: before, 42 of its 200 were training prompts."""
    read = {
        name: [json.loads(x) for x in (EXAMPLES / f"toy_arithmetic_{name}.jsonl").read_text().splitlines()]
        for name in ("train", "test")
    }
    assert read["train"] == make_arithmetic_examples(TRAIN_SIZE, seed=TRAIN_SEED)
    assert read["test"] == make_held_out_examples(TEST_SIZE, seed=TEST_SEED, train=read["train"])
    held_out = {r["prompt"] for r in read["test"]}
    assert len(held_out) == TEST_SIZE and not held_out & {r["prompt"] for r in read["train"]}
    rows = read["test"]
    for row in rows:
        a, b = row["prompt"].rstrip("=").split("+")
        assert (
            int(row["answer"]) == int(a) + int(b) and arithmetic_reward(row["answer"], row["answer"]) == 1.0
        )
    assert max(len(r["prompt"]) for r in rows) <= len("999+999=")


def test_a_chat_template_that_refuses_a_row_is_named_by_it(tokenizer, tmp_path, monkeypatch):
    """Before: jinja2's "TemplateError: Unexpected message role." traceback, naming no file or row."""
    path = write_jsonl(
        tmp_path / "chat.jsonl", [{"prompt": [{"role": "human", "content": "1+1="}], "answer": "2"}]
    )
    monkeypatch.setattr(
        tokenizer,
        "chat_template",
        "{% for m in messages %}{% if m.role not in ['system', 'user'] %}"
        "{{ raise_exception('Unexpected message role.') }}{% endif %}{{ m.content }}{% endfor %}",
    )
    with pytest.raises(
        UserError,
        match=rf"^{re.escape(str(path))} line 1: the chat template refused the messages: TemplateError: "
        "Unexpected message role.$",
    ):
        load_prompts(PromptDataConfig(path=str(path), cache_dir=str(tmp_path)), tokenizer)


def test_a_chat_template_asked_of_a_tokenizer_without_one_names_the_key(tokenizer, tmp_path, monkeypatch):
    """Before: "apply_chat_template=True but the tokenizer has no chat_template", naming neither."""
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "1+1=", "answer": "2"}])
    monkeypatch.setattr(tokenizer, "chat_template", None)
    with pytest.raises(
        UserError, match=r"^data.apply_chat_template is true, and the tokenizer of .* has no "
    ):
        load_prompts(PromptDataConfig(path=str(path), cache_dir=str(tmp_path)), tokenizer)


def test_a_system_prompt_without_a_chat_template_is_refused():
    """Before: accepted and silently dropped: a raw string prompt has no place for a system message."""
    with pytest.raises(
        UserError, match=r"^system_prompt is a chat message: it needs apply_chat_template=true"
    ):
        PromptDataConfig(path="a.jsonl", apply_chat_template=False, system_prompt="Be brief.")


QWEN3_GENERATION_PROMPT = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}"
    "{% endif %}"
)
"""Qwen3's chat template's messages and generation prompt (its `enable_thinking` branch, as Qwen3-8B's
tokenizer_config.json has it), without tools."""


@pytest.mark.parametrize(("switch", "think"), [(None, ""), (True, ""), (False, "<think>\n\n</think>\n\n")])
def test_enable_thinking_reaches_the_chat_template(tmp_path, switch, think):
    """Before: no way to ask Qwen3 for a non-thinking run (the template's default: thinking)."""
    qwen3 = build_char_tokenizer()
    qwen3.chat_template = QWEN3_GENERATION_PROMPT
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "1+1=", "answer": "2"}])
    cfg = PromptDataConfig(path=str(path), enable_thinking=switch, cache_dir=str(tmp_path))
    (example,) = load_prompts(cfg, qwen3)
    assert example.prompt_text == f"<|im_start|>user\n1+1=<|im_end|>\n<|im_start|>assistant\n{think}"
    with pytest.raises(UserError, match="enable_thinking is a chat template's switch: it needs apply_chat"):
        PromptDataConfig(path=str(path), enable_thinking=False, apply_chat_template=False)


def test_repeated_prompts_are_counted_at_load(tokenizer, tmp_path, caplog):
    """DAPO-Math-17k as published repeats its problems; before, nothing said so (an "epoch" then trains
    each problem as often as it repeats)."""
    pairs = [("1+1=", "2"), ("2+2=", "4"), ("1+1=", "2"), ("1+1=", "3"), ("2+2=", "4")]
    rows = [{"prompt": p, "answer": a} for p, a in pairs]
    path = write_jsonl(tmp_path / "rep.jsonl", rows)
    with caplog.at_level("WARNING", logger="megatron_tail.data.prompts"):
        examples = load_prompts(
            PromptDataConfig(path=str(path), apply_chat_template=False, cache_dir=str(tmp_path)), tokenizer
        )
    assert len(examples) == 5  # kept: the warning says, the data decides
    assert [r.getMessage() for r in caplog.records] == [
        f"{path}: 2 of 5 prompts repeat an earlier one (the same rendered prompt and answer; the first: "
        f"{path} line 3 repeats {path} line 1): an epoch trains each copy, and a step may draw one problem "
        "twice; deduplicate the file if that is not meant"
    ]


def test_an_empty_user_message_is_refused_as_an_empty_prompt_is(tokenizer, tmp_path):
    """Before: an empty string prompt was refused, but a chat prompt whose user message was empty loaded."""
    rows = [
        {"prompt": [{"role": "system", "content": "S"}, {"role": "user", "content": "  "}], "answer": "1"}
    ]
    path = write_jsonl(tmp_path / "empty.jsonl", rows)
    with pytest.raises(UserError, match=rf"^{path} line 1: the prompt's user message 2 is empty$"):
        load_prompts(PromptDataConfig(path=str(path), cache_dir=str(tmp_path)), tokenizer)
