"""IBGDA posting cost on a GPU, against a null NIC: what the GPU spends to hand work to a ConnectX itself.

    python benchmarks/ibgda_bench.py --json ibgda_bench.json [--quick]

The queue (send queue, CQ, doorbell records, a stand-in UAR page) is pinned host memory mapped into the
GPU, as with the soft NIC; a host thread (``ibgda_null_nic.cpp``) plays the NIC: it watches the doorbell
record, completes every WQE at once and writes the CQEs asked for. So the numbers are the device code's
own cost — WQE build and store over PCIe, slot claim, doorbell ticket, doorbell record, doorbell, CQ
polling — not a transport's. On a real ConnectX the UAR is MMIO and the queue may live in GPU memory;
expect the doorbell to cost more and the WQE stores less.

single   one thread, n ops back to back: ns per put (1 WQE), put_signal (2, or 3 in fence mode), signal,
         and the warp-aggregated warp_put / warp_put_signal called by one lane alone (their overhead);
         then the quiet that drains them
warp     one warp of 32 threads, n ops each: ns per op of put / put_signal (32 posters on one ticket)
         beside warp_put / warp_put_signal (one claim and one doorbell per warp call)
rtt      one thread, (put, quiet) n times: the GPU -> host NIC -> CQE -> GPU round trip
many     132 x 128 threads on one QP, 8 ops each: ops/s, WQEs/s and WQEs per doorbell, per-thread calls (the
         doorbell ticket serialises them) beside the warp-aggregated ones, in the same run
versus   IBGDA against the proxy path in one run, same kernels (gpu_push.cu, built with and without
         -DTPD_IBGDA), two daemons over softverbs RC, at 1, 32 and 132 x 128 = 16896 posting threads (8 x 32
         in --quick): commands/s of 64-byte puts (one thread; thread 0 of 32 blocks; every thread of 132
         blocks of 128), put -> flag p50/p99 of 4 KiB from one thread, and their ratios (ibgda over proxy),
         with buffers and flags in pinned host memory (the headline; every row) and in GPU memory (bound by
         softverbs' GPU copies; latency and the 32-thread rate). A row posts at most VERSUS_CAP puts, one a
         thread at 16896, and launches again only while its launches took under 4 s, so the soft mlx5
         queue's rows finish. Over softverbs both transports are Python (the proxy loop; the client's soft
         mlx5 queue), so the ratio says what taking the proxy out of the path saves here, not what a
         ConnectX would do.
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import click
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import gpuclient  # noqa: E402
from benchmarks.gpu_common import Gpu  # noqa: E402
from benchmarks.gpu_flag import RateRow, put_to_flag  # noqa: E402
from ibgda.channel_tables import build_channel  # noqa: E402
from ibgda.device_handle import QP_STATE_DTYPE, QUEUE_PAIR_DTYPE, SignalMode  # noqa: E402
from ibgda.queue_memory import QueueMemory  # noqa: E402

HERE = Path(__file__).resolve().parent
KERNELS = HERE / "ibgda_kernels.cu"
NULL_NIC = HERE / "ibgda_null_nic.cpp"
QPN = 0x4242
REGION = 1 << 40  # the null NIC moves nothing: regions are only checked, never touched
OPS = {"put": 0, "put_signal": 1, "signal": 2, "warp_put": 3, "warp_put_signal": 4}
POSTING = ("put", "put_signal", "warp_put", "warp_put_signal")  # the warp and many rows


def wqes_per_op(op: str, mode: SignalMode) -> int:
    """WQEs one op posts (channel.cuh): fence mode adds the ordering read before a flag write."""
    fence = mode == SignalMode.FENCE
    return {"put": 1, "signal": 2 if fence else 1, "put_signal": 3 if fence else 2}[op.removeprefix("warp_")]


def build_null_nic(out_dir: Path) -> ctypes.CDLL:
    cxx = shutil.which("g++") or shutil.which("c++")
    if not cxx:
        raise SystemExit("a C++ compiler (g++) is needed for the null NIC")
    lib = out_dir / "libibgda_null_nic.so"
    includes = [f"-I{d}" for d in gpuclient.get_include_dirs()]
    subprocess.run([cxx, "-std=c++17", "-O2", "-fPIC", "-shared", "-pthread", *includes, str(NULL_NIC), "-o", str(lib)],
                   check=True)
    nic = ctypes.CDLL(str(lib))
    nic.tpd_null_nic_start.restype = ctypes.c_void_p
    nic.tpd_null_nic_start.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_uint32] * 3
    nic.tpd_null_nic_stop.restype = ctypes.c_uint64
    nic.tpd_null_nic_stop.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_uint64)]
    return nic


class Setup:
    """One queue in mapped host memory, a channel over it in GPU memory, the null NIC running."""

    def __init__(self, nic: ctypes.CDLL, mode: SignalMode, wqe_cnt: int) -> None:
        from gpuclient.cuda_memory import DeviceMemory, map_host

        self.nic = nic
        self.mem = QueueMemory(wqe_cnt, wqe_cnt, with_uar_page=True)
        self.mapping = map_host(self.mem.base, self.mem.nbytes, 0)
        self.blocks: list[Any] = []

        def alloc(image: bytes) -> int:
            m = DeviceMemory(max(len(image), 8), 0)
            m.write(0, image)
            self.blocks.append(m)
            return m.ptr

        dev = self.mapping.device_ptr
        qp = np.zeros(1, dtype=QUEUE_PAIR_DTYPE)
        for name, addr in self.mem.addresses().items():
            qp[name] = dev + (addr - self.mem.base)
        qp["qpn"], qp["wqe_cnt"], qp["ncqes"], qp["scratch"], qp["scratch_lkey"] = QPN, wqe_cnt, wqe_cnt, 0x1000, 1
        self.flags = DeviceMemory(64, 0)
        self.out = DeviceMemory(16, 0)
        tables = build_channel(rank=0, world=2, alloc=alloc, signal_mode=mode, flags=self.flags.ptr, flag_count=8,
                               queue_pairs={1: qp}, local_regions=[(0x10000, REGION, 1)],
                               remote_regions={1: [(0x20000, REGION, 2)]}, remote_flags={1: (0x40000, 64, 3)})
        self.arg = tables.record.tobytes()
        self.state = next(m for m in self.blocks if m.ptr == tables.qp_states[1])
        a = self.mem.addresses()
        self.handle = nic.tpd_null_nic_start(a["sq"], a["dbrec"], a["cq"], a["cq_dbrec"], QPN, wqe_cnt, wqe_cnt)

    def read_out(self) -> np.ndarray:
        return np.frombuffer(self.out.read(0, 16), dtype=np.uint64)

    def rings(self) -> int:
        """Doorbells rung so far (QpState.rings)."""
        return int(np.frombuffer(self.state.read(0, QP_STATE_DTYPE.itemsize), dtype=QP_STATE_DTYPE)[0]["rings"])

    def close(self) -> tuple[int, int]:
        cqes = ctypes.c_uint64()
        wqes = self.nic.tpd_null_nic_stop(self.handle, ctypes.byref(cqes))
        for m in [*self.blocks, self.flags, self.out]:
            m.free()
        self.mapping.unmap()
        return int(wqes), int(cqes.value)


def run(quick: bool = False, echo: Any = print) -> dict[str, Any]:
    from gpuclient.cuda_memory import check, driver, use_device

    use_device(0)
    drv = driver()
    module = gpuclient.compile(KERNELS.read_text(), device=0, name="ibgda_kernels.cu")
    n_single, n_warp, n_rtt, n_many = (200, 50, 100, 4) if quick else (20000, 2000, 5000, 8)
    grid, block = (8, 32) if quick else (132, 128)
    results: dict[str, Any] = {"single": {}, "warp": {}, "rtt": {}, "many": {}}
    with tempfile.TemporaryDirectory() as tmp:
        nic = build_null_nic(Path(tmp))
        for mode in SignalMode:
            for op in OPS:
                s = Setup(nic, mode, 1024)
                try:
                    module.function("bench_single").launch(1, 1, (s.arg, np.uint32(1), np.int32(n_single),
                                                                  np.int32(OPS[op]), np.uint32(4096),
                                                                  np.uint64(s.out.ptr)))
                    check(drv.cuCtxSynchronize(), "bench_single")
                    post_ns, quiet_ns = (int(x) for x in s.read_out())
                finally:
                    wqes, cqes = s.close()
                key = f"{op}/{mode.name.lower()}"
                results["single"][key] = {"ns_per_op": post_ns / n_single, "quiet_ns": quiet_ns, "wqes": wqes,
                                          "cqes": cqes, "wqes_per_op": wqes_per_op(op, mode)}
                echo(f"single  {key:22s} {post_ns / n_single:9.1f} ns/op   quiet {quiet_ns / 1e3:8.1f} us   "
                     f"{wqes} WQEs, {cqes} CQEs")
        for mode in SignalMode:
            for op in POSTING:
                s = Setup(nic, mode, 1024)
                try:
                    module.function("bench_single").launch(1, 32, (s.arg, np.uint32(1), np.int32(n_warp),
                                                                   np.int32(OPS[op]), np.uint32(4096),
                                                                   np.uint64(s.out.ptr)))
                    check(drv.cuCtxSynchronize(), "bench_single (one warp)")
                    post_ns, _ = (int(x) for x in s.read_out())
                    rings = s.rings()
                finally:
                    wqes, _ = s.close()
                key = f"{op}/{mode.name.lower()}"
                per_op = post_ns / (n_warp * 32)
                results["warp"][key] = {"ns_per_op": per_op, "wqes": wqes, "doorbells": rings,
                                        "wqes_per_doorbell": wqes / max(rings, 1)}
                echo(f"warp    {key:22s} {per_op:9.1f} ns/op   {wqes / max(rings, 1):6.1f} WQEs/doorbell (32 lanes)")
        s = Setup(nic, SignalMode.WRITE, 1024)
        try:
            module.function("bench_round_trip").launch(1, 1, (s.arg, np.uint32(1), np.int32(n_rtt), np.uint32(64),
                                                              np.uint64(s.out.ptr)))
            check(drv.cuCtxSynchronize(), "bench_round_trip")
            rtt = int(s.read_out()[0]) / n_rtt
        finally:
            s.close()
        results["rtt"] = {"ns_per_round": rtt}
        echo(f"rtt     put + quiet            {rtt:9.1f} ns/round")
        for mode in SignalMode:
            for op in POSTING:
                s = Setup(nic, mode, 4096)
                try:
                    s.out.write(0, np.array([2**64 - 1, 0], dtype=np.uint64).tobytes())
                    module.function("bench_many").launch(grid, block, (s.arg, np.uint32(1), np.int32(n_many),
                                                                       np.int32(OPS[op]), np.uint32(4096),
                                                                       np.uint64(s.out.ptr)))
                    check(drv.cuCtxSynchronize(), "bench_many")
                    start, end = (int(x) for x in s.read_out())
                    rings = s.rings()
                finally:
                    wqes, _ = s.close()
                ops = grid * block * n_many
                secs = (end - start) / 1e9
                key = f"{op}/{mode.name.lower()}"
                results["many"][key] = {"ops_per_s": ops / secs, "wqes_per_s": wqes / secs, "threads": grid * block,
                                        "doorbells": rings, "wqes_per_doorbell": wqes / max(rings, 1)}
                echo(f"many    {key:22s} {ops / secs / 1e6:9.2f} M ops/s  {wqes / secs / 1e6:8.2f} M WQEs/s "
                     f"{wqes / max(rings, 1):6.1f} WQEs/doorbell ({grid}x{block} threads)")
    vs = results["versus"] = versus_proxy(quick, echo)
    results["summary"] = {
        "put_ns_1thread": results["single"]["put/write"]["ns_per_op"],
        "put_signal_ns_1thread_write": results["single"]["put_signal/write"]["ns_per_op"],
        "put_signal_ns_1thread_atomic": results["single"]["put_signal/atomic"]["ns_per_op"],
        "put_signal_ns_1thread_fence": results["single"]["put_signal/fence"]["ns_per_op"],
        "put_quiet_rtt_ns": rtt,
        "many_put_mops": results["many"]["put/write"]["ops_per_s"] / 1e6,
        "many_wqes_mps_put_signal_write": results["many"]["put_signal/write"]["wqes_per_s"] / 1e6,
        "warp_put_ns_1thread": results["single"]["warp_put/write"]["ns_per_op"],
        "warp_put_signal_ns_1thread_write": results["single"]["warp_put_signal/write"]["ns_per_op"],
        "warp32_put_ns_per_op": results["warp"]["put/write"]["ns_per_op"],
        "warp32_warp_put_ns_per_op": results["warp"]["warp_put/write"]["ns_per_op"],
        "many_warp_put_mops": results["many"]["warp_put/write"]["ops_per_s"] / 1e6,
        "many_warp_put_signal_mops_write": results["many"]["warp_put_signal/write"]["ops_per_s"] / 1e6,
        "many_warp_put_over_put": results["many"]["warp_put/write"]["ops_per_s"]
        / results["many"]["put/write"]["ops_per_s"],
        **vs["summary"],
    }
    return results


VERSUS_CAP = 1024  # puts per versus rate row (--quick: 128): the soft mlx5 queue posts a few thousand a second
VERSUS_THREADS = (1, 32, 132 * 128)
VERSUS_WHERES = ("pinned", "device")


def versus_rows(quick: bool) -> list[Any]:
    """The rate rows of the versus section (gpu_flag.RateRow): one thread; thread 0 of each of 32 blocks
    (the row earlier runs measured); every thread of 132 blocks of 128 (8 of 32 in --quick). Each thread
    posts cap // threads puts, at least one."""
    cap = 128 if quick else VERSUS_CAP
    shapes = ((1, 1), (32, 1), (8, 32) if quick else (132, 128))
    return [RateRow(blocks=b, threads=t, per_thread=max(1, cap // (b * t))) for b, t in shapes]


def versus_rows_table(out: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per placement and thread count measured on both paths: commands/s and their ratio; the
    one-thread rows also carry put -> flag p50/p99 and the p50 ratio."""
    rows = []
    for where in VERSUS_WHERES:
        ring, gda = out["ring"].get(where), out["ibgda"].get(where)
        if not ring or not gda:
            continue
        by_threads = {r["threads"]: r for r in gda.get("rates", [])}
        threads = [r["threads"] for r in ring.get("rates", []) if r["threads"] in by_threads]
        if 1 not in threads:
            threads = [1, *threads]  # put -> flag is one thread's even without a one-thread rate row
        for t in threads:
            p = next((r for r in ring.get("rates", []) if r["threads"] == t), None)
            g = by_threads.get(t)
            row: dict[str, Any] = {"where": where, "threads": t}
            if p and g:
                row.update(blocks=p["blocks"], threads_per_block=p["threads_per_block"], commands=p["commands"],
                           proxy_commands_per_s=p["commands_per_s"], ibgda_commands_per_s=g["commands_per_s"],
                           commands_per_s_ratio_ibgda_over_proxy=g["commands_per_s"] / p["commands_per_s"])
            if t == 1:
                row.update(proxy_put_to_flag_p50_us=ring["p50_us"], proxy_put_to_flag_p99_us=ring["p99_us"],
                           ibgda_put_to_flag_p50_us=gda["p50_us"], ibgda_put_to_flag_p99_us=gda["p99_us"],
                           put_to_flag_p50_ratio_ibgda_over_proxy=gda["p50_us"] / ring["p50_us"])
            rows.append(row)
    return rows


def versus_lines(rows: list[dict[str, Any]]) -> list[str]:
    """The versus rows as a Markdown table."""
    lines = ["| buffers / flags | threads | proxy commands/s | IBGDA commands/s | IBGDA / proxy | "
             "put -> flag p50 / p99 µs, proxy | IBGDA | IBGDA / proxy (p50) |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        cells = [r["where"], f"{r['threads']} ({r['blocks']}x{r['threads_per_block']})" if "blocks" in r
                 else str(r["threads"])]
        cells += ([f"{r['proxy_commands_per_s']:.0f}", f"{r['ibgda_commands_per_s']:.0f}",
                   f"{r['commands_per_s_ratio_ibgda_over_proxy']:.2f}"] if "commands" in r else ["", "", ""])
        cells += ([f"{r['proxy_put_to_flag_p50_us']:.1f} / {r['proxy_put_to_flag_p99_us']:.1f}",
                   f"{r['ibgda_put_to_flag_p50_us']:.1f} / {r['ibgda_put_to_flag_p99_us']:.1f}",
                   f"{r['put_to_flag_p50_ratio_ibgda_over_proxy']:.2f}"] if "proxy_put_to_flag_p50_us" in r
                  else ["", "", ""])
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def versus_summary(out: dict[str, Any]) -> dict[str, float]:
    """The headline numbers (pinned buffers and flags): one thread's put -> flag, commands/s at each thread
    count and their ratios; the unsuffixed commands/s keys are the 32-thread row, as in earlier runs."""
    ring, gda = out["ring"]["pinned"], out["ibgda"]["pinned"]
    summary = {
        "proxy_put_to_flag_p50_us": ring["p50_us"], "proxy_put_to_flag_p99_us": ring["p99_us"],
        "ibgda_put_to_flag_p50_us": gda["p50_us"], "ibgda_put_to_flag_p99_us": gda["p99_us"],
        "put_to_flag_p50_ratio_ibgda_over_proxy": gda["p50_us"] / ring["p50_us"],
    }
    for row in versus_rows_table(out):
        if row["where"] != "pinned" or "commands" not in row:
            continue
        t = row["threads"]
        summary[f"proxy_commands_per_s_{t}_threads"] = row["proxy_commands_per_s"]
        summary[f"ibgda_commands_per_s_{t}_threads"] = row["ibgda_commands_per_s"]
        summary[f"commands_per_s_ratio_ibgda_over_proxy_{t}_threads"] = row["commands_per_s_ratio_ibgda_over_proxy"]
        if t == 32:
            summary["proxy_commands_per_s"] = row["proxy_commands_per_s"]
            summary["ibgda_commands_per_s"] = row["ibgda_commands_per_s"]
            summary["commands_per_s_ratio_ibgda_over_proxy"] = row["commands_per_s_ratio_ibgda_over_proxy"]
    return summary


def versus_proxy(quick: bool, echo: Any) -> dict[str, Any]:
    """The same kernels on the proxy path and on the IBGDA path (see ``versus`` in the module doc)."""
    t0 = time.monotonic()
    gpu = Gpu(0)
    n = 50 if quick else 200
    rows = versus_rows(quick)
    rates = {"pinned": rows, "device": [r for r in rows if r.posters == 32]}
    out: dict[str, Any] = {}
    for kind in ("ring", "ibgda"):
        out[kind] = put_to_flag(gpu, n, 4096, kind=kind, wheres=VERSUS_WHERES, rates=rates)
        for where, r in out[kind].items():
            echo(f"versus  {kind:5s} {where:6s} put -> flag p50 {r['p50_us']:8.1f} us  p99 {r['p99_us']:8.1f} us "
                 "(1 thread, 4 KiB)")
            for rr in r.get("rates", []):
                echo(f"versus  {kind:5s} {where:6s} {rr['threads']:6d} threads {rr['commands_per_s']:10.0f} commands/s "
                     f"({rr['commands']} commands, best of {rr['reps']}, {rr['seconds_all']:.2f} s in all)")
    out["rows"] = versus_rows_table(out)
    out["summary"] = versus_summary(out)
    out["wall_s"] = time.monotonic() - t0
    for line in versus_lines(out["rows"]):
        echo(line)
    echo(f"versus  {out['wall_s']:.1f} s")
    return out


@click.command()
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="write the results here")
@click.option("--quick", is_flag=True, help="a few iterations (a smoke test)")
@click.option("--only-versus", is_flag=True, help="only IBGDA against the proxy path (no null-NIC runs)")
@click.option("--no-mps", is_flag=True, help="run without CUDA MPS (as TRANSPORTD_GPU_MPS=0)")
def main(json_path: str | None, quick: bool, only_versus: bool, no_mps: bool) -> None:
    from transportd_cli.mps import DISABLE_ENV, Mps

    t0 = time.monotonic()
    if no_mps:
        os.environ[DISABLE_ENV] = "0"
    # MPS before this process (and the daemons it starts) makes a CUDA context: softverbs' copies into GPU
    # memory then measure the transport, not time slices
    with Mps() as mps:
        click.echo(mps.describe())
        if only_versus:
            vs = versus_proxy(quick, click.echo)
            results = {"versus": vs, "summary": vs["summary"]}
        else:
            results = run(quick=quick, echo=click.echo)
    results["mps"] = mps.describe()
    results["wall_s"] = time.monotonic() - t0
    click.echo(mps.describe())
    click.echo(f"{results['wall_s']:.1f} s in all")
    click.echo(json.dumps(results["summary"], indent=2))
    if json_path:
        Path(json_path).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
