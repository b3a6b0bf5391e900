"""Loopback RDMA writes through the rail's own EFA device: how a worker without GDRCopy puts a flag value
into GPU memory without a copy through its CUDA context (``flags.publication = "loopback"``).

One SRD QP on the rail's context and protection domain, with a CQ of its own (the data path's CQ belongs
to the compiled poster), addressed to itself. The flag words were registered on that PD when the rank's
flags were mapped, so a write lands in them through GPUDirect on a NIC, and through the soft device's
GPU accessor over softverbs. Values come from a registered staging array: each write carries the value
the shadow had when it was posted.

SRD may deliver two writes to one word in either order, so a word never has two writes in flight: one
:meth:`LoopbackWriter.write` call posts at most one write per word and waits for all of them to complete
before it returns (the caller re-reads the shadow and writes again if it moved meanwhile).
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from transportd.backends.verbs_common import access_flags, translate_verbs_errors
from transportd.errors import BackendError

__all__ = ["LoopbackWriter"]

_TIMEOUT_S = 5.0


class LoopbackWriter:
    """8-byte RDMA writes from this rail to itself (``rail``: an :class:`efa.backend.EfaRail`)."""

    def __init__(self, rail: Any, qkey: int, depth: int = 256) -> None:
        self.depth = depth
        self.qp: Any = None
        self.ah: Any = None
        self.twin = rail.sibling(4 * depth)  # same PD, own CQ
        try:
            v = self.v = rail.v
            e, ee = v.libibverbs_enums, v.efa_enums
            self.staging = np.zeros(depth, dtype=np.uint64)
            self.mr = self.twin.register(int(self.staging.ctypes.data), self.staging.nbytes, access_flags(v))
            cap = v.qp.QPCap(max_send_wr=depth, max_recv_wr=1, max_send_sge=1, max_recv_sge=1, max_inline_data=0)
            init = v.qp.QPInitAttrEx(
                qp_type=e.ibv_qp_type.IBV_QPT_DRIVER, scq=self.twin.cq, rcq=self.twin.cq, cap=cap, pd=rail.pd,
                comp_mask=int(e.ibv_qp_init_attr_mask.IBV_QP_INIT_ATTR_PD
                              | e.ibv_qp_init_attr_mask.IBV_QP_INIT_ATTR_SEND_OPS_FLAGS),
                send_ops_flags=int(e.ibv_qp_create_send_ops_flags.IBV_QP_EX_WITH_RDMA_WRITE))
            efa_init = v.efadv.EfaQPInitAttr()
            efa_init.driver_qp_type = int(ee.EFADV_QP_DRIVER_TYPE_SRD)
            with translate_verbs_errors(f"creating the loopback flag QP on {rail.device_name}", v):
                self.qp = v.efadv.SRDQPEx(rail.ctx, init, efa_init)
                attr = v.qp.QPAttr(port_num=rail.port)
                attr.qkey = qkey
                attr.pkey_index = 0
                attr.sq_psn = 0
                self.qp.to_rts(attr)
                gr = v.addr.GlobalRoute(dgid=rail.gid, sgid_index=rail.gid_index)
                self.ah = v.addr.AH(rail.pd, attr=v.addr.AHAttr(port_num=rail.port, is_global=1, gr=gr))
            self.qkey = qkey
            self.qpn = int(self.qp.qp_num)
            self.signaled = int(e.ibv_send_flags.IBV_SEND_SIGNALED)
            self.writes = 0  # flag writes completed
            self.batches = 0  # write() calls: the worker waits for each
            self.wait_ns = 0  # time write() held the worker, posting and waiting
        except BaseException:
            self.close()
            raise

    def write(self, targets: list[tuple[int, int, int]]) -> None:
        """Write each ``(addr, rkey, value)`` (distinct addresses) and wait until all have completed."""
        start = time.perf_counter_ns()
        try:
            self._write(targets)
        finally:
            self.batches += 1
            self.wait_ns += time.perf_counter_ns() - start

    def _write(self, targets: list[tuple[int, int, int]]) -> None:
        v = self.v
        for start in range(0, len(targets), self.depth):
            chunk = targets[start:start + self.depth]
            qp = self.qp
            with translate_verbs_errors("posting loopback flag writes", v):
                qp.wr_start()
                try:
                    for i, (addr, rkey, value) in enumerate(chunk):
                        self.staging[i] = value
                        qp.wr_id = i
                        qp.wr_flags = self.signaled  # EFA: every WR signaled
                        qp.wr_rdma_write(rkey, addr)
                        qp.wr_set_ud_addr(self.ah, self.qpn, self.qkey)
                        qp.wr_set_sge(v.wr.SGE(int(self.staging.ctypes.data) + 8 * i, 8, int(self.mr.lkey)))
                except BaseException:
                    qp.wr_abort()
                    raise
                qp.wr_complete()
            self._wait(len(chunk))
            self.writes += len(chunk)

    def _wait(self, n: int) -> None:
        deadline = time.monotonic() + _TIMEOUT_S
        done = 0
        while done < n:
            rows = self.twin.drain.poll(n - done)
            bad = rows[rows["status"] != 0]
            if len(bad):
                raise BackendError(f"loopback flag write failed: status {int(bad[0]['status'])} "
                                   f"(vendor error {int(bad[0]['vendor_err'])})")
            done += len(rows)
            if done < n:
                if time.monotonic() > deadline:
                    raise BackendError(f"{n - done} loopback flag writes did not complete in {_TIMEOUT_S} s")
                time.sleep(0)  # yield the GIL: over softverbs the device's I/O thread completes them

    def close(self) -> None:
        if self.ah is not None:
            self.ah.close()
            self.ah = None
        if self.qp is not None:
            self.qp.close()
            self.qp = None
        twin = getattr(self, "twin", None)
        if twin is not None:
            twin.close()  # its MRs and CQ; the rail's PD and context stay
