"""benchmarks/loopback_cost.py at a tiny size: every loopback write lands and is counted (no timings asserted)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

from click.testing import CliRunner

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "loopback_cost.py"


def _bench() -> Any:
    spec = importlib.util.spec_from_file_location("loopback_cost", BENCH)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def test_loopback_cost_writes_every_word_and_reports_each_part() -> None:
    bench = _bench()
    result = bench.loopback_cost(40)
    assert result["landed"] is True and result["loopback_writes"] == 40 == result["writes"]
    assert 0 < result["post_p50_us"] <= result["post_p99_us"]
    assert 0 < result["reaped_p50_us"] <= result["reaped_p99_us"] and result["reap_calls_p50"] >= 1
    assert "every word holds its shadow's value: True" in bench.table(result)


def test_a_write_count_below_one_is_refused_before_any_device_opens() -> None:
    for writes in ("0", "-3", "many"):
        result = CliRunner().invoke(_bench().main, ["--writes", writes])
        assert result.exit_code == 2 and "--writes" in result.output, result.output
