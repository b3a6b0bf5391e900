"""Where a dropped resource is closed (softverbs._dropped): on the dropping thread when it is an ordinary
one outside a collection, else on the reaper; and what closing a dropped context releases."""

from __future__ import annotations

import gc
import os
import threading

import pytest

from softverbs._dropped import SoftResource, own_thread
from softverbs.soft import wait_closed
from tests.support.verbs_resources import access, open_provider, poll


class Probe(SoftResource):
    """A resource that records the thread its close ran on (``block``: the close waits for it)."""

    __slots__ = ("_closed", "closes", "block")

    def __init__(self, closes: list[str], block: threading.Event | None = None) -> None:
        self._closed = False
        self.closes = closes
        self.block = block

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.block is not None:
            self.block.wait(10)
        self.closes.append(threading.current_thread().name)


def test_a_drop_on_an_ordinary_thread_closes_there_at_once() -> None:
    closes: list[str] = []
    probe = Probe(closes)
    del probe
    assert closes == [threading.current_thread().name]


def test_a_closed_resource_is_not_closed_again_when_it_goes() -> None:
    closes: list[str] = []
    probe = Probe(closes)
    probe.close()
    del probe
    assert wait_closed(5)
    assert closes == [threading.current_thread().name]


def test_a_resource_the_collector_finds_is_closed_by_the_reaper() -> None:
    closes: list[str] = []
    probe = Probe(closes)
    cycle: list = [probe]
    cycle.append(cycle)
    del probe, cycle
    gc.collect()
    assert wait_closed(5)
    assert closes == ["softverbs-reaper"]


def _reaped_on_a_softverbs_thread() -> bool:
    """A Probe dropped on a softverbs thread, then closed by the reaper."""
    closes: list[str] = []
    box = [Probe(closes)]
    thread = own_thread(box.clear, "softverbs-test")
    thread.start()
    thread.join()
    return wait_closed(5) and closes == ["softverbs-reaper"]


def test_a_drop_on_a_softverbs_thread_is_closed_by_the_reaper() -> None:
    assert _reaped_on_a_softverbs_thread()


def test_a_user_thread_is_not_taken_for_a_softverbs_one_by_its_name() -> None:
    closes: list[str] = []
    box = [Probe(closes)]
    thread = threading.Thread(target=box.clear, name="softverbs-lookalike")
    thread.start()
    thread.join()
    assert closes == ["softverbs-lookalike"]  # closed there and then, as on any ordinary thread


def test_wait_closed_waits_for_a_close_in_progress() -> None:
    closes: list[str] = []
    release = threading.Event()
    box = [Probe(closes, release)]
    thread = own_thread(box.clear, "softverbs-test")
    thread.start()
    thread.join()
    assert not wait_closed(0.05)  # the reaper is inside the close, waiting for release
    assert closes == []
    release.set()
    assert wait_closed(5)
    assert closes == ["softverbs-reaper"]


def test_an_mr_in_a_reference_cycle_stops_answering_once_collected() -> None:
    soft = open_provider("soft")
    with soft.rc_pair() as rc:
        v, e = rc.v, rc.v.enums
        mr = v.mr.MR(rc.pd, 4096, access(v, "IBV_ACCESS_LOCAL_WRITE", "IBV_ACCESS_REMOTE_WRITE"))
        rkey, raddr = mr.rkey, mr.buf
        cycle: list = [mr]
        cycle.append(cycle)
        del mr, cycle
        gc.collect()
        assert wait_closed(5)
        rc.client.qp.post_send(rc.send_wr(e.IBV_WR_RDMA_WRITE, rc.client.sge(0, 64), wr_id=1, rkey=rkey, raddr=raddr))
        assert [(w.wr_id, w.status) for w in poll(rc.client.cq)] == [(1, e.IBV_WC_REM_ACCESS_ERR)]


@pytest.mark.parametrize("name", ["softib0", "softefa0"])
def test_a_dropped_context_closes_its_resources_and_releases_the_device(name: str) -> None:
    from softverbs.device import registry

    v = open_provider("soft").v
    dev = registry()[name]
    refs = dev.refs
    ctx = v.device.Context(name=name)
    pd = v.pd.PD(ctx)
    mr = v.mr.MR(pd, 4096, access(v, "IBV_ACCESS_LOCAL_WRITE", "IBV_ACCESS_REMOTE_WRITE"))
    rkey = mr.rkey
    assert dev.refs == refs + 1 and rkey in dev.mrs_by_rkey
    del mr, pd, ctx  # the MR holds its PD, the PD its context: each goes when the one above it does
    assert dev.refs == refs and rkey not in dev.mrs_by_rkey


def test_a_context_the_collector_finds_is_closed_by_the_reaper() -> None:
    """A context goes the way every resource does: the collection that finds it may run inside a softverbs
    call that holds a lock closing the context takes (its QPs', the device's), or on the device's I/O thread."""
    import uuid

    from softverbs.device import registry

    v = open_provider("soft").v
    name = f"softib-{uuid.uuid4().hex[:6]}"
    v.soft.add_device(name, "ib")
    dev = registry()[name]
    released: list[str] = []
    release = dev.release

    def recorded() -> None:
        released.append(threading.current_thread().name)
        release()

    dev.release = recorded  # what closing the context calls last
    ctx = v.device.Context(name=name)
    cycle: list = [ctx]
    cycle.append(cycle)
    del ctx, cycle
    gc.collect()
    assert wait_closed(5)
    assert released == ["softverbs-reaper"] and dev.refs == 0


def test_a_forked_child_closes_on_a_reaper_of_its_own() -> None:
    assert _reaped_on_a_softverbs_thread()  # the parent's reaper runs
    pid = os.fork()
    if pid == 0:  # the child: the parent's reaper thread does not exist here
        os._exit(0 if _reaped_on_a_softverbs_thread() else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
