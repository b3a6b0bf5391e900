"""Record -> plan translation: every opcode, every bad-record code, and a per-record reference model."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import transportd_models.translate as translate_module
from cmd_ring.record import Command, Flag, Opcode, records_from_commands
from transportd.backends.interface import PlanOp, SignalOp
from transportd.dataplane.tables import PeerTable, RegionTable
from transportd.errors import ErrorCode
from transportd_models.translate import translate

U64_MAX = (1 << 64) - 1
WORLD = 4
SRC = {0: (0x10_0000, 4096, 11), 2: (0x20_0000, 1 << 20, 12)}  # id -> addr, length, lkey
DST = {(1, 0): (0xA0_0000, 8192, 21), (2, 0): (0xB0_0000, 8192, 22), (2, 3): (0xC0_0000, 64, 23),
       (3, 0): (0xD0_0000, 8192, 24)}  # (peer, id) -> addr, length, rkey
FLAGS = {1: (0xF1_0000, 16, 31), 2: (0xF2_0000, 4, 32)}  # peer -> base, slots, rkey
CONN = {1: 7, 2: 8, 3: 7}  # peer 0 (ourselves) has no connection bound


def tables() -> tuple[RegionTable, PeerTable]:
    src = RegionTable()
    for rid, (addr, length, key) in SRC.items():
        src.set(rid, addr, length, key)
    peers = PeerTable(WORLD)
    for (peer, rid), (addr, length, key) in DST.items():
        peers.set_region(peer, rid, addr, length, key)
    for peer, (base, slots, key) in FLAGS.items():
        peers.set_flags(peer, base, slots, key)
    for peer, conn in CONN.items():
        peers.bind(peer, conn)
    return src, peers


def run(*commands: Command, max_length: int = 1 << 20, gone: bool = False):
    src, peers = tables()
    return translate(records_from_commands(list(commands)), src, peers, max_length=max_length, gone=gone)


def put(**kw) -> Command:
    base = dict(opcode=Opcode.PUT, peer=1, src_region=0, src_off=0, dst_region=0, dst_off=0, length=64)
    base.update(kw)
    return Command(**base)


def test_put_becomes_one_write_with_resolved_addresses_and_keys() -> None:
    out = run(put(src_off=100, dst_off=200, length=300, chunk_id=9))
    assert out.codes.tolist() == [0]
    (row,) = out.plan
    assert row["op"] == PlanOp.WRITE and row["dst_rank"] == 1 and row["length"] == 300
    assert row["laddr"] == 0x10_0000 + 100 and row["lkey"] == 11
    assert row["raddr"] == 0xA0_0000 + 200 and row["rkey"] == 21
    assert row["chunk_id"] == 9
    assert out.row_conn.tolist() == [7] and out.row_rec.tolist() == [0]


def test_put_signal_becomes_write_then_signal_at_flag_base_plus_8_slot() -> None:
    out = run(put(opcode=Opcode.PUT_SIGNAL, peer=2, signal_slot=3, signal_value=5, flags=Flag.SIGNAL_SET))
    assert out.plan["op"].tolist() == [PlanOp.WRITE, PlanOp.SIGNAL]
    sig = out.plan[1]
    assert sig["raddr"] == 0xF2_0000 + 8 * 3 and sig["rkey"] == 32 and sig["length"] == 8
    assert sig["signal_op"] == SignalOp.SET and sig["value"] == 5 and sig["slot"] == 3
    assert out.row_rec.tolist() == [0, 0] and out.row_conn.tolist() == [8, 8]


def test_signal_fence_quiet() -> None:
    out = run(Command(Opcode.SIGNAL, peer=1, signal_slot=15, signal_value=2),
              Command(Opcode.FENCE, peer=3),
              Command(Opcode.QUIET, peer=0xFFFF))  # QUIET names no peer: any value is fine
    assert out.codes.tolist() == [0, 0, 0]
    assert out.plan["op"].tolist() == [PlanOp.SIGNAL, PlanOp.FENCE]
    assert out.plan[0]["signal_op"] == SignalOp.ADD and out.plan[0]["raddr"] == 0xF1_0000 + 8 * 15
    assert out.plan[1]["dst_rank"] == 3
    assert out.row_rec.tolist() == [0, 1]  # QUIET has no row


@pytest.mark.parametrize(
    ("command", "code"),
    [
        (put(opcode=0), ErrorCode.BAD_OPCODE),
        (put(opcode=6), ErrorCode.BAD_OPCODE),
        (put(opcode=255), ErrorCode.BAD_OPCODE),
        (put(peer=WORLD), ErrorCode.BAD_PEER),
        (put(peer=0xFFFF), ErrorCode.BAD_PEER),
        (put(peer=0), ErrorCode.BAD_PEER),  # in range, no connection bound
        (Command(Opcode.FENCE, peer=9), ErrorCode.BAD_PEER),
        (Command(Opcode.SIGNAL, peer=9), ErrorCode.BAD_PEER),
        (put(length=0), ErrorCode.BAD_LENGTH),
        (put(opcode=Opcode.PUT_SIGNAL, length=0), ErrorCode.BAD_LENGTH),
        (put(length=(1 << 20) + 1, src_region=2), ErrorCode.BAD_LENGTH),
        (put(src_region=1), ErrorCode.BAD_REGION),  # hole in the table
        (put(src_region=0xFFFF), ErrorCode.BAD_REGION),
        (put(dst_region=1), ErrorCode.BAD_REGION),
        (put(peer=3, dst_region=3), ErrorCode.BAD_REGION),  # id 3 exists for peer 2, not peer 3
        (put(src_off=4096 - 63), ErrorCode.OUT_OF_BOUNDS),
        (put(src_off=4097, length=1), ErrorCode.OUT_OF_BOUNDS),
        (put(dst_off=8192, length=1), ErrorCode.OUT_OF_BOUNDS),
        (put(src_off=U64_MAX, length=2), ErrorCode.OUT_OF_BOUNDS),  # off + length wraps u64
        (put(dst_off=U64_MAX - 10, length=64), ErrorCode.OUT_OF_BOUNDS),
        (put(opcode=Opcode.PUT_SIGNAL, signal_slot=16), ErrorCode.BAD_SLOT),
        (put(opcode=Opcode.PUT_SIGNAL, peer=3), ErrorCode.BAD_SLOT),  # peer 3 has no flag array
        (Command(Opcode.SIGNAL, peer=2, signal_slot=4), ErrorCode.BAD_SLOT),
        (Command(Opcode.SIGNAL, peer=2, signal_slot=0xFFFF_FFFF), ErrorCode.BAD_SLOT),
    ],
)
def test_each_bad_record_gets_its_code_and_the_good_ones_around_it_still_translate(command, code) -> None:
    good_a = put(chunk_id=1)
    good_b = put(opcode=Opcode.PUT_SIGNAL, chunk_id=3, peer=2, dst_region=3, signal_slot=1)
    out = run(good_a, command, good_b)
    assert out.codes.tolist() == [0, int(code), 0]
    assert out.row_rec.tolist() == [0, 2, 2]
    assert out.plan["chunk_id"].tolist() == [1, 3, 3]
    assert out.plan["op"].tolist() == [PlanOp.WRITE, PlanOp.WRITE, PlanOp.SIGNAL]


def test_exact_fit_at_region_end_is_accepted() -> None:
    out = run(put(src_off=4096 - 64, dst_off=8192 - 64, length=64), put(peer=2, dst_region=3, length=64))
    assert out.codes.tolist() == [0, 0]


def test_first_applicable_code_wins() -> None:
    # bad peer and zero length: the peer is reported; zero length and bad region: the length
    out = run(put(peer=9, length=0), put(length=0, src_region=1), put(src_region=1, src_off=1 << 40))
    assert out.codes.tolist() == [ErrorCode.BAD_PEER, ErrorCode.BAD_LENGTH, ErrorCode.BAD_REGION]


def test_gone_channel_rejects_everything_with_client_gone() -> None:
    out = run(put(), Command(Opcode.QUIET), gone=True)
    assert out.codes.tolist() == [ErrorCode.CLIENT_GONE] * 2 and len(out.plan) == 0


def test_failed_peer_reports_its_code() -> None:
    src, peers = tables()
    peers.unbind(1, ErrorCode.PEER_LOST)
    peers.unbind(2)
    out = translate(records_from_commands([put(), put(peer=2, dst_region=3)]), src, peers)
    assert out.codes.tolist() == [ErrorCode.PEER_LOST, ErrorCode.BAD_PEER]


def test_tables_filled_before_the_world_is_known_reject_every_peer() -> None:
    src, _ = tables()
    peers = PeerTable()
    peers.set_region(5, 0, 0x1000, 4096, 1)
    peers.bind(5, 0)
    out = translate(records_from_commands([put(peer=5)]), src, peers)
    assert out.codes.tolist() == [ErrorCode.BAD_PEER]
    peers.set_world(8)
    assert translate(records_from_commands([put(peer=5)]), src, peers).codes.tolist() == [0]
    with pytest.raises(ValueError, match="world"):
        peers.bind(8, 0)


# --- the vectorized translator against a per-record reference ----------------------------------------------
def reference(cmd: Command, max_length: int) -> tuple[int, list[tuple[int, int, int]]]:
    """(code, [(op, laddr, raddr)]) for one command, written as plainly as possible."""
    op = int(cmd.opcode)
    if op not in (1, 2, 3, 4, 5):
        return ErrorCode.BAD_OPCODE, []
    if op == Opcode.QUIET:
        return 0, []
    if not (cmd.peer < WORLD and cmd.peer in CONN):
        return ErrorCode.BAD_PEER, []
    rows = []
    if op in (Opcode.PUT, Opcode.PUT_SIGNAL):
        if cmd.length == 0 or cmd.length > max_length:
            return ErrorCode.BAD_LENGTH, []
        src = SRC.get(cmd.src_region)
        dst = DST.get((cmd.peer, cmd.dst_region))
        if src is None or dst is None:
            return ErrorCode.BAD_REGION, []
        if cmd.src_off + cmd.length > src[1] or cmd.dst_off + cmd.length > dst[1]:
            return ErrorCode.OUT_OF_BOUNDS, []
        rows.append((PlanOp.WRITE, src[0] + cmd.src_off, dst[0] + cmd.dst_off))
    if op in (Opcode.PUT_SIGNAL, Opcode.SIGNAL):
        flags = FLAGS.get(cmd.peer)
        if flags is None or cmd.signal_slot >= flags[1]:
            return ErrorCode.BAD_SLOT, []
        rows.append((PlanOp.SIGNAL, 0, flags[0] + 8 * cmd.signal_slot))
    if op == Opcode.FENCE:
        rows.append((PlanOp.FENCE, 0, 0))
    return 0, rows


def edgy(limit: int) -> st.SearchStrategy[int]:
    """Mostly small values near the table sizes, sometimes anything up to ``limit``."""
    return st.one_of(st.integers(0, 9000), st.integers(0, limit), st.sampled_from([limit, limit - 1]))


def _command(opcode, peer, sr, so, dr, do, length, slot) -> Command:
    cmd = Command(Opcode.PUT, peer=peer, src_region=sr, src_off=so, dst_region=dr, dst_off=do, length=length,
                  signal_slot=slot)
    object.__setattr__(cmd, "opcode", opcode)  # let invalid opcodes through the frozen dataclass
    return cmd


commands = st.builds(
    _command,
    st.sampled_from([0, 1, 2, 3, 4, 5, 6, 200]),
    st.integers(0, 6),
    st.integers(0, 3),
    edgy(U64_MAX),
    st.integers(0, 4),
    edgy(U64_MAX),
    st.one_of(st.integers(0, 9000), st.sampled_from([0, (1 << 32) - 1])),
    st.integers(0, 20),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(commands, min_size=1, max_size=40))
def test_vectorized_translation_matches_the_per_record_reference(cmds: list[Command]) -> None:
    max_length = 8192
    recs = records_from_commands(cmds)
    src, peers = tables()
    out = translate(recs, src, peers, max_length=max_length)
    want_codes, want_rows = [], []
    for i, c in enumerate(cmds):
        code, rows = reference(c, max_length)
        want_codes.append(int(code))
        want_rows += [(i, *r) for r in rows]
    assert out.codes.tolist() == want_codes
    got = [(int(r), int(p["op"]), int(p["laddr"]), int(p["raddr"])) for r, p in zip(out.row_rec, out.plan, strict=True)]
    assert got == [(i, int(op), la, ra) for i, op, la, ra in want_rows]


# Good PUT / PUT_SIGNAL commands (the scalar path's case), and now and then anything.
good_put = st.builds(_command, st.sampled_from([1, 2]), st.integers(1, 2), st.sampled_from([0, 2]),
                     st.integers(0, 4000), st.just(0), st.integers(0, 8000), st.integers(1, 64), st.integers(0, 3))
good_ish = st.one_of(good_put, good_put, good_put, good_put, good_put, good_put, commands)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(good_ish, min_size=1, max_size=5), st.sampled_from([8192, 64, 1 << 40]), st.booleans())
def test_small_block_scalar_path_matches_the_vectorized_path(cmds: list[Command], max_length: int,
                                                             signal_set: bool) -> None:
    recs = records_from_commands(cmds)
    recs["signal_value"] = np.arange(len(recs), dtype=np.uint64) * np.uint64(0x1_0000_0001)
    recs["chunk_id"] = np.arange(len(recs), dtype=np.uint32) + np.uint32(40)
    if signal_set:
        recs["flags"][::2] |= int(Flag.SIGNAL_SET)
    src, peers = tables()
    small = translate_module._translate_small(recs, src, peers, max_length)
    saved = translate_module.SMALL_BLOCK
    translate_module.SMALL_BLOCK = 0
    try:
        want = translate(recs, src, peers, max_length=max_length)
    finally:
        translate_module.SMALL_BLOCK = saved
    if small is None:
        return
    assert want.codes.tolist() == small.codes.tolist() == [0] * len(recs)
    assert want.plan.dtype == small.plan.dtype and np.array_equal(want.plan, small.plan)
    assert want.row_rec.dtype == small.row_rec.dtype and want.row_rec.tolist() == small.row_rec.tolist()
    assert want.row_conn.dtype == small.row_conn.dtype and want.row_conn.tolist() == small.row_conn.tolist()
    if len(recs) <= saved:
        assert np.array_equal(translate(recs, src, peers, max_length=max_length).plan, want.plan)
