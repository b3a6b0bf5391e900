"""A rank's flag array in host memory: an anonymous memfd the daemon creates and hands out by descriptor.

The daemon makes it (:meth:`FlagFile.create_memfd`), maps it, and passes a descriptor to the rank's client
and to every rail worker (``SCM_RIGHTS``), which map it with :meth:`FlagFile.from_fd`. It has no path: no
other process can open it, and nothing is left behind when the daemon is killed.

Layout: a 64-byte header, then ``count`` little-endian u64 flag words (8-byte aligned, so NIC atomics
may target them)::

    0   u32 magic 'TPDF'   4  u32 count   8  u32 status (ErrorCode for the whole session; 0 = fine)
    64  flag[0] ... flag[count-1]
"""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import numpy as np

from cmd_ring.shm import sealed_memfd

__all__ = ["FlagFile", "HEADER_BYTES", "OFF_STATUS"]

MAGIC = 0x46445054  # "TPDF"
HEADER_BYTES = 64
OFF_STATUS = 8


def _flag_bytes(count: int) -> int:
    return (HEADER_BYTES + 8 * count + mmap.PAGESIZE - 1) // mmap.PAGESIZE * mmap.PAGESIZE


class FlagFile:
    """Create (daemon) or map (client, rail worker) a flag array; ``values`` are the flag words.

    ``FlagFile(path, count, create=True)`` and ``FlagFile(path)`` name a file (tools and tests);
    the daemon uses :meth:`create_memfd` and :meth:`from_fd`.
    """

    def __init__(self, path: Path | None, count: int | None = None, *, create: bool = False, mode: int = 0o660,
                 fd: int | None = None) -> None:
        """``fd``: map that descriptor (consumed: closed here) instead of opening ``path``."""
        self.path = Path(path) if path is not None else None
        if create and (count is None or count < 1):
            raise ValueError("a flag file needs count >= 1")
        if fd is not None:
            label = f"flag descriptor {fd}"
        else:
            assert self.path is not None, "a path or a descriptor"
            label = str(self.path)
            if create:
                assert count is not None
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, mode)
                os.fchmod(fd, mode)
                os.ftruncate(fd, _flag_bytes(count))
            else:
                fd = os.open(self.path, os.O_RDWR)
        try:
            size = os.fstat(fd).st_size
            if size < HEADER_BYTES + 8:
                raise ValueError(f"{label} is {size} bytes: not a transportd flag file")
            self._mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        raw = np.frombuffer(self._mm, dtype=np.uint8)
        header = raw[:HEADER_BYTES].view("<u4")
        if create:
            header[1] = count
            header[0] = MAGIC
        elif header[0] != MAGIC or HEADER_BYTES + 8 * int(header[1]) > size:
            del raw, header
            self._mm.close()
            raise ValueError(f"{label} is not a transportd flag file")
        self.count = int(header[1])
        self._status = header[OFF_STATUS // 4 : OFF_STATUS // 4 + 1]
        self.values = raw[HEADER_BYTES : HEADER_BYTES + 8 * self.count].view("<u8")
        self.address = int(raw.ctypes.data) + HEADER_BYTES
        self.nbytes = 8 * self.count

    @classmethod
    def create_memfd(cls, count: int, *, name: str = "tpd-flags") -> tuple[FlagFile, int]:
        """A new flag array in a sealed memfd (see :mod:`cmd_ring.shm`); returns it and a descriptor of it,
        the caller's to hand out and close."""
        if count < 1:
            raise ValueError("a flag file needs count >= 1")
        fd = sealed_memfd(name, _flag_bytes(count))
        try:
            return cls(None, count, create=True, fd=os.dup(fd)), fd
        except BaseException:
            os.close(fd)
            raise

    @classmethod
    def from_fd(cls, fd: int) -> FlagFile:
        """Map the flag array behind ``fd`` (consumed: closed here; the mapping keeps the memory)."""
        return cls(None, fd=fd)

    @property
    def status(self) -> int:
        return int(self._status[0])

    def set_status(self, code: int) -> None:
        if self._status[0] == 0:
            self._status[0] = code

    def close(self) -> None:
        """Unmap the file now (the views into it go with it); the object is unusable afterwards."""
        mm = self.__dict__.pop("_mm", None)
        for name in ("values", "_status"):
            self.__dict__.pop(name, None)
        if mm is not None:
            try:
                mm.close()
            except BufferError:
                pass  # a caller still holds a view of the flag words: the mapping goes when that view does

    def unlink(self) -> None:
        """Remove the file's name; a flag array in a memfd has none."""
        if self.path is None:
            return
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
