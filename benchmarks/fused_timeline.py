"""One launch of each mode with the kernels' timelines (``fused_bench.py --timeline``): what each rank's
programs recorded on the GPU's clock, summarized per rank in ms, and with ``--trace`` mapped onto the soft
fabric trace's clock."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from benchmarks.fused_cases import Case


TIMELINE_MODES = {"compute": {"communicate": False}, "comm": {"compute": False}, "fused": {}}


def rs_timeline_events(layout: Any, programs: int, words: Any) -> dict[str, Any]:
    """One rank's GemmReduceScatter / GemmAllReduce timeline (``ReduceScatterLayout.timeline_words``), split:
    ``tiles`` (tiles x 4: start, computed, waited (own tiles; else 0), end) with each tile's ``step`` (0 ..
    world-1; world-1 is the own segment) and segment row ``band``; ``chunks`` (counters x 2: completed,
    shipped; 0: not shipped by this rank); ``program_ends``."""
    import numpy as np

    tiles, chunks, ends = layout.split_timeline(words, programs)
    order = np.array(layout.tile_order(), dtype=np.int64).reshape(-1, 3)
    return {"tiles": tiles, "step": order[:, 0], "band": order[:, 1],
            "chunks": chunks.reshape(-1, 2), "program_ends": ends}


def rs_timeline_summary(layout: Any, events: dict[str, Any], t0: int) -> dict[str, Any]:
    """Milliseconds from ``t0`` (the earliest start over the ranks) of what a launch's timeline says: when the
    peers' tiles and the own tiles started and were computed, how long the own tiles waited for the peers'
    chunks (summed over tiles, and the share of tiles that waited at all), when this rank's chunks completed and
    shipped, and when its programs ended (the last, and the median: a last program far past the median is the
    launch's tail, its final waits and quiet)."""
    import numpy as np

    def ms(x: Any) -> float:
        return round(float(x - t0) / 1e6, 4)

    tiles, own = events["tiles"], events["step"] == layout.world - 1
    out: dict[str, Any] = {"end_ms": ms(events["program_ends"].max()),
                           "median_end_ms": ms(np.median(events["program_ends"]))}
    for name, which in (("peer_tiles", ~own), ("own_tiles", own)):
        part = tiles[which]
        if len(part):
            out[name] = {"first_start_ms": ms(part[:, 0].min()), "last_computed_ms": ms(part[:, 1].max()),
                         "last_end_ms": ms(part[:, 3].max()),
                         "compute_us_median": round(float(np.median(part[:, 1] - part[:, 0])) / 1e3, 2)}
    waited = tiles[own & (tiles[:, 2] > 0)]
    if len(waited):
        stall = waited[:, 2] - waited[:, 1]
        out["own_waits"] = {"sum_ms": round(float(stall.sum()) / 1e6, 3), "max_ms": round(float(stall.max()) / 1e6, 3),
                            "share_over_10us": round(float((stall > 10_000).mean()), 3),
                            "last_satisfied_ms": ms(waited[:, 2].max())}
    shipped = events["chunks"][events["chunks"][:, 1] > 0]
    if len(shipped):
        out["chunks"] = {"count": len(shipped), "first_shipped_ms": ms(shipped[:, 1].min()),
                         "last_shipped_ms": ms(shipped[:, 1].max()),
                         "gate_wait_ms_max": round(float((shipped[:, 1] - shipped[:, 0]).max()) / 1e6, 3),
                         "shipped_ms": [ms(x) for x in np.sort(shipped[:, 1])]}
    return out


def trace_start(label: str) -> int | None:
    """``--trace``: every process's softverbs stamps from here to ``trace_done`` are the cycle ``label``; returns
    the cycle's start on the trace's clock (``time.monotonic_ns``), None when not tracing."""
    from softverbs import _trace

    if not _trace.DIR:
        return None
    start = time.monotonic_ns()
    _trace.stamp(f"start {label}")
    return start


def trace_done() -> None:
    from softverbs import _trace

    if _trace.DIR:
        _trace.stamp("done")


def gpu_clock(device: int) -> dict[str, float]:
    """How the GPU's ``%globaltimer`` (the timelines' clock) maps onto the soft fabric trace's
    (``time.monotonic_ns``): gpu_common's ping-pong through mapped host memory (``offset_ns``: GPU minus host;
    ``error_bound_ns``: half the tightest round trip)."""
    from benchmarks.gpu_common import Gpu, calibrate

    return calibrate(Gpu(device))


def on_trace_us(gpu_ns: Any, clock: dict[str, float], start_ns: int) -> list:
    """GPU timeline words (%globaltimer ns, 0: no event) as µs from a traced cycle's start on the trace's clock,
    the shape kept, None where no event."""
    import numpy as np

    words = np.asarray(gpu_ns, dtype=np.int64)
    us = np.round((words - int(clock["offset_ns"]) - start_ns) / 1e3, 1).astype(object)
    us[words <= 0] = None
    return us.tolist()


def timeline_runs(case: Case, streams: list[Any], label: str = "") -> dict[str, Any]:
    """One launch of each of compute, comm and fused with every rank's timeline (after a plain launch of each, so
    the variants' first runs are not the ones read): per mode, each rank's summary and the raw words. With
    ``--trace``, each launch is a traced cycle ``label:mode``."""
    import torch

    ops = case.ops
    for op in ops:
        for kw in TIMELINE_MODES.values():
            op.preload(timeline=True, **kw)
    out: dict[str, Any] = {}
    for mode, kw in TIMELINE_MODES.items():
        timelines = [op.timeline() for op in ops]
        torch.cuda.synchronize()
        trace_start(f"{label}:{mode}")
        case.launch(timelines=timelines, **kw)
        torch.cuda.synchronize()
        trace_done()
        words = [tl.cpu().numpy() for tl in timelines]
        events = [rs_timeline_events(op.layout, op.programs, w) for op, w in zip(ops, words, strict=True)]
        t0 = min(int(e["tiles"][:, 0][e["tiles"][:, 0] > 0].min()) for e in events)
        out[mode] = {"ranks": [rs_timeline_summary(op.layout, e, t0) for op, e in zip(ops, events, strict=True)],
                     "raw": [w.tolist() for w in words]}
    return out


def moe_timeline_summary(lay: Any, events: list[dict[str, Any]], rank: int, t0: int) -> dict[str, Any]:
    """Milliseconds from ``t0`` (the earliest event over the ranks) of what rank ``rank``'s ``dispatch_gemm``
    timeline says, beside its peers' (``events``: every rank's ``MoELayout.split_timeline``, one GPU clock for
    all): when it pushed its blocks; when its compute programs saw each peer's block arrive, and how long after
    the peer pushed it (``latency_us``: the transfer through the daemons, flag included); when its tiles ran,
    how long an expert's tiles took once its rows were in (``expert_us_median``), and how much of the compute
    came after the last arrival (``after_last_ready_ms``, and the (source, expert) groups still computing
    then: a backlog, where the compute could not keep up with the arrivals), and ``span_ms`` from its first tile's
    start to its last tile's end (the waits for rows inside it, in a fused launch); when the peers' groups landed
    (``landed``: seen by a communication program, apart from when the compute programs got to them); its
    programs' ends."""
    import numpy as np

    def ms(x: Any) -> float:
        return round(float(x - t0) / 1e6, 4)

    me = events[rank]
    peers = np.arange(lay.world) != rank
    out: dict[str, Any] = {"end_ms": ms(me["program_ends"].max()),
                           "median_end_ms": ms(np.median(me["program_ends"]))}
    sent = me["sent"][peers]
    if (sent > 0).any():
        out["sent"] = {"first_ms": ms(sent[sent > 0].min()), "last_ms": ms(sent.max()), "count": int((sent > 0).sum())}
    ready = me["ready"]
    pushed = np.stack([events[s]["sent"][rank] for s in range(lay.world)])  # [source, local]: when s pushed it
    landed = (me["arrived"] > 0) & (pushed > 0)
    if landed.any():  # when the groups landed, whether or not a compute program was there yet
        out["landed"] = {"first_ms": ms(me["arrived"][landed].min()), "last_ms": ms(me["arrived"][landed].max()),
                         "latency_us_median": round(float(np.median(me["arrived"][landed] - pushed[landed])) / 1e3, 1)}
    seen = (ready > 0) & (pushed > 0)
    if seen.any():
        latency = (ready[seen] - pushed[seen]) / 1e3
        out["arrivals"] = {"count": int(seen.sum()), "first_ready_ms": ms(ready[seen].min()),
                           "last_ready_ms": ms(ready[seen].max()),
                           "latency_us": {"median": round(float(np.median(latency)), 1),
                                          "max": round(float(latency.max()), 1)}}
    done, start = me["done"], me["start"]
    if (done > 0).any():
        began = np.maximum(start, ready)  # an expert's tiles from when its rows were in
        ran = done > 0
        out["compute"] = {"first_start_ms": ms(start[ran].min()), "last_done_ms": ms(done.max()),
                          "span_ms": round(float(done.max() - start[ran].min()) / 1e6, 4),
                          "expert_us_median": round(float(np.median(done[ran] - began[ran])) / 1e3, 1)}
        if seen.any():
            last_ready = ready[seen].max()
            out["compute"]["after_last_ready_ms"] = round(float(done.max() - last_ready) / 1e6, 4)
            out["compute"]["groups_after_last_ready"] = int((done > last_ready).sum())
    return out


def gemm_span_ratio(timeline: dict[str, list[dict[str, Any]]]) -> list[float | None]:
    """Per rank, the expert GEMM's span in the fused launch over its span alone (``compute.span_ms`` of the
    ``fused`` and ``compute`` modes' summaries): 1.0 when the transfers cost the GEMM nothing but its waits for
    rows; None where a mode ran no tile."""
    def span(mode: str, rank: int) -> float | None:
        return timeline[mode][rank].get("compute", {}).get("span_ms")

    ratios: list[float | None] = []
    for rank in range(len(timeline["fused"])):
        fused, alone = span("fused", rank), span("compute", rank)
        ratios.append(round(fused / alone, 3) if fused and alone else None)
    return ratios


def moe_timeline_runs(moe: Any, label: str = "moe_dispatch_gemm") -> dict[str, Any]:
    """One round of each of compute, comm and fused with every rank's ``dispatch_gemm`` timeline (every timeline
    variant loaded first: the ranks share this process; the rounds timed before ran each mode already): per mode,
    each rank's summary (``moe_timeline_summary``) and the raw words. With ``--trace``, each round is a traced
    cycle ``label:mode``, and its ``on_trace`` gives each rank's pushes and landings (``sent``, ``arrived``:
    ``MoELayout.split_timeline``) as µs from the cycle's start on the trace's clock (``gpu_clock``), beside the
    soft fabric's steps of the same launch in ``steps.json``."""
    import torch

    from softverbs import _trace

    for kw in TIMELINE_MODES.values():
        for op in moe.ops:
            op.preload_gemm(timeline=True, **kw)
    clock = gpu_clock(moe.ops[0].device) if _trace.DIR else None
    out: dict[str, Any] = {}
    for mode, kw in TIMELINE_MODES.items():
        timelines = [op.gemm_timeline() for op in moe.ops]
        torch.cuda.synchronize()
        start = trace_start(f"{label}:{mode}")
        moe.round(timelines=timelines, **kw)
        words = [t.cpu().numpy() for t in timelines]
        events = [op.layout.split_timeline(w, op.gemm_programs) for op, w in zip(moe.ops, words, strict=True)]
        firsts = [e[name][e[name] > 0].min() for e in events for name in ("sent", "start") if (e[name] > 0).any()]
        t0 = int(min(firsts))
        out[mode] = {"ranks": [moe_timeline_summary(op.layout, events, r, t0) for r, op in enumerate(moe.ops)],
                     "raw": [w.tolist() for w in words]}
        if clock is not None and start is not None:
            out[mode]["on_trace"] = {"clock": clock, "ranks": [
                {name: on_trace_us(e[name], clock, start) for name in ("sent", "arrived")} for e in events]}
    return out
