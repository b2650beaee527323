"""Math answer reward: the completion's last `\\boxed{...}` checked against the ground truth with math-verify.

A completion without a box scores 0: RL prompts ask for the final answer in `\\boxed{}`, and scoring
any number found in the reasoning would reward guesses.
"""

from __future__ import annotations

import threading
from functools import lru_cache

BOX_COMMANDS = ("\\boxed", "\\fbox")


def last_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` (or `\\fbox{...}`) with balanced braces; None if there is none."""
    start = max(text.rfind(cmd) for cmd in BOX_COMMANDS)
    if start < 0:
        return None
    open_brace = text.find("{", start)
    if open_brace < 0 or text[start:open_brace].strip() not in BOX_COMMANDS:
        return None
    depth = 0
    for i in range(open_brace, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[open_brace + 1 : i]
    return None


def math_reward(completion: str, answer: str) -> float:
    """1.0 if the last boxed answer in `completion` is mathematically equivalent to `answer`, else 0.0.

    `answer` is the dataset's ground truth (LaTeX or plain, with or without `\\boxed{}`). Equivalence is
    math-verify's: `1/2` = `\\frac12` = `0.5`, `\\{1,2\\}` = `\\{2,1\\}`, `x^2+2x+1` = `(x+1)^2`, ...
    """
    if not isinstance(completion, str) or not isinstance(answer, str):
        raise TypeError(
            f"math_reward takes (completion: str, answer: str); got {type(completion)}, {type(answer)}"
        )
    boxed = last_boxed(completion)
    if boxed is None or not boxed.strip():
        return 0.0
    gold_boxed = last_boxed(answer)
    gold = _parse_boxed(answer if gold_boxed is None else gold_boxed)
    pred = _parse_boxed(boxed)
    if not gold or not pred:
        return 0.0
    from math_verify import verify

    return 1.0 if verify(list(gold), list(pred), timeout_seconds=_timeout()) else 0.0


@lru_cache(maxsize=4096)
def _parse_boxed(content: str) -> tuple:
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse

    config = [LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig()]
    return tuple(parse("\\boxed{" + content + "}", extraction_config=config, parsing_timeout=_timeout()))


def _timeout() -> int | None:
    # math-verify's timeouts use signal.alarm, which only the main thread may set; elsewhere run without.
    return 5 if threading.current_thread() is threading.main_thread() else None
