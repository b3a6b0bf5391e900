"""Device memory for the softverbs tests: emulated on the CPU, or a real GPU's.

A pair built with ``client_memory=`` / ``server_memory=`` (tests/support/verbs_resources.py) registers
its MRs over memory from one of these, reached through an accessor as softverbs reaches GPU memory, with
the memory's direct copier installed while the ``with`` block runs, so writes from it go by direct copy
(``softverbs._direct``) once the peer side has opened the allocation.

- :class:`ShmDeviceMemory`: /dev/shm files (``softverbs.soft.ShmCopier``) behind a ``HostAccessor``:
  the direct path, between processes too, on any machine.
- :class:`CudaDeviceMemory`: ``cuMemAlloc`` on GPU 0 behind transportd's ``GpuAccessor``; pairs live in
  one process, so a peer "opens" an allocation by its address and placement is a ``cuMemcpyAsync``
  between the two buffers on the accessor's stream (``via="host"``: its copy through pinned host memory).
"""

from __future__ import annotations

from typing import Any

from softverbs import soft


class ShmDeviceMemory:
    """Shared host memory served as device memory (through a HostAccessor), with its copier installed."""

    def __init__(self) -> None:
        self.copier = soft.ShmCopier()
        self.accessor = soft.HostAccessor()

    def allocate(self, size: int) -> int:
        return self.copier.allocate(size)

    def free(self, addr: int) -> None:
        self.copier.free(addr)

    def mr_options(self) -> dict[str, Any]:
        return {"soft_accessor": self.accessor}

    def __enter__(self) -> ShmDeviceMemory:
        soft.set_direct_copier(self.copier)
        return self

    def __exit__(self, *exc: object) -> None:
        soft.set_direct_copier(None)


class CudaDeviceMemory:
    """GPU 0's memory (cuMemAlloc) behind a GpuAccessor; copies on the accessor's stream."""

    def __init__(self, device: int = 0, via: str = "device") -> None:
        from transportd.cuda_driver import check, driver, use_device
        from transportd.dataplane.gpu_memory import GpuAccessor

        self._drv, self._check = driver(), check
        use_device(device)
        self.device = device
        self.accessor = GpuAccessor(device)
        self.via = via  # softverbs.direct_copy_via: one device-to-device copy, or through pinned host memory
        self._sizes: dict[int, int] = {}
        self.copier = self

    def allocate(self, size: int) -> int:
        addr = int(self._check(self._drv.cuMemAlloc(size), "cuMemAlloc"))
        self._check(self._drv.cuMemsetD8(addr, 0, size), "cuMemsetD8")
        self._sizes[addr] = size
        return addr

    def free(self, addr: int) -> None:
        del self._sizes[addr]
        self._drv.cuMemFree(addr)

    def mr_options(self) -> dict[str, Any]:
        return {"soft_accessor": self.accessor}

    # softverbs.soft.DirectCopier: within this process only (a peer opens nothing: the address is its own)
    def export_range(self, addr: int, length: int) -> tuple[bytes, int, int] | None:
        for base, size in self._sizes.items():
            if base <= addr and addr + length <= base + size:
                return b"cuda:%d" % base, base, size
        return None

    def open_export(self, descriptor: bytes) -> tuple[int, int]:
        raise ValueError("these allocations are shared within this process only")

    def close_export(self, descriptor: bytes) -> None:
        pass

    def copy(self, dst: int, src: int, length: int) -> None:
        if self.via == "host":
            self.accessor.copy_through_host(dst, src, length)
        else:
            self.accessor.copy(dst, src, length)

    def copy_many(self, copies: list[tuple[int, int | memoryview, int]]) -> None:
        if self.via == "host":  # device to device through host memory; host bytes go in as they are
            for dst, src, length in copies:
                if isinstance(src, int):
                    self.accessor.copy_through_host(dst, src, length)
                else:
                    self.accessor.copy_many([(dst, src, length)])
        else:
            self.accessor.copy_many(copies)

    def __enter__(self) -> CudaDeviceMemory:
        soft.set_direct_copier(self)
        return self

    def __exit__(self, *exc: object) -> None:
        soft.set_direct_copier(None)
        self.accessor.close()
