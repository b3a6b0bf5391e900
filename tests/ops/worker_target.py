"""A rail-worker stand-in for the worker-link tests (module level, so a spawned process can import it): two
requests of its own beside the link's ``Stop``, served by a table like a rail's."""

from __future__ import annotations

import os
import time

import msgspec

from transportd.dataplane.link_messages import LinkRequest, Stop, Stopped
from transportd.dataplane.worker_link import WorkerEndpoint


class Value(msgspec.Struct, frozen=True):
    value: int


class Echo(LinkRequest, frozen=True):
    reply = Value
    value: int


class Slow(LinkRequest, frozen=True):
    reply = Value
    value: int


class FdSize(LinkRequest, frozen=True):
    """The size of the file behind the one descriptor sent with it (closed here)."""

    reply = Value
    fds = 1


class _Handler:
    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s

    def echo(self, req: Echo) -> Value:
        return Value(req.value)

    def slow(self, req: Slow) -> Value:
        time.sleep(self.delay_s)  # a busy worker: the slowness is what the worker-link tests are about
        return Value(req.value)

    def fd_size(self, req: FdSize, fds: list[int]) -> Value:
        try:
            return Value(os.fstat(fds[0]).st_size)
        finally:
            for fd in fds:
                os.close(fd)

    def stop(self, req: Stop) -> Stopped:
        return Stopped(drained=True)


def slow_worker(link_endpoint: str, rail: int, delay_s: float) -> None:
    handler = _Handler(delay_s)
    link = WorkerEndpoint(link_endpoint, {Echo: handler.echo, Slow: handler.slow, FdSize: handler.fd_size,
                                          Stop: handler.stop})
    link.send_ready(rail=rail)
    while not link.serve_pending(100):
        pass
    link.close()
