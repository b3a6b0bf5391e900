"""The CUDA driver for this process: ``cuda.bindings.driver`` imported and initialised on first use, calls
checked, a device's primary context made current.

Both sides use it: the client library (``gpuclient.cuda_memory``: buffers, IPC export, host mappings) and
the daemon's rail workers (``transportd.dataplane.gpu_memory``: clients' GPU memory, flag words included).
cuda-python is imported only on first use, so CPU-only processes never need it.
"""

from __future__ import annotations

import ctypes
import threading
from typing import Any

from cmd_ring.errors import CudaError, CudaUnavailableError

__all__ = ["check", "driver", "entry_point", "result_name", "use_device"]

_lock = threading.Lock()
_driver: Any = None
_contexts: dict[int, Any] = {}


def driver() -> Any:
    """``cuda.bindings.driver``, imported and initialised (cuInit) on first use."""
    global _driver
    if _driver is None:
        with _lock:
            if _driver is None:
                try:
                    from cuda.bindings import driver as drv
                except ImportError as exc:
                    raise CudaUnavailableError("import cuda.bindings.driver",
                                               f"{exc}: install cuda-python (pip install 'transportd[cuda]')") from None
                try:
                    (err,) = drv.cuInit(0)
                except RuntimeError as exc:  # cuda-python without a driver: "Failed to dlopen libcuda.so.1"
                    raise CudaUnavailableError("cuInit", str(exc)) from None
                if err != drv.CUresult.CUDA_SUCCESS:
                    raise CudaUnavailableError("cuInit", result_name(err))
                _driver = drv
    return _driver


def entry_point(name: str) -> int:
    """The address of the driver function ``name`` in libcuda (which :func:`driver` has loaded), for compiled
    code that calls the driver with the GIL released (``transportd._core.copy_run``)."""
    driver()
    try:
        fn = getattr(ctypes.CDLL("libcuda.so.1"), name)
    except (OSError, AttributeError) as exc:
        raise CudaUnavailableError(f"libcuda {name}", str(exc)) from None
    address = ctypes.cast(fn, ctypes.c_void_p).value
    assert address  # dlsym found it
    return address


def result_name(err: Any) -> str:
    """A CUresult's name (CUDA_ERROR_...)."""
    return getattr(err, "name", str(err))


def check(result: Any, call: str = "CUDA call") -> Any:
    """Unwrap a cuda-python ``(CUresult, *values)`` tuple: raise on an error, return the value(s)."""
    drv = driver()
    err, *values = result if isinstance(result, tuple) else (result,)
    if err != drv.CUresult.CUDA_SUCCESS:
        raise CudaError(call, result_name(err))
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)


def use_device(device: int) -> Any:
    """Make ``device``'s primary context current on this thread (the one CuPy and PyTorch use); returns it."""
    drv = driver()
    ctx = _contexts.get(device)
    if ctx is None:
        with _lock:
            ctx = _contexts.get(device)
            if ctx is None:
                dev = check(drv.cuDeviceGet(device), f"cuDeviceGet({device})")
                ctx = check(drv.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")
                _contexts[device] = ctx
    check(drv.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
    return ctx
