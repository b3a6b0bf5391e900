"""Operations tests: real daemons (``LocalCluster``) inspected with ``transportctl``, metrics and systemd notify.

One two-node cluster (:func:`ops_cluster`) serves every test that only looks: it is started once, carries
known traffic (so every counter the tests read has a known lower bound) and keeps its two clients joined.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.support.cluster import Rank, close_ranks, join_ranks
from tests.support.ops_cluster import BACK, CHUNK, INFLIGHT_CAP, JOB, PUTS, SET_VALUE, OpsCluster, control_group
from tests.support.waiting import wait_until
from transportd_cli.localcluster import LocalCluster, free_port


@pytest.fixture(scope="session")
def ops_cluster() -> Iterator[OpsCluster]:
    metrics = {name: f"127.0.0.1:{free_port()}" for name in ("nodea", "nodeb")}
    per_node: dict[str, dict[str, Any]] = {name: {"metrics": {"listen": listen}} for name, listen in metrics.items()}
    group = control_group()
    per_node["nodeb"]["control"] = {"group": group}
    cluster = LocalCluster(
        2,
        overrides={"proxy": {"inflight_cap": INFLIGHT_CAP},
                   # the backpressure test stops nodeb's rail worker for a moment: keep the peer "up" meanwhile
                   "peers": {"heartbeat_timeout_s": 15.0}},
        per_node=per_node,
    )
    cluster.start()
    ranks: list[Rank] = []
    try:
        ranks = join_ranks(cluster, job=JOB, nbytes=1 << 20)
        a, b = ranks
        for i in range(PUTS):
            a.channel.put_signal(peer=1, dst_region=b.dst.id, dst_off=i * CHUNK, src_region=a.src.id,
                                 src_off=i * CHUNK, nbytes=CHUNK, slot=0, value=1)
        a.channel.fence(peer=1)
        a.channel.signal(peer=1, slot=1, value=SET_VALUE, op="set")
        for i in range(BACK):
            b.channel.put_signal(peer=0, dst_region=a.dst.id, dst_off=i * CHUNK, src_region=b.src.id,
                                 src_off=i * CHUNK, nbytes=CHUNK, slot=2, value=1)
        assert b.session.wait(slot=0, at_least=PUTS, timeout=30) == PUTS
        assert b.session.wait(slot=1, at_least=SET_VALUE, timeout=30) == SET_VALUE
        assert a.session.wait(slot=2, at_least=BACK, timeout=30) == BACK
        a.channel.quiet(timeout=30)
        # one bad record on b's channel: region 77 was never registered -> BAD_REGION, counted by code
        b.channel.put(peer=0, dst_region=77, dst_off=0, src_region=b.src.id, src_off=0, nbytes=CHUNK)
        wait_until(lambda: b.channel.status()[0] != 0, what="the bad record's error word")
        yield OpsCluster(cluster, a, b, metrics, group)
    finally:
        try:
            if ranks:
                close_ranks(ranks)
        finally:
            cluster.stop()
