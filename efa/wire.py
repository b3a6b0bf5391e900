"""What one efa rail writes into another: the 32-bit immediate and the 32-byte control record.

SRD delivers the pieces of a transfer in any order and says nothing about when a write lands relative to
another, so a flag can't simply be written after its data (there is no "after" on SRD). Instead every
write carries an immediate, the receiving daemon sees one completion per write, counts, and publishes a
flag itself once everything the flag covers has arrived (docs/design.md, "Flags follow their data").

Immediate (host order; pyverbs puts it on the wire big-endian)::

     31  30 29                    18 17                                   0
    +------+------------------------+--------------------------------------+
    | kind |  conn (12 bits)        |  index (18 bits)                     |
    +------+------------------------+--------------------------------------+
    kind 0 DATA  a payload piece;    index = its group   mod 2**18
    kind 1 CTRL  a control record;   index = its seq     mod 2**18
    kind 2, 3    reserved (a receiver refuses them)
    conn         the *receiver's* connection index, handed out by the receiver in its endpoint

Groups. The sender numbers its writes in groups: a group is a run of WRITE rows followed by the SIGNAL
(and FENCE) rows that come after them; the next WRITE opens the next group. Every piece carries its
group, so the receiver counts arrivals per group. Every group is closed by at least one CTRL record (a
signal, or a fence marker), which tells the receiver how many pieces the group has.

Control record (a SIGNAL or a FENCE row), written with write-with-immediate from a registered send
staging entry (EFA has no inline) into the receiver's staging ring for this connection, entry
``seq % ring_entries``; the receiver copies it out when it sees the completion::

    byte  0                  8          12         16         20         24      26   27   28         32
         +------------------+----------+----------+----------+----------+-------+----+----+----------+
         | value       u64  | pieces   | group    | after    | slot     | rank  | op |rsv | seq      |
         |                  | u32      | u32      | u32      | u32      | u16   | u8 | u8 | u32      |
         +------------------+----------+----------+----------+----------+-------+----+----+----------+
    value   ADD increment or SET value (op), 0 for a fence marker
    pieces  number of data pieces in ``group`` (all of them: a group's writes precede its records)
    group   the group this record closes
    after   groups numbered below ``after`` must be complete too (set by a FENCE; ``group`` in
            cumulative mode) before this signal is published
    slot, rank   the flag: slot ``slot`` of rank ``rank``'s flag array at the receiver
    op      0 ADD, 1 SET, 255 FENCE marker (counts only, publishes nothing)
    seq     this connection's record number (the immediate carries its low 18 bits: a mismatch means
            the staging entry was overwritten before it was read, which the sender's window rules out)

All 32-bit counters wrap; the receiver unwraps them against its own position (see ``unwrap``), which
is sound while fewer than 2**17 groups or records of one connection are between "posted" and
"processed" — the sender's outstanding-WR window (``EfaBackend``) keeps that far below.
"""

from __future__ import annotations

import numpy as np

__all__ = [
    "CONN_BITS",
    "CTRL_DTYPE",
    "CTRL_SIZE",
    "INDEX_BITS",
    "INDEX_MASK",
    "KIND_CTRL",
    "KIND_DATA",
    "MAX_CONNS",
    "OP_ADD",
    "OP_FENCE",
    "OP_SET",
    "decode_imm",
    "encode_imm",
    "unwrap",
]

KIND_DATA = 0
KIND_CTRL = 1

CONN_BITS = 12
INDEX_BITS = 18
MAX_CONNS = 1 << CONN_BITS
INDEX_MASK = (1 << INDEX_BITS) - 1
_CONN_MASK = MAX_CONNS - 1
_KIND_SHIFT = CONN_BITS + INDEX_BITS

OP_ADD = 0
OP_SET = 1
OP_FENCE = 255

CTRL_DTYPE = np.dtype(
    [
        ("value", "<u8"),
        ("pieces", "<u4"),
        ("group", "<u4"),
        ("after", "<u4"),
        ("slot", "<u4"),
        ("rank", "<u2"),
        ("op", "u1"),
        ("rsv", "u1"),
        ("seq", "<u4"),
    ]
)
CTRL_SIZE = 32
assert CTRL_DTYPE.itemsize == CTRL_SIZE
assert [CTRL_DTYPE.fields[n][1] for n in ("value", "pieces", "group", "after", "slot", "rank", "op", "seq")] == [
    0, 8, 12, 16, 20, 24, 26, 28]


def encode_imm(kind: int, conn: int, index: int) -> int:
    """The 32-bit immediate for a piece (kind DATA, index = group) or a record (kind CTRL, index = seq)."""
    return (kind << _KIND_SHIFT) | ((conn & _CONN_MASK) << INDEX_BITS) | (index & INDEX_MASK)


def decode_imm(imm: int) -> tuple[int, int, int]:
    """(kind, conn, index) of an immediate."""
    return imm >> _KIND_SHIFT, (imm >> INDEX_BITS) & _CONN_MASK, imm & INDEX_MASK


def unwrap(value: int, bits: int, ref: int) -> int:
    """The full counter whose low ``bits`` bits are ``value``, nearest to ``ref`` (within +-2**(bits-1))."""
    size = 1 << bits
    half = size >> 1
    return ref + ((value - ref + half) & (size - 1)) - half
