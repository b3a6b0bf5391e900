"""The counting scheme without verbs: every delivery order SRD could produce, flags never before data."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from efa.errors import ProtocolViolation
from efa.wire import (
    CTRL_DTYPE,
    INDEX_BITS,
    INDEX_MASK,
    KIND_CTRL,
    KIND_DATA,
    OP_ADD,
    OP_SET,
    decode_imm,
    encode_imm,
    unwrap,
)
from transportd.backends.interface import SignalOp
from transportd_models.arrivals import ArrivalTracker, SenderGroups


def test_imm_round_trip() -> None:
    for kind in (KIND_DATA, KIND_CTRL):
        for conn in (0, 1, 4095):
            for index in (0, 1, INDEX_MASK, 12345):
                imm = encode_imm(kind, conn, index)
                assert 0 <= imm < 1 << 32
                assert decode_imm(imm) == (kind, conn, index)
    assert encode_imm(KIND_DATA, 3, (1 << INDEX_BITS) + 7) == encode_imm(KIND_DATA, 3, 7)


def test_unwrap_is_nearest() -> None:
    assert unwrap(5, 8, 250) == 261
    assert unwrap(250, 8, 5) == -6
    assert unwrap(100, 8, 100) == 100
    for ref in (0, 1000, (1 << 32) - 3, 1 << 40):
        for delta in (-(1 << 17), -1, 0, 1, (1 << 17) - 1):
            assert unwrap((ref + delta) & INDEX_MASK, INDEX_BITS, ref) == ref + delta


# --- a model of one connection: rows in, messages out, any delivery order ------------------------------


@dataclass
class Model:
    """What the sender posted, and which pieces each signal must wait for (its coverage)."""

    cumulative: bool = False
    sender: SenderGroups = field(default_factory=SenderGroups)
    messages: list[tuple] = field(default_factory=list)  # ("piece", group, piece_id) | ("rec", seq, record)
    covers: list[set[int]] = field(default_factory=list)  # per signal: piece ids
    slots: list[tuple[int, int]] = field(default_factory=list)  # per signal: (rank, slot)
    npieces: int = 0
    since_signal: set[int] = field(default_factory=set)  # pieces of the open group
    group_pieces: set[int] = field(default_factory=set)
    before_fence: set[int] = field(default_factory=set)
    all_pieces: set[int] = field(default_factory=set)
    closed: bool = False

    def __post_init__(self) -> None:
        self.sender = SenderGroups(cumulative=self.cumulative)

    def write(self, pieces: int) -> None:
        group = self.sender.piece_group(pieces)
        if self.closed:
            self.group_pieces = set()
            self.closed = False
        for _ in range(pieces):
            pid = self.npieces
            self.npieces += 1
            self.group_pieces.add(pid)
            self.all_pieces.add(pid)
            self.messages.append(("piece", group & INDEX_MASK, pid))

    def signal(self, rank: int, slot: int, op: int) -> None:
        rec = np.zeros(1, dtype=CTRL_DTYPE)
        k = len(self.covers)
        seq = self.sender.signal(rec[0], op, k + 1, rank, slot)  # value names the signal
        cover = set(self.group_pieces) | self.before_fence
        if self.cumulative:
            cover |= self.all_pieces
        for j, key in enumerate(self.slots):  # transitively, what earlier signals on the flag covered
            if key == (rank, slot):
                cover |= self.covers[j]
        self.covers.append(cover)
        self.slots.append((rank, slot))
        self.messages.append(("rec", seq & INDEX_MASK, rec[0]))
        self.closed = True

    def fence(self) -> None:
        rec = np.zeros(1, dtype=CTRL_DTYPE)
        seq = self.sender.fence(rec[0])
        self.before_fence = set(self.all_pieces)
        self.messages.append(("rec", seq & INDEX_MASK, rec[0]))
        self.closed = True


class Receiver:
    """An ArrivalTracker plus what has really arrived, to judge each publication against."""

    def __init__(self, tracker: ArrivalTracker | None = None) -> None:
        self.tracker = tracker or ArrivalTracker()
        self.arrived: set[int] = set()

    def feed(self, model: Model, order: list[int]) -> list[int]:
        """Deliver messages in ``order``; check every publication; returns the published signal ids."""
        tracker = self.tracker
        published: list[int] = []
        for i in order:
            msg = model.messages[i]
            if msg[0] == "piece":
                tracker.on_piece(msg[1])
                self.arrived.add(msg[2])
            else:
                tracker.on_record(msg[1], msg[2])
            for pub in tracker.ready():
                k = pub.value - 1
                assert (pub.rank, pub.slot) == model.slots[k]
                missing = model.covers[k] - self.arrived
                assert not missing, f"signal {k} published before pieces {sorted(missing)} arrived"
                published.append(k)
        return published


def deliver(model: Model, order: list[int]) -> list[int]:
    return Receiver().feed(model, order)


def check_complete(model: Model, published: list[int]) -> None:
    assert sorted(published) == list(range(len(model.covers))), "every signal is published exactly once"
    last: dict[tuple[int, int], int] = {}
    for k in published:  # signals to one flag are published in posting order
        key = model.slots[k]
        assert last.get(key, -1) < k
        last[key] = k


rows = st.lists(
    st.one_of(
        st.tuples(st.just("w"), st.integers(1, 3)),
        st.tuples(st.just("s"), st.integers(0, 1), st.integers(0, 2), st.sampled_from([OP_ADD, OP_SET])),
        st.tuples(st.just("f")),
    ),
    min_size=1,
    max_size=40,
)


def build(ops: list[tuple], cumulative: bool) -> Model:
    model = Model(cumulative=cumulative)
    for op in ops:
        if op[0] == "w":
            model.write(op[1])
        elif op[0] == "s":
            model.signal(op[1], op[2], op[3])
        else:
            model.fence()
    return model


@settings(max_examples=300, deadline=None)
@given(ops=rows, seed=st.integers(0, 2**32 - 1), cumulative=st.booleans())
def test_flags_never_before_data_in_any_order(ops: list[tuple], seed: int, cumulative: bool) -> None:
    model = build(ops, cumulative)
    order = list(range(len(model.messages)))
    random.Random(seed).shuffle(order)
    rx = Receiver()
    check_complete(model, rx.feed(model, order))
    assert rx.tracker.idle()


def test_reverse_and_in_order_delivery() -> None:
    model = build([("w", 3), ("s", 0, 0, OP_ADD), ("w", 1), ("f",), ("w", 2), ("s", 0, 1, OP_SET),
                   ("s", 0, 0, OP_ADD)], cumulative=False)
    n = len(model.messages)
    check_complete(model, deliver(model, list(range(n))))
    check_complete(model, deliver(model, list(range(n))[::-1]))


def test_signal_waits_only_for_its_group_without_fence() -> None:
    model = build([("w", 1), ("s", 0, 0, OP_ADD), ("w", 1), ("s", 0, 1, OP_ADD)], cumulative=False)
    # piece 0, rec 0 (signal 0), piece 1, rec 1 (signal 1): deliver piece 1 and both records, not piece 0
    rx = Receiver()
    assert rx.feed(model, [2, 3, 1]) == [1]  # slot 1's signal covers only piece 1
    assert rx.feed(model, [0]) == [0]


def test_fence_makes_later_signals_wait() -> None:
    model = build([("w", 1), ("f",), ("w", 1), ("s", 0, 1, OP_ADD)], cumulative=False)
    rx = Receiver()
    assert rx.feed(model, [1, 2, 3]) == []  # everything but the piece before the FENCE
    assert rx.feed(model, [0]) == [0]


def test_same_flag_is_published_in_order() -> None:
    model = build([("w", 1), ("s", 0, 0, OP_SET), ("w", 1), ("s", 0, 0, OP_SET)], cumulative=False)
    rx = Receiver()
    assert rx.feed(model, [2, 3, 1]) == []  # the second SET must not land before the first
    assert rx.feed(model, [0]) == [0, 1]


def test_publication_carries_op() -> None:
    model = build([("w", 1), ("s", 2, 7, OP_SET)], cumulative=False)
    tracker = ArrivalTracker()
    tracker.on_piece(model.messages[0][1])
    tracker.on_record(model.messages[1][1], model.messages[1][2])
    (pub,) = tracker.ready()
    assert (pub.rank, pub.slot, pub.op, pub.value) == (2, 7, SignalOp.SET, 1)


def test_counters_wrap() -> None:
    """Groups past 2**18 (the immediate) and record numbers past 2**32 (the record) unwrap correctly."""
    model = Model()
    start_group = (1 << INDEX_BITS) - 3
    model.sender.group = start_group
    model.sender.seq = (1 << 32) - 4
    tracker = ArrivalTracker()
    tracker.low = start_group
    tracker.next_seq = (1 << 32) - 4
    rng = random.Random(7)
    for _ in range(12):
        model.write(rng.randint(1, 3))
        model.signal(0, rng.randint(0, 3), OP_ADD)
    # deliver with bounded reordering (a sliding window), as a real stream would
    pending = list(range(len(model.messages)))
    order = []
    window: list[int] = []
    while pending or window:
        while pending and len(window) < 6:
            window.append(pending.pop(0))
        order.append(window.pop(rng.randrange(len(window))))
    check_complete(model, Receiver(tracker).feed(model, order))
    assert tracker.low > 1 << INDEX_BITS
    assert tracker.next_seq > 1 << 32


def test_overwritten_record_is_detected() -> None:
    model = build([("w", 1), ("s", 0, 0, OP_ADD)], cumulative=False)
    tracker = ArrivalTracker()
    _, _, rec = model.messages[1]
    with pytest.raises(ProtocolViolation, match="overwritten"):
        tracker.on_record(5, rec)


def test_more_pieces_than_announced_is_refused() -> None:
    model = build([("w", 1), ("s", 0, 0, OP_ADD)], cumulative=False)
    tracker = ArrivalTracker()
    tracker.on_piece(model.messages[0][1])
    tracker.on_piece(model.messages[0][1])
    with pytest.raises(ProtocolViolation):
        tracker.on_record(model.messages[1][1], model.messages[1][2])
