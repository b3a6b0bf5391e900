"""Rehearsals: a soft device keeps its Python warm between bursts (`DeviceOptions.rehearse_s`).

A soft device's data path is Python: a post, its frames, the peer's admission and placement, the
acknowledgement, the completion and the poll. After a few milliseconds idle that code runs three to eight
times slower than back to back (`benchmarks/post_cold_bench.py`): its code and data have left the caches,
whatever the thread did meanwhile, and on a shared host the next burst pays for bringing them back at every
step. A NIC's data path has no such cost, so a device that idles between a kernel's launches would add
hundreds of microseconds to the first landing of each that a cluster never sees.

A device configured with ``rehearse_s`` > 0 and started (`softverbs.soft.start_rehearsals`: transportd's rail
worker does so with ``softverbs.rehearse_s``) runs a rehearsal whenever its I/O loop has had no event for that
long: a few 64-byte writes between two QPs of its own (an RC pair on an ib device, posted through
`softverbs.soft.batch.post_wr_batch` as the compiled core posts; an SRD pair on an efa device), connected
through the device's own listener, so they take the same way as a peer's traffic (post, frame, socket, I/O
thread, admission, placement, acknowledgement, completion), and the completion polled through
`poll_wc_batch`. Rehearsal traffic uses its own context, memory and QPs: it never touches a user's. A
rehearsal is skipped while the device is busy, and each one counts in ``device_stats()["rehearsals"]``. It
costs a rehearsal's CPU time every ``rehearse_s`` while idle (tens of microseconds), and a burst that starts
during one waits for it at most that long.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import numpy as np

from .. import _device
from .batch import BATCH_WR_DTYPE, SET_SGE, poll_wc_batch, post_wr_batch

__all__ = ["Rehearsal", "start", "stop", "running"]

log = logging.getLogger("softverbs")

WRITES = 12  # a rehearsal's writes: a MoE dispatch's post to one peer
WRITE_BYTES = 64
COMPLETION_TIMEOUT_S = 1.0
POLL_NAP_S = 20e-6  # between two empty polls of the rehearsal's CQ
PAUSED_LOOK_S = 0.05  # how often a rehearsal configured off (rehearse_s 0) looks whether it is on again
_QKEY = 0x5EA5E

_RUNNING: dict[str, Rehearsal] = {}
_LOCK = threading.Lock()


class Rehearsal:
    """Two QPs of device ``name`` connected to each other, and the thread that rehearses on them."""

    def __init__(self, name: str, device: _device.SoftDevice) -> None:
        from softverbs import addr as am
        from softverbs import cq as cqm
        from softverbs import libibverbs_enums as e
        from softverbs import mr as mrm
        from softverbs import pd as pdm
        from softverbs import qp as qpm
        from softverbs import wr as wrm
        from softverbs.device import Context

        self.name = name
        self.device = device
        self.srd = device.is_efa
        self.checks = 0  # times the thread woke and looked whether the device had idled long enough
        self.paused_looks = 0  # times it looked whether rehearse_s, set to 0, was set again
        self._stop = threading.Event()
        ctx = self._ctx = Context(name=name)
        try:
            pd = pdm.PD(ctx)
            self.cq = cqm.CQ(ctx, 4 * WRITES)
            access = int(e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_WRITE)
            self.mr = mrm.MR(pd, 2 * WRITES * WRITE_BYTES, access)
            cap = qpm.QPCap(max_send_wr=2 * WRITES, max_recv_wr=1, max_send_sge=1, max_recv_sge=1)
            mask = int(e.IBV_QP_INIT_ATTR_PD | e.IBV_QP_INIT_ATTR_SEND_OPS_FLAGS)
            ops = int(e.IBV_QP_EX_WITH_RDMA_WRITE)
            if self.srd:
                from softverbs.providers.efa import efa_enums as ee
                from softverbs.providers.efa import efadv

                def make() -> Any:
                    init = qpm.QPInitAttrEx(qp_type=e.IBV_QPT_DRIVER, scq=self.cq, rcq=self.cq, cap=cap, pd=pd,
                                            comp_mask=mask, send_ops_flags=ops)
                    attr = efadv.EfaQPInitAttr()
                    attr.driver_qp_type = ee.EFADV_QP_DRIVER_TYPE_SRD
                    return efadv.SRDQPEx(ctx, init, attr)
            else:
                def make() -> Any:
                    init = qpm.QPInitAttrEx(qp_type=e.IBV_QPT_RC, scq=self.cq, rcq=self.cq, cap=cap, pd=pd,
                                            comp_mask=mask, send_ops_flags=ops)
                    return qpm.QPEx(ctx, init)
            self.pd = pd
            self.sender, self.receiver = make(), make()
            gid = am.GID(str(ctx.query_gid(1, 0)))
            lid = ctx.query_port(1).lid
            for qp, peer in ((self.sender, self.receiver), (self.receiver, self.sender)):
                attr = qpm.QPAttr(port_num=1)
                if self.srd:
                    attr.qkey = _QKEY
                else:
                    attr.qp_access_flags = access
                    attr.path_mtu = e.IBV_MTU_4096
                    attr.dest_qp_num = peer.qp_num
                    attr.max_dest_rd_atomic = attr.max_rd_atomic = 1
                    attr.min_rnr_timer, attr.timeout, attr.retry_cnt, attr.rnr_retry = 12, 14, 7, 7
                    attr.ah_attr = am.AHAttr(is_global=1, gr=am.GlobalRoute(dgid=gid), dlid=lid)
                qp.to_rts(attr)
            self.ah = am.AH(pd, attr=am.AHAttr(is_global=1, gr=am.GlobalRoute(dgid=gid))) if self.srd else None
            self.receiver_qpn = self.receiver.qp_num
            # the writes, as the compiled core hands a pass to post_wr_batch: first half of the MR into the second
            rows = np.zeros(WRITES, dtype=BATCH_WR_DTYPE)
            rows["wr_id"] = np.arange(WRITES)
            rows["opcode"], rows["setters"] = 0, SET_SGE  # IBV_WR_RDMA_WRITE, one SGE
            rows["sge_addr"] = self.mr.buf + WRITE_BYTES * np.arange(WRITES)
            rows["sge_length"], rows["sge_lkey"] = WRITE_BYTES, self.mr.lkey
            rows["raddr"] = self.mr.buf + WRITE_BYTES * (WRITES + np.arange(WRITES))
            rows["rkey"] = self.mr.rkey
            rows["flags"][-1] = int(e.IBV_SEND_SIGNALED)
            self._rows = rows.tobytes()
            self._signaled = int(e.IBV_SEND_SIGNALED)
            self._sges = [wrm.SGE(self.mr.buf + WRITE_BYTES * i, WRITE_BYTES, self.mr.lkey) for i in range(WRITES)]
        except BaseException:
            ctx.close()
            raise
        self._thread = threading.Thread(target=self._run, name=f"softverbs-{name}-rehearsal", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        dev = self.device
        while True:
            every = dev.options.rehearse_s
            if every <= 0:  # configured off meanwhile: paused until set again or stopped
                self.paused_looks += 1
                if self._stop.wait(PAUSED_LOOK_S):
                    return
                continue
            if self._stop.wait(every):
                return
            self.checks += 1
            if time.monotonic_ns() - dev.last_event_ns < every * 1e9:
                continue  # traffic came meanwhile: it keeps the code warm itself
            try:
                if not self.rehearse():
                    log.warning("softverbs %s: a rehearsal's writes did not complete within %.1f s", self.name,
                                COMPLETION_TIMEOUT_S)
            except Exception:  # the device's own traffic must not take it down; its users' errors show elsewhere
                log.exception("softverbs %s: rehearsal failed; rehearsals stop", self.name)
                return

    def rehearse(self) -> bool:
        """One rehearsal: the writes posted and their completions polled; False if they did not complete."""
        if self.srd:  # SRD: every WR signaled, each with its address (the efa rail's post carries them per WR)
            qp = self.sender
            qp.wr_start()
            for i in range(WRITES):
                qp.wr_id = i
                qp.wr_flags = self._signaled
                qp.wr_rdma_write(self.mr.rkey, self.mr.buf + WRITE_BYTES * (WRITES + i))
                qp.wr_set_sge(self._sges[i])
                qp.wr_set_ud_addr(self.ah, self.receiver_qpn, _QKEY)
            qp.wr_complete()
            expected = WRITES
        else:
            err = post_wr_batch(self.sender, self._rows)
            if err:
                raise OSError(err, "rehearsal post refused")
            expected = 1
        deadline = time.monotonic() + COMPLETION_TIMEOUT_S
        while expected > 0:
            got = poll_wc_batch(self.cq, 4 * WRITES)
            if len(got):
                if np.any(got["status"] != 0):
                    raise OSError(f"rehearsal completion status {got['status'].tolist()}")
                expected -= len(got)
            elif time.monotonic() > deadline:
                return False
            else:  # the I/O thread completes them: leave it the GIL and the core meanwhile
                time.sleep(POLL_NAP_S)
        self.device.stats["rehearsals"] += 1
        return True

    def close(self) -> None:
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(COMPLETION_TIMEOUT_S + 1)
        self._ctx.close()


def start(device: _device.SoftDevice) -> None:
    """Rehearse on ``device`` (its ``rehearse_s`` > 0) unless it already does."""
    with _LOCK:
        if device.name not in _RUNNING:
            _RUNNING[device.name] = Rehearsal(device.name, device)


def stop(device: _device.SoftDevice) -> None:
    """No more rehearsals on ``device``; its rehearsal's context is closed."""
    with _LOCK:
        rehearsal = _RUNNING.pop(device.name, None)
    if rehearsal is not None:
        rehearsal.close()


def running(device: _device.SoftDevice) -> bool:
    with _LOCK:
        return device.name in _RUNNING
