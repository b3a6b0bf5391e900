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

from tests.gpu.plan_gather import (
    CONSUMER_ROWS,
    LAUNCHES,
    ROW_FLOATS,
    ROWS_LOCAL,
    TILE_ROWS,
    WORLD,
    check_launch,
    close_ranks,
    join_ranks,
    poison,
)
from transportd_cli.localcluster import LocalCluster

PROGRAMS = 16  # per rank: both ranks' grids fit on the GPU at once


@pytest.mark.parametrize("backend", ["ib", "efa"])
def test_triton_allgather_waits_for_every_chunk_a_range_touches(cuda_device, backend: str) -> None:
    pytest.importorskip("triton", reason="gpuclient.triton needs Triton: pip install 'transportd[triton]'")
    torch = pytest.importorskip("torch", reason="Triton launches kernels on PyTorch's CUDA streams")
    import gpuclient.triton as tdt
    from tests.gpu.triton_allgather import allgather_rowsum, quiet_status

    rng = np.random.default_rng(11)
    with LocalCluster(WORLD, backend=backend, overrides={"peers": {"heartbeat_timeout_s": 20.0}}) as cluster:
        ranks = join_ranks(cluster, "triton-allgather", cuda_device)
        try:
            for rank in ranks:
                rank["ch"] = tdt.channel_pointer(rank["handle"])  # device copies, made once for every launch
                rank["plan_ptr"] = tdt.plan_pointer(rank["plan"], cuda_device)
                rank["stream"] = torch.cuda.Stream(device=cuda_device)
                rank["args"] = [tdt.device_pointer(rank[k], "float32") for k in ("x", "gathered", "sums")]
                rank["status_ptr"] = tdt.device_pointer(rank["status"], "uint32")
            assert ranks[0]["plan"].tile_count == -(-ROWS_LOCAL // TILE_ROWS)
            launch = {"ROW_FLOATS": ROW_FLOATS, "ROW_BLOCK": 128, "TILE_ROWS": TILE_ROWS, "TILE_BLOCK": 4,
                      "CONSUMER_ROWS": CONSUMER_ROWS, "num_warps": 4}
            # compile and load both kernels before the first launch: a module load waits for running kernels,
            # and rank 0's kernel waits for rank 1's
            tdt.preload(allgather_rowsum, ranks[0]["ch"], ranks[0]["plan_ptr"], 1, *ranks[0]["args"], 0, WORLD,
                        ROWS_LOCAL, ranks[0]["plan"].tile_count, grid=(PROGRAMS,), **launch)
            tdt.preload(quiet_status, ranks[0]["ch"], ranks[0]["status_ptr"], grid=(1,), num_warps=1)
            for epoch in range(1, LAUNCHES + 1):
                shards = poison(ranks, rng)
                for r, rank in enumerate(ranks):
                    x, gathered, sums = rank["args"]
                    with torch.cuda.stream(rank["stream"]):
                        allgather_rowsum[(PROGRAMS,)](rank["ch"], rank["plan_ptr"], epoch, x, gathered, sums, r, WORLD,
                                                      ROWS_LOCAL, rank["plan"].tile_count, **launch)
                        quiet_status[(1,)](rank["ch"], rank["status_ptr"], num_warps=1)
                for rank in ranks:
                    rank["stream"].synchronize()
                check_launch(ranks, shards, epoch)
        finally:
            for rank in ranks:
                for key in ("ch", "plan_ptr"):
                    if key in rank:
                        rank[key].release()
            close_ranks(ranks)
