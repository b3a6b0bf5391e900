"""IBGDA channels handed out by the daemon: two daemons over softverbs, the rank's rail worker playing the
ConnectX. The device code compiled for the host (host_lib) posts WQEs into the queue files the daemon
created, exactly as a kernel does on the GPU with ``device_handle()``; the receiving rank sees data and
flags through the daemon's flag file, and the sending rank sees a bad command in ``tpd::status``.
"""

from __future__ import annotations

import ctypes
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner

import gpuclient
from tests.support.waiting import wait_until
from transportd.control.protocol import ChannelInfo
from transportd.errors import ErrorCode, RequestError
from transportd_cli.ctl import main as ctl_main
from transportd_cli.localcluster import LocalCluster

pytestmark = pytest.mark.multiprocess  # several processes: the unit tests run apart with -m 'not multiprocess'

CHUNK = 4096
NCHUNKS = 64
SLOTS = 8


class Pair:
    """Ranks 0 and 1 of one job, one per daemon, in this process (host regions and host flags)."""

    def __init__(self, cluster: LocalCluster, job: str = "ibgda-job") -> None:
        self.cluster = cluster
        self.sockets = [cluster.socket(name) for name in cluster.names]
        self.clients = [gpuclient.connect(socket, timeout=30) for socket in self.sockets]
        self.sessions = [c.join(job, rank=r, world=2) for r, c in enumerate(self.clients)]
        rng = np.random.default_rng(5)
        self.src = gpuclient.host_array(CHUNK * NCHUNKS)
        self.src[:] = rng.integers(0, 256, self.src.size, dtype=np.uint8)
        self.dst = gpuclient.host_array(CHUNK * NCHUNKS)
        self.regions = [self.sessions[0].register(self.src), self.sessions[1].register(self.dst)]
        self.flags = [s.flags(SLOTS + 1, where="host") for s in self.sessions]
        for s in self.sessions:
            s.exchange(wait=False)
        for s in self.sessions:
            s.exchange(timeout=30)
        self.left: set[int] = set()

    def close(self) -> None:
        for r, (s, c) in enumerate(zip(self.sessions, self.clients, strict=True)):
            if r not in self.left:  # a session that left, or whose daemon was killed
                s.leave()
            c.close()


@pytest.fixture
def pair_factory() -> Iterator[Any]:
    made: list[tuple[LocalCluster, Pair]] = []

    def make(mode: str = "write", adaptive_routing: bool = False, backend: str = "ib") -> Pair:
        cluster = LocalCluster(2, backend=backend, overrides={
            "signal": {"mode": mode}, "softverbs": {"adaptive_routing": adaptive_routing, "reorder_seed": 3}})
        cluster.start()
        try:
            pair = Pair(cluster)
        except BaseException:
            cluster.stop()
            raise
        made.append((cluster, pair))
        return pair

    yield make
    for cluster, pair in made:
        try:
            pair.close()
        finally:
            cluster.stop()


@pytest.mark.parametrize(("mode", "ar"), [("write", False), ("atomic", True), ("fence", True)])
def test_daemon_ibgda_channel_delivers_chunks_and_flags(host_lib: ctypes.CDLL, pair_factory, mode: str,
                                                        ar: bool) -> None:
    pair = pair_factory(mode, ar)
    ch = pair.sessions[0].channel(64, kind="ibgda")  # far fewer WQEs than the commands: the queue wraps
    assert ch.signal_mode.name.lower() == mode and [q.peer for q in ch.queues] == [1]
    handle = ch.host_handle()
    for epoch in (1, 2):  # flags are monotonic: the second round waits for 2 on every slot
        for i in range(NCHUNKS):
            off = i * CHUNK
            host_lib.tpd_test_put_signal(handle.ptr, 1, pair.regions[1].id, off, pair.regions[0].id, off, CHUNK,
                                         i % SLOTS, 1, 0)
        host_lib.tpd_test_signal(handle.ptr, 1, SLOTS, epoch, 1)  # SET: the round is over
        host_lib.tpd_test_quiet(handle.ptr)
        assert pair.sessions[1].wait(SLOTS, epoch, timeout=30) == epoch
        for slot in range(SLOTS):
            assert pair.sessions[1].wait(slot, epoch * NCHUNKS // SLOTS, timeout=30) == epoch * NCHUNKS // SLOTS
        assert np.array_equal(pair.dst, pair.src)
        pair.dst[:] = 0
    assert host_lib.tpd_test_status(handle.ptr) == 0 and ch.status() == (0, 0)
    # transportctl shows the queue pair the rail worker serves, with every WQE executed and no error
    result = CliRunner().invoke(ctl_main, ["queues", "--json", "--socket", pair.sockets[0]])
    assert result.exit_code == 0, result.output
    (qp,) = json.loads(result.output)["ibgda"]
    wqes_per_put_signal = {"write": 2, "atomic": 2, "fence": 3}[mode]
    assert qp["job"] == "ibgda-job" and qp["error"] is None and qp["error_cqes"] == 0
    assert qp["wqes"] == qp["posted"] >= 2 * (NCHUNKS * wqes_per_put_signal + 1)
    text = CliRunner().invoke(ctl_main, ["queues", "--socket", pair.sockets[0]]).output
    assert "ibgda queue pairs" in text and str(qp["qpn"]) in text


def test_bad_command_is_refused_and_the_next_delivered(host_lib: ctypes.CDLL, pair_factory) -> None:
    pair = pair_factory("atomic")
    ch = pair.sessions[0].channel(32, kind="ibgda")
    handle = ch.host_handle()
    # region 7 does not exist on rank 1: refused on the sending side, before a WQE is built
    host_lib.tpd_test_put_signal(handle.ptr, 1, 7, 0, pair.regions[0].id, 0, 64, 0, 1, 0)
    host_lib.tpd_test_put_signal(handle.ptr, 1, pair.regions[1].id, 0, pair.regions[0].id, 0, 64, 1, 1, 0)
    host_lib.tpd_test_quiet(handle.ptr)
    assert host_lib.tpd_test_status(handle.ptr) == ErrorCode.BAD_REGION
    assert ch.status() == (ErrorCode.BAD_REGION, 1)
    assert pair.sessions[1].wait(1, 1, timeout=30) == 1 and pair.flags[1][0] == 0
    assert np.array_equal(pair.dst[:64], pair.src[:64])


def test_a_killed_peer_daemon_fails_the_next_commands_instead_of_hanging(host_lib: ctypes.CDLL,
                                                                         pair_factory) -> None:
    pair = pair_factory("atomic")
    ch = pair.sessions[0].channel(16, kind="ibgda")
    handle = ch.host_handle()
    host_lib.tpd_test_put_signal(handle.ptr, 1, pair.regions[1].id, 0, pair.regions[0].id, 0, 64, 0, 1, 0)
    host_lib.tpd_test_quiet(handle.ptr)
    assert pair.sessions[1].wait(0, 1, timeout=30) == 1
    pair.cluster.kill(pair.cluster.names[1])
    pair.left.add(1)
    host_lib.tpd_test_put_signal(handle.ptr, 1, pair.regions[1].id, 0, pair.regions[0].id, 0, 64, 0, 1, 0)
    host_lib.tpd_test_quiet(handle.ptr)  # returns: the error completion ends the wait
    assert host_lib.tpd_test_status(handle.ptr) == ErrorCode.TRANSPORT
    assert ch.status()[0] == ErrorCode.TRANSPORT


def _responders(client: Any) -> set[int]:
    """The connections node b's rail accepted for peers' requesters (from the daemon's stats)."""
    return set(client.stats()["rails"][0]["responders"])


def test_leave_closes_the_queues_and_the_far_ends(pair_factory) -> None:
    pair = pair_factory()
    far_before = _responders(pair.clients[1])
    ch = pair.sessions[0].channel(16, kind="ibgda")
    # the queues' memory is the daemon's memfds, taken by descriptor: no file anyone could open by name
    assert ch.queues and all(q.memory.path is None for q in ch.queues)
    assert "/memfd:tpd-ibgda-" in Path("/proc/self/maps").read_text()
    assert len(pair.clients[0].stats()["rails"][0]["ibgda"]) == len(ch.queues)
    far_during = _responders(pair.clients[1])
    assert len(far_during - far_before) == 1  # the responder QP node b accepted for the queue pair
    pair.sessions[0].leave()
    pair.left.add(0)
    assert pair.clients[0].stats()["rails"][0]["ibgda"] == []
    # peer_disconnect travels over the peer plane
    wait_until(lambda: not _responders(pair.clients[1]), "node b to close the job's responders")
    # rank 0 was node a's last rank of the job: the queue pair's responder and the one for node a's proxy
    # connection are both closed on node b
    assert _responders(pair.clients[1]) == set()


def test_efa_daemon_refuses_ibgda_channels(pair_factory) -> None:
    pair = pair_factory(backend="efa")
    with pytest.raises(RequestError, match="backend.kind = 'ib'"):
        pair.sessions[0].channel(64, kind="ibgda")
    ring = pair.sessions[0].channel(64)  # the session keeps serving: a ring channel still opens
    assert ring.ring.capacity == 64


def test_ibgda_channel_before_exchange_is_refused(tmp_path) -> None:
    with LocalCluster(2, backend="ib") as cluster:
        client = gpuclient.connect(cluster.socket(cluster.names[0]), timeout=30)
        try:
            session = client.join("early", rank=0, world=2)
            session.flags(4, where="host")
            with pytest.raises(RequestError, match="exchange"):
                session.channel(64, kind="ibgda")
            with pytest.raises(RequestError, match="no IBGDA channel 999"):  # not this session's channel
                session._conn.request(ChannelInfo(channel=999))
            assert session.stats()  # the session keeps working after both refusals
            session.leave()
        finally:
            client.close()
