"""Ring records -> validated plan rows, vectorized, through a job's resolved tables.

This is the proxy's handler (the MSCCL++ ``handleTrigger`` part) without the loop: records carry small
integer ids (peer rank, region ids, flag slot) and the tables below resolve them to addresses and keys.
Everything is numpy over a whole block of records; there is no per-record Python on this path, which is
what keeps the proxy near the ring's own drain rate (DESIGN.md section 3: per-command Python work is where
the proxy's time goes).

Validation (DESIGN.md section 8). A bad record gets exactly one code, the first that applies in this
order, and produces no plan rows; the records around it are translated as usual:

==================  ==================================================================================
``CLIENT_GONE``     the channel's client has left (every record is rejected)
``BAD_OPCODE``      opcode not in PUT..QUIET
``BAD_PEER``        peer >= world, or no connection bound for it (FENCE, SIGNAL, PUT, PUT_SIGNAL)
peer's code         the peer's connection failed (usually ``PEER_LOST``)
``BAD_LENGTH``      PUT/PUT_SIGNAL with length 0 or above ``max_length``
``BAD_REGION``      source or destination region id out of range or not registered
``OUT_OF_BOUNDS``   offset + length past the end of the source or destination region
``BAD_SLOT``        PUT_SIGNAL/SIGNAL slot >= the peer's flag count (or the peer has no flag array)
==================  ==================================================================================

Bounds are checked as ``off <= len and length <= len - off``, so ``off + length`` never overflows u64.

Rows: PUT -> WRITE; PUT_SIGNAL -> WRITE, SIGNAL; SIGNAL -> SIGNAL; FENCE -> FENCE; QUIET -> none (it only
asks for a completion position). A signal's address is ``flag base + 8 * slot``; its length is 8.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from cmd_ring.record import RECORD_DTYPE, Flag, Opcode
from transportd.backend import PLAN_DTYPE, PlanOp, SignalOp
from transportd.batching import take_rows
from transportd.errors import ErrorCode

__all__ = ["RegionTable", "PeerTable", "Translated", "translate", "DEFAULT_MAX_LENGTH", "MAX_REGION_ID"]

DEFAULT_MAX_LENGTH = 1 << 31  # a verbs port's usual max_msg_sz
MAX_REGION_ID = 0xFFFF  # region ids are u16 in the record
_U64 = np.uint64
# Plain ints for the hot path (an IntEnum attribute lookup costs about a microsecond on 3.11).
_PUT, _PUT_SIGNAL, _SIGNAL, _QUIET = int(Opcode.PUT), int(Opcode.PUT_SIGNAL), int(Opcode.SIGNAL), int(Opcode.QUIET)
_WRITE, _SIG_ROW = int(PlanOp.WRITE), int(PlanOp.SIGNAL)
_ADD, _SET, _SIGNAL_SET = int(SignalOp.ADD), int(SignalOp.SET), int(Flag.SIGNAL_SET)

# Per opcode (index = opcode value; 0 and >5 are invalid): plan rows produced and the first row's op.
_ROWS_PER_OP = np.array([0, 1, 2, 1, 1, 0], dtype=np.intp)
_FIRST_OP = np.array([0, PlanOp.WRITE, PlanOp.WRITE, PlanOp.SIGNAL, PlanOp.FENCE, 0], dtype=np.uint8)


def _grown(array: np.ndarray, size: int, fill: object = 0) -> np.ndarray:
    """``array`` extended along axis -1 to ``size`` (a power of two), new cells set to ``fill``."""
    new_size = 1 << max(size - 1, 0).bit_length()
    if array.shape[-1] >= new_size:
        return array
    out = np.full(array.shape[:-1] + (new_size,), fill, dtype=array.dtype)
    out[..., : array.shape[-1]] = array
    return out


def _grown2(array: np.ndarray, rows: int, cols: int) -> np.ndarray:
    """A 2-D ``array`` enlarged to ``rows x cols`` (zero/False filled)."""
    out = np.zeros((rows, cols), dtype=array.dtype)
    out[: array.shape[0], : array.shape[1]] = array
    return out


def _check_region_id(region: int) -> None:
    if not 0 <= region <= MAX_REGION_ID:
        raise ValueError(f"region id {region} is outside 0..{MAX_REGION_ID} (a record carries it as u16)")


class RegionTable:
    """One rank's local source regions by id: address, length and lkey, plus a valid mask.

    The arrays grow to the highest id registered (rounded up to a power of two), so a record's id indexes
    them directly once it is checked against ``len(valid)``.
    """

    def __init__(self) -> None:
        self.addr = np.zeros(1, dtype=np.uint64)
        self.length = np.zeros(1, dtype=np.uint64)
        self.key = np.zeros(1, dtype=np.uint32)
        self.valid = np.zeros(1, dtype=bool)

    def set(self, region: int, addr: int, length: int, key: int) -> None:
        """Register (or replace) region ``region``."""
        _check_region_id(region)
        if region >= len(self.valid):
            size = region + 1
            self.addr, self.length = _grown(self.addr, size), _grown(self.length, size)
            self.key, self.valid = _grown(self.key, size), _grown(self.valid, size, False)
        self.addr[region], self.length[region], self.key[region] = addr, length, key
        self.valid[region] = True

    def remove(self, region: int) -> None:
        """Forget region ``region``; records naming it are rejected with BAD_REGION from now on."""
        if 0 <= region < len(self.valid):
            self.valid[region] = False

    def __len__(self) -> int:
        return int(self.valid.sum())


class PeerTable:
    """A job's view of its peers, by rank: connection, flag array and remote regions.

    ``conn`` holds the proxy's connection index per rank (-1: none bound). ``code`` is nonzero for a rank
    whose connection failed: its records are rejected with that code (PEER_LOST) instead of being posted.
    Remote regions are a ``ranks x regions`` table. Tables may be filled before the job's ``world`` is
    known (peers announce regions before a local channel opens); until then every peer is out of range.
    """

    def __init__(self, world: int = 0) -> None:
        self.world = 0
        self.conn = np.full(1, -1, dtype=np.int64)
        self.code = np.zeros(1, dtype=np.uint16)
        self.flag_base = np.zeros(1, dtype=np.uint64)
        self.flag_slots = np.zeros(1, dtype=np.uint64)
        self.flag_rkey = np.zeros(1, dtype=np.uint32)
        self.addr = np.zeros((1, 1), dtype=np.uint64)
        self.length = np.zeros((1, 1), dtype=np.uint64)
        self.rkey = np.zeros((1, 1), dtype=np.uint32)
        self.valid = np.zeros((1, 1), dtype=bool)
        if world:
            self.set_world(world)

    def set_world(self, world: int) -> None:
        """Fix the job's world size (ranks ``0..world-1`` are valid peers)."""
        if not 1 <= world <= 1 << 16:
            raise ValueError(f"world size must be in 1..65536 (peer is u16 in the record), got {world}")
        self._ensure(world - 1, 0)
        self.world = world

    def _ensure(self, rank: int, region: int) -> None:
        if not 0 <= rank < 1 << 16:
            raise ValueError(f"rank {rank} is outside 0..65535 (peer is u16 in the record)")
        if self.world and rank >= self.world:
            raise ValueError(f"rank {rank} is outside this job's world of {self.world}")
        _check_region_id(region)
        if rank >= len(self.conn):
            size = rank + 1
            self.conn, self.code = _grown(self.conn, size, -1), _grown(self.code, size)
            self.flag_base, self.flag_slots = _grown(self.flag_base, size), _grown(self.flag_slots, size)
            self.flag_rkey = _grown(self.flag_rkey, size)
        rows = max(len(self.conn), self.valid.shape[0])
        cols = self.valid.shape[1] if region < self.valid.shape[1] else 1 << region.bit_length()
        if (rows, cols) != self.valid.shape:
            self.addr, self.length = _grown2(self.addr, rows, cols), _grown2(self.length, rows, cols)
            self.rkey, self.valid = _grown2(self.rkey, rows, cols), _grown2(self.valid, rows, cols)

    def bind(self, rank: int, conn: int) -> None:
        """Route records for ``rank`` to connection index ``conn``."""
        self._ensure(rank, 0)
        self.conn[rank] = conn
        self.code[rank] = 0

    def unbind(self, rank: int, code: int = 0) -> None:
        """No connection for ``rank``: its records get ``code``, or BAD_PEER when code is 0."""
        self._ensure(rank, 0)
        self.conn[rank] = -1
        self.code[rank] = code

    def set_region(self, rank: int, region: int, addr: int, length: int, rkey: int) -> None:
        """Register (or replace) ``rank``'s remote region ``region``."""
        self._ensure(rank, region)
        self.addr[rank, region], self.length[rank, region], self.rkey[rank, region] = addr, length, rkey
        self.valid[rank, region] = True

    def remove_region(self, rank: int, region: int) -> None:
        if 0 <= rank < self.valid.shape[0] and 0 <= region < self.valid.shape[1]:
            self.valid[rank, region] = False

    def set_flags(self, rank: int, base: int, slots: int, rkey: int) -> None:
        """``rank``'s flag array: ``slots`` u64 words from ``base`` (8-byte aligned, for NIC atomics)."""
        self._ensure(rank, 0)
        if base % 8:
            raise ValueError(f"flag array base {base:#x} is not 8-byte aligned")
        self.flag_base[rank], self.flag_slots[rank], self.flag_rkey[rank] = base, slots, rkey

    def remove_flags(self, rank: int) -> None:
        if 0 <= rank < len(self.flag_slots):
            self.flag_slots[rank] = 0

    def connections(self) -> np.ndarray:
        """The distinct connection indexes this job's records may feed."""
        return np.unique(self.conn[self.conn >= 0])


@dataclass(frozen=True, slots=True)
class Translated:
    """The result of :func:`translate` for one block of records.

    ``codes[i]`` is 0 for a good record, else its ErrorCode. ``plan`` holds the good records' rows in
    record order (token unset); ``row_rec[j]`` is the record index of row ``j`` and ``row_conn[j]`` its
    connection index. Records with no rows (bad ones, QUIET) are those absent from ``row_rec``.
    """

    codes: np.ndarray
    plan: np.ndarray
    row_rec: np.ndarray
    row_conn: np.ndarray


def _error_codes(op: np.ndarray, known: np.ndarray, masks: dict[str, np.ndarray], peer_code: np.ndarray) -> np.ndarray:
    """Codes for a block with at least one bad record; the earlier a check is listed, the more it wins."""
    codes = np.zeros(len(op), dtype=np.uint16)
    codes[masks["sig"] & ~masks["slot_ok"]] = ErrorCode.BAD_SLOT
    codes[masks["data"] & ~masks["bounds_ok"]] = ErrorCode.OUT_OF_BOUNDS
    codes[masks["data"] & ~masks["region_ok"]] = ErrorCode.BAD_REGION
    codes[masks["data"] & ~masks["len_ok"]] = ErrorCode.BAD_LENGTH
    lost = masks["needs_peer"] & ~masks["peer_ok"]
    codes[lost] = np.where(peer_code[lost] != 0, peer_code[lost], ErrorCode.BAD_PEER)
    codes[~known] = ErrorCode.BAD_OPCODE
    return codes


def translate(
    records: np.ndarray,
    sources: RegionTable,
    peers: PeerTable,
    *,
    max_length: int = DEFAULT_MAX_LENGTH,
    gone: bool = False,
) -> Translated:
    """Validate ``records`` (RECORD_DTYPE) and turn the good ones into plan rows, in record order."""
    n = len(records)
    if n == 0 or gone:
        codes = np.full(n, ErrorCode.CLIENT_GONE if gone else 0, dtype=np.uint16)
        return Translated(codes, np.zeros(0, PLAN_DTYPE), np.zeros(0, np.intp), np.zeros(0, np.int64))
    assert records.dtype == RECORD_DTYPE

    op = records["opcode"]
    known = (op >= _PUT) & (op <= _QUIET)
    data = (op == _PUT) | (op == _PUT_SIGNAL)
    sig = (op == _PUT_SIGNAL) | (op == _SIGNAL)
    needs_peer = known & (op != _QUIET)

    peer = records["peer"].astype(np.intp)
    peer_in = peer < peers.world  # the tables always cover at least ``world`` ranks
    pidx = np.where(peer_in, peer, 0)
    conn = peers.conn[pidx]
    peer_ok = peer_in & (conn >= 0)

    length = records["length"].astype(np.uint64)
    len_ok = (length != 0) & (length <= _U64(max_length))

    sreg = records["src_region"].astype(np.intp)
    s_in = sreg < len(sources.valid)
    sidx = np.where(s_in, sreg, 0)
    dreg = records["dst_region"].astype(np.intp)
    d_in = dreg < peers.valid.shape[1]
    didx = np.where(d_in, dreg, 0)
    region_ok = s_in & sources.valid[sidx] & d_in & peers.valid[pidx, didx]

    src_len = sources.length[sidx]
    dst_len = peers.length[pidx, didx]
    src_off = records["src_off"]
    dst_off = records["dst_off"]
    # off <= len first; len - off wraps when it is not, but that lane is already false.
    with np.errstate(over="ignore"):
        bounds_ok = ((src_off <= src_len) & (length <= src_len - src_off)
                     & (dst_off <= dst_len) & (length <= dst_len - dst_off))

    slot = records["signal_slot"].astype(np.uint64)
    slot_ok = slot < peers.flag_slots[pidx]

    good = known & (~needs_peer | peer_ok) & (~data | (len_ok & region_ok & bounds_ok)) & (~sig | slot_ok)
    if good.all():
        codes = np.zeros(n, dtype=np.uint16)
    else:
        masks = dict(sig=sig, slot_ok=slot_ok, data=data, bounds_ok=bounds_ok, region_ok=region_ok, len_ok=len_ok,
                     needs_peer=needs_peer, peer_ok=peer_ok)
        codes = _error_codes(op, known, masks, peers.code[pidx])

    nrows = np.where(good, _ROWS_PER_OP[np.where(known, op, 0)], 0)
    one_each = bool((nrows == 1).all())  # the common all-PUT (or all-SIGNAL/FENCE) block
    if one_each:
        total = n
        row_rec = np.arange(n, dtype=np.intp)
        rop = _FIRST_OP[op]
    else:
        total = int(nrows.sum())
        row_rec = np.repeat(np.arange(n, dtype=np.intp), nrows)
        starts = np.cumsum(nrows) - nrows
        rop = _FIRST_OP[op[row_rec]]
        rop[np.arange(total) != starts[row_rec]] = _SIG_ROW  # a PUT_SIGNAL's second row

    r = records if one_each else take_rows(records, row_rec)
    rp = pidx[row_rec]
    rs = sidx[row_rec]
    rd = didx[row_rec]
    is_w = rop == _WRITE
    is_s = rop == _SIG_ROW
    plan = np.zeros(total, dtype=PLAN_DTYPE)
    plan["op"] = rop
    plan["dst_rank"] = r["peer"]
    plan["chunk_id"] = r["chunk_id"]
    with np.errstate(over="ignore"):
        if is_w.all():
            plan["length"] = r["length"]
            plan["laddr"] = sources.addr[rs] + r["src_off"]
            plan["lkey"] = sources.key[rs]
            plan["raddr"] = peers.addr[rp, rd] + r["dst_off"]
            plan["rkey"] = peers.rkey[rp, rd]
        else:
            zero = _U64(0)
            plan["length"] = np.where(is_s, 8, np.where(is_w, r["length"], 0))
            plan["laddr"] = np.where(is_w, sources.addr[rs] + r["src_off"], zero)
            plan["lkey"] = np.where(is_w, sources.key[rs], 0)
            flag_addr = peers.flag_base[rp] + _U64(8) * r["signal_slot"].astype(np.uint64)
            plan["raddr"] = np.where(is_s, flag_addr, np.where(is_w, peers.addr[rp, rd] + r["dst_off"], zero))
            plan["rkey"] = np.where(is_s, peers.flag_rkey[rp], np.where(is_w, peers.rkey[rp, rd], 0))
            plan["value"] = np.where(is_s, r["signal_value"], zero)
            plan["slot"] = np.where(is_s, r["signal_slot"], 0)
            set_flag = (r["flags"] & _SIGNAL_SET) != 0
            plan["signal_op"] = np.where(is_s & set_flag, _SET, _ADD)
    return Translated(codes, plan, row_rec, conn[row_rec])
