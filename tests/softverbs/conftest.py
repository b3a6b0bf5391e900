"""The soft devices' two ways to a device itself, for the modules that ask: a pair of QPs on one device talks
through in-process connections by default (`softverbs._device.LocalConn`, as a NIC loops requests back
inside) and, with ``loopback_in_process=False``, through a TCP connection to its own listener and its I/O
thread, the path two devices (two daemons) take. The rules must hold on both."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from softverbs import soft

DEVICES = ("softib0", "softefa0")


@pytest.fixture(params=["in-process", "socket"])
def loopback_via(request: pytest.FixtureRequest) -> Iterator[str]:
    """Configure the default soft devices' loopback for one test (new connections: each test opens its own)."""
    for name in DEVICES:
        soft.configure(name, loopback_in_process=request.param == "in-process")
    try:
        yield request.param
    finally:
        for name in DEVICES:
            soft.configure(name, loopback_in_process=True)
