"""An all-gather through a chunk plan from a CUDA kernel: two daemons (ib and efa), two ranks on one GPU.

Producer tiles are a few rows, chunks a whole number of tiles (with a short last tile and a short last
chunk), and the consumers' row blocks align with neither, so some of them straddle two chunks and
wait_range must wait for both. The rows owed by the peer are poisoned with NaN before every launch and
the launches reuse the flags and the tile counters with no reset: a read before arrival, or a chunk
shipped before its last tile, shows as NaN or stale data in the row sums or the gathered buffer.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import gpuclient
from gpuclient.cuda_memory import DeviceMemory, check, driver
from transportd_cli.localcluster import LocalCluster

KERNELS = Path(__file__).with_name("plan_kernels.cu")
GATHER_DTYPE = np.dtype([(name, "<u4") for name in ("rank", "world", "rows_local", "row_floats", "tile_rows",
                                                    "consumer_rows", "per_lane", "pad")])
WORLD = 2
ROWS_LOCAL = 203  # not a multiple of the tile, nor of the chunk
ROW_FLOATS = 96
TILE_ROWS = 3
CHUNK_TILES = 7  # 21 rows a chunk: chunks end mid consumer block
CONSUMER_ROWS = 16
LAUNCHES = 3


@pytest.mark.parametrize("per_lane", [False, True], ids=["block-tiles", "warp-tiles"])
@pytest.mark.parametrize("backend", ["ib", "efa"])
def test_plan_allgather_waits_for_every_chunk_a_range_touches(cuda_device, backend: str, per_lane: bool) -> None:
    drv = driver()
    module = gpuclient.compile(KERNELS.read_text(), device=cuda_device, debug=True, name="plan_kernels.cu")
    rng = np.random.default_rng(7)
    row_bytes = ROW_FLOATS * 4
    rows = WORLD * ROWS_LOCAL
    ranks = []
    with LocalCluster(WORLD, backend=backend, overrides={"peers": {"heartbeat_timeout_s": 20.0}}) as cluster:
        try:
            for r, name in enumerate(cluster.names):
                client = gpuclient.connect(cluster.socket(name), timeout=60)
                session = client.join("plan-allgather", rank=r, world=WORLD, device=cuda_device)
                gathered = DeviceMemory(rows * row_bytes, cuda_device)
                region = session.register(gathered)
                plan = gpuclient.ChunkPlan.all_gather(
                    rank=r, world=WORLD, shard_bytes=ROWS_LOCAL * row_bytes, tile_bytes=TILE_ROWS * row_bytes,
                    chunk_tiles=CHUNK_TILES, src_region=region.id, dst_region=region.id)
                session.flags(plan.slot_base + plan.slot_count, where="device")
                ranks.append({"client": client, "session": session, "gathered": gathered, "region": region,
                              "plan": plan, "x": DeviceMemory(ROWS_LOCAL * row_bytes, cuda_device),
                              "sums": DeviceMemory(rows * 4, cuda_device), "status": DeviceMemory(8, cuda_device)})
            for rank in ranks:
                rank["session"].exchange(wait=False)
            for rank in ranks:
                rank["session"].exchange(timeout=60)
                rank["handle"] = rank["session"].channel(64).device_handle(cuda_device)
                rank["plan"].to_device(cuda_device)
                rank["stream"] = check(drv.cuStreamCreate(drv.CUstream_flags.CU_STREAM_NON_BLOCKING), "stream")
            spans = [ranks[0]["plan"].recv_span(1, b * row_bytes, CONSUMER_ROWS * row_bytes)
                     for b in range(0, rows, CONSUMER_ROWS)]
            straddling = [first for first, end in spans if end - first > 1]
            assert straddling, "the shape must make some consumer blocks straddle two chunks"
            for epoch in range(1, LAUNCHES + 1):
                shards = [rng.standard_normal((ROWS_LOCAL, ROW_FLOATS), dtype=np.float32) for _ in range(WORLD)]
                for r, rank in enumerate(ranks):
                    rank["x"].write(0, shards[r].tobytes())
                    rank["gathered"].write(0, np.full((rows, ROW_FLOATS), np.nan, np.float32).tobytes())
                    rank["sums"].write(0, np.full(rows, np.nan, np.float32).tobytes())
                for r, rank in enumerate(ranks):
                    g = np.zeros(1, GATHER_DTYPE)
                    g[0] = (r, WORLD, ROWS_LOCAL, ROW_FLOATS, TILE_ROWS, CONSUMER_ROWS, int(per_lane), 0)
                    module.function("plan_allgather").launch(
                        16, 128, (rank["handle"], rank["plan"].handle(epoch), g, np.uint64(rank["x"].ptr),
                                  np.uint64(rank["gathered"].ptr), np.uint64(rank["sums"].ptr)),
                        stream=rank["stream"])
                    module.function("plan_quiet_status").launch(1, 1, (rank["handle"], np.uint64(rank["status"].ptr)),
                                                                stream=rank["stream"])
                for rank in ranks:
                    check(drv.cuStreamSynchronize(rank["stream"]), "cuStreamSynchronize")
                full = np.concatenate(shards)
                for r, rank in enumerate(ranks):
                    assert int.from_bytes(rank["status"].read(0, 4), "little") == 0, f"rank {r} channel error"
                    got = np.frombuffer(rank["gathered"].read(0, rows * row_bytes), np.float32).reshape(rows, -1)
                    np.testing.assert_array_equal(got, full, err_msg=f"gathered rows, rank {r}, launch {epoch}")
                    sums = np.frombuffer(rank["sums"].read(0, rows * 4), np.float32)
                    np.testing.assert_allclose(sums, full.sum(axis=1), rtol=1e-4, atol=1e-3,
                                               err_msg=f"row sums (NaN: read before arrival), rank {r}, launch {epoch}")
        finally:
            for rank in ranks:
                rank["session"].leave()
                rank["client"].close()
