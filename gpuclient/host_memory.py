"""Host memory the daemon can reach: numpy arrays backed by named shared-memory files.

A daemon is another process, so it can only register host memory it can map. ``host_array`` allocates
a region in /dev/shm; ``resolve_host_buffer`` finds, for any numpy view into such an array, the file
and the byte offset the daemon needs. Memory from anywhere else is refused with a clear error.
"""

from __future__ import annotations

import itertools
import mmap
import os
import weakref
from dataclasses import dataclass
from pathlib import Path

import numpy as np

__all__ = ["host_array", "resolve_host_buffer", "HostBufferError", "SharedFile"]

_SHM_DIR = Path("/dev/shm")
_counter = itertools.count()


class HostBufferError(ValueError):
    """The buffer is not in memory the daemon can map."""


@dataclass
class SharedFile:
    """A mapped shared-memory file (its mapping lives as long as any array made from it)."""

    path: Path
    mm: mmap.mmap
    size: int

    @property
    def address(self) -> int:
        return int(np.frombuffer(self.mm, dtype=np.uint8, count=1).ctypes.data)


# address of a mapping -> its SharedFile; entries go when the mapping is collected
_mappings: dict[int, SharedFile] = {}


def map_shared_file(path: Path, size: int | None = None, *, create: bool = False, mode: int = 0o600) -> SharedFile:
    """Map ``path`` (creating it with ``size`` bytes when ``create``)."""
    flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
    fd = os.open(path, flags, mode)
    try:
        if create:
            assert size is not None
            os.ftruncate(fd, size)
        size = os.fstat(fd).st_size
        mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
    shared = SharedFile(path, mm, size)
    address = shared.address
    _mappings[address] = shared
    weakref.finalize(mm, _mappings.pop, address, None)
    return shared


def host_array(shape: int | tuple[int, ...], dtype: np.typing.DTypeLike = np.uint8) -> np.ndarray:
    """A zero-filled array in a fresh shared-memory file; register it with ``session.register``.

    The file's name is removed when the array (and every view of it) is garbage-collected.
    """
    dt = np.dtype(dtype)
    count = int(np.prod(shape))
    nbytes = max(count * dt.itemsize, 1)
    size = (nbytes + mmap.PAGESIZE - 1) // mmap.PAGESIZE * mmap.PAGESIZE
    path = _SHM_DIR / f"tpd-host-{os.getpid()}-{next(_counter)}"
    shared = map_shared_file(path, size, create=True)
    weakref.finalize(shared.mm, _unlink_quietly, path)
    return np.frombuffer(shared.mm, dtype=dt, count=count).reshape(shape)


def _unlink_quietly(path: Path) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def resolve_host_buffer(buffer: object) -> tuple[Path, int, int, int]:
    """``(file, offset, nbytes, address)`` for a contiguous buffer inside a ``host_array``."""
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
    for base, shared in list(_mappings.items()):
        if base <= address and address + view.nbytes <= base + shared.size:
            return shared.path, address - base, view.nbytes, address
    raise HostBufferError(
        "host memory must come from gpuclient.host_array() (a shared-memory file the daemon can map); "
        "copy the data into one, or register GPU memory"
    )
