"""Does a device-to-device copy need a free SM? The soft fabric's placement of a GPU write is one.

    python benchmarks/copy_needs_sms.py --json benchmarks/results/copy-needs-sms.json

softverbs places a write between two processes' GPU memory with one ``cuMemcpyAsync`` on the
receiving rail worker's stream (``transportd.dataplane.gpu_memory``). A fused op's programs spin on flags
that such copies complete, so if the copy runs as a kernel, it needs room on an SM beside them. This
measures it: a spinning kernel (``--blocks`` blocks of 1024 threads, default two per SM: every SM's
thread slots) holds the GPU until a host-mapped flag is set; meanwhile a 64 MiB copy between two device
buffers is issued on another stream, with ``cuMemcpyAsync`` and with ``cuMemcpyBatchAsync`` asking the
driver to prefer copy engines (``CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE``), and polled for up to
``--wait-ms``; and the soft fabric's other placement, ``softverbs.direct_copy_via = "host"``
(``GpuAccessor.copy_through_host``: device -> pinned host -> device in chunks), called in a thread and
awaited as long. Then the flag releases the kernel, the copy finishes and its bytes are checked. Rows: the
copy alone, beside one spinning block, and beside a full GPU; ms to complete, or that it did not within
the wait. A ConnectX writes GPU memory through PCIe with no SM at all.
"""

from __future__ import annotations

import ctypes
import json
import mmap
import sys
import threading
import time
from pathlib import Path
from typing import Any

import click
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import gpuclient  # noqa: E402
from gpuclient.cuda_memory import DeviceMemory, check, driver, map_host, use_device  # noqa: E402
from transportd_cli.cli_options import FiniteFloat  # noqa: E402

SPIN = r"""
extern "C" __global__ void spin(const volatile unsigned long long* release, volatile unsigned char* resident) {
    if (threadIdx.x == 0) {  // one poller a block: 270k threads reading a host word would fill PCIe
        resident[blockIdx.x] = 1;  // host-mapped: the host counts the blocks running
        while (*release == 0) __nanosleep(1000);
    }
    __syncthreads();  // the other threads hold their slots until then
}
"""
NBYTES = 64 << 20
WAYS = ("memcpy", "batch_prefer_copy_engine", "through_host")


def _issue(drv: Any, way: str, dst: int, src: int, stream: Any, accessor: Any) -> threading.Thread | None:
    """Start the copy; a thread that is alive until it completes, or None for a copy on ``stream``."""
    if way == "through_host":
        thread = threading.Thread(target=accessor.copy_through_host, args=(dst, src, NBYTES), name="through-host",
                                  daemon=True)
        thread.start()
        return thread
    if way == "memcpy":
        check(drv.cuMemcpyAsync(dst, src, NBYTES, stream), "cuMemcpyAsync")
        return
    attr = drv.CUmemcpyAttributes()
    attr.srcAccessOrder = drv.CUmemcpySrcAccessOrder.CU_MEMCPY_SRC_ACCESS_ORDER_STREAM
    attr.flags = drv.CUmemcpyFlags.CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE
    check(drv.cuMemcpyBatchAsync([drv.CUdeviceptr(dst)], [drv.CUdeviceptr(src)], [NBYTES], 1, [attr], [0], 1,
                                 stream), "cuMemcpyBatchAsync")
    return None


def probe(device: int, blocks: int, way: str, wait_ms: float) -> dict[str, Any]:
    """One row: ``blocks`` spinning blocks resident, then one copy ``way``; how long until it completed."""
    drv = driver()
    use_device(device)
    module = gpuclient.compile(SPIN, device=device, name="copy_needs_sms.cu")
    size = mmap.PAGESIZE * (1 + (blocks + mmap.PAGESIZE - 1) // mmap.PAGESIZE)
    page = mmap.mmap(-1, size)
    release = ctypes.c_uint64.from_buffer(page)  # the first 8 bytes; one byte a block from the next page on
    resident = memoryview(page)[mmap.PAGESIZE:]
    host = map_host(ctypes.addressof(release), size, device)
    src, dst = DeviceMemory(NBYTES, device), DeviceMemory(NBYTES, device)
    spin_stream = check(drv.cuStreamCreate(drv.CUstream_flags.CU_STREAM_NON_BLOCKING), "cuStreamCreate")
    accessor = None
    if way == "through_host":  # its pinned staging allocated before the kernel spins, as the rail worker's is
        from transportd.dataplane.gpu_memory import GpuAccessor

        accessor = GpuAccessor(device, stage=True)
    copy_stream = check(drv.cuStreamCreate(drv.CUstream_flags.CU_STREAM_NON_BLOCKING), "cuStreamCreate")
    try:
        check(drv.cuMemsetD8(src.ptr, 0x5A, NBYTES), "cuMemsetD8")
        check(drv.cuCtxSynchronize(), "cuCtxSynchronize")
        if blocks:
            module.function("spin").launch(blocks, 1024, (np.uint64(host.device_ptr),
                                                          np.uint64(host.device_ptr + mmap.PAGESIZE)),
                                           stream=spin_stream)
            deadline = time.monotonic() + 5  # all of them, or as many as fit
            while sum(resident[:blocks]) < blocks and time.monotonic() < deadline:
                pass
        held = sum(resident[:blocks])
        t0 = time.perf_counter()
        thread = _issue(drv, way, dst.ptr, src.ptr, copy_stream, accessor)
        done_ms = None
        if thread is not None:  # joined, not polled: a spinning poll would hold the GIL the copy needs
            thread.join(wait_ms / 1e3)
            if not thread.is_alive():
                done_ms = (time.perf_counter() - t0) * 1e3
        while thread is None and (time.perf_counter() - t0) * 1e3 < wait_ms:
            if drv.cuStreamQuery(copy_stream)[0] == drv.CUresult.CUDA_SUCCESS:
                done_ms = (time.perf_counter() - t0) * 1e3
                break
        release.value = 1
        if thread is not None:
            thread.join()
        check(drv.cuCtxSynchronize(), "cuCtxSynchronize")
        copied = dst.read(NBYTES - 4096, 4096) == b"\x5a" * 4096
    finally:
        release.value = 1
        drv.cuCtxSynchronize()
        for stream in (spin_stream, copy_stream):
            drv.cuStreamDestroy(stream)
        if accessor is not None:
            accessor.close()
        for mem in (src, dst):
            mem.free()
        host.unmap()
        del release
        resident.release()
        page.close()
    return {"way": way, "spinning_blocks": blocks, "resident_blocks": held, "completed_ms": done_ms,
            "waited_ms": wait_ms, "bytes_checked": copied,
            "gb_per_s": NBYTES / (done_ms * 1e-3) / 1e9 if done_ms else None}


@click.command()
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None, help="write the results here")
@click.option("--device", default=0, show_default=True)
@click.option("--blocks", type=click.IntRange(min=1), default=None,
              help="spinning 1024-thread blocks for the full-GPU rows (default: two per SM)")
@click.option("--wait-ms", type=FiniteFloat(min=1.0), default=2000.0, show_default=True,
              help="how long a copy may take before it counts as waiting for SMs")
def main(json_path: str | None, device: int, blocks: int | None, wait_ms: float) -> None:
    """A 64 MiB device-to-device copy beside no kernel, one spinning block, and every SM held (module doc)."""
    drv = driver()
    use_device(device)
    sms = int(check(drv.cuDeviceGetAttribute(drv.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
                                             device), "cuDeviceGetAttribute"))
    full = blocks or 2 * sms
    rows = [probe(device, n, way, wait_ms) for way in WAYS for n in (0, 1, full)]
    for r in rows:
        done = (f"completed in {r['completed_ms']:.3f} ms ({r['gb_per_s']:.0f} GB/s)" if r["completed_ms"] is not None
                else f"not complete after {r['waited_ms']:.0f} ms")
        click.echo(f"{r['way']:>25}  {r['spinning_blocks']:>4} spinning blocks ({r['resident_blocks']} resident): "
                   f"{done}; bytes {'ok' if r['bytes_checked'] else 'WRONG'}")
    if json_path:
        Path(json_path).write_text(json.dumps({"sms": sms, "nbytes": NBYTES, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
