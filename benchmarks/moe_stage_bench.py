"""MoE's first two kernels alone: the routing (``_moe_route``) and the rows staged (``_moe_stage``).

    python benchmarks/moe_stage_bench.py --json benchmarks/results/moe-stage.json [--tokens 128 --tokens 1024 ...]
        [--route-programs 32 --route-programs 64 ...]

Every dispatch (``MoE.dispatch``, ``dispatch_gemm``) starts with them, before any put can leave: the route
kernel counts each expert's tokens and gives each (token, expert) its stage row and handle word; the stage kernel
copies each token's row to each of its experts (a peer's expert's into ``send_x``, one of the rank's own straight
into ``recv_x``). This times them on one rank of a two-rank session with CUDA events around each launch on an idle
GPU, the median of ``--reps`` after ``--warmup``, at each ``--tokens`` (top-k of ``--experts``, hidden
``--hidden``, each token's experts distinct and uniform). No transfer is made, so the fabric does not enter the
numbers. ``--route-programs`` (repeated) launches the route kernel over each grid given in turn, a row each, on the
same session and inputs: an alternation of grids in one process. ``--fp8`` stages FP8 rows, quantized on the way as
``MoE(fp8=True)`` dispatches them. ``stage_gb_per_s`` counts the bytes the stage moves (``stage_bytes``: each
token's row read once and written once for each of its experts): against the GPU's memory bandwidth it says how far
the copy is from its bound.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Any

import click

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.fused_cases import DEFAULT_RUN, WORLD, randn_bf16, rank_sessions, uniform_topk  # noqa: E402


def stage_row(op: Any, tokens: int, reps: int, warmup: int, seed: int,
              route_programs: int | None = None) -> dict[str, Any]:
    """Route and stage of ``tokens`` tokens on ``op``'s rank: µs of each (median, p90) and the stage's rate;
    ``route_programs``: the route kernel's grid in place of the op's."""
    import torch

    from gpuclient.kernels.moe_kernels import _moe_route, _moe_stage

    device = op.recv_x.device.index
    gen = torch.Generator(device="cpu").manual_seed(seed)
    x = randn_bf16(gen, tokens, op.hidden, device=device)
    idx = uniform_topk(gen, tokens, op.num_experts, op.topk, device)
    stream = torch.cuda.Stream(device)
    route_programs = route_programs or op.route_programs
    events = [[torch.cuda.Event(enable_timing=True) for _ in range(3)] for _ in range(warmup + reps)]
    with torch.cuda.stream(stream):
        for start, routed, staged in events:
            start.record(stream)
            op._launcher(_moe_route, (route_programs,), stream, op._route_args(idx, tokens), op._route_meta())
            routed.record(stream)
            op._launcher(_moe_stage, (op.stage_programs,), stream, op._stage_args(x, tokens), op._stage_meta())
            staged.record(stream)
    stream.synchronize()
    timed = events[warmup:]
    route_us = [1e3 * a.elapsed_time(b) for a, b, _ in timed]
    stage_us = [1e3 * b.elapsed_time(c) for _, b, c in timed]
    both_us = [1e3 * a.elapsed_time(c) for a, _, c in timed]
    # a token's row is read once (bf16) and written once for each of its experts (bf16, or FP8 bytes and scales)
    staged_bytes = tokens * (x.element_size() * op.hidden + op.topk * op.row_bytes)
    stage_p50 = statistics.median(stage_us)
    return {"tokens": tokens, "hidden": op.hidden, "topk": op.topk, "experts": op.num_experts, "world": op.world,
            "fp8": op.fp8,
            "route_programs": route_programs, "stage_programs": op.stage_programs, "reps": reps,
            "route_us_p50": statistics.median(route_us), "stage_us_p50": stage_p50,
            "route_and_stage_us_p50": statistics.median(both_us), "stage_bytes": staged_bytes,
            "route_and_stage_us_p90": statistics.quantiles(both_us, n=10)[-1] if reps >= 2 else both_us[0],
            "stage_gb_per_s": staged_bytes / (stage_p50 * 1e-6) / 1e9}


def summary(rows: list[dict[str, Any]], by_grid: bool) -> dict[str, float]:
    """Route and stage µs (p50) per token count, and per route grid where grids were compared (the median over
    a grid's repeated rows)."""
    groups: dict[str, list[float]] = {}
    for r in rows:
        key = f"route_and_stage_us_{r['tokens']}" + (f"_route_{r['route_programs']}" if by_grid else "")
        groups.setdefault(key, []).append(r["route_and_stage_us_p50"])
    return {key: statistics.median(values) for key, values in groups.items()}


@click.command()
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None, help="write the results here")
@click.option("--tokens", "token_counts", multiple=True, default=(128, 1024, 2048), show_default=True,
              type=click.IntRange(min=1), help="tokens a rank, a row each (repeat the option)")
@click.option("--hidden", default=7168, show_default=True, type=click.IntRange(min=1))
@click.option("--topk", default=8, show_default=True, type=click.IntRange(min=1))
@click.option("--experts", default=64, show_default=True, type=click.IntRange(min=1))
@click.option("--reps", default=50, show_default=True, type=click.IntRange(min=1))
@click.option("--warmup", default=5, show_default=True, type=click.IntRange(min=0))
@click.option("--route-programs", "route_grids", multiple=True, type=click.IntRange(min=1),
              help="the route kernel's grid in place of the op's (``route_programs``: a program per expert); "
                   "repeat it to compare grids, a row each in the order given, on one session per token count")
@click.option("--fp8", is_flag=True, help="stage FP8 rows (quantized on the way, as MoE(fp8=True) dispatches)")
@click.option("--device", default=0, show_default=True)
def main(json_path: str | None, token_counts: tuple[int, ...], hidden: int, topk: int, experts: int, reps: int,
         warmup: int, route_grids: tuple[int, ...], fp8: bool, device: int) -> None:
    """Route and stage alone, a row per token count and route grid (module doc)."""
    if fp8 and hidden % 128:
        raise click.BadParameter(f"FP8 rows need a multiple of 128, got {hidden}", param_hint="--hidden")
    import torch

    from gpuclient import exchange_all
    from gpuclient.kernels import MoE

    rows = []
    for tokens in token_counts:
        with rank_sessions(DEFAULT_RUN, "ib", "cx7-400g", "moe-stage-bench", device) as (_, sessions):
            ops = [MoE(s, hidden, experts, tokens, topk, share=WORLD, fp8=fp8) for s in sessions]
            exchange_all(sessions, timeout=60)
            ops[0].prepare()
            for grid in route_grids or (None,):
                row = stage_row(ops[0], tokens, reps, warmup, seed=tokens, route_programs=grid)
                rows.append(row)
                print(f"tokens {tokens:5d}  route {row['route_us_p50']:7.1f}  stage {row['stage_us_p50']:7.1f}  "
                      f"both {row['route_and_stage_us_p50']:7.1f} (p90 {row['route_and_stage_us_p90']:7.1f}) µs  "
                      f"stage {row['stage_gb_per_s']:6.0f} GB/s  ({'fp8' if fp8 else 'bf16'} rows, "
                      f"route {row['route_programs']}, stage {row['stage_programs']} programs)")
    result = {"gpu": torch.cuda.get_device_name(device), "rows": rows, "summary": summary(rows, bool(route_grids))}
    if json_path:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
