"""The reply-parse benchmark's CPU run: both arms parse the same replies to the same columns."""

from __future__ import annotations

from megatron_tail.bench import reply_parse


def test_both_arms_parse_to_the_same_columns(capsys):
    assert reply_parse.main(["--tokens", "1024", "--supports", "0", "20", "--repeats", "1"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and "×" in line]
    assert len(rows) == 2 and all(row.endswith("| yes |") for row in rows), rows
