"""Settings a new user changes do what they say, seen through the daemon's own reports: ``proxy.ring_capacity``
sizes the rings clients open without naming a capacity, and ``backend.verbs = "auto"`` falling back to
softverbs is said in the log, in ``transportctl status`` (text and JSON) and in the metrics."""

from __future__ import annotations

import urllib.request
from collections.abc import Iterator

import pytest

import gpuclient
from tests.support.ctl import ctl
from tests.support.waiting import wait_until
from transportd.backends.verbs import pyverbs_devices
from transportd_cli.localcluster import LocalCluster, free_port

pytestmark = pytest.mark.multiprocess  # several processes: the unit tests run apart with -m 'not multiprocess'


@pytest.fixture(scope="module")
def auto_node() -> Iterator[tuple[LocalCluster, str]]:
    if pyverbs_devices():
        pytest.skip("this machine has an RDMA device: backend.verbs = auto would not fall back")
    listen = f"127.0.0.1:{free_port()}"
    cluster = LocalCluster(1, overrides={"backend": {"verbs": "auto"}, "proxy": {"ring_capacity": 1024},
                                         "metrics": {"listen": listen}})
    cluster.start()
    try:
        yield cluster, listen
    finally:
        cluster.stop()


def test_ring_capacity_sizes_a_channel_opened_without_one(auto_node: tuple[LocalCluster, str]) -> None:
    cluster, _ = auto_node
    client = gpuclient.connect(cluster.socket("nodea"))
    try:
        session = client.join("cap", rank=0, world=1)
        ch = session.channel()
        explicit = session.channel(capacity=64)
        assert ch.ring.capacity == 1024 and explicit.ring.capacity == 64
        result = ctl("queues", "--json", "--socket", cluster.socket("nodea"))
        assert result.exit_code == 0, result.stderr
        capacities = sorted(r["capacity"] for r in result.json()["rings"] if r["job"] == "cap")
        assert capacities == [64, 1024]
        session.leave()
    finally:
        client.close()


def test_auto_verbs_falling_back_to_softverbs_is_loud(auto_node: tuple[LocalCluster, str]) -> None:
    cluster, listen = auto_node
    log = cluster.log("nodea")
    assert "backend.verbs = \"auto\" found no RDMA device: rail 0 uses softverbs" in log
    assert "backend ib over soft" in log
    status = ctl("status", "--json", "--socket", cluster.socket("nodea"))
    assert status.exit_code == 0, status.stderr
    (rail,) = status.json()["rails"]
    assert rail["verbs"] == "soft" and rail["verbs_fallback"] is True
    text = ctl("status", "--socket", cluster.socket("nodea")).stdout
    assert "WARNING" in text and "softverbs" in text and "pyverbs" in text

    def scraped() -> str | None:  # the daemon refreshes its metrics snapshot every second
        with urllib.request.urlopen(f"http://{listen}/metrics", timeout=10) as response:
            body = response.read().decode()
        return body if 'transportd_rails{node="nodea"} 1' in body else None

    body = wait_until(scraped, what="a metrics snapshot with the rail", timeout=15)
    assert 'transportd_verbs_fallback_rails{node="nodea"} 1' in body


def test_a_chosen_provider_is_no_fallback() -> None:
    """verbs = "soft" (what LocalCluster writes) is a choice: no warning anywhere."""
    with LocalCluster(1) as cluster:
        status = ctl("status", "--json", "--socket", cluster.socket("nodea"))
        assert all(r["verbs"] == "soft" and r["verbs_fallback"] is False for r in status.json()["rails"])
        assert "WARNING" not in ctl("status", "--socket", cluster.socket("nodea")).stdout
        assert "found no RDMA device" not in cluster.log("nodea")
