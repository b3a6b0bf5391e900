"""Wiring a job across nodes: announcements, the RC connections between rails, peers coming and going.

All of it idempotent, re-run by :meth:`Peering.refresh_job` whenever something new is learnt:

1. a local rank joins, registers regions (mapped on every rail) and flags, and calls ``exchange``;
2. ``exchange`` announces the rank's regions and flags to every peer node (``peer_regions``);
3. for every node that hosts a rank of the job, each rail used by a local rank opens its own RC
   connection to the same rail index there (rail-peer routing): ``peer_connect_request`` carries our
   endpoint, the remote worker connects and answers ``peer_connect_accept`` with its own;
4. once a connection is up, the worker learns which peer ranks it reaches and their regions and flags;
5. ``exchange`` reports complete to the client when every rank is known and reachable.

Our end of each such connection is an :class:`OutgoingConnection`; the end a peer asked us for is an
:class:`AcceptedConnection`. Announcements for a job with no local rank yet are kept (bounded) for the
first rank that joins it.

A peer daemon restarting (docs/restart.md) keeps its place in every job for ``peers.restart_grace_s``:

- when it says so (``peer_restarting``), or falls silent, our connections to it are *held*: records for its
  ranks stay in the rings (backpressure), what was already taken posts and completes, and once nothing is
  in flight to it we answer ``peer_quiesced`` (a node that said so waits for that before it stops);
- when its next life says hello, those connections are *retired* (whatever was still in flight on them
  has an unknown outcome and is reported so), its ranks are *returning*: each re-announces itself as its
  client re-attaches, we connect to the new life and bind the rank to the new connection, and the retired
  one is closed once every rank of the job there is bound again;
- a rank not back within the grace period, or a node that never came back, costs its jobs PEER_LOST, as
  a lost node always did. A node that fell silent and speaks again in the same life is simply un-held.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from transportd.control.protocol import (
    PeerConnectAccept,
    PeerConnectRequest,
    PeerDisconnect,
    PeerJobLost,
    PeerQuiesced,
    PeerRankLeft,
    PeerRegions,
    RegionInfo,
    ReplyCode,
)
from transportd.daemon.state import FLAGS_REGION_ID, JobState, LocalRank, NodeState, RemoteRank, flag_seeds, quietly
from transportd.dataplane import link_messages as link
from transportd.errors import ErrorCode, RequestError, WorkerError

__all__ = ["MAX_UNCLAIMED_JOBS", "AcceptedConnection", "OutgoingConnection", "Peering"]

log = logging.getLogger("transportd")

MAX_UNCLAIMED_JOBS = 1024  # announcements kept for jobs with no local rank yet


@dataclass
class OutgoingConnection:
    """Our RC connection for (job, node, rail): from this rail's worker to the same rail on ``node``."""

    conn_id: int
    job: str
    node: str
    rail: int
    state: str = "connecting"  # connecting | up | held (its node is restarting) | failed
    bound: set[int] = field(default_factory=set)  # peer ranks bound in the worker
    peer_gid: str = ""  # the remote end's device address (its rail's NIC), once connected
    error: str = ""  # why the connection failed, for the clients that need it
    responder: int = 0  # a connection to this node: the far end, in the same worker
    broken_until: float = 0.0  # its far end stopped answering: held until then (a restart re-wires it)


@dataclass
class AcceptedConnection:
    """Our end of a peer's connection, accepted for it: the answer to its connect request."""

    conn_id: int
    rail: int
    endpoint: dict[str, Any]


class Peering:
    """A job's wiring across nodes (module doc): ``connections`` (ours, by (job, node, rail)), ``accepted``
    (by (node, their connection id)) and ``unclaimed`` announcements."""

    def __init__(self, state: NodeState) -> None:
        self.state = state
        self.connections: dict[tuple[str, str, int], OutgoingConnection] = {}
        self.accepted: dict[tuple[str, int], AcceptedConnection] = {}
        # peer_regions for jobs with no local rank yet: job -> rank -> (node, message)
        self.unclaimed: dict[str, dict[int, tuple[str, PeerRegions]]] = {}
        #: payload bytes posted to each node over connections closed since start (the stats' per-peer bytes
        #: add them, so a peer's sent bytes do not fall back when a job ends)
        self.sent_closed: dict[str, int] = {}
        #: called with the job's name after each refresh (the self-test's far side waits for its wiring)
        self.on_job_refreshed: Callable[[str], None] = lambda job_name: None
        # a restarted node's earlier life's connections, held until their replacement binds the job's ranks
        self.retired: dict[tuple[str, str, int], list[OutgoingConnection]] = {}
        self.quiescing: set[str] = set()  # restarting nodes owed a peer_quiesced once nothing is in flight
        self.rewiring: set[str] = set()  # nodes whose next life came: their ranks re-announce themselves
        self.clock: Callable[[], float] = time.monotonic
        self._next_quiesce_check = 0.0

    # --- announcing --------------------------------------------------------------------------------------
    def claim(self, job_name: str) -> dict[int, RemoteRank]:
        """The ranks peers announced for ``job_name`` before it had a local rank (taken: kept no more)."""
        peers = self.state.peers.peers if self.state.peers else {}
        return {msg.rank: RemoteRank(node, {(r.id, r.rail): r for r in msg.regions}, msg.flag_seeds)
                for node, msg in self.unclaimed.pop(job_name, {}).values() if node in peers}

    def exchange(self, rank: LocalRank) -> dict[str, Any]:
        """Announce ``rank`` (once), wire what is known, and say whether its job is complete."""
        if rank.flags is None:
            raise RequestError(ReplyCode.NO_FLAGS, "allocate flags (op 'flags') before exchange")
        if not rank.announced:
            rank.announced = True
            self.state.plane.broadcast(self.regions_message(rank))
        job = self.state.jobs[rank.job]
        self.refresh_job(rank.job)
        for conn in self.connections.values():
            if conn.job == rank.job and conn.rail == rank.rail and conn.state == "failed" and conn.error:
                raise RequestError(ReplyCode.UNREACHABLE, conn.error)
        return {"complete": self.job_wired(rank), "known": len(job.local) + len(job.remote)}

    def regions_message(self, rank: LocalRank) -> PeerRegions:
        infos = []
        for region_id, per_rail in rank.regions.items():
            for rail, key in per_rail.items():
                infos.append(RegionInfo(id=region_id, addr=key["addr"], length=key["length"], rkey=key["rkey"],
                                        rail=rail))
        for rail, key in rank.flag_keys.items():
            infos.append(RegionInfo(id=FLAGS_REGION_ID, addr=key["addr"], length=key["length"], rkey=key["rkey"],
                                    rail=rail))
        return PeerRegions(job=rank.job, rank=rank.rank, regions=tuple(infos), flag_seeds=flag_seeds(rank.flags))

    # --- reachability ----------------------------------------------------------------------------------
    def rank_reachable(self, me: LocalRank, peer_rank: int) -> bool:
        if peer_rank == me.rank:
            return True  # commands to oneself are not routed through a connection
        node = self.state.node_of(self.state.jobs[me.job], peer_rank)
        conn = self.connections.get((me.job, node, me.rail))
        return conn is not None and conn.state == "up" and peer_rank in conn.bound

    def job_wired(self, rank: LocalRank) -> bool:
        """Every rank of ``rank``'s job is known and reachable from its rail."""
        job = self.state.jobs[rank.job]
        known = len(job.local) + len(job.remote)
        return known == job.world and all(self.rank_reachable(rank, r) for r in range(job.world))

    def peer_keys(self, job: JobState, peer_rank: int, rail: int) -> tuple[dict[int, dict[str, int]],
                                                                             dict[str, int] | None]:
        """Rank ``peer_rank``'s regions (id -> addr, length, rkey) and flag array on ``rail``, whether the
        rank is local or on a peer node; flags None until it has them."""
        local = job.local.get(peer_rank)
        if local is not None:
            regions = {rid: per_rail[rail] for rid, per_rail in local.regions.items() if rail in per_rail}
            return regions, local.flag_keys.get(rail) if local.flags is not None else None
        remote = job.remote[peer_rank]
        regions = {rid: _key(r) for (rid, r_rail), r in remote.regions.items()
                   if r_rail == rail and rid != FLAGS_REGION_ID}
        flags = remote.regions.get((FLAGS_REGION_ID, rail))
        return regions, _key(flags) if flags is not None else None

    # --- wiring ----------------------------------------------------------------------------------------
    def refresh_job(self, job_name: str) -> None:
        """Open missing connections and push missing tables to the workers (idempotent)."""
        job = self.state.jobs[job_name]
        rails = {rank.rail for rank in job.local.values()}
        nodes = {r.node for r in job.remote.values()}
        if len(job.local) > 1:
            nodes.add(self.state.node)
        for node in nodes:
            for rail in rails:
                if (job_name, node, rail) not in self.connections:
                    self._open_connection(job_name, node, rail)
        for conn in self.connections.values():
            if conn.job != job_name or conn.state != "up":
                continue
            peer_ranks = ([r for r in job.local] if conn.node == self.state.node
                          else [r for r, info in job.remote.items() if info.node == conn.node])
            for peer_rank in peer_ranks:
                self._push_peer_tables(job_name, job, conn, peer_rank)
        self._settle_retired(job_name, job)
        self.on_job_refreshed(job_name)

    def _settle_retired(self, job_name: str, job: JobState) -> None:
        """Close a restarted node's earlier connections of ``job`` once the connection replacing them binds
        every rank of the job there (until then, ranks bound to them wait held, never refused)."""
        for key in [k for k in self.retired if k[0] == job_name]:
            conn = self.connections.get(key)
            there = [r for r, info in job.remote.items() if info.node == key[1]]
            if conn is None or conn.state != "up" or any(r in job.returning or r not in conn.bound for r in there):
                continue
            for old in self.retired.pop(key):
                quietly(self.state.workers[old.rail].call, link.CloseConnection(conn=old.conn_id))
            log.info("job %s: re-wired to node %s on rail %d", job_name, key[1], key[2])

    def _push_peer_tables(self, job_name: str, job: JobState, conn: OutgoingConnection, peer_rank: int) -> None:
        if peer_rank in job.returning:
            return  # its node restarted and it has not announced its new keys yet: it stays held where it is
        worker = self.state.workers[conn.rail]
        regions, flags = self.peer_keys(job, peer_rank, conn.rail)
        if flags is None:
            return
        local = job.local.get(peer_rank)
        seeds = flag_seeds(local.flags) if local is not None else job.remote[peer_rank].flag_seeds
        for region_id, key in regions.items():
            if (conn.rail, peer_rank, region_id) not in job.pushed:
                worker.call(link.SetRemoteRegion(job=job_name, peer=peer_rank, region=region_id, addr=key["addr"],
                                                 length=key["length"], rkey=key["rkey"]))
                job.pushed.add((conn.rail, peer_rank, region_id))
        if peer_rank not in conn.bound:
            worker.call(link.SetRemoteFlags(job=job_name, peer=peer_rank, addr=flags["addr"],
                                            count=flags["length"] // 8, rkey=flags["rkey"], seeds=seeds))
            worker.call(link.BindPeer(job=job_name, peer=peer_rank, conn=conn.conn_id))
            conn.bound.add(peer_rank)

    def _open_connection(self, job_name: str, node: str, rail: int) -> None:
        state = self.state
        conn = OutgoingConnection(next(state.conn_ids), job_name, node, rail)
        self.connections[(job_name, node, rail)] = conn
        peer = state.peers.peers.get(node) if state.peers and node != state.node else None
        if peer is not None and peer.rails and rail >= peer.rails:
            # rail-peer routing pairs rail i with rail i: a node without that rail cannot be reached from it
            conn.state = "failed"
            conn.error = (f"node {node} has {peer.rails} rail(s), so rail {rail} of node {state.node} has no "
                          f"peer there: give every node of the job the same rails")
            log.warning("job %s: %s", job_name, conn.error)
            return
        worker = state.workers[rail]
        endpoint = worker.call(link.CreateEndpoint(conn=conn.conn_id, job=job_name)).endpoint
        if node == state.node:
            # a connection to ourselves: the responder end lives in the same worker
            peer_id = conn.responder = next(state.conn_ids)
            remote = worker.call(link.CreateEndpoint(conn=peer_id, job=job_name, responder=True)).endpoint
            worker.call(link.Connect(conn=peer_id, remote=endpoint))
            worker.call(link.Connect(conn=conn.conn_id, remote=remote))
            conn.state, conn.peer_gid = "up", str(remote.get("gid", ""))
            return
        state.plane.send(node, PeerConnectRequest(job=job_name, rail=rail, conn=conn.conn_id, endpoint=endpoint))

    # --- ranks and jobs ending -------------------------------------------------------------------------
    def rank_gone(self, rank: LocalRank) -> None:
        """A local rank was released: tell the peers it left (if it was announced), and stop routing to it
        here; the job's last local rank takes the job's connections with it."""
        if rank.announced and self.state.peers is not None:
            self.state.peers.broadcast(PeerRankLeft(job=rank.job, rank=rank.rank))
        job = self.state.jobs.get(rank.job)
        if job is not None:
            job.local.pop(rank.rank, None)
            if job.local:  # the job goes on here: the other local ranks stop sending to this one
                self.forget_rank(rank.job, job, rank.rank)
            else:
                self._drop_job(rank.job)

    def _drop_job(self, job_name: str) -> None:
        """The job's last local rank left: close its connections, and have their far ends closed too."""
        state = self.state
        for key in [k for k in self.retired if k[0] == job_name]:
            for old in self.retired.pop(key):  # their far end is an earlier life: nothing to tell it
                if old.rail < len(state.workers):
                    quietly(state.workers[old.rail].call, link.CloseConnection(conn=old.conn_id))
        for key in [k for k in self.connections if k[0] == job_name]:
            conn = self.connections.pop(key)
            if conn.rail < len(state.workers):
                for conn_id in (conn.conn_id, conn.responder):
                    if conn_id:
                        closed = quietly(state.workers[conn.rail].call, link.CloseConnection(conn=conn_id))
                        if closed is not None and closed.sent:
                            self.sent_closed[conn.node] = self.sent_closed.get(conn.node, 0) + closed.sent
            if conn.node != state.node and state.peers is not None:
                # the peer's responder serves only this connection; the peer's own connections to our
                # ranks stay (its ranks may still be running, and a rank of ours may rejoin)
                state.peers.send(conn.node, PeerDisconnect(job=job_name, rail=conn.rail, conn=conn.conn_id))
        job = state.jobs.pop(job_name, None)
        # the peers' ranks may still be running: keep what they announced, for a rank of ours that rejoins
        # (a peer_rank_left, or the node going down, removes it)
        live = {node for node, peer in (state.peers.peers.items() if state.peers else ()) if peer.up}
        kept = {r: (info.node, PeerRegions(job=job_name, rank=r, regions=tuple(info.regions.values()),
                                           flag_seeds=info.flag_seeds))
                for r, info in (job.remote.items() if job else ()) if info.node in live}
        if kept and (job_name in self.unclaimed or len(self.unclaimed) < MAX_UNCLAIMED_JOBS):
            self.unclaimed.setdefault(job_name, {}).update(kept)

    def forget_rank(self, job_name: str, job: JobState, rank: int, *, in_workers: bool = True) -> None:
        """Rank ``rank`` is gone from ``job`` (or re-announced): nothing of it counts as pushed or bound any
        more, and (``in_workers``) the workers refuse records for it with BAD_PEER until it is set again."""
        job.pushed = {p for p in job.pushed if p[1] != rank}
        for conn in self.connections.values():
            if conn.job == job_name:
                conn.bound.discard(rank)
        if in_workers:
            for worker in self.state.workers:
                quietly(worker.call, link.ForgetPeer(job=job_name, peer=rank))

    # --- peers coming and going ------------------------------------------------------------------------
    def peer_up(self, node: str) -> None:
        # a node that (re)appears learns every announced rank of ours, and which of its jobs we gave up on:
        # a node that froze past our heartbeat timeout may never have noticed (it heard us all along)
        if node not in self.rewiring:  # the same life speaks again (it was silent, not restarted)
            for conn in self.connections.values():
                if conn.node == node and conn.state == "held" and not conn.broken_until:
                    quietly(self.state.workers[conn.rail].call, link.HoldConnection(conn=conn.conn_id, on=False))
                    conn.state = "up"
            for job in self.state.jobs.values():
                for r in [r for r in job.returning if r in job.remote and job.remote[r].node == node]:
                    del job.returning[r]
        plane = self.state.plane
        for job_name, job in self.state.jobs.items():
            for rank in job.local.values():
                if rank.announced:
                    plane.send(node, self.regions_message(rank))
            if node in job.lost:
                plane.send(node, PeerJobLost(job=job_name))

    def peer_down(self, node: str) -> None:
        """Fail every connection to ``node``: clients waiting on it see PEER_LOST, not a hang."""
        self.quiescing.discard(node)
        self.rewiring.discard(node)
        for job in self.state.jobs.values():
            for r in [r for r in job.returning if r in job.remote and job.remote[r].node == node]:
                del job.returning[r]
        for ranks in self.unclaimed.values():
            for rank in [r for r, (n, _) in ranks.items() if n == node]:
                del ranks[rank]
        for key in [k for k in self.accepted if k[0] == node]:
            # accepted for the node's connections: its daemon's next life asks for new ones (and may reuse
            # the connection ids), so none of these may be handed out again
            self._close_accepted(self.accepted.pop(key))
        self._fail_connections(node)
        for job_name, job in self.state.jobs.items():
            if any(r.node == node for r in job.remote.values()):
                self._lose_node(job_name, job, node)

    def _fail_connections(self, node: str, job_name: str | None = None) -> None:
        """Our connections to ``node`` (of ``job_name`` only, if given) fail: their records get PEER_LOST."""
        for conn in self.connections.values():
            if conn.node == node and conn.state != "failed" and job_name in (None, conn.job):
                conn.state = "failed"
                quietly(self.state.workers[conn.rail].call,
                        link.FailConnection(conn=conn.conn_id, code=int(ErrorCode.PEER_LOST)))
        for key in [k for k in self.retired if k[1] == node and job_name in (None, k[0])]:
            for old in self.retired.pop(key):  # an earlier life's: the ranks still held there are lost too
                worker = self.state.workers[old.rail]
                quietly(worker.call, link.FailConnection(conn=old.conn_id, code=int(ErrorCode.PEER_LOST)))
                quietly(worker.call, link.CloseConnection(conn=old.conn_id))

    def _lose_node(self, job_name: str, job: JobState, node: str) -> None:
        """``job`` cannot go on without ``node``: its local ranks' sessions say PEER_LOST."""
        job.lost.add(node)
        for rank in job.local.values():
            if rank.flags is not None:
                rank.flags.set_status(int(ErrorCode.PEER_LOST))
        log.warning("job %s lost node %s", job_name, node)

    # --- a peer daemon restarting (module doc) ------------------------------------------------------------
    def peer_restarting(self, node: str, announced: bool) -> None:
        """``node`` is restarting (``announced``: it said so and waits for our peer_quiesced) or fell silent:
        hold our connections there, and give its ranks the grace period to come back."""
        deadline = self.clock() + self.state.config.peers.restart_grace_s
        self.rewiring.discard(node)
        for conn in self.connections.values():
            if conn.node == node and conn.state == "up":
                quietly(self.state.workers[conn.rail].call, link.HoldConnection(conn=conn.conn_id, on=True))
                conn.state = "held"
        for job in self.state.jobs.values():
            for r, info in job.remote.items():
                if info.node == node:
                    job.returning.setdefault(r, deadline)
        if announced:
            self.quiescing.add(node)
            self._next_quiesce_check = 0.0

    def peer_restarted(self, node: str) -> None:
        """``node``'s next life said hello: retire what its earlier life served (anything still in flight there
        has an unknown outcome), forget what we accepted for it, and wait for its ranks to re-announce."""
        deadline = self.clock() + self.state.config.peers.restart_grace_s
        self.quiescing.discard(node)
        self.rewiring.add(node)
        for key in [k for k, c in self.connections.items() if c.node == node]:
            conn = self.connections.pop(key)
            worker = self.state.workers[conn.rail]
            if conn.state in ("up", "held"):
                quietly(worker.call, link.RetireConnection(conn=conn.conn_id, code=int(ErrorCode.UNKNOWN_OUTCOME)))
                self.retired.setdefault(key, []).append(conn)
            else:  # connecting (nothing is bound to it yet) or failed
                quietly(worker.call, link.CloseConnection(conn=conn.conn_id))
        for key in [k for k in self.accepted if k[0] == node]:
            self._close_accepted(self.accepted.pop(key))  # its next life may reuse the connection ids
        for ranks in self.unclaimed.values():
            for rank in [r for r, (n, _) in ranks.items() if n == node]:
                del ranks[rank]
        for job in self.state.jobs.values():
            there = {r for r, info in job.remote.items() if info.node == node}
            for r in there:
                job.returning.setdefault(r, deadline)
            job.pushed = {p for p in job.pushed if p[1] not in there}

    def tick(self) -> None:
        """Answer peer_quiesced to each restarting node once nothing of ours is waiting or in flight to it."""
        now = self.clock()
        if not self.quiescing or now < self._next_quiesce_check:
            return
        self._next_quiesce_check = now + 0.002
        for node in list(self.quiescing):
            by_rail: dict[int, list[int]] = {}
            for conn in self.connections.values():
                if conn.node == node:
                    by_rail.setdefault(conn.rail, []).append(conn.conn_id)
            try:
                idle = all(self.state.workers[rail].call(link.ConnectionsIdle(conns=ids)).idle
                           for rail, ids in by_rail.items())
            except WorkerError as exc:
                log.warning("%s", exc)
                idle = True  # a worker that cannot say has nothing it could still deliver
            if idle:
                self.quiescing.discard(node)
                self.state.plane.send(node, PeerQuiesced(node=self.state.node))

    def check_broken(self) -> None:
        """Connections whose far end stopped answering (the engine held them and reported what was in flight
        as UNKNOWN_OUTCOME): wait the grace period for the node's next life to re-wire them."""
        grace = self.state.config.peers.restart_grace_s
        for worker in self.state.workers:
            try:
                broken = set(worker.call(link.BrokenConnections()).conns)
            except WorkerError as exc:
                log.warning("%s", exc)
                continue
            for conn in self.connections.values():
                if conn.rail == worker.rail and conn.conn_id in broken and conn.state in ("up", "held"):
                    conn.state, conn.broken_until = "held", self.clock() + grace
                    log.warning("job %s: the connection to node %s (rail %d) stopped answering: holding its "
                                "records for up to %.1fs", conn.job, conn.node, conn.rail, grace)

    def expire(self) -> None:
        """Ranks of a restarted node that did not come back within the grace period: their jobs lost it. A
        broken connection whose node did not restart within it fails (TRANSPORT, as a dead QP always did)."""
        now = self.clock()
        peers = self.state.plane.peers
        for conn in self.connections.values():
            if conn.state == "held" and conn.broken_until and now > conn.broken_until:
                peer = peers.get(conn.node)
                if conn.node != self.state.node and (peer is None or peer.state != "up"):
                    continue  # the node itself is restarting or lost: its own grace period decides
                conn.state = "failed"
                conn.error = f"the connection to node {conn.node} stopped answering and was not re-made"
                quietly(self.state.workers[conn.rail].call,
                        link.FailConnection(conn=conn.conn_id, code=int(ErrorCode.TRANSPORT)))
                log.warning("job %s: %s", conn.job, conn.error)
        for job_name, job in list(self.state.jobs.items()):
            late = [r for r, deadline in job.returning.items() if now > deadline]
            if not late:
                continue
            nodes = {job.remote[r].node for r in late if r in job.remote}
            for r in late:
                del job.returning[r]
            for node in nodes - job.lost:
                log.warning("job %s: rank(s) %s on node %s did not come back within peers.restart_grace_s", job_name,
                            ", ".join(str(r) for r in sorted(late) if job.remote[r].node == node), node)
                self._fail_connections(node, job_name)
                self._lose_node(job_name, job, node)
                self.state.plane.send(node, PeerJobLost(job=job_name))

    # --- peer messages ---------------------------------------------------------------------------------
    def on_job_lost(self, node: str, msg: PeerJobLost) -> None:
        job = self.state.jobs.get(msg.job)
        if job is not None and node not in job.lost:
            self._fail_connections(node, msg.job)
            self._lose_node(msg.job, job, node)

    def on_regions(self, node: str, msg: PeerRegions) -> None:
        job = self.state.jobs.get(msg.job)
        if job is None:
            # no local rank of this job yet: keep the announcement for when one joins (bounded, so a peer
            # cannot grow it without limit)
            if msg.job in self.unclaimed or len(self.unclaimed) < MAX_UNCLAIMED_JOBS:
                self.unclaimed.setdefault(msg.job, {})[msg.rank] = (node, msg)
            return
        if msg.rank in job.local:
            log.warning("peer %s claims rank %d of job %s, which is local here: ignored", node, msg.rank, msg.job)
            return
        job.remote[msg.rank] = RemoteRank(node, {(r.id, r.rail): r for r in msg.regions}, msg.flag_seeds)
        job.returning.pop(msg.rank, None)  # back after its node's restart, with its new keys
        self.forget_rank(msg.job, job, msg.rank, in_workers=False)  # re-pushed in full just below
        self.refresh_job(msg.job)

    def on_rank_left(self, node: str, msg: PeerRankLeft) -> None:
        unclaimed = self.unclaimed.get(msg.job, {})
        if unclaimed.get(msg.rank, (None,))[0] == node:
            del unclaimed[msg.rank]
            if not unclaimed:
                del self.unclaimed[msg.job]
        job = self.state.jobs.get(msg.job)
        remote = job.remote.get(msg.rank) if job is not None else None
        if job is not None and remote is not None and remote.node == node:
            del job.remote[msg.rank]
            job.returning.pop(msg.rank, None)
            self.forget_rank(msg.job, job, msg.rank)
            log.info("job %s: rank %d on node %s left", msg.job, msg.rank, node)

    def on_connect_request(self, node: str, msg: PeerConnectRequest) -> None:
        state = self.state
        if msg.rail >= len(state.workers):
            log.warning("peer %s asks for rail %d; this node has %d", node, msg.rail, len(state.workers))
            return
        key = (node, msg.conn)
        worker = state.workers[msg.rail]
        accepted = self.accepted.get(key)
        if accepted is None:  # a repeated request (the accept was lost) gets the same answer
            local_id = next(state.conn_ids)
            endpoint = worker.call(link.CreateEndpoint(conn=local_id, job=msg.job, responder=True)).endpoint
            worker.call(link.Connect(conn=local_id, remote=dict(msg.endpoint)))
            accepted = self.accepted[key] = AcceptedConnection(local_id, msg.rail, endpoint)
        state.plane.send(node, PeerConnectAccept(job=msg.job, rail=msg.rail, conn=msg.conn,
                                                 endpoint=accepted.endpoint))

    def on_connect_accept(self, node: str, msg: PeerConnectAccept) -> None:
        conn = self.connections.get((msg.job, node, msg.rail))
        if conn is None or conn.conn_id != msg.conn or conn.state == "up":
            return
        self.state.workers[conn.rail].call(link.Connect(conn=conn.conn_id, remote=dict(msg.endpoint)))
        conn.state, conn.peer_gid = "up", str(msg.endpoint.get("gid", ""))
        self.refresh_job(msg.job)

    def on_disconnect(self, node: str, msg: PeerDisconnect) -> None:
        accepted = self.accepted.pop((node, msg.conn), None)
        if accepted is not None:
            self._close_accepted(accepted)

    def _close_accepted(self, accepted: AcceptedConnection) -> None:
        if accepted.rail < len(self.state.workers):
            quietly(self.state.workers[accepted.rail].call, link.CloseConnection(conn=accepted.conn_id))


def _key(info: RegionInfo) -> dict[str, int]:
    return {"addr": info.addr, "length": info.length, "rkey": info.rkey}
