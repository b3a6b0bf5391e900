"""benchmarks/loopback_cost.py at a tiny size: every loopback write lands and is counted (no timings asserted)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "loopback_cost.py"


def test_loopback_cost_writes_every_word_and_reports_each_part() -> None:
    spec = importlib.util.spec_from_file_location("loopback_cost", BENCH)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    result = bench.loopback_cost(40)
    assert result["landed"] is True and result["loopback_writes"] == 40 == result["writes"]
    assert 0 < result["post_p50_us"] <= result["post_p99_us"]
    assert 0 < result["reaped_p50_us"] <= result["reaped_p99_us"] and result["reap_calls_p50"] >= 1
    assert "every word holds its shadow's value: True" in bench.table(result)
