"""`transportd bench ring`: how fast the host side of the ring moves records.

(a) drain: one consumer empties a pre-filled ring (the proxy's ceiling before any per-command work);
(b) pipe: a producer process and this consumer process, records/s unpaced and commit-to-consume latency
    paced (the producer stamps CLOCK_MONOTONIC into each record; both processes read the same clock).
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import time
from pathlib import Path

import click
import numpy as np

from cmd_ring.loadgen import TIMESTAMP_FIELD, checksummed_records, produce
from cmd_ring.ring import RingConsumer, RingFile, RingProducer

__all__ = ["bench_ring", "run_ring_benchmark"]


def _drain(capacity: int, repeats: int) -> dict:
    name = f"tpd-bench-drain-{os.getpid()}"
    rates = []
    with RingFile.create(name, capacity) as ring:
        producer, consumer = RingProducer(ring), RingConsumer(ring)
        records = checksummed_records(0, capacity, np.random.default_rng(0))
        for _ in range(repeats):
            producer.push_records(records)
            taken = 0
            t0 = time.perf_counter()
            while taken < capacity:
                taken += len(consumer.consume_ready())
            rates.append(capacity / (time.perf_counter() - t0))
    return {"capacity": capacity, "repeats": repeats, "records_per_s": max(rates),
            "records_per_s_median": float(np.median(rates))}


def _pipe(total: int, capacity: int, interval_ns: int, max_batch: int) -> dict:
    name = f"tpd-bench-pipe-{os.getpid()}"
    with RingFile.create(name, capacity) as ring:
        consumer = RingConsumer(ring)
        proc = mp.get_context("spawn").Process(
            target=produce, args=(name, total, 7), kwargs=dict(max_batch=max_batch, timestamps=True,
                                                             interval_ns=interval_ns)
        )
        proc.start()
        latencies = np.empty(total, dtype=np.int64)
        received = 0
        t_first = None
        deadline = time.monotonic() + 300
        while received < total and time.monotonic() < deadline:
            batch = consumer.consume_ready()
            if batch.size:
                now = time.monotonic_ns()
                if t_first is None:
                    t_first = time.perf_counter()
                latencies[received : received + batch.size] = now - batch[TIMESTAMP_FIELD].astype(np.int64)
                received += batch.size
        elapsed = time.perf_counter() - (t_first or time.perf_counter())
        proc.join(30)
    if received < total:
        raise click.ClickException(f"pipe benchmark: only {received} of {total} records arrived")
    lat_us = latencies / 1e3
    return {
        "records": total,
        "capacity": capacity,
        "interval_ns": interval_ns,
        "max_batch": max_batch,
        "records_per_s": total / elapsed if elapsed > 0 else float("nan"),
        "p50_us": float(np.percentile(lat_us, 50)),
        "p99_us": float(np.percentile(lat_us, 99)),
        "max_us": float(lat_us.max()),
    }


def run_ring_benchmark(quick: bool = False) -> dict:
    """Run both parts; returns the JSON document (``summary`` plus detail)."""
    drain = _drain(capacity=1 << (16 if quick else 20), repeats=3 if quick else 5)
    throughput = _pipe(total=200_000 if quick else 2_000_000, capacity=4096, interval_ns=0, max_batch=256)
    paced = _pipe(total=5_000 if quick else 50_000, capacity=4096, interval_ns=50_000, max_batch=1)
    return {
        "benchmark": "ring",
        "host": {"cpus": os.cpu_count()},
        "summary": {
            "drain_records_per_s": drain["records_per_s"],
            "pipe_records_per_s": throughput["records_per_s"],
            "pipe_p50_us": paced["p50_us"],
            "pipe_p99_us": paced["p99_us"],
        },
        "drain": drain,
        "pipe_throughput": throughput,
        "pipe_latency_paced": paced,
    }


@click.command("ring")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path), help="write results here")
@click.option("--quick", is_flag=True, help="smaller sizes (a smoke run)")
def bench_ring(json_path: Path | None, quick: bool) -> None:
    """Consumer drain rate and producer->consumer rate/latency across two processes."""
    result = run_ring_benchmark(quick)
    d, t, p = result["drain"], result["pipe_throughput"], result["pipe_latency_paced"]
    click.echo(f"{'measure':<44}{'value':>16}")
    click.echo(f"{'drain, pre-filled ring of ' + str(d['capacity']):<44}{d['records_per_s'] / 1e6:>12.1f} M/s")
    click.echo(f"{'pipe, 2 processes, batches <= 256':<44}{t['records_per_s'] / 1e6:>12.2f} M/s")
    click.echo(f"{'pipe latency under load p50 / p99':<44}{t['p50_us']:>9.0f} / {t['p99_us']:.0f} us")
    click.echo(f"{'pipe latency paced (20k/s) p50 / p99':<44}{p['p50_us']:>9.1f} / {p['p99_us']:.1f} us")
    if json_path:
        json_path.write_text(json.dumps(result, indent=2) + "\n")
        click.echo(f"wrote {json_path}")
