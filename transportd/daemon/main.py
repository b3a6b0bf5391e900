"""The daemon's main process: local clients, jobs, peers, and the proxy workers that do the posting.

One thread runs :meth:`Daemon.run`: it serves the control socket, the peer plane and liveness checks.
Each rail has a proxy worker process (``transportd.dataplane.worker``) that owns the rail's verbs resources and
posts; the main process tells it what to map, connect and consume through :class:`WorkerHandle`.

Wiring a job (all idempotent, re-run by :meth:`_refresh_job` whenever something new is learnt):

1. a local rank joins, registers regions (mapped on every rail) and flags, and calls ``exchange``;
2. ``exchange`` announces the rank's regions and flags to every peer node (``peer_regions``);
3. for every node that hosts a rank of the job, each rail used by a local rank opens its own RC
   connection to the same rail index there (rail-peer routing): ``peer_connect_request`` carries our
   endpoint, the remote worker connects and answers ``peer_connect_accept`` with its own;
4. once a connection is up, the worker learns which peer ranks it reaches and their regions and flags;
5. ``exchange`` reports complete to the client when every rank is known and reachable.
"""

from __future__ import annotations

import grp
import itertools
import logging
import os
import secrets
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from cmd_ring import RingFile
from cmd_ring.shm import map_fd, sealed_memfd, size_is_sealed, unsealed_memfd
from transportd.control import protocol
from transportd.control.curve import CurveServerKeys
from transportd.control.fdchannel import FdServer, SideConnection, fd_socket_for, is_memfd
from transportd.control.peers import PeerPlane
from transportd.control.protocol import (
    Channel,
    ChannelInfo,
    Exchange,
    Flags,
    Heartbeat,
    Hello,
    Inspect,
    Join,
    Leave,
    PeerConnectAccept,
    PeerConnectRequest,
    PeerDisconnect,
    PeerJobLost,
    PeerMessage,
    PeerRankLeft,
    PeerRegions,
    PeerSelftest,
    PeerSelftestReport,
    RegionInfo,
    Register,
    ReplyCode,
    Selftest,
    Stats,
    Vouch,
)
from transportd.control.server import ControlServer
from transportd.daemon.config import Config
from transportd.daemon.sdnotify import Notifier
from transportd.dataplane.flagfile import FlagFile
from transportd.dataplane.worker_link import WorkerError, WorkerHandle
from transportd.errors import ErrorCode, RequestError
from transportd.ops import selftest
from transportd.ops.metrics import job_traffic

__all__ = ["Daemon", "FLAGS_REGION_ID"]

log = logging.getLogger("transportd")

FLAGS_REGION_ID = 0xFFFF_FFFF  # the id a rank's flag array carries in peer_regions
MAX_UNCLAIMED_JOBS = 1024  # announcements kept for jobs with no local rank yet
MAX_SELFTESTS = 16  # self-test jobs at once, each side (each holds ~1.2 MiB, a ring and a thread on the far side)


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


@dataclass
class LocalRank:
    """One client session that joined a job on this node."""

    client_id: bytes
    job: str
    rank: int
    world: int
    device: int
    rail: int
    pid: int = 0
    regions: dict[int, dict[int, dict[str, int]]] = field(default_factory=dict)  # id -> rail -> key
    region_kinds: dict[int, str] = field(default_factory=dict)
    flags: FlagFile | None = None
    flag_keys: dict[int, dict[str, int]] = field(default_factory=dict)  # rail -> key
    channels: dict[int, RingFile] = field(default_factory=dict)
    ibgda: dict[int, IbgdaChannel] = field(default_factory=dict)
    offers: list[int] = field(default_factory=list)  # descriptors offered to its client (taken or not)
    announced: bool = False
    next_region: int = 0


@dataclass
class RemoteRank:
    node: str
    regions: dict[tuple[int, int], RegionInfo]  # (id, rail) -> info


@dataclass
class Connection:
    """Our outgoing connection for (job, node, rail)."""

    conn_id: int
    job: str
    node: str
    rail: int
    state: str = "connecting"  # connecting | up | failed
    bound: set[int] = field(default_factory=set)  # peer ranks bound in the worker
    peer_gid: str = ""  # the remote end's device address (its rail's NIC), once connected
    error: str = ""  # why the connection failed, for the clients that need it
    responder: int = 0  # a connection to this node: the far end, in the same worker


@dataclass
class Responder:
    """Our end of a peer's connection, accepted for it: the answer to its connect request."""

    conn_id: int
    rail: int
    endpoint: dict[str, Any]


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


@dataclass
class JobState:
    world: int
    owner: str = ""  # the principal of the session that created the job on this node
    local: dict[int, LocalRank] = field(default_factory=dict)
    remote: dict[int, RemoteRank] = field(default_factory=dict)
    pushed: set[tuple[int, int, int]] = field(default_factory=set)  # (rail, peer rank, region id) in workers
    lost: set[str] = field(default_factory=set)  # nodes declared lost while the job ran (it has PEER_LOST)


#: Why a joined session ended: it said leave, its process exited, it fell silent past
#: control.client_timeout_s, or the daemon stopped.
SESSION_ENDS = ("left", "exited", "silent", "shutdown")


class Daemon:
    """The control handler, the peer-message handler and the main loop, around one config."""

    def __init__(self, config: Config, *, worker_target: Callable[..., None] | None = None) -> None:
        self.config = config
        self.node = config.node.name
        self.started = time.time()
        self.stop_event = threading.Event()
        self.failure: str | None = None  # why the daemon stopped on its own (the CLI exits non-zero)
        self._conn_ids = itertools.count(1)
        self._channel_ids = itertools.count(1)
        self.clients: dict[bytes, LocalRank | None] = {}
        self.client_pids: dict[bytes, int] = {}  # the kernel's pid of each vouched ipc client
        self.identities: dict[bytes, Identity] = {}
        self._tokens: dict[bytes, bytes] = {}  # one-time hello token -> control session
        self.side: dict[bytes, SideConnection] = {}  # control session -> its descriptor connection
        self.fdserver: FdServer | None = None
        self.sessions_ended = dict.fromkeys(SESSION_ENDS, 0)  # joined sessions ended, by why
        self.jobs: dict[str, JobState] = {}
        self.connections: dict[tuple[str, str, int], Connection] = {}
        self.accepted: dict[tuple[str, int], Responder] = {}  # (node, their conn id) -> our end of it
        self.ibgda_waiting: dict[tuple[str, int], IbgdaQueue] = {}  # (node, queue id) -> queue awaiting accept
        # peer_regions for jobs with no local rank yet: job -> rank -> (node, message)
        self.unclaimed: dict[str, dict[int, tuple[str, PeerRegions]]] = {}
        self.workers: list[WorkerHandle] = []
        self.control: ControlServer | None = None
        self.peers: PeerPlane | None = None
        self._worker_target = worker_target
        self.notifier = Notifier()
        self.ready = False
        self.snapshot: dict[str, Any] = {"node": self.node}  # the last stats(), for other threads (metrics)
        self.metrics: Any = None
        self.peer_wait_s = config.peers.ready_wait_s  # READY=1 waits this long for the static peers at most
        # transportctl selftest: near side, job -> {"node", "report", "error"}; far side, job -> (rank, echo)
        self.selftests: dict[str, dict[str, Any]] = {}
        self.selftest_far: dict[str, tuple[LocalRank, Any]] = {}

    # --- lifecycle -------------------------------------------------------------------------------------
    def start(self) -> None:
        """Start the rail workers, the control server and the peer plane (raises on any failure)."""
        from transportd.dataplane.worker import rail_main

        target = self._worker_target or rail_main
        rails = self.config.backend.rails or ()
        count = max(1, len(rails))
        try:
            for index in range(count):
                self.workers.append(WorkerHandle(index, target, {"config": self.config}))
            self.control = ControlServer.from_config(self.config, self)
            fd_path = fd_socket_for(self.config.control.socket)
            if fd_path is not None:  # same mode and group as the control socket
                self.fdserver = FdServer(fd_path, self, mode=self.config.control.mode,
                                         group=self.config.control.group,
                                         vouch_timeout_s=self.config.control.vouch_timeout_s,
                                         max_unvouched=self.config.control.max_unvouched)
            curve = CurveServerKeys.from_config(self.config.security, self.config.source)
            self.peers = PeerPlane(
                self.node, self.config.backend.kind, count, self.config.peers.listen, self.config.peers.static,
                on_message=self.on_peer_message, on_peer_down=self.on_peer_down, on_peer_up=self.on_peer_up,
                heartbeat_interval_s=self.config.peers.heartbeat_interval_s,
                heartbeat_timeout_s=self.config.peers.heartbeat_timeout_s, curve=curve)
            for worker in self.workers:
                worker.on_wait = self._while_a_worker_call_waits
            if self.config.metrics.listen:
                from transportd.ops.metrics import MetricsServer

                self.metrics = MetricsServer(self.config.metrics.listen, lambda: self.snapshot)
                log.info("metrics on http://%s/metrics", self.metrics.address)
        except BaseException:
            self.close()
            raise
        providers = sorted({str(w.info.get("verbs", "?")) for w in self.workers})
        log.info("node %s up: backend %s over %s, %d rail(s), control %s, peers %s", self.node,
                 self.config.backend.kind, "/".join(providers), count, self.control.endpoint, self.peers.endpoint)
        paths = [str(w.info.get("flag_publication", "?")) for w in self.workers]
        log.info("flag publication per rail: %s; session.flags() defaults to %s flags (flags.placement = %r)",
                 ", ".join(paths), self.flags_placement(0), self.config.flags.placement)
        fallback = [w.rail for w in self.workers if w.info.get("verbs_fallback")]
        if fallback:
            log.warning("rail(s) %s fell back to softverbs (backend.verbs = \"auto\", no RDMA device): data moves "
                        "over TCP; set backend.verbs = \"pyverbs\" on a production node",
                        ", ".join(map(str, fallback)))

    def run(self) -> None:
        """Serve until :attr:`stop_event` is set (SIGTERM/SIGINT set it when run from the CLI).

        systemd notify: STATUS= while waiting for the static peers, READY=1 once they are all up (the
        rails' devices opened in :meth:`start`) or ``peers.ready_wait_s`` passed, STATUS= whenever the
        status line changes, WATCHDOG=1 at half of WATCHDOG_USEC, STOPPING=1 when told to stop.
        """
        assert self.control and self.peers
        next_liveness = next_report = 0.0
        started = time.monotonic()
        while not self.stop_event.is_set():
            self.control.poll(1)
            if self.fdserver is not None:
                self.fdserver.poll(0)
            self.peers.poll(0)
            now = time.monotonic()
            if now >= next_liveness:
                next_liveness = now + 0.2
                self._check_workers()
                self._check_clients()
                for job_name in [j for j, (_, echo) in self.selftest_far.items() if echo.expired]:
                    log.warning("self-test %s: the near side never finished it; leaving", job_name)
                    self._end_far_selftest(job_name)
                if not self.ready:
                    if self._static_peers_up() or now - started > self.peer_wait_s:
                        self.ready = True
                        self.notifier.ready(self._status_line())
                        log.info("ready: %s", self._status_line())
                    else:
                        self.notifier.status("waiting for static peers: " + self._status_line())
                else:
                    self.notifier.status(self._status_line())
            if now >= next_report:
                next_report = now + 1.0
                self.snapshot = self.stats()
            self.notifier.tick()
        self.notifier.stopping("stopping: draining the rails")
        log.info("stopping: draining the rails")

    def _while_a_worker_call_waits(self) -> None:
        if self.peers is not None:
            self.peers.send_heartbeats()
        self.notifier.tick()

    def _static_peers_up(self) -> bool:
        assert self.peers
        up = sum(1 for p in self.peers.peers.values() if p.up)
        return up >= len(self.config.peers.static)

    def _status_line(self) -> str:
        assert self.peers
        up = sum(1 for p in self.peers.peers.values() if p.up)
        clients = sum(1 for c in self.clients.values() if c is not None)
        return f"{len(self.workers)} rail(s), {clients} client(s), peers {up} up / {len(self.peers.peers)} known"

    def install_signal_handlers(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: self.stop_event.set())

    def close(self) -> None:
        """Drain and stop the workers, then say goodbye to peers and reclaim every client.

        Draining comes first, while clients' rings and the peers' connections are still in place: every
        record committed before the stop is posted and completed (``Proxy.drain``, bounded per rail).
        """
        for job_name in list(self.selftest_far):
            self._end_far_selftest(job_name)
        for worker in self.workers:
            worker.stop()
        self.workers.clear()
        if self.peers:
            self.peers.goodbye("shutdown")
        for client_id in list(self.clients):
            self._reclaim(client_id, "shutdown")
        if self.fdserver:
            self.fdserver.close()
            self.fdserver = None
        if self.control:
            self.control.close()
            self.control = None
        if self.metrics:
            self.metrics.close()
            self.metrics = None
        if self.peers:
            self.peers.close()
            self.peers = None

    # --- control handlers ------------------------------------------------------------------------------
    def on_hello(self, client_id: bytes, req: Hello) -> dict[str, Any]:
        # the pid (and pid_ns) a client states are trusted for nothing: over ipc the kernel says who it is
        # once it presents this token on the descriptor socket; over tcp CURVE's key is the identity
        self.clients.setdefault(client_id, None)
        reply = {"node": self.node, "backend": self.config.backend.kind, "rails": len(self.workers),
                 "version": protocol.V, "keepalive_s": self.config.control.client_timeout_s / 4}
        if self.fdserver is not None:
            for token in [t for t, cid in self._tokens.items() if cid == client_id]:
                del self._tokens[token]
            token = secrets.token_bytes(protocol.TOKEN_BYTES)
            self._tokens[token] = client_id
            reply.update(token=token, fd_socket=self.fdserver.path, vouched=client_id in self.identities)
        return reply

    # --- identity (the descriptor socket) --------------------------------------------------------------
    def on_vouch(self, conn: SideConnection, req: Vouch) -> dict[str, Any]:
        """Bind a control session to the kernel's credentials of the descriptor connection presenting its
        hello token; ``control.group`` is checked here too (root and the daemon's own uid pass)."""
        client_id = self._tokens.pop(req.token, None)
        if client_id is None or client_id not in self.clients:
            raise RequestError(ReplyCode.FORBIDDEN, "unknown or used token: send hello on the control socket and "
                                                    "present the token of its reply once")
        if conn.client_id is not None or client_id in self.side:
            raise RequestError(ReplyCode.INVALID, "this connection (or that session) has vouched already")
        creds = conn.creds
        group = self.config.control.group
        if group and creds.uid not in (0, os.geteuid()):
            gid = grp.getgrnam(group).gr_gid
            if not creds.in_group(gid):
                raise RequestError(ReplyCode.FORBIDDEN, f"uid {creds.uid} is not in group {group!r} "
                                                        "(control.group), which may use this daemon")
        conn.client_id = client_id
        self.side[client_id] = conn
        self.identities[client_id] = Identity(f"uid:{creds.uid}", creds.uid, creds.gid, creds.pid)
        if creds.pid:  # 0: its process is not visible from our pid namespace; the connection still ends with it
            self.client_pids[client_id] = creds.pid
        log.info("client %s is uid %d gid %d pid %d", client_id.hex(), creds.uid, creds.gid, creds.pid)
        return {"uid": creds.uid, "gid": creds.gid, "pid": creds.pid}

    def on_side_closed(self, conn: SideConnection) -> None:
        """A descriptor connection ended: its process exited (or closed it), so its session ends too."""
        client_id = conn.client_id
        if client_id is None or self.side.get(client_id) is not conn:
            return
        del self.side[client_id]
        self._reclaim(client_id, "exited")
        self._forget_identity(client_id)

    def _forget_identity(self, client_id: bytes) -> None:
        self.identities.pop(client_id, None)
        self.client_pids.pop(client_id, None)
        for token in [t for t, cid in self._tokens.items() if cid == client_id]:
            del self._tokens[token]
        conn = self.side.pop(client_id, None)
        if conn is not None and self.fdserver is not None:
            conn.client_id = None
            self.fdserver.drop(conn)

    def _identity(self, client_id: bytes) -> Identity:
        """The session's identity, or a refusal naming what to do about it."""
        ident = self.identities.get(client_id)
        if ident is not None:
            return ident
        if self.fdserver is not None:  # ipc: the kernel must have vouched
            raise RequestError(ReplyCode.NO_IDENTITY, f"this session has not shown who it is: present the hello "
                                                      f"reply's token on {self.fdserver.path} (op 'vouch'; "
                                                      "gpuclient and transportctl do this)")
        info = self.control.clients.get(client_id) if self.control else None
        key = info.user_id if info is not None else ""
        return Identity(f"curve:{key}" if key else "anonymous")

    def _may_touch(self, ident: Identity, job: JobState) -> bool:
        return ident.superuser or job.owner == ident.principal

    def on_heartbeat(self, client_id: bytes, req: Heartbeat) -> dict[str, Any]:
        return {"seq": req.seq}

    def on_join(self, client_id: bytes, req: Join) -> dict[str, Any]:
        if self.clients.get(client_id) is not None:
            raise RequestError("already_joined", "this session already joined a job")
        ident = self._identity(client_id)
        job = self.jobs.get(req.job)
        if job is not None and not self._may_touch(ident, job):
            raise RequestError(ReplyCode.FORBIDDEN, f"job {req.job!r} on node {self.node} belongs to another user "
                                                    "(a job is its creator's on each node): pick another job name")
        if job is None:
            job = self.jobs[req.job] = JobState(world=req.world, owner=ident.principal)
            for node, msg in self.unclaimed.pop(req.job, {}).values():
                if node in (self.peers.peers if self.peers else {}):
                    job.remote[msg.rank] = RemoteRank(node, {(r.id, r.rail): r for r in msg.regions})
        if job.world != req.world:
            raise RequestError("bad_world", f"job {req.job!r} has world {job.world}, not {req.world}")
        if req.rank in job.local or req.rank in job.remote:
            raise RequestError("rank_taken", f"rank {req.rank} of job {req.job!r} is already joined")
        if req.rail >= len(self.workers):
            raise RequestError(ReplyCode.INVALID, f"rail {req.rail}: this node has {len(self.workers)} rail(s)")
        rail = req.rail if req.rail >= 0 else self._rail_for_device(req.device)
        rank = LocalRank(client_id, req.job, req.rank, req.world, req.device, rail,
                         pid=self.client_pids.get(client_id, 0))
        job.local[req.rank] = rank
        self.clients[client_id] = rank
        log.info("job %s rank %d joined (device %d, rail %d)", req.job, req.rank, req.device, rail)
        return {"node": self.node, "rail": rail, "flags_placement": self.flags_placement(req.device)}

    def flags_placement(self, device: int) -> str:
        """Where ``session.flags()`` puts flags when the client does not say: ``flags.placement``, except
        host for a client without a GPU, or where a rail could reach GPU flag words only through the
        daemon's CUDA context (its ``flag_publication`` is ``host-mapped``)."""
        if self.config.flags.placement == "host" or device < 0:
            return "host"
        if any(w.info.get("flag_publication") == "host-mapped" for w in self.workers):
            return "host"
        return "device"

    def _rail_for_device(self, device: int) -> int:
        for index, rail in enumerate(self.config.backend.rails or ()):
            if rail.gpu == device and device >= 0:
                return index
        return max(device, 0) % len(self.workers)

    def _joined(self, client_id: bytes) -> LocalRank:
        rank = self.clients.get(client_id)
        if rank is None:
            raise RequestError("not_joined", "join a job first")
        return rank

    def on_register(self, client_id: bytes, req: Register) -> dict[str, Any]:
        rank = self._joined(client_id)
        fd = -1
        if req.kind in ("host", "dmabuf"):
            # by descriptor only: the fd this session passed on its descriptor socket (never a path)
            conn = self.side.get(client_id)
            if conn is None:
                raise RequestError(ReplyCode.UNSUPPORTED, f"{req.kind} memory travels as a descriptor on the "
                                                          "local descriptor socket: register it over ipc")
            fd = conn.take(int(req.handle))  # type: ignore[arg-type]
        try:
            if req.kind == "host":
                _check_host_fd(fd, req.offset, req.size)
                op, memory = "map_region", {"fds": (fd,)}
            elif req.kind == "cuda_ipc":  # opened by the rail workers in a context on the client's device
                op, memory = "map_gpu_region", {"handle": req.handle, "device": max(rank.device, 0)}
            else:
                # a dma-buf fd arrives the same way; a real-NIC rail would register it with DmaBufMR
                raise RequestError("unsupported", f"{req.kind} memory needs a real-NIC backend (not available yet)")
            if rank.next_region > 0xFFFF:
                raise RequestError("too_many_regions", "a rank may register at most 65536 regions")
            region_id = rank.next_region
            keys = {}
            for worker in self.workers:
                try:
                    keys[worker.rail] = worker.call(
                        op, key=f"{rank.job}/{rank.rank}/{region_id}", offset=req.offset, size=req.size,
                        remote_write="write" in req.access, remote_atomic="atomic" in req.access,
                        remote_read="read" in req.access, **memory)
                except WorkerError as exc:
                    for rail in keys:
                        self.workers[rail].call("unmap_region", key=f"{rank.job}/{rank.rank}/{region_id}")
                    raise RequestError("register_failed", str(exc)) from None
        finally:
            if fd >= 0:
                os.close(fd)  # every worker holds its own mapping; the daemon keeps nothing of it
        rank.next_region += 1
        rank.regions[region_id] = keys
        rank.region_kinds[region_id] = f"{req.kind}:{req.offset}"
        for worker in self.workers:
            worker.call("set_source_region", job=rank.job, rank=rank.rank, region=region_id,
                        key=f"{rank.job}/{rank.rank}/{region_id}")
        return {"region": region_id}

    def _side_for(self, client_id: bytes, what: str) -> SideConnection:
        """The session's descriptor connection: what the daemon makes for a client travels only by descriptor."""
        conn = self.side.get(client_id)
        if conn is None:
            raise RequestError(ReplyCode.UNSUPPORTED, f"{what} is an anonymous memfd handed over by descriptor on "
                                                      "the local ipc descriptor socket: open it over ipc (none "
                                                      "can travel over tcp)")
        return conn

    def _offer(self, rank: LocalRank, conn: SideConnection, fd: int, kind: str) -> int:
        """Offer ``fd`` (owned by the offer from now on) to the rank's client; withdrawn when the rank ends."""
        fd_id = conn.offer(fd, kind)
        rank.offers.append(fd_id)
        return fd_id

    def on_flags(self, client_id: bytes, req: Flags) -> dict[str, Any]:
        rank = self._joined(client_id)
        if rank.flags is not None:
            raise RequestError("flags_exist", "this rank already has its flag array")
        if req.where == "device" and not req.handle:
            raise RequestError("unsupported", "device flags are allocated by the GPU client and sent by CUDA IPC "
                                              "handle (gpuclient: session.flags(count, where='device'))")
        conn = self._side_for(client_id, "a flag array (its status word, and the words of host flags)")
        # + the status word; a memfd: no other process can open it by name, nothing outlives a killed daemon
        flags, fd = FlagFile.create_memfd(req.count, name=_memfd_name("flags", rank.job, rank.rank))
        try:
            for worker in self.workers:
                if req.where == "device":
                    # the flag file rides along: the host shadow of the counters the workers publish
                    rank.flag_keys[worker.rail] = worker.call(
                        "map_gpu_flags", job=rank.job, rank=rank.rank, handle=req.handle, offset=req.offset,
                        count=req.count, device=max(rank.device, 0), fds=(fd,))
                else:
                    rank.flag_keys[worker.rail] = worker.call(
                        "map_flags", job=rank.job, rank=rank.rank, count=req.count, fds=(fd,))
            fd_id = self._offer(rank, conn, fd, "flags")  # the offer owns fd now (closed if it is refused)
            fd = -1
        except (WorkerError, RequestError) as exc:
            if fd >= 0:
                os.close(fd)
            for rail in rank.flag_keys:
                _quietly(self.workers[rail].call, "unmap_flags", job=rank.job, rank=rank.rank)
            rank.flag_keys.clear()
            flags.close()
            if isinstance(exc, RequestError):
                raise
            raise RequestError("flags_failed", str(exc)) from None
        rank.flags = flags
        return {"fd": fd_id, "count": req.count}

    def on_exchange(self, client_id: bytes, req: Exchange) -> dict[str, Any]:
        rank = self._joined(client_id)
        if rank.flags is None:
            raise RequestError("no_flags", "allocate flags (op 'flags') before exchange")
        if not rank.announced:
            rank.announced = True
            assert self.peers
            self.peers.broadcast(self._regions_message(rank))
        job = self.jobs[rank.job]
        self._refresh_job(rank.job)
        for conn in self.connections.values():
            if conn.job == rank.job and conn.rail == rank.rail and conn.state == "failed" and conn.error:
                raise RequestError("unreachable", conn.error)
        return {"complete": self._job_wired(rank), "known": len(job.local) + len(job.remote)}

    def _regions_message(self, rank: LocalRank) -> PeerRegions:
        infos = []
        for region_id, per_rail in rank.regions.items():
            for rail, key in per_rail.items():
                infos.append(RegionInfo(id=region_id, addr=key["addr"], length=key["length"], rkey=key["rkey"],
                                        rail=rail))
        for rail, key in rank.flag_keys.items():
            infos.append(RegionInfo(id=FLAGS_REGION_ID, addr=key["addr"], length=key["length"], rkey=key["rkey"],
                                    rail=rail))
        return PeerRegions(job=rank.job, rank=rank.rank, regions=tuple(infos))

    def _rank_reachable(self, me: LocalRank, peer_rank: int) -> bool:
        if peer_rank == me.rank:
            return True  # commands to oneself are not routed through a connection
        job = self.jobs[me.job]
        node = self.node if peer_rank in job.local else job.remote[peer_rank].node
        conn = self.connections.get((me.job, node, me.rail))
        return conn is not None and conn.state == "up" and peer_rank in conn.bound

    def on_channel(self, client_id: bytes, req: Channel) -> dict[str, Any]:
        rank = self._joined(client_id)
        conn = self._side_for(client_id, "a channel's memory (a ring, or IBGDA queues)")
        if req.kind == "ibgda":
            return self._open_ibgda_channel(rank, req.capacity)
        capacity = req.capacity or self.config.proxy.ring_capacity
        channel_id = next(self._channel_ids)
        # a memfd: the client and the rail worker get it by descriptor; no path another process could open
        ring, fd = RingFile.create_memfd(capacity, name=_memfd_name("ring", rank.job, rank.rank, channel_id))
        try:
            self.workers[rank.rail].call("add_channel", channel=channel_id, job=rank.job, rank=rank.rank,
                                         world=rank.world, fds=(fd,))
        except WorkerError as exc:
            os.close(fd)
            ring.close()
            raise RequestError("channel_failed", str(exc)) from None
        try:
            fd_id = self._offer(rank, conn, fd, "ring")
        except RequestError:
            _quietly(self.workers[rank.rail].call, "remove_channel", channel=channel_id)
            ring.close()
            raise
        rank.channels[channel_id] = ring
        return {"channel": channel_id, "fd": fd_id, "capacity": capacity, "rail": rank.rail}

    # --- IBGDA channels ---------------------------------------------------------------------------------
    def _open_ibgda_channel(self, rank: LocalRank, wqe_cnt: int) -> dict[str, Any]:
        """One queue pair per peer rank in the rank's rail worker, each connected (through the peer plane)
        to a responder QP on the peer's node and rail. The reply comes before the far ends accept: the
        client asks ``channel_info`` until ``ready``."""
        if self.config.backend.kind != "ib":
            raise RequestError("unsupported", f"IBGDA channels need backend.kind = 'ib' (a ConnectX), not "
                                              f"{self.config.backend.kind!r}")
        job = self.jobs[rank.job]
        if not self._job_wired(rank):
            raise RequestError("not_ready", "exchange until every rank of the job is known and reachable before "
                                            "opening an IBGDA channel")
        chan = IbgdaChannel(next(self._channel_ids))
        rank.ibgda[chan.channel_id] = chan
        worker = self.workers[rank.rail]
        try:
            for peer in range(job.world):
                if peer == rank.rank:
                    continue
                queue_id = next(self._conn_ids)
                # empty: the worker sizes it for the queue it builds there, then seals its size
                fd = unsealed_memfd(_memfd_name("ibgda", rank.job, rank.rank, chan.channel_id, peer))
                try:
                    info = worker.call("create_ibgda_queue", queue=queue_id, job=rank.job, wqe_cnt=wqe_cnt,
                                       fds=(fd,))
                except BaseException:
                    os.close(fd)
                    raise
                node = self.node if peer in job.local else job.remote[peer].node
                queue = chan.queues[peer] = IbgdaQueue(queue_id, peer, node, fd, info)
                if node == self.node:  # the responder lives in the same worker
                    queue.responder = next(self._conn_ids)
                    far = worker.call("create_endpoint", conn=queue.responder, job=rank.job, responder=True)
                    worker.call("connect", conn=queue.responder, remote=info["endpoint"])
                    worker.call("connect_ibgda_queue", queue=queue_id, remote=far["endpoint"])
                    queue.state = "up"
                else:
                    assert self.peers
                    self.ibgda_waiting[(node, queue_id)] = queue
                    self.peers.send(node, PeerConnectRequest(job=rank.job, rail=rank.rail, conn=queue_id,
                                                             endpoint=info["endpoint"]))
        except WorkerError as exc:
            self._close_ibgda_channel(rank, chan)
            rank.ibgda.pop(chan.channel_id, None)
            raise RequestError("channel_failed", str(exc)) from None
        return {"channel": chan.channel_id, "kind": "ibgda", "rail": rank.rail,
                "ready": all(q.state == "up" for q in chan.queues.values())}

    def _job_wired(self, rank: LocalRank) -> bool:
        job = self.jobs[rank.job]
        known = len(job.local) + len(job.remote)
        return known == job.world and all(self._rank_reachable(rank, r) for r in range(job.world))

    def on_channel_info(self, client_id: bytes, req: ChannelInfo) -> dict[str, Any]:
        """``ready`` false while a queue awaits its far end; then everything a ``tpd::IbgdaChannel`` needs."""
        rank = self._joined(client_id)
        chan = rank.ibgda.get(req.channel)
        if chan is None:
            raise RequestError("unknown_channel", f"this session has no IBGDA channel {req.channel}")
        failed = [q for q in chan.queues.values() if q.state == "failed"]
        if failed:
            raise RequestError("unreachable", f"the queue pair to rank {failed[0].peer} on {failed[0].node} failed")
        if any(q.state != "up" for q in chan.queues.values()):
            return {"channel": chan.channel_id, "ready": False}
        job, rail = self.jobs[rank.job], rank.rail
        # region tables indexed by region id; an id without a key on this rail is all zeros (refused)
        local = [_triple(rank.regions.get(i, {}).get(rail), "lkey") for i in range(rank.next_region)]
        remote_regions, remote_flags = [], []
        for peer in chan.queues:
            regions, flags = self._peer_keys(job, peer, rail)
            count = max(regions, default=-1) + 1
            remote_regions.append([peer, [_triple(regions.get(i), "rkey") for i in range(count)]])
            if flags is not None:
                remote_flags.append([peer, _triple(flags, "rkey")])
        conn = self._side_for(client_id, "an IBGDA queue's memory")
        for q in chan.queues.values():
            if q.offer not in conn.offered:  # first asked, or taken since: offer it (again)
                q.offer = self._offer(rank, conn, os.dup(q.fd), "ibgda")
        queues = [{"peer": q.peer, "fd": q.offer, **{k: q.info[k] for k in ("qpn", "wqe_cnt", "ncqes", "scratch",
                                                                             "scratch_lkey")}}
                  for q in chan.queues.values()]
        return {"channel": chan.channel_id, "ready": True, "kind": "ibgda", "rail": rail,
                "signal_mode": self.config.signal.mode, "queues": queues, "local_regions": local,
                "remote_regions": remote_regions, "remote_flags": remote_flags}

    def _close_ibgda_channel(self, rank: LocalRank, chan: IbgdaChannel) -> None:
        worker = self.workers[rank.rail] if rank.rail < len(self.workers) else None
        for queue in chan.queues.values():
            self.ibgda_waiting.pop((queue.node, queue.queue_id), None)
            if worker is not None:
                _quietly(worker.call, "close_ibgda_queue", queue=queue.queue_id)
                if queue.responder:
                    _quietly(worker.call, "close_connection", conn=queue.responder)
            if queue.node != self.node and self.peers is not None:  # the far end closes its responder
                self.peers.send(queue.node, PeerDisconnect(job=rank.job, rail=rank.rail, conn=queue.queue_id))
            os.close(queue.fd)

    def on_stats(self, client_id: bytes, req: Stats) -> dict[str, Any]:
        stats = self.stats()
        ident = self._identity(client_id)
        if not ident.superuser:  # node-wide counters for everyone; a job's details for its owner
            stats["jobs"] = {name: info for name, info in stats["jobs"].items()
                             if name in self.jobs and self._may_touch(ident, self.jobs[name])}
        return stats

    def on_inspect(self, client_id: bytes, req: Inspect) -> dict[str, Any]:
        ident = self._identity(client_id)
        job = self.jobs.get(req.job)
        if job is not None and not self._may_touch(ident, job):
            raise RequestError(ReplyCode.FORBIDDEN, f"job {req.job!r} on node {self.node} belongs to another user")
        rank = job.local.get(req.rank) if job else None
        if rank is None:
            raise RequestError("not_found", f"rank {req.rank} of job {req.job!r} is not joined on node {self.node}")
        if rank.flags is None:
            raise RequestError("not_found", f"rank {req.rank} of job {req.job!r} has no flags yet")
        return {"job": req.job, "rank": req.rank, "values": [int(v) for v in rank.flags.values],
                "status": rank.flags.status}

    # --- transportctl selftest --------------------------------------------------------------------------
    def on_selftest(self, client_id: bytes, req: Selftest) -> dict[str, Any]:
        """The near side of a self-test (``transportd.ops.selftest``): list the links, start the far side of a
        job on a peer, ask it to finish, report what it saw."""
        self._identity(client_id)  # a vouched session: a self-test takes memory on the peer
        assert self.peers
        if req.action == "links":
            links = [{"node": node, "up": p.up, "rails": p.rails, "backend": p.backend,
                      "why": "" if p.up else "peer is down (stopped, said goodbye, or stopped answering heartbeats)"}
                     for node, p in sorted(self.peers.peers.items())]
            links += [{"node": address, "up": False, "rails": 0, "backend": "",
                       "why": "no hello from this static peer: not running, unreachable, or its CURVE handshake "
                              "failed (a key missing from, or wrong in, security.curve_authorized_keys_dir)"}
                      for address in self.peers.unreached()]
            return {"node": self.node, "rails": len(self.workers), "backend": self.config.backend.kind,
                    "signal_mode": self.config.signal.mode, "decoupled": self.config.signal.decoupled,
                    "links": links}
        if req.action == "start":
            peer = self.peers.peers.get(req.node)
            if peer is None or not peer.up:
                raise RequestError("unreachable", f"peer {req.node} is not up")
            if req.rail >= min(len(self.workers), peer.rails or len(self.workers)):
                raise RequestError(ReplyCode.INVALID, f"rail {req.rail}: this node has {len(self.workers)} and "
                                                      f"{req.node} has {peer.rails}")
            if req.job in self.selftests or req.job in self.jobs:
                raise RequestError(ReplyCode.INVALID, f"job {req.job!r} exists")
            if len(self.selftests) >= MAX_SELFTESTS:
                raise RequestError("busy", f"{MAX_SELFTESTS} self-tests are running on node {self.node}")
            self.selftests[req.job] = {"node": req.node, "report": None, "error": ""}
            self.peers.send(req.node, PeerSelftest(action="start", job=req.job, rail=req.rail, seed=req.seed))
            return {}
        test = self.selftests.get(req.job)
        if test is None:
            raise RequestError("not_found", f"no self-test {req.job!r} on node {self.node}")
        if req.action == "finish":
            if not self.peers.send(test["node"], PeerSelftest(action="finish", job=req.job)) and not test["error"]:
                test["error"] = f"peer {test['node']} is not reachable"
            return {}
        if test["report"] is not None or test["error"]:
            del self.selftests[req.job]  # delivered: nothing of it stays behind
        return {"report": test["report"], "error": test["error"]}

    def _on_peer_selftest(self, node: str, msg: PeerSelftest) -> None:
        """The far side: join rank 1 of the self-test job with memory, flags and a ring of our own, and
        echo (``transportd.ops.selftest.EchoResponder``); on ``finish``, report and leave."""
        assert self.peers
        if msg.action == "finish":
            found = self.selftest_far.get(msg.job)
            if found is not None and found[1].requester == node:
                report = self._end_far_selftest(msg.job)
                self.peers.send(node, PeerSelftestReport(job=msg.job, report=report))
            return
        try:
            self._start_far_selftest(node, msg)
        except (WorkerError, RequestError, OSError) as exc:
            log.warning("self-test %s from %s: %s", msg.job, node, exc)
            self.peers.send(node, PeerSelftestReport(job=msg.job, report={}, error=str(exc)[:1000]))

    def _start_far_selftest(self, node: str, msg: PeerSelftest) -> None:
        if msg.job in self.jobs or msg.job in self.selftest_far:
            raise RequestError(ReplyCode.INVALID, f"job {msg.job!r} exists on node {self.node}")
        if len(self.selftest_far) >= MAX_SELFTESTS:
            raise RequestError("busy", f"{MAX_SELFTESTS} self-tests are running on node {self.node}")
        if msg.rail >= len(self.workers):
            raise RequestError(ReplyCode.INVALID, f"rail {msg.rail}: node {self.node} has {len(self.workers)}")
        rank = LocalRank(b"selftest:" + msg.job.encode(), msg.job, 1, 2, -1, msg.rail)
        job = self.jobs[msg.job] = JobState(world=2, owner=f"selftest:{node}")
        job.local[1] = rank
        try:
            # the region is a memfd of the daemon's own, mapped here for the echo and in every worker
            fd = sealed_memfd(_memfd_name("selftest", rank.job), selftest.REGION_BYTES)
            try:
                memory = np.frombuffer(map_fd(fd).mm, dtype=np.uint8)
                key = f"{rank.job}/{rank.rank}/0"
                rank.regions[0] = {}
                for worker in self.workers:
                    rank.regions[0][worker.rail] = worker.call(
                        "map_region", key=key, offset=0, size=selftest.REGION_BYTES, remote_write=True,
                        remote_atomic=False, remote_read=True, fds=(fd,))
                    worker.call("set_source_region", job=rank.job, rank=rank.rank, region=0, key=key)
            finally:
                os.close(fd)
            rank.next_region = 1
            rank.region_kinds[0] = "selftest"
            flags, fd = FlagFile.create_memfd(selftest.SLOTS, name=_memfd_name("flags", rank.job, rank.rank))
            rank.flags = flags
            try:
                for worker in self.workers:
                    rank.flag_keys[worker.rail] = worker.call("map_flags", job=rank.job, rank=rank.rank,
                                                              count=selftest.SLOTS, fds=(fd,))
            finally:
                os.close(fd)  # the workers and our own mapping hold it
            channel_id = next(self._channel_ids)
            ring, fd = RingFile.create_memfd(256, name=_memfd_name("ring", rank.job, rank.rank, channel_id))
            rank.channels[channel_id] = ring
            try:
                self.workers[rank.rail].call("add_channel", channel=channel_id, job=rank.job, rank=rank.rank,
                                             world=rank.world, fds=(fd,))
            finally:
                os.close(fd)
        except BaseException:
            self._release_rank(rank)
            raise
        echo = selftest.EchoResponder(msg.job, node, msg.seed, memory, rank.flags, ring)
        self.selftest_far[msg.job] = (rank, echo)
        rank.announced = True
        assert self.peers
        self.peers.send(node, self._regions_message(rank))
        self._refresh_job(msg.job)
        log.info("self-test %s for %s: rank 1 joined on rail %d", msg.job, node, msg.rail)

    def _end_far_selftest(self, job_name: str) -> dict[str, Any]:
        rank, echo = self.selftest_far.pop(job_name)
        report = echo.stop()  # before the ring and flags go away under it
        self._release_rank(rank)
        return report

    def on_leave(self, client_id: bytes, req: Leave) -> dict[str, Any]:
        self._reclaim(client_id, "left")
        return {}

    def on_client_gone(self, client_id: bytes) -> None:
        self._reclaim(client_id, "silent")
        self._forget_identity(client_id)

    # --- reclaiming -------------------------------------------------------------------------------------
    def _check_workers(self) -> None:
        """A rail worker that died (a crash in the provider, the OOM killer) took its QPs and its rings'
        proxy with it: nothing on that rail would ever complete. Stop, so every client and peer hears it
        now, and exit non-zero so the service manager starts a whole daemon again."""
        for worker in self.workers:
            if not worker.process.is_alive() and self.failure is None:
                self.failure = f"rail {worker.rail} worker died (exit code {worker.process.exitcode})"
                log.error("%s: stopping the daemon", self.failure)
                self.stop_event.set()

    def _check_clients(self) -> None:
        """Reclaim sessions whose process has exited or whose keepalives stopped (a killed client never says
        leave). A client watched by pid is kept while its process exists, even stopped in a debugger.
        Silence counts only with no request queued: a daemon that was busy has not heard its clients."""
        for client_id, pid in list(self.client_pids.items()):
            if not _process_alive(pid):
                log.info("client pid %d exited: reclaiming its session", pid)
                self._reclaim(client_id, "exited")
                self._forget_identity(client_id)
        assert self.control
        if not self.control.has_input():
            self.control.expire(self.config.control.client_timeout_s, keep=self.client_pids.keys())

    def _reclaim(self, client_id: bytes, why: str) -> None:
        """End ``client_id``'s session (``why``: one of SESSION_ENDS) and free everything it held."""
        rank = self.clients.pop(client_id, None)
        if why == "shutdown":
            self._forget_identity(client_id)
        if rank is None:
            return
        self.sessions_ended[why] += 1
        self._release_rank(rank)

    def _release_rank(self, rank: LocalRank) -> None:
        """Free everything ``rank`` held (rings, IBGDA queues, regions, flags, offers) and forget it."""
        client_id = rank.client_id
        worker = self.workers[rank.rail] if rank.rail < len(self.workers) else None
        for channel_id, ring in rank.channels.items():
            if worker:
                _quietly(worker.call, "remove_channel", channel=channel_id)
            # a producer still waiting on the ring (quiet) stops at once, as one waiting on its flags does
            ring.report_error(int(ErrorCode.CLIENT_GONE), ring.consumer_pos)
            ring.close()
        for chan in rank.ibgda.values():
            self._close_ibgda_channel(rank, chan)
        for w in self.workers:
            _quietly(w.call, "forget_rank", job=rank.job, rank=rank.rank)
            for region_id in rank.regions:
                _quietly(w.call, "unmap_region", key=f"{rank.job}/{rank.rank}/{region_id}")
        if rank.flags is not None:
            # a client still waiting on its flags (the daemon stopping, its session expired) stops waiting
            rank.flags.set_status(int(ErrorCode.CLIENT_GONE))
            rank.flags.close()
        conn = self.side.get(client_id)
        for fd_id in rank.offers if conn is not None else ():
            conn.withdraw(fd_id)  # offers not taken yet: what they gave is gone
        if rank.announced and self.peers is not None:
            self.peers.broadcast(PeerRankLeft(job=rank.job, rank=rank.rank))
        job = self.jobs.get(rank.job)
        if job is not None:
            job.local.pop(rank.rank, None)
            if job.local:  # the job goes on here: the other local ranks stop sending to this one
                self._forget_rank(rank.job, job, rank.rank)
            else:
                self._drop_job(rank.job)
        log.info("job %s rank %d reclaimed", rank.job, rank.rank)

    def _drop_job(self, job_name: str) -> None:
        """The job's last local rank left: close its connections, and have their far ends closed too."""
        for key in [k for k in self.connections if k[0] == job_name]:
            conn = self.connections.pop(key)
            if conn.rail < len(self.workers):
                for conn_id in (conn.conn_id, conn.responder):
                    if conn_id:
                        _quietly(self.workers[conn.rail].call, "close_connection", conn=conn_id)
            if conn.node != self.node and self.peers is not None:
                # the peer's responder serves only this connection; the peer's own connections to our
                # ranks stay (its ranks may still be running, and a rank of ours may rejoin)
                self.peers.send(conn.node, PeerDisconnect(job=job_name, rail=conn.rail, conn=conn.conn_id))
        job = self.jobs.pop(job_name, None)
        # the peers' ranks may still be running: keep what they announced, for a rank of ours that rejoins
        # (a peer_rank_left, or the node going down, removes it)
        live = {node for node, peer in (self.peers.peers.items() if self.peers else ()) if peer.up}
        kept = {r: (info.node, PeerRegions(job=job_name, rank=r, regions=tuple(info.regions.values())))
                for r, info in (job.remote.items() if job else ()) if info.node in live}
        if kept and (job_name in self.unclaimed or len(self.unclaimed) < MAX_UNCLAIMED_JOBS):
            self.unclaimed.setdefault(job_name, {}).update(kept)

    def _forget_rank(self, job_name: str, job: JobState, rank: int, *, in_workers: bool = True) -> None:
        """Rank ``rank`` is gone from ``job`` (or re-announced): nothing of it counts as pushed or bound any
        more, and (``in_workers``) the workers refuse records for it with BAD_PEER until it is set again."""
        job.pushed = {p for p in job.pushed if p[1] != rank}
        for conn in self.connections.values():
            if conn.job == job_name:
                conn.bound.discard(rank)
        if in_workers:
            for worker in self.workers:
                _quietly(worker.call, "forget_peer", job=job_name, peer=rank)

    # --- peers ---------------------------------------------------------------------------------------------
    def on_peer_up(self, node: str) -> None:
        # a node that (re)appears learns every announced rank of ours, and which of its jobs we gave up on:
        # a node that froze past our heartbeat timeout may never have noticed (it heard us all along)
        assert self.peers
        for job_name, job in self.jobs.items():
            for rank in job.local.values():
                if rank.announced:
                    self.peers.send(node, self._regions_message(rank))
            if node in job.lost:
                self.peers.send(node, PeerJobLost(job=job_name))

    def on_peer_down(self, node: str) -> None:
        """Fail every connection to ``node``: clients waiting on it see PEER_LOST, not a hang."""
        for ranks in self.unclaimed.values():
            for rank in [r for r, (n, _) in ranks.items() if n == node]:
                del ranks[rank]
        for key in [k for k in self.ibgda_waiting if k[0] == node]:
            self.ibgda_waiting.pop(key).state = "failed"
        for key in [k for k in self.accepted if k[0] == node]:
            # responders for the node's connections: its daemon's next life asks for new ones (and may reuse
            # the connection ids), so none of these may be handed out again
            self._close_responder(self.accepted.pop(key))
        self._fail_connections(node)
        for job_name, job in self.jobs.items():
            if any(r.node == node for r in job.remote.values()):
                self._lose_node(job_name, job, node)
        for test in self.selftests.values():
            if test["node"] == node and test["report"] is None and not test["error"]:
                test["error"] = f"peer {node} went down"
        for job_name in [j for j, (_, echo) in self.selftest_far.items() if echo.requester == node]:
            self._end_far_selftest(job_name)

    def _fail_connections(self, node: str, job_name: str | None = None) -> None:
        """Our connections to ``node`` (of ``job_name`` only, if given) fail: their records get PEER_LOST."""
        for conn in self.connections.values():
            if conn.node == node and conn.state != "failed" and job_name in (None, conn.job):
                conn.state = "failed"
                _quietly(self.workers[conn.rail].call, "fail_connection", conn=conn.conn_id,
                         code=int(ErrorCode.PEER_LOST))

    def _lose_node(self, job_name: str, job: JobState, node: str) -> None:
        """``job`` cannot go on without ``node``: its local ranks' sessions say PEER_LOST."""
        job.lost.add(node)
        for rank in job.local.values():
            if rank.flags is not None:
                rank.flags.set_status(int(ErrorCode.PEER_LOST))
        log.warning("job %s lost node %s", job_name, node)

    def _on_job_lost(self, node: str, msg: PeerJobLost) -> None:
        job = self.jobs.get(msg.job)
        if job is not None and node not in job.lost:
            self._fail_connections(node, msg.job)
            self._lose_node(msg.job, job, node)

    def on_peer_message(self, node: str, msg: PeerMessage) -> None:
        try:
            if isinstance(msg, PeerRegions):
                self._on_peer_regions(node, msg)
            elif isinstance(msg, PeerConnectRequest):
                self._on_connect_request(node, msg)
            elif isinstance(msg, PeerConnectAccept):
                self._on_connect_accept(node, msg)
            elif isinstance(msg, PeerDisconnect):
                self._on_disconnect(node, msg)
            elif isinstance(msg, PeerRankLeft):
                self._on_rank_left(node, msg)
            elif isinstance(msg, PeerJobLost):
                self._on_job_lost(node, msg)
            elif isinstance(msg, PeerSelftest):
                self._on_peer_selftest(node, msg)
            elif isinstance(msg, PeerSelftestReport):
                test = self.selftests.get(msg.job)
                if test is not None and test["node"] == node:
                    test["report"], test["error"] = (None, msg.error) if msg.error else (dict(msg.report), "")
        except (WorkerError, RequestError) as exc:
            log.warning("peer %s: %s failed: %s", node, msg.op, exc)

    def _on_peer_regions(self, node: str, msg: PeerRegions) -> None:
        job = self.jobs.get(msg.job)
        if job is None:
            # no local rank of this job yet: keep the announcement for when one joins (bounded, so a peer
            # cannot grow it without limit)
            if msg.job in self.unclaimed or len(self.unclaimed) < MAX_UNCLAIMED_JOBS:
                self.unclaimed.setdefault(msg.job, {})[msg.rank] = (node, msg)
            return
        if msg.rank in job.local:
            log.warning("peer %s claims rank %d of job %s, which is local here: ignored", node, msg.rank, msg.job)
            return
        job.remote[msg.rank] = RemoteRank(node, {(r.id, r.rail): r for r in msg.regions})
        self._forget_rank(msg.job, job, msg.rank, in_workers=False)  # re-pushed in full just below
        self._refresh_job(msg.job)

    def _on_rank_left(self, node: str, msg: PeerRankLeft) -> None:
        unclaimed = self.unclaimed.get(msg.job, {})
        if unclaimed.get(msg.rank, (None,))[0] == node:
            del unclaimed[msg.rank]
            if not unclaimed:
                del self.unclaimed[msg.job]
        job = self.jobs.get(msg.job)
        remote = job.remote.get(msg.rank) if job is not None else None
        if job is not None and remote is not None and remote.node == node:
            del job.remote[msg.rank]
            self._forget_rank(msg.job, job, msg.rank)
            log.info("job %s: rank %d on node %s left", msg.job, msg.rank, node)

    def _refresh_job(self, job_name: str) -> None:
        """Open missing connections and push missing tables to the workers (idempotent)."""
        job = self.jobs[job_name]
        rails = {rank.rail for rank in job.local.values()}
        nodes = {r.node for r in job.remote.values()}
        if len(job.local) > 1:
            nodes.add(self.node)
        for node in nodes:
            for rail in rails:
                if (job_name, node, rail) not in self.connections:
                    self._open_connection(job_name, node, rail)
        for conn in self.connections.values():
            if conn.job != job_name or conn.state != "up":
                continue
            peer_ranks = ([r for r in job.local] if conn.node == self.node
                          else [r for r, info in job.remote.items() if info.node == conn.node])
            for peer_rank in peer_ranks:
                self._push_peer_tables(job_name, job, conn, peer_rank)
        far = self.selftest_far.get(job_name)
        if far is not None and not far[1].wired.is_set() and self._job_wired(far[0]):
            far[1].wired.set()  # its echoes may go now

    def _peer_keys(self, job: JobState, peer_rank: int, rail: int) -> tuple[dict[int, dict[str, int]],
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

    def _push_peer_tables(self, job_name: str, job: JobState, conn: Connection, peer_rank: int) -> None:
        worker = self.workers[conn.rail]
        regions, flags = self._peer_keys(job, peer_rank, conn.rail)
        if flags is None:
            return
        for region_id, key in regions.items():
            if (conn.rail, peer_rank, region_id) not in job.pushed:
                worker.call("set_remote_region", job=job_name, peer=peer_rank, region=region_id, addr=key["addr"],
                            length=key["length"], rkey=key["rkey"])
                job.pushed.add((conn.rail, peer_rank, region_id))
        if peer_rank not in conn.bound:
            worker.call("set_remote_flags", job=job_name, peer=peer_rank, addr=flags["addr"],
                        count=flags["length"] // 8, rkey=flags["rkey"])
            worker.call("bind_peer", job=job_name, peer=peer_rank, conn=conn.conn_id)
            conn.bound.add(peer_rank)

    def _open_connection(self, job_name: str, node: str, rail: int) -> None:
        conn = Connection(next(self._conn_ids), job_name, node, rail)
        self.connections[(job_name, node, rail)] = conn
        peer = self.peers.peers.get(node) if self.peers and node != self.node else None
        if peer is not None and peer.rails and rail >= peer.rails:
            # rail-peer routing pairs rail i with rail i: a node without that rail cannot be reached from it
            conn.state = "failed"
            conn.error = (f"node {node} has {peer.rails} rail(s), so rail {rail} of node {self.node} has no "
                          f"peer there: give every node of the job the same rails")
            log.warning("job %s: %s", job_name, conn.error)
            return
        worker = self.workers[rail]
        endpoint = worker.call("create_endpoint", conn=conn.conn_id, job=job_name)["endpoint"]
        if node == self.node:
            # a connection to ourselves: the responder end lives in the same worker
            peer_id = conn.responder = next(self._conn_ids)
            remote = worker.call("create_endpoint", conn=peer_id, job=job_name, responder=True)["endpoint"]
            worker.call("connect", conn=peer_id, remote=endpoint)
            worker.call("connect", conn=conn.conn_id, remote=remote)
            conn.state, conn.peer_gid = "up", str(remote.get("gid", ""))
            return
        assert self.peers
        self.peers.send(node, PeerConnectRequest(job=job_name, rail=rail, conn=conn.conn_id, endpoint=endpoint))

    def _on_connect_request(self, node: str, msg: PeerConnectRequest) -> None:
        assert self.peers
        if msg.rail >= len(self.workers):
            log.warning("peer %s asks for rail %d; this node has %d", node, msg.rail, len(self.workers))
            return
        key = (node, msg.conn)
        worker = self.workers[msg.rail]
        responder = self.accepted.get(key)
        if responder is None:  # a repeated request (the accept was lost) gets the same answer
            local_id = next(self._conn_ids)
            endpoint = worker.call("create_endpoint", conn=local_id, job=msg.job, responder=True)["endpoint"]
            worker.call("connect", conn=local_id, remote=dict(msg.endpoint))
            responder = self.accepted[key] = Responder(local_id, msg.rail, endpoint)
        self.peers.send(node, PeerConnectAccept(job=msg.job, rail=msg.rail, conn=msg.conn,
                                                endpoint=responder.endpoint))

    def _on_disconnect(self, node: str, msg: PeerDisconnect) -> None:
        responder = self.accepted.pop((node, msg.conn), None)
        if responder is not None:
            self._close_responder(responder)

    def _close_responder(self, responder: Responder) -> None:
        if responder.rail < len(self.workers):
            _quietly(self.workers[responder.rail].call, "close_connection", conn=responder.conn_id)

    def _on_connect_accept(self, node: str, msg: PeerConnectAccept) -> None:
        queue = self.ibgda_waiting.pop((node, msg.conn), None)
        if queue is not None:  # the far end of an IBGDA queue pair
            try:
                self.workers[msg.rail].call("connect_ibgda_queue", queue=queue.queue_id, remote=dict(msg.endpoint))
                queue.state = "up"
            except WorkerError:
                queue.state = "failed"
                raise
            return
        conn = self.connections.get((msg.job, node, msg.rail))
        if conn is None or conn.conn_id != msg.conn or conn.state == "up":
            return
        self.workers[conn.rail].call("connect", conn=conn.conn_id, remote=dict(msg.endpoint))
        conn.state, conn.peer_gid = "up", str(msg.endpoint.get("gid", ""))
        self._refresh_job(msg.job)

    # --- reporting -----------------------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        rails = []
        for worker in self.workers:
            try:
                rails.append(worker.call("stats", timeout_s=5.0))
            except WorkerError as exc:
                rails.append({"error": str(exc)})
        # per-connection queue counters from the workers, by (rail, backend connection id)
        queued = {(r.get("rail"), c["conn"]): c for r in rails for c in r.get("queues", {}).get("connections", [])}
        # a ring's error count is in its error word, which this process maps too (the workers report the code)
        words = {cid: ring.error for job in self.jobs.values() for rank in job.local.values()
                 for cid, ring in rank.channels.items()}
        for r in rails:
            for ring in r.get("queues", {}).get("rings", []):
                if ring.get("channel") in words:
                    ring["error_count"] = int(words[ring["channel"]][1])
        connections = []
        for c in self.connections.values():
            q = queued.get((c.rail, c.conn_id), {})
            connections.append({"conn": c.conn_id, "job": c.job, "node": c.node, "rail": c.rail, "state": c.state,
                                "bytes": q.get("bytes", 0), "inflight": q.get("inflight", 0),
                                "peer_gid": c.peer_gid})
        peers = {}
        if self.peers:
            for node, p in self.peers.peers.items():
                mine = [c for c in connections if c["node"] == node]
                peers[node] = {"up": p.up, "rtt_us": None if p.rtt_s is None else p.rtt_s * 1e6,
                               "messages_in": p.messages_in, "messages_out": p.messages_out,
                               "bytes": sum(c["bytes"] for c in mine), "connections": len(mine)}
        out = {
            "node": self.node,
            "pid": os.getpid(),
            "ready": self.ready,
            "backend": self.config.backend.kind,
            "uptime_s": time.time() - self.started,
            "clients": sum(1 for c in self.clients.values() if c is not None),
            "sessions_ended": dict(self.sessions_ended),
            "jobs": {name: {"world": j.world, "local": sorted(j.local), "remote": sorted(j.remote)}
                     for name, j in self.jobs.items()},
            "connections": connections,
            "peers": peers,
            "rails": rails,
        }
        for name, traffic in job_traffic(out).items():  # per job and rank, assembled from the rails' counters
            if name in out["jobs"]:
                out["jobs"][name]["traffic"] = {"bytes": traffic["bytes"],
                                                "ranks": {str(r): v for r, v in traffic["ranks"].items()}}
        return out


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


def _check_host_fd(fd: int, offset: int, size: int) -> None:
    """Host memory must be an anonymous memfd the client made (no file anyone could name), its size sealed
    (a client that shrank it would make the rail worker, and with it the daemon, die of SIGBUS touching
    the pages), holding the range."""
    if not is_memfd(fd):
        raise RequestError(ReplyCode.INVALID, "host memory must be a memfd (gpuclient.host_array): a named file "
                                              "or another kind of descriptor is refused")
    if not size_is_sealed(fd):
        raise RequestError(ReplyCode.INVALID, "host memory's memfd must have its size sealed (F_SEAL_SHRINK and "
                                              "F_SEAL_GROW, as gpuclient.host_array makes it): its owner could "
                                              "shrink it under the NIC")
    st = os.fstat(fd)
    if offset + size > st.st_size:
        raise RequestError(ReplyCode.INVALID, f"region [{offset}, {offset + size}) is outside the memfd "
                                              f"({st.st_size} bytes)")


def _memfd_name(kind: str, *parts: object) -> str:
    """``tpd-<kind>-<parts>``: a label in /proc/<pid>/maps and fd links, nothing anyone can open by it."""
    return "-".join(("tpd", kind, *map(str, parts)))[:200]  # the kernel takes 249 bytes at most


def _key(info: RegionInfo) -> dict[str, int]:
    return {"addr": info.addr, "length": info.length, "rkey": info.rkey}


def _triple(key: dict[str, int] | None, which: str) -> list[int]:
    """[addr, length, lkey or rkey] for a region table; zeros where the region has no key."""
    return [key["addr"], key["length"], key[which]] if key else [0, 0, 0]


def _quietly(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
    try:
        fn(*args, **kwargs)
    except WorkerError as exc:
        log.warning("%s", exc)
