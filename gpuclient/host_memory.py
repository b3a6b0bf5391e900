"""Host memory the daemon can reach: numpy arrays backed by memfds, handed to the daemon by descriptor.

A daemon is another process, so it can only register host memory it can map. ``host_array`` allocates an
anonymous ``memfd_create`` file and maps it; ``resolve_host_buffer`` finds, for any numpy view into such
an array, the descriptor and the byte offset, and ``session.register`` passes that descriptor to the daemon
over its descriptor socket (``SCM_RIGHTS``). There is no name in ``/dev/shm``: nothing is left behind when
the client is killed, and no other process can open the memory by path. Memory from anywhere else is
refused with a clear error.

The daemon's side of a registration maps the descriptor with :func:`cmd_ring.shm.map_fd`.
"""

from __future__ import annotations

import mmap
import os
import threading
import weakref
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from cmd_ring.shm import sealed_memfd
from gpuclient.errors import HostBufferError

__all__ = ["host_array", "resolve_host_buffer", "HostBuffer"]


class HostBuffer(NamedTuple):
    """Where a registrable buffer lives: its memfd (owned by the array), offset and size in it, address."""

    fd: int
    offset: int
    nbytes: int
    address: int


@dataclass(frozen=True)
class _Mapping:
    fd: int
    size: int


# start address of a host_array mapping -> its memfd; an entry goes (and the fd is closed) when the
# mapping is collected: the registry holds no reference to the mapping itself
_mappings: dict[int, _Mapping] = {}
_lock = threading.Lock()
# Releases waiting for the lock. A mapping's finalizer can run inside a garbage collection that an
# allocation triggers while this very thread holds the lock (resolve_host_buffer, host_array): waiting
# for it there would never end, so the finalizer queues its release for whoever holds the lock.
_pending: deque[tuple[int, int]] = deque()


@contextmanager
def _registry() -> Iterator[dict[int, _Mapping]]:
    with _lock:
        _drain_pending()  # no entry of a mapping already gone is looked at
        try:
            yield _mappings
        finally:
            _drain_pending()


def _drain_pending() -> None:
    """Carry out queued releases (the lock held). The memfd is still open until here, so a new mapping at
    the same address cannot have the same descriptor: the entry goes only if it is still this one."""
    while _pending:
        address, fd = _pending.popleft()
        if (m := _mappings.get(address)) is not None and m.fd == fd:
            del _mappings[address]
        try:
            os.close(fd)
        except OSError:
            pass


def _release(address: int, fd: int) -> None:
    """Finalizer of a host_array mapping: never waits for the lock (see ``_pending``)."""
    _pending.append((address, fd))
    if _lock.acquire(blocking=False):
        try:
            _drain_pending()
        finally:
            _lock.release()


def host_array(shape: int | tuple[int, ...], dtype: np.typing.DTypeLike = np.uint8) -> np.ndarray:
    """A zero-filled array in a fresh memfd; register it with ``session.register``.

    The memory goes when the array (and every view of it) is garbage-collected, or with the process.
    """
    dt = np.dtype(dtype)
    count = int(np.prod(shape))
    nbytes = max(count * dt.itemsize, 1)
    size = (nbytes + mmap.PAGESIZE - 1) // mmap.PAGESIZE * mmap.PAGESIZE
    fd = sealed_memfd("tpd-host", size)  # the size sealed: the daemon refuses memory that could shrink under it
    try:
        mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    except BaseException:
        os.close(fd)
        raise
    arr = np.frombuffer(mm, dtype=dt, count=count).reshape(shape)
    address = int(np.frombuffer(mm, dtype=np.uint8, count=1).ctypes.data)
    with _registry() as mappings:
        mappings[address] = _Mapping(fd, size)
    weakref.finalize(mm, _release, address, fd)
    return arr


def resolve_host_buffer(buffer: object) -> HostBuffer:
    """The memfd, offset, size and address of a contiguous buffer inside a ``host_array``.

    The descriptor belongs to the array: use it while ``buffer`` is alive, do not close it.
    """
    try:
        view = memoryview(buffer)  # type: ignore[arg-type]
    except TypeError:
        raise HostBufferError(f"{type(buffer).__name__} does not expose the buffer protocol") from None
    if not view.c_contiguous:
        raise HostBufferError("register a contiguous buffer (this one is strided)")
    arr = np.frombuffer(view, dtype=np.uint8) if view.nbytes else None
    if arr is None:
        raise HostBufferError("cannot register an empty buffer")
    address = int(arr.ctypes.data)
    with _registry() as mappings:
        found = [(base, m) for base, m in mappings.items()
                 if base <= address and address + view.nbytes <= base + m.size]
    if found:
        base, mapping = found[0]
        return HostBuffer(mapping.fd, address - base, view.nbytes, address)
    raise HostBufferError(
        "host memory must come from gpuclient.host_array() (a memfd the daemon receives by descriptor); "
        "copy the data into one, or register GPU memory"
    )
