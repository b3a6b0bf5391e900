"""Two ib "nodes" in one process: two soft RC devices, an IbBackend on each, one connection between them."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest

from ib.backend import IbBackend
from tests.support.soft_backend import verbs, wait_for, wait_until  # noqa: F401  (fixtures)
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
        wait_until(lambda: self.poll() >= 0 and len(self.completions) >= n, f"{n} completions", timeout)
        return self.completions

    def observe(self, fn: Callable[[int, int, int], None] | None) -> None:
        """Run ``fn(qp_num, addr, length)`` on the receiver's device after every placement."""
        self.verbs.soft.set_placement_observer(self.b.rail.ctx, fn)


@pytest.fixture
def make_link(verbs: Any) -> Iterator[Callable[..., Link]]:  # noqa: F811  (the shared fixture, requested by name)
    made: list[Link] = []

    def make(mode: str = "write", *, adaptive_routing: bool = False, seed: int | None = 1,
             packet_size: int | None = None, **backend_opts: Any) -> Link:
        tag = uuid.uuid4().hex[:8]
        names = (f"ib{tag}a", f"ib{tag}b")
        for name in names:
            verbs.soft.add_device(name, "ib", adaptive_routing=adaptive_routing, reorder_seed=seed,
                                  packet_size=packet_size)
        a = IbBackend(names[0], verbs=verbs, signal_mode=mode, **backend_opts)
        b = IbBackend(names[1], verbs=verbs, signal_mode=mode, **backend_opts)
        rng = np.random.default_rng(seed)
        src = rng.integers(0, 256, DATA_BYTES, dtype=np.uint8)
        dst = np.zeros(DATA_BYTES, dtype=np.uint8)
        flags = np.zeros(NFLAGS, dtype=np.uint64)
        link = Link(verbs, a, b, src, dst, flags,
                    a.register_memory(src.ctypes.data, src.nbytes, remote_write=False, remote_atomic=False),
                    b.register_memory(dst.ctypes.data, dst.nbytes, remote_write=True, remote_atomic=False),
                    b.register_memory(flags.ctypes.data, flags.nbytes, remote_write=True, remote_atomic=True))
        ea = a.create_endpoint(CONN, "job")
        eb = b.create_endpoint(CONN, "job")
        a.connect(CONN, eb)
        b.connect(CONN, ea)
        made.append(link)
        return link

    yield make
    for link in made:
        link.observe(None)
        link.a.close()
        link.b.close()
