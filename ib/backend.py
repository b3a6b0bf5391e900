"""The ib backend: one RC QP per connection on a ConnectX-class NIC; the NIC writes the flags itself.

Plan rows become work requests on the connection's QP, in row order:

- WRITE  -> RDMA write (laddr/lkey -> raddr/rkey).
- SIGNAL -> depends on ``signal_mode`` (below).
- FENCE  -> a zero-length RDMA read (the *ordering read*, below), and the next WR of the connection
  carries IBV_SEND_FENCE. Later writes then start only after everything before the FENCE was placed, with
  or without adaptive routing.

Only the last WR of a batch (a run of rows with the same token; the last row of a plan always ends one) is
signaled; its completion retires the whole batch and reports the token. The SQ holds ``inflight_cap`` WRs
plus one batch's worth; ``post`` refuses (``SendQueueFullError``, nothing posted) rather than overrun it.

Signal modes. Which is correct depends on the fabric:

``write`` (default)
    The flag is an 8-byte inline RDMA write after the payload on the same QP. A write cannot add, so the
    backend keeps a *shadow* per (connection, flag address): ADD adds to the shadow and writes the new
    absolute value, SET sets it. Hence in write mode **a flag slot must have a single signalling
    source** (one connection, and a flag array that starts at zero when the connection is made): two
    nodes adding to one slot overwrite each other — use ``atomic`` for slots several nodes add to.
    Correct only while RC places writes in order: **adaptive routing off**, and the flag's MR registered
    **without relaxed ordering** (this backend never sets IBV_ACCESS_RELAXED_ORDERING on a region
    registered with ``remote_atomic``, which is how flag arrays are registered).
``atomic``
    ADD is an RDMA fetch-and-add on the flag. The responder executes an atomic only after every earlier
    request of the QP is placed (IBTA ordering; what DeepEP and NVSHMEM rely on), so it is safe under
    adaptive routing and needs no shadow: any number of nodes may add to a slot. SET has no atomic
    (compare-and-swap is outside our verbs subset and would need the old value), so a SET is posted the
    way ``fence`` mode posts every flag: ordering read, then a fenced 8-byte write of the value.
``fence``
    Every flag is an ordering read followed by an 8-byte write carrying IBV_SEND_FENCE (shadow values as
    in ``write`` mode, with the same single-source rule). What the fence does and does not do: per
    ibv_post_send(3) a fenced WR is not started until every *earlier RDMA read and atomic* of the QP has
    completed. It does not wait for earlier RDMA *writes* — those need no fence on an in-order path and
    are not ordered by one under adaptive routing, where a fenced flag write could still overtake its
    payload. The ordering read is what makes it safe: a zero-length RDMA read is executed by the
    responder only after every earlier write of the QP is placed, and its response is what the fence
    waits for. So the flag write starts only after the payload is placed, whatever the routing, and the
    cost is one round trip on the wire per flag — NIC-side, the proxy never waits on a CQ.

The ordering read has length zero, so it needs no remote key and touches no memory (IBTA: a zero-length
RDMA read carries no R_Key check); it is the same trick NVSHMEM and Perseus use before a fenced flag.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ib.tracking import SEQ_BITS, SEQ_MASK, OrderedBatches
from transportd.backend import FlagPublisher, MemoryKey, PlanOp, SignalOp
from transportd.verbs_util import (
    BackendError,
    Rail,
    SendQueueFullError,
    access_flags,
    completions,
    translate_verbs_errors,
)

__all__ = ["SIGNAL_MODES", "IbBackend"]

SIGNAL_MODES = ("write", "atomic", "fence")

_WRITE, _SIGNAL, _FENCE = int(PlanOp.WRITE), int(PlanOp.SIGNAL), int(PlanOp.FENCE)
_SET = int(SignalOp.SET)
_MASK64 = (1 << 64) - 1
_MAX_KEYS = (1 << (64 - SEQ_BITS)) - 1

# lowered work requests: (kind, rkey, raddr, laddr, length, lkey, value)
_W, _F, _A, _R = 0, 1, 2, 3
_FLUSH_ERR = 5  # IBV_WC_WR_FLUSH_ERR: what a post on a failed connection completes with


@dataclass(eq=False)
class _Conn:
    conn_id: int
    job: str
    key: int
    qp: Any
    psn: int
    sq_depth: int
    staging: np.ndarray  # one 8-byte flag value per SQ slot (the inline source, or the SGE without inline)
    staging_lkey: int
    tracker: OrderedBatches = field(default_factory=OrderedBatches)
    shadow: dict[tuple[int, int], int] = field(default_factory=dict)
    connected: bool = False
    fence_next: bool = False  # a FENCE row was posted: the next WR carries IBV_SEND_FENCE
    after_read: bool = False  # the last WR posted was an ordering read
    remote: dict[str, Any] = field(default_factory=dict)


class IbBackend:
    """RC backend for one rail (an RDMA device port).

    ``device``: verbs device name (None or "": the first one). ``verbs``: provider name or namespace for
    :func:`transportd.verbs_util.load_verbs`. ``signal_mode``: write, atomic or fence (module docstring).
    ``inflight_cap``/``batch_max``: the proxy's limits, which size the SQ. ``cq_depth``: the rail's CQ
    (shared by every connection; a connection is refused when the sum of SQ depths would exceed it,
    since a QP in error may complete every outstanding WR). ``path_mtu``: an ibv_mtu value, 0 for the
    port's active MTU. ``timeout``/``retry_cnt``/``rnr_retry``/``min_rnr_timer``: RC retry settings.
    ``relaxed_ordering``: register data regions (not flag regions) with relaxed ordering.
    ``visibility_flush`` is accepted for a uniform ``open_backend`` call and unused: on ib the NIC
    writes the flag, ordered by the fabric, so there is nothing for the host to flush.
    """

    name = "ib"

    def __init__(self, device: str | None = None, *, verbs: Any = None, signal_mode: str = "write",
                 inflight_cap: int = 256, batch_max: int = 8, port: int = 1, gid_index: int = 0,
                 cq_depth: int = 1 << 18, path_mtu: int = 0, timeout: int = 14, retry_cnt: int = 7,
                 rnr_retry: int = 7, min_rnr_timer: int = 12, relaxed_ordering: bool = False,
                 visibility_flush: Any = None) -> None:
        if signal_mode not in SIGNAL_MODES:
            raise BackendError(f"signal_mode must be one of {', '.join(SIGNAL_MODES)}, not {signal_mode!r}")
        if inflight_cap < 1 or batch_max < 1:
            raise BackendError("inflight_cap and batch_max must be at least 1")
        self.signal_mode = signal_mode
        self.inflight_cap = inflight_cap
        self.batch_max = batch_max
        self.timeout = timeout
        self.retry_cnt = retry_cnt
        self.rnr_retry = rnr_retry
        self.min_rnr_timer = min_rnr_timer
        self.relaxed_ordering = relaxed_ordering
        self._conns: dict[int, _Conn] = {}
        self._by_key: dict[int, _Conn] = {}
        self._free_keys = list(range(_MAX_KEYS, 0, -1))
        self._carry: list[tuple[int, int, int]] = []
        self._publisher: FlagPublisher | None = None
        self._scratch: np.ndarray | None = None
        self._inline: bool | None = None  # flag values go inline (decided by the first QP created)
        self.stats = {"wrs": 0, "signals": 0, "order_reads": 0, "fences": 0, "errors": 0}
        self.rail = Rail(verbs, device, port=port, gid_index=gid_index, cq_depth=cq_depth)
        try:
            v = self.rail.v
            self.v = v
            e = v.libibverbs_enums
            self._e = e
            attr = self.rail.device_attr
            self.max_rd_atomic = max(1, min(16, int(attr.max_qp_init_rd_atom)))
            self.max_dest_rd_atomic = max(1, min(16, int(attr.max_qp_rd_atom)))
            # A plan row lowers to at most two WRs, and the proxy admits rows (not WRs) while its WR count
            # is below the cap (or one batch when nothing is in flight): at most 2 * cap WRs outstanding.
            self.sq_depth = min(int(attr.max_qp_wr), 2 * max(inflight_cap, batch_max) + 4)
            self.path_mtu = int(path_mtu) or int(self.rail.port_attr.active_mtu)
            self._signaled = int(e.ibv_send_flags.IBV_SEND_SIGNALED)
            self._fence_flag = int(e.ibv_send_flags.IBV_SEND_FENCE)
            # scratch: atomics' old values land at 0, ordering reads (zero bytes) point at 8
            self._scratch = np.zeros(8, dtype=np.uint64)
            self._scratch_mr = self.rail.register(self._scratch.ctypes.data, self._scratch.nbytes,
                                                  access_flags(v))
            self._scratch_addr = self._scratch.ctypes.data
            self._scratch_lkey = int(self._scratch_mr.lkey)
        except BaseException:
            self.rail.close()
            raise

    # --- addressing ----------------------------------------------------------------------------------
    def local_address(self) -> dict[str, Any]:
        r = self.rail
        return {"transport": "ib", "device": r.device_name, "port": r.port, "lid": int(r.port_attr.lid),
                "gid": str(r.gid.gid), "mtu": self.path_mtu, "signal_mode": self.signal_mode}

    # --- memory --------------------------------------------------------------------------------------
    def register_memory(self, addr: int, length: int, *, remote_write: bool, remote_atomic: bool,
                        accessor: Any = None) -> MemoryKey:
        """Register [addr, addr+length); regions that take atomics (flags) never get relaxed ordering.

        ``accessor``: how softverbs reaches memory the CPU cannot address (GPU memory); see ``Rail.register``.
        """
        access = access_flags(self.v, remote_write=remote_write, remote_atomic=remote_atomic,
                              relaxed_ordering=self.relaxed_ordering and not remote_atomic)
        mr = self.rail.register(addr, length, access, accessor)
        return MemoryKey(addr=addr, length=length, lkey=int(mr.lkey), rkey=int(mr.rkey))

    def deregister_memory(self, key: MemoryKey) -> None:
        self.rail.deregister(key.addr, key.lkey)

    # --- connections ---------------------------------------------------------------------------------
    def create_endpoint(self, conn_id: int, job: str) -> dict[str, Any]:
        """Create connection ``conn_id``'s RC QP (in INIT); returns what the remote end needs for RTR."""
        if conn_id in self._conns:
            raise BackendError(f"connection {conn_id} already exists")
        if not self._free_keys:
            raise BackendError("too many connections on this rail")
        budget = sum(c.sq_depth for c in self._conns.values()) + self.sq_depth
        if budget > self.rail.cq_depth:
            raise BackendError(f"connection {conn_id}: the rail's CQ ({self.rail.cq_depth} entries) cannot hold "
                               f"{budget} outstanding WRs; raise cq_depth or lower inflight_cap")
        v = self.v
        staging = np.zeros(self.sq_depth, dtype=np.uint64)
        qp = self._create_qp(conn_id)
        try:
            mr = self.rail.register(staging.ctypes.data, staging.nbytes, access_flags(v))
        except BaseException:
            qp.close()
            raise
        key = self._free_keys.pop()
        conn = _Conn(conn_id=conn_id, job=job, key=key, qp=qp, psn=random.getrandbits(24), sq_depth=self.sq_depth,
                     staging=staging, staging_lkey=int(mr.lkey), tracker=OrderedBatches(random.getrandbits(40)))
        self._conns[conn_id] = conn
        self._by_key[key] = conn
        r = self.rail
        return {"transport": "ib", "qpn": int(qp.qp_num), "psn": conn.psn, "lid": int(r.port_attr.lid),
                "gid": str(r.gid.gid), "port": r.port, "mtu": self.path_mtu,
                "max_dest_rd_atomic": self.max_dest_rd_atomic, "job": job}

    def _create_qp(self, conn_id: int) -> Any:
        """An RC QPEx in INIT; asks for 8 bytes of inline data and does without where the device has none."""
        v, e = self.v, self._e
        ops = e.ibv_qp_create_send_ops_flags
        last: Exception | None = None
        for inline in ((8, 0) if self._inline is None else ((8,) if self._inline else (0,))):
            cap = v.qp.QPCap(max_send_wr=self.sq_depth, max_recv_wr=1, max_send_sge=1, max_recv_sge=1,
                             max_inline_data=inline)
            init = v.qp.QPInitAttrEx(
                qp_type=e.ibv_qp_type.IBV_QPT_RC, scq=self.rail.cq, rcq=self.rail.cq, cap=cap, pd=self.rail.pd,
                sq_sig_all=0,
                comp_mask=int(e.ibv_qp_init_attr_mask.IBV_QP_INIT_ATTR_PD
                              | e.ibv_qp_init_attr_mask.IBV_QP_INIT_ATTR_SEND_OPS_FLAGS),
                send_ops_flags=int(ops.IBV_QP_EX_WITH_RDMA_WRITE | ops.IBV_QP_EX_WITH_RDMA_READ
                                   | ops.IBV_QP_EX_WITH_ATOMIC_FETCH_AND_ADD))
            try:
                with translate_verbs_errors(f"creating the QP of connection {conn_id}", v):
                    qp = v.qp.QPEx(self.rail.ctx, init)
            except BackendError as exc:
                last = exc
                continue
            self._inline = inline > 0
            try:
                with translate_verbs_errors(f"moving the QP of connection {conn_id} to INIT", v):
                    attr = v.qp.QPAttr(port_num=self.rail.port)
                    attr.pkey_index = 0
                    acc = e.ibv_access_flags
                    attr.qp_access_flags = int(acc.IBV_ACCESS_REMOTE_WRITE | acc.IBV_ACCESS_REMOTE_READ
                                               | acc.IBV_ACCESS_REMOTE_ATOMIC)
                    qp.to_init(attr)
            except BaseException:
                qp.close()
                raise
            return qp
        assert last is not None
        raise last

    def connect(self, conn_id: int, remote: dict[str, Any]) -> None:
        """INIT -> RTR -> RTS against the remote end's ``create_endpoint`` result."""
        conn = self._conn(conn_id)
        if conn.connected:
            raise BackendError(f"connection {conn_id} is already connected")
        if remote.get("transport", "ib") != "ib":
            raise BackendError(f"connection {conn_id}: remote end is {remote.get('transport')!r}, not ib")
        v, e = self.v, self._e
        with translate_verbs_errors(f"connecting {conn_id} to QP {remote.get('qpn')}", v):
            attr = v.qp.QPAttr(port_num=self.rail.port, path_mtu=min(self.path_mtu, int(remote["mtu"])))
            attr.pkey_index = 0
            attr.dest_qp_num = int(remote["qpn"])
            attr.rq_psn = int(remote["psn"])
            attr.max_dest_rd_atomic = self.max_dest_rd_atomic
            attr.min_rnr_timer = self.min_rnr_timer
            gid = str(remote.get("gid", ""))
            is_global = 1 if gid and any(ch not in "0:" for ch in gid) else 0
            gr = v.addr.GlobalRoute(dgid=v.addr.GID(gid), sgid_index=self.rail.gid_index) if is_global else None
            attr.ah_attr = v.addr.AHAttr(dlid=int(remote.get("lid", 0)), port_num=self.rail.port,
                                         is_global=is_global, gr=gr)
            acc = e.ibv_access_flags
            attr.qp_access_flags = int(acc.IBV_ACCESS_REMOTE_WRITE | acc.IBV_ACCESS_REMOTE_READ
                                       | acc.IBV_ACCESS_REMOTE_ATOMIC)
            conn.qp.to_rtr(attr)
            attr.timeout = self.timeout
            attr.retry_cnt = self.retry_cnt
            attr.rnr_retry = self.rnr_retry
            attr.sq_psn = conn.psn
            attr.max_rd_atomic = max(1, min(self.max_rd_atomic, int(remote.get("max_dest_rd_atomic", 1))))
            conn.qp.to_rts(attr)
        conn.remote = dict(remote)
        conn.connected = True

    def close_connection(self, conn_id: int) -> None:
        """Destroy the QP; tokens still outstanding are dropped (the proxy fails them itself)."""
        conn = self._conns.pop(conn_id, None)
        if conn is None:
            return
        self._by_key.pop(conn.key, None)
        conn.tracker.drop()
        try:
            conn.qp.close()
        finally:
            self.rail.deregister(conn.staging.ctypes.data, conn.staging_lkey)
            self._free_keys.append(conn.key)

    # --- data path -----------------------------------------------------------------------------------
    def post(self, conn_id: int, plan: np.ndarray) -> int:
        """Post ``plan``'s rows as WRs on the connection's QP; returns how many WRs that was."""
        return sum(self._post_plan(self._conn(conn_id), plan))

    def post_batches(self, conn_ids: np.ndarray, plan: np.ndarray, bounds: np.ndarray) -> np.ndarray:
        """Post several batches (``plan[bounds[i]:bounds[i+1]]`` on ``conn_ids[i]``); WRs per batch.

        Consecutive batches for one connection go out in one ``wr_start``/``wr_complete`` session. Each
        batch must carry its own token (the proxy's do).
        """
        ids = conn_ids.tolist()
        starts, stops = bounds[:-1].tolist(), bounds[1:].tolist()
        out = np.zeros(len(ids), dtype=np.int64)
        i = 0
        while i < len(ids):
            j = i + 1
            while j < len(ids) and ids[j] == ids[i]:
                j += 1
            counts = self._post_plan(self._conn(ids[i]), plan[starts[i]:stops[j - 1]])
            if len(counts) == j - i:
                out[i:j] = counts
            i = j
        return out

    def _post_plan(self, conn: _Conn, plan: np.ndarray) -> list[int]:
        """Post ``plan``; returns the number of WRs of each batch (run of rows with one token) in it."""
        if not conn.connected:
            raise BackendError(f"connection {conn.conn_id} is not connected")
        n_rows = len(plan)
        if n_rows == 0:
            return []
        tracker = conn.tracker
        if tracker.error:
            # the QP is in error: it would only flush these; say so without touching it
            toks = plan["token"].tolist()
            counts = []
            for i in range(n_rows):
                if i == n_rows - 1 or toks[i] != toks[i + 1]:
                    self._carry.append((toks[i], _FLUSH_ERR, 0))
                    counts.append(0)
            return counts
        wrs, ends, shadow, fence_next, after_read = self._lower(conn, plan)
        n = len(wrs)
        if tracker.inflight() + n > conn.sq_depth:
            raise SendQueueFullError(f"connection {conn.conn_id}: {tracker.inflight()} WRs outstanding, "
                                     f"{n} more would overrun the {conn.sq_depth}-entry send queue")
        self._post_wrs(conn, wrs, ends)
        counts = []
        start = 0
        for index, token in ends:
            counts.append(index + 1 - start)
            tracker.add_batch(index + 1 - start, token)
            start = index + 1
        conn.shadow.update(shadow)
        conn.fence_next = fence_next
        conn.after_read = after_read
        self.stats["wrs"] += n
        return counts

    def _lower(self, conn: _Conn, plan: np.ndarray) -> tuple[list[tuple], list[tuple[int, int]],
                                                              dict[tuple[int, int], int], bool, bool]:
        """Plan rows -> (WRs, [(index of a batch's last WR, token)], shadow updates, fence_next, after_read)."""
        mode = self.signal_mode
        wrs: list[tuple] = []
        fences: list[bool] = []
        ends: list[tuple[int, int]] = []
        shadow: dict[tuple[int, int], int] = {}
        old = conn.shadow
        fence_next = conn.fence_next
        after_read = conn.after_read
        n_rows = len(plan)
        rows = plan.tolist()  # tuples in PLAN_DTYPE field order, plain ints: far cheaper to index
        # op, signal_op, dst_rank, length, laddr, raddr, lkey, rkey, value, slot, chunk_id, token
        for i, (op, sop, _rank, length, laddr, raddr, lkey, rkey, value, _slot, _chunk, token) in enumerate(rows):
            if op == _WRITE:
                wrs.append((_W, rkey, raddr, laddr, length, lkey, 0))
                fences.append(fence_next)
                fence_next = after_read = False
            elif op == _SIGNAL:
                self.stats["signals"] += 1
                if mode == "atomic" and sop != _SET:
                    wrs.append((_A, rkey, raddr, 0, 8, 0, value))
                    fences.append(fence_next)
                    fence_next = after_read = False
                else:
                    k = (raddr, rkey)
                    cur = shadow.get(k, old.get(k, 0))
                    new = value & _MASK64 if sop == _SET else (cur + value) & _MASK64
                    shadow[k] = new
                    if mode != "write":
                        if not after_read:
                            wrs.append((_R, rkey, raddr, 0, 0, 0, 0))
                            fences.append(fence_next)
                            self.stats["order_reads"] += 1
                        fence_next = True
                    wrs.append((_F, rkey, raddr, 0, 8, 0, new))
                    fences.append(fence_next)
                    fence_next = after_read = False
            elif op == _FENCE:
                self.stats["fences"] += 1
                wrs.append((_R, 0, 0, 0, 0, 0, 0))
                fences.append(fence_next)
                self.stats["order_reads"] += 1
                fence_next = after_read = True
            else:
                raise BackendError(f"plan row {i}: unknown op {op}")
            if i == n_rows - 1 or (token != rows[i + 1][11] and token != 0):
                ends.append((len(wrs) - 1, token))
        fence = self._fence_flag
        lowered = [wr + (fence if f else 0,) for wr, f in zip(wrs, fences, strict=True)]
        return lowered, ends, shadow, fence_next, after_read

    def _post_wrs(self, conn: _Conn, wrs: list[tuple], ends: list[tuple[int, int]]) -> None:
        qp = conn.qp
        SGE = self.v.wr.SGE
        signaled = {index for index, _ in ends}
        sig = self._signaled
        base = conn.tracker.posted
        key = conn.key << SEQ_BITS
        staging = conn.staging
        depth = conn.sq_depth
        staging_addr = staging.ctypes.data
        scratch, scratch_lkey = self._scratch_addr, self._scratch_lkey
        inline = self._inline
        with translate_verbs_errors(f"posting {len(wrs)} WRs on connection {conn.conn_id}", self.v):
            qp.wr_start()
            try:
                for k, (kind, rkey, raddr, laddr, length, lkey, value, flags) in enumerate(wrs):
                    seq = base + k + 1
                    qp.wr_id = key | (seq & SEQ_MASK)
                    qp.wr_flags = flags | (sig if k in signaled else 0)
                    if kind == _W:
                        qp.wr_rdma_write(rkey, raddr)
                        qp.wr_set_sge(SGE(laddr, length, lkey))
                    elif kind == _F:
                        slot = seq % depth
                        staging[slot] = value
                        qp.wr_rdma_write(rkey, raddr)
                        if inline:
                            qp.wr_set_inline_data(staging_addr + 8 * slot, 8)
                        else:
                            qp.wr_set_sge(SGE(staging_addr + 8 * slot, 8, conn.staging_lkey))
                    elif kind == _A:
                        qp.wr_atomic_fetch_add(rkey, raddr, value)
                        qp.wr_set_sge(SGE(scratch, 8, scratch_lkey))
                    else:
                        qp.wr_rdma_read(rkey, raddr)
                        qp.wr_set_sge(SGE(scratch + 8, 0, scratch_lkey))
                qp.wr_complete()
            except BaseException:
                qp.wr_abort()
                raise

    def poll(self, max_completions: int = 256) -> np.ndarray:
        """Tokens completed since the last call; a failed batch is reported once, with its error status."""
        out = self._carry
        self._carry = []
        if len(out) < max_completions:
            with translate_verbs_errors("polling the CQ", self.v):
                wcs = self.rail.drain.poll(max(1, min(max_completions - len(out), 1024)))
            if len(wcs):
                by_key = self._by_key
                for wr_id, status, vendor_err in zip(wcs["wr_id"].tolist(), wcs["status"].tolist(),
                                                     wcs["vendor_err"].tolist(), strict=True):
                    conn = by_key.get(wr_id >> SEQ_BITS)
                    if conn is None:
                        continue  # a connection closed since
                    if status:
                        self.stats["errors"] += 1
                    conn.tracker.on_completion(wr_id & SEQ_MASK, status, vendor_err, out)
        if len(out) > max_completions:
            self._carry = out[max_completions:]
            out = out[:max_completions]
        return completions(out)

    def inflight(self, conn_id: int) -> int:
        """WRs posted on ``conn_id`` and not yet known complete."""
        return self._conn(conn_id).tracker.inflight()

    def set_flag_publisher(self, publisher: FlagPublisher) -> None:
        """Kept for the interface: on ib the NIC writes flags, nothing is published by the host."""
        self._publisher = publisher

    def close(self) -> None:
        for conn_id in list(self._conns):
            self.close_connection(conn_id)
        self.rail.close()

    def __enter__(self) -> IbBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _conn(self, conn_id: int) -> _Conn:
        try:
            return self._conns[conn_id]
        except KeyError:
            raise BackendError(f"unknown connection {conn_id}") from None
