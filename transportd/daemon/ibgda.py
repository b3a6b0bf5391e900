"""IBGDA channels: queue pairs the GPU posts WQEs to itself, built by the client, their far ends by the daemon.

A rank's client builds its queue pairs (send queue, CQ, UAR; DevX objects on a ConnectX) in its own
process, on the rank's **IBGDA domain**: a device context of its own on the rank's rail, with a PD and the
rank's regions registered there (``ibgda.domain``, made by the rail worker on the rank's first IBGDA
channel). The domain's command descriptor goes to the client over the descriptor socket; it imports the
context, the PD and the MRs by handle. Per channel:

1. ``channel(kind="ibgda")``: the domain (made or brought up to date with the rank's regions), the grant
   (descriptor offer, PD handle, scratch page) and the peer ranks;
2. ``channel_connect``: one endpoint per peer rank; the daemon connects a far end to each, a responder QP
   on the peer's node and rail through the peer plane (``peer_connect_request``/``accept``, as for a
   rank's connections), or in this node's worker for a rank on this node;
3. ``channel_info`` until ``ready``: the far ends' endpoints and the keys the channel's tables need (the
   rank's regions with the domain's lkeys, the peers' regions and flags with their rkeys);
4. ``channel_close`` (or the rank's end): the far ends close. The rank's end closes the domain too.

Only backends the registry declares able to serve them (:func:`transportd.backends.has_capability`,
``"ibgda"``) hand them out.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from transportd.backends import IBGDA, has_capability, kinds_with
from transportd.control.fdsocket import SideConnection
from transportd.control.protocol import (
    ChannelClose,
    ChannelConnect,
    ChannelInfo,
    PeerConnectAccept,
    PeerConnectRequest,
    PeerDisconnect,
    ReplyCode,
)
from transportd.daemon.clients import ControlClients
from transportd.daemon.peering import Peering
from transportd.daemon.state import LocalRank, NodeState, quietly, region_key
from transportd.dataplane import link_messages as link
from transportd.errors import RequestError, WorkerError

__all__ = ["IbgdaChannelRecord", "IbgdaChannels", "IbgdaQueue"]


@dataclass
class IbgdaQueue:
    """One queue pair of an IBGDA channel: the client's, toward rank ``peer`` on ``node``."""

    peer: int
    node: str
    queue_id: int = 0  # the connection id its far end is known by (set when the client connects it)
    endpoint: dict[str, Any] | None = None  # the client's QP, as it described it
    far: dict[str, Any] | None = None  # the far end's endpoint, once it accepted
    state: str = "new"  # new | connecting | up | failed
    responder: int = 0  # the responder's connection id when the peer is on this node


@dataclass
class IbgdaChannelRecord:
    """The daemon's record of one IBGDA channel a client opened: its rail, its queues' depth and, per peer
    rank, the queue and its far end (not the ``tpd::IbgdaChannel`` kernels take, which the client builds)."""

    channel_id: int
    rail: int
    wqe_cnt: int
    queues: dict[int, IbgdaQueue] = field(default_factory=dict)  # peer rank -> queue


class IbgdaChannels:
    """Every rank's IBGDA channels (``channels``, by (job, rank) then channel id), the ranks' domains
    (``domains``: the grant and the regions registered there) and the queues whose far end has not
    accepted yet (``waiting``, by (node, queue id))."""

    def __init__(self, state: NodeState, clients: ControlClients, peering: Peering) -> None:
        self.state = state
        self.clients = clients
        self.peering = peering
        self.channels: dict[tuple[str, int], dict[int, IbgdaChannelRecord]] = {}
        self.domains: dict[tuple[str, int], dict[str, Any]] = {}
        self.waiting: dict[tuple[str, int], IbgdaQueue] = {}

    # --- the domain ------------------------------------------------------------------------------------
    def _sync_domain(self, rank: LocalRank, with_fd: bool) -> dict[str, Any]:
        """Make the rank's domain or register the regions it lacks; with ``with_fd``, the reply's ``fds``
        hold a copy of its command descriptor."""
        keys = [region_key(rank, i) for i in sorted(rank.regions) if rank.rail in rank.regions[i]]
        known = self.domains.get((rank.job, rank.rank))
        if known is not None and not with_fd and all(k in known["regions"] for k in keys):
            return known
        reply = self.state.workers[rank.rail].call(link.OpenIbgdaDomain(job=rank.job, rank=rank.rank, regions=keys,
                                                                        with_fd=with_fd))
        domain = self.domains.setdefault((rank.job, rank.rank), {"grant": reply.grant, "regions": {}})
        domain["regions"].update(reply.regions)
        if with_fd:
            domain["fds"] = reply.fds
        return domain

    # --- requests ----------------------------------------------------------------------------------------
    def open(self, rank: LocalRank, conn: SideConnection, wqe_cnt: int) -> dict[str, Any]:
        """Grant the rank's domain and name the channel's peers; the client builds the queue pairs and sends
        ``channel_connect``."""
        state = self.state
        kind = state.config.backend.kind
        if not has_capability(kind, IBGDA):
            raise RequestError(ReplyCode.UNSUPPORTED, f"IBGDA channels need a backend that serves them (backend.kind = "
                                                      f"{' or '.join(map(repr, kinds_with(IBGDA)))}: a ConnectX), "
                                                      f"not {kind!r}")
        job = state.jobs[rank.job]
        if not self.peering.job_wired(rank):
            raise RequestError(ReplyCode.NOT_READY,
                               "exchange until every rank of the job is known and reachable before "
                               "opening an IBGDA channel")
        try:
            domain = self._sync_domain(rank, with_fd=True)
        except WorkerError as exc:
            raise RequestError(ReplyCode.CHANNEL_FAILED, str(exc)) from None
        (fd,) = domain.pop("fds")
        offer = self.clients.offer(rank, conn, fd, "ibgda")  # owned by the offer from here on
        chan = IbgdaChannelRecord(state.new_channel_id(), rank.rail, wqe_cnt)
        for peer in range(job.world):
            if peer != rank.rank:
                chan.queues[peer] = IbgdaQueue(peer, state.node_of(job, peer))
        self.channels.setdefault((rank.job, rank.rank), {})[chan.channel_id] = chan
        return {"channel": chan.channel_id, "kind": "ibgda", "rail": rank.rail, "wqe_cnt": wqe_cnt,
                "peers": sorted(chan.queues), "domain": {**domain["grant"], "fd": offer}, "ready": False}

    def _channel(self, rank: LocalRank, channel: int) -> IbgdaChannelRecord:
        chan = self.channels.get((rank.job, rank.rank), {}).get(channel)
        if chan is None:
            raise RequestError(ReplyCode.UNKNOWN_CHANNEL, f"this session has no IBGDA channel {channel}")
        return chan

    def connect(self, client_id: bytes, req: ChannelConnect) -> dict[str, Any]:
        """Connect a far end to each of the client's queue pairs."""
        rank = self.clients.joined(client_id)
        chan = self._channel(rank, req.channel)
        if {e.peer for e in req.endpoints} != set(chan.queues):
            raise RequestError(ReplyCode.INVALID, f"channel {chan.channel_id} has queue pairs toward ranks "
                                                  f"{sorted(chan.queues)}; the endpoints name "
                                                  f"{sorted(e.peer for e in req.endpoints)}")
        if any(q.state != "new" for q in chan.queues.values()):
            raise RequestError(ReplyCode.INVALID, f"channel {chan.channel_id}'s queue pairs are connected already")
        state = self.state
        worker = state.workers[chan.rail]
        try:
            for ep in req.endpoints:
                queue = chan.queues[ep.peer]
                queue.queue_id = next(state.conn_ids)
                queue.endpoint = {name: getattr(ep, name) for name in ep.__struct_fields__ if name != "peer"}
                if queue.node == state.node:  # the responder lives in this node's worker
                    queue.responder = next(state.conn_ids)
                    far = worker.call(link.CreateEndpoint(conn=queue.responder, job=rank.job, responder=True))
                    worker.call(link.Connect(conn=queue.responder, remote=queue.endpoint))
                    queue.far, queue.state = far.endpoint, "up"
                else:
                    queue.state = "connecting"
                    self.waiting[(queue.node, queue.queue_id)] = queue
                    state.plane.send(queue.node, PeerConnectRequest(job=rank.job, rail=chan.rail,
                                                                    conn=queue.queue_id, endpoint=queue.endpoint))
        except WorkerError as exc:
            self._close(rank, chan)
            self.channels[(rank.job, rank.rank)].pop(chan.channel_id, None)
            raise RequestError(ReplyCode.CHANNEL_FAILED, str(exc)) from None
        return {"channel": chan.channel_id, "ready": all(q.state == "up" for q in chan.queues.values())}

    def info(self, client_id: bytes, req: ChannelInfo) -> dict[str, Any]:
        """``ready`` false while a far end has not accepted; then everything a ``tpd::IbgdaChannel`` needs."""
        rank = self.clients.joined(client_id)
        chan = self._channel(rank, req.channel)
        failed = [q for q in chan.queues.values() if q.state == "failed"]
        if failed:
            raise RequestError(ReplyCode.UNREACHABLE,
                               f"the queue pair to rank {failed[0].peer} on {failed[0].node} failed")
        if any(q.state != "up" for q in chan.queues.values()):
            return {"channel": chan.channel_id, "ready": False}
        try:  # regions registered since the channel opened join the domain now
            domain = self._sync_domain(rank, with_fd=False)
        except WorkerError as exc:
            raise RequestError(ReplyCode.CHANNEL_FAILED, str(exc)) from None
        job, rail = self.state.jobs[rank.job], chan.rail
        # region tables indexed by region id; an id without a key in the domain is all zeros (refused)
        local = []
        for i in range(rank.next_region):
            key = domain["regions"].get(region_key(rank, i))
            local.append([key["addr"], key["length"], key["lkey"], key["handle"]] if key else [0, 0, 0, 0])
        remote_regions, remote_flags = [], []
        for peer in chan.queues:
            regions, flags = self.peering.peer_keys(job, peer, rail)
            count = max(regions, default=-1) + 1
            remote_regions.append([peer, [_triple(regions.get(i), "rkey") for i in range(count)]])
            if flags is not None:
                remote_flags.append([peer, _triple(flags, "rkey")])
        queues = [{"peer": q.peer, "far": q.far} for q in chan.queues.values()]
        return {"channel": chan.channel_id, "ready": True, "kind": "ibgda", "rail": rail,
                "signal_mode": self.state.config.signal.mode, "queues": queues, "local_regions": local,
                "remote_regions": remote_regions, "remote_flags": remote_flags}

    def close_channel(self, client_id: bytes, req: ChannelClose) -> dict[str, Any]:
        """Close a channel's far ends (its queue pairs are the client's to destroy)."""
        rank = self.clients.joined(client_id)
        chan = self._channel(rank, req.channel)
        self._close(rank, chan)
        self.channels[(rank.job, rank.rank)].pop(chan.channel_id, None)
        return {}

    # --- the rank's end, the peer plane ---------------------------------------------------------------
    def close_rank(self, rank: LocalRank) -> None:
        """Close every IBGDA channel of ``rank`` and its domain (it is being released)."""
        for chan in self.channels.pop((rank.job, rank.rank), {}).values():
            self._close(rank, chan)
        domain = self.domains.pop((rank.job, rank.rank), None)
        if domain is not None:
            for fd in domain.pop("fds", ()):
                os.close(fd)
            if rank.rail < len(self.state.workers):
                quietly(self.state.workers[rank.rail].call, link.CloseIbgdaDomain(job=rank.job, rank=rank.rank))

    def _close(self, rank: LocalRank, chan: IbgdaChannelRecord) -> None:
        state = self.state
        worker = state.workers[chan.rail] if chan.rail < len(state.workers) else None
        for queue in chan.queues.values():
            if queue.state == "new":
                continue
            self.waiting.pop((queue.node, queue.queue_id), None)
            if queue.responder and worker is not None:
                quietly(worker.call, link.CloseConnection(conn=queue.responder))
            if queue.node != state.node and state.peers is not None:  # the far end closes its responder
                state.peers.send(queue.node, PeerDisconnect(job=rank.job, rail=chan.rail, conn=queue.queue_id))
            queue.state = "failed"

    def let_go(self, rank: LocalRank) -> None:
        """The daemon is handing over (its workers are gone): forget ``rank``'s IBGDA channels and domain here,
        telling no one. They do not survive a restart (the domain was the old workers', the queue pairs'
        keys and the peers' are in the kernels' handles): the client reports them lost (CHANNEL_LOST) and
        opens new ones on the next daemon's domain."""
        for chan in self.channels.pop((rank.job, rank.rank), {}).values():
            for queue in chan.queues.values():
                self.waiting.pop((queue.node, queue.queue_id), None)
        domain = self.domains.pop((rank.job, rank.rank), None)
        for fd in (domain or {}).pop("fds", ()):
            os.close(fd)

    def connect_accepted(self, node: str, msg: PeerConnectAccept) -> bool:
        """If ``msg`` answers one of our queues, record its far end (True); else it is not ours (False)."""
        queue = self.waiting.pop((node, msg.conn), None)
        if queue is None:
            return False
        queue.far, queue.state = dict(msg.endpoint), "up"
        return True

    def peer_down(self, node: str) -> None:
        """Queues still waiting for ``node`` to accept fail (``channel_info`` says so)."""
        for key in [k for k in self.waiting if k[0] == node]:
            self.waiting.pop(key).state = "failed"

    def queue_stats(self, rail: int) -> list[dict[str, Any]]:
        """The queue pairs clients built on ``rail``'s domains, as this daemon knows them."""
        out = []
        for (job, rank), chans in self.channels.items():
            for chan in chans.values():
                if chan.rail != rail:
                    continue
                for q in chan.queues.values():
                    out.append({"queue": q.queue_id, "channel": chan.channel_id, "job": job, "rank": rank,
                                "peer": q.peer, "node": q.node, "qpn": (q.endpoint or {}).get("qpn"),
                                "far_qpn": (q.far or {}).get("qpn"), "wqe_cnt": chan.wqe_cnt, "state": q.state})
        return out


def _triple(key: dict[str, int] | None, which: str) -> list[int]:
    """[addr, length, lkey or rkey] for a region table; zeros where the region has no key."""
    return [key["addr"], key["length"], key[which]] if key else [0, 0, 0]
