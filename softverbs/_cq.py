"""A completion queue as the engine sees it: entries pushed by QPs, taken by polling."""

from __future__ import annotations

import threading
from array import array
from collections import deque


class CQCore:
    """Completion entries as tuples; WC objects are built only when polled.

    Entry: (wr_id, status, opcode, byte_len, qp_num, src_qp, imm, wc_flags, slid, qp, retire_sq,
    retire_rq, unsolicited). Polling an entry frees `retire_sq` send-queue slots of `qp` (the slots of the
    WR and of the unsignaled WRs before it, as mlx5 advances its SQ tail) and `retire_rq` receive slots,
    counted in the QP's `sq_polled` / `rq_polled` under this CQ's lock (see `take`).

    `pushed` counts the pushes (an overrun too) in one 8-byte word, bumped after the entry is queued: a
    poller in C reads it without the GIL and calls in only when it moved (`softverbs.soft.batch.doorbell`).
    """

    __slots__ = ("capacity", "entries", "lock", "overrun", "wc_flags", "efa_wc_flags", "closed", "pushed")

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.entries: deque[tuple] = deque()
        self.lock = threading.Lock()
        self.overrun = False
        self.wc_flags = 0
        self.efa_wc_flags = 0
        self.closed = False
        self.pushed = array("Q", [0])

    def push(self, cqe: tuple) -> None:
        with self.lock:
            if len(self.entries) >= self.capacity:
                self.overrun = True  # the hardware would raise IBV_EVENT_CQ_ERR; polling reports it
            else:
                self.entries.append(cqe)
            self.pushed[0] += 1

    def take(self, n: int) -> list[tuple]:
        """Up to ``n`` entries, oldest first. The slots they free are counted in counters of their QPs that
        only pollers write (`sq_polled` for the send CQ's entries, `rq_polled` for the receive CQ's), under
        this CQ's lock: the QP's own threads count what they retire (an SRD QP's unsignaled WR) in
        `sq_retired`, under the QP's lock, so no two read-add-writes meet, and a poll never waits for a QP
        its I/O thread holds (while a run of copies lands, say)."""
        with self.lock:
            entries = self.entries
            out = []
            while entries and len(out) < n:
                cqe = entries.popleft()
                out.append(cqe)
                qp = cqe[9]
                if qp is not None:
                    if cqe[10]:
                        qp.sq_polled += cqe[10]
                    if cqe[11]:
                        qp.rq_polled += cqe[11]
        return out
