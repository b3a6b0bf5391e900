"""The efa backend: one SRD QP per rail, write-with-immediate, flags published by the receiving daemon.

The data path is compiled: ``transportd._core.EfaPoster`` (``efa/csrc/efa_post.c``) lowers plan rows,
submits, tracks completions and counts arrivals; this module is its control plane (device, QP, address
handles, staging memory, connections) and the Python end of the one call per poll that needs Python.
The engine calls the poster directly (:attr:`EfaBackend.c_poster`); ``post``/``post_batches``/``poll`` are
the same C calls for a Python caller.

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
overwritten before the receiver read it (``efa.wire``). A record is copied into its send staging slot
(one ring per connection, as many entries as the peer's ring) when it is submitted.

Receiving. Arrivals come out of the same CQ as send completions. Each one is counted for its connection
in C, rule for rule :class:`transportd_models.arrivals.ArrivalTracker` (the model the tests compare it
with); control records are copied out of the staging ring at once. Flags that became safe are stored by the C
code itself into host-mapped flag words registered with :meth:`EfaBackend.set_host_flags` (the daemon's
flag files); the others (GPU flag words, ranks it does not know) go to the daemon's :class:`FlagPublisher`
in one Python call per poll, after the optional visibility flush. Where the device supports unsolicited
write receive, arrivals consume no receive WR; else the QP keeps ``rq_depth`` receive WRs posted and the
same per-poll call reposts the ones consumed once an eighth of them are.
"""

from __future__ import annotations

import logging
import random
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from efa.srd_shim import AddressTable, bridged, srd_shim_qp
from efa.wire import CTRL_DTYPE, INDEX_BITS, MAX_CONNS
from transportd import _core
from transportd.backends.interface import FlagPublisher, MemoryKey, SignalOp
from transportd.backends.verbs_common import CqDrain, PosterBackend, Rail, access_flags, translate_verbs_errors
from transportd.backends.verbs_shim import shim_cq
from transportd.errors import BackendError, VerbsError

__all__ = ["PUB_DTYPE", "EfaBackend", "EfaRail"]

log = logging.getLogger("transportd.efa")

_SEQ_BITS = 48
_RECV_TAG = 1 << 63  # wr_id of a posted receive WR
_QKEY = 0x11111111
SRD_CQ_FETCH = 4096  # completions the shim CQ takes from the provider in one call

#: A flag update the compiled path hands to Python (efa_post.c PyPub): GPU flag words, unknown ranks.
PUB_DTYPE = np.dtype([("conn", "<i8"), ("rank", "<u4"), ("slot", "<u4"), ("op", "<u4"), ("pad", "<u4"),
                      ("value", "<u8")])
assert PUB_DTYPE.itemsize == _core.EFA_PUB_SIZE


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
        if not getattr(self, "unsolicited", False):  # a sibling (another queue's CQ) takes a plain one
            super().create_cq(depth)
            return
        v = self.v
        wcf = v.libibverbs_enums.ibv_create_cq_wc_flags
        flags = int(wcf.IBV_WC_EX_WITH_BYTE_LEN | wcf.IBV_WC_EX_WITH_IMM | wcf.IBV_WC_EX_WITH_QP_NUM)
        self.cq = v.efadv.EfaCQ(self.ctx, v.cq.CqInitAttrEx(cqe=depth, wc_flags=flags),
                                v.efadv.EfaDVCQInitAttr(wc_flags=int(v.efa_enums.EFADV_WC_EX_WITH_IS_UNSOLICITED)))
        self.drain = CqDrain(self.cq, extended=True, unsolicited=True)


@dataclass(eq=False)
class _Conn:
    """A connection's control-plane state; its data-path state lives in the poster."""

    conn_id: int
    job: str
    index: int  # our index: names this connection in the immediates the peer sends us
    key: int  # names this connection in our send WR ids
    recv_staging: np.ndarray  # CTRL_DTYPE ring the peer writes records into
    recv_lkey: int
    connected: bool = False
    gid: str = ""
    send_staging: np.ndarray | None = None  # CTRL_DTYPE ring our records are sent from
    send_lkey: int = 0


class EfaBackend(PosterBackend):
    """SRD backend for one rail (an EFA device).

    ``device``: verbs device name (None or "": the first one). ``verbs``: provider name or namespace.
    ``inflight_cap``/``batch_max``: the proxy's limits. ``sq_depth``/``rq_depth``/``cq_depth``: queue sizes
    (capped by the device). ``staging_entries``: control records in flight per connection (a power of
    two; 32 bytes each, per connection, on the receiving side). ``cumulative``: every signal also waits for
    all earlier writes of the connection (ib semantics) instead of those since the previous signal
    (``transportd_models.arrivals``). ``visibility_flush``: call ``flush_hook`` (a no-op until the GPU path
    installs ``cuFlushGPUDirectRDMAWrites``) once before publishing the flags of one poll.
    ``use_unsolicited``: use unsolicited write receive where the device has it. ``max_rdma_size``: split
    writes at this size (0: the device's limit). The daemon opens it with its ``[backend.efa]`` table and
    ``efa.visibility_flush`` only (``transportd.backends.open_configured``); it takes no signal mode: on efa
    the receiving daemon publishes every flag.
    """

    name = "efa"  # its traits (transportd.backends.TRAITS): arrivals with no ring record, flags it publishes

    def __init__(self, device: str | None = None, *, verbs: Any = None, inflight_cap: int = 256,
                 batch_max: int = 8, port: int = 1, gid_index: int = 0, sq_depth: int = 4096,
                 rq_depth: int = 4096, cq_depth: int = 1 << 16, staging_entries: int = 4096,
                 cumulative: bool = False, visibility_flush: bool = True,
                 flush_hook: Callable[[], None] | None = None, use_unsolicited: bool = True,
                 max_rdma_size: int = 0) -> None:
        if staging_entries < 64 or staging_entries & (staging_entries - 1) or staging_entries > 1 << INDEX_BITS:
            raise BackendError(f"staging_entries must be a power of two in [64, {1 << INDEX_BITS}]")
        self.inflight_cap = inflight_cap
        self.batch_max = batch_max
        self.staging_entries = staging_entries
        self.cumulative = cumulative
        self.visibility_flush = visibility_flush
        self._flush_hook = flush_hook
        self._conns: dict[int, _Conn] = {}
        self._free_index = deque(range(MAX_CONNS))
        self._free_keys = deque(range(1, 1 << (63 - _SEQ_BITS)))
        self._ahs: dict[str, list[Any]] = {}  # gid -> [AH, users, handle]
        self._addresses = AddressTable()
        self._jobs: dict[str, int] = {}
        self._retired: list[np.ndarray] = []  # send staging of closed connections, until the SQ drains
        self._publisher: FlagPublisher | None = None
        self._end_pass: Callable[[], bool | None] | None = None
        self._want_pass = False  # end_pass asked to be called after every poll (loopback writes in flight)
        self._unpublished: list[tuple[int, int, int, SignalOp, int]] = []
        self._poster: Any = None
        self.qp: Any = None
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
        # the compiled data path on the QP's and CQ's ibv_*_ex structs (the shim's, over a Python provider;
        # pyverbs' own with the bridge, where address handles are their ibv_ah pointers)
        self._addresses = AddressTable(bridged=bridged(v))
        self._shim_qp = srd_shim_qp(v, self.qp, self._addresses)
        self._shim_cq = shim_cq(self.rail, fetch=SRD_CQ_FETCH)
        self._poster = _core.EfaPoster(
            self._shim_qp, self._shim_cq, max_rdma_size=self.max_rdma_size, sq_depth=self.sq_depth,
            rq_depth=self.rq_depth, cumulative=self.cumulative, unsolicited=self.rail.unsolicited,
            visibility_flush=self.visibility_flush, on_pass=self._on_pass, backend_error=BackendError,
            verbs_error=VerbsError)
        self._poster.set_flush_hook(self._flush_hook is not None)
        if self.rq_depth:
            self._replenish(self.rq_depth)

    @property
    def flush_hook(self) -> Callable[[], None] | None:
        """Called once before the flags of one poll are published (with ``visibility_flush``)."""
        return self._flush_hook

    @flush_hook.setter
    def flush_hook(self, hook: Callable[[], None] | None) -> None:
        self._flush_hook = hook
        if self._poster is not None:
            self._poster.set_flush_hook(hook is not None)

    @property
    def stats(self) -> dict[str, int]:
        """Counters of the data path: WRs, pieces, signals, fences, arrivals, flags published, ..."""
        return self._poster.stats() if self._poster is not None else {}

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

    def _job(self, job: str) -> int:
        return self._jobs.setdefault(job, len(self._jobs))

    def set_host_flags(self, job: str, rank: int, addr: int, count: int) -> None:
        """``job``'s rank ``rank`` keeps its ``count`` flags as u64 words at ``addr`` in host memory mapped
        here: flags for it are published by the compiled path's own stores, with no Python call."""
        self._poster.set_host_flags(self._job(job), rank, addr, count)

    def set_mapped_flags(self, job: str, rank: int, addr: int, count: int, shadow: int) -> None:
        """Like :meth:`set_host_flags` for GPU flag words mapped here through the GPU's BAR (GDRCopy) at
        ``addr``: each update is an atomic add (or store) on the host ``shadow`` words (shared by the
        rails' workers) and one 8-byte store of the new value into the mapped word — no read across PCIe."""
        self._poster.set_host_flags(self._job(job), rank, addr, count, shadow)

    def loopback_unavailable(self) -> str | None:
        """None: :meth:`open_flag_loopback` can write into this rail's registered memory (RDMA write is a
        capability the rail already required); else why not."""
        return None

    def open_flag_loopback(self) -> Any:
        """An :class:`efa.loopback.LoopbackWriter` on this rail's device and PD."""
        from efa.loopback import LoopbackWriter

        return LoopbackWriter(self.rail, self.qkey)

    def clear_host_flags(self, job: str, rank: int) -> None:
        """Forget ``set_host_flags`` (before the words are unmapped): its flags go to the publisher again."""
        self._poster.clear_host_flags(self._job(job), rank)

    # --- connections ---------------------------------------------------------------------------------
    def create_endpoint(self, conn_id: int, job: str) -> dict[str, Any]:
        """Set up both directions of ``conn_id``: a staging ring for the records the peer will send us."""
        if conn_id in self._conns:
            raise BackendError(f"connection {conn_id} already exists")
        if not self._free_index:
            raise BackendError(f"more than {MAX_CONNS} connections on one efa rail")
        if self._retired and not self._poster.submitted:
            self._retired.clear()  # no WR of a closed connection can still read them
        staging = np.zeros(self.staging_entries, dtype=CTRL_DTYPE)
        mr = self.rail.register(staging.ctypes.data, staging.nbytes, access_flags(self.v, remote_write=True))
        index = self._free_index.popleft()
        key = self._free_keys.popleft()
        conn = _Conn(conn_id=conn_id, job=job, index=index, key=key, recv_staging=staging, recv_lkey=int(mr.lkey))
        # a random first WR number: completions of an earlier connection with the same key never match
        self._poster.add_connection(conn_id, index, key, self._job(job), random.getrandbits(40),
                                    staging.ctypes.data, self.staging_entries)
        self._conns[conn_id] = conn
        return {**self.local_address(), "index": index, "staging_addr": int(staging.ctypes.data),
                "staging_rkey": int(mr.rkey), "staging_entries": self.staging_entries, "job": job}

    def connect(self, conn_id: int, remote: dict[str, Any]) -> None:
        """Address the peer: an address handle for its GID (shared by connections to the same rail)."""
        conn = self._conn(conn_id)
        if conn.connected:
            raise BackendError(f"connection {conn_id} is already connected")
        if remote.get("transport") != "efa":
            raise BackendError(f"connection {conn_id}: remote end is {remote.get('transport')!r}, not efa")
        entries = int(remote["staging_entries"])
        if entries < 2 or entries & (entries - 1):
            raise BackendError(f"connection {conn_id}: the peer's staging ring has {entries} entries, "
                               "not a power of two")
        gid = str(remote["gid"])
        entry = self._ahs.get(gid)
        if entry is None:
            v = self.v
            with translate_verbs_errors(f"creating an address handle for {gid}", v):
                gr = v.addr.GlobalRoute(dgid=v.addr.GID(gid), sgid_index=self.rail.gid_index)
                ah_attr = v.addr.AHAttr(port_num=self.rail.port, is_global=1, gr=gr)
                ah = v.addr.AH(self.rail.pd, attr=ah_attr)
            entry = self._ahs[gid] = [ah, 0, self._addresses.add(ah)]
        send = np.zeros(entries, dtype=CTRL_DTYPE)
        mr = self.rail.register(send.ctypes.data, send.nbytes, access_flags(self.v))
        try:
            self._poster.connect(conn_id, int(remote["index"]), entry[2], int(remote["qpn"]), int(remote["qkey"]),
                                 int(remote["staging_addr"]), int(remote["staging_rkey"]), entries,
                                 send.ctypes.data, int(mr.lkey))
        except BaseException:
            self.rail.deregister(send.ctypes.data, int(mr.lkey))
            raise
        entry[1] += 1
        conn.gid = gid
        conn.send_staging, conn.send_lkey = send, int(mr.lkey)
        conn.connected = True

    def close_connection(self, conn_id: int) -> None:
        """Forget ``conn_id``: its outstanding tokens are dropped (the proxy fails them itself), WRs still in
        the backlog are discarded, and arrivals for it are ignored from now on."""
        conn = self._conns.pop(conn_id, None)
        if conn is None:
            return
        self._poster.remove_connection(conn_id)
        if conn.connected:
            entry = self._ahs.get(conn.gid)
            if entry is not None:
                entry[1] -= 1
                if entry[1] == 0:
                    del self._ahs[conn.gid]
                    self._addresses.remove(entry[2])
                    entry[0].close()
        if conn.send_staging is not None:
            self.rail.deregister(conn.send_staging.ctypes.data, conn.send_lkey)
            self._retired.append(conn.send_staging)  # a WR still on the SQ may point into it
        self.rail.deregister(conn.recv_staging.ctypes.data, conn.recv_lkey)
        self._free_index.append(conn.index)
        self._free_keys.append(conn.key)

    # --- data path (the engine calls c_poster directly; these and PosterBackend's are the same C calls) ---
    def post(self, conn_id: int, plan: np.ndarray) -> int:
        """Lower ``plan`` to write-with-imm WRs and submit what fits; returns how many WRs it became."""
        return self._poster.post(conn_id, np.ascontiguousarray(plan))

    def poll(self, max_completions: int = 256) -> np.ndarray:
        """Handle send completions and arrivals; returns completed tokens (each batch once)."""
        return super().poll(max_completions)

    def _on_pass(self, pubs: bytes, failures: list[tuple[int, str]], replenish: int, flush: bool) -> None:
        """The one Python call of a poll that needs one (efa_post.c): in this order, the visibility flush,
        protocol errors to log, flags the C code could not store itself and the end of the pass's publishing
        (loopback writes reaped and posted; while some are on the wire, at most once every 20 us), receive WRs to
        repost."""
        if flush and self._flush_hook is not None:
            self._flush_hook()
        for conn_id, why in failures:
            log.error("efa connection %d: peer broke the counting protocol (%s); no more flags will be "
                      "published for it", conn_id, why)
        if pubs:
            publisher = self._publisher
            for conn_id, rank, slot, op, value in np.frombuffer(pubs, dtype=PUB_DTYPE)[
                    ["conn", "rank", "slot", "op", "value"]].tolist():
                if publisher is None:
                    self._unpublished.append((conn_id, rank, slot, SignalOp(op), value))
                else:
                    publisher(conn_id, rank, slot, SignalOp(op), value)
        if self._end_pass is not None and ((pubs and self._publisher is not None) or self._want_pass):
            self._after_pass(self._end_pass())
        if replenish:
            self._replenish(replenish)

    def _replenish(self, n: int) -> None:
        """Post ``n`` receive WRs for the ones arrivals consumed (only without unsolicited write receive)."""
        if not n or self.qp is None:
            return
        v = self.v
        sge = v.wr.SGE(int(self._scratch.ctypes.data), 8, int(self._scratch_mr.lkey))
        head = None
        for _ in range(n):
            head = v.wr.RecvWR(wr_id=_RECV_TAG, num_sge=1, sg=[sge], next_wr=head)
        with translate_verbs_errors(f"posting {n} receive WRs", v):
            self.qp.post_recv(head)

    def _after_pass(self, again: bool | None) -> None:
        if bool(again) != self._want_pass:
            self._poster.want_pass(bool(again))
            self._want_pass = bool(again)

    def set_flag_publisher(self, publisher: FlagPublisher,
                           end_pass: Callable[[], bool | None] | None = None) -> None:
        """Install the daemon's publisher; flags that became ready before it was installed go out now.
        ``end_pass`` is called after the flags of each poll that had any (the loopback path posts its writes
        then); while it returns True, after every poll (its writes are on the wire)."""
        self._publisher = publisher
        self._end_pass = end_pass
        pending, self._unpublished = self._unpublished, []
        for args in pending:
            publisher(*args)
        if pending and end_pass is not None:
            self._after_pass(end_pass())

    def close_resources(self) -> None:
        """After the connections, before the rail: the poster, the SRD QP and the address handles."""
        self._poster = None
        if self.qp is not None:
            self.qp.close()
            self.qp = None
        for ah, _users, _handle in self._ahs.values():
            ah.close()
        self._ahs.clear()
