"""The shim CQ's doorbell over a softverbs CQ: an idle poll makes no Python call, and nothing queued is missed.

``ShimCQ(poll, fetch, doorbell)`` reads the count softverbs bumps after queueing a completion
(``softverbs.soft.batch.doorbell``) and calls ``poll`` only when it moved since a poll that drained the CQ. The
shim is driven through its own ``struct ibv_cq_ex`` pointers, as the compiled pollers drive it.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from softverbs import cq, device
from softverbs.pyverbs_error import PyverbsRDMAError
from softverbs.soft.batch import doorbell, poll_wc_batch
from tests.ib.test_abi_shim import _fn
from tests.support.waiting import wait_until
from transportd import _core
from transportd.errors import BackendError, SendQueueFullError, VerbsError


class Poller:
    """start_poll / next_poll / end_poll of a ShimCQ, called through its struct's function pointers."""

    def __init__(self, shim: Any) -> None:
        self.shim = shim
        capsule = shim.ibv_cq_ex
        self.base, self._start = _fn(capsule, "ibv_cq_ex", "start_poll", ctypes.c_int, ctypes.c_void_p)
        _, self._next = _fn(capsule, "ibv_cq_ex", "next_poll", ctypes.c_int)
        _, self._end = _fn(capsule, "ibv_cq_ex", "end_poll", None)
        self.wr_id = ctypes.c_uint64.from_address(self.base + _core.abi_layout()["offset ibv_cq_ex.wr_id"])

    def take(self) -> list[int] | int:
        """The wr_ids of one start_poll..end_poll batch; the errno when start_poll finds none or fails."""
        rc = self._start(self.base, None)
        if rc:
            return rc
        got = [self.wr_id.value]
        while self._next(self.base) == 0:
            got.append(self.wr_id.value)
        self._end(self.base)
        return got


@pytest.fixture
def soft_cq() -> Iterator[Any]:
    with device.Context(name="softib0") as ctx, cq.CQEX(ctx, cq.CqInitAttrEx(cqe=8)) as c:
        yield c


def shim_over(c: Any, fetch: int = 1024) -> Any:
    return _core.ShimCQ(functools.partial(poll_wc_batch, c), fetch, doorbell(c))


def queue(c: Any, wr_id: int) -> None:
    """Queue a successful send completion, as a softverbs QP does when an acknowledgement arrives."""
    c._core.push((wr_id, 0, 0, 0, 1, 0, 0, 0, 0, None, 0, 0, False))


def test_an_empty_cq_is_polled_without_a_python_call(soft_cq: Any) -> None:
    shim = shim_over(soft_cq)
    p = Poller(shim)
    for _ in range(5):
        assert p.take() == errno.ENOENT
    assert shim.calls == 0
    queue(soft_cq, 7)
    assert p.take() == [7]
    assert shim.calls == 1
    for _ in range(5):
        assert p.take() == errno.ENOENT
    assert shim.calls == 1, "the poll that took 7 drained the CQ: the unchanged count skips the rest"
    queue(soft_cq, 8)
    assert p.take() == [8] and shim.calls == 2


def test_a_full_fetch_calls_again_for_the_rest(soft_cq: Any) -> None:
    shim = shim_over(soft_cq, fetch=2)
    p = Poller(shim)
    for wr_id in (1, 2, 3):
        queue(soft_cq, wr_id)
    assert p.take() == [1, 2]
    assert p.take() == [3], "a poll that filled its fetch may have left some: the next one calls in"
    assert shim.calls == 2
    assert p.take() == errno.ENOENT and shim.calls == 2


def test_an_overrun_rings_the_doorbell_so_the_poll_reports_it(soft_cq: Any) -> None:
    """Through the ib poller: the poll that finds the overrun raises it (EOVERFLOW) to the poster's caller."""
    shim = shim_over(soft_cq)
    scratch = np.zeros(2, dtype=np.uint64)
    poster = _core.IbPoster(shim, "write", scratch.ctypes.data, 1, BackendError, SendQueueFullError, VerbsError)
    assert len(poster.poll(16)) == 0 and shim.calls == 0
    for wr_id in range(9):  # one more than the CQ holds
        queue(soft_cq, wr_id)
    with pytest.raises(PyverbsRDMAError, match="overrun"):
        poster.poll(16)
    assert shim.calls == 1


def test_completions_queued_while_polling_are_all_taken(soft_cq: Any) -> None:
    """A thread queues while the poller runs: every completion comes out, each once, in order."""
    shim = shim_over(soft_cq, fetch=3)
    p = Poller(shim)
    total = 2000
    got: list[int] = []
    room = threading.Semaphore(8)  # the CQ holds 8: the producer waits for the poller's room

    def producer() -> None:
        for wr_id in range(total):
            room.acquire()
            queue(soft_cq, wr_id)

    t = threading.Thread(target=producer, daemon=True)
    t.start()

    def drained() -> bool:
        batch = p.take()
        if isinstance(batch, list):
            got.extend(batch)
            for _ in batch:
                room.release()
        return len(got) == total

    wait_until(drained, timeout=30, interval=0, what=lambda: f"every queued completion taken ({len(got)} of {total})")
    t.join(5)
    assert got == list(range(total))
    assert p.take() == errno.ENOENT


def test_a_doorbell_that_is_not_one_aligned_8_byte_word_is_refused() -> None:
    def poll(n: int) -> bytes:
        return b""

    for bad in (bytearray(4), bytearray(16), memoryview(bytearray(9))[1:]):
        with pytest.raises(ValueError, match="one aligned 8-byte word"):
            _core.ShimCQ(poll, 8, bad)
    with pytest.raises(TypeError):
        _core.ShimCQ(poll, 8, 12345)  # not a buffer
