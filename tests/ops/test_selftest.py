"""``transportctl selftest`` against real daemons over softverbs: every link passes on healthy clusters of
two and three nodes; a stopped peer and a peer with the wrong CURVE key are failed links, in bounded time."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from tests.support.ctl import ctl
from tests.support.waiting import wait_until
from transportd.control.client import ControlConnection
from transportd.control.curve import generate_keypair
from transportd.control.protocol import Selftest, Stats
from transportd_cli.localcluster import LocalCluster

pytestmark = pytest.mark.multiprocess  # several processes: the unit tests run apart with -m 'not multiprocess'

CHECKS = {"put_signal add", "put_signal set", "put + signal add", "1 MiB put_signal", "bad record", "far side data"}


def selftest(cluster: LocalCluster, node: str, *args: str, timeout: float = 180) -> tuple[int, dict, float]:
    started = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "transportd_cli.ctl", "selftest", "--json", "--rounds", "3",
                        "--socket", cluster.socket(node), *args], capture_output=True, text=True, timeout=timeout)
    assert r.stdout, r.stderr
    return r.returncode, json.loads(r.stdout), time.monotonic() - started


def jobs_on(cluster: LocalCluster, node: str) -> dict:
    with ControlConnection(cluster.socket(node), timeout_ms=5000) as conn:
        return conn.request(Stats())["jobs"]


def links_of(cluster: LocalCluster, node: str) -> list[dict]:
    """The links the node would test: its peers, and static peers it has not heard a hello from."""
    with ControlConnection(cluster.socket(node), timeout_ms=5000) as conn:
        return conn.request(Selftest(action="links"))["links"]


def settled(cluster: LocalCluster) -> None:
    """Every node has heard every other on both links (a node first heard on its own link is, until the
    answer to ours arrives, also listed as an unreached static address)."""
    for node in cluster.names:
        wait_until(lambda n=node: len(links_of(cluster, n)) == len(cluster.names) - 1, f"{node}'s links")


def test_two_daemons_every_link_passes():
    with LocalCluster(2) as cluster:
        settled(cluster)
        status, doc, _ = selftest(cluster, "nodea")
        assert status == 0, doc
        (link,) = doc["links"]
        assert (link["node"], link["rail"], link["ok"]) == ("nodeb", 0, True)
        assert set(link["checks"]) == CHECKS and set(link["checks"].values()) == {"ok"}
        assert link["put_flag_p50_us"] > 0 and link["put_flag_p99_us"] >= link["put_flag_p50_us"]
        assert link["gbps_1mib"] > 0 and link["far"]["early"] == 0 and link["far"]["corrupt"] == 0
        assert doc["signal_mode"] == "write"
        human = subprocess.run([sys.executable, "-m", "transportd_cli.ctl", "selftest", "--rounds", "2",
                                "--socket", cluster.socket("nodeb")], capture_output=True, text=True, timeout=180)
        assert human.returncode == 0, human.stdout + human.stderr
        assert "nodea  0     PASS" in human.stdout and "1 of 1 link(s) passed" in human.stdout
        # nothing of the self-test jobs stays on either side
        for node in cluster.names:
            wait_until(lambda n=node: not jobs_on(cluster, n), f"self-test jobs gone on {node}")


def test_two_daemons_efa():
    with LocalCluster(2, backend="efa") as cluster:
        settled(cluster)
        status, doc, _ = selftest(cluster, "nodea")
        assert status == 0, doc
        assert doc["backend"] == "efa" and set(doc["links"][0]["checks"]) == CHECKS


def test_three_daemons_two_rails_atomic():
    config = {"backend": {"rails": [{"device": "softib0"}, {"device": "softib1"}]}, "signal": {"mode": "atomic"}}
    with LocalCluster(3, overrides=config) as cluster:
        settled(cluster)
        status, doc, _ = selftest(cluster, "nodeb")
        assert status == 0, doc
        assert doc["signal_mode"] == "atomic" and doc["rails"] == 2
        assert sorted((link["node"], link["rail"]) for link in doc["links"]) == [
            ("nodea", 0), ("nodea", 1), ("nodec", 0), ("nodec", 1)]
        assert all(link["ok"] for link in doc["links"])


def test_a_killed_peer_is_a_failed_link_not_a_hang():
    with LocalCluster(2) as cluster:
        settled(cluster)
        cluster.kill("nodeb")  # no goodbye: nodea still thinks it is up until the heartbeat timeout
        status, doc, elapsed = selftest(cluster, "nodea", "--timeout", "4")
        assert status == 1
        (link,) = doc["links"]
        assert not link["ok"] and link["reason"]
        assert elapsed < 60
        # once the peer is known down, the link fails at once with that reason
        status, doc, elapsed = selftest(cluster, "nodea", "--timeout", "4")
        assert status == 1 and "down" in doc["links"][0]["reason"], doc
        assert elapsed < 30


def test_a_peer_with_the_wrong_curve_key_is_a_failed_link():
    cluster = LocalCluster(3, curve=True)
    try:
        # nodec's public key in the authorized directory is replaced by a stranger's: nodea and nodeb can
        # neither admit nodec nor authenticate it as a server
        stranger, _ = generate_keypair(cluster.workdir / "stranger", "stranger")
        port_c = cluster.nodes["nodec"].peer_port
        (cluster.workdir / "authorized" / f"127.0.0.1_{port_c}.key").write_bytes(stranger.read_bytes())
        cluster.start(peers_up=0)
        wait_until(lambda: jobs_on(cluster, "nodea") == {} and _peers_up(cluster, "nodea") == {"nodeb"},
                   "nodea sees nodeb", timeout=30)
        status, doc, elapsed = selftest(cluster, "nodea", "--timeout", "4")
        assert status == 1
        by_node = {link["node"]: link for link in doc["links"]}
        assert by_node["nodeb"]["ok"], by_node["nodeb"]
        failed = by_node[f"127.0.0.1:{port_c}"]
        assert not failed["ok"] and "CURVE" in failed["reason"]
        assert elapsed < 60
    finally:
        cluster.stop()


def _peers_up(cluster: LocalCluster, node: str) -> set[str]:
    with ControlConnection(cluster.socket(node), timeout_ms=5000) as conn:
        return {name for name, p in conn.request(Stats())["peers"].items() if p["up"]}


@pytest.mark.parametrize("bad", ["--rounds=0", "--timeout=0"])
def test_bad_arguments_are_refused(bad):
    r = subprocess.run([sys.executable, "-m", "transportd_cli.ctl", "selftest", bad, "--socket", "ipc:///nonexistent"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "Invalid value" in r.stderr


def test_a_node_without_peers_does_not_pass():
    """Nothing to test is not a pass: `0 of 0 passed` with ok true read as a healthy fabric."""
    with LocalCluster(1) as cluster:
        result = ctl("selftest", "--json", "--socket", cluster.socket("nodea"))
        text = ctl("selftest", "--socket", cluster.socket("nodea"))
    assert result.exit_code == 1 and not result.json()["ok"] and "no link to test" in result.json()["reason"]
    assert text.exit_code == 1 and "FAILED: no link to test" in text.stdout and "0 of 0" not in text.stdout
