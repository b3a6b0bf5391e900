"""benchmarks/loopback_cost.py at a tiny size: every loopback write lands and is counted (no timings asserted)."""

from __future__ import annotations

from click.testing import CliRunner

from tests.support.benchmarks import load_benchmark


def test_loopback_cost_writes_every_word_and_reports_each_part() -> None:
    bench = load_benchmark("loopback_cost")
    result = bench.loopback_cost(40)
    assert result["landed"] is True and result["loopback_writes"] == 40 == result["writes"]
    assert 0 < result["post_p50_us"] <= result["post_p99_us"]
    assert 0 < result["reaped_p50_us"] <= result["reaped_p99_us"] and result["reap_calls_p50"] >= 1
    assert "every word holds its shadow's value: True" in bench.table(result)


def test_a_write_count_below_one_is_refused_before_any_device_opens() -> None:
    for writes in ("0", "-3", "many"):
        result = CliRunner().invoke(load_benchmark("loopback_cost").main, ["--writes", writes])
        assert result.exit_code == 2 and "--writes" in result.output, result.output
