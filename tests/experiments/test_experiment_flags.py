"""`megatron-tail experiment`: a flag given to the experiment or collapse suite that ignores it is refused
in one line, before any model is made. Before, `tail-mismatch --suite dose --jobs 4` and `collapse --suite
arms --rhos -5` ran, silently without them."""

from __future__ import annotations

import pytest

from megatron_tail.cli import build_parser
from megatron_tail.experiments.cli import check_flag_scopes
from megatron_tail.utils.errors import UserError


def _args(*argv: str):
    return build_parser().parse_args(["experiment", *argv])


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["tail-mismatch", "--suite", "dose"],
            "--suite is for `experiment collapse`; `experiment tail-mismatch` ignores it",
        ),
        (
            ["tail-mismatch", "--jobs", "4"],
            "--jobs is for `experiment collapse`; `experiment tail-mismatch` ignores it",
        ),
        (["tail-mismatch", "--quick"], "--quick is for `experiment collapse`;"),
        (
            ["collapse", "--variant", "fp8"],
            "--variant is for `experiment tail-mismatch`; `experiment collapse` ignores it",
        ),
        (["collapse", "--rhos", "-5"], "--rhos is for --suite rho; --suite arms ignores it"),
        (
            ["collapse", "--suite", "dose", "--level", "mild"],
            "--level is for --suite arms or rho; --suite dose ignores it",
        ),
        (
            ["collapse", "--suite", "rho", "--levels", "mild"],
            "--levels is for --suite dose; --suite rho ignores it",
        ),
        (["collapse", "--dials", "top_p0.9"], "--dials is for --suite truncation; --suite arms ignores it"),
        (
            ["collapse", "--suite", "dose", "--quick"],
            "--quick is for --suite truncation; --suite dose ignores it",
        ),
        (
            ["collapse", "--suite", "rho", "--arms", "naive"],
            "--arms is for --suite arms or truncation; --suite rho",
        ),
    ],
)
def test_a_flag_where_it_does_nothing_is_refused_by_name(argv, message):
    with pytest.raises(UserError, match=f"^{message.replace('(', '[(]').replace(')', '[)]')}"):
        check_flag_scopes(_args(*argv))


@pytest.mark.parametrize(
    "argv",
    [
        ["tail-mismatch", "--variant", "fp8", "--arms", "naive", "--seeds", "0"],
        ["collapse", "--suite", "rho", "--rhos", "-5", "auto", "--level", "mild", "--jobs", "1"],
        ["collapse", "--suite", "dose", "--levels", "mild"],
        ["collapse", "--suite", "truncation", "--quick", "--dials", "top_p0.9"],
        ["collapse", "--level", "mild", "--arms", "naive"],
    ],
)
def test_each_flag_where_it_applies_passes(argv):
    check_flag_scopes(_args(*argv))
