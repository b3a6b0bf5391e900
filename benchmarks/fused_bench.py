"""Overlap of the fused kernels: how much of the communication a fused launch hides behind its compute.

    python benchmarks/fused_bench.py --json benchmarks/results/fused.json

Two daemons (``LocalCluster`` over softverbs, ib RC and efa SRD), two ranks in this process sharing one GPU
(each rank's kernel gets half the SMs: ``share=2``), the soft fabric's direct GPU copies on and the NIC
model shaping each daemon's link like the NIC its backend stands for (ib: ConnectX-7 400 Gb/s, efa: EFA
200 Gb/s; ``--shapes`` adds ``unshaped``). For AllGather+GEMM (``gpuclient.kernels.AllGatherGemm``,
``C = all_gather(A) @ B``, bf16 in, fp32 accumulate) each row times, as the median of ``--reps`` launches
of both ranks at once (host clock around launch and synchronize):

- ``compute``: the fused kernel with ``communicate=False`` (the GEMM alone, peers' rows as they are);
- ``comm``: ``compute=False`` (the same kernel ships and waits on the same schedule, no GEMM);
- ``fused``: both;
- ``cublas``: ``torch.matmul`` of the whole gathered A by B on each rank's stream (the library GEMM);

and reports ``sequential = comm + compute`` (all-gather, then GEMM), the speedup ``sequential / fused``,
the speedup over ``comm + cublas`` (the unfused pipeline with the library GEMM), and the overlap
efficiency ``(comm + compute - fused) / min(comm, compute)``: 1 when the shorter of the two is hidden
entirely, 0 when nothing overlaps. The first fused launch is checked against torch.

CUDA MPS is started here (as ``benchmarks/fabric_bench.py`` does) so the rail workers' copies share the
GPU with the kernels instead of waiting for time slices.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import click

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.fabric_bench import SHAPES  # noqa: E402

#: the NIC model each backend is shaped like by default
BACKEND_SHAPE = {"ib": "cx7-400g", "efa": "efa-200g"}


def _time(launch: Any, streams: list[Any], reps: int) -> float:
    """Median seconds of ``launch()`` (every rank's kernel, each on its stream) until the GPU is idle."""
    import torch

    samples = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        launch()
        for s in streams:
            s.synchronize()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def allgather_gemm_row(backend: str, shape: str, m_local: int, n: int, k: int, chunk_rows: int, reps: int,
                       device: int = 0, echo: Any = print) -> dict[str, Any]:
    """One row: the four timings of AllGather+GEMM on ``backend`` daemons shaped as ``shape``."""
    import torch

    import gpuclient
    from gpuclient.kernels import AllGatherGemm
    from transportd_cli.localcluster import LocalCluster

    nic = SHAPES.get(shape, {})
    overrides = {"softverbs": {"direct_copy": True, **nic}, "peers": {"heartbeat_timeout_s": 20.0}}
    world = 2
    gen = torch.Generator(device="cpu").manual_seed(5)
    with LocalCluster(world, backend=backend, overrides=overrides) as cluster:
        clients = [gpuclient.connect(cluster.socket(name), timeout=60) for name in cluster.names]
        sessions = [c.join("fused-bench", rank=r, world=world, device=device) for r, c in enumerate(clients)]
        try:
            ops = [AllGatherGemm(s, m_local, n, k, chunk_rows=chunk_rows, share=world) for s in sessions]
            for s in sessions:
                s.exchange(wait=False)
            for s in sessions:
                s.exchange(timeout=60)
            for op in ops:  # every variant loaded before any launch: the ranks share this process
                op.prepare()
                op.preload(communicate=True, compute=False)
                op.preload(communicate=False, compute=True)
            streams = [torch.cuda.Stream(device) for _ in ops]
            shards = [torch.randn(m_local, k, generator=gen).to(torch.bfloat16).cuda(device) for _ in ops]
            bs = [torch.randn(k, n, generator=gen).to(torch.bfloat16).cuda(device) for _ in ops]
            outs = [torch.empty(world * m_local, n, dtype=torch.float32, device=f"cuda:{device}") for _ in ops]
            for op, shard in zip(ops, shards, strict=True):
                op.local_rows().copy_(shard)
            torch.cuda.synchronize()

            def launch(**kw: bool) -> None:
                for r, op in enumerate(ops):
                    op(None, bs[r], outs[r], stream=streams[r], **kw)

            launch()  # the first fused launch, checked
            torch.cuda.synchronize()
            a_full = torch.cat(shards).float()
            error = max(float((outs[r] - a_full @ bs[r].float()).abs().max()) for r in range(world))
            gathered = [op.gathered.clone() for op in ops]

            def cublas() -> None:
                for r in range(world):
                    with torch.cuda.stream(streams[r]):
                        torch.matmul(gathered[r], bs[r])

            row: dict[str, Any] = {"kernel": "allgather_gemm", "backend": backend, "shape": shape, "nic": nic,
                                   "m_local": m_local, "n": n, "k": k, "chunk_rows": chunk_rows, "world": world,
                                   "programs": ops[0].programs, "max_abs_error": error}
            row["compute_s"] = _time(lambda: launch(communicate=False), streams, reps)
            row["comm_s"] = _time(lambda: launch(compute=False), streams, reps)
            row["fused_s"] = _time(launch, streams, reps)
            row["cublas_s"] = _time(cublas, streams, reps)
            seq = row["comm_s"] + row["compute_s"]
            row["sequential_s"] = seq
            row["speedup"] = seq / row["fused_s"]
            row["speedup_vs_comm_plus_cublas"] = (row["comm_s"] + row["cublas_s"]) / row["fused_s"]
            row["overlap_efficiency"] = (seq - row["fused_s"]) / min(row["comm_s"], row["compute_s"])
            flops = 2.0 * world * (world * m_local) * n * k
            row["fused_tflops"] = flops / row["fused_s"] / 1e12
            row["compute_tflops"] = flops / row["compute_s"] / 1e12
            row["comm_gbps"] = (world * m_local * k * 2) / row["comm_s"] / 1e9  # both ranks' shards moved
            for op in ops:
                status = op.channel.status()
                if status[0] != 0:
                    raise RuntimeError(f"channel error {status}")
            echo(f"  {backend} {shape:10s} compute {row['compute_s'] * 1e3:7.3f} ms  comm {row['comm_s'] * 1e3:7.3f} ms"
                 f"  fused {row['fused_s'] * 1e3:7.3f} ms  cublas {row['cublas_s'] * 1e3:7.3f} ms  "
                 f"overlap {row['overlap_efficiency']:.2f}  speedup {row['speedup']:.2f}x")
            return row
        finally:
            for c, s in zip(clients, sessions, strict=True):
                s.leave()
                c.close()


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| backend | NIC model | compute ms | comm ms | fused ms | comm + compute ms | overlap efficiency | "
             "speedup | vs comm + cuBLAS | cuBLAS ms |", "|" + "---|" * 10]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['backend']} | {r['shape']} | failed: {r['error']} |")
            continue
        shape = f"{r['shape']} ({r['nic']['nic_bandwidth'] / 1e9:g} GB/s)" if r["nic"] else r["shape"]
        lines.append(f"| {r['backend']} | {shape} | {r['compute_s'] * 1e3:.3f} | {r['comm_s'] * 1e3:.3f} | "
                     f"{r['fused_s'] * 1e3:.3f} | {r['sequential_s'] * 1e3:.3f} | {r['overlap_efficiency']:.2f} | "
                     f"{r['speedup']:.2f}x | {r['speedup_vs_comm_plus_cublas']:.2f}x | {r['cublas_s'] * 1e3:.3f} |")
    return "\n".join(lines)


@click.command()
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None, help="write the results here")
@click.option("--backends", default="ib,efa", show_default=True)
@click.option("--shapes", default="nic", show_default=True,
              help="comma-separated: nic (each backend's own NIC model), unshaped, or a NIC model name")
@click.option("--m-local", default=4096, show_default=True, type=click.IntRange(min=1), help="A's rows per rank")
@click.option("--n", default=8192, show_default=True, type=click.IntRange(min=1))
@click.option("--k", default=8192, show_default=True, type=click.IntRange(min=1))
@click.option("--chunk-rows", default=128, show_default=True, type=click.IntRange(min=1))
@click.option("--reps", default=5, show_default=True, type=click.IntRange(min=1))
@click.option("--quick", is_flag=True, help="small shapes, 2 reps (a smoke run)")
def main(json_path: str | None, backends: str, shapes: str, m_local: int, n: int, k: int, chunk_rows: int,
         reps: int, quick: bool) -> None:
    """Overlap of AllGather+GEMM on two daemons sharing this GPU (see the module doc)."""
    from transportd_cli.mps import Mps

    if json_path:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).touch()  # a bad path fails now, not after the run
    if quick:
        m_local, n, k, chunk_rows, reps = 512, 1024, 1024, 64, 2
    rows: list[dict[str, Any]] = []
    with Mps() as mps:  # started where wanted and present; describe() says which
        if not mps.running:
            click.echo(mps.describe())
        for backend in backends.split(","):
            for spec in shapes.split(","):
                shape = BACKEND_SHAPE[backend] if spec == "nic" else spec
                try:
                    rows.append(allgather_gemm_row(backend, shape, m_local, n, k, chunk_rows, reps, echo=click.echo))
                except Exception as exc:  # keep what the other rows measured
                    rows.append({"backend": backend, "shape": shape, "error": f"{type(exc).__name__}: {exc}"})
                    click.echo(f"  {backend}:{shape}: failed: {exc}")
        mps_line = mps.describe()
    click.echo(mps_line)
    click.echo(table(rows))
    if json_path:
        Path(json_path).write_text(json.dumps({"rows": rows, "mps": mps_line}, indent=2))


if __name__ == "__main__":
    main()
