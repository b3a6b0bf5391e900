"""RC semantics every provider must share: write, write-with-imm, fetch-and-add, read, send, fence."""

from __future__ import annotations

import socket

from tests.support.verbs_resources import RCPair, poll


def test_rdma_write_places_data_and_completes(rc: RCPair) -> None:
    e = rc.v.enums
    payload = bytes(range(256)) * 16
    rc.client.write_buf(0, payload)
    rc.client.qp.post_send(rc.send_wr(e.IBV_WR_RDMA_WRITE, rc.client.sge(0, len(payload)), wr_id=7,
                                      raddr=rc.server.mr.buf + 4096))
    (wc,) = poll(rc.client.cq)
    assert (wc.wr_id, wc.status, wc.opcode) == (7, e.IBV_WC_SUCCESS, e.IBV_WC_RDMA_WRITE)
    assert rc.server.read_buf(4096, len(payload)) == payload
    assert rc.server.read_buf(0, 16) == bytes(16)  # nothing outside the target range


def test_write_with_imm_consumes_a_receive_and_reports_the_immediate(rc: RCPair) -> None:
    e = rc.v.enums
    rc.server.qp.post_recv(rc.v.wr.RecvWR(wr_id=99, num_sge=0))
    rc.client.write_buf(0, b"abcdefgh")
    rc.client.qp.post_send(rc.send_wr(e.IBV_WR_RDMA_WRITE_WITH_IMM, rc.client.sge(0, 8), wr_id=3, imm=0x12345678))
    (sent,) = poll(rc.client.cq)
    (recv,) = poll(rc.server.cq)
    assert (sent.status, sent.opcode) == (e.IBV_WC_SUCCESS, e.IBV_WC_RDMA_WRITE)
    assert (recv.wr_id, recv.status, recv.opcode) == (99, e.IBV_WC_SUCCESS, e.IBV_WC_RECV_RDMA_WITH_IMM)
    assert recv.imm_data == 0x12345678  # ibv_send_wr.imm_data travels as given
    assert recv.wc_flags & e.IBV_WC_WITH_IMM
    assert (recv.byte_len, recv.src_qp, recv.qp_num) == (8, rc.client.qp.qp_num, rc.server.qp.qp_num)
    assert rc.server.read_buf(0, 8) == b"abcdefgh"


def test_extended_api_write_imm_converts_the_immediate_to_big_endian(rc: RCPair) -> None:
    """pyverbs' wr_rdma_write_imm() applies htobe32(); the receiver reads it back with ntohl()."""
    e = rc.v.enums
    rc.server.qp.post_recv(rc.v.wr.RecvWR(wr_id=1, num_sge=0))
    qp = rc.client.qp
    qp.wr_start()
    qp.wr_id = 5
    qp.wr_flags = e.IBV_SEND_SIGNALED
    qp.wr_rdma_write_imm(rc.server.mr.rkey, rc.server.mr.buf, 0xA1B2C3D4)
    qp.wr_set_sge(rc.client.sge(0, 64))
    qp.wr_complete()
    (sent,) = poll(rc.client.cq)
    (recv,) = poll(rc.server.cq)
    assert sent.status == e.IBV_WC_SUCCESS
    assert socket.ntohl(recv.imm_data) == 0xA1B2C3D4


def test_fetch_and_add_returns_the_old_value(rc: RCPair) -> None:
    e = rc.v.enums
    rc.server.write_buf(64, (41).to_bytes(8, "little"))
    for i in range(3):
        rc.client.qp.post_send(rc.send_wr(e.IBV_WR_ATOMIC_FETCH_AND_ADD, rc.client.sge(8 * i, 8), wr_id=i,
                                          raddr=rc.server.mr.buf + 64, add=10))
    wcs = poll(rc.client.cq, 3)
    assert [(w.wr_id, w.status, w.opcode) for w in wcs] == [(i, e.IBV_WC_SUCCESS, e.IBV_WC_FETCH_ADD)
                                                            for i in range(3)]
    olds = [int.from_bytes(rc.client.read_buf(8 * i, 8), "little") for i in range(3)]
    assert olds == [41, 51, 61]
    assert int.from_bytes(rc.server.read_buf(64, 8), "little") == 71


def test_compare_and_swap(rc: RCPair) -> None:
    e = rc.v.enums
    rc.server.write_buf(0, (5).to_bytes(8, "little"))
    rc.client.qp.post_send(rc.send_wr(e.IBV_WR_ATOMIC_CMP_AND_SWP, rc.client.sge(0, 8), add=5, swap=9))
    rc.client.qp.post_send(rc.send_wr(e.IBV_WR_ATOMIC_CMP_AND_SWP, rc.client.sge(8, 8), add=5, swap=7))
    assert all(w.status == e.IBV_WC_SUCCESS for w in poll(rc.client.cq, 2))
    assert int.from_bytes(rc.client.read_buf(0, 8), "little") == 5
    assert int.from_bytes(rc.client.read_buf(8, 8), "little") == 9  # second compare failed: old value 9
    assert int.from_bytes(rc.server.read_buf(0, 8), "little") == 9


def test_rdma_read_returns_remote_data(rc: RCPair) -> None:
    e = rc.v.enums
    data = bytes(reversed(range(256))) * 40
    rc.server.write_buf(1000, data)
    rc.client.qp.post_send(rc.send_wr(e.IBV_WR_RDMA_READ, rc.client.sge(50_000, len(data)), wr_id=11,
                                      raddr=rc.server.mr.buf + 1000))
    (wc,) = poll(rc.client.cq)
    assert (wc.wr_id, wc.status, wc.opcode, wc.byte_len) == (11, e.IBV_WC_SUCCESS, e.IBV_WC_RDMA_READ, len(data))
    assert rc.client.read_buf(50_000, len(data)) == data


def test_read_after_write_on_one_qp_sees_the_write(rc: RCPair) -> None:
    """A read executes at the responder after every earlier write on the QP is placed."""
    e = rc.v.enums
    data = b"\x5a" * 8192
    rc.client.write_buf(0, data)
    unsignaled = 0
    rc.client.qp.post_send(rc.send_wr(e.IBV_WR_RDMA_WRITE, rc.client.sge(0, len(data)), flags=unsignaled,
                                      raddr=rc.server.mr.buf + 65536))
    rc.client.qp.post_send(rc.send_wr(e.IBV_WR_RDMA_READ, rc.client.sge(200_000, len(data)), wr_id=2,
                                      raddr=rc.server.mr.buf + 65536))
    (wc,) = poll(rc.client.cq)
    assert (wc.wr_id, wc.status) == (2, e.IBV_WC_SUCCESS)
    assert rc.client.read_buf(200_000, len(data)) == data


def test_send_scatters_into_the_receive_buffers(rc: RCPair) -> None:
    e = rc.v.enums
    sg = [rc.server.sge(0, 4), rc.server.sge(100, 12)]
    rc.server.qp.post_recv(rc.v.wr.RecvWR(wr_id=4, num_sge=2, sg=sg))
    rc.client.write_buf(0, b"0123456789abcdef")
    rc.client.qp.post_send(rc.send_wr(e.IBV_WR_SEND_WITH_IMM, rc.client.sge(0, 16), imm=77))
    (recv,) = poll(rc.server.cq)
    (sent,) = poll(rc.client.cq)
    assert (recv.status, recv.opcode, recv.byte_len, recv.imm_data) == (e.IBV_WC_SUCCESS, e.IBV_WC_RECV, 16, 77)
    assert (sent.status, sent.opcode) == (e.IBV_WC_SUCCESS, e.IBV_WC_SEND)
    assert rc.server.read_buf(0, 4) + rc.server.read_buf(100, 12) == b"0123456789abcdef"


def test_completions_come_in_post_order_and_cover_unsignaled_wrs(rc: RCPair) -> None:
    e = rc.v.enums
    for i in range(20):
        flags = int(e.IBV_SEND_SIGNALED) if i % 5 == 4 else 0
        rc.client.qp.post_send(rc.send_wr(e.IBV_WR_RDMA_WRITE, rc.client.sge(64 * i, 64), wr_id=i, flags=flags,
                                          raddr=rc.server.mr.buf + 64 * i))
    assert [w.wr_id for w in poll(rc.client.cq, 4)] == [4, 9, 14, 19]


def test_fence_waits_for_a_prior_read(provider) -> None:
    """IBV_SEND_FENCE: the fenced WR starts only after earlier reads/atomics completed.

    Read remote A into local L and write L to remote B with FENCE, posted as one chain: B must hold A's
    data. Without the fence the write may carry L before the read has filled it (softverbs always does
    when both go out in one post; hardware may).
    """
    with provider.rc_pair() as rc:
        e = rc.v.enums
        data = b"\xc3" * 4096
        rc.server.write_buf(0, data)

        def read_then_write(write_flags: int) -> None:
            read = rc.send_wr(e.IBV_WR_RDMA_READ, rc.client.sge(0, 4096), wr_id=1, flags=0, raddr=rc.server.mr.buf)
            read.next_wr = rc.send_wr(e.IBV_WR_RDMA_WRITE, rc.client.sge(0, 4096), wr_id=2, flags=write_flags,
                                      raddr=rc.server.mr.buf + 8192)
            rc.client.qp.post_send(read)
            (wc,) = poll(rc.client.cq)
            assert (wc.wr_id, wc.status) == (2, e.IBV_WC_SUCCESS)

        read_then_write(int(e.IBV_SEND_FENCE | e.IBV_SEND_SIGNALED))
        assert rc.server.read_buf(8192, 4096) == data
        if provider.soft:
            rc.client.write_buf(0, bytes(4096))
            rc.server.write_buf(8192, bytes(4096))
            read_then_write(int(e.IBV_SEND_SIGNALED))
            assert rc.server.read_buf(8192, 4096) == bytes(4096)
