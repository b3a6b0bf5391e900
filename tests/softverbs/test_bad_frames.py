"""What a broken or hostile peer sends on the soft wire (`softverbs._wire`): refused, and only that peer pays.

A soft device is a daemon's NIC over softverbs, so DESIGN §8 holds for its peers as for the daemon's: a
malformed message is refused, nothing of anyone else's is lost, and the device keeps serving the others.
On the responder side a frame that breaks the framing, or one whose handling fails, costs its sender the
connection. On the requester side a response answers only a request in flight on its own connection, as a
NIC takes only its connection's PSNs; one that names another operation, an unknown status or the wrong
read length fails that request as a bad response, and an acknowledgement's range costs no more than the
requests in flight. The peers here are plain sockets speaking the frame layout.
"""

from __future__ import annotations

import logging
import random
import socket
from typing import Any

import pytest

from softverbs import _wire as w
from softverbs.addr import gid_for_endpoint
from tests.support.verbs_resources import QKEY, RCPair, no_completion, open_provider, poll
from tests.support.waiting import wait_until

ROW = 64


@pytest.fixture
def soft() -> Any:
    return open_provider("soft")


def _image(tag: int) -> bytes:
    return bytes((tag + i) & 0xFF for i in range(ROW))


def _writes(pair: RCPair, tags: range) -> None:
    """Signaled RC writes of a row each, row ``tag`` of the client's MR to the same row of the server's."""
    e = pair.v.enums
    for tag in tags:
        pair.client.write_buf(tag * ROW, _image(tag))
        pair.client.qp.post_send(pair.send_wr(e.IBV_WR_RDMA_WRITE, pair.client.sge(tag * ROW, ROW), wr_id=tag,
                                              raddr=pair.server.mr.buf + tag * ROW))


def _closed_by_peer(sock: socket.socket, timeout: float = 10.0) -> bool:
    """Whether the other end closes ``sock`` (anything it answers first is read and dropped)."""
    sock.settimeout(timeout)
    try:
        while sock.recv(65536):
            pass
    except TimeoutError:
        return False
    except ConnectionResetError:
        pass
    return True


def _hello(port: int) -> bytes:
    return w.HDR.pack(w.MAGIC, w.KIND_HELLO, 0, port, 0)


# --- the responder's side: frames that break the framing --------------------------------------------------

BROKEN_FRAMES = {
    "descriptors": (w.HDR.pack(w.MAGIC, w.KIND_REQ, 0, 1 << 24, 0), "16777216 descriptors (at most 4096)"),
    "magic": (w.HDR.pack(0x1234, w.KIND_REQ, 0, 1, 0), "magic 0x1234"),
    "response": (w.HDR.pack(w.MAGIC, w.KIND_RSP, 0, 1, 0) + w.RSP.pack(1, 0, w.OP_ACK, 0, 1, 1, 0, 0),
                 "kind 2 on a rsp connection"),
    "kind": (w.HDR.pack(w.MAGIC, 9, 0, 0, 0), "kind 9 on a rsp connection"),
}


@pytest.mark.parametrize("case", sorted(BROKEN_FRAMES))
def test_a_frame_that_breaks_the_framing_costs_its_sender_the_connection_only(soft, caplog, case: str) -> None:
    frame, reason = BROKEN_FRAMES[case]
    with soft.rc_pair(mr_size=1 << 16) as pair, caplog.at_level(logging.WARNING, logger="softverbs"):
        _writes(pair, range(8))
        with socket.create_connection(("127.0.0.1", pair.port_attr.lid)) as peer:
            peer.sendall(_hello(4242) + frame)
            assert _closed_by_peer(peer), "the device kept the connection of a frame that breaks the framing"
        _writes(pair, range(8, 16))
        wcs = poll(pair.client.cq, 16)
        assert [(wc.wr_id, wc.status) for wc in wcs] == [(tag, 0) for tag in range(16)]
        for tag in range(16):
            assert pair.server.read_buf(tag * ROW, ROW) == _image(tag)
    assert any(f"bad frame header: {reason}" in r.getMessage() for r in caplog.records), caplog.text


def test_a_frame_whose_handling_fails_costs_its_sender_the_connection_only(soft, caplog, monkeypatch) -> None:
    """A fault the handlers did not foresee (injected here: the only way to make one) drops that connection;
    the loop goes on serving the others, this pass included."""
    with soft.rc_pair(mr_size=1 << 16) as pair, caplog.at_level(logging.WARNING, logger="softverbs"):
        handler = pair.ctx._dev.request_handler
        begin = handler.begin_frame
        with socket.create_connection(("127.0.0.1", pair.port_attr.lid)) as peer:
            faulty = peer.getsockname()

            def begin_frame(conn: Any, kind: int) -> None:
                if conn.peer == faulty:
                    raise RuntimeError("injected fault")
                begin(conn, kind)

            monkeypatch.setattr(handler, "begin_frame", begin_frame)
            _writes(pair, range(4))
            peer.sendall(_hello(4242) + w.HDR.pack(w.MAGIC, w.KIND_REQ, 0, 1, 0) + w.REQ.pack(
                pair.server.qp.qp_num, 7, 1, w.OP_WRITE, 0, 5, 0, 0, 0, 0, 0, 0, 0, 0))
            assert _closed_by_peer(peer), "the device kept a connection whose frame failed"
        _writes(pair, range(4, 8))
        wcs = poll(pair.client.cq, 8)
        assert [(wc.wr_id, wc.status) for wc in wcs] == [(tag, 0) for tag in range(8)]
    assert any("failed" in r.getMessage() and r.exc_info for r in caplog.records), caplog.text


# --- the requester's side: responses ----------------------------------------------------------------------

class FakePeer:
    """A socket a soft device connects to as to another device's: the requests it receives, it answers as a
    test says."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(10)
        self.port = self.listener.getsockname()[1]
        self.sock: socket.socket | None = None

    def _read(self, n: int) -> bytes:
        assert self.sock is not None
        got = b""
        while len(got) < n:
            chunk = self.sock.recv(n - len(got))
            assert chunk, "the device closed the connection"
            got += chunk
        return got

    def requests(self) -> list[tuple]:
        """The next request frame's descriptors (the control frames before it are read and dropped)."""
        if self.sock is None:
            self.sock, _ = self.listener.accept()
            self.sock.settimeout(10)
        while True:
            _magic, kind, _flags, count, payload_len = w.HDR.unpack(self._read(16))
            if kind == w.KIND_REQ:
                descs = [w.REQ.unpack(self._read(w.REQ.size)) for _ in range(count)]
                self._read(payload_len)
                return descs
            self._read(payload_len)

    def answer(self, responses: list[bytes], payload: bytes = b"") -> None:
        assert self.sock is not None
        self.sock.sendall(w.HDR.pack(w.MAGIC, w.KIND_RSP, 0, len(responses), len(payload)) + b"".join(responses)
                          + payload)

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
        self.listener.close()


@pytest.fixture
def fake_peer() -> Any:
    peer = FakePeer()
    yield peer
    peer.close()


def _ack(qpn: int, seq: int, count: int) -> bytes:
    return w.RSP.pack(qpn, 0, w.OP_ACK, 0, seq, count, 0, 0)


def _rc_to(soft: Any, peer: FakePeer) -> RCPair:
    """An RC pair whose client QP's peer is ``peer`` (its server QP is not used)."""
    pair = soft.rc_pair(connect=False, mr_size=1 << 16)
    v = pair.v
    pair.connect(pair.client, pair.server, ah_attr=v.addr.AHAttr(port_num=1, is_global=0, dlid=peer.port))
    return pair


def test_an_acknowledgement_s_range_costs_only_the_requests_in_flight(soft, fake_peer) -> None:
    """An ACK of 2**31 requests from the first one's sequence number completes the one in flight at once (a walk
    over the whole range would hold the device's I/O thread for minutes), and the QP goes on."""
    with _rc_to(soft, fake_peer) as pair:
        e = pair.v.enums
        pair.client.qp.post_send(pair.send_wr(e.IBV_WR_RDMA_WRITE, pair.client.sge(0, ROW), wr_id=1))
        ((qpn, src, seq, *_),) = fake_peer.requests()
        assert qpn == pair.server.qp.qp_num
        fake_peer.answer([_ack(src, seq, 1 << 31)])
        (wc,) = poll(pair.client.cq, 1, timeout=5.0)
        assert (wc.wr_id, wc.status) == (1, 0)
        pair.client.qp.post_send(pair.send_wr(e.IBV_WR_RDMA_WRITE, pair.client.sge(0, ROW), wr_id=2))
        ((_, src, seq, *_),) = fake_peer.requests()
        fake_peer.answer([_ack(src, seq, 1)])
        (wc,) = poll(pair.client.cq)
        assert (wc.wr_id, wc.status) == (2, 0)


BAD_READ_ANSWERS = {
    # (status, op, length, payload) of the answer to a 64-byte read
    "a longer read": (0, w.OP_READ, 100, bytes(range(100))),
    "a shorter read": (0, w.OP_READ, 8, bytes(8)),
    "another operation": (0, w.OP_FADD, 8, b""),
    "an unknown status": (200, w.OP_READ, 0, b""),
}


@pytest.mark.parametrize("case", sorted(BAD_READ_ANSWERS))
def test_a_response_that_does_not_answer_its_request_fails_it_as_a_bad_response(soft, fake_peer, case: str) -> None:
    status, op, length, payload = BAD_READ_ANSWERS[case]
    with _rc_to(soft, fake_peer) as pair:
        e = pair.v.enums
        before = b"\xa5" * ROW
        pair.client.write_buf(0, before)
        pair.client.qp.post_send(pair.send_wr(e.IBV_WR_RDMA_READ, pair.client.sge(0, ROW), wr_id=1))
        ((_, src, seq, rop, *_),) = fake_peer.requests()
        assert rop == w.OP_READ
        fake_peer.answer([w.RSP.pack(src, status, op, 0, seq, length, 0, 0x1122334455667788)], payload)
        (wc,) = poll(pair.client.cq)
        assert (wc.wr_id, wc.status) == (1, e.IBV_WC_BAD_RESP_ERR)
        assert pair.client.read_buf(0, ROW) == before, "a bad response's bytes reached the read's memory"
        assert pair.client.qp.qp_state == e.IBV_QPS_ERR


def test_a_read_answered_as_asked_completes(soft, fake_peer) -> None:
    """The same exchange as above, answered right: the checks refuse only what is wrong."""
    with _rc_to(soft, fake_peer) as pair:
        e = pair.v.enums
        pair.client.qp.post_send(pair.send_wr(e.IBV_WR_RDMA_READ, pair.client.sge(0, ROW), wr_id=1))
        ((_, src, seq, *_),) = fake_peer.requests()
        fake_peer.answer([w.RSP.pack(src, 0, w.OP_READ, 0, seq, ROW, 0, 0)], _image(3))
        (wc,) = poll(pair.client.cq)
        assert (wc.wr_id, wc.status, wc.byte_len) == (1, 0, ROW)
        assert pair.client.read_buf(0, ROW) == _image(3)


def test_an_srd_response_answers_only_requests_sent_on_its_connection(soft) -> None:
    """One SRD QP writes to two peers; the second acknowledges the first's request too. That ghost is dropped:
    the first's request completes only when the first peer acknowledges it."""
    peers = [FakePeer(), FakePeer()]
    try:
        with soft.srd_pair() as pair:
            v = pair.v
            qp = pair.client.qp
            for wr_id, peer in enumerate(peers, start=1):
                gr = v.addr.GlobalRoute(dgid=v.addr.GID(gid_for_endpoint("127.0.0.1", peer.port)), sgid_index=0)
                ah = v.addr.AH(pair.pd, attr=v.addr.AHAttr(port_num=1, is_global=1, gr=gr))
                qp.wr_start()
                qp.wr_id = wr_id
                qp.wr_flags = int(v.enums.IBV_SEND_SIGNALED)
                qp.wr_rdma_write(0x1234, 0x10000)
                qp.wr_set_ud_addr(ah, 77, QKEY)
                qp.wr_set_sge(pair.client.sge(0, ROW))
                qp.wr_complete()
            (first,) = peers[0].requests()
            (second,) = peers[1].requests()
            src = first[1]
            peers[1].answer([_ack(src, first[2], 1)])  # not its request
            peers[1].answer([_ack(src, second[2], 1)])
            (wc,) = poll(pair.client.cq)
            assert (wc.wr_id, wc.status) == (2, 0)
            assert no_completion(pair.client.cq), "a peer's acknowledgement completed another peer's request"
            peers[0].answer([_ack(src, first[2], 1)])
            (wc,) = poll(pair.client.cq)
            assert (wc.wr_id, wc.status) == (1, 0)
    finally:
        for peer in peers:
            peer.close()


# --- random frames: whatever a peer sends, only it pays ------------------------------------------------------

def _random_request(rnd: random.Random, qpns: list[int], rkey: int, raddr: int) -> tuple[bytes, bytes]:
    """One request descriptor of fields drawn around a real QP's and MR's values, and the payload it says."""
    op = rnd.choice([0, w.OP_WRITE, w.OP_WRITE_IMM, w.OP_SEND, w.OP_SEND_IMM, w.OP_READ, w.OP_FADD, w.OP_CSWAP, 99])
    flags = rnd.choice([0, w.F_AR, w.F_SRD, w.F_DIRECT, w.F_DIRECT | w.F_AR, 0xFF])
    length = rnd.choice([0, 1, 8, 64, 4096, 5000, 1 << 20])
    desc = w.REQ.pack(rnd.choice(qpns + [0, 999_999]), rnd.choice([qpns[0], 0, 7]), rnd.randint(0, 5), op, flags,
                      rnd.choice([0, 1, 3, 5, 6, 255]), rnd.getrandbits(32), rnd.choice([rkey, rkey, 0]),
                      rnd.getrandbits(32), rnd.choice([raddr, raddr + 8, raddr + (1 << 16) - 8, 0, (1 << 64) - 1]),
                      length, rnd.choice([0, 1, rnd.getrandbits(24)]), rnd.getrandbits(64),
                      rnd.choice([0, 8, rnd.getrandbits(64)]))
    carries = op in w.DATA_OPS and not flags & w.F_DIRECT
    return desc, bytes(min(length, 1 << 16)) if carries else b""


@pytest.mark.parametrize("kind", ["rc", "srd"])
def test_random_request_frames_cost_only_their_senders(soft, caplog, kind: str) -> None:
    """Frames of random requests (some cut short) from peers that come and go: the device's handlers foresee
    each of them (nothing fails in the I/O loop) and a good pair on the device keeps working."""
    rnd = random.Random(2026)
    make = soft.rc_pair if kind == "rc" else soft.srd_pair
    with make(mr_size=1 << 16) as pair, caplog.at_level(logging.WARNING, logger="softverbs"):
        port = pair.ctx.query_port(1).lid
        qpns = [pair.server.qp.qp_num, pair.client.qp.qp_num]

        def good_write(tag: int) -> None:
            pair.client.write_buf(0, _image(tag))
            if kind == "rc":
                pair.client.qp.post_send(pair.send_wr(pair.v.enums.IBV_WR_RDMA_WRITE, pair.client.sge(0, ROW)))
            else:
                pair.post(pair.client, "write", pair.client.sge(0, ROW))
            (wc,) = poll(pair.client.cq)
            assert wc.status == 0
            assert pair.server.read_buf(0, ROW) == _image(tag)

        for i in range(120):
            pieces = [_random_request(rnd, qpns, pair.server.mr.rkey, pair.server.mr.buf)
                      for _ in range(rnd.randint(1, 6))]
            payload = b"".join(p for _, p in pieces)
            frame = w.HDR.pack(w.MAGIC, w.KIND_REQ, 0, len(pieces), len(payload)) + b"".join(d for d, _ in pieces) \
                + payload
            if rnd.random() < 0.2:
                frame = frame[:rnd.randint(0, len(frame))]
            with socket.create_connection(("127.0.0.1", port)) as peer:
                peer.sendall(_hello(rnd.choice([port, 4242])) + frame)
            if i % 30 == 29:
                good_write(i)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text


def test_random_responses_cost_only_the_requests_they_answer(soft, fake_peer, caplog) -> None:
    """A peer answering a QP's writes, reads and atomics with random responses: the device's handlers foresee
    each of them, and a good pair on the same device keeps working."""
    rnd = random.Random(2026)
    with soft.rc_pair(mr_size=1 << 16) as good, caplog.at_level(logging.WARNING, logger="softverbs"):
        e = good.v.enums
        conns = good.ctx._dev.out_conns  # the device's (every context of softib0 shares it)
        for i in range(30):
            with _rc_to(soft, fake_peer) as pair:
                op = rnd.choice([e.IBV_WR_RDMA_WRITE, e.IBV_WR_RDMA_READ, e.IBV_WR_ATOMIC_FETCH_AND_ADD])
                n = 8 if op == e.IBV_WR_ATOMIC_FETCH_AND_ADD else ROW
                for wr_id in range(rnd.randint(1, 3)):
                    pair.client.qp.post_send(pair.send_wr(op, pair.client.sge(0, n), wr_id=wr_id))
                descs = fake_peer.requests()
                src, seq = descs[0][1], descs[0][2]
                answers, payload = [], b""
                for _ in range(rnd.randint(1, 4)):
                    length = rnd.choice([0, 1, 2, 8, ROW, 1 << 31])
                    rop = rnd.choice([w.OP_ACK, w.OP_ACK, w.OP_WRITE, w.OP_READ, w.OP_FADD, w.OP_CSWAP, 99])
                    status = rnd.choice([0, 0, 1, 5, 9, 10, 12, 200])
                    answers.append(w.RSP.pack(rnd.choice([src, src, 0, 77]), status, rop, 0,
                                              rnd.choice([seq, seq, seq + 1, 0, (1 << 64) - 1]), length, 0,
                                              rnd.getrandbits(64)))
                    if rop == w.OP_READ and status == 0 and length <= ROW:
                        payload += bytes(length)
                fake_peer.answer(answers, payload)
                fake_peer.sock.close()  # the next pair's device connects anew, once it saw this one go
                fake_peer.sock = None
                wait_until(lambda: getattr(conns.get(("127.0.0.1", fake_peer.port)), "closed", True),
                           "the device to drop the fake peer's connection")
            good.client.write_buf(0, _image(i))
            good.client.qp.post_send(good.send_wr(e.IBV_WR_RDMA_WRITE, good.client.sge(0, ROW)))
            (wc,) = poll(good.client.cq)
            assert wc.status == 0
            assert good.server.read_buf(0, ROW) == _image(i)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text


@pytest.mark.parametrize("now", [12.345678, float(1 << 32) / 1e6 - 0.001, 3 * float(1 << 32) / 1e6 + 5.0])
def test_a_landing_field_reads_back_at_most_its_bound_ahead(now: float) -> None:
    """An SRD direct write's landing (µs modulo 2**32 in its psn field) reads back across the wrap, and a field
    further ahead than ``LAND_AHEAD_MAX_S`` (a broken peer's) holds its completion no longer than that."""
    for ahead in (0.0, 0.000250, 0.5, -0.010):  # a shaped link's landings, and one already past
        assert w.land_from_field(w.land_field(now + ahead), now) == pytest.approx(now + ahead, abs=2e-6)
    for ahead in (w.LAND_AHEAD_MAX_S + 1.0, 30 * 60.0):
        assert w.land_from_field(w.land_field(now + ahead), now) == now + w.LAND_AHEAD_MAX_S
