"""A Triton push beside the CUDA push: ns per ``gpuclient.triton.put`` from one program, measured like the CUDA
rows of ``benchmarks/gpu_bench.py`` (``push_loop_*`` in ``gpu_push.cu``): one program pushes ``pushes`` PUT
records in a loop, ``%globaltimer`` read around the loop, against a ring whose credit cache is preset so no
consumer is needed (the bare push: claim, credit check, header-last commit).

The Triton put is the public call, handle read from device memory and all: a barrier (``bar.sync``, which
orders the program's earlier stores before the record), the channel words loaded from the 64-byte device
copy, then thread 0's push. ``num_warps=1`` by default, the closest Triton gets to the CUDA row's single
thread (a Triton program is at least one warp).

    from benchmarks.triton_push import measure_push
    ns = measure_push(map_ring(ring, device), 20000)

    python benchmarks/triton_push.py [--pushes 20000] [--json out.json]   # both rows, side by side, on this GPU

Launching a Triton kernel goes through PyTorch's current CUDA stream (Triton's launcher asks PyTorch), so
this needs torch as well as triton; both are on the H200 image.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import triton
import triton.language as tl

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import gpuclient.triton as tdt  # noqa: E402

__all__ = ["measure_push", "push_loop"]

_CREDIT_PRESET = 1 << 62  # credits never run out: the bare push, as gpu_bench presets them


@triton.jit
def push_loop(ch, pushes, out):
    """One program pushes ``pushes`` PUT records (4 KiB at offsets that walk the region, as gpu_push.cu's);
    ``out[0]``/``out[1]`` are %globaltimer before and after the loop."""
    t0 = tdt.globaltimer()
    for i in range(pushes):
        off = i.to(tl.uint64) << 12
        tdt.put(ch, 1, 0, off, 0, off, 4096, i)
    t1 = tdt.globaltimer()
    tl.store(out, t0)
    tl.store(out + 1, t1)


def measure_push(ring: Any, pushes: int, *, num_warps: int = 1, repeats: int = 3) -> float:
    """Median ns per Triton ``put`` over ``repeats`` runs of ``pushes`` pushes from one program.

    ``ring``: a ``gpuclient.device_channel.DeviceRing`` (``map_ring``) or ``DeviceChannel``; its credit cache is
    preset here (device word ``credit``) so the ring never looks full. The device copy of the handle and the
    timer words are made once, before the timed launches.
    """
    from gpuclient.cuda_memory import DeviceMemory, check, driver

    dev_ring = getattr(ring, "ring", ring)  # a DeviceChannel's ring, or the DeviceRing itself
    device = dev_ring.counters.device
    dev_ring.counters.write(8, _CREDIT_PRESET.to_bytes(8, "little"))
    ch = tdt.channel_pointer(ring)
    out = DeviceMemory(16, device)
    drv = driver()
    try:
        timer = tdt.DevicePointer(out.ptr, "uint64")
        push_loop[(1,)](ch, 100, timer, num_warps=num_warps)  # compile and warm up
        check(drv.cuCtxSynchronize(), "cuCtxSynchronize")
        per_push = []
        for _ in range(repeats):
            push_loop[(1,)](ch, pushes, timer, num_warps=num_warps)
            check(drv.cuCtxSynchronize(), "cuCtxSynchronize")
            t0, t1 = np.frombuffer(out.read(0, 16), dtype="<u8")
            per_push.append((int(t1) - int(t0)) / pushes)
    finally:
        out.free()
        ch.release()
    return float(np.median(per_push))


def measure_cuda_push(ring: Any, pushes: int, *, variant: str = "v2_split", repeats: int = 3) -> float:
    """The CUDA row for comparison: median ns per ``tpd::push`` of one thread (gpu_push.cu's ``push_loop_<variant>``;
    v2_split is the library's commit), credit preset the same way."""
    import gpuclient
    from gpuclient.cuda_memory import DeviceMemory, check, driver

    device = ring.counters.device
    ring.counters.write(8, _CREDIT_PRESET.to_bytes(8, "little"))
    module = gpuclient.compile((ROOT / "benchmarks" / "gpu_push.cu").read_text(), device=device, name="gpu_push.cu")
    kernel = module.function(f"push_loop_{variant}")
    out = DeviceMemory(16, device)
    drv = driver()
    try:
        kernel.launch(1, 1, (ring, np.uint32(100), np.uint64(out.ptr)))
        check(drv.cuCtxSynchronize(), "cuCtxSynchronize")
        per_push = []
        for _ in range(repeats):
            kernel.launch(1, 1, (ring, np.uint32(pushes), np.uint64(out.ptr)))
            check(drv.cuCtxSynchronize(), "cuCtxSynchronize")
            t0, t1 = np.frombuffer(out.read(0, 16), dtype="<u8")
            per_push.append((int(t1) - int(t0)) / pushes)
    finally:
        out.free()
    return float(np.median(per_push))


def main() -> None:
    import argparse

    from cmd_ring.ring import RingFile
    from gpuclient.cuda_memory import use_device
    from gpuclient.device_channel import map_ring

    parser = argparse.ArgumentParser(description="ns per push: Triton put beside the CUDA push (credit preset)")
    parser.add_argument("--pushes", type=int, default=20000)
    parser.add_argument("--device", type=int, default=0)
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args()
    use_device(args.device)
    rows = {}
    for name in ("cuda", "triton"):
        with RingFile.create(f"tpd-tritonpush-{name}-{os.getpid()}-{time.monotonic_ns() % 10**9}", 1 << 14) as ring:
            dev = map_ring(ring, args.device)
            try:
                rows[name] = (measure_cuda_push(dev, args.pushes) if name == "cuda"
                              else measure_push(dev, args.pushes))
            finally:
                dev.release()
    for name, ns in rows.items():
        print(f"push {name:8s} {ns:8.0f} ns/push (one {'thread' if name == 'cuda' else 'program, 1 warp'})")
    print(f"triton / cuda: {rows['triton'] / rows['cuda']:.2f}x (target <= 1.5x)")
    if args.json:
        Path(args.json).write_text(json.dumps({"pushes": args.pushes, "push_ns": rows,
                                               "triton_over_cuda": rows["triton"] / rows["cuda"]}, indent=2))


if __name__ == "__main__":
    main()
