"""GPU memory for the client: find a CUDA buffer's allocation, export it by IPC handle, map host memory.

cuda-python (``cuda.bindings.driver``) is imported on first use only, so CPU-only clients never need it.
Buffers are recognised by ``__cuda_array_interface__`` (CuPy, PyTorch, Numba) or DLPack (a CUDA
``__dlpack_device__``); neither CuPy nor PyTorch is imported here.

* :func:`resolve_device_buffer` -> pointer, size and device of a contiguous GPU buffer;
* :func:`export_ipc` -> the allocation's ``CUipcMemHandle`` (from ``cuMemGetAddressRange``'s base) and the
  buffer's offset in it: what ``Register(kind="cuda_ipc")`` carries to the daemon;
* :class:`DeviceMemory` -> a plain ``cuMemAlloc`` allocation (device flags, a channel's head/credit words);
* :func:`map_host` -> ``cuMemHostRegister(DEVICEMAP)`` of host memory (a ring file, a flag file), giving
  the device address a kernel uses.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any

from cmd_ring.errors import CudaError
from transportd.cuda_driver import check, driver, result_name, use_device

__all__ = [
    "DeviceBuffer",
    "DeviceMemory",
    "IpcExport",
    "check",
    "driver",
    "export_ipc",
    "is_device_buffer",
    "map_host",
    "resolve_device_buffer",
    "use_device",
]

IPC_HANDLE_BYTES = 64
_KDL_CUDA = 2  # DLPack device types: kDLCUDA = 2 (kDLCUDAHost = 3 and kDLCUDAManaged = 13 are refused)


def compute_capability(device: int) -> tuple[int, int]:
    drv = driver()
    dev = check(drv.cuDeviceGet(device), f"cuDeviceGet({device})")
    attr = drv.CUdevice_attribute
    major = check(drv.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev))
    minor = check(drv.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev))
    return int(major), int(minor)


# --- recognising GPU buffers ------------------------------------------------------------------------------


@dataclass(frozen=True)
class DeviceBuffer:
    """A contiguous range of GPU memory: ``ptr`` (device address), ``nbytes``, the ``device`` ordinal."""

    ptr: int
    nbytes: int
    device: int
    owner: object  # keeps the array (and so the memory) alive while the region is registered


def is_device_buffer(obj: object) -> bool:
    """True for CUDA arrays (``__cuda_array_interface__`` or a CUDA DLPack device); imports no CUDA."""
    if hasattr(obj, "__cuda_array_interface__"):
        return True
    dl_device = getattr(obj, "__dlpack_device__", None)
    if dl_device is None:
        return False
    try:
        return int(dl_device()[0]) == _KDL_CUDA
    except Exception:  # noqa: BLE001 - an object whose __dlpack_device__ fails is simply not a GPU buffer
        return False


def _c_contiguous(shape: tuple[int, ...], strides: tuple[int, ...] | None, itemsize: int) -> bool:
    if strides is None:
        return True
    expected = itemsize
    for dim, stride in zip(reversed(shape), reversed(strides), strict=True):
        if dim != 1 and stride != expected:
            return False
        expected *= dim
    return True


def _from_cai(obj: Any) -> tuple[int, int]:
    cai = obj.__cuda_array_interface__
    shape = tuple(int(s) for s in cai["shape"])
    itemsize = int(cai["typestr"][2:])
    if not _c_contiguous(shape, cai.get("strides"), itemsize):
        raise ValueError("register a contiguous GPU buffer (this one is strided)")
    count = 1
    for s in shape:
        count *= s
    return int(cai["data"][0]), count * itemsize


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int), ("device_id", ctypes.c_int)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int), ("dtype", _DLDataType),
                ("shape", ctypes.POINTER(ctypes.c_int64)), ("strides", ctypes.POINTER(ctypes.c_int64)),
                ("byte_offset", ctypes.c_uint64)]


def _from_dlpack(obj: Any) -> tuple[int, int]:
    """Peek at an (unversioned) DLPack capsule without consuming it: its deleter still runs."""
    capsule = obj.__dlpack__()
    get = ctypes.pythonapi.PyCapsule_GetPointer
    get.restype, get.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
    tensor = _DLTensor.from_address(get(capsule, b"dltensor"))
    if tensor.device.device_type != _KDL_CUDA:
        raise ValueError(f"DLPack device type {tensor.device.device_type} is not CUDA device memory")
    shape = tuple(tensor.shape[i] for i in range(tensor.ndim))
    itemsize = (tensor.dtype.bits * tensor.dtype.lanes + 7) // 8
    strides = None if not tensor.strides else tuple(tensor.strides[i] * itemsize for i in range(tensor.ndim))
    if not _c_contiguous(shape, strides, itemsize):
        raise ValueError("register a contiguous GPU buffer (this one is strided)")
    count = 1
    for s in shape:
        count *= s
    ptr = (tensor.data or 0) + int(tensor.byte_offset)
    del tensor, capsule
    return ptr, count * itemsize


def pointer_device(ptr: int) -> int:
    """The device ordinal that owns device address ``ptr``."""
    drv = driver()
    attr = drv.CUpointer_attribute.CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL
    return int(check(drv.cuPointerGetAttribute(attr, ptr), "cuPointerGetAttribute(DEVICE_ORDINAL)"))


def resolve_device_buffer(obj: object) -> DeviceBuffer:
    """Pointer, size and device of a contiguous CUDA array (CuPy, PyTorch, Numba, any DLPack producer)."""
    if hasattr(obj, "__cuda_array_interface__"):
        ptr, nbytes = _from_cai(obj)
    elif is_device_buffer(obj):
        ptr, nbytes = _from_dlpack(obj)
    else:
        raise TypeError(f"{type(obj).__name__} is not a CUDA array (no __cuda_array_interface__ or CUDA DLPack)")
    if nbytes == 0 or ptr == 0:
        raise ValueError("cannot register an empty GPU buffer")
    return DeviceBuffer(ptr, nbytes, pointer_device(ptr), obj)


# --- IPC export ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class IpcExport:
    """What the daemon needs to open a GPU buffer: the allocation's IPC handle and the buffer's place in it."""

    handle: bytes  # 64 bytes of CUipcMemHandle
    offset: int  # buffer start - allocation base
    nbytes: int
    address: int  # the buffer's device address in this process (for reports)
    device: int
    alloc_base: int
    alloc_size: int


def export_ipc(buffer: DeviceBuffer) -> IpcExport:
    """Resolve ``buffer``'s allocation (cuMemGetAddressRange) and export it (cuIpcGetMemHandle).

    IPC works for cudaMalloc/cuMemAlloc memory (CuPy's and PyTorch's default allocators); memory from a
    stream-ordered pool or cuMemCreate is refused by the driver, and the error says so.
    """
    drv = driver()
    use_device(buffer.device)
    base, size = check(drv.cuMemGetAddressRange(buffer.ptr), "cuMemGetAddressRange")
    base, size = int(base), int(size)
    try:
        handle = check(drv.cuIpcGetMemHandle(base), "cuIpcGetMemHandle")
    except CudaError as exc:
        raise CudaError(exc.call, f"{exc.result} (IPC needs memory from cudaMalloc/cuMemAlloc: allocate the "
                                  "buffer with CuPy's or PyTorch's default allocator, not a stream-ordered pool)"
                        ) from None
    raw = bytes(handle.reserved)
    if len(raw) != IPC_HANDLE_BYTES:
        raise CudaError("cuIpcGetMemHandle", f"unexpected handle size {len(raw)}")
    return IpcExport(raw, buffer.ptr - base, buffer.nbytes, buffer.ptr, buffer.device, base, size)


# --- plain allocations and host mappings ---------------------------------------------------------------------


class DeviceMemory:
    """``nbytes`` of zeroed device memory from cuMemAlloc (exportable by IPC); freed by :meth:`free`."""

    def __init__(self, nbytes: int, device: int) -> None:
        drv = driver()
        self.device = device
        self.nbytes = nbytes
        use_device(device)
        self.ptr = int(check(drv.cuMemAlloc(nbytes), f"cuMemAlloc({nbytes})"))
        check(drv.cuMemsetD8(self.ptr, 0, nbytes), "cuMemsetD8")
        # the default allocator hands out memory at >= 256-byte alignment; flags and counters need 8

    def buffer(self) -> DeviceBuffer:
        return DeviceBuffer(self.ptr, self.nbytes, self.device, self)

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        """The allocation as a flat uint8 CUDA array, so ``session.register`` takes it directly."""
        return {"shape": (self.nbytes,), "typestr": "|u1", "data": (self.ptr, False), "version": 3, "strides": None}

    def read(self, offset: int, nbytes: int) -> bytes:
        """Copy ``nbytes`` at ``offset`` to the host (synchronous)."""
        drv = driver()
        use_device(self.device)
        out = bytearray(nbytes)
        check(drv.cuMemcpyDtoH(out, self.ptr + offset, nbytes), "cuMemcpyDtoH")
        return bytes(out)

    def write(self, offset: int, data: bytes) -> None:
        drv = driver()
        use_device(self.device)
        check(drv.cuMemcpyHtoD(self.ptr + offset, data, len(data)), "cuMemcpyHtoD")
        check(drv.cuCtxSynchronize(), "cuCtxSynchronize")

    def free(self) -> None:
        if self.ptr:
            drv = driver()
            use_device(self.device)
            check(drv.cuMemFree(self.ptr), "cuMemFree")
            self.ptr = 0


@dataclass
class HostMapping:
    """Host memory registered with CUDA: ``device_ptr`` is what a kernel dereferences."""

    address: int
    nbytes: int
    device_ptr: int
    device: int
    owned: bool  # False when someone else had registered the range already

    def unmap(self) -> None:
        if self.owned and self.address:
            drv = driver()
            use_device(self.device)
            check(drv.cuMemHostUnregister(self.address), "cuMemHostUnregister")
            self.owned = False


def map_host(address: int, nbytes: int, device: int, *, io: bool = False) -> HostMapping:
    """Register page-aligned host memory with CUDA (DEVICEMAP | PORTABLE) and return its device address;
    ``io``: a device's MMIO page (IOMEMORY: what ``cudaHostRegisterIoMemory`` does, for a NIC's UAR)."""
    drv = driver()
    use_device(device)
    flags = drv.CU_MEMHOSTREGISTER_DEVICEMAP | drv.CU_MEMHOSTREGISTER_PORTABLE
    if io:
        flags |= drv.CU_MEMHOSTREGISTER_IOMEMORY
    (err,) = drv.cuMemHostRegister(address, nbytes, flags)
    owned = err == drv.CUresult.CUDA_SUCCESS
    if not owned and err != drv.CUresult.CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED:
        raise CudaError(f"cuMemHostRegister({address:#x}, {nbytes})", result_name(err))
    device_ptr = int(check(drv.cuMemHostGetDevicePointer(address, 0), "cuMemHostGetDevicePointer"))
    return HostMapping(address, nbytes, device_ptr, device, owned)
