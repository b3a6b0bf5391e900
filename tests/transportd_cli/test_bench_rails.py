"""`transportd bench rails --quick`: two two-rail daemons, one-rail and two-rail phases, the JSON's shape."""

from __future__ import annotations

import json
import math

from click.testing import CliRunner

from transportd_cli.cli import main

SUMMARY = ("one_rail_commands_per_s", "two_rail_commands_per_s", "ratio", "one_rail_put_to_flag_p50_us",
           "two_rail_put_to_flag_p50_us")


def test_quick_run_compares_one_rail_with_two(tmp_path) -> None:
    path = tmp_path / "rails.json"
    result = CliRunner().invoke(main, ["bench", "rails", "--quick", "--json", str(path)])
    assert result.exit_code == 0, result.output + repr(result.exception)
    assert "aggregate commands/s" in result.output and "two rails / one rail" in result.output
    doc = json.loads(path.read_text())
    summary = doc["summary"]
    for key in SUMMARY:  # numbers only: timings are never asserted (shared machines are noisy)
        assert isinstance(summary[key], float) and math.isfinite(summary[key]) and summary[key] > 0, key
    assert math.isclose(summary["ratio"], summary["two_rail_commands_per_s"] / summary["one_rail_commands_per_s"])
    one, two = doc["one_rail"], doc["two_rail"]
    assert one["rails"] == [0, 0] and two["rails"] == [0, 1]  # device 0 twice vs rail-peer routing
    assert set(summary["one_rail_bytes_by_rail"]) == {"0"}  # rail 1 carried nothing in the one-rail phase
    assert set(summary["two_rail_bytes_by_rail"]) == {"0", "1"}
    assert all(v > 0 for v in summary["two_rail_bytes_by_rail"].values())
    for phase in (one, two):
        assert phase["commands"] > 0 and all(p["latency"]["samples"] == 30 for p in phase["producers"])
