"""What the daemon reports: the node's stats (``transportctl status``, the metrics' snapshot) and a rank's
flags (``inspect``), each filtered by who asks."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

from transportd.control.protocol import Inspect, ReplyCode
from transportd.daemon.clients import ControlClients, Identity
from transportd.daemon.peering import Peering
from transportd.daemon.state import NodeState
from transportd.dataplane import link_messages as link
from transportd.errors import RequestError, WorkerError
from transportd.ops.metrics import job_traffic

__all__ = ["collect_stats", "inspect_flags", "visible_stats"]


def collect_stats(state: NodeState, peering: Peering, clients: ControlClients, *, started: float,
                  ready: bool, ibgda: Callable[[int], list[dict[str, Any]]] | None = None) -> dict[str, Any]:
    """The node's stats: each rail worker's, with this process's view of jobs, connections and peers (and,
    given ``ibgda``, of the IBGDA queue pairs clients built on each rail)."""
    rails = []
    for worker in state.workers:
        try:
            rails.append(worker.call(link.Stats(), timeout_s=5.0))
        except WorkerError as exc:
            rails.append({"error": str(exc)})
        if ibgda is not None:
            rails[-1]["ibgda"] = ibgda(worker.rail)
    # per-connection queue counters from the workers, by (rail, backend connection id)
    queued = {(r.get("rail"), c["conn"]): c for r in rails for c in r.get("queues", {}).get("connections", [])}
    # a ring's error count is in its error word, which this process maps too (the workers report the code)
    words = {cid: ring.error for job in state.jobs.values() for rank in job.local.values()
             for cid, ring in rank.channels.items()}
    for r in rails:
        for ring in r.get("queues", {}).get("rings", []):
            if ring.get("channel") in words:
                ring["error_count"] = int(words[ring["channel"]][1])
    connections = []
    for c in peering.connections.values():
        q = queued.get((c.rail, c.conn_id), {})
        connections.append({"conn": c.conn_id, "job": c.job, "node": c.node, "rail": c.rail, "state": c.state,
                            "bytes": q.get("bytes", 0), "inflight": q.get("inflight", 0),
                            "peer_gid": c.peer_gid})
    peers = {}
    if state.peers:
        for node, p in state.peers.peers.items():
            mine = [c for c in connections if c["node"] == node]
            peers[node] = {"up": p.up, "state": p.state, "rtt_us": None if p.rtt_s is None else p.rtt_s * 1e6,
                           "messages_in": p.messages_in, "messages_out": p.messages_out,
                           "bytes": sum(c["bytes"] for c in mine) + peering.sent_closed.get(node, 0),
                           "connections": len(mine)}
    out = {
        "node": state.node,
        "pid": os.getpid(),
        "ready": ready,
        "backend": state.config.backend.kind,
        "uptime_s": time.time() - started,
        "clients": clients.joined_count,
        "sessions_ended": dict(clients.ended),
        "jobs": {name: {"world": j.world, "local": sorted(j.local), "remote": sorted(j.remote)}
                 for name, j in state.jobs.items()},
        "connections": connections,
        "sent_closed": dict(peering.sent_closed),  # bytes per node over connections closed since start
        "peers": peers,
        "rails": rails,
    }
    for name, traffic in job_traffic(out).items():  # per job and rank, assembled from the rails' counters
        if name in out["jobs"]:
            out["jobs"][name]["traffic"] = {"bytes": traffic["bytes"],
                                            "ranks": {str(r): v for r, v in traffic["ranks"].items()},
                                            "errors_by_code": {str(r): v for r, v in
                                                               traffic["errors_by_code"].items()}}
    return out


def visible_stats(stats: dict[str, Any], ident: Identity, state: NodeState) -> dict[str, Any]:
    """``stats`` as ``ident`` may see them: node-wide counters for everyone, a job's details for its owner."""
    if not ident.superuser:
        stats["jobs"] = {name: info for name, info in stats["jobs"].items()
                         if name in state.jobs and ident.may_touch(state.jobs[name])}
    return stats


def inspect_flags(state: NodeState, ident: Identity, req: Inspect) -> dict[str, Any]:
    """A local rank's flag values and status word, for its job's owner."""
    job = state.jobs.get(req.job)
    if job is not None and not ident.may_touch(job):
        raise RequestError(ReplyCode.FORBIDDEN, f"job {req.job!r} on node {state.node} belongs to another user")
    rank = job.local.get(req.rank) if job else None
    if rank is None:
        raise RequestError(ReplyCode.NOT_FOUND,
                           f"rank {req.rank} of job {req.job!r} is not joined on node {state.node}")
    if rank.flags is None:
        raise RequestError(ReplyCode.NOT_FOUND, f"rank {req.rank} of job {req.job!r} has no flags yet")
    return {"job": req.job, "rank": req.rank, "values": [int(v) for v in rank.flags.values],
            "status": rank.flags.status}
