"""The descriptor socket's messages (``vouch``, ``pass_fd``, ``take_fd``) and their receive boundary
(:func:`parse_side_message`, which also checks the descriptors each carries)."""

from __future__ import annotations

import typing
from typing import Annotated, Any, ClassVar, Literal

from msgspec import Meta

from cmd_ring.errors import RemoteProtocolError
from cmd_ring.protocol.wire import TOKEN_BYTES, U32, Message, ReplyCode, _message, _parse

__all__ = [
    "PassFd",
    "SIDE_MESSAGES",
    "SideMessage",
    "TakeFd",
    "Vouch",
    "parse_side_message",
]

SIDE_MESSAGES: dict[str, type[Message]] = {}
_side = _message(SIDE_MESSAGES)


# ---------------------------------------------------------------------------------------------------------
# The descriptor socket: a Unix socket next to the control socket (zmq cannot carry descriptors). Its
# messages are msgpack maps like the control plane's, with at most one descriptor attached (SCM_RIGHTS);
# the kernel vouches for the sender (SO_PEERCRED). The I/O lives in ``transportd.control.fdsocket``.


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


def parse_side_message(msg: dict[str, Any], fds: int = 0) -> SideMessage:
    """Validate a descriptor-socket message carrying ``fds`` descriptors, or raise RemoteProtocolError."""
    parsed = typing.cast(SideMessage, _parse(msg, SIDE_MESSAGES, "descriptor socket"))
    if fds != parsed.fds:
        raise RemoteProtocolError(f"{parsed.op} carries {parsed.fds} descriptor(s), got {fds}",
                                  code=ReplyCode.BAD_MESSAGE, field="fds")
    return parsed
