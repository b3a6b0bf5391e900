"""softverbs as an mlx5 device: a soft NIC that executes the send WQEs a GPU (or a CPU test) writes.

A :class:`SoftMlx5Queue` owns, in one page-aligned host mapping (what a GPU registers with
``cuMemHostRegister`` to reach it), exactly what a ConnectX QP exposes to IBGDA:

====================  ======================================================================================
send queue            ``wqe_cnt`` 64-byte WQEBBs
completion queue      ``ncqes`` 64-byte CQEs, initialised to op_own 0xf0 (opcode INVALID)
QP doorbell record    two be32 words (receive, send); the send word is what this NIC watches
CQ doorbell record    two be32 words (set_ci, arm); set_ci tells it which CQEs were consumed
UAR page              the doorbell register at ``DOORBELL_OFFSET``; every ring is checked, not needed
====================  ======================================================================================

A polling thread notices doorbell-record updates and parses each new WQE with a ConnectX's strictness
(:func:`ibgda.mlx5_layout.decode_wqe`, plus the QPN and the WQE-index stamp: mlx5 send WQEs have no
owner bit, the index in the control segment plays that role and catches a stale or unwritten slot). Good
WQEs are executed on the soft wire through a real softverbs RC QP — so in-order placement or adaptive
routing, fences, keys and access rights all behave as softverbs enforces them — and mlx5 CQEs are
written back: one per WQE with the completion-request bit (CQ_UPDATE), and one per failed WQE whatever
its bit. The first error (a malformed WQE: LOCAL_QP_OP_ERR / LOCAL_LENGTH_ERR; or what softverbs
reports: LOCAL_PROT_ERR, REMOTE_ACCESS_ERR, ...) puts the QP in the error state; every later WQE
completes with WR_FLUSH_ERR, in order, as on hardware.

Internally every softverbs WR is signalled (wr_id = WQE index), so the queue knows when each WQE is done
even when the GPU asked for no CQE; only the CQEs the WQE asked for are written. Reads of the shared
memory rely on the host's store order (x86-64 TSO), as a CPU-side stand-in for a NIC may.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np

from ibgda import mlx5_layout as L
from ibgda.device_handle import queue_pair_record
from ibgda.errors import WqeFormatError
from ibgda.queue_memory import DOORBELL_OFFSET, QueueMemory
from transportd.backends.verbs_common import Rail, access_flags, load_verbs, translate_verbs_errors

__all__ = ["DOORBELL_OFFSET", "SoftMlx5Queue", "WC_TO_SYNDROME"]

log = logging.getLogger(__name__)

# ibv_wc_status -> MLX5_CQE_SYNDROME_* (the inverse of cq.c mlx5_handle_error_cqe)
WC_TO_SYNDROME = {
    1: L.Syndrome.LOCAL_LENGTH_ERR, 2: L.Syndrome.LOCAL_QP_OP_ERR, 4: L.Syndrome.LOCAL_PROT_ERR,
    5: L.Syndrome.WR_FLUSH_ERR, 6: L.Syndrome.MW_BIND_ERR, 7: L.Syndrome.BAD_RESP_ERR,
    8: L.Syndrome.LOCAL_ACCESS_ERR, 9: L.Syndrome.REMOTE_INVAL_REQ_ERR, 10: L.Syndrome.REMOTE_ACCESS_ERR,
    11: L.Syndrome.REMOTE_OP_ERR, 12: L.Syndrome.TRANSPORT_RETRY_EXC_ERR, 13: L.Syndrome.RNR_RETRY_EXC_ERR,
    15: L.Syndrome.REMOTE_INVAL_REQ_ERR, 16: L.Syndrome.REMOTE_ABORTED_ERR,
}


def _be32(word: int) -> int:
    return int.from_bytes(int(word).to_bytes(4, "little"), "big")


@dataclass
class _Pending:
    index: int      # first WQEBB (64-bit)
    opcode: int
    completion: bool
    length: int


class SoftMlx5Queue:
    """One RC QP of a soft ConnectX: send queue, CQ, doorbell records and UAR page in host memory.

    ``device``: soft ib device name (None: the first), opened for this queue alone; or ``rail``: an open
    ``transportd.backends.verbs_common.Rail`` whose context and PD the queue shares (a daemon's rail worker: the
    regions it registered are the queue's). ``fd``: put the queue's memory in that empty memfd (sized
    and sealed here; the caller keeps its descriptor), for a client to map; ``path``: in that named file.
    ``wqe_cnt``/``ncqes``: powers of two, ncqes >= wqe_cnt (default: equal).
    ``max_inline``: largest inline payload accepted. Use as a context manager; ``connect`` (after
    exchanging ``endpoint()``) starts the polling thread.
    """

    def __init__(self, device: str | None = None, *, verbs: Any = None, wqe_cnt: int = 256, ncqes: int | None = None,
                 max_inline: int = 64, port: int = 1, gid_index: int = 0, path_mtu: int = 0,
                 poll_interval_s: float = 20e-6, cq_full_timeout_s: float = 10.0, rail: Rail | None = None,
                 path: str | None = None, fd: int | None = None) -> None:
        ncqes = ncqes or wqe_cnt
        self.mem = QueueMemory(wqe_cnt, ncqes, with_uar_page=True, path=path, fd=fd)
        self.wqe_cnt, self.ncqes, self.max_inline = wqe_cnt, ncqes, max_inline
        self.poll_interval_s, self.cq_full_timeout_s = poll_interval_s, cq_full_timeout_s
        if rail is not None:  # a daemon's rail: its PD (so its lkeys and rkeys serve), a CQ of our own
            self.v = rail.v
            self.rail = rail.sibling(2 * wqe_cnt + 8)
        else:
            self.v = load_verbs(verbs)
            self.rail = Rail(self.v, device, port=port, gid_index=gid_index, cq_depth=2 * wqe_cnt + 8)
        try:
            self._setup_memory()
            self._create_qp(path_mtu)
        except BaseException:
            self.rail.close()
            raise
        self.fetched = 0        # next WQEBB to parse
        self.posted = 0         # doorbell record, extended to 64 bits
        self.cq_pi = 0          # CQEs written
        self.error: L.Syndrome | None = None
        self.pending_error: tuple[int, int, L.Syndrome, str] | None = None  # (index, opcode, syndrome, why)
        self.outstanding: deque[_Pending] = deque()
        self.violations: list[str] = []   # what a ConnectX would not tolerate from the GPU side
        self.errors: list[str] = []       # why each error CQE was written
        self.stats = {"wqes": 0, "cqes": 0, "error_cqes": 0, "doorbells": 0, "doorbell_records": 0}
        self._last_doorbell = 0
        self._stage = np.zeros(max(64, max_inline), dtype=np.uint8)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._wake = threading.Event()

    # --- resources -----------------------------------------------------------------------------------
    def _setup_memory(self) -> None:
        m = self.mem
        self.base, self.nbytes = m.base, m.nbytes
        self.sq, self.cq, self.dbrec, self.cq_dbrec, self.doorbell = m.sq, m.cq, m.dbrec, m.cq_dbrec, m.doorbell

    def addresses(self) -> dict[str, int]:
        """Host addresses of the queue's parts (a GPU maps ``base`` .. ``base + nbytes`` and offsets them)."""
        return self.mem.addresses()

    def spans(self) -> list[tuple[int, int, bool]]:
        """What a GPU must map to post here: (host address, bytes, is I/O memory); one mapping, the stand-in
        doorbell page included."""
        return [(self.mem.base, self.mem.nbytes, False)]

    def queue_pair(self, state: int, scratch: int, scratch_lkey: int, *, translate: Any = None) -> np.ndarray:
        """The QueuePair device handle for this QP. ``state``: address of a zeroed QpState; ``scratch``:
        8 bytes registered with ``scratch_lkey`` on this queue's PD. ``translate(host_addr) -> address``
        maps the queue's host addresses into the GPU's view (identity for CPU posting)."""
        t = translate or (lambda a: a)
        return queue_pair_record({name: t(addr) for name, addr in self.addresses().items()}, qpn=self.qpn,
                                 wqe_cnt=self.wqe_cnt, ncqes=self.ncqes, scratch=scratch, scratch_lkey=scratch_lkey,
                                 state=state)

    def register(self, addr: int, length: int, *, remote_write: bool = False, remote_read: bool = False,
                 remote_atomic: bool = False) -> Any:
        """Register memory on this queue's PD (lkeys for WQEs, rkeys for a peer's)."""
        return self.rail.register(addr, length, access_flags(self.v, remote_write=remote_write,
                                                             remote_read=remote_read, remote_atomic=remote_atomic))

    def _create_qp(self, path_mtu: int) -> None:
        v, e = self.v, self.v.libibverbs_enums
        attr = self.rail.device_attr
        self.max_rd_atomic = max(1, min(16, int(attr.max_qp_init_rd_atom)))
        self.max_dest_rd_atomic = max(1, min(16, int(attr.max_qp_rd_atom)))
        self.path_mtu = int(path_mtu) or int(self.rail.port_attr.active_mtu)
        ops = e.ibv_qp_create_send_ops_flags
        cap = v.qp.QPCap(max_send_wr=self.wqe_cnt + 1, max_recv_wr=1, max_send_sge=1, max_recv_sge=1,
                         max_inline_data=self.max_inline)
        init = v.qp.QPInitAttrEx(
            qp_type=e.ibv_qp_type.IBV_QPT_RC, scq=self.rail.cq, rcq=self.rail.cq, cap=cap, pd=self.rail.pd,
            sq_sig_all=0,
            comp_mask=int(e.ibv_qp_init_attr_mask.IBV_QP_INIT_ATTR_PD
                          | e.ibv_qp_init_attr_mask.IBV_QP_INIT_ATTR_SEND_OPS_FLAGS),
            send_ops_flags=int(ops.IBV_QP_EX_WITH_RDMA_WRITE | ops.IBV_QP_EX_WITH_RDMA_READ
                               | ops.IBV_QP_EX_WITH_ATOMIC_FETCH_AND_ADD | ops.IBV_QP_EX_WITH_ATOMIC_CMP_AND_SWP))
        with translate_verbs_errors("creating the soft mlx5 QP", v):
            self.qp = v.qp.QPEx(self.rail.ctx, init)
            qattr = v.qp.QPAttr(port_num=self.rail.port)
            qattr.pkey_index = 0
            qattr.qp_access_flags = self._remote_access()
            self.qp.to_init(qattr)
        self.qpn = int(self.qp.qp_num)
        self.psn = random.getrandbits(24)
        self._signaled = int(e.ibv_send_flags.IBV_SEND_SIGNALED)
        self._fence = int(e.ibv_send_flags.IBV_SEND_FENCE)

    def _remote_access(self) -> int:
        acc = self.v.libibverbs_enums.ibv_access_flags
        return int(acc.IBV_ACCESS_REMOTE_WRITE | acc.IBV_ACCESS_REMOTE_READ | acc.IBV_ACCESS_REMOTE_ATOMIC)

    def endpoint(self) -> dict[str, Any]:
        """What the other end needs to connect (the ib backend's endpoint format)."""
        r = self.rail
        return {"transport": "ib", "qpn": self.qpn, "psn": self.psn, "lid": int(r.port_attr.lid),
                "gid": str(r.gid.gid), "port": r.port, "mtu": self.path_mtu,
                "max_dest_rd_atomic": self.max_dest_rd_atomic}

    def connect(self, remote: dict[str, Any], *, timeout: int = 14, retry_cnt: int = 7, rnr_retry: int = 7) -> None:
        """INIT -> RTR -> RTS against ``remote`` (another queue's ``endpoint()``), then start polling."""
        v = self.v
        with translate_verbs_errors(f"connecting soft mlx5 QP {self.qpn} to {remote.get('qpn')}", v):
            attr = v.qp.QPAttr(port_num=self.rail.port, path_mtu=min(self.path_mtu, int(remote["mtu"])))
            attr.pkey_index = 0
            attr.dest_qp_num = int(remote["qpn"])
            attr.rq_psn = int(remote["psn"])
            attr.max_dest_rd_atomic = self.max_dest_rd_atomic
            attr.min_rnr_timer = 12
            gid = str(remote.get("gid", ""))
            is_global = 1 if gid and any(ch not in "0:" for ch in gid) else 0
            gr = v.addr.GlobalRoute(dgid=v.addr.GID(gid), sgid_index=self.rail.gid_index) if is_global else None
            attr.ah_attr = v.addr.AHAttr(dlid=int(remote.get("lid", 0)), port_num=self.rail.port,
                                         is_global=is_global, gr=gr)
            attr.qp_access_flags = self._remote_access()
            self.qp.to_rtr(attr)
            attr.timeout, attr.retry_cnt, attr.rnr_retry = timeout, retry_cnt, rnr_retry
            attr.sq_psn = self.psn
            attr.max_rd_atomic = max(1, min(self.max_rd_atomic, int(remote.get("max_dest_rd_atomic", 1))))
            self.qp.to_rts(attr)
        self.start()

    # --- the polling thread --------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=f"soft-mlx5-qp{self.qpn}", daemon=True)
            self._thread.start()

    def kick(self) -> None:
        """Look at the doorbell record now (tests call this after writing it, to skip the poll interval)."""
        self._wake.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                busy = self.step()
            except Exception:  # a bug here must not look like a hung NIC: say it, stop serving
                log.exception("soft mlx5 QP %d: polling thread failed", self.qpn)
                self.violations.append("soft mlx5 polling thread failed (see the log)")
                return
            if not busy:
                self._wake.wait(self.poll_interval_s)
                self._wake.clear()

    def step(self) -> bool:
        """One pass: doorbell, new WQEs, completions. Returns whether anything happened."""
        busy = self._check_doorbell()
        busy |= self._fetch()
        busy |= self._complete()
        return busy

    def _check_doorbell(self) -> bool:
        word = int(self.doorbell[0])
        if word == self._last_doorbell:
            return False
        raw = word.to_bytes(8, "little")
        index = int.from_bytes(raw[1:3], "big")
        qpn = int.from_bytes(raw[4:7], "big")
        if qpn != self.qpn:
            self.violations.append(f"doorbell for QPN {qpn:#x} rung on QP {self.qpn:#x}")
        if self._last_doorbell:
            prev = int.from_bytes(self._last_doorbell.to_bytes(8, "little")[1:3], "big")
            if (index - prev) & 0xFFFF >= 0x8000:
                self.violations.append(f"doorbell went back from WQE index {prev} to {index}")
        self._last_doorbell = word
        self.stats["doorbells"] += 1
        return True

    def _fetch(self) -> bool:
        head16 = _be32(int(self.dbrec[L.SND_DBR])) & 0xFFFF
        posted = self.posted + ((head16 - self.posted) & 0xFFFF)
        if posted != self.posted:
            self.stats["doorbell_records"] += 1
            if posted - self.fetched > self.wqe_cnt:
                self.violations.append(f"doorbell record {posted} is more than {self.wqe_cnt} WQEBBs past the "
                                       f"last WQE fetched ({self.fetched}): the send queue was overrun")
            self.posted = posted
        if self.fetched == self.posted or self.pending_error is not None:
            return False
        if self.error is not None:
            if not self.outstanding:
                while self.fetched < self.posted:
                    self._flush_one()
            return True
        batch: list[tuple[int, L.DecodedWqe]] = []
        while self.fetched < self.posted:
            index = self.fetched
            raw = self._wqe_bytes(index, 1)
            try:
                w = self._parse(index, raw)
            except WqeFormatError as exc:
                opcode = raw[3]
                self.pending_error = (index, opcode, exc.syndrome, f"WQE {index}: {exc}")
                self.fetched += self._lenient_blocks(raw)
                break
            batch.append((index, w))
            self.fetched += w.basic_blocks
        if batch:
            self._post(batch)
        return True

    def _wqe_bytes(self, index: int, blocks: int) -> bytes:
        out = bytearray()
        for i in range(blocks):
            slot = (index + i) & (self.wqe_cnt - 1)
            out += self.sq[slot * L.WQE_BB:(slot + 1) * L.WQE_BB].tobytes()
        return bytes(out)

    @staticmethod
    def _lenient_blocks(raw: bytes) -> int:
        ds = raw[7] & 0x3F
        return L.wqe_basic_blocks(ds) if 0 < ds <= 16 else 1

    def _parse(self, index: int, raw: bytes) -> L.DecodedWqe:
        ds = raw[7] & 0x3F
        blocks = L.wqe_basic_blocks(ds) if ds else 1
        if blocks > 1:
            if index + blocks > self.posted:
                raise WqeFormatError(L.Syndrome.LOCAL_QP_OP_ERR, f"ds {ds} spans {blocks} WQEBBs but the doorbell "
                                       f"record covers only {self.posted - index}")
            raw = self._wqe_bytes(index, blocks)
        w = L.decode_wqe(raw, max_inline=self.max_inline)
        if w.wqe_index != index & 0xFFFF:
            raise WqeFormatError(L.Syndrome.LOCAL_QP_OP_ERR, f"the control segment says WQE index {w.wqe_index}, "
                                   f"the slot is {index & 0xFFFF} (stale from an earlier lap, or never written)")
        if w.qpn != self.qpn:
            raise WqeFormatError(L.Syndrome.LOCAL_QP_OP_ERR, f"QPN {w.qpn:#x} in a WQE of QP {self.qpn:#x}")
        return w

    def _post(self, batch: list[tuple[int, L.DecodedWqe]]) -> None:
        qp, SGE = self.qp, self.v.wr.SGE
        with translate_verbs_errors(f"posting {len(batch)} WQEs on soft mlx5 QP {self.qpn}", self.v):
            qp.wr_start()
            try:
                for index, w in batch:
                    qp.wr_id = index
                    qp.wr_flags = self._signaled | (self._fence if w.fence or w.small_fence else 0)
                    op = w.opcode
                    if op in (L.Opcode.RDMA_WRITE, L.Opcode.NOP):
                        # a NOP is a zero-length write: nothing moves, and it completes in order
                        qp.wr_rdma_write(w.rkey or 0, w.raddr or 0)
                        if w.inline is not None:
                            n = len(w.inline)
                            self._stage[:n] = np.frombuffer(w.inline, dtype=np.uint8)
                            qp.wr_set_inline_data(int(self._stage.ctypes.data), n)
                        elif w.data:
                            count, lkey, addr = w.data[0]
                            qp.wr_set_sge(SGE(addr, count, lkey))
                    elif op == L.Opcode.RDMA_READ:
                        qp.wr_rdma_read(w.rkey, w.raddr)
                        if w.data:
                            count, lkey, addr = w.data[0]
                            qp.wr_set_sge(SGE(addr, count, lkey))
                    elif op == L.Opcode.ATOMIC_FA:
                        qp.wr_atomic_fetch_add(w.rkey, w.raddr, w.swap_add)
                        qp.wr_set_sge(SGE(w.data[0][2], 8, w.data[0][1]))
                    else:  # ATOMIC_CS
                        qp.wr_atomic_cmp_swp(w.rkey, w.raddr, w.compare, w.swap_add)
                        qp.wr_set_sge(SGE(w.data[0][2], 8, w.data[0][1]))
                    self.outstanding.append(_Pending(index, op, w.completion, w.length))
                qp.wr_complete()
            except BaseException:
                qp.wr_abort()
                for _ in batch:
                    self.outstanding.pop()
                raise
        self.stats["wqes"] += len(batch)

    def _complete(self) -> bool:
        wcs = self.rail.drain.poll(256)
        busy = len(wcs) > 0
        for wr_id, status, vendor_err, byte_len in zip(wcs["wr_id"].tolist(), wcs["status"].tolist(),
                                                       wcs["vendor_err"].tolist(), wcs["byte_len"].tolist(),
                                                       strict=True):
            if not self.outstanding or self.outstanding[0].index != wr_id:
                self.violations.append(f"softverbs completed WR {wr_id} out of order")
                continue
            p = self.outstanding.popleft()
            if status == 0:
                if p.completion:
                    self._write_cqe(L.encode_cqe(pi=self.cq_pi, ncqes=self.ncqes, wqe_counter=p.index,
                                                 wqe_opcode=p.opcode, qpn=self.qpn,
                                                 byte_cnt=byte_len if p.opcode != L.Opcode.RDMA_WRITE else p.length))
                continue
            syndrome = WC_TO_SYNDROME.get(status, L.Syndrome.LOCAL_QP_OP_ERR)
            if self.error is None:
                self.errors.append(f"WQE {p.index}: completed with ibv_wc_status {status} ({syndrome.name})")
                self.error = syndrome
            self._write_err(p.index, p.opcode, syndrome, vendor_err)
        if self.pending_error is not None and not self.outstanding:
            index, opcode, syndrome, why = self.pending_error
            self.pending_error = None
            if self.error is None:
                self.errors.append(why)
                self.error = syndrome
                self._write_err(index, opcode, syndrome, 0)
            else:
                self._write_err(index, opcode, L.Syndrome.WR_FLUSH_ERR, 0)
            busy = True
        return busy

    def _flush_one(self) -> None:
        raw = self._wqe_bytes(self.fetched, 1)
        self._write_err(self.fetched, raw[3], L.Syndrome.WR_FLUSH_ERR, 0)
        self.fetched += self._lenient_blocks(raw)

    def _write_err(self, index: int, opcode: int, syndrome: int, vendor_err: int) -> None:
        self.stats["error_cqes"] += 1
        self._write_cqe(L.encode_err_cqe(pi=self.cq_pi, ncqes=self.ncqes, wqe_counter=index, wqe_opcode=opcode,
                                         qpn=self.qpn, syndrome=syndrome, vendor_err=vendor_err))

    def consumer_index(self) -> int:
        """The CQ consumer index the poller last gave back (set_ci), extended to 64 bits."""
        ci24 = _be32(int(self.cq_dbrec[L.CQ_SET_CI])) & 0xFFFFFF
        return self.cq_pi - ((self.cq_pi - ci24) & 0xFFFFFF)

    def _write_cqe(self, cqe: bytes) -> None:
        """Write one CQE at the producer index: bytes 0..62, then op_own (the entry's commit byte)."""
        if self.cq_pi - self.consumer_index() >= self.ncqes:
            deadline = time.monotonic() + self.cq_full_timeout_s
            while self.cq_pi - self.consumer_index() >= self.ncqes:
                if self._stop.is_set() or time.monotonic() > deadline:
                    self.violations.append(f"CQ overrun: {self.ncqes} CQEs written and not consumed (set_ci "
                                           f"{self.consumer_index()}); CQE {self.cq_pi} dropped")
                    return
                time.sleep(self.poll_interval_s)
        slot = (self.cq_pi & (self.ncqes - 1)) * 64
        self.cq[slot:slot + 63] = np.frombuffer(cqe, dtype=np.uint8, count=63)
        self.cq[slot + 63] = cqe[63]
        self.cq_pi += 1
        self.stats["cqes"] += 1

    # --- lifetime ------------------------------------------------------------------------------------
    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None
        qp = getattr(self, "qp", None)
        if qp is not None:
            qp.close()
            self.qp = None
        self.rail.close()
        self.mem.unlink()

    def __enter__(self) -> SoftMlx5Queue:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
