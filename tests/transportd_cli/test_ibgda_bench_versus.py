"""benchmarks/ibgda_bench.py's versus section without a GPU: the rows it launches, the put_burst launch
against the kernel's parameters, and the table, ratios and summary from recorded-shaped results."""

from __future__ import annotations

import re
from types import SimpleNamespace
from typing import Any

import pytest
from click.testing import CliRunner

from benchmarks import gpu_flag
from tests.support.benchmarks import BENCHMARKS, load_benchmark


@pytest.fixture(scope="module")
def bench() -> Any:
    return load_benchmark("ibgda_bench")


def test_rows_are_one_thread_32_blocks_and_every_thread_of_the_gpu(bench) -> None:
    rows = bench.versus_rows(quick=False)
    assert [(r.blocks, r.threads) for r in rows] == [(1, 1), (32, 1), (132, 128)]
    assert [r.posters for r in rows] == list(bench.VERSUS_THREADS) == [1, 32, 16896]
    # at most VERSUS_CAP puts a row, one a thread at least; each block adds its signal
    assert [r.per_thread for r in rows] == [1024, 32, 1]
    assert [r.commands for r in rows] == [1025, 1056, 16896 + 132]
    assert [(r.blocks, r.threads, r.per_thread) for r in bench.versus_rows(quick=True)] == [(1, 1, 128), (32, 1, 4),
                                                                                           (8, 32, 1)]


class _Driver:
    CUresult = SimpleNamespace(CUDA_SUCCESS=0, CUDA_ERROR_NOT_READY=600)

    def __init__(self, seconds: float) -> None:
        self.ms = seconds * 1e3

    def cuEventCreate(self, flags):  # noqa: N802  (the CUDA driver's names)
        return (0, object())

    def cuEventRecord(self, event, stream):  # noqa: N802
        return (0,)

    def cuEventQuery(self, event):  # noqa: N802
        return (0,)

    def cuEventElapsedTime(self, start, end):  # noqa: N802
        return (0, self.ms)

    def cuEventDestroy(self, event):  # noqa: N802
        return (0,)


def test_command_rate_launches_put_burst_as_the_kernel_declares_it(monkeypatch) -> None:
    monkeypatch.setattr(gpu_flag, "check", lambda result, call="": result[1] if len(result) > 1 else None)
    launches: list[tuple] = []
    waits: list[tuple] = []
    module = SimpleNamespace(function=lambda name: SimpleNamespace(
        launch=lambda grid, block, args, stream=None: launches.append((name, grid, block, args))))
    receiver = SimpleNamespace(wait=lambda slot, at_least, timeout: waits.append((slot, at_least)))
    gpu = SimpleNamespace(drv=_Driver(seconds=3.0), stream=None)
    row = gpu_flag.RateRow(blocks=132, threads=128, per_thread=1)
    r = gpu_flag.command_rate(gpu, module, "handle", receiver, 5, 6, row, slot=3)
    # 3 s a launch against a 4 s budget: a second launch, then no third
    assert len(launches) == 2 and r["reps"] == 2 and r["seconds_all"] == pytest.approx(6.0)
    assert waits == [(3, 132), (3, 264)], "every block's signal, counted in the row's own slot"
    assert r["commands_per_s"] == pytest.approx((16896 + 132) / 3.0) and r["threads"] == 16896
    name, grid, block, args = launches[0]
    assert (name, grid, block) == ("put_burst", 132, 128)
    source = (BENCHMARKS / "gpu_push.cu").read_text()
    params = re.search(r"void put_burst\(([^)]*)\)", source).group(1).split(",")
    assert len(args) == len(params) == 8
    assert [int(a) for a in args[1:]] == [1, 6, 5, 64, 1, 3, 1 << 20]  # peer, dst, src, bytes, per thread, slot, span


def _flag(p50: float, rates: list[tuple[int, int, int, float]]) -> dict[str, Any]:
    return {"p50_us": p50, "p99_us": 2 * p50,
            "rates": [{"threads": b * t, "blocks": b, "threads_per_block": t, "commands": b * t * k + b,
                       "commands_per_s": c} for b, t, k, c in rates]}


def test_table_ratios_and_summary(bench) -> None:
    out = {
        "ring": {"pinned": _flag(100.0, [(1, 1, 1024, 50e3), (32, 1, 32, 100e3), (132, 128, 1, 200e3)]),
                 "device": _flag(200.0, [(32, 1, 32, 20e3)])},
        "ibgda": {"pinned": _flag(300.0, [(1, 1, 1024, 5e3), (32, 1, 32, 8e3), (132, 128, 1, 10e3)]),
                  "device": _flag(600.0, [(32, 1, 32, 6e3)])},
    }
    rows = bench.versus_rows_table(out)
    assert [(r["where"], r["threads"]) for r in rows] == [("pinned", 1), ("pinned", 32), ("pinned", 16896),
                                                          ("device", 1), ("device", 32)]
    assert rows[0]["commands_per_s_ratio_ibgda_over_proxy"] == pytest.approx(0.1)
    assert rows[0]["put_to_flag_p50_ratio_ibgda_over_proxy"] == pytest.approx(3.0)
    assert rows[2]["commands_per_s_ratio_ibgda_over_proxy"] == pytest.approx(0.05)
    assert "put_to_flag_p50_ratio_ibgda_over_proxy" not in rows[1]  # latency is one thread's only
    assert "commands" not in rows[3] and rows[3]["ibgda_put_to_flag_p99_us"] == 1200.0
    lines = bench.versus_lines(rows)
    assert lines[0].startswith("| buffers / flags | threads | proxy commands/s | IBGDA commands/s | IBGDA / proxy |")
    assert all(line.count("|") == lines[0].count("|") for line in lines)
    assert "| pinned | 16896 (132x128) | 200000 | 10000 | 0.05 |  |  |  |" in lines
    assert "| pinned | 1 (1x1) | 50000 | 5000 | 0.10 | 100.0 / 200.0 | 300.0 / 600.0 | 3.00 |" in lines
    assert "| device | 1 |  |  |  | 200.0 / 400.0 | 600.0 / 1200.0 | 3.00 |" in lines
    s = bench.versus_summary(out)
    assert s["commands_per_s_ratio_ibgda_over_proxy_16896_threads"] == pytest.approx(0.05)
    assert s["ibgda_commands_per_s_1_threads"] == 5e3
    # the unsuffixed keys stay the 32-block row earlier runs reported
    assert s["proxy_commands_per_s"] == 100e3 and s["commands_per_s_ratio_ibgda_over_proxy"] == pytest.approx(0.08)
    assert all(v > 0 for v in s.values())


def test_help_runs_without_a_gpu(bench) -> None:
    result = CliRunner().invoke(bench.main, ["--help"])
    assert result.exit_code == 0 and "--only-versus" in result.output
