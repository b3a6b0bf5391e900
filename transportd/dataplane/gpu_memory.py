"""GPU memory in a rail worker: open clients' CUDA IPC handles, reach them from softverbs, map them through
the GPU's BAR.

Everything runs in the worker process, in the primary context of the client's device; CUDA is initialised
only when a client first brings GPU memory (``transportd.cuda_driver`` imports cuda-python on first use),
so a CPU-only daemon never needs it.

* :meth:`GpuMemory.open` — ``cuIpcOpenMemHandle`` (reference-counted by the driver, so a client's
  allocation may back several regions) and the address of the region inside it;
* :class:`GpuAccessor` — the ``MemoryAccessor`` softverbs uses for MRs over that memory: copies on a
  worker-owned stream, each followed by a stream synchronize. The synchronize matters: a pageable
  host-to-device copy may return before its DMA lands, and the flag written next (by this accessor, or
  into a host flag file by the soft NIC) must never become visible before the payload it covers. A real
  NIC reaches the memory directly (dmabuf) and needs none of this;
* :class:`GdrCopy` — ``libgdrapi`` (GDRCopy, loaded with ctypes: no build dependency): GPU pages pinned and
  mapped into the worker through the BAR, so CPU stores reach them without a CUDA call;
* direct copies between daemons on one host: :class:`GpuMemory` is softverbs' ``DirectCopier``
  (``softverbs.soft.set_direct_copier``). It exports the clients' allocations it opened (their IPC handle
  and the GPU's PCI location), opens a peer worker's exports with ``cuIpcOpenMemHandle`` and places a
  peer's write with one ``cuMemcpyAsync`` on the destination device's worker stream, synchronized before
  it returns. It opens nothing until this worker serves GPU memory of its own, so a CPU-only daemon never
  starts CUDA for a peer. Under CUDA MPS those copies run while client kernels are resident; without it
  each waits for a time slice of this worker's context. A device-to-device copy runs on SMs (the driver
  launches it like a kernel: ``benchmarks/copy_needs_sms.py``), so it waits while a fused op's programs
  hold every SM and competes with their compute. ``GpuMemory(via="host")`` (config
  ``softverbs.direct_copy_via``) places a GPU-to-GPU write through a pinned host staging buffer instead:
  device -> host, then host -> device, with the copy engines, in pipelined chunks. That needs no SM, like a
  NIC's DMA over PCIe, and runs at PCIe's rate.

Publishing flags into this memory is :mod:`transportd.dataplane.flag_publication`'s job.
"""

from __future__ import annotations

import bisect
import ctypes
import struct
import threading
from collections import deque
from dataclasses import dataclass
from typing import Any

from transportd import _core
from transportd.cuda_driver import check, driver, entry_point, result_name, use_device
from transportd.errors import CudaError, GdrCopyError

__all__ = ["COPY_VIA", "GPU_PAGE_SIZE", "GdrCopy", "GdrMapping", "GpuAccessor", "GpuMemory", "IpcRegion"]

#: gdrdrv pins GPU memory in pages of this size (gdrapi.h GPU_PAGE_SIZE).
GPU_PAGE_SIZE = 1 << 16

#: a copy through host memory moves chunks of this size through this many pinned staging slots, so one
#: chunk's device -> host copy overlaps the previous chunk's host -> device copy
STAGE_CHUNK = 512 << 10  # H200: 21.6 GB/s for 1 MiB copies, 30.7 for 4 MiB (1 MiB chunks: 18.7, 33.3)
STAGE_SLOTS = 8

#: words in an accessor's pinned ring for :meth:`GpuAccessor.post_words` (a write holds its word until its copy ran)
WORD_RING = 8192

#: pinned bytes an accessor stages the host bytes of one :meth:`GpuAccessor.copy_many` in (a run's flag writes):
#: a copy from pageable memory may wait for the stream's earlier copies, which is the wait a run shares
RUN_STAGE = 64 << 10

#: ``GpuMemory(via=...)`` values: how a GPU-to-GPU direct copy is placed (see the module's docstring)
COPY_VIA = ("device", "host")

_DEFAULT_LIBRARIES = ("libgdrapi.so.2", "libgdrapi.so")


class GpuAccessor:
    """Reads and writes device memory with synchronous copies on one stream (thread-safe). ``stage``: the
    pinned staging slots of :meth:`copy_through_host` are allocated now, not at its first call: allocating
    and freeing pinned memory can wait for the context's kernels (on the H200 a copy that pinned its own
    staging and freed it after did not complete beside one spinning block), and a fused op's programs may
    be spinning on that very copy."""

    def __init__(self, device: int, *, stage: bool = False) -> None:
        self._drv = driver()
        self._check = check
        self._use = use_device
        self.device = device
        self._lock = threading.Lock()
        self._use(device)
        flags = self._drv.CUstream_flags.CU_STREAM_NON_BLOCKING
        self._stream = check(self._drv.cuStreamCreate(flags), "cuStreamCreate")
        # copy_many queues and waits in compiled code, GIL released, through these two driver functions
        self._queue_copy, self._wait_stream = entry_point("cuMemcpyAsync"), entry_point("cuStreamSynchronize")
        # pinned now, not at a run's first flag: pinning can wait for the kernels that wait for that flag
        self._run_stage = int(check(self._drv.cuMemHostAlloc(RUN_STAGE, 0), "cuMemHostAlloc"))
        self._bound: set[int] = set()  # threads whose current context is already set
        self._stage: int | None = None  # copy_through_host's pinned slots, stream and events
        self._up: Any = None
        self._filled: list[Any] = []
        self._drained: list[Any] = []
        if stage:
            self._open_stage()
        # post_words: the pinned word ring, its stream and the batches in it, under a lock of their own (a flag's
        # post must not wait behind a placement copy's synchronize)
        self._ring_lock = threading.Lock()
        self._ring: int | None = None
        self._ring_stream: Any = None
        self._ring_head = 0
        self._batches: deque[tuple[int, Any, int, int]] = deque()  # (ticket, event, first word, end word)
        self._spare_events: list[Any] = []  # events of retired batches, used again (tickets are numbers)
        self._tickets = 0  # the last ticket handed out; a ticket no longer in _batches has been copied
        self.reads = 0
        self.writes = 0
        self.copies = 0
        self.words_posted = 0

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

    def copy(self, dst: int, src: int, length: int) -> None:
        """One copy between two addresses of this process (unified addressing: device or host memory, this
        GPU or a peer), complete on return: nothing the caller does next can overtake it."""
        if length:
            self.copy_many([(dst, src, length)])

    def copy_many(self, copies: list[tuple[int, int | memoryview, int]]) -> None:
        """``(dst, src, length)`` copies queued in order on the worker stream, one wait for them all: each
        lands before the next starts, and all have when this returns (pieces that continue each other at both
        ends go as one copy, where it does not overlap itself: the same bytes, one kernel). A ``src`` that is a
        buffer holds host bytes to store at ``dst``, staged in pinned memory while it has room (else copied from
        where they are).
        Queued and waited for by ``transportd._core.copy_run``, with the GIL released throughout: one call
        per run, where a driver call each would hand the GIL over twice a copy."""
        with self._lock:
            self._enter()
            err, at = _core.copy_run(self._queue_copy, self._wait_stream, int(self._stream), copies,
                                     self._run_stage, RUN_STAGE)
            if err:
                raise CudaError("cuStreamSynchronize" if at < 0 else f"cuMemcpyAsync (copy {at} of a run)",
                                result_name(self._drv.CUresult(err)))
            self.copies += len(copies)

    def open_word_ring(self) -> None:
        """Allocate :meth:`post_words`' pinned ring and stream now, before kernels that wait on its words run
        (pinning memory can wait for the context's work); idempotent."""
        with self._ring_lock:
            if self._ring is not None:
                return
            self._enter()
            drv, check = self._drv, self._check
            self._ring = int(check(drv.cuMemHostAlloc(8 * WORD_RING, 0), "cuMemHostAlloc"))
            self._ring_stream = check(drv.cuStreamCreate(drv.CUstream_flags.CU_STREAM_NON_BLOCKING),
                                      "cuStreamCreate")

    def post_words(self, writes: list[tuple[int, int]]) -> int:
        """Write 64-bit ``(address, value)`` words into device memory without waiting: each value is staged
        in the pinned ring and copied by this accessor's word stream, in order, behind every earlier post.
        Returns a ticket for :meth:`landed` (tickets increase; more words than the ring holds go as several
        batches, and the last one's ticket covers them all). The caller orders what the words cover before
        posting (a flag is posted once its data is in place), so nothing here waits for the GPU, except a
        ring that wrapped onto a batch not yet copied."""
        if not writes:
            raise ValueError("post at least one word")
        with self._ring_lock:
            if self._ring is None:
                raise RuntimeError("post_words before open_word_ring")
            self._enter()
            for first in range(0, len(writes), WORD_RING):
                self._post_batch(writes[first:first + WORD_RING])
            return self._tickets

    def _post_batch(self, writes: list[tuple[int, int]]) -> None:
        """One batch of at most WORD_RING words (ring lock held)."""
        drv, check = self._drv, self._check
        n = len(writes)
        start = self._ring_head if self._ring_head + n <= WORD_RING else 0
        self._free_ring(start, start + n)
        ring = (ctypes.c_uint64 * n).from_address(self._ring + 8 * start)
        stream = self._ring_stream
        i = 0
        while i < n:  # one copy per run of adjacent words
            j = i + 1
            while j < n and writes[j][0] == writes[j - 1][0] + 8:
                j += 1
            for k in range(i, j):
                ring[k] = writes[k][1]
            check(drv.cuMemcpyHtoDAsync(writes[i][0], self._ring + 8 * (start + i), 8 * (j - i), stream),
                  "cuMemcpyHtoDAsync")
            i = j
        event = self._spare_events.pop() if self._spare_events else check(
            drv.cuEventCreate(drv.CUevent_flags.CU_EVENT_DISABLE_TIMING), "cuEventCreate")
        check(drv.cuEventRecord(event, stream), "cuEventRecord")
        self._tickets += 1
        self._batches.append((self._tickets, event, start, start + n))
        self._ring_head = start + n
        self.words_posted += n

    def landed(self, ticket: int) -> bool:
        """Whether the words of the :meth:`post_words` batch ``ticket`` are in device memory."""
        with self._ring_lock:
            event = self._pending_event(ticket)
            if event is None:
                return True
            self._enter()
            (done,) = self._drv.cuEventQuery(event)
            if done == self._drv.CUresult.CUDA_ERROR_NOT_READY:
                return False
            self._check(done, "cuEventQuery")
            self._retire(ticket)  # one stream copies the batches in order: every one before it landed too
            return True

    def wait_landed(self, ticket: int) -> None:
        """Wait until the :meth:`post_words` batch ``ticket`` is in device memory (before that memory goes)."""
        with self._ring_lock:
            event = self._pending_event(ticket)
            if event is not None:
                self._enter()
                self._check(self._drv.cuEventSynchronize(event), "cuEventSynchronize")
                self._retire(ticket)

    def _pending_event(self, ticket: int) -> Any:
        """The event of batch ``ticket`` while it is still to be copied; None once it was (retired)."""
        return next((event for t, event, _s, _e in self._batches if t == ticket), None)

    def _retire(self, ticket: int) -> None:
        while self._batches and self._batches[0][0] <= ticket:
            self._spare_events.append(self._batches.popleft()[1])

    def _free_ring(self, start: int, end: int) -> None:
        """Wait until no batch still to be copied holds a word of ``[start, end)`` (lock held). One stream
        copies the batches in order, so waiting for the newest such batch retires every batch before it."""
        newest = None
        for ticket, event, s, e in self._batches:
            if s < end and e > start:
                newest = ticket, event
        if newest is None:
            return
        self._check(self._drv.cuEventSynchronize(newest[1]), "cuEventSynchronize")
        self._retire(newest[0])

    def copy_through_host(self, dst: int, src: int, length: int) -> None:
        """Copy between two device addresses through pinned host memory with the copy engines (no SM):
        device -> host on the worker stream, host -> device on a second stream, chunk by chunk through
        ``STAGE_SLOTS`` staging slots; complete on return."""
        if length == 0:
            return
        with self._lock:
            self._enter()
            drv, check = self._drv, self._check
            if self._stage is None:
                self._open_stage()
            down, up = self._stream, self._up
            for i, off in enumerate(range(0, length, STAGE_CHUNK)):
                n, slot = min(STAGE_CHUNK, length - off), i % STAGE_SLOTS
                buf = self._stage + slot * STAGE_CHUNK
                if i >= STAGE_SLOTS:  # the slot's last chunk must have left it
                    check(drv.cuStreamWaitEvent(down, self._drained[slot], 0), "cuStreamWaitEvent")
                check(drv.cuMemcpyDtoHAsync(buf, src + off, n, down), "cuMemcpyDtoHAsync")
                check(drv.cuEventRecord(self._filled[slot], down), "cuEventRecord")
                check(drv.cuStreamWaitEvent(up, self._filled[slot], 0), "cuStreamWaitEvent")
                check(drv.cuMemcpyHtoDAsync(dst + off, buf, n, up), "cuMemcpyHtoDAsync")
                check(drv.cuEventRecord(self._drained[slot], up), "cuEventRecord")
            check(drv.cuStreamSynchronize(up), "cuStreamSynchronize")
            self.copies += 1

    def _open_stage(self) -> None:
        """The pinned staging slots, the host -> device stream and the slots' events."""
        drv, check = self._drv, self._check
        self._stage = int(check(drv.cuMemHostAlloc(STAGE_SLOTS * STAGE_CHUNK, 0), "cuMemHostAlloc"))
        self._up = check(drv.cuStreamCreate(drv.CUstream_flags.CU_STREAM_NON_BLOCKING), "cuStreamCreate")
        timing_off = drv.CUevent_flags.CU_EVENT_DISABLE_TIMING
        self._filled = [check(drv.cuEventCreate(timing_off), "cuEventCreate") for _ in range(STAGE_SLOTS)]
        self._drained = [check(drv.cuEventCreate(timing_off), "cuEventCreate") for _ in range(STAGE_SLOTS)]

    def close(self) -> None:
        """Free the streams and the staging (freeing pinned memory can wait for the context's kernels)."""
        if self._stream is None and self._stage is None and self._ring is None:
            return
        self._use(self.device)
        if self._ring is not None:
            self._drv.cuStreamSynchronize(self._ring_stream)
            for event in (*(b[1] for b in self._batches), *self._spare_events):
                self._drv.cuEventDestroy(event)
            self._batches.clear()
            self._spare_events.clear()
            self._drv.cuStreamDestroy(self._ring_stream)
            self._drv.cuMemFreeHost(self._ring)
            self._ring = None
        if self._stream is not None:
            self._drv.cuStreamDestroy(self._stream)
            self._stream = None
            self._drv.cuMemFreeHost(self._run_stage)
        if self._stage is not None:
            for event in (*self._filled, *self._drained):
                self._drv.cuEventDestroy(event)
            self._drv.cuStreamDestroy(self._up)
            self._drv.cuMemFreeHost(self._stage)
            self._stage = None


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


#: a direct-copy descriptor: the client's IPC handle, then the PCI domain, bus and device of its GPU
_EXPORT = struct.Struct("<64sIII")


class _Allocation:
    """An IPC allocation open in this worker: a client's (``local``) or a peer worker's export."""

    __slots__ = ("base", "size", "device", "handle", "pci", "refs", "local")

    def __init__(self, base: int, size: int, device: int, handle: bytes, pci: tuple[int, int, int],
                 local: bool) -> None:
        self.base, self.size, self.device, self.handle, self.pci = base, size, device, handle, pci
        self.refs = 1
        self.local = local

    def descriptor(self) -> bytes:
        return _EXPORT.pack(self.handle, *self.pci)


class GpuMemory:
    """The worker's GPU side: one accessor per device, IPC mappings opened in that device's context, and
    softverbs' direct copier (see the module's docstring). Creating it touches no CUDA: the first
    :meth:`open` or :meth:`accessor` does."""

    def __init__(self, via: str = "device") -> None:
        if via not in COPY_VIA:
            raise ValueError(f"direct copies go via one of {COPY_VIA}, not {via!r}")
        self.via = via
        self.accessors: dict[int, GpuAccessor] = {}
        self._table_lock = threading.Lock()
        self._starts: list[int] = []  # bases of self._allocs, sorted
        self._allocs: list[_Allocation] = []
        self._imports: dict[bytes, _Allocation] = {}  # peers' exports open here, by descriptor

    def accessor(self, device: int) -> GpuAccessor:
        acc = self.accessors.get(device)
        if acc is None:
            acc = self.accessors[device] = GpuAccessor(device, stage=self.via == "host")
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
            drv.cuIpcCloseMemHandle(base)
            raise ValueError(f"region [{offset}, {offset + size}) is outside the {int(alloc_size)}-byte allocation")
        self._add(base, int(alloc_size), device, bytes(handle), local=True)
        return IpcRegion(self, base, base + offset, size, device)

    def sync_memops(self, addr: int, device: int) -> None:
        """Set CU_POINTER_ATTRIBUTE_SYNC_MEMOPS on the allocation holding ``addr``: GDRCopy's condition for
        CPU stores through the BAR to be ordered with the driver's own copies into the same memory."""
        drv = driver()
        use_device(device)
        one = ctypes.c_uint(1)
        attr = drv.CUpointer_attribute.CU_POINTER_ATTRIBUTE_SYNC_MEMOPS
        check(drv.cuPointerSetAttribute(ctypes.addressof(one), attr, addr), "cuPointerSetAttribute(SYNC_MEMOPS)")

    def close(self, base: int, device: int) -> None:
        drv = driver()
        use_device(device)
        drv.cuIpcCloseMemHandle(base)
        self._drop(base)

    def shutdown(self) -> None:
        for descriptor in list(self._imports):
            while descriptor in self._imports:
                self.close_export(descriptor)
        for acc in self.accessors.values():
            acc.close()
        self.accessors.clear()

    # --- the allocation table (the driver hands the same base out again for a handle opened twice) ----
    def _add(self, base: int, size: int, device: int, handle: bytes, *, local: bool) -> _Allocation:
        pci = _pci_location(device)
        with self._table_lock:
            i = bisect.bisect_left(self._starts, base)
            if i < len(self._starts) and self._starts[i] == base:
                alloc = self._allocs[i]
                alloc.refs += 1
                alloc.local = alloc.local or local
                return alloc
            alloc = _Allocation(base, size, device, handle, pci, local)
            self._starts.insert(i, base)
            self._allocs.insert(i, alloc)
            return alloc

    def _drop(self, base: int) -> None:
        with self._table_lock:
            i = bisect.bisect_left(self._starts, base)
            if i < len(self._starts) and self._starts[i] == base:
                alloc = self._allocs[i]
                alloc.refs -= 1
                if alloc.refs <= 0:
                    del self._starts[i]
                    del self._allocs[i]

    def _find(self, addr: int, length: int = 1) -> _Allocation | None:
        with self._table_lock:
            i = bisect.bisect_right(self._starts, addr) - 1
            if i >= 0:
                alloc = self._allocs[i]
                if addr + max(length, 1) <= alloc.base + alloc.size:
                    return alloc
        return None

    # --- softverbs.soft.DirectCopier ---------------------------------------------------------------------
    def export_range(self, addr: int, length: int) -> tuple[bytes, int, int] | None:
        """A client allocation this worker opened, as a peer worker on this host can open it."""
        alloc = self._find(addr, length)
        if alloc is None or not alloc.local:
            return None
        return alloc.descriptor(), alloc.base, alloc.size

    def open_export(self, descriptor: bytes) -> tuple[int, int]:
        """Open a peer worker's export (a client's IPC handle) on the GPU it names; (base here, size)."""
        if not self.accessors:
            raise ValueError("this worker serves no GPU memory (CUDA is not started here)")
        if len(descriptor) != _EXPORT.size:
            raise ValueError(f"a GPU export descriptor is {_EXPORT.size} bytes, not {len(descriptor)}")
        alloc = self._imports.get(descriptor)
        if alloc is not None:
            alloc.refs += 1
            return alloc.base, alloc.size
        handle, *pci = _EXPORT.unpack(descriptor)
        device = _device_at(tuple(pci))
        if device is None:
            device = next(iter(self.accessors))  # not visible here by PCI location: open it as a peer
        drv = driver()
        use_device(device)
        self.accessor(device)
        ipc = drv.CUipcMemHandle()
        ipc.reserved = handle
        flags = drv.CUipcMem_flags.CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS
        base = int(check(drv.cuIpcOpenMemHandle(ipc, flags), "cuIpcOpenMemHandle"))
        _alloc_base, size = check(drv.cuMemGetAddressRange(base), "cuMemGetAddressRange")
        alloc = self._imports[descriptor] = _Allocation(base, int(size), device, handle, tuple(pci), False)
        with self._table_lock:
            i = bisect.bisect_left(self._starts, base)
            if not (i < len(self._starts) and self._starts[i] == base):  # a handle also open as a client's
                self._starts.insert(i, base)
                self._allocs.insert(i, alloc)
        return alloc.base, alloc.size

    def close_export(self, descriptor: bytes) -> None:
        alloc = self._imports.get(descriptor)
        if alloc is None:
            return
        alloc.refs -= 1
        if alloc.refs > 0:
            return
        del self._imports[descriptor]
        with self._table_lock:
            i = bisect.bisect_left(self._starts, alloc.base)
            if i < len(self._starts) and self._allocs[i] is alloc:
                del self._starts[i]
                del self._allocs[i]
        drv = driver()
        use_device(alloc.device)
        drv.cuIpcCloseMemHandle(alloc.base)

    def copy(self, dst: int, src: int, length: int) -> None:
        """Place ``length`` bytes on the worker stream of the destination's GPU (else the source's),
        complete when it returns: one copy, or, ``via="host"`` between two GPU allocations, through host
        memory (a copy from or to host memory is the copy engines' already)."""
        self.copy_many([(dst, src, length)])

    def copy_many(self, copies: list[tuple[int, int | memoryview, int]]) -> None:
        """Several copies, complete on return, each after the one before: as :meth:`copy` one by one, but
        copies back to back on one GPU's worker stream share one wait (a wait is most of a small copy's
        cost on a busy GPU). A ``src`` that is a buffer holds host bytes to store at ``dst``
        (:meth:`GpuAccessor.copy_many`)."""
        run: list[tuple[int, int | memoryview, int]] = []
        run_device = -1
        for dst, src, length in copies:
            if not length:
                continue
            device, through_host = self._placement(dst, src, length)
            if run and (through_host or device != run_device):
                self.accessor(run_device).copy_many(run)
                run = []
            if through_host:  # a copy of its own, down and up through the staging slots
                assert isinstance(src, int)  # only a copy between two GPU allocations goes through host memory
                self.accessor(device).copy_through_host(dst, src, length)
                continue
            run.append((dst, src, length))
            run_device = device
        if run:
            self.accessor(run_device).copy_many(run)

    def _placement(self, dst: int, src: int | memoryview, length: int) -> tuple[int, bool]:
        """(the GPU whose worker stream places a copy, whether it goes through host memory): the destination's
        GPU, else the source's, else the first this worker serves; through host memory only with
        ``via="host"`` between two GPU allocations (host bytes never: they are host memory already)."""
        to = self._find(dst, length)
        source = self._find(src, length) if isinstance(src, int) else None
        if self.via == "host" and to is not None and source is not None:
            return to.device, True
        alloc = to or source
        return (alloc.device if alloc is not None else next(iter(self.accessors), 0)), False


def _pci_location(device: int) -> tuple[int, int, int]:
    """(domain, bus, device) of a GPU: how two processes with different CUDA_VISIBLE_DEVICES name it."""
    drv = driver()
    attrs = drv.CUdevice_attribute
    dev = check(drv.cuDeviceGet(device), f"cuDeviceGet({device})")
    return tuple(int(check(drv.cuDeviceGetAttribute(getattr(attrs, name), dev), name))  # type: ignore[return-value]
                 for name in ("CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID", "CU_DEVICE_ATTRIBUTE_PCI_BUS_ID",
                              "CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID"))


def _device_at(pci: tuple[int, ...]) -> int | None:
    """This process's ordinal of the GPU at a PCI location, None if it does not see it."""
    drv = driver()
    count = int(check(drv.cuDeviceGetCount(), "cuDeviceGetCount"))
    for ordinal in range(count):
        if _pci_location(ordinal) == pci:
            return ordinal
    return None


# --- GDRCopy -----------------------------------------------------------------------------------------------
class _MemHandle(ctypes.Structure):
    _fields_ = [("h", ctypes.c_ulong)]  # gdr_mh_t, passed by value


class _Info(ctypes.Structure):
    _fields_ = [("va", ctypes.c_uint64), ("mapped_size", ctypes.c_uint64), ("page_size", ctypes.c_uint32),
                ("tm_cycles", ctypes.c_uint64), ("cycles_per_ms", ctypes.c_uint32), ("bits", ctypes.c_uint32),
                ("mapping_type", ctypes.c_int)]  # gdr_info_v2_t


class GdrCopy:
    """``libgdrapi`` through ctypes: open the driver once, pin and map GPU ranges into this process.

    Only the functions below are used: ``gdr_open``, ``gdr_close``, ``gdr_pin_buffer``,
    ``gdr_unpin_buffer``, ``gdr_map``, ``gdr_unmap`` and, where the library has it, ``gdr_get_info_v2``.
    """

    def __init__(self, library: str = "") -> None:
        names = (library,) if library else _DEFAULT_LIBRARIES
        errors = []
        self.lib: Any = None
        for name in names:
            try:
                self.lib = ctypes.CDLL(name)
                self.library = name
                break
            except OSError as exc:
                errors.append(str(exc))
        if self.lib is None:
            raise GdrCopyError(f"cannot load libgdrapi ({'; '.join(errors)})")
        lib = self.lib
        try:
            lib.gdr_open.restype = ctypes.c_void_p
            lib.gdr_open.argtypes = []
            lib.gdr_close.argtypes = [ctypes.c_void_p]
            lib.gdr_pin_buffer.argtypes = [ctypes.c_void_p, ctypes.c_ulong, ctypes.c_size_t, ctypes.c_uint64,
                                           ctypes.c_uint32, ctypes.POINTER(_MemHandle)]
            lib.gdr_unpin_buffer.argtypes = [ctypes.c_void_p, _MemHandle]
            lib.gdr_map.argtypes = [ctypes.c_void_p, _MemHandle, ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t]
            lib.gdr_unmap.argtypes = [ctypes.c_void_p, _MemHandle, ctypes.c_void_p, ctypes.c_size_t]
        except AttributeError as exc:
            raise GdrCopyError(f"{self.library} is not libgdrapi: {exc}") from None
        self._info = getattr(lib, "gdr_get_info_v2", None)
        if self._info is not None:
            self._info.argtypes = [ctypes.c_void_p, _MemHandle, ctypes.POINTER(_Info)]
        self.handle: int | None = lib.gdr_open()
        if not self.handle:
            self.handle = None
            raise GdrCopyError(f"gdr_open failed ({self.library}: is the gdrdrv module loaded and its device "
                               "node readable by this user?)")

    def map(self, addr: int, size: int) -> GdrMapping:
        """Pin the GPU pages holding ``[addr, addr + size)`` and map them here; ``.ptr`` is ``addr``'s place."""
        if self.handle is None:
            raise GdrCopyError("libgdrapi is closed")
        base = addr & ~(GPU_PAGE_SIZE - 1)
        span = (addr + size - base + GPU_PAGE_SIZE - 1) & ~(GPU_PAGE_SIZE - 1)
        mh = _MemHandle()
        rc = self.lib.gdr_pin_buffer(self.handle, base, span, 0, 0, ctypes.byref(mh))
        if rc:
            raise GdrCopyError(f"gdr_pin_buffer({base:#x}, {span}) failed: {rc}")
        va = ctypes.c_void_p()
        rc = self.lib.gdr_map(self.handle, mh, ctypes.byref(va), span)
        if rc or not va.value:
            self.lib.gdr_unpin_buffer(self.handle, mh)
            raise GdrCopyError(f"gdr_map of {span} bytes at {base:#x} failed: {rc}")
        start = base  # the GPU address mapped at va (the driver may align further: ask it where it can)
        if self._info is not None:
            info = _Info()
            if self._info(self.handle, mh, ctypes.byref(info)) == 0 and info.va:
                start = int(info.va)
        offset = addr - start
        if offset < 0 or offset + size > span:
            self.lib.gdr_unmap(self.handle, mh, va, span)
            self.lib.gdr_unpin_buffer(self.handle, mh)
            raise GdrCopyError(f"gdrdrv mapped {start:#x}, which does not cover [{addr:#x}, {addr + size:#x})")
        return GdrMapping(self, mh, int(va.value), span, int(va.value) + offset)

    def close(self) -> None:
        if self.handle is not None:
            self.lib.gdr_close(self.handle)
            self.handle = None


@dataclass(eq=False)
class GdrMapping:
    """A pinned, mapped GPU range: ``ptr`` is the mapped address of the flag words (write-combined)."""

    gdr: GdrCopy
    mh: Any
    va: int
    size: int
    ptr: int

    def release(self) -> None:
        """Unmap, then unpin (gdrapi's order); before the GPU memory itself is closed."""
        if self.va and self.gdr.handle is not None:
            self.gdr.lib.gdr_unmap(self.gdr.handle, self.mh, ctypes.c_void_p(self.va), self.size)
            self.gdr.lib.gdr_unpin_buffer(self.gdr.handle, self.mh)
        self.va = 0
