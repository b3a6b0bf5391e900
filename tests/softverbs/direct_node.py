"""The responder of test_direct's two-process test (run in a spawned process): an RC QP whose MR is device
memory emulated in /dev/shm, with this process's own ShmCopier; it reports the bytes it holds, how many
peer allocations it has mapped and its device's counters."""

from __future__ import annotations

from typing import Any

from softverbs import soft
from tests.support.device_memory import ShmDeviceMemory
from tests.support.verbs_resources import Side, access, open_provider

SIZE = 64 << 10


def responder(conn: Any) -> None:
    """The responder node: device memory in /dev/shm, its own ShmCopier; reports what it opened."""
    provider = open_provider("soft")
    v, e = provider.v, provider.v.enums
    with ShmDeviceMemory() as memory:
        ctx = v.device.Context(name="softib0")
        pd = v.pd.PD(ctx)
        holder = type("P", (), {"v": v, "pd": pd})()
        side = Side(holder, 8 * SIZE, access(v, "IBV_ACCESS_LOCAL_WRITE", "IBV_ACCESS_REMOTE_WRITE"), memory)
        side.cq = v.cq.CQ(ctx, 64)
        cap = v.qp.QPCap(max_send_wr=16, max_recv_wr=16)
        side.qp = v.qp.QP(pd, v.qp.QPInitAttr(qp_type=e.IBV_QPT_RC, scq=side.cq, rcq=side.cq, cap=cap))
        conn.send({"qpn": side.qp.qp_num, "gid": str(ctx.query_gid(1, 0)), "lid": ctx.query_port(1).lid,
                   "addr": side.mr.buf, "rkey": side.mr.rkey, "psn": side.psn})
        remote = conn.recv()
        to_rts(v, side.qp, remote, side.psn)
        conn.send("ready")
        while (msg := conn.recv()) != "stop":
            if msg == "state":
                conn.send({"data": side.read_buf(0, 8 * SIZE), "opened": memory.copier.opened(),
                           "stats": soft.device_stats("softib0")})
        side.close()
        pd.close()
        ctx.close()


def to_rts(v: Any, qp: Any, remote: dict[str, Any], psn: int) -> None:
    e = v.enums
    attr = v.qp.QPAttr(port_num=1)
    attr.qp_access_flags = access(v, "IBV_ACCESS_REMOTE_WRITE")
    attr.path_mtu = e.IBV_MTU_4096
    attr.dest_qp_num = remote["qpn"]
    attr.rq_psn = remote["psn"]
    attr.sq_psn = psn
    attr.max_dest_rd_atomic = attr.max_rd_atomic = 1
    attr.min_rnr_timer, attr.timeout, attr.retry_cnt, attr.rnr_retry = 12, 14, 7, 7
    gr = v.addr.GlobalRoute(dgid=v.addr.GID(remote["gid"]), sgid_index=0)
    attr.ah_attr = v.addr.AHAttr(port_num=1, is_global=1, gr=gr, dlid=remote["lid"])
    qp.to_rts(attr)


