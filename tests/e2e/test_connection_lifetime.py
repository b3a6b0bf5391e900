"""Queue pairs live as long as the jobs that use them: closed on both nodes when a job ends, and rebuilt when
a peer daemon comes back (systemd restarts it, the node reboots)."""

from __future__ import annotations

import os
import signal
import threading

import numpy as np
import pytest

import gpuclient
from cmd_ring import RingFullError
from tests.support.cluster import Rank, close_ranks, join_rank, join_ranks
from tests.support.waiting import wait_until
from transportd.control.client import ControlConnection
from transportd.control.protocol import Stats
from transportd.errors import ErrorCode
from transportd_cli.localcluster import LocalCluster

pytestmark = pytest.mark.multiprocess  # several processes: the unit tests run apart with -m 'not multiprocess'


def _both_ways(a: Rank, b: Rank, slot: int, nbytes: int = 64 << 10) -> None:
    """a -> b and b -> a, each a PUT_SIGNAL whose data the receiver checks when its flag shows."""
    for src, dst, peer in ((a, b, 1), (b, a, 0)):
        src.channel.put_signal(peer=peer, dst_region=dst.dst.id, dst_off=0, src_region=src.src.id, src_off=0,
                               nbytes=nbytes, slot=slot, value=1)
        assert dst.session.wait(slot=slot, at_least=1, timeout=30) == 1
        assert np.array_equal(dst.recv[:nbytes], src.send[:nbytes])
        src.channel.quiet(timeout=30)
        assert src.channel.status() == (0, 0, 0)


def _a_fresh_job_runs(cluster: LocalCluster, job: str, seed: int) -> None:
    """One rank per node joins ``job`` anew; data moves both ways; they leave."""
    a, b = join_ranks(cluster, job=job, seed=seed)
    try:
        _both_ways(a, b, slot=1)
    finally:
        close_ranks([a, b])


@pytest.mark.parametrize(("backend", "how", "curve"), [("ib", "kill", False), ("ib", "terminate", False),
                                                      ("efa", "kill", False), ("ib", "kill", True)])
def test_a_job_after_a_peer_daemon_restart_moves_data_both_ways(cluster_factory, backend: str, how: str,
                                                                 curve: bool) -> None:
    cluster = cluster_factory(backend=backend, curve=curve)  # with CURVE the new daemon authenticates anew
    a, b = join_ranks(cluster, job="before", nbytes=1 << 20, seed=1)
    _both_ways(a, b, slot=0)
    getattr(cluster, how)("nodeb")
    close_ranks([a])
    b.client.close()
    cluster.restart("nodeb")
    # the same job name again, and a new one: neither may pick up a QP of the node's earlier life
    for job, seed in (("before", 2), ("after", 3)):
        _a_fresh_job_runs(cluster, job, seed)


@pytest.mark.parametrize("backend", ["ib", "efa"])
def test_a_peer_killed_mid_stream_fails_what_was_in_flight_and_the_next_job_runs(cluster_factory,
                                                                                  backend: str) -> None:
    cluster = cluster_factory(backend=backend)
    a, b = join_ranks(cluster, job="stream", seed=1)
    a.channel.timeout = 0.05
    stop, pushed = threading.Event(), [0]

    def stream() -> None:
        while not stop.is_set():
            try:
                a.channel.put_signal(peer=1, dst_region=b.dst.id, dst_off=0, src_region=a.src.id, src_off=0,
                                     nbytes=64 << 10, slot=0, value=1)
                pushed[0] += 1
            except RingFullError:
                pass

    streamer = threading.Thread(target=stream, daemon=True)
    streamer.start()
    try:
        wait_until(lambda: pushed[0] > 100, "the stream to get going")
        cluster.kill("nodeb")
        # what was in flight has an unknown outcome (the QP's far end stopped answering); what follows waits
        # in the ring for the node's restart grace period, then fails with PEER_LOST: it never came back
        wait_until(lambda: a.client.stats()["rails"][0]["errors"].get("PEER_LOST"), "PEER_LOST", timeout=30)
    finally:
        stop.set()
        streamer.join(10)
    code, count, _ = a.channel.status()
    assert code in (ErrorCode.UNKNOWN_OUTCOME, ErrorCode.PEER_LOST) and count > 0
    wait_until(lambda: not a.client.stats()["rails"][0]["inflight"], "nothing left in flight")
    close_ranks([a])
    b.client.close()
    cluster.restart("nodeb")
    _a_fresh_job_runs(cluster, "stream", seed=2)


@pytest.mark.parametrize("backend", ["ib", "efa"])
def test_a_node_that_froze_past_the_heartbeat_timeout_learns_its_jobs_were_lost(cluster_factory,
                                                                                  backend: str) -> None:
    """Node b stops (a long freeze, a one-way partition) and resumes: node a declared it lost; b heard a
    all along and never timed out, but is told, so ranks on both sides see PEER_LOST, not one side a hang."""
    cluster = cluster_factory(backend=backend)  # heartbeat timeout 2 s
    a, b = join_ranks(cluster, job="frozen", seed=1)
    try:
        _both_ways(a, b, slot=0)
        group = cluster.nodes["nodeb"].process.pid
        os.killpg(group, signal.SIGSTOP)
        try:
            with pytest.raises(gpuclient.ChannelError, match="PEER_LOST"):
                a.session.wait(slot=0, at_least=2, timeout=20)
        finally:
            os.killpg(group, signal.SIGCONT)
        with pytest.raises(gpuclient.ChannelError, match="PEER_LOST"):
            b.session.wait(slot=0, at_least=2, timeout=20)
    finally:
        close_ranks([a, b])
    _a_fresh_job_runs(cluster, "after-the-freeze", seed=2)


def _endpoints(cluster: LocalCluster) -> dict[str, tuple[list[int], list[int]]]:
    """Per node: the connection ids with a QP open on rail 0, and the responders among them."""
    out = {}
    for name in cluster.names:
        with ControlConnection(cluster.socket(name)) as conn:
            rail = conn.request(Stats())["rails"][0]
        out[name] = (rail["endpoints"], rail["responders"])
    return out


@pytest.mark.parametrize("backend", ["ib", "efa"])
def test_a_finished_job_leaves_no_queue_pair_on_either_node(cluster_factory, backend: str) -> None:
    cluster = cluster_factory(backend=backend)
    idle = _endpoints(cluster)
    assert idle == {"nodea": ([], []), "nodeb": ([], [])}

    def per_node(jobs: int) -> bool:  # each job: a requester of its own and a responder for the other node's
        return all(len(e) == 2 * jobs and len(r) == jobs for e, r in _endpoints(cluster).values())

    first = join_ranks(cluster, job="first", seed=1)
    second = join_ranks(cluster, job="second", seed=2)
    try:
        for a, b in (first, second):
            _both_ways(a, b, slot=0)
        assert per_node(2), _endpoints(cluster)
        close_ranks(first)
        first = []
        wait_until(lambda: per_node(1), "job first's queue pairs to close")
        _both_ways(*second, slot=1)  # the job still running lost nothing
    finally:
        close_ranks(first + second)
    wait_until(lambda: _endpoints(cluster) == idle, "every queue pair to close")


def test_short_jobs_come_and_go_beside_a_running_one_and_leave_nothing_behind(cluster_factory) -> None:
    cluster = cluster_factory(backend="ib")
    idle = _endpoints(cluster)
    errors: list[str] = []

    def churn(worker: int) -> None:
        for i in range(5):
            try:
                x, y = join_ranks(cluster, job=f"short-{worker}-{i}", nbytes=4096, flags=4, seed=i)
                try:
                    x.channel.put_signal(peer=1, dst_region=y.dst.id, dst_off=0, src_region=x.src.id, src_off=0,
                                         nbytes=4096, slot=0, value=1)
                    assert y.session.wait(slot=0, at_least=1, timeout=30) == 1
                    assert np.array_equal(y.recv[:4096], x.send[:4096])
                finally:
                    close_ranks([x, y])
            except Exception as exc:  # noqa: BLE001 - reported by the main thread
                errors.append(f"{type(exc).__name__}: {exc}")

    a, b = join_ranks(cluster, job="long", seed=1)
    threads = [threading.Thread(target=churn, args=(k,)) for k in range(3)]
    try:
        for t in threads:
            t.start()
        for i in range(20):
            _both_ways(a, b, slot=i)
    finally:
        for t in threads:
            t.join(60)
        close_ranks([a, b])
    assert not errors, errors
    wait_until(lambda: _endpoints(cluster) == idle, "every queue pair to close")
    with ControlConnection(cluster.socket("nodea")) as conn:
        stats = conn.request(Stats())
    assert stats["jobs"] == {} and stats["clients"] == 0


def test_two_ranks_on_one_node_close_their_loopback_pair(cluster_factory) -> None:
    cluster = cluster_factory(nodes=1, backend="ib")
    client = gpuclient.connect(cluster.socket("nodea"))
    other = gpuclient.connect(cluster.socket("nodea"))
    try:
        sessions = [c.join("local", rank=i, world=2) for i, c in enumerate((client, other))]
        for s in sessions:
            s.flags(4)
        gpuclient.exchange_all(sessions)
        assert len(_endpoints(cluster)["nodea"][0]) >= 2
        for s in sessions:
            s.leave()
        assert _endpoints(cluster) == {"nodea": ([], [])}
    finally:
        client.close()
        other.close()


@pytest.mark.parametrize(("backend", "layout"), [("ib", "two-nodes"), ("ib", "one-node"), ("efa", "two-nodes")])
def test_a_rank_that_leaves_and_rejoins_a_running_job_moves_data_both_ways(cluster_factory, backend: str,
                                                                           layout: str) -> None:
    """Rank 0's process restarts while rank 1 keeps running: while it is away, commands to it are refused
    (never posted to its old keys), and once it is back both directions use its new regions and flags."""
    cluster = cluster_factory(nodes=2 if layout == "two-nodes" else 1, backend=backend)
    node_b = cluster.names[-1]
    a, b = join_ranks(cluster, job="j", seed=1, nodes=cluster.names if layout == "two-nodes" else ["nodea"] * 2)
    _both_ways(a, b, slot=0)
    close_ranks([a])
    with ControlConnection(cluster.socket(node_b)) as conn:
        wait_until(lambda: conn.request(Stats())["jobs"]["j"]["remote"] == [] or layout == "one-node",
                   "node b to hear that rank 0 left")
    probe = b.session.channel(capacity=64)
    probe.put(peer=0, dst_region=1, dst_off=0, src_region=b.src.id, src_off=0, nbytes=64)
    wait_until(lambda: probe.status()[0] == ErrorCode.BAD_PEER, "the put to the absent rank to be refused")
    a = join_rank(cluster, "nodea", "j", 0, 2, rng=np.random.default_rng(2))  # its process restarted
    a.session.exchange(timeout=30)
    a.channel = a.session.channel(capacity=256)
    try:
        _both_ways(a, b, slot=1)
    finally:
        close_ranks([a, b])

