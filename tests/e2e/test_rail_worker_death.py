"""A rail worker that dies takes the daemon down with it, loudly: clients and peers hear at once, and the exit
status asks the service manager for a restart (a rail whose proxy is gone would never complete anything)."""

from __future__ import annotations

import os
import signal
import time

import pytest

import gpuclient
from tests.support.cluster import join_ranks

pytestmark = pytest.mark.multiprocess  # several processes: the unit tests run apart with -m 'not multiprocess'


def test_a_dead_rail_worker_stops_the_daemon_with_a_status_that_asks_for_a_restart(cluster_factory) -> None:
    cluster = cluster_factory(backend="ib")
    a, b = join_ranks(cluster, nbytes=4096, flags=4)
    try:
        worker_pid = a.client.stats()["rails"][0]["pid"]
        os.kill(worker_pid, signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(gpuclient.ChannelError, match="CLIENT_GONE"):  # its own clients
            a.session.wait(slot=0, at_least=1, timeout=30)
        with pytest.raises(gpuclient.ChannelError, match="PEER_LOST: a node of this job was lost") as lost:
            b.session.wait(slot=0, at_least=1, timeout=30)  # the other node's, told goodbye
        assert "command(s) failed" not in str(lost.value)  # a plain wait: no command of b's failed
        assert time.monotonic() - t0 < 10
        process = cluster.nodes["nodea"].process
        assert process is not None and process.wait(20) == 70  # EX_SOFTWARE: Restart=on-failure restarts it
        assert "rail 0 worker died" in cluster.log("nodea")
    finally:
        b.session.leave()
        a.client.close()
        b.client.close()
