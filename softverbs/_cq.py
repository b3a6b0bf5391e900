"""A completion queue as the engine sees it: entries pushed by QPs, taken by polling."""

from __future__ import annotations

import threading
from collections import deque


class CQCore:
    """Completion entries as tuples; WC objects are built only when polled.

    Entry: (wr_id, status, opcode, byte_len, qp_num, src_qp, imm, wc_flags, slid, qp, retire_sq,
    retire_rq, unsolicited). Polling an entry frees `retire_sq` send-queue slots of `qp` (the slots of the
    WR and of the unsignaled WRs before it, as mlx5 advances its SQ tail) and `retire_rq` receive slots.
    """

    __slots__ = ("capacity", "entries", "lock", "overrun", "wc_flags", "efa_wc_flags", "closed")

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.entries: deque[tuple] = deque()
        self.lock = threading.Lock()
        self.overrun = False
        self.wc_flags = 0
        self.efa_wc_flags = 0
        self.closed = False

    def push(self, cqe: tuple) -> None:
        with self.lock:
            if len(self.entries) >= self.capacity:
                self.overrun = True  # the hardware would raise IBV_EVENT_CQ_ERR; polling reports it
                return
            self.entries.append(cqe)

    def take(self, n: int) -> list[tuple]:
        with self.lock:
            entries = self.entries
            out = []
            while entries and len(out) < n:
                cqe = entries.popleft()
                qp = cqe[9]
                if qp is not None:
                    if cqe[10]:
                        qp.sq_retired += cqe[10]
                    if cqe[11]:
                        qp.rq_retired += cqe[11]
                out.append(cqe)
            return out
