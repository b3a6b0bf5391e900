"""A job's connections, once closed, leave `transportctl queues` and `top` on both nodes (requester and
responder side), as they leave the metrics' queue pair count; a running job's stay."""

from __future__ import annotations

import json

import pytest

from tests.support.cluster import close_ranks, join_ranks
from tests.support.ctl import ctl
from tests.support.waiting import wait_until

pytestmark = pytest.mark.multiprocess  # several processes: the unit tests run apart with -m 'not multiprocess'


def _queue_rows(socket: str) -> list[dict]:
    result = ctl("queues", "--json", "--socket", socket)
    assert result.exit_code == 0, result.stderr
    return result.json()["connections"]


def test_closed_connections_leave_queues_and_top(cluster_factory) -> None:
    cluster = cluster_factory(backend="ib")
    a, b = join_ranks(cluster, job="brief", nbytes=4096, flags=4)
    a.channel.put_signal(peer=1, dst_region=b.dst.id, dst_off=0, src_region=a.src.id, src_off=0, nbytes=4096,
                         slot=0, value=1)
    assert b.session.wait(slot=0, at_least=1, timeout=30) == 1
    a.channel.quiet(timeout=30)
    sockets = [cluster.socket(n) for n in cluster.names]
    assert all(_queue_rows(s) for s in sockets)  # while the job runs: its connection, both ends
    assert any(r["bytes"] >= 4096 for r in _queue_rows(sockets[0]))
    close_ranks([a, b])

    def gone() -> bool:
        return all(not _queue_rows(s) and not ctl("status", "--json", "--socket", s).json()["connections"]
                   and all(not r["endpoints"] for r in ctl("status", "--json", "--socket", s).json()["rails"])
                   for s in sockets)

    wait_until(gone, what="both nodes to close the job's queue pairs", timeout=20)
    text = ctl("queues", "--socket", sockets[0]).stdout
    assert "(responder)" not in text and "connections (batch sizes" in text
    frame = json.loads(ctl("top", "--iterations", "1", "--json", "--socket", sockets[1]).stdout)
    assert frame["queues"]["connections"] == []
