"""Two efa "nodes" in one process: two soft EFA devices, an EfaBackend on each, one connection between them."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

from efa.backend import EfaBackend
from tests.support.efa_link import CONN, DATA_BYTES, Link
from tests.support.soft_backend import verbs  # noqa: F401  (the fixture)


@pytest.fixture
def make_link(verbs: Any) -> Iterator[Callable[..., Link]]:  # noqa: F811  (the shared fixture, requested by name)
    made: list[Link] = []

    def make(*, seed: int | None = 1, device_opts: dict[str, Any] | None = None, **backend_opts: Any) -> Link:
        tag = uuid.uuid4().hex[:8]
        names = (f"efa{tag}a", f"efa{tag}b")
        for name in names:
            verbs.soft.add_device(name, "efa", reorder_seed=seed, **(device_opts or {}))
        a = EfaBackend(names[0], verbs=verbs, **backend_opts)
        b = EfaBackend(names[1], verbs=verbs, **backend_opts)
        rng = np.random.default_rng(seed)
        src = rng.integers(0, 256, DATA_BYTES, dtype=np.uint8)
        dst = np.zeros(DATA_BYTES, dtype=np.uint8)
        link = Link(verbs, a, b, src, dst,
                    a.register_memory(src.ctypes.data, src.nbytes, remote_write=False, remote_atomic=False),
                    b.register_memory(dst.ctypes.data, dst.nbytes, remote_write=True, remote_atomic=False))
        b.set_flag_publisher(link.publish)
        ea = a.create_endpoint(CONN, "job")
        eb = b.create_endpoint(CONN, "job")
        a.connect(CONN, eb)
        b.connect(CONN, ea)
        made.append(link)
        return link

    yield make
    for link in made:
        link.a.close()
        link.b.close()
