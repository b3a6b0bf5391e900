"""Many blocks and warps push 10^6 checksummed commands into a ring of 1024 slots while a host consumer takes
them: none lost, torn or duplicated, for every header-last commit variant and for the warp-cooperative push
(the design's torn-record rule)."""

from __future__ import annotations

import os

import numpy as np
import pytest

from cmd_ring import RECORD_DTYPE, RingConsumer, RingFile
from gpuclient.cuda_memory import check, driver
from gpuclient.device_channel import map_ring
from tests.support.waiting import wait_until

TOTAL = 1_000_000
CAPACITY = 1024
M64 = np.uint64(0xFFFFFFFFFFFFFFFF)


def mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser, as kernels.cu computes it (uint64 arithmetic wraps)."""
    with np.errstate(over="ignore"):
        z = x.astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def expected_records(ids: np.ndarray) -> np.ndarray:
    ids = ids.astype(np.uint64)
    a, b, c = mix64(ids), mix64(ids ^ np.uint64(0x5555)), mix64(ids ^ np.uint64(0xAAAA))
    out = np.zeros(len(ids), dtype=RECORD_DTYPE)
    words = out.view("<u8").reshape(len(ids), 6)
    words[:, 0] = ((np.uint64(1) + ids % np.uint64(5)) << np.uint64(32)) | ((ids & np.uint64(3)) << np.uint64(40)) \
        | (((ids >> np.uint64(3)) & np.uint64(0xFFFF)) << np.uint64(48))
    words[:, 1] = a
    words[:, 2] = b
    words[:, 3] = (c & np.uint64(0xFFFFFFFFFFFF)) | ((ids & np.uint64(0xFFFF)) << np.uint64(48))
    words[:, 4] = ids | (((~ids) & np.uint64(0xFFFFFFFF)) << np.uint64(32))
    words[:, 5] = a ^ b ^ c
    return out


@pytest.mark.parametrize("variant", ["release_sys", "fence_sys", "v2_release", "v2_split", "warp"])
def test_million_checksummed_pushes_none_lost_torn_or_duplicated(kernels, cuda_device, variant: str) -> None:
    drv = driver()
    name = f"tpd-gpu-stress-{os.getpid()}-{variant}"
    with RingFile.create(name, CAPACITY) as ring:
        dev = map_ring(ring, cuda_device)
        consumer = RingConsumer(ring)
        stream = check(drv.cuStreamCreate(drv.CUstream_flags.CU_STREAM_NON_BLOCKING), "cuStreamCreate")
        try:
            kernels.function(f"stress_{variant}").launch(132, 256, (dev, np.uint32(TOTAL)), stream=stream)
            taken: list[np.ndarray] = []
            count = 0

            def all_arrived() -> bool:
                nonlocal count
                recs = consumer.consume_ready(4096)
                if len(recs):
                    taken.append(recs)
                    count += len(recs)
                return count >= TOTAL

            wait_until(all_arrived, lambda: f"{TOTAL} records (only {count} arrived)", 120, interval=0)  # spins
            check(drv.cuStreamSynchronize(stream), "cuStreamSynchronize")
            assert consumer.ready_count() == 0  # nothing beyond TOTAL
            assert dev.head() == TOTAL
        finally:
            drv.cuStreamDestroy(stream)
            dev.release()
    got = np.concatenate(taken)
    ids = got["chunk_id"].astype(np.int64)
    assert np.bincount(ids, minlength=TOTAL).max() == 1, "a command arrived twice"
    assert len(np.unique(ids)) == TOTAL, "a command was lost"
    want = expected_records(got["chunk_id"])
    gw, ww = got.view("<u8").reshape(-1, 6), want.view("<u8").reshape(-1, 6)
    header_ok = (gw[:, 0] >> np.uint64(32)) == (ww[:, 0] >> np.uint64(32))  # opcode, flags, peer
    torn = np.flatnonzero((gw[:, 1:] != ww[:, 1:]).any(axis=1) | ~header_ok)
    assert len(torn) == 0, f"{len(torn)} torn records, e.g. {got[torn[:3]]} vs {want[torn[:3]]}"
    # seq is the lap stamp of each record's ring position, in order
    assert np.array_equal(got["seq"], (np.arange(TOTAL, dtype=np.uint64) % np.uint64(0xFFFFFFFF) + 1).astype(np.uint32))
