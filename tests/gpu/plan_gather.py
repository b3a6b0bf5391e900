"""The all-gather-through-a-plan setup shared by the CUDA and Triton plan tests: two ranks on one GPU, each
with a gathered buffer (a registered region), a local shard, row sums and a status word; the same shape.

Producer tiles are 3 rows, chunks 7 tiles (a short last tile and a short last chunk), and the consumers'
16-row blocks align with neither, so some straddle two chunks and wait_range must wait for both.
"""

from __future__ import annotations

from typing import Any

import numpy as np

import gpuclient
from gpuclient.cuda_memory import DeviceMemory
from transportd_cli.localcluster import LocalCluster

WORLD = 2
ROWS_LOCAL = 203  # not a multiple of the tile, nor of the chunk
ROW_FLOATS = 96
ROW_BYTES = ROW_FLOATS * 4
ROWS = WORLD * ROWS_LOCAL
TILE_ROWS = 3
CHUNK_TILES = 7  # 21 rows a chunk: chunks end mid consumer block
CONSUMER_ROWS = 16
LAUNCHES = 3


def join_ranks(cluster: LocalCluster, job: str, device: int) -> list[dict[str, Any]]:
    """Every rank joins, registers its gathered buffer, builds the plan and its flags, exchanges and opens a
    channel (``rank["handle"]``: the tpd::Channel). Close with :func:`close_ranks`."""
    ranks: list[dict[str, Any]] = []
    try:
        for r, name in enumerate(cluster.names):
            client = gpuclient.connect(cluster.socket(name), timeout=60)
            session = client.join(job, rank=r, world=WORLD, device=device)
            ranks.append({"client": client, "session": session})
            gathered = DeviceMemory(ROWS * ROW_BYTES, device)
            region = session.register(gathered)
            plan = gpuclient.ChunkPlan.all_gather(
                rank=r, world=WORLD, shard_bytes=ROWS_LOCAL * ROW_BYTES, tile_bytes=TILE_ROWS * ROW_BYTES,
                chunk_tiles=CHUNK_TILES, src_region=region.id, dst_region=region.id)
            session.flags(plan.slot_base + plan.slot_count, where="device")
            ranks[-1].update({"gathered": gathered, "plan": plan, "x": DeviceMemory(ROWS_LOCAL * ROW_BYTES, device),
                              "sums": DeviceMemory(ROWS * 4, device), "status": DeviceMemory(8, device)})
        for rank in ranks:
            rank["session"].exchange(wait=False)
        for rank in ranks:
            rank["session"].exchange(timeout=60)
            rank["handle"] = rank["session"].channel(64).device_handle(device)
            rank["plan"].to_device(device)
    except BaseException:
        close_ranks(ranks)
        raise
    assert straddling_blocks(ranks[0]["plan"], 1), "some consumer blocks must straddle two chunks"
    return ranks


def straddling_blocks(plan: gpuclient.ChunkPlan, source: int) -> list[int]:
    """Consumer blocks whose rows from ``source`` span more than one incoming chunk."""
    out = []
    for r0 in range(0, ROWS, CONSUMER_ROWS):
        a, b = max(r0, source * ROWS_LOCAL), min(r0 + CONSUMER_ROWS, (source + 1) * ROWS_LOCAL)
        if a < b:
            first, end = plan.recv_span(source, a * ROW_BYTES, (b - a) * ROW_BYTES)
            if end - first > 1:
                out.append(r0)
    return out


def poison(ranks: list[dict[str, Any]], rng: np.random.Generator) -> list[np.ndarray]:
    """New shards for a launch; the gathered buffers and row sums poisoned with NaN. Returns the shards."""
    shards = [rng.standard_normal((ROWS_LOCAL, ROW_FLOATS), dtype=np.float32) for _ in ranks]
    for r, rank in enumerate(ranks):
        rank["x"].write(0, shards[r].tobytes())
        rank["gathered"].write(0, np.full((ROWS, ROW_FLOATS), np.nan, np.float32).tobytes())
        rank["sums"].write(0, np.full(ROWS, np.nan, np.float32).tobytes())
    return shards


def check_launch(ranks: list[dict[str, Any]], shards: list[np.ndarray], epoch: int) -> None:
    """Every rank's error word is 0, its gathered buffer is every shard, its row sums match, and each chunk's
    tile counter is epoch x its tiles (no reset between launches)."""
    full = np.concatenate(shards)
    for r, rank in enumerate(ranks):
        assert int.from_bytes(rank["status"].read(0, 4), "little") == 0, f"rank {r} channel error"
        got = np.frombuffer(rank["gathered"].read(0, ROWS * ROW_BYTES), np.float32).reshape(ROWS, -1)
        np.testing.assert_array_equal(got, full, err_msg=f"gathered rows, rank {r}, launch {epoch}")
        sums = np.frombuffer(rank["sums"].read(0, ROWS * 4), np.float32)
        np.testing.assert_allclose(sums, full.sum(axis=1), rtol=1e-4, atol=1e-3,
                                   err_msg=f"row sums (NaN: read before arrival), rank {r}, launch {epoch}")
        counters = rank["plan"].to_device(rank["gathered"].device).counters()
        np.testing.assert_array_equal(counters, epoch * rank["plan"].chunks["tiles"],
                                      err_msg=f"tile arrivals per chunk, rank {r}, launch {epoch}")


def close_ranks(ranks: list[dict[str, Any]]) -> None:
    for rank in ranks:
        rank["session"].leave()
        rank["client"].close()
