"""One-line checks of a settings field, shared by the settings dataclasses (`config.schema`,
`rollout.settings`): each raises `UserError("<section>.<name> <why>; got <value>")`, naming the field
and the bad value."""

from __future__ import annotations

import math

from megatron_tail.utils.errors import UserError

MAX_WAIT_S = 2_000_000.0
"""The longest time limit a setting may hold (~23 days): waits end in `poll`/`epoll` (millisecond ints,
at most 2^31 ms ≈ 24.8 days) and `timedelta`; `inf` or more failed there with a traceback, after start-up."""


def bad(section: str, name: str, value: object, why: str) -> None:
    raise UserError(f"{section}.{name} {why}; got {value!r}")


def positive_int(section: str, name: str, value: int, *, minimum: int = 1, otherwise: str = "") -> None:
    """`otherwise`: the other values the setting takes, said after the bound (e.g. ", or -1 (off)")."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        bad(section, name, value, f"must be an int ≥ {minimum}{otherwise}")


def choice(section: str, name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        bad(section, name, value, f"must be one of {choices}")


def wait_limit(section: str, name: str, value: float, *, unit_s: float = 1.0, unit: str = "seconds") -> None:
    """A time limit in `unit` (`unit_s` seconds each): a finite number > 0, at most `MAX_WAIT_S`."""
    top = MAX_WAIT_S / unit_s
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or not 0 < value <= top
    ):
        bad(section, name, value, f"must be a finite number of {unit} in (0, {top:g}]")
