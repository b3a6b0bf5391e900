"""The responder half of a QP (receive queue, inbound requests) and the device's handler of request frames.

Requests are checked on arrival (QP state, source QP, PSN, rkey, bounds, access flags of the MR and, for RC,
of the QP). In-order RC places each write as it arrives (straight from the socket into the registered
memory). With adaptive routing (RC) and always on SRD, each message is cut into packets that go into a
per-QP pool and are placed in a seeded random order, also across messages; the pool keeps at most
`reorder_window` packets and `reorder_window_bytes` bytes (always one packet) while traffic is streaming,
and drains when the connection goes idle. RC reads and
atomics drain the pool first (they execute after all earlier writes are placed); RC write-with-imm and send
completions are produced in message order once every byte of the message and of all earlier messages is
placed. SRD completes each message as soon as its own bytes are placed.

A direct write (`softverbs._direct`) is admitted by the same checks, then placed by a copy from the
requester's device memory (opened here for its connection) at the point where a wire write's bytes would
be stored: whole, or packet by packet from the pool (`direct_packet_size` bytes unless `packet_size` is
set; direct packets the pool gives up back to back are copied as one run, in order, with one wait). In-order
RC direct writes are held as the QP's run (`QPResponder.flush_run`) until anything else happens on that QP
or the I/O loop has read what its connections had (`RequestFrameHandler.on_idle`), then copied in order with
one wait: a wait is most of a small copy's cost on a busy GPU, and a stream of writes otherwise paid one
each. A wire write into device memory joins the run (its bytes copied in by the same `copy_many`, in its
place in the order), so a put's data and the flag write after it share the wait too. Either way the copy is
complete before anything later on the QP is placed, completed or acknowledged.

`RequestFrameHandler` is the device's handler for frames on the connections peers opened to it: admission
(`_arrive`), placement, the reorder pool, RNR timers and the responses; `QPResponder` is what one QP does
with an admitted request.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import logging
import time
from collections import deque
from typing import TYPE_CHECKING, Any

from . import _direct, _trace
from . import _wire as w
from ._ibv import (
    ERR,
    FLUSH,
    LOC_LEN,
    LOC_PROT,
    LOCAL_WRITE,
    OK,
    RELAXED_ORDERING,
    REM_ACCESS,
    REM_INV_RD_REQ,
    REM_INV_REQ,
    REM_OP,
    REMOTE_ATOMIC,
    REMOTE_READ,
    REMOTE_WRITE,
    RESET,
    RESP_TIMEOUT,
    RETRY_EXC,
    RNR_EXC,
    RNR_TIMER_MS,
    RTR,
    RTS,
    SQD,
    WC_RECV,
    WC_RECV_RDMA_WITH_IMM,
    WC_WITH_IMM,
    mtu_bytes,
)
from ._mr import MRCore, scatter

if TYPE_CHECKING:  # annotations only: the device owns the QPs, and a QP is both halves
    from ._conn import Conn
    from ._device import SoftDevice
    from ._qp import QPCore

log = logging.getLogger("softverbs")

#: in-order writes into device memory (direct, or wire writes) a QP holds before it copies them
#: (`QPResponder.flush_run`) even with more input
WRITE_RUN_MAX = 16


class Msg:
    """A request as the responder sees it."""

    __slots__ = ("qp", "conn", "seq", "op", "flags", "imm", "src_qpn", "rkey", "raddr", "length", "add",
                 "swap", "status", "mr", "recv", "data", "direct", "deferred", "rnr", "pkts_left",
                 "reorder", "mtu", "unsolicited", "silent", "free", "order", "src", "src_off", "land")

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
        self.src: _direct.Imported | None = None  # a direct write's source, opened here
        self.src_off = 0
        self.land = 0.0  # an SRD direct write's modeled landing: it is reported no earlier (`_packet_placed`)


class QPResponder:
    """The responder half of `QPCore` (receive queue, executing admitted requests), mixed into it.

    Runs under the QP's `lock`; `QPCore` holds what both halves share (state, attributes, caps, CQs).
    """

    def _init_responder(self) -> None:
        self.rq: deque[tuple] = deque()
        self.rq_posted = 0
        self.rq_retired = 0  # as sq_retired / sq_polled (`QPRequester`)
        self.rq_polled = 0
        self.exp_psn = 0
        self.backlog: deque[Msg] = deque()
        self.stalled = False
        self.rnr_wait: list[Msg] = []
        self.pool: list[tuple[Msg, int, memoryview]] = []
        self.pool_bytes = 0  # what the pool's packets hold (a direct packet: its length)
        self.pend: deque[Msg] = deque()
        self.rx_order = 0
        self.write_run: list[Msg] = []  # admitted in-order writes into device memory, not copied yet (`flush_run`)

    def post_recv(self, wrs: list[tuple]) -> tuple[int, int]:
        with self.lock:
            for i, (wr_id, sges) in enumerate(wrs):
                if self.state == RESET or (self.efa and self.state == ERR):
                    return errno.EINVAL, i
                if len(sges) > self.max_recv_sge:
                    return errno.EINVAL, i
                if max(0, self.rq_posted - self.rq_retired - self.rq_polled) >= self.max_recv_wr:
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


    def _flush_rq(self) -> None:
        push = self.rcq.push
        rq = self.rq
        while rq:
            wr_id, _sges = rq.popleft()
            push((wr_id, FLUSH, WC_RECV, 0, self.qpn, 0, 0, 0, 0, self, 0, 1, False))


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
        if m.flags & w.F_DIRECT:  # the source must be an allocation this side opened, and hold the bytes
            imp = m.conn.imports.get(m.add) if op in (w.OP_WRITE, w.OP_WRITE_IMM) else None
            if imp is None or imp.closed or m.swap + m.length > imp.size:
                m.status = REM_OP
                return
            m.src, m.src_off = imp, m.swap

    def rx_exec(self, m: Msg, handler: RequestFrameHandler) -> None:
        """Execute an accepted request (lock held)."""
        op = m.op
        if not m.reorder and not self.pool and not self.pend and (
                m.src is not None or m.length and op in (w.OP_WRITE, w.OP_WRITE_IMM) and not m.direct
                and m.mr.accessor is not None and _direct.copier() is not None):
            self.write_run.append(m)  # copied, then completed, with the rest of the run
            handler.runs.add(self)
            if len(self.write_run) >= WRITE_RUN_MAX:
                self.flush_run(handler)
            return
        self.flush_run(handler)  # whatever comes next on the QP comes after the run's bytes
        if op in w.DATA_OPS:
            if m.reorder:
                self._pool_add(m, handler)
                return
            if not m.direct and not self._place_whole(m, handler):
                return
            self._finish(m, handler)
            return
        # reads and atomics: an RC QP executes them only after every earlier write is placed
        if not self.srd and (self.pool or self.pend):
            handler.drain_pool(self)
        if op == w.OP_READ:
            data = b"" if m.length == 0 else bytes(m.mr.read(m.raddr, m.length))
            handler.respond(m, OK, payload=data, length=len(data))
            return
        mr = m.mr
        old = int.from_bytes(bytes(mr.read(m.raddr, 8)), "little")
        if op == w.OP_FADD:
            new = (old + m.add) & w.MASK64
        else:
            new = m.swap & w.MASK64 if old == (m.add & w.MASK64) else old
        if new != old:
            mr.write(m.raddr, new.to_bytes(8, "little"))
            handler.observe(self, m.raddr, 8)
        handler.respond(m, OK, value=old)

    def _place_whole(self, m: Msg, handler: RequestFrameHandler) -> bool:
        op = m.op
        if op in (w.OP_WRITE, w.OP_WRITE_IMM):
            if m.src is not None:
                self._copy_pieces([(m, 0, m.length)], handler)  # one copy, complete when it returns
            elif m.length:
                m.mr.write(m.raddr, m.data)
                handler.observe(self, m.raddr, m.length)
            return True
        return self._scatter_recv(m, handler)

    def flush_run(self, handler: RequestFrameHandler) -> None:
        """Copy the QP's run of in-order writes (lock held): direct writes, and wire writes into device
        memory, one `_copy_pieces` for all, then each completes in order. After one that failed (its QP now
        in error) the rest are answered as a QP in error answers what arrives: no acknowledgement."""
        run = self.write_run
        if not run:
            return
        self.write_run = []
        self._copy_pieces([(m, 0, m.length) for m in run], handler)
        self._complete_run(run, handler)

    def flush_run_released(self, handler: RequestFrameHandler) -> None:
        """`flush_run` for the I/O thread with nothing else to do on the QP (`RequestFrameHandler.on_idle`):
        the run's copies go with the QP's lock let go, so a post on the QP does not wait for them (a copy into
        GPU memory can take a hundred microseconds). Nothing can come between the run and what follows it:
        only this thread admits requests. The run then completes as `flush_run`'s does: acknowledged, or
        answered as a QP in error answers if another thread moved the QP to the error state meanwhile."""
        with self.lock:
            run, self.write_run = self.write_run, []
        if not run:
            return
        self._copy_pieces([(m, 0, m.length) for m in run], handler)
        with self.lock:
            self._complete_run(run, handler)

    def _complete_run(self, run: list[Msg], handler: RequestFrameHandler) -> None:
        for m in run:
            if self.state == ERR:
                handler.respond(m, RETRY_EXC)
            else:
                self._finish(m, handler)

    def _copy_pieces(self, run: list[tuple[Msg, int, int]], handler: RequestFrameHandler) -> None:
        """Copy ``(message, offset, length)`` pieces in order, one wait for all (`DirectCopier.copy_many`),
        complete on return: a direct write's from its source, a wire write's (a run's) from its bytes here. A
        piece whose exporter let go (or whose copy failed) sets its message's status to a remote operational
        error instead, and one whose target MR was deregistered since its admission a remote access error."""
        live = []
        for m, off, n in run:
            assert m.mr is not None  # only admitted writes come here
            if m.src is not None and m.src.closed:  # its exporter let go before the write completed
                m.status = REM_OP
            elif not m.mr.valid:
                m.status = REM_ACCESS
            else:
                live.append((m, off, n))
        if not live:
            return
        # what opened the direct writes' sources (the process's one copier), else the one installed now
        copier = next((m.src.copier for m, _off, _n in live if m.src is not None), None) or _direct.copier()
        assert copier is not None
        start = time.perf_counter_ns()
        if _trace.DIR:  # the run's copies start: ``placed`` follows each once the run's one wait returned
            _trace.stamp(f"copy {len(live)}")
        try:
            copier.copy_many([(m.raddr + off, m.data[off:off + n] if m.src is None  # type: ignore[index]
                               else m.src.base + m.src_off + off, n) for m, off, n in live])
        except Exception:
            log.exception("softverbs %s: direct copy of %d piece(s) to %#x... failed", self.device.name, len(live),
                          live[0][0].raddr + live[0][1])
            for m, _off, _n in live:
                m.status = REM_OP
            return
        stats = self.device.stats
        direct = [n for m, _off, n in live if m.src is not None]
        stats["direct_placed"] += len(direct)
        stats["direct_bytes"] += sum(direct)
        stats["run_wire_writes"] += len(live) - len(direct)
        stats["direct_ns"] += time.perf_counter_ns() - start
        for m, off, n in live:
            handler.observe(self, m.raddr + off, n)
        self.device.send_due()  # a copy takes a while: this device's own requests may be due meanwhile

    def _scatter_recv(self, m: Msg, handler: RequestFrameHandler) -> bool:
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
                scatter(local, data)
        if status != OK:
            self.rcq.push((wr_id, status, WC_RECV, 0, self.qpn, m.src_qpn, 0, 0, 0, self, 0, 1, False))
            handler.respond(m, REM_INV_REQ if status == LOC_LEN else REM_OP)
            if not self.srd:
                self.enter_error()
            return False
        return True

    def _finish(self, m: Msg, handler: RequestFrameHandler) -> None:
        """Message fully placed: receive completion (if it consumes one), then the acknowledgement."""
        op = m.op
        if m.status:  # a direct copy failed: the request fails as a remote operational error
            handler.respond(m, m.status)
            if not self.srd:
                self.enter_error()
            return
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
        handler.respond(m, OK)

    def _pool_add(self, m: Msg, handler: RequestFrameHandler) -> None:
        opts = self.device.options
        pool = self.pool
        self.rx_order += 1
        m.order = self.rx_order
        if m.src is not None:  # a direct write: packets are (message, offset, length), one copy each
            size = opts.packet_size or opts.direct_packet_size
            n = 0
            for off in range(0, m.length, size):
                pool.append((m, off, min(size, m.length - off)))  # type: ignore[arg-type]
                n += 1
            m.pkts_left = n
            self.pool_bytes += m.length
            if not self.srd:
                self.pend.append(m)
            handler.dirty.add(self)
            return
        size = opts.packet_size or (opts.srd_packet_size if self.srd else mtu_bytes(m.mtu))
        data = m.data if m.data is not None else memoryview(b"")
        self.pool_bytes += len(data)
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
        handler.dirty.add(self)

    def place_packets(self, pkts: list[tuple[Msg, int, Any]], handler: RequestFrameHandler,
                      released: bool = False) -> None:
        """Place packets taken from the pool, in the order taken. Direct packets (message, offset, length)
        taken back to back are copied as one run (`_copy_pieces`: an 8 MiB SRD write is eight packets, and
        each wait costs about what a copy does on a busy GPU), and only then is each counted placed, so
        nothing later on the QP overtakes them; the rest are placed one by one.

        ``released``: the I/O thread calls without the QP's lock, which it takes for each placement but not
        for a run's copies, so a post on the QP (efa's one SRD QP carries both directions) does not wait for
        them; only this thread places, so the order holds. A message whose last packet lands after another
        thread moved the QP to the error state is answered as a QP in error answers (`on_item`)."""
        held = self.lock if released else contextlib.nullcontext()  # the caller's hold, or this one's
        for direct, group in itertools.groupby(pkts, key=lambda pkt: pkt[0].src is not None):
            if not direct:
                for pkt in group:
                    with held:
                        self.place_packet(pkt, handler)
                continue
            run = list(group)
            self._copy_pieces(run, handler)
            with held:
                for m, _off, _n in run:
                    if not released or self.state != ERR:
                        self._packet_placed(m, handler)
                        continue
                    m.pkts_left -= 1
                    if not m.pkts_left:
                        handler.respond(m, RESP_TIMEOUT if self.srd else RETRY_EXC)

    def place_packet(self, pkt: tuple[Msg, int, memoryview], handler: RequestFrameHandler) -> None:
        """Place one packet that carries its bytes (direct packets go by `place_packets`' runs)."""
        m, off, view = pkt
        if m.op in (w.OP_SEND, w.OP_SEND_IMM):
            if not self._scatter_recv(m, handler):
                return
        elif len(view):
            m.mr.write(m.raddr + off, view)
            handler.observe(self, m.raddr + off, len(view))
        self._packet_placed(m, handler)

    def _packet_placed(self, m: Msg, handler: RequestFrameHandler) -> None:
        """One more packet of ``m`` is in place: a message whose last one it was completes (RC: in order)."""
        m.pkts_left -= 1
        if m.pkts_left:
            return
        if self.srd:
            if m.land > time.monotonic():  # copied while the link carried it: reported once it has landed
                self.device.at_landing(m.land, lambda: self._landed(m, handler))
                return
            self._finish(m, handler)
            return
        pend = self.pend
        while pend and pend[0].pkts_left == 0:
            self._finish(pend.popleft(), handler)

    def _landed(self, m: Msg, handler: RequestFrameHandler) -> None:
        """I/O thread: an SRD direct write held past its placement (`_packet_placed`) has landed."""
        with self.lock:
            if self.state == ERR or self.closed:
                handler.respond(m, RESP_TIMEOUT)  # as a QP in error answers what arrives
            else:
                self._finish(m, handler)

    def rx_resume(self) -> None:
        """I/O thread: receive WRs were posted; retry requests waiting for one (RNR)."""
        handler = self.device.request_handler
        with self.lock:
            try:
                self._resume(handler)
            finally:
                self.flush_run(handler)
        handler.dev.flush_responses()

    def _resume(self, handler: RequestFrameHandler) -> None:
        """`rx_resume`'s work, lock held."""
        if self.state == ERR:
            return
        if self.srd:
            still = []
            for m in self.rnr_wait:
                if self._reserve_recv(m):
                    self.rx_exec(m, handler)
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
                    handler.fail(self, m)
                    return
            if m.op in w.RECV_OPS and m.recv is None and not self._reserve_recv(m):
                if not self.stalled:
                    self.stalled = True
                    handler.arm_rnr(self, m)
                return
            backlog.popleft()
            self.stalled = False
            self.rx_exec(m, handler)
        self.stalled = False

    def rnr_expired(self, m: Msg) -> None:
        handler = self.device.request_handler
        with self.lock:
            if self.srd:
                if m in self.rnr_wait:
                    self.rnr_wait.remove(m)
                    handler.respond(m, RNR_EXC)
                return
            if self.stalled and self.backlog and self.backlog[0] is m:
                self.backlog.clear()
                self.stalled = False
                handler.respond(m, RNR_EXC)


class RequestFrameHandler:
    """Frame handler for requests arriving at this device (runs on its I/O thread)."""

    def __init__(self, dev: SoftDevice) -> None:
        self.dev = dev
        self.dirty: set[QPCore] = set()
        self.runs: set[QPCore] = set()  # QPs holding a run of writes not copied yet

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
        return d[10] if d[3] in w.DATA_OPS and not d[4] & w.F_DIRECT else 0

    def sink_for(self, conn: Conn, d: tuple, n: int) -> memoryview | None:
        m = self._arrive(conn, d)
        conn.plan = m
        if m.status:
            return None
        if m.direct:  # its bytes go straight into the target: the QP's run of direct writes lands first
            qp = m.qp
            assert qp is not None
            if qp.write_run:
                with qp.lock:
                    qp.flush_run(self)
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
            if qp.state == ERR or m.deferred or m.rnr:
                qp.flush_run(self)  # the run came first: its bytes land and its acknowledgements go first
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
        # a fabric reorders within a bounded time, i.e. a bounded number of bytes in flight: a window of 1 MiB
        # direct packets counted only in packets held 64 MiB, and a message's completion waited for ~64 MiB
        # of later traffic or the link going idle
        opts = self.dev.options
        window, window_bytes = opts.reorder_window, opts.reorder_window_bytes
        for qp in list(self.dirty):
            with qp.lock:
                pool = qp.pool
                taken = []
                while len(pool) > window or (qp.pool_bytes > window_bytes and len(pool) > 1):
                    taken.append(self._take(qp))
            qp.place_packets(taken, self, released=True)
        conn.ro_qpns = None
        self.dev.flush_responses()

    def _take(self, qp: QPCore) -> tuple[Msg, int, memoryview]:
        """Remove a random packet of ``qp``'s pool that may be placed now.

        A packet of a message that is not `free` (an in-order write next to relaxed-ordering ones) goes
        only once every earlier packet is placed; free packets (adaptive routing, SRD, writes into an
        IBV_ACCESS_RELAXED_ORDERING region) may go any time.
        """
        pool = qp.pool
        rng = self.dev.rng
        i = rng.randrange(len(pool))
        if not pool[i][0].free:
            first = min(range(len(pool)), key=lambda k: (pool[k][0].order, pool[k][1]))
            candidates = [k for k in range(len(pool)) if pool[k][0].free or k == first]
            i = candidates[rng.randrange(len(candidates))]
        pool[i], pool[-1] = pool[-1], pool[i]
        pkt = pool.pop()
        held = pkt[2]
        qp.pool_bytes -= held if isinstance(held, int) else len(held)
        return pkt

    def on_idle(self) -> None:
        """No more input right now: copy every QP's run of direct writes, place every held packet (in random
        order)."""
        while self.runs:
            self.runs.pop().flush_run_released(self)
        while self.dirty:
            qp = self.dirty.pop()
            with qp.lock:
                taken = self._take_all(qp)
            qp.place_packets(taken, self, released=True)

    def drain_pool(self, qp: QPCore) -> None:
        """Place every packet ``qp``'s pool holds (lock held)."""
        qp.place_packets(self._take_all(qp), self)

    def _take_all(self, qp: QPCore) -> list[tuple[Msg, int, Any]]:
        """Every packet of ``qp``'s pool, in the order they may be placed (lock held)."""
        taken = []
        while qp.pool:
            taken.append(self._take(qp))
        self.dirty.discard(qp)
        return taken

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
                if m.src is not None and d[11]:
                    m.land = w.land_from_field(d[11], time.monotonic())
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
            if not m.reorder and m.op in (w.OP_WRITE, w.OP_WRITE_IMM) and m.length and m.src is None \
                    and m.mr.view is not None:
                m.direct = True
                m.data = m.mr.view_at(m.raddr, m.length)
            return m

    def fail(self, qp: QPCore, m: Msg) -> None:
        """An admitted-or-not request failed (lock held): NAK it and, for RC access errors, fail the QP."""
        qp.flush_run(self)  # earlier writes were accepted: their bytes land and they complete first
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
        conn.rsp_descs.append(w.RSP.pack(m.src_qpn, status, m.op, 0, m.seq, length, 0, value & w.MASK64))
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
        """Whole frame buffered: admit the leading run of plain in-order RC writes in one pass, one lock.

        A write into host memory is placed here and acknowledged with the others at the end; one into device
        memory (a direct write, or bytes from the wire) joins the QP's run of writes, copied and acknowledged
        by `QPResponder.flush_run`, as `rx_exec` does. Host placements stop once the run holds a write: the
        run's bytes land first. A full run is copied and ends the pass (a copy can take a while). The checks
        are `_arrive`'s and `rx_validate`'s for such a write; anything else ends the pass. Returns
        (descriptors handled, buffer position after their payloads); the rest of the frame goes through the
        general per-request path.
        """
        qp = self.dev.qps.get(descs[0][0])
        if qp is None or qp.srd or qp.closed or conn.ro_qpns:
            return 0, pos
        done = 0
        first_seq, placed = -1, 0  # the host placements: acknowledged as one range, before any of the run's
        with qp.lock:
            if qp.state not in (RTR, RTS, SQD) or qp.backlog or qp.stalled or qp.pool or qp.pend \
                    or not qp.access_flags & REMOTE_WRITE:
                return 0, pos
            qp.flush_run(self)  # the QP's run of writes lands before these
            qpn, dest, exp, path_mtu, pd = qp.qpn, qp.dest_qpn, qp.exp_psn, qp.path_mtu, qp.pd
            mrs = self.dev.mrs_by_rkey
            imports = conn.imports
            run = qp.write_run
            wire_run = _direct.copier() is not None  # wire writes into device memory go by the run's copy
            cur_rkey = cur_mtu = -1
            mtu = 0
            mr: MRCore | None = None
            base = limit = 0
            view: memoryview | None = None
            for d in descs:
                dst, src, seq, op, flags, mtu_code, _imm, rkey, _qk, raddr, length, psn, add, swap = d
                if op != w.OP_WRITE or dst != qpn or src != dest or psn != exp \
                        or flags & (w.F_AR | w.F_SRD) or mtu_code > path_mtu or length == 0:
                    break
                if rkey != cur_rkey:
                    mr = mrs.get(rkey)
                    if mr is None or not mr.valid or mr.pd is not pd or not mr.access & REMOTE_WRITE:
                        break
                    cur_rkey, base, limit, view = rkey, mr.addr, mr.addr + mr.length, mr.view
                if raddr < base or raddr + length > limit:
                    break
                if mtu_code != cur_mtu:
                    cur_mtu, mtu = mtu_code, mtu_bytes(mtu_code)
                if flags & w.F_DIRECT:
                    imp = imports.get(add)
                    if imp is None or imp.closed or swap + length > imp.size:
                        break
                elif view is None and not (mr.accessor is not None and wire_run):  # type: ignore[union-attr]
                    break
                host = view is not None and not flags & w.F_DIRECT  # placed now: after the run, if one waits
                if host and run:
                    break
                exp = (psn + max(1, -(-length // mtu))) & 0xFFFFFF
                done += 1
                if host:
                    off = raddr - base
                    view[off:off + length] = mv[pos:pos + length]
                    pos += length
                    if _trace.DIR:
                        _trace.stamp("placed")
                    obs = self.dev.placement_observer
                    if obs is not None:
                        obs(qpn, raddr, length)
                    if first_seq < 0:
                        first_seq = seq
                    placed += 1
                    continue
                if placed:  # acknowledged before the run's, which come once it is copied; none follow in this pass
                    self.ack(conn, dest, first_seq, placed)
                    placed = 0
                m = Msg(conn, d)
                m.qp, m.mr = qp, mr
                if flags & w.F_DIRECT:
                    m.src, m.src_off = imp, swap
                else:  # its bytes, out of the receive buffer the next read reuses
                    m.data = memoryview(bytearray(mv[pos:pos + length]))
                    pos += length
                run.append(m)
                self.runs.add(qp)
                if len(run) >= WRITE_RUN_MAX:  # copied now; the rest of the frame goes request by request, so
                    qp.flush_run(self)  # the I/O thread's other connections get their turn between two runs
                    break
            qp.exp_psn = exp
        if placed:
            self.ack(conn, dest, first_seq, placed)
        return done, pos

    # -- direct writes: the allocations a requester asks this side to open (`softverbs._direct`)
    def on_import(self, conn: Conn, xid: int, record: bytes) -> None:
        """IMPORT: open the allocation for ``conn`` and say whether it could be (refused: its writes stay on
        the wire)."""
        old = conn.imports.pop(xid, None)
        if old is not None:
            old.close()
        try:
            imp = _direct.open_import(_direct.copier(), record)
        except Exception as exc:  # any failure only keeps this allocation's writes on the wire
            self.dev.stats["imports_refused"] += 1
            log.info("softverbs %s: writes from %s's export %d stay on the wire: %s", self.dev.name, conn.peer, xid,
                     exc)
            conn.send_frame(w.KIND_IMPORTED, [], [], count=xid, flags=_direct.REFUSED)
            return
        conn.imports[xid] = imp
        self.dev.stats["imports_opened"] += 1
        conn.send_frame(w.KIND_IMPORTED, [], [], count=xid, flags=_direct.OPENED)

    def on_forget(self, conn: Conn, xid: int) -> None:
        imp = conn.imports.pop(xid, None)
        if imp is not None:
            imp.close()

    def observe(self, qp: QPCore, addr: int, length: int) -> None:
        """After each placement of inbound bytes: the trace's ``placed`` step, and the placement observer."""
        if _trace.DIR:
            _trace.stamp("placed")
        obs = self.dev.placement_observer
        if obs is not None:
            obs(qp.qpn, addr, length)


def _relaxed(dev: SoftDevice, rkey: int) -> bool:
    mr = dev.mrs_by_rkey.get(rkey)
    return mr is not None and bool(mr.access & RELAXED_ORDERING)
