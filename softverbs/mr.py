"""Memory regions (pyverbs.mr). An MR either allocates host memory or registers memory at `address`.

Memory at an address that a `softverbs.soft.register_memory` range covers (GPU memory, say) is reached
through that range's accessor; other addresses are host memory of this process. Registration checks the
access flags as the kernel does: remote write or remote atomic needs local write. A region registered with
IBV_ACCESS_RELAXED_ORDERING lets writes into it be placed ahead of earlier writes (PCIe relaxed ordering).
"""

from __future__ import annotations

import errno
from typing import Any

from . import libibverbs_enums as e
from ._base import SoftCM
from ._memory import ACCESSORS, alloc_host, host_view
from ._mr import MRCore
from .pyverbs_error import PyverbsRDMAError, PyverbsUserError

__all__ = ["MR"]

_LW = int(e.IBV_ACCESS_LOCAL_WRITE)
_NEEDS_LW = int(e.IBV_ACCESS_REMOTE_WRITE | e.IBV_ACCESS_REMOTE_ATOMIC)
_RO = int(e.IBV_ACCESS_RELAXED_ORDERING)


class MR(SoftCM):
    """A registered memory region: `buf` (its address), `length`, `lkey`, `rkey`."""

    __slots__ = ("_pd", "_core", "_mem", "_closed")

    def __init__(self, creator: Any, length: int = 0, access: int = 0, address: int | None = None,
                 implicit: bool = False, **kwargs: Any) -> None:
        super().__init__()
        from .pd import PD

        self._closed = True
        if not isinstance(creator, PD):
            raise PyverbsUserError(f"Cannot register an MR on {type(creator)}")
        if kwargs.get("handle") is not None or implicit:
            raise PyverbsRDMAError("Failed to register a MR", errno.EOPNOTSUPP)
        access = int(access)
        if (access & _NEEDS_LW) and not access & _LW:
            raise PyverbsRDMAError(f"Failed to register a MR. length: {length}, access flags: {access}",
                                   errno.EINVAL)
        if length <= 0:
            raise PyverbsRDMAError(f"Failed to register a MR. length: {length}, access flags: {access}",
                                   errno.EINVAL)
        accessor = kwargs.get("soft_accessor")
        self._mem: Any = None
        if address:
            if accessor is None:
                accessor = ACCESSORS.lookup(address, length)
            view = None if accessor is not None else host_view(address, length)
            addr = address
        else:
            if accessor is not None:
                raise PyverbsUserError("soft_accessor needs an address")
            self._mem, addr, view = alloc_host(length)
        dev = creator._dev
        core = MRCore(dev, creator, addr, length, access, view, accessor)
        with dev.lock:
            dev.mrs_by_lkey[core.lkey] = core
            dev.mrs_by_rkey[core.rkey] = core
            if access & _RO:
                dev.relaxed_mrs += 1
        self._core = core
        self._pd = creator
        self._closed = False
        creator._children.add(self)

    def close(self) -> None:
        if getattr(self, "_closed", True):
            return
        core = self._core
        core.valid = False
        dev = core.device
        with dev.lock:
            dev.mrs_by_lkey.pop(core.lkey, None)
            dev.mrs_by_rkey.pop(core.rkey, None)
            if core.access & _RO:
                dev.relaxed_mrs -= 1
        dev.release_export(core)
        self._closed = True

    def write(self, data: Any, length: int, offset: int = 0) -> None:
        """Copy `length` bytes of `data` into the region at `offset`."""
        if self._closed or length < 0:
            raise PyverbsUserError(f"The MR buffer isn't allocated or length {length} is invalid")
        if isinstance(data, str):
            data = data.encode()
        core = self._core
        if offset < 0 or offset + length > core.length:
            raise PyverbsUserError(f"write of {length} bytes at offset {offset} is outside the MR")
        core.write(core.addr + offset, memoryview(data).cast("B")[:length])

    def read(self, length: int, offset: int) -> bytes:
        """`length` bytes of the region from `offset`."""
        if offset < 0:
            raise PyverbsUserError(f"Invalid offset {offset}")
        if self._closed or length < 0:
            raise PyverbsUserError(f"The MR buffer isn't allocated or length {length} is invalid")
        core = self._core
        if offset + length > core.length:
            raise PyverbsUserError(f"read of {length} bytes at offset {offset} is outside the MR")
        return bytes(core.read(core.addr + offset, length))

    @property
    def buf(self) -> int:
        return self._core.addr

    @property
    def lkey(self) -> int:
        return self._core.lkey

    @property
    def rkey(self) -> int:
        return self._core.rkey

    @property
    def length(self) -> int:
        return self._core.length

    @property
    def handle(self) -> int:
        return self._core.lkey >> 8

    def __str__(self) -> str:
        c = self._core
        return f"MR:\nlkey: {c.lkey}\nrkey: {c.rkey}\nlength: {c.length}\nbuf: {c.addr}\n"
