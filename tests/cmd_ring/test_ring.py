"""The ring in one process: laps, credits, the commit protocol, attach errors."""

from __future__ import annotations

import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cmd_ring import (
    RECORD_DTYPE,
    RingConsumer,
    RingError,
    RingFile,
    RingFullError,
    RingLayoutError,
    RingNotFoundError,
    RingProducer,
    seq_for,
)


def numbered(start: int, count: int) -> np.ndarray:
    recs = np.zeros(count, dtype=RECORD_DTYPE)
    recs["opcode"] = 1
    recs["chunk_id"] = np.arange(start, start + count)
    recs["signal_value"] = recs["chunk_id"].astype(np.uint64) * 0x9E3779B97F4A7C15
    return recs


@settings(max_examples=60, deadline=None)
@given(
    capacity_log2=st.integers(1, 6),
    pushes=st.lists(st.integers(1, 64), min_size=1, max_size=200),
    takes=st.lists(st.one_of(st.none(), st.integers(1, 64)), min_size=1, max_size=50),
)
def test_many_laps_keep_order_and_lose_nothing(capacity_log2, pushes, takes) -> None:
    with RingFile.create(f"tpd-test-laps-{os.getpid()}", 1 << capacity_log2) as ring:
        check_laps(ring, pushes, takes)


def check_laps(ring: RingFile, pushes: list[int], takes: list[int | None]) -> None:
    producer, consumer = RingProducer(ring), RingConsumer(ring)
    sent = taken = 0
    got: list[np.ndarray] = []
    for i, n in enumerate(pushes):
        n = min(n, ring.capacity)
        if producer.push_records(numbered(sent, n), block=False):
            sent += n
        out = consumer.consume_ready(takes[i % len(takes)])
        taken += len(out)
        got.append(out["chunk_id"])
    got.append(consumer.consume_ready()["chunk_id"])
    assert np.concatenate(got).tolist() == list(range(sent))
    assert consumer.position == ring.consumer_pos == sent


def test_credits_never_let_a_producer_overwrite_an_unconsumed_slot(make_ring) -> None:
    ring = make_ring(8)
    producer, consumer = RingProducer(ring), RingConsumer(ring)
    assert producer.push_records(numbered(0, 8))
    before = ring.records.copy()
    assert producer.push(numbered(8, 1)[0], block=False) is False
    with pytest.raises(RingFullError, match="stayed full"):
        producer.push(numbered(8, 1)[0], timeout=0.05)
    assert (ring.records == before).all(), "a full ring was written"
    assert consumer.consume_ready(3)["chunk_id"].tolist() == [0, 1, 2]
    assert producer.free_slots() == 3
    assert producer.push_records(numbered(8, 3), block=False)
    assert producer.push(numbered(11, 1)[0], block=False) is False
    assert consumer.consume_ready()["chunk_id"].tolist() == list(range(3, 11))


def test_unreleased_slots_stay_owned_by_the_consumer(make_ring) -> None:
    ring = make_ring(4)
    producer, consumer = RingProducer(ring), RingConsumer(ring)
    producer.push_records(numbered(0, 4))
    assert len(consumer.consume_ready(release=False)) == 4
    assert producer.free_slots() == 0
    consumer.release()
    assert producer.free_slots() == 4


def test_a_record_whose_header_is_not_committed_is_never_returned(make_ring) -> None:
    ring = make_ring(8)
    producer, consumer = RingProducer(ring), RingConsumer(ring)
    producer.push_records(numbered(0, 2))
    # A producer stopped between the body and the header: slot 2 has a body but the old header.
    body = numbered(2, 1).view("<u8")
    ring.words[2, 1:] = body[1:]
    assert consumer.consume_ready()["chunk_id"].tolist() == [0, 1]
    assert consumer.consume_ready().size == 0
    # A committed slot after an uncommitted one is not returned either (order is kept).
    ring.words[3, 1:] = numbered(3, 1).view("<u8")[1:]
    ring.records["seq"][3] = seq_for(3)
    ring.records["opcode"][3] = 1
    assert consumer.consume_ready().size == 0
    ring.records["opcode"][2] = 1
    ring.records["seq"][2] = seq_for(2)  # the header lands last
    assert consumer.consume_ready()["chunk_id"].tolist() == [2, 3]


def test_a_record_from_an_older_lap_is_never_returned(make_ring) -> None:
    ring = make_ring(4)
    producer, consumer = RingProducer(ring), RingConsumer(ring)
    producer.push_records(numbered(0, 4))
    assert len(consumer.consume_ready()) == 4
    # Lap 1 begins: every slot still holds lap 0's records with lap 0's stamps.
    assert consumer.consume_ready().size == 0
    # A stale stamp from two laps back in slot 0 is refused as well.
    ring.records["seq"][0] = seq_for(0)
    assert consumer.consume_ready().size == 0
    producer.push_records(numbered(4, 1))
    assert consumer.consume_ready()["chunk_id"].tolist() == [4]


def test_never_written_zero_slots_are_never_returned(make_ring) -> None:
    ring = make_ring(16)
    assert RingConsumer(ring).consume_ready().size == 0
    assert not ring.records.view(np.uint8).any()


def test_seq_wraps_at_u32_in_the_ring(make_ring) -> None:
    ring = make_ring(8)
    start = 2**32 - 4  # cross the point where seq wraps from 2**32-1 back to 1
    ring._consumer_pos[0] = start
    ring._producer_pos[0] = start
    producer, consumer = RingProducer(ring), RingConsumer(ring)
    for lap in range(3):
        producer.push_records(numbered(lap * 8, 8))
        assert consumer.consume_ready()["chunk_id"].tolist() == list(range(lap * 8, lap * 8 + 8))


def test_error_word_and_completion_position(make_ring) -> None:
    ring = make_ring(8)
    assert ring.error == (0, 0, 0)
    ring.report_error(3, 17)
    ring.report_error(5, 18)
    assert ring.error == (3, 2, 17)
    # a record taken earlier that fails later (a completion out of ring order) moves the position down to it
    ring.report_error(14, 12, count=2)
    assert ring.error == (14, 4, 12)
    ring.report_error(5, 13)
    assert ring.error == (14, 5, 12)
    ring.publish_completion(10)
    ring.publish_completion(4)
    assert ring.completion_pos == 10
    with pytest.raises(ValueError):
        ring.report_error(0, 1)


def test_attach_sees_the_same_memory(make_ring, ring_name) -> None:
    ring = make_ring(16)
    other = RingFile.attach(ring_name)
    try:
        assert other.capacity == 16
        RingProducer(other).push_records(numbered(0, 5))
        assert RingConsumer(ring).consume_ready()["chunk_id"].tolist() == [0, 1, 2, 3, 4]
        assert other.consumer_pos == 5
    finally:
        other.close()


def test_attach_to_a_missing_ring_fails_clearly(ring_name) -> None:
    with pytest.raises(RingNotFoundError, match="no ring at /dev/shm/"):
        RingFile.attach(ring_name)


def test_attach_to_a_wrong_sized_ring_fails_clearly(make_ring, ring_name) -> None:
    ring = make_ring(64)
    os.truncate(ring.path, ring.size - 4096)
    with pytest.raises(RingLayoutError, match="truncated or corrupt"):
        RingFile.attach(ring_name)


def test_attach_to_a_foreign_file_fails_clearly(ring_name, tmp_path) -> None:
    path = tmp_path / "not-a-ring"
    path.write_bytes(b"x" * 8192)
    with pytest.raises(RingLayoutError, match="not a transportd ring"):
        RingFile.attach(str(path))
    (tmp_path / "tiny").write_bytes(b"x" * 10)
    with pytest.raises(RingLayoutError, match="smaller than"):
        RingFile.attach(str(tmp_path / "tiny"))


def test_create_refuses_bad_capacity_and_existing_names(make_ring, ring_name) -> None:
    with pytest.raises(RingError, match="power of two"):
        RingFile.create(ring_name, 12)
    make_ring(8)
    with pytest.raises(RingError, match="already exists"):
        RingFile.create(ring_name, 8)
