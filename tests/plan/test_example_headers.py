"""Every example's memory header is what the planner prints for it (regenerate: `python -m
tests.plan.example_headers --write`)."""

from __future__ import annotations

import pytest

from tests.plan.example_headers import EXAMPLES, current_header, expected_header


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_header_is_the_planners_output(path):
    assert current_header(path.read_text()) == expected_header(path), (
        f"{path.name}: memory header differs from the planner; "
        "run python -m tests.plan.example_headers --write"
    )


def test_every_example_fits_without_warnings():
    from megatron_tail.plan.report import format_plan  # noqa: F401  (the header already holds the verdict)

    for path in EXAMPLES:
        header = current_header(path.read_text())
        assert header.rstrip().endswith("#   fits"), path.name
        assert "WARNING" not in header, path.name
