"""Ring records -> validated plan rows, vectorized, through a job's resolved tables.

The translate step of the proxy's numpy model (:mod:`transportd_cli.proxy_model`, the oracle the
differential test holds the compiled engine to): the daemon's proxy validates and translates in C
(``transportd/core/validate.h``) and takes only the tables from here, :class:`RegionTable` and
:class:`PeerTable`, whose views :mod:`transportd.dataplane.proxy` hands the engine. Records carry small
integer ids (peer rank, region ids, flag slot) and the tables resolve them to addresses and keys.
Everything is numpy over a whole block of records, with no per-record Python (docs/design.md, "No Python
per record": per-command Python work is where the proxy's time goes).

Validation (docs/design.md, "Bad input hurts only its sender"). A bad record gets exactly one code, the
first that applies in this order, and produces no plan rows; the records around it are translated as usual:

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

Table layout (for speed): every table has one entry past its last id, a *sentinel* that is never valid
(no connection, length 0, no flag slots). Ids out of range are clamped onto it, so one gather both checks
and resolves them with no masking; an unregistered region has length 0, so the bounds check alone
rejects it on the fast path. Only a block that holds a bad record pays for telling the codes apart.

Rows: PUT -> WRITE; PUT_SIGNAL -> WRITE, SIGNAL; SIGNAL -> SIGNAL; FENCE -> FENCE; QUIET -> none (it only
asks for a completion position). A signal's address is ``flag base + 8 * slot``; its length is 8.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from cmd_ring.record import RECORD_DTYPE, Flag, Opcode
from transportd.backends.interface import PLAN_DTYPE, PlanOp, SignalOp
from transportd.errors import ErrorCode
from transportd.limits import MAX_REGIONS, MAX_WORLD
from transportd.rows import take_rows

__all__ = ["RegionTable", "PeerTable", "Translated", "translate", "DEFAULT_MAX_LENGTH", "MAX_REGION_ID"]

DEFAULT_MAX_LENGTH = 1 << 31  # a verbs port's usual max_msg_sz
MAX_REGION_ID = MAX_REGIONS - 1  # region ids are u16 in the record
_U64 = np.uint64
# Plain ints for the hot path (an IntEnum attribute lookup costs about a microsecond on 3.11).
_PUT, _PUT_SIGNAL, _SIGNAL, _QUIET = int(Opcode.PUT), int(Opcode.PUT_SIGNAL), int(Opcode.SIGNAL), int(Opcode.QUIET)
_WRITE, _SIG_ROW = int(PlanOp.WRITE), int(PlanOp.SIGNAL)
_ADD, _SET, _SIGNAL_SET = int(SignalOp.ADD), int(SignalOp.SET), int(Flag.SIGNAL_SET)

# Per opcode (index = opcode value; 0 and >5 are invalid): plan rows produced and the first row's op.
_ROWS_PER_OP = np.array([0, 1, 2, 1, 1, 0], dtype=np.intp)
_FIRST_OP = np.array([0, PlanOp.WRITE, PlanOp.WRITE, PlanOp.SIGNAL, PlanOp.FENCE, 0], dtype=np.uint8)


def _check_region_id(region: int) -> None:
    if not 0 <= region <= MAX_REGION_ID:
        raise ValueError(f"region id {region} is outside 0..{MAX_REGION_ID} (a record carries it as u16)")


def _capacity_for(index: int) -> int:
    """The power of two above ``index`` (room for ids 0..index)."""
    return 1 << index.bit_length()


class RegionTable:
    """One rank's local source regions by id: address, length and lkey, plus a valid mask.

    Entries ``0 .. size-1`` hold ids; entry ``size`` is the sentinel. Arrays grow to the next power of two
    above the highest id registered.
    """

    def __init__(self) -> None:
        self.size = 1
        self.addr = np.zeros(2, dtype=np.uint64)
        self.length = np.zeros(2, dtype=np.uint64)  # 0 while not valid
        self.key = np.zeros(2, dtype=np.uint32)
        self.valid = np.zeros(2, dtype=bool)

    def _fit(self, region: int) -> None:
        if region < self.size:
            return
        size = _capacity_for(region)
        for name in ("addr", "length", "key", "valid"):
            old = getattr(self, name)
            new = np.zeros(size + 1, dtype=old.dtype)
            new[: self.size] = old[: self.size]
            setattr(self, name, new)
        self.size = size

    def set(self, region: int, addr: int, length: int, key: int) -> None:
        """Register (or replace) region ``region``."""
        _check_region_id(region)
        self._fit(region)
        self.addr[region], self.length[region], self.key[region] = addr, length, key
        self.valid[region] = True

    def remove(self, region: int) -> None:
        """Forget region ``region``; records naming it are rejected with BAD_REGION from now on."""
        if 0 <= region < self.size:
            self.valid[region] = False
            self.length[region] = 0

    def clear(self) -> None:
        """Forget every region."""
        self.valid[:] = False
        self.length[:] = 0

    def __len__(self) -> int:
        return int(self.valid.sum())


class PeerTable:
    """A job's view of its peers, by rank: connection, flag array and remote regions.

    ``conn`` holds the proxy's connection index per rank (-1: none bound). ``code`` is nonzero for a rank
    whose connection failed: its records are rejected with that code (PEER_LOST) instead of being posted.
    Ranks ``0 .. rows-1`` have entries and ``rows`` is the sentinel; remote regions are a flat
    ``(rows+1) x (cols+1)`` table (row stride ``cols + 1``, column ``cols`` the sentinel). Tables may be
    filled before the job's ``world`` is known (peers announce regions before a local channel opens); until
    then every peer is out of range, and :meth:`set_world` then trims the rows to exactly ``world``.
    """

    def __init__(self, world: int = 0) -> None:
        self.world = 0
        self.rows = 0
        self.cols = 1
        self.conn = np.full(1, -1, dtype=np.int64)
        self.code = np.zeros(1, dtype=np.uint16)
        self.flag_base = np.zeros(1, dtype=np.uint64)
        self.flag_slots = np.zeros(1, dtype=np.uint64)
        self.flag_rkey = np.zeros(1, dtype=np.uint32)
        self.addr = np.zeros(2, dtype=np.uint64)
        self.length = np.zeros(2, dtype=np.uint64)  # 0 while not valid
        self.rkey = np.zeros(2, dtype=np.uint32)
        self.valid = np.zeros(2, dtype=bool)
        if world:
            self.set_world(world)

    def _resize(self, rows: int, cols: int) -> None:
        keep_rows, keep_cols = min(rows, self.rows), min(cols, self.cols)
        for name, fill in (("conn", -1), ("code", 0), ("flag_base", 0), ("flag_slots", 0), ("flag_rkey", 0)):
            old = getattr(self, name)
            new = np.full(rows + 1, fill, dtype=old.dtype)
            new[:keep_rows] = old[:keep_rows]
            setattr(self, name, new)
        for name in ("addr", "length", "rkey", "valid"):
            old = getattr(self, name).reshape(self.rows + 1, self.cols + 1)
            new = np.zeros((rows + 1, cols + 1), dtype=old.dtype)
            new[:keep_rows, :keep_cols] = old[:keep_rows, :keep_cols]
            setattr(self, name, new.reshape(-1))
        self.rows, self.cols = rows, cols

    def set_world(self, world: int) -> None:
        """Fix the job's world size (ranks ``0..world-1`` are valid peers)."""
        if not 1 <= world <= MAX_WORLD:
            raise ValueError(f"world size must be in 1..{MAX_WORLD} (peer is u16 in the record), got {world}")
        if self.world and world != self.world:
            raise ValueError(f"the world size is already {self.world}")
        self._resize(world, self.cols)
        self.world = world

    def _ensure(self, rank: int, region: int) -> None:
        if not 0 <= rank < MAX_WORLD:
            raise ValueError(f"rank {rank} is outside 0..{MAX_WORLD - 1} (peer is u16 in the record)")
        if self.world and rank >= self.world:
            raise ValueError(f"rank {rank} is outside this job's world of {self.world}")
        _check_region_id(region)
        rows = self.rows if rank < self.rows else _capacity_for(rank)
        cols = self.cols if region < self.cols else _capacity_for(region)
        if (rows, cols) != (self.rows, self.cols):
            self._resize(rows, cols)

    def _at(self, rank: int, region: int) -> int:
        return rank * (self.cols + 1) + region

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
        at = self._at(rank, region)
        self.addr[at], self.length[at], self.rkey[at] = addr, length, rkey
        self.valid[at] = True

    def remove_region(self, rank: int, region: int) -> None:
        if 0 <= rank < self.rows and 0 <= region < self.cols:
            at = self._at(rank, region)
            self.valid[at] = False
            self.length[at] = 0

    def set_flags(self, rank: int, base: int, slots: int, rkey: int) -> None:
        """``rank``'s flag array: ``slots`` u64 words from ``base`` (8-byte aligned, for NIC atomics)."""
        self._ensure(rank, 0)
        if base % 8:
            raise ValueError(f"flag array base {base:#x} is not 8-byte aligned")
        self.flag_base[rank], self.flag_slots[rank], self.flag_rkey[rank] = base, slots, rkey

    def remove_flags(self, rank: int) -> None:
        if 0 <= rank < self.rows:
            self.flag_slots[rank] = 0

    def forget(self, rank: int) -> None:
        """``rank`` left the job: unbound (its records get BAD_PEER), no flags, no regions."""
        if 0 <= rank < self.rows:
            self.unbind(rank)
            self.remove_flags(rank)
            row = slice(self._at(rank, 0), self._at(rank, self.cols))
            self.valid[row] = False
            self.length[row] = 0

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


# What each opcode needs checked (index = opcode; anything unlisted is an unknown opcode).
_NEEDS_PEER, _NEEDS_DATA, _NEEDS_SLOT, _UNKNOWN = 1, 2, 4, 8
_REQUIRES = np.full(256, _UNKNOWN, dtype=np.uint8)
_REQUIRES[[_PUT, _PUT_SIGNAL, _SIGNAL, int(Opcode.FENCE), _QUIET]] = [
    _NEEDS_PEER | _NEEDS_DATA, _NEEDS_PEER | _NEEDS_DATA | _NEEDS_SLOT, _NEEDS_PEER | _NEEDS_SLOT, _NEEDS_PEER, 0]
_ROWS_PER_OP = np.zeros(256, dtype=np.intp)  # plan rows per good record
_ROWS_PER_OP[[_PUT, _PUT_SIGNAL, _SIGNAL, int(Opcode.FENCE)]] = [1, 2, 1, 1]
_FIRST_OP = np.zeros(256, dtype=np.uint8)
_FIRST_OP[[_PUT, _PUT_SIGNAL, _SIGNAL, int(Opcode.FENCE)]] = [_WRITE, _WRITE, _SIG_ROW, int(PlanOp.FENCE)]


def _error_codes(req: np.ndarray, ok: dict[str, np.ndarray], peer_code: np.ndarray) -> np.ndarray:
    """Codes for a block with at least one bad record; the earlier a check is listed, the more it wins."""
    codes = np.zeros(len(req), dtype=np.uint16)
    data = (req & _NEEDS_DATA) != 0
    codes[((req & _NEEDS_SLOT) != 0) & ~ok["slot"]] = ErrorCode.BAD_SLOT
    codes[data & ~ok["bounds"]] = ErrorCode.OUT_OF_BOUNDS
    codes[data & ~ok["region"]] = ErrorCode.BAD_REGION
    codes[data & ~ok["length"]] = ErrorCode.BAD_LENGTH
    lost = ((req & _NEEDS_PEER) != 0) & ~ok["peer"]
    codes[lost] = np.where(peer_code[lost] != 0, peer_code[lost], ErrorCode.BAD_PEER)
    codes[(req & _UNKNOWN) != 0] = ErrorCode.BAD_OPCODE
    return codes


SMALL_BLOCK = 16  # blocks up to this many records try the scalar path first
_M64 = (1 << 64) - 1


def _translate_small(records: np.ndarray, sources: RegionTable, peers: PeerTable,
                     max_length: int) -> Translated | None:
    """:func:`translate` for a small block of good PUT / PUT_SIGNAL records, in plain Python ints.

    A numpy call costs about a microsecond whatever its size, and the vectorized path makes dozens of them;
    for a handful of records a scalar pass is several times cheaper. Returns None (the caller takes the
    vectorized path) as soon as a record is anything else or fails a check, so error codes, and every
    other opcode, are only ever decided by the vectorized code. The rows are the ones the vectorized
    path builds for the same block, field for field.
    """
    limit = min(max_length, 0xFFFF_FFFF)
    world, prow, pcols = peers.world, peers.rows, peers.cols + 1
    p_conn, p_len, p_addr, p_rkey = peers.conn, peers.length, peers.addr, peers.rkey
    s_size, s_len, s_addr, s_key = sources.size, sources.length, sources.addr, sources.key
    rows: list[tuple[int, ...]] = []
    conns: list[int] = []
    row_rec: list[int] = []
    for i, (_seq, op, flags, peer, src_off, dst_off, length, src_region, dst_region, chunk, slot,
         value) in enumerate(records.tolist()):
        if op != _PUT and op != _PUT_SIGNAL:
            return None
        pidx = min(peer, prow) if world else prow
        conn = int(p_conn[pidx])
        if conn < 0 or not 0 < length <= limit:
            return None
        sidx = min(src_region, s_size)
        didx = pidx * pcols + min(dst_region, pcols - 1)
        src_len, dst_len = int(s_len[sidx]), int(p_len[didx])
        if not (src_off <= src_len and length <= src_len - src_off and dst_off <= dst_len
                and length <= dst_len - dst_off):
            return None
        laddr, raddr = (int(s_addr[sidx]) + src_off) & _M64, (int(p_addr[didx]) + dst_off) & _M64
        rows.append((_WRITE, _ADD, peer, length, laddr, raddr, int(s_key[sidx]), int(p_rkey[didx]), 0, 0, chunk, 0))
        conns.append(conn)
        row_rec.append(i)
        if op == _PUT_SIGNAL:
            if not slot < int(peers.flag_slots[pidx]):
                return None
            raddr = (int(peers.flag_base[pidx]) + 8 * slot) & _M64
            rows.append((_SIG_ROW, _SET if flags & _SIGNAL_SET else _ADD, peer, 8, 0, raddr, 0,
                         int(peers.flag_rkey[pidx]), value, slot, chunk, 0))
            conns.append(conn)
            row_rec.append(i)
    plan = np.zeros(len(rows), dtype=PLAN_DTYPE)
    plan[:] = rows
    return Translated(np.zeros(len(records), dtype=np.uint16), plan, np.array(row_rec, dtype=np.intp),
                      np.array(conns, dtype=np.int64))


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
    if n <= SMALL_BLOCK:
        small = _translate_small(records, sources, peers, max_length)
        if small is not None:
            return small

    op = records["opcode"]
    req = _REQUIRES[op]
    peer = records["peer"]
    if peers.world:
        pidx = np.minimum(peer, np.int64(peers.rows))  # peers past the world land on the sentinel
    else:
        pidx = np.full(n, peers.rows, dtype=np.int64)
    conn = peers.conn[pidx]
    peer_ok = conn >= 0
    sidx = np.minimum(records["src_region"], np.int64(sources.size))
    didx = pidx * (peers.cols + 1) + np.minimum(records["dst_region"], np.int64(peers.cols))
    length32 = records["length"]
    length = length32.astype(np.uint64)
    # 1 <= length <= max_length in one compare: length - 1 wraps for 0
    len_ok = (length32 - np.uint32(1)) < np.uint32(min(max_length, 0xFFFF_FFFF))
    src_len = sources.length[sidx]
    dst_len = peers.length[didx]
    src_off = records["src_off"]
    dst_off = records["dst_off"]
    # off <= len first; len - off wraps when it is not, but that lane is already false.
    bounds_ok = (src_off <= src_len) & (length <= src_len - src_off) & (dst_off <= dst_len) & (
        length <= dst_len - dst_off)
    slot = records["signal_slot"]
    slot_ok = slot < peers.flag_slots[pidx]
    ok_bits = peer_ok.view(np.uint8) | ((len_ok & bounds_ok).view(np.uint8) << 1) | (slot_ok.view(np.uint8) << 2)
    good = (req & ok_bits) == req
    if good.all():
        codes = np.zeros(n, dtype=np.uint16)
        nrows = _ROWS_PER_OP[op]
    else:
        region_ok = sources.valid[sidx] & peers.valid[didx]
        ok = dict(peer=peer_ok, length=len_ok, region=region_ok, bounds=bounds_ok, slot=slot_ok)
        codes = _error_codes(req, ok, peers.code[pidx])
        nrows = _ROWS_PER_OP[op] * good

    rop = _FIRST_OP[op]
    one_each = bool((nrows == 1).all())  # the common all-PUT (or all-SIGNAL/FENCE) block
    if one_each:
        total = n
        row_rec = np.arange(n, dtype=np.intp)
    else:
        total = int(nrows.sum())
        row_rec = np.repeat(np.arange(n, dtype=np.intp), nrows)
        rop = rop[row_rec]
        starts = np.cumsum(nrows) - nrows
        rop[np.arange(total) != starts[row_rec]] = _SIG_ROW  # a PUT_SIGNAL's second row

    plan = np.zeros(total, dtype=PLAN_DTYPE)
    plan["op"] = rop
    if one_each and (rop == _WRITE).all():  # every row a WRITE, one per record: no selects needed
        plan["dst_rank"] = peer
        plan["chunk_id"] = records["chunk_id"]
        plan["length"] = length32
        plan["laddr"] = sources.addr[sidx] + src_off
        plan["lkey"] = sources.key[sidx]
        plan["raddr"] = peers.addr[didx] + dst_off
        plan["rkey"] = peers.rkey[didx]
        return Translated(codes, plan, row_rec, conn)

    r = records if one_each else take_rows(records, row_rec)
    rp = pidx if one_each else pidx[row_rec]
    rs = sidx if one_each else sidx[row_rec]
    rd = didx if one_each else didx[row_rec]
    is_w = rop == _WRITE
    is_s = rop == _SIG_ROW
    zero = _U64(0)
    plan["dst_rank"] = r["peer"]
    plan["chunk_id"] = r["chunk_id"]
    plan["length"] = np.where(is_s, 8, np.where(is_w, r["length"], 0))
    plan["laddr"] = np.where(is_w, sources.addr[rs] + r["src_off"], zero)
    plan["lkey"] = np.where(is_w, sources.key[rs], 0)
    flag_addr = peers.flag_base[rp] + _U64(8) * r["signal_slot"].astype(np.uint64)
    plan["raddr"] = np.where(is_s, flag_addr, np.where(is_w, peers.addr[rd] + r["dst_off"], zero))
    plan["rkey"] = np.where(is_s, peers.flag_rkey[rp], np.where(is_w, peers.rkey[rd], 0))
    plan["value"] = np.where(is_s, r["signal_value"], zero)
    plan["slot"] = np.where(is_s, r["signal_slot"], 0)
    plan["signal_op"] = np.where(is_s & ((r["flags"] & _SIGNAL_SET) != 0), _SET, _ADD)
    return Translated(codes, plan, row_rec, conn if one_each else conn[row_rec])
