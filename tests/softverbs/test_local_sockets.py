"""Same-host peers over an abstract Unix socket (``DeviceOptions.local_sockets``), TCP otherwise: the frames are
the same, so a write lands either way; these tests check which socket a connection took and that the fallback
to TCP works."""

from __future__ import annotations

import socket
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from softverbs import soft
from softverbs._conn import local_name
from tests.support.verbs_resources import RCPair, open_provider, poll


@pytest.fixture
def provider() -> Any:
    return open_provider("soft")


@contextmanager
def _two_devices(provider: Any, requester: dict[str, Any], responder: dict[str, Any]) -> Iterator[tuple[Any, Any]]:
    """A client QP on a fresh device configured ``requester``, its server on another configured ``responder``."""
    names = [f"softib-{uuid.uuid4().hex[:6]}" for _ in range(2)]
    for name, options in zip(names, (requester, responder), strict=True):
        soft.add_device(name, "ib", **options)
    with RCPair(provider, names[0], connect=False) as a, RCPair(provider, names[1], connect=False) as b:
        a.connect(a.client, b.server)
        b.connect(b.server, a.client)
        yield a, b


def _write_and_check(a: Any, b: Any, size: int = 64 << 10) -> None:
    e = a.v.enums
    pattern = bytes(range(256)) * (size // 256)
    a.client.mr.write(pattern, size, 0)
    a.client.qp.post_send(a.send_wr(e.IBV_WR_RDMA_WRITE, a.client.sge(0, size), rkey=b.server.mr.rkey,
                                    raddr=b.server.mr.buf, flags=int(e.IBV_SEND_SIGNALED)))
    (wc,) = poll(a.client.cq, timeout=30)
    assert wc.status == e.IBV_WC_SUCCESS
    assert b.server.mr.read(size, 0) == pattern


def _families(device: str) -> set[int]:
    return {conn.sock.family for conn in soft._device(device).out_conns.values()}


def test_a_peer_on_this_host_is_reached_over_its_local_socket(provider) -> None:
    with _two_devices(provider, {}, {}) as (a, b):
        _write_and_check(a, b)
        assert _families(a.ctx.name) == {socket.AF_UNIX}
        peer = soft._device(b.ctx.name)
        assert peer._local_listener is not None
        assert peer._local_listener.getsockname() == local_name(peer.advertise, peer.port).encode()


@pytest.mark.parametrize("off", ["requester", "responder"])
def test_with_local_sockets_off_on_either_side_the_connection_is_tcp(provider, off) -> None:
    requester = {"local_sockets": off != "requester"}
    responder = {"local_sockets": off != "responder"}
    with _two_devices(provider, requester, responder) as (a, b):
        _write_and_check(a, b)
        assert _families(a.ctx.name) == {socket.AF_INET}
        assert (soft._device(b.ctx.name)._local_listener is None) == (off == "responder")
