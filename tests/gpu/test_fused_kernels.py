"""The fused-kernel library (gpuclient.kernels) on two daemons, two ranks sharing the GPU, ib and efa.

Each kernel is checked against torch with owed data poisoned (NaN) before every launch, over several
launches with no flag reset, on shapes where tiles, chunks and the shard do not line up.
"""

from __future__ import annotations

import pytest

import gpuclient
from transportd_cli.localcluster import LocalCluster

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

LAUNCHES = 3


def _ranks(cluster: LocalCluster, job: str, device: int) -> list:
    sessions = []
    for r, name in enumerate(cluster.names):
        client = gpuclient.connect(cluster.socket(name), timeout=60)
        sessions.append((client, client.join(job, rank=r, world=len(cluster.names), device=device)))
    return sessions


def _exchange(sessions: list) -> None:
    for _, session in sessions:
        session.exchange(wait=False)
    for _, session in sessions:
        session.exchange(timeout=60)


def _close(sessions: list) -> None:
    for client, session in sessions:
        session.leave()
        client.close()


@pytest.mark.parametrize("backend", ["ib", "efa"])
def test_allgather_gemm_matches_torch(cuda_device, backend: str) -> None:
    from gpuclient.kernels import AllGatherGemm

    world, m_local, n, k = 2, 200, 384, 512  # m_local is no multiple of the 128-row tile nor of the 48-row chunk
    gen = torch.Generator(device="cpu").manual_seed(3)
    with LocalCluster(world, backend=backend, overrides={"peers": {"heartbeat_timeout_s": 20.0}}) as cluster:
        sessions = _ranks(cluster, "fused-ag-gemm", cuda_device)
        try:
            ops = [AllGatherGemm(s, m_local, n, k, chunk_rows=48, share=world, programs=24) for _, s in sessions]
            _exchange(sessions)
            for op in ops:  # both ranks' kernels loaded before either launches (one process, one GPU)
                op.prepare()
            streams = [torch.cuda.Stream(cuda_device) for _ in ops]
            b = [torch.randn(k, n, generator=gen).to(torch.bfloat16).cuda(cuda_device) for _ in ops]
            for launch in range(1, LAUNCHES + 1):
                shards = [torch.randn(m_local, k, generator=gen).to(torch.bfloat16).cuda(cuda_device) for _ in ops]
                for op in ops:  # the rows owed by the peers: NaN until they arrive
                    op.gathered.fill_(float("nan"))
                torch.cuda.synchronize(cuda_device)
                outs = []
                for r, op in enumerate(ops):
                    with torch.cuda.stream(streams[r]):
                        outs.append(op(shards[r], b[r], stream=streams[r]))
                torch.cuda.synchronize(cuda_device)
                a_full = torch.cat(shards).float()
                for r, op in enumerate(ops):
                    want = a_full @ b[r].float()
                    assert torch.isfinite(outs[r]).all(), f"rank {r} launch {launch}: read before arrival (NaN)"
                    torch.testing.assert_close(outs[r], want, rtol=1e-3, atol=2e-2,
                                               msg=lambda m, r=r, launch=launch: f"rank {r} launch {launch}: {m}")
                    assert op.channel.status()[0] == 0, op.channel.status()
        finally:
            _close(sessions)
