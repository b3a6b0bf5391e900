"""A daemon killed outright leaves its clients' rings and flag files in /dev/shm; the next one removes them."""

from __future__ import annotations

import os
from pathlib import Path

import gpuclient
from transportd.localcluster import LocalCluster

SHM = Path("/dev/shm")


def test_a_restarted_daemon_removes_what_its_killed_predecessor_left(cluster_factory) -> None:
    cluster: LocalCluster = cluster_factory(nodes=1)
    node_pid = cluster.nodes["nodea"].process.pid
    client = gpuclient.connect(cluster.socket("nodea"))
    session = client.join("crash", rank=0, world=1)
    session.register(gpuclient.host_array(4096))
    session.flags(4)
    session.exchange(timeout=30)
    ring = session.channel(capacity=64).ring.path
    left = sorted(SHM.glob(f"tpd-*-nodea-crash-0*-{node_pid}"))
    assert Path(ring) in left and any(p.name.startswith("tpd-flags-") for p in left), left
    # a file of this node named for a process that is alive (this test) is not the dead daemon's
    alive = SHM / f"tpd-ring-nodea-other-0-1-{os.getpid()}"
    alive.write_bytes(b"")
    try:
        cluster.kill("nodea")
        client.close()
        assert all(p.exists() for p in left)  # nothing cleaned up after a SIGKILL
        cluster.restart("nodea")
        assert not any(p.exists() for p in left)
        assert alive.exists()
        assert f"removed {len(left)} file(s)" in cluster.log("nodea")
    finally:
        alive.unlink(missing_ok=True)
