"""A daemon killed outright (SIGKILL, the OOM killer) takes its rail workers with it: a worker left running
would hold its rail's queue pairs and pinned memory with nobody to serve or reclaim them."""

from __future__ import annotations

import os
import signal

import pytest

from tests.support.ctl import ctl
from tests.support.waiting import proc_stat, process_state, wait_until

pytestmark = pytest.mark.multiprocess  # several processes: the unit tests run apart with -m 'not multiprocess'


def _running(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie (a zombie has exited; only its parent's reaping is due)."""
    return process_state(pid) not in (None, "Z", "X")


def test_kill_9_of_the_daemon_ends_its_rail_workers(cluster_factory) -> None:
    cluster = cluster_factory(nodes=1, backend="ib", overrides={"backend": {"rails": [{"device": "softib0"},
                                                                                    {"device": "softib1"}]}})
    status = ctl("status", "--json", "--socket", cluster.socket("nodea"))
    assert status.exit_code == 0, status.stderr
    daemon_pid = status.json()["pid"]
    workers = [r["pid"] for r in status.json()["rails"]]
    assert len(workers) == 2 and all(_running(p) for p in workers)
    assert all(int(proc_stat(p)[1]) == daemon_pid for p in workers)  # each worker's parent is the daemon
    os.kill(daemon_pid, signal.SIGKILL)  # the daemon alone, not its process group
    cluster.nodes["nodea"].process.wait(10)
    wait_until(lambda: not any(_running(p) for p in workers), what="the rail workers to end with their daemon",
               timeout=10)
