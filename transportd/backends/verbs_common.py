"""Verbs plumbing both RDMA backends share: a rail's resources, memory registration, CQ draining.

Everything here goes through the namespace :func:`transportd.backends.verbs.load` returns (pyverbs or softverbs,
same names), never through a provider directly. Shapes follow rdma-core's tests: a resources object with
``create_*`` hooks that subclasses override (:class:`Rail`), parents close their children, every object is
a context manager.

CQ draining: pyverbs' ``CQ.poll(n)`` calls ``ibv_poll_cq`` once per completion and builds a ``WC`` each
time; an extended CQ (``CQEX``, ``start_poll``/``poll_next``/``end_poll``) reads fields in place and is
the faster path, so :class:`Rail` makes one when the device allows and falls back to a plain CQ. Either
way :meth:`CqDrain.poll` returns one numpy array (:data:`WC_DTYPE`) so backends never see the difference.

:class:`PosterBackend` is what both backends do the same way around their compiled poster: the data-path
calls, the connection lookup, closing (connections, then the backend's own resources, then the rail) and
the context manager.
"""

from __future__ import annotations

import errno
import os
import socket
import types
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Self

import numpy as np

from transportd.backends import verbs as verbs_provider
from transportd.backends.interface import COMPLETION_DTYPE, MemoryKey
from transportd.errors import BackendError, DeviceNotFoundError, VerbsError

__all__ = [
    "WC_DTYPE",
    "CqDrain",
    "PosterBackend",
    "Rail",
    "access_flags",
    "completions",
    "load_verbs",
    "translate_verbs_errors",
]

# One polled work completion. ``imm`` is in host order (the verbs calls hand it over big-endian).
WC_DTYPE = np.dtype(
    [
        ("wr_id", "<u8"),
        ("status", "<u4"),
        ("opcode", "<u4"),
        ("vendor_err", "<u4"),
        ("imm", "<u4"),
        ("byte_len", "<u4"),
        ("qp_num", "<u4"),
        ("wc_flags", "<u4"),
        ("unsolicited", "u1"),
    ],
    align=True,
)


def load_verbs(verbs: Any = None) -> types.SimpleNamespace | Any:
    """The verbs namespace: ``verbs`` itself if it already is one, else ``transportd.backends.verbs.load(verbs)``.

    ``verbs`` may be a provider name (``"auto"``, ``"soft"``, ``"pyverbs"``), None (the default provider),
    or an already loaded namespace (tests pass one to share it between rails).
    """
    if verbs is not None and not isinstance(verbs, str):
        return verbs
    return verbs_provider.load(None if verbs in (None, "auto") else verbs)


@contextmanager
def translate_verbs_errors(what: str, v: Any) -> Iterator[None]:
    """Re-raise the provider's exceptions as :class:`VerbsError` with ``what`` in front."""
    err = v.pyverbs_error
    try:
        yield
    except err.PyverbsRDMAError as exc:
        raise VerbsError(f"{what}: {exc}", getattr(exc, "error_code", -1)) from exc
    except err.PyverbsError as exc:
        raise VerbsError(f"{what}: {exc}") from exc


def access_flags(v: Any, *, remote_write: bool = False, remote_read: bool = False, remote_atomic: bool = False,
                 relaxed_ordering: bool = False) -> int:
    """ibv_access_flags for a region; local write is always on (the NIC writes atomics' old values and
    read responses into local memory, and verbs refuses remote write/atomic without it)."""
    e = v.libibverbs_enums
    flags = e.ibv_access_flags.IBV_ACCESS_LOCAL_WRITE
    if remote_write:
        flags |= e.ibv_access_flags.IBV_ACCESS_REMOTE_WRITE
    if remote_read:
        flags |= e.ibv_access_flags.IBV_ACCESS_REMOTE_READ
    if remote_atomic:
        flags |= e.ibv_access_flags.IBV_ACCESS_REMOTE_ATOMIC
    if relaxed_ordering:
        flags |= e.ibv_access_flags.IBV_ACCESS_RELAXED_ORDERING
    return int(flags)


def completions(tokens: list[tuple[int, int, int]]) -> np.ndarray:
    """COMPLETION_DTYPE array from (token, status, vendor_err) tuples."""
    out = np.zeros(len(tokens), dtype=COMPLETION_DTYPE)
    if tokens:
        out["token"], out["status"], out["vendor_err"] = zip(*tokens, strict=True)
    return out


class CqDrain:
    """Drains one CQ (CQEX or CQ) into WC_DTYPE arrays."""

    def __init__(self, cq: Any, *, extended: bool, unsolicited: bool = False) -> None:
        self.cq = cq
        self.extended = extended
        self.unsolicited = unsolicited  # the CQ can say whether a write-with-imm consumed a receive WR
        self._buf = np.zeros(256, dtype=WC_DTYPE)

    def poll(self, max_entries: int) -> np.ndarray:
        """Up to ``max_entries`` completions, oldest first (a view valid until the next call)."""
        if max_entries > len(self._buf):
            self._buf = np.zeros(max_entries, dtype=WC_DTYPE)
        n = self._poll_ex(max_entries) if self.extended else self._poll_plain(max_entries)
        return self._buf[:n]

    def _poll_ex(self, max_entries: int) -> int:
        cq = self.cq
        rc = cq.start_poll(None)
        if rc == errno.ENOENT:
            return 0
        if rc != 0:
            raise VerbsError("ibv_start_poll failed", rc)
        buf = self._buf
        n = 0
        ntohl = socket.ntohl
        try:
            while True:
                row = buf[n]
                status = cq.status
                row["wr_id"] = cq.wr_id
                row["status"] = status
                row["vendor_err"] = cq.read_vendor_err()
                if status == 0:
                    row["opcode"] = cq.read_opcode()
                    row["byte_len"] = cq.read_byte_len()
                    row["qp_num"] = cq.read_qp_num()
                    flags = cq.read_wc_flags()
                    row["wc_flags"] = flags
                    row["imm"] = ntohl(cq.read_imm_data()) if flags & _WC_WITH_IMM else 0
                    row["unsolicited"] = bool(cq.is_unsolicited()) if self.unsolicited else False
                else:
                    row["opcode"] = row["byte_len"] = row["wc_flags"] = row["imm"] = 0
                    row["qp_num"] = cq.read_qp_num()
                    row["unsolicited"] = False
                n += 1
                if n == max_entries:
                    break
                rc = cq.poll_next()
                if rc == errno.ENOENT:
                    break
                if rc != 0:
                    raise VerbsError("ibv_next_poll failed", rc)
        finally:
            cq.end_poll()
        return n

    def _poll_plain(self, max_entries: int) -> int:
        npolled, wcs = self.cq.poll(max_entries)
        buf = self._buf
        ntohl = socket.ntohl
        for i, wc in enumerate(wcs):
            row = buf[i]
            row["wr_id"] = wc.wr_id
            row["status"] = wc.status
            row["vendor_err"] = wc.vendor_err
            row["qp_num"] = wc.qp_num
            row["unsolicited"] = False
            if wc.status == 0:
                flags = wc.wc_flags
                row["opcode"] = wc.opcode
                row["byte_len"] = wc.byte_len
                row["wc_flags"] = flags
                row["imm"] = ntohl(wc.imm_data) if flags & _WC_WITH_IMM else 0
            else:
                row["opcode"] = row["byte_len"] = row["wc_flags"] = row["imm"] = 0
        return npolled


_WC_WITH_IMM = 1 << 1  # IBV_WC_WITH_IMM (checked against the enums at Rail construction)


class Rail:
    """One NIC port's verbs resources: context, PD, one CQ, and the MRs registered through it.

    Subclasses override ``create_context`` / ``create_cq`` (the efa rail opens an ``EfaContext`` and an
    ``EfaCQ``). ``close`` closes MRs, then the CQ, the PD and the context — children before parents, as
    verbs requires; QPs belong to the backend, which closes them before calling ``close``.
    """

    def __init__(self, verbs: Any = None, device: str | None = None, *, port: int = 1, gid_index: int = 0,
                 cq_depth: int = 4096) -> None:
        self.v = load_verbs(verbs)
        if int(self.v.libibverbs_enums.ibv_wc_flags.IBV_WC_WITH_IMM) != _WC_WITH_IMM:
            raise BackendError("IBV_WC_WITH_IMM differs from the value this module assumes")
        self.port = port
        self.gid_index = gid_index
        self.ctx: Any = None
        self.pd: Any = None
        self.cq: Any = None
        self.mrs: dict[tuple[int, int], Any] = {}
        try:
            self.device_name = self.find_device(device)
            with translate_verbs_errors(f"opening {self.device_name}", self.v):
                self.create_context()
                self.device_attr = self.ctx.query_device()
                self.port_attr = self.ctx.query_port(port)
                self.gid = self.ctx.query_gid(port, gid_index)
                self.create_pd()
                depth = min(cq_depth, int(self.device_attr.max_cqe))
                self.create_cq(depth)
                self.cq_depth = depth
        except BaseException:
            self.close()
            raise

    # --- hooks ---------------------------------------------------------------------------------------
    # ibv_node_type values this rail can drive: a ConnectX (or any IB/RoCE HCA) is IBV_NODE_CA; the efa
    # rail overrides this (EFA devices report IBV_NODE_UNSPECIFIED)
    NODE_TYPES: tuple[str, ...] = ("IBV_NODE_CA",)
    KIND = "an InfiniBand/RoCE HCA"

    def find_device(self, device: str | None) -> str:
        """``device`` if it exists and is of a usable type; without a name, the first usable device."""
        v = self.v
        try:
            found = [(_text(d.name), int(d.node_type)) for d in v.device.get_device_list()]
        except v.pyverbs_error.PyverbsError as exc:
            found = []
            reason = str(exc)
        else:
            reason = "no RDMA devices found"
        if not found:
            raise DeviceNotFoundError(f"no RDMA device to open ({reason})")
        nodes = v.libibverbs_enums.ibv_node_type
        usable = {int(getattr(nodes, name)) for name in self.NODE_TYPES}
        names = [name for name, _ in found]
        if device:
            if device not in names:
                raise DeviceNotFoundError(f"RDMA device {device!r} not found; present: {', '.join(names)}")
            if dict(found)[device] not in usable:
                raise DeviceNotFoundError(f"RDMA device {device!r} is not {self.KIND}")
            return device
        for name, node in found:
            if node in usable:
                return name
        raise DeviceNotFoundError(f"none of the RDMA devices ({', '.join(names)}) is {self.KIND}")

    def create_context(self) -> None:
        self.ctx = self.v.device.Context(name=self.device_name)

    def create_pd(self) -> None:
        self.pd = self.v.pd.PD(self.ctx)

    def create_cq(self, depth: int) -> None:
        """A CQEX with the fields the backends read, else a plain CQ."""
        cqm = self.v.cq
        wcf = self.v.libibverbs_enums.ibv_create_cq_wc_flags
        flags = (wcf.IBV_WC_EX_WITH_BYTE_LEN | wcf.IBV_WC_EX_WITH_IMM | wcf.IBV_WC_EX_WITH_QP_NUM)
        try:
            self.cq = cqm.CQEX(self.ctx, cqm.CqInitAttrEx(cqe=depth, wc_flags=int(flags)))
            self.drain = CqDrain(self.cq, extended=True)
        except (self.v.pyverbs_error.PyverbsError, AttributeError, NotImplementedError):
            self.cq = cqm.CQ(self.ctx, depth)
            self.drain = CqDrain(self.cq, extended=False)

    # --- memory --------------------------------------------------------------------------------------
    def register(self, addr: int, length: int, access: int, accessor: Any = None) -> Any:
        """Register [addr, addr+length) with ``access`` (see :func:`access_flags`); the MR stays owned here.

        ``accessor`` reaches memory the CPU cannot address (GPU memory under softverbs, which takes it as
        ``soft_accessor``); pyverbs ignores the keyword — a real NIC reaches GPU memory by itself.
        """
        extra = {} if accessor is None else {"soft_accessor": accessor}
        with translate_verbs_errors(f"registering {length} bytes at {addr:#x}", self.v):
            mr = self.v.mr.MR(self.pd, length, access, address=addr, **extra)
        self.mrs[(addr, int(mr.lkey))] = mr
        return mr

    def deregister(self, addr: int, lkey: int) -> None:
        mr = self.mrs.pop((addr, lkey), None)
        if mr is not None:
            mr.close()

    @classmethod
    def imported(cls, verbs: Any, cmd_fd: int, pd_handle: int, *, port: int = 1, gid_index: int = 0) -> Rail:
        """A rail on another process's context and PD, imported by command descriptor and PD handle
        (``ibv_import_device``, ``ibv_import_pd``; the rail owns ``cmd_fd`` from here on). It has no CQ:
        :meth:`sibling` gives each queue one. Closing it forgets the PD (an import is not deallocated) and
        closes the imported context."""
        rail = object.__new__(cls)
        rail.v = v = load_verbs(verbs)
        rail.port, rail.gid_index, rail.mrs, rail.cq, rail.pd = port, gid_index, {}, None, None
        try:
            with translate_verbs_errors(f"importing a context by command descriptor {cmd_fd}", v):
                rail.ctx = v.device.Context(cmd_fd=cmd_fd)
        except BaseException:
            os.close(cmd_fd)
            raise
        try:
            with translate_verbs_errors(f"importing PD {pd_handle}", v):
                rail.device_name = _text(rail.ctx.name)
                rail.device_attr = rail.ctx.query_device()
                rail.port_attr = rail.ctx.query_port(port)
                rail.gid = rail.ctx.query_gid(port, gid_index)
                rail.pd = v.pd.PD(rail.ctx, handle=pd_handle)
            rail.cq_depth = 0
        except BaseException:
            rail.close()
            raise
        return rail

    def import_mr(self, handle: int, address: int) -> Any:
        """The exporter's MR ``handle`` on this rail's imported PD (its keys serve WQEs of this process's
        QPs; ``address`` is where the exporter registered it, the NIC's view of its bytes)."""
        with translate_verbs_errors(f"importing MR {handle}", self.v):
            mr = self.v.mr.MR(self.pd, handle=handle, address=address)
        self.mrs[(address, int(mr.lkey))] = mr
        return mr

    def sibling(self, cq_depth: int) -> Rail:
        """A rail on this context and PD with a CQ of its own: another queue's completions kept apart from
        this rail's, its WQEs able to use this rail's lkeys. Closing it closes only its CQ and its MRs."""
        twin = object.__new__(type(self))
        twin.__dict__.update({k: getattr(self, k) for k in ("v", "port", "gid_index", "device_name", "ctx", "pd",
                                                             "device_attr", "port_attr", "gid")})
        twin.mrs, twin.cq, twin.parent = {}, None, self
        twin.cq_depth = min(cq_depth, int(self.device_attr.max_cqe))
        with translate_verbs_errors(f"creating a CQ on {self.device_name}", self.v):
            twin.create_cq(twin.cq_depth)
        return twin

    # --- lifetime ------------------------------------------------------------------------------------
    def close(self) -> None:
        for mr in self.mrs.values():
            mr.close()
        self.mrs.clear()
        for name in ("cq",) if getattr(self, "parent", None) is not None else ("cq", "pd", "ctx"):
            obj = getattr(self, name, None)
            if obj is not None:
                obj.close()
                setattr(self, name, None)

    def __enter__(self) -> Rail:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class PosterBackend:
    """The part of an RDMA backend that is the same for ib and efa: the calls the proxy makes into its
    compiled poster (the engine calls :attr:`c_poster` directly; these are the same C calls), the
    connection lookup, and closing as a context manager: every connection (:meth:`close_connection`), then
    what the backend owns besides (:meth:`close_resources`), then the rail (parents close children).

    A subclass sets ``rail`` (a :class:`Rail`), ``_poster`` (its compiled poster) and ``_conns``
    (connection id -> its state), and implements :meth:`close_connection`.
    """

    rail: Rail
    _poster: Any
    _conns: dict[int, Any]

    @property
    def c_poster(self) -> Any:
        """The compiled poster the proxy's engine calls directly (no Python per record or per WR)."""
        return self._poster

    def deregister_memory(self, key: MemoryKey) -> None:
        self.rail.deregister(key.addr, key.lkey)

    def seed_signals(self, conn_id: int, base: int, rkey: int, seeds: bytes) -> None:
        """Nothing to seed here (the receiver keeps the counters); ib's write and fence modes override."""

    def post_batches(self, conn_ids: np.ndarray, plan: np.ndarray, bounds: np.ndarray) -> np.ndarray:
        """Post several batches (``plan[bounds[i]:bounds[i+1]]`` on ``conn_ids[i]``) in one call; WRs per batch.

        Each batch must carry its own token (the proxy's do); where one does not, that run reports zeros.
        """
        out = self._poster.post_batches(np.ascontiguousarray(conn_ids, dtype=np.int64), np.ascontiguousarray(plan),
                                        np.ascontiguousarray(bounds, dtype=np.int64))
        return np.frombuffer(out, dtype=np.int64).copy()

    def poll(self, max_completions: int = 256) -> np.ndarray:
        """Tokens completed since the last call; a failed batch is reported once, with its error status."""
        return np.frombuffer(self._poster.poll(max_completions), dtype=COMPLETION_DTYPE).copy()

    def inflight(self, conn_id: int) -> int:
        """WRs posted on ``conn_id`` and not yet known complete."""
        self._conn(conn_id)
        return self._poster.inflight(conn_id)

    def close_connection(self, conn_id: int) -> None:
        raise NotImplementedError

    def close_resources(self) -> None:
        """Close what the backend owns besides its connections and its rail (called between the two)."""

    def close(self) -> None:
        for conn_id in list(getattr(self, "_conns", {})):  # getattr: a constructor that failed early
            self.close_connection(conn_id)
        self.close_resources()
        self.rail.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _conn(self, conn_id: int) -> Any:
        try:
            return self._conns[conn_id]
        except KeyError:
            raise BackendError(f"unknown connection {conn_id}") from None


def _text(name: Any) -> str:
    return name.decode() if isinstance(name, bytes | bytearray) else str(name)
