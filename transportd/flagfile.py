"""A rank's flag array in host memory: a shared-memory file the daemon creates and the client maps.

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

__all__ = ["FlagFile", "HEADER_BYTES", "OFF_STATUS"]

MAGIC = 0x46445054  # "TPDF"
HEADER_BYTES = 64
OFF_STATUS = 8


class FlagFile:
    """Create (daemon) or open (client) a flag file; ``values`` are the flag words."""

    def __init__(self, path: Path, count: int | None = None, *, create: bool = False, mode: int = 0o660) -> None:
        self.path = Path(path)
        if create:
            if count is None or count < 1:
                raise ValueError("a flag file needs count >= 1")
            size = (HEADER_BYTES + 8 * count + mmap.PAGESIZE - 1) // mmap.PAGESIZE * mmap.PAGESIZE
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, mode)
            os.fchmod(fd, mode)
            os.ftruncate(fd, size)
        else:
            fd = os.open(self.path, os.O_RDWR)
            size = os.fstat(fd).st_size
        try:
            self._mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        raw = np.frombuffer(self._mm, dtype=np.uint8)
        header = raw[:HEADER_BYTES].view("<u4")
        if create:
            header[1] = count
            header[0] = MAGIC
        elif header[0] != MAGIC:
            raise ValueError(f"{self.path} is not a transportd flag file")
        self.count = int(header[1])
        self._status = header[OFF_STATUS // 4 : OFF_STATUS // 4 + 1]
        self.values = raw[HEADER_BYTES : HEADER_BYTES + 8 * self.count].view("<u8")
        self.address = int(raw.ctypes.data) + HEADER_BYTES
        self.nbytes = 8 * self.count

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
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
