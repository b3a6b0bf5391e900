"""The descriptor socket: the Unix socket next to the control socket that carries what zmq cannot.

zmq carries no file descriptors and no peer credentials. Over ipc, the daemon therefore also listens on
``<control socket>.fds`` (same directory, same mode and group), an ``AF_UNIX`` ``SOCK_SEQPACKET`` socket:

- a client presents the one-time token of its ``hello`` reply (:class:`~transportd.control.protocol.Vouch`); the
  kernel's view of the connection (``SO_PEERCRED``: uid, gid, pid; ``SO_PEERGROUPS``) becomes the zmq
  session's identity, and the session lasts no longer than this connection;
- it hands over memory as descriptors (:class:`~transportd.control.protocol.PassFd`, ``SCM_RIGHTS``): a memfd for
  host memory, later a dma-buf fd for GPU memory on a real NIC; a ``register`` names the returned id;
- it takes the memory the daemon made for it (:class:`~transportd.control.protocol.TakeFd`): its rings, flag array
  and IBGDA queues are anonymous memfds, offered by id in a control reply and attached to this reply.

A connection that has not vouched holds a descriptor and a slot of the daemon's poll set and nothing else;
it may stay ``vouch_timeout_s`` at most, and at most ``max_unvouched`` wait at once (a quarter of those per
uid, as the kernel names it): past that, a new one pushes out the oldest of its own uid, or of the uid
holding the most, so a flood from one uid delays no other's clients.

Messages are msgpack maps (the control plane's codec and envelope, validated by
:func:`transportd.control.protocol.parse_side_message`); each carries at most one descriptor. This module is the
I/O shell on both sides: :class:`FdServer` (the daemon's main loop polls it) and :class:`FdClient`.
"""

from __future__ import annotations

import array
import errno
import logging
import os
import select
import socket
import struct
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from cmd_ring import codec, protocol
from cmd_ring.errors import ProtocolError, RequestError, TransportdError
from cmd_ring.protocol import PassFd, ReplyCode, SideMessage, TakeFd, Vouch

__all__ = ["FD_SOCKET_SUFFIX", "FdClient", "FdServer", "PeerCredentials", "SideConnection", "SideHandler",
           "fd_socket_for", "is_memfd", "peer_credentials"]

# the logger keeps the name it had before this module was named for the descriptor socket: log queries select on it
log = logging.getLogger("transportd.control.fdchannel")

FD_SOCKET_SUFFIX = ".fds"
MAX_SIDE_MESSAGE = 4096  #: bytes of one descriptor-socket message (they are tiny)
MAX_PENDING_FDS = 256  #: descriptors one connection may hold unregistered (and, apart, offered and not taken)
VOUCH_TIMEOUT_S = 5.0  #: default: seconds a connection may stay without vouching (control.vouch_timeout_s)
MAX_UNVOUCHED = 64  #: default: connections without a vouch at once (control.max_unvouched)
_SO_PEERGROUPS = getattr(socket, "SO_PEERGROUPS", 59)  # Linux >= 4.13
_MAX_FDS_READ = 4  # read a few, so a message carrying too many is noticed (and every one closed)
_HANGUP = select.POLLHUP | select.POLLERR | getattr(select, "POLLRDHUP", 0x2000)  # the peer closed its end


def fd_socket_for(endpoint: str) -> str | None:
    """The descriptor socket beside an ``ipc://`` control endpoint (``@name`` stays abstract); None for tcp."""
    if not endpoint.startswith("ipc://"):
        return None
    return endpoint[len("ipc://"):] + FD_SOCKET_SUFFIX


def _address(path: str) -> str:
    return "\0" + path[1:] if path.startswith("@") else path


@dataclass(frozen=True)
class PeerCredentials:
    """What the kernel says about the process at the other end of a Unix socket (at connect time)."""

    uid: int
    gid: int
    pid: int  #: in the reader's pid namespace; 0 when that process is not visible there
    groups: tuple[int, ...] = ()  #: supplementary groups (SO_PEERGROUPS), where the kernel tells

    def in_group(self, gid: int) -> bool:
        return self.gid == gid or gid in self.groups


def peer_credentials(sock: socket.socket) -> PeerCredentials:
    """``SO_PEERCRED`` (and ``SO_PEERGROUPS``) of a connected Unix socket."""
    pid, uid, gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                        struct.calcsize("3i")))
    groups: tuple[int, ...] = ()
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, _SO_PEERGROUPS, 4 * 1024)
        groups = tuple(array.array("I", raw[: len(raw) // 4 * 4]))
    except OSError:
        pass  # an older kernel: the primary gid only
    return PeerCredentials(uid=uid, gid=gid, pid=pid, groups=groups)


def is_memfd(fd: int) -> bool:
    """The descriptor is an anonymous ``memfd_create`` file (no path anyone else could open)."""
    try:
        return os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:")
    except OSError:
        return False


def _send(sock: socket.socket, msg: dict[str, Any], fds: Sequence[int] = ()) -> None:
    payload = codec.encode(msg)
    if fds:
        socket.send_fds(sock, [payload], list(fds))
    else:
        sock.send(payload)


def _receive(sock: socket.socket) -> tuple[bytes, list[int], bool]:
    """One message: ``(payload, descriptors, truncated)``; an empty payload without descriptors is EOF."""
    data, fds, flags, _addr = socket.recv_fds(sock, MAX_SIDE_MESSAGE + 1, _MAX_FDS_READ)
    truncated = bool(flags & (getattr(socket, "MSG_TRUNC", 0x20) | getattr(socket, "MSG_CTRUNC", 0x8)))
    return data, fds, truncated or len(data) > MAX_SIDE_MESSAGE


def _close_all(fds: Sequence[int]) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


@dataclass(eq=False)
class SideConnection:
    """One client's descriptor connection, as the daemon sees it."""

    sock: socket.socket
    creds: PeerCredentials
    client_id: bytes | None = None  #: the control session it vouched for
    fds: dict[int, int] = field(default_factory=dict)  #: id -> descriptor, passed and not registered yet
    offered: dict[int, tuple[str, int]] = field(default_factory=dict)  #: id -> (kind, descriptor) to take
    next_id: int = 0
    accepted_at: float = field(default_factory=time.monotonic)

    def offer(self, fd: int, kind: str) -> int:
        """Hold ``fd`` (owned from now on) for the client to take (:class:`TakeFd`); returns its id."""
        if len(self.offered) >= MAX_PENDING_FDS:
            os.close(fd)
            raise RequestError(ReplyCode.LIMIT, f"{MAX_PENDING_FDS} descriptors offered and not taken: take them "
                                                "(op 'take_fd' on the descriptor socket) first")
        fd_id = self.next_id
        self.next_id += 1
        self.offered[fd_id] = (kind, fd)
        return fd_id

    def withdraw(self, fd_id: int) -> None:
        """Close an offer not taken (what it gave is gone)."""
        entry = self.offered.pop(fd_id, None)
        if entry is not None:
            _close_all([entry[1]])

    def take(self, fd_id: int) -> int:
        """The descriptor passed with id ``fd_id`` (the caller owns it now)."""
        fd = self.fds.pop(fd_id, None)
        if fd is None:
            raise RequestError(ReplyCode.NOT_FOUND, f"no descriptor {fd_id} was passed on this session's descriptor "
                                                    "socket (or it was registered already)")
        return fd

    def close(self) -> None:
        _close_all(list(self.fds.values()) + [fd for _kind, fd in self.offered.values()])
        self.fds.clear()
        self.offered.clear()
        self.sock.close()


class SideHandler(Protocol):
    """What the daemon implements for the descriptor socket."""

    def on_vouch(self, conn: SideConnection, req: Vouch) -> dict[str, Any]: ...
    def on_side_closed(self, conn: SideConnection) -> None: ...


class FdServer:
    """The daemon's descriptor socket: accept, read, answer; never blocks, never dies of bad input."""

    def __init__(self, path: str, handler: SideHandler, *, mode: int = 0o660, group: str | None = None,
                 vouch_timeout_s: float = VOUCH_TIMEOUT_S, max_unvouched: int = MAX_UNVOUCHED) -> None:
        from transportd.control.server import _set_permissions  # the control socket's own rules

        self.path = path
        self.handler = handler
        self.connections: list[SideConnection] = []
        self.vouch_timeout_s = vouch_timeout_s
        self.max_unvouched = max_unvouched
        self.max_unvouched_per_uid = max(1, max_unvouched // 4)
        self.unvouched: dict[SideConnection, None] = {}  # in accept order: the oldest first
        self.unvouched_dropped = 0  # closed for waiting too long or for a newer one
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        try:
            if not path.startswith("@"):
                try:
                    os.unlink(path)  # the control socket's bind already refused a live daemon's
                except FileNotFoundError:
                    pass
            self._listener.bind(_address(path))
            self._listener.listen(64)
            self._listener.setblocking(False)
            if not path.startswith("@"):
                _set_permissions(path, mode, group)
        except BaseException:
            self._listener.close()
            raise
        self._poller = select.poll()
        self._poller.register(self._listener, select.POLLIN)
        self._by_fd: dict[int, SideConnection] = {}
        log.info("descriptor socket listening on %s", path)

    def poll(self, timeout_ms: int = 0) -> int:
        """Accept and serve what is waiting (at most a batch); returns how many events were handled."""
        handled = 0
        for fileno, events in self._poller.poll(timeout_ms):
            if fileno == self._listener.fileno():
                self._accept()
            elif fileno in self._by_fd:
                self._serve(self._by_fd[fileno], events)
            handled += 1
        self._expire_unvouched()
        return handled

    def _expire_unvouched(self) -> None:
        if not self.unvouched:
            return
        deadline = time.monotonic() - self.vouch_timeout_s
        for conn in list(self.unvouched):
            if conn.accepted_at > deadline:
                break  # accept order: every later one is younger
            self._drop_unvouched(conn, f"no valid vouch within {self.vouch_timeout_s:g}s (control.vouch_timeout_s)")

    def _make_room(self, uid: int) -> None:
        """Before a new connection of ``uid`` waits for its vouch: keep within the caps (module doc)."""
        per_uid = Counter(c.creds.uid for c in self.unvouched)
        if per_uid[uid] >= self.max_unvouched_per_uid:
            victim_uid = uid
        elif len(self.unvouched) >= self.max_unvouched:
            victim_uid = per_uid.most_common(1)[0][0]
        else:
            return
        oldest = next(c for c in self.unvouched if c.creds.uid == victim_uid)
        self._drop_unvouched(oldest, f"too many connections waiting to vouch (uid {victim_uid}: "
                                     f"{per_uid[victim_uid]}, all: {len(self.unvouched)}); the oldest goes")

    def _drop_unvouched(self, conn: SideConnection, why: str) -> None:
        self.unvouched_dropped += 1
        # once per burst at info: a flood must not flood the log
        level = logging.INFO if self.unvouched_dropped & (self.unvouched_dropped - 1) == 0 else logging.DEBUG
        log.log(level, "descriptor socket: closed a connection of uid %d pid %d: %s (%d so closed)",
                conn.creds.uid, conn.creds.pid, why, self.unvouched_dropped)
        self._drop(conn)

    def _accept(self) -> None:
        for _ in range(64):
            try:
                sock, _addr = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                log.warning("descriptor socket: accept failed: %s", exc)
                return
            sock.setblocking(False)
            try:
                creds = peer_credentials(sock)
            except OSError:
                sock.close()
                continue
            self._make_room(creds.uid)
            conn = SideConnection(sock, creds)
            self.unvouched[conn] = None
            self.connections.append(conn)
            self._by_fd[sock.fileno()] = conn
            self._poller.register(sock, select.POLLIN)

    def _serve(self, conn: SideConnection, events: int) -> None:
        for _ in range(16):  # a few messages per poll, so one client cannot starve the loop
            try:
                data, fds, truncated = _receive(conn.sock)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno not in (errno.ECONNRESET, errno.EPIPE):
                    log.info("descriptor socket: uid %d pid %d: %s", conn.creds.uid, conn.creds.pid, exc)
                self._drop(conn)
                return
            if not data and not fds:
                self._drop(conn)  # EOF: the client closed it, or its process is gone
                return
            reply, handed = self._dispatch(conn, data, fds, truncated)
            try:
                _send(conn.sock, reply, handed)
            except OSError:
                self._drop(conn)
                return
            finally:
                _close_all(handed)  # the client has its own copy now (or the connection is gone)

    def _dispatch(self, conn: SideConnection, data: bytes, fds: list[int], truncated: bool
                  ) -> tuple[dict[str, Any], list[int]]:
        """The reply to one message, and the descriptors to attach to it (closed here once sent)."""
        owned = list(fds)
        try:
            if truncated:
                raise RequestError(ReplyCode.TOO_LARGE, f"a descriptor-socket message holds at most "
                                                        f"{MAX_SIDE_MESSAGE} bytes and one descriptor")
            req = protocol.parse_side_message(codec.decode(data, MAX_SIDE_MESSAGE), len(fds))
            if isinstance(req, Vouch):
                reply = protocol.ok(**self.handler.on_vouch(conn, req))
                self.unvouched.pop(conn, None)
                return reply, []
            if conn.client_id is None:
                raise RequestError(ReplyCode.NO_IDENTITY, "vouch for a control session (op 'vouch' with the hello "
                                                          "token) before passing descriptors")
            if isinstance(req, TakeFd):
                entry = conn.offered.pop(req.fd, None)
                if entry is None:
                    raise RequestError(ReplyCode.NOT_FOUND, f"this session was offered no descriptor {req.fd} (or "
                                                            "took it already)")
                return protocol.ok(fd=req.fd, kind=entry[0]), [entry[1]]
            assert isinstance(req, PassFd)
            if len(conn.fds) >= MAX_PENDING_FDS:
                raise RequestError(ReplyCode.LIMIT, f"{MAX_PENDING_FDS} descriptors passed and not registered: "
                                                    "register them (or end the session) first")
            fd_id = conn.next_id
            conn.next_id += 1
            conn.fds[fd_id] = owned.pop()
            return protocol.ok(fd=fd_id), []
        except (RequestError, ProtocolError) as exc:
            log.info("descriptor socket: uid %d pid %d refused: %s", conn.creds.uid, conn.creds.pid, exc)
            return protocol.error_reply_for(exc), []
        except Exception as exc:  # noqa: BLE001 - bad input must never stop the daemon
            log.error("descriptor socket: request failed inside the daemon", exc_info=exc)
            return protocol.error_reply_for(exc), []
        finally:
            _close_all(owned)

    def _drop(self, conn: SideConnection) -> None:
        if conn not in self.connections:
            return
        self.connections.remove(conn)
        self.unvouched.pop(conn, None)
        fileno = conn.sock.fileno()
        self._by_fd.pop(fileno, None)
        try:
            self._poller.unregister(fileno)
        except (KeyError, ValueError):
            pass
        try:
            self.handler.on_side_closed(conn)
        except Exception:
            log.exception("descriptor socket: ending uid %d pid %d failed", conn.creds.uid, conn.creds.pid)
        conn.close()

    def drop(self, conn: SideConnection) -> None:
        """Close ``conn`` from the daemon's side (its session was reclaimed)."""
        self._drop(conn)

    def close(self) -> None:
        for conn in list(self.connections):
            self.connections.remove(conn)
            conn.close()
        self.unvouched.clear()
        self._listener.close()
        if not self.path.startswith("@"):
            try:
                os.unlink(self.path)
            except OSError:
                pass


class FdClient:
    """A client's descriptor connection (the client library opens one per control session)."""

    def __init__(self, path: str, timeout_s: float = 5.0) -> None:
        self.path = path
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        self._sock.settimeout(timeout_s)
        try:
            self._sock.connect(_address(path))
        except OSError as exc:
            self._sock.close()
            raise TransportdError(f"cannot connect to the daemon's descriptor socket {path}: {exc.strerror}") from exc

    def request(self, msg: SideMessage, fds: Sequence[int] = ()) -> dict[str, Any]:
        """Send one message (with ``fds`` attached) and return the reply's fields (RequestError if refused)."""
        reply, extra = self._request(msg, fds)
        _close_all(extra)
        return reply

    def _request(self, msg: SideMessage, fds: Sequence[int] = ()) -> tuple[dict[str, Any], list[int]]:
        try:
            _send(self._sock, msg.to_msg(), fds)
            data, extra, _truncated = _receive(self._sock)
        except OSError as exc:
            raise TransportdError(f"descriptor socket {self.path}: {exc.strerror or exc}") from exc
        if not data:
            _close_all(extra)
            raise TransportdError(f"descriptor socket {self.path}: the daemon closed the connection")
        try:
            return protocol.parse_reply(codec.decode(data, MAX_SIDE_MESSAGE)), extra
        except BaseException:
            _close_all(extra)
            raise

    def vouch(self, token: bytes) -> dict[str, Any]:
        return self.request(Vouch(token=token))

    def pass_fd(self, fd: int, kind: str = "memfd") -> int:
        """Hand ``fd`` to the daemon (it gets its own copy); returns the id a ``register`` names."""
        return int(self.request(PassFd(kind=kind), [fd])["fd"])  # type: ignore[arg-type]

    def take_fd(self, fd_id: int, kind: str) -> int:
        """Take the descriptor the daemon offered as ``fd_id`` (a ``kind``: ring, flags, ibgda); the caller
        owns (and closes) it."""
        reply, extra = self._request(TakeFd(fd=fd_id))
        if len(extra) != 1 or reply.get("kind") != kind:
            _close_all(extra)
            raise TransportdError(f"descriptor socket {self.path}: take_fd {fd_id} brought {len(extra)} "
                                  f"descriptor(s) of kind {reply.get('kind')!r}, expected one {kind!r}")
        return extra[0]

    def peer_gone(self) -> bool:
        """The daemon's end is closed (it stopped or died): the kernel says so at once.

        A poll for the hang-up alone: it reads nothing, so a reply another thread is about to read (a request
        in flight on this connection) is neither consumed nor mistaken for the end."""
        try:
            poller = select.poll()
            poller.register(self._sock.fileno(), _HANGUP)
            return any(events & _HANGUP for _fd, events in poller.poll(0))
        except (OSError, ValueError):
            return True  # closed here, or the descriptor is gone

    def close(self) -> None:
        self._sock.close()
