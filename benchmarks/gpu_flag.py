"""put -> flag latency and command rate through two daemons: ``gpu_bench.py``'s put -> flag table
(``--only-flag`` runs it alone), and ``ibgda_bench.py``'s versus section (``put_to_flag`` with ``RateRow``s, on
both channel kinds).

Two daemons (``LocalCluster`` over softverbs, ib RC and efa SRD), ranks 0 and 1 in one process on one GPU: rank
0's kernel put_signals 4 KiB, rank 1's kernel (resident, spinning) waits for the flag and acks through device
memory; both stamp the global timer. Device flags (ib: written by the soft NIC through its GPU accessor; efa:
published by the receiving worker on its rail's ``flag_publication``, loopback where there is no gdrdrv) against
host-mapped flags, GPU buffers in both, and pinned host buffers and flags as the transport's own baseline. Each
setting runs in a child process (``gpu_bench.py --put-flag-child``), once under a private CUDA MPS daemon
(``transportd_cli.mps``, where ``nvidia-cuda-mps-control`` exists) and once without (``--no-mps`` or
``TRANSPORTD_GPU_MPS=0``: without only), into one table: without MPS every copy softverbs makes into GPU memory
waits for a time slice of its worker's context (~2.4 ms).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

import gpuclient
from benchmarks.gpu_common import Gpu, percentile
from gpuclient.cuda_memory import DeviceMemory, check

# the child is gpu_bench.py's own command line (--put-flag-child), a fresh process each MPS setting
GPU_BENCH = Path(__file__).resolve().with_name("gpu_bench.py")


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
            results[where] = {"p50_us": percentile(lat, 50), "p99_us": percentile(lat, 99),
                              "mean_us": float(lat.mean()), "n": n, "bytes": nbytes, "wall_s": wall, "backend": backend,
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
                proc = subprocess.run([sys.executable, str(GPU_BENCH), "--put-flag-child", str(n),
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
