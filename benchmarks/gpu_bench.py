"""GPU benchmarks on a CUDA machine: push cost, commit -> posted latency, put -> flag latency.

    python benchmarks/gpu_bench.py --json gpu_bench.json

push
    one push = atomicAdd on the device-memory head + one 48-byte record into the mapped ring file. Per
    commit variant (the library's four header-last ones and the benchmark-only per-word parity): one
    thread's ns per push (global timer around a loop), and pushes/s with 132 x 128 threads (CUDA events).
    The credit cache is preset so the bare push is measured, with no consumer. The warp-cooperative push
    (``tpd::warp_push``): ns per record for one warp pushing 32 records a round, and the aggregate rate.
plan overhead
    ``tile_done`` + ``wait_range`` against raw ``put_signal`` + ``wait`` on the same chunks of an
    all-gather plan (one thread; flags and credits preset, so only the calls' own costs count).
latency (one thread, pushes paced 200 us apart so nothing queues)
    commit -> posted: the proxy (``transportd.dataplane.proxy.Proxy``, the compiled engine, poll window 0) as its own
    null NIC, which logs when each command is posted; commit -> consumed: a bare consumer of the same ring,
    header-last (``RingConsumer``) against per-word parity (this file's ``ParityConsumer``). The GPU's
    %globaltimer is mapped onto CLOCK_MONOTONIC by a ping-pong through mapped host memory (the tightest of
    200 round trips; its half-width bounds the error). Because that bound (~1.5 µs) is as large as what is
    measured, also: commit -> completion seen by the kernel, a round trip on the GPU's clock alone (the
    kernel pushes, then spins on the proxy's completion position).
round trips under load (the thread sweep; ``--only-sweep`` runs it alone)
    over GPU threads (1, 32, 64, 128, 256, 512, 1024), every thread pushes a record and waits until the
    completion position passes its own before the next push; avg / p50 / p99 round trip and M ops/s, all on
    the GPU's clock. The ring is drained by the rail worker's own loop (``worker.serve_loop``: the engine's
    ``serve``, GIL released) over the engine as its own null NIC, poll window 0 (``--sweep-poll-window-us``),
    records spread over 8 peers. ``--only-sweep`` also runs ``transportd bench proxy``'s drain beside the
    bare C consumer in the same run; ``--sweep-compare`` adds the bare C consumer, one poller a warp, the
    warp-cooperative push, per-word-parity records (bare consumer only; ``parity_fenced`` with the system fence
    a record shipping fresh data needs, which header-last's release already is), and the threads spread over 2 and
    4 rings (``split_ring_sweep``: a bare consumer a ring, a worker a ring, one worker for all of them).
put -> flag
    two daemons (``LocalCluster`` over softverbs, ib RC and efa SRD), ranks 0 and 1 in one process on one
    GPU: rank 0's kernel put_signals 4 KiB, rank 1's kernel (resident, spinning) waits for the flag and
    acks through device memory; both stamp the global timer. Device flags (ib: written by the soft NIC
    through its GPU accessor; efa: published by the receiving worker on its rail's ``flag_publication``,
    loopback where there is no gdrdrv) against host-mapped flags, GPU buffers in both, and pinned host
    buffers and flags as the transport's own baseline. Each setting runs in a child process, once under
    a private CUDA MPS daemon (``transportd_cli.mps``, where ``nvidia-cuda-mps-control`` exists) and once
    without (``--no-mps`` or ``TRANSPORTD_GPU_MPS=0``: without only), into one table: without MPS every
    copy softverbs makes into GPU memory waits for a time slice of its worker's context (~2.4 ms).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import gpuclient  # noqa: E402
from cmd_ring import RingConsumer, RingFile  # noqa: E402
from gpuclient.cuda_memory import DeviceMemory, check, driver, map_host, use_device  # noqa: E402
from gpuclient.device_channel import DeviceRing, map_ring  # noqa: E402
from transportd import _core  # noqa: E402
from transportd_cli.bench_proxy import _worker_loop  # noqa: E402

KERNELS = Path(__file__).with_name("gpu_push.cu")
HEADER_LAST = ("release_sys", "fence_sys", "v2_release", "v2_split")
PARITY = ("parity", "parity_v2", "parity_fenced")  # parity_fenced: a system-scope fence first (gpu_push.cu)
GAP_NS = 200_000  # pushes paced 200 us apart: every latency sample finds the consumer idle
DEFAULT_VARIANT = {0: "release_sys", 1: "fence_sys", 2: "v2_release", 3: "v2_split"}


def _pct(values: np.ndarray, q: float) -> float:
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


def _ring(tag: str, capacity: int) -> RingFile:
    return RingFile.create(f"tpd-gpubench-{tag}-{os.getpid()}-{time.monotonic_ns() % 10**9}", capacity)


# --- push cost ------------------------------------------------------------------------------------------------
def push_cost(gpu: Gpu, variant: str, single_iters: int, agg_iters: int, threads: int = 128) -> dict[str, float]:
    with _ring(f"push-{variant}", 1 << 14) as ring:
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
    with _ring("push-warp", 1 << 14) as ring:
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
    with _ring("plan", 1 << 14) as ring:
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


# --- commit -> posted / consumed ----------------------------------------------------------------------------------
class ParityConsumer:
    """Benchmark-only consumer of per-word-parity records: a slot is ready when all six words carry its lap parity."""

    def __init__(self, ring: RingFile, block: int = 4096) -> None:
        self.ring = ring
        self.position = 0
        self.block = block
        self.mask = ring.capacity - 1

    def consume(self) -> np.ndarray:
        """Chunk ids of the ready records (the payload of word 1), publishing credits like RingConsumer.

        Scans 64 slots first and the rest of the block only when all 64 were ready, so an idle poll costs
        about what RingConsumer's 64-slot header scan costs.
        """
        ring = self.ring
        start = self.position & self.mask
        parity = np.uint64(1 + ((self.position // ring.capacity) & 1))
        ready = 0
        for n in (min(64, ring.capacity - start), min(self.block, ring.capacity - start)):
            words = ring.words[start:start + n]
            ok = ((words & np.uint64(0xFF)) == parity).all(axis=1)
            ready = n if ok.all() else int(ok.argmin())
            if ready < n:
                break
        if ready == 0:
            return np.empty(0, dtype=np.uint64)
        ids = (words[:ready, 1] >> np.uint64(8)).copy()
        self.position += ready
        ring._consumer_pos[0] = self.position
        return ids


def _paced_launch(gpu: Gpu, variant: str, dev: DeviceRing, n: int, gap_ns: int) -> DeviceMemory:
    stamps = DeviceMemory(8 * n, gpu.device)
    gpu.module.function(f"paced_{variant}").launch(1, 1, (dev, np.uint32(n), np.uint32(gap_ns), np.uint64(stamps.ptr)),
                                                   stream=gpu.stream)
    return stamps


def _latencies(stamps: DeviceMemory, n: int, seen_ns: np.ndarray, seen_ids: np.ndarray,
               offset_ns: float) -> np.ndarray:
    gpu_ns = np.frombuffer(stamps.read(0, 8 * n), dtype="<u8").astype(np.int64)
    commit_host = gpu_ns - int(offset_ns)
    ids = seen_ids.astype(np.int64)
    keep = ids < n
    return (seen_ns[keep] - commit_host[ids[keep]]) / 1e3


def commit_to_consumed(gpu: Gpu, variant: str, n: int, gap_ns: int, offset_ns: float) -> np.ndarray:
    with _ring(f"consume-{variant}", 4096) as ring:
        dev = map_ring(ring, gpu.device)
        try:
            stamps = _paced_launch(gpu, variant, dev, n, gap_ns)
            times, ids = [], []
            got = 0
            deadline = time.monotonic() + 60
            if variant in PARITY:
                pc = ParityConsumer(ring)
                while got < n and time.monotonic() < deadline:
                    batch = pc.consume()
                    if len(batch):
                        t = time.monotonic_ns()
                        times.append(np.full(len(batch), t, dtype=np.int64))
                        ids.append(batch)
                        got += len(batch)
            else:
                rc = RingConsumer(ring, scan_block=64)  # the same idle-poll cost as ParityConsumer
                while got < n and time.monotonic() < deadline:
                    recs = rc.consume_ready(4096)
                    if len(recs):
                        t = time.monotonic_ns()
                        times.append(np.full(len(recs), t, dtype=np.int64))
                        ids.append(recs["chunk_id"].astype(np.uint64))
                        got += len(recs)
            gpu.sync()
            lat = _latencies(stamps, n, np.concatenate(times), np.concatenate(ids), offset_ns)
            stamps.free()
        finally:
            dev.release()
    return lat


NULL_NIC_JOB = "gpubench"


def _null_nic_proxy(peers: int = 1, poll_window_us: float = 0.0, max_take: int = 4096) -> Any:
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


def commit_to_posted(gpu: Gpu, variant: str, n: int, gap_ns: int, offset_ns: float) -> tuple[np.ndarray, dict]:
    proxy = _null_nic_proxy()
    proxy.log_posts(n)
    with _ring(f"post-{variant}", 4096) as ring:
        proxy.add_channel(0, ring, NULL_NIC_JOB, 0, 2)
        dev = map_ring(ring, gpu.device)
        try:
            stamps = _paced_launch(gpu, variant, dev, n, gap_ns)
            deadline = time.monotonic() + 60
            while ring.completion_pos < n and time.monotonic() < deadline:
                proxy.run_once()
            gpu.sync()
            log_t, log_id = proxy.post_log()
            lat = _latencies(stamps, n, log_t, log_id, offset_ns)
            stamps.free()
            errors = ring.error
        finally:
            dev.release()
            proxy.remove_channel(0)
    return lat, {"errors": list(errors), "posted": int(len(log_id))}


def commit_to_completion_gpu_clock(gpu: Gpu, variant: str, n: int, gap_ns: int) -> np.ndarray:
    """Round trips on the GPU's clock alone: commit until the kernel sees the proxy's completion position
    pass that record (the proxy as its own null NIC, poll window 0, driven from this thread). µs each."""
    proxy = _null_nic_proxy()
    with _ring(f"rtt-{variant}", 4096) as ring:
        proxy.add_channel(0, ring, NULL_NIC_JOB, 0, 2)
        dev = map_ring(ring, gpu.device)
        rtt = DeviceMemory(8 * n, gpu.device)
        try:
            gpu.module.function(f"roundtrip_{variant}").launch(
                1, 1, (dev, np.uint32(n), np.uint32(gap_ns), np.uint64(rtt.ptr)), stream=gpu.stream)
            deadline = time.monotonic() + 60
            while ring.completion_pos < n and time.monotonic() < deadline:
                proxy.run_once()
            gpu.sync()
            out = np.frombuffer(rtt.read(0, 8 * n), dtype="<u8").astype(np.int64) / 1e3
        finally:
            rtt.free()
            dev.release()
            proxy.remove_channel(0)
    return out


# --- round trips under load: the thread sweep ---------------------------------------------------------------------
SWEEP_THREADS = (1, 32, 64, 128, 256, 512, 1024)
SWEEP_PEERS = 8  # connections the records spread over: 8 x the inflight cap (256) > 1024 records in flight
SWEEP_TIMEOUT_NS = 5_000_000_000  # one record's round trip longer than this fails the thread (never a hang)


SWEEP_CONSUMERS = ("worker", "bare")  # the rail worker's loop over the engine; the bare C consumer
# each thread polls the completion word (acquire loads); one lane of a warp polls for it; each thread polls
# with relaxed loads and fences once
SWEEP_WAITS = ("thread", "warp", "relaxed")
SWEEP_PUSHES = ("thread", "warp")  # each thread's own push; the warp-cooperative push of the lanes together
SWEEP_COMPARE_MAX_TAKE = (256, 64, 16)  # the worker's pass capped at these many records (--sweep-compare)


def roundtrip_sweep(gpu: Gpu, variant: str, threads: tuple[int, ...] = SWEEP_THREADS, iters: int = 2000,
                    peers: int = SWEEP_PEERS, poll_window_us: float = 0.0, capacity: int = 4096,
                    consumer: str = "worker", wait: str = "thread", max_take: int = 4096,
                    cpu: int | None = None, push: str = "thread") -> dict[str, Any]:
    """Round trips under load, on the GPU's clock alone: for each thread count, every thread pushes a 4 KiB PUT,
    waits until the completion position passes its own record, and pushes the next, ``iters`` times
    (``roundtrip_sweep_<variant>`` in gpu_push.cu). Per thread count: avg / p50 / p99 / max of every round trip
    (µs), and M ops/s = round trips / (last completion seen - first push) on the GPU's clock. Threads run 32
    to a block (one block for 1).

    ``consumer``: ``worker`` drains the ring with the rail worker's own loop (``bench proxy``'s ``_worker_loop``,
    what the daemon runs, with a real worker link that stays quiet) over the
    engine as its own null NIC, one worker for the whole sweep (the row the targets name); ``bare`` with
    ``_core.bare_drain`` (take, release, complete, nothing else): the ceiling of the ring itself on this
    machine. ``wait``: ``thread`` (every waiting thread polls the host word with acquire loads), ``warp`` (one
    lane a warp polls and hands the value on: ``roundtrip_sweep_warpwait_<variant>``) or ``relaxed`` (relaxed
    loads, one acquire fence after: ``roundtrip_sweep_relaxedwait_<variant>``). ``max_take``: the most records
    the worker's pass takes from the ring (the proxy's default, 4096, unless asked). ``cpu``: the consumer's
    thread alone on that CPU, every other thread of this process off it (None: wherever the OS puts them).
    ``push``: ``thread`` (each thread's own ``tpd::push``) or ``warp`` (``tpd::warp_push``: the lanes that push
    together share one slot claim and one system-scope release: ``roundtrip_sweep_warppush_<variant>``,
    header-last and ``thread`` waits only). ``variant`` may be a per-word parity one (``PARITY``) with the
    bare consumer only."""
    if consumer not in SWEEP_CONSUMERS or wait not in SWEEP_WAITS:
        raise ValueError(f"consumer must be one of {SWEEP_CONSUMERS} and wait one of {SWEEP_WAITS}")
    if variant in PARITY and consumer != "bare":
        raise ValueError("per-word parity records have only the bare consumer (the engine takes header-last)")
    if push not in SWEEP_PUSHES or (push == "warp" and (wait != "thread" or variant in PARITY)):
        raise ValueError(f"push must be one of {SWEEP_PUSHES}; the warp push waits per thread, header-last only")
    proxy = _null_nic_proxy(peers, poll_window_us, max_take) if consumer == "worker" else None
    rows: dict[str, Any] = {}
    name = f"roundtrip_sweep_{'warppush_' if push == 'warp' else '' if wait == 'thread' else wait + 'wait_'}{variant}"
    with _ring(f"sweep-{variant}", capacity) as ring:
        if proxy is not None:
            proxy.add_channel(0, ring, NULL_NIC_JOB, 0, peers + 1)
        dev = map_ring(ring, gpu.device)
        kernel = gpu.module.function(name)
        try:
            with _worker_loop(proxy, cpu=cpu) if proxy is not None else contextlib.nullcontext():
                launch = functools.partial(_sweep_launch, gpu, kernel, dev, ring=None if proxy else ring, cpu=cpu,
                                           parity=variant in PARITY)
                launch(1, 100, peers)  # warm-up: the module, the mappings, the loop
                for count in threads:
                    before = proxy.loop_stats() if proxy is not None else None
                    rows[str(count)] = _sweep_row(count, iters, *launch(count, iters, peers))
                    if before is not None:  # how the worker's passes went: records a busy pass, idle passes
                        after = proxy.loop_stats()
                        busy = after["busy"] - before["busy"]
                        rows[str(count)]["records_per_busy_pass"] = count * iters / busy if busy else float("nan")
                        rows[str(count)]["idle_passes_per_busy"] = (
                            (after["passes"] - before["passes"] - busy) / busy if busy else float("nan"))
        finally:
            dev.release()
        errors = ring.error
        stats = proxy.stats() if proxy is not None else {"commands": ring.consumer_pos, "rejected": 0}
        if proxy is not None:
            proxy.remove_channel(0)
    loop = ("transportd.dataplane.worker.serve_loop (Engine.serve), null NIC" if proxy is not None
            else f"_core.bare_drain{'(parity=True)' if variant in PARITY else ''} (take, release, complete)")
    return {"variant": variant, "peers": peers, "poll_window_us": poll_window_us, "capacity": capacity,
            "iters": iters, "consumer": consumer, "wait": wait, "push": push, "max_take": max_take, "cpu": cpu,
            "worker_loop": loop,
            "errors": list(errors), "commands": stats["commands"], "rejected": stats["rejected"],
            "by_threads": rows}


FAILED = np.uint64(0xFFFF_FFFF_FFFF_FFFF)


def _sweep_launch(gpu: Gpu, kernel: Any, dev: DeviceRing, count: int, n: int, peers: int,
                  ring: RingFile | None = None, cpu: int | None = None,
                  parity: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One launch of ``count`` threads x ``n`` round trips (``_run_sweep_kernel``). With ``ring``, a thread here
    drains it with the bare C consumer for the launch (GIL released) instead of a worker loop (on ``cpu``
    alone when given; ``parity``: of per-word-parity records)."""
    drains = []
    if ring is not None:
        until = ring.consumer_pos + count * n

        def drain() -> None:
            if cpu is not None:
                os.sched_setaffinity(0, {cpu})
            _core.bare_drain(ring._bytes, until, SWEEP_TIMEOUT_NS / 1e9, parity)

        drains.append(threading.Thread(target=drain, daemon=True))
    return _run_sweep_kernel(gpu, kernel, (dev,), count, n, peers, drains)


def _run_sweep_kernel(gpu: Gpu, kernel: Any, rings: tuple[Any, ...], count: int, n: int, peers: int,
                      drains: list[threading.Thread]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Launch a sweep kernel (its ring arguments ``rings`` first) of ``count`` threads x ``n`` round trips, with
    ``drains`` running for the launch: (round trip ns, zero where never reached and FAILED where the thread
    timed out; the push's own ns of each; (first push, last completion) per thread)."""
    rtt, span = DeviceMemory(8 * count * n, gpu.device), DeviceMemory(16 * count, gpu.device)  # zeroed
    pushed = DeviceMemory(8 * count * n, gpu.device)
    started: list[threading.Thread] = []
    try:
        for t in drains:
            t.start()
            started.append(t)
        block = min(count, 32)
        kernel.launch((count + block - 1) // block, block,
                      (*rings, np.uint32(count), np.uint32(n), np.uint32(peers), np.uint64(SWEEP_TIMEOUT_NS),
                       np.uint64(rtt.ptr), np.uint64(pushed.ptr), np.uint64(span.ptr)), stream=gpu.stream)
        gpu.sync()
        ns = np.frombuffer(rtt.read(0, 8 * count * n), dtype="<u8")
        push_ns = np.frombuffer(pushed.read(0, 8 * count * n), dtype="<u8")
        ends = np.frombuffer(span.read(0, 16 * count), dtype="<u8").reshape(count, 2)
    finally:
        for t in started:
            t.join()
        rtt.free()
        pushed.free()
        span.free()
    return ns, push_ns, ends


SPLIT_CONSUMERS = ("bare", "workers", "worker")  # split_ring_sweep: who drains the rings
SWEEP_RINGS = (1, 2, 4)  # --sweep-compare: the same threads over this many rings, each with its own bare consumer


def split_ring_sweep(gpu: Gpu, rings: int, threads: tuple[int, ...] = SWEEP_THREADS, iters: int = 2000,
                     peers: int = SWEEP_PEERS, capacity: int = 4096, idle_pauses: int = 0,
                     consumer: str = "bare") -> dict[str, Any]:
    """The sweep with the threads spread warp by warp over ``rings`` rings (library commit ``v2_split``):
    whether one ring, or one consumer, is what bounds the rate under load (``roundtrip_sweep_rings_v2_split``).
    ``consumer``: ``bare`` (a bare C consumer a ring, each on its own thread; ``idle_pauses``: its spin-wait
    hints between looks at a slot not committed yet), ``workers`` (a rail worker's loop a ring, each over its
    own engine as null NIC: what as many rails would run) or ``worker`` (one worker's loop drains every ring,
    one channel each, as the daemon's worker drains its clients' channels)."""
    if not 1 <= rings <= 4 or consumer not in SPLIT_CONSUMERS:
        raise ValueError(f"1 to 4 rings, and consumer one of {SPLIT_CONSUMERS}")
    kernel = gpu.module.function("roundtrip_sweep_rings_v2_split")
    rows: dict[str, Any] = {}
    with contextlib.ExitStack() as stack:
        files = [stack.enter_context(_ring(f"split-{i}", capacity)) for i in range(rings)]
        if consumer != "bare":
            proxies = [_null_nic_proxy(peers) for _ in (files if consumer == "workers" else files[:1])]
            for i, f in enumerate(files):  # channel i of the one worker, or channel 0 of worker i
                proxy, channel = (proxies[i], 0) if consumer == "workers" else (proxies[0], i)
                proxy.add_channel(channel, f, NULL_NIC_JOB, 0, peers + 1)
                stack.callback(proxy.remove_channel, channel)
            for proxy in proxies:
                stack.enter_context(_worker_loop(proxy))
        devs = [map_ring(f, gpu.device) for f in files]

        def launch(count: int, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
            warps = (count + 31) // 32  # warp w pushes into ring w % rings
            records = [n * sum(min(32, count - 32 * w) for w in range(i, warps, rings)) for i in range(rings)]
            drains = [threading.Thread(target=_core.bare_drain, daemon=True,
                                       args=(f._bytes, f.consumer_pos + k, SWEEP_TIMEOUT_NS / 1e9, False,
                                             idle_pauses))
                      for f, k in zip(files, records, strict=True) if k and consumer == "bare"]
            ring_args = (*devs, *[devs[0]] * (4 - rings), np.uint32(rings))  # unused slots repeat ring 0
            return _run_sweep_kernel(gpu, kernel, ring_args, count, n, peers, drains)

        try:
            launch(1, 100)  # warm-up: the module, the mappings
            for count in threads:
                rows[str(count)] = _sweep_row(count, iters, *launch(count, iters))
        finally:
            for d in devs:
                d.release()
        errors = files[0].error
        commands = sum(f.consumer_pos for f in files)
    return {"variant": "v2_split", "peers": peers, "poll_window_us": 0.0, "capacity": capacity, "iters": iters,
            "consumer": consumer, "wait": "thread", "push": "thread", "rings": rings, "idle_pauses": idle_pauses,
            "max_take": 4096, "cpu": None,
            "worker_loop": (f"_core.bare_drain, one thread a ring, {rings} rings" if consumer == "bare" else
                            f"transportd.dataplane.worker.serve_loop, one worker a ring, {rings} rings"
                            if consumer == "workers" else
                            f"transportd.dataplane.worker.serve_loop, one worker, {rings} rings (channels)"),
            "errors": list(errors),
            "commands": commands, "rejected": 0, "by_threads": rows}


def _sweep_row(threads: int, n: int, ns: np.ndarray, push_ns: np.ndarray, ends: np.ndarray) -> dict[str, Any]:
    reached = (ns != 0) & (ns != FAILED)
    us = ns[reached].astype(np.float64) / 1e3
    push_us = push_ns[reached].astype(np.float64) / 1e3
    finished = ends[:, 1] != FAILED
    window_ns = float(ends[finished, 1].max()) - float(ends[:, 0].min()) if finished.any() else float("nan")
    return {"threads": threads, "iters": n, "round_trips": int(len(us)), "failed_threads": int((~finished).sum()),
            "avg_us": float(us.mean()) if len(us) else float("nan"), "p50_us": _pct(us, 50),
            "p99_us": _pct(us, 99), "max_us": float(us.max()) if len(us) else float("nan"),
            "push_p50_us": _pct(push_us, 50), "mops": len(us) / window_ns * 1e3 if window_ns > 0 else float("nan")}


def sweep_table(sweep: dict[str, Any]) -> str:
    consumer = {"worker": "the rail worker's loop, null NIC", "workers": "a rail worker's loop a ring, null NIC",
                "bare": "the bare C consumer" + (" a ring" if sweep.get("rings", 1) > 1 else "")
                }[sweep.get("consumer", "worker")]
    take = f" (max take {sweep['max_take']})" if sweep.get("max_take", 4096) != 4096 else ""
    take += f" on CPU {sweep['cpu']} alone" if sweep.get("cpu") is not None else ""
    lines = [f"round trip under load: {sweep['variant']}, {sweep['peers']} peers, poll window "
             f"{sweep['poll_window_us']:g} us, ring of {sweep['capacity']}"
             f"{' x ' + str(sweep['rings']) + ' rings' if sweep.get('rings', 1) > 1 else ''}, "
             f"{consumer}{take}, "
             f"{sweep.get('wait', 'thread')} polls the completion word"
             + (", warp-cooperative push" if sweep.get("push") == "warp" else ""),
             f"{'threads':>8} {'avg us':>9} {'p50 us':>9} {'p99 us':>9} {'max us':>9} {'M ops/s':>9} "
             f"{'push p50':>9}"]
    for row in sweep["by_threads"].values():
        lines.append(f"{row['threads']:>8} {row['avg_us']:>9.2f} {row['p50_us']:>9.2f} {row['p99_us']:>9.2f} "
                     f"{row['max_us']:>9.1f} {row['mops']:>9.2f} {row.get('push_p50_us', float('nan')):>9.2f}" +
                     (f"   {row['records_per_busy_pass']:.1f} records a busy pass, "
                      f"{row['idle_passes_per_busy']:.1f} idle passes each" if "records_per_busy_pass" in row else "") +
                     (f"   ({row['failed_threads']} threads timed out)" if row["failed_threads"] else ""))
    if sweep["errors"][0] or sweep["rejected"]:
        lines.append(f"ERRORS: ring error word {sweep['errors']}, {sweep['rejected']} records rejected")
    return "\n".join(lines)


def sweep_summary(sweep: dict[str, Any]) -> dict[str, float]:
    """The sweep's headline numbers: 1 thread p50/p99, 32 threads p99, ops/s at the most threads."""
    rows = sweep["by_threads"]
    out: dict[str, float] = {}
    if "1" in rows:
        out["sweep_1_thread_p50_us"] = rows["1"]["p50_us"]
        out["sweep_1_thread_p99_us"] = rows["1"]["p99_us"]
    if "32" in rows:
        out["sweep_32_threads_p99_us"] = rows["32"]["p99_us"]
    if rows:
        top = max(rows.values(), key=lambda r: r["threads"])
        out[f"sweep_{top['threads']}_threads_mops"] = top["mops"]
    return out


def pcie_read(gpu: Gpu, rounds: int = 20000) -> dict[str, float]:
    """One GPU thread's read of a word in pinned host memory, each read waited for before the next: what a
    poll of the completion word costs, and so how late one poller sees a new value (~1 round trip)."""
    with _ring("pcie", 64) as ring:
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


def run_sweep_only(quick: bool, threads: tuple[int, ...], iters: int, poll_window_us: float,
                   compare: bool = False, echo: Any = print, waits: tuple[str, ...] = SWEEP_WAITS,
                   max_takes: tuple[int, ...] = SWEEP_COMPARE_MAX_TAKE, cpu: int | None = None) -> dict[str, Any]:
    """``--only-sweep``: the round-trip sweep and, in the same run, ``bench proxy``'s drain beside the bare C
    consumer: every row the loop's targets name, without the put -> flag table (no daemons, no MPS). With
    ``compare``, the same sweep again for every other (consumer, wait) pair: what the ring and the GPU's
    polling cost without the engine, and with one poller a warp (``waits`` and ``max_takes`` narrow it). With
    ``cpu``, the worker's sweep again with its loop alone on that CPU, and the bare consumer's likewise."""
    gpu = Gpu(0)
    library = DEFAULT_VARIANT[_library_default()]
    read = pcie_read(gpu)
    echo(f"PCIe read of a host word, one thread: {read['acquire_read_ns']:.0f} ns acquire, "
         f"{read['relaxed_read_ns']:.0f} ns relaxed")
    sweep = roundtrip_sweep(gpu, library, threads=threads, iters=iters, poll_window_us=poll_window_us)
    echo(sweep_table(sweep))
    others = {}
    if compare:
        for consumer in SWEEP_CONSUMERS:
            for wait in waits:
                if (consumer, wait) != ("worker", "thread"):
                    row = roundtrip_sweep(gpu, library, threads=threads, iters=iters, poll_window_us=poll_window_us,
                                          consumer=consumer, wait=wait)
                    echo(sweep_table(row))
                    others[f"{consumer}_{wait}"] = row
        for consumer in SWEEP_CONSUMERS:  # the lanes of a warp pushing together: one claim, one release
            row = roundtrip_sweep(gpu, library, threads=threads, iters=iters, poll_window_us=poll_window_us,
                                  consumer=consumer, push="warp")
            echo(sweep_table(row))
            others[f"{consumer}_thread_warp_push"] = row
        for consumer in SPLIT_CONSUMERS:  # the threads over more rings: one ring, or one consumer, the bound?
            for count in SWEEP_RINGS[1:]:
                row = split_ring_sweep(gpu, count, threads=threads, iters=iters, consumer=consumer)
                echo(sweep_table(row))
                others[f"{consumer}_thread_{count}_rings"] = row
        for variant in PARITY:  # the design's other commit, where only the bare consumer can take it
            row = roundtrip_sweep(gpu, variant, threads=threads, iters=iters, consumer="bare")
            echo(sweep_table(row))
            others[f"bare_thread_{variant}"] = row
        for take in max_takes:  # smaller passes: completions published sooner
            row = roundtrip_sweep(gpu, library, threads=threads, iters=iters, poll_window_us=poll_window_us,
                                  max_take=take)
            echo(sweep_table(row))
            others[f"worker_thread_max_take_{take}"] = row
    if cpu is not None:  # the consumer on a CPU of its own: what the OS's placement costs the tail
        for consumer in SWEEP_CONSUMERS if compare else ("worker",):
            row = roundtrip_sweep(gpu, library, threads=threads, iters=iters, poll_window_us=poll_window_us,
                                  consumer=consumer, cpu=cpu)
            echo(sweep_table(row))
            others[f"{consumer}_thread_cpu_{cpu}"] = row
    drain = drain_rows(quick, max_takes if compare else ())
    echo(f"drain, one worker, null NIC: {drain['commands_per_s'] / 1e6:.2f} M commands/s (median "
         f"{drain['commands_per_s_median'] / 1e6:.2f}); through the worker's own loop "
         f"{drain['worker_loop_commands_per_s'] / 1e6:.2f} (median "
         f"{drain['worker_loop_commands_per_s_median'] / 1e6:.2f}); bare C consumer "
         f"{drain['bare_c_consumer_records_per_s'] / 1e6:.1f} M/s; core / bare C {drain['core_vs_bare_c']:.3f}")
    for take, rate in drain["worker_loop_commands_per_s_by_max_take"].items():
        echo(f"drain through the worker's own loop, max take {take}: {rate / 1e6:.2f} M commands/s")
    summary = {"library_commit": library, **sweep_summary(sweep), "drain_commands_per_s": drain["commands_per_s"],
               "drain_worker_loop_commands_per_s": drain["worker_loop_commands_per_s"],
               "drain_vs_bare_c": drain["core_vs_bare_c"]}
    return {"summary": summary, "roundtrip_sweep": sweep, "sweep_compare": others, "drain": drain,
            "pcie_read": read, "device_sms": gpu.sms}


def drain_rows(quick: bool = False, max_takes: tuple[int, ...] = ()) -> dict[str, Any]:
    """``transportd bench proxy``'s drain on this host in the same run: the engine as its own null NIC (one
    worker, 8 peers, pre-filled ring), passes called from Python and through the worker's own loop, beside
    the bare C consumer of the same kind of ring; the worker-loop drain again at each of ``max_takes``."""
    from transportd_cli import bench_proxy

    capacity, repeats = 1 << (14 if quick else 16), 3 if quick else 5
    opts = dict(batch_max=8, poll_window_us=50.0, inflight_cap=256)
    core = bench_proxy._drain(capacity, repeats, 8, 1, opts, "core")
    loop = bench_proxy._drain_loop(capacity, repeats, 8, opts)
    bare_c = bench_proxy._bare_c_drain(capacity, repeats, 8)
    by_take = {str(take): bench_proxy._drain_loop(capacity, repeats, 8, dict(opts, max_take=take))["records_per_s"]
               for take in max_takes}
    return {"commands_per_s": core["records_per_s"], "commands_per_s_median": core["records_per_s_median"],
            "worker_loop_commands_per_s": loop["records_per_s"],
            "worker_loop_commands_per_s_median": loop["records_per_s_median"],
            "worker_loop_commands_per_s_by_max_take": by_take,
            "bare_c_consumer_records_per_s": bare_c, "core_vs_bare_c": core["records_per_s"] / bare_c,
            "batch_hist": core["batch_hist"]}


# --- put -> flag ----------------------------------------------------------------------------------------------------
# placement -> (where the data buffers live, where the receiver's flags live). Over softverbs a rail
# worker reaches GPU memory by cuMemcpy from its own CUDA context, and while another process's kernels
# are resident the GPU time-slices between the contexts: every such copy waits for a slice (about 2.4 ms
# on the H200), whatever the transport. "pinned" keeps buffers and flags in host memory mapped into the
# GPU, so it measures the transport itself; a real NIC writes GPU memory directly and pays neither.
PLACEMENTS = {"device": ("device", "device"), "host": ("device", "host"), "pinned": ("host", "host")}


def put_to_flag(gpu: Gpu, n: int, nbytes: int = 4096, kind: str = "ring", wheres: tuple[str, ...] = ("device", "host"),
                rates: dict[str, list[RateRow]] | None = None, backend: str = "ib") -> dict[str, Any]:
    """put -> flag latency per placement (``wheres``, keys of PLACEMENTS) on a ``kind`` channel ("ring":
    the proxy path; "ibgda": the kernels built with -DTPD_IBGDA post to the daemon's queue pairs) between
    two ``backend`` daemons, one thread sending. With ``rates[where]``, a list of RateRow: also commands/s
    for each row (``put_burst`` launches timed by CUDA events), in ``results[where]["rates"]``, on the same
    daemons and channels. Each result names the receiving rail's flag publication."""
    from transportd_cli.localcluster import LocalCluster

    results: dict[str, Any] = {}
    t_start = time.monotonic()
    module = gpu.module_for(kind)

    def step(what: str) -> None:
        print(f"  put->flag {kind} [{time.monotonic() - t_start:6.1f}s] {what}", flush=True)

    with LocalCluster(2, backend=backend, overrides={"peers": {"heartbeat_timeout_s": 20.0}}) as cluster:
        step("daemons up")
        for where in wheres:
            job = f"lat-{kind}-{where}"
            c0, c1 = (gpuclient.connect(cluster.socket(name), timeout=60) for name in cluster.names)
            s0 = c0.join(job, rank=0, world=2, device=gpu.device)
            s1 = c1.join(job, rank=1, world=2, device=gpu.device)
            buffers, flags_where = PLACEMENTS[where]
            if buffers == "device":
                src, dst = DeviceMemory(1 << 20, gpu.device), DeviceMemory(1 << 20, gpu.device)
            else:  # the kernels never touch the payload: only the NIC (soft or not) reads and writes it
                src, dst = gpuclient.host_array(1 << 20), gpuclient.host_array(1 << 20)
            r_src, r_dst = s0.register(src), s1.register(dst)
            s0.flags(8, where=flags_where)
            s1.flags(8, where=flags_where)
            s0.exchange(wait=False)
            s1.exchange(wait=False)
            step(f"{where}: registered, exchanging")
            s0.exchange(timeout=30)
            s1.exchange(timeout=30)
            ch0, ch1 = s0.channel(256, kind=kind), s1.channel(256, kind=kind)
            h0, h1 = ch0.device_handle(gpu.device), ch1.device_handle(gpu.device)
            step(f"{where}: channels open, launching")
            t_send, t_recv, ack = (DeviceMemory(8 * n, gpu.device), DeviceMemory(8 * n, gpu.device),
                                   DeviceMemory(8, gpu.device))
            recv_stream = check(gpu.drv.cuStreamCreate(gpu.drv.CUstream_flags.CU_STREAM_NON_BLOCKING), "stream")
            t0 = time.monotonic()
            module.function("flag_receiver").launch(1, 1, (h1, np.uint32(0), np.uint64(0), np.uint32(n),
                                                           np.uint64(t_recv.ptr), np.uint64(ack.ptr)),
                                                    stream=recv_stream)
            module.function("flag_sender").launch(1, 1, (h0, np.uint32(1), np.uint32(r_dst.id), np.uint32(r_src.id),
                                                         np.uint32(nbytes), np.uint32(0), np.uint32(n),
                                                         np.uint64(t_send.ptr), np.uint64(ack.ptr)),
                                                  stream=gpu.stream)
            for stream, name in ((gpu.stream, "sender"), (recv_stream, "receiver")):
                while True:
                    (err,) = gpu.drv.cuStreamQuery(stream)
                    if err == gpu.drv.CUresult.CUDA_SUCCESS:
                        break
                    if err != gpu.drv.CUresult.CUDA_ERROR_NOT_READY:
                        raise RuntimeError(f"{name} kernel failed: {err}")
                    if time.monotonic() - t0 > 40:
                        diag = {"error0": list(ch0.status()), "flag": int(s1.flag_array.values[0]),
                                "ack": int.from_bytes(ack.read(0, 8), "little"), "stats_a": c0.stats().get("rails")}
                        print(f"put->flag ({kind}, {where}) stuck: {diag}\n{cluster.log(cluster.names[0])[-1500:]}\n"
                              f"{cluster.log(cluster.names[1])[-1500:]}", flush=True)
                        raise TimeoutError(f"put -> flag ({kind}, {where} flags) did not finish: {diag}")
                    time.sleep(0.01)
            step(f"{where}: done")
            wall = time.monotonic() - t0
            ts = np.frombuffer(t_send.read(0, 8 * n), dtype="<u8").astype(np.int64)
            tr = np.frombuffer(t_recv.read(0, 8 * n), dtype="<u8").astype(np.int64)
            lat = (tr - ts) / 1e3
            rails = c1.stats().get("rails", [{}])
            results[where] = {"p50_us": _pct(lat, 50), "p99_us": _pct(lat, 99), "mean_us": float(lat.mean()),
                              "n": n, "bytes": nbytes, "wall_s": wall, "backend": backend,
                              "flag_publication": rails[0].get("flag_publication") if rails else None}
            rows = (rates or {}).get(where, [])
            if len(rows) > 7:
                raise ValueError("at most 7 rate rows: each counts its signals in a flag slot of its own (1..7)")
            if rows:
                results[where]["rates"] = []
            for slot, row in enumerate(rows, start=1):
                r = command_rate(gpu, module, h0, s1, r_src.id, r_dst.id, row, slot=slot, span=1 << 20)
                results[where]["rates"].append(r)
                step(f"{where}: {r['threads']} threads, {r['commands_per_s']:.0f} commands/s "
                     f"({r['reps']} launches, {r['seconds_all']:.2f} s)")
            for s, c in ((s0, c0), (s1, c1)):
                s.leave()
                c.close()
    return results


@dataclass(frozen=True)
class RateRow:
    """One command-rate row: ``blocks`` x ``threads`` threads, each putting ``per_thread`` commands of
    ``nbytes``, then thread 0 of each block one signal and a QUIET (``put_burst``). ``budget_s``: launch
    again (up to ``reps``, best one kept) only while the launches so far took less than this in all."""

    blocks: int
    threads: int
    per_thread: int
    nbytes: int = 64
    reps: int = 3
    budget_s: float = 4.0

    @property
    def posters(self) -> int:
        return self.blocks * self.threads

    @property
    def commands(self) -> int:
        """Commands one launch posts: every thread's puts, and each block's signal."""
        return self.posters * self.per_thread + self.blocks


def command_rate(gpu: Gpu, module: Any, handle: Any, receiver: Any, src_region: int, dst_region: int, row: RateRow,
                 slot: int = 1, span: int = 1 << 20, timeout_s: float = 120.0) -> dict[str, Any]:
    """Best of up to ``row.reps`` ``put_burst`` launches (each ends after its QUIETs): commands completed
    per second. The receiver's flag ``slot`` must count every block's signal, or the run is refused. A
    launch that has not finished after ``timeout_s`` raises (the kernel's spins are unbounded)."""
    assert span % row.nbytes == 0 and row.nbytes <= span, "stripes wrap at span: a whole number of puts"
    drv = gpu.drv
    best, total, reps = float("inf"), 0.0, 0
    while reps < row.reps and (reps == 0 or total < row.budget_s):
        start, end = (check(drv.cuEventCreate(0), "cuEventCreate") for _ in range(2))
        check(drv.cuEventRecord(start, gpu.stream), "cuEventRecord")
        module.function("put_burst").launch(row.blocks, row.threads,
                                            (handle, np.uint32(1), np.uint32(dst_region), np.uint32(src_region),
                                             np.uint32(row.nbytes), np.uint32(row.per_thread), np.uint32(slot),
                                             np.uint64(span)), stream=gpu.stream)
        check(drv.cuEventRecord(end, gpu.stream), "cuEventRecord")
        deadline = time.monotonic() + timeout_s
        while True:
            (err,) = drv.cuEventQuery(end)
            if err == drv.CUresult.CUDA_SUCCESS:
                break
            if err != drv.CUresult.CUDA_ERROR_NOT_READY:
                raise RuntimeError(f"put_burst ({row.posters} threads) failed: {err}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"put_burst ({row.posters} threads, {row.commands} commands) did not finish "
                                   f"in {timeout_s:.0f} s")
            time.sleep(0.001)
        seconds = float(check(drv.cuEventElapsedTime(start, end), "cuEventElapsedTime")) / 1e3
        best, total, reps = min(best, seconds), total + seconds, reps + 1
        drv.cuEventDestroy(start)
        drv.cuEventDestroy(end)
        receiver.wait(slot, row.blocks * reps, timeout=30)  # every block's signal arrived
    return {"commands_per_s": row.commands / best, "commands": row.commands, "seconds": best, "bytes": row.nbytes,
            "blocks": row.blocks, "threads_per_block": row.threads, "threads": row.posters,
            "per_thread": row.per_thread, "reps": reps, "seconds_all": total}


# --- put -> flag, with and without MPS, one table --------------------------------------------------------------
FLAG_BACKENDS = ("ib", "efa")
FLAG_WHERES = ("device", "host", "pinned")


def put_to_flag_child(n: int, json_path: str) -> None:
    """One MPS setting (whatever this process's environment says): every backend and placement, as JSON."""
    gpu = Gpu(0)
    out: dict[str, Any] = {}
    for backend in FLAG_BACKENDS:
        try:
            out[backend] = put_to_flag(gpu, n, wheres=FLAG_WHERES, backend=backend)
        except Exception as exc:  # keep what the other backend measured
            out[backend] = {"error": f"{type(exc).__name__}: {exc}"}
    Path(json_path).write_text(json.dumps(out))


def put_to_flag_table(n: int, echo: Any = print, mps: bool = True) -> dict[str, Any]:
    """Run :func:`put_to_flag_child` in a child process under MPS (when ``mps`` and it can start) and
    without; print one table and return ``{"mps": {...}, "no_mps": {...}}`` (each with ``mps_line``).

    Children, because a process is an MPS client only if MPS ran before it created its CUDA context, and
    the daemons the child starts inherit the child's environment (``CUDA_MPS_*``)."""
    from transportd_cli.mps import Mps

    settings = [("mps", True), ("no_mps", False)] if mps else [("no_mps", False)]
    results: dict[str, Any] = {}
    for label, use in settings:
        server = Mps() if use else None
        if server is not None and not server.start():
            echo(f"put -> flag under MPS skipped: {server.describe()}")
            continue
        try:
            with tempfile.TemporaryDirectory(prefix="tpd-flagbench-") as tmp:
                out = Path(tmp) / "child.json"
                env = {**os.environ}
                if server is None:
                    for key in ("CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY"):
                        env.pop(key, None)
                proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--put-flag-child", str(n),
                                       "--json", str(out)], env=env, timeout=1800)
                got = json.loads(out.read_text()) if out.exists() else {"error": f"child exited {proc.returncode}"}
        finally:
            if server is not None:
                server.stop()
        line = server.describe() if server is not None else "CUDA MPS: did not run: this row runs without it"
        got["mps_line"] = line
        results[label] = got
        echo(line)
    echo(_flag_table(results))
    return results


def _flag_table(results: dict[str, Any]) -> str:
    lines = ["| backend | MPS | buffers / flags | flag publication | p50 µs | p99 µs | device / host flags (p50) |",
             "|---|---|---|---|---|---|---|"]
    for label, by_backend in results.items():
        mps = "yes" if label == "mps" else "no"
        for backend in FLAG_BACKENDS:
            rows = by_backend.get(backend, {})
            if "error" in rows:
                lines.append(f"| {backend} | {mps} | failed: {rows['error']} | | | | |")
                continue
            dev, host = rows.get("device", {}), rows.get("host", {})
            ratio = dev.get("p50_us", float("nan")) / host.get("p50_us", float("nan")) if host else float("nan")
            for where in FLAG_WHERES:
                r = rows.get(where)
                if r is None:
                    continue
                buffers, flags = PLACEMENTS[where]
                lines.append(f"| {backend} | {mps} | {buffers} / {flags} | "
                             f"{r.get('flag_publication') if flags == 'device' else 'host store'} | "
                             f"{r['p50_us']:.1f} | {r['p99_us']:.1f} | {f'{ratio:.2f}' if where == 'device' else ''} |")
    return "\n".join(lines)


# --- driver -------------------------------------------------------------------------------------------------------
def run_gpu_benchmark(quick: bool = False, echo: Any = print, mps: bool = True) -> dict[str, Any]:
    # put -> flag first: its MPS server must start before this process makes a CUDA context of its own
    table = put_to_flag_table(100 if quick else 400, echo, mps=mps)
    gpu = Gpu(0)
    single, agg = (2000, 20) if quick else (20000, 200)
    n_lat = 300 if quick else 1000
    push = {}
    for variant in HEADER_LAST + PARITY:
        push[variant] = push_cost(gpu, variant, single, agg)
        echo(f"push {variant:12s} {push[variant]['push_ns']:8.0f} ns/push (1 thread)   "
             f"{push[variant]['pushes_per_s'] / 1e6:8.1f} M pushes/s ({push[variant]['threads']} threads)")
    push["warp"] = warp_push_cost(gpu, single // 4, agg)
    echo(f"push {'warp (32/warp)':12s} {push['warp']['push_ns']:8.1f} ns/record (1 warp) "
         f"{push['warp']['pushes_per_s'] / 1e6:8.1f} M pushes/s ({push['warp']['threads']} threads)")
    plans = plan_overhead(gpu, 2 if quick else 20)
    echo(f"tile_done + wait_range {plans['tile_done_wait_range_ns_per_chunk']:8.0f} ns/chunk vs put_signal + wait "
         f"{plans['put_signal_wait_ns_per_chunk']:8.0f} ns/chunk ({plans['tiles_per_chunk']} tiles a chunk, 1 thread)")
    clock = calibrate(gpu)
    echo(f"clock: globaltimer - monotonic = {clock['offset_ns']:.0f} ns (+/- {clock['error_bound_ns']:.0f} ns)")
    library = DEFAULT_VARIANT[_library_default()]
    consumed = {}
    for variant in (library, "parity"):
        lat = commit_to_consumed(gpu, variant, n_lat, GAP_NS, clock["offset_ns"])
        consumed[variant] = {"p50_us": _pct(lat, 50), "p99_us": _pct(lat, 99), "n": int(len(lat))}
        echo(f"commit -> consumed ({variant:11s}) p50 {consumed[variant]['p50_us']:7.2f} us  "
             f"p99 {consumed[variant]['p99_us']:7.2f} us")
    lat, post_info = commit_to_posted(gpu, library, n_lat, GAP_NS, clock["offset_ns"])
    posted = {"p50_us": _pct(lat, 50), "p99_us": _pct(lat, 99), "n": int(len(lat)), **post_info}
    echo(f"commit -> posted  (proxy, {library}) p50 {posted['p50_us']:7.2f} us  p99 {posted['p99_us']:7.2f} us")
    rtt = commit_to_completion_gpu_clock(gpu, library, n_lat, GAP_NS)
    roundtrip = {"p50_us": _pct(rtt, 50), "p99_us": _pct(rtt, 99), "n": int(len(rtt))}
    echo(f"commit -> completion seen by the kernel (GPU clock only) p50 {roundtrip['p50_us']:7.2f} us  "
         f"p99 {roundtrip['p99_us']:7.2f} us")
    sweep = roundtrip_sweep(gpu, library, iters=200 if quick else 2000)
    echo(sweep_table(sweep))
    nan = {"p50_us": float("nan"), "p99_us": float("nan")}
    flag = table.get("no_mps", {}).get("ib", {})  # the summary's put -> flag rows: ib without MPS, as before
    flag = {where: flag.get(where, nan) for where in FLAG_WHERES} if "error" not in flag else \
        {where: nan for where in FLAG_WHERES}
    best_parity = push["parity"]
    summary = {
        "library_commit": library,
        "push_ns": push[library]["push_ns"],
        "pushes_per_s": push[library]["pushes_per_s"],
        "warp_push_ns_per_record": push["warp"]["push_ns"],
        "warp_pushes_per_s": push["warp"]["pushes_per_s"],
        "plan_tile_done_wait_range_ns_per_chunk": plans["tile_done_wait_range_ns_per_chunk"],
        "plan_raw_put_signal_wait_ns_per_chunk": plans["put_signal_wait_ns_per_chunk"],
        "commit_to_post_p50_us": posted["p50_us"],
        "commit_to_post_p99_us": posted["p99_us"],
        "commit_to_completion_gpu_clock_p50_us": roundtrip["p50_us"],
        "commit_to_completion_gpu_clock_p99_us": roundtrip["p99_us"],
        "put_to_flag_p50_us": flag["device"]["p50_us"],
        "put_to_flag_p99_us": flag["device"]["p99_us"],
        "header_last": {"push_ns": push[library]["push_ns"], "pushes_per_s": push[library]["pushes_per_s"],
                        "commit_to_consume_p50_us": consumed[library]["p50_us"],
                        "commit_to_consume_p99_us": consumed[library]["p99_us"]},
        "per_word_parity": {"push_ns": best_parity["push_ns"], "pushes_per_s": best_parity["pushes_per_s"],
                            "commit_to_consume_p50_us": consumed["parity"]["p50_us"],
                            "commit_to_consume_p99_us": consumed["parity"]["p99_us"]},
        "put_to_flag_host_flags_p50_us": flag["host"]["p50_us"],
        "put_to_flag_host_flags_p99_us": flag["host"]["p99_us"],
        "put_to_flag_pinned_p50_us": flag["pinned"]["p50_us"],
        "put_to_flag_pinned_p99_us": flag["pinned"]["p99_us"],
        **sweep_summary(sweep),
    }
    for label, by_backend in table.items():
        efa = by_backend.get("efa", {})
        if "device" in efa and "host" in efa:
            summary[f"put_to_flag_efa_device_over_host_{label}"] = efa["device"]["p50_us"] / efa["host"]["p50_us"]
    return {"summary": summary, "push": push, "clock": clock, "commit_to_consumed": consumed,
            "plan_overhead": plans, "commit_to_posted": posted, "commit_to_completion_gpu_clock": roundtrip,
            "roundtrip_sweep": sweep,
            "put_to_flag": flag,
            "put_to_flag_table": table, "device_sms": gpu.sms}


def _library_default() -> int:
    text = (Path(gpuclient.get_include()) / "transportd" / "ring_device.cuh").read_text()
    for line in text.splitlines():
        if line.startswith("#define TPD_COMMIT ") and "TPD_COMMIT_" in line:
            name = line.split()[-1]
            return {"TPD_COMMIT_RELEASE_SYS": 0, "TPD_COMMIT_FENCE_SYS": 1, "TPD_COMMIT_V2_RELEASE": 2,
                    "TPD_COMMIT_V2_SPLIT": 3}[name]
    return 0


@click.command()
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None, help="write the results here")
@click.option("--quick", is_flag=True, help="fewer iterations (a smoke run)")
@click.option("--only-flag", is_flag=True, help="only the put -> flag table (ib and efa, with and without MPS)")
@click.option("--no-mps", is_flag=True, help="put -> flag without CUDA MPS only (as TRANSPORTD_GPU_MPS=0)")
@click.option("--only-sweep", is_flag=True,
              help="only the round-trip sweep over GPU threads and the drain beside the bare C consumer")
@click.option("--sweep-threads", default=",".join(map(str, SWEEP_THREADS)), show_default=True,
              help="GPU thread counts of the round-trip sweep, comma-separated")
@click.option("--sweep-iters", type=click.IntRange(min=1), default=2000, show_default=True,
              help="round trips per thread at each thread count")
@click.option("--sweep-poll-window-us", type=click.FloatRange(min=0.0), default=0.0, show_default=True,
              help="the proxy's polling window in the sweep (the daemon's default is 50)")
@click.option("--sweep-compare", is_flag=True,
              help="with --only-sweep: also the bare C consumer, one completion poller a warp, the warp "
                   "push, and per-word parity records (bare consumer)")
@click.option("--sweep-waits", default=",".join(SWEEP_WAITS), show_default=True,
              help="with --sweep-compare: the ways the GPU waits to compare, comma-separated")
@click.option("--sweep-max-takes", default=",".join(map(str, SWEEP_COMPARE_MAX_TAKE)), show_default=True,
              help="with --sweep-compare: smaller worker passes to compare, comma-separated (empty: none)")
@click.option("--sweep-worker-cpu", type=click.IntRange(min=0), default=None,
              help="with --only-sweep: also the sweep with the consumer's thread alone on this CPU")
@click.option("--put-flag-child", type=int, default=None, hidden=True,
              help="internal: one MPS setting's put -> flag runs (N round trips) into --json")
def main(json_path: str | None, quick: bool, only_flag: bool, no_mps: bool, only_sweep: bool, sweep_threads: str,
         sweep_iters: int, sweep_poll_window_us: float, sweep_compare: bool, sweep_waits: str, sweep_max_takes: str,
         sweep_worker_cpu: int | None, put_flag_child: int | None) -> None:
    """Push cost, commit -> posted, round trips under load and put -> flag on this machine's GPU (see the
    module doc)."""
    from transportd_cli.mps import mps_wanted

    mps = not no_mps and mps_wanted(os.environ)
    if put_flag_child is not None:
        import faulthandler

        faulthandler.dump_traceback_later(120, repeat=True)  # a stalled run shows where
        assert json_path, "--put-flag-child needs --json"
        put_to_flag_child(put_flag_child, json_path)
        return
    if only_sweep:
        try:
            threads = tuple(int(t) for t in sweep_threads.split(","))
        except ValueError:
            raise click.BadParameter(f"{sweep_threads!r} is not a comma-separated list of thread counts",
                                     param_hint="--sweep-threads") from None
        if not threads or min(threads) < 1:
            raise click.BadParameter("thread counts must be >= 1", param_hint="--sweep-threads")
        waits = tuple(w for w in sweep_waits.split(",") if w)
        if not waits or not set(waits) <= set(SWEEP_WAITS):
            raise click.BadParameter(f"{sweep_waits!r}: name some of {', '.join(SWEEP_WAITS)}",
                                     param_hint="--sweep-waits")
        try:
            takes = tuple(int(t) for t in sweep_max_takes.split(",") if t)
        except ValueError:
            raise click.BadParameter(f"{sweep_max_takes!r} is not a comma-separated list of counts",
                                     param_hint="--sweep-max-takes") from None
        if takes and min(takes) < 1:
            raise click.BadParameter("max takes must be >= 1", param_hint="--sweep-max-takes")
        if sweep_worker_cpu is not None and sweep_worker_cpu not in os.sched_getaffinity(0):
            raise click.BadParameter(f"CPU {sweep_worker_cpu} is not one this process may run on",
                                     param_hint="--sweep-worker-cpu")
        result = run_sweep_only(quick, threads, sweep_iters, sweep_poll_window_us, sweep_compare, click.echo,
                                waits=waits, max_takes=takes, cpu=sweep_worker_cpu)
        click.echo(json.dumps(result["summary"], indent=2))
        if json_path:
            Path(json_path).write_text(json.dumps(result, indent=2))
        return
    if only_flag:
        table = put_to_flag_table(50 if quick else 200, click.echo, mps=mps)
        if json_path:
            Path(json_path).write_text(json.dumps(table, indent=2))
        return
    result = run_gpu_benchmark(quick=quick, echo=click.echo, mps=mps)
    click.echo(json.dumps(result["summary"], indent=2))
    if json_path:
        Path(json_path).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
