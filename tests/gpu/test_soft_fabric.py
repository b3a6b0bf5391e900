"""The soft fabric on a GPU: 4 MiB GPU -> GPU writes between two daemons placed by direct copies, a flag
that never shows before its data, and softverbs' ordering trials with GPU buffers.

- Two daemons (ib and efa), ranks 0 and 1 in this process on GPU 0 with GPU buffers registered by CUDA
  IPC: 4 MiB PUTs arrive intact, and the receiving worker placed every write after the first by one copy
  from rank 0's buffer (its softverbs counters say so); PUT_SIGNALs: once the receiver's flag (host or
  device words) counts a launch's chunks, every byte of them is there, three launches without a reset.
- In one process, softverbs pairs over GPU memory (``CudaDeviceMemory``: cuMemAlloc behind a GpuAccessor,
  placement by cuMemcpyAsync): the adaptive-routing hazards and safeties of tests/softverbs/
  test_adaptive_routing.py, and the SRD completion rule and the RC run of direct writes with a flag write in
  it of tests/softverbs/test_direct.py, hold as on host memory.
- Each of those runs with both placements of a GPU-to-GPU copy (``softverbs.direct_copy_via``: one
  device-to-device copy, or through pinned host memory), and the copy through host memory completes while
  spinning kernels hold every SM (the reason it exists: a device-to-device copy does not).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.support.rank_process import SLOW_START

CHUNK = 4 << 20
SLOTS = 4
VIAS = ["device", "host"]  # softverbs.direct_copy_via


def _ranks(cluster: Any, where: str = "host") -> tuple[Any, ...]:
    import gpuclient
    from gpuclient.cuda_memory import DeviceMemory

    c0, c1 = (gpuclient.connect(cluster.socket(name), timeout=60) for name in cluster.names)
    s0 = c0.join("fabric", rank=0, world=2, device=0)
    s1 = c1.join("fabric", rank=1, world=2, device=0)
    src, dst = DeviceMemory(SLOTS * CHUNK, 0), DeviceMemory(SLOTS * CHUNK, 0)
    r_src, r_dst = s0.register(src), s1.register(dst)
    s0.flags(8, where=where)
    s1.flags(8, where=where)
    gpuclient.exchange_all([s0, s1], timeout=60)
    return c0, c1, s0, s1, src, dst, r_src, r_dst, s0.channel(256)


def _close(c0: Any, c1: Any, s0: Any, s1: Any, src: Any, dst: Any) -> None:
    for s, c in ((s0, c0), (s1, c1)):
        s.leave()
        c.close()
    src.free()
    dst.free()


def _soft(client: Any) -> dict[str, Any]:
    return client.stats()["rails"][0]["softverbs"]


def _direct(via: str) -> dict[str, Any]:
    return {**SLOW_START, "softverbs": {"direct_copy": True, "direct_copy_via": via}}


@pytest.mark.parametrize("via", VIAS)
@pytest.mark.parametrize("backend", ["ib", "efa"])
def test_4mib_gpu_writes_between_two_daemons_arrive_by_direct_copy(cuda_device, cluster_factory,
                                                                    backend: str, via: str) -> None:
    cluster = cluster_factory(backend=backend, overrides=_direct(via))
    c0, c1, s0, s1, src, dst, r_src, r_dst, ch = _ranks(cluster)
    try:
        rng = np.random.default_rng(5)
        for round_ in range(2):
            image = rng.integers(0, 256, SLOTS * CHUNK, dtype=np.uint8).tobytes()
            src.write(0, image)
            for k in range(SLOTS):
                ch.put(1, r_dst.id, k * CHUNK, r_src.id, k * CHUNK, CHUNK)
            ch.quiet(timeout=60)
            assert dst.read(0, SLOTS * CHUNK) == image, f"round {round_}: the receiver's buffer differs"
        stats = _soft(c1)
        assert stats["imports_opened"] >= 1, stats
        # the first round's writes may cross the wire while the receiver opens rank 0's allocation (those
        # posted before its answer came back); the second round's all go by copy: one per write on ib (RC in
        # order places a write whole), one per 1 MiB packet of the reorder model on efa
        per_copy = CHUNK if backend == "ib" else 1 << 20
        assert SLOTS * CHUNK <= stats["direct_bytes"] <= (2 * SLOTS - 1) * CHUNK, stats
        assert stats["direct_placed"] * per_copy == stats["direct_bytes"], stats
    except BaseException:
        for name in cluster.names:
            print(f"--- {name} log ---\n{cluster.log(name)}")
        raise
    finally:
        _close(c0, c1, s0, s1, src, dst)


@pytest.mark.parametrize("via", VIAS)
@pytest.mark.parametrize("where", ["host", "device"])
@pytest.mark.parametrize("backend", ["ib", "efa"])
def test_put_signal_the_flag_counts_chunks_whose_bytes_are_all_there(cuda_device, cluster_factory, backend: str,
                                                                     where: str, via: str) -> None:
    cluster = cluster_factory(backend=backend, overrides=_direct(via))
    c0, c1, s0, s1, src, dst, r_src, r_dst, ch = _ranks(cluster, where)
    try:
        rng = np.random.default_rng(6)
        for epoch in (1, 2, 3):  # monotonic flags: no reset between launches
            image = rng.integers(0, 256, SLOTS * CHUNK, dtype=np.uint8).tobytes()
            src.write(0, image)
            for k in range(SLOTS):
                ch.put_signal(1, r_dst.id, k * CHUNK, r_src.id, k * CHUNK, CHUNK, slot=0, value=1)
            s1.wait(0, SLOTS * epoch, timeout=60)
            assert dst.read(0, SLOTS * CHUNK) == image, f"epoch {epoch}: the flag came before the data"
            ch.quiet(timeout=60)  # the sender's source may change only once its writes completed
        assert _soft(c1)["direct_placed"] > 0
    except BaseException:
        for name in cluster.names:
            print(f"--- {name} log ---\n{cluster.log(name)}")
        raise
    finally:
        _close(c0, c1, s0, s1, src, dst)


# --- softverbs' ordering trials on GPU memory (one process) ---------------------------------------------------
@pytest.fixture(params=VIAS)
def gpu_memory(cuda_device: int, request: pytest.FixtureRequest) -> Any:
    from tests.support.device_memory import CudaDeviceMemory

    with CudaDeviceMemory(cuda_device, via=request.param) as memory:
        yield memory


@pytest.fixture
def gpu_ar_pair(gpu_memory: Any) -> Any:
    from tests.softverbs.test_adaptive_routing import ar_pair_on

    yield from ar_pair_on(gpu_memory)


@pytest.mark.parametrize("mode", ["write", "fence"])
def test_gpu_write_and_fence_signaling_can_expose_the_flag_first_under_ar(gpu_ar_pair, mode: str) -> None:
    from tests.softverbs.test_adaptive_routing import _hazards

    pair, log = gpu_ar_pair
    assert _hazards(pair, log, mode, adaptive=True) >= 1


@pytest.mark.parametrize("mode", ["atomic", "read+fence"])
def test_gpu_atomic_and_read_fence_signaling_never_do(gpu_ar_pair, mode: str) -> None:
    from tests.softverbs.test_adaptive_routing import _hazards

    pair, log = gpu_ar_pair
    assert _hazards(pair, log, mode, adaptive=True) == 0


@pytest.mark.parametrize("mode", ["write", "fence", "atomic"])
def test_gpu_in_order_rc_is_safe_for_every_scheme(gpu_ar_pair, mode: str) -> None:
    from tests.softverbs.test_adaptive_routing import _hazards

    pair, log = gpu_ar_pair
    assert _hazards(pair, log, mode, adaptive=False) == 0


@pytest.mark.parametrize("packets", [{"packet_size": 512}, {"direct_packet_size": 1024}], ids=["packet", "direct"])
def test_gpu_srd_write_imm_completes_after_all_its_packets_in_any_order(gpu_memory, packets: dict) -> None:
    from tests.softverbs.test_direct import srd_write_imm_order

    order, stats = srd_write_imm_order(gpu_memory, **packets)
    assert sorted(order) == list(range(48)) and order != sorted(order)
    assert stats["direct_sent"] == 48


def test_gpu_flag_write_joins_the_run_of_direct_writes_before_it(gpu_memory) -> None:
    """On GPU memory a wire write joins the run of direct writes before it (its bytes staged in pinned memory,
    one stream, one wait) and what follows still sees the run's bytes: tests/softverbs/test_direct.py's trial."""
    from softverbs import soft
    from tests.softverbs.test_direct import _agree, run_flag_run_atomic
    from tests.support.verbs_resources import open_provider

    with open_provider("soft").rc_pair(client_memory=gpu_memory, server_memory=gpu_memory) as pair:
        _agree(pair)
        soft.device_stats("softib0", reset=True)
        run_flag_run_atomic(pair)
        stats = soft.device_stats("softib0")
        assert stats["run_wire_writes"] == 1 and stats["direct_placed"] == 4


def test_a_copy_through_host_memory_completes_while_spinning_kernels_hold_every_sm(cuda_device) -> None:
    spec = importlib.util.spec_from_file_location(
        "copy_needs_sms", Path(__file__).resolve().parents[2] / "benchmarks" / "copy_needs_sms.py")
    bench = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = bench
    spec.loader.exec_module(bench)
    from gpuclient.cuda_memory import check, driver

    drv = driver()
    sms = int(check(drv.cuDeviceGetAttribute(drv.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
                                             cuda_device), "cuDeviceGetAttribute"))
    row = bench.probe(cuda_device, 2 * sms, "through_host", wait_ms=30_000.0)
    assert row["resident_blocks"] == 2 * sms, row  # every SM's thread slots held while it copied
    assert row["completed_ms"] is not None and row["bytes_checked"], row


def test_a_run_of_copies_lands_in_order_with_its_host_bytes_staged_or_not(cuda_device) -> None:
    """GpuAccessor.copy_many on the GPU (the compiled run: ``transportd._core.copy_run``): device-to-device
    copies, host bytes staged in pinned memory, host bytes too large for the stage copied from where they
    are, and a later piece over an earlier one's bytes, all in one run: what lands is what placing them one
    after another in the given order leaves."""
    from tests.support.device_memory import CudaDeviceMemory
    from transportd.dataplane.gpu_memory import RUN_STAGE

    rng = np.random.default_rng(7)
    size = 4 * RUN_STAGE
    with CudaDeviceMemory(cuda_device) as memory:
        src, dst = memory.allocate(size), memory.allocate(size)
        acc = memory.accessor
        source = rng.integers(0, 256, size, dtype=np.uint8)
        acc.write(src, memoryview(source.tobytes()))
        flag, big = b"FLAG0001", rng.integers(0, 256, RUN_STAGE + 100, dtype=np.uint8).tobytes()
        run = [(dst, src, 3 * RUN_STAGE), (dst + 64, memoryview(flag), 8), (dst + 4096, src + 8192, 0),
               (dst + RUN_STAGE, memoryview(big), len(big)), (dst + RUN_STAGE + 8, src, 8)]
        expected = np.zeros(size, dtype=np.uint8)
        for i in range(3):  # no reset between runs: each run over the last one's bytes
            acc.copy_many(run)
            expected[:3 * RUN_STAGE] = source[:3 * RUN_STAGE]
            expected[64:72] = np.frombuffer(flag, np.uint8)
            expected[RUN_STAGE:RUN_STAGE + len(big)] = np.frombuffer(big, np.uint8)
            expected[RUN_STAGE + 8:RUN_STAGE + 16] = source[:8]
            got = np.frombuffer(acc.read(dst, size), np.uint8)
            assert np.array_equal(got, expected), f"run {i}: first wrong byte at {np.flatnonzero(got != expected)[:1]}"
            flag = b"FLAG%04d" % (i + 2)
            run[1] = (dst + 64, memoryview(flag), 8)
        memory.free(src)
        memory.free(dst)
