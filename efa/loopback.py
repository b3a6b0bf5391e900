"""Loopback RDMA writes through the rail's own EFA device: how a worker without GDRCopy puts a flag value
into GPU memory without a copy through its CUDA context (``flags.publication = "loopback"``).

One SRD QP on the rail's context and protection domain, with a CQ of its own (the data path's CQ belongs
to the compiled poster), addressed to itself. The flag words were registered on that PD when the rank's
flags were mapped, so a write lands in them through GPUDirect on a NIC, and through the soft device's
GPU accessor over softverbs. Values come from a registered staging array: each write carries the value
the shadow had when it was posted.

Writes are posted and not waited for: :meth:`LoopbackWriter.post` returns at once and
:meth:`LoopbackWriter.reap` hands back those that completed, so the worker goes on polling and posting
while its flags are on the wire (waiting for each batch held a worker on the soft fabric for most of a
launch). SRD may deliver two writes to one word in either order, so the caller keeps at most one write per
word in flight (:class:`transportd.dataplane.flag_publication.GpuFlagWords`).
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
            # one scatter entry per staging entry, made once: a post only names it (wr_set_sge copies its fields)
            base, lkey = int(self.staging.ctypes.data), int(self.mr.lkey)
            self._sges = [v.wr.SGE(base + 8 * i, 8, lkey) for i in range(depth)]
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
            self.batches = 0  # post() calls
            self.wait_ns = 0  # time post() and reap() held the worker (post waits only for a free staging entry)
            self._free = list(range(depth))  # staging entries, and so wr_ids, not in flight
            self._pending: dict[int, tuple[Any, int, int, float]] = {}  # wr_id -> (owner, slot, value, posted)
            self._reaped: list[tuple[Any, int, int]] = []  # completions a post reaped while waiting for an entry
        except BaseException:
            self.close()
            raise

    @property
    def inflight(self) -> int:
        """Writes posted and not yet reaped."""
        return len(self._pending)

    def post(self, writes: list[tuple[Any, int, int, int, int]]) -> None:
        """Post each ``(owner, slot, addr, rkey, value)`` (at most one per word in flight) without waiting for
        it; :meth:`reap` returns ``(owner, slot, value)`` once it completed. Waits only for a staging entry
        when ``depth`` writes are already in flight."""
        start = time.perf_counter_ns()
        try:
            v = self.v
            done = 0
            while done < len(writes):
                if not self._free:
                    self._reaped.extend(self._reap(block=True))
                chunk = writes[done:done + len(self._free)]
                qp = self.qp
                entries = [self._free.pop() for _ in chunk]
                with translate_verbs_errors("posting loopback flag writes", v):
                    qp.wr_start()
                    try:
                        for i, (_owner, _slot, addr, rkey, value) in zip(entries, chunk, strict=True):
                            self.staging[i] = value
                            qp.wr_id = i
                            qp.wr_flags = self.signaled  # EFA: every WR signaled
                            qp.wr_rdma_write(rkey, addr)
                            qp.wr_set_ud_addr(self.ah, self.qpn, self.qkey)
                            qp.wr_set_sge(self._sges[i])
                    except BaseException:
                        qp.wr_abort()
                        self._free.extend(entries)
                        raise
                    qp.wr_complete()
                now = time.monotonic()
                for i, (owner, slot, _addr, _rkey, value) in zip(entries, chunk, strict=True):
                    self._pending[i] = (owner, slot, value, now)
                done += len(chunk)
            self.batches += 1
        finally:
            self.wait_ns += time.perf_counter_ns() - start

    def reap(self, wait: bool = False) -> list[tuple[Any, int, int]]:
        """The writes that completed since the last call, as ``(owner, slot, value)``; with ``wait``, at least
        one if any is in flight. Raises :class:`BackendError` for a failed write (the others that completed
        with it come with the next call), or one still in flight after 5 s."""
        start = time.perf_counter_ns()
        try:
            done, self._reaped = self._reaped, []
            return done + self._reap(block=wait and not done)
        finally:
            self.wait_ns += time.perf_counter_ns() - start

    def _reap(self, block: bool) -> list[tuple[Any, int, int]]:
        out: list[tuple[Any, int, int]] = []
        while True:
            if self._pending:
                rows = self.twin.drain.poll(len(self._pending))
                failed = None
                for i, status, vendor in zip(rows["wr_id"].tolist(), rows["status"].tolist(),
                                             rows["vendor_err"].tolist(), strict=True):
                    owner, slot, value, _posted = self._pending.pop(i)
                    self._free.append(i)
                    if status:
                        failed = failed or (status, vendor)
                    else:
                        out.append((owner, slot, value))
                        self.writes += 1
                if failed:
                    self._reaped.extend(out)
                    raise BackendError(f"loopback flag write failed: status {failed[0]} (vendor error {failed[1]})")
            if (out and block) or not self._pending:
                return out
            try:
                self._check_deadline()
            except BackendError:
                self._reaped.extend(out)  # completed all the same: the next call hands them back
                raise
            if not block:
                return out
            time.sleep(0)  # yield the GIL: over softverbs the device's I/O thread completes them

    def _check_deadline(self) -> None:
        oldest = min(posted for _o, _s, _v, posted in self._pending.values())
        if time.monotonic() - oldest > _TIMEOUT_S:
            raise BackendError(f"{len(self._pending)} loopback flag writes did not complete in {_TIMEOUT_S} s")

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
