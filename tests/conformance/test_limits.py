"""Queue limits: posting past a queue's depth fails with ENOMEM until completions are polled.

A slot is freed when its completion is polled (mlx5 advances its SQ tail, EFA its completed count, on
poll), so an unpolled CQ keeps the queue full. Hardware may round a depth up; softverbs keeps it exact,
so the hardware variant only checks that the refusal comes, with ENOMEM, no earlier than the depth asked.
"""

from __future__ import annotations

import errno

import pytest

from tests.support.verbs_resources import poll


def _post_until_refused(post, limit: int) -> tuple[int, int]:
    """Call post() until it raises; (successful posts, errno)."""
    for n in range(limit):
        try:
            post(n)
        except Exception as exc:  # PyverbsRDMAError of either provider
            return n, getattr(exc, "error_code", -1)
    raise AssertionError(f"{limit} posts accepted; no queue-full refusal")


def test_send_queue_depth(provider) -> None:
    depth = 8
    with provider.rc_pair(max_send_wr=depth) as rc:
        e = rc.v.enums

        def post(i: int) -> None:
            rc.client.qp.post_send(rc.send_wr(e.IBV_WR_RDMA_WRITE, rc.client.sge(0, 8), wr_id=i))

        posted, err = _post_until_refused(post, 4096)
        assert err == errno.ENOMEM
        assert posted == depth if provider.soft else posted >= depth
        poll(rc.client.cq, posted)
        post(posted)  # polling freed the slots
        poll(rc.client.cq)


def test_unsignaled_wrs_hold_their_slots_until_a_signaled_one_is_polled(provider) -> None:
    if not provider.soft:
        pytest.skip("depth rounding on hardware makes the exact count provider-specific")
    with provider.rc_pair(max_send_wr=4) as rc:
        e = rc.v.enums
        for i in range(3):
            rc.client.qp.post_send(rc.send_wr(e.IBV_WR_RDMA_WRITE, rc.client.sge(0, 8), wr_id=i, flags=0))
        rc.client.qp.post_send(rc.send_wr(e.IBV_WR_RDMA_WRITE, rc.client.sge(0, 8), wr_id=3))
        with pytest.raises(rc.v.error.PyverbsRDMAError) as info:
            rc.client.qp.post_send(rc.send_wr(e.IBV_WR_RDMA_WRITE, rc.client.sge(0, 8), wr_id=4))
        assert info.value.error_code == errno.ENOMEM
        assert [w.wr_id for w in poll(rc.client.cq)] == [3]  # one completion frees all four slots
        for i in range(4):
            rc.client.qp.post_send(rc.send_wr(e.IBV_WR_RDMA_WRITE, rc.client.sge(0, 8), wr_id=10 + i))
        poll(rc.client.cq, 4)


def test_receive_queue_depth(provider) -> None:
    depth = 4
    with provider.rc_pair(max_recv_wr=depth) as rc:
        v = rc.v
        posted, err = _post_until_refused(lambda i: rc.server.qp.post_recv(v.wr.RecvWR(wr_id=i, num_sge=0)), 4096)
        assert err == errno.ENOMEM
        assert posted == depth if provider.soft else posted >= depth


def test_a_bad_wr_in_a_chain_stops_the_post_there(provider) -> None:
    """ibv_post_send posts the WRs before the bad one and reports the bad one."""
    with provider.rc_pair(max_send_wr=2) as rc:
        e = rc.v.enums
        head = rc.send_wr(e.IBV_WR_RDMA_WRITE, rc.client.sge(0, 8), wr_id=1)
        node = head
        for i in range(2, 4096):
            node.next_wr = rc.send_wr(e.IBV_WR_RDMA_WRITE, rc.client.sge(0, 8), wr_id=i)
            node = node.next_wr
        bad = rc.v.wr.SendWR(opcode=e.IBV_WR_RDMA_WRITE, num_sge=1, sg=[rc.client.sge(0, 8)])
        with pytest.raises(rc.v.error.PyverbsRDMAError) as info:
            rc.client.qp.post_send(head, bad)
        assert info.value.error_code == errno.ENOMEM
        posted = bad.wr_id - 1
        assert posted == 2 if provider.soft else posted >= 2
        assert [w.wr_id for w in poll(rc.client.cq, posted)] == list(range(1, posted + 1))


def test_too_many_sges_are_refused(provider) -> None:
    with provider.rc_pair() as rc:  # max_send_sge=2
        e = rc.v.enums
        sges = [rc.client.sge(8 * i, 8) for i in range(3 if provider.soft else 64)]
        with pytest.raises(rc.v.error.PyverbsRDMAError) as info:
            rc.client.qp.post_send(rc.send_wr(e.IBV_WR_RDMA_WRITE, sges))
        assert info.value.error_code == errno.ENOMEM  # mlx5's errno for this


def test_queue_and_cq_sizes_above_the_device_limits_are_refused(provider) -> None:
    with provider.rc_pair() as rc:
        v, e = rc.v, rc.v.enums
        attr = rc.ctx.query_device()
        with pytest.raises(v.error.PyverbsRDMAError):
            v.cq.CQ(rc.ctx, int(attr.max_cqe) + 1)
        cap = v.qp.QPCap(max_send_wr=int(attr.max_qp_wr) + 1)
        with pytest.raises(v.error.PyverbsRDMAError):
            v.qp.QP(rc.pd, v.qp.QPInitAttr(qp_type=e.IBV_QPT_RC, scq=rc.client.cq, rcq=rc.client.cq, cap=cap))


def test_efa_send_queue_depth(provider) -> None:
    depth = 8
    with provider.srd_pair(max_send_wr=depth) as pair:
        posted, err = _post_until_refused(lambda i: pair.post(pair.client, "write", pair.client.sge(0, 8), wr_id=i),
                                          4096)
        assert err == errno.ENOMEM
        assert posted == depth if provider.soft else posted >= depth
        poll(pair.client.cq, posted)
