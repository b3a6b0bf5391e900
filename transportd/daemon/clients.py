"""The daemon's control clients: who each one is, the job rank it joined, and what the daemon hands it by
descriptor. A client here is one control session (one connection, from ``hello`` on; docs/control-protocol.md),
joined to a job or not: not gpuclient's ``Session``, which is one joined rank.

Over ipc a session shows who it is on the descriptor socket: ``hello`` gives it a one-time token, and the
descriptor connection presenting that token (``vouch``) binds the session to the kernel's credentials of
that connection (``SO_PEERCRED``); the session ends when that connection closes or the pid exits. Over tcp
CURVE's key is the identity. What the daemon makes for a client (flag arrays, rings, IBGDA queues) is
offered on its descriptor connection and withdrawn when its rank ends.
"""

from __future__ import annotations

import grp
import logging
import os
import secrets
from dataclasses import dataclass
from typing import Any

from transportd.control import protocol
from transportd.control.fdsocket import SideConnection
from transportd.control.protocol import Hello, Join, ReplyCode, Vouch
from transportd.daemon.peering import Peering
from transportd.daemon.state import JobState, LocalRank, NodeState
from transportd.errors import RequestError

__all__ = ["SESSION_ENDS", "ControlClients", "Identity"]

log = logging.getLogger("transportd")

#: Why a joined session ended: it said leave, its process exited, it fell silent past
#: control.client_timeout_s, or the daemon stopped.
SESSION_ENDS = ("left", "exited", "silent", "shutdown")


@dataclass(frozen=True)
class Identity:
    """Who a control session is, as the kernel (ipc: ``SO_PEERCRED``) or CURVE (tcp) vouches for it.

    ``principal`` owns jobs: ``uid:<n>`` over ipc, ``curve:<z85 public key>`` over tcp with CURVE,
    ``anonymous`` over tcp without it (every such client is the same principal).
    """

    principal: str
    uid: int | None = None
    gid: int | None = None
    pid: int = 0

    @property
    def superuser(self) -> bool:
        return self.uid == 0

    def may_touch(self, job: JobState) -> bool:
        """Whether this identity may see or join ``job`` (its creator's on this node, or root)."""
        return self.superuser or job.owner == self.principal


class ControlClients:
    """The daemon's record of each control client (by its zmq identity): ``ranks`` (client -> the rank it
    joined, or None), their identities, the kernel's pid of each vouched ipc client (``pids``), and their
    descriptor connections (``side``)."""

    def __init__(self, state: NodeState, peering: Peering) -> None:
        self.state = state
        self.peering = peering
        self.ranks: dict[bytes, LocalRank | None] = {}
        self.pids: dict[bytes, int] = {}  # the kernel's pid of each vouched ipc client
        self.identities: dict[bytes, Identity] = {}
        self._tokens: dict[bytes, bytes] = {}  # one-time hello token -> control session
        self.side: dict[bytes, SideConnection] = {}  # control session -> its descriptor connection
        self.ended = dict.fromkeys(SESSION_ENDS, 0)  # joined sessions ended, by why

    @property
    def joined_count(self) -> int:
        return sum(1 for rank in self.ranks.values() if rank is not None)

    # --- greeting and identity ------------------------------------------------------------------------
    def hello(self, client_id: bytes, req: Hello) -> dict[str, Any]:
        # the pid (and pid_ns) a client states are trusted for nothing: over ipc the kernel says who it is
        # once it presents this token on the descriptor socket; over tcp CURVE's key is the identity
        state = self.state
        self.ranks.setdefault(client_id, None)
        reply = {"node": state.node, "backend": state.config.backend.kind, "rails": len(state.workers),
                 "version": protocol.V, "keepalive_s": state.config.control.client_timeout_s / 4,
                 "restart_grace_s": state.config.peers.restart_grace_s}
        if state.fdserver is not None:
            for token in [t for t, cid in self._tokens.items() if cid == client_id]:
                del self._tokens[token]
            token = secrets.token_bytes(protocol.TOKEN_BYTES)
            self._tokens[token] = client_id
            reply.update(token=token, fd_socket=state.fdserver.path, vouched=client_id in self.identities)
        return reply

    def vouch(self, conn: SideConnection, req: Vouch) -> dict[str, Any]:
        """Bind a control session to the kernel's credentials of the descriptor connection presenting its
        hello token; ``control.group`` is checked here too (root and the daemon's own uid pass)."""
        client_id = self._tokens.pop(req.token, None)
        if client_id is None or client_id not in self.ranks:
            raise RequestError(ReplyCode.FORBIDDEN, "unknown or used token: send hello on the control socket and "
                                                    "present the token of its reply once")
        if conn.client_id is not None or client_id in self.side:
            raise RequestError(ReplyCode.INVALID, "this connection (or that session) has vouched already")
        creds = conn.creds
        group = self.state.config.control.group
        if group and creds.uid not in (0, os.geteuid()):
            gid = grp.getgrnam(group).gr_gid
            if not creds.in_group(gid):
                raise RequestError(ReplyCode.FORBIDDEN, f"uid {creds.uid} is not in group {group!r} "
                                                        "(control.group), which may use this daemon")
        conn.client_id = client_id
        self.side[client_id] = conn
        self.identities[client_id] = Identity(f"uid:{creds.uid}", creds.uid, creds.gid, creds.pid)
        if creds.pid:  # 0: its process is not visible from our pid namespace; the connection still ends with it
            self.pids[client_id] = creds.pid
        log.info("client %s is uid %d gid %d pid %d", client_id.hex(), creds.uid, creds.gid, creds.pid)
        return {"uid": creds.uid, "gid": creds.gid, "pid": creds.pid}

    def side_closed(self, conn: SideConnection) -> bytes | None:
        """A descriptor connection ended: the session it vouched for, whose process exited (or closed it),
        so that session ends too; None if it vouched for none."""
        client_id = conn.client_id
        if client_id is None or self.side.get(client_id) is not conn:
            return None
        del self.side[client_id]
        return client_id

    def forget(self, client_id: bytes) -> None:
        """Forget who the session was (its identity, pid, tokens) and drop its descriptor connection."""
        self.identities.pop(client_id, None)
        self.pids.pop(client_id, None)
        for token in [t for t, cid in self._tokens.items() if cid == client_id]:
            del self._tokens[token]
        conn = self.side.pop(client_id, None)
        if conn is not None and self.state.fdserver is not None:
            conn.client_id = None
            self.state.fdserver.drop(conn)

    def identity(self, client_id: bytes) -> Identity:
        """The session's identity, or a refusal naming what to do about it."""
        ident = self.identities.get(client_id)
        if ident is not None:
            return ident
        fdserver, control = self.state.fdserver, self.state.control
        if fdserver is not None:  # ipc: the kernel must have vouched
            raise RequestError(ReplyCode.NO_IDENTITY, f"this session has not shown who it is: present the hello "
                                                      f"reply's token on {fdserver.path} (op 'vouch'; "
                                                      "gpuclient and transportctl do this)")
        info = control.clients.get(client_id) if control else None
        key = info.user_id if info is not None else ""
        return Identity(f"curve:{key}" if key else "anonymous")

    def exited(self) -> list[bytes]:
        """The vouched sessions whose process has exited (a killed client never says leave)."""
        gone = []
        for client_id, pid in list(self.pids.items()):
            if not _process_alive(pid):
                log.info("client pid %d exited: reclaiming its session", pid)
                gone.append(client_id)
        return gone

    # --- the job rank -----------------------------------------------------------------------------------
    def join(self, client_id: bytes, req: Join) -> dict[str, Any]:
        state = self.state
        if self.ranks.get(client_id) is not None:
            raise RequestError(ReplyCode.ALREADY_JOINED, "this session already joined a job")
        ident = self.identity(client_id)
        job = state.jobs.get(req.job)
        if job is not None and not ident.may_touch(job):
            raise RequestError(ReplyCode.FORBIDDEN, f"job {req.job!r} on node {state.node} belongs to another "
                                                    "user (a job is its creator's on each node): pick another job "
                                                    "name")
        if job is None:
            job = state.jobs[req.job] = JobState(world=req.world, owner=ident.principal)
            job.remote.update(self.peering.claim(req.job))  # what peers announced before any rank was here
        if job.world != req.world:
            raise RequestError(ReplyCode.BAD_WORLD, f"job {req.job!r} has world {job.world}, not {req.world}")
        if req.rank in job.local or req.rank in job.remote:
            raise RequestError(ReplyCode.RANK_TAKEN, f"rank {req.rank} of job {req.job!r} is already joined")
        if req.rail >= len(state.workers):
            raise RequestError(ReplyCode.INVALID, f"rail {req.rail}: this node has {len(state.workers)} rail(s)")
        rail = req.rail if req.rail >= 0 else state.rail_for_device(req.device)
        rank = LocalRank(client_id, req.job, req.rank, req.world, req.device, rail,
                         pid=self.pids.get(client_id, 0))
        job.local[req.rank] = rank
        self.ranks[client_id] = rank
        log.info("job %s rank %d %s (device %d, rail %d)", req.job, req.rank,
                 "re-attached after a restart" if req.resume else "joined", req.device, rail)
        return {"node": state.node, "rail": rail, "flags_placement": state.flags_placement(req.device)}

    def joined(self, client_id: bytes) -> LocalRank:
        rank = self.ranks.get(client_id)
        if rank is None:
            raise RequestError(ReplyCode.NOT_JOINED, "join a job first")
        return rank

    def end(self, client_id: bytes, why: str) -> LocalRank | None:
        """End ``client_id``'s session (``why``: one of SESSION_ENDS): the rank it held, for the daemon to
        release, or None if it held none."""
        rank = self.ranks.pop(client_id, None)
        if why == "shutdown":
            self.forget(client_id)
        if rank is not None:
            self.ended[why] += 1
        return rank

    # --- what the daemon hands a client by descriptor -------------------------------------------------
    def side_for(self, client_id: bytes, what: str) -> SideConnection:
        """The session's descriptor connection: what the daemon makes for a client travels only by descriptor."""
        conn = self.side.get(client_id)
        if conn is None:
            raise RequestError(ReplyCode.UNSUPPORTED, f"{what} is an anonymous memfd handed over by descriptor on "
                                                      "the local ipc descriptor socket: open it over ipc (none "
                                                      "can travel over tcp)")
        return conn

    def offer(self, rank: LocalRank, conn: SideConnection, fd: int, kind: str) -> int:
        """Offer ``fd`` (owned by the offer from now on, closed if it is refused) to the rank's client;
        withdrawn when the rank ends."""
        fd_id = conn.offer(fd, kind)
        rank.offers.append(fd_id)
        return fd_id

    def withdraw_offers(self, rank: LocalRank) -> None:
        """The rank ended: offers its client has not taken yet go (what they gave is gone)."""
        conn = self.side.get(rank.client_id)
        for fd_id in rank.offers if conn is not None else ():
            conn.withdraw(fd_id)


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # a zombie child still "exists": read its state where /proc allows
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][:1] != "Z"
    except OSError:
        return True
