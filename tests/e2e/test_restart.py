"""A daemon restarts under running jobs (docs/restart.md): real daemons over softverbs, ranks streaming
PUT_SIGNALs (ADD) to each other through it, the receivers checking the data and counting the flags.

- a graceful restart (SIGTERM, then the same config again) of each node in turn loses nothing and writes
  nothing twice: the same client objects carry on, every flag counts every message exactly once;
- a crash (SIGKILL) costs a pause: the records a daemon took and never saw complete come back as
  UNKNOWN_OUTCOME from the first of them, nothing the crash did not touch reports anything, and after the
  application re-sends what was in doubt the data verify and new commands flow on the same objects;
- a restart that fails (a bad config) leaves the peers waiting out ``peers.restart_grace_s`` (shown as
  ``restarting``), then PEER_LOST as for a lost node.
"""

from __future__ import annotations

import os
import signal

import numpy as np
import pytest

import gpuclient
from cmd_ring.shm import sealed_memfd, unsealed_memfd
from gpuclient.host_memory import resolve_host_buffer
from tests.support.cluster import Rank, close_ranks, join_ranks
from tests.support.ctl import ctl
from tests.support.streams import CHUNK, SLOTS, Stream
from tests.support.users import run_as
from tests.support.waiting import process_state, wait_until
from transportd.control.protocol import Channel, Flags, Register
from transportd.dataplane.flagfile import FlagFile
from transportd.errors import ErrorCode, RequestError
from transportd_cli.localcluster import LocalCluster

pytestmark = pytest.mark.multiprocess  # several processes: the unit tests run apart with -m 'not multiprocess'

GRACE_S = 60.0  # restart tests: long enough for a daemon to start on a loaded 2-core machine
NBYTES = SLOTS * CHUNK
RESENT_SLOT = 1  # the flag a test raises after re-sending what was in doubt (the streams count on slot 0)


def _cluster(cluster_factory, backend: str, grace_s: float = GRACE_S) -> LocalCluster:
    return cluster_factory(backend=backend, overrides={"peers": {"restart_grace_s": grace_s}})


def _peer_state(cluster: LocalCluster, node: str, peer: str) -> str:
    result = ctl("peers", "--json", "--socket", cluster.socket(node))
    assert result.exit_code == 0, result.stderr
    return str(result.json()["peers"][peer]["state"])


def _reattached(rank: Rank, count: int, cluster: LocalCluster | None = None) -> bool:
    reattach = rank.session.reattach
    assert reattach.state != "gone", f"{reattach.error}\n" + "\n".join(
        f"--- {n} ---\n{cluster.log(n)}" for n in (cluster.names if cluster else ()))
    return reattach.count >= count


def _reattach_state(cluster: LocalCluster, node: str, rank: Rank) -> str:
    r = rank.session.reattach
    return f"{node}'s client to re-attach ({r.state}, {r.count} so far, last error {r.error}):\n{cluster.log(node)}"


def _exact(stream: Stream) -> None:
    """Every message the sender committed was delivered once: the flag equals the count, the data arrived."""
    total = stream.committed
    assert stream.dst.session.wait(slot=stream.slot, at_least=total, timeout=60) == total
    assert stream.data_arrived()


@pytest.mark.parametrize("backend", ["ib", "efa"])
def test_graceful_restarts_of_either_daemon_lose_nothing_and_count_every_flag_once(cluster_factory,
                                                                                   backend: str) -> None:
    cluster = _cluster(cluster_factory, backend)
    a, b = join_ranks(cluster, job="stream", nbytes=NBYTES, seed=1)
    streams = [Stream(a, b, peer=1).start(), Stream(b, a, peer=0).start()]
    try:
        for s in streams:
            s.flowing_beyond(50, "the streams to get going")
        for node, rank, other in (("nodeb", b, "nodea"), ("nodea", a, "nodeb")):
            committed = [s.committed for s in streams]
            assert cluster.terminate(node) == 0, cluster.log(node)
            # it told its peer before it stopped: the peer holds the job for it
            assert _peer_state(cluster, other, node) == "restarting"
            cluster.restart(node)
            wait_until(lambda rank=rank: _reattached(rank, 1, cluster),
                       lambda node=node, rank=rank: _reattach_state(cluster, node, rank), 120)
            for s, before in zip(streams, committed, strict=True):
                s.flowing_beyond(before + 50, f"the streams to flow again after {node}'s restart")
            assert _peer_state(cluster, other, node) == "up"
    finally:
        for s in streams:
            s.stop()
    for s in streams:
        s.src.channel.quiet(timeout=60)  # raises on any error word
        assert s.src.channel.status() == (0, 0, 0) and s.src.channel.in_doubt is None
        _exact(s)
    assert (a.session.reattach.count, b.session.reattach.count) == (1, 1)
    # the region ids and flag slots the kernels were built with still mean the same memory
    assert (a.src.id, a.dst.id, b.src.id, b.dst.id) == (0, 1, 0, 1)
    close_ranks([a, b])


@pytest.mark.parametrize("backend", ["ib", "efa"])
def test_a_crash_costs_a_pause_and_reports_only_the_records_in_doubt(cluster_factory, backend: str) -> None:
    cluster = _cluster(cluster_factory, backend)
    a, b = join_ranks(cluster, job="stream", nbytes=NBYTES, seed=1)
    x, y = join_ranks(cluster, job="bystander", nbytes=NBYTES, seed=2, nodes=["nodea", "nodea"])
    streams = [Stream(a, b, peer=1).start(), Stream(b, a, peer=0).start()]
    bystander = Stream(x, y, peer=1).start()
    try:
        for s in [*streams, bystander]:
            s.flowing_beyond(50, "the streams to get going")
        # nodea's rail worker stops answering: nodeb's writes to it stay in flight, taken and not complete.
        # With nodea stopped nothing frees room under nodeb's inflight cap (256 WRs, 128 PUT_SIGNALs: 128 ms
        # of the stream): had nodeb's connection been full by the time this thread looked (acknowledgements
        # lagging at the stop, or this thread late, on a loaded machine), nodeb would take nothing more.
        # So nodeb's stream holds and settles first: nothing of nodeb's is in flight to nodea at the stop,
        # and the connection has its whole cap for the records pushed after it.
        worker_a = a.client.stats()["rails"][0]["pid"]
        ring = b.channel.ring
        streams[1].pause()
        streams[1].settled()
        os.kill(worker_a, signal.SIGSTOP)
        try:
            wait_until(lambda: process_state(worker_a) == "T", "nodea's rail worker to stop")
            taken = ring.consumer_pos
            assert ring.completion_pos == taken == ring.producer_pos
            streams[1].resume()
            # records nodeb takes from now on go to a worker that cannot answer: they stay in flight
            wait_until(lambda: ring.consumer_pos > taken, "nodeb to take records nodea cannot answer")
            cluster.kill("nodeb")
        finally:
            os.kill(worker_a, signal.SIGCONT)
        committed = [s.committed for s in streams]
        cluster.restart("nodeb")
        wait_until(lambda: _reattached(b, 1), lambda: _reattach_state(cluster, "nodeb", b), 120)
        for s, before in zip(streams, committed, strict=True):
            s.flowing_beyond(before + 50, "the streams to flow again after the crash")
    finally:
        for s in [*streams, bystander]:
            s.stop()
    for s in [*streams, bystander]:
        s.settled()

    # nodeb's ring: what its dead daemon took and never saw complete, and only that, is in doubt: from the
    # first record it took after nodea stopped (everything before completed)
    first, end = b.channel.in_doubt
    assert end > first == taken
    code, count, position = b.channel.status()
    assert (code, position) == (ErrorCode.UNKNOWN_OUTCOME, first) and count >= end - first
    with pytest.raises(gpuclient.ChannelError, match="UNKNOWN_OUTCOME.*may or may not have executed"):
        b.channel.raise_for_status()
    # nodea's ring: what was in flight to the dead daemon, if anything, is in doubt too, nothing else failed
    code, _count, a_first = a.channel.status()
    assert code in (ErrorCode.OK, ErrorCode.UNKNOWN_OUTCOME)
    # a job that does not touch nodeb saw nothing at all
    assert bystander.src.channel.status() == (0, 0, 0)
    _exact(bystander)

    # the application re-sends the data of every message in doubt (PUT: the flags are not re-counted), then
    # signals a flag of its own and the receiver waits for it: a sender's completion says its NIC is done
    # with the source; what tells a receiver its data is placed is a flag (EFA promises no more)
    resend = [(streams[1], first)] + ([(streams[0], a_first)] if code else [])
    for s, from_position in resend:
        for i, position in enumerate(s.positions):
            if position >= from_position:
                off = (i % SLOTS) * CHUNK
                s.src.channel.put(peer=s.peer, dst_region=s.dst.dst.id, dst_off=off, src_region=s.src.src.id,
                                  src_off=off, nbytes=CHUNK)
        s.src.channel.signal(peer=s.peer, slot=RESENT_SLOT)
        s.settled()
        wait_until(lambda s=s: s.dst.session.flag_array[RESENT_SLOT] >= 1, "the re-sent data's flag")
    for s in streams:
        assert s.data_arrived(), _missing(s, first, end, code, a_first)
        # a flag counted every message that executed: at most all of them, at least those not in doubt
        value = s.dst.session.flag_array[s.slot]
        assert value <= s.committed
        doubt = sum(1 for p in s.positions if p >= (first if s is streams[1] else a_first)) if (
            s is streams[1] or code) else 0
        assert value >= s.committed - doubt

    # new commands flow on the same objects, counted exactly
    for src, dst, peer in ((a, b, 1), (b, a, 0)):
        for i in range(10):
            src.channel.put_signal(peer=peer, dst_region=dst.dst.id, dst_off=i * CHUNK, src_region=src.src.id,
                                   src_off=i * CHUNK, nbytes=CHUNK, slot=2)
        assert dst.session.wait(slot=2, at_least=10, timeout=60) == 10
    close_ranks([a, b, x, y])


def test_a_restart_that_fails_leaves_the_peers_waiting_out_the_grace_period_then_peer_lost(cluster_factory) -> None:
    cluster = _cluster(cluster_factory, "ib", grace_s=10.0)
    a, b = join_ranks(cluster, job="j", nbytes=4096, flags=4, seed=1)
    a.channel.put_signal(peer=1, dst_region=b.dst.id, dst_off=0, src_region=a.src.id, src_off=0, nbytes=64, slot=0)
    assert b.session.wait(slot=0, at_least=1, timeout=30) == 1
    config = cluster.nodes["nodeb"].config_path
    config.write_text(config.read_text() + "\n[proxy]\nbatch_max = 99\n")  # refused at load: exit 78
    assert cluster.terminate("nodeb") == 0
    with pytest.raises(RuntimeError, match="exited with 78"):
        cluster.restart("nodeb")
    # nodeb said it was restarting: nodea holds the job (its status word is clean) for the grace period
    assert _peer_state(cluster, "nodea", "nodeb") == "restarting"
    assert a.session.flag_array.status == 0
    # a command for the absent rank waits in the ring: held, not refused
    a.channel.put_signal(peer=1, dst_region=b.dst.id, dst_off=0, src_region=a.src.id, src_off=0, nbytes=64, slot=0)
    assert a.channel.status() == (0, 0, 0)
    with pytest.raises(gpuclient.ChannelError, match="PEER_LOST"):
        a.session.wait(slot=0, at_least=1, timeout=60)
    assert _peer_state(cluster, "nodea", "nodeb") == "down"
    wait_until(lambda: a.channel.status()[0] == ErrorCode.PEER_LOST, "the held command to fail with PEER_LOST")
    # nodeb's client waited as long, then its session is over
    with pytest.raises(gpuclient.ChannelError, match="CLIENT_GONE"):
        b.session.wait(slot=0, at_least=2, timeout=60)
    close_ranks([a])
    b.client.close()


RESTART_AS_OTHER = """
import json, sys
from transportd.control.client import ControlConnection
from transportd.control.protocol import Restart
from transportd.errors import RequestError
with ControlConnection(sys.argv[1]) as conn:
    try:
        conn.request(Restart())
        print(json.dumps({"refused": None}))
    except RequestError as exc:
        print(json.dumps({"refused": [exc.code, exc.message]}))
"""


def test_transportctl_restart_starts_the_next_daemon_first_and_the_jobs_go_on(cluster_factory, users,
                                                                             shared_dir) -> None:
    cluster = cluster_factory(backend="ib", workdir=str(shared_dir), overrides={
        "peers": {"restart_grace_s": GRACE_S}, "control": {"mode": 0o666}})
    a, b = join_ranks(cluster, job="stream", nbytes=NBYTES, seed=1)
    process = cluster.nodes["nodeb"].process
    stream = Stream(a, b, peer=1).start()
    try:
        stream.flowing_beyond(50, "the stream to get going")
        # another user may not restart the daemon (it may use it: control.mode 0666 here)
        seen = run_as(users["other"], RESTART_AS_OTHER, cluster.socket("nodeb"))
        assert seen["refused"][0] == "forbidden" and "may restart it" in seen["refused"][1]
        # a successor that cannot start (a bad config) changes nothing: the daemon serves on
        config = cluster.nodes["nodeb"].config_path
        good = config.read_text()
        config.write_text(good + "\n[proxy]\nbatch_max = 99\n")
        refused = ctl("restart", "--socket", cluster.socket("nodeb"))
        assert refused.exit_code == 1 and "restart refused" in refused.stderr, refused.stderr
        assert process.poll() is None and b.session.reattach.count == 0
        config.write_text(good)
        before = stream.committed
        result = ctl("restart", "--json", "--socket", cluster.socket("nodeb"))
        assert result.exit_code == 0, result.stderr + cluster.log("nodeb")
        # the successor took over; the daemon started here handed over to it and exited
        assert cluster.follow("nodeb") == result.json()["pid"] != process.pid and process.returncode == 0
        wait_until(lambda: _reattached(b, 1, cluster), lambda: _reattach_state(cluster, "nodeb", b), 120)
        stream.flowing_beyond(before + 50, "the stream to flow again")
    finally:
        stream.stop()
    a.channel.quiet(timeout=60)
    _exact(stream)
    close_ranks([a, b])


def test_what_a_session_passes_back_must_be_what_a_daemon_made_and_refusals_change_nothing(cluster_factory,
                                                                                           tmp_path) -> None:
    """The re-attach requests (Register.id, Flags.adopt, Channel.adopt) are entry points like any other: a
    region id already taken, a descriptor that is not a memfd, an unsealed memfd, a memfd that is no ring or
    flag file, or one of the wrong size are refused with the reason, and the session goes on."""
    cluster = cluster_factory(nodes=1)
    client = gpuclient.connect(cluster.socket("nodea"))
    try:
        session = client.join("adopt", rank=0, world=1)
        conn = session._conn
        buf = gpuclient.host_array(4096)
        region = session.register(buf)

        def refused(request_for_fd, fd: int, match: str) -> None:
            try:
                fd_id = conn.pass_fd(fd, "memfd")
            finally:
                os.close(fd)
            with pytest.raises(RequestError, match=match) as info:
                conn.request(request_for_fd(fd_id))
            assert info.value.code == "invalid"

        with pytest.raises(RequestError, match=f"region id {region.id} is taken"):
            fd_id = conn.pass_fd(resolve_host_buffer(buf).fd, "memfd")
            conn.request(Register(kind="host", handle=fd_id, size=4096, id=region.id))
        named = tmp_path / "ring"
        named.write_bytes(bytes(8192))
        refused(lambda i: Channel(adopt=i), os.open(named, os.O_RDWR), "not another kind of descriptor")
        unsealed = unsealed_memfd("tpd-test")
        os.ftruncate(unsealed, 8192)
        refused(lambda i: Channel(adopt=i), unsealed, "size sealed")
        refused(lambda i: Channel(adopt=i), sealed_memfd("tpd-test", 8192), "not a transportd ring")
        refused(lambda i: Flags(count=4, where="host", adopt=i), sealed_memfd("tpd-test", 8192), "not one")
        other, fd = FlagFile.create_memfd(8)
        other.close()
        refused(lambda i: Flags(count=4, where="host", adopt=i), fd, "holds 8 flags, not 4")
        flags = session.flags(4, where="host")  # the session goes on: its own flags and ring work
        ch = session.channel(capacity=64)
        ch.put(peer=0, dst_region=region.id, dst_off=0, src_region=region.id, src_off=0, nbytes=64)
        wait_until(lambda: ch.ring.completion_pos == 1, "the put to be taken")
        assert flags.status == 0 and ch.status()[0] == ErrorCode.BAD_PEER  # to itself: refused, as ever
    finally:
        client.close()


def _missing(s: Stream, first: int, end: int, code: int, a_first: int) -> str:
    """The receive slots of a stream that do not hold their data, each with the last message sent to it (its
    index and ring position), and what was reported in doubt."""
    bad = []
    for slot in range(min(s.committed, SLOTS)):
        if not np.array_equal(s.dst.recv[slot * CHUNK:(slot + 1) * CHUNK], s.src.send[slot * CHUNK:(slot + 1) * CHUNK]):
            last = slot + (s.committed - 1 - slot) // SLOTS * SLOTS
            bad.append((slot, last, s.positions[last]))
    return (f"stream to rank {s.peer}: {len(bad)} slots wrong of {min(s.committed, SLOTS)} (slot, last message, its "
            f"position) {bad[:8]}; nodeb's ring in doubt [{first}, {end}), nodea's code {code} from {a_first}")
