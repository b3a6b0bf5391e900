"""What the proxy and its model share: the knobs, the job-scoped tables, the channels and connections, and
the stats and shutdown drain built on them.

:class:`~transportd.dataplane.proxy.Proxy` (the daemon's, around the compiled engine) and
:class:`~transportd_models.engine.ModelProxy` (the engine's numpy model) keep their tables the same way
and report the same stats: this class does both once. A subclass runs the loop and answers to the hooks
(the methods below that raise NotImplementedError): each table change is announced to it (the engine is
handed a view of the changed table, the model reads the same table directly), and the stats ask it for
the loop's counters and its per-channel and per-connection state. The differential test
(``tests/transportd/dataplane/test_core_differential.py``) holds the two loops to each other through this
one API.

Tables are job-scoped (docs/design.md, "Jobs are walled off"): a channel (one client's ring) resolves
source regions through its own rank's table and destinations through its job's peer table, so a job's
commands can only reach that job's regions. The tables are views: what a rank registered is recorded by
the daemon's main process (:class:`transportd.daemon.state.LocalRank`, ``regions``), which tells each rail
worker what to put here.

Threading: the table methods may be called between iterations from the loop's thread or from another
one; the subclass's lock (``_lock``) serializes them with the loop.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from cmd_ring.ring import RingFile
from transportd.dataplane.tables import DEFAULT_MAX_LENGTH, PeerTable, RegionTable
from transportd.errors import ErrorCode
from transportd.limits import MAX_BATCH, MAX_TAKE, MIN_BATCH, MIN_INFLIGHT_CAP, MIN_TAKE

__all__ = ["DrainedRing", "JobTables", "ProxyBase", "code_name"]


def code_name(code: int) -> str:
    """An ErrorCode's name, or the number where it names none."""
    try:
        return ErrorCode(code).name
    except ValueError:
        return str(code)


@dataclass(eq=False)
class JobTables:
    """One job's tables on this rail: its peers, and each local rank's source regions with the id the
    loop knows that table by. ``conns``: the connection indexes its records may feed (kept with
    ``peers``)."""

    id: int
    name: str
    peers: PeerTable = field(default_factory=PeerTable)
    sources: dict[int, tuple[int, RegionTable]] = field(default_factory=dict)  # rank -> (source id, table)
    conns: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))


@dataclass(eq=False, slots=True)
class DrainedRing:
    """A ring the proxy drains: the consumer's side of one client's channel (not the client's handle to it),
    drained for ``rank`` of ``job`` (a subclass's loop may keep more on it). ``gone``: its client left."""

    ring: RingFile
    job: JobTables
    rank: int
    gone: bool = False


class ProxyBase:
    """Knobs, tables and stats of a proxy on one rail (one backend); see the module doc.

    ``batch_max`` commands per connection per batch (<= 8); ``poll_window_us`` how long a partial batch
    may wait for more; ``inflight_cap`` WRs posted and not completed per connection; ``decoupled`` turns
    on Perseus signal reduction; ``max_length`` is the largest PUT; ``max_take`` caps records taken from
    one ring per iteration (bounds the work, hence the latency, of one iteration); ``poll_max`` caps the
    completions taken per poll. The subclasses take these as keywords after their backend.
    """

    _lock: AbstractContextManager[Any]  # the subclass's: serializes the table methods with its loop

    def __init__(self, *, batch_max: int = 8, poll_window_us: float = 50.0, inflight_cap: int = 256,
                 decoupled: bool = False, max_length: int = DEFAULT_MAX_LENGTH, max_take: int = 4096,
                 poll_max: int = 4096) -> None:
        if not MIN_BATCH <= batch_max <= MAX_BATCH:
            raise ValueError(f"batch_max must be in {MIN_BATCH}..{MAX_BATCH}, got {batch_max}")
        if inflight_cap < MIN_INFLIGHT_CAP:
            raise ValueError(f"inflight_cap must be >= {MIN_INFLIGHT_CAP} (a PUT_SIGNAL is two WRs), "
                             f"got {inflight_cap}")
        if not MIN_TAKE <= max_take <= MAX_TAKE:
            raise ValueError(f"max_take must be in {MIN_TAKE}..{MAX_TAKE}, got {max_take}")
        self.batch_max = batch_max
        self.window_ns = int(poll_window_us * 1000)
        self.inflight_cap = inflight_cap
        self.decoupled = decoupled
        self.max_length = max_length
        self.max_take = max_take
        self.poll_max = poll_max
        self._jobs: dict[str, JobTables] = {}
        self._channels: dict[int, Any] = {}  # channel -> its DrainedRing (the subclass's kind of one)
        self._conn_index: dict[int, int] = {}  # backend connection id -> the loop's connection index
        self._next_source = 0

    # -- hooks: what the subclass's loop is told, and what it answers -------------------------------------
    def _peers_changed(self, entry: JobTables) -> None:
        """``entry``'s peer table changed (or the job is new)."""
        raise NotImplementedError

    def _sources_changed(self, source: int, table: RegionTable) -> None:
        """Source table ``source`` is new or had a region set."""
        raise NotImplementedError

    def _tables_changed(self, job: str) -> None:
        """``job``'s tables changed (after a channel opened, a source region was set, a peer table changed)."""

    def _open_channel(self, channel: int, ring: RingFile, entry: JobTables, rank: int, track: int) -> Any:
        """Start draining ``ring`` (``track``: how many positions to keep completion marks for); returns its
        :class:`DrainedRing`."""
        raise NotImplementedError

    def _channel_added(self, channel: int, ch: Any) -> None:
        """``channel`` is in the channel table now."""

    def _channel_gone(self, channel: int) -> None:
        """``channel``'s client left (``gone`` is set): refuse its later records, drop its waiting rows."""
        raise NotImplementedError

    def _channel_removed(self, channel: int, ch: Any) -> None:
        """``channel`` left the channel table: forget it."""
        raise NotImplementedError

    def _connection_added(self, conn: int) -> int:
        """A new backend connection ``conn``; returns its connection index."""
        raise NotImplementedError

    def _connection_failed(self, index: int, code: int) -> None:
        """Connection ``index`` is gone (its peers are unbound already): complete what waits or flies on it
        with ``code``."""
        raise NotImplementedError

    def _connection_held(self, index: int, on: bool) -> None:
        raise NotImplementedError

    def _channel_state(self, channel: int, now: int) -> tuple[int, int, int, bool, int, int]:
        """``(taken, depth, completed, gone, head age ns, error word's code)`` of ``channel``; the age only
        where ``now`` >= 0 (monotonic ns), else 0."""
        raise NotImplementedError

    def _ring_extras(self, channel: int, ch: Any) -> dict[str, Any]:
        """What :meth:`queue_stats` adds to ``channel``'s entry beyond the common keys."""
        return {}

    def _counter_values(self) -> dict[str, int]:
        raise NotImplementedError

    def _batch_hist(self) -> Sequence[int]:
        """Batches posted by number of commands (index = commands)."""
        raise NotImplementedError

    def _error_counts(self) -> Sequence[int]:
        """Records refused or failed, by ErrorCode value."""
        raise NotImplementedError

    def _pending_rows(self) -> int:
        raise NotImplementedError

    def _connection_rows(self) -> list[tuple[int, int, int, Sequence[int], int]]:
        """Per connection index: ``(conn id, inflight WRs, pending rows, batch histogram, payload bytes)``."""
        raise NotImplementedError

    def _stop_taking(self) -> None:
        """Take no more records (the drain emptied the rings)."""
        raise NotImplementedError

    def run_once(self) -> bool:
        raise NotImplementedError

    def busy(self) -> bool:
        raise NotImplementedError

    def progress(self) -> int:
        raise NotImplementedError

    # -- tables (the daemon calls these as clients join, register and leave) -------------------------------
    def _job(self, job: str) -> JobTables:
        entry = self._jobs.get(job)
        if entry is None:
            entry = self._jobs[job] = JobTables(len(self._jobs), job)
            self._peers_changed(entry)
        return entry

    def _source(self, entry: JobTables, rank: int) -> tuple[int, RegionTable]:
        found = entry.sources.get(rank)
        if found is None:
            found = entry.sources[rank] = (self._next_source, RegionTable())
            self._next_source += 1
            self._sources_changed(*found)
        return found

    def _update_peers(self, entry: JobTables) -> None:
        """After every change to ``entry.peers``: its connections again, and the loop told."""
        entry.conns = entry.peers.connections()
        self._peers_changed(entry)

    def add_channel(self, channel: int, ring: RingFile, job: str, rank: int, world: int) -> None:
        """Start draining ``ring``: records of ``job``'s ``rank`` in a world of ``world`` ranks."""
        with self._lock:
            if channel in self._channels:
                raise ValueError(f"channel {channel} already exists")
            entry = self._job(job)
            if entry.peers.world and entry.peers.world != world:
                raise ValueError(f"job {job!r} has world {entry.peers.world}, channel says {world}")
            if not 0 <= rank < world:
                raise ValueError(f"rank {rank} is outside world {world}")
            entry.peers.set_world(world)
            self._update_peers(entry)
            track = 1 << max(4 * ring.capacity, 4 * self.max_take).bit_length()
            ch = self._channels[channel] = self._open_channel(channel, ring, entry, rank, track)
            self._channel_added(channel, ch)
            self._tables_changed(job)

    def mark_gone(self, channel: int) -> None:
        """The channel's client left: later records are rejected with CLIENT_GONE, waiting ones dropped.

        Work already posted completes as usual, so the daemon can wait for :meth:`busy` before reclaiming.
        """
        with self._lock:
            ch = self._channels.get(channel)
            if ch is not None:
                ch.gone = True
                self._channel_gone(channel)

    def remove_channel(self, channel: int) -> None:
        """Stop draining ``channel`` and forget it; completions still due for it are ignored."""
        with self._lock:
            ch = self._channels.pop(channel, None)
            if ch is not None:
                self._channel_removed(channel, ch)

    def forget_rank(self, job: str, rank: int) -> None:
        """``rank`` left ``job``: its channels are marked gone and its source regions forgotten."""
        for cid, ch in list(self._channels.items()):
            if ch.job.name == job and ch.rank == rank:
                self.mark_gone(cid)
        with self._lock:
            entry = self._jobs.get(job)
            if entry is not None and rank in entry.sources:
                entry.sources[rank][1].clear()

    def set_source_region(self, job: str, rank: int, region: int, addr: int, length: int, lkey: int) -> None:
        """``rank`` of ``job`` registered local region ``region`` (a source for its PUTs)."""
        with self._lock:
            source = self._source(self._job(job), rank)
            source[1].set(region, addr, length, lkey)
            self._sources_changed(*source)
            self._tables_changed(job)

    def remove_source_region(self, job: str, rank: int, region: int) -> None:
        with self._lock:
            self._source(self._job(job), rank)[1].remove(region)

    def _change_peers(self, job: str, change: Callable[[PeerTable], None]) -> None:
        with self._lock:
            entry = self._job(job)
            change(entry.peers)
            self._update_peers(entry)
            self._tables_changed(job)

    def set_remote_region(self, job: str, peer: int, region: int, addr: int, length: int, rkey: int) -> None:
        """Peer rank ``peer`` of ``job`` exposes region ``region`` (a destination for PUTs)."""
        self._change_peers(job, lambda p: p.set_region(peer, region, addr, length, rkey))

    def remove_remote_region(self, job: str, peer: int, region: int) -> None:
        self._change_peers(job, lambda p: p.remove_region(peer, region))

    def set_remote_flags(self, job: str, peer: int, addr: int, count: int, rkey: int) -> None:
        """Peer rank ``peer``'s flag array: ``count`` u64 words at ``addr`` (slot s is at addr + 8*s)."""
        self._change_peers(job, lambda p: p.set_flags(peer, addr, count, rkey))

    def remove_remote_flags(self, job: str, peer: int) -> None:
        self._change_peers(job, lambda p: p.remove_flags(peer))

    def bind_peer(self, job: str, peer: int, conn: int) -> None:
        """Send ``job``'s records for rank ``peer`` over backend connection ``conn``."""
        with self._lock:
            idx = self._connection_index(conn)
        self._change_peers(job, lambda p: p.bind(peer, idx))

    def unbind_peer(self, job: str, peer: int) -> None:
        """No connection for ``peer`` any more; its records are rejected with BAD_PEER."""
        self._change_peers(job, lambda p: p.unbind(peer))

    def forget_peer(self, job: str, peer: int) -> None:
        """Peer rank ``peer`` left ``job``: records for it are rejected with BAD_PEER until it is set again."""
        self._change_peers(job, lambda p: p.forget(peer))

    def fail_connection(self, conn: int, code: int) -> None:
        """Connection ``conn`` is gone (``code``: usually PEER_LOST; 0 when it was closed on purpose).

        Its waiting rows are dropped and its posted batches are completed here (the backend may never
        report them), with ``code`` in the error words of the channels they came from; records for the
        peers it served are rejected with ``code`` (BAD_PEER when 0) from now on.
        """
        with self._lock:
            idx = self._conn_index.get(conn)
            if idx is None:
                return
            for entry in self._jobs.values():
                for rank in np.flatnonzero(entry.peers.conn == idx):
                    entry.peers.unbind(int(rank), code)
                self._update_peers(entry)
            self._connection_failed(idx, code)

    def hold_connection(self, conn: int, on: bool = True) -> None:
        """While held, records for the peers bound to ``conn`` stay in their rings (their daemon is
        restarting: backpressure, nothing refused); rows already waiting for it still post, so it drains."""
        with self._lock:
            idx = self._conn_index.get(conn)
            if idx is not None:
                self._connection_held(idx, on)

    def _connection_index(self, conn: int) -> int:
        idx = self._conn_index.get(conn)
        if idx is None:
            idx = self._conn_index[conn] = self._connection_added(conn)
        return idx

    # -- shutdown ------------------------------------------------------------------------------------------
    def drain(self, timeout_s: float = 5.0) -> bool:
        """Shutdown: take every record committed so far, post it, wait for its completions.

        Records committed while the first ones drain are taken too, until every ring has been emptied
        once up to the head it had when the drain began; after that nothing more is taken (a client
        that keeps producing cannot hold the daemon up), and what was taken is posted and completed.
        Bounded by ``timeout_s``; True when nothing is left waiting or in flight.
        """
        deadline = time.monotonic() + timeout_s
        with self._lock:
            targets = {cid: taken + depth for cid in self._channels
                       for taken, depth, *_ in [self._channel_state(cid, -1)]}
        while time.monotonic() < deadline:
            with self._lock:
                behind = [cid for cid, target in targets.items()
                          if cid in self._channels and self._channel_state(cid, -1)[0] < target]
            if not behind:
                break
            self.run_once()
        with self._lock:
            self._stop_taking()
        while self.busy() and time.monotonic() < deadline:
            self.run_once()
        # what peers wrote here is on the CQ by now (they waited for its acknowledgement before quiescing):
        # a receiving backend (efa) publishes the flags it covers before this life ends
        while self.progress() and time.monotonic() < deadline:
            pass
        return not self.busy()

    def completion_position(self, channel: int) -> int:
        """The channel's published completion position."""
        with self._lock:
            return self._channel_state(channel, -1)[2]

    # -- reporting -----------------------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """Counters as a plain dict (msgpack/JSON-able) for ``transportctl stats``.

        ``commands`` good records taken (QUIETs included, ``quiets`` of them); ``rejected`` bad ones, by code
        in ``errors`` (completion errors included); ``wrs``/``writes``/``signals``/``fences``/``bytes`` what
        was posted (``signals_requested``: signals before decoupled reduction); ``batch_hist[i]`` batches
        of ``i+1`` commands; ``signals_per_dest_batch`` signals per (batch, destination) pair that had one.
        ``stalls``: iterations in which the inflight cap left ready records in a ring. ``signal_stalls``:
        iterations in which a ready batch holding a signal had to wait for completions; the proxy never
        drains a CQ to order a signal and admits records only with room for them, so this stays 0 unless
        a backend turns rows into more WRs than the proxy counted.
        """
        with self._lock:
            out: dict[str, Any] = dict(self._counter_values())
            pairs = out["signal_dest_batches"]
            out["signals_per_dest_batch"] = out["signals"] / pairs if pairs else 0.0
            out["batch_hist"] = [int(x) for x in self._batch_hist()[1 : self.batch_max + 1]]
            out["errors"] = {code_name(code): int(n) for code, n in enumerate(self._error_counts()) if n}
            out["pending_rows"] = self._pending_rows()
            out["inflight"] = {str(cid): inflight for cid, inflight, *_ in self._connection_rows() if inflight}
            out["channels"] = len(self._channels)
            out["channels_gone"] = sum(ch.gone for ch in self._channels.values())
            out["decoupled"] = self.decoupled
            out["batch_max"] = self.batch_max
            out["inflight_cap"] = self.inflight_cap
            out["poll_window_us"] = self.window_ns / 1000
            return out

    def queue_stats(self) -> dict[str, Any]:
        """Per ring and per connection queue state (``transportctl queues``, metrics), msgpack/JSON-able.

        ``rings``: ``depth`` records committed and not yet taken; ``credits`` slots producers may still
        claim (capacity minus depth: a slot claimed but not yet committed is invisible to the host);
        ``oldest_age_us`` how long the record at the head has waited, counted from when the proxy first
        saw it committed and left it in the ring (0 for an empty ring); ``outstanding`` records taken but
        not yet complete; and what the subclass adds (the daemon's proxy: ``errors_by_code``, ``traced``).
        ``connections``: ``inflight`` WRs posted and not completed, ``pending`` rows waiting for their batch,
        batches full/partial, ``batch_hist`` (index i: batches of i+1 commands) and payload ``bytes`` posted.
        """
        with self._lock:
            now = time.monotonic_ns()
            rings = []
            for cid, ch in self._channels.items():
                taken, depth, completed, gone, age_ns, error = self._channel_state(cid, now)
                capacity = ch.ring.capacity
                rings.append({"channel": cid, "job": ch.job.name, "rank": ch.rank, "capacity": capacity,
                              "depth": depth, "credits": capacity - depth, "oldest_age_us": age_ns / 1000,
                              "taken": taken, "outstanding": taken - completed, "gone": bool(gone),
                              "error": error, **self._ring_extras(cid, ch)})
            conns = []
            for conn_id, inflight, pending, hist, nbytes in self._connection_rows():
                full = int(hist[self.batch_max])
                conns.append({"conn": conn_id, "inflight": inflight, "pending": pending, "batches_full": full,
                              "batches_partial": int(sum(hist[1:])) - full,
                              "batch_hist": [int(x) for x in hist[1 : self.batch_max + 1]], "bytes": nbytes})
            return {"rings": rings, "connections": conns}
