"""Anonymous shared memory handed between processes by descriptor (``memfd_create``), never by name.

A memfd has no path another process could open: only a holder of the descriptor (passed by ``SCM_RIGHTS``
or inherited) can map it, and it goes with the last descriptor and mapping, even when its creator is
killed outright. Its size is sealed once set: every holder maps it read-write, and a holder that could
shrink it would make every other mapping fault (SIGBUS) on the pages cut off.

:func:`map_fd` maps such a descriptor (or any shared file's) into this process as a :class:`SharedFile`;
:func:`map_shared_file` does the same for a named file. The client library, the daemon and its rail
workers all map memory this way, so it lives here, below all of them.
"""

from __future__ import annotations

import fcntl
import mmap
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

__all__ = ["SIZE_SEALS", "SharedFile", "map_fd", "map_shared_file", "sealed_memfd", "seal_size", "size_is_sealed",
           "unsealed_memfd"]

#: no holder may shrink or grow it, nor lift these seals
SIZE_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


def sealed_memfd(name: str, size: int) -> int:
    """A zero-filled memfd of ``size`` bytes, mode 0600, its size sealed; the caller owns the descriptor.

    ``name`` only labels it in ``/proc/<pid>/maps`` and ``/proc/<pid>/fd`` (``/memfd:<name>``).
    """
    fd = unsealed_memfd(name)
    try:
        os.ftruncate(fd, size)
        seal_size(fd)
    except BaseException:
        os.close(fd)
        raise
    return fd


def unsealed_memfd(name: str) -> int:
    """An empty memfd that allows sealing, mode 0600: another process sizes it, then seals it."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.fchmod(fd, 0o600)  # /proc/<pid>/fd/<n> reopens it; the ptrace check comes first, this is the second lock
    return fd


def seal_size(fd: int) -> None:
    """Fix the memfd's size for good (see the module doc)."""
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SIZE_SEALS)


def size_is_sealed(fd: int) -> bool:
    """The descriptor is a memfd whose size no holder can change."""
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError:
        return False
    return seals & (fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW) == fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW


@dataclass
class SharedFile:
    """A mapped shared-memory file or memfd; :meth:`close` unmaps it (and drops the descriptor mmap keeps)."""

    path: Path | None
    mm: mmap.mmap
    size: int
    address: int = 0

    def __post_init__(self) -> None:
        view = np.frombuffer(self.mm, dtype=np.uint8, count=1)
        self.address = int(view.ctypes.data)
        del view  # no buffer export outlives this, so close() can unmap

    def close(self) -> None:
        """Unmap now (raises BufferError while a numpy view of the mapping is alive)."""
        self.mm.close()


def map_shared_file(path: Path, size: int | None = None, *, create: bool = False, mode: int = 0o600) -> SharedFile:
    """Map ``path`` (creating it with ``size`` bytes when ``create``)."""
    flags = os.O_RDWR | os.O_CLOEXEC | (os.O_CREAT | os.O_EXCL if create else 0)
    fd = os.open(path, flags, mode)
    try:
        if create:
            assert size is not None
            os.ftruncate(fd, size)
        shared = map_fd(fd)
    finally:
        os.close(fd)
    shared.path = Path(path)
    return shared


def map_fd(fd: int) -> SharedFile:
    """Map the whole file behind ``fd`` read-write, shared (the caller still owns and closes ``fd``)."""
    size = os.fstat(fd).st_size
    if size <= 0:
        raise ValueError("the descriptor's file is empty: nothing to map")
    mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    return SharedFile(None, mm, size)
