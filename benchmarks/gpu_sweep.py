"""Round trips under load, the thread sweep: ``gpu_bench.py``'s sweep rows, and all of ``--only-sweep``
(``run_sweep_only``).

Over GPU threads (1, 32, 64, 128, 256, 512, 1024), every thread pushes a record and waits until the completion
position passes its own before the next push; avg / p50 / p99 round trip and M ops/s, all on the GPU's clock.
The ring is drained by the rail worker's own loop (``worker.serve_loop``: the engine's ``serve``, GIL released)
over the engine as its own null NIC, poll window 0 (``--sweep-poll-window-us``), records spread over 8 peers.
``--only-sweep`` also runs ``transportd bench proxy``'s drain beside the bare C consumer in the same run
(``drain_rows``); ``--sweep-compare`` adds the bare C consumer, one poller a warp, the warp-cooperative push,
per-word-parity records (bare consumer only; ``parity_fenced`` with the system fence a record shipping fresh
data needs, which header-last's release already is), and the threads spread over 2 and 4 rings
(``split_ring_sweep``: a bare consumer a ring, a worker a ring, one worker for all of them).
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
from typing import Any

import numpy as np

from benchmarks.gpu_common import (
    DEFAULT_VARIANT,
    NULL_NIC_JOB,
    PARITY,
    Gpu,
    library_commit_variant,
    null_nic_proxy,
    percentile,
    ring_file,
)
from benchmarks.gpu_push_cost import pcie_read
from cmd_ring import RingFile
from gpuclient.cuda_memory import DeviceMemory
from gpuclient.device_channel import DeviceRing, map_ring
from transportd import _core
from transportd_cli.bench_proxy import _worker_loop

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
    proxy = null_nic_proxy(peers, poll_window_us, max_take) if consumer == "worker" else None
    rows: dict[str, Any] = {}
    name = f"roundtrip_sweep_{'warppush_' if push == 'warp' else '' if wait == 'thread' else wait + 'wait_'}{variant}"
    with ring_file(f"sweep-{variant}", capacity) as ring:
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
        files = [stack.enter_context(ring_file(f"split-{i}", capacity)) for i in range(rings)]
        if consumer != "bare":
            proxies = [null_nic_proxy(peers) for _ in (files if consumer == "workers" else files[:1])]
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
            "avg_us": float(us.mean()) if len(us) else float("nan"), "p50_us": percentile(us, 50),
            "p99_us": percentile(us, 99), "max_us": float(us.max()) if len(us) else float("nan"),
            "push_p50_us": percentile(push_us, 50),
            "mops": len(us) / window_ns * 1e3 if window_ns > 0 else float("nan")}


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


def run_sweep_only(quick: bool, threads: tuple[int, ...], iters: int, poll_window_us: float,
                   compare: bool = False, echo: Any = print, waits: tuple[str, ...] = SWEEP_WAITS,
                   max_takes: tuple[int, ...] = SWEEP_COMPARE_MAX_TAKE, cpu: int | None = None) -> dict[str, Any]:
    """``--only-sweep``: the round-trip sweep and, in the same run, ``bench proxy``'s drain beside the bare C
    consumer: every row the loop's targets name, without the put -> flag table (no daemons, no MPS). With
    ``compare``, the same sweep again for every other (consumer, wait) pair: what the ring and the GPU's
    polling cost without the engine, and with one poller a warp (``waits`` and ``max_takes`` narrow it). With
    ``cpu``, the worker's sweep again with its loop alone on that CPU, and the bare consumer's likewise."""
    gpu = Gpu(0)
    library = DEFAULT_VARIANT[library_commit_variant()]
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
