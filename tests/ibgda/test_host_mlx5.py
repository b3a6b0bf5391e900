"""IBGDA on a real ConnectX (``-m hardware``): DevX queue pairs from ibgda.host_mlx5, driven by the device
code — first compiled for the host (the CPU builds WQEs, writes the doorbell record and rings the UAR,
polls the CQ: no GPU needed), then from a GPU kernel (also ``gpu``).

Run on a node with a ConnectX and rdma-core's pyverbs (with the mlx5 provider; docs/design.md, "pyverbs
from the node's rdma-core"):

    TPD_IBGDA_DEVICE=mlx5_0 pytest -m hardware tests/ibgda/test_host_mlx5.py

Both queue pairs sit on one device and connect to each other (loopback through the port), so one node
is enough. Skips, saying why, without pyverbs' mlx5 provider, a ConnectX, or (for the GPU test) CUDA.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from ibgda.channel_tables import HostAlloc, build_channel
from ibgda.device_handle import QP_STATE_DTYPE, SignalMode
from tests.support.cuda import gpu_unavailable
from tests.support.ibgda_link import GPU_KERNELS, NFLAGS, view

pytestmark = pytest.mark.hardware

BYTES = 1 << 20


def mlx5_device() -> str:
    try:
        from pyverbs import device
        from pyverbs.providers.mlx5 import mlx5dv  # noqa: F401
        from pyverbs.pyverbs_error import PyverbsError
    except ImportError as exc:
        pytest.skip(f"pyverbs with the mlx5 provider is not installed ({exc})")
    try:
        names = [d.name.decode() for d in device.get_device_list()]
    except PyverbsError:
        names = []
    wanted = os.environ.get("TPD_IBGDA_DEVICE")
    if wanted:
        if wanted not in names:
            pytest.skip(f"TPD_IBGDA_DEVICE={wanted} not found (devices: {names})")
        return wanted
    mlx5 = [n for n in names if n.startswith("mlx5")]
    if not mlx5:
        pytest.skip("No mlx5 (ConnectX) device found")
    return mlx5[0]


@pytest.fixture
def queues() -> Iterator[Any]:
    from ibgda.host_mlx5 import Mlx5Queue

    made: list[Any] = []

    def make(*, map_to_gpu: bool) -> tuple[Any, Any]:
        dev = mlx5_device()
        a = Mlx5Queue(dev, wqe_cnt=64, map_to_gpu=map_to_gpu)
        made.append(a)
        b = Mlx5Queue(dev, wqe_cnt=64, map_to_gpu=False)
        made.append(b)
        a.connect(b.endpoint())
        b.connect(a.endpoint())
        return a, b

    yield make
    for q in made:
        q.close()


class Buffers:
    """Source, scratch (on a's PD), destination and flags (on b's PD), registered."""

    def __init__(self, a: Any, b: Any) -> None:
        acc_local, acc_remote = 1, 1 | 2 | 4 | 8  # LOCAL_WRITE; + REMOTE_WRITE, REMOTE_READ, REMOTE_ATOMIC
        rng = np.random.default_rng(1)
        self.src = rng.integers(0, 256, BYTES, dtype=np.uint8)
        self.scratch = np.zeros(8, dtype=np.uint64)
        self.dst = np.zeros(BYTES, dtype=np.uint8)
        self.flags = np.zeros(NFLAGS, dtype=np.uint64)
        self.mr_src = a.register(self.src.ctypes.data, self.src.nbytes, acc_local)
        self.mr_scratch = a.register(self.scratch.ctypes.data, self.scratch.nbytes, acc_local)
        self.mr_dst = b.register(self.dst.ctypes.data, self.dst.nbytes, acc_remote)
        self.mr_flags = b.register(self.flags.ctypes.data, self.flags.nbytes, acc_remote)

    def channel(self, a: Any, mode: SignalMode, alloc: Any, flags_addr: int, *, for_gpu: bool) -> Any:
        return build_channel(
            rank=0, world=2, alloc=alloc, signal_mode=mode, flags=flags_addr, flag_count=NFLAGS,
            queue_pairs={1: a.queue_pair(self.scratch.ctypes.data, self.mr_scratch.lkey, for_gpu=for_gpu)},
            local_regions=[(self.src.ctypes.data, self.src.nbytes, self.mr_src.lkey)],
            remote_regions={1: [(self.dst.ctypes.data, self.dst.nbytes, self.mr_dst.rkey)]},
            remote_flags={1: (self.flags.ctypes.data, self.flags.nbytes, self.mr_flags.rkey)})


@pytest.mark.parametrize("mode", list(SignalMode))
def test_cpu_posts_to_a_connectx(queues, host_lib, mode: SignalMode) -> None:
    a, b = queues(map_to_gpu=False)
    bufs = Buffers(a, b)
    own = np.zeros(NFLAGS, dtype=np.uint64)
    tables = bufs.channel(a, mode, HostAlloc(), own.ctypes.data, for_gpu=False)
    ch = tables.record.ctypes.data
    host_lib.tpd_test_stress(ch, 1, 4, 64, 4096, 4)  # 4 threads x 64 put_signal + signal, 64-slot SQ
    assert host_lib.tpd_test_status(ch) == 0
    state = view(tables.qp_states[1], QP_STATE_DTYPE, 1)[0]
    assert int(state["posted"]) == int(state["done"]) and int(state["error"]) == 0
    assert [int(f) for f in bufs.flags[:5]] == [64] * 4 + [256]
    assert np.array_equal(bufs.dst[:4 * 64 * 4096], bufs.src[:4 * 64 * 4096])


def test_cpu_sees_a_remote_access_error(queues, host_lib) -> None:
    a, b = queues(map_to_gpu=False)
    bufs = Buffers(a, b)
    own = np.zeros(NFLAGS, dtype=np.uint64)
    tables = build_channel(
        rank=0, world=2, alloc=HostAlloc(), flags=own.ctypes.data, flag_count=NFLAGS,
        queue_pairs={1: a.queue_pair(bufs.scratch.ctypes.data, bufs.mr_scratch.lkey, for_gpu=False)},
        local_regions=[(bufs.src.ctypes.data, BYTES, bufs.mr_src.lkey)],
        remote_regions={1: [(bufs.dst.ctypes.data, BYTES, bufs.mr_dst.rkey ^ 0x5500)]},
        remote_flags={1: (bufs.flags.ctypes.data, bufs.flags.nbytes, bufs.mr_flags.rkey)})
    ch = tables.record.ctypes.data
    for i in range(100):  # past the 64-slot queue: later WQEs flush, nothing hangs
        host_lib.tpd_test_put(ch, 1, 0, 4096 * i, 0, 4096 * i, 4096)
    host_lib.tpd_test_quiet(ch)
    assert host_lib.tpd_test_status(ch) == 9  # REMOTE_ACCESS


@pytest.mark.gpu
def test_gpu_posts_to_a_connectx(queues) -> None:
    reason = gpu_unavailable()
    if reason:
        pytest.skip(reason)
    import gpuclient
    from gpuclient.cuda_memory import DeviceMemory, check, driver, use_device
    from ibgda.host_mlx5 import cuda_alloc

    use_device(0)
    module = gpuclient.compile(GPU_KERNELS.read_text(), device=0, debug=True,
                               defines={"TPD_SPIN_TIMEOUT_NS": "20000000000ull"}, name="gpu_kernels.cu")
    a, b = queues(map_to_gpu=True)
    bufs = Buffers(a, b)
    own = DeviceMemory(8 * NFLAGS, 0)
    keep: list[Any] = []
    tables = bufs.channel(a, SignalMode.ATOMIC, cuda_alloc(keep), own.ptr, for_gpu=True)
    blocks, threads, iters = 4, 64, 4
    module.function("ibgda_stress").launch(blocks, threads, (tables.record.tobytes(), np.uint32(1), np.int32(iters),
                                                             np.uint32(1024), np.uint32(4)))
    check(driver().cuCtxSynchronize(), "ibgda_stress on a ConnectX")
    per = blocks * threads * iters
    assert [int(f) for f in bufs.flags[:5]] == [per // 4] * 4 + [per]
    assert np.array_equal(bufs.dst[:per * 1024], bufs.src[:per * 1024])
    own.free()
