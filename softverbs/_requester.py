"""The requester half of a QP: posting, transmission, requester completions, and the responses that arrive.

A posted WR becomes a `SendEntry` in the QP's transmit queue. Transmission walks the queue in order (an RC
send queue is processed in order): a WR carrying IBV_SEND_FENCE waits until every earlier RDMA read and
atomic on the QP has completed, and reads/atomics wait while `max_rd_atomic` of them are outstanding. Local
keys are checked when a WR is transmitted, as the NIC does when it fetches the WQE. A requester completion is
produced only when the responder's acknowledgement arrives. RC completions come out in post order; SRD
completions in whatever order the acknowledgements arrive.

What IBV_SEND_FENCE orders (ibv_post_send(3), IBTA "fence indicator"): the fenced WR is not started until
all prior RDMA Read and Atomic WRs on the same QP have completed. It does not wait for prior RDMA Writes or
Sends to be placed or acknowledged; on an in-order RC path those are ordered anyway, under adaptive routing
they are not. So a fenced flag write is ordered after the payload only if a read or an atomic sits between
them (a read or atomic executes at the responder after every earlier write on the QP is placed).

`ResponseFrameHandler` is the device's handler for frames on its requester connections: it hands each
frame's responses to their QPs.
"""

from __future__ import annotations

import errno
import functools
import time
from collections import deque
from typing import TYPE_CHECKING, Any

from . import _direct, _trace
from . import _wire as w
from ._ibv import (
    BAD_RESP,
    ERR,
    FENCE,
    FLUSH,
    INIT,
    INLINE,
    LOC_LEN,
    LOC_PROT,
    LOC_QP_OP,
    LOCAL_WRITE,
    OK,
    REMOTE_STATUSES,
    RESET,
    RESP_TIMEOUT,
    RETRY_EXC,
    RTR,
    RTS,
    SIGNALED,
    SQD,
    WC_COMP_SWAP,
    WC_FETCH_ADD,
    WC_RDMA_READ,
    WC_RDMA_WRITE,
    WC_SEND,
    mtu_bytes,
)
from ._memory import host_view
from ._mr import MRCore, scatter
from .pyverbs_error import PyverbsUserError

if TYPE_CHECKING:  # annotations only: the device owns the QPs and their connections
    from ._conn import Conn
    from ._device import SoftDevice

# ibv_wr_opcode -> wire op
WR_TO_OP = {0: w.OP_WRITE, 1: w.OP_WRITE_IMM, 2: w.OP_SEND, 3: w.OP_SEND_IMM, 4: w.OP_READ,
            5: w.OP_CSWAP, 6: w.OP_FADD}
_RC_WC_OPCODE = {w.OP_WRITE: WC_RDMA_WRITE, w.OP_WRITE_IMM: WC_RDMA_WRITE, w.OP_SEND: WC_SEND,
                 w.OP_SEND_IMM: WC_SEND, w.OP_READ: WC_RDMA_READ, w.OP_FADD: WC_FETCH_ADD,
                 w.OP_CSWAP: WC_COMP_SWAP}
# EFA reports RDMA write for writes and IBV_WC_SEND for everything else on the send queue, reads included.
_EFA_WC_OPCODE = {w.OP_WRITE: WC_RDMA_WRITE, w.OP_WRITE_IMM: WC_RDMA_WRITE}
# send_ops_flags bit needed for each wire op on an extended QP
OP_SEND_OPS_BIT = {w.OP_WRITE: 1 << 0, w.OP_WRITE_IMM: 1 << 1, w.OP_SEND: 1 << 2, w.OP_SEND_IMM: 1 << 3,
                   w.OP_READ: 1 << 4, w.OP_CSWAP: 1 << 5, w.OP_FADD: 1 << 6}


class SendEntry:
    """One posted send-queue WR. Class attributes are the defaults, so posting sets only what it needs."""

    seq = 0
    sges: list[tuple[int, int, int]] = []
    inline: bytes | None = None
    rkey = 0
    raddr = 0
    imm = 0
    add = 0
    swap = 0
    status: int | None = None
    byte_len = 0
    dest: tuple[str, int] | None = None
    dest_qpn = 0
    qkey = 0
    conn: Conn | None = None
    local: list[tuple[MRCore, int, int]] = []
    land = 0.0  # a streamed write's modeled landing (`SoftDevice.depart`): its completion waits for it

    def __init__(self, wr_id: int, op: int, flags: int, sig_all: bool, rkey: int = 0, raddr: int = 0, imm: int = 0,
                 add: int = 0, swap: int = 0) -> None:
        self.wr_id = wr_id
        self.op = op
        self.signaled = sig_all or bool(flags & SIGNALED)
        self.fence = bool(flags & FENCE)
        if rkey:  # the rest only where set: the class's defaults stand for zero
            self.rkey = rkey
        if raddr:
            self.raddr = raddr
        if imm:
            self.imm = imm
        if add:
            self.add = add
        if swap:
            self.swap = swap

    def length(self) -> int:
        if self.inline is not None:
            return len(self.inline)
        n = 0
        for sge in self.sges:
            n += sge[1]
        return n


def _payload(e: SendEntry) -> list[Any]:
    """The bytes of a write or send, as the pieces a frame carries (host memory by view, no copy)."""
    if e.inline is not None:
        return [e.inline]
    out: list[Any] = []
    for mr, addr, n in e.local:
        view = mr.view
        if view is not None:
            off = addr - mr.addr
            out.append(view[off:off + n])
        else:
            out.append(mr.read(addr, n))
    return out


def _srd_direct_desc(dst_qpn: int, qpn: int, e: SendEntry, flags: int, mtu_code: int, length: int,
                     ref: tuple[int, int], land: float) -> bytes:
    """An SRD direct write's descriptor, its landing in the psn field (unused on SRD: `w.land_field`)."""
    return w.REQ.pack(dst_qpn, qpn, e.seq, e.op, flags, mtu_code, e.imm, e.rkey, e.qkey, e.raddr, length,
                      w.land_field(land), ref[0], ref[1])


class QPRequester:
    """The requester half of `QPCore` (posting, transmission, completions, responses), mixed into it.

    Runs under the QP's `lock`; `QPCore` holds what both halves share (state, attributes, caps, CQs).
    """

    def _init_requester(self) -> None:
        self.next_seq = 1
        self.sq_posted = 0
        self.sq_retired = 0  # slots the QP's own threads freed, under its lock
        self.sq_polled = 0  # slots polls freed, under the send CQ's lock (`CQCore.take`)
        self.order: deque[SendEntry] = deque()
        self.txq: deque[SendEntry] = deque()
        self.inflight: dict[int, SendEntry] = {}
        self.rd_out = 0
        self.unsig = 0
        self.tx_psn = 0
        self.tx_halted = False
        self.retire_due = 0.0  # when `_retire_landed` runs next (0: not armed)
        self.wr_list: list[SendEntry] | None = None
        self.wr_list_err = 0
        # response batches not yet applied, with the connection each came on (see `rx_responses`)
        self.inbox: deque[tuple[Conn, list[tuple]]] = deque()

    def _sq_full(self, extra: int) -> bool:
        return max(0, self.sq_posted - self.sq_retired - self.sq_polled) + extra >= self.max_send_wr

    def validate_legacy(self, wr: tuple, nreq: int) -> int:
        """post_send checks, per provider, returning an errno (0 = accepted)."""
        _wr_id, opcode, flags, sges, _imm, _rkey, _raddr, _ca, _sw, _ud = wr
        if self.efa:  # providers/efa/verbs.c efa_post_send_validate{,_wr}
            if self.state not in (RTS, SQD):
                return errno.EINVAL
            if not (flags & SIGNALED) and not self.sq_sig_all:
                return errno.EINVAL
            if flags & ~(SIGNALED | INLINE):
                return errno.EINVAL
            if self._sq_full(nreq):
                return errno.ENOMEM
            if opcode not in (2, 3):  # only SEND / SEND_WITH_IMM through ibv_post_send
                return errno.EINVAL
            if flags & INLINE:
                if sum(s[1] for s in sges) > self.max_inline:
                    return errno.EINVAL
            elif len(sges) > self.max_send_sge:
                return errno.EINVAL
            return 0
        # mlx5 (providers/mlx5/qp.c _mlx5_post_send); soft also refuses posting before RTS, where a real
        # QP would silently hold the WR forever.
        if self.state in (RESET, INIT, RTR):
            return errno.EINVAL
        if opcode not in WR_TO_OP:
            return errno.EINVAL
        if self._sq_full(nreq):
            return errno.ENOMEM
        if len(sges) > self.max_send_sge:
            return errno.ENOMEM
        if flags & INLINE and WR_TO_OP[opcode] in w.DATA_OPS:
            if sum(s[1] for s in sges) > self.max_inline:
                return errno.ENOMEM
        return 0

    def post_legacy(self, wrs: list[tuple]) -> tuple[int, int]:
        """ibv_post_send: WRs before the first bad one are posted; returns (errno, index of the bad WR)."""
        with self.lock:
            if _trace.DIR:
                _trace.stamp("locked")
            err, bad = 0, -1
            for i, wr in enumerate(wrs):
                err = self.validate_legacy(wr, 0)  # earlier WRs of the chain are already counted as posted
                if err:
                    bad = i
                    break
                wr_id, opcode, flags, sges, imm, rkey, raddr, cmp_add, swap, ud = wr
                e = SendEntry(wr_id, WR_TO_OP[opcode], flags, self.sq_sig_all)
                op = e.op
                if op in w.DATA_OPS and flags & INLINE:
                    e.inline = b"".join(bytes(host_view(a, n)) for a, n, _k in sges)
                else:
                    e.sges = list(sges)
                e.imm = imm
                e.rkey, e.raddr = rkey, raddr
                if op == w.OP_CSWAP:
                    e.add, e.swap = cmp_add, swap
                elif op == w.OP_FADD:
                    e.add = cmp_add
                if ud is not None:
                    e.dest, e.dest_qpn, e.qkey = ud
                self._enqueue(e)
            self._kick()
        if self.inbox:
            self.drain_inbox()
        return err, bad

    # -- the extended API's WR list (ibv_wr_start .. ibv_wr_complete)
    def wr_start(self) -> None:
        self.wr_list = []
        self.wr_list_err = 0

    def wr_op(self, op: int, wr_id: int, flags: int, rkey: int = 0, raddr: int = 0, imm: int = 0,
              add: int = 0, swap: int = 0) -> None:
        """One wr_* call inside a WR list; a refusal is remembered and reported by wr_complete()."""
        wrs = self.wr_list
        if wrs is None:
            raise PyverbsUserError("wr_* called outside wr_start()/wr_complete()")
        if self.wr_list_err:
            return
        full = self.sq_posted - self.sq_retired - self.sq_polled + len(wrs) >= self.max_send_wr
        if self.efa:  # efa_post_send_validate order: state, signaled, flags, queue space
            if self.state not in (RTS, SQD) or (not (flags & SIGNALED) and not self.sq_sig_all) \
                    or flags & ~(SIGNALED | INLINE):
                self.wr_list_err = errno.EINVAL
                return
            if full:
                self.wr_list_err = errno.ENOMEM
                return
        else:
            if full:
                self.wr_list_err = errno.ENOMEM
                return
            if self.state < RTS:
                self.wr_list_err = errno.EINVAL
                return
        wrs.append(SendEntry(wr_id, op, flags, self.sq_sig_all, rkey, raddr, imm, add, swap))

    def wr_rows(self, ops: list[int], wr_ids: list[int], flags: list[int], rkeys: list[int], raddrs: list[int],
                imms: list[int], adds: list[int], swaps: list[int], sges: list[tuple[int, int, int] | None]) -> None:
        """Many ``wr_op`` calls inside a WR list, each followed by ``wr_set_sge(*sge)`` where its SGE is not None:
        the same checks in the same order, the first refusal remembered for wr_complete(), without a call per WR
        (`softverbs.soft.batch.post_wr_batch`: a pass's list in one)."""
        wrs = self.wr_list
        if wrs is None:
            raise PyverbsUserError("wr_* called outside wr_start()/wr_complete()")
        if self.wr_list_err:
            return
        # a WR is refused ENOMEM from the first one past the queue's room (wr_op's `full`, WR by WR)
        room = self.max_send_wr - (self.sq_posted - self.sq_retired - self.sq_polled + len(wrs))
        sig_all = self.sq_sig_all
        if self.efa:  # efa_post_send_validate order: state, signaled, flags, queue space
            state_ok = self.state in (RTS, SQD)
            for i, f in enumerate(flags):
                if not state_ok or (not (f & SIGNALED) and not sig_all) or f & ~(SIGNALED | INLINE):
                    self.wr_list_err = errno.EINVAL
                    break
                if i >= room:
                    self.wr_list_err = errno.ENOMEM
                    break
        elif flags:  # mlx5: queue space, then state, WR by WR; the state is the same for every WR
            if room <= 0:
                self.wr_list_err = errno.ENOMEM
            elif self.state < RTS:
                self.wr_list_err = errno.EINVAL
            elif len(flags) > room:
                self.wr_list_err = errno.ENOMEM
        if self.wr_list_err:
            return
        append = wrs.append
        for op, wr_id, f, rkey, raddr, imm, add, swap, sge in zip(ops, wr_ids, flags, rkeys, raddrs, imms, adds, swaps,
                                                                  sges, strict=True):
            e = SendEntry(wr_id, op, f, sig_all, rkey, raddr, imm, add, swap)
            if sge is not None:
                e.sges = (sge,)
            append(e)

    def wr_set_sge(self, addr: int, length: int, lkey: int) -> None:
        """wr_set_sge: the fast single-SGE form of wr_set_sges."""
        wrs = self.wr_list
        if wrs and not self.wr_list_err:
            e = wrs[-1]
            e.sges = ((addr, length, lkey),)
            e.inline = None
        elif wrs is None:
            self._wr_cur()

    def _wr_cur(self) -> SendEntry | None:
        if self.wr_list is None:
            raise PyverbsUserError("wr_set_* called outside wr_start()/wr_complete()")
        if self.wr_list_err or not self.wr_list:
            return None
        return self.wr_list[-1]

    def wr_set_sges(self, sges: list[tuple[int, int, int]]) -> None:
        e = self._wr_cur()
        if e is None:
            return
        if self.efa:
            limit = 1 if e.op in (w.OP_WRITE, w.OP_WRITE_IMM, w.OP_READ) else self.max_send_sge
            if len(sges) > limit:
                self.wr_list_err = errno.EINVAL
                return
        elif len(sges) > self.max_send_sge:
            self.wr_list_err = errno.ENOMEM
            return
        e.sges = list(sges)
        e.inline = None

    def wr_set_inline(self, data: bytes) -> None:
        e = self._wr_cur()
        if e is None:
            return
        if len(data) > self.max_inline:
            self.wr_list_err = errno.EINVAL if self.efa else errno.ENOMEM
            return
        if self.efa and e.op not in (w.OP_SEND, w.OP_SEND_IMM):
            # rdma-core 59 would copy the bytes over the RDMA descriptor (the remote address); later
            # releases refuse it. Refuse, so a backend never relies on inline RDMA on EFA.
            self.wr_list_err = errno.EINVAL
            return
        e.inline = data
        e.sges = []

    def wr_set_ud(self, dest: tuple[str, int] | None, qpn: int, qkey: int) -> None:
        e = self._wr_cur()
        if e is None:
            return
        e.dest, e.dest_qpn, e.qkey = dest, qpn, qkey

    def wr_complete(self) -> int:
        with self.lock:
            if _trace.DIR:  # the QP's lock, which its I/O thread holds while it places the peer's requests
                _trace.stamp("locked")
            wrs, err = self.wr_list, self.wr_list_err
            self.wr_list = None
            if wrs is None:
                raise PyverbsUserError("wr_complete() without wr_start()")
            if err:
                return err
            seq = self.next_seq
            for e in wrs:
                e.seq = seq
                seq += 1
            self.next_seq = seq
            self.sq_posted += len(wrs)
            if not self.srd:
                self.order.extend(wrs)
            self.txq.extend(wrs)
            self._kick()
        if self.inbox:
            self.drain_inbox()
        return 0

    def wr_abort(self) -> None:
        self.wr_list = None

    # -- queueing and transmission
    def _enqueue(self, e: SendEntry) -> None:
        e.seq = self.next_seq
        self.next_seq += 1
        self.sq_posted += 1
        if not self.srd:
            self.order.append(e)
        self.txq.append(e)

    def _kick(self) -> None:
        if self.state == ERR:
            self._flush_sq()
        else:
            self._pump_tx()

    def _ar(self) -> bool:
        return self.device.options.adaptive_routing if self.ar is None else self.ar

    def _check_local(self, e: SendEntry) -> int:
        """Resolve the WR's local SGEs: lkey, PD, bounds, and LOCAL_WRITE where the NIC writes."""
        sges = e.sges
        if len(sges) == 1 and e.op in w.DATA_OPS:
            addr, length, lkey = sges[0]
            mr = self.device.mrs_by_lkey.get(lkey)
            if mr is not None and mr.valid and mr.pd is self.pd and mr.addr <= addr \
                    and addr + length <= mr.addr + mr.length:
                e.local = ((mr, addr, length),)
                return OK
            if length:
                return LOC_PROT
        lookup = self.device.mrs_by_lkey
        needs_write = e.op in w.RD_ATOMIC_OPS
        local = []
        for addr, length, lkey in e.sges:
            if length == 0:
                continue
            mr = lookup.get(lkey)
            if mr is None or not mr.valid or mr.pd is not self.pd or addr < mr.addr \
                    or addr + length > mr.addr + mr.length:
                return LOC_PROT
            if needs_write and not mr.access & LOCAL_WRITE:
                return LOC_PROT
            local.append((mr, addr, length))
        if e.op in (w.OP_FADD, w.OP_CSWAP) and sum(x[2] for x in local) != 8:
            return LOC_LEN
        e.local = local
        return OK

    def _pump_tx(self) -> None:
        """Transmit queued WRs in order, as far as fence and outstanding-read limits allow (lock held).

        A shaped device (or one whose departure queue is not empty) hands each request to its departure
        queue instead of a frame, or sends it itself once it lands when that is soon (`SoftDevice.depart`),
        but for one to the device itself (`Conn.loopback`: never on the wire);
        a write from exported device memory that the peer has opened goes as a reference (F_DIRECT)
        instead of its bytes.
        """
        txq = self.txq
        if not txq or self.tx_halted:
            return
        if _trace.DIR:  # the post's WRs are queued: what follows is framing them (or their departures)
            _trace.stamp("pump")
        frames: dict[Conn, tuple[list[bytes], list[Any]]] = {}
        dev = self.device
        srd = self.srd
        base_flags = (w.F_SRD if srd else (w.F_AR if self._ar() else 0)) | ((self.rnr_retry & 7) << w.RNR_SHIFT)
        mtu_code = self.path_mtu
        mtu = mtu_bytes(mtu_code)
        pack = w.REQ.pack
        qpn = self.qpn
        inflight = self.inflight
        data_ops = w.DATA_OPS
        rd_ops = w.RD_ATOMIC_OPS
        max_rdma = dev.options.max_rdma_size
        shaped = dev.options.shaped() or dev.departing()
        # this post's requests that land within nic_spin_s: sent by this thread once they land (`depart`)
        soon: list[tuple] | None = [] if shaped and dev.options.nic_spin_s > 0 else None
        direct = _direct.copier() is not None
        failed: list[SendEntry] = []
        last_dest: Any = None
        remote = self.remote
        dest_qpn = self.dest_qpn
        conn: Conn | None = None
        descs: list[bytes] = []
        payloads: list[Any] = []
        while txq:
            e = txq[0]
            op = e.op
            if op == 1 and not srd and not e.fence and e.status is None and conn is not None \
                    and remote == last_dest:
                # fast path: an RC write to the connection of the previous WR
                txq.popleft()
                if self._check_local(e):
                    e.status = LOC_PROT
                    self.tx_halted = True
                    break
                length = e.length()
                psn = self.tx_psn
                self.tx_psn = (psn + (-(-length // mtu) or 1)) & 0xFFFFFF
                e.conn = conn
                ref = self._direct_ref(conn, e) if direct and e.inline is None else None
                seq = e.seq
                if ref is None:
                    desc = pack(dest_qpn, qpn, seq, 1, base_flags, mtu_code, 0, e.rkey, 0, e.raddr, length, psn, 0, 0)
                else:
                    desc = pack(dest_qpn, qpn, seq, 1, base_flags | w.F_DIRECT, mtu_code, 0, e.rkey, 0, e.raddr, length,
                                psn, ref[0], ref[1])
                inflight[seq] = e
                if shaped and not conn.loopback:
                    if ref is None:
                        dev.depart(conn, self, desc, _payload(e), length, soon)
                    else:  # its bytes are copied as the link carries them; its completion waits for the last
                        e.land = dev.depart(conn, self, desc, [], length, soon, streamed=True)
                    continue
                descs.append(desc)
                if ref is None:
                    payloads.extend(_payload(e))
                if len(descs) >= w.MAX_DESCS_PER_FRAME:
                    del frames[conn]
                    if not conn.send_frame(w.KIND_REQ, descs, payloads):
                        failed.extend(x for x in list(inflight.values()) if x.conn is conn)
                    last_dest = None
                continue
            is_rd = op in rd_ops
            if not srd:
                if e.fence and self.rd_out:
                    break
                if is_rd:
                    if self.max_rd_atomic == 0:
                        e.status = LOC_QP_OP
                    elif self.rd_out >= self.max_rd_atomic:
                        break
            txq.popleft()
            status = e.status if e.status is not None else self._check_local(e)
            if op in data_ops:
                length = e.length()
            elif op == w.OP_READ:
                length = sum(sge[1] for sge in e.sges)
            else:
                length = 8
            if status == OK and srd:
                if e.dest is None:
                    status = LOC_QP_OP  # no address handle: EFA's INVALID_AH
                elif op in (w.OP_WRITE, w.OP_WRITE_IMM, w.OP_READ) and length > max_rdma:
                    status = LOC_LEN
            if status != OK:
                e.status = status
                if srd:
                    self._complete(e)
                    continue
                self.tx_halted = True  # the NIC stops at the failing WQE; the QP is about to fail
                break
            if srd:
                dest, dst_qpn = e.dest, e.dest_qpn
                psn = 0
            else:
                dest, dst_qpn = remote, dest_qpn
                psn = self.tx_psn
                npkts = 1 if op in (w.OP_FADD, w.OP_CSWAP) else max(1, -(-length // mtu))
                self.tx_psn = (psn + npkts) & 0xFFFFFF
            if dest != last_dest or conn is None:
                conn = dev.connection(dest) if dest is not None else None
                last_dest = dest
                if conn is None:
                    e.status = RESP_TIMEOUT if srd else RETRY_EXC
                    failed.append(e)
                    if not srd:
                        break
                    continue
                frame = frames.get(conn)
                if frame is None:
                    frame = frames[conn] = ([], [])
                descs, payloads = frame
            e.conn = conn
            ref = None
            if direct and e.inline is None and (op == w.OP_WRITE or op == w.OP_WRITE_IMM):
                ref = self._direct_ref(conn, e)
            departs = shaped and not conn.loopback
            # a shaped direct write is copied as the link carries it, and its completions wait for its landing:
            # on RC here (`_rc_retire`), on SRD at the responder, told the landing in the psn field, which SRD
            # does not use (`w.land_field`), so its descriptor is packed once that is known (`SoftDevice.depart`)
            streamed = departs and ref is not None and (srd or op == w.OP_WRITE)
            desc: bytes | functools.partial[bytes]
            if ref is None:
                desc = pack(dst_qpn, qpn, e.seq, op, base_flags, mtu_code, e.imm, e.rkey, e.qkey, e.raddr, length, psn,
                            e.add, e.swap)
                pieces = _payload(e) if op in data_ops else []
            elif streamed and srd:
                desc = functools.partial(_srd_direct_desc, dst_qpn, qpn, e, base_flags | w.F_DIRECT, mtu_code, length,
                                         ref)
                pieces = []
            else:
                desc = pack(dst_qpn, qpn, e.seq, op, base_flags | w.F_DIRECT, mtu_code, e.imm, e.rkey, e.qkey,
                            e.raddr, length, psn, ref[0], ref[1])
                pieces = []
            inflight[e.seq] = e
            if is_rd:
                self.rd_out += 1
            if departs:
                land = dev.depart(conn, self, desc, pieces, length if op in data_ops else 0, soon, streamed=streamed)
                if streamed and not srd:
                    e.land = land
                continue
            descs.append(desc)
            payloads.extend(pieces)
            if len(descs) >= w.MAX_DESCS_PER_FRAME:
                assert conn is not None
                del frames[conn]
                if not conn.send_frame(w.KIND_REQ, descs, payloads):
                    failed.extend(x for x in list(inflight.values()) if x.conn is conn)
                last_dest = None
        if soon:
            dev.send_now(soon)
        for fconn, (fdescs, fpayloads) in frames.items():
            if fdescs and not fconn.send_frame(w.KIND_REQ, fdescs, fpayloads):
                failed.extend(x for x in list(inflight.values()) if x.conn is fconn)
        for e in failed:
            inflight.pop(e.seq, None)
            if e.status is None or e.status == OK:
                e.status = RESP_TIMEOUT if srd else RETRY_EXC
            if srd:
                self._complete(e)
        if not srd:
            self._rc_retire()
        if _trace.DIR:  # framed and sent (or queued to depart): what is left of the post is letting go of the lock
            _trace.stamp("pumped")

    def _direct_ref(self, conn: Conn, e: SendEntry) -> tuple[int, int] | None:
        """(export id, offset) when write ``e`` can go as a reference to its device memory on ``conn``.

        The first write of an allocation on a connection asks the peer to open it (IMPORT) and crosses
        the wire; once the peer has answered that it did, the allocation's writes go as references.
        """
        local = e.local
        if len(local) != 1:
            return None
        mr, addr, n = local[0]
        if mr.view is not None or not n:
            return None
        dev = self.device
        ex = dev.export_for(mr)
        if ex is None:
            return None
        state = conn.peer_imports.get(ex.id)
        if state == _direct.CONFIRMED:
            dev.stats["direct_sent"] += 1
            return ex.id, addr - ex.base
        if state is None:
            conn.peer_imports[ex.id] = _direct.PENDING
            with dev.lock:
                ex.conns.add(conn)
            conn.send_frame(w.KIND_IMPORT, [], [ex.record()], count=ex.id)
        dev.stats["device_wire_writes"] += 1
        return None

    # -- completion
    def _wc_opcode(self, op: int) -> int:
        if self.efa:
            return _EFA_WC_OPCODE.get(op, WC_SEND)
        return _RC_WC_OPCODE[op]

    def _complete(self, e: SendEntry) -> None:
        """SRD: one WR's completion, in arrival order (a streamed write's responder acknowledges it only once
        it has landed)."""
        if e.signaled or e.status != OK:
            self.scq.push((e.wr_id, e.status, self._wc_opcode(e.op), 0, self.qpn, 0, 0, 0, 0, self, 1, 0,
                           False))
        else:
            self.sq_retired += 1

    def _rc_retire(self) -> None:
        """RC: completions in post order; the first error fails the QP. A streamed write acknowledged before
        its modeled landing (its copy ran while the link carried it) completes at the landing, and the
        completions after it wait with it (`_retire_at`)."""
        order = self.order
        push = self.scq.push
        while order and order[0].status is not None:
            e = order[0]
            if e.land and e.status == OK and e.land > time.monotonic():
                self._retire_at(e.land)
                return
            order.popleft()
            self.unsig += 1
            if e.status != OK:
                push((e.wr_id, e.status, self._wc_opcode(e.op), 0, self.qpn, 0, 0, 0, 0, self, self.unsig, 0,
                      False))
                self.unsig = 0
                self.enter_error()
                return
            if e.signaled:
                push((e.wr_id, OK, _RC_WC_OPCODE[e.op], e.byte_len, self.qpn, 0, 0, 0, 0, self, self.unsig, 0,
                      False))
                self.unsig = 0

    def _retire_at(self, when: float) -> None:
        """Retire again at ``when`` (on the I/O thread), unless a retirement is due by then already."""
        if 0.0 < self.retire_due <= when:
            return
        self.retire_due = when
        self.device.at_landing(when, self._retire_landed)

    def _retire_landed(self) -> None:
        with self.lock:
            self.retire_due = 0.0
            if not self.closed:
                self._rc_retire()

    def _flush_sq(self) -> None:
        push = self.scq.push
        entries: list[SendEntry] = list(self.order) if not self.srd else \
            list(self.inflight.values()) + [e for e in self.txq if e.seq not in self.inflight]
        self.order.clear()
        self.txq.clear()
        self.inflight.clear()
        self.rd_out = 0
        for e in entries:
            push((e.wr_id, FLUSH, self._wc_opcode(e.op), 0, self.qpn, 0, 0, 0, 0, self, 1 + self.unsig, 0,
                  False))
            self.unsig = 0


    def rx_responses(self, conn: Conn, items: list[tuple]) -> None:
        """Responses arrived on ``conn`` for our requests (I/O thread): (descriptor, data, placed_directly) each.

        They are queued and applied by whichever thread holds the QP lock: if a posting thread holds it,
        that thread applies them when it lets go (see `drain_inbox`), so the I/O thread never waits. Not
        every holder looks at the queue when it lets go (the I/O thread itself, placing a request that
        arrived for this QP, takes the lock a posting thread just released), so a queue left behind is
        retried by the I/O thread until applied (`SoftDevice.retry_inboxes`): else the last responses of a
        stream could wait for a post that never comes.
        """
        self.inbox.append((conn, items))
        if not self.drain_inbox():
            self.device.inbox_waiting.add(self)

    def drain_inbox(self) -> bool:
        """Apply the queued responses unless another thread holds the QP; False when some are left."""
        inbox = self.inbox
        lock = self.lock
        while inbox:
            if not lock.acquire(blocking=False):
                return False
            try:
                while inbox:
                    self._apply_responses(*inbox.popleft())
            finally:
                lock.release()
        return True

    def _apply_responses(self, conn: Conn, items: list[tuple]) -> None:
        """Apply responses that came on ``conn``. A response answers only a request in flight that went out on
        that connection, as a NIC takes only the responses of its own connection's outstanding PSNs; any other
        is a ghost and dropped. One that answers a request with another operation, an unknown status or read
        data of the wrong length fails that request as a bad response (IBV_WC_BAD_RESP_ERR)."""
        inflight = self.inflight
        srd = self.srd
        for d, data, direct in items:
            _qpn, status, op, _r, seq, length, _p, value = d
            if op == w.OP_ACK:
                if status != OK:
                    continue
                # at most the requests in flight: a peer's range of 2**32 must not cost 2**32 steps
                acked = range(seq, seq + length) if length <= len(inflight) else \
                    [s for s in inflight if seq <= s < seq + length]
                for s in acked:
                    e = inflight.get(s)
                    if e is not None and e.conn is conn and e.op in w.DATA_OPS:
                        del inflight[s]
                        e.status = OK
                        if srd:
                            self._complete(e)
                continue
            e = inflight.get(seq)
            if e is None or e.conn is not conn:
                continue
            del inflight[seq]
            if op != e.op or status not in REMOTE_STATUSES:
                status = BAD_RESP
            elif status == OK:
                if op == w.OP_READ:
                    if length != e.length() or length and not direct and data is None:
                        status = BAD_RESP
                    else:
                        if data is not None and not direct:
                            scatter(e.local, data)
                        e.byte_len = length
                elif op in (w.OP_FADD, w.OP_CSWAP):
                    scatter(e.local, (value & w.MASK64).to_bytes(8, "little"))
                    e.byte_len = 8
            e.status = status
            if e.op in w.RD_ATOMIC_OPS:
                self.rd_out -= 1
            if srd:
                self._complete(e)
        if not srd:
            self._rc_retire()
            if self.txq and self.state != ERR:
                self._pump_tx()

    def conn_lost(self, conn: Conn) -> None:
        with self.lock:
            lost = [e for e in self.inflight.values() if e.conn is conn]
            for e in lost:
                del self.inflight[e.seq]
                if e.op in w.RD_ATOMIC_OPS:
                    self.rd_out -= 1
                e.status = RESP_TIMEOUT if self.srd else RETRY_EXC
                if self.srd:
                    self._complete(e)
            if lost and not self.srd:
                self._rc_retire()


class ResponseFrameHandler:
    """Frame handler for responses arriving on this device's requester connections."""

    def __init__(self, dev: SoftDevice) -> None:
        self.dev = dev

    def begin_frame(self, conn: Conn, kind: int) -> None:
        if kind != w.KIND_RSP:
            raise ValueError("request frame on a requester connection")
        conn.plan = None
        conn.pending = []

    @staticmethod
    def payload_len(d: tuple) -> int:
        return d[5] if d[2] == w.OP_READ and d[1] == OK else 0

    def sink_for(self, conn: Conn, d: tuple, n: int) -> memoryview | None:
        """Where a read response's ``n`` bytes go: the read's own memory, a buffer to scatter, or None (dropped)
        when they answer no read of this connection or not its length."""
        qp = self.dev.qps.get(d[0])
        e = qp.inflight.get(d[4]) if qp is not None else None
        conn.plan = False
        if e is None or e.conn is not conn or e.op != w.OP_READ or e.length() != n:
            return None
        if len(e.local) == 1 and e.local[0][0].view is not None:
            mr, addr, _ = e.local[0]
            conn.plan = True
            return mr.view_at(addr, n)
        return memoryview(bytearray(n))

    def on_item(self, conn: Conn, d: tuple, data: memoryview | None) -> None:
        conn.pending.append((d, data, bool(conn.plan)))
        conn.plan = None

    def end_frame(self, conn: Conn) -> None:
        """Apply the frame's responses, taking each QP's lock once."""
        items, conn.pending = conn.pending, []
        qps = self.dev.qps
        if items and all(it[0][0] == items[0][0][0] for it in items):
            qp = qps.get(items[0][0][0])
            if qp is not None:
                qp.rx_responses(conn, items)
            return
        by_qp: dict[int, list[tuple]] = {}
        for it in items:
            by_qp.setdefault(it[0][0], []).append(it)
        for qpn, group in by_qp.items():
            qp = qps.get(qpn)
            if qp is not None:
                qp.rx_responses(conn, group)

    @staticmethod
    def fast_frame(conn: Conn, descs: list[tuple], mv: memoryview, pos: int) -> tuple[int, int]:
        return 0, pos

    def conn_lost(self, conn: Conn) -> None:
        for qp in list(self.dev.qps.values()):
            qp.conn_lost(conn)

    @staticmethod
    def on_imported(conn: Conn, xid: int, opened: bool) -> None:
        """IMPORTED: the peer opened (or refused) export ``xid``; its writes go as references from now on."""
        if conn.peer_imports.get(xid) == _direct.PENDING:
            conn.peer_imports[xid] = _direct.CONFIRMED if opened else _direct.DECLINED
