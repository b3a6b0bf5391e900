"""What every part of ``gpu_bench.py`` stands on: the GPU handle (``Gpu``: ``gpu_push.cu`` compiled for the
device, a stream, the SM count), the commit variants the kernels are built in and the library's default among
them, the benchmark's own ring files (``ring_file``), and two things more than one section uses:

- ``calibrate``: the GPU's %globaltimer mapped onto CLOCK_MONOTONIC by a ping-pong through mapped host memory
  (the tightest of 200 round trips; its half-width bounds the error), for the latency rows and for
  ``fused_bench.py --trace`` (``fused_timeline.py``);
- ``null_nic_proxy``: the compiled engine as its own null NIC, which the latency rows and the sweep drain.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import numpy as np

import gpuclient
from cmd_ring import RingFile
from gpuclient.cuda_memory import check, driver, map_host, use_device

KERNELS = Path(__file__).with_name("gpu_push.cu")
HEADER_LAST = ("release_sys", "fence_sys", "v2_release", "v2_split")
PARITY = ("parity", "parity_v2", "parity_fenced")  # parity_fenced: a system-scope fence first (gpu_push.cu)
DEFAULT_VARIANT = {0: "release_sys", 1: "fence_sys", 2: "v2_release", 3: "v2_split"}


def percentile(values: np.ndarray, q: float) -> float:
    """The ``q``-th percentile (0-100) of ``values``; NaN for none (a row that measured nothing)."""
    return float(np.percentile(values, q)) if len(values) else float("nan")


class Gpu:
    def __init__(self, device: int = 0) -> None:
        self.device = device
        use_device(device)
        self.drv = driver()
        self.module = gpuclient.compile(KERNELS.read_text(), device=device, name="gpu_push.cu")
        self._ibgda_module: Any = None
        self.stream = check(self.drv.cuStreamCreate(self.drv.CUstream_flags.CU_STREAM_NON_BLOCKING), "stream")
        self.sms = int(check(self.drv.cuDeviceGetAttribute(
            self.drv.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, device)))

    def module_for(self, kind: str) -> Any:
        """The kernels for a channel kind: as built, or with -DTPD_IBGDA for "ibgda"."""
        if kind == "ring":
            return self.module
        if self._ibgda_module is None:
            self._ibgda_module = gpuclient.compile(KERNELS.read_text(), device=self.device, name="gpu_push.cu",
                                                   defines={"TPD_IBGDA": 1})
        return self._ibgda_module

    def sync(self, stream: Any = None) -> None:
        check(self.drv.cuStreamSynchronize(self.stream if stream is None else stream), "cuStreamSynchronize")

    def timed(self, kernel: str, grid: int, block: int, args: tuple) -> float:
        """Seconds between CUDA events around one launch."""
        drv = self.drv
        start, end = (check(drv.cuEventCreate(0), "cuEventCreate") for _ in range(2))
        check(drv.cuEventRecord(start, self.stream), "cuEventRecord")
        self.module.function(kernel).launch(grid, block, args, stream=self.stream)
        check(drv.cuEventRecord(end, self.stream), "cuEventRecord")
        check(drv.cuEventSynchronize(end), "cuEventSynchronize")
        ms = check(drv.cuEventElapsedTime(start, end), "cuEventElapsedTime")
        drv.cuEventDestroy(start)
        drv.cuEventDestroy(end)
        return float(ms) / 1e3


def ring_file(tag: str, capacity: int) -> RingFile:
    """A fresh command ring file of ``capacity`` slots, named for ``tag`` and unique to this process and moment."""
    return RingFile.create(f"tpd-gpubench-{tag}-{os.getpid()}-{time.monotonic_ns() % 10**9}", capacity)


# --- clocks -----------------------------------------------------------------------------------------------------
def calibrate(gpu: Gpu, rounds: int = 200) -> dict[str, float]:
    """Offset of the GPU global timer against CLOCK_MONOTONIC: gpu_ns - offset = monotonic ns."""
    words = gpuclient.host_array(512, np.uint64)
    mapping = map_host(int(words.ctypes.data), words.nbytes, gpu.device)
    ping, pong = mapping.device_ptr, mapping.device_ptr + 64
    try:
        gpu.module.function("clock_pingpong").launch(1, 1, (np.uint64(ping), np.uint64(pong), np.uint32(rounds)),
                                                     stream=gpu.stream)
        best = None
        deadline = time.monotonic() + 30
        for r in range(1, rounds + 1):
            h1 = time.monotonic_ns()
            words[0] = r
            while words[8] != r:
                if time.monotonic() > deadline:
                    raise RuntimeError("clock ping-pong: the GPU did not answer")
            h2 = time.monotonic_ns()
            g = int(words[9])
            if best is None or h2 - h1 < best[0]:
                best = (h2 - h1, g - (h1 + h2) // 2)
        gpu.sync()
    finally:
        mapping.unmap()
    assert best is not None
    return {"offset_ns": float(best[1]), "round_trip_ns": float(best[0]), "error_bound_ns": best[0] / 2}


def library_commit_variant() -> int:
    """The commit variant the installed device header builds by default (``TPD_COMMIT`` in ``ring_device.cuh``),
    as ``DEFAULT_VARIANT``'s key."""
    text = (Path(gpuclient.get_include()) / "transportd" / "ring_device.cuh").read_text()
    for line in text.splitlines():
        if line.startswith("#define TPD_COMMIT ") and "TPD_COMMIT_" in line:
            name = line.split()[-1]
            return {"TPD_COMMIT_RELEASE_SYS": 0, "TPD_COMMIT_FENCE_SYS": 1, "TPD_COMMIT_V2_RELEASE": 2,
                    "TPD_COMMIT_V2_SPLIT": 3}[name]
    return 0


# --- the engine as its own null NIC: the latency rows and the sweep drain it ------------------------------------
NULL_NIC_JOB = "gpubench"


def null_nic_proxy(peers: int = 1, poll_window_us: float = 0.0, max_take: int = 4096) -> Any:
    """The compiled engine as its own null NIC (nothing leaves C), poll window 0 unless asked, with one job:
    rank 0 here, ranks 1..peers the peers the records go to, each on its own connection."""
    from transportd.dataplane.proxy import Proxy

    job, region = NULL_NIC_JOB, 1 << 30
    proxy = Proxy(None, poll_window_us=poll_window_us, max_take=max_take)
    proxy.set_source_region(job, 0, 0, 0x1000_0000, region, 1)
    for peer in range(1, peers + 1):
        proxy.set_remote_region(job, peer, 0, 0x100_0000_0000 * peer, region, 100 + peer)
        proxy.set_remote_flags(job, peer, 0xF00_0000_0000 + 0x1_0000 * peer, 64, 200 + peer)
        proxy.bind_peer(job, peer, 1000 + peer)
    return proxy
