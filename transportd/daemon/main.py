"""The daemon's main process: its lifecycle and main loop, composing the parts that serve clients and peers.

One thread runs :meth:`Daemon.run`: it serves the control socket, the descriptor socket, the peer plane
and liveness checks. Each rail has a proxy worker process (``transportd.dataplane.worker``) that owns the
rail's verbs resources and posts; the main process tells it what to map, connect and consume through
:class:`~transportd.dataplane.worker_link.WorkerHandle`.

The parts, each owning its own state, over the resources they share (:class:`~transportd.daemon.state.NodeState`):

- :mod:`~transportd.daemon.clients` — the control clients: who each is (hello, vouch), joining a job;
- :mod:`~transportd.daemon.memory` — a rank's regions, flag array and rings in the rail workers;
- :mod:`~transportd.daemon.ibgda` — IBGDA channels;
- :mod:`~transportd.daemon.peering` — wiring a job across nodes (announcements, connections, peers up/down);
- :mod:`~transportd.daemon.selftest_jobs` — both sides of ``transportctl selftest``;
- :mod:`~transportd.daemon.stats` — what ``stats`` and ``inspect`` report.
- :mod:`~transportd.daemon.tracing` — ``transportctl trace start|stop`` (docs/trace.md).

The :class:`Daemon` is the handler the servers call: its ``on_<op>`` methods (one section for the control
ops, one for the descriptor socket, one for the peer plane) each hand the request to the part that owns it,
and releasing a rank (a client leaving, exiting or going silent; a self-test ending) runs through every part.

Stopping is a *handover* (docs/restart.md) unless the daemon stops because a rail worker died: it tells its
peers it is restarting and waits (briefly) until nothing of theirs is in flight to it, drains its rails
(every record taken is completed, and each ring's consumer position is published in the ring, which the
client holds), and exits without ending any session: its clients re-attach to the next daemon with the
same memory, and its peers keep their side of every job for ``peers.restart_grace_s``. A restart request
(``transportctl restart``, SIGHUP) first starts that next daemon and hands over once it is ready
(:mod:`~transportd.daemon.succession`).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

from transportd.config import Config
from transportd.control.curve import CurveServerKeys
from transportd.control.fdsocket import FdServer, SideConnection, fd_socket_for
from transportd.control.peers import PeerPlane
from transportd.control.protocol import (
    Channel,
    ChannelClose,
    ChannelConnect,
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
    PeerQuiesced,
    PeerRankLeft,
    PeerRegions,
    PeerSelftest,
    PeerSelftestReport,
    Register,
    ReplyCode,
    Restart,
    Selftest,
    Stats,
    TraceStart,
    TraceStop,
    Vouch,
)
from transportd.control.server import ControlServer
from transportd.daemon import stats
from transportd.daemon.clients import ControlClients
from transportd.daemon.ibgda import IbgdaChannels
from transportd.daemon.memory import RankMemory
from transportd.daemon.peering import Peering
from transportd.daemon.sdnotify import Notifier
from transportd.daemon.selftest_jobs import SelftestJobs
from transportd.daemon.state import LocalRank, NodeState
from transportd.daemon.succession import Predecessor, Successor
from transportd.daemon.tracing import Tracing
from transportd.dataplane.worker import rail_main
from transportd.dataplane.worker_link import WorkerHandle
from transportd.errors import RequestError, WorkerError
from transportd.ops.metrics import MetricsServer

__all__ = ["Daemon"]

log = logging.getLogger("transportd")

QUIESCE_WAIT_S = 3.0  # a restarting daemon waits this long at most for its peers' peer_quiesced


class Daemon:
    """The daemon around one config: starts and stops its servers and rail workers, runs the main loop,
    and hands each request to the part that owns it (module doc)."""

    def __init__(self, config: Config, *, worker_target: Callable[..., None] | None = None,
                 predecessor: Predecessor | None = None) -> None:
        self.config = config
        self.node = config.node.name
        self.started = time.time()
        self.stop_event = threading.Event()
        self.failure: str | None = None  # why the daemon stopped on its own (the CLI exits non-zero)
        self.state = NodeState(config)
        self.peering = Peering(self.state)
        self.clients = ControlClients(self.state, self.peering)
        self.memory = RankMemory(self.state, self.clients)
        self.ibgda = IbgdaChannels(self.state, self.clients, self.peering)
        self.selftests = SelftestJobs(self.state, self.peering, self.memory, self._release_rank)
        self.peering.on_job_refreshed = self.selftests.job_refreshed
        self.tracing = Tracing(self.state)
        self._worker_target = worker_target
        self.notifier = Notifier()
        self.ready = False
        self.snapshot: dict[str, Any] = {"node": self.node}  # the last stats(), for other threads (metrics)
        self.metrics: MetricsServer | None = None
        self.peer_wait_s = config.peers.ready_wait_s  # READY=1 waits this long for the static peers at most
        self.predecessor = predecessor  # the daemon this one takes over from (a restart request), if any
        self.restart_requested = False  # transportctl restart, SIGHUP: start a successor, then hand over
        self.successor: Successor | None = None
        self.restart_error = ""  # why the last restart request did not happen (its successor failed)
        self.quiesced: set[str] = set()  # peers that answered our peer_restarting
        self._serving = False  # run() began: stopping from now on hands the jobs over
        self._closing = False

    # --- lifecycle -------------------------------------------------------------------------------------
    def start(self) -> None:
        """Start the rail workers, the control server and the peer plane (raises on any failure)."""
        config, state = self.config, self.state
        target = self._worker_target or rail_main
        count = max(1, len(config.backend.rails or ()))
        try:
            for index in range(count):
                state.workers.append(WorkerHandle(index, target, {"config": config}))
            if self.predecessor is not None:  # ready: it hands over, then its addresses are ours
                self.predecessor.take_over(self.notifier.tick)
                self.predecessor = None
            state.control = ControlServer.from_config(config, self)
            fd_path = fd_socket_for(config.control.socket)
            if fd_path is not None:  # same mode and group as the control socket
                state.fdserver = FdServer(fd_path, self, mode=config.control.mode, group=config.control.group,
                                          vouch_timeout_s=config.control.vouch_timeout_s,
                                          max_unvouched=config.control.max_unvouched)
            curve = CurveServerKeys.from_config(config.security, config.source)
            state.peers = PeerPlane(
                self.node, config.backend.kind, count, config.peers.listen, config.peers.static,
                on_message=self.on_peer_message, on_peer_down=self.on_peer_down, on_peer_up=self.on_peer_up,
                on_peer_restarting=self.on_peer_restarting, on_peer_restarted=self.on_peer_restarted,
                heartbeat_interval_s=config.peers.heartbeat_interval_s,
                heartbeat_timeout_s=config.peers.heartbeat_timeout_s,
                restart_grace_s=config.peers.restart_grace_s, curve=curve)
            for worker in state.workers:
                worker.on_wait = self._while_a_worker_call_waits
            if config.metrics.listen:
                self.metrics = MetricsServer(config.metrics.listen, lambda: self.snapshot)
                log.info("metrics on http://%s/metrics", self.metrics.address)
        except BaseException:
            if self.predecessor is not None:
                self.predecessor.abandon()  # the running daemon serves on
            self.close()
            raise
        providers = sorted({str(w.info.get("verbs", "?")) for w in state.workers})
        log.info("node %s up: backend %s over %s, %d rail(s), control %s, peers %s", self.node,
                 config.backend.kind, "/".join(providers), count, state.control.endpoint, state.peers.endpoint)
        paths = [str(w.info.get("flag_publication", "?")) for w in state.workers]
        log.info("flag publication per rail: %s; session.flags() defaults to %s flags (flags.placement = %r)",
                 ", ".join(paths), state.flags_placement(0), config.flags.placement)
        fallback = [w.rail for w in state.workers if w.info.get("verbs_fallback")]
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
        control, peers = self.state.control, self.state.peers
        assert control and peers
        next_liveness = next_report = 0.0
        started = time.monotonic()
        self._serving = True
        while not self.stop_event.is_set():
            control.poll(1)
            if self.state.fdserver is not None:
                self.state.fdserver.poll(0)
            peers.poll(0)
            self.peering.tick()
            if self.restart_requested:
                self._succession()
            now = time.monotonic()
            if now >= next_liveness:
                next_liveness = now + 0.2
                self._check_workers()
                self._check_clients()
                self.selftests.expire()
                self.peering.check_broken()
                self.peering.expire()
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
        if self.successor is not None:
            self.notifier.reloading("restarting: handing the jobs over to the next daemon")
        else:
            self.notifier.stopping("stopping: draining the rails")
        log.info("stopping: draining the rails (%s)", "handing over to the successor" if self.successor else
                 "jobs handed over" if self.failure is None else "jobs end")

    def _while_a_worker_call_waits(self) -> None:
        if self.state.peers is not None:
            self.state.peers.send_heartbeats()
        self.notifier.tick()

    def _static_peers_up(self) -> bool:
        up = sum(1 for p in self.state.plane.peers.values() if p.up)
        return up >= len(self.config.peers.static)

    def _status_line(self) -> str:
        peers = self.state.plane.peers
        up = sum(1 for p in peers.values() if p.up)
        return (f"{len(self.state.workers)} rail(s), {self.clients.joined_count} client(s), "
                f"peers {up} up / {len(peers)} known")

    def install_signal_handlers(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: self.stop_event.set())
        signal.signal(signal.SIGHUP, lambda *_: self.request_restart())  # the unit's ExecReload

    def request_restart(self) -> None:
        """Start this daemon's command line again (the config and the code read anew) and hand the jobs over
        to it once it is ready (:mod:`~transportd.daemon.succession`); if it cannot start, serve on."""
        self.restart_requested, self.restart_error = True, ""

    def _succession(self) -> None:
        if self.successor is None:  # restart_error was cleared by the request
            try:
                self.successor = Successor.start()
            except OSError as exc:
                self.restart_requested, self.restart_error = False, f"cannot start a successor: {exc}"
                log.error("restart refused: %s", self.restart_error)
                return
        state = self.successor.poll()
        if state == "ready":
            self.restart_requested = False
            self.stop_event.set()  # hand over now: the successor takes our addresses as we leave
        elif state == "failed":
            self.restart_requested, self.restart_error = False, self.successor.error
            self.successor = None

    def close(self) -> None:
        """Stop: hand the jobs over to the next daemon (module doc), or, when the daemon stops because a rail
        worker died, say goodbye to peers and end every session.

        Draining comes first, while clients' rings and the peers' connections are still in place: every
        record committed before the stop is posted and completed (``Proxy.drain``, bounded per rail). A
        handover tells the peers first, so that what they have in flight to us completes before we drain.
        """
        state = self.state
        handover = self._serving and self.failure is None
        self._closing = True
        if handover and state.peers is not None:
            self._quiesce_peers()
        self.selftests.close()
        self.tracing.close()
        for worker in state.workers:
            worker.stop()
        state.workers.clear()
        if handover:
            self._let_go()
            if state.peers:
                state.peers.fall_silent()
        else:
            if state.peers:
                state.peers.goodbye("shutdown")
            for client_id in list(self.clients.ranks):
                self._reclaim(client_id, "shutdown")
        if state.control:  # first: a client that sees its descriptor connection close finds no old daemon
            state.control.close()
            state.control = None
        if state.fdserver:
            state.fdserver.close()
            state.fdserver = None
        if self.metrics:
            self.metrics.close()
            self.metrics = None
        if state.peers:
            state.peers.close()
            state.peers = None
        if self.successor is not None:  # under systemd, the successor is the service's main process now
            self.notifier.notify(f"MAINPID={self.successor.process.pid}", wait_s=self.notifier.important_wait_s)
            log.info("handed over to pid %d", self.successor.process.pid)
            self.successor.close()

    def _quiesce_peers(self) -> None:
        """Tell the peers we are restarting and wait (at most QUIESCE_WAIT_S) until each answers that nothing of
        its own is in flight to us any more: what they wrote here is then placed, and our drain publishes it."""
        plane = self.state.plane
        told = set(plane.announce_restart())
        wait_s = min(QUIESCE_WAIT_S, self.config.peers.restart_grace_s)
        deadline = time.monotonic() + wait_s
        while told - self.quiesced and time.monotonic() < deadline:
            plane.poll(5)
            self.notifier.tick()
        late = sorted(told - self.quiesced)
        if late:
            log.warning("peer(s) %s did not say peer_quiesced within %.1fs: what they still had in flight to us "
                        "has an unknown outcome for them", ", ".join(late), wait_s)
        log.info("peers told of the restart: %d, quiesced: %d", len(told), len(told & self.quiesced))

    def _let_go(self) -> None:
        """Release every session without ending it: nothing is written into its rings or flags, no peer hears
        of its ranks leaving. The memory stays the clients'; they re-attach to the next daemon."""
        kept = 0
        for rank in [r for r in self.clients.ranks.values() if r is not None]:
            for ring in rank.channels.values():
                ring.close()
            rank.channels.clear()
            if rank.flags is not None:
                rank.flags.close()
                rank.flags = None
            self.ibgda.let_go(rank)
            kept += 1
        self.clients.ended["shutdown"] += kept
        if kept:
            log.info("%d session(s) handed over: their rings, flags and memory wait for the next daemon", kept)

    # --- liveness and reclaiming -----------------------------------------------------------------------
    def _check_workers(self) -> None:
        """A rail worker that died (a crash in the provider, the OOM killer) took its QPs and its rings'
        proxy with it: nothing on that rail would ever complete. Stop, so every client and peer hears it
        now, and exit non-zero so the service manager starts a whole daemon again."""
        for worker in self.state.workers:
            if not worker.process.is_alive() and self.failure is None:
                self.failure = f"rail {worker.rail} worker died (exit code {worker.process.exitcode})"
                log.error("%s: stopping the daemon", self.failure)
                self.stop_event.set()

    def _check_clients(self) -> None:
        """Reclaim sessions whose process has exited or whose keepalives stopped (a killed client never says
        leave). A client watched by pid is kept while its process exists, even stopped in a debugger.
        Silence counts only with no request queued: a daemon that was busy has not heard its clients."""
        control = self.state.control
        assert control
        for client_id in self.clients.exited():
            self._reclaim(client_id, "exited")
            self.clients.forget(client_id)
            control.drop(client_id)
        if not control.has_input():
            control.expire(self.config.control.client_timeout_s, keep=self.clients.pids.keys())

    def _reclaim(self, client_id: bytes, why: str) -> None:
        """End ``client_id``'s session (``why``: one of SESSION_ENDS) and free everything it held."""
        rank = self.clients.end(client_id, why)
        if rank is not None:
            self._release_rank(rank)

    def _release_rank(self, rank: LocalRank) -> None:
        """Free everything ``rank`` held (IBGDA queues, rings, regions, flags, offers) and forget it."""
        self.ibgda.close_rank(rank)
        self.memory.release(rank)
        self.clients.withdraw_offers(rank)
        self.peering.rank_gone(rank)
        log.info("job %s rank %d reclaimed", rank.job, rank.rank)

    def stats(self) -> dict[str, Any]:
        out = stats.collect_stats(self.state, self.peering, self.clients, started=self.started, ready=self.ready,
                                  ibgda=self.ibgda.queue_stats)
        out["restart"] = self.restart_status()
        return out

    # --- control ops (ControlServer calls on_<op>) ------------------------------------------------------
    def on_hello(self, client_id: bytes, req: Hello) -> dict[str, Any]:
        return self.clients.hello(client_id, req)

    def on_heartbeat(self, client_id: bytes, req: Heartbeat) -> dict[str, Any]:
        return {"seq": req.seq}

    def on_join(self, client_id: bytes, req: Join) -> dict[str, Any]:
        return self.clients.join(client_id, req)

    def on_register(self, client_id: bytes, req: Register) -> dict[str, Any]:
        return self.memory.register(client_id, req)

    def on_flags(self, client_id: bytes, req: Flags) -> dict[str, Any]:
        return self.memory.flags(client_id, req)

    def on_exchange(self, client_id: bytes, req: Exchange) -> dict[str, Any]:
        return self.peering.exchange(self.clients.joined(client_id))

    def on_channel(self, client_id: bytes, req: Channel) -> dict[str, Any]:
        rank = self.clients.joined(client_id)
        conn = self.clients.side_for(client_id, "a channel's memory (a ring, or IBGDA queues)")
        if req.kind == "ibgda":
            return self.ibgda.open(rank, conn, req.capacity)
        if req.adopt >= 0:  # a session re-attaching after a restart passed its ring back
            return self.memory.adopt_ring(rank, conn, req.adopt, req.id)
        return self.memory.open_ring(rank, conn, req.capacity)

    def on_channel_info(self, client_id: bytes, req: ChannelInfo) -> dict[str, Any]:
        return self.ibgda.info(client_id, req)

    def on_channel_connect(self, client_id: bytes, req: ChannelConnect) -> dict[str, Any]:
        return self.ibgda.connect(client_id, req)

    def on_channel_close(self, client_id: bytes, req: ChannelClose) -> dict[str, Any]:
        return self.ibgda.close_channel(client_id, req)

    def on_stats(self, client_id: bytes, req: Stats) -> dict[str, Any]:
        node_stats = self.stats()
        return stats.visible_stats(node_stats, self.clients.identity(client_id), self.state)

    def on_inspect(self, client_id: bytes, req: Inspect) -> dict[str, Any]:
        return stats.inspect_flags(self.state, self.clients.identity(client_id), req)

    def on_selftest(self, client_id: bytes, req: Selftest) -> dict[str, Any]:
        self.clients.identity(client_id)  # a vouched session: a self-test takes memory on the peer
        return self.selftests.request(req)

    def on_trace_start(self, client_id: bytes, req: TraceStart) -> dict[str, Any]:
        self.clients.side_for(client_id, "a trace file")  # refused now, not at the stop, over tcp
        return self.tracing.start(self.clients.identity(client_id), req)

    def on_trace_stop(self, client_id: bytes, req: TraceStop) -> dict[str, Any]:
        conn = self.clients.side_for(client_id, "a trace file")
        return self.tracing.stop(self.clients.identity(client_id), conn, req)

    def on_restart(self, client_id: bytes, req: Restart) -> dict[str, Any]:
        ident = self.clients.identity(client_id)
        if not (ident.superuser or ident.uid == os.geteuid()):
            raise RequestError(ReplyCode.FORBIDDEN, "only root or the daemon's own user may restart it "
                                                    "(`sudo transportctl restart`, or `systemctl reload transportd`)")
        log.info("restart requested by %s", ident.principal)
        self.request_restart()
        return {"pid": os.getpid(), "started": self.started}

    def restart_status(self) -> dict[str, Any]:
        """For stats: a restart under way (``preparing``: the successor starts) or why the last one failed."""
        if self.successor is not None:
            return {"state": self.successor.state, "successor": self.successor.process.pid}
        if self.restart_requested:  # asked for, the successor not started yet (the next turn of the loop)
            return {"state": "preparing"}
        return {"state": "failed", "error": self.restart_error} if self.restart_error else {"state": "none"}

    def on_leave(self, client_id: bytes, req: Leave) -> dict[str, Any]:
        self._reclaim(client_id, "left")
        return {}

    def on_client_gone(self, client_id: bytes) -> None:
        self._reclaim(client_id, "silent")
        self.clients.forget(client_id)

    # --- the descriptor socket (FdServer calls these) ---------------------------------------------------
    def on_vouch(self, conn: SideConnection, req: Vouch) -> dict[str, Any]:
        return self.clients.vouch(conn, req)

    def on_side_closed(self, conn: SideConnection) -> None:
        """A descriptor connection ended: its process exited (or closed it), so its session ends too."""
        client_id = self.clients.side_closed(conn)
        if client_id is not None:
            self._reclaim(client_id, "exited")
            self.clients.forget(client_id)
            if self.state.control is not None:  # over: not reclaimed again once it has been silent a while
                self.state.control.drop(client_id)

    # --- the peer plane (PeerPlane calls these) ---------------------------------------------------------
    def on_peer_up(self, node: str) -> None:
        if not self._closing:
            self.peering.peer_up(node)

    def on_peer_down(self, node: str) -> None:
        """Fail everything that waits on ``node``: clients waiting on it see PEER_LOST, not a hang."""
        if self._closing:
            return
        self.ibgda.peer_down(node)
        self.peering.peer_down(node)
        self.selftests.peer_down(node)

    def on_peer_restarting(self, node: str, announced: bool) -> None:
        """``node`` is restarting (or went silent): hold what is for it, for the grace period."""
        if not self._closing:
            self.peering.peer_restarting(node, announced)
            self.selftests.peer_down(node)  # a self-test's far side does not survive a restart

    def on_peer_restarted(self, node: str) -> None:
        """``node``'s next life said hello: re-wire its jobs as its ranks come back."""
        if not self._closing:
            self.ibgda.peer_down(node)
            self.peering.peer_restarted(node)

    def on_peer_message(self, node: str, msg: PeerMessage) -> None:
        if isinstance(msg, PeerQuiesced):
            self.quiesced.add(node)
            return
        if self._closing:
            return  # stopping: only the answers to our peer_restarting matter now
        try:
            if isinstance(msg, PeerRegions):
                self.peering.on_regions(node, msg)
            elif isinstance(msg, PeerConnectRequest):
                self.peering.on_connect_request(node, msg)
            elif isinstance(msg, PeerConnectAccept):
                # the far end of one of our IBGDA queue pairs, or of one of our connections
                if not self.ibgda.connect_accepted(node, msg):
                    self.peering.on_connect_accept(node, msg)
            elif isinstance(msg, PeerDisconnect):
                self.peering.on_disconnect(node, msg)
            elif isinstance(msg, PeerRankLeft):
                self.peering.on_rank_left(node, msg)
            elif isinstance(msg, PeerJobLost):
                self.peering.on_job_lost(node, msg)
            elif isinstance(msg, PeerSelftest):
                self.selftests.on_peer_selftest(node, msg)
            elif isinstance(msg, PeerSelftestReport):
                self.selftests.on_report(node, msg)
        except (WorkerError, RequestError) as exc:
            log.warning("peer %s: %s failed: %s", node, msg.op, exc)
