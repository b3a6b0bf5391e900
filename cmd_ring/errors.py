"""Errors raised by transportd and its client, grouped by where the fault came from; and the ring's own.

They live in the contract (cmd_ring) because both sides raise and catch them and the channel error word's
codes (:class:`ErrorCode`) are ABI shared with the C core and the device API; ``transportd.errors`` is the
same module under its old name.

One base class, :class:`TransportdError`, so callers can catch everything we raise. Subclasses say who is
at fault, which decides what to do about it. Three stand outside it, as the builtin a caller expects:
``Invalid`` (the config and the protocol never let it out), ``GdrCopyError`` (an ``OSError``) and
``TraceFormatError`` (a ``ValueError``); so do the ring's ``RingError`` family, which predate the
base and stay plain ``Exception``s.

==========================  ==============================================================================
``ConfigError``             the operator's config file (fix the file; the message names file and key)
``LocalProtocolError``      our own code tried to build or send a message the protocol forbids (a bug here)
``RemoteProtocolError``     the other side sent bytes we cannot accept (malformed, oversized, wrong version)
``RequestError``            a well-formed request the daemon refused; ``code`` is a stable string
``PeerError``               a peer daemon misbehaved; ``PeerDeadError`` when it stopped answering
``DaemonUnavailableError``  no daemon at the control endpoint, or it cannot be reached; says how to fix it
``DaemonTimeoutError``      the daemon was reached once but stopped answering a request in time
``ListenError``             the daemon cannot listen where its config says (a port in use, say)
``SocketGroupError``        the control socket cannot be given to ``control.group`` (no such group, not allowed)
``Invalid``                 a value read from outside does not fit its schema (the config and the protocol
                            turn it into ``ConfigError`` or ``ProtocolError`` naming the path)
``CudaError``               a CUDA driver call failed; ``CudaUnavailableError`` when there is no cuda-python or
                            no driver
``GdrCopyError``            libgdrapi (GDRCopy) is missing or could not pin or map GPU memory (an ``OSError``)
``VerbsUnavailableError``   the requested verbs provider cannot be loaded (pyverbs missing or broken)
``BackendError``            a backend could not do what was asked: ``DeviceNotFoundError`` (no such RDMA
                            device), ``VerbsError`` (a verbs call failed), ``SendQueueFullError`` (backstop)
``WorkerError``             a rail's proxy worker process refused a request, died, or did not answer
``TraceFormatError``        a file is not a trace file this reader understands (a ``ValueError``)
==========================  ==============================================================================

The Local/Remote split follows h11: messages are validated on construction (a failure there is local),
and the single receive boundary translates the same failure into ``RemoteProtocolError``.

:class:`ErrorCode` is the numeric vocabulary a proxy writes into a channel's error word, readable by a GPU
kernel through ``tpd::status(ch)``. The values are ABI: the contract's C header ``<transportd/errors.h>``
mirrors them (see :func:`error_code_c_enum`), so a value is never reused or renumbered.
"""

from __future__ import annotations

from enum import IntEnum
from typing import Any

__all__ = [
    "BackendError",
    "ConfigError",
    "CudaError",
    "CudaUnavailableError",
    "DaemonTimeoutError",
    "DaemonUnavailableError",
    "DeviceNotFoundError",
    "ErrorCode",
    "GdrCopyError",
    "Invalid",
    "ListenError",
    "LocalProtocolError",
    "PeerDeadError",
    "PeerError",
    "ProtocolError",
    "RemoteProtocolError",
    "RequestError",
    "RingError",
    "RingFullError",
    "RingLayoutError",
    "RingNotFoundError",
    "SendQueueFullError",
    "SessionLostError",
    "SocketGroupError",
    "TraceFormatError",
    "TransportdError",
    "VerbsError",
    "VerbsUnavailableError",
    "WorkerError",
    "dotted",
    "error_code_c_enum",
]


class TransportdError(Exception):
    """Base of every error transportd raises on purpose."""


# --- the config, the protocol, requests, peers, reaching and running the daemon --------------------------
class ConfigError(TransportdError):
    """A config file is unreadable or holds a bad value; names the file and dotted key so it can be fixed."""

    def __init__(self, file: str, key: str, reason: str) -> None:
        self.file = file
        self.key = key
        self.reason = reason
        super().__init__(f"{file}: {key}: {reason}")

    def __reduce__(self) -> tuple[type, tuple[str, str, str]]:
        return (type(self), (self.file, self.key, self.reason))


class ListenError(TransportdError):
    """The daemon cannot bind the endpoint config key ``key`` names; the message says which and why.

    Not a :class:`ConfigError`: a port held by another process may be free a moment later, so systemd's
    restart should still try again.
    """

    def __init__(self, key: str, endpoint: str, reason: str, *, in_use: bool = False) -> None:
        self.key = key
        self.endpoint = endpoint
        self.reason = reason
        self.in_use = in_use
        hint = (f": another process holds it (a transportd already running? `ss -ltnp` names it); stop that "
                f"or set another {key}") if in_use else ""
        super().__init__(f"{key} = {endpoint!r}: cannot listen: {reason}{hint}")

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild_listen_error, (self.key, self.endpoint, self.reason, self.in_use))


def _rebuild_listen_error(key: str, endpoint: str, reason: str, in_use: bool) -> ListenError:
    return ListenError(key, endpoint, reason, in_use=in_use)


class ProtocolError(TransportdError):
    """A message breaks the control or peer protocol.

    ``code`` is the stable reply code the control server sends back for it (see
    :class:`transportd.control.protocol.ReplyCode`); ``field`` names the offending field when there is one.
    """

    def __init__(self, message: str, *, code: str = "bad_message", field: str | None = None) -> None:
        self.code = code
        self.field = field
        super().__init__(message)

    def __reduce__(self) -> tuple[object, ...]:
        return (_rebuild_protocol_error, (type(self), str(self), self.code, self.field))


def _rebuild_protocol_error(cls: type[ProtocolError], message: str, code: str, field: str | None):
    return cls(message, code=code, field=field)


class LocalProtocolError(ProtocolError):
    """We were about to build or send something the protocol forbids: a mistake in the calling code."""


class RemoteProtocolError(ProtocolError):
    """The other side sent something the protocol forbids; the connection itself may still be usable."""


class RequestError(TransportdError):
    """The daemon understood a request and refused it.

    ``code`` is a stable machine-readable string (``"bad_state"``, ``"invalid"``, ...) so callers branch on
    it rather than on the human ``message``.
    """

    def __init__(self, code: str, message: str) -> None:
        self.code = code
        self.message = message
        super().__init__(f"{code}: {message}")

    def __reduce__(self) -> tuple[type, tuple[str, str]]:
        return (type(self), (self.code, self.message))


class SessionLostError(RequestError):
    """The daemon no longer knows this client's session: it restarted, or reclaimed the session (its process
    looked dead, or it stayed silent past ``control.client_timeout_s``). Connect and join again."""


class PeerError(TransportdError):
    """A peer daemon sent something wrong or could not be connected; ``peer`` names it."""

    def __init__(self, peer: str, message: str) -> None:
        self.peer = peer
        super().__init__(f"peer {peer}: {message}")

    def __reduce__(self) -> tuple[object, ...]:
        return (_rebuild_peer_error, (type(self), self.peer, str(self)))


def _rebuild_peer_error(cls: type[PeerError], peer: str, text: str) -> PeerError:
    err = cls.__new__(cls)
    err.peer = peer
    Exception.__init__(err, text)
    return err


class PeerDeadError(PeerError):
    """A peer daemon stopped answering heartbeats; its connections and the jobs using them are lost."""


class DaemonUnavailableError(TransportdError):
    """The local daemon cannot be reached at ``endpoint``; the message says what to check or run."""

    def __init__(self, endpoint: str, message: str) -> None:
        self.endpoint = endpoint
        super().__init__(message)

    def __reduce__(self) -> tuple[type, tuple[str, str]]:
        return (type(self), (self.endpoint, str(self)))


class DaemonTimeoutError(DaemonUnavailableError):
    """A request got no reply in time from a daemon that had answered before (hung, overloaded or gone)."""


class SocketGroupError(TransportdError):
    """The control socket file could not be given to the configured group (``control.group``).

    ``ControlServer.from_config`` reports it as the :class:`ConfigError` of that key.
    """


# --- values read from outside (transportd.schema) ---------------------------------------------------------
def dotted(path: tuple[str | int, ...]) -> str:
    """``("rails", 0, "gid")`` as ``rails[0].gid``."""
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else part)
    return out


class Invalid(Exception):
    """A value that does not fit its schema: ``path`` to it, ``problem`` in words, and what kind of failure.

    ``reason`` is ``"missing"`` (a required field), ``"unknown"`` (a field the Struct has not; ``known``
    lists the ones it has) or ``"invalid"``. ``path`` is a ``transportd.schema.FieldPath``.
    """

    def __init__(self, path: tuple[str | int, ...], problem: str, *, reason: str = "invalid",
                 known: tuple[str, ...] = ()) -> None:
        self.path = path
        self.problem = problem
        self.reason = reason
        self.known = known
        super().__init__(f"{dotted(path)}: {problem}")

    def within(self, prefix: tuple[str | int, ...]) -> Invalid:
        """The same failure seen from ``prefix`` (a Struct holding the one that failed)."""
        return Invalid(prefix + self.path, self.problem, reason=self.reason, known=self.known)


# --- the host: CUDA driver, GDRCopy, the verbs provider ---------------------------------------------------
class CudaError(TransportdError):
    """A CUDA driver call failed; ``result`` is the CUresult name."""

    def __init__(self, call: str, result: str) -> None:
        self.call = call
        self.result = result
        super().__init__(f"{call} failed: {result}")


class CudaUnavailableError(CudaError):
    """cuda-python is not installed (``pip install 'transportd[cuda]'``) or no GPU driver is present."""


class GdrCopyError(OSError):
    """libgdrapi could not be loaded, opened or could not pin/map a buffer."""


class VerbsUnavailableError(TransportdError):
    """The requested verbs provider cannot be loaded (pyverbs missing or broken)."""


# --- the RDMA backends (transportd.backends, ib, efa) -----------------------------------------------------
class BackendError(TransportdError):
    """A backend could not do what was asked; the message says what to change."""


class DeviceNotFoundError(BackendError):
    """The configured RDMA device does not exist (or no device exists at all)."""


class VerbsError(BackendError):
    """A verbs call failed; ``errno`` is what the provider returned (-1 if it gave none)."""

    def __init__(self, message: str, errno_: int = -1) -> None:
        self.errno = errno_
        super().__init__(message)

    def __reduce__(self) -> tuple[type, tuple[str, int]]:
        return (type(self), (str(self), self.errno))


class SendQueueFullError(BackendError):
    """``post`` would overrun the connection's send queue; nothing was posted. Poll, then post again.

    The proxy's inflight cap normally keeps this from happening; it is the backstop that keeps a bug from
    becoming a provider error in the middle of a batch.
    """


# --- the daemon's own data plane (transportd.dataplane) ---------------------------------------------------
class WorkerError(TransportdError):
    """A proxy worker refused a request, died, or did not answer."""


class TraceFormatError(ValueError):
    """The file is not a trace file this reader understands (magic, version, sizes or length)."""


# --- the channel error word -------------------------------------------------------------------------------
class ErrorCode(IntEnum):
    """Codes a proxy writes into a channel's error word; 0 means no error.

    The code of the lowest bad position is kept (later ones only raise counters), so a kernel sees the root
    cause, and every record before that position executed. A record taken earlier can fail later (a
    completion out of ring order, on SRD or from a failed connection): then the position moves down to it.
    Values fit in 16 bits and are mirrored by ``TPD_ERR_*`` in the CUDA header.
    """

    def __new__(cls, value: int, doc: str) -> ErrorCode:
        member = int.__new__(cls, value)
        member._value_ = value
        member.__doc__ = doc
        return member

    OK = 0, "No error: every record on this channel so far was accepted."
    BAD_OPCODE = 1, "A record's opcode is not one the proxy knows; the record was not posted."
    BAD_PEER = 2, "A record names a destination rank outside the job's world or without a connection."
    BAD_REGION = 3, "A record names a region id not registered by this job (regions are job-scoped)."
    OUT_OF_BOUNDS = 4, "offset + length falls outside the source or destination region."
    BAD_LENGTH = 5, "A transfer length of zero, or above the backend's maximum message size."
    BAD_SLOT = 6, "A signal or flag slot index outside the channel's flag array."
    CLIENT_GONE = 7, "The session is over (left, reclaimed, or the daemon stopped): its records are refused."
    PEER_LOST = 8, "The destination's node stopped answering heartbeats; its work was flushed."
    REMOTE_ACCESS = 9, "The remote NIC refused the access (rkey, bounds or permission): a remote-access error."
    TRANSPORT = 10, "Any other completion error from the NIC (retry exceeded, QP in error, flush)."
    BAD_ALIGNMENT = 11, "An atomic signal's address or a flag's address is not 8-byte aligned."
    BAD_RECORD = 12, "A torn or corrupt record (commit word or parity mismatch); it was skipped."
    NO_ACCESS = 13, "The region was registered without the access the operation needs (read/write/atomic)."
    UNKNOWN_OUTCOME = 14, ("A daemon restart or crash (its own, or the destination's) came between the post and "
                           "the completion: the record may or may not have executed; the error position is "
                           "the first such record.")
    CHANNEL_LOST = 15, ("The channel did not survive a daemon restart (an IBGDA channel: its queue pairs and "
                        "keys died with the daemon); open a new one, the session is still valid.")
    INTERNAL = 255, "A fault inside the daemon itself; the daemon's log has the details."


def error_code_c_enum(prefix: str = "TPD_ERR_") -> str:
    """C enum text for :class:`ErrorCode`, so the contract's ``<transportd/errors.h>`` can be generated from (or
    checked against) it."""
    lines = ["enum tpd_error_code {"]
    for code in ErrorCode:
        lines.append(f"    /** {code.__doc__} */")
        lines.append(f"    {prefix}{code.name} = {int(code)},")
    lines.append("};")
    return "\n".join(lines) + "\n"


# --- the ring (cmd_ring.ring): created, attached or used -------------------------------------------------
class RingError(Exception):
    """A ring could not be created, attached or used."""


class RingNotFoundError(RingError):
    """No ring file under that name."""


class RingLayoutError(RingError):
    """The file exists but is not a ring of this version, or its size disagrees with its header."""


class RingFullError(RingError):
    """No credit became free before the producer's timeout."""
