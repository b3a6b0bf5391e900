"""The command ring: N records plus control words in a shared-memory file.

One process creates the ring (the daemon, per channel: an anonymous memfd it hands to the client and the
rail worker by descriptor, :meth:`RingFile.create_memfd`) and others map it (tools and tests may still
name a file in /dev/shm: :meth:`RingFile.create`, :meth:`RingFile.attach`). The producers
(GPU thread blocks, or :class:`RingProducer` for CPU clients and tests) write records; one consumer (a
proxy worker, :class:`RingConsumer`) takes them.

Commit protocol (header-last). A producer owns slot ``pos % capacity`` once it holds a credit
(``pos - consumer_pos < capacity``). It writes the five body words, then the header word with a
release store; the header's ``seq`` is the lap stamp of ``pos`` (``record.seq_for``). The consumer
reads the header words of a block of slots, keeps the prefix whose seq equals the expected stamp, then
copies those records and publishes its new position, which hands the slots back as credits. Because
the header is written last and read first, a record is never returned torn; because seq carries the
lap, a slot still holding an older lap's record (or nothing) is never returned as fresh.

Host ordering: x86-64 keeps stores in program order and loads in program order (TSO), so numpy's plain
stores and loads give the release/acquire pairing above. On a weakly ordered host a fence would be
needed between the body and header stores and between the header and body loads.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
import time
from pathlib import Path

import numpy as np

from cmd_ring.errors import RingError, RingFullError, RingLayoutError, RingNotFoundError
from cmd_ring.record import RECORD_DTYPE, RECORD_SIZE, seq_array
from cmd_ring.shm import sealed_memfd

__all__ = [
    "RingFile",
    "RingConsumer",
    "RingProducer",
    "ring_path",
    "CONTROL_BYTES",
]

MAGIC = 0x31474E4952445054  # "TPDRING1"
VERSION = 1
CONTROL_BYTES = 4096
# Control-word byte offsets; the C twin is cmd_ring/include/transportd/cmd_ring.h (TPD_RING_OFF_*).
OFF_MAGIC = 0
OFF_VERSION = 8
OFF_RECORD_SIZE = 12
OFF_CAPACITY = 16
OFF_TOTAL_SIZE = 24
OFF_CONSUMER_POS = 64
OFF_PRODUCER_POS = 128
OFF_COMPLETION_POS = 192
OFF_ERROR_CODE = 256
OFF_ERROR_COUNT = 260
OFF_ERROR_POS = 264

SHM_DIR = Path("/dev/shm")
_SEQ_MODULUS = 0xFFFF_FFFF


def ring_path(name: str) -> Path:
    """Where ring ``name`` lives: a bare name is a file in /dev/shm; anything with a slash is a path."""
    return Path(name) if "/" in name else SHM_DIR / name


def _ring_bytes(capacity: int) -> int:
    raw = CONTROL_BYTES + capacity * RECORD_SIZE
    return (raw + mmap.PAGESIZE - 1) // mmap.PAGESIZE * mmap.PAGESIZE


def _check_capacity(capacity: int) -> None:
    if capacity < 2 or capacity & (capacity - 1) or capacity > 1 << 30:
        raise RingError(f"ring capacity must be a power of two in [2, 2**30], got {capacity}")


def _try_mlock(address: int, length: int) -> bool:
    """Pin the ring in RAM where the memlock limit allows; the ring still works unpinned."""
    libc_name = ctypes.util.find_library("c")
    if not libc_name:
        return False
    libc = ctypes.CDLL(libc_name, use_errno=True)
    return libc.mlock(ctypes.c_void_p(address), ctypes.c_size_t(length)) == 0


class RingFile:
    """A mapped ring file: the records, the control words, and who created it.

    Use :meth:`create_memfd` or :meth:`create` (the owner, usually the daemon), :meth:`from_fd` or
    :meth:`attach` (everyone else).
    """

    def __init__(self, path: Path | None, fd: int, size: int, owner: bool) -> None:
        self.path = path  # None: an anonymous ring (a memfd), reachable only by descriptor
        self.owner = owner
        try:
            self._mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)  # the mapping keeps the memory
        self.size = size
        self._bytes = np.frombuffer(self._mm, dtype=np.uint8)
        self.mlocked = False

    # -- construction ---------------------------------------------------------------------------
    @classmethod
    def create(cls, name: str, capacity: int, *, mode: int = 0o660, lock: bool = True) -> RingFile:
        """Create ring ``name`` with ``capacity`` records (a power of two); fails if it exists."""
        _check_capacity(capacity)
        path = ring_path(name)
        size = _ring_bytes(capacity)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, mode)
        except FileExistsError:
            raise RingError(f"ring file {path} already exists") from None
        try:
            os.fchmod(fd, mode)  # umask must not narrow the mode the caller asked for
            os.ftruncate(fd, size)
            ring = cls(path, fd, size, owner=True)
        except BaseException:
            os.unlink(path)
            raise
        ring._format(capacity, lock)
        return ring

    @classmethod
    def create_memfd(cls, capacity: int, *, name: str = "tpd-ring", lock: bool = True) -> tuple[RingFile, int]:
        """Create an anonymous ring (a sealed memfd, see :mod:`cmd_ring.shm`): no path anyone could open.

        Returns the ring and a descriptor of it, the caller's to hand out (``SCM_RIGHTS``) and close;
        :meth:`from_fd` maps it on the other side. ``name`` labels it in ``/proc/<pid>/maps``.
        """
        _check_capacity(capacity)
        size = _ring_bytes(capacity)
        fd = sealed_memfd(name, size)
        try:
            ring = cls(None, os.dup(fd), size, owner=True)
        except BaseException:
            os.close(fd)
            raise
        ring._format(capacity, lock)
        return ring, fd

    def _format(self, capacity: int, lock: bool) -> None:
        self._u64(OFF_CAPACITY)[0] = capacity
        self._u64(OFF_TOTAL_SIZE)[0] = self.size
        self._u32(OFF_RECORD_SIZE)[0] = RECORD_SIZE
        self._u32(OFF_VERSION)[0] = VERSION
        self._u64(OFF_MAGIC)[0] = MAGIC  # last: an attacher sees a complete header or none
        if lock:
            self.mlocked = _try_mlock(self.address, self.size)
        self._init_views()

    @classmethod
    def attach(cls, name: str) -> RingFile:
        """Map an existing ring; a missing, foreign or wrong-sized file is a clear error."""
        path = ring_path(name)
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError:
            raise RingNotFoundError(
                f"no ring at {path}: the channel is not open (or the daemon has reclaimed it)"
            ) from None
        except PermissionError:
            raise RingError(f"no permission to open ring {path}: are you in the daemon's group?") from None
        return cls._attach_fd(fd, path, str(path))

    @classmethod
    def from_fd(cls, fd: int) -> RingFile:
        """Map the ring behind ``fd`` (from :meth:`create_memfd`, passed by descriptor); ``fd`` is consumed
        (closed), the mapping keeps the memory. A foreign or wrong-sized file is a clear error."""
        return cls._attach_fd(fd, None, f"ring descriptor {fd}")

    @classmethod
    def _attach_fd(cls, fd: int, path: Path | None, label: str) -> RingFile:
        try:
            size = os.fstat(fd).st_size
        except OSError:
            os.close(fd)
            raise
        if size < CONTROL_BYTES:
            os.close(fd)
            raise RingLayoutError(f"{label} is {size} bytes, smaller than a ring's {CONTROL_BYTES}-byte header")
        ring = cls(path, fd, size, owner=False)
        magic = int(ring._u64(OFF_MAGIC)[0])
        if magic != MAGIC:
            ring.close()
            raise RingLayoutError(f"{label} is not a transportd ring (magic {magic:#x})")
        version = int(ring._u32(OFF_VERSION)[0])
        record_size = int(ring._u32(OFF_RECORD_SIZE)[0])
        capacity = int(ring._u64(OFF_CAPACITY)[0])
        if version != VERSION or record_size != RECORD_SIZE:
            ring.close()
            raise RingLayoutError(
                f"{label} is ring version {version} with {record_size}-byte records; "
                f"this library speaks version {VERSION} with {RECORD_SIZE}-byte records"
            )
        expected = _ring_bytes(capacity) if capacity and not capacity & (capacity - 1) else -1
        if expected != size or int(ring._u64(OFF_TOTAL_SIZE)[0]) != size:
            ring.close()
            raise RingLayoutError(
                f"{label} is {size} bytes but its header says capacity {capacity} "
                f"({expected} bytes): the file is truncated or corrupt"
            )
        ring._init_views()
        return ring

    def _init_views(self) -> None:
        self.capacity = int(self._u64(OFF_CAPACITY)[0])
        body = self._bytes[CONTROL_BYTES : CONTROL_BYTES + self.capacity * RECORD_SIZE]
        self.records = body.view(RECORD_DTYPE)
        self.words = body.view("<u8").reshape(self.capacity, RECORD_SIZE // 8)
        self.seqs = self.records["seq"]
        self._consumer_pos = self._u64(OFF_CONSUMER_POS)
        self._producer_pos = self._u64(OFF_PRODUCER_POS)
        self._completion_pos = self._u64(OFF_COMPLETION_POS)
        self._error = self._u32(OFF_ERROR_CODE, 2)
        self._error_pos = self._u64(OFF_ERROR_POS)

    def _u64(self, offset: int, count: int = 1) -> np.ndarray:
        return self._bytes[offset : offset + 8 * count].view("<u8")

    def _u32(self, offset: int, count: int = 1) -> np.ndarray:
        return self._bytes[offset : offset + 4 * count].view("<u4")

    # -- control words --------------------------------------------------------------------------
    @property
    def address(self) -> int:
        """Host virtual address of the mapping (for cuMemHostRegister)."""
        return int(self._bytes.ctypes.data)

    @property
    def consumer_pos(self) -> int:
        """Records the consumer has taken; producers may run ``capacity`` ahead of it."""
        return int(self._consumer_pos[0])

    @property
    def producer_pos(self) -> int:
        """Records a host producer has committed (GPU producers keep their head in device memory)."""
        return int(self._producer_pos[0])

    @property
    def completion_pos(self) -> int:
        """The proxy's QUIET completion position: every record before it has completed locally."""
        return int(self._completion_pos[0])

    def publish_completion(self, position: int) -> None:
        """Advance the QUIET completion position (monotonic)."""
        if position > self._completion_pos[0]:
            self._completion_pos[0] = position

    def report_error(self, code: int, position: int, count: int = 1) -> None:
        """Record ``count`` bad records from ``position``: the lowest bad position and its code are kept (a
        record taken earlier can fail later: completions need not come in ring order), the count grows."""
        if code == 0:
            raise ValueError("error code 0 means 'no error'")
        if self._error[0] == 0 or position < self._error_pos[0]:
            self._error_pos[0] = position
            self._error[0] = code
        self._error[1] += count

    @property
    def error(self) -> tuple[int, int, int]:
        """``(code, count, position)``: the lowest bad position and its code; code 0 means no error has been
        reported."""
        return int(self._error[0]), int(self._error[1]), int(self._error_pos[0])

    def close(self) -> None:
        """Drop this mapping (records returned by the consumer are copies and stay valid)."""
        for attr in ("records", "words", "seqs", "_consumer_pos", "_producer_pos", "_completion_pos",
                     "_error", "_error_pos", "_bytes"):
            self.__dict__.pop(attr, None)
        try:
            self._mm.close()
        except BufferError:
            pass  # a caller still holds a view; the mapping goes when that view does

    def unlink(self) -> None:
        """Remove the ring's name (existing mappings stay valid until closed); an anonymous ring has none."""
        if self.path is None:
            return
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def __enter__(self) -> RingFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
        if self.owner:
            self.unlink()


class RingConsumer:
    """The one consumer of a ring: takes every ready record in one vectorized call.

    ``consume_ready`` scans headers in blocks, keeps the prefix of slots whose seq matches the
    expected lap stamp, copies them out and (by default) publishes the new position at once: slots are
    released when copied, not when the NIC completes them.
    """

    def __init__(self, ring: RingFile, scan_block: int = 4096) -> None:
        self.ring = ring
        self.position = ring.consumer_pos
        self.scan_block = min(scan_block, ring.capacity)
        self._mask = ring.capacity - 1
        self._offsets = np.arange(self.scan_block, dtype=np.uint32)

    def _expected(self, position: int, count: int) -> np.ndarray:
        first = position % _SEQ_MODULUS
        if first + count < _SEQ_MODULUS:
            return self._offsets[:count] + np.uint32(first + 1)
        return seq_array(position, count)

    def ready_count(self, max_records: int | None = None) -> int:
        """How many records are committed and waiting, without taking them."""
        return self._scan(max_records)[1]

    def _scan(self, max_records: int | None) -> tuple[list[tuple[int, int]], int]:
        ring = self.ring
        limit = ring.capacity if max_records is None else min(max_records, ring.capacity)
        spans: list[tuple[int, int]] = []
        total = 0
        while total < limit:
            start = (self.position + total) & self._mask
            n = min(self.scan_block, limit - total, ring.capacity - start)
            ok = ring.seqs[start : start + n] == self._expected(self.position + total, n)
            ready = n if ok.all() else int(ok.argmin())
            if ready:
                spans.append((start, ready))
                total += ready
            if ready < n:
                break
        return spans, total

    def consume_ready(self, max_records: int | None = None, *, release: bool = True) -> np.ndarray:
        """Copy out every ready record (at most ``max_records``), in ring order."""
        spans, total = self._scan(max_records)
        if total == 0:
            return np.empty(0, dtype=RECORD_DTYPE)
        records = self.ring.records
        if len(spans) == 1:
            start, n = spans[0]
            out = records[start : start + n].copy()
        else:
            out = np.concatenate([records[s : s + n] for s, n in spans])
        self.position += total
        if release:
            self.release()
        return out

    def release(self) -> None:
        """Publish the consumer position: the slots taken so far become producer credits."""
        self.ring._consumer_pos[0] = self.position


class RingProducer:
    """A host producer for CPU clients and tests. Single producer per ring: it keeps the head locally.

    (GPU producers claim slots with atomicAdd on a device-memory head instead; the commit protocol is
    the same.)
    """

    def __init__(self, ring: RingFile) -> None:
        self.ring = ring
        self.position = ring.producer_pos
        self._credit_limit = ring.consumer_pos + ring.capacity

    def free_slots(self) -> int:
        """Credits available now (re-reads the consumer position)."""
        self._credit_limit = self.ring.consumer_pos + self.ring.capacity
        return self._credit_limit - self.position

    def _wait_for_credits(self, count: int, block: bool, timeout: float | None) -> bool:
        if self.position + count <= self._credit_limit or self.free_slots() >= count:
            return True
        if not block:
            return False
        deadline = None if timeout is None else time.monotonic() + timeout
        pause = 0.0
        while self.free_slots() < count:
            if deadline is not None and time.monotonic() >= deadline:
                raise RingFullError(
                    f"ring {self.ring.path or 'memfd'} stayed full for {timeout}s "
                    f"(producer at {self.position}, consumer at {self.ring.consumer_pos})"
                )
            time.sleep(pause)
            pause = min(pause * 2 or 1e-6, 1e-3)
        return True

    def push_records(self, records: np.ndarray, *, block: bool = True, timeout: float | None = None) -> bool:
        """Commit ``records`` (RECORD_DTYPE; their seq is overwritten) in order.

        Blocks until there are credits for all of them, or returns False at once if ``block`` is
        False and the ring lacks room. Raises RingFullError when ``timeout`` expires.
        """
        count = len(records)
        if count == 0:
            return True
        if count > self.ring.capacity:
            raise RingError(f"cannot push {count} records into a ring of {self.ring.capacity}")
        if not self._wait_for_credits(count, block, timeout):
            return False
        src = np.ascontiguousarray(records, dtype=RECORD_DTYPE).copy()
        src["seq"] = seq_array(self.position, count)
        src_words = src.view("<u8").reshape(count, RECORD_SIZE // 8)
        start = self.position & (self.ring.capacity - 1)
        first = min(count, self.ring.capacity - start)
        for dst_start, lo, hi in ((start, 0, first), (0, first, count)):
            if hi > lo:
                dst = self.ring.words[dst_start : dst_start + hi - lo]
                dst[:, 1:] = src_words[lo:hi, 1:]  # bodies first ...
        for dst_start, lo, hi in ((start, 0, first), (0, first, count)):
            if hi > lo:
                self.ring.words[dst_start : dst_start + hi - lo, 0] = src_words[lo:hi, 0]  # ... headers last
        self.position += count
        self.ring._producer_pos[0] = self.position
        return True

    def push(self, record: np.ndarray | np.void, *, block: bool = True, timeout: float | None = None) -> bool:
        """Commit one record; see :meth:`push_records`."""
        return self.push_records(np.atleast_1d(np.asarray(record, dtype=RECORD_DTYPE)), block=block,
                                 timeout=timeout)
