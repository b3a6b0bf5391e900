"""The RDMA semantics softverbs enforces: queues, keys, placement order and completions.

Requester. A posted WR becomes a `SendEntry` in the QP's transmit queue. Transmission walks the queue in
order (an RC send queue is processed in order): a WR carrying IBV_SEND_FENCE waits until every earlier
RDMA read and atomic on the QP has completed, and reads/atomics wait while `max_rd_atomic` of them are
outstanding. Local keys are checked when a WR is transmitted, as the NIC does when it fetches the WQE. A
requester completion is produced only when the responder's acknowledgement arrives. RC completions come
out in post order; SRD completions in whatever order the acknowledgements arrive.

What IBV_SEND_FENCE orders (ibv_post_send(3), IBTA "fence indicator"): the fenced WR is not started until
all prior RDMA Read and Atomic WRs on the same QP have completed. It does not wait for prior RDMA Writes or
Sends to be placed or acknowledged; on an in-order RC path those are ordered anyway, under adaptive routing
they are not. So a fenced flag write is ordered after the payload only if a read or an atomic sits between
them (a read or atomic executes at the responder after every earlier write on the QP is placed).

Responder. Requests are checked on arrival (QP state, source QP, PSN, rkey, bounds, access flags of the MR
and, for RC, of the QP). In-order RC places each write as it arrives (straight from the socket into the
registered memory). With adaptive routing (RC) and always on SRD, each message is cut into packets that go
into a per-QP pool and are placed in a seeded random order, also across messages; the pool keeps at most
`reorder_window` packets while traffic is streaming and drains when the connection goes idle. RC reads and
atomics drain the pool first (they execute after all earlier writes are placed); RC write-with-imm and
send completions are produced in message order once every byte of the message and of all earlier messages
is placed. SRD completes each message as soon as its own bytes are placed.

Errors. RC: a protection or length error completes that WR with an error status and moves the QP to the
error state; every later and outstanding WR, and every posted receive, completes with IBV_WC_WR_FLUSH_ERR.
The responder QP also goes to the error state on access / invalid-request errors. SRD (EFA): an error
completes only that WR; the QP stays usable (EFA flushes only on QP destroy).
"""

from __future__ import annotations

import errno
import threading
from collections import deque
from typing import TYPE_CHECKING, Any

from . import _wire as w
from ._memory import host_view
from .pyverbs_error import PyverbsUserError

if TYPE_CHECKING:  # annotations only: the device owns this module's engines, not the other way round
    from ._device import Conn, SoftDevice

# ibv_wc_status
OK = 0
LOC_LEN = 1
LOC_QP_OP = 2
LOC_PROT = 4
FLUSH = 5
REM_INV_REQ = 9
REM_ACCESS = 10
REM_OP = 11
RETRY_EXC = 12
RNR_EXC = 13
REM_INV_RD_REQ = 15
RESP_TIMEOUT = 20

# ibv_qp_state
RESET, INIT, RTR, RTS, SQD, SQE, ERR = range(7)

# ibv_access_flags
LOCAL_WRITE = 1
REMOTE_WRITE = 2
REMOTE_READ = 4
REMOTE_ATOMIC = 8
RELAXED_ORDERING = 1 << 20

# ibv_send_flags
FENCE = 1
SIGNALED = 2
SOLICITED = 4
INLINE = 8

# ibv_wc_opcode / flags
WC_SEND, WC_RDMA_WRITE, WC_RDMA_READ, WC_COMP_SWAP, WC_FETCH_ADD = 0, 1, 2, 3, 4
WC_RECV, WC_RECV_RDMA_WITH_IMM = 128, 129
WC_WITH_IMM = 2

QPT_RC = 2
QPT_DRIVER = 0xFF

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

# IBTA encoding of the RNR NAK timer (milliseconds)
RNR_TIMER_MS = (655.36, 0.01, 0.02, 0.03, 0.04, 0.06, 0.08, 0.12, 0.16, 0.24, 0.32, 0.48, 0.64, 0.96, 1.28,
                1.92, 2.56, 3.84, 5.12, 7.68, 10.24, 15.36, 20.48, 30.72, 40.96, 61.44, 81.92, 122.88,
                163.84, 245.76, 327.68, 491.52)

_MASK64 = (1 << 64) - 1


def mtu_bytes(code: int) -> int:
    return 256 << (max(1, min(5, code)) - 1)


class MRCore:
    """A registered region: keys, bounds, access flags and how to reach its bytes."""

    __slots__ = ("device", "pd", "addr", "length", "access", "lkey", "rkey", "view", "accessor", "valid")

    def __init__(self, device: SoftDevice, pd: Any, addr: int, length: int, access: int,
                 view: memoryview | None, accessor: Any) -> None:
        self.device = device
        self.pd = pd
        self.addr = addr
        self.length = length
        self.access = access
        self.view = view
        self.accessor = accessor
        self.lkey, self.rkey = device.new_keys()
        self.valid = True

    def contains(self, addr: int, length: int) -> bool:
        return self.addr <= addr and addr + length <= self.addr + self.length

    def view_at(self, addr: int, n: int) -> memoryview | None:
        if self.view is None:
            return None
        off = addr - self.addr
        return self.view[off:off + n]

    def read(self, addr: int, n: int) -> bytes | memoryview:
        if self.view is not None:
            off = addr - self.addr
            return self.view[off:off + n]
        return self.accessor.read(addr, n)

    def write(self, addr: int, data: Any) -> None:
        if self.view is not None:
            off = addr - self.addr
            self.view[off:off + len(data)] = data
        else:
            self.accessor.write(addr, memoryview(data).cast("B"))


class CQCore:
    """Completion entries as tuples; WC objects are built only when polled.

    Entry: (wr_id, status, opcode, byte_len, qp_num, src_qp, imm, wc_flags, slid, qp, retire_sq,
    retire_rq, unsolicited). Polling an entry frees `retire_sq` send-queue slots of `qp` (the slots of the
    WR and of the unsignaled WRs before it, as mlx5 advances its SQ tail) and `retire_rq` receive slots.
    """

    __slots__ = ("capacity", "entries", "lock", "overrun", "wc_flags", "efa_wc_flags", "closed")

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.entries: deque[tuple] = deque()
        self.lock = threading.Lock()
        self.overrun = False
        self.wc_flags = 0
        self.efa_wc_flags = 0
        self.closed = False

    def push(self, cqe: tuple) -> None:
        with self.lock:
            if len(self.entries) >= self.capacity:
                self.overrun = True  # the hardware would raise IBV_EVENT_CQ_ERR; polling reports it
                return
            self.entries.append(cqe)

    def take(self, n: int) -> list[tuple]:
        with self.lock:
            entries = self.entries
            out = []
            while entries and len(out) < n:
                cqe = entries.popleft()
                qp = cqe[9]
                if qp is not None:
                    if cqe[10]:
                        qp.sq_retired += cqe[10]
                    if cqe[11]:
                        qp.rq_retired += cqe[11]
                out.append(cqe)
            return out


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

    def __init__(self, wr_id: int, op: int, flags: int, sig_all: bool) -> None:
        self.wr_id = wr_id
        self.op = op
        self.signaled = sig_all or bool(flags & SIGNALED)
        self.fence = bool(flags & FENCE)

    def length(self) -> int:
        if self.inline is not None:
            return len(self.inline)
        n = 0
        for sge in self.sges:
            n += sge[1]
        return n


class Msg:
    """A request as the responder sees it."""

    __slots__ = ("qp", "conn", "seq", "op", "flags", "imm", "src_qpn", "rkey", "raddr", "length", "add",
                 "swap", "status", "mr", "recv", "data", "direct", "deferred", "rnr", "pkts_left",
                 "reorder", "mtu", "unsolicited", "silent", "free", "order")

    def __init__(self, conn: Conn, d: tuple) -> None:
        (_dst, self.src_qpn, self.seq, self.op, self.flags, self.mtu, self.imm, self.rkey, _qkey,
         self.raddr, self.length, _psn, self.add, self.swap) = d
        self.conn = conn
        self.qp: QPCore | None = None
        self.status = OK
        self.mr: MRCore | None = None
        self.recv: tuple | None = None
        self.data: memoryview | None = None
        self.direct = False
        self.deferred = False
        self.rnr = False
        self.pkts_left = 0
        self.reorder = False
        self.unsolicited = False
        self.silent = False
        self.free = True  # its packets may be placed before earlier ones (AR, SRD, relaxed ordering)
        self.order = 0


class QPCore:
    """State of one QP, requester and responder sides, guarded by `lock`."""

    def __init__(self, device: SoftDevice, pd: Any, qp_type: int, scq: CQCore, rcq: CQCore, cap: dict,
                 sq_sig_all: bool, send_ops: int | None, unsolicited: bool) -> None:
        self.device = device
        self.pd = pd
        self.qp_type = qp_type
        self.srd = qp_type == QPT_DRIVER
        self.efa = device.is_efa
        self.scq = scq
        self.rcq = rcq
        self.max_send_wr = cap["max_send_wr"]
        self.max_recv_wr = cap["max_recv_wr"]
        self.max_send_sge = cap["max_send_sge"]
        self.max_recv_sge = cap["max_recv_sge"]
        self.max_inline = cap["max_inline_data"]
        self.sq_sig_all = sq_sig_all
        self.send_ops = send_ops
        self.unsolicited = unsolicited
        self.qpn = device.new_qpn()
        self.lock = threading.RLock()
        self.state = RESET
        self.port_num = 1
        self.pkey_index = 0
        self.qkey = 0
        self.access_flags = 0
        self.path_mtu = 3
        self.dest_qpn = 0
        self.remote: tuple[str, int] | None = None
        self.ah_attr: Any = None
        self.rq_psn = 0
        self.sq_psn = 0
        self.max_rd_atomic = 0
        self.max_dest_rd_atomic = 0
        self.min_rnr_timer = 0
        self.timeout = 0
        self.retry_cnt = 0
        self.rnr_retry = 0
        self.ar: bool | None = None
        # requester
        self.next_seq = 1
        self.sq_posted = 0
        self.sq_retired = 0
        self.order: deque[SendEntry] = deque()
        self.txq: deque[SendEntry] = deque()
        self.inflight: dict[int, SendEntry] = {}
        self.rd_out = 0
        self.unsig = 0
        self.tx_psn = 0
        self.tx_halted = False
        self.sess: list[SendEntry] | None = None
        self.sess_err = 0
        # responder
        self.rq: deque[tuple] = deque()
        self.rq_posted = 0
        self.rq_retired = 0
        self.exp_psn = 0
        self.backlog: deque[Msg] = deque()
        self.stalled = False
        self.rnr_wait: list[Msg] = []
        self.pool: list[tuple[Msg, int, memoryview]] = []
        self.pend: deque[Msg] = deque()
        self.rx_order = 0
        self.inbox: deque[list[tuple]] = deque()
        self.closed = False

    # ================================================================ requester
    def _sq_full(self, extra: int) -> bool:
        return max(0, self.sq_posted - self.sq_retired) + extra >= self.max_send_wr

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
                    e.inline = b"".join(bytes(_host_bytes(a, n)) for a, n, _k in sges)
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

    # -- extended API session (ibv_wr_start .. ibv_wr_complete)
    def session_start(self) -> None:
        self.sess = []
        self.sess_err = 0

    def session_op(self, op: int, wr_id: int, flags: int, rkey: int = 0, raddr: int = 0, imm: int = 0,
                   add: int = 0, swap: int = 0) -> None:
        """One wr_* call inside a session; a refusal is remembered and reported by wr_complete()."""
        sess = self.sess
        if sess is None:

            raise PyverbsUserError("wr_* called outside wr_start()/wr_complete()")
        if self.sess_err:
            return
        full = self.sq_posted - self.sq_retired + len(sess) >= self.max_send_wr
        if self.efa:  # efa_post_send_validate order: state, signaled, flags, queue space
            if self.state not in (RTS, SQD) or (not (flags & SIGNALED) and not self.sq_sig_all) \
                    or flags & ~(SIGNALED | INLINE):
                self.sess_err = errno.EINVAL
                return
            if full:
                self.sess_err = errno.ENOMEM
                return
        else:
            if full:
                self.sess_err = errno.ENOMEM
                return
            if self.state < RTS:
                self.sess_err = errno.EINVAL
                return
        e = SendEntry(wr_id, op, flags, self.sq_sig_all)
        if rkey:
            e.rkey = rkey
        if raddr:
            e.raddr = raddr
        if imm:
            e.imm = imm
        if add:
            e.add = add
        if swap:
            e.swap = swap
        sess.append(e)

    def session_set_sge(self, addr: int, length: int, lkey: int) -> None:
        """wr_set_sge: the fast single-SGE form of session_set_sges."""
        sess = self.sess
        if sess and not self.sess_err:
            e = sess[-1]
            e.sges = ((addr, length, lkey),)
            e.inline = None
        elif sess is None:
            self._sess_cur()

    def _sess_cur(self) -> SendEntry | None:
        if self.sess is None:

            raise PyverbsUserError("wr_set_* called outside wr_start()/wr_complete()")
        if self.sess_err or not self.sess:
            return None
        return self.sess[-1]

    def session_set_sges(self, sges: list[tuple[int, int, int]]) -> None:
        e = self._sess_cur()
        if e is None:
            return
        if self.efa:
            limit = 1 if e.op in (w.OP_WRITE, w.OP_WRITE_IMM, w.OP_READ) else self.max_send_sge
            if len(sges) > limit:
                self.sess_err = errno.EINVAL
                return
        elif len(sges) > self.max_send_sge:
            self.sess_err = errno.ENOMEM
            return
        e.sges = list(sges)
        e.inline = None

    def session_set_inline(self, data: bytes) -> None:
        e = self._sess_cur()
        if e is None:
            return
        if len(data) > self.max_inline:
            self.sess_err = errno.EINVAL if self.efa else errno.ENOMEM
            return
        if self.efa and e.op not in (w.OP_SEND, w.OP_SEND_IMM):
            # rdma-core 59 would copy the bytes over the RDMA descriptor (the remote address); later
            # releases refuse it. Refuse, so a backend never relies on inline RDMA on EFA.
            self.sess_err = errno.EINVAL
            return
        e.inline = data
        e.sges = []

    def session_set_ud(self, dest: tuple[str, int] | None, qpn: int, qkey: int) -> None:
        e = self._sess_cur()
        if e is None:
            return
        e.dest, e.dest_qpn, e.qkey = dest, qpn, qkey

    def session_complete(self) -> int:
        with self.lock:
            sess, err = self.sess, self.sess_err
            self.sess = None
            if sess is None:

                raise PyverbsUserError("wr_complete() without wr_start()")
            if err:
                return err
            seq = self.next_seq
            for e in sess:
                e.seq = seq
                seq += 1
            self.next_seq = seq
            self.sq_posted += len(sess)
            if not self.srd:
                self.order.extend(sess)
            self.txq.extend(sess)
            self._kick()
        if self.inbox:
            self.drain_inbox()
        return 0

    def session_abort(self) -> None:
        self.sess = None

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
        """Transmit queued WRs in order, as far as fence and outstanding-read limits allow (lock held)."""
        txq = self.txq
        if not txq or self.tx_halted:
            return
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
        failed: list[SendEntry] = []
        last_dest: Any = None
        conn: Conn | None = None
        descs: list[bytes] = []
        payloads: list[Any] = []
        while txq:
            e = txq[0]
            op = e.op
            if op == 1 and not srd and not e.fence and e.status is None and conn is not None \
                    and self.remote == last_dest:
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
                descs.append(pack(self.dest_qpn, qpn, e.seq, 1, base_flags, mtu_code, 0, e.rkey, 0, e.raddr,
                                  length, psn, 0, 0))
                if e.inline is not None:
                    payloads.append(e.inline)
                for mr, addr, n in e.local:
                    view = mr.view
                    if view is not None:
                        off = addr - mr.addr
                        payloads.append(view[off:off + n])
                    else:
                        payloads.append(mr.read(addr, n))
                inflight[e.seq] = e
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
                dest, dst_qpn = self.remote, self.dest_qpn
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
            descs.append(pack(dst_qpn, qpn, e.seq, op, base_flags, mtu_code, e.imm, e.rkey, e.qkey, e.raddr,
                              length, psn, e.add, e.swap))
            if op in data_ops:
                if e.inline is not None:
                    payloads.append(e.inline)
                else:
                    for mr, addr, n in e.local:
                        view = mr.view
                        if view is not None:
                            off = addr - mr.addr
                            payloads.append(view[off:off + n])
                        else:
                            payloads.append(mr.read(addr, n))
            inflight[e.seq] = e
            if is_rd:
                self.rd_out += 1
            if len(descs) >= w.MAX_DESCS_PER_FRAME:
                assert conn is not None
                del frames[conn]
                if not conn.send_frame(w.KIND_REQ, descs, payloads):
                    failed.extend(x for x in list(inflight.values()) if x.conn is conn)
                last_dest = None
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

    # -- completion
    def _wc_opcode(self, op: int) -> int:
        if self.efa:
            return _EFA_WC_OPCODE.get(op, WC_SEND)
        return _RC_WC_OPCODE[op]

    def _complete(self, e: SendEntry) -> None:
        """SRD: one WR's completion, in arrival order."""
        if e.signaled or e.status != OK:
            self.scq.push((e.wr_id, e.status, self._wc_opcode(e.op), 0, self.qpn, 0, 0, 0, 0, self, 1, 0,
                           False))
        else:
            self.sq_retired += 1

    def _rc_retire(self) -> None:
        """RC: completions in post order; the first error fails the QP."""
        order = self.order
        push = self.scq.push
        while order and order[0].status is not None:
            e = order.popleft()
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

    def _flush_rq(self) -> None:
        push = self.rcq.push
        rq = self.rq
        while rq:
            wr_id, _sges = rq.popleft()
            push((wr_id, FLUSH, WC_RECV, 0, self.qpn, 0, 0, 0, 0, self, 0, 1, False))

    def enter_error(self) -> None:
        """Move to IBV_QPS_ERR: flush the send queue, posted receives and pending inbound work."""
        if self.state == ERR:
            return
        self.state = ERR
        self.tx_halted = False
        self._flush_sq()
        self._flush_rq()
        self.backlog.clear()
        self.stalled = False
        self.rnr_wait.clear()
        self.pool.clear()
        self.pend.clear()

    def rx_responses(self, items: list[tuple]) -> None:
        """Responses arrived for our requests (I/O thread): (descriptor, data, placed_directly) each.

        They are queued and applied by whichever thread holds the QP lock: if a posting thread holds it,
        that thread applies them before it lets go (see `drain_inbox`), so the I/O thread never waits.
        """
        self.inbox.append(items)
        self.drain_inbox()

    def drain_inbox(self) -> None:
        inbox = self.inbox
        lock = self.lock
        while inbox:
            if not lock.acquire(blocking=False):
                return
            try:
                while inbox:
                    self._apply_responses(inbox.popleft())
            finally:
                lock.release()

    def _apply_responses(self, items: list[tuple]) -> None:
        inflight = self.inflight
        srd = self.srd
        for d, data, direct in items:
            _qpn, status, op, _r, seq, length, _p, value = d
            if op == w.OP_ACK:
                for s in range(seq, seq + length):
                    e = inflight.pop(s, None)
                    if e is not None:
                        e.status = OK
                        if srd:
                            self._complete(e)
                continue
            e = inflight.pop(seq, None)
            if e is None:
                continue
            if status == OK:
                if op == w.OP_READ:
                    if not direct and data is not None:
                        _scatter(e.local, data)
                    e.byte_len = length
                elif op in (w.OP_FADD, w.OP_CSWAP):
                    _scatter(e.local, (value & _MASK64).to_bytes(8, "little"))
                    e.byte_len = 8
            e.status = status
            if op in w.RD_ATOMIC_OPS:
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

    # ================================================================ receive queue
    def post_recv(self, wrs: list[tuple]) -> tuple[int, int]:
        with self.lock:
            for i, (wr_id, sges) in enumerate(wrs):
                if self.state == RESET or (self.efa and self.state == ERR):
                    return errno.EINVAL, i
                if len(sges) > self.max_recv_sge:
                    return errno.EINVAL, i
                if max(0, self.rq_posted - self.rq_retired) >= self.max_recv_wr:
                    return errno.ENOMEM, i
                self.rq_posted += 1
                self.rq.append((wr_id, list(sges)))
            if self.state == ERR:
                self._flush_rq()
            elif self.stalled or self.rnr_wait:
                self.device.post_action(self.rx_resume)
        if self.inbox:
            self.drain_inbox()
        return 0, -1

    # ================================================================ responder
    def _reserve_recv(self, m: Msg) -> bool:
        if m.op == w.OP_WRITE_IMM and self.srd and self.unsolicited:
            m.unsolicited = True
            return True
        if self.rq:
            m.recv = self.rq.popleft()
            return True
        return False

    def rx_validate(self, m: Msg) -> None:
        """Keys, bounds and access flags for one request; sets m.status."""
        op = m.op
        if op in (w.OP_WRITE, w.OP_WRITE_IMM, w.OP_READ):
            if m.length == 0:
                return  # no rkey check for zero-length RDMA (IBTA)
            need = REMOTE_READ if op == w.OP_READ else REMOTE_WRITE
        elif op in (w.OP_FADD, w.OP_CSWAP):
            if self.srd:
                m.status = REM_OP
                return
            need = REMOTE_ATOMIC
            if m.raddr & 7:
                m.status = REM_INV_REQ
                return
            m.length = 8
        else:
            return
        if not self.srd:
            if not self.access_flags & need:
                m.status = REM_ACCESS
                return
            if op in w.RD_ATOMIC_OPS and self.max_dest_rd_atomic == 0:
                m.status = REM_INV_REQ
                return
        mr = self.device.mrs_by_rkey.get(m.rkey)
        if mr is None or not mr.valid or mr.pd is not self.pd or not mr.access & need \
                or not mr.contains(m.raddr, m.length):
            m.status = REM_ACCESS
            return
        m.mr = mr

    def rx_exec(self, m: Msg, responder: Responder) -> None:
        """Execute an accepted request (lock held)."""
        op = m.op
        if op in w.DATA_OPS:
            if m.reorder:
                self._pool_add(m, responder)
                return
            if not m.direct and not self._place_whole(m, responder):
                return
            self._finish(m, responder)
            return
        # reads and atomics: an RC QP executes them only after every earlier write is placed
        if not self.srd and (self.pool or self.pend):
            responder.drain_pool(self)
        if op == w.OP_READ:
            data = b"" if m.length == 0 else bytes(m.mr.read(m.raddr, m.length))
            responder.respond(m, OK, payload=data, length=len(data))
            return
        mr = m.mr
        old = int.from_bytes(bytes(mr.read(m.raddr, 8)), "little")
        if op == w.OP_FADD:
            new = (old + m.add) & _MASK64
        else:
            new = m.swap & _MASK64 if old == (m.add & _MASK64) else old
        if new != old:
            mr.write(m.raddr, new.to_bytes(8, "little"))
            responder.observe(self, m.raddr, 8)
        responder.respond(m, OK, value=old)

    def _place_whole(self, m: Msg, responder: Responder) -> bool:
        op = m.op
        if op in (w.OP_WRITE, w.OP_WRITE_IMM):
            if m.length:
                m.mr.write(m.raddr, m.data)
                responder.observe(self, m.raddr, m.length)
            return True
        return self._scatter_recv(m, responder)

    def _scatter_recv(self, m: Msg, responder: Responder) -> bool:
        """Deliver a send into its receive WR's buffers; failures complete both sides with errors."""
        assert m.recv is not None
        wr_id, sges = m.recv
        data = m.data if m.data is not None else memoryview(b"")
        total = sum(s[1] for s in sges)
        status = OK
        if len(data) > total:
            status = LOC_LEN
        else:
            local = []
            for addr, length, lkey in sges:
                if length == 0:
                    continue
                mr = self.device.mrs_by_lkey.get(lkey)
                if mr is None or not mr.valid or mr.pd is not self.pd or not mr.contains(addr, length) \
                        or not mr.access & LOCAL_WRITE:
                    status = LOC_PROT
                    break
                local.append((mr, addr, length))
            if status == OK:
                _scatter(local, data)
        if status != OK:
            self.rcq.push((wr_id, status, WC_RECV, 0, self.qpn, m.src_qpn, 0, 0, 0, self, 0, 1, False))
            responder.respond(m, REM_INV_REQ if status == LOC_LEN else REM_OP)
            if not self.srd:
                self.enter_error()
            return False
        return True

    def _finish(self, m: Msg, responder: Responder) -> None:
        """Message fully placed: receive completion (if it consumes one), then the acknowledgement."""
        op = m.op
        if op != w.OP_WRITE:
            imm = m.imm if op in (w.OP_WRITE_IMM, w.OP_SEND_IMM) else 0
            wc_flags = WC_WITH_IMM if imm or op in (w.OP_WRITE_IMM, w.OP_SEND_IMM) else 0
            wc_op = WC_RECV_RDMA_WITH_IMM if op == w.OP_WRITE_IMM else WC_RECV
            slid = m.conn.peer_lid
            if m.unsolicited:
                self.rcq.push((0, OK, wc_op, m.length, self.qpn, m.src_qpn, imm, wc_flags, slid, None, 0, 0,
                               True))
            else:
                assert m.recv is not None
                self.rcq.push((m.recv[0], OK, wc_op, m.length, self.qpn, m.src_qpn, imm, wc_flags, slid, self,
                               0, 1, False))
        responder.respond(m, OK)

    def _pool_add(self, m: Msg, responder: Responder) -> None:
        opts = self.device.options
        size = opts.packet_size or (opts.srd_packet_size if self.srd else mtu_bytes(m.mtu))
        data = m.data if m.data is not None else memoryview(b"")
        pool = self.pool
        self.rx_order += 1
        m.order = self.rx_order
        if m.op in (w.OP_SEND, w.OP_SEND_IMM) or len(data) <= size:
            pool.append((m, 0, data))
            m.pkts_left = 1
        else:
            n = 0
            for off in range(0, len(data), size):
                pool.append((m, off, data[off:off + size]))
                n += 1
            m.pkts_left = n
        if not self.srd:
            self.pend.append(m)
        responder.dirty.add(self)

    def place_packet(self, pkt: tuple[Msg, int, memoryview], responder: Responder) -> None:
        m, off, view = pkt
        if m.op in (w.OP_SEND, w.OP_SEND_IMM):
            if not self._scatter_recv(m, responder):
                return
        elif len(view):
            m.mr.write(m.raddr + off, view)
            responder.observe(self, m.raddr + off, len(view))
        m.pkts_left -= 1
        if m.pkts_left:
            return
        if self.srd:
            self._finish(m, responder)
            return
        pend = self.pend
        while pend and pend[0].pkts_left == 0:
            self._finish(pend.popleft(), responder)

    def rx_resume(self) -> None:
        """I/O thread: receive WRs were posted; retry requests waiting for one (RNR)."""
        responder = self.device.core_responder
        with self.lock:
            if self.state == ERR:
                return
            if self.srd:
                still = []
                for m in self.rnr_wait:
                    if self._reserve_recv(m):
                        self.rx_exec(m, responder)
                    else:
                        still.append(m)
                self.rnr_wait = still
                return
            backlog = self.backlog
            while backlog:
                m = backlog[0]
                if m.deferred:
                    m.deferred = False
                    self.rx_validate(m)
                    if m.status:
                        backlog.popleft()
                        responder.fail(self, m)
                        return
                if m.op in w.RECV_OPS and m.recv is None and not self._reserve_recv(m):
                    if not self.stalled:
                        self.stalled = True
                        responder.arm_rnr(self, m)
                    return
                backlog.popleft()
                self.stalled = False
                self.rx_exec(m, responder)
            self.stalled = False
        responder.dev.flush_responses()

    def rnr_expired(self, m: Msg) -> None:
        responder = self.device.core_responder
        with self.lock:
            if self.srd:
                if m in self.rnr_wait:
                    self.rnr_wait.remove(m)
                    responder.respond(m, RNR_EXC)
                return
            if self.stalled and self.backlog and self.backlog[0] is m:
                self.backlog.clear()
                self.stalled = False
                responder.respond(m, RNR_EXC)


class Responder:
    """Frame handler for requests arriving at this device (runs on its I/O thread)."""

    def __init__(self, dev: SoftDevice) -> None:
        self.dev = dev
        self.dirty: set[QPCore] = set()

    def begin_frame(self, conn: Conn, kind: int) -> None:
        if kind != w.KIND_REQ:
            raise ValueError("response frame on a responder connection")
        conn.plan = None
        conn.ro_qpns = None
        if self.dev.relaxed_mrs:
            # Writes into IBV_ACCESS_RELAXED_ORDERING regions may pass earlier writes (PCIe relaxed
            # ordering): the QPs they arrive on place this frame's data through the reorder pool.
            mrs = self.dev.mrs_by_rkey
            ro = set()
            for d in conn.descs:
                if d[3] in (w.OP_WRITE, w.OP_WRITE_IMM) and d[10]:
                    mr = mrs.get(d[7])
                    if mr is not None and mr.access & RELAXED_ORDERING:
                        ro.add(d[0])
            conn.ro_qpns = ro or None

    @staticmethod
    def payload_len(d: tuple) -> int:
        return d[10] if d[3] in w.DATA_OPS else 0

    def sink_for(self, conn: Conn, d: tuple, n: int) -> memoryview | None:
        m = self._arrive(conn, d)
        conn.plan = m
        if m.status:
            return None
        if m.direct:
            return m.data
        m.data = memoryview(bytearray(n))
        return m.data

    def on_item(self, conn: Conn, d: tuple, data: memoryview | None) -> None:
        m = conn.plan
        conn.plan = None
        if m is None:
            m = self._arrive(conn, d)
        qp = m.qp
        if m.status:
            if qp is None:
                self.respond(m, m.status)
            else:
                with qp.lock:
                    self.fail(qp, m)
            return
        assert qp is not None
        with qp.lock:
            if qp.state == ERR:
                self.respond(m, RETRY_EXC if not qp.srd else RESP_TIMEOUT)
            elif m.deferred:
                qp.backlog.append(m)
            elif m.rnr:
                if qp.srd:
                    qp.rnr_wait.append(m)
                else:
                    qp.backlog.append(m)
                    qp.stalled = True
                self.arm_rnr(qp, m)
            else:
                if m.direct and m.length:
                    self.observe(qp, m.raddr, m.length)
                qp.rx_exec(m, self)

    def end_frame(self, conn: Conn) -> None:
        window = self.dev.options.reorder_window
        for qp in list(self.dirty):
            with qp.lock:
                pool = qp.pool
                while len(pool) > window:
                    qp.place_packet(self._take(pool), self)
        conn.ro_qpns = None
        self.dev.flush_responses()

    def _take(self, pool: list[tuple[Msg, int, memoryview]]) -> tuple[Msg, int, memoryview]:
        """Remove a random packet that may be placed now.

        A packet of a message that is not `free` (an in-order write next to relaxed-ordering ones) goes
        only once every earlier packet is placed; free packets (adaptive routing, SRD, writes into an
        IBV_ACCESS_RELAXED_ORDERING region) may go any time.
        """
        rng = self.dev.rng
        i = rng.randrange(len(pool))
        if not pool[i][0].free:
            first = min(range(len(pool)), key=lambda k: (pool[k][0].order, pool[k][1]))
            candidates = [k for k in range(len(pool)) if pool[k][0].free or k == first]
            i = candidates[rng.randrange(len(candidates))]
        pool[i], pool[-1] = pool[-1], pool[i]
        return pool.pop()

    def on_idle(self) -> None:
        """No more input right now: place every held packet (in random order)."""
        while self.dirty:
            qp = self.dirty.pop()
            with qp.lock:
                self.drain_pool(qp)

    def drain_pool(self, qp: QPCore) -> None:
        pool = qp.pool
        while pool:
            qp.place_packet(self._take(pool), self)
        self.dirty.discard(qp)

    def _arrive(self, conn: Conn, d: tuple) -> Msg:
        """Admission checks for one request, in arrival (PSN) order."""
        m = Msg(conn, d)
        qp = self.dev.qps.get(d[0])
        srd_req = bool(m.flags & w.F_SRD)
        if qp is None or qp.closed:
            m.status = REM_INV_RD_REQ if srd_req else RETRY_EXC
            return m
        m.qp = qp
        with qp.lock:
            if qp.srd:
                if not srd_req:
                    m.status = REM_OP
                    m.silent = True
                    return m
                if qp.state not in (RTR, RTS, SQD) or d[8] != qp.qkey:
                    m.status = RESP_TIMEOUT  # the device drops it; the requester sees an unresponsive peer
                    m.silent = True
                    return m
                qp.rx_validate(m)
                if m.status:
                    return m
                m.reorder = True
                if m.op in w.RECV_OPS and not qp._reserve_recv(m):
                    m.rnr = True
                return m
            # RC
            if srd_req or qp.state not in (RTR, RTS, SQD) or m.src_qpn != qp.dest_qpn:
                m.status = RETRY_EXC  # silently dropped by the HCA; the requester retries, then gives up
                m.silent = True
                return m
            psn = d[11]
            if psn != qp.exp_psn:
                m.status = RETRY_EXC
                m.silent = True
                return m
            length = m.length if m.op in w.DATA_OPS or m.op == w.OP_READ else 0
            npkts = 1 if m.op in (w.OP_FADD, w.OP_CSWAP) else max(1, -(-length // mtu_bytes(m.mtu)))
            qp.exp_psn = (psn + npkts) & 0xFFFFFF
            if m.mtu > qp.path_mtu:
                m.status = REM_INV_REQ  # packets longer than the responder's path MTU
                return m
            m.reorder = bool(m.flags & w.F_AR)
            ro = conn.ro_qpns
            if not m.reorder and ro is not None and qp.qpn in ro and m.op in w.DATA_OPS:
                m.reorder = True
                m.free = m.op in (w.OP_WRITE, w.OP_WRITE_IMM) and _relaxed(self.dev, m.rkey)
            if qp.backlog or qp.stalled:
                m.deferred = True
                return m
            qp.rx_validate(m)
            if m.status:
                return m
            if m.op in w.RECV_OPS and not qp._reserve_recv(m):
                m.rnr = True
                return m
            if not m.reorder and m.op in (w.OP_WRITE, w.OP_WRITE_IMM) and m.length and m.mr.view is not None:
                m.direct = True
                m.data = m.mr.view_at(m.raddr, m.length)
            return m

    def fail(self, qp: QPCore, m: Msg) -> None:
        """An admitted-or-not request failed (lock held): NAK it and, for RC access errors, fail the QP."""
        if not qp.srd and m.status in (REM_ACCESS, REM_INV_REQ, REM_OP) and not m.silent:
            if qp.pool or qp.pend:
                self.drain_pool(qp)  # earlier messages were accepted; their bytes still land
            self.respond(m, m.status)
            qp.enter_error()
            return
        self.respond(m, m.status)

    def arm_rnr(self, qp: QPCore, m: Msg) -> None:
        retry = (m.flags >> w.RNR_SHIFT) & 7
        if retry == 7:
            return  # infinite retry
        if qp.srd:
            delay = (retry + 1) * self.dev.options.srd_rnr_timer_ms / 1e3
        else:
            delay = (retry + 1) * RNR_TIMER_MS[qp.min_rnr_timer & 31] / 1e3
        self.dev.add_timer(delay, lambda: qp.rnr_expired(m))

    def respond(self, m: Msg, status: int, payload: Any = None, length: int = 0, value: int = 0) -> None:
        conn = m.conn
        if conn.closed:
            return
        if status == OK and m.op in w.DATA_OPS:
            self.ack(conn, m.src_qpn, m.seq, 1)
            return
        conn.rsp_descs.append(w.RSP.pack(m.src_qpn, status, m.op, 0, m.seq, length, 0, value & _MASK64))
        conn.rsp_payloads.append(payload if length else None)
        conn.last_ack = None
        self.dev.mark_responses(conn)

    def ack(self, conn: Conn, qpn: int, seq: int, count: int) -> None:
        """Acknowledge `count` requests from `seq`, extending the previous ack range when contiguous."""
        last = conn.last_ack
        if last is not None and last[0] == qpn and last[1] + last[2] == seq:
            last[2] += count
            return
        last = [qpn, seq, count]
        conn.rsp_descs.append(last)
        conn.rsp_payloads.append(None)
        conn.last_ack = last
        self.dev.mark_responses(conn)

    def fast_frame(self, conn: Conn, descs: list[tuple], mv: memoryview, pos: int) -> tuple[int, int]:
        """Whole frame buffered: place the leading run of plain in-order RC writes in one pass.

        Returns (descriptors handled, buffer position after their payloads); the rest of the frame goes
        through the general per-request path.
        """
        qp = self.dev.qps.get(descs[0][0])
        if qp is None or qp.srd or qp.closed or conn.ro_qpns:
            return 0, pos
        done = 0
        with qp.lock:
            if qp.state not in (RTR, RTS, SQD) or qp.backlog or qp.stalled or not qp.access_flags & REMOTE_WRITE:
                return 0, pos
            qpn, dest, exp, path_mtu, pd = qp.qpn, qp.dest_qpn, qp.exp_psn, qp.path_mtu, qp.pd
            mrs = self.dev.mrs_by_rkey
            obs = self.dev.placement_observer
            cur_rkey = -1
            base = limit = 0
            view: memoryview | None = None
            first_seq = -1
            src = dest
            for d in descs:
                dst, src, seq, op, flags, mtu_code, _imm, rkey, _qk, raddr, length, psn, _a, _s = d
                if op != w.OP_WRITE or dst != qpn or src != dest or psn != exp or flags & (w.F_AR | w.F_SRD) \
                        or mtu_code > path_mtu or length == 0:
                    break
                if rkey != cur_rkey:
                    mr = mrs.get(rkey)
                    if mr is None or not mr.valid or mr.pd is not pd or not mr.access & REMOTE_WRITE \
                            or mr.view is None:
                        break
                    cur_rkey, base, limit, view = rkey, mr.addr, mr.addr + mr.length, mr.view
                if raddr < base or raddr + length > limit:
                    break
                off = raddr - base
                view[off:off + length] = mv[pos:pos + length]
                pos += length
                if obs is not None:
                    obs(qpn, raddr, length)
                exp = (psn + max(1, -(-length // (256 << (mtu_code - 1))))) & 0xFFFFFF
                if first_seq < 0:
                    first_seq = seq
                done += 1
            qp.exp_psn = exp
        if done:
            self.ack(conn, dest, first_seq, done)
        return done, pos

    def observe(self, qp: QPCore, addr: int, length: int) -> None:
        obs = self.dev.placement_observer
        if obs is not None:
            obs(qp.qpn, addr, length)


class RequesterRx:
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
        qp = self.dev.qps.get(d[0])
        e = qp.inflight.get(d[4]) if qp is not None else None
        if e is not None and len(e.local) == 1 and e.local[0][2] == n and e.local[0][0].view is not None:
            mr, addr, _ = e.local[0]
            conn.plan = True
            return mr.view_at(addr, n)
        conn.plan = False
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
                qp.rx_responses(items)
            return
        by_qp: dict[int, list[tuple]] = {}
        for it in items:
            by_qp.setdefault(it[0][0], []).append(it)
        for qpn, group in by_qp.items():
            qp = qps.get(qpn)
            if qp is not None:
                qp.rx_responses(group)

    @staticmethod
    def fast_frame(conn: Conn, descs: list[tuple], mv: memoryview, pos: int) -> tuple[int, int]:
        return 0, pos

    def conn_lost(self, conn: Conn) -> None:
        for qp in list(self.dev.qps.values()):
            qp.conn_lost(conn)


def _relaxed(dev: SoftDevice, rkey: int) -> bool:
    mr = dev.mrs_by_rkey.get(rkey)
    return mr is not None and bool(mr.access & RELAXED_ORDERING)


def _scatter(local: list[tuple[MRCore, int, int]], data: Any) -> None:
    view = memoryview(data).cast("B") if not isinstance(data, memoryview) else data
    pos = 0
    total = len(view)
    for mr, addr, n in local:
        if pos >= total:
            break
        take = min(n, total - pos)
        mr.write(addr, view[pos:pos + take])
        pos += take


def _host_bytes(addr: int, n: int) -> memoryview:

    return host_view(addr, n)
