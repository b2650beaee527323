"""The CPU demo's toy task: multi-digit addition, `{"prompt": "12+345=", "answer": "357"}`.

`examples/data/toy_arithmetic_{train,test}.jsonl` were written by `write_toy_arithmetic_files` with the
defaults below; a test checks that they still match.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from megatron_tail.utils.paths import STAGING, beside

TRAIN_SEED, TEST_SEED = 1234, 5678
TRAIN_SIZE, TEST_SIZE = 2000, 200
MAX_DIGITS = 3


def make_arithmetic_examples(n: int, *, max_digits: int = MAX_DIGITS, seed: int) -> list[dict[str, str]]:
    """`n` addition problems `a+b=` with 1..max_digits-digit operands (digit counts drawn uniformly)."""
    if n < 1 or max_digits < 1:
        raise ValueError(f"n and max_digits must be ≥ 1; got n={n}, max_digits={max_digits}")
    rng = np.random.default_rng(seed)
    examples = []
    for _ in range(n):
        a, b = (_operand(rng, int(rng.integers(1, max_digits + 1))) for _ in range(2))
        examples.append({"prompt": f"{a}+{b}=", "answer": str(a + b)})
    return examples


def make_held_out_examples(
    n: int, *, max_digits: int = MAX_DIGITS, seed: int, train: list[dict[str, str]]
) -> list[dict[str, str]]:
    """`n` distinct problems drawn as `make_arithmetic_examples` draws them, none of them a prompt of `train`:
    an evaluation set that measures what the policy learned, not what it saw (drawn independently, 94 of
    the demo's 200 test prompts were training prompts, its 1-digit sums nearly all). ValueError when the
    space of problems cannot hold them."""
    seen = {row["prompt"] for row in train}
    counts = [high - low for low, high in map(_operand_range, range(1, max_digits + 1))]
    space = sum(a * b for a in counts for b in counts)
    if n > space - len(seen):
        raise ValueError(f"{n} held-out problems do not fit beside {len(seen)} training prompts in {space}")
    rng = np.random.default_rng(seed)
    examples = []
    while len(examples) < n:
        a, b = (_operand(rng, int(rng.integers(1, max_digits + 1))) for _ in range(2))
        if (prompt := f"{a}+{b}=") not in seen:
            seen.add(prompt)
            examples.append({"prompt": prompt, "answer": str(a + b)})
    return examples


def _operand_range(digits: int) -> tuple[int, int]:
    """[low, high) of the operands of `digits` digits (0..9 for one digit)."""
    return (0 if digits == 1 else 10 ** (digits - 1)), 10**digits


def _operand(rng: np.random.Generator, digits: int) -> int:
    return int(rng.integers(*_operand_range(digits)))


def write_jsonl(rows: list[dict], path: str | Path) -> None:
    """One JSON object per line, written atomically (a temp file renamed into place), so a cache that checks
    for the file never finds a half-written one."""
    path = Path(path)
    tmp = beside(path, STAGING)
    with open(tmp, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    tmp.replace(path)


def write_toy_arithmetic_files(directory: str | Path) -> tuple[Path, Path]:
    directory = Path(directory)
    train, test = directory / "toy_arithmetic_train.jsonl", directory / "toy_arithmetic_test.jsonl"
    rows = make_arithmetic_examples(TRAIN_SIZE, seed=TRAIN_SEED)
    write_jsonl(rows, train)
    write_jsonl(make_held_out_examples(TEST_SIZE, seed=TEST_SEED, train=rows), test)
    return train, test
