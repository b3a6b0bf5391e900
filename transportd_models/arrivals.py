"""The counting scheme, both ends, with no verbs in it: which flag may be published when.

This is the model: the daemon runs the same rules in C (``efa/csrc/efa_post.c`` numbers the groups
and builds the records, ``efa/csrc/efa_arrivals.c`` counts the arrivals), and
``tests/efa/test_efa_core.py`` compares the two. ``SenderGroups`` is the posting side of one connection: it
numbers groups and builds control records (see :mod:`efa.wire` for the layout). ``ArrivalTracker`` is the
receiving side of the same connection: it is fed the immediates and records as their completions come
out of the CQ, in whatever order SRD produced them, and returns the flag updates that have become safe to
publish.

A signal is published only when all of these hold (so a flag is never visible before its data):

1. every piece of its own group has arrived (the record says how many there are);
2. every group below its ``after`` is complete — a FENCE sets ``after`` for all later signals, so a
   signal after a FENCE also waits for everything written before the FENCE (cumulative mode sets it for
   every signal);
3. every earlier signal of this connection to the same flag (rank, slot) has been published, so a
   counter read as ``>= k`` implies the data of the first k signals, and SETs land in posting order;
   hence every record with a smaller ``seq`` must have arrived (to know which flags earlier signals name).

What a signal covers, then: the writes of its group (those since the previous signal of the connection),
everything before the last FENCE, and — through rule 3 — everything the earlier signals on the same flag
covered. That is OpenSHMEM's put-with-signal contract; the ib backend gives more (a flag there is ordered
after *every* earlier write), and ``cumulative=True`` buys the same here at the price of head-of-line
waiting behind unrelated pieces. What a FENCE cannot do on SRD: delay the *placement* of later writes.
A writer that reuses a destination buffer must wait for the reader's flag, not for a FENCE.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

from efa.errors import ProtocolViolation
from efa.wire import INDEX_BITS, OP_ADD, OP_FENCE, OP_SET, unwrap
from transportd.backends.interface import SignalOp

__all__ = ["ArrivalTracker", "FlagUpdate", "SenderGroups"]

_U32 = 0xFFFFFFFF


class SenderGroups:
    """The posting side of one connection: group numbers for pieces, control records for signals."""

    __slots__ = ("group", "pieces", "closed", "after", "seq", "cumulative")

    def __init__(self, *, cumulative: bool = False) -> None:
        self.group = 0  # the group new pieces join (unless it is closed)
        self.pieces = 0  # pieces in ``group`` so far
        self.closed = False  # a record closed ``group``: the next piece opens a new one
        self.after = 0  # groups below this must be complete before a later signal (set by FENCE)
        self.seq = 0  # next record number
        self.cumulative = cumulative

    def piece_group(self, n: int = 1) -> int:
        """Account ``n`` pieces of one WRITE; returns the group they belong to."""
        if self.closed:
            self.group += 1
            self.pieces = 0
            self.closed = False
        self.pieces += n
        return self.group

    def signal(self, record: np.void | np.ndarray, op: int, value: int, rank: int, slot: int) -> int:
        """Fill ``record`` (a CTRL_DTYPE element) for a signal; returns its seq."""
        after = self.group if self.cumulative else self.after
        return self._close(record, op, value, rank, slot, after)

    def fence(self, record: np.void | np.ndarray) -> int:
        """Fill ``record`` for a FENCE marker (counts only); later signals wait for everything so far."""
        seq = self._close(record, OP_FENCE, 0, 0, 0, 0)
        self.after = self.group + 1
        return seq

    def _close(self, record: np.void | np.ndarray, op: int, value: int, rank: int, slot: int, after: int) -> int:
        seq = self.seq
        record["value"] = value
        record["pieces"] = self.pieces
        record["group"] = self.group & _U32
        record["after"] = after & _U32
        record["slot"] = slot
        record["rank"] = rank
        record["op"] = op
        record["rsv"] = 0
        record["seq"] = seq & _U32
        self.seq = seq + 1
        self.closed = True
        return seq


@dataclass(frozen=True, slots=True)
class FlagUpdate:
    """A flag update that has become safe: everything it covers has arrived."""

    rank: int
    slot: int
    op: SignalOp
    value: int


@dataclass(slots=True)
class _Signal:
    seq: int
    group: int
    after: int
    rank: int
    slot: int
    op: SignalOp
    value: int


class ArrivalTracker:
    """The receiving side of one connection: counts pieces per group and releases signals in safe order."""

    __slots__ = ("low", "arrived", "expected", "next_seq", "early", "pending", "pieces_seen", "records_seen")

    def __init__(self) -> None:
        self.low = 0  # every group below ``low`` is complete
        self.arrived: dict[int, int] = {}
        self.expected: dict[int, int] = {}
        self.next_seq = 0  # every record below this has arrived
        self.early: dict[int, _Signal | None] = {}  # records past a gap (None: a fence marker)
        self.pending: deque[_Signal] = deque()  # signals in seq order, not yet published
        self.pieces_seen = 0
        self.records_seen = 0

    # --- input -------------------------------------------------------------------------------------------
    def on_piece(self, index: int) -> None:
        """A data piece arrived; ``index`` is the group field of its immediate."""
        group = unwrap(index, INDEX_BITS, self.low)
        if group < self.low:
            raise ProtocolViolation(f"piece for group {group}, which was already complete")
        self.arrived[group] = self.arrived.get(group, 0) + 1
        self.pieces_seen += 1
        if group == self.low:
            self._advance_low()

    def on_record(self, index: int, record: np.void) -> None:
        """A control record arrived (copied out of the staging ring); ``index`` is its immediate's index."""
        seq = unwrap(int(record["seq"]), 32, self.next_seq)
        if (seq & ((1 << INDEX_BITS) - 1)) != index:
            raise ProtocolViolation(f"staging entry holds record {seq}, the immediate names {index}: overwritten")
        if seq < self.next_seq or seq in self.early:
            raise ProtocolViolation(f"record {seq} arrived twice")
        self.records_seen += 1
        group = unwrap(int(record["group"]), 32, self.low)
        pieces = int(record["pieces"])
        known = self.expected.get(group)
        if group >= self.low:
            if known is not None and known != pieces:
                raise ProtocolViolation(f"group {group} announced with {known} and {pieces} pieces")
            self.expected[group] = pieces
            if self.arrived.get(group, 0) > pieces:
                raise ProtocolViolation(f"group {group}: more pieces arrived than announced")
        op = int(record["op"])
        if op == OP_FENCE:
            entry: _Signal | None = None
        elif op in (OP_ADD, OP_SET):
            entry = _Signal(seq, group, unwrap(int(record["after"]), 32, self.low), int(record["rank"]),
                            int(record["slot"]), SignalOp(op), int(record["value"]))
        else:
            raise ProtocolViolation(f"record {seq}: unknown op {op}")
        if seq == self.next_seq:
            self._accept(entry)
            while self.next_seq in self.early:
                self._accept(self.early.pop(self.next_seq))
        else:
            self.early[seq] = entry
        if group == self.low:
            self._advance_low()

    # --- output ------------------------------------------------------------------------------------------
    def ready(self) -> list[FlagUpdate]:
        """Signals that may be published now, in the order to publish them; they are forgotten here."""
        if not self.pending:
            return []
        out: list[FlagUpdate] = []
        blocked: set[tuple[int, int]] = set()
        keep: deque[_Signal] = deque()
        for sig in self.pending:
            key = (sig.rank, sig.slot)
            if key not in blocked and self._complete(sig.group) and sig.after <= self.low:
                out.append(FlagUpdate(sig.rank, sig.slot, sig.op, sig.value))
            else:
                blocked.add(key)
                keep.append(sig)
        self.pending = keep
        return out

    def idle(self) -> bool:
        """Nothing is waiting: every record arrived and every signal was published."""
        return not self.pending and not self.early

    # --- internals ---------------------------------------------------------------------------------------
    def _accept(self, entry: _Signal | None) -> None:
        self.next_seq += 1
        if entry is not None:
            self.pending.append(entry)

    def _complete(self, group: int) -> bool:
        if group < self.low:
            return True
        expected = self.expected.get(group)
        return expected is not None and self.arrived.get(group, 0) == expected

    def _advance_low(self) -> None:
        arrived, expected = self.arrived, self.expected
        low = self.low
        while True:
            want = expected.get(low)
            if want is None or arrived.get(low, 0) != want:
                break
            del expected[low]
            arrived.pop(low, None)
            low += 1
        self.low = low
