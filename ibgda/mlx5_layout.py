"""The mlx5 send-WQE segments and CQE64, as numpy dtypes with their byte order stated; a strict decoder.

Twin of ``include/transportd/ibgda/segments.cuh`` and ``cqe.cuh`` (themselves following rdma-core's
``providers/mlx5/mlx5dv.h``). Every multi-byte field is **big-endian** ('>' in the dtypes); the one
exception is the payload of an inline segment, which is raw bytes copied to remote memory as they are
(a flag value is a little-endian u64 there). Offsets are from the start of each segment.

``decode_wqe`` is strict the way a ConnectX is: it refuses what the NIC would complete with an error
CQE, raising :class:`ibgda.errors.WqeFormatError` with the syndrome (the soft NIC in :mod:`ibgda.soft_mlx5`
uses it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum

import numpy as np

from ibgda.errors import Syndrome, WqeFormatError  # Syndrome stays in __all__: the error CQE carries it

__all__ = [
    "ATOMIC_SEG_DTYPE", "CQE64_DTYPE", "CQE_INITIAL_OP_OWN", "CQ_SET_CI", "CTRL_CQ_UPDATE", "CTRL_FENCE",
    "CTRL_SEG_DTYPE", "CTRL_SMALL_FENCE", "CTRL_SOLICITED", "CqeOpcode", "DATA_SEG_DTYPE", "DecodedCqe",
    "DecodedWqe", "ERR_CQE_DTYPE", "INLINE_SEG", "MAX_MESSAGE", "Opcode", "RADDR_SEG_DTYPE", "SND_DBR",
    "Syndrome", "WQE_BB", "cq_dbrec_value", "cqe_ready", "decode_cqe", "decode_wqe",
    "encode_cqe", "encode_err_cqe", "sq_dbrec_value", "wqe_basic_blocks",
]

WQE_BB = 64                 # MLX5_SEND_WQE_BB
INLINE_SEG = 0x80000000     # MLX5_INLINE_SEG, in an inline segment's byte_count
SND_DBR = 1                 # MLX5_SND_DBR: the send counter's be32 word in the QP doorbell record
CQ_SET_CI = 0               # MLX5_CQ_SET_CI: the consumer index's be32 word in the CQ doorbell record
CQE_INITIAL_OP_OWN = 0xF0   # MLX5_CQE_INVALID << 4: every CQE before the NIC's first write
MAX_MESSAGE = (1 << 31) - 1  # the largest byte_count a data segment can say (0 means 2^31)

# fm_ce_se (control segment byte 11)
CTRL_FENCE = 4 << 5         # MLX5_WQE_CTRL_FENCE (IBV_SEND_FENCE)
CTRL_SMALL_FENCE = 1 << 5   # MLX5_WQE_CTRL_INITIATOR_SMALL_FENCE
CTRL_CQ_UPDATE = 2 << 2     # MLX5_WQE_CTRL_CQ_UPDATE (IBV_SEND_SIGNALED)
CTRL_SOLICITED = 1 << 1     # MLX5_WQE_CTRL_SOLICITED


class Opcode(IntEnum):
    """mlx5 send opcodes (MLX5_OPCODE_*)."""

    NOP = 0x00
    RDMA_WRITE = 0x08
    RDMA_WRITE_IMM = 0x09
    SEND = 0x0A
    RDMA_READ = 0x10
    ATOMIC_CS = 0x11
    ATOMIC_FA = 0x12


class CqeOpcode(IntEnum):
    """CQE opcodes (MLX5_CQE_*), op_own's high nibble."""

    REQ = 0
    RESP_WR_IMM = 1
    RESP_SEND = 2
    REQ_ERR = 13
    RESP_ERR = 14
    INVALID = 15


# Control segment (struct mlx5_wqe_ctrl_seg), 16 bytes. opmod_idx_opcode is one be32 (opmod << 24 |
# wqe_index << 8 | opcode): its bytes are opmod, wqe_index (be16), opcode. qpn_ds is one be32 (qpn << 8 |
# ds), ds in the low 6 bits.
CTRL_SEG_DTYPE = np.dtype({
    "names": ["opmod", "wqe_index", "opcode", "qpn_ds", "signature", "stream_id", "fm_ce_se", "imm"],
    "formats": ["u1", ">u2", "u1", ">u4", "u1", ">u2", "u1", ">u4"],
    "offsets": [0, 1, 3, 4, 8, 9, 11, 12],
    "itemsize": 16,
})
# Remote-address segment (struct mlx5_wqe_raddr_seg), 16 bytes.
RADDR_SEG_DTYPE = np.dtype({"names": ["raddr", "rkey", "reserved"], "formats": [">u8", ">u4", ">u4"],
                            "offsets": [0, 8, 12], "itemsize": 16})
# Data segment (struct mlx5_wqe_data_seg), 16 bytes; byte_count 0 means 2^31 bytes.
DATA_SEG_DTYPE = np.dtype({"names": ["byte_count", "lkey", "addr"], "formats": [">u4", ">u4", ">u8"],
                           "offsets": [0, 4, 8], "itemsize": 16})
# Inline segment header (struct mlx5_wqe_inl_data_seg): byte_count | INLINE_SEG, then the raw bytes,
# padded to a 16-byte unit.
INLINE_SEG_DTYPE = np.dtype({"names": ["byte_count"], "formats": [">u4"], "offsets": [0], "itemsize": 4})
# Atomic segment (struct mlx5_wqe_atomic_seg), 16 bytes.
ATOMIC_SEG_DTYPE = np.dtype({"names": ["swap_add", "compare"], "formats": [">u8", ">u8"], "offsets": [0, 8],
                             "itemsize": 16})
# Successful CQE (struct mlx5_cqe64), the fields a requester uses plus the ones around them. op_own:
# opcode << 4 | ... | owner (bit 0).
CQE64_DTYPE = np.dtype({
    "names": ["srqn_uidx", "imm_inval_pkey", "app", "app_op", "app_info", "byte_cnt", "timestamp",
              "sop_drop_qpn", "wqe_counter", "signature", "op_own"],
    "formats": [">u4", ">u4", "u1", "u1", ">u2", ">u4", ">u8", ">u4", ">u2", "u1", "u1"],
    "offsets": [32, 36, 40, 41, 42, 44, 48, 56, 60, 62, 63],
    "itemsize": 64,
})
# Error CQE (struct mlx5_err_cqe), the same 64 bytes.
ERR_CQE_DTYPE = np.dtype({
    "names": ["srqn", "vendor_err_synd", "syndrome", "s_wqe_opcode_qpn", "wqe_counter", "signature", "op_own"],
    "formats": [">u4", "u1", "u1", ">u4", ">u2", "u1", "u1"],
    "offsets": [32, 54, 55, 56, 60, 62, 63],
    "itemsize": 64,
})

SEGMENT_DTYPES = {"ctrl": CTRL_SEG_DTYPE, "raddr": RADDR_SEG_DTYPE, "data": DATA_SEG_DTYPE,
                  "inline": INLINE_SEG_DTYPE, "atomic": ATOMIC_SEG_DTYPE, "cqe64": CQE64_DTYPE,
                  "err_cqe": ERR_CQE_DTYPE}


@dataclass
class DecodedWqe:
    """One WQE, field by field, in host byte order."""

    opcode: int
    opmod: int
    wqe_index: int
    qpn: int
    ds: int
    fm_ce_se: int
    imm: int
    raddr: int | None = None
    rkey: int | None = None
    data: list[tuple[int, int, int]] = field(default_factory=list)  # (byte_count, lkey, addr)
    inline: bytes | None = None
    swap_add: int | None = None
    compare: int | None = None

    @property
    def fence(self) -> bool:
        return bool(self.fm_ce_se & CTRL_FENCE)

    @property
    def small_fence(self) -> bool:
        return bool(self.fm_ce_se & CTRL_SMALL_FENCE)

    @property
    def completion(self) -> bool:
        """The WQE asks for a CQE (CQ_UPDATE)."""
        return bool(self.fm_ce_se & CTRL_CQ_UPDATE)

    @property
    def basic_blocks(self) -> int:
        return wqe_basic_blocks(self.ds)

    @property
    def length(self) -> int:
        """Bytes the WQE moves (inline or through its data segments)."""
        if self.inline is not None:
            return len(self.inline)
        return sum(n for n, _, _ in self.data)


def wqe_basic_blocks(ds: int) -> int:
    """WQEBBs a WQE of ``ds`` 16-byte units occupies."""
    return max(1, (ds * 16 + WQE_BB - 1) // WQE_BB)


def _data_segments(raw: bytes, start: int, end: int) -> list[tuple[int, int, int]]:
    segs = np.frombuffer(raw, dtype=DATA_SEG_DTYPE, count=(end - start) // 16, offset=start)
    out = []
    for i, s in enumerate(segs):
        count = int(s["byte_count"])
        if count & INLINE_SEG:
            raise WqeFormatError(Syndrome.LOCAL_QP_OP_ERR, f"data segment {i} has the inline flag")
        out.append((count if count else 1 << 31, int(s["lkey"]), int(s["addr"])))
    return out


def decode_wqe(raw: bytes | bytearray | memoryview, *, max_inline: int = 64, max_sge: int = 1) -> DecodedWqe:
    """Decode the WQE at the start of ``raw`` (contiguous: every WQEBB it spans).

    Refuses, with the syndrome a ConnectX reports: an unknown opcode or a non-zero opmod, a ds that
    does not match the opcode's segments (LOCAL_QP_OP_ERR); a data segment of byte_count 0 (that is
    2^31 bytes), an atomic whose data segment is not 8 bytes, inline data longer than ``max_inline``
    (LOCAL_LENGTH_ERR).
    """
    raw = bytes(raw)
    if len(raw) < 16:
        raise WqeFormatError(Syndrome.LOCAL_QP_OP_ERR, "WQE shorter than a control segment")
    c = np.frombuffer(raw, dtype=CTRL_SEG_DTYPE, count=1)[0]
    qpn_ds = int(c["qpn_ds"])
    w = DecodedWqe(opcode=int(c["opcode"]), opmod=int(c["opmod"]), wqe_index=int(c["wqe_index"]),
                   qpn=qpn_ds >> 8, ds=qpn_ds & 0x3F, fm_ce_se=int(c["fm_ce_se"]), imm=int(c["imm"]))
    name = Opcode(w.opcode).name if w.opcode in Opcode._value2member_map_ else f"{w.opcode:#04x}"
    if w.ds == 0:
        raise WqeFormatError(Syndrome.LOCAL_QP_OP_ERR, "ds is 0: a WQE holds at least its control segment")
    if w.ds * 16 > len(raw):
        raise WqeFormatError(Syndrome.LOCAL_QP_OP_ERR, f"ds {w.ds} runs past the {len(raw)} bytes given")
    if w.opcode not in (Opcode.NOP, Opcode.RDMA_WRITE, Opcode.RDMA_READ, Opcode.ATOMIC_FA, Opcode.ATOMIC_CS):
        raise WqeFormatError(Syndrome.LOCAL_QP_OP_ERR, f"opcode {name} is not an RC send opcode this QP accepts")
    if w.opmod:
        raise WqeFormatError(Syndrome.LOCAL_QP_OP_ERR, f"{name}: opmod {w.opmod:#x} (extended atomics) refused")
    end = w.ds * 16
    if w.opcode == Opcode.NOP:
        return w
    if w.ds < 2:
        raise WqeFormatError(Syndrome.LOCAL_QP_OP_ERR, f"{name}: ds {w.ds} leaves no remote-address segment")
    r = np.frombuffer(raw, dtype=RADDR_SEG_DTYPE, count=1, offset=16)[0]
    w.raddr, w.rkey = int(r["raddr"]), int(r["rkey"])
    if w.opcode in (Opcode.ATOMIC_FA, Opcode.ATOMIC_CS):
        if w.ds != 4:
            raise WqeFormatError(Syndrome.LOCAL_QP_OP_ERR,
                                 f"{name}: ds {w.ds}, expected 4 (ctrl, raddr, atomic, one data segment)")
        a = np.frombuffer(raw, dtype=ATOMIC_SEG_DTYPE, count=1, offset=32)[0]
        w.swap_add, w.compare = int(a["swap_add"]), int(a["compare"])
        w.data = _data_segments(raw, 48, 64)
        if w.data[0][0] != 8:
            raise WqeFormatError(Syndrome.LOCAL_LENGTH_ERR, f"{name}: data segment of {w.data[0][0]} bytes, not 8")
        return w
    if w.ds == 2:
        return w  # a zero-length write or read: no data segment
    first = int(np.frombuffer(raw, dtype=INLINE_SEG_DTYPE, count=1, offset=32)[0]["byte_count"])
    if first & INLINE_SEG:
        if w.opcode != Opcode.RDMA_WRITE:
            raise WqeFormatError(Syndrome.LOCAL_QP_OP_ERR, f"{name} cannot carry inline data")
        n = first & ~INLINE_SEG
        if n > max_inline:
            raise WqeFormatError(Syndrome.LOCAL_LENGTH_ERR, f"inline data of {n} bytes exceeds {max_inline}")
        units = (4 + n + 15) // 16
        if w.ds != 2 + units:
            raise WqeFormatError(Syndrome.LOCAL_QP_OP_ERR,
                                 f"{name}: ds {w.ds} does not fit {n} inline bytes (expected {2 + units})")
        w.inline = raw[36:36 + n]
        return w
    nseg = w.ds - 2
    if nseg > max_sge:
        raise WqeFormatError(Syndrome.LOCAL_QP_OP_ERR, f"{name}: {nseg} data segments, the QP allows {max_sge}")
    w.data = _data_segments(raw, 32, end)
    for count, _, _ in w.data:
        if count > MAX_MESSAGE:
            raise WqeFormatError(Syndrome.LOCAL_LENGTH_ERR,
                                 f"{name}: a data segment of byte_count 0 means 2^31 bytes (a zero-length "
                                 "transfer carries no data segment)")
    return w


def sq_dbrec_value(head: int) -> int:
    """The QP doorbell record's send word for send counter ``head``, as the u32 its bytes read natively."""
    return int.from_bytes((head & 0xFFFF).to_bytes(4, "big"), "little")


def cq_dbrec_value(ci: int) -> int:
    """The CQ doorbell record's set_ci word for consumer index ``ci``, read natively."""
    return int.from_bytes((ci & 0xFFFFFF).to_bytes(4, "big"), "little")


def cqe_ready(op_own: int, ci: int, ncqes: int) -> bool:
    """Does the entry at consumer index ``ci`` hold a new CQE (cq.c get_sw_cqe)?"""
    return (op_own >> 4) != CqeOpcode.INVALID and (op_own & 1) == (1 if ci & ncqes else 0)


def _owner(pi: int, ncqes: int) -> int:
    return 1 if pi & ncqes else 0


def encode_cqe(*, pi: int, ncqes: int, wqe_counter: int, wqe_opcode: int, qpn: int, byte_cnt: int = 0) -> bytes:
    """A successful requester CQE for producer index ``pi`` (the owner bit is the lap parity)."""
    buf = np.zeros(1, dtype=CQE64_DTYPE)
    buf["byte_cnt"] = byte_cnt & 0xFFFFFFFF
    buf["sop_drop_qpn"] = ((wqe_opcode & 0xFF) << 24) | (qpn & 0xFFFFFF)
    buf["wqe_counter"] = wqe_counter & 0xFFFF
    buf["op_own"] = (CqeOpcode.REQ << 4) | _owner(pi, ncqes)
    return buf.tobytes()


def encode_err_cqe(*, pi: int, ncqes: int, wqe_counter: int, wqe_opcode: int, qpn: int, syndrome: int,
                   vendor_err: int = 0) -> bytes:
    """A requester error CQE for producer index ``pi``."""
    buf = np.zeros(1, dtype=ERR_CQE_DTYPE)
    buf["vendor_err_synd"] = vendor_err & 0xFF
    buf["syndrome"] = syndrome
    buf["s_wqe_opcode_qpn"] = ((wqe_opcode & 0xFF) << 24) | (qpn & 0xFFFFFF)
    buf["wqe_counter"] = wqe_counter & 0xFFFF
    buf["op_own"] = (CqeOpcode.REQ_ERR << 4) | _owner(pi, ncqes)
    return buf.tobytes()


@dataclass(frozen=True)
class DecodedCqe:
    opcode: int
    owner: int
    wqe_counter: int
    wqe_opcode: int
    qpn: int
    byte_cnt: int = 0
    syndrome: int = 0
    vendor_err: int = 0

    @property
    def is_error(self) -> bool:
        return self.opcode in (CqeOpcode.REQ_ERR, CqeOpcode.RESP_ERR)


def decode_cqe(raw: bytes | bytearray | memoryview) -> DecodedCqe:
    """Decode one 64-byte CQE (either form, by its opcode)."""
    op_own = bytes(raw[63:64])[0]
    opcode = op_own >> 4
    if opcode in (CqeOpcode.REQ_ERR, CqeOpcode.RESP_ERR):
        e = np.frombuffer(bytes(raw), dtype=ERR_CQE_DTYPE, count=1)[0]
        word = int(e["s_wqe_opcode_qpn"])
        return DecodedCqe(opcode=opcode, owner=op_own & 1, wqe_counter=int(e["wqe_counter"]), wqe_opcode=word >> 24,
                          qpn=word & 0xFFFFFF, syndrome=int(e["syndrome"]), vendor_err=int(e["vendor_err_synd"]))
    c = np.frombuffer(bytes(raw), dtype=CQE64_DTYPE, count=1)[0]
    word = int(c["sop_drop_qpn"])
    return DecodedCqe(opcode=opcode, owner=op_own & 1, wqe_counter=int(c["wqe_counter"]), wqe_opcode=word >> 24,
                      qpn=word & 0xFFFFFF, byte_cnt=int(c["byte_cnt"]))
