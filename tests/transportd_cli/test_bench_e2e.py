"""`transportd bench e2e --quick`: two real daemons, a short stream, the JSON document's shape."""

from __future__ import annotations

import json
import math
import os

import pytest
from click.testing import CliRunner

from transportd_cli.bench_e2e import parse_size
from transportd_cli.cli import main

SUMMARY = ("commands_per_s", "gbytes_per_s", "put_to_flag_p50_us", "put_to_flag_p99_us")


def test_quick_run_writes_positive_numbers(tmp_path) -> None:
    path = tmp_path / "e2e.json"
    result = CliRunner().invoke(main, ["bench", "e2e", "--quick", "--size", "16KiB", "--json", str(path)])
    assert result.exit_code == 0, result.output + repr(result.exception)
    assert "commands/s" in result.output and "put-to-flag p99" in result.output
    doc = json.loads(path.read_text())
    summary = doc["summary"]
    for key in SUMMARY:
        assert isinstance(summary[key], float) and math.isfinite(summary[key]) and summary[key] > 0, key
    assert summary["put_to_flag_p50_us"] <= summary["put_to_flag_p99_us"]
    assert doc["config"]["size"] == 16384 and doc["config"]["backend"] == "ib"
    assert doc["stream"]["commands"] > 0 and doc["latency"]["samples"] == 50
    assert doc["daemon_a"]["commands"] >= doc["stream"]["commands"] + 50
    assert doc["daemon_a"]["rejected"] == doc["daemon_a"]["completion_errors"] == 0


def test_efa_daemons_take_decoupled_signaling_and_send_one_signal_a_batch(tmp_path) -> None:
    """efa with signal.decoupled through two real daemons: the stream's PUT_SIGNALs to one flag become one
    signal a batch, and every flag the latency phase waits for is published (else its samples never end)."""
    path = tmp_path / "e2e.json"
    result = CliRunner().invoke(main, ["bench", "e2e", "--quick", "--backend", "efa", "--decoupled", "--json",
                                       str(path)])
    assert result.exit_code == 0, result.output + repr(result.exception)
    doc = json.loads(path.read_text())
    assert doc["config"]["backend"] == "efa" and doc["config"]["decoupled"] is True
    daemon = doc["daemon_a"]
    assert daemon["rejected"] == daemon["completion_errors"] == 0
    assert daemon["signals"] == daemon["batches"] < daemon["commands"]
    assert doc["latency"]["samples"] == 50 and doc["summary"]["put_to_flag_p50_us"] > 0


@pytest.mark.parametrize(("text", "size"), [("4096", 4096), ("4k", 4096), ("4KiB", 4096), ("64KB", 65536),
                                             ("1MiB", 1 << 20), ("1m", 1 << 20), (512, 512)])
def test_sizes_parse(text, size) -> None:
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["", "0", "-4k", "four", "1GiB"])
def test_bad_sizes_are_refused(text) -> None:
    with pytest.raises(ValueError):
        parse_size(text)


def test_latency_samples_after_idle_gaps(tmp_path) -> None:
    path = tmp_path / "e2e.json"
    result = CliRunner().invoke(main, ["bench", "e2e", "--quick", "--samples", "5", "--gap-ms", "20",
                                       "--json", str(path)])
    assert result.exit_code == 0, result.output + repr(result.exception)
    assert "20 ms idle before each" in result.output
    doc = json.loads(path.read_text())
    assert doc["config"]["gap_ms"] == 20 and doc["latency"]["samples"] == 5
    assert doc["summary"]["put_to_flag_p50_us"] > 0


def test_a_negative_gap_is_refused() -> None:
    result = CliRunner().invoke(main, ["bench", "e2e", "--quick", "--gap-ms", "-1"])
    assert result.exit_code == 2 and "Invalid value" in result.output


def test_adaptive_routing_with_write_signaling_is_refused_before_anything_starts() -> None:
    result = CliRunner().invoke(main, ["bench", "e2e", "--quick", "--adaptive-routing"])
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert "--adaptive-routing needs --signal-mode atomic or fence" in result.output
    assert "daemons up" not in result.output


def test_quick_keeps_an_explicit_seconds_and_adaptive_routing_runs_with_atomic(tmp_path) -> None:
    path = tmp_path / "e2e.json"
    result = CliRunner().invoke(main, ["bench", "e2e", "--quick", "--seconds", "0.8", "--adaptive-routing",
                                       "--signal-mode", "atomic", "--json", str(path)])
    assert result.exit_code == 0, result.output + repr(result.exception)
    config = json.loads(path.read_text())["config"]
    assert config["seconds"] == 0.8 and config["samples"] == 50 and config["adaptive_routing"] is True


def test_each_daemon_s_loop_runs_alone_on_the_cpu_given(tmp_path) -> None:
    cpus = sorted(os.sched_getaffinity(0))[:2]
    if len(cpus) < 2:
        pytest.skip("needs two CPUs")
    path = tmp_path / "e2e.json"
    result = CliRunner().invoke(main, ["bench", "e2e", "--quick", "--samples", "20", "--loop-cpus",
                                       f"{cpus[0]},{cpus[1]}", "--json", str(path)])
    assert result.exit_code == 0, result.output + repr(result.exception)
    doc = json.loads(path.read_text())
    assert doc["loop_cpus"] == cpus and doc["config"]["loop_cpus"] == cpus  # what the daemons report
    assert doc["summary"]["commands_per_s"] > 0 and doc["latency"]["samples"] == 20


@pytest.mark.parametrize("text", ["1", "1,2,3", "a,b", "2,2", "-1,2"])
def test_bad_loop_cpus_are_refused(text) -> None:
    result = CliRunner().invoke(main, ["bench", "e2e", "--quick", "--loop-cpus", text])
    assert result.exit_code == 2 and "--loop-cpus" in result.output, result.output
