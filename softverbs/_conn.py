"""A connection between two soft devices: the frames one side sends and the state machine that reads them.

Connections. A device listens on TCP and, unless ``local_sockets`` is off, on an abstract Unix socket named
after its advertised address and port (`local_name`); a requester reaches a peer of its own user on this
host there, and any other peer over TCP. Both carry the same frames.

Receive side. Each connection runs a small state machine (header -> descriptors -> payload per item) over
a non-blocking socket, for a time slice a turn (`PUMP_SLICE_S`), so one busy peer cannot hold the others'
input back. Payload bytes are copied from the connection's buffer or, when the rest of a large
payload has not arrived yet, received straight into its destination (`recv_into` the registered memory),
so a 1 MiB write costs one kernel copy on each side. A direct write (`softverbs._direct`) carries no
payload: the responder places it with one copy from the requester's device memory.

Send side. A posting thread sends a frame itself (non-blocking `sendmsg`, no thread hop on the fast path);
whatever the kernel does not take stays queued on the connection, and the device's I/O thread flushes it when
the socket is writable (`SoftDevice`'s threading).
"""

from __future__ import annotations

import itertools
import socket
import threading
import time
from collections import deque
from typing import TYPE_CHECKING, Any

from . import _direct, _trace
from . import _wire as w

if TYPE_CHECKING:
    from ._device import SoftDevice

_BUF_SIZE = 1 << 20
_DIRECT_MIN = 16 << 10  # receive straight into the destination when this much of a payload is missing
_IOV_MAX = 512
#: how long the I/O thread works through one connection's input before the other connections get a turn: a
#: request placed by a copy can take tens of microseconds on a busy GPU, and a peer streaming them would else
#: hold back every acknowledgement and loopback write on the device's other connections until it stopped
PUMP_SLICE_S = 2e-4


def local_name(host: str, port: int) -> str:
    """The abstract Unix socket a device advertising ``host:port`` also listens on: a peer in the same network
    namespace (this host) reaches it there without the TCP stack (a frame's ``sendmsg``: 4 µs against 24-27
    on TCP loopback in a ping-pong; docs/performance.md)."""
    return f"\0softverbs-{host}:{port}"


class Conn:
    """One connection between two soft devices (TCP, or a Unix socket on one host), in one role: requester
    (outgoing) or responder."""

    def __init__(self, device: SoftDevice, sock: socket.socket, role: str, peer: tuple[str, int]) -> None:
        sock.setblocking(False)
        if sock.family != socket.AF_UNIX:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.device = device
        self.sock = sock
        self.role = role
        self.peer = peer
        # a requester connection to this device itself: a NIC loops such requests back inside and they never
        # take the wire, so the NIC model does not shape them (an EFA rail's flag writes into its own GPU)
        self.loopback = role == "req" and peer[1] == device.port and peer[0] in (device.advertise, device.host)
        self.handler = device.request_handler if role == "rsp" else device.response_handler
        self.lock = threading.Lock()
        self.outq: deque[memoryview] = deque()
        self.closed = False
        self.registered_write = False
        # receive state machine
        self.buf = bytearray(_BUF_SIZE)
        self.mv = memoryview(self.buf)
        self.start = 0
        self.end = 0
        self.state = 0  # 0 header, 1 descriptors, 2 items
        self.kind = 0
        self.count = 0
        self.payload_len = 0
        self.descs: list[tuple] = []
        self.idx = 0
        self.sink: memoryview | None = None
        self.sink_pos = 0
        self.sink_len = 0
        self.plan: Any = None
        # responses waiting to be framed (responder role)
        self.rsp_descs: list[Any] = []  # packed RSP descriptors, or [qpn, first_seq, count] ack ranges
        self.rsp_payloads: list[Any] = []
        self.last_ack: list[int] | None = None
        self.pending: list[tuple] = []  # responses of the current frame (requester role)
        self.ro_qpns: set[int] | None = None  # QPs of the current frame writing relaxed-ordering regions
        self.read_cap = _BUF_SIZE
        self.peer_lid = 0
        self.peer_imports: dict[int, int] = {}  # requester role: export id -> the responder's answer
        self.imports: dict[int, _direct.Imported] = {}  # responder role: export id -> what this side opened

    # ---------------------------------------------------------------- send side
    def send_frame(self, kind: int, descs: list[bytes], payloads: list[Any], count: int | None = None,
                   flags: int = 0) -> bool:
        """Send one frame with one sendmsg where the socket takes it all; queue the rest for the I/O thread.

        ``count`` is the descriptors' (a control frame's argument where given). False when the connection
        is gone.
        """
        payload_len = 0
        for p in payloads:
            payload_len += len(p)
        bufs = [w.HDR.pack(w.MAGIC, kind, flags, len(descs) if count is None else count, payload_len),
                b"".join(descs)]
        bufs += payloads
        with self.lock:
            if self.closed:
                return False
            if self.outq or len(bufs) > _IOV_MAX:
                self.outq.extend(bufs)
                if len(self.outq) == len(bufs):
                    self._flush_locked()
            else:
                try:
                    if _trace.DIR:
                        _trace.stamp(f"send {kind}")
                    n = self.sock.sendmsg(bufs)
                except (BlockingIOError, InterruptedError):
                    n = 0
                except OSError as exc:
                    self._fail_locked(exc)
                    return False
                if n < 16 + len(bufs[1]) + payload_len:
                    for b in bufs:
                        size = len(b)
                        if n >= size:
                            n -= size
                            continue
                        self.outq.append(memoryview(b)[n:] if n else b)
                        n = 0
            want = bool(self.outq) and not self.closed
        if want:
            self.device.request_write(self)
        return True

    def flush(self) -> None:
        """I/O thread: push queued bytes now that the socket is writable."""
        with self.lock:
            self._flush_locked()

    def _flush_locked(self) -> None:
        outq = self.outq
        sock = self.sock
        while outq:
            chunk = list(itertools.islice(outq, _IOV_MAX))
            try:
                n = sock.sendmsg(chunk)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                self._fail_locked(exc)
                return
            while n:
                head = outq[0]
                size = len(head)
                if n >= size:
                    outq.popleft()
                    n -= size
                else:
                    outq[0] = head[n:]
                    n = 0

    def _fail_locked(self, exc: BaseException | None) -> None:
        if not self.closed:
            self.closed = True
            self.outq.clear()
            self.device.post_action(lambda: self.device.conn_lost(self, exc))

    # ------------------------------------------------------------- receive side
    def pump(self) -> bool:
        """I/O thread: consume what the socket has, driving the frame state machine, for at most
        ``PUMP_SLICE_S``; True when the slice ran out first (input may be left, buffered here where the
        selector does not see it: the loop comes back to this connection on its next pass)."""
        end = time.perf_counter() + PUMP_SLICE_S
        while not self.closed:
            if not self._advance():
                if self.closed or not self._fill():  # closed: the frame was refused (`conn_lost`)
                    return False
            elif time.perf_counter() >= end:
                return True
        return False

    def _recv(self, into: memoryview) -> int:
        """``recv_into(into)``: the bytes read, or 0 when the socket has none now or is gone (reported here)."""
        try:
            n = self.sock.recv_into(into)
        except (BlockingIOError, InterruptedError):
            return 0
        except OSError as exc:
            self.device.conn_lost(self, exc)
            return 0
        if n == 0:
            self.device.conn_lost(self, None)
        elif _trace.DIR:
            _trace.stamp("read")
        return n

    def _fill(self) -> bool:
        """Read more bytes; False when the socket has none now (or closed)."""
        if self.state == 2 and isinstance(self.sink, memoryview) and self.start == self.end:
            missing = self.sink_len - self.sink_pos
            if missing >= _DIRECT_MIN:
                n = self._recv(self.sink[self.sink_pos:])
                self.sink_pos += n
                return n > 0
        if self.start == self.end:
            self.start = self.end = 0
        elif len(self.buf) - self.end < 65536:
            leftover = self.end - self.start
            self.mv[:leftover] = self.mv[self.start:self.end]
            self.start, self.end = 0, leftover
        n = self._recv(self.mv[self.end:self.end + self.read_cap])
        self.end += n
        return n > 0

    def _advance(self) -> bool:
        """Make progress with buffered bytes; False when more input is needed."""
        avail = self.end - self.start
        if self.state == 0:
            if avail < 16:
                return False
            magic, kind, flags, count, payload_len = w.HDR.unpack_from(self.buf, self.start)
            if kind in w.CONTROL_KINDS and magic == w.MAGIC:
                return self._control(kind, flags, count, payload_len, avail)
            refused = w.frame_refusal(magic, kind, count, self.role)
            if refused:  # a peer that breaks the framing loses its connection, and only that
                self.device.conn_lost(self, ValueError(f"bad frame header: {refused}"))
                return False
            self.start += 16
            self.kind, self.count, self.payload_len = kind, count, payload_len
            self.state = 1
            return True
        if self.state == 1:
            st = w.REQ if self.kind == w.KIND_REQ else w.RSP
            need = st.size * self.count
            if need > len(self.buf) - self.start and need > avail:
                grown = bytearray(max(need * 2, len(self.buf)))
                grown[:avail] = self.mv[self.start:self.end]
                self.buf, self.mv = grown, memoryview(grown)
                self.start, self.end = 0, avail
                return False
            if avail < need:
                return False
            self.descs = list(st.iter_unpack(self.mv[self.start:self.start + need]))
            if _trace.DIR:  # a frame's descriptors in: its items' admission and placement follow
                _trace.stamp(f"frame {self.kind} {self.count}")
            self.start += need
            self.idx = 0
            self.sink = None
            self.state = 2
            # Frames with big payloads: keep buffered reads small so payload bytes go straight to memory.
            self.read_cap = 65536 if self.payload_len > (256 << 10) else _BUF_SIZE
            self.handler.begin_frame(self, self.kind)
            if self.kind == w.KIND_REQ and self.end - self.start >= self.payload_len:
                self.idx, self.start = self.handler.fast_frame(self, self.descs, self.mv, self.start)
            return True
        # state 2: items
        handler = self.handler
        descs = self.descs
        while self.idx < len(descs):
            d = descs[self.idx]
            if self.sink is None:
                n = handler.payload_len(d)
                self.sink_len = n
                self.sink_pos = 0
                self.sink = handler.sink_for(self, d, n) if n else None
                if n and self.sink is None:
                    self.sink = _Discard(n)
            if self.sink_len:
                take = min(self.end - self.start, self.sink_len - self.sink_pos)
                if take:
                    sink = self.sink
                    if isinstance(sink, _Discard):
                        sink.pos += take
                    else:
                        sink[self.sink_pos:self.sink_pos + take] = self.mv[self.start:self.start + take]
                    self.start += take
                    self.sink_pos += take
                if self.sink_pos < self.sink_len:
                    return False
            sink = self.sink
            self.sink = None
            self.idx += 1
            handler.on_item(self, d, None if isinstance(sink, _Discard) else sink)
            if self.idx < len(descs):
                return True  # one item a call: pump looks at its time slice between two
        self.state = 0
        self.descs = []
        handler.end_frame(self)
        return True

    def _control(self, kind: int, flags: int, count: int, payload_len: int, avail: int) -> bool:
        """A control frame (header + a small payload): handled whole, once all of it is buffered."""
        if payload_len > w.MAX_CONTROL_PAYLOAD:
            self.device.conn_lost(self, ValueError("oversized control frame"))
            return False
        if avail < 16 + payload_len:
            return False
        body = bytes(self.mv[self.start + 16:self.start + 16 + payload_len])
        self.start += 16 + payload_len
        if kind == w.KIND_HELLO:
            self.peer_lid = count & 0xFFFF
        elif kind == w.KIND_IMPORT and self.role == "rsp":
            self.handler.on_import(self, count, body)
        elif kind == w.KIND_FORGET and self.role == "rsp":
            self.handler.on_forget(self, count)
        elif kind == w.KIND_IMPORTED and self.role == "req":
            self.handler.on_imported(self, count, flags == _direct.OPENED)
        else:
            self.device.conn_lost(self, ValueError(f"control frame {kind} on a {self.role} connection"))
            return False
        return True


class _Discard:
    """A payload sink that drops bytes (the request was refused)."""

    __slots__ = ("n", "pos")

    def __init__(self, n: int) -> None:
        self.n = n
        self.pos = 0

    def __len__(self) -> int:
        return self.n
