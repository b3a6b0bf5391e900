"""Verbs resources for the conformance and softverbs tests, shaped like rdma-core's tests/base.py.

A client/server pair is built in one process on one device (loopback through the device, as rdma-core's
tests do), connection info exchanged by attribute assignment. Every helper goes through the namespace
`transportd.backends.verbs.load()` returns, so the same code drives softverbs and real pyverbs.
"""

from __future__ import annotations

import errno
import random
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import pytest

from tests.support.waiting import wait_until
from transportd.backends import verbs

POLL_TIMEOUT_S = 10.0
QKEY = 0x11111111
FULL_ACCESS = ("IBV_ACCESS_LOCAL_WRITE", "IBV_ACCESS_REMOTE_WRITE", "IBV_ACCESS_REMOTE_READ",
               "IBV_ACCESS_REMOTE_ATOMIC")


def access(v: Any, *names: str) -> int:
    flags = 0
    for name in names:
        flags |= int(getattr(v.enums, name))
    return flags


@dataclass
class Provider:
    """A verbs provider and the devices the tests may use on it."""

    name: str
    v: Any
    rc_device: str | None
    efa_device: str | None

    def need_rc(self) -> str:
        if self.rc_device is None:
            pytest.skip(f"{self.name}: no RC-capable (InfiniBand/RoCE) device found")
        return self.rc_device

    def need_efa(self) -> str:
        if self.efa_device is None:
            pytest.skip(f"{self.name}: no EFA device found")
        return self.efa_device

    @property
    def soft(self) -> bool:
        return self.name == "soft"

    def rc_pair(self, **kw: Any) -> RCPair:
        return RCPair(self, self.need_rc(), **kw)

    def srd_pair(self, **kw: Any) -> SRDPair:
        return SRDPair(self, self.need_efa(), **kw)


def open_provider(name: str) -> Provider:
    """The provider's namespace and devices; skips, saying why, where a real one is not usable."""
    if name == "soft":
        return Provider("soft", verbs.load("soft"), "softib0", "softefa0")
    names = verbs.pyverbs_devices()
    if names is None:
        pytest.skip("pyverbs is not importable: build rdma-core 59's pyverbs "
                    "(docs/design.md, \"pyverbs from the node's rdma-core\")")
    if not names:
        pytest.skip("No RDMA devices found (pyverbs get_device_list() reports none)")
    v = verbs.load("pyverbs")
    rc_dev = efa_dev = None
    for dev in names:
        kind = _device_kind(v, dev)
        if kind == "efa" and efa_dev is None:
            efa_dev = dev
        elif kind == "rc" and rc_dev is None:
            rc_dev = dev
    return Provider("pyverbs", v, rc_dev, efa_dev)


def _device_kind(v: Any, name: str) -> str:
    if v.efadv is not None:
        try:
            with v.efadv.EfaContext(name=name) as ctx:
                ctx.query_efa_device()
                return "efa"
        except v.error.PyverbsError:
            pass
    return "rc"


def poll(cq: Any, count: int = 1, timeout: float = POLL_TIMEOUT_S) -> list[SimpleNamespace]:
    """`count` completions from a CQ or CQEX, as plain records; fails saying how many are missing."""
    out: list[SimpleNamespace] = []
    extended = hasattr(cq, "start_poll")

    def take() -> bool:
        if extended:
            if cq.start_poll(None) == 0:
                while True:
                    out.append(_record_ex(cq))
                    if len(out) == count or cq.poll_next() != 0:
                        break
                cq.end_poll()
        else:
            _, wcs = cq.poll(count - len(out))
            out.extend(SimpleNamespace(wr_id=w.wr_id, status=w.status, opcode=w.opcode, byte_len=w.byte_len,
                                       imm_data=w.imm_data, wc_flags=w.wc_flags, qp_num=w.qp_num,
                                       src_qp=w.src_qp, unsolicited=False) for w in wcs)
        return len(out) >= count

    # polling is the progress check itself: spin
    wait_until(take, lambda: f"{count} completions (polled {len(out)}, {count - len(out)} missing)", timeout,
               interval=0)
    return out


def _record_ex(cq: Any) -> SimpleNamespace:
    unsolicited = bool(cq.is_unsolicited()) if hasattr(cq, "is_unsolicited") else False
    return SimpleNamespace(wr_id=cq.wr_id, status=cq.status, opcode=cq.read_opcode(), byte_len=cq.read_byte_len(),
                           imm_data=cq.read_imm_data(), wc_flags=cq.read_wc_flags(), qp_num=cq.read_qp_num(),
                           src_qp=cq.read_src_qp(), unsolicited=unsolicited)


def no_completion(cq: Any, wait: float = 0.2) -> bool:
    """True if nothing completes within `wait` seconds."""
    try:
        poll(cq, 1, timeout=wait)
    except pytest.fail.Exception:  # the wait timed out
        return True
    return False


def raises_errno(v: Any, code: int, fn: Any, *args: Any, **kwargs: Any) -> None:
    """`fn(*args, **kwargs)` must raise PyverbsRDMAError with errno `code`."""
    with pytest.raises(v.error.PyverbsRDMAError) as info:
        fn(*args, **kwargs)
    assert info.value.error_code == code, f"errno {info.value.error_code}, expected {code} ({errno.errorcode[code]})"


class Side:
    """One end: its CQ, QP and one MR (host memory, or ``memory``'s: see tests/support/device_memory.py)."""

    def __init__(self, pair: Any, mr_size: int, mr_access: int, memory: Any = None) -> None:
        v = pair.v
        self.v = v
        self.cq: Any = None
        self.qp: Any = None
        self.memory = memory
        if memory is None:
            self.mr = v.mr.MR(pair.pd, mr_size, mr_access)
        else:
            self.addr = memory.allocate(mr_size)
            self.mr = v.mr.MR(pair.pd, mr_size, mr_access, address=self.addr, **memory.mr_options())
        self.psn = random.getrandbits(24)
        self.gid: Any = None
        self.lid = 0

    def write_buf(self, offset: int, data: bytes) -> None:
        self.mr.write(data, len(data), offset)

    def read_buf(self, offset: int, length: int) -> bytes:
        return self.mr.read(length, offset)

    def sge(self, offset: int, length: int, mr: Any = None) -> Any:
        mr = mr or self.mr
        return self.v.wr.SGE(mr.buf + offset, length, mr.lkey)

    def close(self) -> None:
        for obj in (self.qp, self.mr, self.cq):
            if obj is not None:
                obj.close()
        if self.memory is not None:
            self.memory.free(self.addr)
            self.memory = None


class RCPair:
    """Client and server RC QPs on one device, connected to each other; a context manager that closes them."""

    SEND_OPS = ("IBV_QP_EX_WITH_RDMA_WRITE", "IBV_QP_EX_WITH_RDMA_WRITE_WITH_IMM", "IBV_QP_EX_WITH_SEND",
                "IBV_QP_EX_WITH_SEND_WITH_IMM", "IBV_QP_EX_WITH_RDMA_READ", "IBV_QP_EX_WITH_ATOMIC_FETCH_AND_ADD",
                "IBV_QP_EX_WITH_ATOMIC_CMP_AND_SWP")

    def __init__(self, provider: Provider, device: str, *, mr_size: int = 1 << 20, mr_access: int | None = None,
                 max_send_wr: int = 64, max_recv_wr: int = 64, cq_depth: int = 512, qp_access: int | None = None,
                 connect: bool = True, max_rd_atomic: int = 4, max_inline_data: int = 0, client_memory: Any = None,
                 server_memory: Any = None) -> None:
        v = self.v = provider.v
        self.provider = provider
        e = v.enums
        self.ctx = v.device.Context(name=device)
        try:
            self.port_attr = self.ctx.query_port(1)
            self.gid = self.ctx.query_gid(1, 0)
            self.pd = v.pd.PD(self.ctx)
            mr_access = access(v, *FULL_ACCESS) if mr_access is None else mr_access
            self.qp_access = access(v, "IBV_ACCESS_REMOTE_WRITE", "IBV_ACCESS_REMOTE_READ",
                                    "IBV_ACCESS_REMOTE_ATOMIC") if qp_access is None else qp_access
            self.client = Side(self, mr_size, mr_access, client_memory)
            self.server = Side(self, mr_size, mr_access, server_memory)
            for side in (self.client, self.server):
                side.gid, side.lid = self.gid, self.port_attr.lid
            ops = 0
            for name in self.SEND_OPS:
                ops |= int(getattr(e.ibv_qp_create_send_ops_flags, name))
            for side in (self.client, self.server):
                side.cq = v.cq.CQ(self.ctx, cq_depth)
                cap = v.qp.QPCap(max_send_wr=max_send_wr, max_recv_wr=max_recv_wr, max_send_sge=2,
                                 max_recv_sge=2, max_inline_data=max_inline_data)
                init = v.qp.QPInitAttrEx(qp_type=e.IBV_QPT_RC, scq=side.cq, rcq=side.cq, cap=cap, pd=self.pd,
                                         comp_mask=int(e.IBV_QP_INIT_ATTR_PD | e.IBV_QP_INIT_ATTR_SEND_OPS_FLAGS),
                                         send_ops_flags=ops, sq_sig_all=0)
                side.qp = v.qp.QPEx(self.ctx, init)
            if connect:
                self.connect(self.client, self.server, max_rd_atomic)
                self.connect(self.server, self.client, max_rd_atomic)
        except BaseException:
            self.close()
            raise

    def connect(self, side: Side, remote: Side, max_rd_atomic: int = 4, **overrides: Any) -> None:
        """to_rts() toward `remote`; `overrides` replace QPAttr fields (e.g. rq_psn, dest_qp_num)."""
        v, e = self.v, self.v.enums
        attr = v.qp.QPAttr(port_num=1)
        attr.qp_access_flags = self.qp_access
        attr.path_mtu = self.port_attr.active_mtu
        attr.dest_qp_num = remote.qp.qp_num
        attr.rq_psn = remote.psn
        attr.sq_psn = side.psn
        attr.max_dest_rd_atomic = max_rd_atomic
        attr.max_rd_atomic = max_rd_atomic
        attr.min_rnr_timer, attr.timeout, attr.retry_cnt, attr.rnr_retry = 12, 14, 7, 7
        gr = v.addr.GlobalRoute(dgid=remote.gid, sgid_index=0)
        attr.ah_attr = v.addr.AHAttr(port_num=1, is_global=1, gr=gr, dlid=remote.lid)
        for name, value in overrides.items():
            setattr(attr, name, value)
        side.qp.to_rts(attr)
        assert side.qp.qp_state == e.IBV_QPS_RTS

    def send_wr(self, opcode: Any, sge: Any | list, *, wr_id: int = 1, flags: int | None = None,
                rkey: int | None = None, raddr: int | None = None, imm: int = 0, add: int = 0,
                swap: int = 0) -> Any:
        """A SendWR (legacy API); RDMA ops target the server's MR unless rkey/raddr are given."""
        v, e = self.v, self.v.enums
        sges = sge if isinstance(sge, list) else [sge]
        flags = int(e.IBV_SEND_SIGNALED) if flags is None else flags
        wr = v.wr.SendWR(wr_id=wr_id, opcode=opcode, num_sge=len(sges), sg=sges, send_flags=flags, imm_data=imm)
        rkey = self.server.mr.rkey if rkey is None else rkey
        raddr = self.server.mr.buf if raddr is None else raddr
        if opcode in (e.IBV_WR_ATOMIC_FETCH_AND_ADD, e.IBV_WR_ATOMIC_CMP_AND_SWP):
            wr.set_wr_atomic(rkey, raddr, add, swap)
        else:
            wr.set_wr_rdma(rkey, raddr)
        return wr

    def __enter__(self) -> RCPair:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for side in (getattr(self, "client", None), getattr(self, "server", None)):
            if side is not None:
                side.close()
        for name in ("pd", "ctx"):
            obj = getattr(self, name, None)
            if obj is not None:
                obj.close()


class SRDPair:
    """Client and server EFA SRD QPs (extended API) on one device, each with an AH to the other; a context
    manager that closes them."""

    def __init__(self, provider: Provider, device: str, *, mr_size: int = 1 << 20, unsolicited: bool = True,
                 max_send_wr: int = 256, max_recv_wr: int = 256, cq_depth: int = 1024,
                 sq_sig_all: int = 0, client_memory: Any = None, server_memory: Any = None) -> None:
        v = self.v = provider.v
        self.provider = provider
        e, ee = v.enums, v.efa_enums
        self.ctx = v.efadv.EfaContext(name=device)
        try:
            self.efa_attr = self.ctx.query_efa_device()
            caps = int(self.efa_attr.device_caps)
            if not caps & int(ee.EFADV_DEVICE_ATTR_CAPS_RDMA_WRITE):
                pytest.skip(f"{device}: no EFADV_DEVICE_ATTR_CAPS_RDMA_WRITE")
            self.unsolicited = unsolicited and bool(caps & int(ee.EFADV_DEVICE_ATTR_CAPS_UNSOLICITED_WRITE_RECV))
            self.has_read = bool(caps & int(ee.EFADV_DEVICE_ATTR_CAPS_RDMA_READ))
            self.gid = self.ctx.query_gid(1, 0)
            self.pd = v.pd.PD(self.ctx)
            mr_access = access(v, "IBV_ACCESS_LOCAL_WRITE", "IBV_ACCESS_REMOTE_WRITE", "IBV_ACCESS_REMOTE_READ")
            self.client = Side(self, mr_size, mr_access, client_memory)
            self.server = Side(self, mr_size, mr_access, server_memory)
            ops = int(e.IBV_QP_EX_WITH_RDMA_WRITE | e.IBV_QP_EX_WITH_RDMA_WRITE_WITH_IMM | e.IBV_QP_EX_WITH_SEND
                      | e.IBV_QP_EX_WITH_SEND_WITH_IMM)
            if self.has_read:
                ops |= int(e.IBV_QP_EX_WITH_RDMA_READ)
            wcf = e.ibv_create_cq_wc_flags
            cq_flags = int(wcf.IBV_WC_EX_WITH_BYTE_LEN | wcf.IBV_WC_EX_WITH_IMM | wcf.IBV_WC_EX_WITH_QP_NUM
                           | wcf.IBV_WC_EX_WITH_SRC_QP)
            for side in (self.client, self.server):
                efa_cq = v.efadv.EfaDVCQInitAttr(
                    int(ee.EFADV_WC_EX_WITH_IS_UNSOLICITED) if self.unsolicited else 0)
                side.cq = v.efadv.EfaCQ(self.ctx, v.cq.CqInitAttrEx(cqe=cq_depth, wc_flags=cq_flags), efa_cq)
                cap = v.qp.QPCap(max_send_wr=max_send_wr, max_recv_wr=max_recv_wr, max_send_sge=1, max_recv_sge=1)
                init = v.qp.QPInitAttrEx(qp_type=e.IBV_QPT_DRIVER, scq=side.cq, rcq=side.cq, cap=cap, pd=self.pd,
                                         comp_mask=int(e.IBV_QP_INIT_ATTR_PD | e.IBV_QP_INIT_ATTR_SEND_OPS_FLAGS),
                                         send_ops_flags=ops, sq_sig_all=sq_sig_all)
                efa_init = v.efadv.EfaQPInitAttr()
                efa_init.driver_qp_type = ee.EFADV_QP_DRIVER_TYPE_SRD
                if self.unsolicited:
                    efa_init.flags = ee.EFADV_QP_FLAGS_UNSOLICITED_WRITE_RECV
                side.qp = v.efadv.SRDQPEx(self.ctx, init, efa_init)
                attr = v.qp.QPAttr(port_num=1)
                attr.qkey = QKEY
                attr.sq_psn = side.psn
                side.qp.to_rts(attr)
            gr = v.addr.GlobalRoute(dgid=self.gid, sgid_index=0)
            self.ah = v.addr.AH(self.pd, attr=v.addr.AHAttr(port_num=1, is_global=1, gr=gr))
        except BaseException:
            self.close()
            raise

    def post(self, side: Side, op: str, sge: Any, *, dest: Side | None = None, wr_id: int = 1,
             flags: int | None = None, rkey: int | None = None, raddr: int | None = None, imm: int = 0,
             inline: bytes | None = None) -> None:
        """One WR through the extended API (op: write, write_imm, read, send); wr_complete() raises on refusal."""
        e = self.v.enums
        dest = dest or (self.server if side is self.client else self.client)
        qp = side.qp
        qp.wr_start()
        try:
            qp.wr_id = wr_id
            qp.wr_flags = int(e.IBV_SEND_SIGNALED) if flags is None else flags
            rkey = dest.mr.rkey if rkey is None else rkey
            raddr = dest.mr.buf if raddr is None else raddr
            if op == "write":
                qp.wr_rdma_write(rkey, raddr)
            elif op == "write_imm":
                qp.wr_rdma_write_imm(rkey, raddr, imm)
            elif op == "read":
                qp.wr_rdma_read(rkey, raddr)
            else:
                qp.wr_send()
            qp.wr_set_ud_addr(self.ah, dest.qp.qp_num, QKEY)
            if inline is not None:
                import ctypes

                buf = ctypes.create_string_buffer(inline, len(inline))
                qp.wr_set_inline_data(ctypes.addressof(buf), len(inline))
            else:
                qp.wr_set_sge(sge)
        except BaseException:
            qp.wr_abort()
            raise
        qp.wr_complete()

    def __enter__(self) -> SRDPair:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        ah = getattr(self, "ah", None)
        if ah is not None:
            ah.close()
        for side in (getattr(self, "client", None), getattr(self, "server", None)):
            if side is not None:
                side.close()
        for name in ("pd", "ctx"):
            obj = getattr(self, name, None)
            if obj is not None:
                obj.close()
