"""GPU memory in a rail worker: open clients' CUDA IPC handles, reach them from softverbs, publish flags.

Imported by ``transportd.dataplane.worker`` only when a client registers GPU memory, so a CPU-only daemon never needs
cuda-python. Everything runs in the worker process, in the primary context of the client's device.

* :meth:`GpuMemory.open` — ``cuIpcOpenMemHandle`` (reference-counted by the driver, so a client's
  allocation may back several regions) and the address of the region inside it;
* :class:`GpuAccessor` — the ``MemoryAccessor`` softverbs uses for MRs over that memory: copies on a
  worker-owned stream, each followed by a stream synchronize. The synchronize matters: a pageable
  host-to-device copy may return before its DMA lands, and the flag written next (by this accessor, or
  into a host flag file by the soft NIC) must never become visible before the payload it covers. A real
  NIC reaches the memory directly (dmabuf) and needs none of this;
* :class:`GpuFlagWords` — a rank's flag words in GPU memory, published by this worker for efa (receiver
  side, after every piece arrived) on the rail's path (:mod:`transportd.dataplane.flag_publication`): GDRCopy (the
  compiled path stores through the BAR mapping; no Python), a loopback RDMA write, or — the last resort —
  a copy through this worker's CUDA context. Each keeps a host shadow of the counters (the rank's flag
  file, shared by the rails' workers), so an ADD is an atomic add on the shadow and one store of the new
  value: never a read of GPU memory.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

from transportd import _core
from transportd.backends.interface import SignalOp
from transportd.cuda_driver import CudaError, check, driver, use_device
from transportd.dataplane.flag_publication import CUDA_COPY, GDRCOPY, LOOPBACK

__all__ = ["GpuAccessor", "GpuFlagWords", "GpuMemory", "IpcRegion"]

_MASK64 = (1 << 64) - 1


class GpuAccessor:
    """Reads and writes device memory with synchronous copies on one stream (thread-safe)."""

    def __init__(self, device: int) -> None:

        self._drv = driver()
        self._check = check
        self._use = use_device
        self.device = device
        self._lock = threading.Lock()
        self._use(device)
        flags = self._drv.CUstream_flags.CU_STREAM_NON_BLOCKING
        self._stream = check(self._drv.cuStreamCreate(flags), "cuStreamCreate")
        self._bound: set[int] = set()  # threads whose current context is already set
        self.reads = 0
        self.writes = 0

    def _enter(self) -> None:
        ident = threading.get_ident()
        if ident not in self._bound:
            self._use(self.device)
            self._bound.add(ident)

    def read(self, addr: int, length: int) -> bytearray:
        out = bytearray(length)
        if length == 0:
            return out
        with self._lock:
            self._enter()
            drv, check = self._drv, self._check
            check(drv.cuMemcpyDtoHAsync(out, addr, length, self._stream), "cuMemcpyDtoHAsync")
            check(drv.cuStreamSynchronize(self._stream), "cuStreamSynchronize")
            self.reads += 1
        return out

    def write(self, addr: int, data: memoryview) -> None:
        if len(data) == 0:
            return
        with self._lock:
            self._enter()
            drv, check = self._drv, self._check
            check(drv.cuMemcpyHtoDAsync(addr, data, len(data), self._stream), "cuMemcpyHtoDAsync")
            check(drv.cuStreamSynchronize(self._stream), "cuStreamSynchronize")
            self.writes += 1

    def close(self) -> None:
        if self._stream is not None:
            self._use(self.device)
            self._drv.cuStreamDestroy(self._stream)
            self._stream = None


@dataclass
class IpcRegion:
    """An opened IPC allocation and the region inside it: ``addr`` is valid in this worker."""

    owner: GpuMemory
    base: int
    addr: int
    size: int
    device: int

    def release(self) -> None:
        """Close this region's reference on the IPC mapping (the driver unmaps at the last one)."""
        if self.base:
            self.owner.close(self.base, self.device)
            self.base = 0


class GpuFlagWords:
    """A rank's ``count`` flag words at ``address`` (GPU memory opened in this worker) and how they are
    published: ``path`` is ``gdrcopy`` (``mapping`` holds the BAR mapping; the backend's compiled path
    stores, :meth:`publish` is not called), ``loopback`` (``loopback``: the rail's
    :class:`~efa.loopback.LoopbackWriter`; :meth:`end_pass` writes what :meth:`publish` queued) or
    ``cuda-copy`` (``accessor``: anything with ``write(addr, bytes)``).

    ``shadow``: the host words holding each counter's current value (the rank's flag file, mapped in
    every rail worker, which all publish through it). ``rkey`` is set once the words are registered.
    ``region``, released with the words, is the IPC mapping (None where the caller owns the memory).
    """

    def __init__(self, address: int, count: int, shadow: Any, path: str, *, region: IpcRegion | None = None,
                 accessor: Any = None, loopback: Any = None, mapping: Any = None) -> None:
        if path not in (GDRCOPY, LOOPBACK, CUDA_COPY):
            raise ValueError(f"GPU flag words cannot be published by {path!r}")
        self.region = region
        self.accessor = accessor
        self.count = count
        self.address = address
        self.nbytes = 8 * count
        self.shadow = shadow
        self.path = path
        self.loopback = loopback
        self.mapping = mapping
        self.rkey = 0
        self._dirty: dict[int, None] = {}  # loopback: slots whose shadow moved since their last write
        self.copies = 0

    def publish(self, slot: int, op: SignalOp, value: int) -> None:
        """Apply one update to the shadow; copy the new value now (cuda-copy) or queue the slot (loopback)."""
        new = _core.flag_shadow_publish(0, self.shadow.address + 8 * slot, int(op), value)
        if self.path == LOOPBACK:
            self._dirty[slot] = None
        else:
            self._copy(slot, new)

    def _copy(self, slot: int, value: int) -> None:
        # as the compiled mapped store: rewrite until the value written is the shadow's (another rail's
        # worker may have moved it meanwhile, and its own copy may land before ours)
        values = self.shadow.values
        while True:
            self.accessor.write(self.address + 8 * slot, memoryview(value.to_bytes(8, "little")))
            self.copies += 1
            now = int(values[slot])
            if now == value:
                return
            value = now

    def end_pass(self) -> None:
        """Loopback: write each queued slot's current shadow value, one write per slot in flight, until no
        slot's shadow moved while its write was on the wire."""
        values = self.shadow.values
        while self._dirty:
            slots = list(self._dirty)
            self._dirty.clear()
            written = [int(values[s]) for s in slots]
            try:
                self.loopback.write([(self.address + 8 * s, self.rkey, v)
                                     for s, v in zip(slots, written, strict=True)])
            except BaseException:
                self._dirty.update(dict.fromkeys(slots))  # still owed: fall_back_to_copy writes them
                raise
            for s, v in zip(slots, written, strict=True):
                if int(values[s]) != v:
                    self._dirty[s] = None

    def fall_back_to_copy(self, accessor: Any) -> None:
        """The loopback path failed: publish by copies from now on, starting with the slots still queued."""
        self.path, self.accessor = CUDA_COPY, accessor
        pending, self._dirty = list(self._dirty), {}
        for s in pending:
            self._copy(s, int(self.shadow.values[s]))

    def release(self) -> None:
        if self.mapping is not None:
            self.mapping.release()  # unmap the BAR pages before the memory they map goes
            self.mapping = None
        if self.region is not None:
            self.region.release()
        self.shadow.close()


class GpuMemory:
    """The worker's GPU side: one accessor per device, IPC mappings opened in that device's context."""

    def __init__(self) -> None:
        self.accessors: dict[int, GpuAccessor] = {}

    def accessor(self, device: int) -> GpuAccessor:
        acc = self.accessors.get(device)
        if acc is None:
            acc = self.accessors[device] = GpuAccessor(device)
        return acc

    def open(self, handle: bytes, offset: int, size: int, device: int) -> IpcRegion:
        """Open a client's allocation by IPC handle and return the region ``[offset, offset+size)`` of it."""

        drv = driver()
        use_device(device)
        ipc = drv.CUipcMemHandle()
        ipc.reserved = bytes(handle)
        flags = drv.CUipcMem_flags.CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS
        try:
            base = int(check(drv.cuIpcOpenMemHandle(ipc, flags), "cuIpcOpenMemHandle"))
        except CudaError as exc:
            raise ValueError(f"cannot open the CUDA IPC handle on device {device}: {exc.result} (is the client "
                             "on this node and the allocation still alive?)") from None
        _alloc_base, alloc_size = check(drv.cuMemGetAddressRange(base), "cuMemGetAddressRange")
        if offset + size > int(alloc_size):
            self.close(base, device)
            raise ValueError(f"region [{offset}, {offset + size}) is outside the {int(alloc_size)}-byte allocation")
        return IpcRegion(self, base, base + offset, size, device)

    def sync_memops(self, addr: int, device: int) -> None:
        """Set CU_POINTER_ATTRIBUTE_SYNC_MEMOPS on the allocation holding ``addr``: GDRCopy's condition for
        CPU stores through the BAR to be ordered with the driver's own copies into the same memory."""
        import ctypes


        drv = driver()
        use_device(device)
        one = ctypes.c_uint(1)
        attr = drv.CUpointer_attribute.CU_POINTER_ATTRIBUTE_SYNC_MEMOPS
        check(drv.cuPointerSetAttribute(ctypes.addressof(one), attr, addr), "cuPointerSetAttribute(SYNC_MEMOPS)")

    def close(self, base: int, device: int) -> None:

        drv = driver()
        use_device(device)
        drv.cuIpcCloseMemHandle(base)

    def shutdown(self) -> None:
        for acc in self.accessors.values():
            acc.close()
        self.accessors.clear()


def make_gpu_memory() -> Any:
    """A :class:`GpuMemory` (the one place the worker creates it; CUDA is initialised on first open)."""
    return GpuMemory()
