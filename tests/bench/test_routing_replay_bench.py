"""`bench.routing_replay`'s tables: the time ratios against `none`, and the bytes per token of a route
(checked against the wire encoder and the trainer's buffer dtype on a real array)."""

from __future__ import annotations

import pytest

from megatron_tail.bench import routing_replay as bench


def test_time_table_ratios_against_none():
    times = {
        "none": {"old": [1.0, 3.0], "update": [4.0, 4.0]},
        "r2": {"old": [3.0, 3.0], "update": [5.0, 5.0]},
        "r3": {"old": [2.0, 2.0], "update": [6.0, 6.0]},
    }
    lines = bench.time_lines(times)
    rows = {line.split()[0]: [float(x) for x in line.split()[1:]] for line in lines[1:]}
    # θ_old s, update s, total s, θ_old ×, update ×, total ×, steps, s.e. of the total (5, 7 → 1; 8, 8 → 0)
    assert rows["none"] == [2.0, 4.0, 6.0, 1.0, 1.0, 1.0, 2.0, 1.0]
    assert rows["r2"] == [3.0, 5.0, 8.0, 1.5, 1.25, pytest.approx(8 / 6, abs=1e-3), 2.0, 0.0]
    assert rows["r3"] == [2.0, 6.0, 8.0, 1.0, 1.5, pytest.approx(8 / 6, abs=1e-3), 2.0, 0.0]


def test_route_bytes_of_the_qwen3_moe_models():
    by_name = {r.name: r for r in (bench.route_bytes(*m) for m in bench.MODELS)}
    a3b, a22b = by_name["Qwen3-30B-A3B"], by_name["Qwen3-235B-A22B"]
    # 48 × 8 ids: int32 on the wire in base64 (4/3 × 4 B), uint8 in the buffer (128 experts < 256)
    assert (a3b.wire, a3b.int32, a3b.buffer) == (pytest.approx(2048.0), 1536, 384)
    assert (a22b.wire, a22b.int32, a22b.buffer) == (pytest.approx(94 * 8 * 16 / 3), 3008, 752)
    assert bench.route_bytes("x", 2, 2, 300, "m").buffer == 8  # ≥ 256 experts: int16


def test_route_bytes_match_the_encoder_and_the_buffer():
    _, layers, k, experts, _ = bench.MODELS[0]
    wire, buffer = bench.measured_route_bytes(layers, k, experts)
    row = bench.route_bytes(*bench.MODELS[0])
    assert wire == pytest.approx(row.wire, abs=1e-3) and buffer == row.buffer == layers * k


def test_bytes_table_labels_arithmetic_rows():
    lines = bench.bytes_lines([bench.route_bytes(*m) for m in bench.MODELS], response_tokens=32768)
    a3b = next(line for line in lines if line.startswith("Qwen3-30B-A3B"))
    assert a3b.split()[-3:] == ["67.11", "12.58", "arithmetic"]  # 2048 B and 384 B × 32768 tokens, in MB
    assert lines[1].endswith("measured")
