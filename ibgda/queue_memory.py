"""The host memory of one IBGDA queue pair: send queue, CQ and doorbell records, laid out as a NIC wants.

One page-aligned mapping, so a GPU maps it with one ``cuMemHostRegister`` and the NIC with one UMEM per
part. Anonymous for a queue used in one process; a memfd (``fd``: the daemon's, sized and sealed here) when
the daemon's rail worker serves the queue and a client maps it (:meth:`QueueMemory.attach` with the
descriptor it took), or a named shared-memory file (``path``) for tools:

=============  =========================  =================================================================
offset         size                       what
=============  =========================  =================================================================
0              wqe_cnt * 64               send queue (WQEBBs)
sq end         ncqes * 64                 completion queue, every op_own 0xf0 (INVALID) at the start
next page      64 + 8                     QP doorbell record at +0 (be32 receive, be32 send), CQ doorbell
                                          record at +64 (be32 set_ci, be32 arm): separate 64-byte lines
next page      4096 (``with_uar_page``)   a stand-in UAR page for the soft NIC: doorbell register at +0x800
=============  =========================  =================================================================
"""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import numpy as np

from cmd_ring.shm import map_fd, map_shared_file, seal_size
from ibgda import mlx5_layout as L
from transportd.limits import MAX_IBGDA_WQES, MIN_IBGDA_WQES

__all__ = ["DOORBELL_OFFSET", "PAGE", "QueueMemory"]

PAGE = mmap.PAGESIZE
DOORBELL_OFFSET = 0x800  # the first BlueFlame register of a ConnectX UAR page
CQ_DBREC_OFFSET = 64


class QueueMemory:
    """Send queue, CQ and doorbell records of one QP in one page-aligned host mapping."""

    def __init__(self, wqe_cnt: int, ncqes: int, *, with_uar_page: bool = False, path: str | Path | None = None,
                 create: bool = True, fd: int | None = None) -> None:
        """``fd`` (the caller keeps and closes it): an empty memfd to size and seal (``create``), or one to
        map as it is."""
        for name, n in (("wqe_cnt", wqe_cnt), ("ncqes", ncqes)):
            if n < MIN_IBGDA_WQES or n & (n - 1) or n > MAX_IBGDA_WQES:
                raise ValueError(f"{name} must be a power of two in {MIN_IBGDA_WQES} .. {MAX_IBGDA_WQES}, not {n}")
        if ncqes < wqe_cnt:
            raise ValueError(f"ncqes ({ncqes}) must be at least wqe_cnt ({wqe_cnt}): one CQE per WQE may come")
        self.wqe_cnt, self.ncqes = wqe_cnt, ncqes
        self.sq_bytes = wqe_cnt * L.WQE_BB
        self.cq_offset = self.sq_bytes
        self.cq_bytes = ncqes * 64
        self.dbrec_offset = -(-(self.sq_bytes + self.cq_bytes) // PAGE) * PAGE
        self.uar_offset = self.dbrec_offset + PAGE if with_uar_page else None
        self.nbytes = self.dbrec_offset + PAGE + (PAGE if with_uar_page else 0)
        self.path = Path(path) if path is not None else None
        if fd is not None:
            if create:
                os.ftruncate(fd, self.nbytes)
                seal_size(fd)  # the client maps it too: it must not be able to shrink it under the worker
            shared = map_fd(fd)
        elif self.path is not None:
            shared = map_shared_file(self.path, self.nbytes, create=create, mode=0o600)
        else:
            shared = None
            self._map = mmap.mmap(-1, self.nbytes)
        if shared is not None:
            if shared.size != self.nbytes:
                shared.close()
                raise ValueError(f"{self.path or 'the queue memfd'} holds {shared.size} bytes; a queue of {wqe_cnt} "
                                 f"WQEs and {ncqes} CQEs takes {self.nbytes}")
            self._map = shared.mm
        whole = np.frombuffer(self._map, dtype=np.uint8)
        self.whole = whole
        self.base = int(whole.ctypes.data)
        self.sq = whole[:self.sq_bytes]
        self.cq = whole[self.cq_offset:self.cq_offset + self.cq_bytes]
        if create:
            self.cq[63::64] = L.CQE_INITIAL_OP_OWN
        self.dbrec = whole[self.dbrec_offset:self.dbrec_offset + 8].view(np.uint32)
        cq_db = self.dbrec_offset + CQ_DBREC_OFFSET
        self.cq_dbrec = whole[cq_db:cq_db + 8].view(np.uint32)
        if self.uar_offset is not None:
            bf = self.uar_offset + DOORBELL_OFFSET
            self.doorbell = whole[bf:bf + 8].view(np.uint64)

    @classmethod
    def attach(cls, path: str | Path | None, wqe_cnt: int, ncqes: int, *, fd: int | None = None) -> QueueMemory:
        """Map the queue another process created (with the stand-in doorbell page): its memfd ``fd`` (the
        caller keeps and closes it) or the file at ``path``."""
        return cls(wqe_cnt, ncqes, with_uar_page=True, path=path, create=False, fd=fd)

    def unlink(self) -> None:
        """Remove the shared-memory file's name (the mappings stay valid)."""
        if self.path is not None:
            self.path.unlink(missing_ok=True)

    def addresses(self) -> dict[str, int]:
        """Host addresses of the parts (``bf`` only with the stand-in UAR page)."""
        out = {"sq": self.base, "cq": self.base + self.cq_offset, "dbrec": self.base + self.dbrec_offset,
               "cq_dbrec": self.base + self.dbrec_offset + CQ_DBREC_OFFSET}
        if self.uar_offset is not None:
            out["bf"] = self.base + self.uar_offset + DOORBELL_OFFSET
        return out
