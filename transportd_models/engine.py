"""The proxy's loop in numpy: the model of the compiled core, never run by the daemon.

The daemon runs :class:`transportd.dataplane.proxy.Proxy`, whose every per-record step is the C engine
(``transportd/core/engine.c``). This module is the same loop written with numpy, kept as the oracle of
the differential test (``tests/transportd/dataplane/test_core_differential.py``: the same records, tables and knobs
through both must give the same codes, rows and completion positions) and as the baseline of
``transportd bench proxy``. A change to the loop's rules lands in both, or the differential test fails.

One iteration (:meth:`ModelProxy.run_once`):

1. **take** -- from every channel, take the records that are ready, as many as the connections its job
   feeds can still accept (``consume_ready(max_records=...)``): when a connection is full, records stay in
   the ring and the ring fills, so backpressure reaches the producer; nothing is dropped and nothing is
   buffered beyond the inflight cap. Records are validated and translated in one vectorized call
   (:mod:`transportd_models.translate`); a bad one is counted and reported through the channel's error word.
2. **post** -- rows wait per connection until a batch of ``batch_max`` commands fills, the polling
   window (``poll_window_us``) passes, or a NO_BATCH / FENCE / QUIET command asks for it; each ready batch
   (decoupled if asked, :mod:`transportd_models.batching`) is posted under the per-connection inflight cap.
3. **progress** -- drain the backend's completions: each posted batch has one token; map it back to the
   ring positions it covered, free its inflight WRs, publish each channel's completion position (the first
   ring position not yet complete, so a kernel's QUIET at ``p`` is satisfied once it is ``> p``), and
   write REMOTE_ACCESS / TRANSPORT into the channel's error word for a completion with an error status.

The ring knows nothing about RDMA and the backend knows nothing about rings: the proxy is the only place
they meet (in the daemon :mod:`transportd.dataplane.proxy` and its engine; here, their model). The tables,
the channel and connection maps and the stats are :class:`~transportd.dataplane.proxy_base.ProxyBase`'s,
shared with the daemon's proxy; the model reads the tables directly where the engine is handed views.

Threading: one thread runs the loop; the table methods may be called between iterations from the same
thread (the rail worker does) or from another thread (a lock serializes them with ``run_once``).
"""

from __future__ import annotations

import select
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from cmd_ring.record import RECORD_DTYPE, Flag, Opcode, seq_for
from cmd_ring.ring import RingConsumer, RingFile
from transportd.backends.interface import PLAN_DTYPE, Backend, PlanOp
from transportd.dataplane.proxy_base import DrainedRing, JobTables, ProxyBase
from transportd.dataplane.tables import RegionTable
from transportd.errors import ErrorCode
from transportd.rows import compress_rows, concat_rows, take_rows
from transportd_models.batching import (
    cumsum_within,
    cut_batches,
    decouple_signals,
    run_starts,
)
from transportd_models.translate import Translated, translate

__all__ = ["ModelLoopState", "ModelProxy", "completion_error_code", "META_DTYPE", "MODEL_SERVE_INTERRUPTED",
           "MODEL_SERVE_LINK", "model_serve"]

# Bookkeeping that travels with each waiting plan row (plan rows themselves are PLAN_DTYPE, for the backend).
META_DTYPE = np.dtype(
    [("pos", "<u8"), ("t", "<i8"), ("conn", "<i4"), ("chan", "<i4"), ("first", "?"), ("closes", "?")], align=True
)

_QUIET, _FENCE_OP, _NO_BATCH = int(Opcode.QUIET), int(Opcode.FENCE), int(Flag.NO_BATCH)
_WRITE, _SIGNAL, _FENCE = int(PlanOp.WRITE), int(PlanOp.SIGNAL), int(PlanOp.FENCE)

# Verbs work-completion statuses that mean "the remote side refused the access".
_REMOTE_ACCESS_STATUSES = (4, 10)  # IBV_WC_LOC_PROT_ERR, IBV_WC_REM_ACCESS_ERR
# ... and "the far end did not answer": the outcome is unknown, the connection is held and broken.
_UNANSWERED_STATUSES = (12, 20)  # IBV_WC_RETRY_EXC_ERR, IBV_WC_RESP_TIMEOUT_ERR
_FLUSH_STATUS = 5  # IBV_WC_WR_FLUSH_ERR: on a broken connection, an unknown outcome too


def _truncated(tr: Translated, k: int) -> Translated:
    """``tr`` for its first ``k`` records only."""
    m = int(np.searchsorted(tr.row_rec, k))
    return Translated(tr.codes[:k], tr.plan[:m], tr.row_rec[:m], tr.row_conn[:m])


def completion_error_code(status: np.ndarray) -> np.ndarray:
    """ErrorCode per work-completion status: 0 stays 0, 4/10 -> REMOTE_ACCESS, anything else -> TRANSPORT."""
    status = np.asarray(status)
    code = np.where(np.isin(status, _REMOTE_ACCESS_STATUSES), ErrorCode.REMOTE_ACCESS, ErrorCode.TRANSPORT)
    return np.where(status == 0, 0, code).astype(np.uint16)


class _DrainedRing(DrainedRing):
    """One client's ring and where its records resolve; ``done`` marks completed positions (mod its size)."""

    __slots__ = ("id", "consumer", "sources", "completed", "done", "seqs", "mask")

    def __init__(self, cid: int, ring: RingFile, job: JobTables, rank: int, sources: RegionTable,
                 track: int) -> None:
        super().__init__(ring, job, rank)
        self.id = cid
        self.consumer = RingConsumer(ring)
        self.sources = sources
        self.completed = self.consumer.position  # positions before it were never this proxy's
        ring.publish_completion(self.completed)
        self.done = np.zeros(track, dtype=bool)
        self.seqs = ring.seqs  # the header seq words: a one-slot peek says whether anything is ready
        self.mask = ring.capacity - 1


@dataclass(eq=False)
class _Posted:
    """The batches posted in one iteration: tokens ``first .. first+ntok-1`` and the commands they cover."""

    first: int
    tok_conn: np.ndarray
    tok_nwr: np.ndarray
    cmd_tok: np.ndarray
    cmd_chan: np.ndarray
    cmd_pos: np.ndarray
    done: np.ndarray
    remaining: int


_CONN_LOG_FOLD = 64  # posts logged before their per-connection counts are folded in

_COUNTERS = (
    "iterations", "commands", "quiets", "bytes", "wrs", "writes", "signals", "signals_requested", "fences",
    "batches", "batches_full", "batches_partial", "signal_dest_batches", "stalls", "signal_stalls", "rejected",
    "completions", "completion_errors", "unknown_completions",
)


class ModelProxy(ProxyBase):
    """Drains command rings into one backend (one rail); see the module doc for the loop, and
    :class:`~transportd.dataplane.proxy_base.ProxyBase` (shared with the daemon's proxy) for the knobs, the
    table methods and the stats."""

    def __init__(self, backend: Backend, **knobs: Any) -> None:
        super().__init__(**knobs)
        self.backend = backend
        self._lock = threading.Lock()
        self._channels: dict[int, _DrainedRing] = {}
        self._conn_ids = np.zeros(0, dtype=np.int64)  # connection index -> backend conn_id
        self._holding = np.zeros(0, dtype=bool)  # records for its peers stay in the rings (a peer restarting)
        self._broken = np.zeros(0, dtype=bool)  # its far end stopped answering
        self._broken_told = np.zeros(0, dtype=bool)
        self._inflight = np.zeros(0, dtype=np.int64)  # WRs posted, not completed, per connection index
        self._pending = np.zeros(0, dtype=np.int64)  # rows waiting in the proxy, per connection index
        self._plan = np.zeros(0, dtype=PLAN_DTYPE)  # rows waiting for a batch to close or the cap to open
        self._meta = np.zeros(0, dtype=META_DTYPE)
        self._posted: list[_Posted] = []
        self._next_token = 1
        self._touched: set[int] = set()
        self.counters: dict[str, int] = dict.fromkeys(_COUNTERS, 0)
        self.batch_hist = np.zeros(9, dtype=np.int64)  # index = commands in the batch
        self._conn_hist = np.zeros((0, 9), dtype=np.int64)  # the same, per connection index
        self._conn_bytes = np.zeros(0, dtype=np.int64)  # payload bytes posted per connection index
        # (batch conn, batch size, row conn, row length, row op) per post, folded into the two above in bulk
        # (every _CONN_LOG_FOLD posts and before reporting): per-connection counting stays off the hot path
        self._conn_log: list[tuple[np.ndarray, ...]] = []
        self._head_seen: dict[int, tuple[int, int]] = {}  # channel -> (head position, ns it was first seen waiting)
        self._taking = True  # False once drain() has emptied the rings: nothing more is taken
        self.errors = np.zeros(256, dtype=np.int64)  # by ErrorCode value

    # -- the tables, as the model sees them: read directly (ProxyBase keeps them) ---------------------------
    def _peers_changed(self, entry: JobTables) -> None:
        pass

    def _sources_changed(self, source: int, table: RegionTable) -> None:
        pass

    def _open_channel(self, channel: int, ring: RingFile, entry: JobTables, rank: int, track: int) -> _DrainedRing:
        return _DrainedRing(channel, ring, entry, rank, self._source(entry, rank)[1], track)

    def _channel_gone(self, channel: int) -> None:
        self._drop_waiting(self._meta["chan"] == channel, ErrorCode.CLIENT_GONE)

    def _channel_removed(self, channel: int, ch: _DrainedRing) -> None:
        self._head_seen.pop(channel, None)
        keep = self._meta["chan"] != channel
        self._plan, self._meta = compress_rows(self._plan, keep), compress_rows(self._meta, keep)
        self._recount_pending()

    def _connection_added(self, conn: int) -> int:
        idx = len(self._conn_ids)
        self._conn_ids = np.append(self._conn_ids, conn)
        self._inflight = np.append(self._inflight, 0)
        self._pending = np.append(self._pending, 0)
        self._conn_hist = np.vstack([self._conn_hist, np.zeros((1, 9), dtype=np.int64)])
        self._conn_bytes = np.append(self._conn_bytes, 0)
        self._holding = np.append(self._holding, False)
        self._broken = np.append(self._broken, False)
        self._broken_told = np.append(self._broken_told, False)
        return idx

    def _connection_failed(self, index: int, code: int) -> None:
        self._drop_waiting(self._meta["conn"] == index, code)
        for posted in self._posted:
            open_tokens = np.flatnonzero((posted.tok_conn == index) & ~posted.done)
            if open_tokens.size:
                status = np.full(open_tokens.size, -1 if code else 0, dtype=np.int64)
                self._complete(posted, open_tokens, status, forced_code=code)
        self._posted = [p for p in self._posted if p.remaining]
        self._inflight[index] = 0
        self._advance_touched()

    def _connection_held(self, index: int, on: bool) -> None:
        self._holding[index] = on

    def broken_connections(self) -> list[int]:
        """Connections whose far end stopped answering since the last call (each once)."""
        with self._lock:
            new = self._broken & ~self._broken_told
            self._broken_told |= new
            return [int(c) for c in self._conn_ids[new]]

    # -- the loop ------------------------------------------------------------------------------------------
    def run_once(self) -> bool:
        """One pass: take ready records, post ready batches, drain completions. True if it did any work.

        Posting comes first so a fresh record never waits behind completion handling; completions are
        drained right after, so a fast NIC's completion (and the QUIET position) lands in the same pass.
        """
        with self._lock:
            self.counters["iterations"] += 1
            now = time.monotonic_ns()
            took, quiet = self._take(now)
            did = took
            if len(self._plan):
                did |= self._post(now, quiet)
            did |= self._progress() > 0
            self._advance_touched()
            return did

    def wait_ready(self, timeout_s: float) -> bool:
        """Watch the rings' head slots for up to ``timeout_s``: True as soon as one holds a committed record.

        Reads one seq word per ring per look and takes nothing (the next :meth:`run_once` does): the idle
        worker's cheap way to notice a record sooner than a sleep would. False at once while rows wait or
        work is in flight: then the caller's next pass is due anyway (completions, the polling window).
        """
        with self._lock:
            if not self._taking or len(self._plan) or self._posted:
                return False
            heads = [(ch.seqs, ch.mask, ch.consumer) for ch in self._channels.values()]
        deadline = time.perf_counter() + timeout_s
        while True:
            for seqs, mask, consumer in heads:
                pos = consumer.position
                if seqs[pos & mask] == seq_for(pos):
                    return True
            if time.perf_counter() >= deadline:
                return False

    def busy(self) -> bool:
        """Rows are waiting in the proxy or WRs are in flight."""
        with self._lock:
            return bool(len(self._plan) or self._posted)

    def progress(self) -> int:
        """Drain completions now (the loop's progress hook); returns how many came."""
        with self._lock:
            n = self._progress()
            self._advance_touched()
            return n

    # -- take --------------------------------------------------------------------------------------------
    def _take(self, now: int) -> tuple[bool, list[int]]:
        plans: list[np.ndarray] = []
        metas: list[np.ndarray] = []
        quiet: list[int] = []
        took = stalled = False
        if not self._taking:
            return took, quiet
        cap = self.inflight_cap
        for ch in self._channels.values():
            consumer = ch.consumer
            pos = consumer.position
            if ch.seqs[pos & ch.mask] != seq_for(pos):
                continue  # nothing committed at the head: skip the scan (the idle loop's main cost)
            budget = min(self.max_take, len(ch.done) - (pos - ch.completed))
            conns = ch.job.conns
            safe = budget  # records that fit even if they all went to the busiest connection
            if conns.size and not ch.gone:
                room = cap - (self._inflight[conns] + self._pending[conns])
                budget = min(budget, int(room[room > 0].sum()))
                safe = int(room.min()) // 2  # a command is at most two rows
            if budget <= 0:
                stalled = True
                self._note_waiting(ch, now)
                continue
            records = consumer.consume_ready(budget, release=False)
            n = len(records)
            if n == 0:
                continue
            tr = translate(records, ch.sources, ch.job.peers, max_length=self.max_length, gone=ch.gone)
            held = np.flatnonzero(self._holding[tr.row_conn]) if len(tr.row_conn) else ()
            if len(held):  # a record for a held connection, and all after it, stay in the ring
                k = int(tr.row_rec[held[0]])
                consumer.position -= n - k
                records, tr = records[:k], _truncated(tr, k)
                n = k
                self._note_waiting(ch, now)
            if n > safe:
                k = self._admit(tr, n)
                if k < n:  # the rest stays in the ring: it was never released
                    stalled = True
                    consumer.position -= n - k
                    records, tr = records[:k], _truncated(tr, k)
                    n = k
                    self._note_waiting(ch, now)
            elif n == budget < self.max_take and consumer.ready_count(1):
                stalled = True
                self._note_waiting(ch, now)
            consumer.release()
            if n == 0:
                continue
            took = True
            plan, meta = self._translate(ch, records, tr, now, quiet)
            if len(plan):
                plans.append(plan)
                metas.append(meta)
                self._pending += np.bincount(meta["conn"], minlength=len(self._pending))
        if stalled:
            self.counters["stalls"] += 1
        if plans:
            if len(self._plan):
                plans.insert(0, self._plan)
                metas.insert(0, self._meta)
            self._plan = concat_rows(plans)
            self._meta = concat_rows(metas)
        return took, quiet

    def _note_waiting(self, ch: _DrainedRing, now: int) -> None:
        """The record at the channel's head is committed but stays in the ring: remember since when."""
        seen = self._head_seen.get(ch.id)
        if seen is None or seen[0] != ch.consumer.position:
            self._head_seen[ch.id] = (ch.consumer.position, now)

    def _admit(self, tr: Translated, n: int) -> int:
        """How many leading records fit under the inflight cap (rows waiting + in flight, per connection)."""
        rc = tr.row_conn
        if not len(rc):
            return n
        load = self._inflight + self._pending
        if (np.bincount(rc, minlength=len(load)) + load <= self.inflight_cap).all():
            return n
        order = np.argsort(rc, kind="stable")
        by_conn = rc[order]
        running = cumsum_within(run_starts(by_conn), np.ones(len(rc), dtype=np.int64))
        over = running + self._inflight[by_conn] + self._pending[by_conn] > self.inflight_cap
        if not over.any():
            return n
        return int(tr.row_rec[order[over].min()])

    def _translate(self, ch: _DrainedRing, records: np.ndarray, tr: Translated, now: int,
                   quiet: list[int]) -> tuple[np.ndarray, np.ndarray]:
        n = len(records)
        first_pos = ch.consumer.position - n
        plan, row_rec = tr.plan, tr.row_rec
        bad = np.flatnonzero(tr.codes)
        self.counters["commands"] += n - len(bad)
        if len(bad):
            self._reject(ch, first_pos + bad, tr.codes[bad])
        meta = np.empty(len(plan), dtype=META_DTYPE)
        first = meta["first"]
        if len(plan):
            first[0] = True
            np.not_equal(row_rec[1:], row_rec[:-1], out=first[1:])
        with_rows = int(np.count_nonzero(first))
        if with_rows != n:  # bad records and QUIETs have no rows: they are complete now
            has_rows = np.zeros(n, dtype=bool)
            has_rows[row_rec] = True
            quiets = int(((records["opcode"] == _QUIET) & (tr.codes == 0)).sum())
            if quiets:
                self.counters["quiets"] += quiets
                quiet.append(ch.id)
            self._mark_done(ch, first_pos + np.flatnonzero(~has_rows).astype(np.uint64))
        if len(plan):
            meta["pos"] = row_rec + first_pos
            meta["t"] = now
            meta["conn"] = tr.row_conn
            meta["chan"] = ch.id
            rec = records if len(plan) == with_rows == n else take_rows(records, row_rec)
            meta["closes"] = ((rec["flags"] & _NO_BATCH) != 0) | (rec["opcode"] == _FENCE_OP)
        return plan, meta

    def _reject(self, ch: _DrainedRing, positions: np.ndarray, codes: np.ndarray) -> None:
        """Count bad records and report each through the channel's error word (the first code sticks)."""
        self.counters["rejected"] += len(codes)
        np.add.at(self.errors, codes, 1)
        for pos, code in zip(positions.tolist(), codes.tolist(), strict=True):
            ch.ring.report_error(code, pos)

    # -- post --------------------------------------------------------------------------------------------
    def _post(self, now: int, quiet: list[int]) -> bool:
        plan, meta = self._plan, self._meta
        conn = meta["conn"]
        if len(conn) > 1 and (conn[1:] < conn[:-1]).any():
            order = np.argsort(conn, kind="stable")
            plan, meta = take_rows(plan, order), take_rows(meta, order)
            conn = meta["conn"]
        b = cut_batches(conn, meta["first"], meta["closes"], self.batch_max)
        ready = ~b.last | b.closed | (b.ncmds == self.batch_max)
        if self.window_ns <= 0:
            ready[:] = True
        elif not ready.all():
            ready |= now - meta["t"][b.start] >= self.window_ns
            if quiet:
                ready |= np.logical_or.reduceat(np.isin(meta["chan"], quiet), b.start)
        rows = b.stop - b.start
        if (self._inflight + self._pending <= self.inflight_cap).all():
            post = ready  # every connection has room for all it has waiting
        else:
            conn_first = np.empty(len(b), dtype=bool)
            conn_first[0] = True
            conn_first[1:] = b.last[:-1]
            inflight = self._inflight[b.conn]
            fits = (inflight + cumsum_within(conn_first, rows) <= self.inflight_cap) | (conn_first & (inflight == 0))
            post = ready & fits  # per connection a prefix of its batches: only the last may be open
            blocked = ready & ~fits
            if blocked.any() and np.logical_or.reduceat(plan["op"] == _SIGNAL, b.start)[blocked].any():
                self.counters["signal_stalls"] += 1  # a signal ready to go waits for the NIC to complete work
        if not post.any():
            return False
        if post.all():
            self._plan = self._plan[:0]
            self._meta = self._meta[:0]
            row_batch = b.row_batch
        else:
            row_post = np.repeat(post, rows)
            self._plan, self._meta = compress_rows(plan, ~row_post), compress_rows(meta, ~row_post)
            plan, meta = compress_rows(plan, row_post), compress_rows(meta, row_post)
            row_batch = (np.cumsum(post) - 1)[b.row_batch[row_post]]
        self._recount_pending()
        sel = post.nonzero()[0]
        self._post_batches_now(plan, meta, row_batch, b.conn[sel], b.ncmds[sel])
        return True

    def _post_batches_now(self, plan: np.ndarray, meta: np.ndarray, row_batch: np.ndarray, bconn: np.ndarray,
                          ncmds: np.ndarray) -> None:
        nb = len(bconn)
        cmd = meta["first"]
        cmd_tok = row_batch[cmd]
        cmd_chan = meta["chan"][cmd]
        cmd_pos = meta["pos"][cmd]
        c = self.counters
        op = plan["op"]
        if self.decoupled:
            c["signals_requested"] += int(np.count_nonzero(op == _SIGNAL))
            plan, row_batch = decouple_signals(plan, row_batch)
            op = plan["op"]
        counts = np.bincount(row_batch, minlength=nb)
        bounds = np.zeros(nb + 1, dtype=np.int64)
        np.cumsum(counts, out=bounds[1:])
        first = self._next_token
        self._next_token += nb
        plan["token"] = row_batch + first
        conn_ids = self._conn_ids[bconn]
        nwr = np.asarray(self.backend.post_batches(conn_ids, plan, bounds), dtype=np.int64)
        np.add.at(self._inflight, bconn, nwr)
        self._posted.append(_Posted(first, bconn, nwr, cmd_tok, cmd_chan, cmd_pos, np.zeros(nb, bool), nb))

        ops = np.bincount(op, minlength=4)
        nsig = int(ops[_SIGNAL])
        c["batches"] += nb
        full = int(np.count_nonzero(ncmds == self.batch_max))
        c["batches_full"] += full
        c["batches_partial"] += nb - full
        self.batch_hist += np.bincount(ncmds, minlength=9)[:9]
        self._conn_log.append((bconn, ncmds, bconn[row_batch], plan["length"], op))
        if len(self._conn_log) >= _CONN_LOG_FOLD:
            self._fold_conn_log()
        c["wrs"] += int(nwr.sum())
        c["writes"] += int(ops[_WRITE])
        c["signals"] += nsig
        c["fences"] += int(ops[_FENCE])
        c["bytes"] += int(plan["length"].sum()) - 8 * nsig
        if not self.decoupled:
            c["signals_requested"] += nsig
        if nsig:
            is_sig = op == _SIGNAL
            key = row_batch[is_sig].astype(np.int64) << 16 | plan["dst_rank"][is_sig]
            c["signal_dest_batches"] += len(np.unique(key))

    def _fold_conn_log(self) -> None:
        """Add the logged posts to the per-connection batch-size histogram and payload bytes."""
        log, self._conn_log = self._conn_log, []
        if not log:
            return
        nconn = len(self._conn_ids)
        bconn, ncmds, row_conn, length, op = (np.concatenate(parts) for parts in zip(*log, strict=True))
        self._conn_hist += np.bincount(bconn * 9 + ncmds, minlength=nconn * 9).reshape(nconn, 9)
        payload = np.bincount(row_conn, weights=np.where(op == _SIGNAL, 0, length), minlength=nconn)
        self._conn_bytes += payload.astype(np.int64)

    def _recount_pending(self) -> None:
        self._pending[:] = 0
        if len(self._meta):
            self._pending += np.bincount(self._meta["conn"], minlength=len(self._pending))

    def _drop_waiting(self, mask: np.ndarray, code: int) -> None:
        """Take rows out of the waiting set; their records complete with ``code`` (silently when 0)."""
        if not mask.any():
            return
        meta = compress_rows(self._meta, mask & self._meta["first"])
        self._plan, self._meta = compress_rows(self._plan, ~mask), compress_rows(self._meta, ~mask)
        self._recount_pending()
        for chan in np.unique(meta["chan"]).tolist():
            ch = self._channels.get(chan)
            if ch is None:
                continue
            pos = np.sort(meta["pos"][meta["chan"] == chan])
            if code:
                self._reject(ch, pos, np.full(len(pos), code, dtype=np.uint16))
            self._mark_done(ch, pos)
        self._advance_touched()

    # -- completions -------------------------------------------------------------------------------------
    def _progress(self) -> int:
        comps = self.backend.poll(self.poll_max)
        n = len(comps)
        if not n:
            return 0
        self.counters["completions"] += n
        tokens = comps["token"].astype(np.int64)
        status = comps["status"].astype(np.int64)
        lo, hi = int(tokens.min()), int(tokens.max())
        matched = 0
        for posted in self._posted:
            first, last = posted.first, posted.first + len(posted.done) - 1
            if last < lo or first > hi:
                continue
            sel = (tokens >= first) & (tokens <= last)
            k = int(np.count_nonzero(sel))
            if k:
                matched += k
                self._complete(posted, tokens[sel] - first, status[sel])
        self.counters["unknown_completions"] += n - matched
        self._posted = [p for p in self._posted if p.remaining]
        return n

    def _complete(self, posted: _Posted, local: np.ndarray, status: np.ndarray, forced_code: int = 0) -> None:
        """Tokens ``posted.first + local`` completed with ``status``: free their WRs, finish their commands."""
        ntok = len(posted.done)
        newly = np.zeros(ntok, dtype=bool)
        newly[local] = True  # duplicates collapse here
        if posted.remaining == ntok and newly.all():  # the usual case: the whole group at once
            posted.done[:] = True
            posted.remaining = 0
            np.subtract.at(self._inflight, posted.tok_conn, posted.tok_nwr)
            cmds = None
            chans, positions = posted.cmd_chan, posted.cmd_pos
        else:
            newly &= ~posted.done
            idx = newly.nonzero()[0]
            if not len(idx):
                return
            posted.done[idx] = True
            posted.remaining -= len(idx)
            np.subtract.at(self._inflight, posted.tok_conn[idx], posted.tok_nwr[idx])
            cmds = newly[posted.cmd_tok]
            chans, positions = posted.cmd_chan[cmds], posted.cmd_pos[cmds]
        if status.any():
            tok_status = np.zeros(ntok, dtype=np.int64)
            tok_status[local] = status
            tok_status[~newly] = 0  # already complete before: not counted again
            cmd_status = tok_status[posted.cmd_tok] if cmds is None else tok_status[posted.cmd_tok[cmds]]
            failed = cmd_status != 0
            self.counters["completion_errors"] += int(np.count_nonzero(tok_status))
            if not forced_code:  # the far end did not answer: held and broken from now on
                gone = np.unique(posted.tok_conn[np.isin(tok_status, _UNANSWERED_STATUSES)])
                self._holding[gone] = self._broken[gone] = True
            if forced_code:
                codes = np.where(failed, forced_code, 0).astype(np.uint16)
            else:
                cmd_conn = posted.tok_conn[posted.cmd_tok] if cmds is None else posted.tok_conn[posted.cmd_tok[cmds]]
                unknown = np.isin(cmd_status, _UNANSWERED_STATUSES) | (
                    (cmd_status == _FLUSH_STATUS) & self._broken[cmd_conn])
                codes = np.where(unknown, ErrorCode.UNKNOWN_OUTCOME, completion_error_code(cmd_status)).astype(
                    np.uint16)
            for chan in np.unique(chans[failed]).tolist():
                ch = self._channels.get(chan)
                if ch is not None:
                    sel = (chans == chan) & failed
                    self._reject(ch, positions[sel], codes[sel])
        if len(chans) and chans[0] == chans[-1] and (chans == chans[0]).all():
            ch = self._channels.get(int(chans[0]))
            if ch is not None:
                self._mark_done(ch, positions)
            return
        for chan in np.unique(chans).tolist():
            ch = self._channels.get(chan)
            if ch is not None:
                self._mark_done(ch, positions[chans == chan])

    def _mark_done(self, ch: _DrainedRing, positions: np.ndarray) -> None:
        if len(positions):
            ch.done[positions % np.uint64(len(ch.done))] = True
            self._touched.add(ch.id)

    def _advance_touched(self) -> None:
        """Publish each touched channel's completion position: the first position not yet complete."""
        for chan in self._touched:
            ch = self._channels.get(chan)
            if ch is None:
                continue
            start, end = ch.completed, ch.consumer.position
            size = len(ch.done)
            s = start % size
            head = ch.done[s : min(size, s + end - start)]
            k = len(head) if head.all() else int(head.argmin())
            if k == len(head) and s + (end - start) > size:
                tail = ch.done[: end - start - len(head)]
                k += len(tail) if tail.all() else int(tail.argmin())
            if k:
                if s + k <= size:
                    ch.done[s : s + k] = False
                else:
                    ch.done[s:] = False
                    ch.done[: s + k - size] = False
                ch.completed = start + k
                ch.ring.publish_completion(ch.completed)
        self._touched.clear()

    def _stop_taking(self) -> None:
        self._taking = False

    # -- reporting (ProxyBase.stats and queue_stats ask these) --------------------------------------------
    def _counter_values(self) -> dict[str, int]:
        return self.counters

    def _batch_hist(self) -> np.ndarray:
        return self.batch_hist

    def _error_counts(self) -> list[int]:
        return self.errors.tolist()

    def _pending_rows(self) -> int:
        return len(self._plan)

    def _connection_rows(self) -> list[tuple[int, int, int, list[int], int]]:
        self._fold_conn_log()
        return [(conn_id, int(self._inflight[idx]), int(self._pending[idx]), self._conn_hist[idx].tolist(),
                 int(self._conn_bytes[idx])) for idx, conn_id in enumerate(self._conn_ids.tolist())]

    def _channel_state(self, channel: int, now: int) -> tuple[int, int, int, bool, int, int]:
        ch = self._channels[channel]
        taken = ch.consumer.position
        depth = ch.consumer.ready_count()
        age_ns = 0
        if depth and now >= 0:
            seen = self._head_seen.get(channel)
            if seen is None or seen[0] != taken:
                seen = self._head_seen[channel] = (taken, now)
            age_ns = now - seen[1]
        return taken, depth, ch.completed, ch.gone, age_ns, ch.ring.error[0]


# -- the serve loop's model ----------------------------------------------------------------------------------
#: What a model serve returns, as ``transportd.dataplane.proxy.SERVE_LINK`` / ``SERVE_INTERRUPTED``.
MODEL_SERVE_INTERRUPTED, MODEL_SERVE_LINK = 0, 1


@dataclass
class ModelLoopState:
    """What the engine keeps across serve calls (``idle_since``) and counts (``stats``, its loop_stats keys)."""

    idle_since: float = -1.0
    stats: dict[str, int] = field(default_factory=lambda: dict.fromkeys(
        ("passes", "busy", "spins", "watches", "naps", "deep_watches", "link", "interrupted"), 0))


def _readable(fd: int, timeout_s: float) -> bool:
    if fd < 0:
        if timeout_s > 0:
            time.sleep(timeout_s)
        return False
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(timeout_s * 1e3))


def model_serve(proxy: Any, state: ModelLoopState, interrupted: Callable[[], bool], *, spin_s: float,
                watch_s: float, nap_s: float, deep_after_s: float, deep_watch_s: float, deep_nap_s: float,
                wake_fd: int = -1, link_every_s: float = 50e-6) -> int:
    """The rail worker's serve loop in Python, pass by pass through ``proxy.run_once``: the model of the
    engine's ``serve`` (``transportd/core/engine.c``, ``tpd_serve_loop``), as the worker ran it before the loop
    moved into C. The same policy, the same returns: :data:`MODEL_SERVE_LINK` when ``wake_fd`` is readable,
    :data:`MODEL_SERVE_INTERRUPTED` once ``interrupted()``. ``proxy`` is an engine
    :class:`~transportd.dataplane.proxy.Proxy` (its ``wait_ready`` takes a nap and a descriptor).
    ``tests/transportd/dataplane/test_serve_loop.py`` runs both over the same scenarios."""
    s = state.stats
    looked = time.perf_counter()
    while True:
        if interrupted():
            s["interrupted"] += 1
            return MODEL_SERVE_INTERRUPTED
        s["passes"] += 1
        now = time.perf_counter()
        look = now - looked >= link_every_s
        if proxy.run_once():
            state.idle_since = -1.0
            s["busy"] += 1
        else:
            if state.idle_since < 0:
                state.idle_since = now
            idle = now - state.idle_since
            if idle < spin_s and idle < deep_after_s:
                s["spins"] += 1
            elif _readable(wake_fd, 0):
                s["link"] += 1
                return MODEL_SERVE_LINK
            elif idle >= deep_after_s:
                s["deep_watches"] += 1
                if not proxy.wait_ready(deep_watch_s, deep_nap_s, wake_fd) and proxy.busy():
                    s["naps"] += 1
                    _readable(wake_fd, deep_nap_s)
                look = False
            else:
                s["watches"] += 1
                if not proxy.wait_ready(watch_s):
                    s["naps"] += 1
                    _readable(wake_fd, nap_s)
                look = False
        if look:
            looked = now
            if _readable(wake_fd, 0):
                s["link"] += 1
                return MODEL_SERVE_LINK


assert RECORD_DTYPE.itemsize == 48
