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
and puts their medians in the JSON (`softverbs.soft.trace.summarize`).

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
from pathlib import Path
from typing import Any

import click
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from transportd.dataplane.gpu_memory import COPY_VIA as DIRECT_COPY_PLACEMENTS  # noqa: E402
from transportd_cli.cli_options import io_spin_us_option, nic_spin_us_option  # noqa: E402

CHUNK = 4 << 20
#: the NIC each backend stands for: [softverbs] NIC-model keys
SHAPES = {
    "cx7-400g": {"nic_bandwidth": 50e9, "nic_latency_s": 2e-6},
    "efa-200g": {"nic_bandwidth": 25e9, "nic_latency_s": 15e-6},
}
ROWS = ("ib:unshaped", "ib:cx7-400g", "ib:wire", "efa:unshaped", "efa:efa-200g", "efa:wire")
TARGET_UNSHAPED_GBPS = 25.0
MAX_LATENCY_BYTES = 64 << 20


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
               nic: dict[str, float] | None = None, copy_via: str = "device",
               latency_sizes: list[int] | None = None, io_spin_s: float = 0.0,
               nic_spin_s: float | None = None) -> dict[str, Any]:
    """One row: ``writes`` PUTs of ``chunk`` bytes, GPU to GPU (or host to host), between two ``backend``
    daemons shaped as ``shape`` ("unshaped", a key of SHAPES, or "wire": unshaped with direct copies off),
    or by ``nic`` (NIC-model keys) where given; direct copies placed ``copy_via``; the soft devices' I/O threads
    awake ``io_spin_s`` after their last event; ``nic_spin_s`` (None: the default) as
    ``softverbs.nic_spin_s``. With ``latency_sizes``, instead one write at a time of each size
    (``latency_row``), ``writes`` a size."""
    import gpuclient
    from transportd_cli.localcluster import LocalCluster

    if buffers == "gpu":
        from gpuclient.cuda_memory import DeviceMemory as Buffer
    else:
        Buffer = HostBuffer  # noqa: N806

    nic = SHAPES.get(shape, {}) if nic is None else nic
    softverbs: dict[str, Any] = {"direct_copy": shape != "wire", "direct_copy_via": copy_via, "io_spin_s": io_spin_s,
                                 **nic}
    if nic_spin_s is not None:
        softverbs["nic_spin_s"] = nic_spin_s
    overrides = {"softverbs": softverbs, "peers": {"heartbeat_timeout_s": 20.0}}
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
            r_src, r_dst = (s0.register(src), s1.register(dst)) if buffers == "gpu" else \
                (s0.register(src.array), s1.register(dst.array))
            for s in (s0, s1):
                s.flags(8)
                s.exchange(wait=False)
            s0.exchange(timeout=60)
            s1.exchange(timeout=60)
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
                return latency_row(backend, shape, nic, copy_via, buffers, latency_sizes, writes, chunk, ch,
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
                "imports_opened": after.get("imports_opened"), "nic": nic or None, "copy_via": copy_via,
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


def trace_table(trace: dict[str, list[dict[str, Any]]]) -> str:
    """``softverbs.soft.trace.summarize``'s steps, a block per row and size."""
    lines = []
    for label, steps in trace.items():
        lines += [f"steps of {label} (µs from the write's start; p0 is this process)", "| step | n | median | p10 |",
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
@click.option("--trace", "trace_dir", type=click.Path(file_okay=False), default=None,
              help="--latency: every process stamps each write's steps here (SOFTVERBS_TRACE), summarized per row "
                   "and size (the stamps add a few microseconds a step)")
@io_spin_us_option
@nic_spin_us_option
def main(json_path: str | None, rows: str, writes: int, slots: int, reps: int, quick: bool, no_mps: bool,
         buffers: str, copy_via: str, latency: str = "", trace_dir: str | None = None, io_spin_us: float = 0.0,
         nic_spin_us: float | None = None) -> None:
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
    if trace_dir and not latency_sizes:
        raise click.BadParameter("--trace stamps the writes of --latency: give --latency too")
    if trace_dir:
        from softverbs import _trace

        Path(trace_dir).mkdir(parents=True, exist_ok=True)
        os.environ["SOFTVERBS_TRACE"] = _trace.DIR = str(Path(trace_dir).resolve())  # the daemons inherit it
    nic_spin_s = None if nic_spin_us is None else nic_spin_us / 1e6
    mps = Mps()  # host buffers need no GPU, and --no-mps runs without
    if buffers == "gpu" and not no_mps and not mps.start():
        click.echo(mps.describe())
    try:
        results = []
        for spec in rows.split(","):
            backend, _, shape = spec.strip().partition(":")
            n = max(slots, writes // 8) if shape == "wire" and not latency_sizes else writes
            try:
                if latency_sizes:  # one slot the size of the largest write
                    results.append(fabric_row(backend, shape or "unshaped", n, 1, reps, echo=click.echo,
                                              buffers=buffers, chunk=max(latency_sizes), copy_via=copy_via,
                                              latency_sizes=latency_sizes, io_spin_s=io_spin_us / 1e6,
                                              nic_spin_s=nic_spin_s))
                else:
                    results.append(fabric_row(backend, shape or "unshaped", n, slots, reps, echo=click.echo,
                                              buffers=buffers, copy_via=copy_via, io_spin_s=io_spin_us / 1e6,
                                              nic_spin_s=nic_spin_s))
            except Exception as exc:  # keep what the other rows measured
                results.append({"backend": backend, "shape": shape, "error": f"{type(exc).__name__}: {exc}"})
                click.echo(f"  {spec}: failed: {exc}")
    finally:
        mps_line = mps.describe()
        mps.stop()
    click.echo(mps_line)
    trace: dict[str, Any] = {}
    if latency_sizes:
        click.echo(latency_table(results))
        met = {}
        if trace_dir:
            from softverbs.soft.trace import summarize

            trace = summarize(trace_dir, skip=writes // 10)
            click.echo(trace_table(trace))
    else:
        click.echo(table(results))
        met = verdict(results)
    click.echo(json.dumps({"targets_met": met}, indent=2))
    if json_path:
        Path(json_path).write_text(json.dumps({"rows": results, "targets_met": met, "mps": mps_line,
                                               "io_spin_us": io_spin_us, "nic_spin_us": nic_spin_us,
                                               **({"trace": trace} if trace else {})},
                                              indent=2))


if __name__ == "__main__":
    main()
