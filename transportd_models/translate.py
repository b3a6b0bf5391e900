"""Ring records -> validated plan rows, vectorized, through a job's resolved tables.

The translate step of the proxy's numpy model (:mod:`transportd_models.engine`, the oracle the
differential test holds the compiled engine to); the daemon never runs it: its proxy validates and
translates in C (``transportd/core/validate.h``), through the same tables
(:mod:`transportd.dataplane.tables`, whose layout this code relies on). Everything is numpy over a whole
block of records, with no per-record Python (docs/design.md, "No Python per record": per-command Python
work is where the proxy's time goes).

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

Through the tables' sentinels (:mod:`transportd.dataplane.tables`) one gather both checks and resolves
every id, and an unregistered region fails the bounds check alone: only a block that holds a bad record
pays for telling the codes apart.

Rows: PUT -> WRITE; PUT_SIGNAL -> WRITE, SIGNAL; SIGNAL -> SIGNAL; FENCE -> FENCE; QUIET -> none (it only
asks for a completion position). A signal's address is ``flag base + 8 * slot``; its length is 8.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from cmd_ring.record import RECORD_DTYPE, Flag, Opcode
from transportd.backends.interface import PLAN_DTYPE, PlanOp, SignalOp
from transportd.dataplane.tables import DEFAULT_MAX_LENGTH, PeerTable, RegionTable
from transportd.errors import ErrorCode
from transportd.rows import take_rows

__all__ = ["Translated", "translate"]

_U64 = np.uint64
# Plain ints for the hot path (an IntEnum attribute lookup costs about a microsecond on 3.11).
_PUT, _PUT_SIGNAL, _SIGNAL, _QUIET = int(Opcode.PUT), int(Opcode.PUT_SIGNAL), int(Opcode.SIGNAL), int(Opcode.QUIET)
_WRITE, _SIG_ROW = int(PlanOp.WRITE), int(PlanOp.SIGNAL)
_ADD, _SET, _SIGNAL_SET = int(SignalOp.ADD), int(SignalOp.SET), int(Flag.SIGNAL_SET)


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
