"""benchmarks/fused_bench.py without a GPU: the derived columns (overlap efficiency, speedups) from recorded
times, the table of kernel and MoE rows with failures kept, and the refusals made before any work."""

from __future__ import annotations

import json
import os
from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from tests.support.benchmarks import load_benchmark


def test_overlap_efficiency_and_speedups_follow_their_definitions() -> None:
    bench = load_benchmark("fused_bench")
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
    bench = load_benchmark("fused_bench")
    ok = bench.derive({"kernel": "gemm_reduce_scatter", "backend": "ib", "shape": "cx7-400g", "m": 8192, "n": 8192,
                       "k": 4096, "chunk_rows": 128, "compute_s": 4e-3, "comm_s": 3e-3, "fused_s": 5e-3,
                       "torch_s": 3.5e-3}, 1e12, 1)
    failed = {"kernel": "ring_attention", "backend": "efa", "shape": "efa-200g", "heads": 32, "seq_local": 2048,
              "head_dim": 128, "error": "RuntimeError: channel error"}
    moe = {"kernel": "moe", "backend": "ib", "shape": "cx7-400g", "decoupled": True, "tokens": 128, "hidden": 7168,
           "topk": 8, "experts": 64, "dispatch_s": 250e-6, "combine_s": 300e-6, "dispatch_signals_per_dest": 2.0,
           "dispatch_signals_requested_per_dest": 2.0, "dispatch_fences_per_dest": 0.0,
           "dispatch_writes_per_dest": 640.0, "dispatch_graph_s": 150e-6, "combine_graph_s": 210e-6}
    fp8 = {**moe, "decoupled": False, "fp8": True, "dispatch_graph_s": None, "combine_graph_s": None}
    line = bench._summary(ok, {"m": 8192, "n": 8192, "k": 4096, "chunk_rows": 128})
    assert line.split() == ["gemm_reduce_scatter", "ib", "cx7-400g", "m=8192", "n=8192", "k=4096", "compute", "4.000",
                            "comm", "3.000", "fused", "5.000", "torch", "3.500", "ms", "overlap", "0.67",
                            "vs", "sequential", "1.30x", "misses"]
    lines = bench.table([ok, failed, moe, fp8]).splitlines()
    assert "| gemm_reduce_scatter | ib | cx7-400g | m=8192 n=8192 k=4096 | 4.000 | 3.000 | 5.000 | 3.500 | 0.67 | " \
           "1.40x | 1.30x | 1.62x | 0.75 |" in lines  # ideal: (3 + 3.5) / max(3, 4)
    assert "| ring_attention | efa | efa-200g | heads=32 seq_local=2048 head_dim=128 | failed: RuntimeError: " \
           "channel error |" in lines
    # the latencies from calls, then from graph replays (none for fp8, whose dequantization runs between phases)
    assert "| 128 tok, H 7168, top-8 of 64 | ib | cx7-400g | on | bf16 | 250.0 | 300.0 | 150.0 / 210.0 | " \
           "2.00 (2.00) | 0.00 | 640.0 |" in lines
    assert "| 128 tok, H 7168, top-8 of 64 | ib | cx7-400g | off | fp8 | 250.0 | 300.0 | — | 2.00 (2.00) | 0.00 | " \
           "640.0 |" in lines
    assert bench._graph_us(moe).split() == ["graphs:", "dispatch", "150.0", "us", "combine", "210.0", "us"]
    assert bench._graph_us(fp8) == ""


def test_an_unknown_kernel_or_a_bad_json_path_is_refused_before_any_work(tmp_path: Path) -> None:
    bench = load_benchmark("fused_bench")
    result = CliRunner().invoke(bench.main, ["--kernels", "allgather_gemm,flash"])
    assert result.exit_code == 2 and "unknown kernel(s) flash" in result.output
    (tmp_path / "file").write_text("")  # a parent that is a file: refused at once, not after the run
    result = CliRunner().invoke(bench.main, ["--json", str(tmp_path / "file" / "x.json"), "--kernels", "moe"])
    assert result.exit_code != 0 and not (tmp_path / "file" / "x.json").exists()
    result = CliRunner().invoke(bench.main, ["--timeline", str(tmp_path / "file" / "raw.json"), "--kernels", "moe"])
    assert result.exit_code != 0 and isinstance(result.exception, OSError)  # before any session starts
    for seconds in ("nan", "inf", "-1"):  # a NaN budget would pass every comparison and never skip
        result = CliRunner().invoke(bench.main, ["--tune", "--tune-seconds", seconds])
        assert result.exit_code == 2 and "--tune-seconds" in result.output, result.output
    result = CliRunner().invoke(bench.main, ["--flags", "gpu", "--kernels", "moe"])  # device or host only
    assert result.exit_code == 2 and "--flags" in result.output, result.output
    result = CliRunner().invoke(bench.main, ["--publication", "gdr", "--kernels", "moe"])  # a path the bench names
    assert result.exit_code == 2 and "--publication" in result.output, result.output
    for spin in ("nan", "-1", "2e6", "x"):  # softverbs.io_spin_s in µs: finite, 0..1 s
        result = CliRunner().invoke(bench.main, ["--io-spin-us", spin, "--kernels", "moe"])
        assert result.exit_code == 2 and "--io-spin-us" in result.output, result.output
    for bad in ("moe=128", "gemm_all_reduce=0", "gemm_all_reduce=x", "gemm_all_reduce"):  # MoE has no chunks
        result = CliRunner().invoke(bench.main, ["--chunk-rows", bad, "--kernels", "moe"])
        assert result.exit_code == 2 and "--chunk-rows" in result.output, (bad, result.output)
    assert bench.parse_per_kernel("gemm_all_reduce=256, gemm_reduce_scatter=512,") == {
        "gemm_all_reduce": 256, "gemm_reduce_scatter": 512}
    for bad in ("ring_attention=4", "allgather_gemm=0", "allgather_gemm=-2", "allgather_gemm=x", "gemm_all_reduce"):
        result = CliRunner().invoke(bench.main, ["--group-m", bad, "--kernels", "moe"])  # the GEMMs only
        assert result.exit_code == 2 and "--group-m" in result.output, (bad, result.output)
    assert bench.parse_per_kernel("allgather_gemm=8,gemm_all_reduce=1", "--group-m", bench.GEMMS, "N") == {
        "allgather_gemm": 8, "gemm_all_reduce": 1}
    for bad in ("moe.tokens=8", "gemm_all_reduce.tokens=8", "gemm_all_reduce.m=0", "gemm_all_reduce.m",
                "gemm_all_reduce=16384"):  # a kernel of KERNELS, one of its size keys, an integer >= 1
        result = CliRunner().invoke(bench.main, ["--dims", bad, "--kernels", "moe"])
        assert result.exit_code == 2 and "--dims" in result.output, (bad, result.output)
    assert bench.parse_dims("gemm_all_reduce.m=16384, gemm_all_reduce.k=4096,ring_attention.seq_local=512") == {
        "gemm_all_reduce": {"m": 16384, "k": 4096}, "ring_attention": {"seq_local": 512}}


# --- the tuning mode (--tune): what it times, in which order, and how it reports ------------------------------
def test_tune_candidates_keep_what_the_ops_accept_and_name_what_they_refuse(monkeypatch) -> None:
    pytest.importorskip("triton")  # the ops' checks live beside their kernels
    bench = load_benchmark("fused_bench")
    for kernel in bench.KERNELS:  # at the bench's sizes every candidate is accepted, the op's default first
        kept, refused = bench.tune_candidates(kernel, bench.SIZES[kernel][0])
        assert kept == bench.TUNE_TILES[kernel] and refused == []
    assert bench.tile_label(bench.GEMM_TILES[0]) == "128x128x64 w8 s3"
    assert bench.tile_label(bench.RING_TILES[0]) == "64x64 w4 s2"
    # MoE Dispatch+GEMM: every candidate accepted, the op's own default first; one its op refuses is named
    kept, refused = bench.tune_candidates("moe_dispatch_gemm", bench.MOE_GEMM_SIZES[0])
    assert kept == bench.MOE_GEMM_TILES and refused == [] and set(bench.TUNABLE) == set(bench.CASES)
    from gpuclient.kernels.moe import default_gemm_tiles
    dims = bench.MOE_GEMM_SIZES[0]
    block, warps, stages = default_gemm_tiles(dims["tokens"], dims["topk"], bench.WORLD, dims["experts"])
    assert bench.MOE_GEMM_TILES[0] == {"block": block, "num_warps": warps, "num_stages": stages}
    monkeypatch.setitem(bench.TUNE_TILES, "moe_dispatch_gemm",
                        [*bench.MOE_GEMM_TILES, {"block": (64, 128, 48), "num_warps": 4, "num_stages": 3}])
    kept, refused = bench.tune_candidates("moe_dispatch_gemm", bench.MOE_GEMM_SIZES[0])
    assert kept == bench.MOE_GEMM_TILES and [r["label"] for r in refused] == ["64x128x48 w4 s3"]
    assert "gemm_block must be three powers of two" in refused[0]["refused"]
    # without --tma the descriptor tiles are left out, not refused
    kept, refused = bench.tune_candidates("gemm_all_reduce", bench.SIZES["gemm_all_reduce"][0], tma=False)
    assert kept and not any(t["tma"] for t in kept) and refused == []
    # rows a tensor descriptor cannot step over: the TMA tiles refused, with the op's reason
    kept, refused = bench.tune_candidates("allgather_gemm", {"m_local": 512, "n": 1004, "k": 1024, "chunk_rows": 64})
    assert [r["label"] for r in refused] == [bench.tile_label(t) for t in bench.GEMM_TILES if t["tma"]]
    assert all("needs n to be a multiple of 8" in r["refused"] for r in refused)
    assert refused[0]["block"] == [128, 128, 64] and refused[0]["tma"] is True
    # a shape the reduce-scatter layout refuses refuses every tile; a tile the ring layout refuses is named
    kept, refused = bench.tune_candidates("gemm_reduce_scatter", {"m": 1025, "n": 1024, "k": 1024, "chunk_rows": 64})
    assert kept == [] and len(refused) == len(bench.GEMM_TILES)
    assert "do not split into 2 equal segments" in refused[0]["refused"]
    monkeypatch.setitem(bench.TUNE_TILES, "ring_attention",
                        [*bench.RING_TILES, {"block": (96, 64), "num_warps": 4, "num_stages": 2},
                         {"block": (64, 64), "num_warps": 6, "num_stages": 2}])
    kept, refused = bench.tune_candidates("ring_attention", bench.SIZES["ring_attention"][0])
    assert kept == bench.RING_TILES
    assert [(r["label"], r["refused"].split(" must")[0]) for r in refused] == [
        ("96x64 w4 s2", "block (block_m, block_n)"), ("64x64 w6 s2", "num_warps")]


def test_tune_plan_times_every_kernels_pointer_tiles_before_any_tma_tile() -> None:
    pytest.importorskip("triton")
    bench = load_benchmark("fused_bench")
    plan = bench.tune_plan(list(bench.KERNELS), bench.SIZES)
    assert [(p["kernel"], {t.get("tma", False) for t in p["tiles"]}) for p in plan] == [
        ("allgather_gemm", {False}), ("gemm_reduce_scatter", {False}), ("gemm_all_reduce", {False}),
        ("ring_attention", {False}),
        ("allgather_gemm", {True}), ("gemm_reduce_scatter", {True}), ("gemm_all_reduce", {True}),
        ("ring_attention", {True})]
    assert all(p["dims"] == bench.SIZES[p["kernel"]][0] for p in plan)  # the larger size
    assert plan[0]["tiles"][0] == bench.GEMM_TILES[0]  # the default first: its compile is prepare's
    assert [p["kernel"] for p in bench.tune_plan(["ring_attention", "gemm_all_reduce"], bench.QUICK_SIZES,
                                                 tma=False)] == ["ring_attention", "gemm_all_reduce"]
    moe = bench.tune_plan(["moe_dispatch_gemm"], {"moe_dispatch_gemm": bench.MOE_GEMM_SIZES})
    assert [(p["kernel"], p["dims"], len(p["tiles"])) for p in moe] == [
        ("moe_dispatch_gemm", bench.MOE_GEMM_SIZES[0], len(bench.MOE_GEMM_TILES))]


def _config(bench, tile: dict, **kw) -> dict:
    return {**bench._tile_fields(tile), **kw}


def test_tune_summary_picks_the_fastest_and_the_table_keeps_every_outcome() -> None:
    bench = load_benchmark("fused_bench")
    g = bench.GEMM_TILES
    flops = 2.0e12
    pointer = {"kernel": "gemm_reduce_scatter", "dims": {"m": 8192, "n": 8192, "k": 4096, "chunk_rows": 128},
               "flops": flops, "params": {"programs": 48}, "torch_s": 1.5e-3, "configs": [
                   _config(bench, g[0], median_s=4e-3, tflops=500.0, max_abs_error=0.0, spills=0),
                   _config(bench, g[2], median_s=2.5e-3, tflops=800.0, max_abs_error=0.0, spills=12),
                   _config(bench, g[3], out_of_resources="out of resource: shared memory"),
                   _config(bench, g[4], failed="CompilationError: x"),
                   _config(bench, g[5], skipped="past the time budget")]}
    tma = {"kernel": "gemm_reduce_scatter", "dims": pointer["dims"], "flops": flops, "params": {"programs": 48},
           "configs": [_config(bench, g[6], median_s=2e-3, tflops=1000.0, max_abs_error=0.0)]}
    ring = {"kernel": "ring_attention", "dims": {"heads": 32, "seq_local": 4096, "head_dim": 128, "chunk_rows": 8192},
            "configs": [_config(bench, bench.RING_TILES[1], refused="num_warps must be ...")],
            "error": "RuntimeError: channel error"}
    summary = bench.tune_summary([pointer, ring, tma])
    rs = summary["gemm_reduce_scatter"]
    assert rs["default"] == "128x128x64 w8 s3" and rs["torch_s"] == 1.5e-3
    assert rs["torch_tflops"] == pytest.approx(flops / 1.5e-3 / 1e12)
    assert rs["best"]["label"] == "128x128x64 w8 s3 tma"
    assert [c["label"] for c in rs["configs"]] == [bench.tile_label(t) for t in (g[0], *g[2:7])]
    timed = {c["label"]: c for c in rs["configs"] if "median_s" in c}
    assert timed["128x256x64 w8 s3"]["speedup_vs_default"] == pytest.approx(1.6)
    assert timed["128x128x64 w8 s3 tma"]["vs_torch"] == pytest.approx(0.75)
    assert summary["ring_attention"]["best"] is None and summary["ring_attention"]["torch_s"] is None
    assert summary["ring_attention"]["errors"] == ["RuntimeError: channel error"]
    lines = bench.tune_table(summary).splitlines()
    size = "| gemm_reduce_scatter | m=8192 n=8192 k=4096 |"
    assert f"{size} 128x128x64 w8 s3 | 4.000 | 500.0 | 1.00x | 0.38 | 0 | default |" in lines
    assert f"{size} 128x256x64 w8 s3 | 2.500 | 800.0 | 1.60x | 0.60 | 0 | 12 spills |" in lines
    assert f"{size} 128x128x64 w8 s3 tma | 2.000 | 1000.0 | 2.00x | 0.75 | 0 | **best** |" in lines
    assert f"{size} 256x128x64 w8 s3 |  |  |  |  |  | out of resources: out of resource: shared memory |" in lines
    assert f"{size} 128x128x128 w8 s2 |  |  |  |  |  | failed: CompilationError: x |" in lines
    assert f"{size} 64x256x64 w4 s4 |  |  |  |  |  | skipped: past the time budget |" in lines
    assert f"{size} torch | 1.500 | 1333.3 |  | 1.00 |  | reference |" in lines
    ring_size = "| ring_attention | heads=32 seq_local=4096 head_dim=128 |"
    assert f"{ring_size} 64x64 w4 s3 |  |  |  |  |  | refused: num_warps must be ... |" in lines
    assert f"{ring_size}  |  |  |  |  |  | session failed: RuntimeError: channel error |" in lines


def test_a_tuning_run_writes_its_json_after_every_session_and_keeps_failures(tmp_path: Path, monkeypatch) -> None:
    pytest.importorskip("triton")
    bench = load_benchmark("fused_bench")
    calls = []

    def session(kernel, backend, shape, dims, tiles, reps, deadline, reference, echo=print, run=None):
        calls.append((kernel, len(tiles), reference))
        if kernel == "gemm_all_reduce":
            raise RuntimeError("spin bound")
        written = json.loads(out.read_text()) if out.exists() else {"kernels": {}}
        assert len(written["kernels"]) == len({k for k, _, _ in calls[:-1]})  # the sessions before are saved
        configs = [{**bench._tile_fields(t), "median_s": 1e-3 * (i + 1), "tflops": 1.0} for i, t in enumerate(tiles)]
        return {"kernel": kernel, "dims": dims, "flops": 1e9, "params": {},
                **({"torch_s": 5e-4} if reference else {}), "configs": configs}

    monkeypatch.setattr(bench, "tune_session", session)
    out = tmp_path / "tune.json"
    lines: list[str] = []
    result = bench.run_tune(["allgather_gemm", "gemm_all_reduce", "ring_attention"], "ib", "cx7-400g",
                            bench.QUICK_SIZES, 2, True, 60.0, str(out), "python benchmarks/fused_bench.py --tune",
                            echo=lines.append)
    g, tma = len([t for t in bench.GEMM_TILES if not t["tma"]]), len([t for t in bench.GEMM_TILES if t["tma"]])
    ring = len([t for t in bench.RING_TILES if not t.get("tma")])
    assert calls == [("allgather_gemm", g, True), ("gemm_all_reduce", g, True), ("ring_attention", ring, True),
                     ("allgather_gemm", tma, False), ("gemm_all_reduce", tma, True),  # torch until one session ran
                     ("ring_attention", len(bench.RING_TILES) - ring, False)]
    written = json.loads(out.read_text())
    assert written == json.loads(json.dumps(result))
    ag = written["kernels"]["allgather_gemm"]
    assert ag["best"]["label"] == "128x128x64 w8 s3" and ag["torch_s"] == 5e-4 and len(ag["configs"]) == g + tma
    assert written["kernels"]["gemm_all_reduce"]["errors"] == ["RuntimeError: spin bound"] * 2
    assert "| allgather_gemm | m_local=512 n=1024 k=1024 | 128x128x64 w8 s3 | 1.000 | 1.0 | 1.00x | 0.50 |  | " \
           "default, **best** |" in lines[-1].splitlines()


def test_past_the_time_budget_no_session_starts_and_every_tile_is_recorded_as_skipped(monkeypatch) -> None:
    pytest.importorskip("triton")
    bench = load_benchmark("fused_bench")

    def session(*args, **kw):
        raise AssertionError("no session may start past the budget")

    monkeypatch.setattr(bench, "tune_session", session)
    result = bench.run_tune(["gemm_reduce_scatter", "ring_attention"], "ib", "cx7-400g", bench.SIZES, 5, True, 0.0,
                            None, "how", echo=lambda line: None)
    rs = result["kernels"]["gemm_reduce_scatter"]
    assert [c["label"] for c in rs["configs"]] == [bench.tile_label(t) for t in bench.GEMM_TILES]
    assert all(c["skipped"] == "past the time budget" for c in rs["configs"]) and rs["best"] is None
    assert len(result["kernels"]["ring_attention"]["configs"]) == len(bench.RING_TILES)


def test_the_tune_flag_runs_the_tuning_on_the_first_backend_and_shape_and_saves_the_mps_line(
        tmp_path: Path, monkeypatch) -> None:
    import transportd_cli.mps

    bench = load_benchmark("fused_bench")
    seen = {}

    class NoMps:
        running = True

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def describe(self) -> str:
            return "MPS: stand-in"

    def run_tune(kernels, backend, shape, sizes, reps, tma, seconds, json_path, how, echo=print, run=None):
        seen.update(kernels=kernels, backend=backend, shape=shape, sizes=sizes, reps=reps, tma=tma, seconds=seconds)
        return {"how": how, "kernels": {}}

    monkeypatch.setattr(transportd_cli.mps, "Mps", NoMps)
    monkeypatch.setattr(bench, "run_tune", run_tune)
    out = tmp_path / "tune.json"
    result = CliRunner().invoke(bench.main, ["--tune", "--json", str(out), "--backends", "efa,ib", "--no-tma",
                                             "--kernels", "moe,ring_attention,allgather_gemm,moe_dispatch_gemm",
                                             "--tune-seconds", "60"])
    assert result.exit_code == 0, result.output
    assert seen == {"kernels": ["ring_attention", "allgather_gemm", "moe_dispatch_gemm"], "backend": "efa",
                    "shape": "efa-200g", "sizes": {**bench.SIZES, "moe_dispatch_gemm": bench.MOE_GEMM_SIZES},
                    "reps": 5, "tma": False, "seconds": 60.0}
    written = json.loads(out.read_text())
    assert written["mps"] == "MPS: stand-in" and written["gpu"] is None  # the card beside the tiles, none here
    CliRunner().invoke(bench.main, ["--tune", "--quick"])
    assert seen["sizes"] == {**bench.QUICK_SIZES, "moe_dispatch_gemm": bench.QUICK_MOE_GEMM_SIZES}
    assert seen["reps"] == 2 and seen["tma"] is True
    CliRunner().invoke(bench.main, ["--tune", "--kernels", "moe_dispatch_gemm", "--moe-experts", "8"])
    assert seen["sizes"]["moe_dispatch_gemm"] == [{**dims, "experts": 8} | _all_split(dims, 8)
                                                  for dims in bench.MOE_GEMM_SIZES]
    assert seen["sizes"]["allgather_gemm"] == bench.SIZES["allgather_gemm"]


def test_a_run_rewrites_its_json_after_every_row_and_keeps_failures(tmp_path: Path, monkeypatch) -> None:
    """A run the device's time limit cuts short keeps the rows it measured."""
    bench = load_benchmark("fused_bench")
    out = tmp_path / "fused.json"
    seen: list[int] = []

    def row(kernel, backend, shape, dims, reps, echo=print, timeline=False, run=None):
        assert not timeline  # no --timeline
        seen.append(len(json.loads(out.read_text())["rows"]) if out.stat().st_size else 0)
        if kernel == "ring_attention":
            raise RuntimeError("spin bound")
        times = {"compute_s": 2e-3, "comm_s": 2e-3, "fused_s": 3e-3, "torch_s": 1e-3}
        return bench.derive({"kernel": kernel, "backend": backend, "shape": shape, **dims, **times}, 1e9, 1 << 20)

    monkeypatch.setattr(bench, "fused_row", row)
    result = CliRunner().invoke(bench.main, ["--json", str(out), "--kernels", "allgather_gemm,ring_attention",
                                             "--backends", "ib,efa", "--quick"])
    assert result.exit_code == 0, result.output
    assert seen == [0, 1, 2, 3]  # each row found every row before it already written
    rows = json.loads(out.read_text())["rows"]
    assert [(r["kernel"], r["backend"], "error" in r) for r in rows] == [
        ("allgather_gemm", "ib", False), ("ring_attention", "ib", True),
        ("allgather_gemm", "efa", False), ("ring_attention", "efa", True)]
    assert rows[1]["error"] == "RuntimeError: spin bound"
    # beside the rows, what fused_standing counts them by: the GPU (none here) and the settings, at their defaults
    call = json.loads(out.read_text())
    defaults = load_benchmark("fused_standing").CALL_DEFAULTS
    assert call.keys() == {"rows", "gpu", "mps", "kernel_source", *defaults} and call["gpu"] is None
    assert {key: call[key] for key in defaults} == defaults
    assert call["kernel_source"] == bench.kernel_source()  # the tree's kernels, as the run read them


def test_the_kernel_source_digest_follows_the_kernels_sources_and_nothing_else(tmp_path: Path) -> None:
    bench = load_benchmark("fused_bench")
    kernels = tmp_path / "gpuclient" / "kernels"
    kernels.mkdir(parents=True)
    (kernels / "op.py").write_text("TILE = 128\n")
    (tmp_path / "gpuclient" / "triton.py").write_text("calls\n")
    first = bench.kernel_source(tmp_path)
    assert len(first) == 12 and int(first, 16) >= 0
    (tmp_path / "gpuclient" / "session.py").write_text("not a kernel\n")  # outside KERNEL_SOURCES
    (tmp_path / "README.md").write_text("docs\n")
    assert bench.kernel_source(tmp_path) == first
    (kernels / "op.py").write_text("TILE = 64\n")  # a variant
    assert bench.kernel_source(tmp_path) != first
    (kernels / "op.py").write_text("TILE = 128\n")
    (tmp_path / "gpuclient" / "plan.py").write_text("plans\n")  # a covered file added
    assert bench.kernel_source(tmp_path) != first
    assert bench.kernel_source() != first  # the tree's own


def test_each_backend_runs_its_own_sizes_and_efa_grows_only_what_the_compute_grows_with(monkeypatch) -> None:
    """Both efa sizes of the four tensor- and sequence-parallel kernels keep the communication of ib's first (the
    same shards, chunks, tokens) and differ from it at most in the compute's dimension, grown, the second more than
    the first; MoE Dispatch+GEMM measures ib's sizes on efa too. A run measures each backend's own."""
    bench = load_benchmark("fused_bench")
    moves = {"allgather_gemm": ("n",), "gemm_reduce_scatter": ("k",), "gemm_all_reduce": ("k",),
             "ring_attention": ("seq_local",)}
    ib, efa = bench.backend_sizes("ib"), bench.backend_sizes("efa")
    assert set(ib) == set(efa) == {*moves, "moe_dispatch_gemm"}
    assert efa["moe_dispatch_gemm"] == ib["moe_dispatch_gemm"] and len(ib["moe_dispatch_gemm"]) == 2
    for kernel, grown in moves.items():
        base = ib[kernel][0]
        assert len(efa[kernel]) == 2
        for dims in efa[kernel]:
            assert dims.keys() == base.keys()
            assert {key for key in dims if dims[key] != base[key]} <= set(grown)
            assert all(dims[key] >= base[key] for key in grown)
        assert {key for key in base if efa[kernel][0][key] != efa[kernel][1][key]} == set(grown)
        assert all(efa[kernel][1][key] > efa[kernel][0][key] for key in grown)
    assert bench.backend_sizes("efa", quick=True) == bench.backend_sizes("ib", quick=True)
    seen: list[tuple[str, str, dict[str, int]]] = []

    def row(kernel, backend, shape, dims, reps, echo=print, timeline=False, run=None):
        seen.append((kernel, backend, dims))
        return bench.derive({"kernel": kernel, "backend": backend, "shape": shape, **dims, "compute_s": 2e-3,
                             "comm_s": 2e-3, "fused_s": 3e-3, "torch_s": 1e-3}, 1e9, 1 << 20)

    monkeypatch.setattr(bench, "fused_row", row)
    result = CliRunner().invoke(bench.main, ["--kernels", "gemm_all_reduce", "--backends", "ib,efa"])
    assert result.exit_code == 0, result.output
    assert seen == [("gemm_all_reduce", "ib", dims) for dims in ib["gemm_all_reduce"]] + [
        ("gemm_all_reduce", "efa", dims) for dims in efa["gemm_all_reduce"]]


def test_chunk_rows_and_dims_reach_every_size_of_their_kernel_only_and_dims_wins(monkeypatch) -> None:
    """--chunk-rows and --dims set keys in every size of the kernels they name, no other; a key both set takes
    --dims' value; the module's sizes are left alone."""
    bench = load_benchmark("fused_bench")
    before = {kernel: [dict(d) for d in sizes] for kernel, sizes in bench.SIZES.items()}
    seen: list[tuple[str, dict[str, int]]] = []

    def row(kernel, backend, shape, dims, reps, echo=print, timeline=False, run=None):
        seen.append((kernel, dims))
        return bench.derive({"kernel": kernel, "backend": backend, "shape": shape, **dims, "compute_s": 2e-3,
                             "comm_s": 2e-3, "fused_s": 3e-3, "torch_s": 1e-3}, 1e9, 1 << 20)

    monkeypatch.setattr(bench, "fused_row", row)
    result = CliRunner().invoke(bench.main, [
        "--kernels", "gemm_all_reduce,gemm_reduce_scatter", "--backends", "ib",
        "--chunk-rows", "gemm_all_reduce=256,gemm_reduce_scatter=128",
        "--dims", "gemm_all_reduce.m=16384,gemm_reduce_scatter.chunk_rows=64"])
    assert result.exit_code == 0, result.output
    assert seen == [("gemm_all_reduce", {**d, "m": 16384, "chunk_rows": 256}) for d in before["gemm_all_reduce"]] + [
        ("gemm_reduce_scatter", {**d, "chunk_rows": 64}) for d in before["gemm_reduce_scatter"]]
    assert bench.SIZES == before


def test_a_reduce_scatter_timeline_splits_into_tiles_chunks_and_ends_and_summarizes_in_ms() -> None:
    from gpuclient.kernels.gemm_reduce_scatter import ReduceScatterLayout

    bench = load_benchmark("fused_bench")
    # 2 segments of 2 x 2 tiles; 2 chunks a segment (3 counter sets: rs to each segment, then all-gather's)
    lay = ReduceScatterLayout(0, 2, m=512, n=256, k=64, chunk_rows=128, block=(128, 128, 64))
    ms = 1_000_000
    t0 = 50 * ms
    tiles = []
    for t in range(lay.tiles):  # peer tiles compute 1 ms each from t0; own tiles wait 2 ms after computing
        start = t0 + t * ms
        own = t >= 4
        tiles += [start, start + ms, start + 3 * ms if own else 0, start + (3 if own else 1) * ms]
    chunks = [0, 0] * 6
    chunks[2 * 2:2 * 2 + 4] = [t0 + 2 * ms, t0 + 2 * ms + ms // 2, t0 + 4 * ms, t0 + 5 * ms]  # segment 1's chunks
    ends = [t0 + 10 * ms, t0 + 11 * ms, t0 + 9 * ms]
    words = tiles + chunks + ends
    assert len(words) == lay.timeline_words(3)
    events = bench.rs_timeline_events(lay, 3, words)
    # the kernel's order: the default groups both row blocks, column by column; row-major goes row by row
    assert list(events["step"]) == [0, 0, 0, 0, 1, 1, 1, 1] and list(events["band"]) == [0, 1, 0, 1] * 2
    row_major = bench.rs_timeline_events(replace(lay, group_m=1), 3, words)
    assert list(row_major["band"]) == [0, 0, 1, 1] * 2
    summary = bench.rs_timeline_summary(lay, events, t0)
    assert summary["end_ms"] == 11.0 and summary["median_end_ms"] == 10.0
    assert summary["peer_tiles"] == {"first_start_ms": 0.0, "last_computed_ms": 4.0, "last_end_ms": 4.0,
                                     "compute_us_median": 1000.0}
    assert summary["own_tiles"]["last_end_ms"] == 10.0
    assert summary["own_waits"] == {"sum_ms": 8.0, "max_ms": 2.0, "share_over_10us": 1.0, "last_satisfied_ms": 10.0}
    assert summary["chunks"] == {"count": 2, "first_shipped_ms": 2.5, "last_shipped_ms": 5.0, "gate_wait_ms_max": 1.0,
                                 "shipped_ms": [2.5, 5.0]}


def test_a_moe_gemm_timeline_summary_reads_the_peers_pushes_beside_the_arrivals() -> None:
    """Rank 0 of two, two local experts: the peer's blocks seen 200 and 300 us after their push, the second
    expert's tiles still running after the last arrival."""
    from gpuclient.kernels.moe_layout import MoELayout

    bench = load_benchmark("fused_bench")
    ms, t0 = 1_000_000, 100_000_000
    lays = [MoELayout(r, 2, 4, 8, 2, 16) for r in range(2)]

    def words(sent: list, ready: list, start: list, done: list, arrived: list, ends: list) -> list[int]:
        # [rank or source][local expert], in ms from t0 (None: never happened)
        flat = [x for event in (sent, ready, start, done, arrived) for per in event for x in per]
        return [0 if x is None else t0 + round(x * ms) for x in flat] + [t0 + round(x * ms) for x in ends]

    rank0 = words(sent=[[None, None], [1.0, 2.0]], ready=[[None, None], [1.7, 3.3]],
                  start=[[0.0, 0.1], [1.0, 1.1]], done=[[0.5, 0.6], [2.0, 3.5]], arrived=[[None, None], [1.6, 3.2]],
                  ends=[3.6, 3.4, 3.5])
    rank1 = words(sent=[[1.5, 3.0], [None, None]], ready=[[1.2, 2.4], [None, None]],
                  start=[[1.0, 1.0], [0.2, 0.2]], done=[[1.5, 2.9], [0.4, 0.4]], arrived=[[1.1, 1.2], [None, None]],
                  ends=[3.0, 3.0, 3.0])
    events = [lay.split_timeline(w, 3) for lay, w in zip(lays, (rank0, rank1), strict=True)]
    got = bench.moe_timeline_summary(lays[0], events, 0, t0)
    assert got["end_ms"] == 3.6 and got["median_end_ms"] == 3.5
    assert got["sent"] == {"first_ms": 1.0, "last_ms": 2.0, "count": 2}
    assert got["arrivals"] == {"count": 2, "first_ready_ms": 1.7, "last_ready_ms": 3.3,
                               "latency_us": {"median": 250.0, "max": 300.0}}
    # landed 100 and 200 us after the peer pushed them: each ahead of the compute programs getting there
    assert got["landed"] == {"first_ms": 1.6, "last_ms": 3.2, "latency_us_median": 150.0}
    # an expert's tiles from when its rows were in: own 500 and 500 us, the peer's 300 and 200
    assert got["compute"] == {"first_start_ms": 0.0, "last_done_ms": 3.5, "span_ms": 3.5, "expert_us_median": 400.0,
                              "after_last_ready_ms": 0.2, "groups_after_last_ready": 1}
    alone = [{**e, "sent": 0 * e["sent"], "ready": 0 * e["ready"], "arrived": 0 * e["arrived"]}
             for e in events]  # the compute alone
    assert set(bench.moe_timeline_summary(lays[1], alone, 1, t0)) == {"end_ms", "median_end_ms", "compute"}
    # the GEMM's span fused over alone, per rank: rank 1 ran tiles from 0.2 to 2.9 ms; a mode with no tile: None
    timeline = {"fused": [got, bench.moe_timeline_summary(lays[1], events, 1, t0)],
                "compute": [{"compute": {"span_ms": 2.5}}, {"end_ms": 3.0}]}
    assert bench.gemm_span_ratio(timeline) == [1.4, None]
    assert bench.moe_timeline_summary(lays[1], events, 1, t0)["compute"]["span_ms"] == 2.7


def test_timeline_events_go_to_their_own_file_and_the_rows_keep_the_summaries(tmp_path: Path, monkeypatch) -> None:
    bench = load_benchmark("fused_bench")
    out, raw = tmp_path / "fused.json", tmp_path / "raw.json"
    asked: list[bool] = []

    def row(kernel, backend, shape, dims, reps, echo=print, timeline=False, run=None):
        asked.append(timeline)
        times = {"compute_s": 2e-3, "comm_s": 2e-3, "fused_s": 3e-3, "torch_s": 1e-3}
        done = bench.derive({"kernel": kernel, "backend": backend, "shape": shape, **dims, **times}, 1e9, 1 << 20)
        return {**done, "timeline": {"fused": [{"end_ms": 3.0}]}, "timeline_raw": {"fused": [[1, 2, 3]]}}

    def moe_row(backend, shape, dims, reps, echo=print, timeline=False, run=None):
        return row("moe_dispatch_gemm", backend, shape, dims, reps, echo, timeline)

    monkeypatch.setattr(bench, "fused_row", row)
    monkeypatch.setattr(bench, "moe_gemm_row", moe_row)
    result = CliRunner().invoke(bench.main, ["--json", str(out), "--timeline", str(raw), "--kernels",
                                             "gemm_reduce_scatter,moe_dispatch_gemm", "--backends", "ib", "--quick"])
    assert result.exit_code == 0, result.output
    assert asked == [True, True]
    kept, kept_moe = json.loads(out.read_text())["rows"]
    for r in (kept, kept_moe):
        assert r["timeline"] == {"fused": [{"end_ms": 3.0}]} and "timeline_raw" not in r
    events, moe_events = json.loads(raw.read_text())
    assert events["kernel"] == "gemm_reduce_scatter" and events["backend"] == "ib" and events["m"] == 1024
    assert events["modes"] == moe_events["modes"] == {"fused": [[1, 2, 3]]}
    assert moe_events["kernel"] == "moe_dispatch_gemm"
    assert moe_events["gemm_n"] == bench.QUICK_MOE_GEMM_SIZES[0]["gemm_n"]


@pytest.mark.multiprocess
def test_settle_waits_until_no_rail_has_work_in_flight() -> None:
    """``_settle`` on two real daemons over a slow modeled link: while a burst of PUTs is in a ring or on the wire
    it gives up after its timeout, and once it returns no rail has a record in a ring or taken and not complete,
    a work request in flight or a record waiting for its batch."""
    from tests.support.cluster import close_ranks, join_ranks
    from transportd_cli.localcluster import LocalCluster

    bench = load_benchmark("fused_bench")
    nbytes, puts = 1 << 16, 16  # 1 MiB at 20 MB/s: the link is busy for ~50 ms after the last push
    overrides = {"softverbs": {"nic_bandwidth": 20e6, "nic_latency_s": 1e-3}}
    with LocalCluster(2, backend="ib", overrides=overrides) as cluster:
        ranks = join_ranks(cluster, "settle", nbytes=nbytes, flags=8)
        clients = [r.client for r in ranks]
        try:
            sender, receiver = ranks
            for _ in range(puts):
                sender.channel.put(1, receiver.dst.id, 0, sender.src.id, 0, nbytes)
            with pytest.raises(TimeoutError, match="did not settle"):
                bench._settle(clients, timeout=0.0)
            bench._settle(clients)
            rails = [r for c in clients for r in c.stats()["rails"]]
            assert rails and not any(r["inflight"] or r["pending_rows"] for r in rails)
            rings = [ring for r in rails for ring in r["queues"]["rings"]]
            assert rings and not any(ring["depth"] or ring["outstanding"] for ring in rings)
            assert sum(r["commands"] for r in rails) >= puts  # the burst was taken, not lost
            sender.channel.quiet(timeout=10)
        finally:
            close_ranks(ranks)


def test_per_launch_columns_are_each_daemons_counters_over_a_phase_divided_by_its_launches() -> None:
    bench = load_benchmark("fused_bench")
    zero = dict.fromkeys((key for key, _, _ in bench.PER_LAUNCH), 0)
    before = [zero, {**zero, "direct_ns": 1_000_000}]
    middle = [{**zero, "direct_ns": 6_000_000, "flag_copies": 30}, {**zero, "direct_ns": 3_000_000}]
    after = [{**middle[0], "link_busy_ns": 9_000_000}, middle[1]]
    row: dict = {}

    def counted(start: list[dict], end: list[dict]) -> list:  # what each daemon counted from start to end
        return [Counter({key: e[key] - b[key] for key in b}) for b, e in zip(start, end, strict=True)]

    bench.per_launch(row, {"comm": counted(before, middle), "fused": counted(middle, after)}, reps=3)
    assert row["comm_direct_copy_ms"] == [2.0, pytest.approx(0.667)]
    assert row["comm_flag_copies"] == [10.0, 0.0] and row["fused_flag_copies"] == [0.0, 0.0]
    assert row["fused_link_busy_ms"] == [3.0, 0.0] and row["comm_loopback_wait_ms"] == [0.0, 0.0]
    assert set(row) == {f"{mode}_{name}" for mode in ("comm", "fused") for _, name, _ in bench.PER_LAUNCH}


def test_interleaved_runs_the_modes_in_turn_and_counts_only_around_the_counted_ones() -> None:
    """Each round runs every mode once, in order, after one untimed round; the medians are per mode; the counted
    modes' columns are what the daemons counted across their own timed launches alone (a counter that moves only
    during ``comm`` launches lands in comm's column, none in fused's)."""
    bench = load_benchmark("fused_bench")
    calls: list[str] = []
    placed = [0]

    class Daemon:  # a client whose one rail counts direct copies
        def stats(self) -> dict:
            return {"rails": [{"softverbs": {"direct_placed": placed[0], "direct_ns": 1000 * placed[0]}}]}

    def launch(mode: str, seconds: list[float]):
        def run() -> float:
            calls.append(mode)
            if mode == "comm":
                placed[0] += 4
            return seconds[sum(1 for c in calls if c == mode) - 1]
        return run

    # the first of each: the untimed round (a compile, say)
    times = {"compute": [90.0, 3.0, 1.0, 2.0], "comm": [90.0, 5.0, 6.0, 4.0], "fused": [90.0, 7.0, 9.0, 8.0],
             "torch": [90.0, 1.0, 1.0, 1.0]}
    launches = {mode: launch(mode, t) for mode, t in times.items()}
    seconds, counted_by = bench.interleaved(launches, 3, [Daemon(), Daemon()])
    assert calls == ["compute", "comm", "fused", "torch"] * 4
    assert seconds == {"compute": 2.0, "comm": 5.0, "fused": 8.0, "torch": 1.0}
    row: dict = {}
    bench.per_launch(row, counted_by, reps=3)
    assert row["comm_direct_copy_ms"] == [pytest.approx(0.004)] * 2  # 4 copies of 1 µs a launch, each daemon
    assert row["fused_direct_copy_ms"] == [0.0, 0.0]


def test_trace_needs_a_timeline_and_leaves_every_launchs_steps_in_its_directory(tmp_path: Path, monkeypatch) -> None:
    """``--trace`` without ``--timeline`` is a usage error before anything runs; with it, the daemons inherit
    ``SOFTVERBS_TRACE`` and what the timeline launches stamped lands in ``DIR/steps.json``."""
    from softverbs import _trace

    bench = load_benchmark("fused_bench")
    refused = CliRunner().invoke(bench.main, ["--trace", str(tmp_path / "t"), "--kernels", "gemm_reduce_scatter"])
    assert refused.exit_code == 2 and "give --timeline too" in refused.output
    assert not (tmp_path / "t").exists()
    (tmp_path / "a-file").write_text("kept")
    refused = CliRunner().invoke(bench.main, ["--timeline", str(tmp_path / "raw.json"), "--trace",
                                              str(tmp_path / "a-file")])
    assert refused.exit_code == 2 and "is a file" in refused.output
    assert (tmp_path / "a-file").read_text() == "kept"
    trace = tmp_path / "trace"

    def row(kernel, backend, shape, dims, reps, echo=print, timeline=False, run=None):
        assert timeline and os.environ["SOFTVERBS_TRACE"] == str(trace.resolve())
        bench._trace_start(f"{kernel}:{backend}:fused")
        _trace.stamp("send 1")
        bench._trace_done()
        times = {"compute_s": 2e-3, "comm_s": 2e-3, "fused_s": 3e-3, "torch_s": 1e-3}
        return bench.derive({"kernel": kernel, "backend": backend, "shape": shape, **dims, **times}, 1e9, 1 << 20)

    monkeypatch.setattr(bench, "fused_row", row)
    monkeypatch.setattr(_trace, "DIR", None)  # both restored after the test: main sets them
    monkeypatch.setenv("SOFTVERBS_TRACE", "")
    result = CliRunner().invoke(bench.main, ["--timeline", str(tmp_path / "raw.json"), "--trace", str(trace),
                                             "--kernels", "gemm_reduce_scatter", "--backends", "ib", "--quick"])
    assert result.exit_code == 0, result.output
    (label, cycle), = json.loads((trace / "steps.json").read_text()).items()
    assert label == "gemm_reduce_scatter:ib:fused" and sorted(cycle["p0"]) == ["done", "send 1"]


def test_gpu_timeline_words_go_onto_a_traced_cycles_clock(tmp_path: Path, monkeypatch) -> None:
    """``on_trace_us`` puts timeline words (GPU ns) on a traced cycle's clock through ``gpu_clock``'s offset
    (GPU minus host), its "no event" zeros as None; a cycle's start comes back from ``_trace_start`` on the
    trace's clock, and None when not tracing."""
    from softverbs import _trace
    from softverbs.soft.trace import read

    bench = load_benchmark("fused_bench")
    clock = {"offset_ns": 5_000.0, "round_trip_ns": 800.0, "error_bound_ns": 400.0}
    start = 1_000_000
    words = [[start + 5_000 + 1_500, 0], [start + 5_000 - 2_000, start + 5_000 + 123_456]]
    assert bench.on_trace_us(words, clock, start) == [[1.5, None], [-2.0, 123.5]]
    monkeypatch.setattr(_trace, "DIR", None)
    assert bench._trace_start("x") is None
    monkeypatch.setattr(_trace, "DIR", str(tmp_path))
    before = bench.time.monotonic_ns()
    start = bench._trace_start("x")
    assert before <= start <= bench.time.monotonic_ns()
    (ns, _pid, step), = read(tmp_path)
    assert step == "start x" and start <= ns


def _moe_gemm_sizes_seen(bench: Any, monkeypatch: Any) -> list[dict[str, int]]:
    """The sizes each MoE Dispatch+GEMM row of a run is asked for, recorded by a stand-in for ``moe_gemm_row``."""
    seen: list[dict[str, int]] = []

    def row(backend, shape, dims, reps, echo=print, timeline=False, run=None):
        seen.append(dims)
        return bench.derive({"kernel": "moe_dispatch_gemm", "backend": backend, "shape": shape, **dims,
                             "compute_s": 2e-3, "comm_s": 2e-3, "fused_s": 3e-3, "torch_s": 1e-3}, 1e9, 1 << 20)

    monkeypatch.setattr(bench, "moe_gemm_row", row)
    return seen


def test_moe_experts_overrides_only_the_moe_gemm_sizes_experts(monkeypatch) -> None:
    """--moe-experts: MoE Dispatch+GEMM's sizes with that many experts, everything else as it was (a split of
    every local expert stays a split of every one)."""
    bench = load_benchmark("fused_bench")
    seen = _moe_gemm_sizes_seen(bench, monkeypatch)
    result = CliRunner().invoke(bench.main, ["--kernels", "moe_dispatch_gemm", "--backends", "ib",
                                             "--moe-experts", "16"])
    assert result.exit_code == 0, result.output
    assert seen == [{**dims, "experts": 16} | _all_split(dims, 16) for dims in bench.MOE_GEMM_SIZES]
    assert any(_all_split(dims, 16) for dims in bench.MOE_GEMM_SIZES), "a size splits every expert"
    assert all(dims["experts"] == 64 for dims in bench.MOE_GEMM_SIZES)  # the module's sizes are left alone
    result = CliRunner().invoke(bench.main, ["--kernels", "moe_dispatch_gemm", "--moe-experts", "0"])
    assert result.exit_code == 2 and "--moe-experts" in result.output


def _all_split(dims: dict[str, int], experts: int) -> dict[str, int]:
    """A size that splits every local expert (two ranks) splits every one of ``experts`` too."""
    return {"split_experts": experts // 2} if dims.get("split_experts") == dims["experts"] // 2 else {}


@pytest.mark.parametrize("backend", ["ib", "efa"])
def test_moe_tokens_and_experts_per_put_reach_only_the_moe_gemm_sizes(monkeypatch, backend: str) -> None:
    """--moe-experts-per-put, --moe-tokens, --moe-split-experts and --moe-gemm-n: every MoE Dispatch+GEMM size of
    the backend with that group, that many tokens a rank, that split or that expert width, with --moe-experts too;
    the sizes' own otherwise (no experts_per_put key: the op's default); the module's sizes left alone."""
    bench = load_benchmark("fused_bench")
    sizes = bench.EFA_MOE_GEMM_SIZES if backend == "efa" else bench.MOE_GEMM_SIZES
    before = [dict(d) for d in sizes]
    seen = _moe_gemm_sizes_seen(bench, monkeypatch)
    for args, want in [([], sizes),
                       (["--moe-experts-per-put", "2"], [{**d, "experts_per_put": 2} for d in sizes]),
                       (["--moe-experts-per-put", "1", "--moe-experts", "16"],
                        [{**d, "experts": 16, "experts_per_put": 1} | _all_split(d, 16) for d in sizes]),
                       (["--moe-tokens", "1024"], [{**d, "tokens": 1024} for d in sizes]),
                       (["--moe-tokens", "512", "--moe-experts", "32"],
                        [{**d, "tokens": 512, "experts": 32} | _all_split(d, 32) for d in sizes]),
                       (["--moe-experts", "16", "--moe-split-experts", "3"],
                        [{**d, "experts": 16, "split_experts": 3} for d in sizes]),
                       (["--moe-split-experts", "0"], [{**d, "split_experts": 0} for d in sizes]),
                       (["--moe-gemm-n", "6144"], [{**d, "gemm_n": 6144} for d in sizes])]:
        seen.clear()
        result = CliRunner().invoke(bench.main, ["--kernels", "moe_dispatch_gemm", "--backends", backend, *args])
        assert result.exit_code == 0, result.output
        assert seen == want, args
    for bad in (["--moe-gemm-n", "0"], ["--moe-gemm-n", "wide"]):  # refused before any row runs
        seen.clear()
        result = CliRunner().invoke(bench.main, ["--kernels", "moe_dispatch_gemm", "--backends", backend, *bad])
        assert result.exit_code == 2 and "--moe-gemm-n" in result.output and seen == [], bad
    assert sizes == before and all("experts_per_put" not in dims for dims in sizes)
    for option in ("--moe-experts-per-put", "--moe-tokens"):
        result = CliRunner().invoke(bench.main, ["--kernels", "moe_dispatch_gemm", option, "0"])
        assert result.exit_code == 2 and option in result.output


def test_moe_gemm_work_counts_weight_passes_and_row_block_fill() -> None:
    """The MoE row's ``weight_passes`` and ``row_block_fill``, from each rank's layout and counts: two ranks of
    two local experts, 130 rows from each rank for expert 0 of each rank and none for expert 1. Split, an
    expert's weights stream once per source step (the own block first, then the peer's two), whole once; three
    128-row blocks span the 260 rows either way."""
    import numpy as np

    from gpuclient.kernels.moe_layout import MoELayout

    bench = load_benchmark("fused_bench")
    lays = [MoELayout(r, 2, 4, 256, 2, 16) for r in range(2)]
    counts = np.zeros((2, 4), dtype=np.int32)
    counts[:, [0, 2]] = 130
    assert bench.moe_gemm_work(lays, [counts, counts], 128, 2) == {"weight_passes": 2.0,
                                                                  "row_block_fill": round(260 / 384, 3)}
    assert bench.moe_gemm_work(lays, [counts, counts], 128, 0) == {"weight_passes": 1.0,
                                                                  "row_block_fill": round(260 / 384, 3)}
    assert bench.moe_gemm_work(lays, [counts, counts], 64, 0)["row_block_fill"] == round(260 / 320, 3)


def test_the_daemons_run_with_the_shape_the_options_and_the_rows_own_sections(tmp_path: Path, monkeypatch) -> None:
    """--nic-spin-us, --no-nic-streaming, --gil-switch-us and --poll-window-us reach the daemons' config beside the
    NIC shape and the run's other options, a row's own sections (MoE's decoupled signaling) merge in, and the JSON
    says what the run used; without them the daemons keep their defaults (no key, or 0 for the switch interval:
    Python's, and streaming on)."""
    bench = load_benchmark("fused_bench")
    out = tmp_path / "fused.json"
    seen: list[dict[str, Any]] = []

    def row(kernel, backend, shape, dims, reps, echo=print, timeline=False, run=None):
        seen.append(run.daemon_config(backend, shape, {"signal": {"decoupled": True}, "proxy": {"max_take": 64}}))
        times = {"compute_s": 2e-3, "comm_s": 2e-3, "fused_s": 3e-3, "torch_s": 1e-3}
        return bench.derive({"kernel": kernel, "backend": backend, "shape": shape, **dims, **times}, 1e9, 1 << 20)

    monkeypatch.setattr(bench, "fused_row", row)
    result = CliRunner().invoke(bench.main, ["--json", str(out), "--kernels", "allgather_gemm", "--backends", "efa",
                                             "--quick", "--nic-spin-us", "12", "--poll-window-us", "5",
                                             "--gil-switch-us", "50", "--no-nic-streaming"])
    assert result.exit_code == 0, result.output
    config = seen[0]
    assert config["softverbs"] == {"direct_copy": True, "direct_copy_via": "device", "io_spin_s": 0.0,
                                   **bench.SHAPES["efa-200g"], "nic_spin_s": pytest.approx(12e-6),
                                   "gil_switch_interval_s": pytest.approx(50e-6), "nic_streaming": False}
    assert config["proxy"] == {"poll_window_us": 5, "max_take": 64}
    assert config["signal"] == {"decoupled": True} and config["flags"] == {"publication": "cuda-copy"}
    saved = json.loads(out.read_text())
    assert (saved["nic_spin_us"], saved["poll_window_us"], saved["gil_switch_us"], saved["nic_streaming"]) == \
        (12.0, 5, 50.0, False)

    bench = load_benchmark("fused_bench")
    default = bench.RunOptions().daemon_config("ib", "cx7-400g")
    assert "nic_spin_s" not in default["softverbs"]
    assert default["softverbs"]["gil_switch_interval_s"] == 0.0  # Python's own
    assert default["softverbs"]["nic_streaming"] is True
    assert "proxy" not in default
    for option, bad in (("--nic-spin-us", "nan"), ("--nic-spin-us", "-1"), ("--nic-spin-us", "2e4"),
                        ("--poll-window-us", "-1"), ("--poll-window-us", "x")):
        result = CliRunner().invoke(bench.main, [option, bad, "--kernels", "moe"])
        assert result.exit_code == 2 and option in result.output, (option, bad, result.output)
