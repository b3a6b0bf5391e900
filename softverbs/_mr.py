"""A registered region as the engine sees it: keys, bounds, access flags and how to reach its bytes."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ._direct import UNRESOLVED

if TYPE_CHECKING:  # annotations only: the device owns the regions, not the other way round
    from ._device import SoftDevice


class MRCore:
    """A registered region: keys, bounds, access flags and how to reach its bytes."""

    __slots__ = ("device", "pd", "addr", "length", "access", "lkey", "rkey", "view", "accessor", "valid",
                 "export")

    def __init__(self, device: SoftDevice, pd: Any, addr: int, length: int, access: int,
                 view: memoryview | None, accessor: Any) -> None:
        self.device = device
        self.pd = pd
        self.addr = addr
        self.length = length
        self.access = access
        self.view = view
        self.accessor = accessor
        self.lkey, self.rkey = device.new_keys()
        self.valid = True
        self.export: Any = UNRESOLVED  # the device's Export of the allocation under it (direct writes), or None

    def contains(self, addr: int, length: int) -> bool:
        return self.addr <= addr and addr + length <= self.addr + self.length

    def view_at(self, addr: int, n: int) -> memoryview | None:
        if self.view is None:
            return None
        off = addr - self.addr
        return self.view[off:off + n]

    def read(self, addr: int, n: int) -> bytes | memoryview:
        if self.view is not None:
            off = addr - self.addr
            return self.view[off:off + n]
        return self.accessor.read(addr, n)

    def write(self, addr: int, data: Any) -> None:
        if self.view is not None:
            off = addr - self.addr
            self.view[off:off + len(data)] = data
        else:
            self.accessor.write(addr, memoryview(data).cast("B"))


def scatter(local: list[tuple[MRCore, int, int]], data: Any) -> None:
    """Copy `data` across the (region, address, length) pieces in order, stopping when it runs out."""
    view = memoryview(data).cast("B") if not isinstance(data, memoryview) else data
    pos = 0
    total = len(view)
    for mr, addr, n in local:
        if pos >= total:
            break
        take = min(n, total - pos)
        mr.write(addr, view[pos:pos + take])
        pos += take
