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
    windows. An fp8 row also times a bf16 MoE on the same daemons (``bf16_dispatch_s``, ``bf16_combine_s``; its
    combine checked as ``bf16_max_abs_error``), its rounds alternated with fp8's, first one then the other: the
    two row formats compared with no drift, and no other pair of daemons, between them."""
    import torch

    from gpuclient.kernels import MoE
    from gpuclient.kernels.moe_layout import MoELayout

    config = {"signal": {"decoupled": True}} if decoupled else None
    gen = torch.Generator(device="cpu").manual_seed(7)
    with rank_sessions(run, backend, shape, "fused-bench-moe", device, config) as (clients, sessions):
        if fp8:  # flag words for two ops: the fp8 one's, then its bf16 twin's past them
            for s in sessions:
                s.flags(2 * MoELayout(s.rank, s.world, experts, tokens, topk, hidden).slots, where="device")
        ops = [MoE(s, hidden, experts, tokens, topk, share=WORLD, fp8=fp8) for s in sessions]
        twins = [MoE(s, hidden, experts, tokens, topk, share=WORLD, slot_base=op.slots)
                 for s, op in zip(sessions, ops, strict=True)] if fp8 else []
        exchange_all(sessions, timeout=60)
        for op in (*ops, *twins):
            op.prepare()
        streams = [torch.cuda.Stream(device) for _ in ops]
        xs = [randn_bf16(gen, tokens, hidden, device=device) for _ in ops]
        idx = [uniform_topk(gen, tokens, experts, topk, device) for _ in ops]
        weights = [torch.rand(tokens, topk, generator=gen).cuda(device) for _ in ops]
        torch.cuda.synchronize()
        timed = _RoundTimer(clients, streams, xs, idx, weights)
        dispatch_s, combine_s = [], []
        twin_s: tuple[list[float], list[float]] = ([], [])
        graph_s: tuple[list[float], list[float]] = ([], [])
        graphs: tuple[list[Any], list[Any]] | None = None
        posted = {"dispatch": dict.fromkeys(COUNTED, 0), "combine": dict.fromkeys(COUNTED, 0)}

        def combine_error(op: Any) -> float:  # with y = x and weights summing per token, combine returns sum_k w_k * x
            expect = xs[0].float() * weights[0].sum(dim=1, keepdim=True)
            return float((op.out[:tokens].float() - expect).abs().max())

        errors, twin_errors = [], []  # the last round's, from its calls and from its graphs; the twin's apart
        for i in range(reps + 1):  # round 0 warms up; its counts and times are dropped
            if twins and i % 2 == 0:  # the twin first in every other round
                twin = timed.round(twins, fp8=False)
            seconds, counters = timed.round(ops, fp8)
            if twins and i % 2 == 1:
                twin = timed.round(twins, fp8=False)
            if i == reps:
                errors.append(combine_error(ops[0]))
                if twins:
                    twin_errors.append(combine_error(twins[0]))
            if i > 0:
                dispatch_s.append(seconds[0])
                combine_s.append(seconds[1])
                if twins:
                    twin_s[0].append(twin[0][0])
                    twin_s[1].append(twin[0][1])
                before, mid, after = counters
                for key in COUNTED:
                    posted["dispatch"][key] += sum(m[key] - b[key] for b, m in zip(before, mid, strict=True))
                    posted["combine"][key] += sum(a[key] - m[key] for m, a in zip(mid, after, strict=True))
            # the same round replayed from CUDA graphs, captured after the warm-up's calls (bf16: fp8's
            # dequantization runs between the phases); in the same round, so a drift weighs on both alike
            if not fp8:
                graphs = graphs or _moe_graphs(ops, streams, xs, idx, weights)
                for phase, samples in zip(graphs, graph_s, strict=True):
                    seconds_replayed = _replayed(phase, streams, clients)
                    if i > 0:
                        samples.append(seconds_replayed)
        if graphs:
            errors.append(combine_error(ops[0]))
        error = max(errors)
        check_channels([*ops, *twins])
    rounds = len(dispatch_s)
    per = WORLD * (WORLD - 1) * rounds  # (sender, destination) pairs over the counted rounds
    row: dict[str, Any] = {"kernel": "moe", "backend": backend, "shape": shape, "nic": SHAPES.get(shape, {}),
                           "decoupled": decoupled, "fp8": fp8, "world": WORLD, "tokens": tokens, "hidden": hidden,
                           "topk": topk,
                           "experts": experts, "rounds": rounds, "max_abs_error": error,
                           "dispatch_s": statistics.median(dispatch_s), "combine_s": statistics.median(combine_s),
                           "dispatch_graph_s": statistics.median(graph_s[0]) if graph_s[0] else None,
                           "combine_graph_s": statistics.median(graph_s[1]) if graph_s[1] else None,
                           "bf16_dispatch_s": statistics.median(twin_s[0]) if twin_s[0] else None,
                           "bf16_combine_s": statistics.median(twin_s[1]) if twin_s[1] else None,
                           "bf16_max_abs_error": max(twin_errors) if twin_errors else None}
    for phase, counts in posted.items():
        for key in ("signals", "signals_requested", "fences", "writes", "direct_placed"):
            row[f"{phase}_{key}_per_dest"] = counts[key] / per
    echo(f"  moe {backend} {shape:9s} decoupled={'on ' if decoupled else 'off'}{' fp8' if fp8 else ''} "
         f"dispatch {row['dispatch_s'] * 1e6:8.1f} us  combine {row['combine_s'] * 1e6:8.1f} us  "
         f"{_graph_us(row)}{_twin_us(row)}"
         f"per dispatch and destination: signals "
         f"{row['dispatch_signals_per_dest']:.2f} (requested {row['dispatch_signals_requested_per_dest']:.2f}), "
         f"fences {row['dispatch_fences_per_dest']:.2f}, writes {row['dispatch_writes_per_dest']:.1f} "
         f"({row['dispatch_direct_placed_per_dest']:.1f} placed by direct copy)")
    return row


class _RoundTimer:
    """``moe_row``'s round for one MoE per rank: the ranks' dispatches at once, then their combines, each phase
    from settled daemons, with the daemons' counters read around (outside) the timed windows."""

    def __init__(self, clients: list[Any], streams: list[Any], xs: list[Any], idx: list[Any],
                 weights: list[Any]) -> None:
        self.clients, self.streams, self.xs, self.idx, self.weights = clients, streams, xs, idx, weights

    def _synchronized(self) -> float:
        for s in self.streams:
            s.synchronize()
        return time.perf_counter()

    def round(self, ops: list[Any], fp8: bool) -> tuple[tuple[float, float], tuple[list, list, list]]:
        """((dispatch s, combine s), (counters before, between and after the phases)) of one round."""
        import torch

        settle(self.clients)
        before = [daemon_counters(c) for c in self.clients]
        t0 = time.perf_counter()
        handles = [op.dispatch(self.xs[r], self.idx[r], self.weights[r], stream=self.streams[r])
                   for r, op in enumerate(ops)]
        t1 = self._synchronized()
        ys = [_dequantized(h[0]) if fp8 else h[0] for h in handles]  # the identity expert: y = x
        torch.cuda.synchronize()
        settle(self.clients)
        mid = [daemon_counters(c) for c in self.clients]
        t2 = time.perf_counter()
        for r, op in enumerate(ops):
            op.combine(ys[r], handles[r][2], stream=self.streams[r])
        t3 = self._synchronized()
        settle(self.clients)
        after = [daemon_counters(c) for c in self.clients]
        return (t1 - t0, t3 - t2), (before, mid, after)


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


def _twin_us(row: dict[str, Any]) -> str:
    """An fp8 row's bf16 twin on the same daemons, for the echo ("" where it has none)."""
    if row.get("bf16_dispatch_s") is None:
        return ""
    return (f"bf16 beside it: dispatch {row['bf16_dispatch_s'] * 1e6:8.1f} us  "
            f"combine {row['bf16_combine_s'] * 1e6:8.1f} us  ")


def twin_cell(row: dict[str, Any]) -> str:
    if row.get("bf16_dispatch_s") is None:
        return "—"
    return f"{row['bf16_dispatch_s'] * 1e6:.1f} / {row['bf16_combine_s'] * 1e6:.1f}"


def graph_cell(row: dict[str, Any]) -> str:
    if row.get("dispatch_graph_s") is None:
        return "—"
    return f"{row['dispatch_graph_s'] * 1e6:.1f} / {row['combine_graph_s'] * 1e6:.1f}"


def _dequantized(received: tuple[Any, Any]) -> Any:
    """bf16 rows from fp8 dispatch's (values, scales per 128)."""
    import torch

    q, scales = received
    return (q.float().unflatten(-1, (-1, 128)) * scales[..., None]).flatten(-2).to(torch.bfloat16)
