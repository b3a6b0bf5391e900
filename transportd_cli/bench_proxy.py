"""`transportd bench proxy` and `transportd bench signals`: the proxy alone, ring -> post, with the null NIC.

proxy
    (a) drain: pre-filled rings, one proxy (one worker), until every record has completed: the compiled
        engine with its own null NIC (nothing leaves C), the engine over the Python null backend, and the
        numpy model (:mod:`transportd_models.engine`) in the same run, beside a bare numpy
        ``consume_ready`` loop and a bare C consumer (``_core.bare_drain``: take, release, complete, no
        validation or posting) over the same kind of ring;
    (b) live: a producer process pushes records while the proxy drains them, unpaced (rate, latency under
        load) and paced (record-to-post latency when the proxy keeps up). The producer stamps each batch
        with CLOCK_MONOTONIC in ``signal_value`` (as ``cmd_ring.loadgen`` does) and saves the stamps; the
        null backend logs when each chunk was posted; both processes read the same clock.
    (t) with ``--trace``: the core drain and the one-record round trip again with the trace recorder on
        for the drained rank (``transportd/core/trace.h``: every record written to a part file), beside
        the same runs with it off, which is the one branch per channel per pass every untraced channel pays;
    (c) idle: the rail worker's own loop (``rail.serve_loop``: the engine's serve loop, with a real worker
        link that stays quiet)
        sits idle; a producer process commits one record after each second of silence. Reported: the
        loop thread's CPU use while idle, and each first record's record -> posted latency.
    (e) bursts: a C producer thread commits 1, 32 or 128 records back to back and waits for the completion
        position to pass the last, again and again, against the rail worker's own loop (as in (c)) and
        against the bare C consumer: each burst's round trip, p50 / p99. The CPU's twin of
        ``benchmarks/gpu_bench.py``'s thread sweep, where the GPU's warps are the producer.
signals
    The same stream of PUT_SIGNALs to a few destinations, through a naive proxy (one signal per command)
    and a decoupled one (one per destination and flag per batch): signals and fences per destination per
    batch, WRs per command, proxy stalls, and a check that the receivers' flags end up equal.

Numbers from a shared machine are noisy: compare the ratios printed in one run.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing as mp
import os
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import click
import numpy as np

from cmd_ring.loadgen import TIMESTAMP_FIELD
from cmd_ring.record import RECORD_DTYPE, Opcode
from cmd_ring.ring import RingConsumer, RingFile, RingProducer
from transportd import _core
from transportd.backends.interface import PlanOp
from transportd.backends.null import NullBackend, apply_plans
from transportd.dataplane.link_messages import Stop
from transportd.dataplane.proxy import Proxy
from transportd.dataplane.worker import DEEP_NAP_S, serve_loop
from transportd.dataplane.worker_link import WorkerEndpoint
from transportd.limits import MAX_BATCH, MAX_INFLIGHT_CAP, MAX_TAKE, MIN_BATCH, MIN_INFLIGHT_CAP, MIN_TAKE
from transportd_cli.cli_options import FiniteFloat
from transportd_models.engine import ModelProxy

__all__ = ["bench_proxy", "bench_signals", "run_proxy_benchmark", "run_signals_benchmark"]

JOB = "bench"
REGION = 1 << 30
LENGTH = 4096


def _setup(proxy: Proxy, peers: int, ranks: int = 1) -> None:
    """One job: local ranks 0..ranks-1, remote peers ranks..ranks+peers-1, one connection per peer."""
    for rank in range(ranks):
        proxy.set_source_region(JOB, rank, 0, 0x1000_0000 * (rank + 1), REGION, 1 + rank)
    for peer in range(ranks, ranks + peers):
        proxy.set_remote_region(JOB, peer, 0, 0x100_0000_0000 * peer, REGION, 100 + peer)
        proxy.set_remote_flags(JOB, peer, 0xF00_0000_0000 + 0x1_0000 * peer, 64, 200 + peer)
        proxy.bind_peer(JOB, peer, 1000 + peer)


def put_records(start: int, count: int, peers: int, first_peer: int = 1) -> np.ndarray:
    """``count`` PUTs of LENGTH bytes, round-robin over the peers, chunk ids from ``start``."""
    idx = np.arange(start, start + count, dtype=np.uint64)
    recs = np.zeros(count, dtype=RECORD_DTYPE)
    recs["opcode"] = Opcode.PUT
    recs["peer"] = first_peer + idx % np.uint64(peers)
    recs["length"] = LENGTH
    recs["src_off"] = idx * np.uint64(LENGTH) % np.uint64(REGION)
    recs["dst_off"] = recs["src_off"]
    recs["chunk_id"] = idx.astype(np.uint32)
    return recs


def _ring_name(tag: str) -> str:
    return f"tpd-bench-{tag}-{os.getpid()}-{time.monotonic_ns() % 1_000_000}"


def _drain_until(proxy: Proxy, rings: list[RingFile], target: int, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    run_once = proxy.run_once
    while any(r.completion_pos < target for r in rings):
        run_once()
        if time.monotonic() > deadline:
            raise click.ClickException(f"proxy did not drain in {timeout_s}s: {proxy.stats()}")


# --- proxy: drain ------------------------------------------------------------------------------------------
# What drains the rings: the engine with its own null NIC (nothing leaves C), the engine posting through the
# Python null backend (one Python call each way per pass), and the numpy model over the Python null backend.
ENGINES = ("core", "core_python_nic", "model")


def _make_proxy(engine: str, opts: dict[str, Any], **backend_opts: Any) -> tuple[Any, NullBackend | None]:
    if engine == "core":
        return Proxy(None, **opts), None
    backend = NullBackend(**backend_opts)
    return (Proxy if engine == "core_python_nic" else ModelProxy)(backend, **opts), backend


def _drain(capacity: int, repeats: int, peers: int, channels: int, opts: dict[str, Any],
           engine: str = "core", trace: bool = False) -> dict[str, Any]:
    rings = [RingFile.create(_ring_name(f"drain{i}"), capacity) for i in range(channels)]
    tmp = tempfile.TemporaryDirectory() if trace else None
    traced: dict[str, Any] = {}
    try:
        proxy, _ = _make_proxy(engine, opts)
        _setup(proxy, peers)
        for i, ring in enumerate(rings):
            proxy.add_channel(i, ring, JOB, 0, peers + 1)
        if tmp is not None:
            proxy.trace_start(JOB, 0, str(Path(tmp.name) / "drain"))
        producers = [RingProducer(r) for r in rings]
        rates = []
        for rep in range(repeats):
            for p in producers:
                p.push_records(put_records(rep * capacity, capacity, peers))
            t0 = time.perf_counter()
            _drain_until(proxy, rings, (rep + 1) * capacity)
            rates.append(channels * capacity / (time.perf_counter() - t0))
        stats = proxy.stats()
        if tmp is not None:
            traced = _trace_summary(proxy.trace_stop(JOB, 0), channels * capacity * repeats)
    finally:
        for ring in rings:
            ring.close()
            ring.unlink()
        if tmp is not None:
            tmp.cleanup()
    return {"engine": engine, **traced, "records_per_s": max(rates), "records_per_s_median": float(np.median(rates)),
            "records_per_s_min": min(rates), "repeats": repeats, "capacity": capacity, "channels": channels,
            "peers": peers, "batch_hist": stats["batch_hist"], "stalls": stats["stalls"],
            "iterations": stats["iterations"]}


def _drain_loop(capacity: int, repeats: int, peers: int, opts: dict[str, Any]) -> dict[str, Any]:
    """The drain again, through the rail worker's own loop (``rail.serve_loop``, all in C) instead of passes
    called one by one from Python (each of which pays a Python call and a lock, ~3 us here, which is what a
    small ``max_take`` multiplies): the ring is filled, the loop started, and the rate timed between its
    first and last post (the engine's post log) so the thread's start is not counted."""
    with RingFile.create(_ring_name("loopdrain"), capacity) as ring:
        proxy = Proxy(None, **opts)
        proxy.log_posts(capacity * repeats)
        _setup(proxy, peers)
        proxy.add_channel(0, ring, JOB, 0, peers + 1)
        producer = RingProducer(ring)
        for rep in range(repeats):
            producer.push_records(put_records(rep * capacity, capacity, peers))
            with _worker_loop(proxy):
                deadline = time.monotonic() + 120
                while ring.completion_pos < (rep + 1) * capacity:
                    if time.monotonic() > deadline:
                        raise click.ClickException(f"the worker loop did not drain in 120 s: {proxy.stats()}")
                    time.sleep(1e-4)
        post_t, chunks = proxy.post_log()
    if len(chunks) != capacity * repeats:
        raise click.ClickException(f"worker-loop drain: {len(chunks)} of {capacity * repeats} posts logged")
    rates = []
    for rep in range(repeats):
        t = post_t[(chunks >= rep * capacity) & (chunks < (rep + 1) * capacity)]
        rates.append(float((capacity - 1) / ((t.max() - t.min()) / 1e9)))
    return {"engine": "core", "loop": "worker", "records_per_s": max(rates),
            "records_per_s_median": float(np.median(rates)), "repeats": repeats, "capacity": capacity,
            "peers": peers, "max_take": opts.get("max_take", 4096)}


def _trace_summary(stopped: dict[str, Any], expected: int) -> dict[str, Any]:
    """What a traced run's recorders wrote; every record taken must be there."""
    if stopped["written"] != expected or stopped["dropped"]:
        raise click.ClickException(f"trace: {stopped['written']} of {expected} records written "
                                   f"({stopped['dropped']} dropped: {stopped['write_errors']})")
    return {"traced": True, "trace_entries": stopped["written"]}


def _bare_drain(capacity: int, repeats: int, peers: int) -> float:
    """The numpy ceiling: ``consume_ready`` alone over the same pre-filled ring."""
    with RingFile.create(_ring_name("bare"), capacity) as ring:
        producer, consumer = RingProducer(ring), RingConsumer(ring)
        rates = []
        for rep in range(repeats):
            producer.push_records(put_records(rep * capacity, capacity, peers))
            taken = 0
            t0 = time.perf_counter()
            while taken < capacity:
                taken += len(consumer.consume_ready(4096))
            rates.append(capacity / (time.perf_counter() - t0))
    return max(rates)


def _bare_c_drain(capacity: int, repeats: int, peers: int) -> float:
    """The compiled ceiling: ``_core.bare_drain``, a C loop that takes each committed record (seq read, record
    copied out), releases the slots and publishes the completion position, and does nothing else."""
    with RingFile.create(_ring_name("barec"), capacity) as ring:
        producer = RingProducer(ring)
        rates = []
        for rep in range(repeats):
            producer.push_records(put_records(rep * capacity, capacity, peers))
            t0 = time.perf_counter()
            reached = _core.bare_drain(ring._bytes, (rep + 1) * capacity, 10.0)
            rates.append(capacity / (time.perf_counter() - t0))
            if reached != (rep + 1) * capacity:
                raise click.ClickException(f"the bare C consumer stopped at {reached}")
    return max(rates)


# --- proxy: live producer ----------------------------------------------------------------------------------
def produce_stamped(ring_name: str, total: int, peers: int, max_batch: int, interval_ns: int,
                    stamps_path: str) -> None:
    """Producer process: push ``total`` PUTs in batches of 1..max_batch, each batch stamped when pushed."""
    rng = np.random.default_rng(11)
    ring = RingFile.attach(ring_name)
    producer = RingProducer(ring)
    stamps = np.zeros(total, dtype=np.int64)
    sent = 0
    next_due = time.monotonic_ns()
    while sent < total:
        if interval_ns:
            while time.monotonic_ns() < next_due:
                pass
            next_due += interval_ns
        n = min(int(rng.integers(1, max_batch + 1)), total - sent)
        batch = put_records(sent, n, peers)
        now = time.monotonic_ns()
        batch[TIMESTAMP_FIELD] = now
        stamps[sent : sent + n] = now
        producer.push_records(batch, timeout=60.0)
        sent += n
    np.save(stamps_path, stamps)
    ring.close()


def produce_pingpong(ring_name: str, total: int, peers: int, stamps_path: str) -> None:
    """Producer process: one PUT at a time, committed by compiled stores, each waiting for its completion."""
    ring = RingFile.attach(ring_name)
    stamps = np.zeros(total, dtype=np.int64)
    done = _core.pingpong_produce(ring._bytes, total, peers, LENGTH, stamps, 60.0)
    np.save(stamps_path, stamps[:done])
    ring.close()


def _post_log(proxy: Any, backend: NullBackend | None) -> tuple[np.ndarray, np.ndarray]:
    if backend is None:
        return proxy.post_log()
    backend.poll(0)
    return (np.concatenate([t for t, _ in backend.post_log]),
            np.concatenate([c for _, c in backend.post_log]).astype(np.int64))


def _live(total: int, capacity: int, peers: int, max_batch: int, interval_ns: int, opts: dict[str, Any],
          engine: str = "core", pingpong: bool = False, trace: bool = False) -> dict[str, Any]:
    """A producer process against a draining proxy; record -> posted latency from both processes' clocks."""
    name = _ring_name("live")
    traced: dict[str, Any] = {}
    with RingFile.create(name, capacity) as ring, tempfile.TemporaryDirectory() as tmp:
        stamps_path = str(Path(tmp) / "stamps.npy")
        proxy, backend = _make_proxy(engine, opts, log_posts=True)
        if backend is None:
            proxy.log_posts(total)
        _setup(proxy, peers)
        proxy.add_channel(0, ring, JOB, 0, peers + 1)
        if trace:
            proxy.trace_start(JOB, 0, str(Path(tmp) / "live"))
        target, args = ((produce_pingpong, (name, total, peers, stamps_path)) if pingpong else
                        (produce_stamped, (name, total, peers, max_batch, interval_ns, stamps_path)))
        proc = mp.get_context("spawn").Process(target=target, args=args)
        proc.start()
        try:
            deadline = time.monotonic() + 60
            while ring.consumer_pos == 0:
                proxy.run_once()
                if time.monotonic() > deadline or (not proc.is_alive() and proc.exitcode):
                    raise click.ClickException("the producer process did not start pushing")
            t0 = time.perf_counter()
            _drain_until(proxy, [ring], total, timeout_s=300)
            elapsed = time.perf_counter() - t0
            proc.join(60)
        finally:
            if proc.is_alive():
                proc.kill()
        stamps = np.load(stamps_path)
        stats = proxy.stats()
        post_t, chunks = _post_log(proxy, backend)
        if trace:
            traced = _trace_summary(proxy.trace_stop(JOB, 0), total)
    if len(chunks) != total or len(stamps) != total or not np.array_equal(np.sort(chunks), np.arange(total)):
        raise click.ClickException(f"live run: {len(chunks)} of {total} chunks posted (lost or duplicated)")
    lat_us = (post_t - stamps[chunks]) / 1e3
    return {
        "engine": engine, **traced, "pingpong": pingpong, "records": total, "capacity": capacity,
        "interval_ns": interval_ns, "max_batch": max_batch, "poll_window_us": opts.get("poll_window_us"),
        "records_per_s": total / elapsed if elapsed > 0 else float("nan"),
        "p50_us": float(np.percentile(lat_us, 50)), "p99_us": float(np.percentile(lat_us, 99)),
        "max_us": float(lat_us.max()), "batch_hist": stats["batch_hist"], "stalls": stats["stalls"],
    }


def produce_after_idle(ring_name: str, count: int, peers: int, idle_s: float, stamps_path: str) -> None:
    """Producer process: ``count`` times, stay silent ``idle_s`` (the idleness under test), then commit one PUT
    with compiled stores and wait for its completion."""
    ring = RingFile.attach(ring_name)
    stamps = np.zeros(count, dtype=np.int64)
    one = np.zeros(1, dtype=np.int64)
    done = 0
    for done in range(count):
        time.sleep(idle_s)
        if _core.pingpong_produce(ring._bytes, 1, peers, LENGTH, one, 60.0) != 1:
            break
        stamps[done] = one[0]
    else:
        done = count
    np.save(stamps_path, stamps[:done])
    ring.close()


@contextlib.contextmanager
def _worker_loop(proxy: Proxy, nap_us: float = DEEP_NAP_S * 1e6, cpu: int | None = None
                 ) -> Iterator[threading.Thread]:
    """The rail worker's own loop (``rail.serve_loop``: the engine's serve loop) over ``proxy`` in a thread,
    with a real worker link that stays quiet; stopped on exit, where an error the loop raised is raised
    again. Yields the thread (its CPU clock). ``cpu``: the loop's thread alone on that CPU, and every thread
    this process starts meanwhile (zmq's among them) off it."""
    import zmq

    mask = os.sched_getaffinity(0)
    if cpu is not None:
        os.sched_setaffinity(0, mask - {cpu})
    errors: list[BaseException] = []

    def run(link: WorkerEndpoint, stopping: Any) -> None:
        try:
            if cpu is not None:
                os.sched_setaffinity(0, {cpu})  # this thread alone
            serve_loop(proxy, link, stopping, nap_us / 1e6)
        except BaseException as exc:  # raised again on exit
            errors.append(exc)

    try:
        with tempfile.TemporaryDirectory() as tmp:
            ctx = zmq.Context()
            main_end = ctx.socket(zmq.PAIR)
            main_end.linger = 0
            main_end.bind(f"ipc://{tmp}/link")
            # the link only wakes the loop here: nothing is asked over it
            link = WorkerEndpoint(f"ipc://{tmp}/link", {Stop: lambda request: None})
            stop = threading.Event()
            loop = threading.Thread(target=run, args=(link, stop.is_set), name="worker")
            loop.start()
            try:
                yield loop
            finally:
                stop.set()
                proxy.interrupt()  # the loop runs in C until its link or this says otherwise
                loop.join(10)
                main_end.close()
                if loop.is_alive():  # its link and context stay open: closing them under it would hang
                    raise RuntimeError("the worker loop did not stop")
                link.close()
                ctx.term()
    finally:
        os.sched_setaffinity(0, mask)
    if errors:
        raise errors[0]


def _idle(count: int, idle_s: float, peers: int, opts: dict[str, Any], nap_us: float = DEEP_NAP_S * 1e6
          ) -> dict[str, Any]:
    """(c) above: the worker loop's idle CPU use and the latency of a record after ``idle_s`` of silence,
    with ``nap_us`` between the long-idle worker's looks at the ring headers."""
    name = _ring_name("idle")
    with RingFile.create(name, 4096) as ring, tempfile.TemporaryDirectory() as tmp:
        stamps_path = str(Path(tmp) / "stamps.npy")
        proxy = Proxy(None, **opts)
        proxy.log_posts(count)
        _setup(proxy, peers)
        proxy.add_channel(0, ring, JOB, 0, peers + 1)
        with _worker_loop(proxy, nap_us) as loop:
            cpu_clock = time.pthread_getcpuclockid(loop.ident)  # type: ignore[arg-type]
            proc = mp.get_context("spawn").Process(target=produce_after_idle,
                                                   args=(name, count, peers, idle_s, stamps_path))
            t0, c0 = time.monotonic(), time.clock_gettime(cpu_clock)
            proc.start()
            try:
                proc.join(count * (idle_s + 60) + 60)
            finally:
                wall, cpu = time.monotonic() - t0, time.clock_gettime(cpu_clock) - c0
                if proc.is_alive():
                    proc.kill()
        stamps = np.load(stamps_path)
        post_t, _chunks = proxy.post_log()
    if len(stamps) != count or len(post_t) != count:
        raise click.ClickException(f"idle run: {len(post_t)} of {count} records posted")
    lat_us = (post_t - stamps) / 1e3
    return {"records": count, "idle_s": idle_s, "nap_us": nap_us,
            "cpu_fraction": cpu / wall if wall > 0 else float("nan"),
            "first_record_us": [float(x) for x in lat_us], "p50_us": float(np.percentile(lat_us, 50)),
            "max_us": float(lat_us.max())}


# --- proxy: bursts -----------------------------------------------------------------------------------------
BURSTS = (1, 32, 128)  # records committed back to back before the producer waits (a thread, a warp, four)
BURST_CONSUMERS = ("worker", "bare")


def _bursts(burst: int, rounds: int, peers: int, opts: dict[str, Any], consumer: str = "worker") -> dict[str, Any]:
    """(e) above: a C producer commits ``burst`` PUTs back to back and waits for the completion position to
    pass the last, ``rounds`` times; each burst's round trip on the producer's clock. ``consumer``: the rail
    worker's own loop over the engine with its null NIC, or the bare C consumer (take, release, complete)."""
    if consumer not in BURST_CONSUMERS:
        raise ValueError(f"consumer must be one of {BURST_CONSUMERS}")
    rtt = np.zeros(rounds, dtype=np.int64)
    with RingFile.create(_ring_name("burst"), 4096) as ring:
        if consumer == "worker":
            proxy = Proxy(None, **opts)
            _setup(proxy, peers)
            proxy.add_channel(0, ring, JOB, 0, peers + 1)
            with _worker_loop(proxy):
                done = _core.burst_produce(ring._bytes, rounds, burst, peers, LENGTH, rtt, 60.0)
            loop = proxy.loop_stats()
        else:
            drainer = threading.Thread(target=_core.bare_drain, args=(ring._bytes, rounds * burst, 60.0))
            drainer.start()
            done = _core.burst_produce(ring._bytes, rounds, burst, peers, LENGTH, rtt, 60.0)
            drainer.join()
            loop = None
    if done != rounds:
        raise click.ClickException(f"bursts of {burst}: {done} of {rounds} completed ({consumer})")
    us = rtt[rounds // 10 :] / 1e3  # the first tenth warms the loop and the caches
    out = {"consumer": consumer, "burst": burst, "rounds": rounds, "p50_us": float(np.percentile(us, 50)),
           "p99_us": float(np.percentile(us, 99)), "records_per_s": float(burst * len(us) / us.sum() * 1e6)}
    if loop is not None:
        out["records_per_busy_pass"] = rounds * burst / max(loop["busy"], 1)
    return out


def run_proxy_benchmark(*, quick: bool = False, peers: int = 8, batch_max: int = 8, poll_window_us: float = 50.0,
                        inflight_cap: int = 256, channels: int = 1,
                        idle_naps_us: tuple[float, ...] = (DEEP_NAP_S * 1e6,), trace: bool = False,
                        max_take: int = 4096) -> dict[str, Any]:
    """All parts of ``bench proxy``; returns the JSON document (``trace``: also the traced runs, part t)."""
    opts = dict(batch_max=batch_max, poll_window_us=poll_window_us, inflight_cap=inflight_cap, max_take=max_take)
    capacity = 1 << (14 if quick else 16)
    repeats = 3 if quick else 5
    bare = _bare_drain(capacity, repeats, peers)
    bare_c = _bare_c_drain(capacity, repeats, peers)
    drains = {engine: _drain(capacity, repeats, peers, channels, opts, engine) for engine in ENGINES}
    loop_drain = _drain_loop(capacity, repeats, peers, opts)
    core, model = drains["core"], drains["model"]
    live = _live(50_000 if quick else 1_000_000, 4096, peers, 256, 0, opts)
    paced_total = 2_000 if quick else 20_000
    window0 = dict(opts, poll_window_us=0)
    paced = _live(paced_total, 4096, peers, 1, 50_000, window0)
    paced_window = _live(paced_total, 4096, peers, 1, 50_000, opts)
    pingpong = _live(5_000 if quick else 100_000, 4096, peers, 1, 0, window0, pingpong=True)
    pingpong_model = _live(500 if quick else 5_000, 4096, peers, 1, 0, window0, engine="model", pingpong=True)
    idles = [_idle(3 if quick else 10, 1.0, peers, window0, nap) for nap in idle_naps_us]
    bursts = {f"{consumer}_{size}": _bursts(size, 2_000 if quick else 20_000, peers, window0, consumer)
              for size in BURSTS for consumer in BURST_CONSUMERS}
    idle = idles[0]
    traced: dict[str, Any] = {}
    traced_summary: dict[str, Any] = {}
    if trace:
        traced = {"drain": _drain(capacity, repeats, peers, channels, opts, "core", trace=True),
                  "pingpong": _live(5_000 if quick else 100_000, 4096, peers, 1, 0, window0, pingpong=True,
                                    trace=True)}
        traced_summary = {
            "traced_commands_per_s": traced["drain"]["records_per_s"],
            "traced_vs_off": traced["drain"]["records_per_s"] / core["records_per_s"],
            "traced_pingpong_p50_us": traced["pingpong"]["p50_us"],
            "traced_pingpong_p99_us": traced["pingpong"]["p99_us"],
        }
    return {
        "benchmark": "proxy",
        "host": {"cpus": os.cpu_count()},
        "config": {**opts, "peers": peers, "channels": channels, "length": LENGTH},
        "summary": {
            "commands_per_s": core["records_per_s"],
            "worker_loop_commands_per_s": loop_drain["records_per_s"],
            "model_commands_per_s": model["records_per_s"],
            "core_vs_model": core["records_per_s"] / model["records_per_s"],
            "core_python_nic_commands_per_s": drains["core_python_nic"]["records_per_s"],
            "pingpong_p50_us": pingpong["p50_us"],
            "pingpong_p99_us": pingpong["p99_us"],
            "model_pingpong_p50_us": pingpong_model["p50_us"],
            "model_pingpong_p99_us": pingpong_model["p99_us"],
            "p50_us": paced["p50_us"],
            "p99_us": paced["p99_us"],
            "latency_poll_window_us": 0,
            "live_commands_per_s": live["records_per_s"],
            "proxy_vs_bare_consumer": core["records_per_s"] / bare,
            "proxy_vs_bare_c_consumer": core["records_per_s"] / bare_c,
            "idle_cpu_fraction": idle["cpu_fraction"],
            "after_idle_p50_us": idle["p50_us"],
            "after_idle_max_us": idle["max_us"],
            **{f"burst_{size}_p50_us": bursts[f"worker_{size}"]["p50_us"] for size in BURSTS},
            **{f"burst_{size}_p99_us": bursts[f"worker_{size}"]["p99_us"] for size in BURSTS},
            **traced_summary,
        },
        "bare_consumer_records_per_s": bare,
        "bare_c_consumer_records_per_s": bare_c,
        "drain": drains,
        "drain_worker_loop": loop_drain,
        "live_unpaced": live,
        "live_paced_window_0": paced,
        "live_paced_window": paced_window,
        "pingpong": pingpong,
        "pingpong_model": pingpong_model,
        "idle": idle,
        "idle_naps": idles,
        "bursts": bursts,
        **({"traced": traced} if trace else {}),
    }


def _echo_table(rows: list[tuple[str, str]]) -> None:
    width = max(len(k) for k, _ in rows) + 2
    click.echo(f"{'measure':<{width}}value")
    for key, value in rows:
        click.echo(f"{key:<{width}}{value}")


@click.command("proxy")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path), help="write results here")
@click.option("--quick", is_flag=True, help="smaller sizes (a smoke run)")
@click.option("--peers", default=8, show_default=True, type=click.IntRange(1, 4096),
              help="destinations (one connection each)")
@click.option("--channels", default=1, show_default=True, type=click.IntRange(1, 256),
              help="pre-filled rings drained by the one worker")
@click.option("--batch-max", default=8, show_default=True, type=click.IntRange(MIN_BATCH, MAX_BATCH))
@click.option("--poll-window-us", default=50.0, show_default=True, type=FiniteFloat(min=0, max=1e6))
@click.option("--inflight-cap", default=256, show_default=True,
              type=click.IntRange(MIN_INFLIGHT_CAP, MAX_INFLIGHT_CAP))
@click.option("--idle-nap-us", "idle_naps_us", type=click.FloatRange(min=0.0), multiple=True,
              default=(DEEP_NAP_S * 1e6,), show_default=True,
              help="the long-idle worker's sleep between looks at the rings; repeat to compare several")
@click.option("--trace", is_flag=True,
              help="also run the core drain and the one-record round trip with the trace recorder on")
@click.option("--max-take", default=4096, show_default=True, type=click.IntRange(MIN_TAKE, MAX_TAKE),
              help="the most records one pass takes from a ring (the proxy's max_take)")
def bench_proxy(json_path: Path | None, quick: bool, peers: int, channels: int, batch_max: int,
                poll_window_us: float, inflight_cap: int, idle_naps_us: tuple[float, ...], trace: bool,
                max_take: int) -> None:
    """Ring -> post with the null backend: commands/s per worker, batch sizes, record-to-post latency."""
    r = run_proxy_benchmark(quick=quick, peers=peers, batch_max=batch_max, poll_window_us=poll_window_us,
                            inflight_cap=inflight_cap, channels=channels, idle_naps_us=idle_naps_us, trace=trace,
                            max_take=max_take)
    d, sm, lv = r["drain"], r["summary"], r["live_unpaced"]
    p0, pw, pp, pm = r["live_paced_window_0"], r["live_paced_window"], r["pingpong"], r["pingpong_model"]
    c = d["core"]
    _echo_table([
        (f"numpy consume_ready alone, ring of {c['capacity']}", f"{r['bare_consumer_records_per_s'] / 1e6:8.2f} M/s"),
        ("bare C consumer alone (take, release, complete)", f"{r['bare_c_consumer_records_per_s'] / 1e6:8.2f} M/s"
         f"   (core drain {sm['proxy_vs_bare_c_consumer']:.3f}x)"),
        (f"drain, core + C null NIC, {c['channels']} ring(s), {c['peers']} peers",
         f"{c['records_per_s'] / 1e6:8.2f} M/s   (median {c['records_per_s_median'] / 1e6:.2f})"),
        ("drain, core + C null NIC, the worker's own loop",
         f"{r['drain_worker_loop']['records_per_s'] / 1e6:8.2f} M/s   "
         f"(median {r['drain_worker_loop']['records_per_s_median'] / 1e6:.2f})"),
        ("drain, core + Python null backend", f"{d['core_python_nic']['records_per_s'] / 1e6:8.2f} M/s"),
        ("drain, numpy model + Python null backend", f"{d['model']['records_per_s'] / 1e6:8.2f} M/s"
         f"   (core {sm['core_vs_model']:.1f}x model)"),
        ("batch-size histogram 1..8 (core drain)", " ".join(str(x) for x in c["batch_hist"])),
        ("one record at a time (C producer), core: p50 / p99", f"{pp['p50_us']:8.2f} / {pp['p99_us']:.2f} us"),
        ("one record at a time (C producer), model: p50 / p99", f"{pm['p50_us']:8.2f} / {pm['p99_us']:.2f} us"),
        ("live producer (numpy), unpaced", f"{lv['records_per_s'] / 1e6:8.2f} M/s"
         f"   p50 {lv['p50_us']:.0f} / p99 {lv['p99_us']:.0f} us"),
        ("live paced 20k/s, window 0: p50 / p99", f"{p0['p50_us']:8.1f} / {p0['p99_us']:.1f} us"),
        (f"live paced 20k/s, window {pw['poll_window_us']:g} us: p50 / p99",
         f"{pw['p50_us']:8.1f} / {pw['p99_us']:.1f} us"),
        *[(f"idle worker, {i['nap_us']:g} us naps: CPU / first record after {i['idle_s']:g} s p50 / max",
           f"{100 * i['cpu_fraction']:8.1f} % of a core   {i['p50_us']:.1f} / {i['max_us']:.1f} us")
          for i in r["idle_naps"]],
        *[(f"bursts of {size} (C producer), worker loop / bare C: p50 / p99",
           f"{r['bursts'][f'worker_{size}']['p50_us']:8.2f} / {r['bursts'][f'worker_{size}']['p99_us']:.2f} us   "
           f"{r['bursts'][f'bare_{size}']['p50_us']:.2f} / {r['bursts'][f'bare_{size}']['p99_us']:.2f} us")
          for size in BURSTS],
        *([("drain, core + C null NIC, trace recorder on",
            f"{sm['traced_commands_per_s'] / 1e6:8.2f} M/s   ({sm['traced_vs_off']:.2f}x off)"),
           ("one record at a time (C producer), traced: p50 / p99",
            f"{sm['traced_pingpong_p50_us']:8.2f} / {sm['traced_pingpong_p99_us']:.2f} us")] if trace else []),
    ])
    if json_path:
        json_path.write_text(json.dumps(r, indent=2) + "\n")
        click.echo(f"wrote {json_path}")


# --- signals -----------------------------------------------------------------------------------------------
def signal_records(total: int, dests: int, slots: int, fence_every: int) -> np.ndarray:
    """PUT_SIGNALs (ADD 1) round-robin over ``dests`` and their ``slots``; a FENCE every ``fence_every``."""
    idx = np.arange(total, dtype=np.uint64)
    recs = put_records(0, total, dests)
    recs["opcode"] = Opcode.PUT_SIGNAL
    recs["signal_slot"] = (idx // np.uint64(dests)) % np.uint64(slots)
    recs["signal_value"] = 1
    if fence_every:
        recs["opcode"][fence_every - 1 :: fence_every] = Opcode.FENCE
    return recs


def _per_dest_batch(plans: list[np.ndarray]) -> dict[str, float]:
    """Signals and fences per (batch, destination) pair, from the plans the backend saw."""
    if not plans:
        return {"batch_dest_pairs": 0, "signals_per_dest_batch": 0.0, "fences_per_dest_batch": 0.0}
    plan = np.concatenate(plans)
    batch = np.repeat(np.arange(len(plans)), [len(p) for p in plans])
    key = batch.astype(np.int64) << 16 | plan["dst_rank"]
    pairs = len(np.unique(key))
    sig = plan["op"] == PlanOp.SIGNAL
    fence = plan["op"] == PlanOp.FENCE
    sig_pairs = len(np.unique(key[sig]))
    return {
        "batch_dest_pairs": pairs,
        "signals_per_dest_batch": float(sig.sum() / sig_pairs) if sig_pairs else 0.0,
        "fences_per_dest_batch": float(fence.sum() / pairs),
    }


def _signals_run(records: np.ndarray, dests: int, decoupled: bool, opts: dict[str, Any],
                 completion_delay_us: float, burst: int) -> tuple[dict[str, Any], dict]:
    """Push ``records`` in bursts, each drained (every record complete) before the next."""
    capacity = 1 << 14
    burst = min(burst, capacity)
    with RingFile.create(_ring_name("sig"), capacity) as ring:
        backend = NullBackend(keep_plans=True, completion_delay_us=completion_delay_us)
        proxy = Proxy(backend, decoupled=decoupled, **opts)
        _setup(proxy, dests)
        proxy.add_channel(0, ring, JOB, 0, dests + 1)
        producer = RingProducer(ring)
        t0 = time.perf_counter()
        for start in range(0, len(records), burst):
            chunk = records[start : start + burst]
            producer.push_records(chunk)
            _drain_until(proxy, [ring], start + len(chunk))
        elapsed = time.perf_counter() - t0
        stats = proxy.stats()
    plans = [p for conn in sorted(backend.plans) for p in backend.plans[conn]]
    result = {
        "decoupled": decoupled,
        "burst": burst,
        "commands": stats["commands"],
        "commands_per_s": len(records) / elapsed,
        "batches": stats["batches"],
        "wrs": stats["wrs"],
        "wrs_per_command": stats["wrs"] / max(stats["commands"], 1),
        "signals": stats["signals"],
        "signals_requested": stats["signals_requested"],
        "fences": stats["fences"],
        "stalls": stats["stalls"],
        "signal_stalls": stats["signal_stalls"],
        "proxy_signals_per_dest_batch": stats["signals_per_dest_batch"],
        **_per_dest_batch(plans),
    }
    return result, apply_plans(plans)


def run_signals_benchmark(*, quick: bool = False, dests: int = 4, slots: int = 1, fence_every: int = 256,
                          batch_max: int = 8, poll_window_us: float = 50.0, inflight_cap: int = 256,
                          completion_delay_us: float = 10.0, burst: int = 256,
                          records: int | None = None) -> dict[str, Any]:
    """Naive vs decoupled on one record stream, in bursts and as a flood; returns the JSON document."""
    total = records or (16_384 if quick else 131_072)
    stream = signal_records(total, dests, slots, fence_every)
    opts = dict(batch_max=batch_max, poll_window_us=poll_window_us, inflight_cap=inflight_cap)
    runs: dict[str, dict[str, Any]] = {}
    flags: dict[str, dict] = {}
    for load, size in (("burst", burst), ("flood", total)):
        for mode, decoupled in (("naive", False), ("decoupled", True)):
            runs[f"{load}_{mode}"], flags[f"{load}_{mode}"] = _signals_run(
                stream, dests, decoupled, opts, completion_delay_us, size)
    naive, dec = runs["burst_naive"], runs["burst_decoupled"]
    return {
        "benchmark": "signals",
        "config": {**opts, "records": total, "dests": dests, "slots_per_dest": slots, "fence_every": fence_every,
                   "completion_delay_us": completion_delay_us, "burst": burst},
        "summary": {
            "naive_signals_per_dest_batch": naive["signals_per_dest_batch"],
            "decoupled_signals_per_dest_batch": dec["signals_per_dest_batch"],
            "proxy_stalls": dec["signal_stalls"],
            "naive_proxy_stalls": naive["signal_stalls"],
            "cap_stalls_decoupled": dec["stalls"],
            "cap_stalls_naive": naive["stalls"],
            "flood_proxy_stalls": runs["flood_decoupled"]["signal_stalls"],
            "flags_match": all(f == flags["burst_naive"] for f in flags.values()),
        },
        **runs,
    }


@click.command("signals")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path), help="write results here")
@click.option("--quick", is_flag=True, help="smaller sizes (a smoke run)")
@click.option("--dests", default=4, show_default=True, type=click.IntRange(1, 4096), help="destination ranks")
@click.option("--slots", default=1, show_default=True, type=click.IntRange(1, 1 << 16),
              help="flag slots per destination")
@click.option("--fence-every", default=256, show_default=True, type=click.IntRange(min=0),
              help="a FENCE every N records (0: none)")
@click.option("--burst", default=256, show_default=True, type=click.IntRange(min=1),
              help="records pushed, then drained, at a time")
@click.option("--records", type=click.IntRange(1, 1 << 26), default=None,
              help="stream length [default: 131072, --quick 16384]")
@click.option("--inflight-cap", default=256, show_default=True,
              type=click.IntRange(MIN_INFLIGHT_CAP, MAX_INFLIGHT_CAP))
@click.option("--completion-delay-us", default=10.0, show_default=True, type=FiniteFloat(min=0, max=1e6),
              help="null NIC completion latency")
def bench_signals(json_path: Path | None, quick: bool, dests: int, slots: int, fence_every: int, burst: int,
                  records: int | None, inflight_cap: int, completion_delay_us: float) -> None:
    """Naive per-command signaling vs Perseus decoupled signaling on the same PUT_SIGNAL stream."""
    r = run_signals_benchmark(quick=quick, dests=dests, slots=slots, fence_every=fence_every, burst=burst,
                              inflight_cap=inflight_cap, completion_delay_us=completion_delay_us, records=records)
    cols = ["burst_naive", "burst_decoupled", "flood_naive", "flood_decoupled"]
    click.echo(f"{'measure':<26}" + "".join(f"{c:>17}" for c in cols))
    for key, fmt in [("commands_per_s", "{:,.0f}"), ("batches", "{:d}"), ("wrs_per_command", "{:.3f}"),
                     ("signals", "{:d}"), ("signals_per_dest_batch", "{:.3f}"), ("fences_per_dest_batch", "{:.3f}"),
                     ("stalls", "{:d}"), ("signal_stalls", "{:d}")]:
        click.echo(f"{key:<26}" + "".join(f"{fmt.format(r[c][key]):>17}" for c in cols))
    click.echo(f"{'receiver flags equal':<26}{str(r['summary']['flags_match']):>17}")
    click.echo(f"(burst: {r['config']['burst']} records pushed then drained; flood: the whole stream pre-filled; "
               f"null NIC completes after {r['config']['completion_delay_us']:g} us)")
    if json_path:
        json_path.write_text(json.dumps(r, indent=2) + "\n")
        click.echo(f"wrote {json_path}")
