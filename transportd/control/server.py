"""The control server: a thin zmq ROUTER shell around :mod:`transportd.control.protocol`.

:class:`ControlDispatcher` is the socket-free core; :class:`ControlServer` adds the ROUTER socket. Each
received message goes decode (:mod:`transportd.control.codec`) → parse (:func:`parse_request`) → session state
check (:data:`protocol.TRANSITIONS`) → the handler's ``on_<op>(client_id, request)`` → reply. Any failure
along the way becomes an error reply to that client and the server carries on serving everyone else
(docs/design.md, "Bad input hurts only its sender"). :meth:`ControlServer.poll` serves what is queued and
returns, so the daemon's main loop can interleave it with other work.

Envelopes: a REQ client arrives as ``[identity, (request-id,) b"", payload]``, a DEALER client as
``[identity, payload]`` or with the empty delimiter; the reply repeats whatever came before the payload.

A handler that cannot answer at once (``exchange`` waits for other ranks) calls :meth:`ControlServer.defer`
during ``on_<op>`` and later :meth:`ControlServer.complete` or :meth:`ControlServer.fail` with the token.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import socket as _socket
import stat
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Protocol

import zmq
from zmq.auth.thread import ThreadAuthenticator

from transportd.config import Config
from transportd.control import codec, protocol
from transportd.control.curve import CurveServerKeys, configure_server, start_authenticator
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
    Register,
    ReplyCode,
    Request,
    SessionRules,
    SessionState,
    Stats,
)
from transportd.errors import ConfigError, ProtocolError, RequestError, SocketGroupError, TransportdError

__all__ = ["BaseHandler", "ClientInfo", "ControlDispatcher", "ControlHandler", "ControlServer", "ReplyToken"]

log = logging.getLogger("transportd.control.server")

Reply = Mapping[str, Any] | None


class ControlHandler(Protocol):
    """What the daemon implements: one method per op, each returning the reply's fields (or None).

    Raise :class:`RequestError` to refuse with a code; anything else becomes an ``internal`` error reply.
    The server has already checked the session order (hello → join → ...), so a handler can rely on it.
    """

    def on_hello(self, client_id: bytes, req: Hello) -> Reply: ...
    def on_join(self, client_id: bytes, req: Join) -> Reply: ...
    def on_register(self, client_id: bytes, req: Register) -> Reply: ...
    def on_flags(self, client_id: bytes, req: Flags) -> Reply: ...
    def on_exchange(self, client_id: bytes, req: Exchange) -> Reply: ...
    def on_channel(self, client_id: bytes, req: Channel) -> Reply: ...
    def on_channel_info(self, client_id: bytes, req: ChannelInfo) -> Reply: ...
    def on_stats(self, client_id: bytes, req: Stats) -> Reply: ...
    def on_inspect(self, client_id: bytes, req: Inspect) -> Reply: ...
    def on_leave(self, client_id: bytes, req: Leave) -> Reply: ...
    def on_heartbeat(self, client_id: bytes, req: Heartbeat) -> Reply: ...
    def on_client_gone(self, client_id: bytes) -> None:
        """The client stopped talking (see :meth:`ControlServer.expire`): reclaim what it held."""


class BaseHandler:
    """A handler that greets and answers heartbeats and refuses the rest; subclass and override ops."""

    def on_hello(self, client_id: bytes, req: Hello) -> Reply:
        return {"version": protocol.V}

    def on_heartbeat(self, client_id: bytes, req: Heartbeat) -> Reply:
        return {"seq": req.seq}

    def on_client_gone(self, client_id: bytes) -> None:
        return None

    def _unsupported(self, client_id: bytes, req: Request) -> Reply:
        raise RequestError(ReplyCode.UNSUPPORTED, f"this daemon does not implement '{req.op}'")

    on_join = on_register = on_flags = on_exchange = on_channel = on_channel_info = _unsupported
    on_stats = on_inspect = on_leave = _unsupported


@dataclass
class ClientInfo:
    """What the server knows of one client connection (keyed by its zmq identity)."""

    session: SessionRules = field(default_factory=SessionRules)
    first_seen: float = 0.0
    last_seen: float = 0.0
    requests: int = 0
    errors: int = 0
    user_id: str = ""  #: the ZAP User-Id of its connection: the z85 CURVE public key over tcp with CURVE


@dataclass(frozen=True, eq=False)
class ReplyToken:
    """Where a deferred reply goes: the envelope of the request it answers (compared by identity)."""

    client_id: bytes
    op: str
    envelope: tuple[bytes, ...]


class ControlDispatcher:
    """The server's protocol core, no sockets: payload in, reply map out (tests drive it directly).

    Owns the per-client table (session state, last seen, counters) and the deferred requests.
    """

    def __init__(self, handler: ControlHandler, *, max_message_bytes: int = 1 << 20,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.handler = handler
        self.max_message_bytes = max_message_bytes
        self._clock = clock
        self._clients: dict[bytes, ClientInfo] = {}
        self._current: tuple[bytes, str, tuple[bytes, ...]] | None = None
        self._deferred: set[ReplyToken] = set()
        self._deferred_now: ReplyToken | None = None

    def handle(self, client_id: bytes, payload: bytes, envelope: tuple[bytes, ...] = (), *,
               user_id: str = "") -> dict[str, Any] | None:
        """Serve one request payload; the reply map to send, or None when the handler deferred it.

        ``user_id`` is what the transport vouches for (zmq's User-Id: a CURVE client's public key).
        """
        op = "?"
        info = self._clients.get(client_id)
        try:
            msg = codec.decode(payload, self.max_message_bytes)
            req = protocol.parse_request(msg)
            op = req.op
            now = self._clock()
            if info is None:
                info = self._clients[client_id] = ClientInfo(first_seen=now, user_id=user_id)
            elif info.user_id != user_id:  # a zmq identity is not a key: another key may not take it over
                raise RequestError(ReplyCode.FORBIDDEN, "this connection's identity belongs to another key")
            info.last_seen = now
            info.requests += 1
            refusal = info.session.refuse_reason(op)
            if refusal is not None and info.session.state is SessionState.NEW:
                # only a client that said hello to an earlier daemon, or whose session expired, skips it
                log.debug("no session for client %s: %s", client_id.hex(), refusal)
                raise RequestError(ReplyCode.NO_SESSION, "the daemon no longer knows this session: it restarted, "
                                   "or ended the session (the client was silent past control.client_timeout_s "
                                   "or its process looked gone); connect and join again")
            if refusal is not None:
                raise RequestError(ReplyCode.BAD_STATE, refusal)
            method = getattr(self.handler, f"on_{op}", None)
            if method is None:
                raise RequestError(ReplyCode.UNSUPPORTED, f"this daemon does not implement '{op}'")
            self._current = (client_id, op, envelope or (client_id,))
            self._deferred_now = None
            try:
                fields = method(client_id, req)
            except Exception:
                if self._deferred_now is not None:
                    self._deferred.discard(self._deferred_now)  # it failed after all: answer now
                raise
            finally:
                token, self._current, self._deferred_now = self._deferred_now, None, None
            if token is not None:
                return None
            reply = protocol.ok(**(fields or {}))
            info.session.advance(op)
            return reply
        except Exception as exc:  # every failure becomes an error reply; the server keeps serving
            if info is not None:
                info.errors += 1
            return _error_reply(client_id, op, exc)

    # --- deferred replies ----------------------------------------------------------------------------

    def defer(self) -> ReplyToken:
        """Inside ``on_<op>``: answer later through :meth:`complete` / :meth:`fail` instead of returning now."""
        if self._current is None:
            raise RuntimeError("defer() is only valid while a handler method is running")
        if self._deferred_now is None:
            self._deferred_now = ReplyToken(*self._current)
            self._deferred.add(self._deferred_now)
        return self._deferred_now

    def complete(self, token: ReplyToken, fields: Mapping[str, Any] | None = None) -> dict[str, Any] | None:
        """The success reply for a deferred request (advancing that session), or None if the client is gone."""
        self._deferred.discard(token)
        info = self._clients.get(token.client_id)
        if info is None:
            return None  # the client expired meanwhile; nobody is waiting
        try:
            reply = protocol.ok(**(fields or {}))
        except ProtocolError as exc:
            info.errors += 1
            return _error_reply(token.client_id, token.op, exc)
        info.session.advance(token.op)
        return reply

    def fail(self, token: ReplyToken, exc: Exception) -> dict[str, Any] | None:
        """The error reply for a deferred request, or None if the client is gone."""
        self._deferred.discard(token)
        info = self._clients.get(token.client_id)
        if info is None:
            return None
        info.errors += 1
        return _error_reply(token.client_id, token.op, exc)

    @property
    def pending(self) -> frozenset[ReplyToken]:
        """Deferred requests not yet answered."""
        return frozenset(self._deferred)

    # --- liveness ------------------------------------------------------------------------------------

    @property
    def clients(self) -> Mapping[bytes, ClientInfo]:
        """Known clients by zmq identity (read-only view)."""
        return MappingProxyType(self._clients)

    def drop(self, client_id: bytes) -> None:
        """Forget a client whose session the handler ended itself (its process exited, its descriptor
        connection closed): no ``on_client_gone`` now, and none when it would have turned silent later."""
        self._clients.pop(client_id, None)
        self._deferred = {t for t in self._deferred if t.client_id != client_id}

    def expire(self, timeout_s: float, keep: Collection[bytes] = ()) -> list[bytes]:
        """Forget clients silent for more than ``timeout_s``, calling ``handler.on_client_gone`` for each.

        A client whose request the handler deferred is waiting for us, not silent: it is kept, as are those
        in ``keep`` (the caller knows them alive by other means).
        """
        now = self._clock()
        waiting = {t.client_id for t in self._deferred}
        gone = [cid for cid, info in self._clients.items()
                if now - info.last_seen > timeout_s and cid not in waiting and cid not in keep]
        for cid in gone:
            del self._clients[cid]
            self._deferred = {t for t in self._deferred if t.client_id != cid}
            log.info("client %s silent for more than %.1f s: reclaiming", cid.hex(), timeout_s)
            try:
                self.handler.on_client_gone(cid)
            except Exception:
                log.exception("reclaiming client %s failed", cid.hex())
        return gone


def _error_reply(client_id: bytes, op: str, exc: Exception) -> dict[str, Any]:
    reply = protocol.error_reply_for(exc)
    if isinstance(exc, RequestError | ProtocolError):
        log.info("client %s op %s refused: %s: %s", client_id.hex(), op, reply["code"], reply["message"])
    else:
        log.error("client %s op %s failed inside the daemon", client_id.hex(), op, exc_info=exc)
    return reply


_SERVE_BATCH = 64  # messages per poll() call, so one chatty client cannot starve the daemon's loop


class ControlServer:
    """The daemon's client socket: bind, receive, dispatch, reply; never dies of bad input."""

    def __init__(
        self,
        endpoint: str,
        handler: ControlHandler,
        *,
        max_message_bytes: int = 1 << 20,
        mode: int = 0o660,
        group: str | None = None,
        curve: CurveServerKeys | None = None,
        zap: bool = True,
        context: zmq.Context | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """Bind ``endpoint`` (``ipc://`` or ``tcp://``).

        For ipc, refuses to steal a socket another live daemon serves, then sets ``mode`` and ``group`` on
        the socket file. With ``curve``, the socket is a CURVE server and (with ``zap``) a ZAP thread on this
        server's context admits only the authorized keys; pass ``zap=False`` when the shared context already
        runs one.
        """
        self.dispatcher = ControlDispatcher(handler, max_message_bytes=max_message_bytes, clock=clock)
        self._own_context = context is None
        self._context = zmq.Context() if context is None else context
        self._auth: ThreadAuthenticator | None = None
        self._ipc_path: str | None = None
        self._closed = False
        self._bound = False
        self._sock: zmq.Socket | None = None
        try:
            sock = self._sock = self._context.socket(zmq.ROUTER)
            sock.linger = 0
            sock.router_mandatory = True  # a vanished client raises EHOSTUNREACH instead of silent loss
            # Oversized messages below 4x the limit still get a too_large reply; beyond it zmq drops the peer.
            sock.maxmsgsize = 4 * max_message_bytes + 4096
            if curve is not None:
                if zap:
                    self._auth = start_authenticator(self._context, curve.authorized_keys_dir)
                configure_server(sock, curve)
            if endpoint.startswith("ipc://"):
                self._ipc_path = _prepare_ipc_path(endpoint[len("ipc://"):])
            elif endpoint.startswith("tcp://") and curve is None and not _is_loopback(endpoint):
                log.warning("control socket %s is tcp without CURVE: anyone who can reach it may use it", endpoint)
            sock.bind(endpoint)
            self._bound = True
            self.endpoint: str = sock.last_endpoint.decode()
            if self._ipc_path is not None and not self._ipc_path.startswith("@"):
                _set_permissions(self._ipc_path, mode, group)
        except BaseException:
            self.close()
            raise
        log.info("control server listening on %s", self.endpoint)

    @classmethod
    def from_config(cls, config: Config, handler: ControlHandler, *, context: zmq.Context | None = None
                    ) -> ControlServer:
        """A server with ``[control]`` settings; CURVE from ``[security]`` when the endpoint is tcp."""
        ctl = config.control
        curve = None
        if ctl.socket.startswith("tcp://"):
            curve = CurveServerKeys.from_config(config.security, config.source)
        try:
            return cls(ctl.socket, handler, max_message_bytes=ctl.max_message_bytes, mode=ctl.mode,
                       group=ctl.group, curve=curve, context=context)
        except SocketGroupError as exc:
            raise ConfigError(config.source, "control.group", str(exc)) from None

    @property
    def handler(self) -> ControlHandler:
        """The object whose ``on_<op>`` methods answer requests."""
        return self.dispatcher.handler

    # --- serving -------------------------------------------------------------------------------------

    def poll(self, timeout_ms: int = 0) -> int:
        """Wait up to ``timeout_ms`` for requests, serve those queued (at most a batch); return how many."""
        sock = self._socket
        if not sock.poll(timeout_ms, zmq.POLLIN):
            return 0
        served = 0
        while served < _SERVE_BATCH:
            try:
                parts = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            self._serve_one([p.bytes for p in parts], _user_id(parts[-1]))
            served += 1
        return served

    def _serve_one(self, frames: list[bytes], user_id: str = "") -> None:
        envelope = tuple(frames[:-1])
        if len(envelope) > 1 and envelope[-1] != b"":
            # Frames after the delimiter (or after the identity, for a DEALER sending none): not one payload.
            route = _route(frames)
            extra = len(frames) - len(route)
            self._send(route, protocol.error(ReplyCode.BAD_MESSAGE, f"expected one payload frame, got {extra}"))
            return
        reply = self.dispatcher.handle(frames[0], frames[-1], envelope, user_id=user_id)
        if reply is not None:
            self._send(envelope, reply)

    def _send(self, envelope: tuple[bytes, ...], reply: Mapping[str, Any]) -> None:
        try:
            payload = codec.encode(dict(reply))
        except ProtocolError as exc:
            log.error("reply to client %s could not be encoded: %s", envelope[0].hex(), exc)
            payload = codec.encode(protocol.error(ReplyCode.INTERNAL, f"reply could not be encoded: {exc}"))
        try:
            self._socket.send_multipart([*envelope, payload], zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            if exc.errno in (errno.EHOSTUNREACH, zmq.EAGAIN):
                log.info("reply to client %s dropped: %s", envelope[0].hex(), exc.strerror)
            else:
                raise

    # --- deferred replies and liveness (see ControlDispatcher) ---------------------------------------

    def defer(self) -> ReplyToken:
        """Inside ``on_<op>``: answer later with :meth:`complete` / :meth:`fail` instead of returning now."""
        return self.dispatcher.defer()

    def complete(self, token: ReplyToken, fields: Mapping[str, Any] | None = None) -> None:
        """Send the success reply for a deferred request and advance that client's session."""
        reply = self.dispatcher.complete(token, fields)
        if reply is not None:
            self._send(token.envelope, reply)

    def fail(self, token: ReplyToken, exc: Exception) -> None:
        """Send the error reply for a deferred request."""
        reply = self.dispatcher.fail(token, exc)
        if reply is not None:
            self._send(token.envelope, reply)

    @property
    def pending(self) -> frozenset[ReplyToken]:
        """Deferred requests not yet answered."""
        return self.dispatcher.pending

    @property
    def clients(self) -> Mapping[bytes, ClientInfo]:
        """Known clients by zmq identity (read-only view), with session state and last-seen time."""
        return self.dispatcher.clients

    def drop(self, client_id: bytes) -> None:
        """Forget a client whose session the handler ended itself (:meth:`ControlDispatcher.drop`)."""
        self.dispatcher.drop(client_id)

    def expire(self, timeout_s: float, keep: Collection[bytes] = ()) -> list[bytes]:
        """Forget clients silent for more than ``timeout_s`` (except those in ``keep``), calling
        ``handler.on_client_gone`` for each."""
        return self.dispatcher.expire(timeout_s, keep)

    def has_input(self) -> bool:
        """A request is queued on the socket, not served yet."""
        return bool(self._socket.poll(0, zmq.POLLIN))

    # --- lifetime ------------------------------------------------------------------------------------

    @property
    def _socket(self) -> zmq.Socket:
        if self._sock is None or self._closed:
            raise TransportdError("control server is closed")
        return self._sock

    def close(self) -> None:
        """Unbind and release the socket, removing the ipc socket file this server created."""
        if self._closed:
            return
        self._closed = True
        if self._sock is not None:
            self._sock.close(linger=0)
        if self._bound and self._ipc_path is not None and not self._ipc_path.startswith("@"):
            # libzmq leaves the file behind; remove it so clients see "not running" rather than a stale socket.
            try:
                os.unlink(self._ipc_path)
            except OSError:
                pass
        if self._auth is not None:
            self._auth.stop()
        if self._own_context:
            self._context.term()

    def __enter__(self) -> ControlServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _user_id(frame: zmq.Frame) -> str:
    """The User-Id ZAP gave the frame's connection ("" without ZAP, e.g. over ipc)."""
    try:
        return str(frame.get("User-Id") or "")
    except zmq.ZMQError:
        return ""


def _route(frames: list[bytes]) -> tuple[bytes, ...]:
    """The reply envelope of a malformed multi-frame message: up to its first empty delimiter, else the identity."""
    for i in range(1, len(frames)):
        if frames[i] == b"":
            return tuple(frames[: i + 1])
    return (frames[0],)


def _prepare_ipc_path(path: str) -> str:
    """Create the socket's directory and refuse a socket file some live process still serves."""
    if path.startswith("@"):
        return path  # Linux abstract namespace: no file, no permissions
    parent = os.path.dirname(path) or "."
    os.makedirs(parent, exist_ok=True)
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return path
    if not stat.S_ISSOCK(st.st_mode):
        raise TransportdError(f"{path} exists and is not a socket; remove it or choose another control.socket")
    probe = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
    try:
        probe.settimeout(0.5)
        probe.connect(path)
    except (ConnectionRefusedError, FileNotFoundError):
        return path  # stale socket from a daemon that died; zmq replaces it on bind
    except OSError as exc:
        raise TransportdError(f"cannot check whether {path} is in use: {exc.strerror}") from exc
    finally:
        probe.close()
    raise TransportdError(f"another process is serving {path}: is transportd already running?")


def _set_permissions(path: str, mode: int, group: str | None) -> None:
    if group is not None:
        try:
            shutil.chown(path, group=group)
        except LookupError:
            raise SocketGroupError(f"group {group!r} does not exist") from None
        except PermissionError:
            raise SocketGroupError(f"not allowed to give {path} to group {group!r} (run as root or a member)") from None
    os.chmod(path, mode)


def _is_loopback(endpoint: str) -> bool:
    host = endpoint[len("tcp://"):].rsplit(":", 1)[0]
    return host in ("127.0.0.1", "localhost", "[::1]", "::1")

