"""How long a rail worker takes to place one run of soft-fabric writes into GPU memory.

    python benchmarks/copy_run_bench.py --json benchmarks/results/copy-run.json

softverbs hands a rail worker in-order writes bound for GPU memory as one run (``GpuAccessor.copy_many``):
here ``--blocks`` device-to-device copies of ``--block-bytes`` each followed by an 8-byte flag from host
bytes, as MoE dispatch's token blocks and their flags arrive. Two ways of queueing that run on one stream
and waiting for it once:

- ``compiled``: ``GpuAccessor.copy_many`` itself (``transportd._core.copy_run``: staged and queued in C, the
  GIL released once for the whole run);
- ``python``: the same calls one at a time through cuda-python (each gives the GIL up and takes it back),
  as the accessor queued a run before; the reference.

Each way runs quiet and beside ``--gil-threads`` Python threads that wake every ~20 µs for a few µs of
Python (a rail worker's other threads wanting the GIL now and then: softverbs' I/O thread, the requester,
the serve loop's Python passes). Two more rows, compiled and quiet, place the same blocks with no flags
between them: ``continuing`` (each block's source and destination continue the previous block's, as a MoE
group's rows written in several puts: ``copy_run`` joins them into one copy) and ``gapped`` (4 KiB between
blocks at both ends: a copy each). Rows: µs per run from the first queue call to the wait's return, p50 /
p90 over ``--runs`` runs, after ``--warmup``.
"""

from __future__ import annotations

import ctypes
import json
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import click

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from transportd.cuda_driver import check, driver, use_device  # noqa: E402
from transportd.dataplane.gpu_memory import RUN_STAGE, GpuAccessor  # noqa: E402

WAYS = ("compiled", "python")


def _python_run(drv: Any, stream: Any, stage: int, run: list[tuple[int, Any, int]]) -> None:
    """The run queued one cuda-python call at a time, host bytes staged with ctypes, one wait."""
    staged = 0
    for dst, src, length in run:
        if isinstance(src, int):
            check(drv.cuMemcpyAsync(dst, src, length, stream), "cuMemcpyAsync")
        else:
            ctypes.memmove(stage + staged, bytes(src), length)
            check(drv.cuMemcpyHtoDAsync(dst, stage + staged, length, stream), "cuMemcpyHtoDAsync")
            staged += length
    check(drv.cuStreamSynchronize(stream), "cuStreamSynchronize")


def _busy(stop: threading.Event) -> None:
    """A thread that wakes every few tens of µs for a little Python, as a rail worker's others do."""
    while not stop.is_set():
        sum(range(300))  # a few µs holding the GIL
        time.sleep(20e-6)


def measure(device: int, blocks: int, block_bytes: int, runs: int, warmup: int, gil_threads: int) -> list[dict]:
    drv = driver()
    use_device(device)
    acc = GpuAccessor(device)
    stream = check(drv.cuStreamCreate(drv.CUstream_flags.CU_STREAM_NON_BLOCKING), "cuStreamCreate")
    stage = int(check(drv.cuMemHostAlloc(RUN_STAGE, 0), "cuMemHostAlloc"))
    size = blocks * block_bytes
    gap = 4096  # the gapped layout's room between blocks
    src = int(check(drv.cuMemAlloc(size + gap * blocks), "cuMemAlloc"))
    dst = int(check(drv.cuMemAlloc(size + (8 + gap) * blocks), "cuMemAlloc"))
    flags = [memoryview(i.to_bytes(8, "little")) for i in range(1, blocks + 1)]
    run: list[tuple[int, Any, int]] = []
    for i in range(blocks):
        run += [(dst + i * block_bytes, src + i * block_bytes, block_bytes), (dst + size + 8 * i, flags[i], 8)]
    layouts = {"continuing": [(dst + i * block_bytes, src + i * block_bytes, block_bytes) for i in range(blocks)],
               "gapped": [(dst + i * (block_bytes + gap), src + i * (block_bytes + gap), block_bytes)
                          for i in range(blocks)]}
    rows = []

    def timed(place: Any) -> dict[str, float]:
        took = []
        for i in range(warmup + runs):
            start = time.perf_counter_ns()
            place()
            if i >= warmup:
                took.append((time.perf_counter_ns() - start) / 1e3)
        took.sort()
        return {"p50_us": round(statistics.median(took), 1), "p90_us": round(took[int(0.9 * (len(took) - 1))], 1),
                "min_us": round(took[0], 1)}

    try:
        for layout, copies in layouts.items():
            rows.append({"way": "compiled", "layout": layout, "gil_threads": 0, "pieces": len(copies), "runs": runs,
                         **timed(lambda copies=copies: acc.copy_many(copies))})
        for threads in (0, gil_threads):
            for way in WAYS:
                place = (lambda: acc.copy_many(run)) if way == "compiled" else (
                    lambda: _python_run(drv, stream, stage, run))
                stop = threading.Event()
                spinners = [threading.Thread(target=_busy, args=(stop,), daemon=True) for _ in range(threads)]
                for t in spinners:
                    t.start()
                took = timed(place)
                stop.set()
                for t in spinners:
                    t.join()
                rows.append({"way": way, "layout": "flags", "gil_threads": threads, "pieces": len(run), "runs": runs,
                             **took})
            if not gil_threads:
                break
    finally:
        drv.cuMemFree(src)
        drv.cuMemFree(dst)
        drv.cuMemFreeHost(stage)
        drv.cuStreamDestroy(stream)
        acc.close()
    return rows


@click.command()
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None, help="write the results here")
@click.option("--device", default=0, show_default=True)
@click.option("--blocks", type=click.IntRange(min=1, max=RUN_STAGE // 8), default=8, show_default=True,
              help="device-to-device copies in a run, each followed by an 8-byte flag")
@click.option("--block-bytes", type=click.IntRange(min=1), default=224 << 10, show_default=True)
@click.option("--runs", type=click.IntRange(min=1), default=300, show_default=True)
@click.option("--warmup", type=click.IntRange(min=0), default=30, show_default=True)
@click.option("--gil-threads", type=click.IntRange(min=0), default=2, show_default=True,
              help="Python threads waking beside the runs in the second pair of rows (0: none)")
def main(json_path: str | None, device: int, blocks: int, block_bytes: int, runs: int, warmup: int,
         gil_threads: int) -> None:
    rows = measure(device, blocks, block_bytes, runs, warmup, gil_threads)
    click.echo(f"one run: {blocks} copies of {block_bytes} B device -> device (flags: each followed by an 8 B flag)")
    click.echo(f"{'way':>9} {'layout':>10} {'GIL threads':>11} {'p50 µs':>8} {'p90 µs':>8} {'min µs':>8}")
    for r in rows:
        click.echo(f"{r['way']:>9} {r['layout']:>10} {r['gil_threads']:>11} {r['p50_us']:>8} {r['p90_us']:>8} "
                   f"{r['min_us']:>8}")
    if json_path:
        summary = {f"{r['way']}_{r['layout']}_{r['gil_threads']}_threads_p50_us": r["p50_us"] for r in rows}
        Path(json_path).write_text(json.dumps({"benchmark": "copy_run", "blocks": blocks, "block_bytes": block_bytes,
                                               "rows": rows, "summary": summary}, indent=2) + "\n")


if __name__ == "__main__":
    main()
