"""Reward functions: a math-verify table, the toy arithmetic reward, and the dotted-path plug-in point."""

from __future__ import annotations

import logging
import math
import threading

import pytest

from megatron_tail.rewards import (
    arithmetic_reward,
    compute_rewards,
    last_boxed,
    load_reward_fn,
    math_reward,
    parse_integer_answer,
)

MATH_TABLE = [
    # (completion, ground truth, expected reward)
    # equivalent forms
    ("so the answer is \\boxed{\\frac{1}{2}}.", "0.5", 1.0),
    ("\\boxed{1/2}", "\\frac12", 1.0),
    ("\\boxed{\\dfrac{1}{2}}", "\\frac{1}{2}", 1.0),
    ("\\boxed{2\\sqrt{2}}", "\\sqrt{8}", 1.0),
    ("\\boxed{x^2+2x+1}", "(x+1)^2", 1.0),
    ("\\boxed{34.0}", "34", 1.0),
    ("\\boxed{\\{1,2\\}}", "\\{2,1\\}", 1.0),
    ("\\boxed{\\pi/2}", "\\frac{\\pi}{2}", 1.0),
    ("\\boxed{10^{3}}", "1000", 1.0),
    ("\\boxed{x=3}", "3", 1.0),
    ("\\boxed{1,000}", "1000", 1.0),
    ("first \\boxed{7}, then corrected: \\boxed{8}", "8", 1.0),  # the last box counts
    ("\\boxed{\\text{(B)}}", "B", 1.0),
    ("\\boxed{[0,1)}", "[0,1)", 1.0),
    ("\\boxed{5}", "\\boxed{5}", 1.0),  # ground truth given boxed
    # wrong answers
    ("\\boxed{35}", "34", 0.0),
    ("\\boxed{3}", "-3", 0.0),
    ("\\boxed{[0,1]}", "[0,1)", 0.0),
    ("first \\boxed{8}, then corrected: \\boxed{7}", "8", 0.0),
    ("\\boxed{\\frac{1}{3}}", "0.5", 0.0),
    # no box (or an empty / unclosed one)
    ("The answer is 34.", "34", 0.0),
    ("$34$", "34", 0.0),
    ("\\boxed{}", "34", 0.0),
    ("\\boxed{34", "34", 0.0),
    ("", "34", 0.0),
    # a reasoning model's thinking is not its answer (before: a box drawn while thinking scored 1)
    ("<think>\nmaybe 12? \\boxed{12} no wait, 3*4+", "12", 0.0),  # cut off while thinking
    ("<think>so \\boxed{6}.\n</think>\n\nThe answer is \\boxed{5}.", "6", 0.0),  # the final answer is 5
    ("<think>so \\boxed{6}.\n</think>\n\nThe answer is \\boxed{5}.", "5", 1.0),
    ("<think>so 6.\n</think>\n\nThe answer is 6.", "6", 0.0),  # no box after the thinking
    ("thinking opened by the template </think> so \\boxed{7}", "7", 1.0),  # DeepSeek-R1's template
    # prose about the command after the answer (before: it hid the answer, 0)
    ("answer \\boxed{5}. (I wrote it in \\boxed{} as asked)", "5", 1.0),
    ("answer \\boxed{5}. Note: \\boxed is a LaTeX command", "5", 1.0),
]


@pytest.mark.parametrize(("completion", "answer", "expected"), MATH_TABLE)
def test_math_reward_table(completion, answer, expected):
    assert math_reward(completion, answer) == expected


def test_math_reward_works_off_the_main_thread():
    """math-verify's signal timeouts only work in the main thread; rewards are often computed in workers."""
    results = []
    worker = threading.Thread(target=lambda: results.append(math_reward("\\boxed{\\frac{1}{2}}", "0.5")))
    worker.start()
    worker.join()
    assert results == [1.0]


@pytest.mark.parametrize(
    ("text", "content"),
    [
        ("a \\boxed{x^{2}} b", "x^{2}"),
        ("\\boxed{1} and \\fbox{2}", "2"),
        ("\\boxed {3}", "3"),
        ("\\boxed{\\frac{a}{b}", None),
        ("no box", None),
        ("\\boxedx{3}", None),
        ("\\boxed{4} then \\boxed{ } and \\boxed", "4"),  # the last non-empty box
        ("\\boxed{\\boxed{5}}", "5"),
        ("\\boxed{5} then \\boxed{6", None),  # a last box never closed: no answer, as before
    ],
)
def test_last_boxed(text, content):
    assert last_boxed(text) == content


def _last_boxed_before(text: str) -> str | None:
    """The rule as first written (rfind back over the text per box: quadratic), the reference for the
    linear one."""
    commands = ("\\boxed", "\\fbox")
    end = len(text)
    while (start := max(text.rfind(cmd, 0, end) for cmd in commands)) >= 0:
        end = start
        open_brace = text.find("{", start)
        if open_brace < 0 or text[start:open_brace].strip() not in commands:
            continue
        depth = 0
        for i in range(open_brace, len(text)):
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            if depth == 0:
                break
        if depth:
            return None
        if text[open_brace + 1 : i].strip():
            return text[open_brace + 1 : i]
    return None


def test_last_boxed_is_the_first_rule_on_random_texts():
    import random

    pieces = ["\\boxed", "\\fbox", "\\boxedx", "{", "}", " ", "\n", "4", "x", "\\frac"]
    rng = random.Random(0)
    for _ in range(5000):
        text = "".join(rng.choice(pieces) for _ in range(rng.randrange(1, 24)))
        assert last_boxed(text) == _last_boxed_before(text), text


def test_a_parse_that_came_back_empty_is_not_remembered(monkeypatch):
    """math-verify answers a timed-out parse with the same [] as an unparseable one. Remembered, one slow
    parse on a loaded host scored that answer 0 for the rest of the run."""
    import math_verify

    from megatron_tail.rewards import math_answer

    real, slow = math_verify.parse, [True]

    def parse(*args, **kwargs):
        if slow[0]:  # the first parse of the prediction "times out"
            slow[0] = False
            return []
        return real(*args, **kwargs)

    monkeypatch.setattr(math_verify, "parse", parse)
    monkeypatch.setattr(math_answer, "_PARSED", {})
    answers = [math_reward("so \\boxed{0.75}", "\\frac{3}{4}") for _ in range(3)]
    assert answers == [0.0, 1.0, 1.0]


def test_the_reward_workers_caches_are_cleared_now_and_then(monkeypatch):
    """sympy's caches grow with every distinct expression (1.8 GB after 600 large-number answers in the
    rewards audit) in a worker that lives as long as the run: cleared every `CLEAR_SYMPY_EVERY` calls."""
    import sympy.core.cache

    from megatron_tail.rewards import math_answer

    cleared = []
    monkeypatch.setattr(sympy.core.cache, "clear_cache", lambda: cleared.append(len(math_answer._PARSED)))
    monkeypatch.setattr(math_answer, "CLEAR_SYMPY_EVERY", 3)
    monkeypatch.setattr(math_answer, "_calls", [0])
    monkeypatch.setattr(math_answer, "_PARSED", {})
    for k in range(7):
        assert math_reward(f"\\boxed{{{k}}}", str(k)) == 1.0
    # at the start of calls 3 and 6: one parse remembered per earlier call (the reply's box and the gold
    # are the same text)
    assert cleared == [2, 3]
    assert len(math_answer._PARSED) == 2  # calls 6 and 7


@pytest.mark.parametrize(
    ("completion", "answer", "expected"),
    [
        ("357", "357", 1.0),
        (" 357<|endoftext|>", "357", 1.0),
        ("357\n12+3=15", "357", 1.0),  # the first integer is the answer
        ("-42", "-42", 1.0),
        ("0357", "357", 1.0),
        ("356", "357", 0.0),
        ("3570", "357", 0.0),
        ("35 7", "357", 0.0),
        ("abc", "357", 0.0),
        ("", "357", 0.0),
        ("357", 357, 1.0),
        ("357.9", "357", 0.0),  # its first number is not an integer (before: 357, reward 1)
        ("357. Done", "357", 1.0),  # a sentence's full stop is no decimal
        ("٣٥٧", "357", 0.0),  # ASCII digits only (before: any script's)
    ],
)
def test_arithmetic_reward(completion, answer, expected):
    assert arithmetic_reward(completion, answer) == expected


def test_arithmetic_reward_rejects_a_non_integer_answer():
    with pytest.raises(ValueError, match=r"arithmetic answer must be an integer; got '3\.5'"):
        arithmetic_reward("3", "3.5")
    assert parse_integer_answer("x = -7, y = 2") == -7


def test_plugin_rewards_load_by_dotted_path():
    assert load_reward_fn("math") is math_reward and load_reward_fn("arithmetic") is arithmetic_reward
    for spec in (
        "tests.rewards.plugin_reward:ends_with_answer",
        "tests.rewards.plugin_reward.ends_with_answer",
    ):
        fn = load_reward_fn(spec)
        assert compute_rewards(fn, ["so 12", "so 13 "], ["12", "12"]) == [1.0, 0.0]


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("", "built-in name"),
        ("mathh", "neither a built-in .* nor a dotted path"),
        ("no_such_pkg.mod:fn", "cannot import module 'no_such_pkg.mod'"),
        ("tests.rewards.plugin_reward:missing", "has no callable 'missing'"),
        ("tests.rewards.plugin_reward:NOT_CALLABLE", "has no callable 'NOT_CALLABLE'"),
        # before: a failure at step 1 pointing into our registry, or a ValueError from unpacking the range
        (
            "tests.rewards.plugin_reward:one_argument",
            r"data.reward 'tests.rewards.plugin_reward:one_argument' must take \(completion, answer\); its "
            r"signature is \(completion: str\) -> float$",
        ),
        (  # before: accepted, and the first step failed on an instance where a number was due
            "tests.rewards.plugin_reward:AClass",
            r"data.reward 'tests.rewards.plugin_reward:AClass' is a class; give a function",
        ),
        (
            "tests.rewards.plugin_reward:badly_declared",
            r"reward_range of 'badly_declared' must be two finite numbers \(low, high\), low ≤ high; got "
            r"\(1.0,\)$",
        ),
    ],
)
def test_bad_reward_specs_are_clear_errors(spec, message):
    with pytest.raises(ValueError, match=message):
        load_reward_fn(spec)


@pytest.mark.parametrize(
    ("source", "message"),
    [
        ("def score(completion, answer)\n    return 0.0\n", r"raised SyntaxError: .*user_reward\.py:1$"),
        (
            'raise RuntimeError("no API key for the judge")\n',
            r"raised RuntimeError: no API key .*user_reward\.py:1$",
        ),
    ],
    ids=["syntax", "raises"],
)
def test_a_reward_module_that_fails_to_import_names_its_file_and_line(tmp_path, monkeypatch, source, message):
    """Before: a SyntaxError or RuntimeError traceback at load (only ImportError was caught)."""
    (tmp_path / "user_reward.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(
        ValueError, match=rf"^data.reward 'user_reward:score': importing module 'user_reward' {message}"
    ):
        load_reward_fn("user_reward:score")


def test_a_reward_outside_its_declared_range_is_refused_naming_it():
    """Before: 5.0 trained while DVP's bias bound took R_max = 1 from the declared range."""
    fn = load_reward_fn("tests.rewards.plugin_reward:out_of_range")
    with pytest.raises(
        ValueError, match=r"^reward function 'out_of_range' returned 5.0 for sample 0, outside its declared "
        r"reward_range \(0.0, 1.0\)$",
    ):  # fmt: skip
        compute_rewards(fn, ["x"], ["y"])


@pytest.mark.parametrize("bad", [math.nan, None, "1", True])
def test_compute_rewards_rejects_non_numbers(bad):
    with pytest.raises(ValueError, match=r"returned .* for sample 1"):
        compute_rewards(lambda c, _a: 0.0 if c == "ok" else bad, ["ok", "bad"], ["a", "a"])


def test_reward_bound_comes_from_the_declared_range_or_the_config():
    from megatron_tail.config import load_config
    from megatron_tail.rewards import reward_bound
    from megatron_tail.train.rl.old_policy import reward_max_abs

    assert reward_bound(load_reward_fn("math")) == 1.0 and reward_bound(load_reward_fn("arithmetic")) == 1.0
    undeclared = load_reward_fn("tests.rewards.plugin_reward:ends_with_answer")
    assert reward_bound(undeclared) is None

    def signed(completion: str, answer: str) -> float:  # noqa: ARG001
        return -2.0

    signed.reward_range = (-2.5, 1.0)
    assert reward_bound(signed) == 2.5
    signed.reward_range = (1.0, -1.0)
    with pytest.raises(
        ValueError,
        match=r"reward_range of 'signed' must be two finite numbers \(low, high\), low ≤ high; "
        r"got \(1.0, -1.0\)",
    ):
        reward_bound(signed)
    assert reward_max_abs(load_config(None, ["data.reward=math"])) == 1.0
    assert reward_max_abs(load_config(None, ["data.reward=math", "data.reward_max_abs=3"])) == 3.0
    spec = "data.reward=tests.rewards.plugin_reward:ends_with_answer"
    assert reward_max_abs(load_config(None, [spec])) is None


def test_a_ground_truth_that_does_not_parse_is_said_once(capsys, monkeypatch):
    """Every sample of a prompt whose answer math-verify cannot parse scored 0 without a word."""
    from megatron_tail.rewards import math_answer

    monkeypatch.setattr(math_answer, "_UNPARSED_SAID", set())
    assert [math_reward("so \\\\boxed{3}", "}{") for _ in range(3)] == [0.0, 0.0, 0.0]
    assert math_reward("so \\\\boxed{3}", "3") == 1.0
    err = capsys.readouterr().err
    assert err.count("warning: math reward: the answer '}{' does not parse") == 1, err
    assert "every sample of its prompt scores 0" in err


def test_math_verify_logs_a_pathological_answer_shortened(caplog):
    """math-verify logs the whole answer when its parse times out; a collapsing policy's thousands of such
    answers, each up to a response long, went into the run's log whole."""
    import math_verify.grader
    import math_verify.parser

    from megatron_tail.rewards.math_answer import LOGGED_CHARS

    answer = "x" * 100_000
    with caplog.at_level(logging.WARNING):
        math_verify.parser.logger.warning(f"Timeout during parsing: {answer}")
        math_verify.grader.logger.warning("Timeout during comparison")
    long, short = caplog.records
    assert long.getMessage() == f"Timeout during parsing: {answer}"[:LOGGED_CHARS] + "… (100,024 characters)"
    assert short.getMessage() == "Timeout during comparison"
