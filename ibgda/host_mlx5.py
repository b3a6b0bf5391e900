"""IBGDA on a real ConnectX: the QP, CQ and UAR a GPU drives, created through pyverbs' mlx5 provider (DevX).

Hardware only (tests: ``pytest -m hardware tests/ibgda``; they skip, saying why, without a ConnectX,
pyverbs with the mlx5 provider, or CUDA). What :class:`Mlx5Queue` does, step by step:

1. ``Mlx5Context`` with DevX on the device; a PD and its number (``Mlx5DvObj``); EQ 0 for the CQ.
2. Queue memory (:class:`ibgda.queue_memory.QueueMemory`: SQ, CQ, doorbell-record page, in pinned host
   memory) registered as three UMEMs. The NIC reads WQEs and writes CQEs there over PCIe; the GPU
   reaches it through ``cuMemHostRegister(DEVICEMAP)``.
3. A UAR (``Mlx5UAR``, non-cached: doorbells from the GPU must not sit in a write-combining buffer); its
   register page is mapped into the GPU with ``cuMemHostRegister(IOMEMORY | DEVICEMAP)`` — what
   ``cudaHostRegisterIoMemory`` does — and its ``reg_addr`` is the doorbell the GPU writes 8 bytes to.
4. CREATE_CQ (64-byte CQEs, doorbell record at +64 of the record page) and CREATE_QP (RC, zero-length
   receive queue, ``wqe_cnt`` WQEBBs at the start of the SQ UMEM, doorbell record at +0, that CQ for
   both directions). PRM commands are encoded here (:func:`prm_encode`) from the field tables below.
5. RST2INIT, INIT2RTR, RTR2RTS against the peer's endpoint (the ib backend's endpoint format, so the
   peer may be an ib-backend connection or another Mlx5Queue). InfiniBand: LID, with a GRH when the
   peer's GID is routable. RoCE additionally needs the peer's MAC (``remote["rmac"]``).
6. :meth:`Mlx5Queue.queue_pair` returns the QueuePair record with GPU addresses; hand it to
   :func:`ibgda.channel_tables.build_channel` with ``cuda_alloc()`` to get the ``tpd::IbgdaChannel``.

PRM field tables: (bit offset, width) from the start of each command or context, bit 0 being the most
significant bit of byte 0 (PRM's big-endian bit numbering). Only the fields this module sets appear.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping
from typing import Any

import numpy as np

from ibgda.device_handle import queue_pair_record
from ibgda.errors import Mlx5QueueError
from ibgda.queue_memory import CQ_DBREC_OFFSET, PAGE, QueueMemory

__all__ = [
    "CQC", "CREATE_CQ_IN", "CREATE_QP_IN", "MODIFY_QP_IN", "Mlx5Queue", "QPC", "cuda_alloc",
    "cuda_map_host", "prm_encode", "prm_get",
]

OP_CREATE_CQ, OP_CREATE_QP, OP_RST2INIT, OP_INIT2RTR, OP_RTR2RTS = 0x400, 0x500, 0x502, 0x503, 0x504
CMD_BYTES, OUT_BYTES = 272, 16
CQC_BIT, QPC_BIT = 128, 192  # where the context sits in create_cq_in / create_qp_in and the modify commands
QPC_ST_RC, PM_STATE_MIGRATED, RQ_TYPE_ZERO_LEN, ATOMIC_MODE_UP_TO_64B, TS_FORMAT_DEFAULT = 0, 3, 3, 3, 1

CREATE_CQ_IN = {"opcode": (0, 16), "cq_umem_offset": (640, 64), "cq_umem_id": (704, 32), "cq_umem_valid": (736, 1)}
CQC = {"dbr_umem_valid": (6, 1), "cqe_sz": (8, 3), "cc": (11, 1), "oi": (14, 1), "dbr_umem_id": (32, 32),
       "log_cq_size": (99, 5), "uar_page": (104, 24), "c_eqn": (184, 8), "log_page_size": (195, 5),
       "dbr_addr": (448, 64)}
CREATE_QP_IN = {"opcode": (0, 16), "opt_param_mask": (128, 32), "wq_umem_offset": (2048, 64),
                "wq_umem_id": (2112, 32), "wq_umem_valid": (2144, 1)}
MODIFY_QP_IN = {"opcode": (0, 16), "qpn": (72, 24), "opt_param_mask": (128, 32)}
QPC = {
    "st": (8, 8), "pm_state": (19, 2), "pd": (40, 24), "mtu": (64, 3), "log_msg_max": (67, 5),
    "log_rq_size": (73, 4), "log_rq_stride": (77, 3), "no_sq": (80, 1), "log_sq_size": (81, 4),
    "ts_format": (88, 2), "counter_set_id": (96, 8), "uar_page": (104, 24), "log_page_size": (163, 5),
    "remote_qpn": (168, 24),
    # primary address path (struct ads at qpc bit 192)
    "ads.pkey_index": (208, 16), "ads.grh": (232, 1), "ads.mlid": (233, 7), "ads.rlid": (240, 16),
    "ads.ack_timeout": (256, 5), "ads.src_addr_index": (264, 8), "ads.hop_limit": (280, 8),
    "ads.tclass": (292, 8), "ads.flow_label": (300, 20), "ads.rgid_rip": (320, 128), "ads.udp_sport": (464, 16),
    "ads.sl": (484, 4), "ads.vhca_port_num": (488, 8), "ads.rmac": (496, 48),
    "log_ack_req_freq": (896, 4), "log_sra_max": (904, 3), "retry_count": (909, 3), "rnr_retry": (912, 3),
    "next_send_psn": (968, 24), "cqn_snd": (1000, 24), "log_rra_max": (1160, 3), "atomic_mode": (1164, 4),
    "rre": (1168, 1), "rwe": (1169, 1), "rae": (1170, 1), "min_rnr_nak": (1187, 5), "next_rcv_psn": (1192, 24),
    "cqn_rcv": (1256, 24), "dbr_addr": (1280, 64), "rq_type": (1381, 3), "dbr_umem_valid": (1667, 1),
    "dbr_umem_id": (1824, 32),
}
QPC_BITS = 1856
OUT = {"status": (0, 8), "syndrome": (32, 32), "id": (72, 24)}  # id: the CQN or QPN a create returns


def prm_set(buf: bytearray, bit: int, width: int, value: int) -> None:
    """Store ``value`` in the big-endian bit field [bit, bit + width) of ``buf``."""
    if value < 0 or value >> width:
        raise ValueError(f"{value:#x} does not fit {width} bits")
    total = len(buf) * 8
    whole = int.from_bytes(buf, "big")
    shift = total - bit - width
    whole = (whole & ~(((1 << width) - 1) << shift)) | (value << shift)
    buf[:] = whole.to_bytes(len(buf), "big")


def prm_get(buf: bytes | bytearray | memoryview, bit: int, width: int) -> int:
    """Read the big-endian bit field [bit, bit + width) of ``buf``."""
    data = bytes(buf)
    return (int.from_bytes(data, "big") >> (len(data) * 8 - bit - width)) & ((1 << width) - 1)


def prm_encode(nbytes: int, values: Mapping[str, int], *tables: tuple[int, Mapping[str, tuple[int, int]]]) -> bytes:
    """A PRM command of ``nbytes``: each ``values`` key is looked up in the (base bit, table) pairs given."""
    buf = bytearray(nbytes)
    for name, value in values.items():
        for base, table in tables:
            if name in table:
                bit, width = table[name]
                prm_set(buf, base + bit, width, int(value))
                break
        else:
            raise KeyError(f"no PRM field {name!r} in the tables given")
    return bytes(buf)


def _check_out(what: str, out: bytes | memoryview) -> int:
    status, syndrome = prm_get(out, *OUT["status"]), prm_get(out, *OUT["syndrome"])
    if status:
        raise Mlx5QueueError(f"{what}: status {status:#x}, syndrome {syndrome:#010x}")
    return prm_get(out, *OUT["id"])


# --- CUDA --------------------------------------------------------------------------------------------
def _driver() -> Any:
    try:
        from cuda.bindings import driver
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise Mlx5QueueError("cuda-python is needed to map IBGDA queues into the GPU (pip install "
                             "'transportd[cuda]')") from exc
    return driver


def _cu(what: str, result: tuple) -> Any:
    err, *rest = result
    if int(err) != 0:
        raise Mlx5QueueError(f"{what} failed: {err!r}")
    return rest[0] if len(rest) == 1 else rest


def cuda_map_host(addr: int, nbytes: int, *, io: bool = False) -> int:
    """Register host memory for the GPU (``io``: a device's MMIO page, cudaHostRegisterIoMemory) and
    return the device address of ``addr``. The current CUDA context must be the kernel's."""
    drv = _driver()
    start, end = addr // PAGE * PAGE, -(-(addr + nbytes) // PAGE) * PAGE
    flags = drv.CU_MEMHOSTREGISTER_DEVICEMAP | drv.CU_MEMHOSTREGISTER_PORTABLE
    if io:
        flags |= drv.CU_MEMHOSTREGISTER_IOMEMORY
    _cu("cuMemHostRegister", drv.cuMemHostRegister(start, end - start, flags))
    dev = int(_cu("cuMemHostGetDevicePointer", drv.cuMemHostGetDevicePointer(start, 0)))
    return dev + (addr - start)


def cuda_alloc(keep: list[Any]) -> Any:
    """An ``Alloc`` for :func:`ibgda.channel_tables.build_channel`: GPU memory, filled by a copy."""
    drv = _driver()

    def alloc(image: bytes) -> int:
        ptr = _cu("cuMemAlloc", drv.cuMemAlloc(max(len(image), 8)))
        keep.append(ptr)
        _cu("cuMemcpyHtoD", drv.cuMemcpyHtoD(ptr, image, len(image)))
        return int(ptr)

    return alloc


# --- the queue ---------------------------------------------------------------------------------------
class Mlx5Queue:
    """One RC QP on a ConnectX whose send queue the GPU drives (see the module docstring).

    ``device``: mlx5 device name, opened here (a DevX context and a PD of the queue's own, through pyverbs);
    or ``devx``: an imported context and PD (:class:`ibgda.devx.DevxContext`: a daemon's IBGDA domain,
    which owns them) with ``port_info`` (``lid``, ``gid``, ``mtu``: the port as the daemon saw it).
    ``wqe_cnt``: send-queue WQEBBs (a power of two; the CQ gets as many CQEs). ``map_to_gpu``: register the
    queue memory and the UAR with CUDA (off: for host-side tests, or where the caller maps :meth:`spans`).
    ``ts_format``: the QP's timestamp format (1, the device default; 0 free-running, 2 real time where a
    device accepts only those).
    """

    def __init__(self, device: str | None = None, *, port: int = 1, gid_index: int = 0, wqe_cnt: int = 256,
                 map_to_gpu: bool = True, ts_format: int = TS_FORMAT_DEFAULT, devx: Any = None,
                 port_info: Mapping[str, Any] | None = None) -> None:
        self.port, self.gid_index, self.wqe_cnt, self.ts_format = port, gid_index, wqe_cnt, ts_format
        self._objs: list[Any] = []
        self._mrs: list[Any] = []
        self._registered: list[int] = []
        self.ctx: Any = None
        self.pd: Any = None
        self.uar: Any = None
        self.devx = devx
        try:
            if devx is None:
                if device is None:
                    raise Mlx5QueueError("Mlx5Queue needs a device name or an imported DevX context")
                self._open(device)
            else:
                if port_info is None:
                    raise Mlx5QueueError("an Mlx5Queue on an imported context needs port_info (lid, gid, mtu)")
                self.lid, self.gid_text, self.mtu = int(port_info["lid"]), str(port_info["gid"]), int(port_info["mtu"])
                self.pdn, self.eqn = devx.pdn, devx.query_eqn(0)
            self.mem = QueueMemory(wqe_cnt, wqe_cnt)
            m = self.mem
            access = 1  # IBV_ACCESS_LOCAL_WRITE: the NIC writes CQEs and reads WQEs
            self.sq_umem = self._umem(m.base, m.sq_bytes, access)
            self.cq_umem = self._umem(m.base + m.cq_offset, m.cq_bytes, access)
            self.db_umem = self._umem(m.base + m.dbrec_offset, PAGE, access)
            self._objs += [self.db_umem, self.cq_umem, self.sq_umem]
            self.uar = self._uar()
            self.cqn = self._create_cq()
            self.qpn = self._create_qp()
            self.psn = random.getrandbits(24)
            self.gpu: dict[str, int] | None = self._map_to_gpu() if map_to_gpu else None
        except BaseException:
            self.close()
            raise

    def _open(self, device: str) -> None:
        """A DevX context and a PD of this queue's own (pyverbs' mlx5 provider)."""
        from pyverbs.pd import PD
        from pyverbs.providers.mlx5 import mlx5_enums as dve
        from pyverbs.providers.mlx5.mlx5dv import Mlx5Context, Mlx5DVContextAttr
        from pyverbs.providers.mlx5.mlx5dv_objects import Mlx5DvObj

        self.ctx = Mlx5Context(Mlx5DVContextAttr(dve.mlx5dv_context_attr_flags.MLX5DV_CONTEXT_FLAGS_DEVX), device)
        self.port_attr = self.ctx.query_port(self.port)
        self.gid = self.ctx.query_gid(self.port, self.gid_index)
        self.lid, self.gid_text, self.mtu = int(self.port_attr.lid), str(self.gid.gid), int(self.port_attr.active_mtu)
        self.pd = PD(self.ctx)
        self.pdn = Mlx5DvObj(dve.mlx5dv_obj_type.MLX5DV_OBJ_PD, pd=self.pd).dvpd.pdn
        self.eqn = self.ctx.devx_query_eqn(0)

    def _umem(self, addr: int, size: int, access: int) -> Any:
        if self.devx is not None:
            return self.devx.umem(addr, size, access)
        from pyverbs.providers.mlx5.mlx5dv import Mlx5UMEM

        return Mlx5UMEM(self.ctx, size, addr=addr, access=access)

    def _uar(self) -> Any:
        """Non-cached first (what a GPU needs); BlueFlame (write-combining) where NC is not offered."""
        if self.devx is not None:
            from ibgda.devx import UAR_ALLOC_TYPE_BF, UAR_ALLOC_TYPE_NC

            try:
                return self.devx.uar(UAR_ALLOC_TYPE_NC)
            except Mlx5QueueError:
                return self.devx.uar(UAR_ALLOC_TYPE_BF)
        from pyverbs.providers.mlx5 import mlx5_enums as dve
        from pyverbs.providers.mlx5.mlx5dv import Mlx5UAR

        try:
            return Mlx5UAR(self.ctx, dve._MLX5DV_UAR_ALLOC_TYPE_NC)
        except Exception:
            return Mlx5UAR(self.ctx, dve._MLX5DV_UAR_ALLOC_TYPE_BF)

    def _obj(self, cmd: bytes) -> Any:
        if self.devx is not None:
            return self.devx.obj(cmd, OUT_BYTES)
        from pyverbs.providers.mlx5.mlx5dv import Mlx5DevxObj

        return Mlx5DevxObj(self.ctx, cmd, OUT_BYTES)

    def _create_cq(self) -> int:
        cmd = prm_encode(CMD_BYTES, {
            "opcode": OP_CREATE_CQ, "cq_umem_id": self.cq_umem.umem_id, "cq_umem_valid": 1,
            "dbr_umem_valid": 1, "dbr_umem_id": self.db_umem.umem_id, "dbr_addr": CQ_DBREC_OFFSET,
            "cqe_sz": 0, "log_cq_size": int(math.log2(self.mem.ncqes)), "uar_page": self.uar.page_id,
            "c_eqn": self.eqn, "log_page_size": int(math.log2(PAGE)) - 12,
        }, (0, CREATE_CQ_IN), (CQC_BIT, CQC))
        self.cq_obj = self._obj(cmd)
        self._objs.insert(0, self.cq_obj)
        return _check_out("CREATE_CQ", self.cq_obj.out_view)

    def _create_qp(self) -> int:
        cmd = prm_encode(CMD_BYTES, {
            "opcode": OP_CREATE_QP, "wq_umem_id": self.sq_umem.umem_id, "wq_umem_valid": 1,
            "st": QPC_ST_RC, "pm_state": PM_STATE_MIGRATED, "pd": self.pdn, "uar_page": self.uar.page_id,
            "rq_type": RQ_TYPE_ZERO_LEN, "log_rq_size": 0, "log_sq_size": int(math.log2(self.wqe_cnt)),
            "cqn_snd": self.cqn, "cqn_rcv": self.cqn, "ts_format": self.ts_format,
            "dbr_umem_valid": 1, "dbr_umem_id": self.db_umem.umem_id, "dbr_addr": 0,
            "log_page_size": int(math.log2(PAGE)) - 12,
        }, (0, CREATE_QP_IN), (QPC_BIT, QPC))
        self.qp_obj = self._obj(cmd)
        self._objs.insert(0, self.qp_obj)
        return _check_out("CREATE_QP", self.qp_obj.out_view)

    def _modify(self, what: str, opcode: int, values: Mapping[str, int]) -> None:
        cmd = prm_encode(CMD_BYTES, {"opcode": opcode, "qpn": self.qpn, **values}, (0, MODIFY_QP_IN), (QPC_BIT, QPC))
        _check_out(what, self.qp_obj.modify(cmd, OUT_BYTES))

    def _map_to_gpu(self) -> dict[str, int]:
        m = self.mem
        dev = cuda_map_host(m.base, m.nbytes)
        self._registered.append(m.base)
        out = {name: dev + (addr - m.base) for name, addr in m.addresses().items()}
        bf = int(self.uar.reg_addr)
        out["bf"] = cuda_map_host(bf, 8, io=True)
        self._registered.append(bf // PAGE * PAGE)
        return out

    # --- connection ----------------------------------------------------------------------------------
    def endpoint(self) -> dict[str, Any]:
        """What the peer needs (the ib backend's endpoint format)."""
        return {"transport": "ib", "qpn": self.qpn, "psn": self.psn, "lid": self.lid, "gid": self.gid_text,
                "port": self.port, "mtu": self.mtu, "max_dest_rd_atomic": 16}

    def connect(self, remote: Mapping[str, Any], *, max_rd_atomic: int = 16, timeout: int = 14, retry_cnt: int = 7,
                rnr_retry: int = 7, sl: int = 0) -> None:
        """RST -> INIT -> RTR -> RTS against ``remote`` (an endpoint dict)."""
        port = {"ads.vhca_port_num": self.port, "ads.pkey_index": 0}
        self._modify("RST2INIT_QP", OP_RST2INIT, {
            **port, "pm_state": PM_STATE_MIGRATED, "rre": 1, "rwe": 1, "rae": 1,
            "atomic_mode": ATOMIC_MODE_UP_TO_64B})
        rtr = {**port, "mtu": min(self.mtu, int(remote["mtu"])), "log_msg_max": 30,
               "remote_qpn": int(remote["qpn"]), "next_rcv_psn": int(remote["psn"]), "min_rnr_nak": 12,
               "log_rra_max": int(math.log2(16)),  # responder resources we grant (endpoint's max_dest_rd_atomic)
               "ads.rlid": int(remote.get("lid", 0)), "ads.sl": sl}
        gid = str(remote.get("gid", ""))
        if gid and any(ch not in "0:" for ch in gid):
            rtr.update({"ads.grh": 1, "ads.rgid_rip": int(gid.replace(":", ""), 16), "ads.hop_limit": 64,
                        "ads.src_addr_index": self.gid_index})
        if "rmac" in remote:
            rtr["ads.rmac"] = int(str(remote["rmac"]).replace(":", ""), 16)
            rtr["ads.udp_sport"] = 0xC000 | (self.qpn & 0x3FFF)
        self._modify("INIT2RTR_QP", OP_INIT2RTR, rtr)
        self._modify("RTR2RTS_QP", OP_RTR2RTS, {
            "next_send_psn": self.psn, "retry_count": retry_cnt, "rnr_retry": rnr_retry, "ads.ack_timeout": timeout,
            "log_sra_max": int(math.log2(max(1, min(max_rd_atomic, int(remote.get("max_dest_rd_atomic", 1)))))),
            "log_ack_req_freq": 0})

    def queue_pair(self, scratch: int, scratch_lkey: int, *, for_gpu: bool = True) -> np.ndarray:
        """The QueuePair record (state is filled in by build_channel): GPU addresses, or with ``for_gpu``
        off the host's own (the CPU may drive the QP too: the hardware tests run the device code on the
        host against the real NIC, ringing the UAR from the CPU)."""
        if for_gpu and self.gpu is None:
            raise Mlx5QueueError("the queue was created with map_to_gpu=False")
        addrs = self.gpu if for_gpu else self.addresses()
        return queue_pair_record(addrs or {}, qpn=self.qpn, wqe_cnt=self.wqe_cnt, ncqes=self.mem.ncqes,
                                 scratch=scratch, scratch_lkey=scratch_lkey)

    def addresses(self) -> dict[str, int]:
        """Host addresses of the queue's parts and of the doorbell register (``bf``, in the UAR page)."""
        return {**self.mem.addresses(), "bf": int(self.uar.reg_addr)}

    def spans(self) -> list[tuple[int, int, bool]]:
        """What a GPU must map to post here: (host address, bytes, is I/O memory): the queue memory, and the
        UAR page (``cudaHostRegisterIoMemory``)."""
        bf = int(self.uar.reg_addr)
        return [(self.mem.base, self.mem.nbytes, False), (bf // PAGE * PAGE, PAGE, True)]

    def register(self, addr: int, length: int, access: int) -> Any:
        """A memory region on this queue's PD (host memory; GPU memory through DmaBufMR, not here). A queue on
        an imported context registers nothing: its domain's MRs serve it."""
        from pyverbs.mr import MR

        if self.pd is None:
            raise Mlx5QueueError("this queue is on an imported domain: use the domain's MRs")
        mr = MR(self.pd, length, access, address=addr)
        self._mrs.append(mr)
        return mr

    def close(self) -> None:
        """MRs, then DevX objects in reverse order of creation (QP, CQ, UMEMs), the UAR, the PD, the
        context (none of those two on an imported domain: it owns them); the CUDA registrations last."""
        for obj in [*getattr(self, "_mrs", []), *getattr(self, "_objs", []), getattr(self, "uar", None),
                    getattr(self, "pd", None), getattr(self, "ctx", None)]:
            if obj is not None:
                obj.close()
        self._mrs, self._objs = [], []
        self.uar = self.pd = self.ctx = None
        if getattr(self, "_registered", None):
            drv = _driver()
            for start in self._registered:
                drv.cuMemHostUnregister(start)
            self._registered = []

    def __enter__(self) -> Mlx5Queue:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
