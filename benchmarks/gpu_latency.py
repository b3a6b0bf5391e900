"""Latency of one record (``gpu_bench.py``'s latency rows): one thread, pushes paced ``GAP_NS`` apart so nothing
queues.

commit -> posted: the proxy (``transportd.dataplane.proxy.Proxy``, the compiled engine, poll window 0) as its own
null NIC (``gpu_common.null_nic_proxy``), which logs when each command is posted; commit -> consumed: a bare
consumer of the same ring, header-last (``RingConsumer``) against per-word parity (``ParityConsumer``). Both
take the host's clock, the kernel's stamps mapped onto it by ``gpu_common.calibrate``'s offset. Because that
offset's error bound (~1.5 µs) is as large as what is measured, also: commit -> completion seen by the kernel, a
round trip on the GPU's clock alone (the kernel pushes, then spins on the proxy's completion position).
"""

from __future__ import annotations

import time

import numpy as np

from benchmarks.gpu_common import NULL_NIC_JOB, PARITY, Gpu, null_nic_proxy, ring_file
from cmd_ring import RingConsumer, RingFile
from gpuclient.cuda_memory import DeviceMemory
from gpuclient.device_channel import DeviceRing, map_ring

GAP_NS = 200_000  # pushes paced 200 us apart: every latency sample finds the consumer idle


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
    with ring_file(f"consume-{variant}", 4096) as ring:
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


def commit_to_posted(gpu: Gpu, variant: str, n: int, gap_ns: int, offset_ns: float) -> tuple[np.ndarray, dict]:
    proxy = null_nic_proxy()
    proxy.log_posts(n)
    with ring_file(f"post-{variant}", 4096) as ring:
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
    proxy = null_nic_proxy()
    with ring_file(f"rtt-{variant}", 4096) as ring:
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
