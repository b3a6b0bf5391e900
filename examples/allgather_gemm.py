"""AllGather + GEMM at tile granularity over transportd: two daemons, two ranks, one GPU.

    python examples/allgather_gemm.py [--backend ib|efa] [--launches 2]

Each rank holds a row shard of A and its own B; the fused kernel (allgather_gemm.cu) ships its shard's row
chunks to the peer with ``tpd::put_signal`` and computes ``C = A_full @ B``, each tile waiting only for the
flag of the chunk its rows come from. Every launch uses new A values and first poisons the rows owed by the
peer (NaN), so a tile that read before its chunk arrived would show; the result is checked against numpy.
Flags are monotonic: launch e waits for e, no reset in between.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import gpuclient  # noqa: E402
from gpuclient.cuda_memory import DeviceMemory, check, driver, use_device  # noqa: E402
from transportd.errors import TransportdError  # noqa: E402
from transportd_cli.localcluster import LocalCluster  # noqa: E402

SOURCE = Path(__file__).with_name("allgather_gemm.cu")
PROBLEM_DTYPE = np.dtype([(name, "<u4") for name in
                          ("rank", "world", "m_local", "n", "k", "rows_per_chunk", "a_region", "epoch")])


def run(m_local: int = 256, n: int = 256, k: int = 512, rows_per_chunk: int = 64, launches: int = 2,
        backend: str = "ib", overrides: dict[str, Any] | None = None, device: int = 0, seed: int = 0,
        echo: Any = print) -> dict[str, Any]:
    """Run the fused AllGather+GEMM ``launches`` times on two ranks; returns errors and timings."""
    world = 2
    assert m_local % rows_per_chunk == 0 and (world * m_local) % 64 == 0 and n % 64 == 0 and k % 16 == 0
    use_device(device)
    drv = driver()
    rng = np.random.default_rng(seed)
    m = world * m_local
    chunks = m // rows_per_chunk
    module = gpuclient.compile(SOURCE.read_text(), device=device, name="allgather_gemm.cu")
    results: dict[str, Any] = {"launches": [], "backend": backend}
    # the first GPU registration starts CUDA in each daemon's worker: let heartbeats tolerate that pause
    config = {"peers": {"heartbeat_timeout_s": 20.0}, **(overrides or {})}
    with LocalCluster(world, backend=backend, overrides=config) as cluster:
        ranks = []
        for r, name in enumerate(cluster.names):
            client = gpuclient.connect(cluster.socket(name), timeout=60)
            session = client.join("allgather-gemm", rank=r, world=world, device=device)
            a_full, b, c = DeviceMemory(m * k * 4, device), DeviceMemory(k * n * 4, device), DeviceMemory(m * n * 4,
                                                                                                          device)
            b_host = rng.standard_normal((k, n), dtype=np.float32)
            b.write(0, b_host.tobytes())
            region = session.register(a_full)
            session.flags(chunks + 1, where="device")
            ranks.append({"client": client, "session": session, "a": a_full, "b": b, "b_host": b_host, "c": c,
                          "region": region})
        for rank in ranks:  # publish once every rank has joined, then wait for the job to be wired
            rank["session"].exchange(wait=False)
        for rank in ranks:
            rank["session"].exchange(timeout=60)
            rank["handle"] = rank["session"].channel(256).device_handle(device)
            rank["stream"] = check(drv.cuStreamCreate(drv.CUstream_flags.CU_STREAM_NON_BLOCKING), "cuStreamCreate")
            rank["status"] = DeviceMemory(8, device)
        sms = int(check(drv.cuDeviceGetAttribute(drv.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
                                                 device)))
        try:
            for epoch in range(1, launches + 1):
                a_host = rng.standard_normal((m, k), dtype=np.float32)
                shard_bytes = m_local * k * 4
                for r, rank in enumerate(ranks):  # own shard in place, the peer's rows poisoned
                    poisoned = np.full((m, k), np.nan, dtype=np.float32)
                    poisoned[r * m_local:(r + 1) * m_local] = a_host[r * m_local:(r + 1) * m_local]
                    rank["a"].write(0, poisoned.tobytes())
                    assert len(poisoned[r * m_local:(r + 1) * m_local].tobytes()) == shard_bytes
                t0 = time.perf_counter()
                for r, rank in enumerate(ranks):
                    problem = np.zeros(1, dtype=PROBLEM_DTYPE)
                    problem[0] = (r, world, m_local, n, k, rows_per_chunk, rank["region"].id, epoch)
                    module.function("allgather_gemm").launch(
                        sms // world, 256, (rank["handle"], problem, np.uint64(rank["a"].ptr), np.uint64(rank["b"].ptr),
                                            np.uint64(rank["c"].ptr)), stream=rank["stream"])
                    module.function("quiet_status").launch(1, 1, (rank["handle"], np.uint64(rank["status"].ptr)),
                                                           stream=rank["stream"])
                for rank in ranks:
                    check(drv.cuStreamSynchronize(rank["stream"]), "cuStreamSynchronize")
                elapsed = time.perf_counter() - t0
                errs = []
                for rank in ranks:
                    c_host = np.frombuffer(rank["c"].read(0, m * n * 4), dtype=np.float32).reshape(m, n)
                    want = a_host @ rank["b_host"]
                    errs.append(float(np.nanmax(np.abs(c_host - want))) if np.isfinite(c_host).all() else float("inf"))
                    status = int.from_bytes(rank["status"].read(0, 4), "little")
                    if status:
                        raise RuntimeError(f"channel error {status} after launch {epoch}")
                results["launches"].append({"epoch": epoch, "max_abs_err": max(errs), "seconds": elapsed})
                echo(f"launch {epoch}: max |C - A_full @ B| = {max(errs):.2e} over {m}x{n}x{k} per rank, "
                     f"{elapsed * 1e3:.1f} ms (both ranks, {chunks} chunks of {rows_per_chunk} rows)")
        finally:
            for rank in ranks:
                rank["session"].leave()
                rank["client"].close()
    results["ok"] = all(launch["max_abs_err"] < 1e-2 for launch in results["launches"])
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="ib", choices=("ib", "efa"))
    parser.add_argument("--launches", type=int, default=2)
    args = parser.parse_args()
    try:
        result = run(backend=args.backend, launches=args.launches)
    except (TransportdError, TimeoutError, RuntimeError, OSError) as exc:  # no GPU, no cuda-python, no daemon
        print(f"{Path(__file__).name}: {' '.join(str(exc).split())}", file=sys.stderr)
        sys.exit(1)
    print("OK" if result["ok"] else "MISMATCH")
    sys.exit(0 if result["ok"] else 1)


if __name__ == "__main__":
    main()
