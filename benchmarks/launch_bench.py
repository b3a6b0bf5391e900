"""Host time of a fused op's call: the ops' own launches against Triton's.

    python benchmarks/launch_bench.py --json benchmarks/results/launch-host-time.json

A call of a fused op spends host time before its kernels run: checks, arguments, and each kernel's launch.
The ops launch through ``gpuclient.kernels._launch.KernelLauncher``, which launches the compiled kernel Triton
chose for an earlier call with the same specialization (``launcher``). The reference, ``triton``, is the
same op with every launch through Triton's own ``kernel[grid](...)`` (the launcher's ``direct = False``), as
the ops launched before. The two alternate call by call. For MoE, ``graph`` is the same calls captured in a CUDA
graph per rank and call (``docs/kernels.md``, launch contract 6), each sample one ``graph.replay()``.

Each op runs two ranks on soft-fabric daemons on one GPU, as ``fused_bench.py`` runs them, at its ``--quick``
size (a call's host time does not depend on the size). A sample is one call's host time, from the call until
it returns, the GPU idle before it; each call's kernels finish before the next call. The tensor-parallel ops
and ring attention are timed over both ranks' calls of a launch (each sample is half of it); MoE's
``dispatch``, ``dispatch_gemm`` and ``combine`` one rank's call at a time. Rows: µs a call, p50 / p90.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.fused_bench import QUICK_MOE_GEMM_SIZES, QUICK_SIZES, gpu_name  # noqa: E402
from benchmarks.fused_cases import BACKEND_SHAPE, CASES, DEFAULT_RUN, WORLD, MoeGemmRanks, rank_sessions  # noqa: E402
from tests.support.cuda_graphs import capture_per_rank  # noqa: E402

MODES = ("launcher", "triton")
GRAPH = "graph"  # MoE's calls captured in CUDA graphs, replayed
OPS = (*QUICK_SIZES, "moe")


def _set_mode(ops: list[Any], mode: str) -> None:
    for op in ops:
        op._launcher.direct = mode == "launcher"


def _row(op: str, call: str, mode: str, us: list[float]) -> dict[str, Any]:
    us = sorted(us)
    return {"op": op, "call": call, "mode": mode, "calls": len(us),
            "p50_us": round(us[len(us) // 2], 1), "p90_us": round(us[9 * len(us) // 10], 1)}


def _timed(call: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[float, Any]:
    """µs that ``call(*args, **kwargs)`` took, and what it returned."""
    start = time.perf_counter()
    result = call(*args, **kwargs)
    return (time.perf_counter() - start) * 1e6, result


def case_rows(kernel: str, backend: str, calls: int, device: int) -> list[dict[str, Any]]:
    """``kernel``'s fused launch (both ranks' calls): µs a call in each mode."""
    import torch

    gen = torch.Generator(device="cpu").manual_seed(5)
    samples: dict[str, list[float]] = {mode: [] for mode in MODES}
    with rank_sessions(DEFAULT_RUN, backend, BACKEND_SHAPE[backend], f"launch-bench-{kernel}",
                       device) as (_clients, sessions):
        streams = [torch.cuda.Stream(device) for _ in sessions]
        case = CASES[kernel](sessions, streams, gen, device, **QUICK_SIZES[kernel][0])
        for i in range(calls + 1):  # one untimed launch each first: the launcher keeps its kernel there
            for mode in MODES:
                _set_mode(case.ops, mode)
                torch.cuda.synchronize()
                us, _ = _timed(case.launch)
                torch.cuda.synchronize()
                if i:
                    samples[mode].append(us / WORLD)
    return [_row(kernel, "launch", mode, samples[mode]) for mode in MODES]


def moe_rows(backend: str, calls: int, device: int) -> list[dict[str, Any]]:
    """MoE's dispatch, dispatch_gemm and combine, one rank's call at a time: µs a call in each mode."""
    import torch

    gen = torch.Generator(device="cpu").manual_seed(9)
    samples = {(call, mode): [] for call in ("dispatch", "dispatch_gemm", "combine") for mode in MODES}
    with rank_sessions(DEFAULT_RUN, backend, BACKEND_SHAPE[backend], "launch-bench-moe",
                       device) as (_clients, sessions):
        moe = MoeGemmRanks(sessions, device, gen, **QUICK_MOE_GEMM_SIZES[0])
        ops = moe.ops

        def round_of(call: str, mode: str, timed: bool) -> None:
            _set_mode(ops, mode)
            torch.cuda.synchronize()
            handles = []
            for r, op in enumerate(ops):
                x, idx, weights, stream = moe.xs[r], moe.idx[r], moe.weights[r], moe.streams[r]
                if call == "dispatch":
                    us, (_, _, handle) = _timed(op.dispatch, x, idx, weights, stream=stream)
                else:
                    us, (_, _, handle) = _timed(op.dispatch_gemm, x, idx, weights, moe.ws[r], stream=stream)
                handles.append(handle)
                if timed:
                    samples[(call, mode)].append(us)
            torch.cuda.synchronize()
            for r, op in enumerate(ops):
                us, _ = _timed(op.combine, op.recv_x, handles[r], stream=moe.streams[r])
                if timed and call == "dispatch":
                    samples[("combine", mode)].append(us)
            torch.cuda.synchronize()

        for i in range(calls + 1):
            for call in ("dispatch", "dispatch_gemm"):
                for mode in MODES:
                    round_of(call, mode, timed=i > 0)
        _set_mode(ops, "launcher")
        for call in ("dispatch", "dispatch_gemm"):
            for (which, _), us in _graph_replays(moe, call, calls).items():
                if which == call or call == "dispatch":  # combine's samples once, after the plain dispatch
                    samples[(which, GRAPH)] = us
    return [_row("moe", call, mode, us) for (call, mode), us in samples.items()]


def _graph_replays(moe: Any, call: str, calls: int) -> dict[tuple[str, str], list[float]]:
    """``call`` and combine captured in a CUDA graph per rank each, then replayed ``calls`` times after an untimed
    replay: µs a replay, one rank's at a time (keys as ``moe_rows``' samples)."""
    import torch

    def dispatch(r: int) -> Any:
        op, args = moe.ops[r], (moe.xs[r], moe.idx[r], moe.weights[r])
        if call == "dispatch":
            return op.dispatch(*args, stream=moe.streams[r])
        return op.dispatch_gemm(*args, moe.ws[r], stream=moe.streams[r])

    dispatches, results = capture_per_rank(moe.streams, dispatch)
    combines, _ = capture_per_rank(moe.streams, lambda r: moe.ops[r].combine(moe.ops[r].recv_x, results[r][2]))
    samples: dict[tuple[str, str], list[float]] = {(call, GRAPH): [], ("combine", GRAPH): []}
    for i in range(calls + 1):
        for which, graphs in ((call, dispatches), ("combine", combines)):
            torch.cuda.synchronize()
            for graph, stream in zip(graphs, moe.streams, strict=True):
                with torch.cuda.stream(stream):
                    us, _ = _timed(graph.replay)
                if i:
                    samples[(which, GRAPH)].append(us)
        torch.cuda.synchronize()
    return samples


def measure(ops: tuple[str, ...], backend: str, calls: int, device: int = 0) -> list[dict[str, Any]]:
    rows = []
    for op in ops:
        rows += moe_rows(backend, calls, device) if op == "moe" else case_rows(op, backend, calls, device)
    return rows


def summary(rows: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Each call's p50 in each mode it ran (``graph``: MoE's only), and what the launcher saves."""
    out: dict[str, dict[str, float]] = {}
    for r in rows:
        out.setdefault(f"{r['op']}.{r['call']}", {})[f"{r['mode']}_p50_us"] = r["p50_us"]
    for entry in out.values():
        entry["saved_p50_us"] = round(entry["triton_p50_us"] - entry["launcher_p50_us"], 1)
    return out


@click.command()
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None, help="write the results here")
@click.option("--ops", default=",".join(OPS), show_default=True, help="comma-separated: " + ", ".join(OPS))
@click.option("--backend", type=click.Choice(sorted(BACKEND_SHAPE)), default="ib", show_default=True)
@click.option("--calls", type=click.IntRange(min=1), default=50, show_default=True, help="timed calls a row")
def main(json_path: str | None, ops: str, backend: str, calls: int) -> None:
    chosen = tuple(op for op in ops.split(",") if op)
    unknown = [op for op in chosen if op not in OPS]
    if unknown or not chosen:
        raise click.BadParameter(f"unknown {unknown}: choose from {', '.join(OPS)}", param_hint="--ops")
    rows = measure(chosen, backend, calls)
    click.echo(f"host time of a call, µs ({backend}, {gpu_name()}): launcher / triton, p50 (p90)")
    for key, entry in summary(rows).items():
        p90 = {r["mode"]: r["p90_us"] for r in rows if f"{r['op']}.{r['call']}" == key}
        graph = f"  graph replay {entry['graph_p50_us']:6.1f} ({p90[GRAPH]:6.1f})" if GRAPH in p90 else ""
        click.echo(f"  {key:<28} {entry['launcher_p50_us']:7.1f} ({p90['launcher']:7.1f})  "
                   f"{entry['triton_p50_us']:7.1f} ({p90['triton']:7.1f})  saved {entry['saved_p50_us']:6.1f}{graph}")
    if json_path:
        doc = {"benchmark": "launch", "gpu": gpu_name(), "backend": backend, "rows": rows, "summary": summary(rows)}
        Path(json_path).write_text(json.dumps(doc, indent=2) + "\n")


if __name__ == "__main__":
    main()
