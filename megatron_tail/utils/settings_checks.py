"""One-line checks of a settings field, shared by the settings dataclasses (`config.schema`,
`rollout.settings`): each raises `UserError("<section>.<name> <why>; got <value>")`, naming the field
and the bad value."""

from __future__ import annotations

from megatron_tail.utils.errors import UserError


def bad(section: str, name: str, value: object, why: str) -> None:
    raise UserError(f"{section}.{name} {why}; got {value!r}")


def positive_int(section: str, name: str, value: int, *, minimum: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        bad(section, name, value, f"must be an int ≥ {minimum}")


def choice(section: str, name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        bad(section, name, value, f"must be one of {choices}")
