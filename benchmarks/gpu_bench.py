"""GPU benchmarks on a CUDA machine: push cost, commit -> posted latency, put -> flag latency.

    python benchmarks/gpu_bench.py --json gpu_bench.json

This script holds the command line and the whole run (``run_gpu_benchmark``); each section is a module of its
own, whose docstring says what it measures and how:

push, plan overhead (``gpu_push_cost.py``)
    the bare push per commit variant (one thread's ns per push, and pushes/s over every SM), the
    warp-cooperative push, and ``tile_done`` + ``wait_range`` against raw ``put_signal`` + ``wait``.
latency (``gpu_latency.py``; one thread, pushes paced 200 us apart so nothing queues)
    commit -> posted (the proxy as its own null NIC) and commit -> consumed (header-last against per-word
    parity), on the host's clock; commit -> completion seen by the kernel, on the GPU's clock alone.
round trips under load (``gpu_sweep.py``; ``--only-sweep`` runs it alone)
    over GPU threads (1 to 1024), every thread pushes a record and waits for its completion before the next:
    avg / p50 / p99 round trip and M ops/s, the rail worker's loop draining the ring. ``--only-sweep`` also
    runs ``transportd bench proxy``'s drain beside the bare C consumer; ``--sweep-compare`` adds the bare C
    consumer, other waits, the warp push, per-word parity and the threads over more rings.
put -> flag (``gpu_flag.py``; ``--only-flag`` runs it alone)
    two daemons (``LocalCluster`` over softverbs, ib RC and efa SRD), one GPU: device flags against
    host-mapped flags and pinned buffers, each setting in a child process with and without CUDA MPS
    (``--no-mps`` or ``TRANSPORTD_GPU_MPS=0``: without only), into one table.

``gpu_common.py`` holds what they share: the GPU handle (``Gpu``), the commit variants, the benchmark's ring
files, the clock calibration (``calibrate``) and the engine as its own null NIC.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import click

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.gpu_common import (  # noqa: E402
    DEFAULT_VARIANT,
    HEADER_LAST,
    PARITY,
    Gpu,
    calibrate,
    library_commit_variant,
    percentile,
)
from benchmarks.gpu_flag import FLAG_WHERES, put_to_flag_child, put_to_flag_table  # noqa: E402
from benchmarks.gpu_latency import (  # noqa: E402
    GAP_NS,
    commit_to_completion_gpu_clock,
    commit_to_consumed,
    commit_to_posted,
)
from benchmarks.gpu_push_cost import plan_overhead, push_cost, warp_push_cost  # noqa: E402
from benchmarks.gpu_sweep import (  # noqa: E402
    SWEEP_COMPARE_MAX_TAKE,
    SWEEP_THREADS,
    SWEEP_WAITS,
    roundtrip_sweep,
    run_sweep_only,
    sweep_summary,
    sweep_table,
)


def run_gpu_benchmark(quick: bool = False, echo: Any = print, mps: bool = True) -> dict[str, Any]:
    # put -> flag first: its MPS server must start before this process makes a CUDA context of its own
    table = put_to_flag_table(100 if quick else 400, echo, mps=mps)
    gpu = Gpu(0)
    single, agg = (2000, 20) if quick else (20000, 200)
    n_lat = 300 if quick else 1000
    push = {}
    for variant in HEADER_LAST + PARITY:
        push[variant] = push_cost(gpu, variant, single, agg)
        echo(f"push {variant:12s} {push[variant]['push_ns']:8.0f} ns/push (1 thread)   "
             f"{push[variant]['pushes_per_s'] / 1e6:8.1f} M pushes/s ({push[variant]['threads']} threads)")
    push["warp"] = warp_push_cost(gpu, single // 4, agg)
    echo(f"push {'warp (32/warp)':12s} {push['warp']['push_ns']:8.1f} ns/record (1 warp) "
         f"{push['warp']['pushes_per_s'] / 1e6:8.1f} M pushes/s ({push['warp']['threads']} threads)")
    plans = plan_overhead(gpu, 2 if quick else 20)
    echo(f"tile_done + wait_range {plans['tile_done_wait_range_ns_per_chunk']:8.0f} ns/chunk vs put_signal + wait "
         f"{plans['put_signal_wait_ns_per_chunk']:8.0f} ns/chunk ({plans['tiles_per_chunk']} tiles a chunk, 1 thread)")
    clock = calibrate(gpu)
    echo(f"clock: globaltimer - monotonic = {clock['offset_ns']:.0f} ns (+/- {clock['error_bound_ns']:.0f} ns)")
    library = DEFAULT_VARIANT[library_commit_variant()]
    consumed = {}
    for variant in (library, "parity"):
        lat = commit_to_consumed(gpu, variant, n_lat, GAP_NS, clock["offset_ns"])
        consumed[variant] = {"p50_us": percentile(lat, 50), "p99_us": percentile(lat, 99), "n": int(len(lat))}
        echo(f"commit -> consumed ({variant:11s}) p50 {consumed[variant]['p50_us']:7.2f} us  "
             f"p99 {consumed[variant]['p99_us']:7.2f} us")
    lat, post_info = commit_to_posted(gpu, library, n_lat, GAP_NS, clock["offset_ns"])
    posted = {"p50_us": percentile(lat, 50), "p99_us": percentile(lat, 99), "n": int(len(lat)), **post_info}
    echo(f"commit -> posted  (proxy, {library}) p50 {posted['p50_us']:7.2f} us  p99 {posted['p99_us']:7.2f} us")
    rtt = commit_to_completion_gpu_clock(gpu, library, n_lat, GAP_NS)
    roundtrip = {"p50_us": percentile(rtt, 50), "p99_us": percentile(rtt, 99), "n": int(len(rtt))}
    echo(f"commit -> completion seen by the kernel (GPU clock only) p50 {roundtrip['p50_us']:7.2f} us  "
         f"p99 {roundtrip['p99_us']:7.2f} us")
    sweep = roundtrip_sweep(gpu, library, iters=200 if quick else 2000)
    echo(sweep_table(sweep))
    nan = {"p50_us": float("nan"), "p99_us": float("nan")}
    flag = table.get("no_mps", {}).get("ib", {})  # the summary's put -> flag rows: ib without MPS, as before
    flag = {where: flag.get(where, nan) for where in FLAG_WHERES} if "error" not in flag else \
        {where: nan for where in FLAG_WHERES}
    best_parity = push["parity"]
    summary = {
        "library_commit": library,
        "push_ns": push[library]["push_ns"],
        "pushes_per_s": push[library]["pushes_per_s"],
        "warp_push_ns_per_record": push["warp"]["push_ns"],
        "warp_pushes_per_s": push["warp"]["pushes_per_s"],
        "plan_tile_done_wait_range_ns_per_chunk": plans["tile_done_wait_range_ns_per_chunk"],
        "plan_raw_put_signal_wait_ns_per_chunk": plans["put_signal_wait_ns_per_chunk"],
        "commit_to_post_p50_us": posted["p50_us"],
        "commit_to_post_p99_us": posted["p99_us"],
        "commit_to_completion_gpu_clock_p50_us": roundtrip["p50_us"],
        "commit_to_completion_gpu_clock_p99_us": roundtrip["p99_us"],
        "put_to_flag_p50_us": flag["device"]["p50_us"],
        "put_to_flag_p99_us": flag["device"]["p99_us"],
        "header_last": {"push_ns": push[library]["push_ns"], "pushes_per_s": push[library]["pushes_per_s"],
                        "commit_to_consume_p50_us": consumed[library]["p50_us"],
                        "commit_to_consume_p99_us": consumed[library]["p99_us"]},
        "per_word_parity": {"push_ns": best_parity["push_ns"], "pushes_per_s": best_parity["pushes_per_s"],
                            "commit_to_consume_p50_us": consumed["parity"]["p50_us"],
                            "commit_to_consume_p99_us": consumed["parity"]["p99_us"]},
        "put_to_flag_host_flags_p50_us": flag["host"]["p50_us"],
        "put_to_flag_host_flags_p99_us": flag["host"]["p99_us"],
        "put_to_flag_pinned_p50_us": flag["pinned"]["p50_us"],
        "put_to_flag_pinned_p99_us": flag["pinned"]["p99_us"],
        **sweep_summary(sweep),
    }
    for label, by_backend in table.items():
        efa = by_backend.get("efa", {})
        if "device" in efa and "host" in efa:
            summary[f"put_to_flag_efa_device_over_host_{label}"] = efa["device"]["p50_us"] / efa["host"]["p50_us"]
    return {"summary": summary, "push": push, "clock": clock, "commit_to_consumed": consumed,
            "plan_overhead": plans, "commit_to_posted": posted, "commit_to_completion_gpu_clock": roundtrip,
            "roundtrip_sweep": sweep,
            "put_to_flag": flag,
            "put_to_flag_table": table, "device_sms": gpu.sms}


@click.command()
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None, help="write the results here")
@click.option("--quick", is_flag=True, help="fewer iterations (a smoke run)")
@click.option("--only-flag", is_flag=True, help="only the put -> flag table (ib and efa, with and without MPS)")
@click.option("--no-mps", is_flag=True, help="put -> flag without CUDA MPS only (as TRANSPORTD_GPU_MPS=0)")
@click.option("--only-sweep", is_flag=True,
              help="only the round-trip sweep over GPU threads and the drain beside the bare C consumer")
@click.option("--sweep-threads", default=",".join(map(str, SWEEP_THREADS)), show_default=True,
              help="GPU thread counts of the round-trip sweep, comma-separated")
@click.option("--sweep-iters", type=click.IntRange(min=1), default=2000, show_default=True,
              help="round trips per thread at each thread count")
@click.option("--sweep-poll-window-us", type=click.FloatRange(min=0.0), default=0.0, show_default=True,
              help="the proxy's polling window in the sweep (the daemon's default is 50)")
@click.option("--sweep-compare", is_flag=True,
              help="with --only-sweep: also the bare C consumer, one completion poller a warp, the warp "
                   "push, and per-word parity records (bare consumer)")
@click.option("--sweep-waits", default=",".join(SWEEP_WAITS), show_default=True,
              help="with --sweep-compare: the ways the GPU waits to compare, comma-separated")
@click.option("--sweep-max-takes", default=",".join(map(str, SWEEP_COMPARE_MAX_TAKE)), show_default=True,
              help="with --sweep-compare: smaller worker passes to compare, comma-separated (empty: none)")
@click.option("--sweep-worker-cpu", type=click.IntRange(min=0), default=None,
              help="with --only-sweep: also the sweep with the consumer's thread alone on this CPU")
@click.option("--put-flag-child", type=int, default=None, hidden=True,
              help="internal: one MPS setting's put -> flag runs (N round trips) into --json")
def main(json_path: str | None, quick: bool, only_flag: bool, no_mps: bool, only_sweep: bool, sweep_threads: str,
         sweep_iters: int, sweep_poll_window_us: float, sweep_compare: bool, sweep_waits: str, sweep_max_takes: str,
         sweep_worker_cpu: int | None, put_flag_child: int | None) -> None:
    """Push cost, commit -> posted, round trips under load and put -> flag on this machine's GPU (see the
    module doc)."""
    from transportd_cli.mps import mps_wanted

    mps = not no_mps and mps_wanted(os.environ)
    if put_flag_child is not None:
        import faulthandler

        faulthandler.dump_traceback_later(120, repeat=True)  # a stalled run shows where
        assert json_path, "--put-flag-child needs --json"
        put_to_flag_child(put_flag_child, json_path)
        return
    if only_sweep:
        try:
            threads = tuple(int(t) for t in sweep_threads.split(","))
        except ValueError:
            raise click.BadParameter(f"{sweep_threads!r} is not a comma-separated list of thread counts",
                                     param_hint="--sweep-threads") from None
        if not threads or min(threads) < 1:
            raise click.BadParameter("thread counts must be >= 1", param_hint="--sweep-threads")
        waits = tuple(w for w in sweep_waits.split(",") if w)
        if not waits or not set(waits) <= set(SWEEP_WAITS):
            raise click.BadParameter(f"{sweep_waits!r}: name some of {', '.join(SWEEP_WAITS)}",
                                     param_hint="--sweep-waits")
        try:
            takes = tuple(int(t) for t in sweep_max_takes.split(",") if t)
        except ValueError:
            raise click.BadParameter(f"{sweep_max_takes!r} is not a comma-separated list of counts",
                                     param_hint="--sweep-max-takes") from None
        if takes and min(takes) < 1:
            raise click.BadParameter("max takes must be >= 1", param_hint="--sweep-max-takes")
        if sweep_worker_cpu is not None and sweep_worker_cpu not in os.sched_getaffinity(0):
            raise click.BadParameter(f"CPU {sweep_worker_cpu} is not one this process may run on",
                                     param_hint="--sweep-worker-cpu")
        result = run_sweep_only(quick, threads, sweep_iters, sweep_poll_window_us, sweep_compare, click.echo,
                                waits=waits, max_takes=takes, cpu=sweep_worker_cpu)
        click.echo(json.dumps(result["summary"], indent=2))
        if json_path:
            Path(json_path).write_text(json.dumps(result, indent=2))
        return
    if only_flag:
        table = put_to_flag_table(50 if quick else 200, click.echo, mps=mps)
        if json_path:
            Path(json_path).write_text(json.dumps(table, indent=2))
        return
    result = run_gpu_benchmark(quick=quick, echo=click.echo, mps=mps)
    click.echo(json.dumps(result["summary"], indent=2))
    if json_path:
        Path(json_path).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
