"""benchmarks/launch_bench.py without a GPU: what it derives from its rows, and the ops it refuses (its timings come
from the GPU machine)."""

from __future__ import annotations

from click.testing import CliRunner

from tests.support.benchmarks import load_benchmark


def test_the_summary_pairs_each_call_s_modes_and_a_graph_replay_and_says_what_the_launcher_saves() -> None:
    bench = load_benchmark("launch_bench")
    rows = [bench._row("moe", "combine", "launcher", [40.0, 10.0, 30.0, 20.0]),
            bench._row("moe", "combine", "triton", [90.0, 70.0, 80.0, 100.0]),
            bench._row("moe", "combine", "graph", [9.0, 5.0, 7.0]),
            bench._row("ring_attention", "launch", "launcher", [25.0]),
            bench._row("ring_attention", "launch", "triton", [60.0])]
    assert rows[0] == {"op": "moe", "call": "combine", "mode": "launcher", "calls": 4, "p50_us": 30.0,
                       "p90_us": 40.0}
    assert bench.summary(rows) == {
        "moe.combine": {"launcher_p50_us": 30.0, "triton_p50_us": 90.0, "graph_p50_us": 7.0, "saved_p50_us": 60.0},
        "ring_attention.launch": {"launcher_p50_us": 25.0, "triton_p50_us": 60.0, "saved_p50_us": 35.0}}


def test_an_unknown_op_is_refused_before_anything_runs() -> None:
    result = CliRunner().invoke(load_benchmark("launch_bench").main, ["--ops", "moe,allgather"])
    assert result.exit_code == 2 and "allgather" in result.output and "--ops" in result.output
