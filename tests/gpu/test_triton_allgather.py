"""An all-gather through a chunk plan from a Triton kernel (gpuclient.triton): two daemons (ib and efa), two
ranks on one GPU — the Triton twin of test_plan_allgather.py, same shapes.

Producer tiles are 3 rows, chunks 7 tiles (with a short last tile and a short last chunk), and the consumers'
16-row blocks align with neither, so some straddle two chunks and wait_range must wait for both. The whole
gathered buffer is poisoned with NaN before every launch (the peer's rows, and our own until the producers
write them), and the launches reuse the flags and the tile counters with no reset (launch k waits for k):
a read before arrival, or a chunk shipped before its last tile, shows as NaN or stale data in the row sums
or the gathered buffer. The channel's error word must stay 0.

Triton launches through PyTorch's current stream, so each rank's kernels run on a PyTorch stream of its own
(both ranks' kernels must be resident together: each waits for the other's chunks).
"""

from __future__ import annotations

import numpy as np
import pytest

import gpuclient
from gpuclient.cuda_memory import DeviceMemory
from transportd_cli.localcluster import LocalCluster

WORLD = 2
ROWS_LOCAL = 203  # not a multiple of the tile, nor of the chunk
ROW_FLOATS = 96
TILE_ROWS = 3
CHUNK_TILES = 7  # 21 rows a chunk: chunks end mid consumer block
CONSUMER_ROWS = 16
PROGRAMS = 16  # per rank: both ranks' grids fit on the GPU at once
LAUNCHES = 3


def _straddling_blocks(plan: gpuclient.ChunkPlan, source: int, row_bytes: int) -> list[int]:
    """Consumer blocks whose rows from ``source`` span more than one incoming chunk."""
    out = []
    for r0 in range(0, WORLD * ROWS_LOCAL, CONSUMER_ROWS):
        a, b = max(r0, source * ROWS_LOCAL), min(r0 + CONSUMER_ROWS, (source + 1) * ROWS_LOCAL)
        if a < b:
            first, end = plan.recv_span(source, a * row_bytes, (b - a) * row_bytes)
            if end - first > 1:
                out.append(r0)
    return out


@pytest.mark.parametrize("backend", ["ib", "efa"])
def test_triton_allgather_waits_for_every_chunk_a_range_touches(cuda_device, backend: str) -> None:
    pytest.importorskip("triton", reason="gpuclient.triton needs Triton: pip install 'transportd[triton]'")
    torch = pytest.importorskip("torch", reason="Triton launches kernels on PyTorch's CUDA streams")
    import gpuclient.triton as tdt
    from tests.gpu.triton_allgather import allgather_rowsum, quiet_status

    rng = np.random.default_rng(11)
    row_bytes = ROW_FLOATS * 4
    rows = WORLD * ROWS_LOCAL
    ranks: list[dict] = []
    with LocalCluster(WORLD, backend=backend, overrides={"peers": {"heartbeat_timeout_s": 20.0}}) as cluster:
        try:
            for r, name in enumerate(cluster.names):
                client = gpuclient.connect(cluster.socket(name), timeout=60)
                session = client.join("triton-allgather", rank=r, world=WORLD, device=cuda_device)
                gathered = DeviceMemory(rows * row_bytes, cuda_device)
                region = session.register(gathered)
                plan = gpuclient.ChunkPlan.all_gather(
                    rank=r, world=WORLD, shard_bytes=ROWS_LOCAL * row_bytes, tile_bytes=TILE_ROWS * row_bytes,
                    chunk_tiles=CHUNK_TILES, src_region=region.id, dst_region=region.id)
                session.flags(plan.slot_base + plan.slot_count, where="device")
                ranks.append({"client": client, "session": session, "gathered": gathered, "plan": plan,
                              "x": DeviceMemory(ROWS_LOCAL * row_bytes, cuda_device),
                              "sums": DeviceMemory(rows * 4, cuda_device), "status": DeviceMemory(8, cuda_device)})
            for rank in ranks:
                rank["session"].exchange(wait=False)
            for rank in ranks:
                rank["session"].exchange(timeout=60)
                handle = rank["session"].channel(64).device_handle(cuda_device)
                rank["ch"] = tdt.channel_pointer(handle)  # device copies, made once for every launch
                rank["plan_ptr"] = tdt.plan_pointer(rank["plan"], cuda_device)
                rank["stream"] = torch.cuda.Stream(device=cuda_device)
                rank["args"] = [tdt.device_pointer(rank[k], "float32") for k in ("x", "gathered", "sums")]
                rank["status_ptr"] = tdt.device_pointer(rank["status"], "uint32")
            assert _straddling_blocks(ranks[0]["plan"], 1, row_bytes), "some consumer blocks must straddle chunks"
            assert ranks[0]["plan"].tile_count == -(-ROWS_LOCAL // TILE_ROWS)
            launch = {"ROW_FLOATS": ROW_FLOATS, "ROW_BLOCK": 128, "TILE_ROWS": TILE_ROWS, "TILE_BLOCK": 4,
                      "CONSUMER_ROWS": CONSUMER_ROWS, "num_warps": 4}
            # compile before the first launch: rank 0's kernel must not wait on a compile for rank 1's
            allgather_rowsum.warmup(ranks[0]["ch"], ranks[0]["plan_ptr"], 1, *ranks[0]["args"], 0, WORLD, ROWS_LOCAL,
                                    ranks[0]["plan"].tile_count, grid=(PROGRAMS,), **launch)
            quiet_status.warmup(ranks[0]["ch"], ranks[0]["status_ptr"], grid=(1,), num_warps=1)
            for epoch in range(1, LAUNCHES + 1):
                shards = [rng.standard_normal((ROWS_LOCAL, ROW_FLOATS), dtype=np.float32) for _ in range(WORLD)]
                for r, rank in enumerate(ranks):
                    rank["x"].write(0, shards[r].tobytes())
                    rank["gathered"].write(0, np.full((rows, ROW_FLOATS), np.nan, np.float32).tobytes())
                    rank["sums"].write(0, np.full(rows, np.nan, np.float32).tobytes())
                for r, rank in enumerate(ranks):
                    x, gathered, sums = rank["args"]
                    with torch.cuda.stream(rank["stream"]):
                        allgather_rowsum[(PROGRAMS,)](rank["ch"], rank["plan_ptr"], epoch, x, gathered, sums, r, WORLD,
                                                      ROWS_LOCAL, rank["plan"].tile_count, **launch)
                        quiet_status[(1,)](rank["ch"], rank["status_ptr"], num_warps=1)
                for rank in ranks:
                    rank["stream"].synchronize()
                full = np.concatenate(shards)
                for r, rank in enumerate(ranks):
                    assert int.from_bytes(rank["status"].read(0, 4), "little") == 0, f"rank {r} channel error"
                    got = np.frombuffer(rank["gathered"].read(0, rows * row_bytes), np.float32).reshape(rows, -1)
                    np.testing.assert_array_equal(got, full, err_msg=f"gathered rows, rank {r}, launch {epoch}")
                    got_sums = np.frombuffer(rank["sums"].read(0, rows * 4), np.float32)
                    np.testing.assert_allclose(got_sums, full.sum(axis=1), rtol=1e-4, atol=1e-3,
                                               err_msg=f"row sums (NaN: read before arrival), rank {r}, "
                                                       f"launch {epoch}")
                    counters = rank["plan"].to_device(cuda_device).counters()
                    np.testing.assert_array_equal(counters, epoch * rank["plan"].chunks["tiles"],
                                                  err_msg=f"tile arrivals per chunk, rank {r}, launch {epoch}")
        finally:
            for rank in ranks:
                for key in ("ch", "plan_ptr"):
                    if key in rank:
                        rank[key].release()
                rank["session"].leave()
                rank["client"].close()
