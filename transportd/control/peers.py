"""The peer plane: daemons on different nodes talk over zmq TCP (CURVE-authenticated when configured).

Each daemon binds one ROUTER on ``peers.listen`` and connects one DEALER to every ``peers.static``
address. A DEALER's routing id is its node name, so the remote ROUTER knows who speaks. A node is
*known* once it has said ``peer_hello`` on either socket; messages to it go back the way it reached us
(our ROUTER, addressed by its name) or through our DEALER to it. Every message counts as a heartbeat;
``tick`` sends ``peer_heartbeat`` each interval and reports a node that stayed silent past the timeout
as down, exactly once, until it speaks again.

Restarts (docs/restart.md): with ``restart_grace_s`` > 0 a node that says ``peer_restarting``, falls
silent past the timeout, or says hello as a new life is *restarting* rather than down: ``on_peer_restarting``
when that begins, ``on_peer_restarted`` when its next life says hello (then ``on_peer_up``), and
``on_peer_down`` only if the grace period ends first. A node that fell silent and speaks again in the same
life is simply up again; one that announced its restart stays restarting until its next life (or the end
of the grace period), whatever its old life still sends. A goodbye (``peer_bye``) is down at once.

CURVE: the ROUTER is a CURVE server with this node's keypair and admits only the public keys in
``security.curve_authorized_keys_dir``. A DEALER must know its server's public key: it reads
``<authorized_keys_dir>/<host>_<port>.key`` (then ``<host>.key``) for the static entry ``host:port``.
One keypair per node serves both directions, so that directory holds every peer's public key.
"""

from __future__ import annotations

import errno
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import zmq

from transportd.control import codec
from transportd.control.curve import (
    CurveClientKeys,
    CurveServerKeys,
    configure_client,
    configure_server,
    load_public_key,
    start_authenticator,
)
from transportd.control.protocol import (
    PeerBye,
    PeerHeartbeat,
    PeerHello,
    PeerMessage,
    PeerRestarting,
    parse_peer_message,
)
from transportd.errors import ConfigError, ListenError, RemoteProtocolError

__all__ = ["PeerPlane", "PeerState"]

log = logging.getLogger("transportd.control.peers")


@dataclass
class PeerState:
    """What this node knows of one remote node."""

    node: str
    up: bool = True
    last_heard: float = 0.0
    rtt_s: float | None = None
    messages_in: int = 0
    messages_out: int = 0
    via_router: bool = False
    dealer: zmq.Socket | None = field(default=None, repr=False)
    backend: str = ""
    rails: int = 0
    incarnation: int = 0  # from its hello; a larger value means the node's daemon restarted
    said_goodbye: bool = False  # this life said peer_bye: only a hello of a new life brings the node back
    restarting_until: float = 0.0  # restarting (said so, or fell silent) until this clock time; 0: not
    restart_announced: bool = False  # it said peer_restarting: only its next life ends the restart

    @property
    def state(self) -> str:
        """``up``, ``restarting`` (within its grace period) or ``down``."""
        return "restarting" if self.restarting_until else ("up" if self.up else "down")


class PeerPlane:
    """Sockets, hellos, heartbeats and dispatch for the daemon-to-daemon protocol."""

    def __init__(
        self,
        node: str,
        backend: str,
        rails: int,
        listen: str,
        static: tuple[str, ...],
        *,
        on_message: Callable[[str, PeerMessage], None],
        on_peer_up: Callable[[str], None] = lambda node: None,
        on_peer_down: Callable[[str], None] = lambda node: None,
        on_peer_restarting: Callable[[str, bool], None] = lambda node, announced: None,
        on_peer_restarted: Callable[[str], None] = lambda node: None,
        heartbeat_interval_s: float = 1.0,
        heartbeat_timeout_s: float = 5.0,
        restart_grace_s: float = 0.0,
        curve: CurveServerKeys | None = None,
        context: zmq.Context | None = None,
        max_message_bytes: int = 16 << 20,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.node = node
        # the start time orders a node's lives: a hello of an earlier life that arrives late (queued on a
        # link before the restart) is known for stale instead of taken for yet another restart
        self.incarnation = time.time_ns()
        self.hello = PeerHello(node=node, backend=backend, rails=rails,  # type: ignore[arg-type]
                               incarnation=self.incarnation)
        self.peers: dict[str, PeerState] = {}
        self._on_message, self._on_up, self._on_down = on_message, on_peer_up, on_peer_down
        self._on_restarting, self._on_restarted = on_peer_restarting, on_peer_restarted
        self.interval, self.timeout = heartbeat_interval_s, heartbeat_timeout_s
        self.restart_grace_s = restart_grace_s
        self.max_message_bytes = max_message_bytes
        self._clock = clock
        self._ctx = context or zmq.Context.instance()
        self._hb_seq = 0
        self._leaving = False  # said goodbye: heartbeats stop, and close gives the goodbye time to leave
        self._next_heartbeat = 0.0
        self._unintroduced: set[str] = set()  # senders warned about (messages before their hello), once each
        self.router = self._ctx.socket(zmq.ROUTER)
        self.router.linger = 0
        self.router.router_mandatory = True
        # a node whose daemon came back (after a crash that left no TCP reset, say) reconnects under the
        # same name: the new link takes over from the dead one instead of being refused
        self.router.router_handover = True
        self.router.maxmsgsize = max_message_bytes
        self._auth = None
        if curve is not None:
            # without a ZAP handler libzmq would admit any client key: admit only the authorized ones
            self._auth = start_authenticator(self._ctx, curve.authorized_keys_dir)
            configure_server(self.router, curve)
        try:
            self.router.bind(listen)
        except zmq.ZMQError as exc:
            self.router.close(0)
            if self._auth is not None:
                self._auth.stop()
            raise ListenError("peers.listen", listen, exc.strerror, in_use=exc.errno == errno.EADDRINUSE) from None
        self.endpoint = self.router.last_endpoint.decode()
        self._poller = zmq.Poller()
        self._poller.register(self.router, zmq.POLLIN)
        self._dealers: list[tuple[str, zmq.Socket]] = []
        for address in static:
            dealer = self._ctx.socket(zmq.DEALER)
            dealer.linger = 0
            dealer.routing_id = node.encode()
            dealer.maxmsgsize = max_message_bytes
            if curve is not None:
                configure_client(dealer, _client_keys_for(address, curve))
            dealer.connect(f"tcp://{address}")
            self._dealers.append((address, dealer))
            self._poller.register(dealer, zmq.POLLIN)
            self._send_on(dealer, self.hello)
        log.info("peer plane on %s, static peers %s", self.endpoint, ", ".join(static) or "none")

    # --- sending ---------------------------------------------------------------------------------------
    def _send_on(self, dealer: zmq.Socket, msg: PeerMessage) -> None:
        try:
            dealer.send(codec.encode(msg.to_msg()), zmq.NOBLOCK)
        except zmq.Again:
            pass  # not connected yet: the hello is resent with every heartbeat until answered

    def send(self, node: str, msg: PeerMessage) -> bool:
        """Send ``msg`` to ``node``; False when the node is unknown or unreachable right now, or when this
        node said goodbye (anything after it, even a heartbeat echo, would bring the node back up)."""
        peer = self.peers.get(node)
        if peer is None or self._leaving:
            return False
        data = codec.encode(msg.to_msg())
        if peer.dealer is not None:
            try:
                peer.dealer.send(data, zmq.NOBLOCK)
                peer.messages_out += 1
                return True
            except zmq.Again:
                pass
        if peer.via_router:
            try:
                self.router.send_multipart([node.encode(), data], zmq.NOBLOCK)
                peer.messages_out += 1
                return True
            except (zmq.Again, zmq.ZMQError):
                return False
        return False

    def broadcast(self, msg: PeerMessage) -> None:
        for node, peer in self.peers.items():
            if peer.up:
                self.send(node, msg)

    def goodbye(self, reason: str) -> None:
        """Tell every peer this node is going away; nothing is sent after it."""
        self.broadcast(PeerBye(node=self.node, reason=reason))
        self._leaving = True

    def announce_restart(self) -> list[str]:
        """Tell every peer that is up that this daemon is restarting (each answers ``peer_quiesced`` once
        nothing of its own is in flight to us); returns the nodes told. Heartbeats and replies go on, so
        the answers can come; :meth:`fall_silent` ends this life's sending."""
        told = [node for node, peer in self.peers.items() if peer.up and self.send(node, PeerRestarting(
            node=self.node))]
        return told

    def fall_silent(self) -> None:
        """Send nothing more (the end of a life that announced its restart: no goodbye, peers wait)."""
        self._leaving = True

    # --- receiving -------------------------------------------------------------------------------------
    def poll(self, timeout_ms: int = 0) -> int:
        """Handle what has arrived (waiting up to ``timeout_ms``); returns messages handled."""
        handled = 0
        for sock, _ in self._poller.poll(timeout_ms):
            for _ in range(256):
                try:
                    frames = sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                handled += 1
                if sock is self.router:
                    self._receive(frames[0].decode(errors="replace"), frames[-1], None)
                else:
                    self._receive(None, frames[-1], sock)
        self.tick()
        return handled

    def _receive(self, identity: str | None, data: bytes, dealer: zmq.Socket | None) -> None:
        if self._leaving:
            return  # said goodbye: hellos and heartbeats go unanswered
        try:
            msg = parse_peer_message(codec.decode(data, max_size=self.max_message_bytes))
        except RemoteProtocolError as exc:
            log.warning("refused a peer message from %s: %s", identity or "a static peer", exc)
            return
        if isinstance(msg, PeerHello):
            node = msg.node
            if identity is not None and identity != node:
                log.warning("peer says it is %r but connected as %r: refused", node, identity)
                return
            peer = self.peers.get(node)
            restarted = False
            if peer is None:
                peer = self.peers[node] = PeerState(node=node, last_heard=self._clock())
                log.info("peer %s joined (%s, %d rails)", node, msg.backend, msg.rails)
                is_new = True
            else:
                if peer.incarnation and msg.incarnation and msg.incarnation < peer.incarnation:
                    log.debug("hello from an earlier life of %s: dropped", node)
                    return
                restarted = bool(peer.incarnation and msg.incarnation and msg.incarnation != peer.incarnation)
                if restarted and self.restart_grace_s > 0 and (peer.up or peer.restarting_until):
                    log.warning("peer %s is back as a new life: re-wiring its jobs (their ranks have %.1fs to "
                                "re-announce themselves)", node, self.restart_grace_s)
                    peer.up, peer.restarting_until, peer.restart_announced = False, 0.0, False
                    self._on_restarted(node)
                elif restarted:
                    log.warning("peer %s restarted: dropping what was built with its earlier life", node)
                    self._down(peer)
                elif peer.said_goodbye:
                    # a hello (or the answer to one of ours) sent before its goodbye, overtaken on the other
                    # link: that life is over and cannot come back
                    log.debug("hello from %s after its goodbye: dropped", node)
                    return
                peer.said_goodbye = False
                # the life that announced its restart says nothing that brings it back; its next life does
                is_new = not peer.up and not (peer.restarting_until and peer.restart_announced)
            self._unintroduced.clear()  # whoever was early has introduced itself, or will be warned about anew
            if restarted and peer.dealer is not None and peer.dealer is not dealer:
                # our link to its earlier life reconnects to the new one, which has not heard us say hello on
                # it: say it first, so that nothing we send there next is dropped as coming from a stranger
                self._send_on(peer.dealer, self.hello)
            peer.backend, peer.rails, peer.incarnation = msg.backend, msg.rails, msg.incarnation
            if identity is not None:
                peer.via_router = True
                # answer on the same path so the remote DEALER learns who it reached; a link that closed
                # since (the peer died or restarted right after its hello) has no one to answer
                try:
                    self.router.send_multipart([node.encode(), codec.encode(self.hello.to_msg())], zmq.NOBLOCK)
                except (zmq.Again, zmq.ZMQError) as exc:
                    log.debug("hello from %s not answered: %s", node, exc)
            if dealer is not None:
                peer.dealer = dealer
            self._heard(peer)
            if is_new:
                peer.up, peer.restarting_until = True, 0.0
                self._on_up(node)
            return
        node = identity if identity is not None else self._dealer_node(dealer)
        peer = self.peers.get(node) if node else None
        if peer is None:
            # a restarted peer's heartbeats can overtake its hello: say so once per sender, not per message
            sender = node or next((a for a, d in self._dealers if d is dealer), "a static peer")
            if sender not in self._unintroduced:
                self._unintroduced.add(sender)
                log.warning("messages from %s, which has not said hello, are dropped until it does (first: %s)",
                            sender, msg.op)
            else:
                log.debug("message %s from %s before its hello: dropped", msg.op, sender)
            return
        if isinstance(msg, PeerBye):
            log.info("peer %s said goodbye (%s)", peer.node, msg.reason or "no reason")
            peer.said_goodbye = True
            self._down(peer)
            return
        if peer.said_goodbye:
            log.debug("message %s from %s after its goodbye: dropped", msg.op, peer.node)
            return  # sent before the goodbye on the other link and overtaken by it
        if isinstance(msg, PeerRestarting):
            self._heard(peer)
            log.info("peer %s is restarting: holding what is for it, for up to %.1fs", peer.node,
                     self.restart_grace_s)
            self._begin_restart(peer, announced=True)
            self._on_message(peer.node, msg)  # the daemon answers peer_quiesced once it has drained
            return
        was_down = not peer.up
        self._heard(peer)
        if peer.restarting_until and peer.restart_announced:
            pass  # its old life's last words (heartbeats, a quiesce answer): the restart goes on
        elif was_down:
            if peer.restarting_until:
                log.info("peer %s speaks again (same life): back up", peer.node)
            peer.up, peer.restarting_until = True, 0.0
            self._on_up(peer.node)
        if isinstance(msg, PeerHeartbeat):
            if msg.seq & 1:  # odd: an echo of one of ours; its t is our send time
                peer.rtt_s = max(0.0, self._clock() - msg.t)
            else:
                self.send(peer.node, PeerHeartbeat(seq=msg.seq + 1, t=msg.t))
            return
        self._on_message(peer.node, msg)

    def unreached(self) -> list[str]:
        """Static peer addresses no node has introduced itself on (not running, or its CURVE handshake
        fails: a wrong key is silent in zmq, so all we know is that no hello came)."""
        heard = {id(p.dealer) for p in self.peers.values() if p.dealer is not None}
        return [address for address, dealer in self._dealers if id(dealer) not in heard]

    def _dealer_node(self, dealer: zmq.Socket | None) -> str | None:
        for peer in self.peers.values():
            if peer.dealer is dealer:
                return peer.node
        return None

    def _heard(self, peer: PeerState) -> None:
        peer.last_heard = self._clock()
        peer.messages_in += 1

    # --- liveness --------------------------------------------------------------------------------------
    def tick(self) -> None:
        """Send heartbeats when due and declare silent peers down."""
        self.send_heartbeats()
        now = self._clock()
        for peer in self.peers.values():
            if peer.restarting_until and now > peer.restarting_until:
                log.warning("peer %s did not come back within peers.restart_grace_s (%.1fs): down", peer.node,
                            self.restart_grace_s)
                self._down(peer)
            elif peer.up and now - peer.last_heard > self.timeout:
                if self.restart_grace_s > 0:
                    log.warning("peer %s silent for %.1fs: restarting? its jobs wait up to %.1fs", peer.node,
                                now - peer.last_heard, self.restart_grace_s)
                    self._begin_restart(peer, announced=False)
                else:
                    log.warning("peer %s silent for %.1fs: down", peer.node, now - peer.last_heard)
                    self._down(peer)

    def send_heartbeats(self) -> None:
        """Send heartbeats (and unanswered hellos) when due. Reads nothing, so a caller busy elsewhere (a slow
        rail-worker call) can keep the peers from declaring this node lost without serving their messages."""
        now = self._clock()
        if now >= self._next_heartbeat and not self._leaving:
            self._next_heartbeat = now + self.interval
            self._hb_seq += 2
            for _address, dealer in self._dealers:
                if self._dealer_node(dealer) is None:
                    self._send_on(dealer, self.hello)
            for node in self.peers:
                self.send(node, PeerHeartbeat(seq=self._hb_seq, t=now))

    def _begin_restart(self, peer: PeerState, *, announced: bool) -> None:
        """``peer`` is restarting (it said so, or went silent): its jobs wait out the grace period."""
        if self.restart_grace_s <= 0:
            self._down(peer)
            return
        if announced and peer.restarting_until:
            peer.restart_announced = True  # a silent node that then said so: its next life ends it
            return
        if not peer.up:
            return  # down already (its grace ran out, or it said goodbye): nothing left to hold
        peer.up = False
        peer.restarting_until = self._clock() + self.restart_grace_s
        peer.restart_announced = announced
        self._on_restarting(peer.node, announced)

    def _down(self, peer: PeerState) -> None:
        """Report ``peer`` down once (a timeout, a goodbye, a restart, the end of its restart grace period);
        it is up again when it next speaks."""
        if peer.up or peer.restarting_until:
            peer.up, peer.restarting_until, peer.restart_announced = False, 0.0, False
            self._on_down(peer.node)

    def close(self) -> None:
        linger_ms = 500 if self._leaving else 0
        for _, dealer in self._dealers:
            dealer.close(linger_ms)
        self.router.close(linger_ms)
        if self._auth is not None:
            self._auth.stop()


def _client_keys_for(address: str, curve: CurveServerKeys) -> CurveClientKeys:
    host, _, port = address.rpartition(":")
    directory = Path(curve.authorized_keys_dir)
    for candidate in (directory / f"{host}_{port}.key", directory / f"{host}.key"):
        if candidate.exists():
            return CurveClientKeys(curve.public, curve.secret, load_public_key(candidate))
    raise ConfigError("<config>", "peers.static",
                      f"no public key for peer {address}: expected {directory}/{host}_{port}.key or {host}.key")
