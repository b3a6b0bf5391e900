"""Memory regions (pyverbs.mr). An MR either allocates host memory or registers memory at `address`.

Memory at an address that a `softverbs.soft.register_memory` range covers (GPU memory, say) is reached
through that range's accessor; other addresses are host memory of this process. Registration checks the
access flags as the kernel does: remote write or remote atomic needs local write. A region registered with
IBV_ACCESS_RELAXED_ORDERING lets writes into it be placed ahead of earlier writes (PCIe relaxed ordering).

``MR(pd, handle=h)`` imports the MR whose handle is ``h`` (``ibv_import_mr``): on an imported PD, the
exporter's MR, its keys the same and its bytes reached through the exporter (``softverbs._export``); on a
PD of this process, another name for that PD's own MR. Closing an imported MR (or ``unimport``) leaves the
MR itself alone.
"""

from __future__ import annotations

import errno
from typing import Any

from . import libibverbs_enums as e
from ._dropped import SoftResource
from ._memory import ACCESSORS, alloc_host, host_view
from ._mr import MRCore
from .pyverbs_error import PyverbsRDMAError, PyverbsUserError

__all__ = ["MR"]

_LW = int(e.IBV_ACCESS_LOCAL_WRITE)
_NEEDS_LW = int(e.IBV_ACCESS_REMOTE_WRITE | e.IBV_ACCESS_REMOTE_ATOMIC)
_RO = int(e.IBV_ACCESS_RELAXED_ORDERING)


class MR(SoftResource):
    """A registered memory region: `buf` (its address), `length`, `lkey`, `rkey`."""

    _kind = "mr"  # what softverbs._export looks for among a context's objects
    __slots__ = ("_pd", "_core", "_mem", "_closed", "_imported", "_buf")

    def __init__(self, creator: Any, length: int = 0, access: int = 0, address: int | None = None,
                 implicit: bool = False, **kwargs: Any) -> None:
        super().__init__()
        from .pd import PD

        self._closed = True
        self._imported = False
        self._buf: int | None = None
        if not isinstance(creator, PD):
            raise PyverbsUserError(f"Cannot register an MR on {type(creator)}")
        if kwargs.get("handle") is not None:
            self._import(creator, int(kwargs["handle"]))
            self._buf = int(address or 0)  # as pyverbs: an imported MR's buf is the address given, else NULL
            return
        if implicit:
            raise PyverbsRDMAError("Failed to register a MR", errno.EOPNOTSUPP)
        if creator._imported and creator._ctx._link is not None:
            # the keys of an imported context are the exporter's: register there and import the handle
            raise PyverbsRDMAError("Failed to register a MR: softverbs registers memory on an imported PD only "
                                   "in the exporting process (import the MR by handle)", errno.EOPNOTSUPP)
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
        core = MRCore(dev, creator._ident, addr, length, access, view, accessor)
        with dev.lock:
            dev.mrs_by_lkey[core.lkey] = core
            dev.mrs_by_rkey[core.rkey] = core
            if access & _RO:
                dev.relaxed_mrs += 1
        self._core = core
        self._pd = creator
        self._closed = False
        creator._children.add(self)

    def _import(self, pd: Any, handle: int) -> None:
        """ibv_import_mr: the MR ``handle`` of ``pd``'s context, which must be on ``pd``."""
        from ._export import LinkAccessor, LinkError

        if pd._closed or pd._gone:
            raise PyverbsRDMAError("Failed to import MR", errno.EINVAL)
        ctx = pd._ctx
        self._imported = True
        self._mem = None
        if ctx._link is None:  # this process's own MR, by another name
            for other in list(ctx._children):
                for child in list(getattr(other, "_children", ())):
                    if isinstance(child, MR) and not child._closed and not child._imported \
                            and child.handle == handle and child._core.pd is pd._ident:
                        self._core, self._pd, self._closed = child._core, pd, False
                        pd._children.add(self)
                        return
            raise PyverbsRDMAError("Failed to import MR", errno.EINVAL)
        try:
            reply, _ = ctx._link.call("mr", handle=handle, pd=pd.handle)
        except LinkError as exc:
            raise PyverbsRDMAError("Failed to import MR", exc.errno) from None
        exporter = ctx._exporter() if ctx._exporter is not None else None
        if exporter is not None:  # in the exporter's process: the exporter's MR itself
            for other in list(exporter._children):
                for child in list(getattr(other, "_children", ())):
                    if isinstance(child, MR) and not child._closed and not child._imported and child.handle == handle:
                        self._core, self._pd, self._closed = child._core, pd, False
                        pd._children.add(self)
                        return
            raise PyverbsRDMAError("Failed to import MR", errno.EINVAL)
        dev = pd._dev
        core = MRCore(dev, pd._ident, int(reply["addr"]), int(reply["length"]), int(reply["access"]), None, None)
        core.lkey, core.rkey = int(reply["lkey"]), int(reply["rkey"])
        core.accessor = LinkAccessor(ctx._link, handle, lambda: core)
        with dev.lock:
            dev.mrs_by_lkey[core.lkey] = core
            dev.mrs_by_rkey[core.rkey] = core
            if core.access & _RO:
                dev.relaxed_mrs += 1
        ctx._imports["mr"].setdefault(handle, []).append(core)
        self._core, self._pd, self._closed = core, pd, False
        pd._children.add(self)

    def close(self) -> None:
        if getattr(self, "_closed", True):
            return
        self._closed = True
        core = self._core
        if self._imported:
            group = self._pd._ctx._imports["mr"].get(self.handle, [])
            if core in group:  # an import over the link: its core is ours to drop
                group.remove(core)
                _drop_core(core)
            return
        _drop_core(core)
        export = self._pd._ctx._export
        if export is not None:
            export.gone("mr", self.handle)

    def unimport(self) -> None:
        """ibv_unimport_mr: forget an imported MR without deregistering it (an MR made here: closes it)."""
        self.close()

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
        return self._core.addr if self._buf is None else self._buf

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


def _drop_core(core: MRCore) -> None:
    """The region's keys stop working on its device."""
    core.valid = False
    dev = core.device
    with dev.lock:
        if dev.mrs_by_lkey.get(core.lkey) is core:
            del dev.mrs_by_lkey[core.lkey]
        if dev.mrs_by_rkey.get(core.rkey) is core:
            del dev.mrs_by_rkey[core.rkey]
        if core.access & _RO:
            dev.relaxed_mrs -= 1
    dev.release_export(core)
