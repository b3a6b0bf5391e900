"""Local client → daemon requests (the control socket): one checked :class:`~cmd_ring.protocol.wire.Message`
per op in :data:`REQUESTS`, and :func:`parse_request`, their receive boundary. Which op may follow which is
``cmd_ring.protocol.session``'s."""

from __future__ import annotations

import typing
from typing import Annotated, Any, ClassVar, Literal

from msgspec import Meta

from cmd_ring.limits import (
    MAX_CHANNEL_CAPACITY,
    MAX_DEVICE,
    MAX_IBGDA_WQES,
    MAX_RAILS,
    MAX_REGIONS,
    MAX_WORLD,
    MIN_CHANNEL_CAPACITY,
    MIN_IBGDA_WQES,
)
from cmd_ring.protocol.wire import (
    _ACCESS,
    _U24,
    _U32,
    _U64,
    CUDA_IPC_HANDLE_BYTES,
    MAX_FD_ID,
    MAX_FLAGS,
    MAX_NODE_LEN,
    MAX_PID,
    MAX_REGION_BYTES,
    U24,
    U32,
    U64,
    Message,
    Name,
    NameOrEmpty,
    NodeName,
    Rail,
    Rank,
    Record,
    _handle,
    _message,
    _parse,
)

__all__ = [
    "Channel",
    "ChannelClose",
    "ChannelConnect",
    "ChannelInfo",
    "Exchange",
    "Flags",
    "Heartbeat",
    "Hello",
    "Inspect",
    "Join",
    "Leave",
    "QueueEndpoint",
    "REQUESTS",
    "Register",
    "Request",
    "Restart",
    "Selftest",
    "Stats",
    "TraceStart",
    "TraceStop",
    "parse_request",
]

REQUESTS: dict[str, type[Message]] = {}
_request = _message(REQUESTS)


# ---------------------------------------------------------------------------------------------------------
# Local client → daemon requests.


class Request(Message):
    """Marker base of client → daemon requests (one subclass per op in :data:`REQUESTS`)."""


@_request
class Hello(Request):
    """Open a session. The reply carries a one-time ``token`` (and, over ipc, the ``fd_socket`` path).

    ``pid`` and ``pid_ns`` (the inode of ``/proc/self/ns/pid``) are what the client says about itself: kept
    for logs, trusted for nothing. Over ipc the client presents the token on the descriptor socket
    (:class:`Vouch`), where the kernel tells the daemon its uid, gid and pid (``SO_PEERCRED``): those are
    the session's identity and the pid the daemon watches.
    """

    op: ClassVar[str] = "hello"
    pid: Annotated[int, Meta(ge=0, le=MAX_PID)] = 0
    name: NameOrEmpty = ""
    pid_ns: U64 = 0


@_request
class Join(Request):
    """Attach this session to rank ``rank`` of ``job`` (``world`` ranks) on local GPU ``device`` (-1: CPU)."""

    op: ClassVar[str] = "join"
    job: Name
    rank: int  #: in [0, world - 1]: checked with ``world``
    world: Annotated[int, Meta(ge=1, le=MAX_WORLD)]
    device: Annotated[int, Meta(ge=-1, le=MAX_DEVICE)]
    #: -1: the rail of ``device``; else this rail (``transportctl selftest`` tests each one)
    rail: Annotated[int, Meta(ge=-1, le=MAX_RAILS - 1)] = -1
    #: a session coming back to a restarted daemon (gpuclient re-attaches by itself, docs/restart.md): the
    #: register, flags and channel requests that follow re-send the memory the old daemon served
    resume: bool = False

    def _check(self) -> None:
        self._range("rank", 0, self.world - 1)


@_request
class Register(Request):
    """Register memory for RDMA: by descriptor or handle, never by path (docs/design.md, "Jobs are walled off").

    ``handle`` depends on ``kind``: ``host`` — the id the daemon gave a memfd this client passed on its
    descriptor socket (:class:`PassFd`; ``gpuclient.host_array`` memory); ``cuda_ipc`` — the 64-byte
    ``CUipcMemHandle`` of the allocation (``offset`` into it); ``dmabuf`` — the id of a dma-buf fd passed
    the same way (``cuMemGetHandleForAddressRange``; registered with ``DmaBufMR``, remote addresses are then
    offsets). A path is refused: the daemon maps only what the client itself could open and hand over.
    ``address`` is the client's virtual address of the region, kept for reports. ``access`` lists what
    remote peers may do: ``read``, ``write``, ``atomic``. ``id`` -1 takes the rank's next region id; a
    session re-attaching to a restarted daemon names the id it had, so kernels' commands stay valid.
    """

    op: ClassVar[str] = "register"
    kind: Literal["host", "cuda_ipc", "dmabuf"]
    #: bytes or an integer id; typed Any so that a string (a path) gets the reason it is refused, not only
    #: "expected bytes or integer"
    handle: Annotated[Any, Meta(extra={"check": _handle, "doc_type": "bytes or int"})]
    size: Annotated[int, Meta(ge=1, le=MAX_REGION_BYTES)]
    offset: U64 = 0  #: at most 2**64 - 1 - size: checked with ``size``
    address: U64 = 0
    access: tuple[str, ...] = ("read", "write")
    id: Annotated[int, Meta(ge=-1, le=MAX_REGIONS - 1)] = -1

    def _check(self) -> None:
        if isinstance(self.handle, str):
            self._fail("handle", "memory is registered by descriptor, never by path: pass the memory's fd on the "
                                 "descriptor socket (op 'pass_fd') and register the id it returns "
                                 "(gpuclient.host_array does this)")
        if self.kind == "cuda_ipc":
            if not isinstance(self.handle, bytes) or len(self.handle) != CUDA_IPC_HANDLE_BYTES:
                self._fail("handle", f"cuda_ipc needs {CUDA_IPC_HANDLE_BYTES} bytes of CUipcMemHandle")
        elif not isinstance(self.handle, int) or not 0 <= self.handle <= MAX_FD_ID:
            self._fail("handle", f"{self.kind} needs the id of a descriptor passed on the descriptor socket "
                                 f"(an integer in [0, {MAX_FD_ID}])")
        self._range("offset", 0, _U64 - self.size)
        if not self.access:
            self._fail("access", f"must list at least one of {', '.join(_ACCESS)}")
        for i, item in enumerate(self.access):
            if item not in _ACCESS:
                self._fail(f"access[{i}]", f"must be one of {', '.join(_ACCESS)}, got {item!r:.40}")
        if len(set(self.access)) != len(self.access):
            self._fail("access", "lists an access twice")


@_request
class Flags(Request):
    """Allocate ``count`` 64-bit flag words that peers signal, in GPU memory or host-mapped memory.

    ``device`` flags are allocated by the GPU client: ``handle`` is the 64-byte ``CUipcMemHandle`` of that
    allocation and ``offset`` the flags' place in it (the daemon publishes into them). ``adopt`` names a
    flag file passed back on the descriptor socket (the one an earlier daemon made, re-sent by a session
    re-attaching after a restart): the daemon serves that file, counters as they are, instead of a new one.
    """

    op: ClassVar[str] = "flags"
    count: Annotated[int, Meta(ge=1, le=MAX_FLAGS)]
    where: Literal["host", "device"] = "device"
    handle: bytes = b""
    offset: U64 = 0
    adopt: Annotated[int, Meta(ge=-1, le=MAX_FD_ID)] = -1

    def _check(self) -> None:
        if self.handle and len(self.handle) != CUDA_IPC_HANDLE_BYTES:
            self._fail("handle", f"device flags need {CUDA_IPC_HANDLE_BYTES} bytes of CUipcMemHandle")
        if self.handle and self.where != "device":
            self._fail("handle", "only device flags carry an IPC handle")


@_request
class Exchange(Request):
    """Share this rank's regions and flags with the job; the reply says whether every rank is known and
    reachable yet (``complete``), so clients repeat it until then (``gpuclient.Session.exchange`` does)."""

    op: ClassVar[str] = "exchange"


@_request
class Channel(Request):
    """Open a channel for this session.

    ``kind="ring"``: a command ring of ``capacity`` slots (a power of two; 0: the daemon's
    ``proxy.ring_capacity``) and its error word, drained by the rail's proxy. ``kind="ibgda"``: one queue
    pair per peer rank of ``capacity`` WQEs (a power of two, 8 .. 32768) that the GPU posts to itself, built
    by the client in its own process on the rank's IBGDA domain (the reply grants it: the domain's command
    descriptor, offered on the descriptor socket, its PD handle, the peers); the client then sends
    :class:`ChannelConnect` and asks :class:`ChannelInfo` until ``ready``.

    ``adopt`` names a ring passed back on the descriptor socket (a session re-attaching after a restart):
    the daemon drains that ring from its published consumer position, keeping channel ``id`` where it is
    free, and reports the records an earlier daemon took but never saw complete (``in_doubt``).
    """

    op: ClassVar[str] = "channel"
    capacity: int = 0  #: its range depends on ``kind``
    kind: Literal["ring", "ibgda"] = "ring"
    adopt: Annotated[int, Meta(ge=-1, le=MAX_FD_ID)] = -1
    id: U32 = 0

    def _check(self) -> None:
        if self.adopt >= 0 and self.kind != "ring":
            self._fail("adopt", "only a ring can be adopted (an IBGDA channel does not survive a restart)")
        if self.kind == "ring" and self.capacity == 0:
            return  # the daemon's default
        if self.kind == "ibgda":
            self._range("capacity", MIN_IBGDA_WQES, MAX_IBGDA_WQES)
        else:
            self._range("capacity", MIN_CHANNEL_CAPACITY, MAX_CHANNEL_CAPACITY)
        if self.capacity & (self.capacity - 1):
            self._fail("capacity", f"must be a power of two, got {self.capacity}")


@_request
class ChannelInfo(Request):
    """The state of an IBGDA channel this session opened: ``ready``, then what a kernel's tables need."""

    op: ClassVar[str] = "channel_info"
    channel: Annotated[int, Meta(ge=1, le=_U32)]


class QueueEndpoint(Record):
    """One queue pair a client built for an IBGDA channel, toward rank ``peer``: what its far end needs to
    connect to it (the ib backend's endpoint fields)."""

    _context: ClassVar[str] = "endpoint"
    peer: Rank
    qpn: Annotated[int, Meta(ge=1, le=_U24)]
    psn: U24
    lid: Annotated[int, Meta(ge=0, le=0xFFFF)]
    gid: Annotated[str, Meta(max_length=64, pattern=r"^[0-9A-Fa-f:.]*\Z")]
    port: Annotated[int, Meta(ge=1, le=255)]
    mtu: Annotated[int, Meta(ge=1, le=5)]  #: an ibv_mtu value
    max_dest_rd_atomic: Annotated[int, Meta(ge=1, le=16)]
    transport: Literal["ib"] = "ib"


@_request
class ChannelConnect(Request):
    """The queue pairs this session built in its own process for IBGDA channel ``channel``, one per peer rank
    the channel's reply named: the daemon connects a far end to each (the client then asks
    :class:`ChannelInfo` until ``ready``)."""

    op: ClassVar[str] = "channel_connect"
    channel: Annotated[int, Meta(ge=1, le=_U32)]
    endpoints: tuple[QueueEndpoint, ...]

    def _check(self) -> None:
        if not 1 <= len(self.endpoints) <= MAX_WORLD:
            self._fail("endpoints", f"must list 1..{MAX_WORLD} queue pairs, got {len(self.endpoints)}")
        if len({e.peer for e in self.endpoints}) != len(self.endpoints):
            self._fail("endpoints", "lists a peer twice")


@_request
class ChannelClose(Request):
    """Close IBGDA channel ``channel``: the daemon closes the far ends of its queue pairs (the client destroys
    the queue pairs themselves). A channel whose queues failed is closed this way before a new one opens."""

    op: ClassVar[str] = "channel_close"
    channel: Annotated[int, Meta(ge=1, le=_U32)]


@_request
class Stats(Request):
    """Counters for this session (and the daemon, for ``transportctl``)."""

    op: ClassVar[str] = "stats"


@_request
class Inspect(Request):
    """Operator queries (``transportctl``), read-only: ``what`` is ``flags`` (one local rank's flag values)."""

    op: ClassVar[str] = "inspect"
    what: Literal["flags"]
    job: Name
    rank: Rank


@_request
class Selftest(Request):
    """``transportctl selftest``: ``links`` lists this node's peers (and static peers never heard from) with
    their rails; ``start`` has peer ``node`` host rank 1 of ``job`` (world 2) on ``rail`` itself, with no
    user process there (``peer_selftest``); ``finish`` asks it for its observations and to leave;
    ``status`` returns them once they came back (``report``), or why the far side failed (``error``)."""

    op: ClassVar[str] = "selftest"
    action: Literal["links", "start", "finish", "status"]
    job: NameOrEmpty = ""  #: needed by every action but ``links``
    node: Annotated[str, Meta(max_length=MAX_NODE_LEN)] = ""  #: needed by ``start``
    rail: Rail = 0
    seed: U64 = 0

    def _check(self) -> None:
        if self.action != "links":
            self._require("job", Name)
        if self.action == "start":
            self._require("node", NodeName)


@_request
class TraceStart(Request):
    """``transportctl trace start``: record every record local rank ``rank`` of ``job`` takes from its
    channels (docs/trace.md) until ``trace_stop``; ``out`` is where the client means to write the trace,
    only echoed back by ``trace_stop`` (the daemon writes into no path a client names)."""

    op: ClassVar[str] = "trace_start"
    job: Name
    rank: Rank
    out: Annotated[str, Meta(max_length=4096)] = ""


@_request
class TraceStop(Request):
    """``transportctl trace stop``: end the recording; the reply offers the trace file as descriptor ``fd``
    (kind ``trace``) on the descriptor socket, with ``entries`` written and ``dropped``."""

    op: ClassVar[str] = "trace_stop"
    job: Name
    rank: Rank


@_request
class Restart(Request):
    """``transportctl restart``: start a new daemon of the same command line and hand the jobs over to it once
    it is ready; they keep their rings, flags and regions (docs/restart.md). Root or the daemon's own user
    only. The reply comes at once, with the daemon's ``pid``; from then on ``stats`` says ``restart``
    ``preparing`` while the new daemon starts, or ``failed`` (with the reason) if it cannot, and the daemon
    serves on. The new daemon is the one that answers with another ``pid``."""

    op: ClassVar[str] = "restart"


@_request
class Leave(Request):
    """Leave the job: the daemon reclaims this session's rings, regions and flags."""

    op: ClassVar[str] = "leave"


@_request
class Heartbeat(Request):
    """Tell the daemon the client is alive while it has nothing else to say."""

    op: ClassVar[str] = "heartbeat"
    seq: U64 = 0


def parse_request(msg: dict[str, Any]) -> Request:
    """Validate a decoded client message into its :class:`Request`, or raise :class:`RemoteProtocolError`."""
    return typing.cast(Request, _parse(msg, REQUESTS, "control"))
