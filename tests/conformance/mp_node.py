"""One "node" of the multi-process SRD exchange (run in a spawned process; see test_multiprocess.py).

Each node writes `n_ops` random-size messages (half RDMA writes, half write-with-imm) into its peer's
buffer, back to back, and receives the peer's. Message i of a node sits at the same offset in its send
buffer and in the peer's receive buffer, and the send buffer holds a seeded random image, so the receiver
knows every byte to expect: each write-with-imm is checked when its completion arrives (all its bytes
must be there already), and the whole buffer once the peer's writes have all completed.

Flow control. Every write-with-imm puts a completion on the receiver's CQ, and nothing in SRD (or in the
NIC) holds a sender back while the receiving application is not polling: the responder places and
acknowledges the write whatever the state of its CQ, so a sender that runs ahead of a descheduled
receiver overruns the receiver's CQ (IBV_EVENT_CQ_ERR on an EFA; softverbs reports EOVERFLOW on the next
poll). So the nodes keep application-level credits: a node has at most `CQE - DEPTH` write-with-imm not
yet polled by its peer (the peer's CQ also holds up to DEPTH completions of its own sends), and the
receiver reports how many it has polled over the pipe.

Pipe messages, after the address exchange: ("consumed", n) n write-with-imm polled so far; ("starved",)
the sender is out of credits; ("sent",) every send of the sender has completed; ("failed", why) the node
gave up, so its peer stops at once instead of waiting for writes that will never come.
"""

from __future__ import annotations

import ctypes
import socket
import time
from typing import Any

import numpy as np

QKEY = 0x11111111
CQE = 8192  # one CQ per node, for its send completions and the peer's write-with-imm
DEPTH = 512  # send and receive queue depth
BATCH = 32  # WRs per wr_start() .. wr_complete()
REPORT_EVERY = 1024  # write-with-imm polled between credit reports (sooner when the peer is starved)


class PeerFailed(RuntimeError):
    """The other node reported an error and stopped."""


def layout(seed: int, n_ops: int, size_max: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(sizes, offsets, is_write_imm) of a node's messages."""
    rng = np.random.default_rng(seed)
    sizes = rng.integers(1, size_max + 1, n_ops)
    offsets = np.concatenate(([0], np.cumsum(sizes)[:-1]))
    return sizes, offsets, rng.random(n_ops) < 0.5


def image(seed: int, nbytes: int) -> np.ndarray:
    return np.random.default_rng(seed + 1_000_003).integers(0, 256, nbytes, dtype=np.uint8)


def _view(mr: Any) -> np.ndarray:
    return np.frombuffer((ctypes.c_uint8 * mr.length).from_address(mr.buf), dtype=np.uint8)


def run_node(peer: Any, result: Any, provider: str, device: str, my_seed: int, peer_seed: int, n_ops: int,
             size_max: int, timeout: float, credits: bool = True, hold: bool = False) -> None:
    """Exchange with the other node over `peer` (a Pipe end); put the outcome on `result`.

    `credits=False` drops the flow control (to show what it prevents). `hold=True` models a receiving
    application that is not scheduled: the node polls nothing until its peer has finished sending or has
    run out of credits.
    """
    try:
        result.send(_run(peer, provider, device, my_seed, peer_seed, n_ops, size_max, timeout, credits, hold))
    except BaseException as exc:  # report, never hang the parent
        why = f"{type(exc).__name__}: {exc}"
        if not isinstance(exc, PeerFailed):
            try:
                peer.send(("failed", why))
            except OSError:
                pass
        result.send({"error": why})


def _run(conn: Any, provider: str, device: str, my_seed: int, peer_seed: int, n_ops: int, size_max: int,
         timeout: float, credits: bool, hold: bool) -> dict[str, Any]:
    from transportd.backends import verbs

    v = verbs.load(provider)
    e, ee = v.enums, v.efa_enums
    if v.soft is not None:
        v.soft.configure(device, srd_packet_size=1024, reorder_seed=my_seed)
    sizes, offsets, imm_ops = layout(my_seed, n_ops, size_max)
    psizes, poffsets, pimm = layout(peer_seed, n_ops, size_max)
    send_bytes, recv_bytes = int(sizes.sum()), int(psizes.sum())
    expect = image(peer_seed, recv_bytes)
    ctx = v.efadv.EfaContext(name=device)
    pd = v.pd.PD(ctx)
    try:
        caps = int(ctx.query_efa_device().device_caps)
        unsolicited = bool(caps & int(ee.EFADV_DEVICE_ATTR_CAPS_UNSOLICITED_WRITE_RECV))
        send_mr = v.mr.MR(pd, send_bytes, int(e.IBV_ACCESS_LOCAL_WRITE))
        recv_mr = v.mr.MR(pd, recv_bytes, int(e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_WRITE))
        _view(send_mr)[:] = image(my_seed, send_bytes)
        got = _view(recv_mr)
        wcf = e.ibv_create_cq_wc_flags
        cq = v.efadv.EfaCQ(ctx, v.cq.CqInitAttrEx(cqe=CQE, wc_flags=int(wcf.IBV_WC_EX_WITH_BYTE_LEN
                                                                           | wcf.IBV_WC_EX_WITH_IMM)),
                           v.efadv.EfaDVCQInitAttr(int(ee.EFADV_WC_EX_WITH_IS_UNSOLICITED) if unsolicited else 0))
        depth = DEPTH
        init = v.qp.QPInitAttrEx(qp_type=e.IBV_QPT_DRIVER, scq=cq, rcq=cq, pd=pd,
                                 cap=v.qp.QPCap(max_send_wr=depth, max_recv_wr=depth, max_send_sge=1, max_recv_sge=1),
                                 comp_mask=int(e.IBV_QP_INIT_ATTR_PD | e.IBV_QP_INIT_ATTR_SEND_OPS_FLAGS),
                                 send_ops_flags=int(e.IBV_QP_EX_WITH_RDMA_WRITE | e.IBV_QP_EX_WITH_RDMA_WRITE_WITH_IMM))
        efa_init = v.efadv.EfaQPInitAttr()
        efa_init.driver_qp_type = ee.EFADV_QP_DRIVER_TYPE_SRD
        if unsolicited:
            efa_init.flags = ee.EFADV_QP_FLAGS_UNSOLICITED_WRITE_RECV
        qp = v.efadv.SRDQPEx(ctx, init, efa_init)
        attr = v.qp.QPAttr(port_num=1)
        attr.qkey = QKEY
        qp.to_rts(attr)
        if not unsolicited:
            for i in range(depth):
                qp.post_recv(v.wr.RecvWR(wr_id=1 << 40 | i, num_sge=0))
        conn.send(("addr", {"qpn": qp.qp_num, "gid": str(ctx.query_gid(1, 0)), "rkey": recv_mr.rkey,
                            "addr": recv_mr.buf}))
        kind, peer = conn.recv()
        if kind == "failed":
            raise PeerFailed(f"peer failed: {peer}")
        gr = v.addr.GlobalRoute(dgid=v.addr.GID(peer["gid"]))
        ah = v.addr.AH(pd, attr=v.addr.AHAttr(port_num=1, is_global=1, gr=gr))

        signaled = int(e.IBV_SEND_SIGNALED)
        sges = [v.wr.SGE(send_mr.buf + int(o), int(s), send_mr.lkey) for o, s in zip(offsets, sizes, strict=True)]
        expect_imm = int(pimm.sum())
        window = CQE - depth  # write-with-imm the peer's CQ has room for beyond its own send completions
        posted = completed = received = 0
        imm_posted = 0  # write-with-imm posted by this node
        peer_consumed = 0  # ... and polled by the peer, as it last reported
        reported = 0  # write-with-imm of the peer this node has reported polled
        peer_starved = said_starved = False
        peer_done = said_done = False
        holding = hold
        deadline = time.monotonic() + timeout
        batch = BATCH
        while completed < n_ops or received < expect_imm or not peer_done:
            if time.monotonic() > deadline:
                raise TimeoutError(f"sent {completed}/{n_ops}, received {received}/{expect_imm}, "
                                   f"peer done {peer_done}, credits {imm_posted - peer_consumed}/{window}")
            if posted < n_ops and posted - completed <= depth - batch:
                end = min(n_ops, posted + batch)
                if credits:
                    room = peer_consumed + window - imm_posted
                    stop = posted
                    while stop < end and (room > 0 or not imm_ops[stop]):
                        room -= int(imm_ops[stop])
                        stop += 1
                    if stop < end and not said_starved:
                        conn.send(("starved",))
                        said_starved = True
                    end = stop
                if end > posted:
                    qp.wr_start()
                    for i in range(posted, end):
                        qp.wr_id = i
                        qp.wr_flags = signaled
                        raddr = peer["addr"] + int(offsets[i])
                        if imm_ops[i]:
                            qp.wr_rdma_write_imm(peer["rkey"], raddr, i)
                        else:
                            qp.wr_rdma_write(peer["rkey"], raddr)
                        qp.wr_set_ud_addr(ah, peer["qpn"], QKEY)
                        qp.wr_set_sge(sges[i])
                    qp.wr_complete()
                    imm_posted += int(imm_ops[posted:end].sum())
                    posted = end
            if not holding and cq.start_poll(None) == 0:
                while True:
                    if cq.status != 0:
                        raise RuntimeError(f"completion wr_id {cq.wr_id} failed with status {cq.status}")
                    if cq.read_opcode() == e.IBV_WC_RECV_RDMA_WITH_IMM:
                        i = socket.ntohl(cq.read_imm_data())
                        lo, hi = int(poffsets[i]), int(poffsets[i] + psizes[i])
                        if not (pimm[i] and cq.read_byte_len() == hi - lo and np.array_equal(got[lo:hi],
                                                                                            expect[lo:hi])):
                            raise AssertionError(f"write-with-imm {i} completed before all its bytes were placed")
                        received += 1
                        if not unsolicited:
                            qp.post_recv(v.wr.RecvWR(wr_id=cq.wr_id, num_sge=0))
                    else:
                        completed += 1
                    if cq.poll_next() != 0:
                        break
                cq.end_poll()
            # credits back to the peer; none once it has finished sending (it may have stopped reading)
            if not peer_done and received > reported and (received - reported >= REPORT_EVERY or peer_starved):
                conn.send(("consumed", received))
                reported = received
                peer_starved = False
            if completed == n_ops and not said_done:
                conn.send(("sent",))
                said_done = True
            while conn.poll():
                msg = conn.recv()
                if msg[0] == "consumed":
                    peer_consumed = msg[1]
                    said_starved = False
                elif msg[0] == "starved":
                    peer_starved = True
                    holding = False
                elif msg[0] == "sent":
                    peer_done = True
                    holding = False
                elif msg[0] == "failed":
                    raise PeerFailed(f"peer failed: {msg[1]}")
        bad = np.flatnonzero(got != expect)
        return {"sent": completed, "received_imm": received, "bytes": recv_bytes, "bad_bytes": int(bad.size),
                "first_bad": int(bad[0]) if bad.size else -1}
    finally:
        ctx.close()
