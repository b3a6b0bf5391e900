"""Direct placement: a write whose source is device memory is placed by the responder with one copy from
the source, when requester and responder run on one host, instead of device -> host -> TCP -> host -> device.

Who copies. A process that can share device memory installs a `DirectCopier` (`softverbs.soft.
set_direct_copier`; transportd's rail worker installs its GPU memory, which exports its clients' CUDA IPC
handles and opens its peers'). The responder makes the copy: it is where the rkey, bounds and access checks
run and where a write's bytes are placed, so the checks and the ordering below stay exactly as for a
write that crossed the wire. (The writer copying into the target would place bytes before the target
checked the request, or cost a round trip per write and a hold on every later request of the QP.)

How the two sides agree, per connection and per exported allocation:

1. A requester's write reads an MR served by an accessor (device memory) and the copier exports the
   allocation holding it. The first such write on a connection travels over the wire as before, and an
   IMPORT frame goes with it: the export id, this host's boot id, a token of this process, the
   allocation's base and size here, and the copier's descriptor (a CUDA IPC handle and the GPU's PCI
   location, for the GPU copier).
2. The responder opens it: in the same process the base is used as is; on the same host (same boot id)
   through its copier; otherwise, or if the copier cannot (no copier, no CUDA context there, the open
   fails), it refuses. It answers IMPORTED (opened or refused); what it opened it keeps for the
   connection, sized by its own mapping, never by the requester's word.
3. From an "opened" on, that allocation's writes on that connection carry (export id, offset) in place of
   their bytes (REQ flag F_DIRECT); a refusal keeps them on the wire. Closing the last MR over the
   allocation sends FORGET; the responder closes what it opened then, or when the connection goes.

Checks and ordering. A direct write is admitted like any write (QP state, PSN, rkey, bounds and access of
the target MR, the QP's access flags: failures complete with the same remote-access errors and move an RC
QP to the error state), and its source range must lie inside the opened allocation (else a remote
operational error). It is placed where a wire write's bytes would be stored: whole (RC in order), or in
packets through the reorder pool (adaptive routing, SRD, relaxed ordering). `DirectCopier.copy` returns
only once the copy is complete (the GPU copier synchronizes its stream), and so does `copy_many`, which
places the pool's direct packets taken back to back (queued in order on one stream, one wait for all), so
whatever the responder does next on that QP -- the next write, a flag, an atomic, a receive completion, the
acknowledgement that becomes the requester's completion -- comes after the bytes are in place, as on the wire
path.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import struct
import tempfile
import threading
import uuid
from typing import Any, Protocol, runtime_checkable

from ._memory import host_view

__all__ = ["DirectCopier", "Export", "Imported", "ShmCopier", "boot_id", "copier", "open_import", "process_token",
           "set_copier"]

#: IMPORT payload: boot id, process token, the allocation's base and size in the exporter; then the descriptor
IMPORT_HEAD = struct.Struct("<16s8sQQ")

# soft-protocol answers to IMPORT (IMPORTED frame flags)
OPENED, REFUSED = 1, 0
UNRESOLVED: Any = object()  # an MR whose export has not been looked up yet
# a requester connection's view of one export: the responder's answer, or none yet
PENDING = 0
CONFIRMED = 1
DECLINED = -1


@runtime_checkable
class DirectCopier(Protocol):
    """Shares device memory between processes on one host and copies between addresses of this process."""

    def export_range(self, addr: int, length: int) -> tuple[bytes, int, int] | None:
        """(descriptor, allocation base, allocation size) of the allocation holding ``[addr, addr+length)``,
        which another process on this host can open; None when this memory cannot be shared."""
        ...

    def open_export(self, descriptor: bytes) -> tuple[int, int]:
        """Map an allocation another process exported: (its base here, its size). Raises if it cannot."""
        ...

    def close_export(self, descriptor: bytes) -> None:
        """Undo one `open_export` of ``descriptor``."""
        ...

    def copy(self, dst: int, src: int, length: int) -> None:
        """Copy ``length`` bytes between two addresses of this process (device or host memory); the copy is
        complete when this returns."""
        ...

    def copy_many(self, copies: list[tuple[int, int | memoryview, int]]) -> None:
        """``(dst, src, length)`` copies, each complete before the next starts and all complete when this
        returns: as `copy` one by one, with one wait for the GPU where it can (a run of SRD packets, or of
        RC writes). A ``src`` that is a buffer, not an address, holds bytes to store at ``dst`` (a wire write
        into device memory placed in its run's order)."""
        ...


_COPIER: list[DirectCopier | None] = [None]


def copier() -> DirectCopier | None:
    """This process's copier (None: every write crosses the wire)."""
    return _COPIER[0]


def set_copier(obj: DirectCopier | None) -> None:
    _COPIER[0] = obj


# --- who we are: the host (boot id) and this process (a token: pids repeat across pid namespaces) -------
def _read_boot_id() -> bytes:
    try:
        with open("/proc/sys/kernel/random/boot_id") as fh:
            return uuid.UUID(fh.read().strip()).bytes
    except (OSError, ValueError):
        return b""


_BOOT_ID = _read_boot_id()
_TOKEN = [os.urandom(8)]


def _new_token() -> None:
    _TOKEN[0] = os.urandom(8)  # a forked child has its own memory: the parent's addresses are not its own


os.register_at_fork(after_in_child=_new_token)


def boot_id() -> bytes:
    """This host's boot id (16 bytes; empty where /proc does not say): processes that share it share a
    kernel, and with it the GPU driver that CUDA IPC goes through."""
    return _BOOT_ID


def process_token() -> bytes:
    """8 random bytes naming this process (renewed in a forked child)."""
    return _TOKEN[0]


# --- requester side ---------------------------------------------------------------------------------------
class Export:
    """One allocation of this device's MRs that peers may open: its id on the wire, and who was told."""

    __slots__ = ("id", "descriptor", "base", "size", "refs", "conns")

    def __init__(self, xid: int, descriptor: bytes, base: int, size: int) -> None:
        self.id = xid
        self.descriptor = descriptor
        self.base = base
        self.size = size
        self.refs = 0  # MRs over it
        self.conns: set[Any] = set()  # requester connections an IMPORT went out on

    def record(self) -> bytes:
        """The IMPORT frame's payload."""
        return IMPORT_HEAD.pack(_BOOT_ID, process_token(), self.base, self.size) + self.descriptor


# --- responder side ---------------------------------------------------------------------------------------
class Imported:
    """An allocation a peer exported, opened in this process for one connection: ``base``/``size`` here."""

    __slots__ = ("base", "size", "descriptor", "copier", "closed")

    def __init__(self, base: int, size: int, descriptor: bytes | None, copier: DirectCopier) -> None:
        self.base = base
        self.size = size
        self.descriptor = descriptor  # None: the exporter's own process (nothing was opened)
        self.copier = copier
        self.closed = False

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            if self.descriptor is not None:
                self.copier.close_export(self.descriptor)


def open_import(copier: DirectCopier | None, payload: bytes | memoryview) -> Imported:
    """Open what an IMPORT frame names; ValueError says why it cannot be."""
    if copier is None:
        raise ValueError("no direct copier in this process")
    if len(payload) < IMPORT_HEAD.size:
        raise ValueError("short import record")
    host, token, base, size = IMPORT_HEAD.unpack_from(payload, 0)
    if not _BOOT_ID or host != _BOOT_ID:
        raise ValueError("the exporter runs on another host")
    if token == process_token():
        return Imported(base, size, None, copier)
    descriptor = bytes(payload[IMPORT_HEAD.size:])
    here, mapped = copier.open_export(descriptor)
    return Imported(int(here), int(mapped), descriptor, copier)


# --- a host-memory copier for tests ------------------------------------------------------------------------
class ShmCopier:
    """A `DirectCopier` over host memory shared through files in /dev/shm: tests run the direct path
    between processes without a GPU. `allocate` gives memory to serve as "device memory" (register it
    with `register_memory(addr, size, HostAccessor())`); peers open it by the file's path."""

    def __init__(self, directory: str = "/dev/shm") -> None:
        self.directory = directory if os.path.isdir(directory) else tempfile.gettempdir()
        self._lock = threading.Lock()
        self._mine: dict[int, tuple[str, mmap.mmap, Any]] = {}  # base -> (path, mapping, pin)
        self._opened: dict[bytes, list[Any]] = {}  # descriptor -> [mapping, pin, base, size, refs]
        self.copies = 0
        self.copied = 0
        self.runs = 0  # copy_many calls: runs of copies that share one wait on a GPU

    def allocate(self, size: int) -> int:
        fd, path = tempfile.mkstemp(prefix="softverbs-", dir=self.directory)
        try:
            os.ftruncate(fd, size)
            mem = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        pin = ctypes.c_char.from_buffer(mem)
        base = ctypes.addressof(pin)
        with self._lock:
            self._mine[base] = (path, mem, pin)
        return base

    def free(self, base: int) -> None:
        with self._lock:
            path, mem, pin = self._mine.pop(base)
        del pin
        mem.close()
        os.unlink(path)

    def export_range(self, addr: int, length: int) -> tuple[bytes, int, int] | None:
        with self._lock:
            for base, (path, mem, _pin) in self._mine.items():
                if base <= addr and addr + length <= base + len(mem):
                    return path.encode(), base, len(mem)
        return None

    def open_export(self, descriptor: bytes) -> tuple[int, int]:
        with self._lock:
            entry = self._opened.get(descriptor)
            if entry is None:
                fd = os.open(descriptor.decode(), os.O_RDWR)
                try:
                    mem = mmap.mmap(fd, 0)
                finally:
                    os.close(fd)
                pin = ctypes.c_char.from_buffer(mem)
                entry = self._opened[descriptor] = [mem, pin, ctypes.addressof(pin), len(mem), 0]
            entry[4] += 1
            return entry[2], entry[3]

    def close_export(self, descriptor: bytes) -> None:
        with self._lock:
            entry = self._opened.get(descriptor)
            if entry is None:
                return
            entry[4] -= 1
            if entry[4]:
                return
            del self._opened[descriptor]
        mem = entry[0]
        entry.clear()  # drops the pin, so the mapping may close
        mem.close()

    def opened(self) -> int:
        """Allocations of other processes mapped here now."""
        with self._lock:
            return len(self._opened)

    def copy(self, dst: int, src: int, length: int) -> None:
        ctypes.memmove(dst, src, length)
        self.copies += 1
        self.copied += length

    def copy_many(self, copies: list[tuple[int, int | memoryview, int]]) -> None:
        self.runs += 1
        for dst, src, length in copies:
            if isinstance(src, int):
                self.copy(dst, src, length)
            else:
                host_view(dst, length)[:] = src
