"""The proxy: drains command rings into one backend (one rail), through the compiled engine.

Every per-record step runs in C (``transportd/core/engine.c``, the extension ``transportd._core``) with
the GIL released. One iteration (:meth:`Proxy.run_once`):

1. **take** -- from every channel, the records that are ready, as many as the connections its job feeds
   can still accept (rows waiting + WRs in flight under ``inflight_cap``): when a connection is full,
   records stay in the ring and the ring fills, so backpressure reaches the producer; nothing is dropped.
   Each record is validated and translated (``transportd/core/validate.h``); a bad one is counted and
   reported through the channel's error word, and the good ones around it go on.
2. **post** -- rows wait per connection until a batch of ``batch_max`` commands fills, the polling
   window (``poll_window_us``) passes, or a NO_BATCH / FENCE / QUIET command asks for it; each ready batch
   (decoupled if asked) is handed to the backend, all of them in one call, one token per batch.
3. **progress** -- the backend's completions, in one call: each token retires its batch, frees its WRs,
   publishes each channel's completion position (the first ring position not yet complete, so a kernel's
   QUIET at ``p`` is satisfied once it is ``> p``), and a failed one writes REMOTE_ACCESS / TRANSPORT into
   the error words of the channels it came from.

This module is the control plane around the engine. The job-scoped tables, the channel and connection
maps and the stats are :class:`~transportd.dataplane.proxy_base.ProxyBase`'s, which the engine's model
shares; here the engine is handed a view of a table
(:class:`~transportd.dataplane.tables.RegionTable`, :class:`~transportd.dataplane.tables.PeerTable`) after
every change, and its counters and per-channel and per-connection state are read for the stats.

``backend=None`` makes the engine its own null NIC (every batch completes on the next poll, nothing
leaves C): what ``transportd bench proxy`` measures. :mod:`transportd_models.engine` is the same loop in
numpy, the oracle of the differential test; the daemon never runs it.

Tracing (:meth:`Proxy.trace_start` / :meth:`Proxy.trace_stop`): the engine appends every record a traced
rank's channels take, with its time and outcome, to a part file per channel (``transportd/core/trace.h``,
:mod:`transportd.dataplane.trace`); this side only opens the files, hands the engine their descriptors,
flushes and closes them. A channel the rank opens while traced is traced from its first record.

The rail worker does not call :meth:`Proxy.run_once` pass by pass: :meth:`Proxy.serve` runs its whole
loop in the engine (passes, the idle back-off, the watch of the ring heads) with the GIL released, and
returns only when the worker's link has a request or :meth:`Proxy.interrupt` asks it to
(``transportd/dataplane/worker.py``, ``serve_loop``).

Threading: one thread runs the loop; the table methods may be called between iterations from the same
thread (the rail worker does) or from another thread (a lock serializes them with ``run_once``; a call
from another thread while :meth:`Proxy.serve` holds that lock interrupts the loop until it gets the lock).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from cmd_ring.ring import RingFile
from transportd import _core
from transportd.backends import traits_of
from transportd.backends.interface import COMPLETION_DTYPE, PLAN_DTYPE, Backend
from transportd.dataplane.proxy_base import DrainedRing, JobTables, ProxyBase, code_name
from transportd.dataplane.tables import PeerTable, RegionTable

__all__ = ["Proxy", "COUNTERS", "SERVE_INTERRUPTED", "SERVE_LINK", "TRACE_BUFFER_ENTRIES"]

#: Why :meth:`Proxy.serve` returned: its link descriptor turned readable, or :meth:`Proxy.interrupt`.
SERVE_LINK: int = _core.SERVE_LINK
SERVE_INTERRUPTED: int = _core.SERVE_INTERRUPTED

TRACE_BUFFER_ENTRIES = 4096  # entries a traced channel buffers before the engine writes them out (288 KiB)

COUNTERS: tuple[str, ...] = _core.COUNTERS
assert _core.PLAN_ROW_SIZE == PLAN_DTYPE.itemsize and _core.COMPLETION_SIZE == COMPLETION_DTYPE.itemsize


class _EngineLock:
    """The proxy's lock. :meth:`Proxy.serve` holds it while the loop runs in C, for as long as no request
    comes; a caller from another thread asks that loop to return (``Engine.interrupt``) until it gets the
    lock, retrying every millisecond, since the serving thread may take the lock again first."""

    __slots__ = ("_lock", "_interrupt", "serving")

    def __init__(self, interrupt: Callable[[], None]) -> None:
        self._lock = threading.Lock()
        self._interrupt = interrupt
        self.serving = False

    def __enter__(self) -> None:
        lock = self._lock
        if lock.acquire(False):
            return
        while True:
            if self.serving:
                self._interrupt()
            if lock.acquire(timeout=0.001):
                return

    def __exit__(self, *exc: object) -> None:
        self._lock.release()


@dataclass(eq=False)
class _Trace:
    """A traced (job, rank): where its part files go and what its channels' recorders wrote."""

    prefix: str
    buffer_entries: int
    start_mono_ns: int
    start_wall_ns: int
    fds: dict[int, int] = field(default_factory=dict)  # channel -> part file descriptor, while recording
    parts: list[str] = field(default_factory=list)
    channels: dict[int, int] = field(default_factory=dict)  # channel -> ring capacity, every one traced
    entries: int = 0
    written: int = 0
    dropped: int = 0
    write_errors: list[str] = field(default_factory=list)
    context: dict[str, Any] | None = None  # what the job looked like while the rank was in it (merged snapshots)


def _merge_context(old: dict[str, Any] | None, new: dict[str, Any]) -> dict[str, Any]:
    """A trace's context after another snapshot: ``new``, plus the regions and flags ``old`` knew and ``new``
    no longer does (a rank that left, the traced one included), so a trace stopped after its job ended
    still says what its records addressed."""
    if old is None:
        return new
    peers: dict[str, Any] = {}
    for r in sorted(old["peers"].keys() | new["peers"].keys(), key=int):
        before, now = old["peers"].get(r), new["peers"].get(r)
        if before is None or now is None:
            peers[r] = now or before
            continue
        peers[r] = {**now, "regions": {**before["regions"], **now["regions"]}, "flags": now["flags"] or before["flags"]}
    return {**new, "world": new["world"] or old["world"], "sources": {**old["sources"], **new["sources"]},
            "peers": peers}


class Proxy(ProxyBase):
    """Drains command rings into one backend (one rail); see the module doc for the loop, and
    :class:`~transportd.dataplane.proxy_base.ProxyBase` for the knobs, the table methods and the stats.

    A backend whose traits declare a compiled poster (ib, efa: :attr:`c_poster`) is posted to and polled
    from C directly; others (the null backend) through their Python ``post_batches`` and ``poll``, once per
    pass: one posting path per backend.
    """

    def __init__(self, backend: Backend | None, **knobs: Any) -> None:
        super().__init__(**knobs)
        self.backend = backend
        # a backend with a compiled poster (ib, efa) is posted to and polled from C, with no Python per pass
        poster = backend.c_poster if traits_of(backend).compiled_poster else None
        hooks = (None, None) if backend is None or poster is not None else (self._post, self._poll)
        self._core = _core.Engine(batch_max=self.batch_max, window_ns=self.window_ns,
                                  inflight_cap=self.inflight_cap, decoupled=self.decoupled,
                                  max_length=self.max_length, max_take=self.max_take, poll_max=self.poll_max,
                                  post=hooks[0], poll=hooks[1], poster=poster)
        self._lock = _EngineLock(self._core.interrupt)
        self._traces: dict[tuple[str, int], _Trace] = {}

    # -- the backend seam: one call per iteration each way -------------------------------------------------
    def _post(self, conn_ids: bytes, plan: bytearray, bounds: bytes) -> np.ndarray:
        ids = np.frombuffer(conn_ids, dtype=np.int64)
        rows = np.frombuffer(plan, dtype=PLAN_DTYPE)
        edges = np.frombuffer(bounds, dtype=np.int64)
        return np.ascontiguousarray(self.backend.post_batches(ids, rows, edges), dtype=np.int64)

    def _poll(self, max_completions: int) -> np.ndarray:
        return np.ascontiguousarray(self.backend.poll(max_completions), dtype=COMPLETION_DTYPE)

    # -- the tables, as the engine sees them: a view of each after every change ----------------------------
    def _peers_changed(self, entry: JobTables) -> None:
        p = entry.peers
        self._core.set_peers(entry.id, p.world, p.rows, p.cols, p.conn, p.code, p.flag_base, p.flag_slots,
                             p.flag_rkey, p.addr, p.length, p.rkey, p.valid, entry.conns)

    def _sources_changed(self, source: int, table: RegionTable) -> None:
        # the engine's view of the table: it holds these arrays until it is handed their successors
        self._core.set_sources(source, table.addr, table.length, table.key, table.valid)

    def _tables_changed(self, job: str) -> None:
        self._snapshot_traces(job)

    def _open_channel(self, channel: int, ring: RingFile, entry: JobTables, rank: int, track: int) -> DrainedRing:
        sid, _ = self._source(entry, rank)
        self._core.add_channel(channel, ring._bytes, entry.id, sid, track)
        return DrainedRing(ring, entry, rank)

    def _channel_added(self, channel: int, ch: DrainedRing) -> None:
        trace = self._traces.get((ch.job.name, ch.rank))
        if trace is not None:
            self._trace_channel(channel, trace)

    def _channel_gone(self, channel: int) -> None:
        self._core.mark_gone(channel)

    def _channel_removed(self, channel: int, ch: DrainedRing) -> None:
        trace = self._traces.get((ch.job.name, ch.rank))
        if trace is not None and channel in trace.fds:
            self._untrace_channel(channel, trace)
        self._core.remove_channel(channel)

    def _connection_added(self, conn: int) -> int:
        return self._core.add_connection(conn)

    def _connection_failed(self, index: int, code: int) -> None:
        self._core.fail_connection(index, code)

    def _connection_held(self, index: int, on: bool) -> None:
        self._core.hold_connection(index, on)

    def retire_connection(self, conn: int, code: int) -> None:
        """The far end of ``conn`` is gone for good (its daemon's next life has other keys): what is still
        waiting or in flight on it completes here with ``code`` (UNKNOWN_OUTCOME after a crash), while its
        peers stay bound to it, held, until they are bound to the connection that replaces it."""
        with self._lock:
            idx = self._conn_index.get(conn)
            if idx is not None:
                self._core.hold_connection(idx, True)
                self._core.fail_connection(idx, code)

    def broken_connections(self) -> list[int]:
        """Connections whose far end stopped answering (retry exceeded, response timeout) since the last call.

        The engine holds each (records for its peers wait in the rings) and reports what was in flight on it
        as UNKNOWN_OUTCOME; the daemon re-wires it if the peer's daemon restarted, else fails it."""
        with self._lock:
            return list(self._core.broken_connections())

    def connections_idle(self, conns: list[int]) -> bool:
        """Nothing is waiting or in flight on any of ``conns`` (unknown ones count as idle)."""
        with self._lock:
            wanted = {self._conn_index[c] for c in conns if c in self._conn_index}
            busy = [i for i, (_cid, inflight, pending, *_rest) in enumerate(self._core.connections())
                    if i in wanted and (inflight or pending)]
            return not busy

    # -- tracing (the recorder is the engine's; see trace.h) -------------------------------------------------
    def trace_start(self, job: str, rank: int, prefix: str, buffer_entries: int = TRACE_BUFFER_ENTRIES) -> list[int]:
        """Record what ``rank`` of ``job``'s channels take into ``{prefix}.ch{channel}.part`` files, from the
        next pass on (and channels it opens later, from their first record); returns the channels traced now.

        The part files are created here (mode 0600, truncated); :meth:`trace_stop` ends the recording.
        """
        if buffer_entries < 1:
            raise ValueError(f"buffer_entries must be >= 1, got {buffer_entries}")
        with self._lock:
            if (job, rank) in self._traces:
                raise ValueError(f"rank {rank} of job {job!r} is traced already")
            trace = _Trace(prefix, buffer_entries, time.monotonic_ns(), time.time_ns())
            traced = [cid for cid, ch in self._channels.items() if ch.job.name == job and ch.rank == rank]
            try:
                for cid in traced:
                    self._trace_channel(cid, trace)
            except BaseException:
                for cid in list(trace.fds):
                    self._untrace_channel(cid, trace)
                raise
            trace.context = self._trace_context(job, rank, trace.channels)
            self._traces[(job, rank)] = trace
            return traced

    def _snapshot_traces(self, job: str) -> None:
        """``job``'s tables changed: every traced rank of it takes their picture into its context (under the
        lock). Taken as the tables change, not only at the stop: by then the job may be over and its tables
        empty."""
        for (name, rank), trace in self._traces.items():
            if name == job:
                trace.context = _merge_context(trace.context, self._trace_context(job, rank, trace.channels))

    def _trace_channel(self, channel: int, trace: _Trace) -> None:
        path = f"{trace.prefix}.ch{channel}.part"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            self._core.trace_open(channel, fd, trace.buffer_entries)
        except BaseException:
            os.close(fd)
            raise
        trace.fds[channel] = fd
        trace.parts.append(path)
        trace.channels[channel] = self._channels[channel].ring.capacity

    def _untrace_channel(self, channel: int, trace: _Trace) -> None:
        entries, written, dropped, err = self._core.trace_close(channel)
        os.close(trace.fds.pop(channel))
        trace.entries += entries
        trace.written += written
        trace.dropped += dropped
        if err:
            trace.write_errors.append(f"channel {channel}: {os.strerror(err)}")

    def trace_flush(self, job: str, rank: int) -> int:
        """Write out what the rank's recorders buffered; returns the entries written so far."""
        with self._lock:
            trace = self._traces[(job, rank)]
            return trace.written + sum(self._core.trace_flush(cid)[1] for cid in trace.fds)

    def tracing(self) -> list[tuple[str, int]]:
        """The (job, rank) pairs being traced."""
        with self._lock:
            return sorted(self._traces)

    def trace_stop(self, job: str, rank: int) -> dict[str, Any]:
        """Stop recording ``rank`` of ``job``: every recorder is flushed and its part file closed.

        Returns (msgpack/JSON-able) the part files, entry counts (``entries`` recorded, ``written``,
        ``dropped`` to failed writes, ``write_errors``), the start times, and the ``context`` a replay
        needs (:meth:`trace_context`): every region and flag array the job had while traced, also those of
        ranks that have left since (the traced one included). Raises KeyError when the rank is not traced.
        """
        with self._lock:
            trace = self._traces.pop((job, rank))
            for cid in list(trace.fds):
                self._untrace_channel(cid, trace)
            context = _merge_context(trace.context, self._trace_context(job, rank, trace.channels))
            return {"parts": trace.parts, "entries": trace.entries, "written": trace.written,
                    "dropped": trace.dropped, "write_errors": trace.write_errors,
                    "start_mono_ns": trace.start_mono_ns, "start_wall_ns": trace.start_wall_ns, "context": context}

    def trace_context(self, job: str, rank: int) -> dict[str, Any]:
        """What a replay of ``rank``'s records needs to rebuild ``job`` (docs/trace.md, "context")."""
        with self._lock:
            channels = {cid: ch.ring.capacity for cid, ch in self._channels.items()
                        if ch.job.name == job and ch.rank == rank}
            return self._trace_context(job, rank, channels)

    def _trace_context(self, job: str, rank: int, channels: dict[int, int]) -> dict[str, Any]:
        entry = self._jobs.get(job)
        p = entry.peers if entry is not None else PeerTable()
        sources: dict[str, int] = {}
        if entry is not None and rank in entry.sources:
            table = entry.sources[rank][1]
            sources = {str(i): int(table.length[i]) for i in np.flatnonzero(table.valid[: table.size])}
        peers: dict[str, Any] = {}
        for r in range(p.world):
            row = slice(r * (p.cols + 1), r * (p.cols + 1) + p.cols)
            lengths, valid = p.length[row], p.valid[row]
            peers[str(r)] = {"regions": {str(i): int(lengths[i]) for i in np.flatnonzero(valid)},
                             "flags": int(p.flag_slots[r]), "connected": bool(p.conn[r] >= 0),
                             "code": int(p.code[r])}
        return {"job": job, "rank": rank, "world": p.world, "sources": sources, "peers": peers,
                "channels": {str(cid): {"capacity": cap} for cid, cap in sorted(channels.items())},
                "proxy": {"batch_max": self.batch_max, "poll_window_us": self.window_ns / 1000,
                          "inflight_cap": self.inflight_cap, "decoupled": self.decoupled,
                          "max_length": self.max_length, "max_take": self.max_take}}

    # -- the loop ------------------------------------------------------------------------------------------
    def run_once(self) -> bool:
        """One pass: take ready records, post ready batches, drain completions. True if it did any work.

        Posting comes first so a fresh record never waits behind completion handling; completions are
        drained right after, so a fast NIC's completion (and the QUIET position) lands in the same pass.
        """
        with self._lock:
            return self._core.run_once()

    def serve(self, *, spin_s: float, watch_s: float, nap_s: float, deep_after_s: float, deep_watch_s: float,
              deep_nap_s: float, wake_fd: int = -1, link_every_s: float = 50e-6) -> int:
        """The rail worker's loop, all in C with the GIL released (``engine.c``, ``tpd_serve_loop``): pass after
        pass, then the idle back-off these times describe (``transportd.dataplane.worker``), until
        ``wake_fd`` turns readable (:data:`SERVE_LINK`: the worker's link has a request) or
        :meth:`interrupt` is called (:data:`SERVE_INTERRUPTED`). A backend's Python post/poll runs inside
        the loop, the GIL taken for that call. How long the proxy has been idle carries over from one call
        to the next, so serving a request does not restart the back-off.
        """
        with self._lock:
            self._lock.serving = True
            try:
                return self._core.serve(int(spin_s * 1e9), int(watch_s * 1e9), int(nap_s * 1e9),
                                        int(deep_after_s * 1e9), int(deep_watch_s * 1e9), int(deep_nap_s * 1e9),
                                        int(wake_fd), int(link_every_s * 1e9))
            finally:
                self._lock.serving = False

    def interrupt(self) -> None:
        """Make a :meth:`serve` running in another thread return (or the next one return at once)."""
        self._core.interrupt()

    def loop_stats(self) -> dict[str, int]:
        """What :meth:`serve` did so far: ``passes`` (``busy`` of them did work, ``spins`` idle ones back
        to back), ``watches`` of the ring heads and ``naps`` after them, long-idle ``deep_watches``, and
        returns for the ``link`` and for an ``interrupted`` loop."""
        return self._core.loop_stats()

    def wait_ready(self, timeout_s: float, nap_s: float = 0.0, wake_fd: int = -1) -> bool:
        """Watch the rings' head slots for up to ``timeout_s``: True as soon as one holds a committed record.

        Reads one seq word per ring per look and takes nothing (the next :meth:`run_once` does): the idle
        worker's cheap way to notice a record sooner than a sleep would. ``nap_s`` > 0 sleeps that long
        between looks (a long-idle worker: little CPU, a record still seen within about ``nap_s``); with
        ``wake_fd`` each nap is a poll on that descriptor, and its turning readable ends the wait (False).
        False at once while rows wait or work is in flight: then the caller's next pass is due anyway
        (completions, the polling window).
        """
        with self._lock:
            return self._core.wait_ready(float(timeout_s), float(nap_s), int(wake_fd))

    def busy(self) -> bool:
        """Rows are waiting in the proxy or WRs are in flight."""
        with self._lock:
            return self._core.busy()

    def progress(self) -> int:
        """Drain completions now (the loop's progress hook); returns how many came."""
        with self._lock:
            return self._core.progress()

    def _stop_taking(self) -> None:
        self._core.set_taking(False)

    # -- the null NIC's post log (backend=None): what benchmarks time --------------------------------------
    def log_posts(self, capacity: int) -> None:
        """Keep (monotonic ns at post, chunk id) of up to ``capacity`` posted WRITEs from now on."""
        self._core.log_posts(capacity)

    def post_log(self) -> tuple[np.ndarray, np.ndarray]:
        """``(post ns, chunk id)`` of the WRITEs logged so far."""
        pairs = np.frombuffer(self._core.post_log(), dtype=np.uint64).reshape(-1, 2)
        return pairs[:, 0].astype(np.int64), pairs[:, 1].copy()

    # -- reporting (ProxyBase.stats and queue_stats ask these) --------------------------------------------
    @property
    def counters(self) -> dict[str, int]:
        """The engine's counters by name (see :meth:`stats`)."""
        return dict(zip(COUNTERS, self._core.counters(), strict=True))

    def _counter_values(self) -> dict[str, int]:
        return self.counters

    def _batch_hist(self) -> list[int]:
        return list(self._core.batch_hist())

    def _error_counts(self) -> list[int]:
        return list(self._core.errors())

    def _pending_rows(self) -> int:
        return self._core.pending_rows()

    def _connection_rows(self) -> list[tuple[int, int, int, list[int], int]]:
        return list(self._core.connections())

    def _channel_state(self, channel: int, now: int) -> tuple[int, int, int, bool, int, int]:
        taken, depth, completed, gone, age_ns, code, _count, _at = self._core.channel_state(channel, now)
        return taken, depth, completed, gone, age_ns, code

    def _ring_extras(self, channel: int, ch: DrainedRing) -> dict[str, Any]:
        """``errors_by_code``: the ring's refused or failed records by ErrorCode name (the error word keeps
        only the first code); ``traced``: whether its rank is being traced."""
        return {"errors_by_code": {code_name(c): n for c, n in sorted(self._core.channel_codes(channel).items())},
                "traced": (ch.job.name, ch.rank) in self._traces}
