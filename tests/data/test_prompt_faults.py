"""Bad prompt files: one error naming the file and the line or row, checked when the data is loaded (before:
`StopIteration`, a row named only in an earlier log line, a pyarrow error without a path, an answer-less
record failing at step 2 or reaching a custom reward as the string 'None', unknown characters silently
mapped to the pad id)."""

from __future__ import annotations

import json

import pytest

from megatron_tail.data import PromptDataConfig, build_char_tokenizer, load_prompts
from megatron_tail.utils.errors import UserError


@pytest.fixture(scope="module")
def tokenizer():
    return build_char_tokenizer()


def _load(path, tokenizer, tmp_path, **fields):
    cfg = PromptDataConfig(
        path=str(path), cache_dir=str(tmp_path / "cache"), apply_chat_template=False, **fields
    )
    return load_prompts(cfg, tokenizer)


def test_an_empty_file_is_named(tokenizer, tmp_path):
    for text in ("", "\n\n"):
        path = tmp_path / "empty.jsonl"
        path.write_text(text)
        with pytest.raises(UserError, match=rf"prompt file {path} (is empty|holds no records)"):
            _load(path, tokenizer, tmp_path)


def test_a_malformed_json_line_is_named(tokenizer, tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": "2+2=", "answer": 4\n')
    with pytest.raises(UserError, match=rf"prompt file {path} line 2: invalid JSON: Expecting ',' delimiter"):
        _load(path, tokenizer, tmp_path)


def test_a_parquet_file_that_is_not_parquet_is_named(tokenizer, tmp_path):
    path = tmp_path / "data.parquet"
    path.write_text('{"prompt": "1+1=", "answer": "2"}\n')
    with pytest.raises(UserError, match=rf"prompt file {path} is not readable as parquet"):
        _load(path, tokenizer, tmp_path)


@pytest.mark.parametrize("answer", [None, "", "missing"])
def test_a_record_without_an_answer_is_refused_at_load_naming_file_and_row(tokenizer, tmp_path, answer):
    rows = [{"prompt": "1+1=", "answer": "2"}, {"prompt": "2+2=", "answer": answer}]
    if answer == "missing":
        del rows[1]["answer"]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(UserError, match=rf"{path} row 1: no answer \('answer' is (missing or null|empty)\)"):
        _load(path, tokenizer, tmp_path)


def test_characters_the_demo_tokenizer_lacks_are_named(tokenizer, tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps({"prompt": "1+1=2 ✓ é", "answer": "2"}) + "\n")
    with pytest.raises(UserError, match=rf"{path} row 0: the tokenizer has no token for 'é', '✓'"):
        _load(path, tokenizer, tmp_path)
    # the pad token written out is a token, not an unknown character
    path.write_text(json.dumps({"prompt": "1+1=<|pad|>", "answer": "2"}) + "\n")
    assert len(_load(path, tokenizer, tmp_path)) == 1
