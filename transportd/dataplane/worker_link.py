"""The link between the daemon's main process and one proxy worker process (one per rail).

The main process owns clients, jobs and peers; a worker owns its rail's verbs resources (context, PD,
MRs, QPs) and the proxy loop, because work requests must be posted from the process that owns them.
The main process sends requests over a zmq PAIR socket and waits for the reply; the worker serves them
between proxy iterations, so a request costs the worker one poll. A request is one of the typed messages of
:mod:`transportd.dataplane.link_messages`; the worker decodes it with a typed decoder over the requests it
serves and calls the handler its table names for that type, so a malformed or unknown request is refused
with a clear error (and the worker goes on serving). A frame is a msgpack map: a request
``{"seq", "fds", "request"}``, a reply ``{"seq", "ok", "error", "fds", "reply"}``; ``seq`` pairs them.

Descriptors (a client's memfd, later a dma-buf fd) cannot travel over zmq: a call with ``fds`` sends them
first on a Unix ``SOCK_SEQPACKET`` socket beside the link (``fds`` in the same private directory, which
the worker connects to at start, ``SCM_RIGHTS``), and the request says how many to take (as many as its
type declares); the worker hands them to the handler, which owns them from its call on, even when it
fails. The other way, a reply with ``fds`` (descriptors the handler owns: an IBGDA domain's command
descriptor) has them sent on that socket before the reply, closed there, and reaches the caller as the
reply's ``fds``, which the caller then owns.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import socket
import tempfile
import time
from collections.abc import Callable, Mapping
from functools import cache
from typing import Any, Union

import msgspec
import zmq

from transportd.control import codec
from transportd.dataplane.link_messages import LinkRequest, Stop
from transportd.errors import WorkerError

__all__ = ["WorkerEndpoint", "WorkerHandle"]

log = logging.getLogger("transportd.worker")

MAX_FRAME = 64 << 20  # bytes in one frame either way; a stats reply of a busy rail stays far below this


class _RequestFrame(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    seq: int
    fds: int
    request: msgspec.Raw  # decoded apart, so a bad request still has its seq answered


class _ReplyFrame(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    seq: int | None  # None: the ready message, and the answer to a frame that was not one
    ok: bool
    error: str = ""
    fds: int = 0
    reply: msgspec.Raw = msgspec.Raw(b"\xc0")  # msgpack nil


_request_frames = msgspec.msgpack.Decoder(_RequestFrame)
_reply_frames = msgspec.msgpack.Decoder(_ReplyFrame)


@cache
def _reply_decoder(reply_type: Any) -> msgspec.msgpack.Decoder[Any]:
    return msgspec.msgpack.Decoder(reply_type)


def receive_fds(sock: socket.socket, op: str, count: int) -> list[int]:
    """The ``count`` descriptors sent with ``op`` on the link's descriptor socket (both ends use it). A
    message that names another op or carries another number of them raises OSError, every descriptor
    that did arrive closed."""
    name, fds, _flags, _addr = socket.recv_fds(sock, 256, count + 1)
    if name != op.encode() or len(fds) != count:
        for fd in fds:
            os.close(fd)
        raise OSError(f"{op}: expected {count} descriptor(s) for it, got {len(fds)} for {name!r}")
    return fds


class WorkerHandle:
    """The main process's end: start the worker process, call it, stop it."""

    def __init__(self, rail: int, target: Callable[..., None], kwargs: dict[str, Any], *,
                 start_timeout_s: float = 30.0, call_timeout_s: float = 30.0) -> None:
        self.rail = rail
        self.call_timeout_s = call_timeout_s
        self._ctx = zmq.Context.instance()
        self._dir = tempfile.mkdtemp(prefix=f"tpd-worker{rail}-")
        self.endpoint = f"ipc://{self._dir}/link"
        self._sock = self._ctx.socket(zmq.PAIR)
        self._sock.linger = 0
        self._sock.bind(self.endpoint)
        self._fd_listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        self._fd_listener.bind(f"{self._dir}/fds")
        self._fd_listener.listen(1)
        self._fd_sock: socket.socket | None = None  # accepted once the worker is ready
        self.process = mp.get_context("spawn").Process(
            target=target, kwargs={**kwargs, "link_endpoint": self.endpoint, "rail": rail},
            name=f"transportd-rail{rail}", daemon=True)
        self._seq = 0  # each call's number, echoed by the worker: a late reply is never taken for a later call's
        # called about every 50 ms while a call waits: the daemon keeps its peer heartbeats and the systemd
        # watchdog going through a slow call (a first CUDA context, pinning a large region), sending only
        self.on_wait: Callable[[], None] | None = None
        self.process.start()
        ready = self._receive(start_timeout_s, "start")
        self.info: dict[str, Any] = ready
        self._fd_listener.setblocking(False)
        try:  # the worker connected before it said ready (a stand-in worker may not have)
            self._fd_sock, _ = self._fd_listener.accept()
            self._fd_sock.setblocking(True)
        except BlockingIOError:
            pass
        log.info("rail %d worker pid %d ready", rail, self.process.pid)

    def call(self, request: LinkRequest, timeout_s: float | None = None, fds: tuple[int, ...] = ()) -> Any:
        """Run ``request`` in the worker and return its reply, of the request's ``reply`` type (raises
        WorkerError on refusal).

        ``fds`` are sent to the worker (each a copy; the caller keeps and closes its own): as many as the
        request's type carries.
        """
        op = request.op
        if not self.process.is_alive():
            raise WorkerError(f"rail {self.rail} worker is not running (exit code {self.process.exitcode})")
        if fds:
            if self._fd_sock is None:
                raise WorkerError(f"rail {self.rail} worker has no descriptor link: cannot send {op} a descriptor")
            try:
                socket.send_fds(self._fd_sock, [op.encode()], list(fds))
            except OSError as exc:
                raise WorkerError(f"rail {self.rail} worker: {op}: sending descriptors failed: {exc}") from exc
        self._seq += 1
        self._sock.send(codec.encode({"seq": self._seq, "fds": len(fds), "request": request}))
        return self._receive(self.call_timeout_s if timeout_s is None else timeout_s, op, self._seq,
                             type(request).reply)

    def _receive(self, timeout_s: float, op: str, seq: int | None = None, reply_type: Any = dict[str, Any]) -> Any:
        deadline = time.monotonic() + timeout_s
        while True:
            if self._sock.poll(50):
                data = self._sock.recv()
                try:
                    if len(data) > MAX_FRAME:
                        raise msgspec.DecodeError(f"{len(data)} bytes, above the link's {MAX_FRAME}")
                    frame = _reply_frames.decode(data)
                except msgspec.DecodeError as exc:  # a worker of another build, or a bug: never a guess
                    raise WorkerError(f"rail {self.rail} worker: {op}: malformed reply: {exc}") from None
                if frame.seq != seq:
                    log.warning("rail %d worker: dropped a late reply to an earlier call", self.rail)
                    continue
                fds = self._receive_fds(op, frame.fds) if frame.fds else []  # sent before the reply: queued
                if not frame.ok:
                    _close(fds)
                    raise WorkerError(f"rail {self.rail} worker: {op}: {frame.error or 'failed'}")
                try:
                    reply = _reply_decoder(reply_type).decode(frame.reply)
                except msgspec.DecodeError as exc:
                    _close(fds)
                    raise WorkerError(f"rail {self.rail} worker: {op}: the reply does not fit {reply_type}: "
                                      f"{exc}") from None
                if fds:
                    if "fds" not in getattr(reply_type, "__struct_fields__", ()):
                        _close(fds)
                        raise WorkerError(f"rail {self.rail} worker: {op}: descriptors came with a reply that "
                                          "carries none")
                    reply = msgspec.structs.replace(reply, fds=fds)
                return reply
            if not self.process.is_alive():
                raise WorkerError(f"rail {self.rail} worker died during {op} (exit code {self.process.exitcode})")
            if self.on_wait is not None:
                self.on_wait()
            if time.monotonic() > deadline:
                raise WorkerError(f"rail {self.rail} worker did not answer {op} within {timeout_s}s")

    def _receive_fds(self, op: str, count: int) -> list[int]:
        if self._fd_sock is None:
            raise WorkerError(f"rail {self.rail} worker: {op} sent descriptors, but there is no descriptor link")
        try:
            return receive_fds(self._fd_sock, op, count)
        except OSError as exc:
            raise WorkerError(f"rail {self.rail} worker: {exc}") from None

    def stop(self, timeout_s: float = 10.0) -> None:
        """Ask the worker to drain and exit; kill it if it does not."""
        if self.process.is_alive():
            try:
                self.call(Stop(), timeout_s=timeout_s)
            except WorkerError as exc:
                log.warning("%s", exc)
            self.process.join(timeout_s)
            if self.process.is_alive():
                self.process.kill()
                self.process.join(2)
        self._sock.close(0)
        if self._fd_sock is not None:
            self._fd_sock.close()
        self._fd_listener.close()
        try:
            os.unlink(f"{self._dir}/link")
            os.unlink(f"{self._dir}/fds")
            os.rmdir(self._dir)
        except OSError:
            pass


class WorkerEndpoint:
    """The worker's end: serve requests from the main process by the handler ``handlers`` names for their
    type. A handler takes the request (and, for a request type that carries descriptors, the list of them)
    and returns the reply; a :class:`~transportd.dataplane.link_messages.Stop` ends the serving."""

    def __init__(self, endpoint: str, handlers: Mapping[type[LinkRequest], Callable[..., Any]]) -> None:
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.PAIR)
        self._sock.linger = 1000
        self._sock.connect(endpoint)
        self.handlers = dict(handlers)
        self._decoder = msgspec.msgpack.Decoder(Union[tuple(self.handlers)])  # noqa: UP007 (a runtime tuple)
        self._fd_sock: socket.socket | None = None
        fd_path = os.path.join(os.path.dirname(endpoint[len("ipc://"):]), "fds")
        if endpoint.startswith("ipc://") and os.path.exists(fd_path):
            self._fd_sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
            self._fd_sock.connect(fd_path)

    def send_ready(self, **fields: Any) -> None:
        """Tell the main process this worker is up; ``fields`` become its ``WorkerHandle.info``."""
        self._sock.send(codec.encode({"seq": None, "ok": True, "reply": fields}))

    def wake_fd(self) -> int:
        """A descriptor that turns readable when a request may have arrived (zmq's ZMQ_FD of the link; it
        is reset by :meth:`serve_pending`), for an idle worker to wait on."""
        return int(self._sock.getsockopt(zmq.FD))

    def serve_pending(self, timeout_ms: int = 0) -> bool:
        """Serve every request waiting (after up to ``timeout_ms``); True if the worker should stop."""
        stop = False
        if not self._sock.poll(timeout_ms):
            return False
        while True:
            try:
                data = self._sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return stop
            seq, stopping, reply = self._serve(data)
            stop = stop or stopping
            self._sock.send(codec.encode({"seq": seq, **reply}))

    def _serve(self, data: bytes) -> tuple[int | None, bool, dict[str, Any]]:
        """One request frame: its seq, whether it asks the worker to stop, and the reply frame's fields."""
        try:
            if len(data) > MAX_FRAME:
                raise msgspec.DecodeError(f"{len(data)} bytes, above the link's {MAX_FRAME}")
            frame = _request_frames.decode(data)
        except msgspec.DecodeError as exc:  # nothing to pair the answer with: the caller times out, and says so
            log.warning("worker link: refused a frame that is not a request frame: %s", exc)
            return None, False, {"ok": False, "error": f"not a request frame: {exc}"}
        try:
            request = self._decoder.decode(frame.request)
        except msgspec.DecodeError as exc:
            self._drop_fds(frame.fds)
            error = self._refusal(frame.request, exc)
            log.warning("worker link: %s", error)
            return frame.seq, False, {"ok": False, "error": error}
        return frame.seq, isinstance(request, Stop), self._call(request, frame.fds)

    def _refusal(self, raw: msgspec.Raw, exc: msgspec.DecodeError) -> str:
        """Why a request did not decode, naming the op (or that it names none this worker serves)."""
        try:
            op = msgspec.msgpack.decode(raw).get("op")
        except (msgspec.DecodeError, AttributeError):
            return f"malformed request: {exc}"
        known = sorted(cls.__struct_config__.tag for cls in self.handlers)
        if op not in known:
            return f"unknown worker op {op!r:.40} (this worker serves: {', '.join(known)})"
        return f"malformed {op} request: {exc}"

    def _call(self, request: LinkRequest, count: int) -> dict[str, Any]:
        op = request.op
        fds: list[int] = []
        try:
            if count:
                fds = self._receive_fds(op, count)
            wanted = type(request).fds
            if len(fds) != wanted:
                raise ValueError(f"{op} carries {wanted} descriptor(s), got {len(fds)}")
            handler = self.handlers[type(request)]
            if wanted:
                given, fds = fds, []  # the handler owns them from its call on, failing or not
                reply = handler(request, given)
            else:
                reply = handler(request)
            send = list(getattr(reply, "fds", ()))
            out: dict[str, Any] = {"ok": True, "reply": reply}
            if send:
                try:
                    if self._fd_sock is None:
                        raise OSError(f"{op} returns descriptors, but this worker has no descriptor link")
                    socket.send_fds(self._fd_sock, [op.encode()], send)
                finally:
                    _close(send)
                out = {"ok": True, "fds": len(send), "reply": msgspec.structs.replace(reply, fds=[])}
            return out
        except Exception as exc:  # a refused request must not kill the rail
            log.warning("worker op %s failed: %s", op, exc)
            return {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        finally:
            _close(fds)

    def _drop_fds(self, count: int) -> None:
        """Take and close the descriptors sent with a request that is refused before it is read."""
        if count and self._fd_sock is not None:
            try:
                _name, fds, _flags, _addr = socket.recv_fds(self._fd_sock, 256, count)
            except OSError as exc:
                log.warning("worker link: could not take the descriptors of a refused request: %s", exc)
                return
            _close(fds)

    def _receive_fds(self, op: str, count: int) -> list[int]:
        if self._fd_sock is None:
            raise OSError(f"{op} carries {count} descriptor(s), but this worker has no descriptor link")
        return receive_fds(self._fd_sock, op, count)

    def close(self) -> None:
        self._sock.close()
        if self._fd_sock is not None:
            self._fd_sock.close()
        self._ctx.term()


def _close(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)
