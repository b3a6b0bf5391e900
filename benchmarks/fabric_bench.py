"""Soft fabric throughput: GB/s of 4 MiB GPU -> GPU writes between two daemons on one host.

    python benchmarks/fabric_bench.py --json benchmarks/results/fabric.json

Two daemons (``LocalCluster`` over softverbs: ib RC and efa SRD), ranks 0 and 1 in this process on one GPU,
each with a GPU buffer of ``--slots`` x 4 MiB registered by CUDA IPC. Rank 0's host producer pushes
``--writes`` PUTs of 4 MiB (slot k % slots of its buffer to the same slot of rank 1's) and a QUIET; the
rate is bytes / (first push -> QUIET returned), best of ``--reps``. Before the timed runs one PUT per slot
lets the receiving worker open rank 0's allocation (the first write of an allocation crosses the wire);
after them the receiver's buffer must equal the sender's.

Rows (``--rows``): per backend, unshaped; shaped like the NIC the backend stands for (ib: ConnectX-7
400 Gb/s, 50e9 B/s and 2 us; efa: 200 Gb/s, 25e9 B/s and 15 us); and the old path as a baseline
(``direct_copy = false``: device -> host -> TCP -> host -> device, fewer writes). Each row reports the
receiving rail's direct copies (``direct_placed``: every write after the first slot's should be one) and,
when shaped, the sending rail's link schedule: the modeled GB/s (bytes / busy time) beside the measured.

Targets on the H200 (issue 25, item 0): unshaped >= 25 GB/s (an EFA port), so shaped runs up to that rate
are faithful; shaped within 10 % of the configured rate.

``--copy-via host`` places each direct copy through pinned host memory with the copy engines
(``softverbs.direct_copy_via``: no SM, PCIe's rate) instead of one device-to-device copy.

``--buffers host`` runs the same rows on pinned-free host memory (no GPU needed): the path's own overhead
and the NIC model, not the direct copy (host writes always cross the wire).

``--latency BYTES,...`` times one write at a time instead (a PUT, then a QUIET: placed and acknowledged),
``--writes`` of each size, beside the NIC model's least and the receiver's direct copy (``latency_row``);
``--trace DIR`` also has every process stamp each write's steps (``SOFTVERBS_TRACE``, `softverbs._trace`)
and puts their medians in the JSON (`softverbs.soft.trace.summarize`), with each process's I/O thread's
waits from an epoll return to its read, the GIL's among them (``ready_waits``, `softverbs.soft.trace.ready_waits`).

``--burst GROUPS,BYTES`` sends what a MoE dispatch sends instead (``burst_row``): each round (``--gap-ms`` after the
last, 2 ms by default) both ranks push the other, in one ring push each, a count row put_signal, GROUPS put_signals
of BYTES (each its own flag), a handle-word put and a dispatch SIGNAL, as ``MoE.dispatch_gemm``'s communication
programs do at once; the table gives when each flag landed after the push (p50 / p90 / min over ``--writes`` rounds
and both ranks) beside the NIC model's least. It tells the soft fabric's own time for a kernel's burst from what a
launch adds to it; ``--post-now`` marks the last record ``NO_BATCH`` (``tpd::Post::Now``). The flags are host flags
(polled here), where the kernel's are in GPU memory.

CUDA MPS: started here (a private control daemon, ``transportd_cli.mps``) before this process makes a
CUDA context, so the daemons' workers and this process share one server context and the workers' copies
never wait for a time slice; ``--no-mps`` (or ``TRANSPORTD_GPU_MPS=0``) runs without.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from transportd.dataplane.gpu_memory import COPY_VIA as DIRECT_COPY_PLACEMENTS  # noqa: E402
from transportd_cli.cli_options import (  # noqa: E402
    FiniteFloat,
    gil_switch_us_option,
    io_spin_us_option,
    nic_spin_us_option,
    nic_streaming_option,
)

CHUNK = 4 << 20
#: the NIC each backend stands for: [softverbs] NIC-model keys
SHAPES = {
    "cx7-400g": {"nic_bandwidth": 50e9, "nic_latency_s": 2e-6},
    "efa-200g": {"nic_bandwidth": 25e9, "nic_latency_s": 15e-6},
}
ROWS = ("ib:unshaped", "ib:cx7-400g", "ib:wire", "efa:unshaped", "efa:efa-200g", "efa:wire")
TARGET_UNSHAPED_GBPS = 25.0
MAX_LATENCY_BYTES = 64 << 20
MAX_BURST_GROUPS = 64


def _softverbs(stats: dict[str, Any]) -> dict[str, Any]:
    rails = stats.get("rails") or [{}]
    return rails[0].get("softverbs") or {}


class HostBuffer:
    """A host buffer with DeviceMemory's read/write/free, for ``--buffers host``."""

    def __init__(self, nbytes: int, device: int = 0) -> None:
        import gpuclient

        self.array = gpuclient.host_array(nbytes)

    def write(self, offset: int, data: bytes) -> None:
        self.array[offset:offset + len(data)] = np.frombuffer(data, dtype=np.uint8)

    def read(self, offset: int, nbytes: int) -> bytes:
        return self.array[offset:offset + nbytes].tobytes()

    def free(self) -> None:
        pass


def buffer_type(buffers: str) -> Any:
    """The buffer class of ``--buffers``: GPU memory (``DeviceMemory``), or a ``HostBuffer``."""
    if buffers == "gpu":
        from gpuclient.cuda_memory import DeviceMemory

        return DeviceMemory
    return HostBuffer


def registrable(buf: Any) -> Any:
    """What ``session.register`` takes for a buffer of ``buffer_type``: GPU memory itself, a host buffer's array."""
    return buf.array if isinstance(buf, HostBuffer) else buf


@dataclass(frozen=True)
class SoftOptions:
    """How a benchmark's soft devices run, beside their NIC model: direct copies placed ``copy_via``
    (``softverbs.direct_copy_via``), I/O threads awake ``io_spin_s`` after their last event, ``nic_spin_s``
    (None: the config's default), the rail workers' GIL switch interval ``gil_switch_s`` (0: Python's), and
    ``nic_streaming`` (``softverbs.nic_streaming``). The benchmarks' options of the same names fill it."""

    copy_via: str = "device"
    io_spin_s: float = 0.0
    nic_spin_s: float | None = None
    gil_switch_s: float = 0.0
    nic_streaming: bool = True

    @classmethod
    def from_options(cls, copy_via: str, io_spin_us: float, nic_spin_us: float | None, gil_switch_us: float,
                     nic_streaming: bool) -> SoftOptions:
        """From the command line's microseconds (``--io-spin-us``, ``--nic-spin-us``, ``--gil-switch-us``)."""
        return cls(copy_via, io_spin_us / 1e6, None if nic_spin_us is None else nic_spin_us / 1e6,
                   gil_switch_us / 1e6, nic_streaming)

    def as_options(self) -> dict[str, Any]:
        """The command line's names and units, as a results file records them."""
        def us(s: float) -> float:
            return round(s * 1e6, 6)  # the microseconds given, not their float's trip through seconds

        return {"copy_via": self.copy_via, "io_spin_us": us(self.io_spin_s),
                "nic_spin_us": None if self.nic_spin_s is None else us(self.nic_spin_s),
                "gil_switch_us": us(self.gil_switch_s), "nic_streaming": self.nic_streaming}

    def daemon_config(self, nic: dict[str, float], direct_copy: bool = True) -> dict[str, Any]:
        """The config overrides the daemons run with: the soft fabric shaped by ``nic`` (NIC-model keys; empty:
        unshaped), direct copies on or off, these options, and a heartbeat timeout that survives a loaded host."""
        softverbs: dict[str, Any] = {"direct_copy": direct_copy, "direct_copy_via": self.copy_via,
                                     "io_spin_s": self.io_spin_s, "gil_switch_interval_s": self.gil_switch_s,
                                     "nic_streaming": self.nic_streaming, **nic}
        if self.nic_spin_s is not None:
            softverbs["nic_spin_s"] = self.nic_spin_s
        return {"softverbs": softverbs, "peers": {"heartbeat_timeout_s": 20.0}}


def _cluster_config(shape: str, nic: dict[str, float] | None,
                    soft: SoftOptions) -> tuple[dict[str, float], dict[str, Any]]:
    """The NIC model of ``shape`` (``nic`` where given) and the daemons' config for a row ("wire": direct copies
    off)."""
    nic = SHAPES.get(shape, {}) if nic is None else nic
    return nic, soft.daemon_config(nic, direct_copy=shape != "wire")


def latency_row(backend: str, shape: str, nic: dict[str, float], copy_via: str, buffers: str, sizes: list[int],
                writes: int, chunk: int, ch: Any, src_region: int, dst_region: int, c0: Any, c1: Any,
                echo: Any = print) -> dict[str, Any]:
    """One write at a time: PUT of each size, then QUIET (the write placed and acknowledged), ``writes``
    times a size. Per size: p50 / p90 / min microseconds, the NIC model's least (bytes / bandwidth +
    latency), per write the receiver's direct-copy time and the rest of the path (p50 - model - copy), and
    how the sender's shaped requests left: by its posting thread (``sent_at_post``, within
    ``nic_spin_s``) or through its departure queue (``departed``; ``departures_awaited`` of them waited for
    awake by its I/O thread)."""
    from softverbs import _trace

    out: dict[str, Any] = {"backend": backend, "shape": shape, "buffers": buffers, "nic": nic or None,
                           "copy_via": copy_via, "writes": writes, "latency": []}
    for size in sizes:
        before, sender_before = _softverbs(c1.stats()), _softverbs(c0.stats())
        times = []
        for _ in range(writes):
            if _trace.DIR:  # --trace: the cycle's start and end for softverbs.soft.trace.summarize
                _trace.stamp(f"start {backend}:{shape}:{size}")
            t0 = time.perf_counter()
            ch.put(1, dst_region, 0, src_region, 0, size)
            ch.quiet(timeout=60)
            times.append(time.perf_counter() - t0)
            if _trace.DIR:
                _trace.stamp("done")
        after, sender = _softverbs(c1.stats()), _softverbs(c0.stats())
        us = np.array(times) * 1e6
        model_us = (size / nic["nic_bandwidth"] + nic["nic_latency_s"]) * 1e6 if nic else 0.0
        placed = after.get("direct_placed", 0) - before.get("direct_placed", 0)
        copy_us = (after.get("direct_ns", 0) - before.get("direct_ns", 0)) / 1e3 / max(placed, 1)
        entry = {"bytes": size, "p50_us": float(np.percentile(us, 50)), "p90_us": float(np.percentile(us, 90)),
                 "min_us": float(us.min()), "model_us": model_us, "direct_placed_per_write": placed / writes,
                 "copy_us_per_write": copy_us,
                 **{k: sender.get(k, 0) - sender_before.get(k, 0) for k in ("sent_at_post", "departed",
                                                                       "departures_awaited")}}
        entry["rest_us"] = entry["p50_us"] - model_us - copy_us
        out["latency"].append(entry)
        echo(f"  {backend:3s} {shape:9s} {size:>9d} B  p50 {entry['p50_us']:8.1f} us  p90 {entry['p90_us']:8.1f}  "
             f"model {model_us:7.1f}  copy {copy_us:6.1f}  rest {entry['rest_us']:7.1f}")
    return out


def fabric_row(backend: str, shape: str, writes: int, slots: int, reps: int, device: int = 0,
               echo: Any = print, buffers: str = "gpu", chunk: int = CHUNK,
               nic: dict[str, float] | None = None, latency_sizes: list[int] | None = None,
               soft: SoftOptions = SoftOptions()) -> dict[str, Any]:
    """One row: ``writes`` PUTs of ``chunk`` bytes, GPU to GPU (or host to host), between two ``backend``
    daemons shaped as ``shape`` ("unshaped", a key of SHAPES, or "wire": unshaped with direct copies off),
    or by ``nic`` (NIC-model keys) where given, the soft devices run as ``soft`` says. With ``latency_sizes``,
    instead one write at a time of each size (``latency_row``), ``writes`` a size."""
    import gpuclient
    from transportd_cli.localcluster import LocalCluster

    Buffer = buffer_type(buffers)  # noqa: N806
    nic, overrides = _cluster_config(shape, nic, soft)
    nbytes = slots * chunk
    rng = np.random.default_rng(len(backend) * 7 + len(shape))
    with LocalCluster(2, backend=backend, overrides=overrides) as cluster:
        c0, c1 = (gpuclient.connect(cluster.socket(name), timeout=60) for name in cluster.names)
        s0 = c0.join("fabric", rank=0, world=2, device=device)
        s1 = c1.join("fabric", rank=1, world=2, device=device)
        src, dst = Buffer(nbytes, device), Buffer(nbytes, device)
        try:
            image = rng.integers(0, 256, nbytes, dtype=np.uint8).tobytes()
            src.write(0, image)
            r_src, r_dst = s0.register(registrable(src)), s1.register(registrable(dst))
            for s in (s0, s1):
                s.flags(8)
            gpuclient.exchange_all([s0, s1], timeout=60)
            ch = s0.channel(4096)

            def burst(n: int) -> float:
                t0 = time.perf_counter()
                for k in range(n):
                    off = (k % slots) * chunk
                    ch.put(1, r_dst.id, off, r_src.id, off, chunk)
                ch.quiet(timeout=300)
                return time.perf_counter() - t0

            burst(slots)  # every slot once: the receiver opens the allocation, the path is warm
            if latency_sizes:
                return latency_row(backend, shape, nic, soft.copy_via, buffers, latency_sizes, writes, chunk, ch,
                                   r_src.id, r_dst.id, c0, c1, echo)
            before = _softverbs(c1.stats())
            c0_before = _softverbs(c0.stats()).get("link", {})
            times = [burst(writes) for _ in range(reps)]
            after = _softverbs(c1.stats())
            link = _softverbs(c0.stats()).get("link", {})
            intact = dst.read(0, nbytes) == image
            placed = after.get("direct_placed", 0) - before.get("direct_placed", 0)
            best = min(times)
            row: dict[str, Any] = {
                "backend": backend, "shape": shape, "buffers": buffers, "writes": writes, "bytes_per_write": chunk,
                "reps": reps, "gbps_best": writes * chunk / best / 1e9,
                "gbps_median": writes * chunk / statistics.median(times) / 1e9,
                "seconds": times, "intact": intact, "direct_placed": placed,
                "direct_placed_per_write": placed / (writes * reps),
                "imports_opened": after.get("imports_opened"), "nic": nic or None, "copy_via": soft.copy_via,
            }
            busy = link.get("busy_s", 0.0) - c0_before.get("busy_s", 0.0)
            if busy > 0:
                row["gbps_modeled"] = (link.get("bytes", 0) - c0_before.get("bytes", 0)) / busy / 1e9
                row["gbps_configured"] = nic["nic_bandwidth"] / 1e9
                row["of_configured"] = row["gbps_best"] / row["gbps_configured"]
            echo(f"  {backend:3s} {shape:9s} {row['gbps_best']:7.2f} GB/s best  {row['gbps_median']:7.2f} median  "
                 f"direct copies/write {row['direct_placed_per_write']:.2f}  intact {intact}")
            return row
        finally:
            for s, c in ((s0, c0), (s1, c1)):
                s.leave()
                c.close()
            src.free()
            dst.free()


#: a burst's layout in each rank's buffer: the count row, then the handle words, then the groups (each half:
#: what the rank sends, then where the peer's burst lands)
BURST_COUNT_BYTES, BURST_HANDLE_OFFSET, BURST_HANDLE_BYTES, BURST_GROUPS_OFFSET = 256, 4096, 1024, 8192
BURST_WARMUP = 3


def burst_records(peer: int, src_region: int, dst_region: int, groups: int, group_bytes: int, half: int,
                  post_now: bool = False) -> np.ndarray:
    """One rank's burst to ``peer`` (RECORD_DTYPE), in push order: the count row put_signal (flag 0), each
    group's put_signal (flags 1..groups), the handle words' put and the dispatch SIGNAL (flag groups + 1),
    ADD 1 each. Sources lie in the sender's first ``half`` bytes, destinations in the peer's second half.
    ``post_now``: the last record is ``NO_BATCH``, so the proxy posts the burst without its polling window."""
    from cmd_ring.record import RECORD_DTYPE, Flag, Opcode

    def put(opcode: Opcode, offset: int, nbytes: int, slot: int, value: int) -> tuple:
        return (0, int(opcode), 0, peer, offset, half + offset, nbytes, src_region, dst_region, 0, slot, value)

    rows = [put(Opcode.PUT_SIGNAL, 0, BURST_COUNT_BYTES, 0, 1)]
    rows += [put(Opcode.PUT_SIGNAL, BURST_GROUPS_OFFSET + g * group_bytes, group_bytes, 1 + g, 1)
             for g in range(groups)]
    rows += [put(Opcode.PUT, BURST_HANDLE_OFFSET, BURST_HANDLE_BYTES, 0, 0),
             (0, int(Opcode.SIGNAL), int(Flag.NO_BATCH) if post_now else 0, peer, 0, 0, 0, 0, 0, 0, groups + 1, 1)]
    return np.array(rows, dtype=RECORD_DTYPE)


def burst_model_us(nic: dict[str, float], groups: int, group_bytes: int) -> list[float]:
    """The NIC model's least time from the push to each flag of a burst (count, groups, dispatch): the bytes the
    sender's link carries up to that message, then the latency; 0 each when unshaped."""
    if not nic:
        return [0.0] * (groups + 2)
    sent = [BURST_COUNT_BYTES + g * group_bytes for g in range(groups + 1)]
    sent.append(sent[-1] + BURST_HANDLE_BYTES)
    return [(b / nic["nic_bandwidth"] + nic["nic_latency_s"]) * 1e6 for b in sent]


BURST_GAP_MS = 2.0  # how long both ranks idle between two rounds of a burst (--gap-ms)


def burst_row(backend: str, shape: str, groups: int, group_bytes: int, rounds: int, device: int = 0,
              echo: Any = print, buffers: str = "gpu", nic: dict[str, float] | None = None, post_now: bool = False,
              gap_s: float = BURST_GAP_MS / 1e3, timeout_s: float = 60.0,
              soft: SoftOptions = SoftOptions()) -> dict[str, Any]:
    """A MoE dispatch's messages both ways at once (`burst_records`), ``rounds`` times after
    ``BURST_WARMUP`` (the receivers open the allocations), ``gap_s`` apart: per flag, µs from the round's push
    to its landing (p50 / p90 / min over rounds and both ranks) beside `burst_model_us`, and every landing
    (``landed_us[round][rank][flag]``, the receiving rank); ``intact`` whether what the bursts wrote of each rank's
    receive half holds the peer's bytes."""
    import gpuclient
    from softverbs import _trace
    from transportd_cli.localcluster import LocalCluster

    Buffer = buffer_type(buffers)  # noqa: N806
    nic, overrides = _cluster_config(shape, nic, soft)
    half = BURST_GROUPS_OFFSET + groups * group_bytes
    flags = groups + 2
    label = f"{backend}:{shape}:burst"
    with LocalCluster(2, backend=backend, overrides=overrides) as cluster:
        clients = [gpuclient.connect(cluster.socket(name), timeout=60) for name in cluster.names]
        sessions = [c.join("burst", rank=r, world=2, device=device) for r, c in enumerate(clients)]
        bufs = [Buffer(2 * half, device) for _ in range(2)]
        try:
            rng = np.random.default_rng(groups * 7919 + group_bytes)
            images = [rng.integers(0, 256, half, dtype=np.uint8).tobytes() for _ in range(2)]
            for buf, image in zip(bufs, images, strict=True):
                buf.write(0, image)
            regions = [s.register(registrable(b)) for s, b in zip(sessions, bufs, strict=True)]
            arrays = [s.flags(flags, where="host") for s in sessions]
            gpuclient.exchange_all(sessions, timeout=60)
            channels = [s.channel(4096) for s in sessions]
            records = [burst_records(1 - r, regions[r].id, regions[1 - r].id, groups, group_bytes, half, post_now)
                       for r in range(2)]
            landed = np.zeros((rounds, 2, flags))
            for n in range(1, BURST_WARMUP + rounds + 1):
                if _trace.DIR and n > BURST_WARMUP:
                    _trace.stamp(f"start {label}")
                t0 = time.perf_counter()
                for ch, recs in zip(channels, records, strict=True):
                    ch.push_records(recs)
                seen = np.zeros((2, flags))
                while not seen.all():
                    now = time.perf_counter()
                    for r, fl in enumerate(arrays):
                        up = (fl.values[:flags] >= n) & (seen[r] == 0)
                        seen[r][up] = now - t0
                    if now - t0 > timeout_s:
                        raise TimeoutError(f"burst {n}: flags still low after {timeout_s} s (landed: {seen.tolist()})")
                    time.sleep(10e-6)
                if _trace.DIR and n > BURST_WARMUP:
                    _trace.stamp("done")
                if n > BURST_WARMUP:
                    landed[n - 1 - BURST_WARMUP] = seen
                time.sleep(gap_s)
            spans = [(0, BURST_COUNT_BYTES), (BURST_HANDLE_OFFSET, BURST_HANDLE_BYTES),
                     (BURST_GROUPS_OFFSET, groups * group_bytes)]  # what a burst writes of the half
            intact = all(bufs[r].read(half + off, n) == images[1 - r][off:off + n] for r in range(2)
                         for off, n in spans)
        finally:
            for s, c in zip(sessions, clients, strict=True):
                s.leave()
                c.close()
            for b in bufs:
                b.free()
    us = landed.reshape(rounds * 2, flags) * 1e6
    names = ["count"] + [f"group {g + 1}" for g in range(groups)] + ["dispatch"]
    model = burst_model_us(nic, groups, group_bytes)
    messages = [{"message": name, "p50_us": float(np.percentile(us[:, k], 50)),
                 "p90_us": float(np.percentile(us[:, k], 90)), "min_us": float(us[:, k].min()), "model_us": model[k]}
                for k, name in enumerate(names)]
    row = {"backend": backend, "shape": shape, "buffers": buffers, "nic": nic or None, "copy_via": soft.copy_via,
           "groups": groups, "group_bytes": group_bytes, "rounds": rounds, "post_now": post_now, "intact": intact,
           "burst": messages, "landed_us": np.round(landed * 1e6, 1).tolist()}
    for m in messages:
        echo(f"  {backend:3s} {shape:9s} {m['message']:>9s}  p50 {m['p50_us']:8.1f} us  p90 {m['p90_us']:8.1f}  "
             f"min {m['min_us']:8.1f}  model {m['model_us']:7.1f}")
    return row


def _markdown(columns: list[str], rows: list[dict[str, Any]],
              lines_of: Callable[[dict[str, Any]], list[list[str]]]) -> str:
    """A table of ``columns``: ``lines_of(row)``'s lines for each row, one "failed" line for a row with an error."""
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['backend']} | {r['shape']} | failed: {r['error']} |" + " |" * (len(columns) - 3))
        else:
            lines += ["| " + " | ".join(cells) + " |" for cells in lines_of(r)]
    return "\n".join(lines)


def table(rows: list[dict[str, Any]]) -> str:
    def line(r: dict[str, Any]) -> list[list[str]]:
        of = f"{100 * r['of_configured']:.1f} %" if "of_configured" in r else "—"
        shape = f"{r['shape']} ({r['nic']['nic_bandwidth'] / 1e9:g} GB/s)" if r.get("nic") else r["shape"]
        return [[r["backend"], shape, f"{r['gbps_best']:.2f}", f"{r['gbps_median']:.2f}", of,
                 f"{r['direct_placed_per_write']:.2f}", "intact" if r["intact"] else "CORRUPT"]]

    return _markdown(["backend", "NIC model", "GB/s best", "GB/s median", "of configured", "direct copies / write",
                      "data"], rows, line)


def latency_table(rows: list[dict[str, Any]]) -> str:
    def lines(r: dict[str, Any]) -> list[list[str]]:
        return [[r["backend"], r["shape"], str(e["bytes"]), f"{e['p50_us']:.1f}", f"{e['p90_us']:.1f}",
                 f"{e['model_us']:.1f}", f"{e['copy_us_per_write']:.1f}", f"{e['rest_us']:.1f}"]
                for e in r["latency"]]

    return _markdown(["backend", "NIC model", "bytes", "p50 us", "p90 us", "model us", "direct copy us", "rest us"],
                     rows, lines)


def burst_table(rows: list[dict[str, Any]]) -> str:
    def lines(r: dict[str, Any]) -> list[list[str]]:
        return [[r["backend"], r["shape"], m["message"], f"{m['p50_us']:.1f}", f"{m['p90_us']:.1f}",
                 f"{m['min_us']:.1f}", f"{m['model_us']:.1f}"] for m in r["burst"]]

    return _markdown(["backend", "NIC model", "flag", "p50 us", "p90 us", "min us", "model us"], rows, lines)


def trace_table(trace: dict[str, list[dict[str, Any]]]) -> str:
    """``softverbs.soft.trace.summarize``'s steps, a block per row and size."""
    lines = []
    for label, steps in trace.items():
        lines += [f"steps of {label} (µs from the cycle's start; p0 is this process)", "| step | n | median | p10 |",
                  "|---|---|---|---|"]
        lines += [f"| {r['step']} | {r['n']} | {r['median_us']:.1f} | {r['p10_us']:.1f} |" for r in steps]
    return "\n".join(lines)


def verdict(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The targets, row by row: unshaped >= 25 GB/s, shaped within 10 % of the configured rate."""
    out = {}
    for r in rows:
        if "error" in r or r["shape"] == "wire" or r.get("buffers", "gpu") != "gpu":
            continue
        key = f"{r['backend']}:{r['shape']}"
        if r["shape"] == "unshaped":
            out[key] = r["gbps_best"] >= TARGET_UNSHAPED_GBPS and r["intact"]
        else:
            out[key] = abs(r["of_configured"] - 1.0) <= 0.10 and r["intact"]
    return out


def _burst_spec(burst: str) -> tuple[int, int]:
    """``--burst GROUPS,BYTES`` as (groups, bytes); (0, 0) when not given."""
    if not burst:
        return 0, 0
    try:
        groups, group_bytes = (int(x, 0) for x in burst.split(","))
    except ValueError:
        raise click.BadParameter(f"--burst takes GROUPS,BYTES (say 4,1835008), got {burst!r}") from None
    if not 1 <= groups <= MAX_BURST_GROUPS or not 1 <= group_bytes <= MAX_LATENCY_BYTES:
        raise click.BadParameter(f"--burst: GROUPS in [1, {MAX_BURST_GROUPS}], BYTES in [1, {MAX_LATENCY_BYTES}]")
    return groups, group_bytes


@click.command()
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None, help="write the results here")
@click.option("--rows", default=",".join(ROWS), show_default=True, help="backend:shape, comma-separated")
@click.option("--writes", default=512, show_default=True, help="4 MiB writes per timed run (the wire row: 1/8)")
@click.option("--slots", default=16, show_default=True, help="4 MiB slots in each buffer")
@click.option("--reps", default=3, show_default=True, help="timed runs per row")
@click.option("--quick", is_flag=True, help="64 writes, 1 run (a smoke run)")
@click.option("--no-mps", is_flag=True, help="without CUDA MPS (as TRANSPORTD_GPU_MPS=0)")
@click.option("--buffers", type=click.Choice(["gpu", "host"]), default="gpu", show_default=True,
              help="host: the same rows on host memory, no GPU needed (no direct copies)")
@click.option("--copy-via", type=click.Choice(DIRECT_COPY_PLACEMENTS), default="device", show_default=True,
              help="softverbs.direct_copy_via: one device-to-device copy, or through pinned host memory")
@click.option("--latency", "latency", default="", metavar="BYTES,...",
              help="instead of the rate: one write at a time of each size (PUT, then QUIET), --writes a size")
@click.option("--burst", "burst", default="", metavar="GROUPS,BYTES",
              help="instead of the rate: a MoE dispatch's messages both ways at once (count row, GROUPS put_signals "
                   "of BYTES, handle words, dispatch signal), --writes rounds; when each flag lands")
@click.option("--post-now", is_flag=True, help="--burst: the last record of each burst is NO_BATCH (tpd::Post::Now)")
@click.option("--trace", "trace_dir", type=click.Path(file_okay=False), default=None,
              help="--latency or --burst: every process stamps each message's steps here (SOFTVERBS_TRACE), "
                   "summarized per row (the stamps add a few microseconds a step)")
@io_spin_us_option
@nic_spin_us_option
@nic_streaming_option
@gil_switch_us_option
@click.option("--gap-ms", default=None, type=FiniteFloat(min=0.0, max=1000.0),
              help="--burst: how long both ranks idle between two rounds (default 2)")
def main(json_path: str | None, rows: str, writes: int, slots: int, reps: int, quick: bool, no_mps: bool,
         buffers: str, copy_via: str, latency: str = "", burst: str = "", post_now: bool = False,
         trace_dir: str | None = None, io_spin_us: float = 0.0, nic_spin_us: float | None = None,
         gil_switch_us: float = 0.0, gap_ms: float | None = None, nic_streaming: bool = True) -> None:
    """GB/s of 4 MiB GPU -> GPU writes between two daemons, unshaped and NIC-shaped (see the module doc)."""
    from transportd_cli.mps import Mps

    if quick:
        writes, reps = 64, 1
    try:
        latency_sizes = [int(x, 0) for x in latency.split(",") if x.strip()]
    except ValueError:
        raise click.BadParameter(f"--latency takes byte counts, got {latency!r}") from None
    if any(n < 1 or n > MAX_LATENCY_BYTES for n in latency_sizes):
        raise click.BadParameter(f"--latency sizes must be in [1, {MAX_LATENCY_BYTES}]")
    groups, group_bytes = _burst_spec(burst)
    if burst and latency_sizes:
        raise click.BadParameter("--burst and --latency are two ways to time messages: give one")
    if trace_dir and not (latency_sizes or burst):
        raise click.BadParameter("--trace stamps the messages of --latency or --burst: give one of them")
    if post_now and not burst:
        raise click.BadParameter("--post-now marks the last record of a --burst: give --burst too")
    if gap_ms is not None and not burst:
        raise click.BadParameter("--gap-ms spaces the rounds of a --burst: give --burst too")
    gap_ms = BURST_GAP_MS if gap_ms is None else gap_ms
    if trace_dir:
        from softverbs import _trace

        Path(trace_dir).mkdir(parents=True, exist_ok=True)
        os.environ["SOFTVERBS_TRACE"] = _trace.DIR = str(Path(trace_dir).resolve())  # the daemons inherit it
    soft = SoftOptions.from_options(copy_via, io_spin_us, nic_spin_us, gil_switch_us, nic_streaming)
    mps = Mps()  # host buffers need no GPU, and --no-mps runs without
    if buffers == "gpu" and not no_mps and not mps.start():
        click.echo(mps.describe())
    try:
        results = []
        for spec in rows.split(","):
            backend, _, shape = spec.strip().partition(":")
            n = max(slots, writes // 8) if shape == "wire" and not latency_sizes else writes
            try:
                if burst:
                    results.append(burst_row(backend, shape or "unshaped", groups, group_bytes, writes,
                                             echo=click.echo, buffers=buffers, post_now=post_now,
                                             gap_s=gap_ms / 1e3, soft=soft))
                elif latency_sizes:  # one slot the size of the largest write
                    results.append(fabric_row(backend, shape or "unshaped", n, 1, reps, echo=click.echo,
                                              buffers=buffers, chunk=max(latency_sizes),
                                              latency_sizes=latency_sizes, soft=soft))
                else:
                    results.append(fabric_row(backend, shape or "unshaped", n, slots, reps, echo=click.echo,
                                              buffers=buffers, soft=soft))
            except Exception as exc:  # keep what the other rows measured
                results.append({"backend": backend, "shape": shape, "error": f"{type(exc).__name__}: {exc}"})
                click.echo(f"  {spec}: failed: {exc}")
    finally:
        mps_line = mps.describe()
        mps.stop()
    click.echo(mps_line)
    trace: dict[str, Any] = {}
    waits: dict[int, Any] = {}  # --trace: each process's I/O thread, from a wait's return to its read
    if latency_sizes or burst:
        click.echo(burst_table(results) if burst else latency_table(results))
        met = {}
        if trace_dir:
            from softverbs.soft.trace import ready_waits, summarize

            trace = summarize(trace_dir, skip=0 if burst else writes // 10)  # a burst's warm-up is not stamped
            click.echo(trace_table(trace))
            waits = ready_waits(trace_dir)
            for pid, w in waits.items():
                click.echo(f"pid {pid}: ready -> read p50 {w['p50_us']} us, p90 {w['p90_us']} us; {w['slow']} of "
                           f"{w['n']} over 50 us, {w['slow_in_own_post']} of those during its own post")
    else:
        click.echo(table(results))
        met = verdict(results)
    click.echo(json.dumps({"targets_met": met}, indent=2))
    if json_path:
        Path(json_path).write_text(json.dumps({"rows": results, "targets_met": met, "mps": mps_line,
                                               **soft.as_options(), "post_now": post_now, "gap_ms": gap_ms,
                                               **({"trace": trace, "ready_waits": waits} if trace else {})},
                                              indent=2))


if __name__ == "__main__":
    main()
