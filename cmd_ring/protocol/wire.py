"""What the control, descriptor-socket and peer protocols share, with no I/O: the protocol version, the
stable reply codes, the field types that carry each field's limits, the validated :class:`Record` and
:class:`Message` bases, and the one receive boundary (:func:`_parse`) each plane's parse function goes
through. The planes' messages live in ``client_messages``, ``side_messages`` and ``peer_messages``;
``cmd_ring.protocol`` (and its old name ``transportd.control.protocol``) re-exports them all.
"""

from __future__ import annotations

import typing
from enum import StrEnum
from typing import Annotated, Any, ClassVar

import msgspec
from msgspec import Meta

from cmd_ring import schema
from cmd_ring.errors import Invalid, LocalProtocolError, ProtocolError, RemoteProtocolError
from cmd_ring.limits import MAX_RAILS, MAX_WORLD

__all__ = [
    "CUDA_IPC_HANDLE_BYTES",
    "GID_BYTES",
    "IpcHandle",
    "MAX_EFA_ADDRESS",
    "MAX_FD_ID",
    "MAX_FLAGS",
    "MAX_NAME_LEN",
    "MAX_NODE_LEN",
    "MAX_OPAQUE_KEYS",
    "MAX_PID",
    "MAX_REGION_BYTES",
    "MAX_TEXT_LEN",
    "Message",
    "Name",
    "NameOrEmpty",
    "NodeName",
    "Opaque",
    "Rail",
    "Rank",
    "Record",
    "ReplyCode",
    "TOKEN_BYTES",
    "Text",
    "U24",
    "U32",
    "U64",
    "V",
    "WORDS",
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
    # op-specific codes (their values were on the wire before they were members here: never change them)
    ALREADY_JOINED = "already_joined"  #: join from a session that is in a job already
    NOT_JOINED = "not_joined"  #: an op that needs a joined session, before join
    BAD_WORLD = "bad_world"  #: join with another world size than the job has
    RANK_TAKEN = "rank_taken"  #: join as a rank another session of the job holds
    TOO_MANY_REGIONS = "too_many_regions"  #: register past the per-rank region limit
    REGISTER_FAILED = "register_failed"  #: a rail could not map or register the memory
    FLAGS_EXIST = "flags_exist"  #: flags for a rank that has its flag array already
    FLAGS_FAILED = "flags_failed"  #: a rail could not map or register the flag array
    NO_FLAGS = "no_flags"  #: exchange before flags
    UNREACHABLE = "unreachable"  #: a peer or a connection to it is down (exchange, self-test, IBGDA queues)
    NOT_READY = "not_ready"  #: an IBGDA channel before exchange has completed
    CHANNEL_FAILED = "channel_failed"  #: a rail could not open, connect or adopt a channel
    UNKNOWN_CHANNEL = "unknown_channel"  #: names a channel this session did not open
    BUSY = "busy"  #: too many self-tests running on the node
    EXISTS = "exists"  #: trace_start for a rank being traced already
    FAILED = "failed"  #: trace_start failed on a rail (the message says why)


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
