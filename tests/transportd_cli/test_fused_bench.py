"""benchmarks/fused_bench.py without a GPU: the derived columns (overlap efficiency, speedups) from recorded
times, the table of kernel and MoE rows with failures kept, and the refusals made before any work."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "fused_bench.py"


def _bench():
    spec = importlib.util.spec_from_file_location("fused_bench", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up there
    spec.loader.exec_module(module)
    return module


def test_overlap_efficiency_and_speedups_follow_their_definitions() -> None:
    bench = _bench()
    # compute 4 ms, comm 3 ms, fused 5 ms: 2 of the 3 ms of communication hidden
    row = bench.derive({"compute_s": 4e-3, "comm_s": 3e-3, "fused_s": 5e-3, "torch_s": 3.5e-3}, flops=1e12,
                       moved=6_000_000)
    assert row["overlap_efficiency"] == pytest.approx(2 / 3)
    assert row["speedup_vs_unfused"] == pytest.approx(7 / 5)
    assert row["speedup_vs_sequential"] == pytest.approx(6.5 / 5)
    assert row["comm_over_compute"] == pytest.approx(0.75)
    assert row["fused_tflops"] == pytest.approx(200.0)
    assert row["comm_gbps"] == pytest.approx(2.0)
    # nothing hidden, and everything hidden
    assert bench.derive({"compute_s": 2.0, "comm_s": 1.0, "fused_s": 3.0, "torch_s": 2.0}, 1, 1)[
        "overlap_efficiency"] == pytest.approx(0.0)
    assert bench.derive({"compute_s": 2.0, "comm_s": 1.0, "fused_s": 2.0, "torch_s": 2.0}, 1, 1)[
        "overlap_efficiency"] == pytest.approx(1.0)


def test_the_table_has_a_line_per_row_and_keeps_failures() -> None:
    bench = _bench()
    ok = bench.derive({"kernel": "gemm_reduce_scatter", "backend": "ib", "shape": "cx7-400g", "m": 8192, "n": 8192,
                       "k": 4096, "chunk_rows": 128, "compute_s": 4e-3, "comm_s": 3e-3, "fused_s": 5e-3,
                       "torch_s": 3.5e-3}, 1e12, 1)
    failed = {"kernel": "ring_attention", "backend": "efa", "shape": "efa-200g", "heads": 32, "seq_local": 2048,
              "head_dim": 128, "error": "RuntimeError: channel error"}
    moe = {"kernel": "moe", "backend": "ib", "shape": "cx7-400g", "decoupled": True, "tokens": 128, "hidden": 7168,
           "topk": 8, "experts": 64, "dispatch_s": 250e-6, "combine_s": 300e-6, "dispatch_signals_per_dest": 2.0,
           "dispatch_signals_requested_per_dest": 2.0, "dispatch_fences_per_dest": 0.0,
           "dispatch_writes_per_dest": 640.0}
    line = bench._summary(ok, {"m": 8192, "n": 8192, "k": 4096, "chunk_rows": 128})
    assert line.split() == ["gemm_reduce_scatter", "ib", "cx7-400g", "m=8192", "n=8192", "k=4096", "compute", "4.000",
                            "comm", "3.000", "fused", "5.000", "torch", "3.500", "ms", "overlap", "0.67",
                            "vs", "sequential", "1.30x"]
    lines = bench.table([ok, failed, moe]).splitlines()
    assert "| gemm_reduce_scatter | ib | cx7-400g | m=8192 n=8192 k=4096 | 4.000 | 3.000 | 5.000 | 3.500 | 0.67 | " \
           "1.40x | 1.30x | 0.75 |" in lines
    assert "| ring_attention | efa | efa-200g | heads=32 seq_local=2048 head_dim=128 | failed: RuntimeError: " \
           "channel error |" in lines
    assert "| 128 tok, H 7168, top-8 of 64 | ib | cx7-400g | on | 250.0 | 300.0 | 2.00 (2.00) | 0.00 | 640.0 |" \
           in lines


def test_an_unknown_kernel_or_a_bad_json_path_is_refused_before_any_work(tmp_path: Path) -> None:
    bench = _bench()
    result = CliRunner().invoke(bench.main, ["--kernels", "allgather_gemm,flash"])
    assert result.exit_code == 2 and "unknown kernel(s) flash" in result.output
    (tmp_path / "file").write_text("")  # a parent that is a file: refused at once, not after the run
    result = CliRunner().invoke(bench.main, ["--json", str(tmp_path / "file" / "x.json"), "--kernels", "moe"])
    assert result.exit_code != 0 and not (tmp_path / "file" / "x.json").exists()
