"""The IBGDA device path on a GPU (``-m gpu``): kernels post mlx5 WQEs into a soft NIC's send queue mapped
into the GPU, ring its doorbell, and poll its CQ; the soft NIC executes them on the soft wire. Same checks
as the host-compiled run (test_host_post.py), now with thousands of GPU threads contending for the QP.

Run on a CUDA machine: ``pytest -m gpu tests/ibgda/test_gpu_ibgda.py``. Kernels: gpu_kernels.cu (NVRTC,
debug build: every device spin traps after 20 s instead of hanging).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ibgda.channel_tables import build_channel
from ibgda.device_handle import SignalMode
from tests.support.cuda import gpu_unavailable
from tests.support.ibgda_link import DATA_BYTES, GPU_KERNELS, NFLAGS, Link

pytestmark = pytest.mark.gpu

DEBUG_DEFINES = {"TPD_SPIN_TIMEOUT_NS": "20000000000ull"}
ERR_BAD_REGION = 3
ERR_REMOTE_ACCESS = 9


@pytest.fixture(scope="module")
def gpu() -> Any:
    reason = gpu_unavailable()
    if reason:
        pytest.skip(reason)
    import gpuclient
    from gpuclient.cuda_memory import use_device

    use_device(0)
    return gpuclient.compile(GPU_KERNELS.read_text(), device=0, debug=True, defines=DEBUG_DEFINES,
                             name="gpu_kernels.cu")


class GpuChannel:
    """A tpd::IbgdaChannel for rank 0 of a soft link, with its tables in GPU memory."""

    def __init__(self, link: Link, mode: SignalMode, dst_rkey: int | None = None) -> None:
        from gpuclient.cuda_memory import DeviceMemory, map_host

        self.blocks: dict[int, Any] = {}
        self.mapping = map_host(link.a.mem.base, link.a.mem.nbytes, 0)
        base, dev = link.a.mem.base, self.mapping.device_ptr

        def alloc(image: bytes) -> int:
            mem = DeviceMemory(max(len(image), 8), 0)
            mem.write(0, image)
            self.blocks[mem.ptr] = mem
            return mem.ptr

        self.own_flags = DeviceMemory(8 * NFLAGS, 0)
        qp = link.a.queue_pair(0, link.scratch.ctypes.data, link.mr_scratch.lkey,
                               translate=lambda a: dev + (a - base))
        self.tables = build_channel(
            rank=0, world=2, alloc=alloc, signal_mode=mode, flags=self.own_flags.ptr, flag_count=NFLAGS,
            queue_pairs={1: qp}, local_regions=[(link.src.ctypes.data, link.src.nbytes, link.mr_src.lkey)],
            remote_regions={1: [(link.dst.ctypes.data, link.dst.nbytes,
                                 link.mr_dst.rkey if dst_rkey is None else dst_rkey)]},
            remote_flags={1: (link.flags.ctypes.data, link.flags.nbytes, link.mr_flags.rkey)})
        self.arg = self.tables.record.tobytes()

    def error(self) -> tuple[int, int]:
        words = np.frombuffer(self.blocks[self.tables.error].read(0, 8), dtype=np.uint32)
        return int(words[0]), int(words[1])

    def state(self) -> dict[str, int]:
        from ibgda.device_handle import QP_STATE_DTYPE

        raw = self.blocks[self.tables.qp_states[1]].read(0, QP_STATE_DTYPE.itemsize)
        s = np.frombuffer(raw, dtype=QP_STATE_DTYPE)[0]
        return {k: int(s[k]) for k in ("claimed", "posted", "done", "cq_ci", "error")}

    def state_word(self, name: str) -> int:
        from ibgda.device_handle import QP_STATE_DTYPE

        raw = self.blocks[self.tables.qp_states[1]].read(0, QP_STATE_DTYPE.itemsize)
        return int(np.frombuffer(raw, dtype=QP_STATE_DTYPE)[0][name])

    def close(self) -> None:
        for mem in self.blocks.values():
            mem.free()
        self.own_flags.free()
        self.mapping.unmap()


@pytest.fixture
def gpu_channel() -> Iterator[Any]:
    made: list[GpuChannel] = []

    def make(link: Link, mode: SignalMode, dst_rkey: int | None = None) -> GpuChannel:
        made.append(GpuChannel(link, mode, dst_rkey))
        return made[-1]

    yield make
    for ch in made:
        ch.close()


def sync() -> None:
    from gpuclient.cuda_memory import check, driver

    check(driver().cuCtxSynchronize(), "cuCtxSynchronize (a trap here: a device spin timed out)")


@pytest.mark.parametrize(("mode", "adaptive_routing"), [
    (SignalMode.WRITE, False), (SignalMode.ATOMIC, False), (SignalMode.FENCE, False),
    (SignalMode.ATOMIC, True), (SignalMode.FENCE, True)])
def test_gpu_threads_post_put_signal(gpu, make_link, gpu_channel, mode: SignalMode, adaptive_routing: bool) -> None:
    link = make_link(adaptive_routing=adaptive_routing, seed=4, packet_size=1024 if adaptive_routing else None,
                     wqe_cnt=64)
    ch = gpu_channel(link, mode)
    blocks, threads, iters, nbytes, slots = 4, 32, 4, 1024, 4
    assert blocks * threads * iters * nbytes <= DATA_BYTES
    gpu.function("ibgda_stress").launch(blocks, threads, (ch.arg, np.uint32(1), np.int32(iters), np.uint32(nbytes),
                                                          np.uint32(slots)))
    sync()
    assert ch.error() == (0, 0), link.a.errors
    s = ch.state()
    assert s["claimed"] == s["posted"] == s["done"] and s["error"] == 0
    per = blocks * threads * iters
    assert [int(f) for f in link.flags[:slots + 1]] == [per // slots] * slots + [per]
    assert np.array_equal(link.dst[:per * nbytes], link.src[:per * nbytes])
    assert link.a.violations == [] and link.a.errors == []


def test_gpu_fence_then_set(gpu, make_link, gpu_channel) -> None:
    from gpuclient.cuda_memory import DeviceMemory

    link = make_link(adaptive_routing=True, seed=2, packet_size=512)
    ch = gpu_channel(link, SignalMode.WRITE)
    out = DeviceMemory(8, 0)
    gpu.function("ibgda_put_fence_set").launch(1, 1, (ch.arg, np.uint32(1), np.uint32(256 << 10), np.uint32(5),
                                                      np.uint64(77), np.uint64(out.ptr)))
    sync()
    assert tuple(np.frombuffer(out.read(0, 8), dtype=np.uint32)) == (0, 0)
    assert int(link.flags[5]) == 77 and np.array_equal(link.dst[:256 << 10], link.src[:256 << 10])
    out.free()


def test_gpu_bad_command_is_refused(gpu, make_link, gpu_channel) -> None:
    from gpuclient.cuda_memory import DeviceMemory

    link = make_link()
    ch = gpu_channel(link, SignalMode.ATOMIC)
    out = DeviceMemory(8, 0)
    gpu.function("ibgda_bad_then_good").launch(1, 1, (ch.arg, np.uint32(1), np.uint64(out.ptr)))
    sync()
    assert tuple(np.frombuffer(out.read(0, 8), dtype=np.uint32)) == (ERR_BAD_REGION, 1)
    assert np.array_equal(link.dst[:64], link.src[:64])
    out.free()


def test_gpu_error_completion_reaches_tpd_status(gpu, make_link, gpu_channel) -> None:
    """A WQE the responder refuses (a wrong rkey): the soft NIC writes an error CQE, the kernel's quiet
    polls it, and tpd::status reads REMOTE_ACCESS; the QP is in error, as on a ConnectX."""
    from gpuclient.cuda_memory import DeviceMemory

    link = make_link(seed=6)
    ch = gpu_channel(link, SignalMode.ATOMIC, dst_rkey=link.mr_dst.rkey ^ 0x777700)
    out = DeviceMemory(8, 0)
    gpu.function("ibgda_put_fence_set").launch(1, 1, (ch.arg, np.uint32(1), np.uint32(4096), np.uint32(2),
                                                      np.uint64(5), np.uint64(out.ptr)))
    sync()
    code, count = np.frombuffer(out.read(0, 8), dtype=np.uint32)
    assert code == ERR_REMOTE_ACCESS and count >= 1
    assert ch.error()[0] == ERR_REMOTE_ACCESS and ch.state()["error"] != 0
    assert int(link.flags[2]) == 0  # nothing after the refused write was placed
    out.free()


def wqes_per_cmd(put: bool, is_set: bool, mode: SignalMode) -> int:
    """WQEs one put / put_signal posts (channel.cuh's table)."""
    if put:
        return 1
    return 3 if mode == SignalMode.FENCE or (mode == SignalMode.ATOMIC and is_set) else 2


def claims(sizes: list[int], cap: int) -> int:
    """Claims (and doorbells) a warp call takes for lanes posting ``sizes`` WQEs (warp.cuh: by offset // cap)."""
    offs = [sum(sizes[:i]) for i, n in enumerate(sizes) if n]
    return offs[-1] // cap + 1 if offs else 0


@pytest.mark.parametrize(("mode", "adaptive_routing"), [
    (SignalMode.WRITE, False), (SignalMode.ATOMIC, False), (SignalMode.FENCE, False),
    (SignalMode.ATOMIC, True), (SignalMode.FENCE, True)])
def test_gpu_warps_post_aggregated(gpu, make_link, gpu_channel, mode: SignalMode, adaptive_routing: bool) -> None:
    """8 warps x 4 rounds of warp_put (odd lanes) and warp_put_signal (all lanes) through a 64-slot queue:
    every byte lands, inactive lanes post nothing, flags count every put_signal, and the QP rang once per
    claim (a warp call of 32 put_signals is cut in claims of group_cap = 32 WQEBBs) plus quiet's probes."""
    link = make_link(adaptive_routing=adaptive_routing, seed=5, packet_size=1024 if adaptive_routing else None,
                     wqe_cnt=64)
    ch = gpu_channel(link, mode)
    blocks, threads, iters, nbytes, slots = 4, 64, 4, 512, 4
    half = blocks * threads * iters * nbytes
    assert 2 * half <= DATA_BYTES
    gpu.function("ibgda_warp_stress").launch(blocks, threads, (ch.arg, np.uint32(1), np.int32(iters),
                                                               np.uint32(nbytes), np.uint32(slots), np.uint64(half)))
    sync()
    assert ch.error() == (0, 0), link.a.errors
    s = ch.state()
    assert s["claimed"] == s["posted"] == s["done"] and s["error"] == 0
    per = blocks * threads * iters
    assert [int(f) for f in link.flags[:slots]] == [per // slots] * slots
    assert np.array_equal(link.dst[half:2 * half], link.src[half:2 * half])
    for t in range(blocks * threads):
        lo, hi = t * iters * nbytes, (t + 1) * iters * nbytes
        if t % 2:
            assert np.array_equal(link.dst[lo:hi], link.src[lo:hi]), f"thread {t}'s warp_put"
        else:
            assert not link.dst[lo:hi].any(), f"thread {t} was inactive in warp_put but its range was written"
    k = wqes_per_cmd(False, False, mode)
    calls = blocks * threads // 32 * iters
    wqes = calls * (16 + 32 * k)
    rings = calls * (claims([1] * 16, 32) + claims([k] * 32, 32))
    probes = s["posted"] - wqes
    assert 0 <= probes <= blocks, "only quiet's probes come on top of the warps' WQEs"
    assert ch.state_word("rings") == rings + probes, "one doorbell per claim"
    assert link.a.violations == [] and link.a.errors == []


class BareGpuQueues:
    """A tpd::IbgdaChannel for rank 0 of 3 whose QPs to ranks 1 and 2 nobody executes: queues in host memory
    mapped into the GPU (posting stores WQEs and rings, nothing more), tables in GPU memory."""

    def __init__(self, mode: SignalMode, wqe_cnt: int) -> None:
        from gpuclient.cuda_memory import DeviceMemory, map_host
        from ibgda.device_handle import queue_pair_record
        from ibgda.queue_memory import QueueMemory

        self.blocks: dict[int, Any] = {}

        def alloc(image: bytes) -> int:
            mem = DeviceMemory(max(len(image), 8), 0)
            mem.write(0, image)
            self.blocks[mem.ptr] = mem
            return mem.ptr

        self.mems = {r: QueueMemory(wqe_cnt, wqe_cnt, with_uar_page=True) for r in (1, 2)}
        self.maps = {r: map_host(m.base, m.nbytes, 0) for r, m in self.mems.items()}
        qps = {r: queue_pair_record({k: self.maps[r].device_ptr + (a - m.base) for k, a in m.addresses().items()},
                                    qpn=0x100 + r, wqe_cnt=wqe_cnt, ncqes=wqe_cnt, scratch=0x1000, scratch_lkey=5)
               for r, m in self.mems.items()}
        self.own_flags = DeviceMemory(8 * NFLAGS, 0)
        self.tables = build_channel(
            rank=0, world=3, alloc=alloc, signal_mode=mode, flags=self.own_flags.ptr, flag_count=NFLAGS,
            queue_pairs=qps, local_regions=[(0x10000, 1 << 30, 0x11)],
            remote_regions={r: [(0x20000 * r, 1 << 30, 0x22 + r)] for r in (1, 2)},
            remote_flags={r: (0x40000 * r, 8 * NFLAGS, 0x33 + r) for r in (1, 2)})
        self.arg = self.tables.record.tobytes()

    def state(self, peer: int) -> dict[str, int]:
        from ibgda.device_handle import QP_STATE_DTYPE

        raw = self.blocks[self.tables.qp_states[peer]].read(0, QP_STATE_DTYPE.itemsize)
        s = np.frombuffer(raw, dtype=QP_STATE_DTYPE)[0]
        return {k: int(s[k]) for k in ("claimed", "posted", "signaled", "fence_next", "rings", "done")}

    def words(self, addr: int, nbytes: int, dtype: type) -> list[int]:
        return [int(x) for x in np.frombuffer(self.blocks[addr].read(0, nbytes), dtype=dtype)]

    def close(self) -> None:
        for mem in self.blocks.values():
            mem.free()
        self.own_flags.free()
        for m in self.maps.values():
            m.unmap()


def lane_table(active: int, two_peers: bool, mode: SignalMode) -> list[tuple[int, int]]:
    """gpu_kernels.cu's lane_cmd: (peer, WQEs) of each lane's command (0 WQEs: inactive or refused)."""
    out = []
    for lane in range(32):
        put, peer, refused = lane % 3 == 2, 1 + (lane & 1) if two_peers else 1, lane == 9
        on = bool(active >> lane & 1) and not refused
        out.append((peer, wqes_per_cmd(put, lane % 5 == 4, mode) if on else 0))
    return out


@pytest.mark.parametrize("mode", list(SignalMode))
@pytest.mark.parametrize(("active", "two_peers", "fence_first"), [
    (0xFFFFFFFF, False, False), (0xFFFFFFFF, False, True), (0x8F0F_3A21, False, False),
    (0xFFFFFFFF, True, False), (0x0000_0004, True, True)],
    ids=["full", "full-fenced", "sparse", "two-peers", "one-lane-fenced"])
def test_gpu_warp_stores_what_single_posts_store(gpu, mode: SignalMode, active: int, two_peers: bool,
                                                 fence_first: bool) -> None:
    """One warp's warp_put call then its warp_put_signal call (lanes off, lane 9 refused, lanes to two peers, a
    pending fence) against one thread posting the same commands with put / put_signal in that order: the
    same WQE bytes
    in each queue, the same doorbell record, doorbell, shadow counters and error words; one doorbell per
    claim instead of one per command; every lane told its WQEBB index."""
    from gpuclient.cuda_memory import DeviceMemory

    wqe_cnt = 128  # 32 lanes x 3 WQEs + a fence fit without a NIC; group_cap 64 cuts fence-mode warps in two
    warp, single = BareGpuQueues(mode, wqe_cnt), BareGpuQueues(mode, wqe_cnt)
    out = DeviceMemory(8 * 32, 0)
    try:
        gpu.function("ibgda_lanes_warp").launch(1, 32, (warp.arg, np.uint32(active), np.int32(two_peers),
                                                        np.int32(fence_first), np.uint64(out.ptr)))
        gpu.function("ibgda_lanes_single").launch(1, 1, (single.arg, np.uint32(active), np.int32(two_peers),
                                                          np.int32(fence_first)))
        sync()
        table = lane_table(active, two_peers, mode)
        first_of = [int(x) for x in np.frombuffer(out.read(0, 8 * 32), dtype=np.uint64)]
        for peer in (1, 2):
            fence = 1 if fence_first and peer == 1 else 0
            # the warp makes two calls, its puts (lanes 2, 5, 8, ...) then its put_signals, each in lane order
            calls = [[n if p == peer and (lane % 3 == 2) == put else 0 for lane, (p, n) in enumerate(table)]
                     for put in (True, False)]
            total = fence + sum(map(sum, calls))
            w, s = warp.state(peer), single.state(peer)
            differ = np.flatnonzero(warp.mems[peer].sq != single.mems[peer].sq)
            assert not differ.size, (f"peer {peer}: other WQE bytes from WQEBB {differ[0] // 64} on: warp "
                                     f"{warp.mems[peer].sq[differ[0] // 64 * 64:][:64].tobytes().hex()} single "
                                     f"{single.mems[peer].sq[differ[0] // 64 * 64:][:64].tobytes().hex()}")
            assert warp.mems[peer].dbrec[1] == single.mems[peer].dbrec[1]
            assert int(warp.mems[peer].doorbell[0]) == int(single.mems[peer].doorbell[0])
            assert w["posted"] == w["claimed"] == s["posted"] == total
            assert (w["signaled"], w["fence_next"]) == (s["signaled"], s["fence_next"])
            assert w["rings"] == fence + sum(claims(sizes, wqe_cnt // 2) for sizes in calls)
            assert s["rings"] == fence + sum(1 for sizes in calls for n in sizes if n)
            at = fence
            for sizes in calls:
                for lane, n in enumerate(sizes):
                    if table[lane][0] == peer and n:
                        assert first_of[lane] == at, f"lane {lane}"
                    at += n
            for lane, (p, n) in enumerate(table):
                if p == peer and not n:
                    assert first_of[lane] == 2**64 - 1, f"lane {lane} posted nothing"
        shadow_bytes = 8 * 3 * NFLAGS
        assert warp.words(warp.tables.shadow, shadow_bytes, np.uint64) == \
            single.words(single.tables.shadow, shadow_bytes, np.uint64)
        errors = warp.words(warp.tables.error, 8, np.uint32)
        assert errors == single.words(single.tables.error, 8, np.uint32)
        assert errors == ([5, 1] if active >> 9 & 1 else [0, 0])  # lane 9: BAD_LENGTH
    finally:
        out.free()
        warp.close()
        single.close()


def test_benchmark_smoke(gpu) -> None:
    """benchmarks/ibgda_bench.py --quick: the kernels run against the null NIC and report numbers."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("ibgda_bench", Path(__file__).parents[2] / "benchmarks" /
                                                  "ibgda_bench.py")
    assert spec and spec.loader
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    results = bench.run(quick=True, echo=lambda *_: None)
    assert all(v > 0 for v in results["summary"].values())
    assert results["single"]["put/write"]["wqes"] in (200, 201)  # + quiet's probe when needed
    # one lane of a warp call posts alone: one doorbell per op; 32 lanes: one per warp call
    assert results["warp"]["warp_put/write"]["doorbells"] in (50, 51)
    assert results["warp"]["put/write"]["doorbells"] in (50 * 32, 50 * 32 + 1)
    assert results["many"]["warp_put/write"]["doorbells"] < results["many"]["put/write"]["doorbells"]
