"""benchmarks/gpu_bench.py's put -> flag table, from recorded results (the runs themselves need a GPU)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_bench.py"


def _bench():
    spec = importlib.util.spec_from_file_location("gpu_bench", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_one_table_with_and_without_mps_for_both_backends() -> None:
    bench = _bench()

    def row(p50: float, publication: str) -> dict:
        return {"p50_us": p50, "p99_us": p50 + 1, "flag_publication": publication}

    results = {
        "mps": {"ib": {"device": row(600, "nic"), "host": row(500, "nic"), "pinned": row(400, "nic")},
                "efa": {"device": row(700, "loopback"), "host": row(560, "loopback"), "pinned": row(450, "loopback")}},
        "no_mps": {"ib": {"error": "TimeoutError: stuck"},
                   "efa": {"device": row(4767, "loopback"), "host": row(2382, "loopback")}},
    }
    table = bench._flag_table(results).splitlines()
    assert table[0].startswith("| backend | MPS | buffers / flags | flag publication | p50")
    assert "| efa | yes | device / device | loopback | 700.0 | 701.0 | 1.25 |" in table
    assert "| efa | yes | device / host | host store | 560.0 | 561.0 |  |" in table
    assert "| efa | no | device / device | loopback | 4767.0 | 4768.0 | 2.00 |" in table
    assert "| ib | no | failed: TimeoutError: stuck | | | | |" in table
    assert len(table) == 2 + 3 + 3 + 1 + 2
