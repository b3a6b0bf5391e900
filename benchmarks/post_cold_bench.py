"""What a soft batch post's Python costs when its thread has just been idle, against back to back.

    python benchmarks/post_cold_bench.py --json benchmarks/results/post-cold.json

A rail worker posts a fused launch's first records after sitting idle between launches, so the post's Python
(`softverbs.soft.batch.post_wr_batch`: the WR list, its checks and queueing) runs with the thread's caches cold.
This times that part of a post, ``--wrs`` RDMA writes on a connected soft RC QP in this process (``wr_complete``
left out: no frame is sent, so only the post's own Python is timed): ``warm``, posts back to back; ``spun``, each
after the thread spun ``--idle-ms`` awake on the clock; ``c_spun``, each after it spun as long in C with the GIL let
go (`softverbs._spin.spin_until`: no Python runs, almost no memory is touched); ``thrashed``, each after it wrote a
``--thrash-mib`` MiB buffer over and over for as long (more than the last-level cache holds, the core busy);
``rehearsed``, each after it slept as long in steps of ``--rehearse-ms``, posting the same list on a second QP of
the device after each (the same code, other objects); ``cold``, each after it slept ``--idle-ms``. Rows: µs per
post, p50 / p90. Spun near warm says the cold cost is the idle core's (its sleep state and clock); ``c_spun`` and
``thrashed`` alike say it is the time away from the post's code and data, whatever the thread does meanwhile;
``rehearsed`` near warm says running the same code now and then keeps most of it.
"""

from __future__ import annotations

import json
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

from softverbs import _spin  # noqa: E402
from softverbs.soft.batch import BATCH_WR_DTYPE, SET_SGE, post_wr_batch  # noqa: E402
from softverbs.soft.bench import _close, _connect, _open  # noqa: E402  (transportd bench softverbs' endpoints)
from transportd_cli.cli_options import FiniteFloat  # noqa: E402


def _connected_qp(wrs: int) -> tuple[Callable[[], None], list[dict[str, Any]]]:
    """A client RC QP connected to a server QP (`transportd bench softverbs`' endpoints, both on softib0), and a
    call that posts ``wrs`` 64-byte writes from the client's memory into the server's on it (``wr_complete`` left
    out: the list is built and checked, then dropped, so no frame is sent and nothing completes)."""
    client, server = _open("rc"), _open("rc")
    _connect(client, server["info"])
    _connect(server, client["info"])
    rows = np.zeros(wrs, dtype=BATCH_WR_DTYPE)
    rows["wr_id"] = np.arange(wrs)
    rows["opcode"], rows["setters"] = 0, SET_SGE  # IBV_WR_RDMA_WRITE, one SGE
    rows["sge_addr"] = client["mr"].buf + 64 * np.arange(wrs)
    rows["sge_length"], rows["sge_lkey"] = 64, client["mr"].lkey
    rows["raddr"] = server["info"]["addr"] + 64 * np.arange(wrs)
    rows["rkey"] = server["info"]["rkey"]
    qp = client["qp"]
    core = qp._core
    core.wr_complete = lambda: 0
    wire = rows.tobytes()  # as the verbs shim hands it over

    def post() -> None:
        post_wr_batch(qp, wire)
        core.wr_list = None

    return post, [client, server]


MODES = ("warm", "spun", "c_spun", "thrashed", "rehearsed", "cold")


def _idle(mode: str, seconds: float, scratch: np.ndarray, rehearse: Callable[[], None], every: float) -> None:
    """What the thread does for ``seconds`` before a post of ``mode`` (`MODES`; warm: nothing)."""
    if mode == "cold":
        time.sleep(seconds)
    elif mode == "c_spun":
        _spin.spin_until(time.monotonic_ns() + int(seconds * 1e9))
    elif mode == "rehearsed":
        until = time.perf_counter() + seconds
        while (left := until - time.perf_counter()) > 0:
            time.sleep(min(every, left))
            rehearse()
    elif mode == "spun":
        until = time.perf_counter() + seconds
        while time.perf_counter() < until:
            pass
    elif mode == "thrashed":
        until = time.perf_counter() + seconds
        while time.perf_counter() < until:
            scratch += 1


def measure(wrs: int, posts: int, idle_ms: float, thrash_mib: int = 64,
            rehearse_ms: float = 1.0) -> list[dict[str, Any]]:
    post, keep = _connected_qp(wrs)
    rehearse, keep_other = _connected_qp(wrs)
    keep += keep_other
    scratch = np.zeros(thrash_mib << 20, dtype=np.uint8)

    def once() -> float:
        start = time.perf_counter_ns()
        post()
        return (time.perf_counter_ns() - start) / 1e3

    out = []
    try:
        for mode in MODES:
            took = []
            for i in range(posts + 10):
                _idle(mode, idle_ms / 1e3, scratch, rehearse, rehearse_ms / 1e3)
                t = once()
                if i >= 10:
                    took.append(t)
            took.sort()
            out.append({"mode": mode, "wrs": wrs, "posts": posts, "idle_ms": idle_ms if mode != "warm" else 0.0,
                        "p50_us": round(took[len(took) // 2], 1), "p90_us": round(took[9 * len(took) // 10], 1)})
    finally:
        for endpoint in keep:
            _close(endpoint)
    return out


@click.command()
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None, help="write the results here")
@click.option("--wrs", type=click.IntRange(min=1, max=1024), default=12, show_default=True,
              help="writes a post (a MoE dispatch's post to one peer: 12)")
@click.option("--posts", type=click.IntRange(min=1), default=200, show_default=True)
@click.option("--idle-ms", type=FiniteFloat(min=0.0, max=1000.0), default=20.0, show_default=True,
              help="how long the thread sleeps (cold), spins (spun, c_spun), writes memory (thrashed) or sleeps in "
                   "steps between posts on the second QP (rehearsed) before each such post")
@click.option("--thrash-mib", type=click.IntRange(min=1, max=4096), default=64, show_default=True,
              help="the buffer the thrashed row writes (larger than the last-level cache)")
@click.option("--rehearse-ms", type=FiniteFloat(min=0.01, max=1000.0), default=1.0, show_default=True,
              help="how often the rehearsed row's thread posts on the second QP while it idles")
def main(json_path: str | None, wrs: int, posts: int, idle_ms: float, thrash_mib: int, rehearse_ms: float) -> None:
    rows = measure(wrs, posts, idle_ms, thrash_mib, rehearse_ms)
    click.echo(f"post_wr_batch of {wrs} RDMA writes (its Python, no frame sent)")
    for r in rows:
        click.echo(f"  {r['mode']:>9}  p50 {r['p50_us']:8.1f} µs  p90 {r['p90_us']:8.1f} µs")
    if json_path:
        summary = {f"{r['mode']}_p50_us": r["p50_us"] for r in rows}
        Path(json_path).write_text(json.dumps({"benchmark": "post_cold", "rows": rows, "summary": summary,
                                               "thrash_mib": thrash_mib, "rehearse_ms": rehearse_ms},
                                              indent=2) + "\n")


if __name__ == "__main__":
    main()
