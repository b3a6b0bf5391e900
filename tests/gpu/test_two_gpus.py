"""Issue 8 on real GPUs: one daemon per node serving two GPUs on two rails (needs 2 GPUs on one host).

Two daemons (node a, node b), each with ``[[backend.rails]]`` softib0 (gpu 0) and softib1 (gpu 1). Four GPU
client processes (``rank_proc.py``), rank ``2 * node + gpu``, each narrowed to its GPU by
``CUDA_VISIBLE_DEVICES`` and joined with ``device=gpu``. Node a's GPU g kernel streams chunks to node b's
GPU g kernel and back the other way, both rails at once, for two launches (flags are monotonic); each
receiving kernel verifies every chunk when its flag arrives. Afterwards the daemons' stats show that rail
g of each node carried exactly GPU g's bytes to rail g of the other node (rail-peer routing).

NCCL / PyTorch / NVSHMEM NVLink multicast stays off in every process (``NO_MULTICAST``): nothing here
needs it, and it is not to be turned on on the shared machines.

Not run yet: it needs an ``nvidia-h200-x2`` (or any 2-GPU) host; with fewer GPUs it skips and says so.
"""

from __future__ import annotations

import os
from typing import Any

import pytest

from tests.support.cuda import gpu_unavailable
from tests.support.rank_process import SLOW_START, RankProcess
from transportd.control.client import ControlConnection
from transportd.control.protocol import Stats

GPUS = 2
CHUNK = 64 << 10
NCHUNKS = 48
CAPACITY = 64
SLOTS = NCHUNKS + 8
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
MISSING_RUN = ("needs 2 GPUs on one host (an nvidia-h200-x2 machine): two daemons, GPU 0 and GPU 1 kernels on "
               "each node exchanging chunks over rails 0 and 1; run there with NCCL_NVLS_ENABLE=0 "
               "TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 python -m pytest -m gpu "
               "tests/gpu/test_two_gpus.py")


def gpu_count() -> int:
    from gpuclient.cuda_memory import driver

    drv = driver()
    err, count = drv.cuDeviceGetCount()
    return int(count) if err == drv.CUresult.CUDA_SUCCESS else 0


@pytest.fixture(scope="module")
def two_gpus() -> None:
    reason = gpu_unavailable()
    if reason:
        pytest.skip(f"{reason}; {MISSING_RUN}")
    count = gpu_count()
    if count < GPUS:
        pytest.skip(f"{count} GPU visible; {MISSING_RUN}")


class GpuRankProcess(RankProcess):
    """A rank_proc.py child that sees only GPU ``gpu`` (it is CUDA device 0 there), multicast off."""

    def __init__(self, gpu: int) -> None:
        super().__init__(env={**os.environ, **NO_MULTICAST, "CUDA_VISIBLE_DEVICES": _physical(gpu)})


def _physical(gpu: int) -> str:
    """The id of the test's GPU ``gpu`` in CUDA_VISIBLE_DEVICES terms (honours a narrower parent setting)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").strip()
    return visible.split(",")[gpu].strip() if visible else str(gpu)


def test_gpu_g_kernels_exchange_chunks_over_rail_g(two_gpus: None, cluster_factory: Any,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    for key, value in NO_MULTICAST.items():  # the daemons inherit them too
        monkeypatch.setenv(key, value)
    rails = [{"device": f"softib{g}", "gpu": g} for g in range(GPUS)]
    cluster = cluster_factory(backend="ib", overrides={"backend": {"rails": rails}, **SLOW_START})
    procs = {(n, g): GpuRankProcess(g) for n in range(2) for g in range(GPUS)}
    try:
        setup = {"job": "two-gpus", "world": 2 * GPUS, "nbytes": CHUNK * NCHUNKS, "flags": SLOTS,
                 "where": "device", "src_kind": "torch", "dst_kind": "cupy"}
        for (n, g), p in procs.items():
            p.send("setup", socket=cluster.socket(cluster.names[n]), rank=2 * n + g, device=g, **setup)
        info = {key: p.reply() for key, p in procs.items()}
        assert all(info[(n, g)]["rail"] == g for n, g in procs), info
        for p in procs.values():
            p.send("exchange", capacity=CAPACITY)
        for p in procs.values():
            p.reply()
        for epoch in (1, 2):
            for p in procs.values():  # every verifier waits first
                p.call("recv", chunk=CHUNK, nchunks=NCHUNKS, epoch=epoch)
            for (n, g), p in procs.items():  # then all four senders at once: both rails, both directions
                p.send("send", peer=2 * (1 - n) + g, dst_region=info[(1 - n, g)]["dst"], chunk=CHUNK,
                       nchunks=NCHUNKS, epoch=epoch)
            for key, p in procs.items():
                sent = p.reply()
                assert sent["status"] == 0 and sent["host_status"] == [0, 0, 0], (key, sent)
            for key, p in procs.items():
                done = p.call("finish")
                assert done == {"ok": True, "bad_words": 0, "chunks": NCHUNKS}, (key, done)
        stats = []
        for name in cluster.names:
            with ControlConnection(cluster.socket(name)) as conn:
                stats.append(conn.request(Stats()))
        for n, s in enumerate(stats):
            other = cluster.names[1 - n]
            for c in s["connections"]:
                if c["node"] == other:  # rail g reached rail g there and carried GPU g's two launches
                    assert c["peer_gid"] == stats[1 - n]["rails"][c["rail"]]["gid"], c
                    assert c["bytes"] == 2 * NCHUNKS * CHUNK, c
    except BaseException:
        for name in cluster.names:
            print(f"--- {name} log ---\n{cluster.log(name)}")
        raise
    finally:
        for p in procs.values():
            p.close()
