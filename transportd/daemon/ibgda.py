"""IBGDA channels: queue pairs the GPU posts WQEs to itself, made and connected by the daemon.

A channel is one queue pair per peer rank in the rank's rail worker, each connected (through the peer
plane: ``peer_connect_request``/``accept``, like a rank's connections) to a responder QP on the peer's node
and rail, or in the same worker for a rank on this node. Only backends the registry declares able to serve
them (:func:`transportd.backends.has_capability`, ``"ibgda"``) hand them out.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from cmd_ring.shm import unsealed_memfd
from transportd.backends import IBGDA, has_capability, kinds_with
from transportd.control.protocol import ChannelInfo, PeerConnectAccept, PeerConnectRequest, PeerDisconnect
from transportd.daemon.clients import ClientSessions
from transportd.daemon.peering import Peering
from transportd.daemon.state import LocalRank, NodeState, memfd_name, quietly
from transportd.errors import RequestError, WorkerError

__all__ = ["IbgdaChannel", "IbgdaChannels", "IbgdaQueue"]


@dataclass
class IbgdaQueue:
    """One queue pair of an IBGDA channel: in the rank's rail worker, connected to a responder on ``node``."""

    queue_id: int
    peer: int
    node: str
    fd: int  # the queue's memfd (the worker sized and sealed it): offered to the client once it is up
    info: dict[str, Any]  # the worker's reply: endpoint, qpn, wqe_cnt, ncqes, scratch, scratch_lkey
    state: str = "connecting"  # connecting | up | failed
    responder: int = 0  # the responder's connection id when the peer is on this node
    offer: int = -1  # the id of its descriptor offered to the client and not taken yet


@dataclass
class IbgdaChannel:
    channel_id: int
    queues: dict[int, IbgdaQueue] = field(default_factory=dict)  # peer rank -> queue


class IbgdaChannels:
    """Every rank's IBGDA channels (``channels``, by (job, rank) then channel id) and the queues whose far
    end has not accepted yet (``waiting``, by (node, queue id))."""

    def __init__(self, state: NodeState, clients: ClientSessions, peering: Peering) -> None:
        self.state = state
        self.clients = clients
        self.peering = peering
        self.channels: dict[tuple[str, int], dict[int, IbgdaChannel]] = {}
        self.waiting: dict[tuple[str, int], IbgdaQueue] = {}

    def open(self, rank: LocalRank, wqe_cnt: int) -> dict[str, Any]:
        """Make the channel's queues and ask their far ends to connect. The reply comes before they accept:
        the client asks ``channel_info`` until ``ready``."""
        state = self.state
        kind = state.config.backend.kind
        if not has_capability(kind, IBGDA):
            raise RequestError("unsupported", f"IBGDA channels need a backend that serves them (backend.kind = "
                                              f"{' or '.join(map(repr, kinds_with(IBGDA)))}: a ConnectX), "
                                              f"not {kind!r}")
        job = state.jobs[rank.job]
        if not self.peering.job_wired(rank):
            raise RequestError("not_ready", "exchange until every rank of the job is known and reachable before "
                                            "opening an IBGDA channel")
        chan = IbgdaChannel(next(state.channel_ids))
        mine = self.channels.setdefault((rank.job, rank.rank), {})
        mine[chan.channel_id] = chan
        worker = state.workers[rank.rail]
        try:
            for peer in range(job.world):
                if peer == rank.rank:
                    continue
                queue_id = next(state.conn_ids)
                # empty: the worker sizes it for the queue it builds there, then seals its size
                fd = unsealed_memfd(memfd_name("ibgda", rank.job, rank.rank, chan.channel_id, peer))
                try:
                    info = worker.call("create_ibgda_queue", queue=queue_id, job=rank.job, wqe_cnt=wqe_cnt,
                                       fds=(fd,))
                except BaseException:
                    os.close(fd)
                    raise
                node = state.node_of(job, peer)
                queue = chan.queues[peer] = IbgdaQueue(queue_id, peer, node, fd, info)
                if node == state.node:  # the responder lives in the same worker
                    queue.responder = next(state.conn_ids)
                    far = worker.call("create_endpoint", conn=queue.responder, job=rank.job, responder=True)
                    worker.call("connect", conn=queue.responder, remote=info["endpoint"])
                    worker.call("connect_ibgda_queue", queue=queue_id, remote=far["endpoint"])
                    queue.state = "up"
                else:
                    self.waiting[(node, queue_id)] = queue
                    state.plane.send(node, PeerConnectRequest(job=rank.job, rail=rank.rail, conn=queue_id,
                                                              endpoint=info["endpoint"]))
        except WorkerError as exc:
            self._close(rank, chan)
            mine.pop(chan.channel_id, None)
            if not mine:
                del self.channels[(rank.job, rank.rank)]
            raise RequestError("channel_failed", str(exc)) from None
        return {"channel": chan.channel_id, "kind": "ibgda", "rail": rank.rail,
                "ready": all(q.state == "up" for q in chan.queues.values())}

    def info(self, client_id: bytes, req: ChannelInfo) -> dict[str, Any]:
        """``ready`` false while a queue awaits its far end; then everything a ``tpd::IbgdaChannel`` needs."""
        rank = self.clients.joined(client_id)
        chan = self.channels.get((rank.job, rank.rank), {}).get(req.channel)
        if chan is None:
            raise RequestError("unknown_channel", f"this session has no IBGDA channel {req.channel}")
        failed = [q for q in chan.queues.values() if q.state == "failed"]
        if failed:
            raise RequestError("unreachable", f"the queue pair to rank {failed[0].peer} on {failed[0].node} failed")
        if any(q.state != "up" for q in chan.queues.values()):
            return {"channel": chan.channel_id, "ready": False}
        job, rail = self.state.jobs[rank.job], rank.rail
        # region tables indexed by region id; an id without a key on this rail is all zeros (refused)
        local = [_triple(rank.regions.get(i, {}).get(rail), "lkey") for i in range(rank.next_region)]
        remote_regions, remote_flags = [], []
        for peer in chan.queues:
            regions, flags = self.peering.peer_keys(job, peer, rail)
            count = max(regions, default=-1) + 1
            remote_regions.append([peer, [_triple(regions.get(i), "rkey") for i in range(count)]])
            if flags is not None:
                remote_flags.append([peer, _triple(flags, "rkey")])
        conn = self.clients.side_for(client_id, "an IBGDA queue's memory")
        for q in chan.queues.values():
            if q.offer not in conn.offered:  # first asked, or taken since: offer it (again)
                q.offer = self.clients.offer(rank, conn, os.dup(q.fd), "ibgda")
        queues = [{"peer": q.peer, "fd": q.offer, **{k: q.info[k] for k in ("qpn", "wqe_cnt", "ncqes", "scratch",
                                                                             "scratch_lkey")}}
                  for q in chan.queues.values()]
        return {"channel": chan.channel_id, "ready": True, "kind": "ibgda", "rail": rail,
                "signal_mode": self.state.config.signal.mode, "queues": queues, "local_regions": local,
                "remote_regions": remote_regions, "remote_flags": remote_flags}

    def close_rank(self, rank: LocalRank) -> None:
        """Close every IBGDA channel of ``rank`` (it is being released)."""
        for chan in self.channels.pop((rank.job, rank.rank), {}).values():
            self._close(rank, chan)

    def _close(self, rank: LocalRank, chan: IbgdaChannel) -> None:
        state = self.state
        worker = state.workers[rank.rail] if rank.rail < len(state.workers) else None
        for queue in chan.queues.values():
            self.waiting.pop((queue.node, queue.queue_id), None)
            if worker is not None:
                quietly(worker.call, "close_ibgda_queue", queue=queue.queue_id)
                if queue.responder:
                    quietly(worker.call, "close_connection", conn=queue.responder)
            if queue.node != state.node and state.peers is not None:  # the far end closes its responder
                state.peers.send(queue.node, PeerDisconnect(job=rank.job, rail=rank.rail, conn=queue.queue_id))
            os.close(queue.fd)

    def connect_accepted(self, node: str, msg: PeerConnectAccept) -> bool:
        """If ``msg`` answers one of our queues, connect it (True); else it is not ours (False)."""
        queue = self.waiting.pop((node, msg.conn), None)
        if queue is None:
            return False
        try:
            self.state.workers[msg.rail].call("connect_ibgda_queue", queue=queue.queue_id,
                                              remote=dict(msg.endpoint))
            queue.state = "up"
        except WorkerError:
            queue.state = "failed"
            raise
        return True

    def peer_down(self, node: str) -> None:
        """Queues still waiting for ``node`` to accept fail (``channel_info`` says so)."""
        for key in [k for k in self.waiting if k[0] == node]:
            self.waiting.pop(key).state = "failed"


def _triple(key: dict[str, int] | None, which: str) -> list[int]:
    """[addr, length, lkey or rkey] for a region table; zeros where the region has no key."""
    return [key["addr"], key["length"], key[which]] if key else [0, 0, 0]
