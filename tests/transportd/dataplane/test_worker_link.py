"""The worker link is typed: a request the worker cannot decode (an op it does not serve, a field missing,
extra or of the wrong type, descriptors it does not carry) is refused with an error that says so, the
descriptors sent with it are taken and closed, and the worker goes on serving the next request. Run over
the real link, against the stand-in worker and a real rail worker (softverbs)."""

from __future__ import annotations

import os
import typing
from collections.abc import Iterator

import msgspec
import pytest

from tests.ops.worker_target import Echo, FdSize, Value, slow_worker
from transportd.config import Config
from transportd.dataplane import link_messages as link
from transportd.dataplane.link_messages import LinkRequest
from transportd.dataplane.worker import RailService, rail_main
from transportd.dataplane.worker_link import WorkerHandle
from transportd.errors import WorkerError

pytestmark = pytest.mark.multiprocess  # several processes: the unit tests run apart with -m 'not multiprocess'


# Requests the main process can send but no worker serves in this shape (built here, never in the worker).
class Frobnicate(LinkRequest, frozen=True):
    reply = Value


class EchoAsText(LinkRequest, frozen=True, tag="echo"):
    reply = Value
    value: str


class EchoWithoutValue(LinkRequest, frozen=True, tag="echo"):
    reply = Value


class EchoWithExtra(LinkRequest, frozen=True, tag="echo"):
    reply = Value
    value: int
    extra: int


class FdSizeWithExtra(LinkRequest, frozen=True, tag="fd_size"):
    reply = Value
    fds = 1
    extra: int


class StatsAsIdle(LinkRequest, frozen=True, tag="stats"):
    reply = link.Idle  # a reply that does not fit the type the caller expects


@pytest.fixture
def stand_in() -> Iterator[WorkerHandle]:
    handle = WorkerHandle(0, slow_worker, {"delay_s": 0.0})
    try:
        yield handle
    finally:
        handle.stop()


@pytest.fixture
def memfd() -> Iterator[int]:
    fd = os.memfd_create("worker-link-test")
    os.ftruncate(fd, 4096)
    yield fd
    os.close(fd)


@pytest.mark.parametrize(("request_", "match"), [
    (Frobnicate(), r"frobnicate: unknown worker op 'frobnicate' \(this worker serves: echo, fd_size, slow, stop\)"),
    (EchoAsText(value="2"), r"echo: malformed echo request: Expected `int`, got `str` - at `\$.value`"),
    (EchoWithoutValue(), r"echo: malformed echo request: Object missing required field `value`"),
    (EchoWithExtra(value=1, extra=2), r"echo: malformed echo request: Object contains unknown field `extra`"),
])
def test_a_bad_request_is_refused_and_the_worker_serves_the_next(stand_in: WorkerHandle, request_: LinkRequest,
                                                                  match: str) -> None:
    with pytest.raises(WorkerError, match=match):
        stand_in.call(request_)
    assert stand_in.process.is_alive()
    assert stand_in.call(Echo(value=7)) == Value(7)


def test_descriptors_of_a_refused_request_are_taken_so_the_next_ones_match(stand_in: WorkerHandle,
                                                                           memfd: int) -> None:
    with pytest.raises(WorkerError, match="malformed fd_size request: Object contains unknown field `extra`"):
        stand_in.call(FdSizeWithExtra(extra=1), fds=(memfd,))
    with pytest.raises(WorkerError, match=r"echo carries 0 descriptor\(s\), got 1"):
        stand_in.call(Echo(value=1), fds=(memfd,))
    with pytest.raises(WorkerError, match=r"fd_size carries 1 descriptor\(s\), got 0"):
        stand_in.call(FdSize())
    # had any of those left a descriptor queued, this one would find another op's (or none) and fail
    assert stand_in.call(FdSize(), fds=(memfd,)) == Value(4096)
    assert stand_in.call(Echo(value=3)) == Value(3)


def test_a_real_rail_worker_refuses_bad_requests_and_goes_on_serving() -> None:
    handle = WorkerHandle(0, rail_main, {"config": Config()})
    try:
        with pytest.raises(WorkerError, match="unknown worker op 'frobnicate'"):
            handle.call(Frobnicate())
        with pytest.raises(WorkerError, match=r"malformed connections_idle request: Expected `int` >= 0 - at "
                                              r"`\$.conns\[0\]`"):
            handle.call(link.ConnectionsIdle(conns=[-1]))
        with pytest.raises(WorkerError, match=r"malformed unmap_region request: Expected `str`, got `int`"):
            handle.call(link.UnmapRegion(key=typing.cast(str, 5)))
        with pytest.raises(WorkerError, match=r"the reply does not fit .*Idle"):
            handle.call(StatsAsIdle())  # the worker answered its stats; the caller refuses the shape
        assert handle.call(link.ConnectionsIdle(conns=[1, 2])) == link.Idle(idle=True)
        assert handle.call(link.BrokenConnections()) == link.Conns(conns=[])
        assert handle.call(link.UnmapRegion(key="never-mapped")) == link.Done()
        assert handle.call(link.Stats())["rail"] == 0
    finally:
        handle.stop()
    assert handle.process.exitcode == 0


@pytest.mark.parametrize(("softverbs", "placed"), [({}, "device"), ({"direct_copy_via": "host"}, "host"),
                                                   ({"direct_copy": False, "direct_copy_via": "host"}, None)])
def test_a_soft_rail_reports_how_its_direct_copies_are_placed(softverbs: dict, placed: str | None) -> None:
    config = Config(softverbs=msgspec.structs.replace(Config().softverbs, **softverbs))
    handle = WorkerHandle(0, rail_main, {"config": config})
    try:
        assert handle.call(link.Stats())["softverbs"]["direct_copy_via"] == placed
    finally:
        handle.stop()


def test_the_rail_serves_every_request_type_once() -> None:
    tags = [cls.__struct_config__.tag for cls in link.RAIL_REQUESTS]
    assert len(set(tags)) == len(tags) == len(set(link.RAIL_REQUESTS))
    assert all(hasattr(cls, "reply") for cls in link.RAIL_REQUESTS)
    assert {name for name in vars(RailService) if name.startswith("op_")} == set()
    # every request type a rail serves round-trips through the typed decoder the worker builds
    decoder = msgspec.msgpack.Decoder(typing.Union[link.RAIL_REQUESTS])  # noqa: UP007
    sample = link.SetRemoteFlags(job="j", peer=1, addr=2, count=3, rkey=4, seeds=b"\x01")
    assert decoder.decode(msgspec.msgpack.encode(sample)) == sample
