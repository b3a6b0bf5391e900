"""benchmarks/fused_timeline.py without a GPU: the kernels' timeline words split and summarized per rank, and
GPU clock words mapped onto a traced cycle's clock."""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

from benchmarks import fused_timeline


def test_a_reduce_scatter_timeline_splits_into_tiles_chunks_and_ends_and_summarizes_in_ms() -> None:
    from gpuclient.kernels.gemm_reduce_scatter import ReduceScatterLayout

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
    events = fused_timeline.rs_timeline_events(lay, 3, words)
    # the kernel's order: the default groups both row blocks, column by column; row-major goes row by row
    assert list(events["step"]) == [0, 0, 0, 0, 1, 1, 1, 1] and list(events["band"]) == [0, 1, 0, 1] * 2
    row_major = fused_timeline.rs_timeline_events(replace(lay, group_m=1), 3, words)
    assert list(row_major["band"]) == [0, 0, 1, 1] * 2
    summary = fused_timeline.rs_timeline_summary(lay, events, t0)
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
    got = fused_timeline.moe_timeline_summary(lays[0], events, 0, t0)
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
    assert set(fused_timeline.moe_timeline_summary(lays[1], alone, 1, t0)) == {"end_ms", "median_end_ms", "compute"}
    # the GEMM's span fused over alone, per rank: rank 1 ran tiles from 0.2 to 2.9 ms; a mode with no tile: None
    timeline = {"fused": [got, fused_timeline.moe_timeline_summary(lays[1], events, 1, t0)],
                "compute": [{"compute": {"span_ms": 2.5}}, {"end_ms": 3.0}]}
    assert fused_timeline.gemm_span_ratio(timeline) == [1.4, None]
    assert fused_timeline.moe_timeline_summary(lays[1], events, 1, t0)["compute"]["span_ms"] == 2.7


def test_gpu_timeline_words_go_onto_a_traced_cycles_clock(tmp_path: Path, monkeypatch) -> None:
    """``on_trace_us`` puts timeline words (GPU ns) on a traced cycle's clock through ``gpu_clock``'s offset
    (GPU minus host), its "no event" zeros as None; a cycle's start comes back from ``_trace_start`` on the
    trace's clock, and None when not tracing."""
    from softverbs import _trace
    from softverbs.soft.trace import read

    clock = {"offset_ns": 5_000.0, "round_trip_ns": 800.0, "error_bound_ns": 400.0}
    start = 1_000_000
    words = [[start + 5_000 + 1_500, 0], [start + 5_000 - 2_000, start + 5_000 + 123_456]]
    assert fused_timeline.on_trace_us(words, clock, start) == [[1.5, None], [-2.0, 123.5]]
    monkeypatch.setattr(_trace, "DIR", None)
    assert fused_timeline.trace_start("x") is None
    monkeypatch.setattr(_trace, "DIR", str(tmp_path))
    before = time.monotonic_ns()
    start = fused_timeline.trace_start("x")
    assert before <= start <= time.monotonic_ns()
    (ns, _pid, step), = read(tmp_path)
    assert step == "start x" and start <= ns
