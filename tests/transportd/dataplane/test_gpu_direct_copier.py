"""GpuMemory as softverbs' direct copier, on a recording stand-in for the CUDA driver (no GPU here; the
real thing runs in tests/gpu/test_soft_fabric.py): what it exports, what it opens on which GPU, how often
it opens and closes a peer's handle, and which GPU's worker stream each copy runs on."""

from __future__ import annotations

import ctypes
import enum
from types import SimpleNamespace
from typing import Any

import pytest

from softverbs import soft
from transportd import cuda_driver
from transportd.dataplane import gpu_memory
from transportd.dataplane.gpu_memory import RUN_STAGE, STAGE_SLOTS, GpuMemory
from transportd.errors import CudaError

HANDLE_A = bytes(range(64))
HANDLE_PEER = bytes(range(64, 128))
STAGE_CHUNK = 1 << 16


class FakeResult(enum.IntEnum):
    CUDA_SUCCESS = 0
    CUDA_ERROR_INVALID_VALUE = 1
    CUDA_ERROR_ILLEGAL_ADDRESS = 700
    CUDA_ERROR_NOT_READY = 600


class FakeStream(str):
    """A stream as the fake driver hands it out: its name, and a handle (``int()``) for compiled code."""

    handle = 0

    def __int__(self) -> int:
        return self.handle


# the two driver functions `_core.copy_run` calls, as C sees them
QUEUE_COPY = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p)
WAIT_STREAM = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)


class FakeDriver:
    """The cuda.bindings.driver calls GpuMemory makes: two GPUs at PCI buses 0x10 and 0x20, IPC handles
    mapped at fixed addresses, every open, close and copy recorded. The copies and waits the compiled copy
    run makes reach the same records through C-callable entry points (:meth:`entry_point`)."""

    CUresult = FakeResult
    CUstream_flags = SimpleNamespace(CU_STREAM_NON_BLOCKING=1)
    CUevent_flags = SimpleNamespace(CU_EVENT_DISABLE_TIMING=2)
    CUipcMem_flags = SimpleNamespace(CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS=1)
    CUdevice_attribute = SimpleNamespace(CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID="domain",
                                         CU_DEVICE_ATTRIBUTE_PCI_BUS_ID="bus",
                                         CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID="device")

    class CUipcMemHandle:
        reserved = b""

    def __init__(self) -> None:
        self.mapped = {HANDLE_A: (0x7000_0000, 1 << 20), HANDLE_PEER: (0x9000_0000, 4 << 20)}
        self.current = None
        self.opens: list[tuple[bytes, Any]] = []
        self.closes: list[int] = []
        self.copies: list[tuple[int, int, int, Any]] = []
        self.staged: list[tuple[Any, ...]] = []  # copy_through_host's calls, in order
        self.syncs: list[tuple[int, str]] = []  # (copies issued by then, stream) per cuStreamSynchronize
        self.streams: dict[Any, int] = {}  # streams made in each context
        self.events = 0
        self.pinned: list[int] = []
        self.done: set[str] = set()  # events whose work ran (cuEventQuery), set by the test
        self.entry_points: list[Any] = []
        self.by_handle: dict[int, FakeStream] = {}  # the streams made, by the handle compiled code passes

    def cuDeviceGetCount(self) -> tuple[int, int]:
        return 0, 2

    def cuDeviceGet(self, ordinal: int) -> tuple[int, int]:
        return 0, ordinal

    def cuDeviceGetAttribute(self, attr: str, dev: int) -> tuple[int, int]:
        return 0, {"domain": 0, "bus": 0x10 * (dev + 1), "device": 0}[attr]

    def cuDevicePrimaryCtxRetain(self, dev: int) -> tuple[int, str]:
        return 0, f"ctx{dev}"

    def cuCtxSetCurrent(self, ctx: str) -> tuple[int]:
        self.current = ctx
        return (0,)

    def cuStreamCreate(self, flags: int) -> tuple[int, str]:
        made = self.streams[self.current] = self.streams.get(self.current, 0) + 1
        stream = FakeStream(f"stream@{self.current}" + ("" if made == 1 else f"#{made}"))
        stream.handle = 0x100 + len(self.by_handle)
        self.by_handle[stream.handle] = stream
        return 0, stream

    def cuMemHostAlloc(self, size: int, flags: int) -> tuple[int, int]:
        self.pinned.append(size)
        return 0, 0x5000_0000

    def cuMemFreeHost(self, ptr: int) -> tuple[int]:
        self.staged.append(("free_host", ptr))
        return (0,)

    def cuEventCreate(self, flags: int) -> tuple[int, str]:
        self.events += 1
        return 0, f"event{self.events}"

    def cuEventDestroy(self, event: str) -> tuple[int]:
        return (0,)

    def cuEventRecord(self, event: str, stream: str) -> tuple[int]:
        self.staged.append(("record", event, stream))
        self.done.discard(event)  # recorded again: not run until the test says
        return (0,)

    def cuEventQuery(self, event: str) -> tuple[int]:
        return (0 if event in self.done else 600,)

    def cuEventSynchronize(self, event: str) -> tuple[int]:
        self.staged.append(("sync", event))
        self.done.add(event)
        return (0,)

    def cuStreamWaitEvent(self, stream: str, event: str, flags: int) -> tuple[int]:
        self.staged.append(("wait", stream, event))
        return (0,)

    def cuMemcpyDtoHAsync(self, dst: int, src: int, n: int, stream: str) -> tuple[int]:
        self.staged.append(("down", dst, src, n, stream))
        return (0,)

    def cuMemcpyHtoDAsync(self, dst: int, src: int, n: int, stream: str) -> tuple[int]:
        self.staged.append(("up", dst, src, n, stream))
        return (0,)

    def cuStreamDestroy(self, stream: str) -> tuple[int]:
        return (0,)

    def cuStreamSynchronize(self, stream: str) -> tuple[int]:
        self.syncs.append((len(self.copies), stream))
        return (0,)

    def cuIpcOpenMemHandle(self, ipc: Any, flags: int) -> tuple[int, int]:
        self.opens.append((bytes(ipc.reserved), self.current))
        return 0, self.mapped[bytes(ipc.reserved)][0]

    def cuMemGetAddressRange(self, base: int) -> tuple[int, int, int]:
        size = next(size for b, size in self.mapped.values() if b == base)
        return 0, base, size

    def cuIpcCloseMemHandle(self, base: int) -> tuple[int]:
        self.closes.append(base)
        return (0,)

    def cuMemcpyAsync(self, dst: int, src: int, n: int, stream: str) -> tuple[int]:
        self.copies.append((dst, src, n, stream))
        return (self.copy_error if len(self.copies) == self.fail_copy else 0,)

    fail_copy = 0  # the copy (counting from 1) that fails with copy_error; 0: none
    copy_error = 0

    def entry_point(self, name: str) -> int:
        """The address of a C-callable stand-in for libcuda's ``name`` (kept alive by this driver)."""
        if name == "cuMemcpyAsync":
            fn: Any = QUEUE_COPY(lambda dst, src, n, stream: self.cuMemcpyAsync(
                dst, src, n, self.by_handle[stream])[0])
        else:
            assert name == "cuStreamSynchronize"
            fn = WAIT_STREAM(lambda stream: self.cuStreamSynchronize(self.by_handle[stream])[0])
        self.entry_points.append(fn)
        address = ctypes.cast(fn, ctypes.c_void_p).value
        assert address
        return address


@pytest.fixture
def drv(monkeypatch: pytest.MonkeyPatch) -> FakeDriver:
    fake = FakeDriver()
    monkeypatch.setattr(cuda_driver, "_driver", fake)
    monkeypatch.setattr(gpu_memory, "entry_point", fake.entry_point)
    monkeypatch.setattr(cuda_driver, "_contexts", {})
    return fake


def _descriptor(handle: bytes, bus: int) -> bytes:
    return handle + (0).to_bytes(4, "little") + bus.to_bytes(4, "little") + (0).to_bytes(4, "little")


def test_it_is_a_direct_copier_and_exports_only_the_clients_allocations_it_opened(drv: FakeDriver) -> None:
    gpu = GpuMemory()
    assert isinstance(gpu, soft.DirectCopier)
    assert gpu.export_range(0x7000_0000, 8) is None  # nothing opened yet: nothing to share, no CUDA touched
    region = gpu.open(HANDLE_A, 4096, 65536, device=1)
    assert region.addr == 0x7000_1000
    descriptor, base, size = gpu.export_range(region.addr + 100, 1000)
    assert (base, size) == (0x7000_0000, 1 << 20) and descriptor == _descriptor(HANDLE_A, 0x20)
    assert gpu.export_range(0x7000_0000 + (1 << 20) - 4, 8) is None  # straddles the allocation's end
    assert gpu.export_range(0x6FFF_FFF0, 8) is None
    second = gpu.open(HANDLE_A, 0, 4096, device=1)  # the driver maps one allocation once for both regions
    region.release()
    assert gpu.export_range(second.addr, 16) is not None
    second.release()
    assert gpu.export_range(second.addr, 16) is None


def test_a_worker_without_gpu_memory_refuses_to_open_a_peer_s_allocation(drv: FakeDriver) -> None:
    with pytest.raises(ValueError, match="serves no GPU memory"):
        GpuMemory().open_export(_descriptor(HANDLE_PEER, 0x10))
    assert drv.opens == []


def test_a_peer_allocation_opens_once_on_the_gpu_its_pci_location_names(drv: FakeDriver) -> None:
    gpu = GpuMemory()
    gpu.accessor(0)  # this worker serves GPU 0
    desc = _descriptor(HANDLE_PEER, 0x20)  # the peer's buffer is on the GPU at bus 0x20: ordinal 1 here
    assert gpu.open_export(desc) == (0x9000_0000, 4 << 20)
    assert gpu.open_export(desc) == (0x9000_0000, 4 << 20)
    assert drv.opens == [(HANDLE_PEER, "ctx1")]
    gpu.close_export(desc)
    assert drv.closes == []
    gpu.close_export(desc)
    assert drv.closes == [0x9000_0000]
    with pytest.raises(ValueError, match="descriptor is 76 bytes"):
        gpu.open_export(b"short")


def test_each_copy_runs_on_the_destination_gpu_s_stream_and_is_synchronized(drv: FakeDriver) -> None:
    gpu = GpuMemory()
    region = gpu.open(HANDLE_A, 0, 1 << 20, device=0)
    gpu.accessor(0)
    src, _ = gpu.open_export(_descriptor(HANDLE_PEER, 0x20))
    gpu.copy(region.addr + 64, src + 128, 4096)  # into this worker's client buffer: GPU 0's stream
    gpu.copy(0x1234_0000, src, 8)  # into host memory: the source's GPU (1)
    assert [(d, s, n) for d, s, n, _ in drv.copies] == [(region.addr + 64, src + 128, 4096), (0x1234_0000, src, 8)]
    assert [stream for *_, stream in drv.copies] == ["stream@ctx0", "stream@ctx1"]
    assert gpu.accessors[0].copies == 1 and gpu.accessors[1].copies == 1
    gpu.shutdown()
    assert 0x9000_0000 in drv.closes


def test_copies_back_to_back_on_one_gpu_share_one_wait_and_keep_their_order(drv: FakeDriver) -> None:
    """copy_many: the copies in the order given, each on its GPU's stream as copy() would place it, one
    synchronize per run on one stream, and a run ends (synchronized) before the next GPU's copies start."""
    gpu = GpuMemory()
    region = gpu.open(HANDLE_A, 0, 1 << 20, device=0)
    gpu.accessor(0)
    src, _ = gpu.open_export(_descriptor(HANDLE_PEER, 0x20))
    copies = [(region.addr + 4096 * i, src + 8192 * i, 4096) for i in range(3)]  # not continuing each other
    copies += [(0x1234_0000, src, 8), (region.addr, src + 64, 64)]  # host memory: GPU 1's; then GPU 0 again
    gpu.copy_many(copies)
    assert [(d, s, n) for d, s, n, _ in drv.copies] == copies
    assert [stream for *_, stream in drv.copies] == ["stream@ctx0"] * 3 + ["stream@ctx1", "stream@ctx0"]
    assert drv.syncs == [(3, "stream@ctx0"), (4, "stream@ctx1"), (5, "stream@ctx0")]
    assert gpu.accessors[0].copies == 4 and gpu.accessors[1].copies == 1


def test_host_bytes_in_a_run_are_staged_in_pinned_memory_and_copied_in_their_place(
        drv: FakeDriver, monkeypatch: pytest.MonkeyPatch) -> None:
    """copy_many with host bytes among device copies (a flag write in a run of direct writes): each piece is
    queued in the order given on the one stream, the bytes staged in the accessor's pinned buffer while it
    has room (else copied from where they are), and one synchronize ends the run."""
    stage = (ctypes.c_char * RUN_STAGE)()
    monkeypatch.setattr(drv, "cuMemHostAlloc", lambda size, flags: (0, ctypes.addressof(stage)))
    gpu = GpuMemory()
    region = gpu.open(HANDLE_A, 0, 1 << 20, device=0)
    gpu.accessor(0)
    src, _ = gpu.open_export(_descriptor(HANDLE_PEER, 0x10))
    big = memoryview(bytearray(b"b" * RUN_STAGE))
    gpu.copy_many([(region.addr, src, 4096), (region.addr + 4096, memoryview(b"FLAGFLAG"), 8),
                   (region.addr + 8192, src + 4096, 4096), (region.addr + 8200, memoryview(b"flag"), 4),
                   (region.addr + 16384, big, RUN_STAGE)])
    base = ctypes.addressof(stage)
    big_at = ctypes.addressof(ctypes.c_char.from_buffer(big))  # no room left: copied from where it is
    assert drv.copies == [(region.addr, src, 4096, "stream@ctx0"), (region.addr + 4096, base, 8, "stream@ctx0"),
                          (region.addr + 8192, src + 4096, 4096, "stream@ctx0"),
                          (region.addr + 8200, base + 8, 4, "stream@ctx0"),
                          (region.addr + 16384, big_at, RUN_STAGE, "stream@ctx0")]
    assert stage.raw[:12] == b"FLAGFLAGflag"
    assert drv.syncs == [(5, "stream@ctx0")]  # one wait, after every piece was queued


def test_pieces_that_continue_each_other_go_as_one_copy_where_that_copy_does_not_overlap_itself(
        drv: FakeDriver, monkeypatch: pytest.MonkeyPatch) -> None:
    """A run's pieces whose source and destination both continue the previous piece's are queued as one copy
    (a MoE group's rows come as several writes that do); a gap at either end, or a joined copy whose source
    would overlap its destination, keeps them apart (an empty piece between does not: it queues nothing). Host
    bytes staged back to back join too, but never with an address piece, and the copies are queued in the
    pieces' order."""
    stage = (ctypes.c_char * RUN_STAGE)()
    monkeypatch.setattr(drv, "cuMemHostAlloc", lambda size, flags: (0, ctypes.addressof(stage)))
    gpu = GpuMemory()
    region = gpu.open(HANDLE_A, 0, 1 << 20, device=0)
    acc = gpu.accessor(0)
    src, _ = gpu.open_export(_descriptor(HANDLE_PEER, 0x10))
    a = region.addr
    base = ctypes.addressof(stage)
    acc.copy_many([(a, src, 4096), (a + 4096, src + 4096, 4096), (a + 8192, src + 8192, 100),  # one copy
                   (a + 8292, src + 8292 + 1, 10),  # the source has a gap: apart
                   (a + 9000, src + 9000, 8), (a + 9008, src + 9008, 0), (a + 9008, src + 9008, 8),  # empty: joins
                   (a + 20000, memoryview(b"AAAA"), 4), (a + 20004, memoryview(b"BBBB"), 4),  # staged: one copy
                   # addresses that continue the staged bytes at both ends: apart from them, joined to each other
                   (a + 20008, base + 8, 4), (a + 20012, base + 12, 4),
                   (a + 30000, a + 29000, 600), (a + 30600, a + 29600, 600)])  # joined, they would overlap
    assert [(d, s, n) for d, s, n, _ in drv.copies] == [
        (a, src, 8292), (a + 8292, src + 8293, 10), (a + 9000, src + 9000, 16), (a + 20000, base, 8),
        (a + 20008, base + 8, 8), (a + 30000, a + 29000, 600), (a + 30600, a + 29600, 600)]
    assert stage.raw[:8] == b"AAAABBBB"
    assert drv.syncs == [(7, "stream@ctx0")] and acc.copies == 13


def test_a_copy_the_driver_refuses_names_itself_and_the_run_is_still_waited_for(drv: FakeDriver) -> None:
    """A run whose second copy the driver refuses raises CudaError naming that copy, after the stream's
    synchronize (the first copy, queued, may still read the staging buffer); empty copies queue nothing."""
    gpu = GpuMemory()
    region = gpu.open(HANDLE_A, 0, 1 << 20, device=0)
    gpu.accessor(0)
    drv.fail_copy, drv.copy_error = 2, FakeResult.CUDA_ERROR_ILLEGAL_ADDRESS
    with pytest.raises(CudaError, match=r"cuMemcpyAsync \(copy 1 of a run\) failed: CUDA_ERROR_ILLEGAL_ADDRESS"):
        gpu.copy_many([(region.addr, 0x1234_0000, 64), (region.addr + 64, 0, 0),
                       (region.addr + 128, 0x1234_0040, 64), (region.addr + 192, 0x1234_0080, 64)])
    assert [d for d, *_ in drv.copies] == [region.addr, region.addr + 128]
    assert drv.syncs == [(2, "stream@ctx0")]


@pytest.mark.parametrize("copies, error", [
    ([(0x7000_0000, 0x1234_0000)], "each copy is"),
    ([(0x7000_0000, memoryview(b"flag"), 8)], "has 4 host bytes, not 8"),
    ([(0x7000_0000, "not an address", 8)], "bytes-like"),
])
def test_a_malformed_run_is_refused_before_anything_is_queued(drv: FakeDriver, copies: list[Any],
                                                               error: str) -> None:
    gpu = GpuMemory()
    gpu.open(HANDLE_A, 0, 1 << 20, device=0)
    with pytest.raises((TypeError, ValueError), match=error):
        gpu.accessor(0).copy_many([(0x7000_0040, 0x1234_0000, 8), *copies])
    assert drv.copies == [] and drv.syncs == []


def test_via_host_a_gpu_to_gpu_copy_goes_down_and_up_through_the_staging_slots_in_order(
        drv: FakeDriver, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gpu_memory, "STAGE_CHUNK", STAGE_CHUNK)  # small: several chunks fit the 1 MiB buffer
    gpu = GpuMemory(via="host")
    region = gpu.open(HANDLE_A, 0, 1 << 20, device=0)
    gpu.accessor(0)
    src, _ = gpu.open_export(_descriptor(HANDLE_PEER, 0x10))  # the peer's buffer, on GPU 0 too
    chunks = STAGE_SLOTS + 2
    length = chunks * STAGE_CHUNK - 100  # the last chunk short
    gpu.copy(region.addr, src, length)
    stage = 0x5000_0000
    assert drv.pinned == [RUN_STAGE, STAGE_SLOTS * STAGE_CHUNK] and drv.copies == []  # a run's, then these
    moves = [c for c in drv.staged if c[0] in ("down", "up")]
    expected = []
    for i in range(chunks):
        n = min(STAGE_CHUNK, length - i * STAGE_CHUNK)
        slot = stage + (i % STAGE_SLOTS) * STAGE_CHUNK
        expected += [("down", slot, src + i * STAGE_CHUNK, n, "stream@ctx0"),
                     ("up", region.addr + i * STAGE_CHUNK, slot, n, "stream@ctx0#2")]
    assert moves == expected
    # each chunk's up waits for its down; a slot is filled again only after its last chunk went up
    for i, step in enumerate(c for c in drv.staged if c[0] == "down"):
        at = drv.staged.index(step)
        filled = drv.staged[at + 1]
        assert filled[0] == "record" and drv.staged[at + 2] == ("wait", "stream@ctx0#2", filled[1])
        if i >= STAGE_SLOTS:
            drained = drv.staged[drv.staged.index(expected[2 * (i - STAGE_SLOTS) + 1]) + 1]
            assert drained[0] == "record" and drv.staged[at - 1] == ("wait", "stream@ctx0", drained[1])
    assert gpu.accessors[0].copies == 1
    gpu.copy(0x1234_0000, src, 8)  # into host memory: one copy, the copy engines' already
    assert [(d, s, n) for d, s, n, _ in drv.copies] == [(0x1234_0000, src, 8)]
    gpu.shutdown()
    assert ("free_host", stage) in drv.staged


def test_posted_words_are_copied_in_runs_from_a_pinned_ring_without_waiting(
        drv: FakeDriver, monkeypatch: pytest.MonkeyPatch) -> None:
    """post_words stages each value in the pinned ring, copies each run of adjacent words once on the word
    stream and records the batch's event; nothing waits until the ring wraps onto a batch not yet copied,
    and then it waits for that batch's event (and no later one)."""
    ring = (ctypes.c_uint64 * 16)()
    monkeypatch.setattr(gpu_memory, "WORD_RING", 16)
    def pin(size: int, flags: int) -> tuple[int, int]:
        drv.pinned.append(size)
        return 0, ctypes.addressof(ring)

    monkeypatch.setattr(drv, "cuMemHostAlloc", pin)
    acc = GpuMemory().accessor(0)
    with pytest.raises(RuntimeError, match="open_word_ring"):
        acc.post_words([(0x7000_0000, 1)])
    acc.open_word_ring()
    acc.open_word_ring()
    assert drv.pinned == [RUN_STAGE, 8 * 16]  # the accessor's run staging, then the ring
    base = ctypes.addressof(ring)
    first = acc.post_words([(0x7000_0000, 5), (0x7000_0008, 6), (0x7000_0040, 7)])
    ups = [c for c in drv.staged if c[0] == "up"]
    assert ups == [("up", 0x7000_0000, base, 16, "stream@ctx0#2"), ("up", 0x7000_0040, base + 16, 8, "stream@ctx0#2")]
    assert list(ring[:3]) == [5, 6, 7] and drv.staged[-1] == ("record", "event1", "stream@ctx0#2")
    assert not acc.landed(first)
    second = acc.post_words([(0x7000_0100 + 8 * i, i) for i in range(12)])  # fills the ring to its end
    assert not any(c[0] == "sync" for c in drv.staged)
    third = acc.post_words([(0x7000_0200, 9)] * 2)  # wraps onto the first batch: waits for it alone
    assert [c for c in drv.staged if c[0] == "sync"] == [("sync", "event1")] and list(ring[:2]) == [9, 9]
    assert drv.staged[-1] == ("record", "event1", "stream@ctx0#2")  # the first batch's event, used again
    assert first < second < third and acc.landed(first) and not acc.landed(second) and not acc.landed(third)
    drv.done.add("event1")  # the third batch ran
    assert acc.landed(third) and acc.landed(second)  # batches land in order: the third retires the second
    assert acc.words_posted == 17
    with pytest.raises(ValueError, match="at least one"):
        acc.post_words([])
    last = acc.post_words([(0x7000_1000 + 8 * i, 100 + i) for i in range(20)])  # more than the ring: two batches
    assert last == third + 2 and acc.words_posted == 37
    assert [c[3] for c in drv.staged if c[0] == "up"][-2:] == [8 * 16, 8 * 4]


def test_an_unknown_placement_is_refused() -> None:
    with pytest.raises(ValueError, match="device.*host.*not 'sm'"):
        GpuMemory(via="sm")
