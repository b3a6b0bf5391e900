"""`transportd replay FILE`: a recorded trace (docs/trace.md) pushed again into a fresh job, and what differed.

The trace's context says how the recorded job looked from the traced rank's worker: the world, the rank's
source regions, each peer rank's regions and flag count, the channels and their ring sizes. The replay
rebuilds that with host memory against running daemons: every rank of the world joins (the traced one on
the first daemon given, the others spread over the rest, or on the first when only one is given),
registers regions of the recorded lengths in the recorded id order, takes the recorded flag count (the
traced rank, whose own count the recording does not hold, one), and exchanges; the traced rank opens
one channel per recorded channel. Region ids in the records are mapped to the ids the replay's regions
got (an id that was not registered in the recording maps to one that is not registered in the replay
either, so it is still refused).

The records are pushed in their recorded order, each channel's into its own ring, ``pace="recorded"``
keeping the recorded gaps between passes, ``pace="fast"`` as fast as the rings take them, while the
replay traces its own rank on the first daemon. Then the two traces are compared record by record (the
n-th record taken from a channel in the replay against the n-th in the recording): the take-time code,
and any later code (a completion error, a lost peer). The report lists the differences (the first
``max_listed``), counts by code on both sides, and the timing of both.
"""

from __future__ import annotations

import mmap
import os
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Annotated, Any

import msgspec
import numpy as np

import gpuclient
from transportd.control.client import ControlConnection
from transportd.control.curve import CurveClientKeys
from transportd.control.protocol import TraceStart, TraceStop
from transportd.dataplane.trace import FAILED, TAKEN, Trace, parse_trace
from transportd.errors import ErrorCode
from transportd_cli.errors import ReplayError

__all__ = ["PACES", "compare_traces", "format_report", "run_replay", "trace_start", "trace_stop"]

PACES = ("recorded", "fast")
UNREGISTERED = 0xFFFF  # a region id no replay rank registers: what an id unknown to the recording maps to


# --- the trace requests, shared with transportctl -----------------------------------------------------------
def trace_start(conn: ControlConnection, job: str, rank: int, out: str = "") -> dict[str, Any]:
    """Ask the daemon to record ``rank`` of ``job``'s channels (``out`` is only echoed back by stop)."""
    return conn.request(TraceStart(job=job, rank=rank, out=out))


def trace_stop(conn: ControlConnection, job: str, rank: int) -> tuple[dict[str, Any], bytes]:
    """End the recording; the reply and the trace file's bytes (handed over by descriptor)."""
    reply = conn.request(TraceStop(job=job, rank=rank))
    fd = conn.take_fd(int(reply["fd"]), "trace")
    try:
        size = os.fstat(fd).st_size
        if not size:
            return reply, b""
        with mmap.mmap(fd, size, prot=mmap.PROT_READ) as m:
            return reply, bytes(m)
    finally:
        os.close(fd)


# --- comparing two traces -----------------------------------------------------------------------------------
def _name(code: int) -> str:
    try:
        return ErrorCode(code).name
    except ValueError:
        return str(code)


def _by_channel(trace: Trace, channels: list[int]) -> dict[int, tuple[np.ndarray, dict[int, list[int]]]]:
    """Per channel (in ``channels`` order): its TAKEN entries, and later codes by index among them."""
    out = {}
    for cid in channels:
        mine = trace.entries[trace.entries["channel"] == cid]
        taken = mine[mine["kind"] == TAKEN]
        index = {int(p): i for i, p in enumerate(taken["position"].tolist())}
        later: dict[int, list[int]] = {}
        for e in mine[mine["kind"] == FAILED]:
            i = index.get(int(e["position"]))
            if i is not None:
                later.setdefault(i, []).append(int(e["code"]))
        out[cid] = (taken, later)
    return out


def _counts(codes: list[int]) -> dict[str, int]:
    out: dict[str, int] = {}
    for c in codes:
        out[_name(c)] = out.get(_name(c), 0) + 1
    return dict(sorted(out.items()))


def compare_traces(recorded: Trace, replayed: Trace, channel_map: dict[int, int],
                   max_listed: int = 50) -> dict[str, Any]:
    """What differed between a recording and its replay; ``channel_map``: recorded channel -> replay channel.

    Per record: the take-time code and the later codes; per side: records and outcomes by code.
    """
    rec = _by_channel(recorded, list(channel_map))
    rep = _by_channel(replayed, list(channel_map.values()))
    differences: list[dict[str, Any]] = []
    total_diff = 0
    rec_codes: list[int] = []
    rep_codes: list[int] = []
    counts = {"recorded": 0, "replayed": 0}
    for cid, rid in channel_map.items():
        (a, a_late), (b, b_late) = rec[cid], rep[rid]
        counts["recorded"] += len(a)
        counts["replayed"] += len(b)
        rec_codes += a["code"].tolist() + [c for v in a_late.values() for c in v]
        rep_codes += b["code"].tolist() + [c for v in b_late.values() for c in v]
        for i in range(max(len(a), len(b))):
            want = (int(a["code"][i]), a_late.get(i, [])) if i < len(a) else None
            got = (int(b["code"][i]), b_late.get(i, [])) if i < len(b) else None
            if want == got:
                continue
            total_diff += 1
            if len(differences) < max_listed:
                src = a if i < len(a) else b
                differences.append({
                    "channel": cid, "index": i, "opcode": int(src["record"]["opcode"][i]),
                    "recorded": None if want is None else [_name(want[0]), *map(_name, want[1])],
                    "replayed": None if got is None else [_name(got[0]), *map(_name, got[1])],
                })
    by_code = {"recorded": _counts(rec_codes), "replayed": _counts(rep_codes)}
    return {"same": total_diff == 0, "records": counts, "differences": total_diff, "listed": differences,
            "outcomes": by_code}


# --- the replay ---------------------------------------------------------------------------------------------
_Id = Annotated[int, msgspec.Meta(ge=0, le=0xFFFF)]
_Count = Annotated[int, msgspec.Meta(ge=0)]


class _PeerContext(msgspec.Struct):
    regions: dict[_Id, _Count] = {}
    flags: _Count = 0


class _ChannelContext(msgspec.Struct):
    capacity: Annotated[int, msgspec.Meta(ge=1)]


class _Context(msgspec.Struct):
    """What the replay reads of a trace's context (docs/trace.md); other keys are the recorder's own."""

    world: Annotated[int, msgspec.Meta(ge=1, le=1 << 16)]
    rank: _Id
    channels: dict[int, _ChannelContext]
    sources: dict[_Id, _Count] = {}
    peers: dict[_Id, _PeerContext] = {}


def _context(trace: Trace, path: str) -> _Context:
    """The trace's context in the shape the replay needs, or a ReplayError naming the file and the field."""
    try:
        ctx = msgspec.convert(trace.context, _Context, strict=False)
    except msgspec.ValidationError as exc:
        raise ReplayError(f"{path}: its context is not a trace context ({exc})") from None
    if ctx.rank >= ctx.world:
        raise ReplayError(f"{path}: its context puts rank {ctx.rank} in a world of {ctx.world}")
    return ctx


@dataclass
class _Rank:
    client: gpuclient.Client
    session: gpuclient.Session
    regions: dict[int, int] = field(default_factory=dict)  # recorded id -> replay id
    buffers: list[np.ndarray] = field(default_factory=list)


def _region_map(mapping: dict[int, int]) -> np.ndarray:
    """A u16 -> u16 lookup: recorded ids to replay ids, every other id to one the replay never registered."""
    table = np.full(1 << 16, UNREGISTERED, dtype=np.uint16)
    for recorded, replayed in mapping.items():
        table[recorded] = replayed
    return table


def _rewrite(entries: np.ndarray, sources: np.ndarray, dests: dict[int, np.ndarray]) -> np.ndarray:
    records = np.ascontiguousarray(entries["record"]).copy()
    records["src_region"] = sources[records["src_region"]]
    for peer, table in dests.items():
        mine = records["peer"] == peer
        records["dst_region"][mine] = table[records["dst_region"][mine]]
    return records


def _wait(what: str, done: Callable[[], bool], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    pause = 1e-4
    while not done():
        if time.monotonic() > deadline:
            raise ReplayError(f"replay: {what} did not happen within {timeout}s")
        time.sleep(pause)
        pause = min(2 * pause, 0.01)


def run_replay(path: str, sockets: list[str], *, pace: str = "fast", timeout: float = 60.0, job: str | None = None,
               curve: CurveClientKeys | None = None, max_listed: int = 50,
               echo: Callable[[str], None] = lambda _: None) -> dict[str, Any]:
    """Replay the trace at ``path`` against the daemons at ``sockets``; the report (see the module doc)."""
    if pace not in PACES:
        raise ValueError(f"pace must be one of {PACES}, not {pace!r}")
    if not sockets:
        raise ValueError("give at least one daemon's control socket")
    with open(path, "rb") as f:
        recorded = parse_trace(f.read(), path)
    ctx = _context(recorded, path)
    world, traced = ctx.world, ctx.rank
    channels = {cid: info.capacity for cid, info in ctx.channels.items()}
    if not channels:
        raise ReplayError(f"{path}: the trace names no channels or no world; nothing to replay")
    job = job or f"replay-{uuid.uuid4().hex[:8]}"
    others = sockets[1:] or sockets[:1]
    placement = {r: sockets[0] if r == traced else others[(r - (r > traced)) % len(others)] for r in range(world)}
    ranks: dict[int, _Rank] = {}
    control: ControlConnection | None = None
    try:
        for r in range(world):
            client = gpuclient.connect(placement[r])
            ranks[r] = rank = _Rank(client, client.join(job, rank=r, world=world))
            regions = ctx.sources if r == traced else ctx.peers.get(r, _PeerContext()).regions
            for rid, length in sorted(regions.items()):
                buf = gpuclient.host_array(max(length, 1))
                rank.regions[rid] = rank.session.register(buf).id
                rank.buffers.append(buf)
            # every rank that exchanged had flags; the traced rank's own count is not in its worker's peer
            # table (its records cannot signal itself), so it takes one
            rank.session.flags(max(1, ctx.peers.get(r, _PeerContext()).flags))
        gpuclient.exchange_all((rank.session for rank in ranks.values()), timeout=timeout)
        me = ranks[traced]
        handles = {cid: me.session.channel(capacity=max(cap, 64)) for cid, cap in channels.items()}
        control = ControlConnection(sockets[0], timeout_ms=int(timeout * 1000), name="transportd-replay", curve=curve)
        trace_start(control, job, traced)
        sources = _region_map(me.regions)
        dests = {r: _region_map(rank.regions) for r, rank in ranks.items()}
        taken = recorded.taken
        echo(f"replaying {len(taken)} records of rank {traced} (world {world}) into job {job!r}, pace {pace}")
        t0 = time.monotonic_ns()
        first_ns = int(taken["t_ns"][0]) if len(taken) else 0
        pushed = {cid: 0 for cid in channels}
        # one push per recorded pass of one channel: the entries one pass took share a t_ns
        cut = np.flatnonzero((np.diff(taken["t_ns"].astype(np.int64)) != 0) | (np.diff(taken["channel"]) != 0)) + 1
        for group in np.split(np.arange(len(taken)), cut) if len(taken) else []:
            entries = taken[group]
            cid = int(entries["channel"][0])
            if pace == "recorded":
                due = t0 + int(entries["t_ns"][0]) - first_ns
                while (left := due - time.monotonic_ns()) > 0:
                    time.sleep(min(left / 1e9, 0.01))  # keeping the recorded gaps: a deliberate wait
            records = _rewrite(entries, sources, dests)
            ch, capacity = handles[cid], max(channels[cid], 64)
            for lo in range(0, len(records), capacity):
                ch.push_records(records[lo : lo + capacity])
            pushed[cid] += len(records)
        elapsed = (time.monotonic_ns() - t0) / 1e9
        for cid, ch in handles.items():
            _wait(f"completion of channel {cid}'s {pushed[cid]} records",
                  lambda ch=ch, n=pushed[cid]: ch.ring.completion_pos >= n, timeout)
        stop_reply, data = trace_stop(control, job, traced)
        replayed = parse_trace(data, "the replay's trace")
    finally:
        if control is not None:
            control.close()
        for rank in ranks.values():
            try:
                rank.session.leave()
            finally:
                rank.client.close()
    channel_map = {cid: handles[cid].id for cid in channels}
    report = compare_traces(recorded, replayed, channel_map, max_listed)
    span = (int(taken["t_ns"][-1]) - first_ns) / 1e9 if len(taken) else 0.0
    report.update({"trace": path, "job": job, "rank": traced, "world": world, "pace": pace,
                   "recorded_span_s": span, "replay_push_s": elapsed, "replay_dropped": stop_reply["dropped"],
                   "channels": {str(k): v for k, v in channel_map.items()}})
    return report


def format_report(report: dict[str, Any]) -> str:
    """The report as text: a verdict line, counts by code on both sides, then the differences listed."""
    n = report["records"]
    lines = [f"{'same' if report['same'] else 'DIFFERENT'}: {n['replayed']} of {n['recorded']} records replayed "
             f"(pace {report['pace']}: recorded over {report['recorded_span_s']:.3f} s, pushed in "
             f"{report['replay_push_s']:.3f} s), {report['differences']} differing"]
    for side in ("recorded", "replayed"):
        codes = ", ".join(f"{k} {v}" for k, v in report["outcomes"][side].items()) or "-"
        lines.append(f"  {side:<9} outcomes: {codes}")
    for d in report["listed"]:
        lines.append(f"  channel {d['channel']} record {d['index']} (opcode {d['opcode']}): recorded "
                     f"{'/'.join(d['recorded']) if d['recorded'] else 'nothing'}, replayed "
                     f"{'/'.join(d['replayed']) if d['replayed'] else 'nothing'}")
    if report["differences"] > len(report["listed"]):
        lines.append(f"  ... and {report['differences'] - len(report['listed'])} more")
    return "\n".join(lines)

