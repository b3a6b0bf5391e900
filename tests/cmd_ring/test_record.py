"""The record: encode/decode round trips, stamps, and the all-zero slot."""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from cmd_ring import RECORD_DTYPE, RECORD_SIZE, Command, Flag, Opcode, decode, encode, seq_array, seq_for

u16 = st.integers(0, 2**16 - 1)
u32 = st.integers(0, 2**32 - 1)
u64 = st.integers(0, 2**64 - 1)

commands = st.builds(
    Command,
    opcode=st.sampled_from(list(Opcode)),
    peer=u16,
    src_region=u16,
    src_off=u64,
    dst_region=u16,
    dst_off=u64,
    length=u32,
    chunk_id=u32,
    signal_slot=u32,
    signal_value=u64,
    flags=st.sampled_from([Flag.NONE, Flag.SIGNAL_SET, Flag.NO_BATCH, Flag.SIGNAL_SET | Flag.NO_BATCH]),
)


@given(commands, st.integers(1, 2**32 - 1))
def test_encode_decode_round_trip(command: Command, seq: int) -> None:
    data = encode(command, seq)
    assert len(data) == RECORD_SIZE
    assert decode(data) == (seq, command)


def test_header_word_packs_seq_opcode_flags_peer_little_endian() -> None:
    data = encode(Command(Opcode.PUT_SIGNAL, peer=0x1234, flags=Flag.SIGNAL_SET), seq=0xA1B2C3D4)
    assert data[:8] == bytes([0xD4, 0xC3, 0xB2, 0xA1, 2, 1, 0x34, 0x12])


def test_all_zero_record_is_never_a_command() -> None:
    # Regression guard: an untouched slot must not decode to a valid opcode or a valid stamp.
    zero = np.zeros(1, dtype=RECORD_DTYPE)[0]
    assert int(zero["seq"]) not in {seq_for(p) for p in range(0, 10)}
    assert 0 not in {int(op) for op in Opcode}


def test_decode_rejects_wrong_size() -> None:
    try:
        decode(b"\x00" * 47)
    except ValueError as exc:
        assert "48 bytes" in str(exc)
    else:
        raise AssertionError("47 bytes decoded")


@given(st.integers(0, 2**40), st.integers(1, 64))
def test_seq_array_matches_seq_for_and_never_zero(start: int, count: int) -> None:
    stamps = seq_array(start, count)
    assert stamps.tolist() == [seq_for(start + i) for i in range(count)]
    assert (stamps != 0).all()


def test_seq_wraps_past_u32_without_hitting_zero() -> None:
    edge = 2**32 - 1
    assert [seq_for(p) for p in range(edge - 2, edge + 2)] == [edge - 1, edge, 1, 2]
