"""The control and peer protocols, with no I/O (the zmq shells live in ``server.py``, ``client.py`` and ``peers.py``).

A message on the wire is a msgpack map ``{"v": V, "op": <name>, <field>: <value>, ...}``. Each op is a
msgspec Struct here whose annotations carry each field's limits (``Annotated[int, Meta(ge=..., le=...)]``,
name lengths and charsets); :mod:`cmd_ring.schema` checks them, on construction and at the receive
boundary alike (lists become tuples, nested maps become records), and each class's ``_check`` adds the
rules across fields. Building a bad message raises :class:`LocalProtocolError`; :func:`parse_request` and
:func:`parse_peer_message`, the receive boundary, turn the same failure into :class:`RemoteProtocolError`
naming the field. Replies are ``{"v": V, "ok": true, ...}`` or ``{"v": V, "ok": false, "code", "message"}``.

Local clients (one session per client socket) speak ``hello`` → ``join`` → ``register`` / ``flags`` /
``channel`` / ``exchange`` … → ``leave``; :data:`TRANSITIONS` is the whole state machine, used by the
client before sending and by the server before dispatching. Peer daemons speak the ``peer_*`` ops.
"""

from __future__ import annotations

import typing
from enum import Enum, StrEnum
from typing import Annotated, Any, ClassVar, Literal

import msgspec
from msgspec import Meta

from cmd_ring import schema
from cmd_ring.errors import Invalid, LocalProtocolError, ProtocolError, RemoteProtocolError, RequestError
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

__all__ = [
    "CUDA_IPC_HANDLE_BYTES",
    "MAX_FD_ID",
    "MAX_FLAGS",
    "MAX_NAME_LEN",
    "MAX_OPAQUE_KEYS",
    "MAX_RAILS",
    "MAX_REGIONS",
    "MAX_REGION_BYTES",
    "MAX_WORLD",
    "MAX_CHANNEL_CAPACITY",
    "MIN_CHANNEL_CAPACITY",
    "REQUESTS",
    "SIDE_MESSAGES",
    "PEER_MESSAGES",
    "TRANSITIONS",
    "TOKEN_BYTES",
    "V",
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
    "Message",
    "PassFd",
    "PeerBye",
    "PeerConnect",
    "PeerConnectAccept",
    "PeerConnectRequest",
    "PeerDisconnect",
    "PeerHeartbeat",
    "PeerHello",
    "PeerJobLost",
    "PeerMessage",
    "PeerRankLeft",
    "PeerQuiesced",
    "PeerRegions",
    "PeerRestarting",
    "PeerSelftest",
    "PeerSelftestReport",
    "QueueEndpoint",
    "RailQP",
    "Record",
    "RegionInfo",
    "Register",
    "Restart",
    "Selftest",
    "ReplyCode",
    "Request",
    "SessionRules",
    "SessionState",
    "SideMessage",
    "Stats",
    "TakeFd",
    "TraceStart",
    "TraceStop",
    "Vouch",
    "error",
    "error_reply_for",
    "next_state",
    "ok",
    "parse_peer_message",
    "parse_reply",
    "parse_request",
    "parse_side_message",
]

#: Protocol version carried in every message as ``v``; a mismatch is refused, never guessed at.
V = 1

MAX_NAME_LEN = 64  #: job and client names
MAX_NODE_LEN = 253  #: node names (a DNS name fits)
MAX_REGION_BYTES = 1 << 40  #: one registration (1 TiB)
MAX_FLAGS = 1 << 20  #: flag words in one flags array
CUDA_IPC_HANDLE_BYTES = 64  #: sizeof(CUipcMemHandle)
MAX_FD_ID = (1 << 31) - 1  #: ids of descriptors passed on the descriptor socket
TOKEN_BYTES = 16  #: the one-time token of a hello, presented on the descriptor socket
MAX_OPAQUE_KEYS = 64  #: keys in a backend-defined map (an endpoint description)
MAX_TEXT_LEN = 1024  #: an error or reason string
MAX_PID = (1 << 31) - 1
MAX_EFA_ADDRESS = 32  #: bytes of an EFA address (the device's GID plus its QP number and qkey fit)
GID_BYTES = 16
_U64 = (1 << 64) - 1
_U32 = (1 << 32) - 1
_U24 = (1 << 24) - 1

_ACCESS = ("read", "write", "atomic")


class ReplyCode(StrEnum):
    """Stable ``code`` strings in error replies; clients branch on these, never on the message text."""

    BAD_MESSAGE = "bad_message"  #: not msgpack, not a map, bad envelope
    TOO_LARGE = "too_large"  #: above control.max_message_bytes
    BAD_VERSION = "bad_version"  #: ``v`` is not :data:`V`
    UNKNOWN_OP = "unknown_op"  #: ``op`` names no request
    BAD_FIELD = "bad_field"  #: a field is missing, extra, of the wrong type or out of range
    BAD_STATE = "bad_state"  #: the op is not allowed in the session's state (e.g. register before join)
    NO_SESSION = "no_session"  #: the daemon has no session for this client (it restarted, or reclaimed it)
    INVALID = "invalid"  #: well-formed but refused (a handle that does not open, a duplicate rank, ...)
    NOT_FOUND = "not_found"  #: names something that does not exist (a region id, a job)
    LIMIT = "limit"  #: a resource limit was reached (memlock, rings, regions)
    TIMEOUT = "timeout"  #: the daemon gave up waiting for something on the client's behalf (exchange)
    UNSUPPORTED = "unsupported"  #: the daemon does not implement this op (or not with this backend)
    FORBIDDEN = "forbidden"  #: the caller's identity may not do this (another uid's job, outside control.group)
    NO_IDENTITY = "no_identity"  #: over ipc, the session has not vouched for itself on the descriptor socket
    INTERNAL = "internal"  #: a fault inside the daemon; details are in its log


# ---------------------------------------------------------------------------------------------------------
# Field types: the limits of each field, stated once, in the annotation (cmd_ring.schema checks them).

_NAME_RULE = "may hold only letters, digits, '.', '_', '-' and must start with a letter or digit"
#: a job or client name
Name = Annotated[str, Meta(min_length=1, max_length=MAX_NAME_LEN, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*\Z",
                           extra={"rule": _NAME_RULE})]
#: a name, or "" where the field is optional (node-wide connections have no job)
NameOrEmpty = Annotated[str, Meta(max_length=MAX_NAME_LEN, pattern=r"^(?:[A-Za-z0-9][A-Za-z0-9._-]*)?\Z",
                                  extra={"rule": _NAME_RULE})]
#: a node name (a DNS name fits)
NodeName = Annotated[str, Meta(min_length=1, max_length=MAX_NODE_LEN, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*\Z",
                               extra={"rule": _NAME_RULE})]
U64 = Annotated[int, Meta(ge=0, extra={"le": _U64})]  # msgspec holds integer bounds within int64 only
U32 = Annotated[int, Meta(ge=0, le=_U32)]
U24 = Annotated[int, Meta(ge=0, le=_U24)]
Rail = Annotated[int, Meta(ge=0, le=MAX_RAILS - 1)]  #: a rail index on a node
Rank = Annotated[int, Meta(ge=0, le=MAX_WORLD - 1)]
Text = Annotated[str, Meta(max_length=MAX_TEXT_LEN)]  #: an error or a reason, for humans
#: a backend-defined map (an endpoint description, a report): string keys, any wire values
Opaque = Annotated[dict[str, Any], Meta(max_length=MAX_OPAQUE_KEYS)]
IpcHandle = Annotated[bytes, Meta(min_length=CUDA_IPC_HANDLE_BYTES, max_length=CUDA_IPC_HANDLE_BYTES)]


def _handle(value: object) -> bytes | int | str:
    """A register ``handle``'s type: bytes (a CUipcMemHandle), an integer id, or a string (refused with why)."""
    if isinstance(value, bytes | bytearray | memoryview):
        return bytes(value)
    if isinstance(value, str) or (isinstance(value, int) and not isinstance(value, bool)):
        return value
    raise ValueError(f"expected bytes or integer or string, got {_type_name(value)}")


def _type_name(value: object) -> str:
    if value is None:
        return "nil"
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, list | tuple):
        return "array"
    if isinstance(value, dict | msgspec.Struct):
        return "map"
    return {int: "integer", float: "number", str: "string", bytes: "bytes"}.get(type(value), type(value).__name__)


#: how the protocol names types in its errors (msgpack's vocabulary)
WORDS = schema.Words(types={int: "integer", float: "number", bool: "bool", str: "string", bytes: "bytes",
                            tuple: "array", dict: "map", msgspec.Struct: "map"}, value_type=_type_name)


def _field_error(ctx: str, exc: Invalid, cls: type[ProtocolError] = LocalProtocolError) -> ProtocolError:
    field = schema.dotted(exc.path)
    return cls(f"{ctx}: field '{field}': {exc.problem}", code=ReplyCode.BAD_FIELD, field=field)


def _to_wire(value: object) -> object:
    if isinstance(value, msgspec.Struct):
        return {name: _to_wire(getattr(value, name)) for name in value.__struct_fields__}
    if isinstance(value, tuple | list):
        return [_to_wire(v) for v in value]
    if isinstance(value, dict):
        return {k: _to_wire(v) for k, v in value.items()}
    return value


class Record(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Base of every validated, immutable protocol value (messages and the records nested in them).

    Built locally, a record is checked at once (a mistake raises :class:`LocalProtocolError`); received, it
    is checked by the parse functions. Either way lists become tuples and maps become nested records.
    """

    _context: ClassVar[str] = "record"

    def __post_init__(self) -> None:
        if schema.converting():
            return  # built by msgspec inside schema.convert, which checks the whole message once it is built
        try:
            checked = schema.convert({name: getattr(self, name) for name in self.__struct_fields__}, type(self),
                                     WORDS)
        except Invalid as exc:
            raise _field_error(self._context, exc) from None
        for name in self.__struct_fields__:
            msgspec.structs.force_setattr(self, name, getattr(checked, name))

    def _check(self) -> None:
        """Rules across fields (the per-field ones are in the annotations); raise via :meth:`_fail`."""

    def _fail(self, field: str, problem: str) -> typing.NoReturn:
        raise Invalid((field,), problem)

    def _range(self, field: str, lo: int | float, hi: int | float) -> None:
        value = getattr(self, field)
        if not lo <= value <= hi:
            self._fail(field, f"must be in [{lo}, {hi}], got {value}")

    def _require(self, field: str, hint: Any) -> None:
        """Check ``field`` against ``hint`` where whether it applies depends on another field."""
        problem = schema.describe(hint, getattr(self, field), WORDS)
        if problem is not None:
            self._fail(field, problem)


class Message(Record):
    """A top-level message: a :class:`Record` with an ``op`` name and a wire form."""

    op: ClassVar[str]

    def to_msg(self) -> dict[str, Any]:
        """The wire map for this message (``v``, ``op`` and every field; tuples as lists)."""
        msg: dict[str, Any] = {"v": V, "op": self.op}
        for name in self.__struct_fields__:
            msg[name] = _to_wire(getattr(self, name))
        return msg


def _message(registry: dict[str, type[Message]]):
    def register(cls: type[Message]) -> type[Message]:
        cls._context = cls.op
        registry[cls.op] = cls
        return cls

    return register


REQUESTS: dict[str, type[Message]] = {}
PEER_MESSAGES: dict[str, type[Message]] = {}
SIDE_MESSAGES: dict[str, type[Message]] = {}
_request = _message(REQUESTS)
_peer = _message(PEER_MESSAGES)
_side = _message(SIDE_MESSAGES)


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
    only. The reply comes at once; ``stats`` says ``restart`` ``failed`` (with the reason) if the new daemon
    cannot start, and the daemon serves on."""

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


# ---------------------------------------------------------------------------------------------------------
# The descriptor socket: a Unix socket next to the control socket (zmq cannot carry descriptors). Its
# messages are msgpack maps like the control plane's, with at most one descriptor attached (SCM_RIGHTS);
# the kernel vouches for the sender (SO_PEERCRED). The I/O lives in ``transportd.control.fdchannel``.


class SideMessage(Message):
    """Marker base of descriptor-socket messages (one subclass per op in :data:`SIDE_MESSAGES`)."""

    #: descriptors the message carries (SCM_RIGHTS); any other number is refused
    fds: ClassVar[int] = 0


@_side
class Vouch(SideMessage):
    """Bind this descriptor connection to the control session whose hello returned ``token``.

    The token is good once; the session's uid, gid and pid become the kernel's view of this connection,
    and the session lasts no longer than the connection.
    """

    op: ClassVar[str] = "vouch"
    token: Annotated[bytes, Meta(min_length=TOKEN_BYTES, max_length=TOKEN_BYTES,
                                 description="from the hello reply")]


@_side
class PassFd(SideMessage):
    """Hand the daemon one descriptor (attached): ``memfd`` host memory, or a ``dmabuf`` of GPU memory.

    The reply's ``fd`` is the id a later ``register`` names as its ``handle``. Descriptors not registered
    stay with the session (bounded) until it ends.
    """

    op: ClassVar[str] = "pass_fd"
    fds: ClassVar[int] = 1
    kind: Literal["memfd", "dmabuf"] = "memfd"


@_side
class TakeFd(SideMessage):
    """Take a descriptor the daemon offered this session: the ``fd`` id of a ``flags`` or ``channel`` reply.

    Rings, flag arrays and IBGDA queues are anonymous memfds the daemon made: they travel only this way,
    attached to the reply (``SCM_RIGHTS``), which also says their ``kind`` (``ring``, ``flags``, ``ibgda``).
    Each is good once; offers not taken stay with the session (bounded) until it ends.
    """

    op: ClassVar[str] = "take_fd"
    fd: U32


# ---------------------------------------------------------------------------------------------------------
# Daemon ↔ daemon messages.


class PeerMessage(Message):
    """Marker base of daemon ↔ daemon messages (one subclass per op in :data:`PEER_MESSAGES`)."""


class RailQP(Record):
    """What a peer needs to connect to one rail: an IB RC QP (``gid`` and/or ``lid``) or an EFA endpoint."""

    _context: ClassVar[str] = "rail"
    rail: Rail
    qpn: Annotated[int, Meta(ge=1, le=_U24)]
    psn: U24 = 0
    gid: bytes = b""  #: GID_BYTES, or empty where the rail has a lid or is EFA
    lid: Annotated[int, Meta(ge=0, le=0xFFFF)] = 0
    efa_address: Annotated[bytes, Meta(max_length=MAX_EFA_ADDRESS)] = b""
    qkey: U32 = 0

    def _check(self) -> None:
        if self.efa_address:
            if self.gid or self.lid:
                self._fail("efa_address", "an EFA rail carries no gid/lid")
        elif self.gid:
            if len(self.gid) != GID_BYTES:
                self._fail("gid", f"must be {GID_BYTES} bytes, got {len(self.gid)}")
        elif not self.lid:
            self._fail("gid", "an IB rail needs a gid or a lid (an EFA rail needs efa_address)")


class RegionInfo(Record):
    """One registered region as peers see it: remote address (an offset for dmabuf MRs), length, rkey."""

    _context: ClassVar[str] = "region"
    id: U32
    addr: U64  #: at most 2**64 - 1 - length: checked with ``length``
    length: Annotated[int, Meta(ge=1, le=MAX_REGION_BYTES)]
    rkey: U32
    rail: Rail = 0

    def _check(self) -> None:
        self._range("addr", 0, _U64 - self.length)


@_peer
class PeerHello(PeerMessage):
    """First message on a peer link: who we are, which backend, how many rails, which life of the daemon.

    ``incarnation`` is the daemon's start time in ns (0: not told). A known node saying hello with a larger
    one has restarted: everything built with its earlier life (connections, responder QPs) is torn down, even
    when it came back before its heartbeats timed out. A smaller one is a late hello of an earlier life.
    """

    op: ClassVar[str] = "peer_hello"
    node: NodeName
    backend: Literal["ib", "efa", "soft"]
    rails: Annotated[int, Meta(ge=1, le=MAX_RAILS)]
    incarnation: U64 = 0


@_peer
class PeerConnect(PeerMessage):
    """QP (or EFA endpoint) information per rail; ``job`` empty for node-wide connections."""

    op: ClassVar[str] = "peer_connect"
    node: NodeName
    rails: tuple[RailQP, ...]
    job: NameOrEmpty = ""

    def _check(self) -> None:
        if not 1 <= len(self.rails) <= MAX_RAILS:
            self._fail("rails", f"must list 1..{MAX_RAILS} rails, got {len(self.rails)}")
        if len({r.rail for r in self.rails}) != len(self.rails):
            self._fail("rails", "lists a rail twice")


class _PeerEndpoint(PeerMessage):
    """One end of connection ``conn`` on ``rail`` for ``job``: the fields both connect messages carry.

    ``endpoint`` is that end as its backend described it (``Backend.create_endpoint``); the protocol
    checks only that it is a small map with string keys — its meaning belongs to the backend.
    """

    job: NameOrEmpty
    rail: Rail
    conn: U64
    endpoint: Opaque


@_peer
class PeerConnectRequest(_PeerEndpoint):
    """Ask the peer to create its end of connection ``conn``; ``endpoint`` is the sender's end.

    This is the form the daemon uses; :class:`PeerConnect` is the typed verbs-level equivalent.
    """

    op: ClassVar[str] = "peer_connect_request"


@_peer
class PeerConnectAccept(_PeerEndpoint):
    """The answer to :class:`PeerConnectRequest`: the accepting side's ``endpoint`` for the same ``conn``."""

    op: ClassVar[str] = "peer_connect_accept"


@_peer
class PeerDisconnect(PeerMessage):
    """The sender closed its end of connection ``conn`` (a job's connection or an IBGDA queue pair): close the
    end accepted for it."""

    op: ClassVar[str] = "peer_disconnect"
    job: NameOrEmpty
    rail: Rail
    conn: U64


@_peer
class PeerRegions(PeerMessage):
    """The regions rank ``rank`` of ``job`` registered on the sending node (replaces earlier announcements).

    ``flag_seeds`` are the nonzero counters of its flag array as they are now (``FLAG_SEED_DTYPE`` records:
    slot, pad, value): a flag array that outlived a daemon restart, so that a sender writing absolute flag
    values (ib write and fence modes) goes on from them rather than from 0.
    """

    op: ClassVar[str] = "peer_regions"
    job: Name
    rank: Rank
    regions: tuple[RegionInfo, ...]
    flag_seeds: Annotated[bytes, Meta(max_length=16 * MAX_FLAGS)] = b""

    def _check(self) -> None:
        if len(self.regions) > MAX_REGIONS:
            self._fail("regions", f"at most {MAX_REGIONS} regions, got {len(self.regions)}")
        if len({(r.id, r.rail) for r in self.regions}) != len(self.regions):
            self._fail("regions", "lists the same (id, rail) twice")
        if len(self.flag_seeds) % 16:
            self._fail("flag_seeds", f"must be 16-byte records, got {len(self.flag_seeds)} bytes")


@_peer
class PeerRankLeft(PeerMessage):
    """Rank ``rank`` of ``job`` on the sending node left (or was reclaimed): forget its regions and flags."""

    op: ClassVar[str] = "peer_rank_left"
    job: Name
    rank: Rank


@_peer
class PeerJobLost(PeerMessage):
    """The sender declared this node lost while ``job`` ran (its heartbeats stopped arriving, though the node
    itself may have noticed nothing) and failed the job's connections to it: the job cannot go on at the
    receiver either."""

    op: ClassVar[str] = "peer_job_lost"
    job: Name


@_peer
class PeerSelftest(PeerMessage):
    """A self-test job of the daemons' own: ``start``, the receiver joins rank 1 of ``job`` (world 2) on
    ``rail`` with its own memory, flags and ring, and echoes every flag it sees back to rank 0 (on the
    sender) with the data it covers; ``finish``, it answers ``peer_selftest_report`` and leaves the job.
    Travels on the peer plane, so it is authenticated (CURVE) like every other peer message."""

    op: ClassVar[str] = "peer_selftest"
    action: Literal["start", "finish"]
    job: Name
    rail: Rail = 0
    seed: U64 = 0


@_peer
class PeerSelftestReport(PeerMessage):
    """What the far side of a self-test saw: ``report`` (rounds, data checked, flags seen early, its
    turnaround per echo), or ``error`` when it could not take part."""

    op: ClassVar[str] = "peer_selftest_report"
    job: Name
    report: Opaque
    error: Text = ""


@_peer
class PeerRestarting(PeerMessage):
    """The sender's daemon is restarting (SIGTERM, ``transportctl restart``): hold every record for its
    ranks, let what is in flight to it complete, answer ``peer_quiesced``, and keep its jobs for
    ``peers.restart_grace_s`` while its next life comes back and its ranks re-announce themselves."""

    op: ClassVar[str] = "peer_restarting"
    node: NodeName


@_peer
class PeerQuiesced(PeerMessage):
    """The answer to ``peer_restarting``: nothing of the sender's is in flight to the restarting node any
    more (its connections there are held and drained), so the restarting node may stop."""

    op: ClassVar[str] = "peer_quiesced"
    node: NodeName


@_peer
class PeerHeartbeat(PeerMessage):
    """Liveness: sequence number and the sender's clock (seconds), for loss and round-trip reports."""

    op: ClassVar[str] = "peer_heartbeat"
    seq: U64
    t: Annotated[float, Meta(ge=0)]


@_peer
class PeerBye(PeerMessage):
    """The sender is shutting down cleanly; tear down without waiting for the heartbeat timeout."""

    op: ClassVar[str] = "peer_bye"
    node: NodeName
    reason: Text = ""


# ---------------------------------------------------------------------------------------------------------
# The receive boundary.


def _parse(msg: object, registry: dict[str, type[Message]], plane: str) -> Message:
    if not isinstance(msg, dict):
        raise RemoteProtocolError(f"{plane} message must be a map, got {_type_name(msg)}")
    if "v" not in msg:
        raise RemoteProtocolError(f"{plane} message has no protocol version 'v'", code=ReplyCode.BAD_VERSION,
                                  field="v")
    version = msg["v"]
    if type(version) is not int or version != V:  # exactly the integer: not 1.0, not True
        kind = "" if type(version) is int else f" ({_type_name(version)}): this side speaks v{V}, the integer {V}"
        raise RemoteProtocolError(f"protocol version {version!r:.20} is not supported" + (kind or
                                  f" (this side speaks v{V})"),
                                  code=ReplyCode.BAD_VERSION, field="v")
    op = msg.get("op")
    if not isinstance(op, str):
        raise RemoteProtocolError(f"{plane} message has no string 'op' (got {_type_name(op)})",
                                  code=ReplyCode.BAD_MESSAGE, field="op")
    cls = registry.get(op)
    if cls is None:
        raise RemoteProtocolError(f"unknown op {op!r:.40}; known: {', '.join(sorted(registry))}",
                                  code=ReplyCode.UNKNOWN_OP, field="op")
    fields = {k: v for k, v in msg.items() if k not in ("v", "op")}
    try:
        return schema.convert(fields, cls, WORDS)
    except Invalid as exc:
        raise _field_error(op, exc, RemoteProtocolError) from None


def parse_request(msg: dict[str, Any]) -> Request:
    """Validate a decoded client message into its :class:`Request`, or raise :class:`RemoteProtocolError`."""
    return typing.cast(Request, _parse(msg, REQUESTS, "control"))


def parse_side_message(msg: dict[str, Any], fds: int = 0) -> SideMessage:
    """Validate a descriptor-socket message carrying ``fds`` descriptors, or raise RemoteProtocolError."""
    parsed = typing.cast(SideMessage, _parse(msg, SIDE_MESSAGES, "descriptor socket"))
    if fds != parsed.fds:
        raise RemoteProtocolError(f"{parsed.op} carries {parsed.fds} descriptor(s), got {fds}",
                                  code=ReplyCode.BAD_MESSAGE, field="fds")
    return parsed


def parse_peer_message(msg: dict[str, Any]) -> PeerMessage:
    """Validate a decoded peer-daemon message into its :class:`PeerMessage`, or raise RemoteProtocolError."""
    return typing.cast(PeerMessage, _parse(msg, PEER_MESSAGES, "peer"))


# ---------------------------------------------------------------------------------------------------------
# Replies.

_REPLY_RESERVED = frozenset({"v", "ok", "code", "message"})


def ok(**fields: Any) -> dict[str, Any]:
    """A success reply carrying ``fields``."""
    clash = _REPLY_RESERVED.intersection(fields)
    if clash:
        raise LocalProtocolError(f"reply field(s) {', '.join(sorted(clash))} are reserved")
    return {"v": V, "ok": True, **fields}


def error(code: str, message: str) -> dict[str, Any]:
    """An error reply: stable ``code`` (see :class:`ReplyCode`) plus a message for humans."""
    return {"v": V, "ok": False, "code": str(code), "message": message}


def error_reply_for(exc: BaseException) -> dict[str, Any]:
    """Map an exception raised while serving a request to its error reply (unknown ones are ``internal``)."""
    if isinstance(exc, RequestError):
        return error(exc.code, exc.message)
    if isinstance(exc, ProtocolError):
        return error(exc.code, str(exc))
    return error(ReplyCode.INTERNAL, f"{type(exc).__name__}: {exc}")


def parse_reply(msg: dict[str, Any]) -> dict[str, Any]:
    """The fields of a success reply; raises :class:`RequestError` for an error reply.

    A reply that is not a reply at all raises :class:`RemoteProtocolError`.
    """
    if type(msg.get("v")) is not int or msg.get("v") != V:
        raise RemoteProtocolError(f"reply has protocol version {msg.get('v')!r:.20}, expected {V}",
                                  code=ReplyCode.BAD_VERSION, field="v")
    status = msg.get("ok")
    if not isinstance(status, bool):
        raise RemoteProtocolError("reply has no boolean 'ok'", field="ok")
    if not status:
        code, message = msg.get("code"), msg.get("message")
        if not isinstance(code, str) or not isinstance(message, str):
            raise RemoteProtocolError("error reply lacks string 'code' and 'message'", field="code")
        raise RequestError(code, message)
    return {k: v for k, v in msg.items() if k not in ("v", "ok")}


# ---------------------------------------------------------------------------------------------------------
# Session state machine: the only place that says which op may follow which.


class SessionState(Enum):
    """Where a client session stands."""

    NEW = "new"  #: connected, not greeted
    READY = "ready"  #: greeted, not in a job
    JOINED = "joined"  #: attached to (job, rank); may use memory, flags and channels


_ANY = ("heartbeat",)
#: state -> {op: next state}. An op missing from a state's row is refused with ``bad_state``.
TRANSITIONS: dict[SessionState, dict[str, SessionState]] = {
    SessionState.NEW: {"hello": SessionState.READY},
    SessionState.READY: {
        "hello": SessionState.READY,
        "join": SessionState.JOINED,
        "stats": SessionState.READY,
        "inspect": SessionState.READY,
        "selftest": SessionState.READY,
        "trace_start": SessionState.READY,
        "trace_stop": SessionState.READY,
        "restart": SessionState.READY,
    },
    SessionState.JOINED: {
        "register": SessionState.JOINED,
        "flags": SessionState.JOINED,
        "channel": SessionState.JOINED,
        "channel_info": SessionState.JOINED,
        "channel_connect": SessionState.JOINED,
        "channel_close": SessionState.JOINED,
        "exchange": SessionState.JOINED,
        "stats": SessionState.JOINED,
        "inspect": SessionState.JOINED,
        "selftest": SessionState.JOINED,
        "trace_start": SessionState.JOINED,
        "trace_stop": SessionState.JOINED,
        "restart": SessionState.JOINED,
        "leave": SessionState.READY,
    },
}
for _row_state, _row in TRANSITIONS.items():
    for _op in _ANY:
        _row[_op] = _row_state
assert all(op in REQUESTS for row in TRANSITIONS.values() for op in row)


def next_state(state: SessionState, op: str) -> SessionState | None:
    """The state after a successful ``op`` in ``state``, or None when ``op`` is not allowed there."""
    return TRANSITIONS[state].get(op)


def _state_problem(state: SessionState, op: str) -> str:
    allowed = ", ".join(sorted(TRANSITIONS[state]))
    hint = {SessionState.NEW: " (send hello first)", SessionState.READY: " (join a job first)"}.get(state, "")
    return f"op '{op}' is not allowed in session state '{state.value}'{hint}; allowed: {allowed}"


class SessionRules:
    """Which ops one client session may send now (its state); the client checks before sending, the server
    before dispatching."""

    def __init__(self, state: SessionState = SessionState.NEW) -> None:
        self.state = state

    def check(self, op: str) -> None:
        """Raise :class:`LocalProtocolError` (code ``bad_state``) when ``op`` may not be sent now."""
        if next_state(self.state, op) is None:
            raise LocalProtocolError(_state_problem(self.state, op), code=ReplyCode.BAD_STATE, field="op")

    def refuse_reason(self, op: str) -> str | None:
        """The server's view: why ``op`` is refused now, or None when it is allowed."""
        return None if next_state(self.state, op) is not None else _state_problem(self.state, op)

    def advance(self, op: str) -> None:
        """Record that ``op`` succeeded."""
        new = next_state(self.state, op)
        if new is None:
            raise LocalProtocolError(_state_problem(self.state, op), code=ReplyCode.BAD_STATE, field="op")
        self.state = new

    def __repr__(self) -> str:
        return f"SessionRules({self.state.value})"
