"""The main process's link to a rail worker stays correct after a call times out (e.g. ``stats`` while the
worker is busy or stopped): the late reply is dropped, never taken for the next call's."""

from __future__ import annotations

import pytest

from tests.ops.worker_target import Echo, Slow, Value, slow_worker
from tests.support.peer_planes import Events, pump
from transportd.dataplane.worker_link import WorkerHandle
from transportd.errors import WorkerError
from transportd_cli.localcluster import free_port

pytestmark = pytest.mark.multiprocess  # several processes: the unit tests run apart with -m 'not multiprocess'


def test_a_late_reply_is_not_taken_for_the_next_calls() -> None:
    handle = WorkerHandle(0, slow_worker, {"delay_s": 0.5})
    try:
        assert handle.info["rail"] == 0
        with pytest.raises(WorkerError, match="did not answer slow"):
            handle.call(Slow(value=1), timeout_s=0.05)
        assert handle.call(Echo(value=2)) == Value(2)  # the slow call's reply arrives first: dropped
        assert handle.call(Echo(value=3)) == Value(3)
    finally:
        handle.stop()


def test_a_slow_call_keeps_the_peers_heartbeats_going() -> None:
    """A daemon stuck in a worker call serves nothing, but its peers must not declare it lost meanwhile."""
    pa, pb = free_port(), free_port()
    events_b = Events()
    a = Events().plane("a", pa, (f"127.0.0.1:{pb}",))
    b = events_b.plane("b", pb, (f"127.0.0.1:{pa}",))
    b.timeout = 0.5
    handle = WorkerHandle(0, slow_worker, {"delay_s": 1.5})
    try:
        pump([a, b], lambda: ("up", "a") in events_b.log)
        handle.on_wait = lambda: b.poll(0)  # a sends nothing while it waits: b gives it up
        handle.call(Slow(value=1))
        assert ("down", "a") in events_b.log
        pump([a, b], lambda: events_b.log.count(("up", "a")) == 2)
        handle.on_wait = lambda: (a.send_heartbeats(), b.poll(0))
        handle.call(Slow(value=2))
        assert events_b.log.count(("down", "a")) == 1, events_b.log
    finally:
        handle.stop()
        a.close()
        b.close()
