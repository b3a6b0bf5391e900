"""Two ib "nodes" in one process (the ``make_link`` fixture of tests/ib): an IbBackend on each of two soft RC
devices, one connection between them, and the plan rows the tests post over it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ib.backend import IbBackend
from tests.support.waiting import wait_until
from transportd.backends.interface import PLAN_DTYPE, MemoryKey, PlanOp, SignalOp

CONN = 7
DATA_BYTES = 1 << 20
NFLAGS = 16


@dataclass
class Link:
    """Sender ``a`` -> receiver ``b`` over connection CONN, with registered source, destination and flags."""

    verbs: Any
    a: IbBackend
    b: IbBackend
    src: np.ndarray
    dst: np.ndarray
    flags: np.ndarray
    ksrc: MemoryKey
    kdst: MemoryKey
    kflags: MemoryKey
    conn: int = CONN
    completions: list[tuple[int, int, int]] = field(default_factory=list)

    def reconnect(self) -> None:
        """A fresh connection (new QPs, shadows at zero) on the same two backends; buffers zeroed."""
        self.a.close_connection(self.conn)
        self.b.close_connection(self.conn)
        self.conn += 1
        ea = self.a.create_endpoint(self.conn, "job")
        eb = self.b.create_endpoint(self.conn, "job")
        self.a.connect(self.conn, eb)
        self.b.connect(self.conn, ea)
        self.dst[:] = 0
        self.flags[:] = 0
        self.completions.clear()

    def write(self, off: int, length: int, token: int, dst_off: int | None = None) -> tuple:
        d = off if dst_off is None else dst_off
        return (PlanOp.WRITE, 0, 1, length, self.ksrc.addr + off, self.kdst.addr + d, self.ksrc.lkey,
                self.kdst.rkey, 0, 0, 0, token)

    def signal(self, slot: int, value: int, token: int, op: SignalOp = SignalOp.ADD) -> tuple:
        return (PlanOp.SIGNAL, op, 1, 8, 0, self.kflags.addr + 8 * slot, 0, self.kflags.rkey, value, slot, 0,
                token)

    def fence(self, token: int) -> tuple:
        return (PlanOp.FENCE, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0, token)

    def post(self, rows: list[tuple]) -> int:
        plan = np.array(rows, dtype=PLAN_DTYPE)
        return self.a.post(self.conn, plan)

    def poll(self) -> int:
        comps = self.a.poll()
        self.completions.extend(zip(comps["token"].tolist(), comps["status"].tolist(),
                                    comps["vendor_err"].tolist(), strict=True))
        self.b.poll()
        return len(comps)

    def wait_tokens(self, n: int, timeout: float = 10.0) -> list[tuple[int, int, int]]:
        # poll() drains the CQ itself: spin
        wait_until(lambda: self.poll() >= 0 and len(self.completions) >= n, f"{n} completions", timeout,
                   interval=0)
        return self.completions

    def observe(self, fn: Callable[[int, int, int], None] | None) -> None:
        """Run ``fn(qp_num, addr, length)`` on the receiver's device after every placement."""
        self.verbs.soft.set_placement_observer(self.b.rail.ctx, fn)
