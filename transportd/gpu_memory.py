"""GPU memory in a rail worker: open clients' CUDA IPC handles, reach them from softverbs, publish flags.

Imported by ``transportd.rail`` only when a client registers GPU memory, so a CPU-only daemon never needs
cuda-python. Everything runs in the worker process, in the primary context of the client's device.

* :meth:`GpuMemory.open` — ``cuIpcOpenMemHandle`` (reference-counted by the driver, so a client's
  allocation may back several regions) and the address of the region inside it;
* :class:`GpuAccessor` — the ``MemoryAccessor`` softverbs uses for MRs over that memory: copies on a
  worker-owned stream, each followed by a stream synchronize. The synchronize matters: a pageable
  host-to-device copy may return before its DMA lands, and the flag written next (by this accessor, or
  into a host flag file by the soft NIC) must never become visible before the payload it covers. A real
  NIC reaches the memory directly (dmabuf) and needs none of this;
* :class:`GpuFlagWords` — a rank's flag words in GPU memory, published by this worker for efa (receiver
  side, after every piece arrived): read-modify-write under a lock, one writer per rank per worker.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

from transportd.backend import SignalOp

__all__ = ["GpuAccessor", "GpuFlagWords", "GpuMemory", "IpcRegion"]

_MASK64 = (1 << 64) - 1


class GpuAccessor:
    """Reads and writes device memory with synchronous copies on one stream (thread-safe)."""

    def __init__(self, device: int) -> None:
        from gpuclient.cuda_memory import check, driver, use_device

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

    def add_u64(self, addr: int, value: int, op: SignalOp) -> int:
        """``*addr += value`` (or ``= value`` for SET) as one locked read-modify-write; returns the new value."""
        with self._lock:
            self._enter()
            drv, check = self._drv, self._check
            word = bytearray(8)
            if op != SignalOp.SET:
                check(drv.cuMemcpyDtoHAsync(word, addr, 8, self._stream), "cuMemcpyDtoHAsync")
                check(drv.cuStreamSynchronize(self._stream), "cuStreamSynchronize")
                new = (int.from_bytes(word, "little") + value) & _MASK64
            else:
                new = value & _MASK64
            word[:] = new.to_bytes(8, "little")
            check(drv.cuMemcpyHtoDAsync(addr, word, 8, self._stream), "cuMemcpyHtoDAsync")
            check(drv.cuStreamSynchronize(self._stream), "cuStreamSynchronize")
            self.writes += 1
            return new

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
    """A rank's flag words in GPU memory; :meth:`publish` is the worker's efa flag publisher."""

    def __init__(self, region: IpcRegion, accessor: GpuAccessor, count: int) -> None:
        self.region = region
        self.accessor = accessor
        self.count = count
        self.address = region.addr
        self.nbytes = 8 * count

    def publish(self, slot: int, op: SignalOp, value: int) -> None:
        self.accessor.add_u64(self.address + 8 * slot, value, op)

    def release(self) -> None:
        self.region.release()


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
        from gpuclient.cuda_memory import CudaError, check, driver, use_device

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

    def close(self, base: int, device: int) -> None:
        from gpuclient.cuda_memory import driver, use_device

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
