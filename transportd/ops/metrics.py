"""Prometheus metrics of the daemon, in the OpenMetrics text format, served on localhost (``metrics.listen``).

``prometheus_client`` renders them: a collector (:class:`SnapshotCollector`) turns one ``Daemon.stats()``
snapshot into metric families, and the library writes the OpenMetrics text. Conventions: every family
is ``transportd_``-prefixed; values are in base units (seconds, bytes) with the unit as the name's last
word. Labels are only ``node``, ``job``, ``rank`` and ``peer``, so cardinality stays bounded by the
cluster's size. Errors by code are therefore one family per :class:`ErrorCode` (a fixed set, always
present, 0 until seen) rather than a ``code`` label: node-wide ``transportd_command_errors_<code>`` and per
job and rank ``transportd_job_command_errors_<code>``.

The HTTP thread only renders the snapshot the daemon's main loop refreshes every second
(``Daemon.stats()``): it never touches sockets or workers itself.
"""

from __future__ import annotations

import errno
import socket
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.openmetrics.exposition import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.registry import Collector, CollectorRegistry

from transportd.errors import ErrorCode, ListenError

__all__ = ["CONTENT_TYPE", "MetricsServer", "SnapshotCollector", "job_traffic", "render_metrics"]

CONTENT_TYPE = CONTENT_TYPE_LATEST

# rail counter key -> (family, unit, help)
_RAIL_COUNTERS = {
    "commands": ("transportd_commands", "", "Commands taken from rings and accepted."),
    "bytes": ("transportd_payload_bytes", "bytes", "Payload bytes posted."),
    "wrs": ("transportd_work_requests", "", "Work requests posted."),
    "signals": ("transportd_signals", "", "Signal work requests posted."),
    "fences": ("transportd_fences", "", "Fences posted."),
    "quiets": ("transportd_quiets", "", "QUIET commands served."),
    "batches_full": ("transportd_batches_full", "", "Batches posted with batch_max commands."),
    "batches_partial": ("transportd_batches_partial", "", "Batches posted before they filled."),
    "stalls": ("transportd_stalls", "", "Proxy iterations that left ready records in a ring (inflight cap)."),
    "signal_stalls": ("transportd_signal_stalls", "", "Iterations where a ready signal waited for the NIC."),
    "rejected": ("transportd_command_errors", "", "Commands rejected or failed, all codes."),
    "completion_errors": ("transportd_completion_errors", "", "Work completions with an error status."),
}


class _Families:
    """The families of one snapshot; every sample carries the ``node`` label first."""

    def __init__(self, node: str) -> None:
        self.node = node
        self.out: list[Metric] = []

    def family(self, name: str, kind: str, help_text: str, samples: list[tuple[dict[str, object], float]],
               unit: str = "") -> None:
        labels = ["node", *(samples[0][0] if samples else ())]
        fam = (CounterMetricFamily if kind == "counter" else GaugeMetricFamily)(name, help_text, labels=labels,
                                                                             unit=unit)
        for values, value in samples:
            fam.add_metric([self.node, *(str(v) for v in values.values())], value)
        self.out.append(fam)


_SESSION_END_HELP = {
    "left": "Joined sessions that ended with leave.",
    "exited": "Joined sessions reclaimed because the client's process exited.",
    "silent": "Joined sessions reclaimed after no keepalive within control.client_timeout_s.",
    "shutdown": "Joined sessions ended by the daemon stopping.",
}


def job_traffic(stats: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Per job and rank, from the rail workers' per-ring and per-connection counters in one snapshot.

    The compiled engine counts per channel (records taken, the error word: first code, count; refused or
    failed records by code) and per connection (payload bytes), not per job, so the job view is assembled
    here at stats time: ``ranks[rank]``: ``commands`` (records taken from the rank's rings: bad ones and
    QUIETs included), ``errors`` (refused or failed records, all codes), ``first_error`` (the ErrorCode of
    the first one, from the error word), and ``bytes`` when it can be told: a connection is per (job, peer
    node, rail), shared by the job's local ranks on that rail, so a rank's bytes are known only when it is
    the job's one local rank on its rail.
    ``bytes``: the job's payload bytes over all its connections. ``errors_by_code[rank]``: the rank's
    refused or failed records by ErrorCode name, summed over its rings (the engine's per-channel counts).
    A job's entry exists while it has rings or connections here, so its series go when it ends.
    """
    jobs: dict[str, dict[str, Any]] = {}
    on_rail: dict[tuple[str, int], set[int]] = {}
    for rail in stats.get("rails", []):
        for ring in rail.get("queues", {}).get("rings", []) if "error" not in rail else ():
            job = jobs.setdefault(ring["job"], {"bytes": 0, "ranks": {}, "errors_by_code": {}})
            codes = job["errors_by_code"].setdefault(int(ring["rank"]), {})
            for name, n in ring.get("errors_by_code", {}).items():
                codes[name] = codes.get(name, 0) + int(n)
            rank = job["ranks"].setdefault(int(ring["rank"]), {"commands": 0, "errors": 0, "first_error": 0,
                                                                 "bytes": None})
            rank["commands"] += int(ring.get("taken", 0))
            count = int(ring.get("error_count", 1 if ring.get("error") else 0))
            rank["errors"] += count
            if ring.get("error") and not rank["first_error"]:
                rank["first_error"] = int(ring["error"])
            on_rail.setdefault((ring["job"], int(rail.get("rail", 0))), set()).add(int(ring["rank"]))
    by_rail: dict[tuple[str, int], int] = {}
    for conn in stats.get("connections", []):
        if "job" not in conn:
            continue
        job = jobs.setdefault(conn["job"], {"bytes": 0, "ranks": {}, "errors_by_code": {}})
        job["bytes"] += int(conn.get("bytes", 0))
        key = (conn["job"], int(conn.get("rail", 0)))
        by_rail[key] = by_rail.get(key, 0) + int(conn.get("bytes", 0))
    for (job_name, _rail), ranks in on_rail.items():
        if len(ranks) == 1:
            (only,) = ranks
            jobs[job_name]["ranks"][only]["bytes"] = by_rail.get((job_name, _rail), 0)
    return jobs


def _families(stats: dict[str, Any]) -> list[Metric]:
    """The metric families of one ``Daemon.stats()`` snapshot."""
    w = _Families(stats.get("node", ""))
    w.family("transportd_up", "gauge", "1 while the daemon serves.", [({}, 1)])
    w.family("transportd_ready", "gauge", "1 once the daemon reported ready (rails open, static peers up).",
             [({}, 1 if stats.get("ready") else 0)])
    w.family("transportd_uptime_seconds", "gauge", "Seconds since the daemon started.",
             [({}, float(stats.get("uptime_s", 0.0)))], unit="seconds")
    w.family("transportd_clients", "gauge", "Joined client sessions.", [({}, stats.get("clients", 0))])
    for why, count in stats.get("sessions_ended", {}).items():
        w.family(f"transportd_sessions_ended_{why}", "counter", _SESSION_END_HELP.get(why, why), [({}, count)])
    rails = [r for r in stats.get("rails", []) if "error" not in r]
    w.family("transportd_rails", "gauge", "Rail workers answering.", [({}, len(rails))])
    w.family("transportd_verbs_fallback_rails", "gauge", "Rails on softverbs (TCP) because backend.verbs = auto "
             "found no RDMA device; nonzero on a production node means its data does not use the NIC.",
             [({}, sum(1 for r in rails if r.get("verbs_fallback")))])

    peers = stats.get("peers", {})
    w.family("transportd_peer_up", "gauge", "1 while the peer node answers heartbeats.",
             [({"peer": p}, 1 if v.get("up") else 0) for p, v in sorted(peers.items())])
    w.family("transportd_peer_rtt_seconds", "gauge", "Heartbeat round trip to the peer node.",
             [({"peer": p}, v["rtt_us"] / 1e6) for p, v in sorted(peers.items()) if v.get("rtt_us") is not None],
             unit="seconds")
    sent: dict[str, int] = {node: int(n) for node, n in stats.get("sent_closed", {}).items()}  # jobs over
    inflight: dict[str, int] = {}
    for c in stats.get("connections", []):
        sent[c["node"]] = sent.get(c["node"], 0) + int(c.get("bytes", 0))
        inflight[c["node"]] = inflight.get(c["node"], 0) + int(c.get("inflight", 0))
    w.family("transportd_peer_sent_bytes", "counter", "Payload bytes posted to the peer node's ranks.",
             [({"peer": p}, v) for p, v in sorted(sent.items())], unit="bytes")
    w.family("transportd_peer_inflight_work_requests", "gauge", "Work requests posted to the peer node, not "
             "yet completed.", [({"peer": p}, v) for p, v in sorted(inflight.items())])

    for key, (name, unit, help_text) in _RAIL_COUNTERS.items():
        w.family(name, "counter", help_text, [({}, sum(int(r.get(key, 0)) for r in rails))], unit=unit)
    loopback = [r.get("flag_loopback") or {} for r in rails]  # efa rails with no GDRCopy (docs/transports.md)
    w.family("transportd_flag_loopback_writes", "counter", "Flag writes into GPU memory by loopback RDMA write "
             "(efa without GDRCopy), completed.", [({}, sum(int(lb.get("writes", 0)) for lb in loopback))])
    w.family("transportd_flag_loopback_seconds", "counter", "Time the rail workers spent posting and reaping "
             "their loopback flag writes.", [({}, sum(int(lb.get("wait_ns", 0)) for lb in loopback) / 1e9)],
             unit="seconds")
    w.family("transportd_flag_copies", "counter", "Flag words posted into GPU memory as CUDA copies (efa rails on "
             "flags.publication = \"cuda-copy\").", [({}, sum(int(r.get("flag_copies") or 0) for r in rails))])
    by_code: dict[str, int] = {}
    for rail in rails:
        for code, count in rail.get("errors", {}).items():
            by_code[code] = by_code.get(code, 0) + int(count)
    for code in ErrorCode:
        if code is ErrorCode.OK:
            continue
        name = f"transportd_command_errors_{code.name.lower()}"
        w.family(name, "counter", f"Commands rejected or failed with {code.name}.", [({}, by_code.get(code.name, 0))])

    open_qps = sum(len(r.get("endpoints", [])) for r in rails)
    responders = sum(len(r.get("responders", [])) for r in rails)
    w.family("transportd_queue_pairs", "gauge", "Queue pairs (EFA: endpoints) open on the node's rails: its own "
             "connections and the responders below.", [({}, open_qps)])
    w.family("transportd_ibgda_queue_pairs", "gauge", "IBGDA queue pairs clients built on the node's rails "
             "(in their own processes), as the daemon knows them.",
             [({}, sum(len(r.get("ibgda", [])) for r in rails))])
    w.family("transportd_responder_queue_pairs", "gauge", "Queue pairs open as the far end of a peer node's "
             "connections (closed when that job ends on the peer).", [({}, responders)])
    depth: dict[tuple[str, int], int] = {}
    age: dict[tuple[str, int], float] = {}
    for rail in rails:
        for ring in rail.get("queues", {}).get("rings", []):
            key = (ring["job"], ring["rank"])
            depth[key] = depth.get(key, 0) + int(ring["depth"])
            age[key] = max(age.get(key, 0.0), float(ring["oldest_age_us"]) / 1e6)
    w.family("transportd_ring_depth", "gauge", "Records committed in the rank's rings and not yet taken.",
             [({"job": j, "rank": r}, v) for (j, r), v in sorted(depth.items())])
    w.family("transportd_ring_oldest_age_seconds", "gauge", "How long the oldest record left in the rank's "
             "rings has waited.", [({"job": j, "rank": r}, v) for (j, r), v in sorted(age.items())], unit="seconds")
    jobs = stats.get("jobs", {})
    w.family("transportd_job_local_ranks", "gauge", "Ranks of the job joined on this node.",
             [({"job": j}, len(v.get("local", []))) for j, v in sorted(jobs.items())])
    traffic = job_traffic(stats)
    ranks = [(j, r, v) for j, t in sorted(traffic.items()) for r, v in sorted(t["ranks"].items())]
    w.family("transportd_job_commands", "counter", "Records taken from the rank's rings (bad ones and QUIETs "
             "included).", [({"job": j, "rank": r}, v["commands"]) for j, r, v in ranks])
    w.family("transportd_job_command_errors", "counter", "The rank's records refused or failed, all codes (its "
             "channels' error words).", [({"job": j, "rank": r}, v["errors"]) for j, r, v in ranks])
    for code in ErrorCode:
        if code is ErrorCode.OK:
            continue
        w.family(f"transportd_job_command_errors_{code.name.lower()}", "counter", f"The rank's records refused or "
                 f"failed with {code.name}.", [({"job": j, "rank": r}, traffic[j]["errors_by_code"].get(r, {}).get(
                     code.name, 0)) for j, r, _ in ranks])
    w.family("transportd_job_first_error_code", "gauge", "ErrorCode of the rank's first refused or failed "
             "record (0: none); the error word keeps only the first code.",
             [({"job": j, "rank": r}, v["first_error"]) for j, r, v in ranks])
    w.family("transportd_job_payload_bytes", "counter", "Payload bytes posted on the job's connections.",
             [({"job": j}, t["bytes"]) for j, t in sorted(traffic.items())], unit="bytes")
    w.family("transportd_job_rank_payload_bytes", "counter", "Payload bytes the rank posted, where it is the "
             "job's only local rank on its rail (connections are shared per job and rail).",
             [({"job": j, "rank": r}, v["bytes"]) for j, r, v in ranks if v["bytes"] is not None], unit="bytes")
    return w.out


class SnapshotCollector(Collector):
    """A ``prometheus_client`` collector over the daemon's latest stats snapshot (``snapshot()``)."""

    def __init__(self, snapshot: Callable[[], dict[str, Any]]) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        yield from _families(self._snapshot())


def _registry(snapshot: Callable[[], dict[str, Any]]) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SnapshotCollector(snapshot))
    return registry


def render_metrics(stats: dict[str, Any]) -> str:
    """The OpenMetrics text for one ``Daemon.stats()`` snapshot."""
    return generate_latest(_registry(lambda: stats)).decode()


class MetricsServer:
    """``GET /metrics`` on ``listen`` (``host:port``) in a daemon thread."""

    def __init__(self, listen: str, snapshot: Callable[[], dict[str, Any]]) -> None:
        host, _, port = listen.rpartition(":")
        registry = _registry(snapshot)

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
                if self.path.split("?")[0] != "/metrics":
                    self.send_error(404, "only /metrics is served")
                    return
                body = generate_latest(registry)
                self.send_response(200)
                self.send_header("Content-Type", CONTENT_TYPE)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        address = host.strip("[]") or "127.0.0.1"

        class Server(ThreadingHTTPServer):
            address_family = socket.AF_INET6 if ":" in address else socket.AF_INET

        try:
            self.server = Server((address, int(port)), Handler)
        except OSError as exc:
            raise ListenError("metrics.listen", listen, exc.strerror or str(exc),
                              in_use=exc.errno == errno.EADDRINUSE) from None
        self.server.daemon_threads = True
        self.address = f"{self.server.server_address[0]}:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, name="metrics", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
