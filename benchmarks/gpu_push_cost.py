"""What the GPU's side of a command costs alone, with no consumer: ``gpu_bench.py``'s push and plan rows, and
the PCIe read ``--only-sweep`` starts with.

push
    one push = atomicAdd on the device-memory head + one 48-byte record into the mapped ring file. Per
    commit variant (the library's four header-last ones and the benchmark-only per-word parity): one
    thread's ns per push (global timer around a loop), and pushes/s with 132 x 128 threads (CUDA events).
    The credit cache is preset so the bare push is measured, with no consumer. The warp-cooperative push
    (``tpd::warp_push``): ns per record for one warp pushing 32 records a round, and the aggregate rate.
plan overhead
    ``tile_done`` + ``wait_range`` against raw ``put_signal`` + ``wait`` on the same chunks of an
    all-gather plan (one thread; flags and credits preset, so only the calls' own costs count).
PCIe read
    one thread's read of a host word, each waited for: what a poll of the completion word costs.
"""

from __future__ import annotations

import numpy as np

import gpuclient
from benchmarks.gpu_common import Gpu, ring_file
from gpuclient.cuda_memory import DeviceMemory
from gpuclient.device_channel import map_ring


def push_cost(gpu: Gpu, variant: str, single_iters: int, agg_iters: int, threads: int = 128) -> dict[str, float]:
    with ring_file(f"push-{variant}", 1 << 14) as ring:
        dev = map_ring(ring, gpu.device)
        out = DeviceMemory(16, gpu.device)
        try:
            dev.counters.write(8, (1 << 62).to_bytes(8, "little"))  # credits never run out: the bare push
            args1 = (dev, np.uint32(single_iters), np.uint64(out.ptr))
            gpu.module.function(f"push_loop_{variant}").launch(1, 1, (dev, np.uint32(100), np.uint64(out.ptr)),
                                                               stream=gpu.stream)  # warm-up
            gpu.sync()
            singles = []
            for _ in range(3):
                gpu.module.function(f"push_loop_{variant}").launch(1, 1, args1, stream=gpu.stream)
                gpu.sync()
                t0, t1 = np.frombuffer(out.read(0, 16), dtype="<u8")
                singles.append((int(t1) - int(t0)) / single_iters)
            blocks = gpu.sms
            argsn = (dev, np.uint32(agg_iters), np.uint64(out.ptr))
            gpu.timed(f"push_loop_{variant}", blocks, threads, (dev, np.uint32(4), np.uint64(out.ptr)))  # warm-up
            rates = [blocks * threads * agg_iters / gpu.timed(f"push_loop_{variant}", blocks, threads, argsn)
                     for _ in range(3)]
        finally:
            out.free()
            dev.release()
    return {"push_ns": float(np.median(singles)), "push_ns_min": float(min(singles)),
            "pushes_per_s": float(np.median(rates)), "pushes_per_s_max": float(max(rates)),
            "threads": blocks * threads}


def warp_push_cost(gpu: Gpu, single_iters: int, agg_iters: int, threads: int = 128) -> dict[str, float]:
    """The warp-cooperative push (``tpd::warp_push``, the library's commit): ns per record for one warp
    pushing 32 records per round, and records/s with every SM's ``threads`` threads pushing."""
    with ring_file("push-warp", 1 << 14) as ring:
        dev = map_ring(ring, gpu.device)
        out = DeviceMemory(16, gpu.device)
        try:
            dev.counters.write(8, (1 << 62).to_bytes(8, "little"))  # credits never run out: the bare push
            kernel = gpu.module.function("push_loop_warp32")
            kernel.launch(1, 32, (dev, np.uint32(100), np.uint64(out.ptr)), stream=gpu.stream)  # warm-up
            gpu.sync()
            per_record = []
            for _ in range(3):
                kernel.launch(1, 32, (dev, np.uint32(single_iters), np.uint64(out.ptr)), stream=gpu.stream)
                gpu.sync()
                t0, t1 = np.frombuffer(out.read(0, 16), dtype="<u8")
                per_record.append((int(t1) - int(t0)) / (single_iters * 32))
            blocks = gpu.sms
            argsn = (dev, np.uint32(agg_iters), np.uint64(out.ptr))
            gpu.timed("push_loop_warp32", blocks, threads, (dev, np.uint32(4), np.uint64(out.ptr)))  # warm-up
            rates = [blocks * threads * agg_iters / gpu.timed("push_loop_warp32", blocks, threads, argsn)
                     for _ in range(3)]
        finally:
            out.free()
            dev.release()
    return {"push_ns": float(np.median(per_record)), "push_ns_min": float(min(per_record)),
            "records_per_warp": 32, "pushes_per_s": float(np.median(rates)),
            "pushes_per_s_max": float(max(rates)), "threads": blocks * threads}


def plan_overhead(gpu: Gpu, rounds: int, tiles_per_chunk: int = 4, chunks: int = 64) -> dict[str, float]:
    """``tile_done`` + ``wait_range`` against raw ``put_signal`` + ``wait`` on the same chunks (one thread,
    an all-gather plan of two ranks, ``tiles_per_chunk`` tiles a chunk): ns per chunk for both. Waits find
    their flags already reached and pushes find credit, so only the calls' own costs are compared."""
    from gpuclient.device_channel import CHANNEL_DTYPE

    tile = 4096
    plan = gpuclient.ChunkPlan.all_gather(rank=0, world=2, shard_bytes=chunks * tiles_per_chunk * tile,
                                          tile_bytes=tile, chunk_tiles=tiles_per_chunk, dst_region=1)
    with ring_file("plan", 1 << 14) as ring:
        dev = map_ring(ring, gpu.device)
        flags = DeviceMemory(8 * plan.slot_count, gpu.device)
        out = DeviceMemory(24, gpu.device)
        device_plan = plan.to_device(gpu.device)
        try:
            dev.counters.write(8, (1 << 62).to_bytes(8, "little"))  # credits never run out
            flags.write(0, np.full(plan.slot_count, 1 << 60, dtype="<u8").tobytes())  # every wait satisfied
            ch = np.zeros(1, dtype=CHANNEL_DTYPE)
            for name in dev.value.dtype.names:
                ch[name] = dev.value[name]
            ch["flags"], ch["flag_count"], ch["rank"], ch["world"] = flags.ptr, plan.slot_count, 0, 2
            kernel = gpu.module.function("plan_overhead")
            samples = []
            for epoch in range(1, 5):  # the first is a warm-up
                kernel.launch(1, 1, (ch.tobytes(), device_plan.handle(epoch), np.uint32(1), np.uint32(rounds),
                                     np.uint64(out.ptr)), stream=gpu.stream)
                gpu.sync()
                _, t_plan, t_raw = np.frombuffer(out.read(0, 24), dtype="<u8")
                samples.append((int(t_plan) / (rounds * chunks), int(t_raw) / (rounds * chunks)))
        finally:
            device_plan.release()
            out.free()
            flags.free()
            dev.release()
    plan_ns = float(np.median([s[0] for s in samples[1:]]))
    raw_ns = float(np.median([s[1] for s in samples[1:]]))
    return {"tile_done_wait_range_ns_per_chunk": plan_ns, "put_signal_wait_ns_per_chunk": raw_ns,
            "overhead_ns_per_chunk": plan_ns - raw_ns, "ratio": plan_ns / raw_ns, "tiles_per_chunk": tiles_per_chunk,
            "chunks": chunks}


def pcie_read(gpu: Gpu, rounds: int = 20000) -> dict[str, float]:
    """One GPU thread's read of a word in pinned host memory, each read waited for before the next: what a
    poll of the completion word costs, and so how late one poller sees a new value (~1 round trip)."""
    with ring_file("pcie", 64) as ring:
        dev = map_ring(ring, gpu.device)
        out = DeviceMemory(24, gpu.device)
        try:
            word = np.uint64(dev.ring_map.device_ptr + 1024)  # an unused line of the control page (zeros)
            gpu.module.function("pcie_read").launch(1, 1, (word, np.uint32(rounds), np.uint64(out.ptr)),
                                                    stream=gpu.stream)
            gpu.sync()
            acquire_ns, relaxed_ns, _ = np.frombuffer(out.read(0, 24), dtype="<u8")
        finally:
            out.free()
            dev.release()
    return {"rounds": rounds, "acquire_read_ns": float(acquire_ns) / rounds,
            "relaxed_read_ns": float(relaxed_ns) / rounds}
