"""The trace file: what a traced rank's channels took, record by record (docs/trace.md, version 1).

The compiled engine records (``transportd/core/trace.h``): for every record it takes from a traced
channel, the 48 bytes, the time of the pass that took it, its ring position and its outcome code, as one
72-byte entry (:data:`ENTRY_DTYPE`); and for a record that fails later (a completion error, a lost peer,
a client gone) a second entry with that code. Each rail worker's engine appends raw entries to a *part*
file per channel (no header: the engine only ever appends); when the trace stops, the daemon merges the
parts into one trace file:

    header   64 bytes (:data:`HEADER_DTYPE`): magic ``TPDTRACE``, version, sizes, start times, count
    context  ``context_len`` bytes of UTF-8 JSON (what a replay needs to rebuild the job: world, the
             rank's regions, its peers' regions and flags, the channels, the proxy's settings),
             zero-padded to a multiple of 8
    entries  ``entries`` x 72 bytes, in time order (ties: channel, then position)

:func:`write_trace` and :func:`read_trace` are the writer and the reader; :func:`read_part` reads a part
file (ignoring a torn last entry), :func:`merge_parts` turns parts into a trace file.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from cmd_ring.record import RECORD_DTYPE
from transportd import _core
from transportd.errors import TraceFormatError

__all__ = ["ENTRY_DTYPE", "FAILED", "HEADER_DTYPE", "MAGIC", "TAKEN", "VERSION", "Trace", "merge_parts",
           "parse_trace", "read_part", "read_trace", "write_trace"]

MAGIC = b"TPDTRACE"
VERSION = 1
TAKEN = 1  # the take-time outcome of a record (0: accepted)
FAILED = 2  # a later code for a record taken before; its record bytes are zero

ENTRY_DTYPE = np.dtype([
    ("record", RECORD_DTYPE),
    ("t_ns", "<u8"),
    ("position", "<u8"),
    ("channel", "<u4"),
    ("code", "<u2"),
    ("kind", "u1"),
    ("reserved", "u1"),
])
assert ENTRY_DTYPE.itemsize == _core.TRACE_ENTRY_SIZE == 72, "ENTRY_DTYPE must match trace.h's tpd_trace_entry"

HEADER_DTYPE = np.dtype([
    ("magic", "S8"),
    ("version", "<u2"),
    ("header_size", "<u2"),
    ("entry_size", "<u2"),
    ("reserved0", "<u2"),
    ("context_len", "<u4"),
    ("reserved1", "<u4"),
    ("start_mono_ns", "<u8"),
    ("start_wall_ns", "<u8"),
    ("entries", "<u8"),
    ("reserved2", "<u8", (2,)),
])
assert HEADER_DTYPE.itemsize == 64


@dataclass
class Trace:
    """A trace file read back: its context (JSON object), entries (ENTRY_DTYPE) and start times."""

    context: dict[str, Any]
    entries: np.ndarray
    start_mono_ns: int = 0
    start_wall_ns: int = 0
    version: int = VERSION
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def taken(self) -> np.ndarray:
        """The TAKEN entries, in file order."""
        return self.entries[self.entries["kind"] == TAKEN]

    @property
    def failed(self) -> np.ndarray:
        """The FAILED entries (later codes), in file order."""
        return self.entries[self.entries["kind"] == FAILED]


def _padded(n: int) -> int:
    return (n + 7) // 8 * 8


def write_trace(out: str | os.PathLike[str] | BinaryIO, context: dict[str, Any], entries: np.ndarray,
                start_mono_ns: int = 0, start_wall_ns: int = 0) -> int:
    """Write a trace file (to a path, or an open binary file); returns its size in bytes. ``entries`` are
    written in the order given."""
    entries = np.ascontiguousarray(entries, dtype=ENTRY_DTYPE)
    blob = json.dumps(context, sort_keys=True, separators=(",", ":")).encode()
    header = np.zeros(1, dtype=HEADER_DTYPE)
    header[0] = (MAGIC, VERSION, HEADER_DTYPE.itemsize, ENTRY_DTYPE.itemsize, 0, len(blob), 0, start_mono_ns,
                 start_wall_ns, len(entries), (0, 0))
    if isinstance(out, (str, os.PathLike)):
        with open(out, "wb") as f:
            return write_trace(f, context, entries, start_mono_ns, start_wall_ns)
    out.write(header.tobytes())
    out.write(blob.ljust(_padded(len(blob)), b"\0"))
    out.write(entries.tobytes())
    return HEADER_DTYPE.itemsize + _padded(len(blob)) + entries.nbytes


def read_trace(path: str | os.PathLike[str]) -> Trace:
    """Read a trace file (any version-1 file; a longer header or entry from a later minor change is cut)."""
    return parse_trace(Path(path).read_bytes(), str(path))


def parse_trace(data: bytes, path: str = "trace") -> Trace:
    """A trace file's bytes read back (see :func:`read_trace`); ``path`` names it in errors."""
    if len(data) < HEADER_DTYPE.itemsize or data[:8] != MAGIC:
        raise TraceFormatError(f"{path}: not a transportd trace file (no {MAGIC.decode()} magic)")
    h = np.frombuffer(data, dtype=HEADER_DTYPE, count=1)[0]
    version, header_size, entry_size = int(h["version"]), int(h["header_size"]), int(h["entry_size"])
    if version != VERSION:
        raise TraceFormatError(f"{path}: trace format version {version}; this reader reads {VERSION}")
    if header_size < HEADER_DTYPE.itemsize or entry_size < ENTRY_DTYPE.itemsize:
        raise TraceFormatError(f"{path}: header of {header_size} or entries of {entry_size} bytes are too short")
    start = header_size + _padded(int(h["context_len"]))
    count = int(h["entries"])
    if len(data) < start + count * entry_size:
        raise TraceFormatError(f"{path}: {len(data)} bytes cannot hold {count} entries of {entry_size} bytes")
    try:
        context = json.loads(data[header_size : header_size + int(h["context_len"])].decode() or "{}")
    except ValueError as exc:  # not UTF-8, or not JSON
        raise TraceFormatError(f"{path}: its context is not JSON ({exc})") from None
    raw = np.frombuffer(data, dtype=np.uint8, count=count * entry_size, offset=start).reshape(count, entry_size)
    entries = np.ascontiguousarray(raw[:, : ENTRY_DTYPE.itemsize]).view(ENTRY_DTYPE).reshape(-1)
    return Trace(context, entries, int(h["start_mono_ns"]), int(h["start_wall_ns"]), version)


def read_part(path: str | os.PathLike[str]) -> np.ndarray:
    """The entries of an engine's part file (raw entries, no header); a torn last entry is left out."""
    data = Path(path).read_bytes()
    whole = len(data) // ENTRY_DTYPE.itemsize
    return np.frombuffer(data, dtype=ENTRY_DTYPE, count=whole).copy()


def merge_parts(out: str | os.PathLike[str] | BinaryIO, parts: Iterable[str | os.PathLike[str]],
                context: dict[str, Any], start_mono_ns: int = 0, start_wall_ns: int = 0, remove: bool = True) -> int:
    """Merge part files into the trace file ``out`` (time order; ties by channel, then position); returns
    the number of entries. With ``remove`` the parts are deleted once the trace is written."""
    parts = list(parts)
    chunks = [read_part(p) for p in parts]
    entries = np.concatenate(chunks) if chunks else np.zeros(0, dtype=ENTRY_DTYPE)
    # FAILED after TAKEN for the same record even if both fall in one nanosecond tick
    order = np.lexsort((entries["kind"], entries["position"], entries["channel"], entries["t_ns"]))
    write_trace(out, context, entries[order], start_mono_ns, start_wall_ns)
    if remove:
        for p in parts:
            Path(p).unlink(missing_ok=True)
    return len(entries)
