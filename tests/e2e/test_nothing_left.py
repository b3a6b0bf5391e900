"""A daemon killed outright leaves nothing of its jobs behind: rings, flags and host memory are memfds.

They have no name in /dev/shm (or anywhere): the kernel frees each with its last descriptor and mapping,
so a SIGKILL of the daemon (and its rail workers) leaves no file for the next daemon to sweep.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import gpuclient
from transportd_cli.localcluster import LocalCluster

pytestmark = pytest.mark.multiprocess  # several processes: the unit tests run apart with -m 'not multiprocess'

SHM = Path("/dev/shm")


def _memfds(pid: int) -> set[str]:
    """The memfd names ``pid`` maps."""
    return {line.split(maxsplit=5)[5] for line in Path(f"/proc/{pid}/maps").read_text().splitlines()
            if len(line.split(maxsplit=5)) == 6 and line.split(maxsplit=5)[5].startswith("/memfd:")}


def test_a_daemon_killed_outright_leaves_nothing_of_a_job_in_dev_shm(cluster_factory) -> None:
    before = set(os.listdir(SHM))
    cluster: LocalCluster = cluster_factory(nodes=1)
    node_pid = cluster.nodes["nodea"].process.pid
    client = gpuclient.connect(cluster.socket("nodea"))
    session = client.join("crash", rank=0, world=1)
    session.register(gpuclient.host_array(4096))
    session.flags(4)
    session.exchange(timeout=30)
    ch = session.channel(capacity=64)
    worker = client.stats()["rails"][0]["pid"]
    # the daemon and its rail worker map the job's ring and flags, and nothing of it has a name
    assert {"/memfd:tpd-ring-crash-0-1 (deleted)", "/memfd:tpd-flags-crash-0 (deleted)"} <= _memfds(node_pid)
    assert {"/memfd:tpd-ring-crash-0-1 (deleted)", "/memfd:tpd-flags-crash-0 (deleted)",
            "/memfd:tpd-host (deleted)"} <= _memfds(worker)
    assert set(os.listdir(SHM)) - before == set()
    cluster.kill("nodea")
    assert set(os.listdir(SHM)) - before == set()  # nothing to clean up after a SIGKILL
    # the client still holds its own mappings (the memory goes with them), and a new daemon serves at once
    assert ch.ring.capacity == 64
    client.close()
    cluster.restart("nodea")
    with gpuclient.connect(cluster.socket("nodea")) as again:
        s = again.join("crash", rank=0, world=1)
        s.flags(4)
        assert s.channel(capacity=64).ring.capacity == 64
        s.leave()
    assert set(os.listdir(SHM)) - before == set()
