"""A small arithmetic evaluator for the calculator tool: it parses the expression itself (recursive descent
over a tokenized string), never `eval`, and bounds what it computes.

Grammar: `expr := term (("+" | "-") term)*`, `term := unary (("*" | "/" | "//" | "%") unary)*`,
`unary := ("+" | "-") unary | power`, `power := atom ("^" | "**") unary | atom`,
`atom := number | "(" expr ")"`. Numbers are integers or decimals; arithmetic is exact on rationals
(`fractions.Fraction`; a non-integer power is the only float), and the result prints as an integer when it is
one, else as a 10-significant-digit decimal.
"""

from __future__ import annotations

import math
import re
from fractions import Fraction

MAX_EXPRESSION_CHARS = 200
MAX_EXPONENT = 64
MAX_DIGITS = 100

_TOKEN = re.compile(r"\s*(\d+\.\d*|\.\d+|\d+|\*\*|//|[-+*/%^()])")


class ArithmeticError_(ValueError):
    """The expression is not valid arithmetic, or is out of bounds (its message is the tool's reply)."""


def evaluate(expression: str) -> Fraction | float:
    """The value of `expression`; `ArithmeticError_` with a short reason otherwise."""
    if not isinstance(expression, str):
        raise ArithmeticError_(f"expression must be a string, got {type(expression).__name__}")
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ArithmeticError_(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    parser = _Parser(_tokenize(expression))
    value = parser.expr()
    if parser.pos != len(parser.tokens):
        raise ArithmeticError_(f"unexpected {parser.tokens[parser.pos]!r}")
    return value


def format_number(value: Fraction | float) -> str:
    """Integers as digits; anything else rounded to 10 significant digits."""
    if isinstance(value, Fraction) and value.denominator == 1:
        return str(value.numerator)
    return f"{float(value):.10g}"


def _tokenize(text: str) -> list[str]:
    tokens, pos = [], 0
    text = text.rstrip()
    while pos < len(text):
        match = _TOKEN.match(text, pos)
        if match is None:
            raise ArithmeticError_(f"unexpected character {text[pos:].lstrip()[:1]!r}")
        tokens.append(match.group(1))
        pos = match.end()
    if not tokens:
        raise ArithmeticError_("empty expression")
    return tokens


class _Parser:
    def __init__(self, tokens: list[str]):
        self.tokens, self.pos = tokens, 0

    def peek(self) -> str | None:
        return self.tokens[self.pos] if self.pos < len(self.tokens) else None

    def take(self) -> str:
        token = self.peek()
        if token is None:
            raise ArithmeticError_("incomplete expression")
        self.pos += 1
        return token

    def expr(self):
        value = self.term()
        while self.peek() in ("+", "-"):
            op, right = self.take(), self.term()
            value = _checked(value + right if op == "+" else value - right)
        return value

    def term(self):
        value = self.unary()
        while self.peek() in ("*", "/", "//", "%"):
            op, right = self.take(), self.unary()
            if op != "*" and right == 0:
                raise ArithmeticError_("division by zero")
            if op == "*":
                value = value * right
            elif op == "/":
                value = value / right
            elif op == "//":
                value = value // right
            else:
                value = value % right
            value = _checked(value)
        return value

    def unary(self):
        if self.peek() in ("+", "-"):
            sign = self.take()
            value = self.unary()
            return -value if sign == "-" else value
        return self.power()

    def power(self):
        base = self.atom()
        if self.peek() in ("^", "**"):
            self.take()
            exponent = self.unary()
            if abs(exponent) > MAX_EXPONENT:
                raise ArithmeticError_(f"exponent larger than {MAX_EXPONENT}")
            if base == 0 and exponent < 0:
                raise ArithmeticError_("division by zero")
            if isinstance(exponent, Fraction) and exponent.denominator == 1:
                exponent = exponent.numerator  # Fraction ** int stays exact
            else:
                base, exponent = float(base), float(exponent)
            try:
                return _checked(base**exponent)
            except (OverflowError, ZeroDivisionError) as e:
                raise ArithmeticError_(str(e)) from None
        return base

    def atom(self):
        token = self.take()
        if token == "(":
            value = self.expr()
            if self.take() != ")":
                raise ArithmeticError_("missing ')'")
            return value
        if token[0].isdigit() or token[0] == ".":
            if len(token) > MAX_DIGITS:
                raise ArithmeticError_(f"number longer than {MAX_DIGITS} digits")
            return Fraction(token)
        raise ArithmeticError_(f"unexpected {token!r}")


def _checked(value):
    """Results stay finite real numbers of bounded size."""
    if isinstance(value, complex):
        raise ArithmeticError_("result is not a real number")
    if isinstance(value, float) and not math.isfinite(value):
        raise ArithmeticError_("result is not finite")
    if isinstance(value, Fraction) and max(abs(value.numerator), value.denominator) >= 10**MAX_DIGITS:
        raise ArithmeticError_(f"result longer than {MAX_DIGITS} digits")
    return value
