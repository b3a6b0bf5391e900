"""When a resource goes, as pyverbs has it: one dropped without close() is released when its object goes
(``__dealloc__``), so its keys and its QP number stop answering; closing a CQ closes the QPs on it first."""

from __future__ import annotations

import gc

from tests.support.verbs_resources import Provider, access, poll


def test_an_mr_dropped_without_close_stops_answering_its_rkey(provider: Provider) -> None:
    with provider.rc_pair() as rc:
        v, e = rc.v, rc.v.enums
        mr = v.mr.MR(rc.pd, 4096, access(v, "IBV_ACCESS_LOCAL_WRITE", "IBV_ACCESS_REMOTE_WRITE"))
        rkey, raddr = mr.rkey, mr.buf
        rc.client.qp.post_send(rc.send_wr(e.IBV_WR_RDMA_WRITE, rc.client.sge(0, 64), wr_id=1, rkey=rkey, raddr=raddr))
        assert [(w.wr_id, w.status) for w in poll(rc.client.cq)] == [(1, e.IBV_WC_SUCCESS)]
        del mr
        gc.collect()  # not needed by refcounting; pyverbs' objects sit in no cycle either
        rc.client.qp.post_send(rc.send_wr(e.IBV_WR_RDMA_WRITE, rc.client.sge(0, 64), wr_id=2, rkey=rkey, raddr=raddr))
        assert [(w.wr_id, w.status) for w in poll(rc.client.cq)] == [(2, e.IBV_WC_REM_ACCESS_ERR)]


def test_a_qp_dropped_without_close_stops_answering(provider: Provider) -> None:
    with provider.rc_pair() as rc:
        e = rc.v.enums
        rc.client.qp.post_send(rc.send_wr(e.IBV_WR_RDMA_WRITE, rc.client.sge(0, 8), wr_id=1))
        assert [(w.wr_id, w.status) for w in poll(rc.client.cq)] == [(1, e.IBV_WC_SUCCESS)]
        rc.server.qp = None  # the only reference: the server's QP is destroyed
        rc.client.qp.post_send(rc.send_wr(e.IBV_WR_RDMA_WRITE, rc.client.sge(0, 8), wr_id=2))
        assert [(w.wr_id, w.status) for w in poll(rc.client.cq)] == [(2, e.IBV_WC_RETRY_EXC_ERR)]


def test_closing_a_cq_closes_the_qps_that_complete_on_it(provider: Provider) -> None:
    with provider.rc_pair() as rc:
        e = rc.v.enums
        rc.server.cq.close()  # pyverbs closes the server's QP first: ibv_destroy_cq refuses a CQ in use
        rc.client.qp.post_send(rc.send_wr(e.IBV_WR_RDMA_WRITE, rc.client.sge(0, 8), wr_id=1))
        assert [(w.wr_id, w.status) for w in poll(rc.client.cq)] == [(1, e.IBV_WC_RETRY_EXC_ERR)]
