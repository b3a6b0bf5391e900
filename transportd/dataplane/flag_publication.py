"""How a rail's worker publishes flags into GPU memory without a CUDA context switch (``flags.publication``).

On efa the receiving daemon, not the NIC, writes a flag once every piece it covers arrived (DESIGN.md
section 4). Host flag files are plain stores into host memory the GPU maps. GPU flag words need a way in
from a host thread, and the obvious one — ``cuMemcpyHtoD`` in the daemon's own CUDA context — waits for
a time slice of that context while the client's kernel is resident: 2.38 ms per copy on the H200. So each
rail picks, at start, by what the node has:

``gdrcopy``
    ``libgdrapi`` (loaded here with ctypes: no build dependency) where the ``gdrdrv`` module is loaded
    (its device node exists): the flag pages are pinned and mapped into the worker through the GPU's BAR
    and the compiled data path stores into them as it stores host flags — how NCCL, NVSHMEM and MSCCL++
    reach GPU memory from a host thread.
``loopback``
    an RDMA write through the rail's own NIC into the GPU flag word (GPUDirect), where there is no
    gdrdrv. Over softverbs this is a real loopback QP write into memory registered with the GPU accessor.
``host-mapped``
    neither is possible: ``session.flags()`` defaults to host flags (pinned host memory mapped into the
    GPU) on this node; a client that asks for device flags explicitly gets ``cuda-copy``.
``cuda-copy``
    the copy through the daemon's CUDA context, the last resort; the log says what it costs.

Every path keeps a host shadow of each counter (the rank's host flag file, shared by the rails' workers):
an ADD is one atomic add on the shadow and one store (or write) of the new value, never a read of GPU
memory. Rails whose NIC writes flags itself (ib) report ``nic``.
"""

from __future__ import annotations

import ctypes
import logging
import os
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "COPY_COST",
    "CUDA_COPY",
    "GDRCOPY",
    "GPU_PAGE_SIZE",
    "HOST_MAPPED",
    "LOOPBACK",
    "NIC",
    "GdrCopy",
    "GdrCopyError",
    "GdrMapping",
    "Publication",
    "choose_publication",
    "words_path",
]

log = logging.getLogger("transportd.flags")

GDRCOPY, LOOPBACK, HOST_MAPPED, CUDA_COPY, NIC = "gdrcopy", "loopback", "host-mapped", "cuda-copy", "nic"

#: What the last resort costs, for the log line that announces it.
COPY_COST = ("each flag is a copy through the daemon's CUDA context, which waits for a time slice while the "
             "client's kernel runs: 2.38 ms per flag measured on an H200 (about 0.5 ms with CUDA MPS running); "
             "load gdrdrv (GDRCopy) or use host flags to avoid it")

#: gdrdrv pins GPU memory in pages of this size (gdrapi.h GPU_PAGE_SIZE).
GPU_PAGE_SIZE = 1 << 16

_DEFAULT_LIBRARIES = ("libgdrapi.so.2", "libgdrapi.so")


class GdrCopyError(OSError):
    """libgdrapi could not be loaded, opened or could not pin/map a buffer."""


class _MemHandle(ctypes.Structure):
    _fields_ = [("h", ctypes.c_ulong)]  # gdr_mh_t, passed by value


class _Info(ctypes.Structure):
    _fields_ = [("va", ctypes.c_uint64), ("mapped_size", ctypes.c_uint64), ("page_size", ctypes.c_uint32),
                ("tm_cycles", ctypes.c_uint64), ("cycles_per_ms", ctypes.c_uint32), ("bits", ctypes.c_uint32),
                ("mapping_type", ctypes.c_int)]  # gdr_info_v2_t


class GdrCopy:
    """``libgdrapi`` through ctypes: open the driver once, pin and map GPU ranges into this process.

    Only the functions below are used: ``gdr_open``, ``gdr_close``, ``gdr_pin_buffer``,
    ``gdr_unpin_buffer``, ``gdr_map``, ``gdr_unmap`` and, where the library has it, ``gdr_get_info_v2``.
    """

    def __init__(self, library: str = "") -> None:
        names = (library,) if library else _DEFAULT_LIBRARIES
        errors = []
        self.lib: Any = None
        for name in names:
            try:
                self.lib = ctypes.CDLL(name)
                self.library = name
                break
            except OSError as exc:
                errors.append(str(exc))
        if self.lib is None:
            raise GdrCopyError(f"cannot load libgdrapi ({'; '.join(errors)})")
        lib = self.lib
        try:
            lib.gdr_open.restype = ctypes.c_void_p
            lib.gdr_open.argtypes = []
            lib.gdr_close.argtypes = [ctypes.c_void_p]
            lib.gdr_pin_buffer.argtypes = [ctypes.c_void_p, ctypes.c_ulong, ctypes.c_size_t, ctypes.c_uint64,
                                           ctypes.c_uint32, ctypes.POINTER(_MemHandle)]
            lib.gdr_unpin_buffer.argtypes = [ctypes.c_void_p, _MemHandle]
            lib.gdr_map.argtypes = [ctypes.c_void_p, _MemHandle, ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t]
            lib.gdr_unmap.argtypes = [ctypes.c_void_p, _MemHandle, ctypes.c_void_p, ctypes.c_size_t]
        except AttributeError as exc:
            raise GdrCopyError(f"{self.library} is not libgdrapi: {exc}") from None
        self._info = getattr(lib, "gdr_get_info_v2", None)
        if self._info is not None:
            self._info.argtypes = [ctypes.c_void_p, _MemHandle, ctypes.POINTER(_Info)]
        self.handle: int | None = lib.gdr_open()
        if not self.handle:
            self.handle = None
            raise GdrCopyError(f"gdr_open failed ({self.library}: is the gdrdrv module loaded and its device "
                               "node readable by this user?)")

    def map(self, addr: int, size: int) -> GdrMapping:
        """Pin the GPU pages holding ``[addr, addr + size)`` and map them here; ``.ptr`` is ``addr``'s place."""
        if self.handle is None:
            raise GdrCopyError("libgdrapi is closed")
        base = addr & ~(GPU_PAGE_SIZE - 1)
        span = (addr + size - base + GPU_PAGE_SIZE - 1) & ~(GPU_PAGE_SIZE - 1)
        mh = _MemHandle()
        rc = self.lib.gdr_pin_buffer(self.handle, base, span, 0, 0, ctypes.byref(mh))
        if rc:
            raise GdrCopyError(f"gdr_pin_buffer({base:#x}, {span}) failed: {rc}")
        va = ctypes.c_void_p()
        rc = self.lib.gdr_map(self.handle, mh, ctypes.byref(va), span)
        if rc or not va.value:
            self.lib.gdr_unpin_buffer(self.handle, mh)
            raise GdrCopyError(f"gdr_map of {span} bytes at {base:#x} failed: {rc}")
        start = base  # the GPU address mapped at va (the driver may align further: ask it where it can)
        if self._info is not None:
            info = _Info()
            if self._info(self.handle, mh, ctypes.byref(info)) == 0 and info.va:
                start = int(info.va)
        offset = addr - start
        if offset < 0 or offset + size > span:
            self.lib.gdr_unmap(self.handle, mh, va, span)
            self.lib.gdr_unpin_buffer(self.handle, mh)
            raise GdrCopyError(f"gdrdrv mapped {start:#x}, which does not cover [{addr:#x}, {addr + size:#x})")
        return GdrMapping(self, mh, int(va.value), span, int(va.value) + offset)

    def close(self) -> None:
        if self.handle is not None:
            self.lib.gdr_close(self.handle)
            self.handle = None


@dataclass(eq=False)
class GdrMapping:
    """A pinned, mapped GPU range: ``ptr`` is the mapped address of the flag words (write-combined)."""

    gdr: GdrCopy
    mh: Any
    va: int
    size: int
    ptr: int

    def release(self) -> None:
        """Unmap, then unpin (gdrapi's order); before the GPU memory itself is closed."""
        if self.va and self.gdr.handle is not None:
            self.gdr.lib.gdr_unmap(self.gdr.handle, self.mh, ctypes.c_void_p(self.va), self.size)
            self.gdr.lib.gdr_unpin_buffer(self.gdr.handle, self.mh)
        self.va = 0


@dataclass
class Publication:
    """A rail's choice: ``path`` (one of the module's names), why, and whether the config forced it."""

    path: str
    reason: str
    forced: bool = False
    gdr: GdrCopy | None = field(default=None, repr=False)

    def describe(self) -> dict[str, Any]:
        return {"path": self.path, "reason": self.reason, "forced": self.forced}


def choose_publication(setting: str, *, receiver_publishes: bool, loopback: str | None, gdrdrv_device: str,
                       gdrcopy_library: str = "") -> Publication:
    """Pick the rail's path for ``flags.publication = setting``.

    ``receiver_publishes``: the backend publishes flags at the receiver (efa); else the NIC writes them
    (``nic``). ``loopback``: None where the backend can write into its own registered memory through its
    NIC, else why not. A forced path that cannot work raises :class:`ValueError` naming why.
    """
    if not receiver_publishes:
        return Publication(NIC, "the sender's NIC writes the flags (RDMA write or atomic)")
    forced = setting != "auto"

    def gdr() -> Publication | str:
        if not os.path.exists(gdrdrv_device):
            return f"{gdrdrv_device} is absent (the gdrdrv kernel module is not loaded)"
        try:
            lib = GdrCopy(gdrcopy_library)
        except GdrCopyError as exc:
            return str(exc)
        return Publication(GDRCOPY, f"gdrdrv at {gdrdrv_device}, {lib.library}: GPU flag pages mapped through "
                                    "the BAR, published by CPU stores", forced, lib)

    if setting in ("auto", GDRCOPY):
        got = gdr()
        if isinstance(got, Publication):
            return got
        if forced:
            raise ValueError(f"flags.publication = \"gdrcopy\": {got}")
        no_gdr = got
    if setting in ("auto", LOOPBACK):
        if loopback is None:
            why = "RDMA write through the rail's own NIC into the GPU flag words"
            return Publication(LOOPBACK, why if forced else f"no GDRCopy ({no_gdr}); {why}", forced)
        if forced:
            raise ValueError(f"flags.publication = \"loopback\": {loopback}")
    if setting == CUDA_COPY:
        return Publication(CUDA_COPY, "forced by flags.publication: " + COPY_COST, True)
    if setting in ("auto", HOST_MAPPED):
        why = ("flags default to host memory mapped into the GPU; device flags asked for explicitly fall back "
               "to cuda-copy")
        if not forced:
            why = f"no GDRCopy ({no_gdr}), no loopback write ({loopback}); {why}"
        return Publication(HOST_MAPPED, why, forced)
    raise ValueError(f"unknown flags.publication {setting!r}")


def words_path(path: str) -> str:
    """How a rail on ``path`` publishes GPU flag words a client registered: its own path where it has one
    into GPU memory; else (``host-mapped``: device flags asked for explicitly) ``cuda-copy``. On ``nic``
    rails the sender's NIC writes them and the worker never publishes; ``cuda-copy`` stands by."""
    return path if path in (GDRCOPY, LOOPBACK, CUDA_COPY) else CUDA_COPY
