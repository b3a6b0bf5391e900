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

Where it runs. The lowering above and the completion tracking are compiled (``transportd._core.IbPoster``,
``ib/csrc/ib_post.c``): plan rows become ``ibv_wr_*`` calls through the function pointers of a
``struct ibv_qp_ex`` per connection, completions come from a ``struct ibv_cq_ex`` (the rail's CQ) through
``start_poll``/``next_poll``/``end_poll``. The proxy's engine calls it directly (:attr:`IbBackend.c_poster`),
so no Python runs per record or per WR between the ring and those structs. For a Python verbs provider the
structs are the verbs shim (:mod:`transportd.backends.verbs_shim`): it collects each pass's WRs in C and hands them
to the provider in one call, and takes completions back the same way; so the tests run the lowering a NIC
runs. ``post``/``post_batches``/``poll`` here are thin calls into the same code.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ibgda.domain import ImportDomain
from transportd import _core
from transportd.backends.interface import FlagPublisher, MemoryKey
from transportd.backends.verbs_common import PosterBackend, Rail, access_flags, translate_verbs_errors
from transportd.backends.verbs_shim import shim_cq, shim_qp
from transportd.errors import BackendError, SendQueueFullError, VerbsError

__all__ = ["SIGNAL_MODES", "IbBackend"]

SIGNAL_MODES = ("write", "atomic", "fence")


@dataclass(eq=False)
class _Conn:
    conn_id: int
    job: str
    qp: Any
    shim: Any  # the ibv_qp_ex the compiled lowering posts through
    psn: int
    staging: np.ndarray  # one 8-byte flag value per SQ slot (the inline source, or the SGE without inline)
    staging_lkey: int
    connected: bool = False
    remote: dict[str, Any] = field(default_factory=dict)


class IbBackend(PosterBackend):
    """RC backend for one rail (an RDMA device port).

    ``device``: verbs device name (None or "": the first one). ``verbs``: provider name or namespace for
    :func:`transportd.backends.verbs_common.load_verbs`. ``signal_mode``: write, atomic or fence (module docstring).
    ``inflight_cap``/``batch_max``: the proxy's limits, which size the SQ. ``cq_depth``: the rail's CQ
    (shared by every connection; a connection is refused when the sum of SQ depths would exceed it,
    since a QP in error may complete every outstanding WR). ``path_mtu``: an ibv_mtu value, 0 for the
    port's active MTU. ``timeout``/``retry_cnt``/``rnr_retry``/``min_rnr_timer``: RC retry settings.
    ``relaxed_ordering``: register data regions (not flag regions) with relaxed ordering. The daemon opens
    it with its ``[backend.ib]`` table and ``signal.mode`` only (``transportd.backends.open_configured``).
    """

    name = "ib"

    def __init__(self, device: str | None = None, *, verbs: Any = None, signal_mode: str = "write",
                 inflight_cap: int = 256, batch_max: int = 8, port: int = 1, gid_index: int = 0,
                 cq_depth: int = 1 << 18, path_mtu: int = 0, timeout: int = 14, retry_cnt: int = 7,
                 rnr_retry: int = 7, min_rnr_timer: int = 12, relaxed_ordering: bool = False) -> None:
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
        self._publisher: FlagPublisher | None = None
        self._scratch: np.ndarray | None = None
        self._inline: bool | None = None  # flag values go inline (decided by the first QP created)
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
            if (int(e.ibv_send_flags.IBV_SEND_SIGNALED), int(e.ibv_send_flags.IBV_SEND_FENCE)) != (
                    _core.abi_layout()["const IBV_SEND_SIGNALED"], _core.abi_layout()["const IBV_SEND_FENCE"]):
                raise BackendError("the verbs provider's send flags differ from the compiled core's")
            # scratch: atomics' old values land at 0, ordering reads (zero bytes) point at 8
            self._scratch = np.zeros(8, dtype=np.uint64)
            self._scratch_mr = self.rail.register(self._scratch.ctypes.data, self._scratch.nbytes,
                                                  access_flags(v))
            self._scratch_addr = self._scratch.ctypes.data
            self._scratch_lkey = int(self._scratch_mr.lkey)
            self._cq = shim_cq(self.rail)
            self._poster = _core.IbPoster(self._cq, signal_mode, self._scratch_addr, self._scratch_lkey,
                                          BackendError, SendQueueFullError, VerbsError)
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

    # --- connections ---------------------------------------------------------------------------------
    def create_endpoint(self, conn_id: int, job: str) -> dict[str, Any]:
        """Create connection ``conn_id``'s RC QP (in INIT); returns what the remote end needs for RTR."""
        if conn_id in self._conns:
            raise BackendError(f"connection {conn_id} already exists")
        budget = self.sq_depth * (len(self._conns) + 1)
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
        try:
            shim = shim_qp(v, qp)
            # WR numbers start after a random base, so a stale completion of an earlier connection that had
            # the same key never matches
            self._poster.add_connection(conn_id, shim, self.sq_depth, staging.ctypes.data, int(mr.lkey),
                                        random.getrandbits(40), bool(self._inline))
        except BaseException:
            self.rail.deregister(staging.ctypes.data, int(mr.lkey))
            qp.close()
            raise
        conn = _Conn(conn_id=conn_id, job=job, qp=qp, shim=shim, psn=random.getrandbits(24), staging=staging,
                     staging_lkey=int(mr.lkey))
        self._conns[conn_id] = conn
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
        self._poster.connect(conn_id)

    def seed_signals(self, conn_id: int, base: int, rkey: int, seeds: bytes) -> None:
        """Write and fence modes write a flag's absolute value from a shadow of this connection's: a word it
        never signalled starts at what its receiver announced (a counter that outlived a restart of either
        daemon), not at 0. Atomic mode adds on the NIC and needs no shadow; SETs need none either."""
        if seeds:
            self._poster.seed_shadow(conn_id, base, rkey, seeds)

    def close_connection(self, conn_id: int) -> None:
        """Destroy the QP; tokens still outstanding are dropped (the proxy fails them itself)."""
        conn = self._conns.pop(conn_id, None)
        if conn is None:
            return
        self._poster.remove_connection(conn_id)
        try:
            conn.qp.close()
        finally:
            self.rail.deregister(conn.staging.ctypes.data, conn.staging_lkey)

    # --- data path (compiled: ib/csrc/ib_post.c, ``transportd._core.IbPoster``; PosterBackend has
    # post_batches, which sends consecutive batches for one connection in one WR list (one wr_start .. wr_complete),
    # poll and inflight) -------------------------------------------------------------------------------
    @property
    def stats(self) -> dict[str, int]:
        """wrs, signals, order_reads, fences, errors (failed completions), cqes (completions read)."""
        return self._poster.stats()

    def post(self, conn_id: int, plan: np.ndarray) -> int:
        """Post ``plan``'s rows as WRs on the connection's QP; returns how many WRs that was.

        Nothing is posted when the send queue could not take them all (:class:`SendQueueFullError`); on a
        connection whose QP failed, every batch completes with IBV_WC_WR_FLUSH_ERR and 0 is returned.
        """
        self._conn(conn_id)
        return self._poster.post(conn_id, np.ascontiguousarray(plan))

    def create_ibgda_domain(self) -> Any:
        """A client's IBGDA domain on this rail's device (``ibgda.domain``): a context and PD of its own that
        the client imports to build its queue pairs on. Over softverbs the client's process then plays the
        ConnectX (``ibgda.soft_mlx5``)."""
        r = self.rail
        return ImportDomain(r.v, r.device_name, port=r.port, gid_index=r.gid_index)

    def set_flag_publisher(self, publisher: FlagPublisher) -> None:
        """Kept for the interface: on ib the NIC writes flags, nothing is published by the host."""
        self._publisher = publisher
