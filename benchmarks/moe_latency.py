"""MoE ``dispatch`` and ``combine`` latency (``fused_bench.py --kernels moe``): both ranks at once, from calls
and from CUDA graph replays, with the signals, fences and writes the sending daemons posted per destination."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

from benchmarks.fabric_bench import SHAPES
from benchmarks.fused_cases import (
    DEFAULT_RUN,
    WORLD,
    RunOptions,
    check_channels,
    randn_bf16,
    rank_sessions,
    uniform_topk,
)
from benchmarks.fused_timing import COUNTED, daemon_counters, settle
from gpuclient import exchange_all
from tests.support.cuda_graphs import capture_per_rank, replay_per_rank


def moe_row(backend: str, shape: str, decoupled: bool, reps: int, tokens: int, hidden: int, topk: int, experts: int,
            device: int = 0, echo: Callable[[str], None] = print, fp8: bool = False,
            run: RunOptions = DEFAULT_RUN) -> dict[str, Any]:
    """Dispatch and combine latency (both ranks at once) and what the sending daemons posted per dispatch;
    ``fp8``: the rows go as e4m3 with a scale per 128 values, and combine takes them dequantized (untimed). Each
    phase starts once the daemons have settled (``settle``) and the counters are read outside the timed
    windows."""
    import torch

    from gpuclient.kernels import MoE

    config = {"signal": {"decoupled": True}} if decoupled else None
    gen = torch.Generator(device="cpu").manual_seed(7)
    with rank_sessions(run, backend, shape, "fused-bench-moe", device, config) as (clients, sessions):
        ops = [MoE(s, hidden, experts, tokens, topk, share=WORLD, fp8=fp8) for s in sessions]
        exchange_all(sessions, timeout=60)
        for op in ops:
            op.prepare()
        streams = [torch.cuda.Stream(device) for _ in ops]
        xs = [randn_bf16(gen, tokens, hidden, device=device) for _ in ops]
        idx = [uniform_topk(gen, tokens, experts, topk, device) for _ in ops]
        weights = [torch.rand(tokens, topk, generator=gen).cuda(device) for _ in ops]
        torch.cuda.synchronize()
        dispatch_s, combine_s = [], []
        graph_s: tuple[list[float], list[float]] = ([], [])
        graphs: tuple[list[Any], list[Any]] | None = None
        posted = {"dispatch": dict.fromkeys(COUNTED, 0), "combine": dict.fromkeys(COUNTED, 0)}

        def combine_error() -> float:  # with y = x and weights summing per token, combine returns sum_k w_k * x
            expect = xs[0].float() * weights[0].sum(dim=1, keepdim=True)
            return float((ops[0].out[:tokens].float() - expect).abs().max())

        errors = []  # the last round's, from its calls and from its graphs
        for i in range(reps + 1):  # round 0 warms up; its counts and times are dropped
            settle(clients)
            before = [daemon_counters(c) for c in clients]
            t0 = time.perf_counter()
            handles = [op.dispatch(xs[r], idx[r], weights[r], stream=streams[r]) for r, op in enumerate(ops)]
            for s in streams:
                s.synchronize()
            t1 = time.perf_counter()
            ys = [_dequantized(h[0]) if fp8 else h[0] for h in handles]  # the identity expert: y = x
            torch.cuda.synchronize()
            settle(clients)
            mid = [daemon_counters(c) for c in clients]
            t2 = time.perf_counter()
            for r, op in enumerate(ops):
                op.combine(ys[r], handles[r][2], stream=streams[r])
            for s in streams:
                s.synchronize()
            t3 = time.perf_counter()
            if i == reps:
                errors.append(combine_error())
            settle(clients)
            after = [daemon_counters(c) for c in clients]
            if i > 0:
                dispatch_s.append(t1 - t0)
                combine_s.append(t3 - t2)
                for key in COUNTED:
                    posted["dispatch"][key] += sum(m[key] - b[key] for b, m in zip(before, mid, strict=True))
                    posted["combine"][key] += sum(a[key] - m[key] for m, a in zip(mid, after, strict=True))
            # the same round replayed from CUDA graphs, captured after the warm-up's calls (bf16: fp8's
            # dequantization runs between the phases); in the same round, so a drift weighs on both alike
            if not fp8:
                graphs = graphs or _moe_graphs(ops, streams, xs, idx, weights)
                for phase, samples in zip(graphs, graph_s, strict=True):
                    seconds = _replayed(phase, streams, clients)
                    if i > 0:
                        samples.append(seconds)
        if graphs:
            errors.append(combine_error())
        error = max(errors)
        check_channels(ops)
    rounds = len(dispatch_s)
    per = WORLD * (WORLD - 1) * rounds  # (sender, destination) pairs over the counted rounds
    row: dict[str, Any] = {"kernel": "moe", "backend": backend, "shape": shape, "nic": SHAPES.get(shape, {}),
                           "decoupled": decoupled, "fp8": fp8, "world": WORLD, "tokens": tokens, "hidden": hidden,
                           "topk": topk,
                           "experts": experts, "rounds": rounds, "max_abs_error": error,
                           "dispatch_s": statistics.median(dispatch_s), "combine_s": statistics.median(combine_s),
                           "dispatch_graph_s": statistics.median(graph_s[0]) if graph_s[0] else None,
                           "combine_graph_s": statistics.median(graph_s[1]) if graph_s[1] else None}
    for phase, counts in posted.items():
        for key in ("signals", "signals_requested", "fences", "writes", "direct_placed"):
            row[f"{phase}_{key}_per_dest"] = counts[key] / per
    echo(f"  moe {backend} {shape:9s} decoupled={'on ' if decoupled else 'off'}{' fp8' if fp8 else ''} "
         f"dispatch {row['dispatch_s'] * 1e6:8.1f} us  combine {row['combine_s'] * 1e6:8.1f} us  "
         f"{_graph_us(row)}"
         f"per dispatch and destination: signals "
         f"{row['dispatch_signals_per_dest']:.2f} (requested {row['dispatch_signals_requested_per_dest']:.2f}), "
         f"fences {row['dispatch_fences_per_dest']:.2f}, writes {row['dispatch_writes_per_dest']:.1f} "
         f"({row['dispatch_direct_placed_per_dest']:.1f} placed by direct copy)")
    return row


def _moe_graphs(ops: list[Any], streams: list[Any], xs: list[Any], idx: list[Any],
                weights: list[Any]) -> tuple[list[Any], list[Any]]:
    """``moe_row``'s round captured: a graph per rank of its dispatch, and one of its combine (the identity expert:
    the received rows combined as they are)."""
    dispatches, handles = capture_per_rank(streams, lambda r: ops[r].dispatch(xs[r], idx[r], weights[r]))
    combines, _ = capture_per_rank(streams, lambda r: ops[r].combine(handles[r][0], handles[r][2]))
    return dispatches, combines


def _replayed(graphs: list[Any], streams: list[Any], clients: list[Any]) -> float:
    """Seconds of one phase replayed, every rank's graph on its stream at once, from settled daemons (a replay's
    ~4 us of host time in place of a call's)."""
    settle(clients)
    start = time.perf_counter()
    replay_per_rank(graphs, streams)
    for stream in streams:
        stream.synchronize()
    return time.perf_counter() - start


def _graph_us(row: dict[str, Any]) -> str:
    """A MoE row's graph-replayed latencies, for the echo ("" where it has none)."""
    if row.get("dispatch_graph_s") is None:
        return ""
    return f"graphs: dispatch {row['dispatch_graph_s'] * 1e6:8.1f} us  combine {row['combine_graph_s'] * 1e6:8.1f} us  "


def graph_cell(row: dict[str, Any]) -> str:
    if row.get("dispatch_graph_s") is None:
        return "—"
    return f"{row['dispatch_graph_s'] * 1e6:.1f} / {row['combine_graph_s'] * 1e6:.1f}"


def _dequantized(received: tuple[Any, Any]) -> Any:
    """bf16 rows from fp8 dispatch's (values, scales per 128)."""
    import torch

    q, scales = received
    return (q.float().unflatten(-1, (-1, 128)) * scales[..., None]).flatten(-2).to(torch.bfloat16)
