"""benchmarks/fused_tune.py without a GPU: which tiles a tuning run times and in what order, the summary and
table it reports, and the JSON it keeps after every session."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import fused_cases, fused_tune
from tests.support.benchmarks import load_benchmark


def test_tune_candidates_keep_what_the_ops_accept_and_name_what_they_refuse(monkeypatch) -> None:
    pytest.importorskip("triton")  # the ops' checks live beside their kernels
    bench = load_benchmark("fused_bench")
    for kernel in bench.KERNELS:  # at the bench's sizes every candidate is accepted, the op's default first
        kept, refused = fused_tune.tune_candidates(kernel, bench.SIZES[kernel][0])
        assert kept == fused_tune.TUNE_TILES[kernel] and refused == []
    assert fused_tune.tile_label(fused_tune.GEMM_TILES[0]) == "128x128x64 w8 s3"
    assert fused_tune.tile_label(fused_tune.RING_TILES[0]) == "64x64 w4 s2"
    # MoE Dispatch+GEMM: every candidate accepted, the op's own default first; one its op refuses is named
    kept, refused = fused_tune.tune_candidates("moe_dispatch_gemm", bench.MOE_GEMM_SIZES[0])
    assert kept == fused_tune.MOE_GEMM_TILES and refused == [] and set(fused_tune.TUNABLE) == set(fused_cases.CASES)
    from gpuclient.kernels.moe import default_gemm_tiles
    dims = bench.MOE_GEMM_SIZES[0]
    block, warps, stages = default_gemm_tiles(dims["tokens"], dims["topk"], fused_cases.WORLD, dims["experts"])
    assert fused_tune.MOE_GEMM_TILES[0] == {"block": block, "num_warps": warps, "num_stages": stages}
    monkeypatch.setitem(fused_tune.TUNE_TILES, "moe_dispatch_gemm",
                        [*fused_tune.MOE_GEMM_TILES, {"block": (64, 128, 48), "num_warps": 4, "num_stages": 3}])
    kept, refused = fused_tune.tune_candidates("moe_dispatch_gemm", bench.MOE_GEMM_SIZES[0])
    assert kept == fused_tune.MOE_GEMM_TILES and [r["label"] for r in refused] == ["64x128x48 w4 s3"]
    assert "gemm_block must be three powers of two" in refused[0]["refused"]
    # without --tma the descriptor tiles are left out, not refused
    kept, refused = fused_tune.tune_candidates("gemm_all_reduce", bench.SIZES["gemm_all_reduce"][0], tma=False)
    assert kept and not any(t["tma"] for t in kept) and refused == []
    # rows a tensor descriptor cannot step over: the TMA tiles refused, with the op's reason
    kept, refused = fused_tune.tune_candidates("allgather_gemm",
                                               {"m_local": 512, "n": 1004, "k": 1024, "chunk_rows": 64})
    assert [r["label"] for r in refused] == [fused_tune.tile_label(t) for t in fused_tune.GEMM_TILES if t["tma"]]
    assert all("needs n to be a multiple of 8" in r["refused"] for r in refused)
    assert refused[0]["block"] == [128, 128, 64] and refused[0]["tma"] is True
    # a shape the reduce-scatter layout refuses refuses every tile; a tile the ring layout refuses is named
    kept, refused = fused_tune.tune_candidates("gemm_reduce_scatter",
                                               {"m": 1025, "n": 1024, "k": 1024, "chunk_rows": 64})
    assert kept == [] and len(refused) == len(fused_tune.GEMM_TILES)
    assert "do not split into 2 equal segments" in refused[0]["refused"]
    monkeypatch.setitem(fused_tune.TUNE_TILES, "ring_attention",
                        [*fused_tune.RING_TILES, {"block": (96, 64), "num_warps": 4, "num_stages": 2},
                         {"block": (64, 64), "num_warps": 6, "num_stages": 2}])
    kept, refused = fused_tune.tune_candidates("ring_attention", bench.SIZES["ring_attention"][0])
    assert kept == fused_tune.RING_TILES
    assert [(r["label"], r["refused"].split(" must")[0]) for r in refused] == [
        ("96x64 w4 s2", "block (block_m, block_n)"), ("64x64 w6 s2", "num_warps")]


def test_tune_plan_times_every_kernels_pointer_tiles_before_any_tma_tile() -> None:
    pytest.importorskip("triton")
    bench = load_benchmark("fused_bench")
    plan = fused_tune.tune_plan(list(bench.KERNELS), bench.SIZES)
    assert [(p["kernel"], {t.get("tma", False) for t in p["tiles"]}) for p in plan] == [
        ("allgather_gemm", {False}), ("gemm_reduce_scatter", {False}), ("gemm_all_reduce", {False}),
        ("ring_attention", {False}),
        ("allgather_gemm", {True}), ("gemm_reduce_scatter", {True}), ("gemm_all_reduce", {True}),
        ("ring_attention", {True})]
    assert all(p["dims"] == bench.SIZES[p["kernel"]][0] for p in plan)  # the larger size
    assert plan[0]["tiles"][0] == fused_tune.GEMM_TILES[0]  # the default first: its compile is prepare's
    assert [p["kernel"] for p in fused_tune.tune_plan(["ring_attention", "gemm_all_reduce"], bench.QUICK_SIZES,
                                                 tma=False)] == ["ring_attention", "gemm_all_reduce"]
    moe = fused_tune.tune_plan(["moe_dispatch_gemm"], {"moe_dispatch_gemm": bench.MOE_GEMM_SIZES})
    assert [(p["kernel"], p["dims"], len(p["tiles"])) for p in moe] == [
        ("moe_dispatch_gemm", bench.MOE_GEMM_SIZES[0], len(fused_tune.MOE_GEMM_TILES))]


def _config(tile: dict, **kw) -> dict:
    return {**fused_tune._tile_fields(tile), **kw}


def test_tune_summary_picks_the_fastest_and_the_table_keeps_every_outcome() -> None:
    g = fused_tune.GEMM_TILES
    flops = 2.0e12
    pointer = {"kernel": "gemm_reduce_scatter", "dims": {"m": 8192, "n": 8192, "k": 4096, "chunk_rows": 128},
               "flops": flops, "params": {"programs": 48}, "torch_s": 1.5e-3, "configs": [
                   _config(g[0], median_s=4e-3, tflops=500.0, max_abs_error=0.0, spills=0),
                   _config(g[2], median_s=2.5e-3, tflops=800.0, max_abs_error=0.0, spills=12),
                   _config(g[3], out_of_resources="out of resource: shared memory"),
                   _config(g[4], failed="CompilationError: x"),
                   _config(g[5], skipped="past the time budget")]}
    tma = {"kernel": "gemm_reduce_scatter", "dims": pointer["dims"], "flops": flops, "params": {"programs": 48},
           "configs": [_config(g[6], median_s=2e-3, tflops=1000.0, max_abs_error=0.0)]}
    ring = {"kernel": "ring_attention", "dims": {"heads": 32, "seq_local": 4096, "head_dim": 128, "chunk_rows": 8192},
            "configs": [_config(fused_tune.RING_TILES[1], refused="num_warps must be ...")],
            "error": "RuntimeError: channel error"}
    summary = fused_tune.tune_summary([pointer, ring, tma])
    rs = summary["gemm_reduce_scatter"]
    assert rs["default"] == "128x128x64 w8 s3" and rs["torch_s"] == 1.5e-3
    assert rs["torch_tflops"] == pytest.approx(flops / 1.5e-3 / 1e12)
    assert rs["best"]["label"] == "128x128x64 w8 s3 tma"
    assert [c["label"] for c in rs["configs"]] == [fused_tune.tile_label(t) for t in (g[0], *g[2:7])]
    timed = {c["label"]: c for c in rs["configs"] if "median_s" in c}
    assert timed["128x256x64 w8 s3"]["speedup_vs_default"] == pytest.approx(1.6)
    assert timed["128x128x64 w8 s3 tma"]["vs_torch"] == pytest.approx(0.75)
    assert summary["ring_attention"]["best"] is None and summary["ring_attention"]["torch_s"] is None
    assert summary["ring_attention"]["errors"] == ["RuntimeError: channel error"]
    lines = fused_tune.tune_table(summary).splitlines()
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
        configs = [{**fused_tune._tile_fields(t), "median_s": 1e-3 * (i + 1), "tflops": 1.0}
                   for i, t in enumerate(tiles)]
        return {"kernel": kernel, "dims": dims, "flops": 1e9, "params": {},
                **({"torch_s": 5e-4} if reference else {}), "configs": configs}

    monkeypatch.setattr(fused_tune, "tune_session", session)
    out = tmp_path / "tune.json"
    lines: list[str] = []
    result = fused_tune.run_tune(["allgather_gemm", "gemm_all_reduce", "ring_attention"], "ib", "cx7-400g",
                            bench.QUICK_SIZES, 2, True, 60.0, str(out), "python benchmarks/fused_bench.py --tune",
                            echo=lines.append)
    g = len([t for t in fused_tune.GEMM_TILES if not t["tma"]])
    tma = len([t for t in fused_tune.GEMM_TILES if t["tma"]])
    ring = len([t for t in fused_tune.RING_TILES if not t.get("tma")])
    assert calls == [("allgather_gemm", g, True), ("gemm_all_reduce", g, True), ("ring_attention", ring, True),
                     ("allgather_gemm", tma, False), ("gemm_all_reduce", tma, True),  # torch until one session ran
                     ("ring_attention", len(fused_tune.RING_TILES) - ring, False)]
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

    monkeypatch.setattr(fused_tune, "tune_session", session)
    result = fused_tune.run_tune(["gemm_reduce_scatter", "ring_attention"], "ib", "cx7-400g", bench.SIZES, 5, True, 0.0,
                            None, "how", echo=lambda line: None)
    rs = result["kernels"]["gemm_reduce_scatter"]
    assert [c["label"] for c in rs["configs"]] == [fused_tune.tile_label(t) for t in fused_tune.GEMM_TILES]
    assert all(c["skipped"] == "past the time budget" for c in rs["configs"]) and rs["best"] is None
    assert len(result["kernels"]["ring_attention"]["configs"]) == len(fused_tune.RING_TILES)
