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
