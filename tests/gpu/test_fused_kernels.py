"""The fused-kernel library (gpuclient.kernels) on two daemons, two ranks sharing the GPU, ib and efa.

Each kernel is checked against torch with owed data poisoned (NaN) before every launch, over several
launches with no flag reset, on shapes where tiles, chunks and the shard (or segment) do not line up; the
channels' error words must stay 0. AllGatherGemm, GemmReduceScatter (bf16 partials with fp32 output, fp32
partials with bf16 output) and GemmAllReduce (bf16 throughout).
"""

from __future__ import annotations

import numpy as np
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


def _reference(a: list, b: list) -> tuple:
    """The partials in float64 on the CPU: their sum, and the sum of their magnitudes (bf16's rounding bound)."""
    parts = [x.double().cpu() @ y.double().cpu() for x, y in zip(a, b, strict=True)]
    return sum(parts), sum(p.abs() for p in parts)


def _assert_sum(got, want, magnitude, what: str) -> None:
    """Within bf16's rounding: each partial and the output round at most 2^-8 relative (2^-7 here, twice the
    margin), plus fp32 summation order. A lost or doubled partial misses by its whole size."""
    got = got.double().cpu()
    assert torch.isfinite(got).all(), f"{what}: read before arrival (NaN)"
    bound = 2.0 ** -7 * (magnitude + want.abs()) + 1e-2
    err = (got - want).abs()
    worst = int(torch.argmax(err - bound))
    row, col = divmod(worst, want.shape[1])
    assert (err <= bound).all(), (f"{what}: {int((err > bound).sum())} elements off; worst at ({row}, {col}): "
                                  f"{float(got[row, col])} vs {float(want[row, col])}")


@pytest.mark.parametrize("backend", ["ib", "efa"])
@pytest.mark.parametrize(("partial_dtype", "out_dtype"), [("bfloat16", "float32"), ("float32", "bfloat16")])
def test_gemm_reduce_scatter_matches_torch(cuda_device, backend: str, partial_dtype: str, out_dtype: str) -> None:
    from gpuclient.kernels import GemmReduceScatter

    # segments of 200 rows: no multiple of the 128-row tile nor of the 48-row chunk; n not of the 128-col tile
    world, m, n, k = 2, 400, 320, 320
    m_seg = m // world
    pdt, odt = getattr(torch, partial_dtype), getattr(torch, out_dtype)
    gen = torch.Generator(device="cpu").manual_seed(5)
    with LocalCluster(world, backend=backend, overrides={"peers": {"heartbeat_timeout_s": 20.0}}) as cluster:
        sessions = _ranks(cluster, "fused-gemm-rs", cuda_device)
        try:
            # programs=5: a program takes peer and own tiles (12 per rank), both ranks' grids resident at once
            ops = [GemmReduceScatter(s, m, n, k, chunk_rows=48, share=world, programs=5, partial_dtype=pdt,
                                     out_dtype=odt) for _, s in sessions]
            _exchange(sessions)
            for op in ops:  # both ranks' kernels loaded before either launches (one process, one GPU)
                op.prepare()
            streams = [torch.cuda.Stream(cuda_device) for _ in ops]
            b = [torch.randn(k, n, generator=gen).to(torch.bfloat16).cuda(cuda_device) for _ in ops]
            bad = torch.zeros(m, k + 1, dtype=torch.bfloat16, device=f"cuda:{cuda_device}")
            with pytest.raises(ValueError, match=f"a must be {m} x {k} torch.bfloat16"):
                ops[0](bad, b[0])
            for launch in range(1, LAUNCHES + 1):
                a = [torch.randn(m, k, generator=gen).to(torch.bfloat16).cuda(cuda_device) for _ in ops]
                for op in ops:  # what the peers owe, and what is shipped from: NaN until written
                    op.staging.fill_(float("nan"))
                    op.partial.fill_(float("nan"))
                outs = [torch.full((m_seg, n), float("nan"), dtype=odt, device=f"cuda:{cuda_device}") for _ in ops]
                torch.cuda.synchronize(cuda_device)
                for r, op in enumerate(ops):
                    with torch.cuda.stream(streams[r]):
                        op(a[r], b[r], outs[r], stream=streams[r])
                torch.cuda.synchronize(cuda_device)
                want, magnitude = _reference(a, b)
                for r, op in enumerate(ops):
                    rows = slice(r * m_seg, (r + 1) * m_seg)
                    _assert_sum(outs[r], want[rows], magnitude[rows], f"rank {r} launch {launch}")
                    assert op.channel.status()[0] == 0, op.channel.status()
            for r, op in enumerate(ops):
                lay = op.layout
                shipped = op.rs_plan.to_device(cuda_device).counters().reshape(world, lay.chunks_per_segment)
                assert (shipped[r] == 0).all() and (np.delete(shipped, r, axis=0) == LAUNCHES).all(), shipped
                arrived = op._arrive.cpu().numpy()[:world * lay.chunks_per_segment].reshape(world, -1)
                per_chunk = [LAUNCHES * lay.arrivals(c) for c in range(lay.chunks_per_segment)]
                assert (arrived[r] == 0).all() and (np.delete(arrived, r, axis=0) == per_chunk).all(), arrived
        finally:
            _close(sessions)


@pytest.mark.parametrize("backend", ["ib", "efa"])
def test_gemm_all_reduce_matches_torch(cuda_device, backend: str) -> None:
    from gpuclient.kernels import GemmAllReduce

    # segments of 184 rows (128 + 56; 3 x 48 + 40), n = 128 + 72, k no multiple of the 64-wide k step
    world, m, n, k = 2, 368, 200, 200
    gen = torch.Generator(device="cpu").manual_seed(7)
    with LocalCluster(world, backend=backend, overrides={"peers": {"heartbeat_timeout_s": 20.0}}) as cluster:
        sessions = _ranks(cluster, "fused-gemm-ar", cuda_device)
        try:
            ops = [GemmAllReduce(s, m, n, k, chunk_rows=48, share=world, programs=5, out_dtype=torch.bfloat16)
                   for _, s in sessions]
            _exchange(sessions)
            for op in ops:
                op.prepare()
            streams = [torch.cuda.Stream(cuda_device) for _ in ops]
            b = [torch.randn(k, n, generator=gen).to(torch.bfloat16).cuda(cuda_device) for _ in ops]
            for launch in range(1, LAUNCHES + 1):
                a = [torch.randn(m, k, generator=gen).to(torch.bfloat16).cuda(cuda_device) for _ in ops]
                for op in ops:  # staging and result are written by the peers, partial is shipped from
                    op.staging.fill_(float("nan"))
                    op.partial.fill_(float("nan"))
                    op.result.fill_(float("nan"))
                torch.cuda.synchronize(cuda_device)
                outs = []
                for r, op in enumerate(ops):
                    with torch.cuda.stream(streams[r]):
                        outs.append(op(a[r], b[r], stream=streams[r]))
                torch.cuda.synchronize(cuda_device)
                want, magnitude = _reference(a, b)
                for r, op in enumerate(ops):
                    assert outs[r] is op.result
                    _assert_sum(outs[r], want, magnitude, f"rank {r} launch {launch}")
                    assert op.channel.status()[0] == 0, op.channel.status()
            for op in ops:  # each reduced chunk went to the peer once per launch
                assert (op.ag_plan.to_device(cuda_device).counters() == LAUNCHES).all()
        finally:
            _close(sessions)
