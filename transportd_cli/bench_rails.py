"""`transportd bench rails`: two producers ("GPU" 0 and "GPU" 1 of node a) on one rail vs on two rails.

``LocalCluster`` starts two daemons (node a, node b), each with two rails (``softib0``/``softib1``, or
``softefa0``/``softefa1`` for efa): two soft devices and two proxy workers per node. Two producer processes
run at once; producer ``g`` joins rank ``g`` on node a and rank ``2 + g`` on node b and streams PUT_SIGNALs
from the first to the second, as ``transportd bench e2e`` does for one pair (same stream and latency
measures). Two phases, each its own job on the same daemons, so nothing but the routing differs:

one rail
    both producers join with ``device=0``: both rings are drained by rail 0's worker and both streams
    share rail 0's connection to node b (rail 1 idles).
two rails
    producer ``g`` joins with ``device=g``: rail-peer routing puts GPU 0 on rail 0 and GPU 1 on rail 1,
    each rail with its own worker, device and connection.

Aggregate commands/s = all commands whose flag arrived / the longer producer's time to its last flag (the
streams start together). Put->flag latency: both producers take one-at-a-time samples at the same time;
p50 = the mean of their p50s, p99 = the larger p99. ``ratio`` = two-rail commands/s over one-rail
commands/s. The bytes each rail of node a carried per phase are reported, so the routing is visible in
the JSON.

On a real multi-GPU node each rail has its own NIC and its worker its own cores; here every worker, both
daemons and both producers share this machine's CPUs, so the ratio says how much a second worker helps
on this host and nothing about NIC bandwidth. Compare ratios of one run; take absolute numbers from a
quiet host.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import traceback
from pathlib import Path
from typing import Any

import click
import numpy as np

from transportd.backends import DEVICE_KINDS
from transportd_cli.bench_e2e import stream_options

__all__ = ["bench_rails", "run_rails_benchmark"]

GPUS = 2
PHASES = (("one_rail", (0, 0)), ("two_rail", (0, 1)))  # phase name, the device each producer joins with


def _producer(sockets: list[str], job: str, g: int, device: int, size: int, window: int, seconds: float,
              samples: int, timeout_s: float, barrier: Any, release: Any, out: Any) -> None:
    """One producer process: join, stream, sample latency (in step with the other one), verify, report;
    stay joined until ``release`` is set (the parent reads the job's per-rail counters before it ends)."""
    from transportd_cli.bench_e2e import StreamPair, _latency, _stream

    pair = None
    try:
        # producer g: rank g on node a sends to rank 2 + g on node b, both on "GPU" ``device``
        pair = StreamPair(sockets, job, size, window, send_rank=g, recv_rank=GPUS + g, world=2 * GPUS,
                          device=device, seed=2024 + g, exchange_timeout_s=60.0)
        pair_rail = int(pair.sessions[0].info["rail"])
        barrier.wait(timeout_s)
        stream = _stream(pair, seconds, timeout_s)
        barrier.wait(timeout_s)
        lat = _latency(pair, samples, timeout_s)
        pair.channel.quiet(timeout=timeout_s)
        used = min(window, max(stream["commands"], samples)) * size
        if not np.array_equal(pair.recv[:used], pair.send[:used]):
            raise RuntimeError(f"producer {g}: received data differs from what was sent")
        out.send({"ok": True, "g": g, "rail": pair_rail, "stream": stream, "latency": lat})
        release.wait(timeout_s)
    except BaseException as exc:  # noqa: BLE001  (reported to the parent, which fails the run)
        out.send({"ok": False, "g": g, "error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()})
    finally:
        if pair is not None:
            pair.close()


def _rail_bytes(stats: dict[str, Any], job: str, node: str) -> dict[int, int]:
    out: dict[int, int] = {}
    for c in stats.get("connections", []):
        if c["job"] == job and c["node"] == node:
            out[c["rail"]] = out.get(c["rail"], 0) + int(c["bytes"])
    return out


def _phase(cluster: Any, name: str, devices: tuple[int, ...], *, size: int, window: int, seconds: float,
           samples: int, timeout_s: float) -> dict[str, Any]:
    from transportd.control.client import ControlConnection
    from transportd.control.protocol import Stats

    ctx = mp.get_context("spawn")
    job = f"bench-rails-{name}"
    sockets = [cluster.socket(n) for n in cluster.names]
    barrier, release = ctx.Barrier(GPUS), ctx.Event()
    pipes = [ctx.Pipe(duplex=False) for _ in range(GPUS)]
    procs = [ctx.Process(target=_producer, name=f"bench-rails-producer{g}", daemon=True,
                         args=(sockets, job, g, devices[g], size, window, seconds, samples, timeout_s, barrier,
                               release, pipes[g][1]))
             for g in range(GPUS)]
    for p in procs:
        p.start()
    results = []
    try:
        for g, (recv_end, _) in enumerate(pipes):
            if not recv_end.poll(timeout_s + seconds + 120):
                raise RuntimeError(f"{name}: producer {g} did not report")
            results.append(recv_end.recv())
        with ControlConnection(cluster.socket(cluster.names[0])) as conn:
            stats = conn.request(Stats())  # while the job still exists: its connections' bytes per rail
    finally:
        release.set()
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    for r in results:
        if not r["ok"]:
            raise RuntimeError(f"{name}: producer {r['g']} failed: {r['error']}\n{r['trace']}")
    commands = sum(r["stream"]["commands"] for r in results)
    elapsed = max(r["stream"]["elapsed_s"] for r in results)
    lat = [r["latency"] for r in results]
    p50 = float(np.mean([x["p50_us"] for x in lat])) if all("p50_us" in x for x in lat) else None
    p99 = float(max(x["p99_us"] for x in lat)) if all("p99_us" in x for x in lat) else None
    loaded = [r["stream"]["loaded_put_to_flag"].get("p50_us") for r in results]
    return {
        "devices": list(devices),
        "rails": [r["rail"] for r in results],
        "commands": commands,
        "elapsed_s": elapsed,
        "commands_per_s": commands / elapsed if elapsed > 0 else 0.0,
        "gbytes_per_s": commands * size / elapsed / 1e9 if elapsed > 0 else 0.0,
        "put_to_flag_p50_us": p50,
        "put_to_flag_p99_us": p99,
        "loaded_put_to_flag_p50_us": float(np.mean(loaded)) if None not in loaded else None,
        "bytes_by_rail": {str(k): v for k, v in sorted(_rail_bytes(stats, job, cluster.names[1]).items())},
        "producers": results,
    }


def run_rails_benchmark(*, backend: str = "ib", size: int = 4096, seconds: float = 3.0, window: int = 64,
                        samples: int = 500, timeout_s: float = 60.0, echo: Any = None) -> dict[str, Any]:
    """Start two two-rail daemons, run the one-rail and the two-rail phase, stop them; the JSON document."""
    from transportd_cli.localcluster import LocalCluster

    if window < 1 or samples < 1 or seconds <= 0:
        raise ValueError("window and samples must be >= 1 and seconds > 0")
    prefix = f"soft{DEVICE_KINDS[backend]}"  # the soft device kind its rails get
    rails = [{"device": f"{prefix}{g}", "gpu": g} for g in range(GPUS)]
    overrides: dict[str, dict[str, Any]] = {"backend": {"rails": rails},
                                            "logging": {"level": "warning", "format": "text"}}
    config = {"backend": backend, "rails": rails, "size": size, "seconds": seconds, "window": window,
              "samples": samples, "producers": GPUS, "producer": "cpu (one process per GPU)",
              "direction": "node a GPU g -> node b GPU g"}
    result: dict[str, Any] = {"config": config}
    with LocalCluster(2, backend=backend, overrides=overrides) as cluster:
        for name, devices in PHASES:
            if echo:
                echo(f"{name.replace('_', ' ')}: {GPUS} producers on device(s) {sorted(set(devices))}, "
                     f"{size} B PUT_SIGNALs for {seconds} s ...")
            result[name] = _phase(cluster, name, devices, size=size, window=window, seconds=seconds,
                                  samples=samples, timeout_s=timeout_s)
    one, two = result["one_rail"], result["two_rail"]
    result["summary"] = {
        "one_rail_commands_per_s": one["commands_per_s"],
        "two_rail_commands_per_s": two["commands_per_s"],
        "ratio": two["commands_per_s"] / one["commands_per_s"] if one["commands_per_s"] else None,
        "one_rail_put_to_flag_p50_us": one["put_to_flag_p50_us"],
        "two_rail_put_to_flag_p50_us": two["put_to_flag_p50_us"],
        "one_rail_put_to_flag_p99_us": one["put_to_flag_p99_us"],
        "two_rail_put_to_flag_p99_us": two["put_to_flag_p99_us"],
        "one_rail_bytes_by_rail": one["bytes_by_rail"],
        "two_rail_bytes_by_rail": two["bytes_by_rail"],
    }
    return result


def print_table(res: dict[str, Any], echo: Any = click.echo) -> None:
    c, s = res["config"], res["summary"]
    one, two = res["one_rail"], res["two_rail"]
    echo(f"bench rails: {c['backend']} over softverbs, {c['producers']} producers, {c['size']} B PUT_SIGNAL, "
         f"window {c['window']} each, {c['direction']}")

    def fmt(v: Any, spec: str) -> str:
        return "-" if v is None else format(v, spec)

    rows = [
        ("aggregate commands/s", fmt(one["commands_per_s"], ",.0f"), fmt(two["commands_per_s"], ",.0f")),
        ("aggregate GB/s", fmt(one["gbytes_per_s"], ".3f"), fmt(two["gbytes_per_s"], ".3f")),
        ("put-to-flag p50 us (1 in flight each)", fmt(one["put_to_flag_p50_us"], ".1f"),
         fmt(two["put_to_flag_p50_us"], ".1f")),
        ("put-to-flag p99 us (1 in flight each)", fmt(one["put_to_flag_p99_us"], ".1f"),
         fmt(two["put_to_flag_p99_us"], ".1f")),
        (f"put-to-flag p50 us (window {c['window']})", fmt(one["loaded_put_to_flag_p50_us"], ".1f"),
         fmt(two["loaded_put_to_flag_p50_us"], ".1f")),
        ("rails used (producer 0, 1)", ",".join(map(str, one["rails"])), ",".join(map(str, two["rails"]))),
        ("bytes sent per rail (node a)", _by_rail(one["bytes_by_rail"]), _by_rail(two["bytes_by_rail"])),
    ]
    width = max(len(r[0]) for r in rows) + 2
    col = max(14, *(len(r[1]) + 2 for r in rows))
    echo(f"{'measure':<{width}}{'one rail':<{col}}two rails")
    for key, a, b in rows:
        echo(f"{key:<{width}}{a:<{col}}{b}")
    ratio = s["ratio"]
    echo(f"two rails / one rail, commands/s: {'-' if ratio is None else f'{ratio:.2f}'}")


def _by_rail(by_rail: dict[str, int]) -> str:
    return " ".join(f"{k}:{v >> 20}MiB" if v >= 1 << 20 else f"{k}:{v}B" for k, v in by_rail.items()) or "-"


@click.command("rails")
@click.option("--backend", type=click.Choice(["ib", "efa"]), default="ib", show_default=True)
@stream_options(samples=500, per=" per producer")
@click.option("--quick", is_flag=True, help="smoke run: 0.5 s streams, 30 samples")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="write the results as JSON here")
def bench_rails(backend: str, size_text: str, seconds: float, window: int, samples: int, quick: bool,
                json_path: Path | None) -> None:
    """Two producers on one rail vs two rails (two daemons, two rails each): commands/s and put->flag."""
    from transportd.errors import TransportdError
    from transportd_cli.bench_e2e import parse_size

    try:
        size = parse_size(size_text)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--size") from None
    if quick:
        seconds, samples = min(seconds, 0.5), min(samples, 30)
    try:
        res = run_rails_benchmark(backend=backend, size=size, seconds=seconds, window=window, samples=samples,
                                  echo=click.echo)
    except (RuntimeError, TimeoutError, ValueError, TransportdError) as exc:
        raise click.ClickException(str(exc)) from None
    print_table(res)
    if json_path is not None:
        json_path.write_text(json.dumps(res, indent=2))
        click.echo(f"wrote {json_path}")
