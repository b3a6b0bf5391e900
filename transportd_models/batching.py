"""Grouping plan rows into per-connection batches, and Perseus decoupled signaling, vectorized.

The batching step of the proxy's numpy model (:mod:`transportd_models.engine`); the daemon never runs it:
its engine batches in C (``transportd/core/engine.c``), by these rules.

Batches. Rows arrive sorted by connection (stable, so each connection keeps its order). A *command* is
one record's rows (a PUT_SIGNAL is one command of two rows, and its rows never split across batches). A
connection's commands are cut into batches of at most ``batch_max`` commands; a command that must go out
at once (NO_BATCH, FENCE) closes its batch, so earlier commands of that connection ride with it instead of
being posted after it. Only a connection's last batch can be partial and open; the proxy posts it once the
polling window has passed (or a QUIET asks for it).

Decoupled signaling (docs/design.md, "Flags follow their data"). Within a batch, and within each FENCE-delimited
segment of it (rows never move across a FENCE), every WRITE goes first, in order, then one SIGNAL per flag word,
placed where that word's first signal was: ADDs are summed; a SET resets the sum, so ``SET a, ADD b, ADD c``
becomes ``SET a+b+c`` and ``ADD b, SET a`` becomes ``SET a`` (the last SET wins). A flag word is ``(dst_rank,
raddr, rkey)``. The reduced signal carries the chunk id of the last signal it replaces. The result at the
receiver equals applying the original signals in order, and no signal becomes visible before a write that
preceded it: the backend orders a connection's WRs (WR flags or an ordered QP), the proxy never waits on a
completion queue to do so.

Two ends of a segment stay in place, reduced on their own: its leading signals (before its first WRITE) and
its trailing writes (after its last SIGNAL). On efa a signal covers the writes since the connection's previous
signal (``transportd_models.arrivals``). A leading signal covers writes of an earlier batch, and moved behind
this batch's writes it would cover those instead; a trailing write belongs to a signal of a later batch, and
moved ahead of this batch's signals it would leave that one's group. Kept so, every reduced signal covers at
least what the last signal it replaces covered as pushed. (On ib a signal follows every earlier write anyway.)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from transportd.backends.interface import PlanOp, SignalOp
from transportd.rows import concat_rows, take_rows

_WRITE, _SIGNAL, _FENCE = int(PlanOp.WRITE), int(PlanOp.SIGNAL), int(PlanOp.FENCE)
_ADD, _SET = int(SignalOp.ADD), int(SignalOp.SET)

__all__ = [
    "Batches",
    "cut_batches",
    "cumsum_within",
    "decouple_signals",
    "run_starts",
]


@dataclass(frozen=True, slots=True)
class Batches:
    """Batches over rows sorted by connection; per-batch arrays are in row order.

    ``row_batch[j]`` is row ``j``'s batch; batch ``b`` is rows ``start[b]:stop[b]`` on connection
    ``conn[b]`` with ``ncmds[b]`` commands; ``closed[b]`` says its last command was NO_BATCH or FENCE;
    ``last[b]`` says it is its connection's last batch (the only one that may be open and partial).
    """

    row_batch: np.ndarray
    start: np.ndarray
    stop: np.ndarray
    conn: np.ndarray
    ncmds: np.ndarray
    closed: np.ndarray
    last: np.ndarray

    def __len__(self) -> int:
        return len(self.start)


def run_starts(keys: np.ndarray) -> np.ndarray:
    """True where a run of equal ``keys`` begins."""
    out = np.empty(len(keys), dtype=bool)
    if len(keys):
        out[0] = True
        np.not_equal(keys[1:], keys[:-1], out=out[1:])
    return out


def cumsum_within(group_start: np.ndarray, values: np.ndarray) -> np.ndarray:
    """Inclusive running sum of non-negative ``values`` that restarts wherever ``group_start`` is True."""
    total = np.cumsum(values)
    base = np.maximum.accumulate(np.where(group_start, total - values, 0))  # total before each group
    return total - base


SMALL_ROWS = 32  # up to this many rows, batches are cut in plain Python (numpy's fixed costs dominate)


def _cut_small(conn: np.ndarray, first: np.ndarray, closes: np.ndarray, batch_max: int) -> Batches:
    """:func:`cut_batches` one row at a time: the same batches, for a handful of rows."""
    cs, fs, cl = conn.tolist(), first.tolist(), closes.tolist()
    row_batch: list[int] = []
    start: list[int] = []
    bconn: list[int] = []
    ncmds: list[int] = []
    closed: list[bool] = []
    b = -1
    k = 0  # commands so far in the current segment (a connection's run, up to a closing command)
    prev_conn, prev_closes = None, False
    for j, c in enumerate(cs):
        if fs[j]:
            if j == 0 or c != prev_conn or prev_closes:
                k = 0
            if k % batch_max == 0:
                b += 1
                start.append(j)
                bconn.append(c)
                ncmds.append(0)
                closed.append(False)
            ncmds[b] += 1
            closed[b] = bool(cl[j])
            k += 1
            prev_conn, prev_closes = c, cl[j]
        row_batch.append(b)
    last = [bconn[i] != bconn[i + 1] for i in range(len(bconn) - 1)] + [True]
    return Batches(row_batch=np.array(row_batch, dtype=np.intp), start=np.array(start, dtype=np.intp),
                   stop=np.array(start[1:] + [len(cs)], dtype=np.int64), conn=np.array(bconn, dtype=conn.dtype),
                   ncmds=np.array(ncmds, dtype=np.int64), closed=np.array(closed, dtype=bool),
                   last=np.array(last, dtype=bool))


def cut_batches(conn: np.ndarray, first: np.ndarray, closes: np.ndarray, batch_max: int) -> Batches:
    """Cut rows (sorted by ``conn``) into batches.

    ``first[j]``: row ``j`` begins a command. ``closes[j]``: row ``j``'s command closes its batch (only
    read on first rows).
    """
    n = len(conn)
    if n <= SMALL_ROWS and n and first[0]:
        return _cut_small(conn, first, closes, batch_max)
    cmd_row = first.nonzero()[0]
    nc = len(cmd_row)
    one_row_each = nc == n
    cmd_conn = conn if one_row_each else conn[cmd_row]
    cmd_closes = closes if one_row_each else closes[cmd_row]
    seg_start = run_starts(cmd_conn)  # a new connection, or the command after a closing one
    seg_start[1:] |= cmd_closes[:-1]
    if batch_max > 1:
        seg_first = seg_start.nonzero()[0]
        k = np.arange(nc) - seg_first[np.cumsum(seg_start) - 1]  # index within the segment
        batch_start = seg_start | (k % batch_max == 0)
    else:
        batch_start = np.ones(nc, dtype=bool)
    first_cmd = batch_start.nonzero()[0]
    nb = len(first_cmd)
    batch_of_cmd = np.cumsum(batch_start) - 1
    ncmds = np.empty(nb, dtype=np.int64)
    ncmds[:-1] = first_cmd[1:] - first_cmd[:-1]
    ncmds[-1] = nc - first_cmd[-1]
    start = cmd_row[first_cmd]
    stop = np.empty(nb, dtype=np.int64)
    stop[:-1] = start[1:]
    stop[-1] = n
    bconn = cmd_conn[first_cmd]
    last = np.empty(nb, dtype=bool)
    last[-1] = True
    np.not_equal(bconn[1:], bconn[:-1], out=last[:-1])
    if one_row_each:
        row_batch = batch_of_cmd
    else:
        rows_per_cmd = np.empty(nc, dtype=np.int64)
        rows_per_cmd[:-1] = cmd_row[1:] - cmd_row[:-1]
        rows_per_cmd[-1] = n - cmd_row[-1]
        row_batch = np.repeat(batch_of_cmd, rows_per_cmd)
    return Batches(row_batch=row_batch, start=start, stop=stop, conn=bconn, ncmds=ncmds,
                   closed=cmd_closes[first_cmd + ncmds - 1], last=last)


def decouple_signals(plan: np.ndarray, row_batch: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Reorder and reduce each batch's signals (see the module doc); returns ``(plan, row_batch)``.

    ``row_batch`` must be non-decreasing (rows grouped by batch, each batch in posting order).
    """
    op = plan["op"]
    is_sig = op == _SIGNAL
    if not is_sig.any():
        return plan, row_batch
    n = len(plan)
    is_fence = op == _FENCE
    seg_start = run_starts(row_batch)
    seg_start[1:] |= is_fence[1:] | is_fence[:-1]  # a FENCE is a segment of its own
    seg = np.cumsum(seg_start) - 1
    # Leading signals (before a segment's first write) and trailing writes (after its last signal) stay where
    # they are, each a part of its own: moved, an efa signal would cover other writes than it did
    pos = np.arange(n)
    nseg = int(seg[-1]) + 1
    first_write = np.full(nseg, n)
    np.minimum.at(first_write, seg[op == _WRITE], pos[op == _WRITE])
    last_signal = np.full(nseg, -1)
    np.maximum.at(last_signal, seg[is_sig], pos[is_sig])
    part = np.where(pos < first_write[seg], 0, np.where(pos > last_signal[seg], 2, 1))
    seg = seg * 3 + part

    sig_rows = np.flatnonzero(is_sig)
    sig = take_rows(plan, sig_rows)
    order = np.lexsort((sig_rows, sig["rkey"], sig["raddr"], sig["dst_rank"], seg[sig_rows]))
    rows = sig_rows[order]
    s = take_rows(sig, order)
    s_seg = seg[rows]
    word_start = run_starts(s_seg) | run_starts(s["dst_rank"]) | run_starts(s["raddr"]) | run_starts(s["rkey"])
    gfirst = np.flatnonzero(word_start)
    glast = np.append(gfirst[1:], len(rows)) - 1
    gid = np.cumsum(word_start) - 1

    is_set = s["signal_op"] == _SET
    pos = np.arange(len(rows))
    last_set = np.maximum.reduceat(np.where(is_set, pos, -1), gfirst)
    counted = ~is_set & (pos > last_set[gid])  # ADDs after the word's last SET (all ADDs if none)
    values = s["value"]
    adds = np.add.reduceat(np.where(counted, values, np.uint64(0)), gfirst)
    has_set = last_set >= 0
    reduced = take_rows(s, glast)  # the last signal of each word is the template (its chunk id, slot, keys)
    reduced["value"] = np.where(has_set, values[np.where(has_set, last_set, 0)] + adds, adds)
    reduced["signal_op"] = np.where(has_set, _SET, _ADD)

    keep = np.flatnonzero(~is_sig)
    out = concat_rows([take_rows(plan, keep), reduced])
    out_seg = np.concatenate([seg[keep], s_seg[gfirst]])
    out_kind = np.concatenate([np.zeros(len(keep), np.int8), np.ones(len(gfirst), np.int8)])
    out_at = np.concatenate([keep, rows[gfirst]])  # a word's signal goes where its first signal was
    perm = np.lexsort((out_at, out_kind, out_seg))
    out_batch = np.concatenate([row_batch[keep], row_batch[rows[gfirst]]])
    assert len(out) <= n
    return take_rows(out, perm), out_batch[perm]
