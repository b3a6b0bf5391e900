from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import pytest

from cmd_ring import RingFile


@pytest.fixture
def ring_name() -> Iterator[str]:
    name = f"tpd-test-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    yield name
    try:
        os.unlink(f"/dev/shm/{name}")
    except FileNotFoundError:
        pass


@pytest.fixture
def make_ring(ring_name: str) -> Iterator:
    made: list[RingFile] = []

    def make(capacity: int) -> RingFile:
        ring = RingFile.create(ring_name, capacity)
        made.append(ring)
        return ring

    yield make
    for ring in made:
        ring.close()
        ring.unlink()
