"""IBGDA channels through the daemon: two daemons over softverbs. The client builds its queue pairs in its
own process on the rank's IBGDA domain, which it imports from its daemon (context, PD and MRs by handle),
and plays the ConnectX for them; the daemons connect the far ends. The device code compiled for the host
(host_lib) posts WQEs into those queues, exactly as a kernel does on the GPU with ``device_handle()``; the
receiving rank sees data and flags through the daemon's flag file, and the sending rank sees a bad command
or an error completion in ``tpd::status``. Leaving, a killed client and recovery after an error are here.
"""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner

import gpuclient
from ibgda.device_handle import REGION_DTYPE
from tests.support.waiting import wait_until
from transportd.control.protocol import ChannelInfo
from transportd.errors import ErrorCode, RequestError
from transportd_cli.ctl import main as ctl_main
from transportd_cli.localcluster import LocalCluster

ROOT = Path(__file__).resolve().parents[2]

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
        gpuclient.exchange_all(self.sessions)
        self.left: set[int] = set()

    def close(self) -> None:
        for r, (s, c) in enumerate(zip(self.sessions, self.clients, strict=True)):
            if r not in self.left:  # a session that left, or whose daemon was killed
                s.leave()
            c.close()


@pytest.fixture
def pair_factory() -> Iterator[Any]:
    made: list[tuple[LocalCluster, Pair]] = []

    def make(mode: str = "write", adaptive_routing: bool = False, backend: str = "ib", grace_s: float = 5.0) -> Pair:
        cluster = LocalCluster(2, backend=backend, overrides={
            "signal": {"mode": mode}, "softverbs": {"adaptive_routing": adaptive_routing, "reorder_seed": 3},
            "peers": {"restart_grace_s": grace_s}})
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
    # the queue pair is this process's: its soft NIC executed every WQE, with no error
    (queue,) = ch.queues
    wqes_per_put_signal = {"write": 2, "atomic": 2, "fence": 3}[mode]
    assert queue.qp.error is None and queue.qp.stats["error_cqes"] == 0
    assert queue.qp.stats["wqes"] == queue.qp.posted >= 2 * (NCHUNKS * wqes_per_put_signal + 1)
    # transportctl shows it as the daemon knows it: the client's QPN, connected to the peer's responder
    result = CliRunner().invoke(ctl_main, ["queues", "--json", "--socket", pair.sockets[0]])
    assert result.exit_code == 0, result.output
    (qp,) = json.loads(result.output)["ibgda"]
    assert (qp["job"], qp["rank"], qp["peer"], qp["channel"]) == ("ibgda-job", 0, 1, ch.id)
    assert qp["qpn"] == queue.qp.qpn and qp["far_qpn"] and qp["state"] == "up"
    assert json.loads(result.output)["ibgda_domains"] == [{"rail": 0, "job": "ibgda-job", "rank": 0, "regions": 1}]
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


def test_a_restart_loses_the_ibgda_channel_but_not_the_session(host_lib: ctypes.CDLL, pair_factory) -> None:
    """A daemon restart keeps the session (its ring channels re-attach) but not an IBGDA channel: its queue
    pairs and the peers' keys are in the kernel's handle. It says CHANNEL_LOST; a new one works."""
    pair = pair_factory("atomic", grace_s=60.0)
    ch = pair.sessions[0].channel(16, kind="ibgda")
    ring = pair.sessions[0].channel(64)
    handle = ch.host_handle()
    host_lib.tpd_test_put_signal(handle.ptr, 1, pair.regions[1].id, 0, pair.regions[0].id, 0, 64, 0, 1, 0)
    host_lib.tpd_test_quiet(handle.ptr)
    assert pair.sessions[1].wait(0, 1, timeout=30) == 1
    node = pair.cluster.names[0]
    assert pair.cluster.terminate(node) == 0
    pair.cluster.restart(node)
    wait_until(lambda: pair.sessions[0].reattach.count == 1, "the session to re-attach", 120)
    assert ch.lost and ch.status() == (ErrorCode.CHANNEL_LOST, 0)
    assert host_lib.tpd_test_status(handle.ptr) == ErrorCode.CHANNEL_LOST  # what the kernel reads
    # the session and its ring channel go on; a new IBGDA channel delivers
    ring.put_signal(peer=1, dst_region=pair.regions[1].id, dst_off=0, src_region=pair.regions[0].id, src_off=0,
                    nbytes=64, slot=1)
    assert pair.sessions[1].wait(1, 1, timeout=60) == 1
    again = pair.sessions[0].channel(16, kind="ibgda")
    fresh = again.host_handle()
    host_lib.tpd_test_put_signal(fresh.ptr, 1, pair.regions[1].id, 0, pair.regions[0].id, 0, 64, 2, 1, 0)
    host_lib.tpd_test_quiet(fresh.ptr)
    assert pair.sessions[1].wait(2, 1, timeout=30) == 1 and again.status() == (0, 0)


def _responders(client: Any) -> set[int]:
    """The connections node b's rail accepted for peers' requesters (from the daemon's stats)."""
    return set(client.stats()["rails"][0]["responders"])


def _domains(client: Any) -> list[dict[str, Any]]:
    """The IBGDA domains node a's rail worker holds (one per rank that opened an IBGDA channel)."""
    return client.stats()["rails"][0]["ibgda_domains"]


def test_the_queue_pairs_are_the_clients_on_the_ranks_own_domain(pair_factory) -> None:
    pair = pair_factory()
    ch = pair.sessions[0].channel(16, kind="ibgda")
    (queue,) = ch.queues
    # built in this process: its memory is ours (no file, no daemon memfd), its QP on the imported PD
    assert queue.qp.mem.path is None and "/memfd:tpd-ibgda-" not in Path("/proc/self/maps").read_text()
    domain = ch.domain
    assert domain.nic == "soft" and domain.rail.pd._imported and domain.rail.ctx._link is not None
    assert queue.qp.qp._pd is domain.rail.pd
    # the domain holds the rank's one region (and a scratch page) and no one else's; the channel's local
    # table names it by the domain's lkey and handle, which this process imported
    assert _domains(pair.clients[0]) == [{"job": "ibgda-job", "rank": 0, "regions": 1}]
    (local,) = ch.info["local_regions"]
    assert local[0] == pair.src.ctypes.data or local[1] == pair.src.nbytes
    assert local[3] in domain._mr_handles
    # a second channel reuses the imported domain
    ch2 = pair.sessions[0].channel(16, kind="ibgda")
    assert ch2.domain is domain and len(pair.clients[0].stats()["rails"][0]["ibgda"]) == 2
    ch2.close()
    assert len(pair.clients[0].stats()["rails"][0]["ibgda"]) == 1


def test_leave_closes_the_queues_the_domain_and_the_far_ends(pair_factory) -> None:
    pair = pair_factory()
    far_before = _responders(pair.clients[1])
    ch = pair.sessions[0].channel(16, kind="ibgda")
    (queue,) = ch.queues
    assert len(pair.clients[0].stats()["rails"][0]["ibgda"]) == 1 and len(_domains(pair.clients[0])) == 1
    far_during = _responders(pair.clients[1])
    assert len(far_during - far_before) == 1  # the responder QP node b accepted for the queue pair
    pair.sessions[0].leave()
    pair.left.add(0)
    assert queue.qp.qp is None and ch.queues == []  # this process destroyed its queue pairs
    assert pair.sessions[0]._ibgda_domains == {}
    stats = pair.clients[0].stats()["rails"][0]
    assert stats["ibgda"] == [] and stats["ibgda_domains"] == []
    # peer_disconnect travels over the peer plane
    wait_until(lambda: not _responders(pair.clients[1]), "node b to close the job's responders")
    # rank 0 was node a's last rank of the job: the queue pair's responder and the one for node a's proxy
    # connection are both closed on node b
    assert _responders(pair.clients[1]) == set()


KILLED_RANK = textwrap.dedent("""
    import ctypes, json, sys
    import numpy as np
    import gpuclient
    from tests.support.ibgda_link import SIGNATURES
    socket, lib_path = sys.argv[1:3]
    lib = ctypes.CDLL(lib_path)
    for name, (res, args) in SIGNATURES.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = res, args
    client = gpuclient.connect(socket, timeout=30)
    session = client.join("killed-job", rank=0, world=2)
    src = gpuclient.host_array(4096)
    src[:] = np.arange(4096) % 251
    region = session.register(src)
    session.flags(4, where="host")
    session.exchange(timeout=30)
    ch = session.channel(16, kind="ibgda")
    handle = ch.host_handle()
    lib.tpd_test_put_signal(handle.ptr, 1, 0, 0, region.id, 0, 4096, 0, 1, 0)
    lib.tpd_test_quiet(handle.ptr)
    print(json.dumps({"status": lib.tpd_test_status(handle.ptr), "qpn": ch.queues[0].qp.qpn}), flush=True)
    sys.stdin.readline()  # until killed
""")


def test_a_killed_client_leaves_no_queue_no_domain_and_no_far_end(host_lib: ctypes.CDLL, build_dir: Path) -> None:
    with LocalCluster(2, backend="ib") as cluster:
        a, b = (cluster.socket(name) for name in cluster.names)
        client = gpuclient.connect(b, timeout=30)
        session = client.join("killed-job", rank=1, world=2)
        dst = gpuclient.host_array(4096)
        session.register(dst)
        session.flags(4, where="host")
        session.exchange(wait=False)
        child = subprocess.Popen([sys.executable, "-c", KILLED_RANK, a, str(build_dir / "libtpd_ibgda_host.so")],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT,
                                 env={**os.environ, "PYTHONPATH": str(ROOT)})
        watcher = gpuclient.connect(a, timeout=30)
        try:
            session.exchange(timeout=60)
            line = child.stdout.readline()
            assert line, "the child rank exited before its transfer"
            report = json.loads(line)
            assert report["status"] == 0 and session.wait(0, 1, timeout=30) == 1
            assert np.array_equal(dst, np.arange(4096) % 251)
            (queue,) = watcher.stats()["rails"][0]["ibgda"]
            assert queue["qpn"] == report["qpn"] and queue["state"] == "up"
            assert _responders(client)
            child.kill()  # SIGKILL: no leave, no channel_close
            child.wait(10)
            wait_until(lambda: watcher.stats()["rails"][0]["ibgda"] == [], "node a to drop the killed rank's queues")
            assert watcher.stats()["rails"][0]["ibgda_domains"] == []
            wait_until(lambda: not _responders(client), "node b to close the far ends")
        finally:
            if child.poll() is None:
                child.kill()
            watcher.close()
            session.leave()
            client.close()


def test_after_a_remote_access_error_a_new_channel_to_the_same_peer_delivers(host_lib: ctypes.CDLL,
                                                                             pair_factory) -> None:
    pair = pair_factory("atomic")
    far_before = _responders(pair.clients[1])  # the far end of node a's proxy connection, if any
    ch = pair.sessions[0].channel(32, kind="ibgda")
    handle = ch.host_handle()
    far_first = _responders(pair.clients[1]) - far_before
    assert len(far_first) == 1
    # a stale key, as a kernel holding an old table would use: rank 1's region 0 with a wrong rkey
    remote = int(handle.record["remote"][0])
    world_regions = int(handle.record["nregions"][0])
    table = np.frombuffer((ctypes.c_uint8 * (24 * 2 * world_regions)).from_address(remote), dtype=REGION_DTYPE)
    table[1 * world_regions + pair.regions[1].id]["key"] ^= 0x5500
    host_lib.tpd_test_put_signal(handle.ptr, 1, pair.regions[1].id, 0, pair.regions[0].id, 0, 256, 0, 1, 0)
    host_lib.tpd_test_quiet(handle.ptr)
    assert host_lib.tpd_test_status(handle.ptr) == ErrorCode.REMOTE_ACCESS
    assert ch.status()[0] == ErrorCode.REMOTE_ACCESS and ch.queues[0].qp.error is not None
    assert pair.flags[1][0] == 0 and not pair.dst[:256].any()
    # recovery: close the failed channel and open another to the same peer, without leaving the job
    ch.close()
    wait_until(lambda: not (far_first & _responders(pair.clients[1])), "node b to close the failed far end")
    ch2 = pair.sessions[0].channel(32, kind="ibgda")
    assert ch2.id != ch.id and [q.peer for q in ch2.queues] == [1]
    assert len(_responders(pair.clients[1]) - far_before) == 1  # node b accepted the replacement
    handle2 = ch2.host_handle()
    for i in range(8):
        off = i * CHUNK
        host_lib.tpd_test_put_signal(handle2.ptr, 1, pair.regions[1].id, off, pair.regions[0].id, off, CHUNK, 0, 1,
                                     0)
    host_lib.tpd_test_quiet(handle2.ptr)
    assert host_lib.tpd_test_status(handle2.ptr) == 0 and ch2.status() == (0, 0)
    assert pair.sessions[1].wait(0, 8, timeout=30) == 8
    assert np.array_equal(pair.dst[:8 * CHUNK], pair.src[:8 * CHUNK])
    (qp,) = pair.clients[0].stats()["rails"][0]["ibgda"]  # only the new channel's queue pair is left
    assert qp["channel"] == ch2.id and qp["state"] == "up"


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
