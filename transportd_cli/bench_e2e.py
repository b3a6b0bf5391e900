"""`transportd bench e2e`: two real daemons over softverbs, a CPU producer, data and flags end to end.

``LocalCluster`` starts two daemons (node a, node b) on this machine with the chosen backend; this one
process joins a rank on each (rank 0 on a, rank 1 on b) and drives both: rank 0 pushes PUT_SIGNALs of
``size`` bytes through its command ring (``ChannelHandle.put_signal``, one record per push, as a kernel
thread would), each adding 1 to rank 1's flag 0, and rank 1's flag is read straight from its flag file.
Everything crosses the real path: ring -> node a's proxy -> backend -> softverbs -> node b's memory (ib:
the NIC writes the flag; efa: node b's daemon counts the pieces and publishes it).

Phases:

stream
    For ``seconds``: keep ``window`` commands in flight (a new one is pushed when the flag shows an old
    one landed; destinations cycle through ``window`` slots, so a slot is rewritten only after its flag
    came). ``commands/s`` and ``GB/s`` = commands (bytes) whose flag arrived / time to the last flag.
    The loaded latency is the same put-to-flag measure taken in this phase; the flag is read between
    pushes, so it is late by up to one push (a few microseconds).
latency
    ``samples`` commands one at a time: timestamp (CLOCK_MONOTONIC) right before the push, spin on the
    flag, timestamp when it shows. Includes the daemon's polling window (``--poll-window-us``), which a
    lone command waits out before its batch is posted.
baseline
    (not with ``--quick``) the softverbs loopback stream of the same write size between two bare QPs
    (``transportd bench softverbs``' measurement, RC for ib, SRD for efa): the ceiling of the transport
    under the daemon path, so ``e2e / raw`` is a ratio measured in the same run.

At the end every destination slot is compared with its source. Shared machines are noisy: compare the
ratios of one run, and take absolute numbers from a quiet host.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click
import numpy as np

from transportd.backends import TRAITS, TRANSPORTS
from transportd_cli.cli_options import FiniteFloat, check_signal_mode

__all__ = ["bench_e2e", "parse_size", "run_e2e_benchmark"]

JOB = "bench-e2e"
_STAT_KEYS = ("commands", "bytes", "wrs", "signals", "batches", "batches_full", "batches_partial", "stalls",
              "signal_stalls", "completion_errors", "rejected")


def parse_size(text: str | int) -> int:
    """``4096``, ``4k``, ``4KiB``, ``64KB``, ``1m``, ``1MiB`` -> bytes (K and M are powers of two)."""
    if isinstance(text, int):
        return text
    s = text.strip().lower().removesuffix("b").removesuffix("i")
    mult = 1
    if s and s[-1] in "km":
        mult = 1 << (10 if s[-1] == "k" else 20)
        s = s[:-1]
    try:
        value = int(s) * mult
    except ValueError:
        raise ValueError(f"not a size: {text!r} (try 4096, 4KiB, 1MiB)") from None
    if value <= 0:
        raise ValueError(f"size must be positive, got {text!r}")
    return value


def _percentiles(ns: np.ndarray) -> dict[str, float]:
    if not len(ns):
        return {"samples": 0}
    us = ns / 1e3
    return {"samples": int(len(us)), "p50_us": float(np.percentile(us, 50)), "p99_us": float(np.percentile(us, 99)),
            "min_us": float(us.min()), "max_us": float(us.max()), "mean_us": float(us.mean())}


def _daemon_counters(stats: dict[str, Any]) -> dict[str, int]:
    rails = [r for r in stats.get("rails", []) if "error" not in r]
    return {k: sum(int(r.get(k, 0)) for r in rails) for k in _STAT_KEYS}


class StreamPair:
    """A sending rank and a receiving rank of one job, on two nodes, driven from this process.

    ``put(k)`` streams into a window of ``window`` slots of ``size`` bytes; the receiver's flag 0 counts
    arrived commands. bench rails reuses it with more ranks per job and a device per producer.
    """

    def __init__(self, sockets: list[str], job: str, size: int, window: int, *, send_rank: int = 0,
                 recv_rank: int = 1, world: int = 2, device: int | None = None, seed: int = 2024,
                 exchange_timeout_s: float = 30.0) -> None:
        import gpuclient

        self.clients = [gpuclient.connect(s) for s in sockets]
        self.sessions = [c.join(job, rank=r, world=world, device=device)
                         for c, r in zip(self.clients, (send_rank, recv_rank), strict=True)]
        span = size * window
        self.send = gpuclient.host_array(span)
        self.send[:] = np.random.default_rng(seed).integers(0, 256, span, dtype=np.uint8)
        self.recv = gpuclient.host_array(span)
        self.src = self.sessions[0].register(self.send)
        self.dst = self.sessions[1].register(self.recv)
        for s in self.sessions:
            s.flags(4)
        gpuclient.exchange_all(self.sessions, timeout=exchange_timeout_s)
        self.peer = recv_rank
        self.channel = self.sessions[0].channel(capacity=1 << max(10, (2 * window - 1).bit_length()))
        flags = self.sessions[1].flag_array
        assert flags is not None
        self.flag = flags.values  # the receiver's flag words, mapped: slot 0 counts arrived commands
        self.size = size
        self.window = window

    def put(self, k: int) -> None:
        off = (k % self.window) * self.size
        self.channel.put_signal(peer=self.peer, dst_region=self.dst.id, dst_off=off, src_region=self.src.id,
                                src_off=off, nbytes=self.size, slot=0, value=1)

    def arrived(self) -> int:
        return int(self.flag[0])

    def close(self) -> None:
        for s in self.sessions:
            try:
                s.leave()
            except Exception:  # noqa: BLE001  (a daemon already gone: nothing left to release)
                pass
        for c in self.clients:
            c.close()


def _stream(pair: StreamPair, seconds: float, timeout_s: float) -> dict[str, Any]:
    window = pair.window
    base = pair.arrived()
    push_ns: list[int] = []
    seen_ns: list[int] = []
    sent = seen = 0
    now = time.monotonic_ns
    t0 = now()
    stop = t0 + int(seconds * 1e9)
    give_up = stop + int(timeout_s * 1e9)
    while True:
        t = now()
        if t < stop and sent - seen < window:
            push_ns.append(t)
            pair.put(sent)
            sent += 1
        got = pair.arrived() - base
        if got > seen:
            t = now()
            seen_ns.extend([t] * (got - seen))
            seen = got
        elif t >= stop and seen >= sent:
            break
        elif t > give_up:
            raise click.ClickException(f"stream: {sent - seen} of {sent} flags never arrived "
                                       f"(flag {pair.arrived()}, started at {base})")
    if seen != sent:
        raise click.ClickException(f"stream: {seen} flags for {sent} commands (lost or duplicated signals)")
    elapsed = (seen_ns[-1] - t0) / 1e9 if seen_ns else seconds
    lat = np.asarray(seen_ns, dtype=np.int64) - np.asarray(push_ns, dtype=np.int64)
    return {"commands": sent, "bytes": sent * pair.size, "elapsed_s": elapsed,
            "commands_per_s": sent / elapsed, "gbytes_per_s": sent * pair.size / elapsed / 1e9,
            "loaded_put_to_flag": _percentiles(lat)}


def _latency(pair: StreamPair, samples: int, timeout_s: float, gap_s: float = 0.0) -> dict[str, Any]:
    """``samples`` put-to-flag round trips, one at a time, ``gap_s`` of idleness before each."""
    flag = pair.flag
    now = time.monotonic_ns
    out = np.zeros(samples, dtype=np.int64)
    for i in range(samples):
        if gap_s:
            time.sleep(gap_s)
        target = int(flag[0]) + 1
        t0 = now()
        pair.put(i)
        spins = 0
        while int(flag[0]) < target:
            spins += 1
            if not spins & 0xFFFF and now() - t0 > timeout_s * 1e9:
                raise click.ClickException(f"latency: sample {i}'s flag did not arrive in {timeout_s}s")
        out[i] = now() - t0
    return _percentiles(out)


def _baseline(backend: str, size: int, seconds: float) -> dict[str, Any]:
    from softverbs.soft.bench import _run_kind

    kind = TRANSPORTS[backend]
    res = _run_kind(kind, [size], seconds, 64)[str(size)]
    return {"qp": kind, "bytes_per_s": res["bytes_per_s"], "wr_per_s": res["wr_per_s"],
            "gbytes_per_s": res["bytes_per_s"] / 1e9}


def run_e2e_benchmark(*, backend: str = "ib", signal_mode: str = "write", size: int = 4096, seconds: float = 3.0,
                      window: int = 64, samples: int = 1000, decoupled: bool = False, adaptive_routing: bool = False,
                      poll_window_us: int | None = None, baseline: bool = True, timeout_s: float = 60.0,
                      gap_ms: float = 0.0, loop_cpus: tuple[int, int] | None = None,
                      echo: Any = None) -> dict[str, Any]:
    """Start two daemons, measure (stream, latency, baseline), stop them; returns the JSON document.
    ``loop_cpus``: node a's and node b's rail loop each on that CPU alone (``backend.rails[].loop_cpu``)."""
    from transportd_cli.localcluster import LocalCluster

    if window < 1 or samples < 0 or seconds <= 0 or gap_ms < 0:
        raise ValueError("window must be >= 1, samples >= 0, seconds > 0 and gap_ms >= 0")
    overrides: dict[str, dict[str, Any]] = {
        "signal": {"mode": signal_mode, "decoupled": decoupled},
        "softverbs": {"adaptive_routing": adaptive_routing},
        "logging": {"level": "warning", "format": "text"},
    }
    if poll_window_us is not None:
        overrides["proxy"] = {"poll_window_us": poll_window_us}
    per_node: dict[str, dict[str, Any]] = {}
    if loop_cpus is not None:  # the soft device a daemon's one rail opens by default, named so it can be configured
        device = f"{'softefa' if backend == 'efa' else 'softib'}0"
        per_node = {name: {"backend": {"rails": [{"device": device, "loop_cpu": cpu}]}}
                    for name, cpu in zip(("nodea", "nodeb"), loop_cpus, strict=True)}
    publishes = TRAITS[backend].publishes_flags  # then the signal mode does not apply
    config = {"backend": backend, "signal_mode": "receiver publishes" if publishes else signal_mode,
              "size": size, "seconds": seconds, "window": window, "samples": samples, "decoupled": decoupled,
              "adaptive_routing": adaptive_routing, "poll_window_us": poll_window_us, "producer": "cpu",
              "gap_ms": gap_ms, "loop_cpus": list(loop_cpus) if loop_cpus else None,
              "direction": "rank 0 (node a) -> rank 1 (node b)"}
    result: dict[str, Any] = {"config": config}
    with LocalCluster(2, backend=backend, overrides=overrides, per_node=per_node) as cluster:
        pair = StreamPair([cluster.socket(n) for n in cluster.names], JOB, size, window)
        try:
            if echo:
                echo(f"2 daemons up ({backend} over softverbs); streaming {size} B PUT_SIGNALs for {seconds} s ...")
            stream = _stream(pair, seconds, timeout_s)
            latency = _latency(pair, samples, timeout_s, gap_ms / 1000)
            pair.channel.quiet(timeout=timeout_s)
            used = min(window, max(stream["commands"], samples)) * size
            if not np.array_equal(pair.recv[:used], pair.send[:used]):
                raise click.ClickException("received data differs from what was sent")
            result["daemon_a"] = _daemon_counters(pair.clients[0].stats())
            result["loop_cpus"] = [c.stats()["rails"][0].get("loop_cpu") for c in pair.clients]  # as the daemons say
        finally:
            pair.close()
    result["stream"] = stream
    result["latency"] = latency
    loaded = stream["loaded_put_to_flag"]
    summary = {
        "commands_per_s": stream["commands_per_s"],
        "gbytes_per_s": stream["gbytes_per_s"],
        "put_to_flag_p50_us": latency.get("p50_us", loaded.get("p50_us")),
        "put_to_flag_p99_us": latency.get("p99_us", loaded.get("p99_us")),
        "loaded_put_to_flag_p50_us": loaded.get("p50_us"),
        "loaded_put_to_flag_p99_us": loaded.get("p99_us"),
    }
    if baseline:
        if echo:
            echo("baseline: softverbs loopback stream of the same write size ...")
        base = _baseline(backend, size, min(seconds, 2.0))
        result["baseline"] = base
        summary["raw_softverbs_gbytes_per_s"] = base["gbytes_per_s"]
        summary["e2e_over_raw"] = stream["gbytes_per_s"] / base["gbytes_per_s"] if base["gbytes_per_s"] else None
    result["summary"] = summary
    return result


def _fmt_size(n: int) -> str:
    for unit, shift in (("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift} {unit}"
    return f"{n} B"


def print_table(res: dict[str, Any], echo: Any = click.echo) -> None:
    c, s = res["config"], res["summary"]
    lat, loaded = res["latency"], res["stream"]["loaded_put_to_flag"]
    echo(f"bench e2e: {c['backend']} over softverbs, signal {c['signal_mode']}"
         f"{', decoupled' if c['decoupled'] else ''}{', adaptive routing' if c['adaptive_routing'] else ''}, "
         f"{_fmt_size(c['size'])} PUT_SIGNAL, window {c['window']}, {c['direction']}")
    rows = [
        ("commands/s", f"{s['commands_per_s']:,.0f}"),
        ("GB/s", f"{s['gbytes_per_s']:.3f}"),
        (f"put-to-flag p50 us (1 in flight, n={lat.get('samples', 0)}"
         f"{', ' + format(c['gap_ms'], 'g') + ' ms idle before each' if c.get('gap_ms') else ''})",
         f"{s['put_to_flag_p50_us']:.1f}"),
        ("put-to-flag p99 us (1 in flight)", f"{s['put_to_flag_p99_us']:.1f}"),
        (f"put-to-flag p50 us (window {c['window']})", f"{loaded['p50_us']:.1f}"),
        (f"put-to-flag p99 us (window {c['window']})", f"{loaded['p99_us']:.1f}"),
        ("commands streamed", f"{res['stream']['commands']:,}"),
    ]
    if "baseline" in res:
        raw = f"raw softverbs {res['baseline']['qp'].upper()} GB/s (same size)"
        rows += [(raw, f"{s['raw_softverbs_gbytes_per_s']:.3f}"), ("e2e / raw", f"{s['e2e_over_raw']:.2f}")]
    if c.get("loop_cpus"):
        rows.append(("rail loops alone on CPUs (a, b)", ", ".join(str(x) for x in res.get("loop_cpus") or [])))
    d = res.get("daemon_a")
    if d:
        rows.append(("node a proxy: batches full/partial", f"{d['batches_full']:,}/{d['batches_partial']:,}"))
    width = max(len(k) for k, _ in rows) + 2
    echo(f"{'measure':<{width}}value")
    for key, value in rows:
        echo(f"{key:<{width}}{value}")


def stream_options(*, samples: int, per: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """--size, --seconds, --window and --samples of the streaming benchmarks (``per``: " per producer" etc.)."""
    def apply(fn: Callable[..., Any]) -> Callable[..., Any]:
        for option in reversed([
            click.option("--size", "size_text", default="4KiB", show_default=True,
                         help="message size (4096, 64KiB, 1MiB)"),
            click.option("--seconds", default=3.0, show_default=True, type=FiniteFloat(min=0, min_open=True, max=3600),
                         help=f"stream phase duration{per and ', per phase'}"),
            click.option("--window", default=64, show_default=True, type=click.IntRange(1, 1 << 16),
                         help=f"commands in flight{per or ' in the stream phase'}"),
            click.option("--samples", default=samples, show_default=True, type=click.IntRange(1, 1 << 24),
                         help=f"one-at-a-time latency samples{per}")]):
            fn = option(fn)
        return fn

    return apply


@click.command("e2e")
@click.option("--backend", type=click.Choice(["ib", "efa"]), default="ib", show_default=True)
@click.option("--signal-mode", type=click.Choice(["write", "atomic", "fence"]), default="write", show_default=True,
              help="ib signal mode (efa: the receiving daemon publishes flags; ignored)")
@stream_options(samples=1000, per="")
@click.option("--decoupled", is_flag=True, help="Perseus decoupled signaling in the daemons")
@click.option("--adaptive-routing", is_flag=True, help="softverbs adaptive routing (ib; not with write mode)")
@click.option("--poll-window-us", type=click.IntRange(0, 1_000_000), default=None,
              help="daemon proxy polling window [default: config's]")
@click.option("--gap-ms", type=FiniteFloat(min=0, max=60_000), default=0.0, show_default=True,
              help="idle time before each latency sample (the first command after a pause)")
@click.option("--loop-cpus", "loop_cpus_text", default=None, metavar="A,B",
              help="node a's and node b's rail loop each alone on that CPU (backend.rails[].loop_cpu)")
@click.option("--baseline/--no-baseline", default=True, show_default=True,
              help="also measure the bare softverbs stream of the same size (e2e / raw ratio)")
@click.option("--quick", is_flag=True, help="smoke run: 0.5 s stream, 50 samples, no baseline (unless given)")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="write the results as JSON here")
def bench_e2e(backend: str, signal_mode: str, size_text: str, seconds: float, window: int, samples: int,
              decoupled: bool, adaptive_routing: bool, poll_window_us: int | None, gap_ms: float,
              loop_cpus_text: str | None, baseline: bool, quick: bool, json_path: Path | None) -> None:
    """Two daemons over softverbs, CPU producer: commands/s, GB/s, put-to-flag latency."""
    try:
        size = parse_size(size_text)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--size") from None
    loop_cpus = None
    if loop_cpus_text is not None:
        parts = loop_cpus_text.split(",")
        if len(parts) != 2 or not all(p.strip().isdigit() for p in parts) or int(parts[0]) == int(parts[1]):
            raise click.BadParameter(f"two different CPU numbers, A,B; got {loop_cpus_text!r}",
                                     param_hint="--loop-cpus")
        loop_cpus = (int(parts[0]), int(parts[1]))
    check_signal_mode(backend, signal_mode, adaptive_routing)
    if quick:  # shorter defaults; what the command line says explicitly still holds
        source = click.get_current_context().get_parameter_source
        given = {name for name in ("seconds", "samples", "baseline")
                 if source(name) is not click.core.ParameterSource.DEFAULT}
        seconds = seconds if "seconds" in given else 0.5
        samples = samples if "samples" in given else 50
        baseline = baseline if "baseline" in given else False
    from transportd.errors import TransportdError

    try:
        res = run_e2e_benchmark(backend=backend, signal_mode=signal_mode, size=size, seconds=seconds,
                                window=window, samples=samples, decoupled=decoupled,
                                adaptive_routing=adaptive_routing, poll_window_us=poll_window_us,
                                gap_ms=gap_ms, baseline=baseline, loop_cpus=loop_cpus, echo=click.echo)
    except (RuntimeError, TimeoutError, ValueError, TransportdError) as exc:
        raise click.ClickException(str(exc)) from None
    print_table(res)
    if json_path is not None:
        json_path.write_text(json.dumps(res, indent=2))
        click.echo(f"wrote {json_path}")
