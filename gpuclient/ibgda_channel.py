"""An IBGDA channel: the GPU posts mlx5 WQEs to queue pairs this process built on the daemon's domain.

``session.channel(kind="ibgda")`` (:func:`open_channel`):

1. the daemon grants the rank's IBGDA domain (``ibgda.domain``): a device context of the rank's own on its
   rail, a PD holding the rank's regions, a scratch page; the context's command descriptor comes over the
   descriptor socket. The session imports it once (:class:`ibgda.imported.ImportedDomain`) and keeps it
   for its later channels;
2. one RC queue pair per peer rank is built here, in this process, on the imported PD (over softverbs a
   soft ConnectX thread runs here too; on a ConnectX, DevX objects and a UAR this process maps);
3. their endpoints go to the daemon (``channel_connect``), which connects a far end to each through the
   peer plane; ``channel_info`` then gives the far ends and the keys: the rank's regions with the
   domain's lkeys, the peers' regions and flag arrays with their rkeys, the signal mode;
4. the queue pairs are connected (RTR, RTS) and the channel's tables are built on request
   (:func:`ibgda.channel_tables.build_channel`):

* :meth:`IbgdaChannelHandle.device_handle` — tables in GPU memory, queue memory (and a ConnectX's UAR page)
  mapped into the GPU (``cuMemHostRegister``); pass ``.bytes`` to a kernel built with ``-DTPD_IBGDA``;
* :meth:`IbgdaChannelHandle.host_handle` — the same tables in host memory, for the device code compiled
  for the host (the CPU tests drive the queues this way).

The tables are a snapshot: open the channel after registering regions, allocating flags and exchanging.
After an error completion (``status()`` reports it) the channel's queue pairs are in the error state for
good: :meth:`IbgdaChannelHandle.close` it and open another to the same peers (queue recovery); the daemon
closes the old far ends and the peers accept the new ones.
"""

from __future__ import annotations

import ctypes
import os
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from cmd_ring.errors import ErrorCode
from cmd_ring.protocol import Channel as ChannelRequest
from cmd_ring.protocol import ChannelClose, ChannelConnect, ChannelInfo, QueueEndpoint
from ibgda.channel_tables import Alloc, ChannelTables, HostAlloc, build_channel
from ibgda.device_handle import CHANNEL_DTYPE, SignalMode, queue_pair_record
from ibgda.imported import ImportedDomain

if TYPE_CHECKING:
    from gpuclient.cuda_memory import DeviceMemory, HostMapping
    from gpuclient.session import Session

__all__ = ["IbgdaChannelHandle", "IbgdaDeviceChannel", "IbgdaHostChannel", "close_domains", "open_channel"]

_ENDPOINT_FIELDS = ("qpn", "psn", "lid", "gid", "port", "mtu", "max_dest_rd_atomic")


def open_channel(session: Session, wqe_cnt: int, timeout: float) -> IbgdaChannelHandle:
    """Open an IBGDA channel of ``wqe_cnt`` WQEs per queue pair (module doc, steps 1 to 4)."""
    reply = session._conn.request(ChannelRequest(capacity=wqe_cnt, kind="ibgda"))
    channel = int(reply["channel"])
    fd = session._conn.take_fd(int(reply["domain"]["fd"]), "ibgda")
    domains = session._ibgda_domains
    rail = int(reply["rail"])
    if rail in domains:
        os.close(fd)  # imported already: the copy offered with each channel is not needed
    else:
        domains[rail] = ImportedDomain(reply["domain"], fd)
    domain = domains[rail]
    ch = IbgdaChannelHandle(session, channel, domain, int(reply["wqe_cnt"]))
    try:
        ch._connect([int(p) for p in reply["peers"]], timeout)
    except BaseException:
        ch.close()
        raise
    return ch


def close_domains(session: Session) -> None:
    """Close the session's imported domains (after its channels)."""
    for domain in session._ibgda_domains.values():
        domain.close()
    session._ibgda_domains.clear()


@dataclass
class _Queue:
    peer: int
    qp: Any  # ibgda.soft_mlx5.SoftMlx5Queue or ibgda.host_mlx5.Mlx5Queue
    scratch: int
    scratch_lkey: int

    def record(self, translate: Any) -> np.ndarray:
        """The QueuePair handle with the queue's parts at ``translate(host address)``."""
        return queue_pair_record({name: translate(addr) for name, addr in self.qp.addresses().items()},
                                 qpn=self.qp.qpn, wqe_cnt=self.qp.wqe_cnt, ncqes=self.qp.mem.ncqes,
                                 scratch=self.scratch, scratch_lkey=self.scratch_lkey)


class IbgdaChannelHandle:
    """The host side of one IBGDA channel (see the module doc); ``kind`` is ``"ibgda"``."""

    kind = "ibgda"

    def __init__(self, session: Session, channel: int, domain: ImportedDomain, wqe_cnt: int) -> None:
        self.id = channel
        self._session = session
        self.domain = domain
        self.wqe_cnt = wqe_cnt
        self.queues: list[_Queue] = []
        self.info: dict[str, Any] = {}
        self.signal_mode = SignalMode.WRITE
        self._device: IbgdaDeviceChannel | None = None
        self._host: IbgdaHostChannel | None = None
        self._closed = False
        #: the daemon that served its domain is gone (a restart): CHANNEL_LOST; open a new channel
        self.lost = False

    def _connect(self, peers: list[int], timeout: float) -> None:
        conn = self._session._conn
        for peer in peers:
            scratch, lkey = self.domain.scratch_slot()
            self.queues.append(_Queue(peer, self.domain.queue(self.wqe_cnt), scratch, lkey))
        endpoints = []
        for q in self.queues:
            ep = q.qp.endpoint()
            endpoints.append(QueueEndpoint(peer=q.peer, **{k: ep[k] for k in _ENDPOINT_FIELDS}))
        info = conn.request(ChannelConnect(channel=self.id, endpoints=tuple(endpoints)))
        deadline = time.monotonic() + timeout
        while not info.get("ready"):
            if time.monotonic() > deadline:
                raise TimeoutError(f"IBGDA channel {self.id}: the peers' far ends did not connect within {timeout}s")
            time.sleep(0.005)
            info = conn.request(ChannelInfo(channel=self.id))
        far = {int(q["peer"]): q["far"] for q in info["queues"]}
        for q in self.queues:
            q.qp.connect(dict(far[q.peer]))
        for addr, _length, _lkey, handle in info["local_regions"]:
            if handle:
                self.domain.import_mr(int(handle), int(addr))
        self.info = info
        self.signal_mode = SignalMode[str(info["signal_mode"]).upper()]

    def tables(self, alloc: Alloc, translate: Any, flags: int, flag_count: int) -> ChannelTables:
        """Build the channel's tables with ``alloc``; queue addresses go through ``translate``."""
        info = self.info
        qps = {q.peer: q.record(translate) for q in self.queues}
        return build_channel(
            rank=self._session.rank, world=self._session.world, alloc=alloc, signal_mode=self.signal_mode,
            flags=flags, flag_count=flag_count, queue_pairs=qps,
            local_regions=[tuple(r[:3]) for r in info["local_regions"]],
            remote_regions={int(peer): [tuple(r) for r in regions] for peer, regions in info["remote_regions"]},
            remote_flags={int(peer): tuple(key) for peer, key in info["remote_flags"]})

    def device_handle(self, device: int | None = None) -> IbgdaDeviceChannel:
        """The ``tpd::IbgdaChannel`` for kernels (built once): ``.bytes`` is the kernel argument."""
        if self._device is None:
            self._device = IbgdaDeviceChannel.build(self, device)
        return self._device

    def host_handle(self) -> IbgdaHostChannel:
        """The channel for the device code compiled for the host: ``.ptr`` is a ``const IbgdaChannel*``."""
        if self._host is None:
            self._host = IbgdaHostChannel.build(self)
        return self._host

    def status(self) -> tuple[int, int]:
        """The channel's error words ``(first_code, count)`` as kernels left them; (0, 0) before any handle;
        CHANNEL_LOST once the daemon that served its queue pairs is gone (and nothing came first)."""
        for handle in (self._device, self._host):
            if handle is not None:
                code, count = handle.status()
                return (code or (int(ErrorCode.CHANNEL_LOST) if self.lost else 0)), count
        return (int(ErrorCode.CHANNEL_LOST), 0) if self.lost else (0, 0)

    def mark_lost(self) -> None:
        """The daemon restarted: the domain its queue pairs were built on and the keys in this channel's
        tables are gone, so the channel cannot go on (docs/restart.md). Kernels see CHANNEL_LOST in the
        error word (unless an error came first); the session stays valid: close this channel once its kernels
        are done and open a new one."""
        self.lost = True
        for handle in (self._device, self._host):
            if handle is not None:
                handle.report(int(ErrorCode.CHANNEL_LOST))

    def close(self) -> None:
        """Close the channel (the kernels using it must be done): free the handles' memory, destroy the
        queue pairs and have the daemon close their far ends. The session can open another channel to the
        same peers afterwards (after an error completion, that is how a channel recovers)."""
        if self._closed:
            return
        self._closed = True
        for handle in (self._device, self._host):
            if handle is not None:
                handle.release()
        self._device = self._host = None
        for q in self.queues:
            q.qp.close()
        self.queues.clear()
        try:
            self._session._conn.request(ChannelClose(channel=self.id))
        except Exception:  # the session already left, or the daemon is gone: the far ends went with it
            pass
        if self in self._session.ibgda_channels:
            self._session.ibgda_channels.remove(self)


@dataclass
class IbgdaHostChannel:
    """Tables in host memory; ``ptr`` addresses the channel record (a ``const tpd::IbgdaChannel*``)."""

    tables: ChannelTables
    alloc: HostAlloc
    record: np.ndarray = field(repr=False)

    @classmethod
    def build(cls, channel: IbgdaChannelHandle) -> IbgdaHostChannel:
        flags = channel._session.flag_array
        values = getattr(flags, "values", None)
        if flags is None or not isinstance(values, np.ndarray):
            raise RuntimeError("a host IBGDA channel needs host flags: call session.flags(count, where='host')")
        alloc = HostAlloc()
        tables = channel.tables(alloc, lambda a: a, int(values.ctypes.data), flags.count)
        record = np.zeros(1, dtype=CHANNEL_DTYPE)
        record[:] = tables.record
        return cls(tables, alloc, record)

    @property
    def ptr(self) -> int:
        return int(self.record.ctypes.data)

    def status(self) -> tuple[int, int]:
        code, count = (ctypes.c_uint32 * 2).from_address(self.tables.error)  # in a block ``alloc`` keeps
        return int(code), int(count)

    def report(self, code: int) -> None:
        """Write ``code`` into the error word where no code is yet (what a kernel reads)."""
        word = (ctypes.c_uint32 * 2).from_address(self.tables.error)
        if word[0] == 0:
            word[0] = code

    def release(self) -> None:
        self.alloc.blocks.clear()


@dataclass
class IbgdaDeviceChannel:
    """Tables in GPU memory and the queues mapped into the GPU; ``bytes`` is the kernel argument."""

    device: int
    tables: ChannelTables
    blocks: list[DeviceMemory]
    mappings: list[HostMapping]

    @classmethod
    def build(cls, channel: IbgdaChannelHandle, device: int | None) -> IbgdaDeviceChannel:
        from gpuclient.cuda_memory import DeviceMemory, map_host, use_device
        from gpuclient.device_channel import flag_pointer

        session = channel._session
        if device is None:
            device = session.device if session.device not in (None, -1) else 0
        use_device(device)
        blocks: list[DeviceMemory] = []
        mappings: list[HostMapping] = []

        def alloc(image: bytes) -> int:
            mem = DeviceMemory(max(len(image), 8), device)
            blocks.append(mem)
            mem.write(0, image)
            return mem.ptr

        try:
            spans = {}
            for q in channel.queues:
                for base, nbytes, io in q.qp.spans():  # queue memory; a ConnectX's UAR page as I/O memory
                    m = map_host(base, nbytes, device, io=io)
                    mappings.append(m)
                    spans[base] = (nbytes, m.device_ptr)

            def translate(addr: int) -> int:
                for base, (nbytes, dev) in spans.items():
                    if base <= addr < base + nbytes:
                        return dev + (addr - base)
                raise ValueError(f"address {addr:#x} is in no queue mapping")

            flags_ptr, flag_count, flags_map = flag_pointer(session, device)
            if flags_map is not None:
                mappings.append(flags_map)
            tables = channel.tables(alloc, translate, flags_ptr, flag_count)
        except BaseException:
            for mem in blocks:
                mem.free()
            for m in mappings:
                m.unmap()
            raise
        return cls(device, tables, blocks, mappings)

    @property
    def bytes(self) -> bytes:
        """The 80 bytes of ``tpd::IbgdaChannel`` to pass as a kernel argument."""
        return self.tables.record.tobytes()

    def __bytes__(self) -> bytes:
        return self.bytes

    def status(self) -> tuple[int, int]:
        mem = next(b for b in self.blocks if b.ptr == self.tables.error)
        code, count = np.frombuffer(mem.read(0, 8), dtype="<u4")
        return int(code), int(count)

    def report(self, code: int) -> None:
        """Write ``code`` into the error word in GPU memory where no code is yet (a kernel still running may
        race this write: its own first error may land after it)."""
        if self.status()[0] == 0:
            mem = next(b for b in self.blocks if b.ptr == self.tables.error)
            mem.write(0, np.array([code], dtype="<u4").tobytes())

    def release(self) -> None:
        for mem in self.blocks:
            mem.free()
        for m in self.mappings:
            m.unmap()
        self.blocks.clear()
        self.mappings.clear()
