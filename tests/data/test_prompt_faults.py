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


def test_an_empty_prompt_is_named_by_file_and_line(tokenizer, tmp_path):
    """Before: accepted at load; at step 1 the engine refused "prompt 3 must be a non-empty list of token
    ids"."""
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "1+1=", "answer": "2"}\n\n{"prompt": "  ", "answer": "4"}\n')
    with pytest.raises(UserError, match=rf"^{path} line 3: the prompt is empty$"):
        _load(path, tokenizer, tmp_path)


def test_an_empty_file_is_named(tokenizer, tmp_path):
    for text in ("", "\n\n"):
        path = tmp_path / "empty.jsonl"
        path.write_text(text)
        with pytest.raises(UserError, match=rf"prompt file {path} (is empty|holds no records)"):
            _load(path, tokenizer, tmp_path)


def test_a_malformed_json_line_is_named_and_nothing_else_is_said(tokenizer, tmp_path, capfd):
    import datasets

    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": "2+2=", "answer": 4\n')
    bars, verbosity = datasets.are_progress_bars_disabled(), datasets.logging.get_verbosity()
    with pytest.raises(UserError, match=rf"prompt file {path} line 2: invalid JSON: Expecting ',' delimiter"):
        _load(path, tokenizer, tmp_path)
    path.write_text("not json\n")
    with pytest.raises(UserError, match=rf"prompt file {path} line 1: invalid JSON: Expecting value"):
        _load(path, tokenizer, tmp_path)
    # before: datasets' "Generating train split" bar and "Failed to load JSON from file ... pyarrow ..." too
    said = capfd.readouterr()
    assert "Generating" not in said.err + said.out and "Failed to load" not in said.err + said.out, said
    assert (datasets.are_progress_bars_disabled(), datasets.logging.get_verbosity()) == (bars, verbosity)


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
    with pytest.raises(UserError, match=rf"{path} line 2: no answer \('answer' is (missing or null|empty)\)"):
        _load(path, tokenizer, tmp_path)


@pytest.mark.parametrize(
    ("rows", "fields", "message"),
    [
        (  # before: "line 2: without a chat template the prompt must be a string; got NoneType"
            [{"prompt": "1+1=", "answer": "2"}, {"question": "1+2=", "answer": "3"}],
            {},
            r"line 2: no prompt \('prompt' is missing or null\); the row's fields: \['answer', 'question'\]",
        ),
        (  # before: "no 'ground_truth' at reward_model; fields there: a NoneType, not a record"
            [{"prompt": "x", "reward_model": {"ground_truth": "1"}}, {"prompt": "y", "answer": "2"}],
            {"answer_key": "reward_model.ground_truth"},
            r"line 2: field 'reward_model.ground_truth' not found: no 'reward_model' at the top level; "
            r"fields there: \['answer', 'prompt'\]",
        ),
    ],
)
def test_a_field_another_row_has_is_named_as_missing(tokenizer, tmp_path, rows, fields, message):
    """`datasets` gives a row every key of the file, null where it has none: a missing field read as a null
    of the wrong type."""
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(UserError, match=rf"{path} {message}"):
        _load(path, tokenizer, tmp_path, **fields)


def test_numeric_answers_reach_the_reward_as_the_file_spells_them(tokenizer, tmp_path):
    """A column of integers and decimals is read as floats (pyarrow), so line 1's 12 arrived as "12.0",
    which the arithmetic reward refused at step 1 without naming the row; true reached a reward as "True"."""
    from megatron_tail.rewards.arithmetic import arithmetic_reward

    path = tmp_path / "numbers.jsonl"
    # (an integer past 2^53 read as a float is refused: its digits may be lost, below)
    rows = [(12, "12"), (3.5, "3.5"), (-7, "-7"), (0.1, "0.1"), (2.0**52, "4503599627370496")]
    path.write_text(
        "".join(json.dumps({"prompt": f"{i}=", "answer": a}) + "\n" for i, (a, _) in enumerate(rows))
    )
    answers = [e.answer for e in _load(path, tokenizer, tmp_path)]
    assert answers == [text for _, text in rows]
    assert arithmetic_reward(" 12", answers[0]) == 1.0
    path.write_text('{"prompt": "1=", "answer": true}\n{"prompt": "2=", "answer": false}\n')
    assert [e.answer for e in _load(path, tokenizer, tmp_path)] == ["true", "false"]


@pytest.mark.parametrize(("answer", "said"), [([1, 2], r"\[1, 2\]"), ({"a": 1}, r'\{"a": 1\}')])
def test_an_answer_no_reward_can_compare_with_is_refused_naming_the_row(tokenizer, tmp_path, answer, said):
    """Before: the list reached the reward as the string "[1, 2]"."""
    path = tmp_path / "rows.jsonl"
    path.write_text(
        '{"prompt": "1+1=", "answer": "2"}\n' + json.dumps({"prompt": "2+2=", "answer": answer}) + "\n"
    )
    with pytest.raises(
        UserError,
        match=rf"^{path} line 2: the answer \('answer'\) is {said}; a reward takes a string or a finite",
    ):
        _load(path, tokenizer, tmp_path)


def test_a_number_that_is_not_finite_is_not_an_answer():
    """JSON readers give NaN as null ("no answer"); a parquet float column can hold either."""
    from megatron_tail.data.prompts import answer_text

    for value, said in ((float("nan"), "NaN"), (float("-inf"), "-Infinity")):
        with pytest.raises(UserError, match=rf"^f row 1: the answer \('a'\) is {said}; a reward takes"):
            answer_text(value, "a", "f row 1")


def test_a_small_number_reaches_the_reward_as_math_verify_reads_it(tokenizer, tmp_path):
    """Before: repr's "1e-07", which math-verify parses as −7 + e (Euler's number), so every sample of
    such a prompt scored 0; a big integer the JSON reader had turned into a float lost its last digits."""
    from megatron_tail.rewards import math_reward

    path = tmp_path / "rows.jsonl"
    path.write_text(
        "".join(
            json.dumps({"prompt": f"q{i}", "answer": a}) + "\n" for i, a in enumerate((1e-07, 1.5e-05, 0.5))
        )
    )
    assert [e.answer for e in _load(path, tokenizer, tmp_path)] == ["0.0000001", "0.000015", "0.5"]
    assert (
        math_reward("\\boxed{10^{-7}}", "0.0000001") == 1.0
        and math_reward("\\boxed{10^{-7}}", "1e-07") == 0.0
    )
    path.write_text(json.dumps({"prompt": "q", "answer": 12345678901234567890}) + "\n")
    with pytest.raises(
        UserError, match=r"line 1: the answer \('answer'\) is the number 1.2345678901234567e\+19, an "
    ):
        _load(path, tokenizer, tmp_path)


def test_characters_the_demo_tokenizer_lacks_are_named(tokenizer, tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps({"prompt": "1+1=2 ✓ é", "answer": "2"}) + "\n")
    with pytest.raises(UserError, match=rf"{path} line 1: the tokenizer has no token for 'é', '✓'"):
        _load(path, tokenizer, tmp_path)
    # the pad token written out is a token, not an unknown character
    path.write_text(json.dumps({"prompt": "1+1=<|pad|>", "answer": "2"}) + "\n")
    assert len(_load(path, tokenizer, tmp_path)) == 1


def test_bytes_that_are_not_utf8_are_named_by_file_and_line(tokenizer, tmp_path):
    """Before: a `UnicodeDecodeError` traceback from pyarrow when the row was read, naming neither."""
    path = tmp_path / "latin1.jsonl"
    good = json.dumps({"prompt": "1+1=", "answer": "2"}).encode()
    path.write_bytes(good + b"\n\n" + '{"prompt": "caf\xe9", "answer": "2"}\n'.encode("latin-1"))
    with pytest.raises(
        UserError, match=rf"^prompt file {path} line 3: not UTF-8 text \(byte 0xe9, byte 16 of"
    ):
        _load(path, tokenizer, tmp_path)


def test_rows_are_counted_as_an_editor_counts_lines(tokenizer, tmp_path):
    """Before: "row 1" (from 0, blank lines skipped) for what an editor shows as line 4."""
    path = tmp_path / "gaps.jsonl"
    good, bad = json.dumps({"prompt": "1+1=", "answer": "2"}), json.dumps({"prompt": "2+2=", "answer": None})
    path.write_text(f"{good}\n\n   \n{bad}\n")
    with pytest.raises(UserError, match=rf"^{path} line 4: no answer"):
        _load(path, tokenizer, tmp_path)
    array = tmp_path / "array.json"
    array.write_text(json.dumps([json.loads(good), json.loads(bad)], indent=2))
    with pytest.raises(UserError, match=rf"^{array} record 2: no answer"):
        _load(array, tokenizer, tmp_path)
    import datasets

    table = tmp_path / "rows.parquet"
    datasets.Dataset.from_list([json.loads(good), json.loads(good), json.loads(bad)]).to_parquet(table)
    with pytest.raises(UserError, match=rf"^{table} row 3: no answer"):
        _load(table, tokenizer, tmp_path)


def test_a_prompt_longer_than_the_context_is_named_with_the_limit_and_the_remedies(tokenizer, tmp_path):
    """Before: the engine's HTTP 400 at the step that first drew the prompt, 80 lines, no file or row."""
    from megatron_tail.data.prompts import PromptLimit

    rows = [{"prompt": "1+1=", "answer": "2"}, {"prompt": "1+1=" * 5, "answer": "2"}]
    rows.append(dict(rows[1]))
    path = tmp_path / "long.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    examples = _load(path, tokenizer, tmp_path)
    limit = PromptLimit(context=24, context_source="max_position_embeddings in m/config.json", new_tokens=5)
    with pytest.raises(UserError) as caught:
        limit.check(examples, path)
    assert str(caught.value) == (
        f"{path} line 2: the prompt is 20 tokens; with rollout.max_new_tokens=5 that is 25, more than the "
        "model's context of 24 tokens (max_position_embeddings in m/config.json) "
        "(and 1 more prompt too long). Shorten it, drop such prompts with data.max_prompt_tokens=19, or "
        "lower rollout.max_new_tokens"
    )
    PromptLimit(context=25, context_source="m", new_tokens=5).check(examples, path)  # exactly full: accepted
    with pytest.raises(UserError, match=r"rollout.max_new_tokens=24 leaves no room for a prompt"):
        PromptLimit(context=24, context_source="m", new_tokens=24).check(examples, path)


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_a_file_rewritten_with_its_mtime_kept_is_read_anew(tokenizer, tmp_path, suffix):
    """`datasets` keys its cache of a local file by path and mtime alone. Before: a file rewritten and given
    its old mtime back (`cp -p`, `rsync -t`, or two writes within one timestamp tick) loaded the first
    file's rows from the cache, while the run's data digest recorded the new file."""
    import os

    import datasets

    path = tmp_path / f"p{suffix}"

    def write(rows):
        if suffix == ".jsonl":
            path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        else:
            datasets.Dataset.from_list(rows).to_parquet(str(path))

    write([{"prompt": "1+1=", "answer": "2"}])
    first = os.stat(path)
    assert [p.answer for p in _load(path, tokenizer, tmp_path)] == ["2"]
    write([{"prompt": "2+2=", "answer": "4"}])
    os.utime(path, ns=(first.st_atime_ns, first.st_mtime_ns))
    assert os.stat(path).st_mtime_ns == first.st_mtime_ns
    assert [p.answer for p in _load(path, tokenizer, tmp_path)] == ["4"]
