"""The I/O thread's spin (``DeviceOptions.io_spin_s``): awake for a while after its last event, it takes the next
frame from a poll of its epoll set (``softverbs._spin.wait_readable``, GIL released) instead of sleeping first."""

from __future__ import annotations

import os
import select
import threading
import time
from typing import Any

import pytest

from softverbs import _spin, soft
from tests.softverbs.test_local_sockets import _two_devices, _write_and_check
from tests.support.verbs_resources import open_provider


@pytest.fixture
def provider() -> Any:
    return open_provider("soft")


@pytest.fixture
def pipe_set() -> Any:
    """An epoll set watching a pipe's read end: ``(the set, read end, write end)``; the set is closed after the
    test body (a test may close it first, to call on a closed set)."""
    ep = select.epoll()
    r, w = os.pipe()
    ep.register(r, select.EPOLLIN)
    try:
        yield ep, r, w
    finally:
        ep.close()
        os.close(r)
        os.close(w)


def test_wait_readable_returns_when_a_descriptor_is_ready_and_leaves_the_event(pipe_set) -> None:
    ep, r, w = pipe_set
    start = time.monotonic()
    assert _spin.wait_readable(ep.fileno(), 20_000_000) is False  # nothing ready: the whole spin
    assert time.monotonic() - start >= 0.019
    threading.Timer(0.01, os.write, (w, b"x")).start()
    start = time.monotonic()
    assert _spin.wait_readable(ep.fileno(), 5_000_000_000) is True  # ready within the spin: at once
    assert time.monotonic() - start < 2.0
    assert ep.poll(0) == [(r, select.EPOLLIN)], "the selector still sees the event"
    epfd = ep.fileno()
    ep.close()
    with pytest.raises(OSError):
        _spin.wait_readable(epfd, 1000)  # a closed epoll set (EBADF)


def test_wait_ready_sleeps_until_a_descriptor_is_ready_and_says_when_before_taking_the_gil(pipe_set) -> None:
    ep, r, w = pipe_set
    start = time.monotonic()
    assert _spin.wait_ready(ep.fileno(), 20) == 0  # nothing ready: the timeout, then 0
    assert time.monotonic() - start >= 0.019
    wrote: list[int] = []
    threading.Timer(0.01, lambda: (wrote.append(time.monotonic_ns()), os.write(w, b"x"))).start()
    at = _spin.wait_ready(ep.fileno(), -1)
    back = time.monotonic_ns()
    assert wrote and wrote[0] <= at <= back  # ready once written, read before the call returned
    assert ep.poll(0) == [(r, select.EPOLLIN)], "the selector still sees the event"
    epfd = ep.fileno()
    ep.close()
    with pytest.raises(OSError):
        _spin.wait_ready(epfd, 0)  # a closed epoll set (EBADF)


def _ready(*pairs: Any) -> int:
    return sum(soft.device_stats(p.ctx.name)["io_spin_ready"] for p in pairs)


def test_an_awake_io_thread_takes_the_next_frame_without_sleeping(provider) -> None:
    spin = {"io_spin_s": 0.5}  # long: the steps of one write come well within it even on a loaded host
    with _two_devices(provider, spin, spin) as (a, b):
        for _ in range(10):
            _write_and_check(a, b, 4096)
        assert _ready(a, b) >= 1


def test_without_io_spin_the_io_thread_sleeps(provider) -> None:
    with _two_devices(provider, {}, {}) as (a, b):
        for _ in range(10):
            _write_and_check(a, b, 4096)
        assert _ready(a, b) == 0
        soft.configure(a.ctx.name, io_spin_s=0.5)  # applies to the running thread from its next wait
        soft.configure(b.ctx.name, io_spin_s=0.5)
        for _ in range(10):
            _write_and_check(a, b, 4096)
        assert _ready(a, b) >= 1


@pytest.mark.multiprocess
def test_the_config_key_reaches_the_rail_workers_devices() -> None:
    """``softverbs.io_spin_s`` in two daemons' config: their rail workers' devices spin (their stats count
    frames caught awake) and the writes land."""
    from tests.support.cluster import close_ranks, join_ranks
    from transportd_cli.localcluster import LocalCluster

    with LocalCluster(2, backend="ib", overrides={"softverbs": {"io_spin_s": 0.5}}) as cluster:
        ranks = join_ranks(cluster, "spin", nbytes=1 << 16, flags=8)
        try:
            sender, receiver = ranks
            for _ in range(8):
                sender.channel.put(1, receiver.dst.id, 0, sender.src.id, 0, 1 << 16)
                sender.channel.quiet(timeout=30)
            assert bytes(receiver.recv) == bytes(sender.send)
            rails = [r for rank in ranks for r in rank.client.stats()["rails"]]
            assert sum(r["softverbs"]["io_spin_ready"] for r in rails) >= 1
        finally:
            close_ranks(ranks)
