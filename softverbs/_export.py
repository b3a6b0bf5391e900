"""Sharing a context between processes, as rdma-core does: ``ibv_import_device``, ``ibv_import_pd``,
``ibv_import_mr`` (pyverbs: ``Context(cmd_fd=...)``, ``PD(ctx, handle=...)``, ``MR(pd, handle=...)``).

On a NIC a context's objects live in the kernel. A process holding the context's command descriptor
(``Context.cmd_fd``, a copy passed with ``SCM_RIGHTS``) imports the context, then a PD or an MR of that
context by its handle; QPs it makes on the imported PD use the imported MR's keys, and the NIC reaches
the bytes in the pages of the process that registered them.

Here: the exporting Context's ``cmd_fd`` is one end of an unnamed datagram socket pair; an
:class:`ExportService` thread holds the other end. An importer attaches by sending, over ``cmd_fd``, one
end of a fresh stream socket pair (``SCM_RIGHTS``), which becomes its :class:`ImportLink`: only a holder of
the descriptor can attach, since the socket has no name to connect to. Over the link it learns the device
(kind and options: the QPs and CQs it makes on the imported context run in an engine of its own with the
same behaviour, not listed by ``get_device_list``), looks PDs and MRs up by handle, and reads and writes
an imported MR's bytes, which stay in the exporter's memory (a NIC's DMA into the exporter's pages).

Rules kept, as on hardware:

- handles are per context: a PD or MR of another context, even on the same device, is not found (EINVAL);
- an MR is imported on the PD it was registered on, or not at all (EINVAL);
- what was imported is valid while the exporter's object lives: when the exporter closes an MR, a PD or
  the context, or its process ends, the imported MR's keys fail local access (a local protection error
  completion, and the QP goes to the error state), the imported PD takes no QP and no MR import, and the
  context imports nothing more (ENODEV).

Memory registered by the importer on an imported PD is refused (EOPNOTSUPP): softverbs keeps an imported
context's keys the exporter's. An import in the exporter's own process shares the exporter's engine: its
QPs answer at the device's address and its imported MRs are the exporter's, as one device's are on a NIC
(rdma-core's own test of the calls, ``test_shared_pd``, relies on it).
"""

from __future__ import annotations

import dataclasses
import errno
import json
import logging
import os
import secrets
import selectors
import socket
import struct
import threading
import weakref
from collections.abc import Callable
from typing import Any

from ._dropped import own_thread

log = logging.getLogger("softverbs")

_HDR = struct.Struct("<II")  # header bytes, payload bytes
_MAX_HEADER = 1 << 16


def _send(sock: socket.socket, header: dict[str, Any], payload: bytes | memoryview = b"") -> None:
    head = json.dumps(header).encode()
    sock.sendall(_HDR.pack(len(head), len(payload)) + head)
    if payload:
        sock.sendall(payload)


def _recv_exact(sock: socket.socket, n: int) -> bytes | None:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            return None
        got += k
    return bytes(buf)


def _recv(sock: socket.socket) -> tuple[dict[str, Any], bytes] | None:
    """One frame, or None at the end of the stream."""
    raw = _recv_exact(sock, _HDR.size)
    if raw is None:
        return None
    hlen, plen = _HDR.unpack(raw)
    if hlen > _MAX_HEADER:
        raise OSError(errno.EPROTO, f"import link: a {hlen}-byte header")
    head = _recv_exact(sock, hlen)
    payload = _recv_exact(sock, plen) if plen else b""
    if head is None or payload is None:
        return None
    return json.loads(head), payload


# --- the exporting side -------------------------------------------------------------------------------

#: exporting contexts of this process, by token: an import in the same process uses the exporter's own
#: engine (its QPs then answer at the exporter's address, as on a NIC, where both contexts are one device)
EXPORTED: weakref.WeakValueDictionary[str, Any] = weakref.WeakValueDictionary()


class ExportService:
    """One exported Context's end: attaches importers, answers their look-ups and memory accesses, and
    tells them when an object they imported is gone."""

    def __init__(self, ctx: Any) -> None:
        self._ctx = weakref.ref(ctx)
        self.token = secrets.token_hex(16)
        EXPORTED[self.token] = ctx
        self.device_name: str = ctx._name
        self.device = ctx._dev
        self._mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.cmd_fd = theirs.detach()  # the Context owns it; callers pass copies
        self._lock = threading.Lock()
        self._links: dict[socket.socket, dict[str, set[int]]] = {}  # link -> {"pd": handles, "mr": handles}
        self._send_locks: dict[socket.socket, threading.Lock] = {}
        self._wake_r, self._wake_w = socket.socketpair()
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._mine, selectors.EVENT_READ, "attach")
        self._sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._running = True
        self._thread = own_thread(self._loop, f"softverbs-export-{self.device_name}")
        self._thread.start()

    # the exporter's objects, found by handle among the context's own
    def _pd(self, handle: int) -> Any:
        ctx = self._ctx()
        for child in list(ctx._children) if ctx is not None else ():
            if getattr(child, "_kind", "") == "pd" and not child._closed and not child._imported \
                    and child.handle == handle:
                return child
        return None

    def _mr(self, handle: int) -> Any:
        ctx = self._ctx()
        for pd in list(ctx._children) if ctx is not None else ():
            for child in list(getattr(pd, "_children", ())):
                if getattr(child, "_kind", "") == "mr" and not child._closed and not child._imported \
                        and child.handle == handle:
                    return child
        return None

    def _loop(self) -> None:
        while self._running:
            try:
                events = self._sel.select()
            except OSError:
                return
            for key, _mask in events:
                if key.data == "wake":
                    try:
                        self._wake_r.recv(4096)
                    except OSError:
                        pass
                elif key.data == "attach":
                    self._attach()
                else:
                    self._serve(key.fileobj)  # type: ignore[arg-type]

    def _attach(self) -> None:
        try:
            _msg, fds, _flags, _addr = socket.recv_fds(self._mine, 64, 4)
        except OSError:
            return
        for fd in fds:
            link = socket.socket(fileno=fd)
            if link.family != socket.AF_UNIX or link.type != socket.SOCK_STREAM:
                link.close()
                continue
            link.setblocking(True)
            with self._lock:
                self._links[link] = {"pd": set(), "mr": set()}
                self._send_locks[link] = threading.Lock()
            self._sel.register(link, selectors.EVENT_READ, "link")

    def _drop(self, link: socket.socket) -> None:
        with self._lock:
            self._links.pop(link, None)
            self._send_locks.pop(link, None)
        try:
            self._sel.unregister(link)
        except (KeyError, ValueError):
            pass
        link.close()

    def _serve(self, link: socket.socket) -> None:
        try:
            frame = _recv(link)
        except (OSError, ValueError):
            frame = None
        if frame is None:
            self._drop(link)
            return
        req, payload = frame
        try:
            reply, data = self._answer(link, req, payload)
        except Exception as exc:  # a bad request is answered, not fatal to the service
            reply, data = {"errno": errno.EINVAL, "error": f"{type(exc).__name__}: {exc}"}, b""
        reply["id"] = req.get("id")
        lock = self._send_locks.get(link)
        if lock is None:
            return
        try:
            with lock:
                _send(link, reply, data)
        except OSError:
            self._drop(link)

    def _answer(self, link: socket.socket, req: dict[str, Any], payload: bytes) -> tuple[dict[str, Any], bytes]:
        op = req.get("op")
        if op == "hello":
            opts = {k: v for k, v in dataclasses.asdict(self.device.options).items() if k != "extra"}
            return {"name": self.device_name, "options": opts, "pid": os.getpid(), "token": self.token}, b""
        if op == "pd":
            pd = self._pd(int(req["handle"]))
            if pd is None:
                return {"errno": errno.EINVAL, "error": f"no PD with handle {req['handle']} in this context"}, b""
            self._links[link]["pd"].add(pd.handle)
            return {}, b""
        mr = self._mr(int(req["handle"]))
        if mr is None:
            return {"errno": errno.EINVAL, "error": f"no MR with handle {req['handle']} in this context"}, b""
        core = mr._core
        if op == "mr":
            if mr._pd.handle != int(req["pd"]):
                return {"errno": errno.EINVAL, "error": f"MR {mr.handle} is not on PD {req['pd']}"}, b""
            self._links[link]["mr"].add(mr.handle)
            return {"lkey": core.lkey, "rkey": core.rkey, "addr": core.addr, "length": core.length,
                    "access": core.access}, b""
        addr, n = int(req["addr"]), int(req.get("length", len(payload)))
        if not core.contains(addr, n):
            return {"errno": errno.EFAULT, "error": f"{addr:#x}+{n} is outside MR {mr.handle}"}, b""
        if op == "read":
            return {}, bytes(core.read(addr, n))
        if op == "write":
            core.write(addr, memoryview(payload))
            return {}, b""
        return {"errno": errno.EOPNOTSUPP, "error": f"unknown import op {op!r}"}, b""

    def gone(self, kind: str, handle: int) -> None:
        """The exporter closed PD or MR ``handle``: tell the importers that took it."""
        with self._lock:
            targets = [(link, self._send_locks[link]) for link, taken in self._links.items() if handle in taken[kind]]
            for link, _ in targets:
                self._links[link][kind].discard(handle)
        for link, lock in targets:
            try:
                with lock:
                    _send(link, {"gone": kind, "handle": handle})
            except OSError:
                pass

    def close(self) -> None:
        """The context is closing: every importer's link ends (what they imported is gone)."""
        self._running = False
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass
        if self._thread is not threading.current_thread():
            self._thread.join(5)
        with self._lock:
            links = list(self._links)
            self._links.clear()
        for link in links:
            try:
                link.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            link.close()
        self._sel.close()
        for s in (self._mine, self._wake_r, self._wake_w):
            s.close()
        try:
            os.close(self.cmd_fd)
        except OSError:
            pass


# --- the importing side -------------------------------------------------------------------------------


class LinkError(OSError):
    """The exporter refused a request, or is gone (``errno`` says which)."""


class ImportLink:
    """An importer's link to the exporting context: requests and replies, and notices of what is gone."""

    def __init__(self, cmd_fd: int) -> None:
        try:
            dup = os.dup(cmd_fd)
        except OSError as exc:
            raise LinkError(errno.EBADF, f"cmd_fd {cmd_fd}: {exc.strerror}") from None
        try:
            cmd = socket.socket(fileno=dup)
        except OSError:
            os.close(dup)
            raise LinkError(errno.EINVAL, f"descriptor {cmd_fd} is not a softverbs context's command descriptor"
                            ) from None
        try:
            if cmd.family != socket.AF_UNIX or cmd.type != socket.SOCK_DGRAM:
                raise LinkError(errno.EINVAL, f"descriptor {cmd_fd} is not a softverbs context's command "
                                                 "descriptor")
            mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                socket.send_fds(cmd, [b"attach"], [theirs.fileno()])
            except OSError as exc:
                mine.close()
                raise LinkError(errno.ENODEV, f"the exporting context is closed ({exc.strerror})") from None
            finally:
                theirs.close()
        finally:
            cmd.close()
        self._sock = mine
        self._lock = threading.Lock()
        self._next = 0
        self._waiting: dict[int, list[Any]] = {}  # id -> [event, reply, payload]
        self.alive = True
        self.on_gone: Callable[[str, int | None], None] = lambda kind, handle: None
        self._reader = own_thread(self._read, "softverbs-import")
        self._reader.start()

    def _read(self) -> None:
        while True:
            try:
                frame = _recv(self._sock)
            except (OSError, ValueError):
                frame = None
            if frame is None:
                break
            head, payload = frame
            if "gone" in head:
                self.on_gone(str(head["gone"]), int(head["handle"]))
                continue
            slot = self._waiting.pop(int(head.get("id", -1)), None)
            if slot is not None:
                slot[1], slot[2] = head, payload
                slot[0].set()
        self.alive = False
        for slot in list(self._waiting.values()):
            slot[0].set()
        self._waiting.clear()
        self.on_gone("context", None)

    def call(self, op: str, payload: bytes | memoryview = b"", **fields: Any) -> tuple[dict[str, Any], bytes]:
        """One request; raises :class:`LinkError` with the exporter's errno (ENODEV once it is gone)."""
        if not self.alive:
            raise LinkError(errno.ENODEV, "the exporting context is closed")
        slot: list[Any] = [threading.Event(), None, b""]
        with self._lock:
            self._next += 1
            rid = self._next
            self._waiting[rid] = slot
            try:
                _send(self._sock, {"op": op, "id": rid, **fields}, payload)
            except OSError:
                self._waiting.pop(rid, None)
                raise LinkError(errno.ENODEV, "the exporting context is closed") from None
        slot[0].wait()
        reply = slot[1]
        if reply is None:
            raise LinkError(errno.ENODEV, "the exporting context is closed")
        if "errno" in reply:
            raise LinkError(int(reply["errno"]), str(reply.get("error", "refused")))
        return reply, slot[2]

    def close(self) -> None:
        self.alive = False
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()


class LinkAccessor:
    """A MemoryAccessor for an imported MR: its bytes are the exporter's, reached over the link. An access
    after the MR is gone reads zeros and writes nothing (the key check before it failed the work)."""

    def __init__(self, link: ImportLink, handle: int, core_ref: Callable[[], Any]) -> None:
        self.link, self.handle, self._core = link, handle, core_ref

    def _gone(self) -> None:
        core = self._core()
        if core is not None:
            core.valid = False

    def read(self, addr: int, length: int) -> bytes:
        try:
            _reply, data = self.link.call("read", handle=self.handle, addr=addr, length=length)
        except LinkError:
            self._gone()
            return bytes(length)
        return data

    def write(self, addr: int, data: memoryview) -> None:
        try:
            self.link.call("write", bytes(data), handle=self.handle, addr=addr, length=len(data))
        except LinkError:
            self._gone()
