"""EFA SRD semantics: write-with-imm delivery in any order, unsolicited receive, and the EFA post rules."""

from __future__ import annotations

import errno
import socket

import numpy as np
import pytest

from tests.support.verbs_resources import SRDPair, no_completion, poll, raises_errno


def test_srd_write_lands(srd: SRDPair) -> None:
    e = srd.v.enums
    srd.client.write_buf(0, b"srd-write" * 100)
    srd.post(srd.client, "write", srd.client.sge(0, 900), wr_id=21, raddr=srd.server.mr.buf + 512)
    (wc,) = poll(srd.client.cq)
    assert (wc.wr_id, wc.status, wc.opcode) == (21, e.IBV_WC_SUCCESS, e.IBV_WC_RDMA_WRITE)
    assert srd.server.read_buf(512, 900) == b"srd-write" * 100


def test_unsolicited_write_with_imm_needs_no_receive_wr(srd: SRDPair) -> None:
    if not srd.unsolicited:
        pytest.skip("device without unsolicited write receive")
    e = srd.v.enums
    srd.post(srd.client, "write_imm", srd.client.sge(0, 100), imm=0xBEEF)
    (sent,) = poll(srd.client.cq)
    (recv,) = poll(srd.server.cq)
    assert (sent.status, sent.opcode) == (e.IBV_WC_SUCCESS, e.IBV_WC_RDMA_WRITE)
    assert (recv.status, recv.opcode, recv.byte_len) == (e.IBV_WC_SUCCESS, e.IBV_WC_RECV_RDMA_WITH_IMM, 100)
    assert recv.unsolicited and recv.wr_id == 0
    assert socket.ntohl(recv.imm_data) == 0xBEEF
    assert recv.src_qp == srd.client.qp.qp_num


def test_solicited_write_with_imm_consumes_a_posted_receive(provider) -> None:
    with provider.srd_pair(unsolicited=False) as pair:
        e = pair.v.enums
        pair.server.qp.post_recv(pair.v.wr.RecvWR(wr_id=555, num_sge=0))
        pair.post(pair.client, "write_imm", pair.client.sge(0, 64), imm=1)
        (recv,) = poll(pair.server.cq)
        assert (recv.wr_id, recv.status, recv.opcode) == (555, e.IBV_WC_SUCCESS, e.IBV_WC_RECV_RDMA_WITH_IMM)
        assert not recv.unsolicited


def test_write_with_imm_completes_only_after_all_its_bytes_in_any_order(provider) -> None:
    """Many multi-packet write-with-imm: at each receive completion, that message's bytes are all there.

    SRD places packets in any order, also inside one message; the completion is the only ordering
    promise. On softverbs the packets are small here, so every message is split and shuffled, and the
    completions must show at least one out-of-order delivery.
    """
    if provider.soft:
        provider.v.soft.configure("softefa0", srd_packet_size=512, reorder_seed=7)
    try:
        with provider.srd_pair(max_send_wr=128) as pair:
            e = pair.v.enums
            n, size = 48, 6000
            rng = np.random.default_rng(3)
            image = rng.integers(0, 256, n * size, dtype=np.uint8).tobytes()
            pair.client.write_buf(0, image)
            if not pair.unsolicited:
                for i in range(n):
                    pair.server.qp.post_recv(pair.v.wr.RecvWR(wr_id=i, num_sge=0))
            for i in range(n):
                pair.post(pair.client, "write_imm", pair.client.sge(i * size, size), wr_id=i,
                          raddr=pair.server.mr.buf + i * size, imm=i)
            order = []
            for _ in range(n):
                (recv,) = poll(pair.server.cq)
                assert recv.status == e.IBV_WC_SUCCESS
                i = socket.ntohl(recv.imm_data)
                assert pair.server.read_buf(i * size, size) == image[i * size:(i + 1) * size], f"message {i} torn"
                order.append(i)
            assert sorted(order) == list(range(n))
            assert sorted(w.wr_id for w in poll(pair.client.cq, n)) == list(range(n))
            if provider.soft:
                assert order != sorted(order), "SRD delivered every message in post order"
    finally:
        if provider.soft:
            provider.v.soft.configure("softefa0", srd_packet_size=8192, reorder_seed=None)


def test_efa_requires_every_wr_signaled(srd: SRDPair) -> None:
    raises_errno(srd.v, errno.EINVAL, srd.post, srd.client, "write", srd.client.sge(0, 8), flags=0)
    assert no_completion(srd.client.cq)
    srd.post(srd.client, "write", srd.client.sge(0, 8))  # the QP is still fine
    assert poll(srd.client.cq)[0].status == srd.v.enums.IBV_WC_SUCCESS


def test_efa_accepts_unsignaled_wrs_when_the_qp_signals_all(provider) -> None:
    with provider.srd_pair(sq_sig_all=1) as pair:
        pair.post(pair.client, "write", pair.client.sge(0, 8), flags=0)
        assert poll(pair.client.cq)[0].status == pair.v.enums.IBV_WC_SUCCESS


def test_efa_rejects_fence(srd: SRDPair) -> None:
    e = srd.v.enums
    flags = int(e.IBV_SEND_SIGNALED | e.IBV_SEND_FENCE)
    raises_errno(srd.v, errno.EINVAL, srd.post, srd.client, "write", srd.client.sge(0, 8), flags=flags)


def test_efa_rejects_inline_rdma_write(srd: SRDPair) -> None:
    e = srd.v.enums
    flags = int(e.IBV_SEND_SIGNALED | e.IBV_SEND_INLINE)
    with pytest.raises(srd.v.error.PyverbsRDMAError) as info:
        srd.post(srd.client, "write", None, flags=flags, inline=b"12345678")
    assert info.value.error_code == errno.EINVAL
    assert no_completion(srd.client.cq)


def test_efa_post_send_carries_only_sends(srd: SRDPair) -> None:
    """ibv_post_send on EFA accepts SEND and SEND_WITH_IMM only; RDMA goes through the extended API."""
    v, e = srd.v, srd.v.enums
    wr = v.wr.SendWR(wr_id=1, opcode=e.IBV_WR_RDMA_WRITE, num_sge=1, sg=[srd.client.sge(0, 8)])
    wr.set_wr_rdma(srd.server.mr.rkey, srd.server.mr.buf)
    wr.set_wr_ud(srd.ah, srd.server.qp.qp_num, 0x11111111)
    raises_errno(v, errno.EINVAL, srd.client.qp.post_send, wr)


def test_efa_send_reaches_a_posted_receive(srd: SRDPair) -> None:
    v, e = srd.v, srd.v.enums
    srd.server.qp.post_recv(v.wr.RecvWR(wr_id=8, num_sge=1, sg=[srd.server.sge(4096, 64)]))
    srd.client.write_buf(0, b"hello, srd")
    wr = v.wr.SendWR(wr_id=2, opcode=e.IBV_WR_SEND, num_sge=1, sg=[srd.client.sge(0, 10)])
    wr.set_wr_ud(srd.ah, srd.server.qp.qp_num, 0x11111111)
    srd.client.qp.post_send(wr)
    (recv,) = poll(srd.server.cq)
    (sent,) = poll(srd.client.cq)
    assert (recv.wr_id, recv.status, recv.opcode, recv.byte_len) == (8, e.IBV_WC_SUCCESS, e.IBV_WC_RECV, 10)
    assert (sent.status, sent.opcode) == (e.IBV_WC_SUCCESS, e.IBV_WC_SEND)
    assert srd.server.read_buf(4096, 10) == b"hello, srd"


def test_srd_rdma_read(srd: SRDPair) -> None:
    """EFA completes a read on the send queue with IBV_WC_SEND (providers/efa efa_wc_read_opcode)."""
    if not srd.has_read:
        pytest.skip("device without EFADV_DEVICE_ATTR_CAPS_RDMA_READ")
    e = srd.v.enums
    srd.server.write_buf(2048, b"read me over srd")
    srd.post(srd.client, "read", srd.client.sge(8192, 16), wr_id=31, raddr=srd.server.mr.buf + 2048)
    (wc,) = poll(srd.client.cq)
    assert (wc.wr_id, wc.status, wc.opcode) == (31, e.IBV_WC_SUCCESS, e.IBV_WC_SEND)
    assert srd.client.read_buf(8192, 16) == b"read me over srd"
