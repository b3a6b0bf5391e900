"""Checksummed record streams for the two-process tests and the ring benchmark.

Every record carries its stream index in ``chunk_id`` and a checksum of all its other fields in
``signal_value``, so a consumer can prove, vectorized, that nothing was lost, duplicated, reordered or
torn. A producer process runs :func:`produce` against a ring it attaches to by name.
"""

from __future__ import annotations

import time

import numpy as np

from cmd_ring.record import RECORD_DTYPE, Opcode
from cmd_ring.ring import RingFile, RingProducer

__all__ = ["checksummed_records", "checksum", "verify_stream", "produce", "TIMESTAMP_FIELD"]

_MIX = np.uint64(0x9E3779B97F4A7C15)
_VALID_OPCODES = np.array([int(op) for op in Opcode], dtype=np.uint8)
# For latency runs the producer stores its enqueue time (ns, CLOCK_MONOTONIC) here instead of a checksum.
TIMESTAMP_FIELD = "signal_value"


def checksum(records: np.ndarray) -> np.ndarray:
    """A 64-bit mix of every field except seq and signal_value, per record."""
    words = np.ascontiguousarray(records).view("<u8").reshape(len(records), 6)
    header = words[:, 0] >> np.uint64(32)  # opcode, flags, peer: seq is the ring's, not the payload's
    acc = header * _MIX
    for i in range(1, 5):
        acc = (acc ^ words[:, i]) * _MIX
        acc ^= acc >> np.uint64(29)
    return acc


def checksummed_records(start: int, count: int, rng: np.random.Generator) -> np.ndarray:
    """``count`` random records numbered from ``start``, each carrying its checksum."""
    recs = np.zeros(count, dtype=RECORD_DTYPE)
    recs["opcode"] = rng.choice(_VALID_OPCODES, count)
    recs["flags"] = rng.integers(0, 4, count, dtype=np.uint8)
    recs["peer"] = rng.integers(0, 1 << 16, count, dtype=np.uint16)
    recs["src_off"] = rng.integers(0, 1 << 63, count, dtype=np.uint64)
    recs["dst_off"] = rng.integers(0, 1 << 63, count, dtype=np.uint64)
    recs["length"] = rng.integers(1, 1 << 32, count, dtype=np.uint32)
    recs["src_region"] = rng.integers(0, 1 << 16, count, dtype=np.uint16)
    recs["dst_region"] = rng.integers(0, 1 << 16, count, dtype=np.uint16)
    recs["chunk_id"] = np.arange(start, start + count, dtype=np.uint64).astype(np.uint32)
    recs["signal_slot"] = rng.integers(0, 1 << 32, count, dtype=np.uint32)
    recs["signal_value"] = checksum(recs)
    return recs


def verify_stream(records: np.ndarray, expected_start: int) -> None:
    """Raise AssertionError unless ``records`` are stream indices ``expected_start``.. with good sums."""
    want = (np.arange(expected_start, expected_start + len(records), dtype=np.uint64)).astype(np.uint32)
    if not np.array_equal(records["chunk_id"], want):
        bad = int(np.flatnonzero(records["chunk_id"] != want)[0])
        raise AssertionError(
            f"record {expected_start + bad}: got stream index {int(records['chunk_id'][bad])} "
            "(lost, duplicated or reordered)"
        )
    sums = checksum(records)
    if not np.array_equal(sums, records["signal_value"]):
        bad = int(np.flatnonzero(sums != records["signal_value"])[0])
        raise AssertionError(f"record {expected_start + bad} is torn: checksum mismatch")


def produce(
    ring_name: str,
    total: int,
    seed: int,
    max_batch: int = 256,
    timestamps: bool = False,
    interval_ns: int = 0,
) -> None:
    """Push ``total`` records into ``ring_name`` in random-sized batches (a producer process's body).

    With ``timestamps`` the records carry their enqueue time instead of a checksum (latency runs);
    ``interval_ns`` paces the batches (spinning, so the pacing itself adds no sleep jitter).
    """
    rng = np.random.default_rng(seed)
    ring = RingFile.attach(ring_name)
    producer = RingProducer(ring)
    sent = 0
    pool = checksummed_records(0, max_batch * 64, rng)
    next_due = time.monotonic_ns()
    while sent < total:
        if interval_ns:
            while time.monotonic_ns() < next_due:
                pass
            next_due += interval_ns
        n = min(int(rng.integers(1, max_batch + 1)), total - sent)
        if timestamps:
            batch = pool[:n].copy()
            batch["chunk_id"] = np.arange(sent, sent + n, dtype=np.uint64).astype(np.uint32)
            batch[TIMESTAMP_FIELD] = time.monotonic_ns()
        else:
            batch = checksummed_records(sent, n, rng)
        producer.push_records(batch, timeout=60.0)
        sent += n
    ring.close()
