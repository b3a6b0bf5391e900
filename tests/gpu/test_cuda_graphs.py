"""The fused ops captured in CUDA graphs and replayed: two ranks on two daemons sharing the GPU, ib and efa.

A launch reads its round from the op's round words in device memory (``gpuclient/kernels/_rounds.py``), so a
replay runs the next round as a call would. Each test makes one eager call; captures each rank's call in a graph
of its own (the capture runs nothing); replays the graphs ``REPLAYS`` times, with new inputs copied into the
captured input tensors and everything a peer owes, and the captured outputs, poisoned (NaN) before each; then
makes one more eager call. Every launch is checked against torch, and the rounds the device ran after each,
with no flag reset anywhere. Where the two ranks share a process, MoE's dispatch and combine are graphs of their
own, with the expert matmul between them outside (no kernel of a rank is queued behind a waiting kernel of its
own: test_moe.py's launch discipline); with a process per rank, as ranks run on a cluster, one graph holds a
whole MoE layer: dispatch, the experts' matmul and combine.
"""

from __future__ import annotations

import multiprocessing
import queue
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from gpuclient.kernels.moe_layout import dispatch_model

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from tests.gpu.test_fused_kernels import (  # noqa: E402  (needs torch)
    _assert_ranks_match_torch,
    _close,
    _cluster,
    _exchange,
    _poison_owed,
    _ranks,
)
from tests.gpu.test_moe import _expert_weights, _prepared, _routing, _seeded  # noqa: E402
from tests.support.cuda_graphs import capture_per_rank, replay_per_rank  # noqa: E402

REPLAYS = 3
NAN = float("nan")


def _eager(streams: list, call: Callable[[int], Any], device: int) -> list:
    """Every rank's ``call(r)`` on its stream, from an idle GPU; the results once the GPU is idle again."""
    torch.cuda.synchronize(device)
    results = []
    for r, stream in enumerate(streams):
        with torch.cuda.stream(stream):
            results.append(call(r))
    torch.cuda.synchronize(device)
    return results


def _replay(graphs: list, streams: list, device: int) -> None:
    """Every rank's graph replayed on its stream, from an idle GPU to an idle GPU."""
    torch.cuda.synchronize(device)
    replay_per_rank(graphs, streams)
    torch.cuda.synchronize(device)


def _random_into(tensors: list, gen: Any) -> None:
    for t in tensors:
        t.copy_(torch.randn(t.shape, generator=gen).to(t.dtype))


@pytest.mark.parametrize("fabric", ["ib", "efa"])
@pytest.mark.parametrize("kind", ["allgather_gemm", "gemm_reduce_scatter", "gemm_all_reduce", "ring_attention"])
def test_the_fused_ops_replay_from_cuda_graphs(cuda_device, fabric: str, kind: str) -> None:
    from gpuclient.kernels import AllGatherGemm, GemmAllReduce, GemmReduceScatter, RingAttention

    world, bf16, dev = 2, torch.bfloat16, f"cuda:{cuda_device}"
    gen = torch.Generator(device="cpu").manual_seed(21)
    # the shapes of test_fused_kernels.py: no multiple of the tiles nor of the 48-row chunks
    heads, seq_local, head_dim = 3, 200, 128
    m_local, m, n, k = 200, 368, 200, 200
    with _cluster(2, fabric) as cluster:
        sessions = _ranks(cluster, f"graph-{kind}", cuda_device, world)
        try:
            if kind == "allgather_gemm":
                ops = [AllGatherGemm(s, m_local, n, k, chunk_rows=48, share=world, programs=24) for _, s in sessions]
                inputs = [[torch.empty(m_local, k, dtype=bf16, device=dev), torch.empty(k, n, dtype=bf16, device=dev)]
                          for _ in ops]
            elif kind == "ring_attention":
                ops = [RingAttention(s, heads, seq_local, head_dim, causal=True, chunk_rows=48, share=world,
                                     programs=5) for _, s in sessions]
                inputs = [[torch.empty(heads, seq_local, head_dim, dtype=bf16, device=dev) for _ in range(3)]
                          for _ in ops]
            else:
                cls = GemmAllReduce if kind == "gemm_all_reduce" else GemmReduceScatter
                ops = [cls(s, m, n, k, chunk_rows=48, share=world, programs=5, out_dtype=bf16) for _, s in sessions]
                inputs = [[torch.empty(m, k, dtype=bf16, device=dev), torch.empty(k, n, dtype=bf16, device=dev)]
                          for _ in ops]
            _exchange(sessions)
            for op in ops:  # both ranks' kernels loaded before either launches, and before any capture
                op.prepare()
            streams = [torch.cuda.Stream(cuda_device) for _ in ops]

            def call(r: int) -> Any:
                return ops[r](*inputs[r], stream=streams[r])

            def fresh(outputs: list) -> None:
                """New inputs in the tensors a graph reads; what the peers owe and the outputs poisoned."""
                _random_into([t for per_rank in inputs for t in per_rank], gen)
                _poison_owed(ops, kind)
                for out in outputs:
                    out.fill_(NAN)

            def check(outs: list, what: str) -> None:
                _assert_ranks_match_torch(kind, ops, outs, inputs, True, f"{fabric} {kind}, {what}")

            def rounds_run() -> list[int]:
                return [int(op._rounds[0]) for op in ops]

            fresh([])
            check(_eager(streams, call, cuda_device), "eager launch 1")
            assert rounds_run() == [1, 1]
            graphs, outs = capture_per_rank(streams, call)
            assert rounds_run() == [1, 1], "a capture ran a round"
            for replay in range(1, REPLAYS + 1):
                fresh(outs)
                _replay(graphs, streams, cuda_device)
                check(outs, f"replay {replay}")
                assert rounds_run() == [1 + replay] * world
            fresh([])
            check(_eager(streams, call, cuda_device), "the eager launch after the replays")
            assert rounds_run() == [2 + REPLAYS] * world
        finally:
            _close(sessions)


@pytest.mark.parametrize("fabric", ["ib", "efa"])
@pytest.mark.parametrize("fused", [False, True])
def test_moe_dispatch_and_combine_replay_from_cuda_graphs(cuda_device, fabric: str, fused: bool) -> None:
    """``dispatch`` (or ``dispatch_gemm``) and ``combine`` each in a graph per rank; the combined output of every
    launch against a float64 torch MoE on the same routing (uneven, -1 entries, repeats), as in test_moe.py."""
    world, experts, max_tokens, topk, hidden = 2, 6, 40, 3, 200
    dev = f"cuda:{cuda_device}"
    rng, gen, lays, local = _seeded(31, world, experts, max_tokens, topk, hidden)
    tokens = [max_tokens, max_tokens - 7]
    with _cluster(2, fabric) as cluster:
        sessions = _ranks(cluster, "graph-moe", cuda_device, world)
        try:
            extra = {"gemm_n": hidden, "comm_programs": 2, "gemm_programs": 6} if fused else {}
            ops, streams = _prepared(sessions, hidden, experts, max_tokens, topk, cuda_device, **extra)
            weights_e, w_dev = _expert_weights(gen, experts, hidden, dev)
            w_rank = [w_dev[r * local:(r + 1) * local] for r in range(world)]
            x = [torch.empty(n, hidden, dtype=torch.bfloat16, device=dev) for n in tokens]
            idx = [torch.empty(n, topk, dtype=torch.int64, device=dev) for n in tokens]
            weights = [torch.empty(n, topk, dtype=torch.float32, device=dev) for n in tokens]
            ys = [op.y if fused else torch.empty_like(op.recv_x) for op in ops]  # combine's input
            case: dict[str, Any] = {}

            def fresh(outputs: list) -> None:
                """A new routing and new tokens in the tensors a graph reads; all a peer writes poisoned."""
                case["idx"] = [_routing(rng, n, topk, np.arange(experts), hot=1, dtype=np.int64) for n in tokens]
                case["xs"] = [torch.randn(n, hidden, generator=gen).to(torch.bfloat16) for n in tokens]
                case["ws"] = [torch.rand(n, topk, generator=gen) for n in tokens]
                for r in range(world):
                    idx[r].copy_(torch.from_numpy(case["idx"][r]))
                    x[r].copy_(case["xs"][r])
                    weights[r].copy_(case["ws"][r])
                for op, y in zip(ops, ys, strict=True):
                    for buf in (op.recv_x, op.send_x, op.send_y, op.combine_buf, op.out, y):
                        buf.fill_(NAN)
                    op.recv_src.fill_(-1)
                    op.src_stage.fill_(-1)
                for out in outputs:
                    out.fill_(NAN)

            def dispatch(r: int) -> tuple:
                if fused:
                    return ops[r].dispatch_gemm(x[r], idx[r], weights[r], w_rank[r], stream=streams[r])
                return ops[r].dispatch(x[r], idx[r], weights[r], stream=streams[r])

            def experts_between() -> None:  # the plain dispatch's experts, on an idle GPU
                if not fused:
                    for r, op in enumerate(ops):
                        torch.bmm(op.recv_x, w_rank[r], out=ys[r])
                    torch.cuda.synchronize(cuda_device)

            def check(outs: list, what: str) -> None:
                model = dispatch_model(lays, case["idx"])
                for r, op in enumerate(ops):
                    where = f"{fabric} {'dispatch_gemm' if fused else 'dispatch'} rank {r}, {what}"
                    assert op.channel.status()[0] == 0, (where, op.channel.status())
                    got = outs[r].double().cpu()
                    assert torch.isfinite(got).all(), f"{where}: a slot read before it arrived (NaN)"
                    ref = torch.zeros(tokens[r], hidden, dtype=torch.float64)
                    magnitude = torch.zeros_like(ref)
                    norm = model[r]["idx"]
                    for t, j in zip(*np.nonzero(norm >= 0), strict=True):
                        term = case["ws"][r][t, j].double() * (case["xs"][r][t].double() @
                                                              weights_e[int(norm[t, j])].double())
                        ref[t] += term
                        magnitude[t] += term.abs()
                    # bf16 expert outputs (2^-8 each) and a bf16 sum, with test_moe.py's margin
                    bound = 2.0 ** -6 * (magnitude + ref.abs()) + 2e-2
                    assert ((got - ref).abs() <= bound).all(), (where, float((got - ref).abs().max()))

            def rounds_run() -> list[list[int]]:
                return [op._rounds.tolist() for op in ops]

            def ran(n: int) -> list[list[int]]:  # the rounds run, no launch half done, the fused ones
                return [[n, 0, n if fused else 0]] * world

            fresh([])
            handles = _eager(streams, dispatch, cuda_device)
            experts_between()
            check(_eager(streams, lambda r: ops[r].combine(ys[r], handles[r][2], stream=streams[r]), cuda_device),
                  "eager round 1")
            assert rounds_run() == ran(1)
            dispatch_graphs, captured = capture_per_rank(streams, dispatch)
            combine_graphs, outs = capture_per_rank(streams, lambda r: ops[r].combine(ys[r], captured[r][2]))
            assert rounds_run() == ran(1), "a capture ran a round"
            for replay in range(1, REPLAYS + 1):
                fresh(outs)
                _replay(dispatch_graphs, streams, cuda_device)
                experts_between()
                _replay(combine_graphs, streams, cuda_device)
                check(outs, f"replay {replay}")
                assert rounds_run() == ran(1 + replay)
            fresh([])
            handles = _eager(streams, dispatch, cuda_device)
            experts_between()
            check(_eager(streams, lambda r: ops[r].combine(ys[r], handles[r][2], stream=streams[r]), cuda_device),
                  "the eager round after the replays")
            assert rounds_run() == ran(2 + REPLAYS)
        finally:
            _close(sessions)


LAYER = {"world": 2, "experts": 6, "max_tokens": 40, "topk": 3, "hidden": 200}


def _moe_layer_rank(rank: int, socket: str, device: int, results: Any) -> None:
    """One rank in a process of its own: a MoE layer (dispatch, each local expert's matmul, combine) called once,
    captured whole in one CUDA graph and replayed ``REPLAYS`` times with new tokens and routing, then called once
    more. Puts ``(rank, {"errors": [the worst error against the float64 reference's bound, per launch], "rounds":
    the op's round words, "status": its channel's status})``, or ``(rank, the exception)``."""
    try:
        import torch

        import gpuclient
        from gpuclient.kernels import MoE

        world, experts, max_tokens, topk, hidden = (LAYER[k] for k in ("world", "experts", "max_tokens", "topk",
                                                                        "hidden"))
        torch.cuda.set_device(device)
        dev = f"cuda:{device}"
        client = gpuclient.connect(socket, timeout=60)
        session = client.join("graph-moe-layer", rank=rank, world=world, device=device)
        op = MoE(session, hidden, experts, max_tokens, topk, share=world, programs=4)
        session.exchange(timeout=60)
        op.prepare()
        local = experts // world
        rng, gen = np.random.default_rng(40 + rank), torch.Generator(device="cpu").manual_seed(40 + rank)
        weights_e = (torch.randn(experts, hidden, hidden, generator=torch.Generator().manual_seed(7)) /
                     hidden ** 0.5).to(torch.bfloat16)  # every process draws every expert alike
        w_local = weights_e[rank * local:(rank + 1) * local].to(dev)
        tokens = max_tokens - 5 * rank
        x = torch.empty(tokens, hidden, dtype=torch.bfloat16, device=dev)
        idx = torch.empty(tokens, topk, dtype=torch.int64, device=dev)
        weights = torch.empty(tokens, topk, dtype=torch.float32, device=dev)
        y = torch.empty_like(op.recv_x)

        def layer() -> Any:
            recv_x, _, handle = op.dispatch(x, idx, weights)
            torch.bmm(recv_x, w_local, out=y)
            return op.combine(y, handle)

        def fresh() -> tuple[Any, Any, Any]:
            """New tokens and routing in the tensors the graph reads; all a peer writes poisoned (no peer writes
            into them before this rank's dispatch sends its counts)."""
            idx_np = _routing(rng, tokens, topk, np.arange(experts), hot=1, dtype=np.int64)
            xs, ws = torch.randn(tokens, hidden, generator=gen).to(torch.bfloat16), torch.rand(tokens, topk,
                                                                                             generator=gen)
            idx.copy_(torch.from_numpy(idx_np))
            x.copy_(xs)
            weights.copy_(ws)
            for buf in (op.recv_x, op.send_x, op.send_y, op.combine_buf, op.out, y):
                buf.fill_(NAN)
            torch.cuda.synchronize(device)
            return idx_np, xs, ws

        def worst(out: Any, idx_np: np.ndarray, xs: Any, ws: Any) -> float:
            """max(|out - ref| / bound) against a float64 MoE (repeats count once, -1 is no expert)."""
            got = out.double().cpu()
            ref, magnitude = torch.zeros(tokens, hidden, dtype=torch.float64), torch.zeros(tokens, hidden,
                                                                                          dtype=torch.float64)
            for t in range(tokens):
                for e in {int(e) for e in idx_np[t] if 0 <= e < experts}:
                    j = int(np.nonzero(idx_np[t] == e)[0][0])
                    term = ws[t, j].double() * (xs[t].double() @ weights_e[e].double())
                    ref[t] += term
                    magnitude[t] += term.abs()
            return float(((got - ref).abs() / (2.0 ** -6 * (magnitude + ref.abs()) + 2e-2)).max())

        errors = []
        case = fresh()
        errors.append(worst(layer(), *case))
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            out = layer()
        for _ in range(REPLAYS):
            case = fresh()
            graph.replay()
            torch.cuda.synchronize(device)
            errors.append(worst(out, *case))
        case = fresh()
        errors.append(worst(layer(), *case))
        torch.cuda.synchronize(device)
        results.put((rank, {"errors": errors, "rounds": op._rounds.tolist(), "status": list(op.channel.status())}))
        session.leave()
        client.close()
    except BaseException as exc:  # the parent reports it
        results.put((rank, f"{type(exc).__name__}: {exc}"))


@pytest.mark.parametrize("fabric", ["ib", "efa"])
def test_a_whole_moe_layer_replays_from_one_graph_in_each_rank_s_process(cuda_device, fabric: str) -> None:
    """Two rank processes on the GPU (under the suite's MPS, their kernels run side by side): each captures its
    MoE layer, dispatch -> expert matmul -> combine, in one graph. Every launch's output within the bound (<= 1),
    NaN-poisoned before each, and every rank ran REPLAYS + 2 rounds."""
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    with _cluster(2, fabric) as cluster:
        procs = [context.Process(target=_moe_layer_rank, args=(r, cluster.socket(name), cuda_device, results))
                 for r, name in enumerate(cluster.names)]
        for proc in procs:
            proc.start()
        try:
            got = dict(results.get(timeout=200) for _ in procs)
        except queue.Empty:
            got = {}
        finally:
            for proc in procs:
                proc.join(timeout=30)
                if proc.is_alive():
                    proc.kill()
    assert sorted(got) == [0, 1], f"{fabric}: a rank process reported nothing: {got}"
    for rank, report in sorted(got.items()):
        assert isinstance(report, dict), f"{fabric} rank {rank}: {report}"
        errors = report["errors"]  # NaN (read before arrival) compares false
        assert len(errors) == REPLAYS + 2 and all(e <= 1.0 for e in errors), (fabric, rank, report)
        assert report["rounds"] == [REPLAYS + 2, 0, 0] and report["status"][0] == 0, (fabric, rank, report)
