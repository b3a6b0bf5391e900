"""Two ib "nodes" in one process: two soft RC devices, an IbBackend on each, one connection between them."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

from ib.backend import IbBackend
from tests.support.ib_link import CONN, DATA_BYTES, NFLAGS, Link
from tests.support.soft_backend import verbs  # noqa: F401  (the fixture)


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
