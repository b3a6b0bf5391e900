"""A client's connection to its node's daemon: the zmq shell on the client side of the control protocol.

:class:`ControlConnection` owns one REQ socket (relaxed and correlated, so a timed-out request does not wedge
it and a late reply is never taken for the next one's). Construction performs a bounded ``hello``; when
nothing answers, the error says the daemon is not running at that endpoint and how to start it, instead of
hanging. Requests built from :mod:`transportd.control.protocol` classes are checked against the session state
machine before they are sent, so ``register`` before ``join`` fails locally with the reason.

Endpoint resolution: explicit argument > ``$TRANSPORTD_SOCKET`` > the config's ``control.socket``.

Identity: over ipc the hello reply carries a one-time token and the path of the daemon's descriptor socket
(:mod:`transportd.control.fdsocket`); :meth:`ControlConnection.hello` presents the token there, so the daemon
learns this process's uid, gid and pid from the kernel, and keeps that connection open for the session's
lifetime: it carries memory descriptors both ways (:meth:`ControlConnection.pass_fd` hands over host memory,
:meth:`ControlConnection.take_fd` takes the rings and flags the daemon made), and its end tells the daemon
this process is gone (and this process that the daemon is gone, :meth:`ControlConnection.daemon_gone`).

Keepalive: the hello reply says how often the daemon wants to hear from an idle client (``keepalive_s``);
a background thread sends a ``heartbeat`` when no request went out for that long. The daemon reclaims a
session whose client stays silent past ``control.client_timeout_s`` (a killed client over tcp, or in
another pid namespace, is noticed that way). Requests and heartbeats share the one socket under a lock.
"""

from __future__ import annotations

import grp
import os
import socket as _socket
import stat
import threading
import time
import weakref
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import zmq

from cmd_ring import codec, protocol
from cmd_ring.endpoints import DEFAULT_SOCKET, SOCKET_ENV, check_control_endpoint
from cmd_ring.errors import (
    DaemonTimeoutError,
    DaemonUnavailableError,
    RequestError,
    SessionLostError,
    TransportdError,
)
from cmd_ring.protocol import Heartbeat, Hello, Request, SessionRules
from transportd.control.curve import CurveClientKeys, configure_client
from transportd.control.fdsocket import FdClient

if TYPE_CHECKING:  # an annotation only: a client never loads the daemon's config (or its backend registry)
    from transportd.config import Config

__all__ = ["ControlConnection", "not_a_socket", "pid_namespace", "resolve_endpoint"]

_START_HINT = (
    "Start it with `transportd run --config /etc/transportd/transportd.toml` (or `systemctl start transportd`), "
    f"or, if it listens elsewhere, set {SOCKET_ENV} (or pass socket= to gpuclient.connect, --socket to "
    "transportctl)."
)
_MAX_REPLY_BYTES = 64 << 20


def resolve_endpoint(endpoint: str | None = None, *, config: Config | None = None,
                     env: Mapping[str, str] | None = None) -> str:
    """The control endpoint to use: ``endpoint`` if given, else ``$TRANSPORTD_SOCKET``, else the config's."""
    if endpoint:
        return endpoint
    value = (os.environ if env is None else env).get(SOCKET_ENV)
    if value:
        return value
    return config.control.socket if config is not None else DEFAULT_SOCKET


def pid_namespace() -> int:
    """The inode of this process's pid namespace (0 where /proc does not say): equal inodes, same pids."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def _close_resources(socks: list[zmq.Socket], context: zmq.Context | None, stop: threading.Event,
                     side: list[FdClient]) -> None:
    stop.set()  # ends the keepalive thread, if any
    for fd_client in side:
        fd_client.close()
    side.clear()
    for sock in socks:
        sock.close(linger=0)
    socks.clear()
    if context is not None:
        context.term()


class ControlConnection:
    """One client session with the local daemon over its control socket (one thread at a time)."""

    def __init__(
        self,
        endpoint: str | None = None,
        *,
        config: Config | None = None,
        timeout_ms: int = 10_000,
        handshake_timeout_ms: int = 2_000,
        name: str = "",
        curve: CurveClientKeys | None = None,
        context: zmq.Context | None = None,
        handshake: bool = True,
    ) -> None:
        """Connect to ``endpoint`` (see :func:`resolve_endpoint`) and, unless ``handshake`` is False, say hello.

        ``timeout_ms`` bounds each request; ``handshake_timeout_ms`` bounds the hello (and sends). Raises
        :class:`DaemonUnavailableError` when the daemon does not answer the hello in time.
        """
        self.endpoint = resolve_endpoint(endpoint, config=config)
        try:
            check_control_endpoint(self.endpoint)
        except ValueError as exc:  # before zmq, whose EINVAL would name nothing
            raise DaemonUnavailableError(self.endpoint, f"not a control endpoint: {exc}") from None
        self.timeout_ms = timeout_ms
        self.handshake_timeout_ms = handshake_timeout_ms
        self.session = SessionRules()
        self.hello_reply: dict[str, Any] = {}
        self._name = name
        self._curve = curve is not None
        self._suspect: str | None = None  # why the daemon may be gone (set by a timed-out request)
        self._lock = threading.Lock()  # one request (or heartbeat) on the REQ socket at a time
        self._last_sent = time.monotonic()
        self._stop_keepalive = threading.Event()
        self.vouch_reply: dict[str, Any] = {}  # the kernel's view of this process, as the daemon saw it
        self._token: bytes | None = None  # from the last hello reply: good once, on the descriptor socket
        self._fd_socket = ""
        self._side: list[FdClient] = []  # the descriptor connection, once vouched
        self._curve = curve
        self._keepalive: threading.Thread | None = None
        own_context = context is None
        ctx = zmq.Context() if context is None else context
        self._ctx = ctx
        try:
            sock = ctx.socket(zmq.REQ)
        except BaseException:
            if own_context:
                ctx.term()
            raise
        # One bag: socket (and the context if we made it) are released together, even if we are leaked.
        self._sock = sock
        self._socks = [sock]
        self._finalizer = weakref.finalize(self, _close_resources, self._socks, ctx if own_context else None,
                                           self._stop_keepalive, self._side)
        try:
            self._connect(sock)
            if handshake:
                self.hello()
        except BaseException:
            self.close()
            raise

    def _connect(self, sock: zmq.Socket) -> None:
        sock.linger = 0
        sock.setsockopt(zmq.REQ_RELAXED, 1)
        sock.setsockopt(zmq.REQ_CORRELATE, 1)
        sock.setsockopt(zmq.IMMEDIATE, 1)  # queue nothing for a daemon we are not connected to
        sock.sndtimeo = self.handshake_timeout_ms
        if self._curve is not None:
            configure_client(sock, self._curve)
        try:
            sock.connect(self.endpoint)
        except zmq.ZMQError as exc:  # e.g. a tcp host name that does not resolve
            raise DaemonUnavailableError(self.endpoint, f"cannot connect to {self.endpoint}: {exc.strerror}") \
                from None

    def reconnect(self, timeout_ms: int | None = None) -> dict[str, Any]:
        """Greet the daemon at the same endpoint anew (one that restarted): a fresh socket, ``hello`` and,
        over ipc, a new descriptor connection; the session starts over from ``hello`` (join again). Raises
        :class:`DaemonUnavailableError` while no daemon answers within ``timeout_ms`` (default: the
        handshake timeout)."""
        with self._lock:
            if self.closed:
                raise DaemonUnavailableError(self.endpoint, f"connection to transportd at {self.endpoint} is closed")
            while self._side:
                self._side.pop().close()
            old = self._socks.pop()
            old.close(linger=0)
            sock = self._ctx.socket(zmq.REQ)
            self._socks.append(sock)
            self._sock = sock
            self._connect(sock)
            self.session = SessionRules()
            self._suspect = None
            self._token = None
            self.hello_reply = {}
        saved = self.handshake_timeout_ms
        if timeout_ms is not None:
            self.handshake_timeout_ms = sock.sndtimeo = timeout_ms
        try:
            return self.hello()
        finally:
            self.handshake_timeout_ms = sock.sndtimeo = saved

    # --- requests ------------------------------------------------------------------------------------

    def hello(self) -> dict[str, Any]:
        """The bounded startup handshake; returns the daemon's hello reply fields."""
        req = Hello(pid=os.getpid(), name=self._name, pid_ns=pid_namespace())
        try:
            self.hello_reply = self.request(req, timeout_ms=self.handshake_timeout_ms)
        except DaemonUnavailableError as exc:
            raise DaemonUnavailableError(self.endpoint, self._not_running_message()) from exc
        if self._token is not None:
            self.vouch()
        interval = float(self.hello_reply.get("keepalive_s") or 0)
        if interval > 0 and (self._keepalive is None or not self._keepalive.is_alive()):
            self._keepalive = threading.Thread(target=_keepalive, args=(weakref.ref(self), self._stop_keepalive,
                                                                        interval),
                                               name="transportd-keepalive", daemon=True)
            self._keepalive.start()
        return self.hello_reply

    def vouch(self) -> dict[str, Any]:
        """Present the last hello's token on the descriptor socket: the daemon takes this process's uid, gid
        and pid from the kernel (``hello`` does this itself). Returns what the daemon saw."""
        with self._lock:
            token, path = self._token, self.hello_reply.get("fd_socket") or self._fd_socket
            if token is None or not path:
                raise TransportdError("no hello token to present: say hello over an ipc endpoint first")
            self._token = None
            while self._side:  # a connection to an earlier daemon (this one said we had not vouched)
                self._side.pop().close()
            self._side.append(FdClient(str(path), timeout_s=self.timeout_ms / 1000))
            try:
                self.vouch_reply = self._side[0].vouch(token)
                return self.vouch_reply
            except RequestError:
                self._side.pop().close()
                raise

    def pass_fd(self, fd: int, kind: str = "memfd") -> int:
        """Hand ``fd`` to the daemon over the descriptor socket; returns the id a ``register`` names."""
        with self._lock:
            if not self._side:
                raise TransportdError(f"memory travels by descriptor over the local ipc socket; {self.endpoint} "
                                      "has no descriptor socket (host memory cannot be registered over tcp)")
            if self._side[0].peer_gone():
                raise SessionLostError(protocol.ReplyCode.NO_SESSION, "the daemon no longer knows this session: it "
                                       "stopped, restarted or ended the session (its descriptor connection "
                                       "closed); connect and join again")
            return self._side[0].pass_fd(fd, kind)

    def take_fd(self, fd_id: int, kind: str) -> int:
        """Take a descriptor the daemon offered in a reply (``fd``: a ring, flag array or IBGDA queue it
        made as an anonymous memfd); the caller owns and closes it."""
        with self._lock:
            if not self._side:
                raise TransportdError(f"rings and flag arrays travel by descriptor over the local ipc socket; "
                                      f"{self.endpoint} has no descriptor socket")
            return self._side[0].take_fd(fd_id, kind)

    def daemon_gone(self) -> bool:
        """The daemon closed this session's descriptor connection (it stopped, died or reclaimed us)."""
        side = self._side
        return bool(side) and side[0].peer_gone()

    def request(self, msg: Request | Mapping[str, Any], *, timeout_ms: int | None = None) -> dict[str, Any]:
        """Send one request and return the reply's fields.

        Raises :class:`RequestError` for an error reply, :class:`LocalProtocolError` when a :class:`Request`
        is not allowed in the session's state, :class:`DaemonTimeoutError` when no reply comes in time.
        A plain dict is sent as is (no state check), which is how tests send malformed messages.
        """
        with self._lock:
            return self._request(msg, timeout_ms)

    def _request(self, msg: Request | Mapping[str, Any], timeout_ms: int | None) -> dict[str, Any]:
        self._ensure_alive()
        timeout = self.timeout_ms if timeout_ms is None else timeout_ms
        op = msg.op if isinstance(msg, Request) else str(msg.get("op", "?"))
        if isinstance(msg, Request):
            self.session.check(op)
            payload = codec.encode(msg.to_msg())
        else:
            payload = codec.encode(dict(msg))
        self._exchange(payload, op, timeout)
        reply = self._receive(op, timeout)
        try:
            fields = protocol.parse_reply(reply)  # raises RequestError for error replies
        except RequestError as exc:
            if exc.code == protocol.ReplyCode.NO_SESSION:
                raise SessionLostError(exc.code, exc.message) from None
            raise
        if isinstance(msg, Request):
            self.session.advance(op)
        if op == "hello" and isinstance(fields.get("token"), bytes) and not fields.get("vouched"):
            self._token, self._fd_socket = fields["token"], str(fields.get("fd_socket") or "")
        return fields

    def _exchange(self, payload: bytes, op: str, timeout_ms: int) -> None:
        self._last_sent = time.monotonic()
        try:
            self._sock.send(payload)
        except zmq.Again:
            self._suspect = f"could not send '{op}' within {self._sock.sndtimeo / 1000:.1f} s"
            raise DaemonTimeoutError(
                self.endpoint, f"transportd at {self.endpoint} is not accepting requests ({self._suspect}). "
                + _START_HINT) from None

    def _receive(self, op: str, timeout_ms: int) -> dict[str, Any]:
        if not self._sock.poll(timeout_ms, zmq.POLLIN):
            self._suspect = f"no reply to '{op}' within {timeout_ms / 1000:.1f} s"
            raise DaemonTimeoutError(
                self.endpoint, f"transportd at {self.endpoint} did not answer ({self._suspect}); it may be hung "
                "or overloaded: check its log (`journalctl -u transportd`)")
        data = self._sock.recv()
        self._suspect = None
        return codec.decode(data, _MAX_REPLY_BYTES)

    # --- liveness ------------------------------------------------------------------------------------

    def ensure_alive(self) -> None:
        """Raise :class:`DaemonUnavailableError` now rather than hang later when the daemon is gone.

        Cheap when all is well; after a timed-out request it pings the daemon once (bounded by the
        handshake timeout) before letting another request through.
        """
        with self._lock:
            self._ensure_alive()

    def _ensure_alive(self) -> None:
        if not self._finalizer.alive:
            raise DaemonUnavailableError(self.endpoint, f"connection to transportd at {self.endpoint} is closed")
        path = _ipc_path(self.endpoint)
        if path is not None and self.session.state is not protocol.SessionState.NEW and not os.path.exists(path):
            raise DaemonUnavailableError(
                self.endpoint, f"transportd at {self.endpoint} has exited (socket file {path} is gone). "
                + _START_HINT)
        if self._suspect is not None:
            suspect, self._suspect = self._suspect, None
            try:
                self._heartbeat()
            except TransportdError as exc:
                self._suspect = suspect
                raise DaemonUnavailableError(
                    self.endpoint, f"transportd at {self.endpoint} stopped answering ({suspect}, and a "
                    f"heartbeat got no reply either). " + _START_HINT) from exc

    def _heartbeat(self) -> None:
        """One heartbeat round trip, bounded by the handshake timeout (the caller holds the lock)."""
        self._exchange(codec.encode(Heartbeat().to_msg()), "heartbeat", self.handshake_timeout_ms)
        protocol.parse_reply(self._receive("heartbeat", self.handshake_timeout_ms))

    def keepalive(self, interval_s: float) -> None:
        """Send a heartbeat if nothing went to the daemon for ``interval_s``; skipped while a request is out
        (the daemon is serving us). A failure marks the daemon suspect, so the next request checks it."""
        if not self._lock.acquire(blocking=False):
            return
        try:
            if self.closed or time.monotonic() - self._last_sent < interval_s:
                return
            self._heartbeat()
        except TransportdError:
            pass  # _exchange/_receive noted why in _suspect
        finally:
            self._lock.release()

    def _not_running_message(self) -> str:
        seconds = self.handshake_timeout_ms / 1000
        detail = ""
        path = _ipc_path(self.endpoint)
        if path is not None:
            kind = not_a_socket(path)
            if kind:
                return f"{path} is {kind}, not a control socket: {_SOCKET_FILE}"
            detail = _socket_file_problem(path)
        elif self.endpoint.startswith("tcp://") and (problem := _tcp_listener_problem(self.endpoint, self._curve)):
            return f"no reply to hello from {self.endpoint} within {seconds:.1f} s: {problem}"
        return (f"transportd is not running at {self.endpoint} (no reply to hello within {seconds:.1f} s"
                f"{'; ' + detail if detail else ''}). " + _START_HINT)

    # --- lifetime ------------------------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        """True once :meth:`close` ran (or the object was collected)."""
        return not self._finalizer.alive

    def close(self) -> None:
        """Release the socket (and the context if this connection created it). Does not send ``leave``."""
        self._stop_keepalive.set()
        with self._lock:  # a heartbeat in flight finishes first
            self._finalizer()

    def __enter__(self) -> ControlConnection:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else self.session.state.value
        return f"ControlConnection({self.endpoint!r}, {state})"


def _keepalive(ref: weakref.ReferenceType[ControlConnection], stop: threading.Event, interval_s: float) -> None:
    """The keepalive thread: holds the connection only while it sends, so a dropped one is still collected."""
    while not stop.wait(interval_s / 2):
        conn = ref()
        if conn is None:
            return
        conn.keepalive(interval_s)
        del conn


def _ipc_path(endpoint: str) -> str | None:
    if endpoint.startswith("ipc://") and not endpoint.startswith("ipc://@"):
        return endpoint[len("ipc://"):]
    return None


_SOCKET_FILE = "give the daemon's control socket file (control.socket, by default ipc:///run/transportd/control.sock)"


def not_a_socket(path: str) -> str | None:
    """What ``path`` is when it exists and is not a socket ("a directory", "a regular file", ...); else None."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return None
    if stat.S_ISSOCK(mode):
        return None
    return "a directory" if stat.S_ISDIR(mode) else "a regular file" if stat.S_ISREG(mode) else "not a socket"


def _tcp_listener_problem(endpoint: str, curve: bool) -> str | None:
    """Why a tcp endpoint that accepts connections gave no hello reply; None when nothing accepts them (then
    the daemon is simply not running there)."""
    host, _, port = endpoint[len("tcp://"):].rpartition(":")
    try:
        _socket.create_connection((host.strip("[]"), int(port)), timeout=1.0).close()
    except (OSError, ValueError):
        return None
    if curve:
        return ("something accepts connections there but the CURVE handshake found no daemon: the server key is "
                "not this daemon's, or this client's public key is not in its security.curve_authorized_keys_dir")
    return ("something accepts connections there but did not answer: a control socket that needs CURVE keys "
            "(transportctl --curve-secret-key and --curve-server-key), or not a control socket at all (peers.listen, "
            "the peer port, is for other daemons, not clients)")


def _socket_file_problem(path: str) -> str:
    """Why a client may fail to reach an ipc socket file, in words an operator can act on."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return f"socket file {path} does not exist"
    except PermissionError:
        return f"no permission to look up {path}: check the directory's permissions"
    if not os.access(path, os.R_OK | os.W_OK):
        try:
            group = grp.getgrgid(st.st_gid).gr_name
        except KeyError:
            group = str(st.st_gid)
        return (f"no permission to use {path} (mode {oct(st.st_mode & 0o777)}, group {group}): "
                f"add this user to group {group} or set control.group")
    return f"socket file {path} exists but nothing answered: a stale socket from a daemon that died?"
