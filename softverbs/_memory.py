"""Memory behind soft MRs: host memory reached by address, other memory through a pluggable accessor.

Host memory is wrapped as a memoryview over the raw address (ctypes), so the wire can `recv_into` it
directly. Memory the CPU cannot touch (GPU memory) is reached through a `MemoryAccessor` registered for an
address range; the GPU work implements one with cuda-python copies. An accessor only needs read and write.
"""

from __future__ import annotations

import bisect
import ctypes
import mmap
import threading
from typing import Protocol, runtime_checkable


@runtime_checkable
class MemoryAccessor(Protocol):
    """Copies bytes in and out of memory the CPU cannot address directly (e.g. GPU memory)."""

    def read(self, addr: int, length: int) -> bytes | bytearray | memoryview:
        """Return `length` bytes starting at device address `addr`."""
        ...

    def write(self, addr: int, data: memoryview) -> None:
        """Store `data` at device address `addr`."""
        ...


def host_view(addr: int, length: int) -> memoryview:
    """A writable byte view of `length` bytes of this process's memory at `addr`."""
    if length == 0:
        return memoryview(bytearray(0))
    return memoryview((ctypes.c_char * length).from_address(addr)).cast("B")


def alloc_host(length: int) -> tuple[mmap.mmap, int, memoryview]:
    """Page-aligned, zeroed host memory (what pyverbs' MR allocates with posix_memalign)."""
    buf = mmap.mmap(-1, length)
    addr = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    return buf, addr, memoryview(buf)


class HostAccessor:
    """A MemoryAccessor over host memory: used to test the accessor path without a GPU."""

    def __init__(self) -> None:
        self.reads = 0
        self.writes = 0

    def read(self, addr: int, length: int) -> bytes:
        self.reads += 1
        return bytes(host_view(addr, length))

    def write(self, addr: int, data: memoryview) -> None:
        self.writes += 1
        host_view(addr, len(data))[:] = data


class AccessorRegistry:
    """Address ranges served by accessors; an MR whose range falls inside one uses it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._starts: list[int] = []
        self._ranges: list[tuple[int, int, MemoryAccessor]] = []

    def register(self, base: int, length: int, accessor: MemoryAccessor) -> None:
        if length <= 0:
            raise ValueError("accessor range must be non-empty")
        with self._lock:
            for start, end, _ in self._ranges:
                if base < end and start < base + length:
                    raise ValueError(f"range {base:#x}+{length} overlaps a registered range")
            i = bisect.bisect(self._starts, base)
            self._starts.insert(i, base)
            self._ranges.insert(i, (base, base + length, accessor))

    def unregister(self, base: int) -> None:
        with self._lock:
            i = bisect.bisect_left(self._starts, base)
            if i == len(self._starts) or self._starts[i] != base:
                raise KeyError(f"no accessor range starts at {base:#x}")
            del self._starts[i]
            del self._ranges[i]

    def lookup(self, addr: int, length: int) -> MemoryAccessor | None:
        with self._lock:
            i = bisect.bisect(self._starts, addr) - 1
            if i < 0:
                return None
            start, end, accessor = self._ranges[i]
            if addr + max(length, 1) <= end:
                return accessor
            if addr < end:
                raise ValueError(f"{addr:#x}+{length} straddles the end of an accessor range")
            return None


ACCESSORS = AccessorRegistry()
