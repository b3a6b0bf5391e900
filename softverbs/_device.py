"""A soft device: a TCP listener, one I/O thread, its QP and MR tables, and connections to peer devices.

Connections (`softverbs._conn`): a device listens on TCP and, unless ``local_sockets`` is off, on an abstract
Unix socket on this host (`local_name`); each connection reads its frames with a state machine of its own.

Threading. The I/O thread owns every socket's receive side and the selector. Posting threads send frames
themselves (non-blocking `sendmsg`, no thread hop on the fast path); whatever the kernel does not take
stays queued on the connection and the I/O thread flushes it when the socket is writable. Nobody ever
blocks in a send while holding a lock, so two devices (or one device talking to itself) cannot deadlock.
Lock order: QP -> device -> connection -> CQ. Opening and closing the device (`acquire`/`release`) take a
lock of their own that the I/O thread never takes, so stopping may wait for the thread: the thread may need
the device lock (a lost connection updates the connection table) while it winds down.

Waking. The I/O thread sleeps in epoll when it has nothing to do, and a step that waits for it pays the
host's wake-up; with ``io_spin_s`` it first stays awake that long after its last event (`_loop`).

Shaping. A device with a NIC model (`nic_bandwidth`, `nic_latency_s`, `nic_message_rate`; `softverbs._link`)
hands each outgoing request to its departure queue with the time the model says it lands, or its first
byte does for a direct write, copied as the link carries it (`LinkModel.departure`; ``nic_streaming`` off:
its last byte, store and forward; a request to the device itself excepted: a NIC loops it back without
taking the wire); the I/O thread sends it then,
in its loop and also between two direct placements (`send_due`), so a stream it is placing does not hold
its own requests back. A thread that sleeps until a landing time pays the host's wake-up after it (tens of
microseconds), which would make a modeled 2 µs link slower than an unshaped one, so the last ``nic_spin_s``
before a departure are waited awake, GIL released: a request that leaves within that of its post, with none
queued ahead, is sent by the posting thread itself at that time (`depart`, `send_now`), and the I/O thread
wakes that long before a queued one leaves, or a held completion is due (`_loop`, `at_landing`).
Acknowledgements and read responses are not shaped.
"""

from __future__ import annotations

import errno
import heapq
import itertools
import logging
import math
import os
import random
import selectors
import socket
import struct
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from . import _direct, _spin, _trace
from . import _wire as w
from ._conn import Conn, local_name
from ._dropped import own_thread
from ._ibv import ERR
from ._link import LinkModel
from ._requester import ResponseFrameHandler
from ._responder import RequestFrameHandler
from ._waketimer import WakeTimer, open_wake_timer, tighten_timer_slack

log = logging.getLogger("softverbs")

INBOX_RETRY_S = 1e-4  # how soon the I/O thread looks again at responses a held QP could not take


@dataclass
class DeviceOptions:
    """Soft-only behaviour of one device; see `softverbs.soft` for what each knob models."""

    kind: str = "ib"  # "ib" (ConnectX-like RC) or "efa" (EFA-like SRD)
    host: str = "127.0.0.1"
    port: int = 0
    advertise: str | None = None
    adaptive_routing: bool = False
    reorder_seed: int | None = None
    reorder_window: int = 64
    reorder_window_bytes: int = 64 * 8192  # a window of SRD packets' bytes: it also bounds large direct packets
    packet_size: int | None = None
    srd_packet_size: int = 8192
    srd_rnr_timer_ms: float = 1.0
    connect_timeout_s: float = 5.0
    reconnect_backoff_s: float = 0.5  # after a failed connect, WRs to that endpoint fail at once this long
    # peers on this host over an abstract Unix socket (local_name) instead of TCP loopback; False: TCP always
    local_sockets: bool = True
    efa_device_caps: int | None = None
    max_rdma_size: int = 1 << 30
    max_qp_wr: int | None = None
    max_cqe: int | None = None
    max_inline_data: int | None = None
    # the NIC model (None / 0: unshaped): bytes/s, seconds added to every message, messages/s
    nic_bandwidth: float | None = None
    nic_latency_s: float = 0.0
    nic_message_rate: float | None = None
    # the last this-long before a shaped request lands is waited awake (GIL released), not asleep: one landing
    # within it of its post (none queued ahead) leaves from the posting thread, and the I/O thread wakes this
    # long before a queued one lands; 0: the I/O thread sleeps until each landing (and wakes after it)
    nic_spin_s: float = 30e-6
    # a shaped direct write leaves as its first byte lands, copied while the link carries the rest (what follows
    # it and its completion wait for its last byte), as a NIC places packets; False: it leaves once its last byte
    # has landed (store and forward), so its copy adds to every landing (`LinkModel.departure`)
    nic_streaming: bool = True
    # the reorder pool's packet for direct writes when packet_size is not set: one copy per packet
    direct_packet_size: int = 1 << 20
    # how long the I/O thread stays awake after it last had something to do, polling its sockets without
    # sleeping (GIL released) before it sleeps in epoll: 0 sleeps at once (see `_loop`)
    io_spin_s: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)

    def shaped(self) -> bool:
        return bool(self.nic_bandwidth or self.nic_latency_s or self.nic_message_rate)


_PEERCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


#: counters of `SoftDevice.stats` (`softverbs.soft.device_stats`)
STAT_NAMES = (
    "direct_sent",  # requester: writes sent as a reference to device memory instead of their bytes
    "direct_placed",  # responder: direct writes (or packets of them) placed by a copy
    "direct_bytes",  # responder: bytes placed so
    "direct_ns",  # responder: time its thread spent in those copies and runs (each complete when it returns)
    "run_wire_writes",  # responder: wire writes into device memory placed with a run of direct writes
    "imports_opened",  # responder: peers' allocations opened for direct writes
    "imports_refused",  # responder: ... that could not be (another host, no copier, the open failed)
    "device_wire_writes",  # requester: writes from device memory that crossed the wire (no agreement yet)
    "io_spin_ready",  # I/O thread: spins (io_spin_s) that found input ready, so no sleep and wake-up
    "sent_at_post",  # shaped requests the posting thread sent itself once they landed (nic_spin_s)
    "departed",  # shaped requests the departure queue held until they landed (the I/O thread sent them)
    "departures_awaited",  # I/O thread: queued departures it waited for awake (nic_spin_s), not woken for
    "streamed",  # shaped direct writes sent as their first byte landed (`LinkModel.departure`)
)

_LISTENER = object()
_WAKE = object()
_TIMER = object()


class SoftDevice:
    """Process-wide state of one soft device, shared by every Context opened on it."""

    def __init__(self, name: str, options: DeviceOptions) -> None:
        self.name = name
        self.options = options
        self.is_efa = options.kind == "efa"
        self.lock = threading.RLock()
        self._life = threading.RLock()  # acquire/release only; never held by the I/O thread
        self.refs = 0
        self.qps: dict[int, Any] = {}
        self.mrs_by_lkey: dict[int, Any] = {}
        self.mrs_by_rkey: dict[int, Any] = {}
        self.relaxed_mrs = 0  # MRs registered with IBV_ACCESS_RELAXED_ORDERING (they change placement)
        self._qpn = itertools.count(0x11 + (os.getpid() % 97) * 0x100)
        self._key = itertools.count(1 + (os.getpid() % 251) * 0x1000)
        self.out_conns: dict[tuple[str, int], Conn] = {}
        # endpoints a connect just failed to reach -> when to try again: until then their WRs fail at once,
        # as a NIC's do toward a dead address, instead of paying (and logging) a connect attempt each
        self._unreachable: dict[tuple[str, int], float] = {}
        self.in_conns: set[Conn] = set()
        self.host = options.host
        self.port = 0
        self.advertise = options.advertise or (options.host if options.host not in ("", "0.0.0.0") else "127.0.0.1")
        self.rng = random.Random(options.reorder_seed)
        self.placement_observer: Callable[[int, int, int], None] | None = None
        # direct writes: this device's exported allocations (by the copier's descriptor) and counters
        self.exports: dict[bytes, _direct.Export] = {}
        self._export_id = itertools.count(1)
        self.stats: dict[str, int] = dict.fromkeys(STAT_NAMES, 0)
        # the NIC model: the link's schedule and the requests waiting for their landing time
        self.link = LinkModel()
        self._dep_lock = threading.Lock()
        self._departures: list[tuple] = []  # heap of (landing time, seq, conn, qp, descriptor, payloads)
        self._dep_seq = itertools.count()
        self._actions: deque[Callable[[], None]] = deque()
        self._timers: list[tuple[float, int, Callable[[], None]]] = []
        # I/O thread: calls due at a modeled landing (`at_landing`), woken for as a departure is
        self._landings: list[tuple[float, int, Callable[[], None]]] = []
        self._timer_seq = itertools.count()
        self._dirty_rsp: set[Conn] = set()
        self.inbox_waiting: set[Any] = set()  # QPs whose queued responses the I/O thread could not apply yet
        self._unfinished: set[Conn] = set()  # connections whose pump ran out of its slice (Conn.pump)
        self._running = False
        self._thread: threading.Thread | None = None
        self._timer: WakeTimer | None = None  # wakes the I/O loop at its next timer or departure
        self._sel: selectors.BaseSelector | None = None
        self._listener: socket.socket | None = None
        self._local_listener: socket.socket | None = None  # local_name(advertise, port), where it could bind
        self._wake_r: socket.socket | None = None
        self._wake_w: socket.socket | None = None
        self.request_handler = RequestFrameHandler(self)  # frames on connections peers opened to us
        self.response_handler = ResponseFrameHandler(self)  # frames on the connections we opened

    # --------------------------------------------------------------- lifecycle
    def acquire(self) -> None:
        """A Context opened on this device: start the listener and I/O thread on first use."""
        with self._life:
            if self.refs == 0:
                self._start()
            self.refs += 1

    def release(self) -> None:
        with self._life:  # not the device lock: _stop waits for the I/O thread, which may need that one
            self.refs -= 1
            if self.refs == 0:
                self._stop()

    def _start(self) -> None:
        lst = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        lst.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        lst.bind((self.options.host, self.options.port))
        lst.listen(128)
        lst.setblocking(False)
        self._listener = lst
        self.port = lst.getsockname()[1]
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._sel = selectors.DefaultSelector()
        self._sel.register(lst, selectors.EVENT_READ, _LISTENER)
        self._sel.register(self._wake_r, selectors.EVENT_READ, _WAKE)
        self._timer = open_wake_timer()
        if self._timer is not None:
            self._sel.register(self._timer, selectors.EVENT_READ, _TIMER)
        self.rng = random.Random(self.options.reorder_seed)
        self.host = self.options.host
        self.advertise = self.options.advertise or (self.host if self.host not in ("", "0.0.0.0") else "127.0.0.1")
        if self.options.local_sockets:
            self._local_listener = self._listen_local()
            if self._local_listener is not None:
                self._sel.register(self._local_listener, selectors.EVENT_READ, _LISTENER)
        self._running = True
        self._thread = own_thread(self._loop, f"softverbs-{self.name}")
        self._thread.start()

    def _stop(self) -> None:
        self._running = False
        self.wake()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(5)
            if self._thread.is_alive():
                log.warning("softverbs %s: I/O thread did not stop within 5 s", self.name)
        self._thread = None
        with self.lock:
            conns = list(self.out_conns.values()) + list(self.in_conns)
            self.out_conns.clear()
            self.in_conns.clear()
            # the endpoints found dead go too: their ports may be handed out again, this device's next listener's
            # among them, which it would then refuse to reach for the rest of the backoff
            self._unreachable.clear()
        for conn in conns:
            conn.closed = True
            conn.sock.close()
            self._close_imports(conn)
        for s in (self._listener, self._local_listener, self._wake_r, self._wake_w, self._timer):
            if s is not None:
                s.close()
        if self._sel is not None:
            self._sel.close()
        self._timer = None
        self._listener = self._local_listener = self._wake_r = self._wake_w = None
        self._sel = None
        self._actions.clear()
        self._timers.clear()
        self._landings.clear()
        self._dirty_rsp.clear()  # their connections are closed: nothing of theirs is sent
        self.inbox_waiting.clear()
        self._unfinished.clear()
        with self._dep_lock:
            self._departures.clear()
            # the link's schedule with them: a later request must not land behind requests that never left
            self.link = LinkModel()
        self.port = 0

    # ----------------------------------------------------------- identifiers
    def new_qpn(self) -> int:
        return next(self._qpn) & 0xFFFFFF

    def new_keys(self) -> tuple[int, int]:
        """(lkey, rkey): distinct, so a backend that mixes them up fails here as it would on hardware."""
        k = next(self._key)
        return ((k << 8) | 0x5A) & 0xFFFFFFFF, ((k << 8) | 0xA5) & 0xFFFFFFFF

    # ------------------------------------------------------------- I/O thread
    def wake(self) -> None:
        """Make the I/O thread's select() return (always a byte: a skipped wake-up would be lost)."""
        wake_w = self._wake_w
        if wake_w is not None:
            try:
                wake_w.send(b"x")
            except OSError:  # full (plenty of wake-ups pending) or closing
                pass

    def post_action(self, fn: Callable[[], None]) -> None:
        """Run `fn` on the I/O thread soon (state changes that must not race the receive path)."""
        self._actions.append(fn)
        self.wake()

    def add_timer(self, delay_s: float, fn: Callable[[], None]) -> None:
        """I/O thread only: call `fn` after `delay_s` seconds."""
        heapq.heappush(self._timers, (time.monotonic() + delay_s, next(self._timer_seq), fn))

    def at_landing(self, when: float, fn: Callable[[], None]) -> None:
        """Call `fn` on the I/O thread at ``when`` (time.monotonic()), a modeled landing: a held completion
        (`LinkModel.departure`). Any thread; the loop waits the last ``nic_spin_s`` of it awake, as for a
        departure, so the call is not a wake-up late."""
        self.post_action(lambda: heapq.heappush(self._landings, (when, next(self._timer_seq), fn)))

    def request_write(self, conn: Conn) -> None:
        self.post_action(lambda: self._want_write(conn))

    def _want_write(self, conn: Conn) -> None:
        if conn.closed or self._sel is None:
            return
        with conn.lock:
            want = bool(conn.outq)
        if want != conn.registered_write:
            events = selectors.EVENT_READ | (selectors.EVENT_WRITE if want else 0)
            try:
                self._sel.modify(conn.sock, events, conn)
                conn.registered_write = want
            except (KeyError, ValueError, OSError):
                pass

    def retry_inboxes(self) -> None:
        """I/O thread: apply the responses queued for QPs that were held when they arrived (see
        `QPRequester.rx_responses`); a QP still held stays for the next pass."""
        for qp in list(self.inbox_waiting):
            if qp.drain_inbox():
                self.inbox_waiting.discard(qp)

    def mark_responses(self, conn: Conn) -> None:
        """I/O thread: `conn` has responses to frame before the thread sleeps."""
        self._dirty_rsp.add(conn)

    def flush_responses(self) -> None:
        dirty = self._dirty_rsp
        while dirty:
            conn = dirty.pop()
            if conn.rsp_descs:
                pack = w.RSP.pack
                descs = [pack(a[0], 0, w.OP_ACK, 0, a[1], a[2], 0, 0) if isinstance(a, list) else a
                         for a in conn.rsp_descs]
                payloads = conn.rsp_payloads
                conn.rsp_descs, conn.rsp_payloads, conn.last_ack = [], [], None
                for i in range(0, len(descs), w.MAX_DESCS_PER_FRAME):
                    j = i + w.MAX_DESCS_PER_FRAME
                    conn.send_frame(w.KIND_RSP, descs[i:j], [p for p in payloads[i:j] if p is not None])

    def _loop(self) -> None:
        """The I/O thread. With ``io_spin_s`` it stays awake that long after it last had something to do:
        before sleeping in epoll it polls the same set, GIL released (`softverbs._spin`), so a frame that
        arrives meanwhile is taken at once instead of after the host's wake-up (20-50 µs on a busy host,
        once per step of a write's way there and back). It costs a core while traffic flows.

        A queued departure wakes it ``nic_spin_s`` before it lands, and it waits the rest the same way,
        taking any input that comes meanwhile, so the request leaves when it lands, not a wake-up after."""
        sel = self._sel
        assert sel is not None
        timer = self._timer
        tighten_timer_slack()
        epfd = sel.fileno() if isinstance(sel, selectors.EpollSelector) else -1  # the spin polls an epoll set
        busy_ns = 0  # time.monotonic_ns() when the loop last had events
        while self._running:
            at = None  # the earliest timer or departure, in time.monotonic() seconds
            if self._timers:
                at = self._timers[0][0]
            lands = None  # a departure or landing due within nic_spin_s: waited for awake below, not on the timer
            if self._departures or self._landings:
                due = min(self._departures[0][0] if self._departures else math.inf,
                          self._landings[0][0] if self._landings else math.inf)
                if epfd >= 0:  # wake nic_spin_s early (a wake-up would land it late) and spin the rest
                    early = due - self.options.nic_spin_s
                    if early <= time.monotonic():
                        lands, due = due, None
                    else:
                        due = early
                if due is not None:
                    at = due if at is None else min(at, due)
            if self.inbox_waiting:  # a thread holds such a QP: look again soon
                retry = time.monotonic() + INBOX_RETRY_S
                at = retry if at is None else min(at, retry)
            if self._actions or self._unfinished:
                timeout: float | None = 0.0
            elif at is None:
                timeout = None
            elif timer is not None:  # the timerfd wakes the select at ``at`` itself, not at the next millisecond
                timer.arm(at)
                timeout = None
            else:
                timeout = max(0.0, at - time.monotonic())
            try:
                if lands is not None and timeout != 0.0:
                    left = int(lands * 1e9) - time.monotonic_ns()
                    if left > 0:  # until it lands, or input comes first (its turn, then back here)
                        if not _spin.wait_readable(epfd, left):
                            self.stats["departures_awaited"] += 1
                    timeout = 0.0
                spin_ns = int(self.options.io_spin_s * 1e9) if epfd >= 0 and timeout != 0.0 else 0
                if spin_ns:
                    now_ns = time.monotonic_ns()
                    left = busy_ns + spin_ns - now_ns
                    if timeout is not None:
                        left = min(left, int(timeout * 1e9))
                    if left > 0:
                        if _spin.wait_readable(epfd, left):
                            timeout = 0.0
                            self.stats["io_spin_ready"] += 1
                        elif timeout is not None:
                            timeout = max(0.0, timeout - (time.monotonic_ns() - now_ns) / 1e9)
                if _trace.DIR and epfd >= 0 and timeout != 0.0:
                    # traced: sleep in an epoll wait that says when the set became ready before the GIL is taken
                    # back (``ready``), then take the events; a trace then tells the wait for the GIL apart
                    ready = _spin.wait_ready(epfd, -1 if timeout is None else max(1, math.ceil(timeout * 1e3)))
                    if ready:
                        _trace.stamp("ready", ready)
                    events = sel.select(0)
                else:
                    events = sel.select(timeout)
            except OSError:
                if not self._running:
                    return
                raise
            if events:
                busy_ns = time.monotonic_ns()
            try:
                unfinished = self._unfinished
                resume = set(unfinished)  # pumped below unless an event pumps them first
                unfinished.clear()
                for key, mask in events:
                    data = key.data
                    if data is _LISTENER:
                        self._accept(key.fileobj)  # type: ignore[arg-type]
                    elif data is _TIMER:
                        timer.clear()  # type: ignore[union-attr]
                    elif data is _WAKE:
                        try:
                            while self._wake_r is not None and self._wake_r.recv(4096):
                                pass
                        except (BlockingIOError, OSError):
                            pass
                    else:
                        if mask & selectors.EVENT_WRITE:
                            data.flush()
                            self._want_write(data)
                        if mask & selectors.EVENT_READ:
                            resume.discard(data)
                            if self._pump(data):
                                unfinished.add(data)
                for conn in resume:  # their turn again, input or not (what they buffered the selector cannot see)
                    if self._pump(conn):
                        unfinished.add(conn)
                while self._actions:
                    self._actions.popleft()()
                self.request_handler.on_idle()
                if self.inbox_waiting:
                    self.retry_inboxes()
                now = time.monotonic()
                while self._timers and self._timers[0][0] <= now:
                    heapq.heappop(self._timers)[2]()
                while self._landings and self._landings[0][0] <= now:
                    heapq.heappop(self._landings)[2]()
                self.send_due()
                self.flush_responses()
            except Exception:  # keep serving other peers; the fault is logged with its traceback
                log.exception("softverbs device %s: I/O loop error", self.name)

    def _pump(self, conn: Conn) -> bool:
        """I/O thread: `Conn.pump`, a fault in it confined to its connection. What a peer's frames do that
        the handlers did not foresee drops that peer's connection, as a frame that breaks the framing does,
        and the loop goes on serving the others (whose turn in this pass it would otherwise take)."""
        try:
            return conn.pump()
        except Exception as exc:
            log.exception("softverbs device %s: frame from %s failed", self.name, conn.peer)
            if not conn.closed:
                self.conn_lost(conn, exc)
            return False

    # ------------------------------------------------------------ NIC model
    def depart(self, conn: Conn, qp: Any, desc: bytes | Callable[[float], bytes], payloads: list[Any], nbytes: int,
               soon: list[tuple] | None = None, streamed: bool = False) -> float:
        """Send one request when the link model says it lands (any posting thread, its QP's lock held), or,
        ``streamed`` (its bytes are placed as the link carries them: `LinkModel.departure`; unless the device's
        ``nic_streaming`` is off), when its first byte lands; returns its landing time. ``desc`` may be made
        from that time (``desc(land)``).

        With ``soon`` (the post's own list, sent by `send_now` before the QP's lock is let go): a request that
        leaves within ``nic_spin_s`` with nothing queued ahead joins it instead of the departure queue. A
        request queued here leaves after everything in ``soon``, which is therefore sent first."""
        opts = self.options
        with self._dep_lock:
            now = time.monotonic()
            link = self.link
            land = link.schedule(now, nbytes, opts.nic_bandwidth, opts.nic_latency_s, opts.nic_message_rate)
            streamed = streamed and opts.nic_streaming
            when = link.departure(land, opts.nic_latency_s, streamed)
            if callable(desc):
                desc = desc(land)
            if streamed:
                self.stats["streamed"] += 1
            deps = self._departures
            if soon is not None and not deps and when - now <= opts.nic_spin_s:
                soon.append((when, conn, desc, payloads))
                return land
            if soon:
                self._send_now(soon)
            first = not deps or when < deps[0][0]
            heapq.heappush(deps, (when, next(self._dep_seq), conn, qp, desc, payloads))
            self.stats["departed"] += 1
        if first:
            self.wake()
        return land

    def send_now(self, soon: list[tuple]) -> None:
        """The posting thread: wait, awake, until the last of ``soon`` lands, then send them all (`depart`)."""
        with self._dep_lock:
            self._send_now(soon)

    def _send_now(self, soon: list[tuple]) -> None:
        _spin.spin_until(int(soon[-1][0] * 1e9))  # departure times never decrease: the last is the latest
        self.stats["sent_at_post"] += len(soon)
        frames: dict[Conn, list[tuple[bytes, list[Any]]]] = {}
        for _when, conn, desc, payloads in soon:
            frames.setdefault(conn, []).append((desc, payloads))
        soon.clear()
        self._send_frames(frames)

    def send_due(self) -> None:
        """I/O thread: send this device's requests whose time has come. The loop calls it every pass, and the
        responder between two placements of a stream of incoming requests (each a copy that can take tens of
        microseconds on a busy GPU): else a device placing a peer's stream holds back its own until its slice
        ends, and the two directions of an exchange take turns."""
        deps = self._departures
        if deps and deps[0][0] <= time.monotonic():
            self._send_departures(time.monotonic())

    def departing(self) -> bool:
        """Requests wait in the departure queue, or are being sent from it: later ones must queue behind
        them, shaped or not (the NIC model was just turned off)."""
        with self._dep_lock:
            return bool(self._departures)

    def _send_departures(self, now: float) -> None:
        """I/O thread: send every request whose time has come, one frame per connection, in order. The
        queue's lock is held until they are handed to their connections, so that nothing posted meanwhile
        (`departing`) can pass them."""
        with self._dep_lock:
            deps = self._departures
            frames: dict[Conn, list[tuple[bytes, list[Any]]]] = {}
            while deps and deps[0][0] <= now:
                _when, _seq, conn, qp, desc, payloads = heapq.heappop(deps)
                if qp.closed or qp.state == ERR:  # a QP in error sends nothing more (its WRs are flushed)
                    continue
                frames.setdefault(conn, []).append((desc, payloads))
            self._send_frames(frames)

    @staticmethod
    def _send_frames(frames: dict[Conn, list[tuple[bytes, list[Any]]]]) -> None:
        """Requests as frames, in order, per connection (a lost connection fails its WRs on its own)."""
        for conn, requests in frames.items():
            for i in range(0, len(requests), w.MAX_DESCS_PER_FRAME):
                chunk = requests[i:i + w.MAX_DESCS_PER_FRAME]
                conn.send_frame(w.KIND_REQ, [d for d, _ in chunk], [p for _, ps in chunk for p in ps])

    # ------------------------------------------------------------ direct writes
    def export_for(self, mr: Any) -> _direct.Export | None:
        """The export of the allocation under ``mr`` (resolved once per MR), or None."""
        ex = mr.export
        if ex is not _direct.UNRESOLVED:
            return ex
        copier = _direct.copier()
        found = copier.export_range(mr.addr, mr.length) if copier is not None and mr.accessor is not None else None
        ex = None
        if found is not None:
            descriptor, base, size = found
            with self.lock:
                ex = self.exports.get(descriptor)
                if ex is None:
                    ex = self.exports[descriptor] = _direct.Export(next(self._export_id), descriptor, base, size)
                ex.refs += 1
        mr.export = ex
        return ex

    def release_export(self, mr: Any) -> None:
        """``mr`` is closed: the last MR over an exported allocation tells the peers that opened it."""
        ex = mr.export
        mr.export = None
        if not isinstance(ex, _direct.Export):
            return
        with self.lock:
            ex.refs -= 1
            if ex.refs:
                return
            self.exports.pop(ex.descriptor, None)
            conns = list(ex.conns)
            ex.conns.clear()
        for conn in conns:
            conn.peer_imports.pop(ex.id, None)
            conn.send_frame(w.KIND_FORGET, [], [], count=ex.id)

    def _close_imports(self, conn: Conn) -> None:
        imports, conn.imports = conn.imports, {}
        for imp in imports.values():
            try:
                imp.close()
            except Exception:  # closing must not stop the others from closing
                log.exception("softverbs %s: closing an imported allocation", self.name)

    def _listen_local(self) -> socket.socket | None:
        """The same-host listener (``local_name``), or None where the name is taken or Unix sockets are not."""
        lst = None
        try:
            lst = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            lst.bind(local_name(self.advertise, self.port))
            lst.listen(128)
            lst.setblocking(False)
            return lst
        except OSError as exc:
            if lst is not None:
                lst.close()
            log.info("softverbs %s: peers on this host connect over TCP (no local socket: %s)", self.name, exc)
            return None

    def _connect(self, endpoint: tuple[str, int]) -> socket.socket:
        """A connected socket to ``endpoint``: its local name where a device of this user on this host listens
        there, else TCP."""
        if self.options.local_sockets:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(self.options.connect_timeout_s)
            try:
                sock.connect(local_name(*endpoint))
                _pid, uid, _gid = _PEERCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                                   _PEERCRED.size))
                if uid == os.getuid():  # another user's socket under that name is not the device
                    return sock
            except OSError:  # no such device here: another host, or one without the local listener
                pass
            sock.close()
        return socket.create_connection(endpoint, timeout=self.options.connect_timeout_s)

    def _accept(self, listener: socket.socket) -> None:
        assert self._sel is not None
        while True:
            try:
                sock, addr = listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            conn = Conn(self, sock, "rsp", addr[:2] if isinstance(addr, tuple) else ("local", 0))
            self.in_conns.add(conn)
            self._sel.register(sock, selectors.EVENT_READ, conn)

    # ------------------------------------------------------------ connections
    def connection(self, endpoint: tuple[str, int]) -> Conn | None:
        """The requester connection to `endpoint`, connecting on first use; None if unreachable."""
        conn = self.out_conns.get(endpoint)
        if conn is not None and not conn.closed:
            return conn
        with self.lock:
            conn = self.out_conns.get(endpoint)
            if conn is not None and not conn.closed:
                return conn
            retry_at = self._unreachable.get(endpoint)
            if retry_at is not None and time.monotonic() < retry_at:
                return None
            try:
                sock = self._connect(endpoint)
            except OSError as exc:
                if retry_at is None:  # logged once until it is reachable again
                    log.warning("softverbs %s: cannot reach %s:%d (%s); trying again at most every %g s", self.name,
                                endpoint[0], endpoint[1], exc, self.options.reconnect_backoff_s)
                self._unreachable[endpoint] = time.monotonic() + self.options.reconnect_backoff_s
                return None
            if self._unreachable.pop(endpoint, None) is not None:
                log.info("softverbs %s: %s:%d is reachable again", self.name, endpoint[0], endpoint[1])
            conn = Conn(self, sock, "req", endpoint)
            self.out_conns[endpoint] = conn
            conn.peer_lid = endpoint[1] & 0xFFFF
            with conn.lock:
                conn.outq.append(memoryview(w.HDR.pack(w.MAGIC, w.KIND_HELLO, 0, self.port, 0)))
                conn._flush_locked()
        self.post_action(lambda: self._register(conn))
        return conn

    def _register(self, conn: Conn) -> None:
        if self._sel is None or conn.closed:
            return
        with conn.lock:
            want = bool(conn.outq)
        self._sel.register(conn.sock, selectors.EVENT_READ | (selectors.EVENT_WRITE if want else 0), conn)
        conn.registered_write = want

    def conn_lost(self, conn: Conn, exc: BaseException | None) -> None:
        """I/O thread: a connection closed or broke; requests in flight on it fail as on a dead link (once)."""
        if conn.sock.fileno() < 0:  # already lost: this closed its socket
            return
        with conn.lock:
            conn.closed = True
            conn.outq.clear()
        if self._sel is not None:
            try:
                self._sel.unregister(conn.sock)
            except (KeyError, ValueError):
                pass
        conn.sock.close()
        if exc is not None and not isinstance(exc, ConnectionError):
            log.warning("softverbs %s: connection to %s dropped: %s", self.name, conn.peer, exc)
        if conn.role == "req":
            with self.lock:
                if self.out_conns.get(conn.peer) is conn:
                    del self.out_conns[conn.peer]
            self.response_handler.conn_lost(conn)
            with self.lock:
                for ex in self.exports.values():
                    ex.conns.discard(conn)
        else:
            self.in_conns.discard(conn)
            self._dirty_rsp.discard(conn)
            self._close_imports(conn)


def errno_name(code: int) -> str:
    return errno.errorcode.get(code, str(code))
