"""The one place transportd turns messages into bytes and back (msgpack, through msgspec).

Every control and peer message is a msgpack map. Decoding is the trust boundary, so :func:`decode` refuses
anything the protocol has no use for — oversized input, trailing bytes, a non-map top level, non-string map
keys, ext types (including msgpack timestamps) and nesting deeper than :data:`MAX_DEPTH` — with a
:class:`RemoteProtocolError` that says which rule was broken. Encoding carries numpy arrays and other
buffers as msgpack ``bin`` (raw bytes, no dtype); the receiver views them with :func:`as_array` without a
copy. The protocol's Structs (:mod:`cmd_ring.protocol`) are then built from the decoded map by
msgspec as well (``cmd_ring.schema.convert``).
"""

from __future__ import annotations

import datetime
from typing import Any

import msgspec
import numpy as np

from cmd_ring.errors import LocalProtocolError, RemoteProtocolError

__all__ = ["MAX_DEPTH", "as_array", "decode", "encode"]

#: Deepest nesting of maps/arrays accepted; our messages use three levels at most.
MAX_DEPTH = 16

def _default(obj: object) -> object:
    if isinstance(obj, np.ndarray):
        if not obj.flags.c_contiguous:
            obj = np.ascontiguousarray(obj)
        return obj.tobytes()
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, bytearray | memoryview):
        return bytes(obj)
    if isinstance(obj, tuple | frozenset | set):
        return list(obj)
    raise LocalProtocolError(f"cannot encode a value of type {type(obj).__name__}: {obj!r:.80}")


def _refuse_ext(code: int, data: memoryview) -> object:
    raise RemoteProtocolError(f"malformed message: msgpack ext type {code} is not accepted")


# The module-level msgspec calls, not one shared Encoder: an Encoder keeps its output buffer between calls,
# and several threads encode here (a client's keepalive thread beside its caller); the per-call state costs
# little at control-message sizes. msgspec's own bytes, bytearray, memoryview, tuple and set support covers
# the rest of what _default would do. On decode, ext types are refused by the hook; a timestamp (ext -1)
# decodes as a datetime, which _check_tree refuses.


def encode(obj: Any) -> bytes:
    """Serialize ``obj`` (normally a dict message) to msgpack; arrays and buffers become ``bin``."""
    try:
        return msgspec.msgpack.encode(obj, enc_hook=_default)
    except LocalProtocolError:
        raise
    except (TypeError, ValueError, OverflowError) as exc:
        raise LocalProtocolError(f"cannot encode message: {exc}") from exc


def decode(data: bytes | bytearray | memoryview, max_size: int) -> dict[str, Any]:
    """Parse one msgpack map of at most ``max_size`` bytes, refusing anything else.

    Raises :class:`RemoteProtocolError` (code ``too_large`` for size, ``bad_message`` otherwise).
    """
    size = len(data) if not isinstance(data, memoryview) else data.nbytes
    if size > max_size:
        raise RemoteProtocolError(
            f"message of {size} bytes exceeds the limit of {max_size} bytes", code="too_large"
        )
    if size == 0:
        raise RemoteProtocolError("malformed message: empty payload")
    try:
        obj = msgspec.msgpack.decode(data, ext_hook=_refuse_ext)
    except RemoteProtocolError:
        raise
    except msgspec.DecodeError as exc:
        detail = str(exc)
        if "trailing characters" in detail:
            raise RemoteProtocolError("malformed message: trailing bytes after the msgpack map") from exc
        if "UTF-8" in detail:
            raise RemoteProtocolError(f"malformed message: string is not valid UTF-8 ({detail})") from exc
        raise RemoteProtocolError(f"malformed message: not valid msgpack ({detail})") from exc
    except (ValueError, TypeError, RecursionError) as exc:
        detail = str(exc) or type(exc).__name__
        raise RemoteProtocolError(f"malformed message: not valid msgpack ({detail})") from exc
    if not isinstance(obj, dict):
        raise RemoteProtocolError(f"malformed message: top level must be a map, got {_wire_type(obj)}")
    _check_tree(obj, 1)
    return obj


def as_array(data: bytes | memoryview, dtype: np.dtype | str, shape: tuple[int, ...] | None = None) -> np.ndarray:
    """A read-only zero-copy numpy view of ``bin`` data from :func:`decode` (checks the size divides)."""
    dt = np.dtype(dtype)
    nbytes = len(data) if not isinstance(data, memoryview) else data.nbytes
    if nbytes % dt.itemsize:
        raise RemoteProtocolError(f"{nbytes} bytes is not a whole number of {dt} items")
    arr = np.frombuffer(data, dtype=dt)
    return arr.reshape(shape) if shape is not None else arr


def _check_tree(obj: object, depth: int) -> None:
    if depth > MAX_DEPTH:
        raise RemoteProtocolError(f"malformed message: nested deeper than {MAX_DEPTH} levels")
    if isinstance(obj, dict):
        for key, value in obj.items():
            if isinstance(key, bytes):
                raise RemoteProtocolError(f"malformed message: map key {key!r:.40} is not a string")
            if not isinstance(key, str):  # msgpack allows any key; we allow string keys (and name bin ones)
                raise RemoteProtocolError(f"malformed message: not valid msgpack (map key of type "
                                          f"{_wire_type(key)}: keys must be strings)")
            if isinstance(value, dict | list):
                _check_tree(value, depth + 1)
            elif not isinstance(value, _SCALARS):
                raise RemoteProtocolError(f"malformed message: value of type {_wire_type(value)} not accepted")
    elif isinstance(obj, list):
        for value in obj:
            if isinstance(value, dict | list):
                _check_tree(value, depth + 1)
            elif not isinstance(value, _SCALARS):
                raise RemoteProtocolError(f"malformed message: value of type {_wire_type(value)} not accepted")


_SCALARS = (type(None), bool, int, float, str, bytes)


def _wire_type(obj: object) -> str:
    if isinstance(obj, datetime.datetime):
        return "ext -1 (timestamp)"
    return {list: "array", dict: "map", str: "string", bytes: "bin", bool: "bool", int: "integer",
            float: "float", type(None): "nil"}.get(type(obj), type(obj).__name__)
