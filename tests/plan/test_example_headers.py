"""Every example's memory header is what the planner prints for it (regenerate: `python -m
tests.plan.example_headers --write`)."""

from __future__ import annotations

import re

import pytest

from tests.plan.example_headers import EXAMPLES, ROOT, current_header, expected_header


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


def test_the_slurm_readmes_memory_column_is_each_headers_total():
    rows = re.findall(
        r"^\| `examples/(\S+\.yaml)` \|.*\| ([\d.]+) GiB of (\d+) \|$",
        (ROOT / "slurm" / "README.md").read_text(),
        re.M,
    )
    assert len(rows) == 4, rows
    for name, used, of in rows:
        total = re.search(
            r"^#     total +([\d.]+) GiB +of ([\d.]+) GiB$", (ROOT / "examples" / name).read_text(), re.M
        )
        assert (used, float(of)) == (total.group(1), float(total.group(2))), name
