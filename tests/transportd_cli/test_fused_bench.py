"""benchmarks/fused_bench.py without a GPU: the derived columns (overlap efficiency, speedups) from recorded
times, the table of kernel and MoE rows with failures kept, and the refusals made before any work."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from benchmarks import fused_cases, fused_timeline, moe_latency
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
           "dispatch_writes_per_dest": 640.0, "combine_writes_per_dest": 33.0, "dispatch_graph_s": 150e-6,
           "combine_graph_s": 210e-6}
    fp8 = {**moe, "decoupled": False, "fp8": True, "dispatch_graph_s": None, "combine_graph_s": None,
           "bf16_dispatch_s": 270e-6, "bf16_combine_s": 305e-6}
    line = bench._summary(ok, {"m": 8192, "n": 8192, "k": 4096, "chunk_rows": 128})
    assert line.split() == ["gemm_reduce_scatter", "ib", "cx7-400g", "m=8192", "n=8192", "k=4096", "compute", "4.000",
                            "comm", "3.000", "fused", "5.000", "torch", "3.500", "ms", "overlap", "0.67",
                            "vs", "sequential", "1.30x", "misses"]
    lines = bench.table([ok, failed, moe, fp8]).splitlines()
    assert "| gemm_reduce_scatter | ib | cx7-400g | m=8192 n=8192 k=4096 | 4.000 | 3.000 | 5.000 | 3.500 | 0.67 | " \
           "1.40x | 1.30x | 1.62x | 0.75 |" in lines  # ideal: (3 + 3.5) / max(3, 4)
    assert "| ring_attention | efa | efa-200g | heads=32 seq_local=2048 head_dim=128 | failed: RuntimeError: " \
           "channel error |" in lines
    # the latencies from calls, then from graph replays (none for fp8, whose dequantization runs between phases),
    # then fp8's bf16 twin on the same daemons (none for a bf16 row)
    assert "| 128 tok, H 7168, top-8 of 64 | ib | cx7-400g | on | bf16 | 250.0 | 300.0 | 150.0 / 210.0 | — | " \
           "2.00 (2.00) | 0.00 | 640.0 | 33.0 |" in lines
    assert "| 128 tok, H 7168, top-8 of 64 | ib | cx7-400g | off | fp8 | 250.0 | 300.0 | — | 270.0 / 305.0 | " \
           "2.00 (2.00) | 0.00 | 640.0 | 33.0 |" in lines
    assert moe_latency._graph_us(moe).split() == ["graphs:", "dispatch", "150.0", "us", "combine", "210.0", "us"]
    assert moe_latency._graph_us(fp8) == ""
    assert moe_latency._twin_us(moe) == ""
    assert moe_latency._twin_us(fp8).split() == ["bf16", "beside", "it:", "dispatch", "270.0", "us", "combine",
                                                 "305.0", "us"]


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
    assert bench.parse_per_kernel("allgather_gemm=8,gemm_all_reduce=1", "--group-m", fused_cases.GEMMS, "N") == {
        "allgather_gemm": 8, "gemm_all_reduce": 1}
    for bad in ("moe.tokens=8", "gemm_all_reduce.tokens=8", "gemm_all_reduce.m=0", "gemm_all_reduce.m",
                "gemm_all_reduce=16384"):  # a kernel of KERNELS, one of its size keys, an integer >= 1
        result = CliRunner().invoke(bench.main, ["--dims", bad, "--kernels", "moe"])
        assert result.exit_code == 2 and "--dims" in result.output, (bad, result.output)
    assert bench.parse_dims("gemm_all_reduce.m=16384, gemm_all_reduce.k=4096,ring_attention.seq_local=512") == {
        "gemm_all_reduce": {"m": 16384, "k": 4096}, "ring_attention": {"seq_local": 512}}


# --- the tuning mode (--tune): what it times, in which order, and how it reports ------------------------------


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
        fused_timeline.trace_start(f"{kernel}:{backend}:fused")
        _trace.stamp("send 1")
        fused_timeline.trace_done()
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
    default = fused_cases.RunOptions().daemon_config("ib", "cx7-400g")
    assert "nic_spin_s" not in default["softverbs"]
    assert default["softverbs"]["gil_switch_interval_s"] == 0.0  # Python's own
    assert default["softverbs"]["nic_streaming"] is True
    assert "proxy" not in default
    for option, bad in (("--nic-spin-us", "nan"), ("--nic-spin-us", "-1"), ("--nic-spin-us", "2e4"),
                        ("--poll-window-us", "-1"), ("--poll-window-us", "x")):
        result = CliRunner().invoke(bench.main, [option, bad, "--kernels", "moe"])
        assert result.exit_code == 2 and option in result.output, (option, bad, result.output)
