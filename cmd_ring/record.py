"""The 48-byte command record: the one numpy dtype, its opcodes and flags, encode/decode helpers.

Layout (little-endian, 8-byte aligned; the C twin is ``cmd_ring/include/transportd/cmd_ring.h`` and a test
compiles a probe against it so the two can never drift apart)::

    word 0  | seq:u32            | opcode:u8 | flags:u8 | peer:u16 |   header, committed last
    word 1  | src_off:u64                                           |
    word 2  | dst_off:u64                                           |
    word 3  | length:u32         | src_region:u16 | dst_region:u16  |
    word 4  | chunk_id:u32       | signal_slot:u32                  |
    word 5  | signal_value:u64                                      |

``seq`` is the lap-stamped slot number plus one (:func:`seq_for`), never 0, so a slot still holding a
record from an earlier lap (or never written) is never taken for a fresh one.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import numpy as np

__all__ = [
    "RECORD_SIZE",
    "RECORD_DTYPE",
    "HEADER_FIELDS",
    "BODY_FIELDS",
    "Opcode",
    "Flag",
    "Command",
    "seq_for",
    "seq_array",
    "encode",
    "decode",
    "records_from_commands",
]

RECORD_SIZE = 48

RECORD_DTYPE = np.dtype(
    [
        ("seq", "<u4"),
        ("opcode", "u1"),
        ("flags", "u1"),
        ("peer", "<u2"),
        ("src_off", "<u8"),
        ("dst_off", "<u8"),
        ("length", "<u4"),
        ("src_region", "<u2"),
        ("dst_region", "<u2"),
        ("chunk_id", "<u4"),
        ("signal_slot", "<u4"),
        ("signal_value", "<u8"),
    ],
    align=True,
)
assert RECORD_DTYPE.itemsize == RECORD_SIZE

HEADER_FIELDS = ("seq", "opcode", "flags", "peer")
BODY_FIELDS = tuple(name for name in RECORD_DTYPE.names if name not in HEADER_FIELDS)

# seq values cycle through 1 .. 2**32 - 1: zero is reserved for "never written".
_SEQ_MODULUS = 0xFFFF_FFFF


class Opcode(enum.IntEnum):
    """What a record asks for. 0 is never valid, so an all-zero slot is never a command."""

    PUT = 1  #: write length bytes src_region[src_off:] -> peer's dst_region[dst_off:]
    PUT_SIGNAL = 2  #: PUT, then update the peer's flag signal_slot once the payload is placed
    SIGNAL = 3  #: update the peer's flag signal_slot (ADD or SET) after earlier commands to it
    FENCE = 4  #: later commands to this peer are delivered after earlier ones are placed
    QUIET = 5  #: ask for local completion of everything before it; the proxy publishes a position


class Flag(enum.IntFlag):
    """Record flags. A signal ADDs ``signal_value`` unless SIGNAL_SET asks for a store."""

    NONE = 0
    SIGNAL_SET = 0x01  #: the signal stores signal_value instead of adding it
    NO_BATCH = 0x02  #: post this command on its own, without waiting for a batch to fill


def seq_for(position: int) -> int:
    """The seq stamp of the record at absolute ring ``position`` (0-based, counts every push)."""
    return position % _SEQ_MODULUS + 1


def seq_array(start: int, count: int) -> np.ndarray:
    """The seq stamps of ``count`` consecutive positions from ``start``, as uint32."""
    first = start % _SEQ_MODULUS
    stamps = np.arange(first, first + count, dtype=np.uint64) % _SEQ_MODULUS + 1
    return stamps.astype(np.uint32)


@dataclass(frozen=True, slots=True)
class Command:
    """One command, as a producer states it (the ring assigns ``seq``)."""

    opcode: Opcode
    peer: int = 0
    src_region: int = 0
    src_off: int = 0
    dst_region: int = 0
    dst_off: int = 0
    length: int = 0
    chunk_id: int = 0
    signal_slot: int = 0
    signal_value: int = 0
    flags: Flag = Flag.NONE


def encode(command: Command, seq: int = 0) -> bytes:
    """The 48 bytes of ``command`` stamped with ``seq``."""
    return records_from_commands([command], first_seq=seq).tobytes()


def decode(data: bytes | bytearray | memoryview | np.void) -> tuple[int, Command]:
    """``(seq, command)`` from 48 bytes (or one record of RECORD_DTYPE)."""
    if isinstance(data, np.void):
        rec = data
    else:
        if len(data) != RECORD_SIZE:
            raise ValueError(f"a command record is {RECORD_SIZE} bytes, got {len(data)}")
        rec = np.frombuffer(bytes(data), dtype=RECORD_DTYPE)[0]
    command = Command(
        opcode=Opcode(int(rec["opcode"])),
        peer=int(rec["peer"]),
        src_region=int(rec["src_region"]),
        src_off=int(rec["src_off"]),
        dst_region=int(rec["dst_region"]),
        dst_off=int(rec["dst_off"]),
        length=int(rec["length"]),
        chunk_id=int(rec["chunk_id"]),
        signal_slot=int(rec["signal_slot"]),
        signal_value=int(rec["signal_value"]),
        flags=Flag(int(rec["flags"])),
    )
    return int(rec["seq"]), command


def records_from_commands(commands: list[Command], first_seq: int = 0) -> np.ndarray:
    """An array of records for ``commands``; seq is ``first_seq`` and up (0 leaves them unstamped)."""
    out = np.zeros(len(commands), dtype=RECORD_DTYPE)
    for i, c in enumerate(commands):
        out[i] = (
            0,
            int(c.opcode),
            int(c.flags),
            c.peer,
            c.src_off,
            c.dst_off,
            c.length,
            c.src_region,
            c.dst_region,
            c.chunk_id,
            c.signal_slot,
            c.signal_value,
        )
    if first_seq:
        out["seq"] = seq_array(first_seq - 1, len(commands))
    return out
