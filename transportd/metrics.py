"""Prometheus text exposition of the daemon's counters, served on localhost.

Names follow OpenMetrics conventions (``transportd_`` prefix, ``_total`` counters, base units); labels
are limited to node, job, rank and peer so cardinality stays bounded. The HTTP thread only reads the
snapshot the main loop refreshes every second: it never touches sockets or workers itself.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

__all__ = ["render_metrics", "MetricsServer"]

_RAIL_COUNTERS = {
    "commands": ("transportd_commands_total", "Commands taken from rings and posted."),
    "bytes": ("transportd_bytes_total", "Payload bytes posted."),
    "signals": ("transportd_signals_total", "Signal work requests posted."),
    "fences": ("transportd_fences_total", "Fences posted."),
    "batches_full": ("transportd_batches_full_total", "Batches posted with batch_max commands."),
    "batches_partial": ("transportd_batches_partial_total", "Batches posted before they filled."),
    "stalls": ("transportd_stalls_total", "Proxy iterations that could not take records (inflight cap)."),
}


def _labels(**labels: object) -> str:
    inner = ",".join(f'{k}="{str(v).replace(chr(92), chr(92) * 2).replace(chr(34), chr(92) + chr(34))}"'
                     for k, v in labels.items())
    return "{" + inner + "}" if inner else ""


def render_metrics(stats: dict[str, Any]) -> str:
    """The text exposition for one ``Daemon.stats()`` snapshot."""
    node = stats.get("node", "")
    out: list[str] = []

    def metric(name: str, kind: str, help_text: str, samples: list[tuple[dict[str, object], float]]) -> None:
        out.append(f"# HELP {name} {help_text}")
        out.append(f"# TYPE {name} {kind}")
        for labels, value in samples:
            out.append(f"{name}{_labels(node=node, **labels)} {float(value):g}")

    metric("transportd_up", "gauge", "1 while the daemon serves.", [({}, 1)])
    metric("transportd_uptime_seconds", "gauge", "Seconds since the daemon started.", [({}, stats.get("uptime_s", 0))])
    metric("transportd_clients", "gauge", "Joined client sessions.", [({}, stats.get("clients", 0))])
    peers = stats.get("peers", {})
    metric("transportd_peer_up", "gauge", "1 if the peer node answers heartbeats.",
           [({"peer": p}, 1 if v.get("up") else 0) for p, v in sorted(peers.items())])
    metric("transportd_peer_rtt_seconds", "gauge", "Heartbeat round trip to the peer node.",
           [({"peer": p}, v["rtt_us"] / 1e6) for p, v in sorted(peers.items()) if v.get("rtt_us") is not None])
    rails = [r for r in stats.get("rails", []) if "error" not in r]
    for key, (name, help_text) in _RAIL_COUNTERS.items():
        metric(name, "counter", help_text, [({}, sum(r.get(key, 0) for r in rails))])
    errors: dict[str, float] = {}
    for rail in rails:
        for code, count in rail.get("errors", {}).items():
            errors[code] = errors.get(code, 0) + count
    metric("transportd_command_errors_total", "counter", "Commands rejected or failed, by error code.",
           [({"code": code}, count) for code, count in sorted(errors.items())])
    jobs = stats.get("jobs", {})
    metric("transportd_job_local_ranks", "gauge", "Ranks of the job joined on this node.",
           [({"job": j}, len(v.get("local", []))) for j, v in sorted(jobs.items())])
    out.append("# EOF")
    return "\n".join(out) + "\n"


class MetricsServer:
    """``GET /metrics`` on ``listen`` (``host:port``) in a daemon thread."""

    def __init__(self, listen: str, snapshot: Callable[[], dict[str, Any]]) -> None:
        host, _, port = listen.rpartition(":")
        render = snapshot

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
                if self.path.split("?")[0] != "/metrics":
                    self.send_error(404, "only /metrics is served")
                    return
                body = render_metrics(render()).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/openmetrics-text; version=1.0.0; charset=utf-8")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer((host.strip("[]") or "127.0.0.1", int(port)), Handler)
        self.address = f"{self.server.server_address[0]}:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, name="metrics", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
