"""An IBGDA channel from the daemon: the GPU posts mlx5 WQEs to queue pairs the daemon created for it.

``session.channel(kind="ibgda")`` asks the daemon for one RC queue pair per peer rank, on the rank's rail
and connected to a responder on the peer's node through the daemon's peer plane. The daemon answers with
a snapshot of what a ``tpd::IbgdaChannel`` needs — each queue's shared-memory file (send queue, CQ,
doorbell records, doorbell page), the rank's regions with their lkeys, the peers' regions and flag arrays
with their rkeys, and the signal mode — and this module builds the channel's tables from it
(:func:`ibgda.channel_tables.build_channel`):

* :meth:`IbgdaChannelHandle.device_handle` — tables in GPU memory, queue files mapped into the GPU
  (``cuMemHostRegister``); pass ``.bytes`` to a kernel built with ``-DTPD_IBGDA`` (``tpd::DefaultChannel``);
* :meth:`IbgdaChannelHandle.host_handle` — the same tables in host memory, for the device code compiled
  for the host (the CPU tests drive the daemon's queues this way).

Over softverbs the daemon's rail worker is the NIC: it executes the WQEs (``ibgda.soft_mlx5``). On a
ConnectX the same tables point at DevX queues (``ibgda.host_mlx5``). The tables are a snapshot: open the
channel after registering regions, allocating flags and exchanging.
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from ibgda.channel_tables import Alloc, ChannelTables, HostAlloc, build_channel
from ibgda.device_handle import CHANNEL_DTYPE, SignalMode, queue_pair_record
from ibgda.queue_memory import QueueMemory

if TYPE_CHECKING:
    from gpuclient.cuda_memory import DeviceMemory, HostMapping
    from gpuclient.session import Session

__all__ = ["IbgdaChannelHandle", "IbgdaDeviceChannel", "IbgdaHostChannel"]


@dataclass
class _Queue:
    peer: int
    memory: QueueMemory
    info: dict[str, Any]

    def record(self, translate: Any) -> np.ndarray:
        """The QueuePair handle with the queue's parts at ``translate(host address)``."""
        return queue_pair_record({name: translate(addr) for name, addr in self.memory.addresses().items()},
                                 qpn=self.info["qpn"], wqe_cnt=self.memory.wqe_cnt, ncqes=self.memory.ncqes,
                                 scratch=self.info["scratch"], scratch_lkey=self.info["scratch_lkey"])


class IbgdaChannelHandle:
    """The host side of one IBGDA channel (see the module doc); ``kind`` is ``"ibgda"``."""

    kind = "ibgda"

    def __init__(self, session: Session, info: dict[str, Any]) -> None:
        self.id = int(info["channel"])
        self._session = session
        self.info = info
        self.signal_mode = SignalMode[str(info["signal_mode"]).upper()]
        self.queues = [_Queue(int(q["peer"]), _attach_queue(session, q), q) for q in info["queues"]]
        self._device: IbgdaDeviceChannel | None = None
        self._host: IbgdaHostChannel | None = None

    def tables(self, alloc: Alloc, translate: Any, flags: int, flag_count: int) -> ChannelTables:
        """Build the channel's tables with ``alloc``; queue addresses go through ``translate``."""
        info = self.info
        qps = {q.peer: q.record(translate) for q in self.queues}
        return build_channel(
            rank=self._session.rank, world=self._session.world, alloc=alloc, signal_mode=self.signal_mode,
            flags=flags, flag_count=flag_count, queue_pairs=qps,
            local_regions=[tuple(r) for r in info["local_regions"]],
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
        """The channel's error words ``(first_code, count)`` as kernels left them; (0, 0) before any handle."""
        for handle in (self._device, self._host):
            if handle is not None:
                return handle.status()
        return 0, 0

    def close(self) -> None:
        """Free the handles' memory (the kernels using them must be done)."""
        for handle in (self._device, self._host):
            if handle is not None:
                handle.release()
        self._device = self._host = None


def _attach_queue(session: Session, q: dict[str, Any]) -> QueueMemory:
    """Map a queue the daemon's rail worker serves: a memfd it hands over by descriptor (no path to open)."""
    fd = session._conn.take_fd(int(q["fd"]), "ibgda")
    try:
        return QueueMemory.attach(None, int(q["wqe_cnt"]), int(q["ncqes"]), fd=fd)
    finally:
        os.close(fd)  # the mapping keeps the memory


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

    def release(self) -> None:
        self.alloc.blocks.clear()


@dataclass
class IbgdaDeviceChannel:
    """Tables in GPU memory and the queue files mapped into the GPU; ``bytes`` is the kernel argument."""

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
                m = map_host(q.memory.base, q.memory.nbytes, device)
                mappings.append(m)
                spans[q.memory.base] = (q.memory.nbytes, m.device_ptr)

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

    def release(self) -> None:
        for mem in self.blocks:
            mem.free()
        for m in self.mappings:
            m.unmap()
        self.blocks.clear()
        self.mappings.clear()
