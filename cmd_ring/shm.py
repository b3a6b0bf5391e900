"""Anonymous shared memory handed between processes by descriptor (``memfd_create``), never by name.

A memfd has no path another process could open: only a holder of the descriptor (passed by ``SCM_RIGHTS``
or inherited) can map it, and it goes with the last descriptor and mapping, even when its creator is
killed outright. Its size is sealed once set: every holder maps it read-write, and a holder that could
shrink it would make every other mapping fault (SIGBUS) on the pages cut off.
"""

from __future__ import annotations

import fcntl
import os

__all__ = ["SIZE_SEALS", "sealed_memfd", "seal_size", "size_is_sealed", "unsealed_memfd"]

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
