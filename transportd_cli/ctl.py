"""The `transportctl` command: inspect a running daemon through its control socket.

Every command takes ``--socket`` (default: ``$TRANSPORTD_SOCKET``, else ``ipc:///run/transportd/control.sock``)
and ``--json`` (one JSON document on stdout, for scripts). Exit status: 0 on success; 2 when the daemon
cannot be reached — not running, no socket file, a stale socket, no permission to use it — with one line
on stderr saying what is wrong and what to do; 1 when the request was refused, by the daemon (e.g.
``flags`` for a rank not joined on this node) or before it was sent (a job name or rank the protocol does
not allow), also one line. Options click itself refuses (unknown, missing, out of range, not a finite
number) print click's usage error and exit 2, as every click program does; nothing was sent then.

Before speaking zmq, an ipc endpoint is probed with a plain ``connect()``: a missing file, a refused
connection (a socket left behind by a daemon that died) and a permission error are told apart at once
instead of after a handshake timeout.
"""

from __future__ import annotations

import errno
import grp
import json
import os
import shutil
import socket as _socket
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, NoReturn

import click

from transportd.control.client import ControlConnection, not_a_socket, resolve_endpoint
from transportd.control.curve import CurveClientKeys
from transportd.control.protocol import Inspect, Stats
from transportd.errors import ErrorCode, LocalProtocolError, RequestError, TransportdError
from transportd_cli.cli_options import FiniteFloat, Program, harden, writable_problem
from transportd_cli.replay import trace_start, trace_stop

__all__ = ["main"]

EXIT_UNREACHABLE = 2
EXIT_REFUSED = 1
_START = "start it with `systemctl start transportd` (or `transportd run --config FILE`), or pass --socket"


def _fail(message: str, status: int = EXIT_UNREACHABLE) -> NoReturn:
    click.echo("transportctl: " + " ".join(message.split()), err=True)  # always one line
    sys.exit(status)


def _probe_ipc(endpoint: str) -> None:
    """Fail with a precise one-line reason when an ipc endpoint cannot be used; return if it can."""
    if not endpoint.startswith("ipc://"):
        return
    path = endpoint[len("ipc://"):]
    if kind := not_a_socket(path):
        _fail(f"{path} is {kind}, not a control socket: give the daemon's socket file (control.socket, e.g. "
              "ipc:///run/transportd/control.sock)")
    address = "\0" + path[1:] if path.startswith("@") else path
    sock = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
    sock.settimeout(2.0)
    try:
        sock.connect(address)
    except FileNotFoundError:
        _fail(f"transportd is not running: control socket {path} does not exist; {_START}")
    except PermissionError:
        _fail(_permission_problem(path))
    except ConnectionRefusedError:
        _fail(f"transportd is not running: nothing listens on {path} (a socket left by a daemon that exited; "
              f"`journalctl -u transportd` says why); {_START}")
    except OSError as exc:
        if exc.errno in (errno.EACCES, errno.EPERM):
            _fail(_permission_problem(path))
        _fail(f"cannot connect to {path}: {exc.strerror or exc}")
    finally:
        sock.close()


def _permission_problem(path: str) -> str:
    try:
        st = os.stat(path)
    except OSError:
        return (f"no permission to reach control socket {path}: this user cannot search its directory "
                f"{os.path.dirname(path)}")
    try:
        group = grp.getgrgid(st.st_gid).gr_name
    except KeyError:
        group = str(st.st_gid)
    return (f"no permission to use control socket {path} (mode {st.st_mode & 0o777:04o}, group {group}): "
            f"add this user to group {group} (the daemon's control.group), or run as root")


@contextmanager
def _connection(socket: str | None) -> Iterator[ControlConnection]:
    """A control connection; a refusal exits 1, an unreachable daemon 2, each with its one line."""
    endpoint = resolve_endpoint(socket)
    _probe_ipc(endpoint)
    try:
        with ControlConnection(endpoint, timeout_ms=5000, name="transportctl", curve=_curve_keys()) as conn:
            yield conn
    except (RequestError, LocalProtocolError) as exc:  # refused by the daemon, or before it was sent
        _fail(str(exc), EXIT_REFUSED)
    except TransportdError as exc:
        _fail(str(exc))


def _fetch(socket: str | None, request: Callable[[], Any] = Stats) -> dict[str, Any]:
    """The reply to ``request()`` (built here, so a field the protocol refuses is a one-line refusal)."""
    with _connection(socket) as conn:
        return conn.request(request())


def _emit(data: Any, as_json: bool, human: Callable[[Any], str]) -> None:
    click.echo(json.dumps(data, indent=2, sort_keys=True, default=str) if as_json else human(data))


def _common(fn: Callable[..., None]) -> Callable[..., None]:
    fn = click.option("--json", "as_json", is_flag=True, help="print JSON")(fn)
    fn = click.option("--socket", default=None, metavar="ENDPOINT",
                      help="control endpoint (ipc:///path or tcp://host:port); default $TRANSPORTD_SOCKET, "
                           "else ipc:///run/transportd/control.sock")(fn)
    return fn


def _curve_keys() -> CurveClientKeys | None:
    """CURVE client keys from the group options, for a daemon whose control socket is tcp with CURVE."""
    ctx = click.get_current_context(silent=True)
    opts = (ctx.find_root().obj if ctx else None) or {}
    secret, server = opts.get("curve_secret_key"), opts.get("curve_server_key")
    if not secret and not server:
        return None
    if not (secret and server):
        _fail("give both --curve-secret-key and --curve-server-key (or neither)", EXIT_REFUSED)
    try:
        return CurveClientKeys.from_files(secret, server)
    except (OSError, ValueError) as exc:
        _fail(f"cannot load CURVE keys: {exc}", EXIT_REFUSED)
    return None


@click.group(cls=Program, prefix="transportctl")
@click.version_option(package_name="transportd")
@click.option("--curve-secret-key", type=click.Path(dir_okay=False), envvar="TRANSPORTD_CURVE_SECRET_KEY",
              help="this client's CURVE secret key file (for a tcp:// control socket with CURVE)")
@click.option("--curve-server-key", type=click.Path(dir_okay=False), envvar="TRANSPORTD_CURVE_SERVER_KEY",
              help="the daemon's CURVE public key file")
@click.pass_context
def main(ctx: click.Context, curve_secret_key: str | None, curve_server_key: str | None) -> None:
    """Inspect a running transportd (exit 2: daemon not reachable)."""
    ctx.obj = {"curve_secret_key": curve_secret_key, "curve_server_key": curve_server_key}


# --- formatting ----------------------------------------------------------------------------------------
def _table(rows: list[list[Any]], header: list[str]) -> str:
    cells = [header] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in cells)


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)  # pragma: no cover


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    d, rest = divmod(seconds, 86400)
    h, rest = divmod(rest, 3600)
    m, s = divmod(rest, 60)
    return (f"{d}d " if d else "") + (f"{h}h " if d or h else "") + (f"{m}m " if d or h or m else "") + f"{s}s"


def _rails(s: dict[str, Any]) -> list[dict[str, Any]]:
    return [r for r in s.get("rails", []) if "error" not in r]


# --- status --------------------------------------------------------------------------------------------
def _status_text(s: dict[str, Any]) -> str:
    peers = s.get("peers", {})
    up = sum(1 for p in peers.values() if p.get("up"))
    restarting = sum(1 for p in peers.values() if p.get("state") == "restarting")
    jobs = s.get("jobs", {})
    lines = [
        f"node      {s['node']}  (pid {s.get('pid', '?')}, {'ready' if s.get('ready') else 'STARTING'})",
        f"backend   {s['backend']}, {len(s.get('rails', []))} rail(s)",
        f"uptime    {_duration(s['uptime_s'])}",
        f"clients   {s['clients']} joined, {len(jobs)} job(s)"
        + ("" if not jobs else ": " + ", ".join(f"{j} ({len(v['local'])}/{v['world']} local)"
                                                for j, v in sorted(jobs.items()))),
        f"peers     {up} up, " + (f"{restarting} restarting, " if restarting else "")
        + f"{len(peers) - up - restarting} down" + ("" if up == len(peers) else "  <- check `transportctl peers`"),
    ]
    fallback = [str(r.get("rail", "?")) for r in _rails(s) if r.get("verbs_fallback")]
    if fallback:
        lines.append(f"WARNING   rail {', '.join(fallback)} on softverbs (TCP, no NIC): backend.verbs = \"auto\" "
                     "found no RDMA device; use \"pyverbs\" in production")
    for rail in s.get("rails", []):
        if "error" in rail:
            lines.append(f"rail      ERROR {rail['error']}")
            continue
        errors = sum(rail.get("errors", {}).values())
        cpus, loop = rail.get("cpus"), rail.get("loop_cpu")
        pinned = "CPUs " + _cpulist(cpus) if cpus else "not pinned"
        pinned += f", its loop alone on CPU {loop}" if loop is not None else ""
        lines.append(f"rail {rail.get('rail', '?')}    {rail.get('backend', '?')} on {rail.get('device') or '?'}, "
                     f"worker pid {rail.get('pid', '?')} ({pinned}), "
                     f"{rail.get('channels', 0)} ring(s), {rail.get('commands', 0)} commands, {errors} errors, "
                     f"flags by {rail.get('flag_publication', '?')}")
    return "\n".join(lines)


def _cpulist(cpus: list[int]) -> str:
    from transportd.dataplane.pinning import format_cpulist

    return format_cpulist(cpus)


@main.command()
@_common
def status(socket: str | None, as_json: bool) -> None:
    """Node, readiness, backend, rails, uptime, clients and jobs, peers up/down.

    Each rail says how its worker publishes flags into GPU memory (``flag_publication`` in ``--json``:
    gdrcopy, loopback, host-mapped, cuda-copy, or nic where the sender's NIC writes them)."""
    _emit(_fetch(socket), as_json, _status_text)


# --- peers ---------------------------------------------------------------------------------------------
def _peers_text(data: dict[str, Any]) -> str:
    rows = []
    for node, p in sorted(data["peers"].items()):
        rtt = "-" if p.get("rtt_us") is None else f"{p['rtt_us'] / 1000:.2f}"
        state = p.get("state") or ("up" if p["up"] else "down")  # restarting: its jobs wait (docs/restart.md)
        rows.append([node, "DOWN" if state == "down" else state, rtt, _bytes(p.get("bytes", 0)),
                     p.get("connections", 0)])
    if not rows:
        return "no peers known (peers.static empty and no peer has connected)"
    return _table(rows, ["peer", "state", "rtt_ms", "sent", "connections"])


@main.command()
@_common
def peers(socket: str | None, as_json: bool) -> None:
    """Per peer node: state, heartbeat RTT, payload bytes sent to it, connections."""
    s = _fetch(socket)
    _emit({"peers": s.get("peers", {}), "connections": s.get("connections", [])}, as_json, _peers_text)


# --- queues --------------------------------------------------------------------------------------------
def _queues(s: dict[str, Any]) -> dict[str, Any]:
    nodes = {(c["rail"], c["conn"]): c for c in s.get("connections", [])}
    rings, conns = [], []
    for rail in _rails(s):
        q = rail.get("queues", {})
        for ring in q.get("rings", []):
            rings.append({"rail": rail["rail"], **ring})
        for conn in q.get("connections", []):
            owner = nodes.get((rail["rail"], conn["conn"]), {})
            conns.append({"rail": rail["rail"], "node": owner.get("node", "(responder)"), "job": owner.get("job"),
                          **conn})
    ibgda = [{"rail": rail["rail"], **q} for rail in _rails(s) for q in rail.get("ibgda", [])]
    domains = [{"rail": rail["rail"], **d} for rail in _rails(s) for d in rail.get("ibgda_domains", [])]
    return {"rings": rings, "connections": conns, "ibgda": ibgda, "ibgda_domains": domains,
            "batch_max": max((r.get("batch_max", 8) for r in _rails(s)), default=8)}


def _queues_text(q: dict[str, Any]) -> str:
    rings = [[r["rail"], r["channel"], f"{r['job']}/{r['rank']}", r["depth"], r["credits"], r["capacity"],
              f"{r['oldest_age_us'] / 1000:.1f}", r["outstanding"], "gone" if r["gone"] else ""]
             for r in q["rings"]]
    out = ["rings (depth: committed, not yet taken; credits: slots producers may still claim)"]
    out.append(_table(rings, ["rail", "channel", "job/rank", "depth", "credits", "capacity", "oldest_ms",
                              "outstanding", ""]) if rings else "  none")
    conns = [[c["rail"], c["conn"], c["node"], c["job"] or "-", c["inflight"], c["pending"], c["batches_full"],
              c["batches_partial"], " ".join(str(h) for h in c["batch_hist"]), _bytes(c["bytes"])]
             for c in q["connections"] if c["job"] is not None or c["inflight"] or c["batches_full"]
             or c["batches_partial"]]
    out += ["", f"connections (batch sizes: batches of 1..{q['batch_max']} commands)"]
    out.append(_table(conns, ["rail", "conn", "peer", "job", "inflight", "pending", "full", "partial",
                              "batch sizes", "sent"]) if conns else "  none")
    if q["ibgda"]:  # queue pairs GPUs post to themselves (IBGDA channels), built by the clients
        qps = [[g["rail"], g["channel"], g["queue"], f"{g['job']}/{g['rank']}", g["peer"], g["node"], g["qpn"],
                g["far_qpn"], g["wqe_cnt"], g["state"]] for g in q["ibgda"]]
        out += ["", "ibgda queue pairs (built by the client; far: the peer's responder)"]
        out.append(_table(qps, ["rail", "channel", "queue", "job/rank", "peer", "node", "qpn", "far qpn", "wqes",
                                "state"]))
    return "\n".join(out)


@main.command()
@_common
def queues(socket: str | None, as_json: bool) -> None:
    """Per ring: depth, credits, oldest age; per connection: inflight, batches full/partial, sizes; per
    IBGDA queue pair: its channel, peer, QPNs and state."""
    _emit(_queues(_fetch(socket)), as_json, _queues_text)


# --- stats ---------------------------------------------------------------------------------------------
_COUNTERS = ("commands", "bytes", "wrs", "signals", "fences", "quiets", "batches_full", "batches_partial",
             "stalls", "signal_stalls", "rejected", "completion_errors")


def _counters(s: dict[str, Any]) -> dict[str, Any]:
    rails = _rails(s)
    totals: dict[str, Any] = {k: sum(int(r.get(k, 0)) for r in rails) for k in _COUNTERS}
    errors: dict[str, int] = {}
    for r in rails:
        for code, n in r.get("errors", {}).items():
            errors[code] = errors.get(code, 0) + int(n)
    totals["errors"] = errors
    return totals


def _stats_text(c: dict[str, Any]) -> str:
    lines = [f"{k:<18}{_bytes(c[k]) if k == 'bytes' else c[k]}" for k in _COUNTERS]
    lines.append(f"{'errors by code':<18}" + (", ".join(f"{k}={v}" for k, v in sorted(c["errors"].items()))
                                              or "none"))
    return "\n".join(lines)


@main.command()
@_common
def stats(socket: str | None, as_json: bool) -> None:
    """Counters since start: commands, bytes, signals, fences, stalls, errors by code."""
    _emit(_counters(_fetch(socket)), as_json, _stats_text)


# --- flags ---------------------------------------------------------------------------------------------
def _flags_text(r: dict[str, Any]) -> str:
    nonzero = [[i, v] for i, v in enumerate(r["values"]) if v]
    body = _table(nonzero, ["slot", "value"]) if nonzero else "all flags are 0"
    status = r.get("status", 0)
    return body + f"\n({len(r['values'])} slots, nonzero shown; status {_code_name(status)})"


def _code_name(code: int) -> str:
    try:
        return f"{code} {ErrorCode(code).name}"
    except ValueError:
        return str(code)


@main.command()
@click.argument("job")
@click.argument("rank", type=int)
@_common
def flags(job: str, rank: int, socket: str | None, as_json: bool) -> None:
    """Flag values of rank RANK of job JOB (joined on this node) and its status word."""
    _emit(_fetch(socket, lambda: Inspect(what="flags", job=job, rank=rank)), as_json, _flags_text)


# --- top -----------------------------------------------------------------------------------------------
def _top_frame(s: dict[str, Any], rates: dict[str, float], c: dict[str, Any], interval: float, width: int,
               height: int) -> str:
    """One screen of ``top``: at most ``height - 1`` lines of at most ``width`` characters, header first, so
    the terminal never wraps or scrolls it away; what does not fit is counted on the last line."""
    def cell(k: str, v: float) -> str:
        return _bytes(v) if k == "bytes" else f"{v:.0f}"

    half = (len(_COUNTERS) + 1) // 2  # counters in two columns: half the lines
    rows = []
    right_column: list[str | None] = [*_COUNTERS[half:], *[None] * (2 * half - len(_COUNTERS))]
    for left, right in zip(_COUNTERS[:half], right_column, strict=True):
        row: list[Any] = [left, cell(left, rates[left]) + "/s", cell(left, c[left])]
        row += [right, cell(right, rates[right]) + "/s", cell(right, c[right])] if right else ["", "", ""]
        rows.append(row)
    text = "\n".join([f"transportctl top  {time.strftime('%H:%M:%S')}  every {interval:g} s",
                      _status_text(s), "", _table(rows, ["counter", "per_s", "total", "counter", "per_s", "total"]),
                      "", _queues_text(_queues(s)), "", _peers_text({"peers": s.get("peers", {})})])
    lines = [line if len(line) <= width else line[: max(width - 1, 0)] + "~" for line in text.splitlines()]
    room = max(height - 1, 2)
    if len(lines) > room:
        hidden = len(lines) - room + 1
        lines = lines[: room - 1] + [f"... {hidden} more line(s): a taller terminal, or transportctl queues / peers"
                                     [:width]]
    return "\n".join(lines)


@main.command()
@click.option("--interval", default=1.0, show_default=True, type=FiniteFloat(min=0.01, max=3600),
              help="seconds between refreshes")
@click.option("--iterations", default=0, type=click.IntRange(min=0), help="stop after N refreshes (0: until Ctrl-C)")
@_common
def top(interval: float, iterations: int, socket: str | None, as_json: bool) -> None:
    """A live view: rates per second, queues, peers; refreshed every --interval."""
    previous: tuple[float, dict[str, Any]] | None = None
    count = 0
    try:
        while iterations == 0 or count < iterations:
            s = _fetch(socket)
            now = time.monotonic()
            c = _counters(s)
            if previous is None:
                rates = dict.fromkeys(_COUNTERS, 0.0)
            else:
                dt = max(now - previous[0], 1e-9)
                rates = {k: (c[k] - previous[1][k]) / dt for k in _COUNTERS}
            previous = (now, c)
            count += 1
            if as_json:  # one JSON object per line (JSON Lines)
                click.echo(json.dumps({"t": time.time(), "node": s["node"], "rates": rates, "totals": c,
                                       "queues": _queues(s)}, sort_keys=True, default=str))
            else:
                # fit a terminal (or the COLUMNS/LINES given); output to a pipe or file is not cut
                fit = sys.stdout.isatty() or "COLUMNS" in os.environ or "LINES" in os.environ
                size = shutil.get_terminal_size() if fit else os.terminal_size((1 << 30, 1 << 30))
                click.clear()
                click.echo(_top_frame(s, rates, c, interval, size.columns, size.lines))
            if iterations == 0 or count < iterations:
                time.sleep(interval)
    except KeyboardInterrupt:
        pass


# --- restart -------------------------------------------------------------------------------------------
@main.command()
@click.option("--timeout", default=120.0, show_default=True, help="seconds to wait for the new daemon")
@_common
def restart(timeout: float, socket: str | None, as_json: bool) -> None:
    """Restart the daemon without stopping its jobs (what `systemctl reload transportd` does).

    The daemon starts its successor (the same command line: the config and the installed code are read
    anew) and, once that is ready, hands its jobs over to it: the clients re-attach by themselves while
    the peers wait (docs/restart.md). A successor that cannot start (a bad config) changes nothing: the
    daemon serves on, and this exits 1 with the reason. Returns once the new daemon answers (another pid).
    Root or the daemon's user only."""
    from transportd.control.protocol import Restart

    reply = _fetch(socket, Restart)
    old_pid = reply["pid"]  # always in the reply: a missing one must not pass the old daemon off as new
    deadline = time.monotonic() + timeout
    endpoint = resolve_endpoint(socket)
    while True:
        try:
            with ControlConnection(endpoint, timeout_ms=2000, handshake_timeout_ms=500, name="transportctl",
                                   curve=_curve_keys()) as conn:
                after = conn.request(Stats())
            if after["pid"] != old_pid:  # the successor is a child of the daemon: another pid, same host
                break
            restart = after.get("restart", {})
            if restart.get("state") == "failed":
                _fail(f"restart refused, pid {old_pid} serves on: the new daemon "
                      f"{restart.get('error', 'did not start')}; `journalctl -u transportd` says why", EXIT_REFUSED)
        except TransportdError:
            pass
        if time.monotonic() > deadline:
            _fail(f"the daemon (pid {old_pid}) did not come back within {timeout:.0f}s: "
                  "`journalctl -u transportd` says why; its peers hold its jobs for peers.restart_grace_s")
        time.sleep(0.1)
    took = timeout - (deadline - time.monotonic())
    _emit({"pid": after["pid"], "restarted_in_s": took, "clients": after.get("clients"), "peers": {
        n: p.get("state") for n, p in after.get("peers", {}).items()}}, as_json,
        lambda d: f"restarted in {d['restarted_in_s']:.1f}s (pid {d['pid']}): {d['clients']} client(s) "
                  "re-attached so far")


# --- selftest ------------------------------------------------------------------------------------------
@main.command()
@click.option("--rounds", default=20, show_default=True, type=click.IntRange(1, 10000),
              help="4 KiB rounds per signal mode")
@click.option("--timeout", default=10.0, show_default=True, type=FiniteFloat(min=0.1, max=3600),
              help="seconds any one step of a link may take before the link is failed")
@_common
def selftest(rounds: int, timeout: float, socket: str | None, as_json: bool) -> None:
    """Check every link of this node: each peer daemon, each rail, with a job of the daemons' own.

    Data-checked transfers in each signal op, flag-before-data checks on both sides, a bad record's error
    code, put -> flag p50/p99 and GB/s at 1 MiB. Exit 1 when any link fails. Needs the ipc control socket
    (host memory travels by descriptor)."""
    from transportd_cli.selftest import format_table, run_selftest

    endpoint = resolve_endpoint(socket)
    _probe_ipc(endpoint)
    try:
        doc = run_selftest(endpoint, curve=_curve_keys(), rounds=rounds, timeout=timeout)
    except (RequestError, LocalProtocolError) as exc:
        _fail(str(exc), EXIT_REFUSED)
    except TransportdError as exc:
        _fail(str(exc))
    _emit(doc, as_json, format_table)
    if not doc["ok"]:
        sys.exit(EXIT_REFUSED)


# --- trace ---------------------------------------------------------------------------------------------
def _save_elsewhere(data: bytes, job: str, rank: int) -> str:
    """Keep a stopped trace that could not go where asked: in the working directory, else the temp directory."""
    for directory in (os.getcwd(), tempfile.gettempdir()):
        try:
            fd, path = tempfile.mkstemp(prefix=f"{job}-{rank}-", suffix=".trace", dir=directory)
        except OSError:
            continue
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        return f"saved it to {path} instead"
    return "and nowhere else either: the recording is lost"


def _empty_context(data: bytes) -> bool:
    """Whether a trace's context holds nothing a replay could rebuild the job from (no region, no flags)."""
    from transportd.dataplane.trace import parse_trace

    ctx = parse_trace(data).context
    return not ctx.get("sources") and not any(p.get("regions") or p.get("flags")
                                              for p in ctx.get("peers", {}).values())


@main.group()
def trace() -> None:
    """Record what a local rank's channels take (docs/trace.md), to replay with `transportd replay FILE`."""


@trace.command("start")
@click.argument("job")
@click.argument("rank", type=int)
@click.option("--out", required=True, type=click.Path(dir_okay=False), help="where `trace stop` writes the trace")
@_common
def trace_start_command(job: str, rank: int, out: str, socket: str | None, as_json: bool) -> None:
    """Record every record rank RANK of job JOB (joined on this node) takes, until `trace stop`.

    The daemon records into files of its own; `trace stop` hands the trace over and this command's user
    writes it to --out (checked writable now, so a typo fails here and not after the run). Needs the ipc
    control socket."""
    path = os.path.abspath(out)
    if problem := writable_problem(path):  # checked without creating it: a refused start leaves no file
        _fail(f"{problem} (the trace, at `trace stop`)", EXIT_REFUSED)
    with _connection(socket) as conn:
        reply = trace_start(conn, job, rank, path)
    _emit(reply, as_json, lambda r: f"tracing rank {rank} of job {job} ({r['channels']} channel(s) now, and any it "
                                    f"opens); `transportctl trace stop {job} {rank}` writes {path}")


@trace.command("stop")
@click.argument("job")
@click.argument("rank", type=int)
@click.option("--out", default=None, type=click.Path(dir_okay=False),
              help="write the trace here instead of where `trace start --out` said")
@_common
def trace_stop_command(job: str, rank: int, out: str | None, socket: str | None, as_json: bool) -> None:
    """Stop recording rank RANK of job JOB and write the trace file.

    A --out that cannot be written is refused before the recording stops (it goes on); should the file
    still fail to be written, the trace is saved next to it in a file of its own, named in the error."""
    if out is not None and (problem := writable_problem(out)):
        _fail(f"{problem}; the recording goes on (stop it with a --out that can be written)", EXIT_REFUSED)
    with _connection(socket) as conn:
        reply, data = trace_stop(conn, job, rank)
    path = os.path.abspath(out or reply.get("out") or f"{job}-{rank}.trace")
    try:
        with open(path, "wb") as f:
            f.write(data)
    except OSError as exc:
        _fail(f"cannot write the trace to {path}: {exc.strerror or exc}; {_save_elsewhere(data, job, rank)}",
              EXIT_REFUSED)
    doc = {"job": job, "rank": rank, "out": path, "entries": reply["entries"], "bytes": len(data),
           "dropped": reply["dropped"], "write_errors": reply["write_errors"]}
    if reply["entries"] and _empty_context(data):
        if as_json:
            _emit(doc, True, str)
        _fail(f"wrote {reply['entries']} entries to {path}, but the trace knows no region or flag array of job "
              f"{job} (rank {rank} registered none while traced): a replay would refuse every record",
              EXIT_REFUSED)

    def human(d: dict[str, Any]) -> str:
        text = f"wrote {d['entries']} entries ({_bytes(d['bytes'])}) to {d['out']}"
        if d["dropped"]:
            text += f"; {d['dropped']} lost to failed writes: {'; '.join(d['write_errors'])}"
        return text

    _emit(doc, as_json, human)


harden(main)

if __name__ == "__main__":
    main()
