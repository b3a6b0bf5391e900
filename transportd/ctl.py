"""The `transportctl` command: inspect a running daemon through its control socket.

Every command takes ``--socket`` (default: ``TRANSPORTD_SOCKET`` or the configured default) and
``--json`` (machine-readable output). A daemon that is not running, or a socket this user may not open,
is a one-line error with what to do about it, and exit status 2.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from typing import Any

import click

from transportd.connection import ControlConnection
from transportd.errors import TransportdError
from transportd.protocol import Inspect, Stats

__all__ = ["main"]


def _fetch(socket: str | None, request: Any = None) -> dict[str, Any]:
    try:
        with ControlConnection(socket, timeout_ms=5000, name="transportctl") as conn:
            return conn.request(request if request is not None else Stats())
    except TransportdError as exc:
        click.echo(f"transportctl: {exc}", err=True)
        sys.exit(2)


def _emit(data: Any, as_json: bool, human: Callable[[Any], str]) -> None:
    click.echo(json.dumps(data, indent=2, sort_keys=True, default=str) if as_json else human(data))


def _common(fn: Callable[..., None]) -> Callable[..., None]:
    fn = click.option("--json", "as_json", is_flag=True, help="print JSON")(fn)
    fn = click.option("--socket", default=None, help="control endpoint (ipc://... or tcp://...)")(fn)
    return fn


@click.group()
@click.version_option(package_name="transportd")
def main() -> None:
    """Inspect a running transportd."""


def _table(rows: list[list[Any]], header: list[str]) -> str:
    cells = [header] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in cells)


def _status_text(s: dict[str, Any]) -> str:
    peers = s.get("peers", {})
    up = sum(1 for p in peers.values() if p.get("up"))
    lines = [
        f"node      {s['node']}",
        f"backend   {s['backend']}  ({len(s.get('rails', []))} rail(s))",
        f"uptime    {s['uptime_s']:.0f} s",
        f"clients   {s['clients']}",
        f"peers     {up} up, {len(peers) - up} down",
    ]
    for rail in s.get("rails", []):
        lines.append(f"rail {rail.get('rail', '?')}    {rail.get('backend', '?')}  device {rail.get('device', '-')}"
                     + (f"  ERROR {rail['error']}" if "error" in rail else ""))
    return "\n".join(lines)


@main.command()
@_common
def status(socket: str | None, as_json: bool) -> None:
    """Node, backend, devices, uptime, clients, peers up/down."""
    _emit(_fetch(socket), as_json, _status_text)


def _peers_text(s: dict[str, Any]) -> str:
    conns = s.get("connections", [])
    rows = []
    for node, p in sorted(s.get("peers", {}).items()):
        n = sum(1 for c in conns if c["node"] == node)
        rtt = "-" if p.get("rtt_us") is None else f"{p['rtt_us']:.0f}"
        rows.append([node, "up" if p["up"] else "DOWN", rtt, p.get("bytes", 0), n])
    return _table(rows, ["peer", "state", "rtt_us", "bytes", "connections"]) if rows else "no peers known"


@main.command()
@_common
def peers(socket: str | None, as_json: bool) -> None:
    """Per peer: state, RTT from heartbeats, bytes, connections."""
    s = _fetch(socket)
    _emit({"peers": s.get("peers", {}), "connections": s.get("connections", [])}, as_json, lambda _: _peers_text(s))


def _queues_text(s: dict[str, Any]) -> str:
    rings, conns = [], []
    for rail in s.get("rails", []):
        for ch in rail.get("channels", []):
            rings.append([rail.get("rail"), ch.get("channel"), f"{ch.get('job')}/{ch.get('rank')}", ch.get("depth"),
                          ch.get("credits"), f"{ch.get('oldest_age_us', 0):.0f}"])
        for c in rail.get("connections", []):
            hist = c.get("batch_hist", [])
            conns.append([rail.get("rail"), c.get("conn"), c.get("inflight"), c.get("batches_full"),
                          c.get("batches_partial"), " ".join(str(h) for h in hist)])
    out = [_table(rings, ["rail", "channel", "job/rank", "depth", "credits", "oldest_us"]) if rings else "no rings"]
    out.append("")
    out.append(_table(conns, ["rail", "conn", "inflight", "full", "partial", "batch sizes 1..8"])
               if conns else "no connections")
    return "\n".join(out)


@main.command()
@_common
def queues(socket: str | None, as_json: bool) -> None:
    """Per ring: depth, credits, oldest age; per connection: inflight, batches, batch-size histogram."""
    s = _fetch(socket)
    data = {"rails": [{k: r.get(k) for k in ("rail", "channels", "connections")} for r in s.get("rails", [])]}
    _emit(data, as_json, lambda _: _queues_text(s))


_COUNTERS = ("commands", "bytes", "signals", "fences", "batches_full", "batches_partial", "stalls")


def _counters(s: dict[str, Any]) -> dict[str, Any]:
    rails = [r for r in s.get("rails", []) if "error" not in r]
    totals: dict[str, Any] = {k: sum(r.get(k, 0) for r in rails) for k in _COUNTERS}
    errors: dict[str, int] = {}
    for r in rails:
        for code, n in r.get("errors", {}).items():
            errors[code] = errors.get(code, 0) + n
    totals["errors"] = errors
    return totals


def _stats_text(c: dict[str, Any]) -> str:
    lines = [f"{k:<16}{c[k]}" for k in _COUNTERS]
    lines.append("errors          " + (", ".join(f"{k}={v}" for k, v in sorted(c["errors"].items())) or "none"))
    return "\n".join(lines)


@main.command()
@_common
def stats(socket: str | None, as_json: bool) -> None:
    """Counters: commands, bytes, signals, fences, stalls, errors by code."""
    _emit(_counters(_fetch(socket)), as_json, _stats_text)


@main.command()
@click.argument("job")
@click.argument("rank", type=int)
@_common
def flags(job: str, rank: int, socket: str | None, as_json: bool) -> None:
    """A client's flag values (JOB RANK must be joined on this node)."""
    reply = _fetch(socket, Inspect(what="flags", job=job, rank=rank))
    _emit(reply, as_json, lambda r: _table([[i, v] for i, v in enumerate(r["values"]) if v], ["slot", "value"])
          + f"\n({len(r['values'])} slots, nonzero shown; status {r.get('status', 0)})")


@main.command()
@click.option("--interval", default=1.0, show_default=True, help="seconds between refreshes")
@click.option("--iterations", default=0, help="stop after N refreshes (0: until Ctrl-C)")
@_common
def top(interval: float, iterations: int, socket: str | None, as_json: bool) -> None:
    """A live view: rates per second and queue depths, refreshed like top."""
    previous: dict[str, Any] | None = None
    count = 0
    try:
        while iterations == 0 or count < iterations:
            s = _fetch(socket)
            c = _counters(s)
            rates = {k: (c[k] - previous[k]) / interval for k in _COUNTERS} if previous else {k: 0 for k in _COUNTERS}
            previous = c
            count += 1
            if as_json:
                click.echo(json.dumps({"t": time.time(), "rates": rates, "totals": c}, default=str))
            else:
                click.clear()
                click.echo(_status_text(s))
                click.echo("")
                click.echo(_table([[k, f"{rates[k]:.0f}", c[k]] for k in _COUNTERS], ["counter", "per_s", "total"]))
                click.echo("")
                click.echo(_queues_text(s))
            if iterations == 0 or count < iterations:
                time.sleep(interval)
    except KeyboardInterrupt:
        pass
