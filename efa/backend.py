"""The efa backend: one SRD QP per rail, write-with-immediate, flags published by the receiving daemon.

Sending. Every plan row becomes RDMA write-with-immediate WRs on the rail's SRD QP, addressed through an
address handle per remote rail (its GID) plus the remote QPN and QKey:

- WRITE  -> one WR per piece of at most ``max_rdma_size`` bytes (the EFA device's limit); each piece's
  immediate names the receiver's connection and the piece's group (:mod:`efa.wire`).
- SIGNAL -> a 32-byte control record, staged in registered memory (EFA has no inline), written into the
  receiver's staging ring for this connection; the immediate names the record.
- FENCE  -> a control record too (a fence marker): later signals wait for everything before it.

EFA rules this follows: every WR is signaled (EFA refuses anything else), no IBV_SEND_FENCE, no inline.
A batch's token is reported when every one of its WRs has completed — SRD completes them in any order;
an error fails only that WR (the QP stays usable), and the token carries the first error status seen.

All connections of a rail share one SQ, so a batch that does not fit waits in a software queue (the
*backlog*) and is submitted from ``poll`` as completions free space: ``post`` never refuses, the proxy's
per-connection inflight cap bounds what waits. Submission also keeps, per connection, fewer than
``2**16`` WRs between the oldest one not yet completed and the newest, and fewer than half the staging
ring's records: that keeps the receiver's 18-bit counters unambiguous and a staging entry from being
overwritten before the receiver read it (``efa.wire``).

Receiving. Arrivals come out of the same CQ as send completions. Each one is counted by its connection's
:class:`efa.arrivals.ArrivalTracker`; control records are copied out of the staging ring at once. Flags
that became safe are handed to the daemon's :class:`FlagPublisher` (after the optional visibility flush).
Where the device supports unsolicited write receive, arrivals consume no receive WR; else the QP keeps
``rq_depth`` receive WRs posted and ``poll`` reposts the ones consumed.
"""

from __future__ import annotations

import logging
import random
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from efa.arrivals import ArrivalTracker, ProtocolViolation, SenderGroups
from efa.wire import (
    CTRL_DTYPE,
    CTRL_SIZE,
    INDEX_BITS,
    KIND_CTRL,
    KIND_DATA,
    MAX_CONNS,
    OP_ADD,
    OP_SET,
    decode_imm,
    encode_imm,
)
from transportd.backend import FlagPublisher, MemoryKey, PlanOp, SignalOp
from transportd.verbs_util import (
    BackendError,
    CqDrain,
    Rail,
    access_flags,
    completions,
    translate_verbs_errors,
)

__all__ = ["EfaBackend", "EfaRail"]

log = logging.getLogger("transportd.efa")

_WRITE, _SIGNAL, _FENCE = int(PlanOp.WRITE), int(PlanOp.SIGNAL), int(PlanOp.FENCE)
_SET = int(SignalOp.SET)
_SEQ_BITS = 48
_SEQ_MASK = (1 << _SEQ_BITS) - 1
_RECV_TAG = 1 << 63  # wr_id of a posted receive WR
_MAX_SPAN = 1 << 16  # most WRs of one connection between the oldest incomplete and the newest submitted
_WC_RECV_RDMA_WITH_IMM = 129
_QKEY = 0x11111111
_POOL_CHUNK = 1024  # send-staging entries registered at a time


class EfaRail(Rail):
    """A rail on an EFA device: an ``EfaContext`` (for the device's EFA limits) and, where the device can
    mark unsolicited write-with-imm receives, an ``EfaCQ`` that reports them."""

    NODE_TYPES = ("IBV_NODE_UNSPECIFIED",)
    KIND = "an EFA device"

    def __init__(self, verbs: Any = None, device: str | None = None, *, port: int = 1, gid_index: int = 0,
                 cq_depth: int = 1 << 16, use_unsolicited: bool = True) -> None:
        self.use_unsolicited = use_unsolicited
        super().__init__(verbs, device, port=port, gid_index=gid_index, cq_depth=cq_depth)

    def create_context(self) -> None:
        efadv = self.v.efadv
        self.ctx = efadv.EfaContext(name=self.device_name)
        self.efa_attr = self.ctx.query_efa_device()
        caps = int(self.efa_attr.device_caps)
        ee = self.v.efa_enums
        if not caps & int(ee.EFADV_DEVICE_ATTR_CAPS_RDMA_WRITE):
            raise BackendError(f"EFA device {self.device_name} has no RDMA write capability "
                               "(EFADV_DEVICE_ATTR_CAPS_RDMA_WRITE; needs an EFA generation with RDMA write and "
                               "rdma-core >= 46): the efa backend cannot run on it")
        self.unsolicited = self.use_unsolicited and bool(caps & int(ee.EFADV_DEVICE_ATTR_CAPS_UNSOLICITED_WRITE_RECV))

    def create_cq(self, depth: int) -> None:
        if not self.unsolicited:
            super().create_cq(depth)
            return
        v = self.v
        wcf = v.libibverbs_enums.ibv_create_cq_wc_flags
        flags = int(wcf.IBV_WC_EX_WITH_BYTE_LEN | wcf.IBV_WC_EX_WITH_IMM | wcf.IBV_WC_EX_WITH_QP_NUM)
        self.cq = v.efadv.EfaCQ(self.ctx, v.cq.CqInitAttrEx(cqe=depth, wc_flags=flags),
                                v.efadv.EfaDVCQInitAttr(wc_flags=int(v.efa_enums.EFADV_WC_EX_WITH_IS_UNSOLICITED)))
        self.drain = CqDrain(self.cq, extended=True, unsolicited=True)


@dataclass(eq=False)
class _Batch:
    token: int
    remaining: int
    status: int = 0
    vendor_err: int = 0


@dataclass(eq=False)
class _Conn:
    conn_id: int
    job: str
    index: int  # our index: names this connection in the immediates the peer sends us
    key: int  # names this connection in our send WR ids
    recv_staging: np.ndarray  # CTRL_DTYPE ring the peer writes records into
    recv_lkey: int
    arrivals: ArrivalTracker = field(default_factory=ArrivalTracker)
    groups: SenderGroups = field(default_factory=SenderGroups)
    connected: bool = False
    # the peer's end
    ah: Any = None
    gid: str = ""
    qpn: int = 0
    qkey: int = 0
    peer_index: int = 0
    peer_staging_addr: int = 0
    peer_staging_rkey: int = 0
    peer_staging_entries: int = 0
    # send side bookkeeping
    next_seq: int = 0  # number of the next WR lowered (random start: stale completions never match)
    oldest: int = 0  # every WR below this has completed
    pending: dict[int, tuple[_Batch, int]] = field(default_factory=dict)  # seq -> (batch, staging entry or -1)
    waiting: int = 0  # WRs lowered, not yet submitted (in the backlog)
    oldest_ctrl: int = 0
    ctrl_pending: set[int] = field(default_factory=set)
    ctrl_seq: dict[int, int] = field(default_factory=dict)  # WR seq -> record seq, for records in flight
    failed: bool = False  # the peer broke the counting protocol: nothing more is published for it

    def inflight(self) -> int:
        return len(self.pending)


class _StagingPool:
    """Registered 32-byte send-staging entries for control records, handed out and returned one by one."""

    def __init__(self, rail: Rail) -> None:
        self.rail = rail
        self.chunks: list[np.ndarray] = []
        self.lkeys: list[int] = []
        self.free: list[int] = []  # entry ids: chunk << 16 | index

    def take(self) -> int:
        if not self.free:
            chunk = np.zeros(_POOL_CHUNK, dtype=CTRL_DTYPE)
            mr = self.rail.register(chunk.ctypes.data, chunk.nbytes, access_flags(self.rail.v))
            c = len(self.chunks)
            self.chunks.append(chunk)
            self.lkeys.append(int(mr.lkey))
            self.free.extend((c << 16) | i for i in range(_POOL_CHUNK - 1, -1, -1))
        return self.free.pop()

    def give(self, entry: int) -> None:
        self.free.append(entry)

    def record(self, entry: int) -> np.ndarray:
        return self.chunks[entry >> 16][entry & 0xFFFF: (entry & 0xFFFF) + 1]

    def sge(self, entry: int) -> tuple[int, int]:
        chunk = self.chunks[entry >> 16]
        return chunk.ctypes.data + CTRL_SIZE * (entry & 0xFFFF), self.lkeys[entry >> 16]


class EfaBackend:
    """SRD backend for one rail (an EFA device).

    ``device``: verbs device name (None or "": the first one). ``verbs``: provider name or namespace.
    ``inflight_cap``/``batch_max``: the proxy's limits. ``sq_depth``/``rq_depth``/``cq_depth``: queue sizes
    (capped by the device). ``staging_entries``: control records in flight per connection (a power of
    two; 32 bytes each, per connection, on the receiving side). ``cumulative``: every signal also waits for
    all earlier writes of the connection (ib semantics) instead of those since the previous signal
    (``efa.arrivals``). ``visibility_flush``: call ``flush_hook`` (a no-op until the GPU path installs
    ``cuFlushGPUDirectRDMAWrites``) once before publishing the flags of one poll. ``use_unsolicited``:
    use unsolicited write receive where the device has it. ``max_rdma_size``: split writes at this size
    (0: the device's limit). ``signal_mode`` is accepted for a uniform ``open_backend`` call and unused:
    on efa the receiving daemon publishes every flag.
    """

    name = "efa"

    def __init__(self, device: str | None = None, *, verbs: Any = None, inflight_cap: int = 256,
                 batch_max: int = 8, port: int = 1, gid_index: int = 0, sq_depth: int = 4096,
                 rq_depth: int = 4096, cq_depth: int = 1 << 16, staging_entries: int = 4096,
                 cumulative: bool = False, visibility_flush: bool = True,
                 flush_hook: Callable[[], None] | None = None, use_unsolicited: bool = True,
                 max_rdma_size: int = 0, signal_mode: str | None = None) -> None:
        if staging_entries < 64 or staging_entries & (staging_entries - 1) or staging_entries > 1 << INDEX_BITS:
            raise BackendError(f"staging_entries must be a power of two in [64, {1 << INDEX_BITS}]")
        self.inflight_cap = inflight_cap
        self.batch_max = batch_max
        self.staging_entries = staging_entries
        self.cumulative = cumulative
        self.visibility_flush = visibility_flush
        self.flush_hook = flush_hook
        self._conns: dict[int, _Conn] = {}
        self._by_index: dict[int, _Conn] = {}
        self._by_key: dict[int, _Conn] = {}
        self._free_index = deque(range(MAX_CONNS))
        self._free_keys = deque(range(1, 1 << (63 - _SEQ_BITS)))
        self._ahs: dict[str, list[Any]] = {}  # gid -> [AH, users]
        self._backlog: deque[tuple] = deque()
        self._submitted = 0  # WRs on the SQ (submitted, not completed)
        self._carry: list[tuple[int, int, int]] = []
        self._publisher: FlagPublisher | None = None
        self._unpublished: list[tuple[int, int, int, SignalOp, int]] = []
        self._rq_missing = 0
        self.qp: Any = None
        self.stats = {"wrs": 0, "pieces": 0, "signals": 0, "fences": 0, "errors": 0, "arrivals": 0,
                      "published": 0, "visibility_flushes": 0, "backlogged": 0, "protocol_errors": 0,
                      "unknown_arrivals": 0}
        self.rail = EfaRail(verbs, device, port=port, gid_index=gid_index, cq_depth=cq_depth,
                            use_unsolicited=use_unsolicited)
        try:
            self.v = v = self.rail.v
            attr = self.rail.efa_attr
            self.max_rdma_size = int(max_rdma_size) or int(attr.max_rdma_size)
            if self.max_rdma_size <= 0:
                raise BackendError(f"EFA device {self.rail.device_name} reports max_rdma_size 0")
            self.sq_depth = min(sq_depth, int(attr.max_sq_wr))
            self.rq_depth = 0 if self.rail.unsolicited else min(rq_depth, int(attr.max_rq_wr))
            self._signaled = int(v.libibverbs_enums.ibv_send_flags.IBV_SEND_SIGNALED)
            self._pool = _StagingPool(self.rail)
            self._scratch = np.zeros(1, dtype=np.uint64)
            self._scratch_mr = self.rail.register(self._scratch.ctypes.data, 8, access_flags(v))
            self.qkey = _QKEY
            self._create_qp()
        except BaseException:
            self.close()
            raise

    def _create_qp(self) -> None:
        v = self.v
        e = v.libibverbs_enums
        ee = v.efa_enums
        cap = v.qp.QPCap(max_send_wr=self.sq_depth, max_recv_wr=max(1, self.rq_depth), max_send_sge=1,
                         max_recv_sge=1, max_inline_data=0)
        init = v.qp.QPInitAttrEx(
            qp_type=e.ibv_qp_type.IBV_QPT_DRIVER, scq=self.rail.cq, rcq=self.rail.cq, cap=cap, pd=self.rail.pd,
            comp_mask=int(e.ibv_qp_init_attr_mask.IBV_QP_INIT_ATTR_PD
                          | e.ibv_qp_init_attr_mask.IBV_QP_INIT_ATTR_SEND_OPS_FLAGS),
            send_ops_flags=int(e.ibv_qp_create_send_ops_flags.IBV_QP_EX_WITH_RDMA_WRITE_WITH_IMM))
        efa_init = v.efadv.EfaQPInitAttr()
        efa_init.driver_qp_type = int(ee.EFADV_QP_DRIVER_TYPE_SRD)
        if self.rail.unsolicited:
            efa_init.flags = int(ee.EFADV_QP_FLAGS_UNSOLICITED_WRITE_RECV)
        with translate_verbs_errors(f"creating the SRD QP on {self.rail.device_name}", v):
            self.qp = v.efadv.SRDQPEx(self.rail.ctx, init, efa_init)
            attr = v.qp.QPAttr(port_num=self.rail.port)
            attr.qkey = self.qkey
            attr.pkey_index = 0
            attr.sq_psn = random.getrandbits(24)
            self.qp.to_rts(attr)
            if int(self.rail.efa_attr.device_caps) & int(ee.EFADV_DEVICE_ATTR_CAPS_RNR_RETRY):
                # a peer without unsolicited write receive may briefly run out of receive WRs: wait
                # for it (7 = retry forever) rather than fail the write with an RNR error
                rts = v.qp.QPAttr(qp_state=e.ibv_qp_state.IBV_QPS_RTS, port_num=self.rail.port)
                rts.rnr_retry = 7
                self.qp.modify(rts, int(e.ibv_qp_attr_mask.IBV_QP_STATE | e.ibv_qp_attr_mask.IBV_QP_RNR_RETRY))
        if self.rq_depth:
            self._rq_missing = self.rq_depth
            self._replenish()

    # --- addressing ----------------------------------------------------------------------------------
    def local_address(self) -> dict[str, Any]:
        r = self.rail
        return {"transport": "efa", "device": r.device_name, "gid": str(r.gid.gid), "qpn": int(self.qp.qp_num),
                "qkey": self.qkey, "max_rdma_size": self.max_rdma_size}

    # --- memory --------------------------------------------------------------------------------------
    def register_memory(self, addr: int, length: int, *, remote_write: bool, remote_atomic: bool,
                        accessor: Any = None) -> MemoryKey:
        """Register [addr, addr+length). EFA has no atomics: ``remote_atomic`` only asks for remote write
        (flags are written by the receiving daemon, never by the NIC). ``accessor``: see ``Rail.register``."""
        mr = self.rail.register(addr, length, access_flags(self.v, remote_write=remote_write or remote_atomic),
                                accessor)
        return MemoryKey(addr=addr, length=length, lkey=int(mr.lkey), rkey=int(mr.rkey))

    def deregister_memory(self, key: MemoryKey) -> None:
        self.rail.deregister(key.addr, key.lkey)

    # --- connections ---------------------------------------------------------------------------------
    def create_endpoint(self, conn_id: int, job: str) -> dict[str, Any]:
        """Set up both directions of ``conn_id``: a staging ring for the records the peer will send us."""
        if conn_id in self._conns:
            raise BackendError(f"connection {conn_id} already exists")
        if not self._free_index:
            raise BackendError(f"more than {MAX_CONNS} connections on one efa rail")
        staging = np.zeros(self.staging_entries, dtype=CTRL_DTYPE)
        mr = self.rail.register(staging.ctypes.data, staging.nbytes, access_flags(self.v, remote_write=True))
        index = self._free_index.popleft()
        key = self._free_keys.popleft()
        conn = _Conn(conn_id=conn_id, job=job, index=index, key=key, recv_staging=staging, recv_lkey=int(mr.lkey),
                     groups=SenderGroups(cumulative=self.cumulative))
        conn.next_seq = conn.oldest = random.getrandbits(40)
        self._conns[conn_id] = conn
        self._by_index[index] = conn
        self._by_key[key] = conn
        return {**self.local_address(), "index": index, "staging_addr": int(staging.ctypes.data),
                "staging_rkey": int(mr.rkey), "staging_entries": self.staging_entries, "job": job}

    def connect(self, conn_id: int, remote: dict[str, Any]) -> None:
        """Address the peer: an address handle for its GID (shared by connections to the same rail)."""
        conn = self._conn(conn_id)
        if conn.connected:
            raise BackendError(f"connection {conn_id} is already connected")
        if remote.get("transport") != "efa":
            raise BackendError(f"connection {conn_id}: remote end is {remote.get('transport')!r}, not efa")
        gid = str(remote["gid"])
        entry = self._ahs.get(gid)
        if entry is None:
            v = self.v
            with translate_verbs_errors(f"creating an address handle for {gid}", v):
                gr = v.addr.GlobalRoute(dgid=v.addr.GID(gid), sgid_index=self.rail.gid_index)
                ah_attr = v.addr.AHAttr(port_num=self.rail.port, is_global=1, gr=gr)
                entry = self._ahs[gid] = [v.addr.AH(self.rail.pd, attr=ah_attr), 0]
        entry[1] += 1
        conn.ah, conn.gid = entry[0], gid
        conn.qpn, conn.qkey = int(remote["qpn"]), int(remote["qkey"])
        conn.peer_index = int(remote["index"])
        conn.peer_staging_addr = int(remote["staging_addr"])
        conn.peer_staging_rkey = int(remote["staging_rkey"])
        conn.peer_staging_entries = int(remote["staging_entries"])
        conn.connected = True

    def close_connection(self, conn_id: int) -> None:
        """Forget ``conn_id``: its outstanding tokens are dropped (the proxy fails them itself), WRs still in
        the backlog are discarded, and arrivals for it are ignored from now on."""
        conn = self._conns.pop(conn_id, None)
        if conn is None:
            return
        self._by_index.pop(conn.index, None)
        self._by_key.pop(conn.key, None)
        if conn.waiting:
            self._backlog = deque(wr for wr in self._backlog if wr[0] is not conn)
        for _batch, entry in conn.pending.values():
            if entry >= 0:
                self._pool.give(entry)  # a WR still on the SQ may read it: harmless, the record is stale
        conn.pending.clear()
        if conn.ah is not None:
            entry_ = self._ahs.get(conn.gid)
            if entry_ is not None:
                entry_[1] -= 1
                if entry_[1] == 0:
                    del self._ahs[conn.gid]
                    entry_[0].close()
        self.rail.deregister(conn.recv_staging.ctypes.data, conn.recv_lkey)
        self._free_index.append(conn.index)
        self._free_keys.append(conn.key)

    # --- data path -----------------------------------------------------------------------------------
    def post(self, conn_id: int, plan: np.ndarray) -> int:
        """Lower ``plan`` to write-with-imm WRs and submit what fits; returns how many WRs it became."""
        conn = self._conn(conn_id)
        if not conn.connected:
            raise BackendError(f"connection {conn_id} is not connected")
        n = self._lower(conn, plan)
        self._submit()
        return n

    def post_batches(self, conn_ids: np.ndarray, plan: np.ndarray, bounds: np.ndarray) -> np.ndarray:
        """Post several batches (``plan[bounds[i]:bounds[i+1]]`` on ``conn_ids[i]``) with one submission."""
        out = np.zeros(len(conn_ids), dtype=np.int64)
        for i, (cid, s, e) in enumerate(zip(conn_ids.tolist(), bounds[:-1].tolist(), bounds[1:].tolist(),
                                            strict=True)):
            conn = self._conn(cid)
            if not conn.connected:
                raise BackendError(f"connection {cid} is not connected")
            out[i] = self._lower(conn, plan[s:e])
        self._submit()
        return out

    def _lower(self, conn: _Conn, plan: np.ndarray) -> int:
        """Plan rows -> WRs appended to the backlog; returns the number of WRs."""
        rows = plan.tolist()
        n_rows = len(rows)
        if not n_rows:
            return 0
        groups = conn.groups
        pool = self._pool
        maxsz = self.max_rdma_size
        peer = conn.peer_index
        srkey, saddr, sents = conn.peer_staging_rkey, conn.peer_staging_addr, conn.peer_staging_entries
        out: list[tuple] = []
        entries: list[int] = []
        ctrl: list[int] = []  # record seq per WR (-1: a data piece)
        batches: list[tuple[int, _Batch]] = []  # (number of WRs before the batch ends, batch)
        saved = (groups.group, groups.pieces, groups.closed, groups.after, groups.seq)
        try:
            for i, (op, sop, rank, length, laddr, raddr, lkey, rkey, value, slot, _chunk, token) in enumerate(rows):
                if op == _WRITE:
                    npieces = max(1, -(-length // maxsz))
                    imm = encode_imm(KIND_DATA, peer, groups.piece_group(npieces))
                    for off in range(0, max(length, 1), maxsz):
                        out.append((rkey, raddr + off, laddr + off, min(maxsz, length - off), lkey, imm))
                        entries.append(-1)
                        ctrl.append(-1)
                    self.stats["pieces"] += npieces
                elif op == _SIGNAL or op == _FENCE:
                    entry = pool.take()
                    entries.append(entry)
                    rec = pool.record(entry)
                    if op == _SIGNAL:
                        seq = groups.signal(rec, OP_SET if sop == _SET else OP_ADD, value, rank, slot)
                        self.stats["signals"] += 1
                    else:
                        seq = groups.fence(rec)
                        self.stats["fences"] += 1
                    addr, slkey = pool.sge(entry)
                    out.append((srkey, saddr + CTRL_SIZE * (seq % sents), addr, CTRL_SIZE, slkey,
                                encode_imm(KIND_CTRL, peer, seq)))
                    ctrl.append(seq)
                else:
                    raise BackendError(f"plan row {i}: unknown op {op}")
                if i == n_rows - 1 or (token != rows[i + 1][11] and token != 0):
                    batches.append((len(out), _Batch(token, 0)))
        except BaseException:
            groups.group, groups.pieces, groups.closed, groups.after, groups.seq = saved
            for entry in entries:
                if entry >= 0:
                    pool.give(entry)
            raise
        # commit: number the WRs, attach them to their batches, queue them
        seq = conn.next_seq
        start = 0
        backlog = self._backlog
        pending = conn.pending
        for end, batch in batches:
            batch.remaining = end - start
            for k in range(start, end):
                pending[seq] = (batch, entries[k])
                if ctrl[k] >= 0:
                    conn.ctrl_seq[seq] = ctrl[k]
                    conn.ctrl_pending.add(ctrl[k])
                backlog.append((conn, seq, *out[k]))
                seq += 1
            start = end
        conn.next_seq = seq
        conn.waiting += len(out)
        self.stats["wrs"] += len(out)
        return len(out)

    def _submit(self) -> None:
        """Move WRs from the backlog onto the SQ: as many as fit, keeping each connection's windows."""
        backlog = self._backlog
        room = self.sq_depth - self._submitted
        if not backlog or room <= 0:
            if backlog:
                self.stats["backlogged"] += 1
            return
        batch: list[tuple] = []
        while backlog and len(batch) < room:
            item = backlog[0]
            conn, seq = item[0], item[1]
            if seq - conn.oldest >= _MAX_SPAN:
                break
            rec = conn.ctrl_seq.get(seq)
            if rec is not None and rec - conn.oldest_ctrl >= conn.peer_staging_entries // 2:
                break
            batch.append(backlog.popleft())
        if batch:
            qp = self.qp
            SGE = self.v.wr.SGE
            sig = self._signaled
            try:
                with translate_verbs_errors("posting on the SRD QP", self.v):
                    qp.wr_start()
                    try:
                        for conn, seq, rkey, raddr, laddr, length, lkey, imm in batch:
                            qp.wr_id = (conn.key << _SEQ_BITS) | (seq & _SEQ_MASK)
                            qp.wr_flags = sig
                            qp.wr_rdma_write_imm(rkey, raddr, imm)
                            qp.wr_set_sge(SGE(laddr, length, lkey))
                            qp.wr_set_ud_addr(conn.ah, conn.qpn, conn.qkey)
                        qp.wr_complete()
                    except BaseException:
                        qp.wr_abort()
                        raise
            except BaseException:
                backlog.extendleft(reversed(batch))  # nothing was posted: they wait again, in order
                raise
            for item in batch:
                item[0].waiting -= 1
            self._submitted += len(batch)
        if backlog:
            self.stats["backlogged"] += 1

    def poll(self, max_completions: int = 256) -> np.ndarray:
        """Handle send completions and arrivals; returns completed tokens (each batch once)."""
        out = self._carry
        self._carry = []
        with translate_verbs_errors("polling the CQ", self.v):
            wcs = self.rail.drain.poll(max(64, min(2 * max_completions, 4096)))
        if len(wcs):
            touched = self._handle(wcs, out)
            if touched:
                self._publish(touched)
        if self._rq_missing >= max(1, self.rq_depth // 8):
            self._replenish()
        if self._backlog:
            self._submit()
        if len(out) > max_completions:
            self._carry = out[max_completions:]
            out = out[:max_completions]
        return completions(out)

    def _handle(self, wcs: np.ndarray, out: list[tuple[int, int, int]]) -> list[_Conn]:
        touched: list[_Conn] = []
        by_key, by_index = self._by_key, self._by_index
        stats = self.stats
        sent_done = 0
        for wr_id, status, opcode, vendor_err, imm, unsolicited in zip(
                wcs["wr_id"].tolist(), wcs["status"].tolist(), wcs["opcode"].tolist(), wcs["vendor_err"].tolist(),
                wcs["imm"].tolist(), wcs["unsolicited"].tolist(), strict=True):
            if status == 0 and opcode == _WC_RECV_RDMA_WITH_IMM:
                if not unsolicited:
                    self._rq_missing += 1
                stats["arrivals"] += 1
                kind, index, idx = decode_imm(imm)
                conn = by_index.get(index)
                if conn is None or conn.failed:
                    stats["unknown_arrivals"] += 1
                    continue
                try:
                    if kind == KIND_DATA:
                        conn.arrivals.on_piece(idx)
                    elif kind == KIND_CTRL:
                        entries = len(conn.recv_staging)
                        conn.arrivals.on_record(idx, conn.recv_staging[idx & (entries - 1)].copy())
                    else:
                        raise ProtocolViolation(f"immediate kind {kind}")
                except ProtocolViolation as exc:
                    conn.failed = True
                    stats["protocol_errors"] += 1
                    log.error("efa connection %d: peer broke the counting protocol (%s); no more flags will be "
                              "published for it", conn.conn_id, exc)
                    continue
                if not touched or touched[-1] is not conn:
                    touched.append(conn)
                continue
            if wr_id & _RECV_TAG:
                self._rq_missing += 1  # a receive WR flushed (QP going away)
                continue
            sent_done += 1
            if status:
                stats["errors"] += 1
            conn = by_key.get(wr_id >> _SEQ_BITS)
            if conn is None:
                continue
            seq = wr_id & _SEQ_MASK
            item = conn.pending.pop(seq, None)
            if item is None:
                continue
            batch, entry = item
            if entry >= 0:
                self._pool.give(entry)
                rec = conn.ctrl_seq.pop(seq)
                conn.ctrl_pending.discard(rec)
                if rec == conn.oldest_ctrl:
                    nxt = conn.groups.seq
                    while conn.oldest_ctrl < nxt and conn.oldest_ctrl not in conn.ctrl_pending:
                        conn.oldest_ctrl += 1
            if seq == conn.oldest:
                nxt = conn.next_seq
                while conn.oldest < nxt and conn.oldest not in conn.pending:
                    conn.oldest += 1
            if status and not batch.status:
                batch.status, batch.vendor_err = status, vendor_err
            batch.remaining -= 1
            if batch.remaining == 0:
                out.append((batch.token, batch.status, batch.vendor_err))
        self._submitted -= sent_done
        return touched

    def _publish(self, conns: list[_Conn]) -> None:
        flushed = False
        publisher = self._publisher
        for conn in dict.fromkeys(conns):
            ready = conn.arrivals.ready()
            if not ready:
                continue
            if self.visibility_flush and not flushed:
                flushed = True
                self.stats["visibility_flushes"] += 1
                if self.flush_hook is not None:
                    self.flush_hook()
            for p in ready:
                if publisher is None:
                    self._unpublished.append((conn.conn_id, p.rank, p.slot, p.op, p.value))
                else:
                    publisher(conn.conn_id, p.rank, p.slot, p.op, p.value)
            self.stats["published"] += len(ready)

    def _replenish(self) -> None:
        """Post receive WRs for the ones arrivals consumed (only without unsolicited write receive)."""
        n = self._rq_missing
        if not n or self.qp is None:
            return
        v = self.v
        sge = v.wr.SGE(int(self._scratch.ctypes.data), 8, int(self._scratch_mr.lkey))
        head = None
        for _ in range(n):
            head = v.wr.RecvWR(wr_id=_RECV_TAG, num_sge=1, sg=[sge], next_wr=head)
        with translate_verbs_errors(f"posting {n} receive WRs", v):
            self.qp.post_recv(head)
        self._rq_missing = 0

    def inflight(self, conn_id: int) -> int:
        """WRs posted on ``conn_id`` (submitted or still in the backlog) and not yet completed."""
        return self._conn(conn_id).inflight()

    def set_flag_publisher(self, publisher: FlagPublisher) -> None:
        """Install the daemon's publisher; flags that became ready before it was installed go out now."""
        self._publisher = publisher
        pending, self._unpublished = self._unpublished, []
        for args in pending:
            publisher(*args)

    def close(self) -> None:
        for conn_id in list(getattr(self, "_conns", {})):
            self.close_connection(conn_id)
        if self.qp is not None:
            self.qp.close()
            self.qp = None
        for ah, _users in self._ahs.values():
            ah.close()
        self._ahs.clear()
        self.rail.close()

    def __enter__(self) -> EfaBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _conn(self, conn_id: int) -> _Conn:
        try:
            return self._conns[conn_id]
        except KeyError:
            raise BackendError(f"unknown connection {conn_id}") from None
