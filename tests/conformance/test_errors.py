"""Protection and error semantics: keys, bounds and access flags; what an error does to the QP.

RC: the failing WR completes with an error status, the QP goes to IBV_QPS_ERR and every later or
outstanding WR (and posted receive) completes with IBV_WC_WR_FLUSH_ERR. SRD (EFA): only the failing WR
completes in error; the QP keeps working.
"""

from __future__ import annotations

import errno

import pytest

from tests.support.verbs_resources import RCPair, SRDPair, access, poll, raises_errno


def qp_state(v, qp) -> int:
    attr, _ = qp.query(v.enums.IBV_QP_STATE)
    return int(attr.qp_state)


def test_bad_rkey_fails_the_wr_then_the_qp_flushes(rc: RCPair) -> None:
    v, e = rc.v, rc.v.enums
    rc.client.qp.post_recv(v.wr.RecvWR(wr_id=70, num_sge=1, sg=[rc.client.sge(0, 64)]))
    bad = rc.send_wr(e.IBV_WR_RDMA_WRITE, rc.client.sge(0, 64), wr_id=1, rkey=rc.server.mr.rkey ^ 0x5A5A00)
    bad.next_wr = rc.send_wr(e.IBV_WR_RDMA_WRITE, rc.client.sge(0, 64), wr_id=2)
    rc.client.qp.post_send(bad)
    wcs = poll(rc.client.cq, 3)
    by_id = {w.wr_id: w.status for w in wcs}
    assert by_id == {1: e.IBV_WC_REM_ACCESS_ERR, 2: e.IBV_WC_WR_FLUSH_ERR, 70: e.IBV_WC_WR_FLUSH_ERR}
    assert [w.wr_id for w in wcs if w.wr_id != 70] == [1, 2]
    assert qp_state(v, rc.client.qp) == e.IBV_QPS_ERR
    # a WR posted to a QP in the error state is flushed too
    rc.client.qp.post_send(rc.send_wr(e.IBV_WR_RDMA_WRITE, rc.client.sge(0, 64), wr_id=3))
    (wc,) = poll(rc.client.cq)
    assert (wc.wr_id, wc.status) == (3, e.IBV_WC_WR_FLUSH_ERR)
    rc.client.qp.post_recv(v.wr.RecvWR(wr_id=71, num_sge=0))
    (wc,) = poll(rc.client.cq)
    assert (wc.wr_id, wc.status) == (71, e.IBV_WC_WR_FLUSH_ERR)


def test_unsignaled_wrs_behind_an_error_still_flush(rc: RCPair) -> None:
    e = rc.v.enums
    head = rc.send_wr(e.IBV_WR_RDMA_WRITE, rc.client.sge(0, 8), wr_id=1, raddr=rc.server.mr.buf + (1 << 20))
    node = head
    for i in range(2, 5):
        node.next_wr = rc.send_wr(e.IBV_WR_RDMA_WRITE, rc.client.sge(0, 8), wr_id=i, flags=0)
        node = node.next_wr
    rc.client.qp.post_send(head)
    wcs = poll(rc.client.cq, 4)
    assert [(w.wr_id, w.status) for w in wcs] == [(1, e.IBV_WC_REM_ACCESS_ERR)] + [
        (i, e.IBV_WC_WR_FLUSH_ERR) for i in range(2, 5)]


@pytest.mark.parametrize("case", ["out_of_bounds", "no_remote_write", "qp_without_remote_write", "other_pd"])
def test_write_access_violations(provider, case: str) -> None:
    kw = {}
    if case == "no_remote_write":
        kw["mr_access"] = access(provider.v, "IBV_ACCESS_LOCAL_WRITE", "IBV_ACCESS_REMOTE_READ")
    if case == "qp_without_remote_write":
        kw["qp_access"] = access(provider.v, "IBV_ACCESS_REMOTE_READ")
    with provider.rc_pair(**kw) as rc:
        v, e = rc.v, rc.v.enums
        rkey, raddr = rc.server.mr.rkey, rc.server.mr.buf
        if case == "out_of_bounds":
            raddr += rc.server.mr.length - 32
        if case == "other_pd":
            pd2 = v.pd.PD(rc.ctx)
            mr2 = v.mr.MR(pd2, 4096, access(v, "IBV_ACCESS_LOCAL_WRITE", "IBV_ACCESS_REMOTE_WRITE"))
            rkey, raddr = mr2.rkey, mr2.buf
        rc.client.qp.post_send(rc.send_wr(e.IBV_WR_RDMA_WRITE, rc.client.sge(0, 64), rkey=rkey, raddr=raddr))
        (wc,) = poll(rc.client.cq)
        assert wc.status == e.IBV_WC_REM_ACCESS_ERR
        assert qp_state(v, rc.client.qp) == e.IBV_QPS_ERR
        if case == "other_pd":
            mr2.close()
            pd2.close()


def test_read_needs_remote_read(provider) -> None:
    with provider.rc_pair(mr_access=access(provider.v, "IBV_ACCESS_LOCAL_WRITE", "IBV_ACCESS_REMOTE_WRITE")) as rc:
        e = rc.v.enums
        rc.client.qp.post_send(rc.send_wr(e.IBV_WR_RDMA_READ, rc.client.sge(0, 64)))
        assert poll(rc.client.cq)[0].status == e.IBV_WC_REM_ACCESS_ERR


def test_atomic_needs_remote_atomic(provider) -> None:
    with provider.rc_pair(mr_access=access(provider.v, "IBV_ACCESS_LOCAL_WRITE", "IBV_ACCESS_REMOTE_WRITE")) as rc:
        e = rc.v.enums
        rc.client.qp.post_send(rc.send_wr(e.IBV_WR_ATOMIC_FETCH_AND_ADD, rc.client.sge(0, 8), add=1))
        assert poll(rc.client.cq)[0].status == e.IBV_WC_REM_ACCESS_ERR


def test_misaligned_atomic_is_an_invalid_request(rc: RCPair) -> None:
    e = rc.v.enums
    rc.client.qp.post_send(rc.send_wr(e.IBV_WR_ATOMIC_FETCH_AND_ADD, rc.client.sge(0, 8), add=1,
                                      raddr=rc.server.mr.buf + 4))
    assert poll(rc.client.cq)[0].status == e.IBV_WC_REM_INV_REQ_ERR


def test_bad_lkey_is_a_local_protection_error(rc: RCPair) -> None:
    v, e = rc.v, rc.v.enums
    sge = v.wr.SGE(rc.client.mr.buf, 64, rc.client.mr.lkey ^ 0x00FF0000)
    rc.client.qp.post_send(rc.send_wr(e.IBV_WR_RDMA_WRITE, sge, wr_id=9))
    (wc,) = poll(rc.client.cq)
    assert (wc.wr_id, wc.status) == (9, e.IBV_WC_LOC_PROT_ERR)
    assert qp_state(v, rc.client.qp) == e.IBV_QPS_ERR


def test_read_into_memory_without_local_write_is_a_local_protection_error(rc: RCPair) -> None:
    v, e = rc.v, rc.v.enums
    ro = v.mr.MR(rc.pd, 4096, 0)  # no access flags: the NIC may read it, not write it
    try:
        rc.client.qp.post_send(rc.send_wr(e.IBV_WR_RDMA_READ, rc.client.sge(0, 64, mr=ro)))
        assert poll(rc.client.cq)[0].status == e.IBV_WC_LOC_PROT_ERR
    finally:
        ro.close()


def test_remote_write_without_local_write_cannot_be_registered(rc: RCPair) -> None:
    v = rc.v
    raises_errno(v, errno.EINVAL, v.mr.MR, rc.pd, 4096, access(v, "IBV_ACCESS_REMOTE_WRITE"))
    raises_errno(v, errno.EINVAL, v.mr.MR, rc.pd, 4096, access(v, "IBV_ACCESS_REMOTE_ATOMIC"))


def test_srd_access_error_fails_only_that_wr(srd: SRDPair) -> None:
    v, e = srd.v, srd.v.enums
    srd.post(srd.client, "write", srd.client.sge(0, 64), wr_id=1, rkey=srd.server.mr.rkey ^ 0x5A5A00)
    (wc,) = poll(srd.client.cq)
    assert (wc.wr_id, wc.status) == (1, e.IBV_WC_REM_ACCESS_ERR)
    assert qp_state(v, srd.client.qp) == e.IBV_QPS_RTS
    srd.client.write_buf(0, b"still here")
    srd.post(srd.client, "write", srd.client.sge(0, 10), wr_id=2)
    (wc,) = poll(srd.client.cq)
    assert (wc.wr_id, wc.status) == (2, e.IBV_WC_SUCCESS)
    assert srd.server.read_buf(0, 10) == b"still here"


def test_srd_bad_lkey_is_a_local_protection_error(srd: SRDPair) -> None:
    v, e = srd.v, srd.v.enums
    srd.post(srd.client, "write", v.wr.SGE(srd.client.mr.buf, 64, srd.client.mr.lkey ^ 0x00FF0000), wr_id=5)
    (wc,) = poll(srd.client.cq)
    assert (wc.wr_id, wc.status) == (5, e.IBV_WC_LOC_PROT_ERR)
