"""An all-gather through a chunk plan from a CUDA kernel: two daemons (ib and efa), two ranks on one GPU.

Producer tiles are a few rows, chunks a whole number of tiles (with a short last tile and a short last
chunk), and the consumers' row blocks align with neither, so some of them straddle two chunks and
wait_range must wait for both (tests/gpu/plan_gather.py holds the shape). The rows owed by the peer are
poisoned with NaN before every launch and the launches reuse the flags and the tile counters with no
reset: a read before arrival, or a chunk shipped before its last tile, shows as NaN or stale data in the
row sums or the gathered buffer. Producers are a block per tile (tile_done) or a lane per tile
(tile_done_warp, the warp-cooperative push).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import gpuclient
from gpuclient.cuda_memory import check, driver
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

KERNELS = Path(__file__).with_name("plan_kernels.cu")
GATHER_DTYPE = np.dtype([(name, "<u4") for name in ("rank", "world", "rows_local", "row_floats", "tile_rows",
                                                    "consumer_rows", "per_lane", "pad")])


@pytest.mark.parametrize("per_lane", [False, True], ids=["block-tiles", "warp-tiles"])
@pytest.mark.parametrize("backend", ["ib", "efa"])
def test_plan_allgather_waits_for_every_chunk_a_range_touches(cuda_device, backend: str, per_lane: bool) -> None:
    drv = driver()
    module = gpuclient.compile(KERNELS.read_text(), device=cuda_device, debug=True, name="plan_kernels.cu")
    rng = np.random.default_rng(7)
    with LocalCluster(WORLD, backend=backend, overrides={"peers": {"heartbeat_timeout_s": 20.0}}) as cluster:
        ranks = join_ranks(cluster, "plan-allgather", cuda_device)
        try:
            for rank in ranks:
                rank["stream"] = check(drv.cuStreamCreate(drv.CUstream_flags.CU_STREAM_NON_BLOCKING), "stream")
            for epoch in range(1, LAUNCHES + 1):
                shards = poison(ranks, rng)
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
                check_launch(ranks, shards, epoch)
        finally:
            for rank in ranks:
                if "stream" in rank:
                    drv.cuStreamDestroy(rank["stream"])
            close_ranks(ranks)
