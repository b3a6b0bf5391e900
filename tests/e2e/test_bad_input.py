"""docs/design.md, "Bad input hurts only its sender", against real daemons: a clear error, nothing lost,
everyone else keeps being served."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import zmq

import gpuclient
from cmd_ring import RECORD_DTYPE, Opcode
from tests.support.cluster import VICTIM_CLIENT, close_ranks, join_ranks
from tests.support.waiting import wait_until
from transportd.control import codec
from transportd.control.client import ControlConnection
from transportd.control.protocol import Stats
from transportd.errors import ErrorCode, RequestError

pytestmark = pytest.mark.multiprocess  # several processes: the unit tests run apart with -m 'not multiprocess'


def record(opcode: int, **fields: int) -> np.ndarray:
    rec = np.zeros(1, dtype=RECORD_DTYPE)
    rec["opcode"] = opcode
    for name, value in fields.items():
        rec[name] = value
    return rec


def errors_by_code(client: gpuclient.Client) -> dict[str, int]:
    totals: dict[str, int] = {}
    for rail in client.stats()["rails"]:
        for code, n in rail.get("errors", {}).items():
            totals[code] = totals.get(code, 0) + n
    return totals


def test_each_bad_record_is_rejected_with_its_code_and_the_good_ones_around_it_arrive(cluster_factory) -> None:
    cluster = cluster_factory(backend="ib", overrides={"signal": {"mode": "atomic"}})
    a, b = join_ranks(cluster, nbytes=1 << 16, flags=8)
    try:
        good = dict(opcode=Opcode.PUT_SIGNAL, peer=1, dst_region=b.dst.id, src_region=a.src.id, length=512,
                    signal_slot=0, signal_value=1)
        bad = {
            "BAD_OPCODE": dict(opcode=9, peer=1, length=8),
            "BAD_PEER": dict(good, peer=7),
            "BAD_REGION": dict(good, dst_region=99),
            "OUT_OF_BOUNDS": dict(good, dst_off=(1 << 16) - 100),
            "BAD_LENGTH": dict(good, length=0),
            "BAD_SLOT": dict(good, signal_slot=8),
        }
        stream = []
        for i, fields in enumerate(bad.values()):
            g = dict(good, dst_off=i * 512, src_off=i * 512)
            stream += [record(g.pop("opcode"), **g), record(fields.pop("opcode"), **fields)]
        g = dict(good, dst_off=len(bad) * 512, src_off=len(bad) * 512)
        stream.append(record(g.pop("opcode"), **g))
        first = a.channel.push_records(np.concatenate(stream))
        # every good record arrives: 7 signals, 7 chunks in place
        assert b.session.wait(slot=0, at_least=len(bad) + 1, timeout=30) == len(bad) + 1
        n = (len(bad) + 1) * 512
        assert np.array_equal(b.recv[:n], a.send[:n])
        # the error word names the first bad record; the daemon counted every code
        code, count, position = a.channel.status()
        assert (ErrorCode(code), count, position) == (ErrorCode.BAD_OPCODE, len(bad), first + 1)
        counted = errors_by_code(a.client)
        for name in bad:
            assert counted.get(name) == 1, f"{name}: {counted}"
        with pytest.raises(gpuclient.ChannelError, match="BAD_OPCODE"):
            a.channel.raise_for_status()
        # still serving: a fresh put from the other rank arrives
        b.channel.put_signal(peer=0, dst_region=a.dst.id, dst_off=0, src_region=b.src.id, src_off=0, nbytes=64,
                             slot=3, value=1)
        assert a.session.wait(slot=3, at_least=1, timeout=30) == 1
    finally:
        close_ranks([a, b])


def test_a_job_cannot_touch_another_jobs_regions(cluster_factory) -> None:
    cluster = cluster_factory(backend="ib")
    a, b = join_ranks(cluster, job="alpha", nbytes=4096, flags=4)  # alpha: regions 0, 1 per rank
    # job beta on the same two nodes registers more regions, so region ids 2.. exist only in beta
    beta = join_ranks(cluster, job="beta", nbytes=4096, flags=4, seed=1)
    extra = gpuclient.host_array(4096)
    victim = beta[1].session.register(extra)
    assert victim.id == 2
    try:
        a.channel.put_signal(peer=1, dst_region=victim.id, dst_off=0, src_region=a.src.id, src_off=0, nbytes=4096,
                             slot=0, value=1)
        a.channel.signal(peer=1, slot=1, value=1)
        assert b.session.wait(slot=1, at_least=1, timeout=30) == 1
        assert ErrorCode(a.channel.status()[0]) == ErrorCode.BAD_REGION
        assert not extra.any(), "job alpha wrote into job beta's memory"
        assert b.session.flag_array[0] == 0
        assert beta[1].session.flag_array[0] == 0
    finally:
        close_ranks([a, b] + beta)


def test_malformed_and_oversized_control_messages_get_error_replies(cluster_factory) -> None:
    cluster = cluster_factory(backend="ib", nodes=2)
    endpoint = cluster.socket("nodea")
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.REQ)
    sock.linger = 0
    sock.rcvtimeo = 5000
    sock.setsockopt(zmq.REQ_RELAXED, 1)
    sock.connect(endpoint)
    try:
        for payload, code in [
            (b"\xc1\xc1 not msgpack", "bad_message"),
            (codec.encode({"v": 99, "op": "hello"}), "bad_version"),
            (codec.encode({"v": 1, "op": "teleport"}), "unknown_op"),
            (codec.encode({"v": 1, "op": "join", "job": "j", "rank": 5, "world": 2, "device": -1}), None),
            (codec.encode({"v": 1, "op": "hello", "pad": b"x" * (2 << 20)}), "too_large"),
        ]:
            sock.send(payload)
            reply = codec.decode(sock.recv(), max_size=1 << 20)
            assert reply["ok"] is False, reply
            if code:
                assert reply["code"] == code, reply
    finally:
        sock.close()
    with ControlConnection(endpoint) as conn:  # and the daemon still serves
        assert conn.request(Stats())["node"] == "nodea"
    with ControlConnection(endpoint) as conn, pytest.raises(RequestError, match="rank"):
        conn.request({"v": 1, "op": "join", "job": "j", "rank": 3, "world": 2, "device": -1})


def _channels(stats: dict) -> int:
    """Rings the node's rail workers drain."""
    return sum(rail.get("channels", 0) for rail in stats["rails"])


def test_a_killed_client_is_reclaimed_and_others_keep_running(cluster_factory) -> None:
    cluster = cluster_factory(backend="ib")
    a, b = join_ranks(cluster, nbytes=4096, flags=4)
    try:
        proc = subprocess.Popen([sys.executable, "-c", VICTIM_CLIENT, cluster.socket("nodea")], stdout=subprocess.PIPE,
                                text=True)
        assert proc.stdout.readline().strip() == "joined"
        stats = a.client.stats()
        assert stats["clients"] == 2 and _channels(stats) == 2  # rank 0's and the victim's, in the rail worker
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        wait_until(lambda: (lambda s: s["clients"] == 1 and _channels(s) == 1)(a.client.stats()),
                   "the killed client's session and ring to be reclaimed", 10)
        assert "victim" not in a.client.stats()["jobs"]
        a.channel.put_signal(peer=1, dst_region=b.dst.id, dst_off=0, src_region=a.src.id, src_off=0, nbytes=4096,
                             slot=0, value=1)
        assert b.session.wait(slot=0, at_least=1, timeout=30) == 1
        assert np.array_equal(b.recv, a.send)
    finally:
        close_ranks([a, b])


def test_a_killed_peer_daemon_makes_waiting_clients_fail_not_hang(cluster_factory) -> None:
    cluster = cluster_factory(backend="ib")
    a, b = join_ranks(cluster, nbytes=4096, flags=4)
    try:
        cluster.kill("nodeb")
        t0 = time.monotonic()
        with pytest.raises(gpuclient.ChannelError, match="PEER_LOST"):
            a.session.wait(slot=0, at_least=1, timeout=30)
        assert time.monotonic() - t0 < 15
        # commands to the lost peer are refused with PEER_LOST on the channel, not queued forever
        a.channel.put(peer=1, dst_region=b.dst.id, dst_off=0, src_region=a.src.id, src_off=0, nbytes=64)
        with pytest.raises((gpuclient.ChannelError, TimeoutError)):
            a.channel.quiet(timeout=10)
    finally:
        a.session.leave()
        a.client.close()


def test_a_peer_without_the_right_curve_key_is_refused(cluster_factory, tmp_path) -> None:
    from transportd.control.curve import generate_keypair, load_secret_keypair
    from transportd.control.protocol import PeerHello

    cluster = cluster_factory(backend="ib", curve=True)
    a, b = join_ranks(cluster, nbytes=4096, flags=4)  # the two real nodes authenticate each other
    try:
        public, secret = generate_keypair(tmp_path, "intruder")
        pub, sec = load_secret_keypair(secret)
        server_key = (cluster.workdir / "keys" / "nodea.key").read_bytes()
        import zmq.auth

        server_public, _ = zmq.auth.load_certificate(cluster.workdir / "keys" / "nodea.key")
        del server_key
        ctx = zmq.Context.instance()
        dealer = ctx.socket(zmq.DEALER)
        dealer.linger = 0
        dealer.routing_id = b"intruder"
        dealer.curve_secretkey, dealer.curve_publickey, dealer.curve_serverkey = sec, pub, server_public
        # A send waits for a connection; once the daemon has refused the handshake there is none, and a
        # DEALER with no peer blocks its send: that refusal may come before or after the hello is queued.
        dealer.sndtimeo = 2000
        dealer.connect(f"tcp://127.0.0.1:{cluster.nodes['nodea'].peer_port}")
        try:
            dealer.send(codec.encode(PeerHello(node="intruder", backend="ib", rails=1).to_msg()))
        except zmq.Again:
            pass  # refused before the hello could be queued
        assert dealer.poll(2000) == 0, "an unauthorized peer got an answer"
        dealer.close()
        assert "intruder" not in a.client.stats()["peers"]
        a.channel.put_signal(peer=1, dst_region=b.dst.id, dst_off=0, src_region=a.src.id, src_off=0, nbytes=4096,
                             slot=0, value=1)
        assert b.session.wait(slot=0, at_least=1, timeout=30) == 1
    finally:
        close_ranks([a, b])
