"""The link between the daemon's main process and one proxy worker process (one per rail).

The main process owns clients, jobs and peers; a worker owns its rail's verbs resources (context, PD,
MRs, QPs) and the proxy loop, because work requests must be posted from the process that owns them.
The main process sends requests (msgpack maps with an ``op``) over a zmq PAIR socket and waits for the
reply; the worker serves them between proxy iterations, so a request costs the worker one poll.

Descriptors (a client's memfd, later a dma-buf fd) cannot travel over zmq: a call with ``fds`` sends them
first on a Unix ``SOCK_SEQPACKET`` socket beside the link (``fds`` in the same private directory, which
the worker connects to at start, ``SCM_RIGHTS``), and the request says how many to take; the worker
hands them to the op as ``fds``, which owns them from its call on, even when it fails. The other way, an
op that returns ``_send_fds`` (descriptors it owns: an IBGDA domain's command descriptor) has them sent on
that socket before its reply, closed there, and reaches the caller as the reply's ``fds``, which the
caller then owns.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import socket
import tempfile
import time
from collections.abc import Callable
from typing import Any

import zmq

from transportd.control import codec
from transportd.errors import WorkerError

__all__ = ["WorkerEndpoint", "WorkerHandle"]

log = logging.getLogger("transportd.worker")


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

    def call(self, op: str, timeout_s: float | None = None, fds: tuple[int, ...] = (), **fields: Any
             ) -> dict[str, Any]:
        """Run ``op`` in the worker and return its reply fields (raises WorkerError on refusal).

        ``fds`` are sent to the worker (each a copy; the caller keeps and closes its own) and reach the op
        as its ``fds`` argument.
        """
        if not self.process.is_alive():
            raise WorkerError(f"rail {self.rail} worker is not running (exit code {self.process.exitcode})")
        if fds:
            if self._fd_sock is None:
                raise WorkerError(f"rail {self.rail} worker has no descriptor link: cannot send {op} a descriptor")
            try:
                socket.send_fds(self._fd_sock, [op.encode()], list(fds))
            except OSError as exc:
                raise WorkerError(f"rail {self.rail} worker: {op}: sending descriptors failed: {exc}") from exc
            fields["_fds"] = len(fds)
        self._seq += 1
        self._sock.send(codec.encode({"op": op, "seq": self._seq, **fields}))
        return self._receive(self.call_timeout_s if timeout_s is None else timeout_s, op, self._seq)

    def _receive(self, timeout_s: float, op: str, seq: int | None = None) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while True:
            if self._sock.poll(50):
                reply = codec.decode(self._sock.recv(), max_size=64 << 20)
                if reply.pop("seq", None) != seq:
                    log.warning("rail %d worker: dropped a late reply to an earlier call", self.rail)
                    continue
                count = int(reply.pop("_fds", 0))
                if count:  # sent before the reply: already queued on the descriptor socket
                    reply["fds"] = self._receive_fds(op, count)
                if not reply.get("ok", False):
                    for fd in reply.get("fds", ()):
                        os.close(fd)
                    raise WorkerError(f"rail {self.rail} worker: {op}: {reply.get('error', 'failed')}")
                reply.pop("ok", None)
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
                self.call("stop", timeout_s=timeout_s)
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
    """The worker's end: serve requests from the main process by calling ``handler.op_<name>``."""

    def __init__(self, endpoint: str, handler: object) -> None:
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.PAIR)
        self._sock.linger = 1000
        self._sock.connect(endpoint)
        self.handler = handler
        self._fd_sock: socket.socket | None = None
        fd_path = os.path.join(os.path.dirname(endpoint[len("ipc://"):]), "fds")
        if endpoint.startswith("ipc://") and os.path.exists(fd_path):
            self._fd_sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
            self._fd_sock.connect(fd_path)

    def send_ready(self, **fields: Any) -> None:
        self._sock.send(codec.encode({"ok": True, **fields}))

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
            request = codec.decode(data, max_size=64 << 20)
            op = request.pop("op", "")
            seq = request.pop("seq", None)
            reply = self._call(op, request)
            stop = stop or op == "stop"
            self._sock.send(codec.encode({**reply, "seq": seq}))

    def _call(self, op: str, request: dict[str, Any]) -> dict[str, Any]:
        fds: list[int] = []
        try:
            count = request.pop("_fds", 0)
            if count:
                fds = self._receive_fds(op, count)
                request["fds"] = fds
            method = getattr(self.handler, f"op_{op}", None)
            if method is None:
                return {"ok": False, "error": f"unknown worker op {op!r}"}
            fds = []  # the op owns them from its call on, failing or not (it closes what it does not keep)
            reply = {"ok": True, **(method(**request) or {})}
            send = reply.pop("_send_fds", ())
            if send:
                try:
                    if self._fd_sock is None:
                        raise OSError(f"{op} returns descriptors, but this worker has no descriptor link")
                    socket.send_fds(self._fd_sock, [op.encode()], list(send))
                finally:
                    for fd in send:
                        os.close(fd)
                reply["_fds"] = len(send)
            return reply
        except Exception as exc:  # a refused request must not kill the rail
            log.warning("worker op %s failed: %s", op, exc)
            return {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        finally:
            for fd in fds:
                os.close(fd)

    def _receive_fds(self, op: str, count: int) -> list[int]:
        if self._fd_sock is None:
            raise OSError(f"{op} carries {count} descriptor(s), but this worker has no descriptor link")
        return receive_fds(self._fd_sock, op, count)

    def close(self) -> None:
        self._sock.close()
        if self._fd_sock is not None:
            self._fd_sock.close()
        self._ctx.term()
