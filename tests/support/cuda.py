"""Skip GPU tests, with the reason, where no CUDA device (or no cuda-python) is present."""

from __future__ import annotations

import functools

from transportd.errors import CudaError


@functools.cache
def gpu_unavailable() -> str | None:
    """None when a CUDA device is usable here; otherwise why not."""
    try:
        from gpuclient.cuda_memory import driver

        drv = driver()
        err, count = drv.cuDeviceGetCount()
        if err != drv.CUresult.CUDA_SUCCESS or count < 1:
            return "no CUDA device"
    except CudaError as exc:
        return f"CUDA unavailable: {exc}"
    return None
