"""Two efa "nodes" in one process (the ``make_link`` fixture of tests/efa): an EfaBackend on each of two soft
EFA devices, one connection between them, the plan rows the tests post and the flag updates the receiver
publishes."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from efa.backend import EfaBackend
from tests.support.waiting import wait_until
from transportd.backends.interface import PLAN_DTYPE, MemoryKey, PlanOp, SignalOp

CONN = 3
DATA_BYTES = 1 << 20


@dataclass
class Link:
    """Sender ``a`` -> receiver ``b`` on connection ``conn``; ``b``'s publisher records flag updates."""

    verbs: Any
    a: EfaBackend
    b: EfaBackend
    src: np.ndarray
    dst: np.ndarray
    ksrc: MemoryKey
    kdst: MemoryKey
    conn: int = CONN
    completions: list[tuple[int, int, int]] = field(default_factory=list)
    published: list[tuple[int, int, int, SignalOp, int]] = field(default_factory=list)
    on_publish: Callable[[int, int, int, SignalOp, int], None] | None = None

    def publish(self, conn_id: int, rank: int, slot: int, op: SignalOp, value: int) -> None:
        if self.on_publish is not None:
            self.on_publish(conn_id, rank, slot, op, value)
        self.published.append((conn_id, rank, slot, op, value))

    def write(self, off: int, length: int, token: int) -> tuple:
        return (PlanOp.WRITE, 0, 1, length, self.ksrc.addr + off, self.kdst.addr + off, self.ksrc.lkey,
                self.kdst.rkey, 0, 0, 0, token)

    def signal(self, slot: int, value: int, token: int, op: SignalOp = SignalOp.ADD, rank: int = 1) -> tuple:
        return (PlanOp.SIGNAL, op, rank, 8, 0, 0, 0, 0, value, slot, 0, token)

    def fence(self, token: int) -> tuple:
        return (PlanOp.FENCE, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0, token)

    def post(self, rows: list[tuple]) -> int:
        return self.a.post(self.conn, np.array(rows, dtype=PLAN_DTYPE))

    def poll(self) -> int:
        comps = self.a.poll()
        self.completions.extend(zip(comps["token"].tolist(), comps["status"].tolist(),
                                    comps["vendor_err"].tolist(), strict=True))
        self.b.poll()
        return len(comps)

    def wait(self, tokens: int, published: int = 0, timeout: float = 10.0) -> None:
        wait_until(lambda: self.poll() >= 0 and len(self.completions) >= tokens  # poll() drains: spin
                   and len(self.published) >= published,
                   f"{tokens} completions and {published} flags", timeout, interval=0)

    def reconnect(self) -> None:
        """A fresh connection (counters from zero) on the same two backends; buffers zeroed."""
        self.a.close_connection(self.conn)
        self.b.close_connection(self.conn)
        self.conn += 1
        ea = self.a.create_endpoint(self.conn, "job")
        eb = self.b.create_endpoint(self.conn, "job")
        self.a.connect(self.conn, eb)
        self.b.connect(self.conn, ea)
        self.dst[:] = 0
        self.completions.clear()
        self.published.clear()
