"""DevX objects on an imported ConnectX context, through libibverbs and libmlx5 themselves (ctypes).

pyverbs 59 imports a context (``Context(cmd_fd=...)``) as a plain ``Context``, and its DevX classes
(``Mlx5UMEM``, ``Mlx5DevxObj``) register themselves only with an ``Mlx5Context``: on an imported context
they are made and then refused. So the client's IBGDA queues on a domain the daemon exported are made
here, with the C calls pyverbs itself wraps:

==============================  ==========================================================================
``ibv_import_device(fd)``       the domain's context (the daemon opened it with DevX; the import shares
                                its DevX user id, so the PD below serves our QPs); owns ``fd``
``ibv_import_pd(ctx, handle)``  the domain's PD; ``mlx5dv_init_obj(MLX5DV_OBJ_PD)`` gives its number
``mlx5dv_devx_query_eqn``       the EQ for the CQ
``mlx5dv_devx_umem_reg``        send queue, CQ, doorbell records: this process's pinned pages
``mlx5dv_devx_alloc_uar``       the UAR page, mapped into this process (what a daemon-made QP could not give)
``mlx5dv_devx_obj_create``      CREATE_CQ, CREATE_QP (PRM commands from :mod:`ibgda.host_mlx5`); ``_modify``
                                for the QP's state changes, ``_destroy`` on close
==============================  ==========================================================================

The struct layouts used (``mlx5dv_devx_uar``, ``mlx5dv_devx_umem``, ``mlx5dv_obj``, ``mlx5dv_pd``) are
checked against rdma-core's headers by ``tests/ibgda/test_devx.py`` (a probe compiled with the tree's
headers), and every symbol against the built libraries; the calls themselves run only on a ConnectX
(``TPD_IBGDA_DEVICE=mlx5_0 pytest -m hardware tests/ibgda``).
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass
from typing import Any

from ibgda.errors import Mlx5QueueError

__all__ = ["MLX5DV_OBJ_PD", "UAR_ALLOC_TYPE_BF", "UAR_ALLOC_TYPE_NC", "DevxContext", "DevxObj", "DevxUar",
           "DevxUmem", "libraries"]

MLX5DV_OBJ_PD = 1 << 6
UAR_ALLOC_TYPE_BF, UAR_ALLOC_TYPE_NC = 0x0, 0x1  # MLX5_IB_UAPI_UAR_ALLOC_TYPE_{BF,NC}
_P = ctypes.c_void_p


class MlxDevxUar(ctypes.Structure):
    """struct mlx5dv_devx_uar (mlx5dv.h)."""

    _fields_ = [("reg_addr", _P), ("base_addr", _P), ("page_id", ctypes.c_uint32), ("mmap_off", ctypes.c_long),
                ("comp_mask", ctypes.c_uint64)]


class MlxDevxUmem(ctypes.Structure):
    """struct mlx5dv_devx_umem."""

    _fields_ = [("umem_id", ctypes.c_uint32)]


class MlxPd(ctypes.Structure):
    """struct mlx5dv_pd."""

    _fields_ = [("pdn", ctypes.c_uint32), ("comp_mask", ctypes.c_uint64)]


class _InOut(ctypes.Structure):
    _fields_ = [("in_", _P), ("out", _P)]


class MlxObj(ctypes.Structure):
    """struct mlx5dv_obj: eight (in, out) pointer pairs, qp .. devx; only ``pd`` is used."""

    _fields_ = [(name, _InOut) for name in ("qp", "cq", "srq", "rwq", "dm", "ah", "pd", "devx")]


# name -> (restype, argtypes)
SIGNATURES: dict[str, dict[str, tuple[Any, list[Any]]]] = {
    "ibverbs": {
        "ibv_import_device": (_P, [ctypes.c_int]),
        "ibv_import_pd": (_P, [_P, ctypes.c_uint32]),
        "ibv_unimport_pd": (None, [_P]),
        "ibv_close_device": (ctypes.c_int, [_P]),
    },
    "mlx5": {
        "mlx5dv_init_obj": (ctypes.c_int, [ctypes.POINTER(MlxObj), ctypes.c_uint64]),
        "mlx5dv_devx_query_eqn": (ctypes.c_int, [_P, ctypes.c_uint32, ctypes.POINTER(ctypes.c_uint32)]),
        "mlx5dv_devx_umem_reg": (ctypes.POINTER(MlxDevxUmem), [_P, _P, ctypes.c_size_t, ctypes.c_uint32]),
        "mlx5dv_devx_umem_dereg": (ctypes.c_int, [ctypes.POINTER(MlxDevxUmem)]),
        "mlx5dv_devx_alloc_uar": (ctypes.POINTER(MlxDevxUar), [_P, ctypes.c_uint32]),
        "mlx5dv_devx_free_uar": (None, [ctypes.POINTER(MlxDevxUar)]),
        "mlx5dv_devx_obj_create": (_P, [_P, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_char_p, ctypes.c_size_t]),
        "mlx5dv_devx_obj_modify": (ctypes.c_int, [_P, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_char_p,
                                                  ctypes.c_size_t]),
        "mlx5dv_devx_obj_destroy": (ctypes.c_int, [_P]),
    },
}
_SONAMES = {"ibverbs": "libibverbs.so.1", "mlx5": "libmlx5.so.1"}
_libs: dict[str, ctypes.CDLL] = {}


def libraries() -> dict[str, ctypes.CDLL]:
    """libibverbs and libmlx5 (the ones the dynamic linker finds: pyverbs' own where it is on the library
    path), with the signatures above set."""
    if not _libs:
        for key, soname in _SONAMES.items():
            try:
                lib = ctypes.CDLL(soname, use_errno=True)
            except OSError as exc:
                raise Mlx5QueueError(f"{soname} cannot be loaded ({exc}): IBGDA on a ConnectX needs rdma-core's "
                                     "libraries (the ones pyverbs was built with)") from None
            for name, (res, args) in SIGNATURES[key].items():
                fn = getattr(lib, name)
                fn.restype, fn.argtypes = res, args
            _libs[key] = lib
    return _libs


def _fail(what: str) -> Mlx5QueueError:
    code = ctypes.get_errno()
    return Mlx5QueueError(f"{what} failed: {os.strerror(code) if code else 'no reason given'} (errno {code})")


@dataclass
class DevxUmem:
    """A UMEM: pinned pages of this process the NIC reaches by ``umem_id``."""

    ptr: Any
    umem_id: int

    def close(self) -> None:
        if self.ptr:
            libraries()["mlx5"].mlx5dv_devx_umem_dereg(self.ptr)
            self.ptr = None


@dataclass
class DevxUar:
    """A UAR page mapped into this process: ``reg_addr`` is the doorbell register, ``page_id`` its number."""

    ptr: Any
    reg_addr: int
    base_addr: int
    page_id: int

    def close(self) -> None:
        if self.ptr:
            libraries()["mlx5"].mlx5dv_devx_free_uar(self.ptr)
            self.ptr = None


class DevxObj:
    """A DevX object made by a PRM create command: ``out_view`` is the command's output."""

    def __init__(self, ctx: int, cmd: bytes, outlen: int) -> None:
        out = ctypes.create_string_buffer(outlen)
        ptr = libraries()["mlx5"].mlx5dv_devx_obj_create(ctx, cmd, len(cmd), out, outlen)
        self.out_view = memoryview(out.raw)
        if not ptr:
            raise _fail("mlx5dv_devx_obj_create") if not any(out.raw[:8]) else Mlx5QueueError(
                f"mlx5dv_devx_obj_create: status {out.raw[0]:#x}, syndrome {out.raw[4:8].hex()}")
        self.ptr: Any = ptr

    def modify(self, cmd: bytes, outlen: int) -> memoryview:
        out = ctypes.create_string_buffer(outlen)
        if libraries()["mlx5"].mlx5dv_devx_obj_modify(self.ptr, cmd, len(cmd), out, outlen) and not any(out.raw[:8]):
            raise _fail("mlx5dv_devx_obj_modify")
        return memoryview(out.raw)

    def close(self) -> None:
        if self.ptr:
            libraries()["mlx5"].mlx5dv_devx_obj_destroy(self.ptr)
            self.ptr = None


class DevxContext:
    """An imported DevX context and PD (:meth:`imported`), and the DevX objects a queue pair needs."""

    def __init__(self, ctx: int, pd: int, pdn: int) -> None:
        self.ctx, self.pd, self.pdn = ctx, pd, pdn

    @classmethod
    def imported(cls, fd: int, pd_handle: int) -> DevxContext:
        """Import the context behind command descriptor ``fd`` (owned from here on) and its PD ``pd_handle``."""
        libs = libraries()
        ctypes.set_errno(0)
        ctx = libs["ibverbs"].ibv_import_device(fd)
        if not ctx:
            err = _fail(f"ibv_import_device({fd})")
            os.close(fd)
            raise err
        pd = libs["ibverbs"].ibv_import_pd(ctx, pd_handle)
        if not pd:
            err = _fail(f"ibv_import_pd({pd_handle})")
            libs["ibverbs"].ibv_close_device(ctx)
            raise err
        obj, out = MlxObj(), MlxPd()
        obj.pd.in_, obj.pd.out = pd, ctypes.cast(ctypes.pointer(out), _P)
        if libs["mlx5"].mlx5dv_init_obj(ctypes.byref(obj), MLX5DV_OBJ_PD):
            err = _fail("mlx5dv_init_obj(PD)")
            libs["ibverbs"].ibv_unimport_pd(pd)
            libs["ibverbs"].ibv_close_device(ctx)
            raise err
        return cls(ctx, pd, int(out.pdn))

    def query_eqn(self, vector: int = 0) -> int:
        eqn = ctypes.c_uint32()
        if libraries()["mlx5"].mlx5dv_devx_query_eqn(self.ctx, vector, ctypes.byref(eqn)):
            raise _fail("mlx5dv_devx_query_eqn")
        return int(eqn.value)

    def umem(self, addr: int, size: int, access: int) -> DevxUmem:
        ptr = libraries()["mlx5"].mlx5dv_devx_umem_reg(self.ctx, addr, size, access)
        if not ptr:
            raise _fail("mlx5dv_devx_umem_reg")
        return DevxUmem(ptr, int(ptr.contents.umem_id))

    def uar(self, flags: int) -> DevxUar:
        ptr = libraries()["mlx5"].mlx5dv_devx_alloc_uar(self.ctx, flags)
        if not ptr:
            raise _fail("mlx5dv_devx_alloc_uar")
        u = ptr.contents
        return DevxUar(ptr, int(u.reg_addr or 0), int(u.base_addr or 0), int(u.page_id))

    def obj(self, cmd: bytes, outlen: int) -> DevxObj:
        return DevxObj(self.ctx, cmd, outlen)

    def close(self) -> None:
        """Forget the PD (an import is not deallocated) and close the context (its descriptor with it)."""
        libs = libraries()
        if self.pd:
            libs["ibverbs"].ibv_unimport_pd(self.pd)
            self.pd = 0
        if self.ctx:
            libs["ibverbs"].ibv_close_device(self.ctx)
            self.ctx = 0
