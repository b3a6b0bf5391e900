"""Compile kernels that include ``<transportd/client.cuh>`` with NVRTC, load them, launch them.

::

    module = gpuclient.compile(source)                 # NVRTC, -I each of gpuclient.get_include_dirs(), this GPU's arch
    kernel = module.function("stream_chunks")
    kernel.launch(grid=132, block=128, args=(ch.device_handle(), np.uint64(ptr), np.uint32(n)))

Arguments are packed by value: numpy scalars and ctypes objects as they are, a channel handle (anything
with ``bytes``, e.g. ``DeviceChannel``) or raw ``bytes`` as a struct.

Every kernel of a module is loaded when the module is (``cuFuncLoad``), not at its first launch: under
CUDA's lazy loading the first launch of a function may wait for the kernels already running, so a kernel
that spins on a flag another kernel of the same process will set (two ranks in one process, a receiver
launched before its sender) can deadlock the first time.

Only ``cuda.bindings`` is needed (``nvrtc`` and ``driver``); CuPy and PyTorch users can instead pass
every root of ``get_include_dirs()`` to their own compilers and the handle's bytes to their own launchers (and
should load their kernels before launching ones that wait on each other).
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

import cmd_ring
from cmd_ring.errors import CudaError
from gpuclient.cuda_memory import check, compute_capability, driver, use_device
from gpuclient.errors import CompileError

__all__ = ["Kernel", "Module", "compile", "get_include", "get_include_dirs", "load_all_functions", "nvrtc_options"]


def get_include() -> str:
    """gpuclient's own include root, the device API: ``<transportd/client.cuh>`` (the proxy path) and
    ``<transportd/ibgda/ibgda.cuh>`` (the IBGDA path). Its headers include the contract's too, so a build
    needs every root of :func:`get_include_dirs`."""
    return str(Path(__file__).parent / "include")


def get_include_dirs() -> list[str]:
    """Every include root a build of the device API needs, in order: :func:`get_include`, then the contract's
    (``cmd_ring/include``: ``<transportd/cmd_ring.h>``, the record layout, and ``<transportd/errors.h>``, the
    error codes; the daemon's C core includes the same two). Pass each as ``-I``."""
    return [get_include(), str(Path(cmd_ring.__file__).parent / "include")]


def _nvrtc() -> Any:
    try:
        from cuda.bindings import nvrtc
    except ImportError as exc:
        raise CudaError("import cuda.bindings.nvrtc", str(exc)) from None
    return nvrtc


def _nvrtc_check(result: Any, call: str) -> Any:
    nvrtc = _nvrtc()
    err, *values = result if isinstance(result, tuple) else (result,)
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise CudaError(call, getattr(err, "name", str(err)))
    return values[0] if len(values) == 1 else (tuple(values) or None)


def nvrtc_options(arch: str, *, debug: bool = False, defines: dict[str, object] | None = None,
                  include_dirs: Iterable[str] = (), options: Sequence[str] = ()) -> list[str]:
    """The NVRTC command line used by :func:`compile` (exposed for tests and other compilers)."""
    opts = [f"-arch={arch}", "-std=c++17", *(f"-I{d}" for d in get_include_dirs()), "-default-device"]
    opts += [f"-I{d}" for d in include_dirs]
    if debug:
        opts += ["-DTPD_DEBUG=1", "-lineinfo"]
    for key, value in (defines or {}).items():
        opts.append(f"-D{key}" if value is None else f"-D{key}={value}")
    opts += list(options)
    return opts


def compile_to_cubin(source: str, *, name: str = "kernel.cu", arch: str = "sm_90", debug: bool = False,
                     defines: dict[str, object] | None = None, include_dirs: Iterable[str] = (),
                     options: Sequence[str] = ()) -> bytes:
    """NVRTC ``source`` to a cubin for ``arch`` (``sm_90``, ``sm_90a``, ...); raises CompileError with the log."""
    nvrtc = _nvrtc()
    prog = _nvrtc_check(nvrtc.nvrtcCreateProgram(source.encode(), name.encode(), 0, [], []), "nvrtcCreateProgram")
    try:
        opts = [o.encode() for o in nvrtc_options(arch, debug=debug, defines=defines, include_dirs=include_dirs,
                                                   options=options)]
        (err,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
        if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            size = _nvrtc_check(nvrtc.nvrtcGetProgramLogSize(prog), "nvrtcGetProgramLogSize")
            log = b" " * size
            nvrtc.nvrtcGetProgramLog(prog, log)
            raise CompileError(name, log.decode(errors="replace").rstrip("\x00 "))
        size = _nvrtc_check(nvrtc.nvrtcGetCUBINSize(prog), "nvrtcGetCUBINSize")
        cubin = b" " * size
        _nvrtc_check(nvrtc.nvrtcGetCUBIN(prog, cubin), "nvrtcGetCUBIN")
        return cubin
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


def _pack(arg: Any) -> ctypes.Array | ctypes._SimpleCData | ctypes.Structure:
    """Host storage holding ``arg``'s bytes as the kernel expects them."""
    if isinstance(arg, ctypes._SimpleCData | ctypes.Structure | ctypes.Array):
        return arg
    if isinstance(arg, np.generic):
        return (ctypes.c_char * arg.nbytes).from_buffer_copy(arg.tobytes())
    if isinstance(arg, np.ndarray) and arg.dtype.fields is not None and arg.size == 1:
        return (ctypes.c_char * arg.nbytes).from_buffer_copy(arg.tobytes())
    raw = getattr(arg, "bytes", None)
    if isinstance(raw, bytes):
        return (ctypes.c_char * len(raw)).from_buffer_copy(raw)
    if isinstance(arg, bytes | bytearray):
        return (ctypes.c_char * len(arg)).from_buffer_copy(bytes(arg))
    if isinstance(arg, bool | int | float):
        raise TypeError(f"give a sized type for {arg!r} (np.uint64(...), np.int32(...), np.float32(...))")
    raise TypeError(f"cannot pass {type(arg).__name__} as a kernel argument")


@dataclass
class Kernel:
    """One ``extern "C" __global__`` function of a loaded module."""

    module: Module
    name: str
    handle: Any

    def launch(self, grid: int | tuple[int, ...], block: int | tuple[int, ...], args: Sequence[Any] = (), *,
               shared_bytes: int = 0, stream: Any = 0) -> None:
        """Launch asynchronously on ``stream`` (0: the context's default stream)."""
        drv = driver()
        use_device(self.module.device)
        g = (grid, 1, 1) if isinstance(grid, int) else tuple(grid) + (1,) * (3 - len(grid))
        b = (block, 1, 1) if isinstance(block, int) else tuple(block) + (1,) * (3 - len(block))
        storage = [_pack(a) for a in args]
        pointers = (ctypes.c_void_p * max(len(storage), 1))(*[ctypes.addressof(s) for s in storage])
        if shared_bytes > 48 * 1024:
            attr = drv.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
            check(drv.cuFuncSetAttribute(self.handle, attr, shared_bytes), "cuFuncSetAttribute")
        check(drv.cuLaunchKernel(self.handle, *g, *b, shared_bytes, stream, ctypes.addressof(pointers), 0),
              f"cuLaunchKernel({self.name})")


@dataclass
class Module:
    """A cubin loaded into ``device``'s primary context."""

    device: int
    handle: Any
    cubin: bytes = field(repr=False)
    _kernels: dict[str, Kernel] = field(default_factory=dict, repr=False)

    def function(self, name: str) -> Kernel:
        kernel = self._kernels.get(name)
        if kernel is None:
            drv = driver()
            use_device(self.device)
            handle = check(drv.cuModuleGetFunction(self.handle, name.encode()), f"cuModuleGetFunction({name})")
            if hasattr(drv, "cuFuncLoad"):
                check(drv.cuFuncLoad(handle), f"cuFuncLoad({name})")  # never load lazily at a launch
            kernel = self._kernels[name] = Kernel(self, name, handle)
        return kernel

    def global_address(self, name: str) -> tuple[int, int]:
        """(device address, size) of a ``__device__`` variable."""
        drv = driver()
        use_device(self.device)
        ptr, size = check(drv.cuModuleGetGlobal(self.handle, name.encode()), f"cuModuleGetGlobal({name})")
        return int(ptr), int(size)


def compile(source: str, *, device: int = 0, arch: str | None = None, name: str = "kernel.cu", debug: bool = False,
            defines: dict[str, object] | None = None, include_dirs: Iterable[str] = (),
            options: Sequence[str] = ()) -> Module:
    """Compile ``source`` with NVRTC (include path set to :func:`get_include_dirs`) and load it on ``device``.

    ``arch`` defaults to the device's own (``sm_90`` on an H100/H200); ``debug`` bounds every device spin
    (TPD_DEBUG) and adds line info. Kernels should be ``extern "C"`` so :meth:`Module.function` finds them.
    """
    use_device(device)
    if arch is None:
        major, minor = compute_capability(device)
        arch = f"sm_{major}{minor}"
    cubin = compile_to_cubin(source, name=name, arch=arch, debug=debug, defines=defines, include_dirs=include_dirs,
                             options=options)
    drv = driver()
    handle = check(drv.cuModuleLoadData(cubin), "cuModuleLoadData")
    load_all_functions(handle)
    return Module(device, handle, cubin)


def load_all_functions(module: Any) -> int:
    """Load every function of ``module`` now (see the module doc: lazy loading can deadlock waiting kernels).

    Returns how many were loaded; 0 where the driver or bindings predate ``cuFuncLoad`` (CUDA < 12.4),
    which also predate lazy loading by default.
    """
    drv = driver()
    if not hasattr(drv, "cuModuleEnumerateFunctions") or not hasattr(drv, "cuFuncLoad"):
        return 0
    count = int(check(drv.cuModuleGetFunctionCount(module), "cuModuleGetFunctionCount"))
    if count == 0:
        return 0
    functions = check(drv.cuModuleEnumerateFunctions(count, module), "cuModuleEnumerateFunctions")
    for function in functions:
        check(drv.cuFuncLoad(function), "cuFuncLoad")
    return count
