"""What one loopback flag write costs a rail worker over softverbs: efa's flag publication without GDRCopy.

    python benchmarks/loopback_cost.py --json benchmarks/results/loopback-cost.json

An efa rail without GDRCopy publishes each flag into GPU memory with an RDMA write through its own NIC
(``efa.loopback.LoopbackWriter``, driven by ``GpuFlagWords``: ``transportd.dataplane.flag_publication``).
On a NIC that is a work request and a completion; on the soft EFA device it is Python on both of the
worker's threads: the posting thread builds the work request and sends a request frame to the device itself,
the device's I/O thread receives it, places the 8 bytes through the memory's accessor and acknowledges it,
and the posting thread reaps the completion. This times it on this machine, one word at a time with
nothing else running (one soft EFA device, flag words in host memory it reaches only through an accessor,
as it reaches GPU memory): per write, the post (``end_pass``), post -> reaped (``reap`` called until the
completion is back, yielding the GIL between calls) and the writer's own ``wait_ns`` (the time its ``post``
and ``reap`` calls took). A fused kernel's comm launch on efa publishes about 33 flags a daemon
(docs/performance-log.md, "What an efa comm launch's workers count").
"""

from __future__ import annotations

import json
import os
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import click
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from efa.backend import EfaBackend  # noqa: E402
from softverbs._memory import HostAccessor  # noqa: E402
from transportd.backends import verbs as tverbs  # noqa: E402
from transportd.backends.interface import SignalOp  # noqa: E402
from transportd.dataplane.flag_publication import LOOPBACK, GpuFlagWords  # noqa: E402
from transportd.dataplane.flagfile import FlagFile  # noqa: E402

WORDS = 64
TIMEOUT_S = 10.0


def _us(ns: list[int], q: float) -> float:
    return float(np.percentile(np.asarray(ns, dtype=np.float64), q)) / 1e3


def loopback_cost(writes: int = 2000) -> dict[str, Any]:
    """One flag word at a time, ``writes`` times: the post, post -> reaped, and the writer's time per write (µs);
    checks that every word holds its shadow's value at the end."""
    verbs = tverbs.load("soft")
    name = f"efa{uuid.uuid4().hex[:8]}"
    verbs.soft.add_device(name, "efa", reorder_seed=1)
    backend = EfaBackend(name, verbs=verbs)
    target = np.zeros(WORDS, dtype=np.uint64)
    key = backend.register_memory(int(target.ctypes.data), target.nbytes, remote_write=True, remote_atomic=True,
                                  accessor=HostAccessor())
    shadow, fd = FlagFile.create_memfd(WORDS)
    os.close(fd)
    words = GpuFlagWords(int(target.ctypes.data), WORDS, shadow, LOOPBACK, loopback=backend.open_flag_loopback())
    words.rkey = key.rkey
    writer = words.loopback
    post_ns: list[int] = []
    reaped_ns: list[int] = []
    reaps: list[int] = []
    try:
        for i in range(writes):
            words.publish(i % WORDS, SignalOp.ADD, 1)
            t0 = time.perf_counter_ns()
            words.end_pass()
            t1 = time.perf_counter_ns()
            calls = 0
            while words.busy:
                calls += 1
                for owner, slot, value in writer.reap():
                    owner.written(slot, value)
                if time.perf_counter_ns() - t1 > TIMEOUT_S * 1e9:
                    raise TimeoutError(f"loopback write {i} not reaped in {TIMEOUT_S} s")
            post_ns.append(t1 - t0)
            reaped_ns.append(time.perf_counter_ns() - t1)
            reaps.append(calls)
        landed = bool((target == shadow.values).all())
        result = {"writes": writes, "landed": landed, "loopback_writes": writer.writes,
                  "post_p50_us": _us(post_ns, 50), "post_p99_us": _us(post_ns, 99),
                  "reaped_p50_us": _us(reaped_ns, 50), "reaped_p99_us": _us(reaped_ns, 99),
                  "reap_calls_p50": float(np.median(reaps)),
                  "writer_us_per_write": writer.wait_ns / max(writer.writes, 1) / 1e3,
                  "cpus": len(os.sched_getaffinity(0))}
    finally:
        writer.close()
        words.release()
        backend.close()
    return result


def table(r: dict[str, Any]) -> str:
    return "\n".join([
        f"loopback flag writes over softverbs, one at a time, {r['writes']} writes ({r['cpus']} CPUs)",
        f"  post (end_pass)            p50 {r['post_p50_us']:8.1f} us   p99 {r['post_p99_us']:8.1f} us",
        f"  post -> reaped             p50 {r['reaped_p50_us']:8.1f} us   p99 {r['reaped_p99_us']:8.1f} us "
        f"({r['reap_calls_p50']:.0f} reap calls)",
        f"  the writer's calls, a write    {r['writer_us_per_write']:8.1f} us",
        f"  every word holds its shadow's value: {r['landed']}"])


@click.command()
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None, help="write the results here")
@click.option("--writes", type=click.IntRange(min=1), default=2000, show_default=True)
def main(json_path: str | None, writes: int) -> None:
    """Time one loopback flag write on the soft EFA device (see the module doc)."""
    result = loopback_cost(writes)
    click.echo(table(result))
    if json_path:
        Path(json_path).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
