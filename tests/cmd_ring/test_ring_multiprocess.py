"""A producer and a consumer in two real processes: 10^6 records, none lost, duplicated, reordered, torn."""

from __future__ import annotations

import multiprocessing as mp

import pytest

from cmd_ring import RingConsumer, RingFile
from cmd_ring.loadgen import produce, verify_stream
from tests.support.waiting import wait_until

pytestmark = pytest.mark.multiprocess  # several processes: the unit tests run apart with -m 'not multiprocess'


@pytest.mark.parametrize("capacity", [4096])
def test_two_processes_exchange_a_million_checksummed_records(ring_name: str, capacity: int) -> None:
    total = 1_000_000
    ring = RingFile.create(ring_name, capacity)
    proc = mp.get_context("spawn").Process(target=produce, args=(ring_name, total, 1234))
    proc.start()
    consumer = RingConsumer(ring)
    received = 0

    def all_arrived() -> bool:
        nonlocal received
        batch = consumer.consume_ready()
        if batch.size:
            verify_stream(batch, received)
            received += batch.size
        elif not proc.is_alive() and proc.exitcode:
            pytest.fail(f"producer died with exit code {proc.exitcode}")
        return received >= total

    try:
        wait_until(all_arrived, lambda: f"{total} records (only {received} arrived)", 120, interval=0)  # spins
        proc.join(30)
        assert proc.exitcode == 0
        assert consumer.consume_ready().size == 0, "records beyond the stream arrived"
        assert received == total
    finally:
        if proc.is_alive():
            proc.kill()
        ring.close()
        ring.unlink()


def test_verify_stream_catches_torn_lost_and_reordered_records() -> None:
    # The checker itself must be able to fail, or the test above proves nothing.
    import numpy as np

    from cmd_ring.loadgen import checksummed_records

    recs = checksummed_records(0, 16, np.random.default_rng(0))
    verify_stream(recs, 0)
    torn = recs.copy()
    torn["dst_off"][5] ^= 1
    with pytest.raises(AssertionError, match="torn"):
        verify_stream(torn, 0)
    with pytest.raises(AssertionError, match="lost, duplicated or reordered"):
        verify_stream(np.concatenate([recs[:3], recs[4:]]), 0)
    with pytest.raises(AssertionError, match="lost, duplicated or reordered"):
        verify_stream(recs[::-1], 0)
