"""Replies on the control and descriptor sockets: ``{"v", "ok": true, ...}`` or ``{"v", "ok": false, "code",
"message"}``, the code one of :class:`~cmd_ring.protocol.wire.ReplyCode`'s members."""

from __future__ import annotations

from typing import Any

from cmd_ring.errors import LocalProtocolError, ProtocolError, RemoteProtocolError, RequestError
from cmd_ring.protocol.wire import ReplyCode, V

__all__ = [
    "error",
    "error_reply_for",
    "ok",
    "parse_reply",
]

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
