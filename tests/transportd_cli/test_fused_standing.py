"""benchmarks/fused_standing.py: a row's verdict against the targets, and the counts over calls that the standing
tables of docs/performance.md quote."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from tests.support.benchmarks import load_benchmark

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"


def _row(comm: float, compute: float, overlap: float, speedup: float, **dims: object) -> dict[str, object]:
    return {"kernel": "gemm_all_reduce", "backend": "ib", "shape": "cx7-400g", "m": 8192, "n": 8192, "k": 12288,
            "chunk_rows": 512, "comm_s": comm, "compute_s": compute, "overlap_efficiency": overlap,
            "speedup_vs_sequential": speedup, **dims}


@pytest.mark.parametrize(("comm", "overlap", "speedup", "verdict"), [
    (1.0, 0.8, 1.3, {"in_band": True, "meets_targets": True}),     # both targets met at their bounds
    (1.0, 0.79, 1.5, {"in_band": True, "meets_targets": False}),
    (1.0, 0.9, 1.29, {"in_band": True, "meets_targets": False}),
    (2.0, 0.9, 1.5, {"in_band": True, "meets_targets": True}),     # comm twice the compute: the band's edge
    (0.5, 0.9, 1.5, {"in_band": True, "meets_targets": True}),
    (2.01, 0.9, 1.5, {"in_band": False, "meets_targets": None}),   # outside the band the targets do not apply
    (0.49, 0.1, 1.0, {"in_band": False, "meets_targets": None}),
])
def test_a_row_meets_the_targets_only_inside_the_band(comm, overlap, speedup, verdict) -> None:
    standing = load_benchmark("fused_standing")
    assert standing.judge(_row(comm, 1.0, overlap, speedup)) == verdict


def test_fused_bench_writes_the_verdict_into_every_row() -> None:
    bench = load_benchmark("fused_bench")
    row = bench.derive({"compute_s": 4e-3, "comm_s": 3e-3, "fused_s": 3.5e-3, "torch_s": 3.5e-3}, 1, 1)
    assert (row["in_band"], row["meets_targets"]) == (True, True)  # overlap 3.5 / 3, 1.86x
    row = bench.derive({"compute_s": 4e-3, "comm_s": 9e-3, "fused_s": 9e-3, "torch_s": 3.5e-3}, 1, 1)
    assert (row["in_band"], row["meets_targets"]) == (False, None)


def test_a_size_is_named_by_every_key_fused_bench_sets() -> None:
    """fused_standing.SIZE_KEYS restates fused_bench's size keys (it cannot import the benchmark, which imports it):
    a key the benchmark gains and the standing lacks would lump two sizes into one."""
    bench, standing = load_benchmark("fused_bench"), load_benchmark("fused_standing")
    assert {*bench.SIZES_KEYS, "group_m", "tma"} <= set(standing.SIZE_KEYS)


def test_the_call_defaults_are_fused_bench_s() -> None:
    """fused_standing.CALL_DEFAULTS restates the settings fused_bench records beside its rows at its options'
    defaults: a default it misstated would count every plain call as a departure, one it lacked would lump a
    departure in with them."""
    bench, standing = load_benchmark("fused_bench"), load_benchmark("fused_standing")
    option = {"flags": "flags_where"}  # a recorded setting whose option is named otherwise
    defaults = {param.name: param.default for param in bench.main.params}
    assert {key: defaults[option.get(key, key)] for key in standing.CALL_DEFAULTS} == standing.CALL_DEFAULTS


def test_a_call_off_the_defaults_or_on_another_gpu_is_counted_apart() -> None:
    standing = load_benchmark("fused_standing")
    plain = {"rows": [_row(1.0, 1.0, 0.85, 1.4)], "copy_via": "device", "programs": None, "gpu": "NVIDIA H200"}
    entries = standing.standing([
        ("a.json", plain),
        ("b.json", {**plain, "copy_via": "host", "programs": 48}),
        ("c.json", {**plain, "gpu": "NVIDIA H100 80GB HBM3"}),
        ("d.json", {"rows": plain["rows"]}),  # an older call: no settings recorded (the defaults), no GPU
        ("e.json", {**plain, "rows": [_row(1.0, 1.0, 0.7, 1.4)]}),
    ])
    got = {(e["gpu"], e["size"]): (e["rows"], e["met"], e["calls"]) for e in entries}
    size = "m=8192 n=8192 k=12288 chunk_rows=512"
    assert got == {("NVIDIA H200", size): (2, 1, ["a.json", "e.json"]),
                   ("NVIDIA H200", f"{size} copy_via=host programs=48"): (1, 1, ["b.json"]),
                   ("NVIDIA H100 80GB HBM3", size): (1, 1, ["c.json"]),
                   (standing.UNRECORDED_GPU, size): (1, 1, ["d.json"])}
    assert "| NVIDIA H200 | gemm_all_reduce | ib | cx7-400g | " + size + " copy_via=host programs=48 | 1 / 1 |" \
        in standing.table(entries)


def test_an_entry_names_its_calls_kernel_sources_and_source_counts_only_those_calls(tmp_path) -> None:
    standing = load_benchmark("fused_standing")
    row = _row(1.0, 1.0, 0.85, 1.4)
    calls = {"tree-a.json": {"rows": [row], "kernel_source": "0123456789ab"},
             "variant.json": {"rows": [_row(1.0, 1.0, 0.70, 1.4)], "kernel_source": "fedcba987654"},
             "tree-b.json": {"rows": [row], "kernel_source": "0123456789ab"},
             "older.json": {"rows": [row]}}  # no digest recorded
    (entry,) = standing.standing(calls.items())
    assert entry["sources"] == ["0123456789ab", "fedcba987654", standing.UNRECORDED_SOURCE]
    assert (entry["rows"], entry["met"]) == (4, 3)
    for name, call in calls.items():
        (tmp_path / name).write_text(json.dumps(call))
    out = tmp_path / "standing.json"
    result = CliRunner().invoke(standing.main, [*sorted(str(p) for p in tmp_path.glob("*.json")), "--source", "0123",
                                                "--json", str(out)])
    assert result.exit_code == 0, result.output
    assert "variant.json: kernel source fedcba987654, not counted" in result.output
    assert "older.json: kernel source —, not counted" in result.output
    (counted,) = json.loads(out.read_text())["standing"]
    assert (counted["rows"], counted["met"], counted["sources"]) == (2, 2, ["0123456789ab"])
    assert counted["calls"] == ["tree-a.json", "tree-b.json"]


def test_the_standing_counts_rows_per_size_over_calls(tmp_path) -> None:
    standing = load_benchmark("fused_standing")
    calls = [
        ("a.json", {"rows": [_row(1.0, 1.0, 0.85, 1.4), _row(1.0, 1.0, 0.70, 1.5, m=32768),
                             {"kernel": "moe", "backend": "ib", "dispatch_s": 1e-4}]}),  # latency: not counted
        ("b.json", {"rows": [_row(1.0, 1.0, 0.75, 1.35), _row(3.0, 1.0, 0.99, 1.9),  # the second: outside the band
                             _row(1.0, 1.0, 0.9, 1.6, backend="efa", shape="efa-200g")]}),
        ("c.json", {"rows": []}),
    ]
    entries = standing.standing(calls)
    by = {(e["backend"], e["size"]): e for e in entries}
    assert len(entries) == 3
    base = by[("ib", "m=8192 n=8192 k=12288 chunk_rows=512")]
    assert (base["rows"], base["in_band"], base["met"]) == (3, 2, 1)
    assert base["overlap"] == [0.75, 0.85] and base["speedup"] == [1.35, 1.4]  # the band's rows alone
    assert base["calls"] == ["a.json", "b.json"]
    big = by[("ib", "m=32768 n=8192 k=12288 chunk_rows=512")]
    assert (big["rows"], big["in_band"], big["met"]) == (1, 1, 0)
    assert (by[("efa", base["size"])]["met"], by[("efa", base["size"])]["shape"]) == (1, "efa-200g")
    table = standing.table(entries).splitlines()
    assert "| — | gemm_all_reduce | ib | cx7-400g | m=8192 n=8192 k=12288 chunk_rows=512 | 1 / 2 | 3 | 0.75–0.85 | " \
           "1.35–1.40× |" in table
    for name, call in calls:
        (tmp_path / name).write_text(json.dumps(call))
    out = tmp_path / "standing.json"
    result = CliRunner().invoke(standing.main, [str(tmp_path / name) for name, _ in calls] + ["--json", str(out)])
    assert result.exit_code == 0, result.output
    assert "c.json: no rows" in result.output
    written = json.loads(out.read_text())
    assert written["targets"] == {"overlap": 0.8, "speedup": 1.3, "band": 2.0}
    assert written["standing"] == entries


def _standing_of(*patterns: str) -> list[dict[str, object]]:
    files = sorted(path for pattern in patterns for path in RESULTS.glob(pattern))
    assert files
    return load_benchmark("fused_standing").standing((path.name, json.loads(path.read_text())) for path in files)


def _met_by_size(entries: list[dict[str, object]], kernel: str, backend: str, size: str) -> tuple[int, int]:
    """(met, in band) over the entries of a size whatever their GPU, tile order or loads (group_m, tma), as the docs
    sum them; a call off fused_bench's default settings stays apart (its size names the departure)."""
    def plain(entry_size: str) -> str:
        return " ".join(word for word in entry_size.split() if not word.startswith(("group_m=", "tma=")))

    met = [(e["met"], e["in_band"]) for e in entries
           if (e["kernel"], e["backend"]) == (kernel, backend) and plain(e["size"]) == size]
    return sum(m for m, _ in met), sum(b for _, b in met)


#: the first sizes the standing counts: AllGather+GEMM's, ring attention's, and the reductions' at M and K
AG_FIRST = "m_local=4096 n=8192 k=8192 chunk_rows=512"
RING_FIRST = "heads=32 seq_local=8192 head_dim=128 chunk_rows=8192"
REDUCTION = "m={m} n=8192 k={k} chunk_rows=512"


def test_the_reductions_at_m_32768_stand_as_the_docs_say() -> None:
    """docs/performance.md's counts for the reductions' ib sizes, from the calls they were measured in."""
    entries = _standing_of("h200-2026-12-06-reductions-m-*.json")
    assert _met_by_size(entries, "gemm_reduce_scatter", "ib", REDUCTION.format(m=32768, k=6144)) == (3, 3)
    assert _met_by_size(entries, "gemm_all_reduce", "ib", REDUCTION.format(m=32768, k=12288)) == (2, 3)
    # 0.797 once: printed 0.80, a miss
    assert _met_by_size(entries, "gemm_reduce_scatter", "ib", REDUCTION.format(m=8192, k=6144)) == (0, 3)
    assert _met_by_size(entries, "gemm_all_reduce", "ib", REDUCTION.format(m=8192, k=12288)) == (1, 3)


#: the H200 calls with the GEMMs in a grouped tile order that docs/performance.md's standing counts (2026-12-04)
GROUPED_CALLS = ("h200-2026-12-04-gemm-order-a-8.json", "h200-2026-12-04-gemm-order-b-4.json",
                 "h200-2026-12-04-gemm-order-b-8.json", "h200-2026-12-04-fused-bench-all.json",
                 "h200-2026-12-04-trace.json", "h200-2026-12-04-fused-bench-all-2.json",
                 "h200-2026-12-04-fused-bench-runs.json", "h200-2026-12-04-fused-bench-last.json",
                 "h200-2026-12-04-fused-bench-copy-run-tp.json")
#: the H200 calls of ring attention at its current sizes that the same standing counts (2026-12-03 and -04)
RING_CALLS = ("h200-2026-12-03-fused-bench-8mib-1.json", "h200-2026-12-03-fused-bench-8mib-2.json",
              "h200-2026-12-03-fused-bench-8mib-chunks.json", "h200-2026-12-03-fused-bench-local-sockets-all.json",
              "h200-2026-12-03-fused-bench-interleaved-all.json", "h200-2026-12-04-ring-attention-tma.json",
              "h200-2026-12-04-ring-attention-pointers.json", *GROUPED_CALLS[3:4], *GROUPED_CALLS[5:])


def test_the_hand_counted_standing_holds() -> None:
    """docs/performance.md's and the README's counts made by hand before fused_standing existed, recounted from the
    calls they cover: AllGather+GEMM's and ring attention's first sizes, the reductions at M 8192."""
    grouped = _standing_of(*GROUPED_CALLS)
    assert _met_by_size(grouped, "allgather_gemm", "ib", AG_FIRST) == (8, 8)
    assert _met_by_size(grouped, "allgather_gemm", "efa", AG_FIRST) == (7, 8)
    assert _met_by_size(grouped, "gemm_reduce_scatter", "efa", REDUCTION.format(m=8192, k=12288)) == (6, 9)
    assert _met_by_size(grouped, "gemm_all_reduce", "efa", REDUCTION.format(m=8192, k=24576)) == (4, 8)
    with_later = _standing_of(*GROUPED_CALLS, "h200-2026-12-06-reductions-m-8192-*.json")
    assert _met_by_size(with_later, "gemm_reduce_scatter", "ib", REDUCTION.format(m=8192, k=6144)) == (3, 12)
    assert _met_by_size(with_later, "gemm_all_reduce", "ib", REDUCTION.format(m=8192, k=12288)) == (1, 11)
    ring = _standing_of(*RING_CALLS)
    assert _met_by_size(ring, "ring_attention", "ib", RING_FIRST) == (12, 12)
    assert _met_by_size(ring, "ring_attention", "efa", RING_FIRST) == (11, 12)


def test_the_reductions_on_the_h100_stand_as_the_docs_say() -> None:
    """docs/performance.md's and the README's H100 counts for the reductions' first sizes at M 32768, from the calls at
    fused_bench's default settings and chunks (GEMM+AR's calls with --chunk-rows 1024 and 2048 or --copy-via host are
    not counted)."""
    entries = _standing_of("h100-2026-12-06-reductions-*.json", "h100-2026-12-06-ar-ib-chunk-rows-512.json")
    # summed with and without a recorded GPU
    assert _met_by_size(entries, "gemm_reduce_scatter", "ib", REDUCTION.format(m=32768, k=6144)) == (6, 9)
    assert _met_by_size(entries, "gemm_all_reduce", "ib", REDUCTION.format(m=32768, k=12288)) == (7, 12)
    assert _met_by_size(entries, "gemm_reduce_scatter", "efa", REDUCTION.format(m=32768, k=12288)) == (5, 5)
    assert _met_by_size(entries, "gemm_all_reduce", "efa", REDUCTION.format(m=32768, k=24576)) == (5, 5)
    assert {e["gpu"] for e in entries} == {"NVIDIA H100 80GB HBM3", load_benchmark("fused_standing").UNRECORDED_GPU}


def test_allgather_and_ring_attention_on_the_h100_stand_as_the_docs_say() -> None:
    """docs/performance.md's and the README's H100 counts for AllGather+GEMM's and ring attention's first sizes."""
    entries = _standing_of("h100-2026-12-06-fused-allgather-ring-moe.json", "h100-2026-12-06-ag-ring-first-size-*.json")
    for backend in ("ib", "efa"):
        assert _met_by_size(entries, "allgather_gemm", backend, AG_FIRST) == (3, 3)
        assert _met_by_size(entries, "ring_attention", backend, RING_FIRST) == (3, 3)


def test_moe_stands_as_the_docs_say() -> None:
    """docs/performance.md's and the README's MoE Dispatch+GEMM counts, from the H100 calls they quote (the earlier
    ones record no GPU; their file names say it), summed over both."""
    entries = _standing_of("h100-2026-12-05-moe-1024-n6144-split-32-*.json",
                           "h100-2026-12-05-fused-bench-moe-sizes-*.json",
                           "h100-2026-12-06-fused-allgather-ring-moe.json", "h100-2026-12-06-moe-defaults-*.json",
                           "h100-2026-12-06-moe-1024-defaults-*.json", "h100-2026-12-06-moe-launch-*.json",
                           "h100-2026-12-06-moe-rehearse-off-*.json")
    few = "tokens=128 hidden=7168 topk=8 experts=64 gemm_n=4096 experts_per_put=8 split_experts=8"
    many = "tokens=1024 hidden=7168 topk=8 experts=64 gemm_n=6144 experts_per_put=8 split_experts=32"
    assert _met_by_size(entries, "moe_dispatch_gemm", "ib", many) == (8, 19)
    assert _met_by_size(entries, "moe_dispatch_gemm", "efa", many) == (6, 19)
    assert _met_by_size(entries, "moe_dispatch_gemm", "ib", few) == (0, 15)
    assert _met_by_size(entries, "moe_dispatch_gemm", "efa", few) == (1, 15)
    ib_many = [e for e in entries if (e["kernel"], e["backend"], e["size"]) == ("moe_dispatch_gemm", "ib", many)]
    assert min(e["overlap"][0] for e in ib_many) == pytest.approx(0.76, abs=0.005)
    assert max(e["overlap"][1] for e in ib_many) == pytest.approx(0.86, abs=0.005)
    assert {e["gpu"] for e in ib_many} == {"NVIDIA H100 80GB HBM3", load_benchmark("fused_standing").UNRECORDED_GPU}


@pytest.mark.parametrize(("text", "message"), [
    ("{not json", "not JSON"),
    (b"\xff\xfe\x00garbage", "not JSON"),
    ("[1, 2]", "not a fused_bench JSON"),
    ('{"rows": 3}', "not a fused_bench JSON"),
    ('{"rows": [{"kernel": "gemm_all_reduce", "backend": "ib", "overlap_efficiency": 0.9}]}',
     "has no comm_s, compute_s, speedup_vs_sequential"),
])
def test_a_file_that_is_not_a_fused_bench_json_is_refused_by_name(tmp_path, text, message) -> None:
    standing = load_benchmark("fused_standing")
    good, bad = tmp_path / "good.json", tmp_path / "bad.json"
    good.write_text(json.dumps({"rows": [_row(1.0, 1.0, 0.9, 1.5)]}))
    bad.write_bytes(text if isinstance(text, bytes) else text.encode())
    out = tmp_path / "standing.json"
    result = CliRunner().invoke(standing.main, [str(good), str(bad), "--json", str(out)])
    assert result.exit_code == 2, result.output
    assert "bad.json" in result.output and message in result.output
    assert "Traceback" not in result.output and not out.exists()  # nothing half written
