"""benchmarks/gpu_bench.py's tables from recorded results (put -> flag: gpu_flag.py; the sweep: gpu_sweep.py) and
its sweep options (the runs themselves need a GPU)."""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks import gpu_flag, gpu_sweep
from tests.support.benchmarks import load_benchmark


def test_one_table_with_and_without_mps_for_both_backends() -> None:
    def row(p50: float, publication: str) -> dict:
        return {"p50_us": p50, "p99_us": p50 + 1, "flag_publication": publication}

    results = {
        "mps": {"ib": {"device": row(600, "nic"), "host": row(500, "nic"), "pinned": row(400, "nic")},
                "efa": {"device": row(700, "loopback"), "host": row(560, "loopback"), "pinned": row(450, "loopback")}},
        "no_mps": {"ib": {"error": "TimeoutError: stuck"},
                   "efa": {"device": row(4767, "loopback"), "host": row(2382, "loopback")}},
    }
    table = gpu_flag._flag_table(results).splitlines()
    assert table[0].startswith("| backend | MPS | buffers / flags | flag publication | p50")
    assert "| efa | yes | device / device | loopback | 700.0 | 701.0 | 1.25 |" in table
    assert "| efa | yes | device / host | host store | 560.0 | 561.0 |  |" in table
    assert "| efa | no | device / device | loopback | 4767.0 | 4768.0 | 2.00 |" in table
    assert "| ib | no | failed: TimeoutError: stuck | | | | |" in table
    assert len(table) == 2 + 3 + 3 + 1 + 2


def test_sweep_table_names_its_consumer_and_wait() -> None:
    row = {"threads": 32, "avg_us": 4.0, "p50_us": 3.9, "p99_us": 5.5, "max_us": 20.0, "mops": 8.0,
           "failed_threads": 0}  # an older result: no push column
    sweep = {"variant": "v2_split", "peers": 8, "poll_window_us": 0.0, "capacity": 4096, "errors": [0, 0, 0],
             "rejected": 0, "by_threads": {"32": row}}
    worker = gpu_sweep.sweep_table({**sweep, "consumer": "worker", "wait": "thread"}).splitlines()
    assert "the rail worker's loop, null NIC, thread polls" in worker[0]
    assert worker[2].split() == ["32", "4.00", "3.90", "5.50", "20.0", "8.00", "nan"]
    bare = gpu_sweep.sweep_table({**sweep, "consumer": "bare", "wait": "warp"}).splitlines()
    assert "the bare C consumer, warp polls" in bare[0]
    failed = gpu_sweep.sweep_table({**sweep, "rejected": 3}).splitlines()
    assert failed[-1].startswith("ERRORS:")


def test_sweep_refuses_an_unknown_consumer_or_wait() -> None:
    with pytest.raises(ValueError, match="consumer must be one of"):
        gpu_sweep.roundtrip_sweep(None, "v2_split", consumer="fifo")
    with pytest.raises(ValueError, match="consumer must be one of"):
        gpu_sweep.roundtrip_sweep(None, "v2_split", wait="block")


def test_sweep_row_times_the_push_apart_and_drops_unreached_round_trips() -> None:
    ns = np.array([3000, 4000, 0, gpu_sweep.FAILED], dtype=np.uint64)
    push_ns = np.array([900, 1100, 0, 0], dtype=np.uint64)
    ends = np.array([[100, 10_100], [200, int(gpu_sweep.FAILED)]], dtype=np.uint64)
    row = gpu_sweep._sweep_row(2, 2, ns, push_ns, ends)
    assert row["round_trips"] == 2 and row["failed_threads"] == 1
    assert row["p50_us"] == pytest.approx(3.5) and row["push_p50_us"] == pytest.approx(1.0)
    assert row["mops"] == pytest.approx(2 / 10_000 * 1e3)


def test_sweep_table_shows_the_workers_passes_when_measured() -> None:
    row = {"threads": 1024, "avg_us": 60.0, "p50_us": 58.0, "p99_us": 120.0, "max_us": 200.0, "mops": 15.0,
           "failed_threads": 0, "records_per_busy_pass": 12.5, "idle_passes_per_busy": 0.25}
    sweep = {"variant": "v2_split", "peers": 8, "poll_window_us": 0.0, "capacity": 4096, "errors": [0, 0, 0],
             "rejected": 0, "by_threads": {"1024": row}}
    assert gpu_sweep.sweep_table(sweep).splitlines()[2].endswith("12.5 records a busy pass, 0.2 idle passes each")


@pytest.mark.parametrize(("args", "culprit"), [
    (["--sweep-waits", "thread,spin"], "--sweep-waits"),
    (["--sweep-waits", ""], "--sweep-waits"),
    (["--sweep-max-takes", "256,lots"], "--sweep-max-takes"),
    (["--sweep-max-takes", "0"], "--sweep-max-takes"),
    (["--sweep-worker-cpu", "100000"], "--sweep-worker-cpu"),
])
def test_sweep_options_are_refused_before_anything_runs(args: list[str], culprit: str) -> None:
    """Each bad value ends the run with a usage error naming its option, before a GPU is touched."""
    from click.testing import CliRunner

    result = CliRunner().invoke(load_benchmark("gpu_bench").main, ["--only-sweep", *args])
    assert result.exit_code == 2 and culprit in result.output, result.output


def test_the_sweep_table_names_a_pinned_consumer() -> None:
    row = {"threads": 1, "avg_us": 3.0, "p50_us": 3.0, "p99_us": 4.0, "max_us": 9.0, "mops": 0.3, "push_p50_us": 0.9,
           "failed_threads": 0}
    sweep = {"variant": "v2_split", "peers": 8, "poll_window_us": 0.0, "capacity": 4096, "consumer": "worker",
             "max_take": 4096, "cpu": 3, "errors": [0, 0, 0], "rejected": 0, "by_threads": {"1": row}}
    assert "on CPU 3 alone" in gpu_sweep.sweep_table(sweep).splitlines()[0]
    assert "alone" not in gpu_sweep.sweep_table({**sweep, "cpu": None}).splitlines()[0]
