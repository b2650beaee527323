"""Math answer reward: the last `\\boxed{...}` of the completion's final answer checked against the ground
truth with math-verify.

A completion without a box scores 0: RL prompts ask for the final answer in `\\boxed{}`, and scoring
any number found in the reasoning would reward guesses. For the same reason a reasoning model's thinking
(`<think> ... </think>`, Qwen3's and DeepSeek-R1's) is not its answer: only the text after the last
`</think>` is scored, and a completion whose `<think>` never closes (cut off by `max_new_tokens` while
thinking) has no final answer and scores 0. Before, a box drawn while thinking scored 1.
"""

from __future__ import annotations

import logging
import re
import sys
import threading

from megatron_tail.utils.thinking import after_thinking

BOX_COMMANDS = ("\\boxed", "\\fbox")

LOGGED_CHARS = 300
"""math-verify's warnings are cut to this many characters: it logs the whole answer when its parse times
out ("Timeout during parsing: ..."), and a collapsing policy's answers are pathological by the thousand,
each up to a response long, into the run's log."""


class _Shortened(logging.Filter):
    """Cuts a record's message to `LOGGED_CHARS`, saying how long it was."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if len(message) > LOGGED_CHARS:
            record.msg, record.args = f"{message[:LOGGED_CHARS]}… ({len(message):,} characters)", None
        return True


# on the loggers that log (a logger's filters see only its own records); the names math-verify 0.9 uses
for _name in ("math_verify.parser", "math_verify.grader", "math_verify.metric"):
    logging.getLogger(_name).addFilter(_Shortened())


_BOX = re.compile(r"\\(?:boxed|fbox)\s*\{")
_BRACE = re.compile(r"[{}]")


def last_boxed(text: str) -> str | None:
    """Content of the last non-empty `\\boxed{...}` (or `\\fbox{...}`) with balanced braces; None if there
    is none. A later `\\boxed` without braces or with nothing in them (prose about the command: "I wrote it
    in \\boxed{} as asked") does not hide an earlier answer. Linear in the text's length (a reply of
    hundreds of thousands of characters took seconds, before math-verify's own time limits)."""
    for box in reversed(list(_BOX.finditer(text))):
        open_brace = box.end() - 1
        depth = 0
        for brace in _BRACE.finditer(text, open_brace):
            depth += 1 if brace.group() == "{" else -1
            if depth == 0:
                break
        if depth:  # never closed: no answer (and no walk back, which would rescan the rest per earlier box)
            return None
        content = text[open_brace + 1 : brace.start()]
        if content.strip():
            return content
    return None


def math_reward(completion: str, answer: str) -> float:
    """1.0 if the last boxed answer of `completion`'s final answer (`utils.thinking.after_thinking`: after
    its thinking) is mathematically equivalent to `answer`, else 0.0.

    `answer` is the dataset's ground truth (LaTeX or plain, with or without `\\boxed{}`). Equivalence is
    math-verify's: `1/2` = `\\frac12` = `0.5`, `\\{1,2\\}` = `\\{2,1\\}`, `x^2+2x+1` = `(x+1)^2`, ...
    """
    if not isinstance(completion, str) or not isinstance(answer, str):
        raise TypeError(
            f"math_reward takes (completion: str, answer: str); got {type(completion)}, {type(answer)}"
        )
    _release_caches()
    answer_part = after_thinking(completion)
    boxed = None if answer_part is None else last_boxed(answer_part)
    if boxed is None:
        return 0.0
    gold_boxed = last_boxed(answer)
    gold = _parse_boxed(answer if gold_boxed is None else gold_boxed)
    if not gold:
        _say_unparsed_gold(answer)
        return 0.0
    pred = _parse_boxed(boxed)
    if not pred:
        return 0.0
    from math_verify import verify

    return 1.0 if verify(list(gold), list(pred), timeout_seconds=_timeout()) else 0.0


def _parse_boxed(content: str) -> tuple:
    """math-verify's parse of `\\boxed{content}`; a non-empty parse is remembered (`_PARSED`). An empty
    one is not: math-verify returns the same `[]` for "cannot parse" and for "timed out", and one slow
    parse on a loaded host must not score that answer 0 for the rest of the run."""
    if (known := _PARSED.get(content)) is not None:
        return known
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse

    config = [LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig()]
    parsed = tuple(parse("\\boxed{" + content + "}", extraction_config=config, parsing_timeout=_timeout()))
    if parsed:
        if len(_PARSED) >= PARSED_KEPT:
            _PARSED.pop(next(iter(_PARSED)))  # the oldest
        _PARSED[content] = parsed
    return parsed


def _say_unparsed_gold(answer: str) -> None:
    """Once per answer (per worker): a ground truth math-verify cannot parse scores every sample of its
    prompt 0, silently, e.g. MATH's `0.\\overline{3}`; said on stderr, which the run's log holds."""
    if answer in _UNPARSED_SAID or len(_UNPARSED_SAID) >= PARSED_KEPT:
        return
    _UNPARSED_SAID.add(answer)
    print(
        f"warning: math reward: the answer {answer[:200]!r} does not parse (math-verify; or its parse timed "
        "out): every sample of its prompt scores 0",
        file=sys.stderr,
        flush=True,
    )


_UNPARSED_SAID: set[str] = set()

PARSED_KEPT = 4096
"""Parses remembered at most (a group's gold answer is parsed once per sample)."""
_PARSED: dict[str, tuple] = {}

CLEAR_SYMPY_EVERY = 1024
"""Calls of `math_reward` between two clears of sympy's caches, which grow with every distinct expression
(about 3 MB per answer with large numbers, by the rewards audit: 1.8 GB after 600) in a worker that lives as
long as the run."""
_calls = [0]


def _release_caches() -> None:
    _calls[0] += 1
    if _calls[0] % CLEAR_SYMPY_EVERY == 0:
        from sympy.core.cache import clear_cache

        clear_cache()
        _PARSED.clear()


def _timeout() -> int | None:
    # math-verify's timeouts use signal.alarm, which only the main thread may set; elsewhere run without.
    return 5 if threading.current_thread() is threading.main_thread() else None
