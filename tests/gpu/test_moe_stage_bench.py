"""benchmarks/moe_stage_bench.py on the GPU: a row per token count, its timings from the kernels' events."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from click.testing import CliRunner

from tests.support.benchmarks import load_benchmark

pytest.importorskip("torch")
pytest.importorskip("triton")


def test_the_stage_bench_times_route_and_stage_at_each_token_count(cuda_device, tmp_path: Path) -> None:
    out = tmp_path / "stage.json"
    args = ["--tokens", "48", "--tokens", "96", "--hidden", "1024", "--topk", "4", "--experts", "8", "--reps", "4",
            "--warmup", "1", "--device", str(cuda_device), "--json", str(out)]
    result = CliRunner().invoke(load_benchmark("moe_stage_bench").main, args)
    assert result.exit_code == 0, result.output
    doc = json.loads(out.read_text())
    assert [r["tokens"] for r in doc["rows"]] == [48, 96]
    for row in doc["rows"]:
        for key in ("route_us_p50", "stage_us_p50", "route_and_stage_us_p50", "stage_gb_per_s"):
            assert math.isfinite(row[key]) and row[key] > 0, (key, row)
        # the events bracket both launches, so the two together take at least the longer one's median
        assert row["route_and_stage_us_p50"] >= max(row["route_us_p50"], row["stage_us_p50"]), row
        assert row["stage_programs"] >= 1 and row["world"] == 2, row
    assert set(doc["summary"]) == {"route_and_stage_us_48", "route_and_stage_us_96"}


def test_route_grids_compared_give_a_row_each_in_the_order_given(cuda_device, tmp_path: Path) -> None:
    out = tmp_path / "grids.json"
    args = ["--tokens", "64", "--hidden", "1024", "--topk", "4", "--experts", "8", "--reps", "3", "--warmup", "1",
            "--route-programs", "2", "--route-programs", "8", "--route-programs", "2", "--device", str(cuda_device),
            "--json", str(out)]
    result = CliRunner().invoke(load_benchmark("moe_stage_bench").main, args)
    assert result.exit_code == 0, result.output
    doc = json.loads(out.read_text())
    assert [(r["tokens"], r["route_programs"]) for r in doc["rows"]] == [(64, 2), (64, 8), (64, 2)]
    assert all(math.isfinite(r["route_us_p50"]) and r["route_us_p50"] > 0 for r in doc["rows"]), doc["rows"]
    assert set(doc["summary"]) == {"route_and_stage_us_64_route_2", "route_and_stage_us_64_route_8"}


def test_fp8_rows_are_staged_and_counted_as_bytes_and_scales(cuda_device, tmp_path: Path) -> None:
    out = tmp_path / "fp8.json"
    hidden, topk, tokens = 1024, 4, 64
    args = ["--tokens", str(tokens), "--hidden", str(hidden), "--topk", str(topk), "--experts", "8", "--reps", "3",
            "--warmup", "1", "--fp8", "--device", str(cuda_device), "--json", str(out)]
    result = CliRunner().invoke(load_benchmark("moe_stage_bench").main, args)
    assert result.exit_code == 0, result.output
    (row,) = json.loads(out.read_text())["rows"]
    assert row["fp8"] is True and math.isfinite(row["stage_us_p50"]) and row["stage_us_p50"] > 0, row
    # each token's bf16 row read once, then per expert H fp8 bytes and H / 128 fp32 scales
    assert row["stage_bytes"] == tokens * (2 * hidden + topk * (hidden + hidden // 32)), row
