"""gpuclient.kernels.MoE on two daemons (ib and efa), two ranks sharing the GPU in one process (dispatch and
combine also with four, two a daemon).

Three rounds of dispatch -> per-expert matmul in torch -> combine, with no flag reset, each on uneven
routing: a hot expert, an expert no token picks, -1 entries and repeated experts; round 2 sends every token
to rank 0's experts (rank 1 receives nothing), round 3 has rank 1 dispatch no tokens at all and uses int32
indices (rounds 1-2 int64). Everything a peer writes (received rows, handle words, expert outputs) and what
is shipped from is poisoned before each round. Checked: counts, per-source layout and handle words exactly
against the numpy model (gpuclient/kernels/moe_layout.py), every received row bit for bit, the combined
output against the model's weighted sum of the experts' actual outputs (bf16 rounding of one fp32 sum) and
against a float64 torch reference MoE (bf16 rounding of the expert outputs too); channel error words 0.

Launch discipline (one process, one GPU): every kernel of both ops is compiled and loaded (``prepare``)
before any launch; inputs are made before the round's first launch; between one rank's launches and the
other's no torch kernel runs (a module load there would wait behind a spinning kernel); the torch expert
matmul runs only after a synchronize, when no MoE kernel is resident.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from gpuclient.kernels.moe_layout import MoELayout, combine_model, dispatch_model

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from tests.gpu.test_fused_kernels import DECOUPLED, _close, _cluster, _exchange, _ranks  # noqa: E402  (needs torch)

ROUNDS = 3


def _routing(rng: np.random.Generator, tokens: int, topk: int, pickable: np.ndarray, hot: int,
             dtype: type) -> np.ndarray:
    """Top-k lists over ``pickable`` experts: ``hot`` in half the tokens' first entry (which may repeat a
    later entry: a repeat counts once), 15 % of entries -1, token 0 with no expert."""
    if tokens == 0:
        return np.zeros((0, topk), dtype=dtype)
    idx = np.stack([rng.choice(pickable, size=topk, replace=False) for _ in range(tokens)])
    idx[rng.random(tokens) < 0.5, 0] = hot
    idx[rng.random((tokens, topk)) < 0.15] = -1
    idx[0] = -1
    return idx.astype(dtype)


def _expert_weights(gen: Any, experts: int, hidden: int, device: str) -> tuple[Any, Any]:
    """Every expert's ``hidden x hidden`` bf16 weight (scaled to keep outputs near unit size): on the CPU for
    the references, and a copy on ``device``."""
    weights = (torch.randn(experts, hidden, hidden, generator=gen) / hidden ** 0.5).to(torch.bfloat16)
    return weights, weights.to(device)


def _seeded(seed: int, world: int, experts: int, max_tokens: int, topk: int,
            hidden: int) -> tuple[np.random.Generator, Any, list[MoELayout], int]:
    """A test's numpy generator and torch CPU generator seeded alike, each rank's layout and the experts a rank
    holds."""
    lays = [MoELayout(r, world, experts, max_tokens, topk, hidden) for r in range(world)]
    return np.random.default_rng(seed), torch.Generator(device="cpu").manual_seed(seed), lays, lays[0].local_experts


def _round_shape(rnd: int, local: int, experts: int, max_tokens: int,
                 world: int = 2) -> tuple[np.ndarray, list[int]]:
    """(the experts a round picks from, each rank's token count): round 1 leaves expert 5 unpicked, round 2
    picks only rank 0's experts (the other ranks receive nothing), round 3 has rank 1 send nothing."""
    pickable = {1: np.arange(5), 2: np.arange(local), 3: np.arange(experts)}[rnd]
    if rnd < 3:
        return pickable, [max_tokens - 7 * r for r in range(world)]
    return pickable, [max_tokens - 3] + [0] + [max_tokens - r for r in range(2, world)]


# (fabric, world, experts): world 4 is two ranks on each of the two daemons, all four on the GPU
LL_CASES = [(fabric, 2, 6) for fabric in ("ib", "ib-atomic", "ib-fence", "efa", "ib" + DECOUPLED,
                                         "efa" + DECOUPLED)] + [("ib", 4, 12), ("efa", 4, 12)]


@pytest.mark.parametrize(("fabric", "world", "experts"), LL_CASES)
def test_moe_dispatch_and_combine_match_a_torch_reference(cuda_device, fabric: str, world: int, experts: int) -> None:
    # hidden 200: no multiple of the 256-wide copy block; 3 local experts per rank (round 2's top-3 picks among
    # rank 0's); 40 rows per rank at most
    max_tokens, topk, hidden = 40, 3, 200
    dev = f"cuda:{cuda_device}"
    rng, gen, lays, local = _seeded(11, world, experts, max_tokens, topk, hidden)
    with _cluster(2, fabric) as cluster:
        sessions = _ranks(cluster, "moe-ll", cuda_device, world)
        try:
            ops, streams = _prepared(sessions, hidden, experts, max_tokens, topk, cuda_device)
            weights_e, w_dev = _expert_weights(gen, experts, hidden, dev)
            bad = torch.zeros(max_tokens + 1, hidden, dtype=torch.bfloat16, device=dev)
            with pytest.raises(ValueError, match="x must be"):
                ops[0].dispatch(bad, bad[:, :topk].long(), bad[:, :topk].float())
            with pytest.raises(RuntimeError, match="without gemm_n"):  # built without the fused GEMM
                ops[0].dispatch_gemm(bad[:max_tokens], bad[:max_tokens, :topk].long(),
                                     bad[:max_tokens, :topk].float(), w_dev)
            for rnd in range(1, ROUNDS + 1):
                # round 1: expert 5 unpicked, expert 1 hot; round 2: only rank 0's experts (rank 1 receives
                # nothing); round 3: rank 1 sends nothing, int32 indices
                pickable, tokens = _round_shape(rnd, local, experts, max_tokens, world)
                dtype = np.int64 if rnd < 3 else np.int32
                idx = [_routing(rng, n, topk, pickable, hot=1, dtype=dtype) for n in tokens]
                xs = [torch.randn(n, hidden, generator=gen).to(torch.bfloat16) for n in tokens]
                ws = [torch.rand(n, topk, generator=gen) for n in tokens]
                # all inputs on the GPU and every buffer poisoned before the round's first launch
                x_dev = [x.to(dev) for x in xs]
                idx_dev = [torch.from_numpy(i).to(dev) for i in idx]
                w_in = [w.to(dev) for w in ws]
                handles = _poison_and_dispatch(ops, streams, x_dev, idx_dev, w_in, cuda_device)

                model = dispatch_model(lays, idx)
                ys = []
                for r, (op, (recv_x, recv_count, handle)) in enumerate(zip(ops, handles, strict=True)):
                    what = f"{fabric} round {rnd} rank {r}"
                    assert op.channel.status()[0] == 0, (what, op.channel.status())
                    assert recv_count.cpu().numpy().tolist() == model[r]["recv_count"].tolist(), what
                    assert (handle.recv_layout.cpu().numpy() == model[r]["recv_layout"]).all(), what
                    assert (handle.topk_idx.cpu().numpy() == model[r]["idx"]).all(), what
                    src = handle.recv_src.cpu().numpy()
                    rows = recv_x.cpu()
                    for le in range(local):
                        n = int(model[r]["recv_count"][le])
                        assert (src[le, :n] == model[r]["recv_src"][le, :n]).all(), (what, le)
                        for p in range(n):  # every row is its token's row, bit for bit (NaN: never arrived)
                            s, t, _ = lays[r].decode(src[le, p])
                            assert torch.equal(rows[le, p].view(torch.int16), xs[s][t].view(torch.int16)), (
                                what, le, p)
                    # the experts: a matmul per local expert over all W*T rows (rows past the counts are NaN
                    # and stay in their own rows of y; combine never reads them)
                    ys.append(torch.bmm(recv_x, w_dev[r * local:(r + 1) * local]))
                torch.cuda.synchronize(cuda_device)

                _combine_and_check(ops, streams, handles, ys, lays, model, xs, ws, weights_e, tokens, hidden,
                                   cuda_device, f"{fabric} round {rnd}")
            for op in ops:  # the calls made, and the rounds the device ran (a refused call is neither)
                assert op.rounds == ROUNDS and op._rounds.tolist() == [ROUNDS, 0, 0]
        finally:
            _close(sessions)


def _prepared(sessions: list, hidden: int, experts: int, max_tokens: int, topk: int, device: int,
              **kwargs: Any) -> tuple[list, list]:
    """Every rank's MoE (4 programs: both ranks' grids resident together, several programs per kernel), the
    exchange, every kernel of both ranks loaded before either launches (one process, one GPU), a stream each."""
    from gpuclient.kernels import MoE

    ops = [MoE(s, hidden, experts, max_tokens, topk, share=len(sessions), programs=4, **kwargs) for _, s in sessions]
    _exchange(sessions)
    for op in ops:
        op.prepare()
    return ops, [torch.cuda.Stream(device) for _ in ops]


def _poison_and_dispatch(ops: list, streams: list, xs: list, idx: list, weights: list, device: int) -> list:
    """Poison everything a peer writes, where its rows land and what is shipped from (NaN; 0xFF bytes in fp8
    rows: NaN as e4m3 and as the fp32 scales), then every rank's dispatch on its stream; the results once the GPU
    is idle."""
    for op in ops:
        for buf in (op.recv_x, op.land_x, op.send_x, op.send_y, op.combine_buf, op.out):
            buf.fill_(0xFF if buf.dtype == torch.uint8 else float("nan"))
        op.recv_src.fill_(-1)
        op.src_stage.fill_(-1)
        op.recv_count.fill_(-1)
    torch.cuda.synchronize(device)
    handles = []
    for r, op in enumerate(ops):
        with torch.cuda.stream(streams[r]):
            handles.append(op.dispatch(xs[r], idx[r], weights[r], stream=streams[r]))
    torch.cuda.synchronize(device)
    return handles


def _combine_and_check(ops: list, streams: list, handles: list, ys: list, lays: list, model: list, xs: list,
                       ws: list, weights_e: Any, tokens: list, hidden: int, device: int, prefix: str,
                       dense: bool = True) -> None:
    """Combine every rank's ``ys`` and check each output: against the model on the experts' actual outputs (one
    fp32 sum rounded to bf16), and, when ``dense``, against a float64 torch MoE whose expert e is ``x @
    weights_e[e]``; a token with no expert sums to exactly 0."""
    outs = []
    for r, op in enumerate(ops):
        with torch.cuda.stream(streams[r]):
            outs.append(op.combine(ys[r], handles[r][2], stream=streams[r]))
    torch.cuda.synchronize(device)

    y_host = [y.double().cpu().numpy() for y in ys]
    want = combine_model(lays, model, y_host, [w.double().numpy() for w in ws])
    for r, op in enumerate(ops):
        what = f"{prefix} rank {r}"
        assert op.channel.status()[0] == 0, (what, op.channel.status())
        got = outs[r].double().cpu()
        assert tuple(got.shape) == (tokens[r], hidden), what
        assert torch.isfinite(got).all(), f"{what}: a slot read before it arrived (NaN)"
        # against the model on the experts' actual outputs: one fp32 sum rounded to bf16
        magnitude = np.zeros((tokens[r], hidden))
        norm = model[r]["idx"]
        for t, k in zip(*np.nonzero(norm >= 0), strict=True):
            d, le = lays[r].owner(norm[t, k])
            p = int(np.nonzero(model[d]["recv_src"][le] == lays[r].encode(r, t, k))[0][0])
            magnitude[t] += abs(ws[r][t, k].item()) * np.abs(y_host[d][le, p])
        err = np.abs(got.numpy() - want[r])
        assert (err <= 2.0 ** -7 * (magnitude + np.abs(want[r])) + 1e-3).all(), (what, err.max())
        if not dense:
            continue
        # against a dense torch reference MoE in float64 (the same routing, normalised)
        ref = torch.zeros(tokens[r], hidden, dtype=torch.float64)
        for t, k in zip(*np.nonzero(norm >= 0), strict=True):
            e = int(norm[t, k])
            ref[t] += ws[r][t, k].double() * (xs[r][t].double() @ weights_e[e].double())
        bound = 2.0 ** -6 * (torch.from_numpy(magnitude) + ref.abs()) + 2e-2
        assert ((got - ref).abs() <= bound).all(), (what, float((got - ref).abs().max()))
        # a token with no expert sums to exactly 0
        empty = np.nonzero((norm < 0).all(axis=1))[0]
        assert (got[torch.from_numpy(empty)] == 0).all(), what


def _rows_of(lay: MoELayout, recv_src: np.ndarray, n: int, xs: list) -> Any:
    """The received rows of one expert as the model says they are: each handle word's token row (float64)."""
    rows = [xs[s][t] for s, t, _ in (lay.decode(w) for w in recv_src[:n])]
    return torch.stack(rows).double() if rows else torch.zeros(0, lay.hidden, dtype=torch.float64)


def _expert_rows_ok(y: Any, lay: MoELayout, le: int, n: int, src: np.ndarray, xs: list, w: Any, bf16_out: bool,
                    what: str) -> None:
    """A rank's local expert ``le``: its ``n`` rows of ``y`` against float64 ``x @ w`` (each row's token from the
    handle words ``src``), and nothing past them (NaN). Tolerance: ``2^-12 (|x| @ |w|)`` (the fp32 sum), plus
    ``2^-8 |ref|`` for bf16 output (its rounding)."""
    a = _rows_of(lay, src[le], n, xs)
    w64 = w.double()
    ref, size = a @ w64, a.abs() @ w64.abs()
    got = y[le, :n].double()
    assert torch.isfinite(got).all(), f"{what} expert {le}: a row read before it arrived"
    bound = 2.0 ** -12 * size + (2.0 ** -8 * ref.abs() if bf16_out else 0.0)
    assert ((got - ref).abs() <= bound).all(), (what, le, float((got - ref).abs().max()))
    assert torch.isnan(y[le, n:].float()).all(), (what, le)  # no row past the count


# dispatch_gemm's rounds: (call, pickable experts, rank 1 sends nothing, index dtype); world 2, 6 experts
GEMM_ROUNDS = {1: ("gemm", 5, False, np.int64),  # expert 5 unpicked: an empty expert beside full ones; 1 hot
               2: ("gemm", 3, False, np.int64),  # only rank 0's experts: rank 1 receives nothing
               3: ("dispatch", 6, True, np.int32),  # the plain dispatch between fused rounds, on the same flags
               4: ("gemm", 5, True, np.int32),  # rank 1 sends nothing; then the compute-only rerun
               5: ("comm-only", 6, False, np.int64)}  # compute=False: the rows move, the GEMM is skipped


@pytest.mark.parametrize(("fabric", "out_dtype", "split"),
                         [("ib", "bf16", None), ("ib-atomic", "bf16", 0), ("ib-fence", "fp32", 1),
                          ("efa", "bf16", 3), ("efa", "fp32", 0), ("efa" + DECOUPLED, "bf16", 1)])
def test_moe_dispatch_gemm_matches_a_torch_reference(cuda_device, fabric: str, out_dtype: str,
                                                     split: int | None) -> None:
    """``MoE.dispatch_gemm``: dispatch fused with each local expert's GEMM, then combine on its output.

    Five rounds with no flag reset (``GEMM_ROUNDS``), each followed by ``combine``: three ``dispatch_gemm``
    (an expert with zero tokens beside full ones and a hot expert; rank 1 receiving nothing; rank 1 sending
    nothing, int32 indices), a plain ``dispatch`` between them (the two share the op's flags round by round),
    and a ``compute=False`` round. Before each round everything a peer writes and the GEMM's output are
    poisoned with NaN. Checked: counts, layout, handle words and received rows exactly against the model;
    ``y`` against float64 ``recv_x @ w[e]`` per expert, with the rows past each count untouched; combine on
    ``y`` against the model and a float64 torch MoE. The timing variants: ``communicate=False`` reruns round
    4's GEMM bit for bit into another buffer, then with other tiles (the fp32 cases: the default tiles for many
    rows an expert) within tolerance; ``compute=False`` moves rows and counts exactly and leaves ``y``.

    Tolerance of ``y`` (H = 200 products per element, fp32 accumulation): bf16 output, ``2^-8 |ref|`` (the
    output's rounding is at most half an ulp, ``2^-9`` relative) plus ``2^-12 (|x| @ |w|)`` (the fp32 sum's
    error, with a wide margin); fp32 output, the second term alone. ``split``: the op's ``split_experts`` (None:
    its default, the first put group's two experts by source, the third whole; 3 every expert by source; 0
    every expert whole; 1 the first by source, the others whole).
    """
    from gpuclient.kernels import MoE
    from gpuclient.kernels.moe import FEW_ROWS_TILES, MANY_ROWS_TILES

    world, experts, max_tokens, topk, hidden = 2, 6, 40, 3, 200
    dev = f"cuda:{cuda_device}"
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[out_dtype]
    rng, gen, lays, local = _seeded(12, world, experts, max_tokens, topk, hidden)
    nan = float("nan")

    def expert_rows_ok(y: torch.Tensor, r: int, le: int, n: int, src: np.ndarray, what: str) -> None:
        _expert_rows_ok(y, lays[r], le, n, src, xs, weights_e[r * local + le], out_dtype == "bf16", what)

    with _cluster(world, fabric) as cluster:
        sessions = _ranks(cluster, "moe-gemm", cuda_device)
        try:
            # the fused GEMM's arguments, refused before anything is allocated or registered
            session = sessions[0][1]
            for kwargs, message in [
                    ({"gemm_n": 0}, "gemm_n must be an integer >= 1"),
                    ({"gemm_n": True}, "gemm_n must be an integer >= 1"),
                    ({"gemm_n": 8.0}, "gemm_n must be an integer >= 1"),
                    ({"gemm_n": 8, "comm_programs": 0}, "comm_programs must be >= 1"),
                    ({"gemm_n": 8, "comm_programs": 2, "gemm_programs": 2}, "gemm_programs more than it"),
                    ({"gemm_n": 8, "gemm_block": (64, 128)}, "gemm_block must be three powers of two"),
                    ({"gemm_n": 8, "gemm_block": (64, 96, 64)}, "gemm_block must be three powers of two"),
                    ({"gemm_n": 8, "gemm_block": (8, 128, 64)}, "gemm_block must be three powers of two"),
                    ({"gemm_n": 8, "gemm_dtype": torch.float16}, "gemm_dtype must be"),
                    ({"gemm_n": 8, "split_experts": 4}, "split_experts must be an integer in")]:
                with pytest.raises(ValueError, match=message):
                    MoE(session, hidden, experts, max_tokens, topk, **kwargs)
            assert session._registrations == [], "a refused MoE registered memory"
            # gemm_n = hidden: combine takes y itself; 2 communication and 4 compute programs per rank, both
            # ranks' grids resident together
            ops = [MoE(s, hidden, experts, max_tokens, topk, share=world, programs=4, gemm_n=hidden,
                       gemm_dtype=dtype, comm_programs=2, gemm_programs=6, experts_per_put=2, split_experts=split)
                   for _, s in sessions]
            assert ops[0].split_experts == (2 if split is None else split)
            assert ops[0].layout.put_groups == 2  # experts {0, 1} in one put, {2} in another
            assert (ops[0].gemm_block, ops[0].gemm_warps, ops[0].gemm_stages) == FEW_ROWS_TILES  # ~40 rows an expert
            _exchange(sessions)
            for op in ops:  # every kernel and variant of both ranks loaded before either launches
                op.prepare()
                op.preload_gemm(communicate=False)
                op.preload_gemm(compute=False)
            streams = [torch.cuda.Stream(cuda_device) for _ in ops]
            weights_e, w_dev = _expert_weights(gen, experts, hidden, dev)
            w_rank = [w_dev[r * local:(r + 1) * local] for r in range(world)]
            bad = torch.zeros(max_tokens, hidden, dtype=torch.bfloat16, device=dev)
            with pytest.raises(ValueError, match="w must be"):
                ops[0].dispatch_gemm(bad, bad[:, :topk].long(), bad[:, :topk].float(), w_dev)
            again = [torch.full_like(op.y, nan) for op in ops]  # the compute-only rerun's output
            for rnd, (call, pickable, quiet_rank1, idx_type) in GEMM_ROUNDS.items():
                tokens = [max_tokens - 3, 0] if quiet_rank1 else [max_tokens, max_tokens - 7]
                idx = [_routing(rng, n, topk, np.arange(pickable), hot=1, dtype=idx_type) for n in tokens]
                xs = [torch.randn(n, hidden, generator=gen).to(torch.bfloat16) for n in tokens]
                ws = [torch.rand(n, topk, generator=gen) for n in tokens]
                x_dev = [x.to(dev) for x in xs]
                idx_dev = [torch.from_numpy(i).to(dev) for i in idx]
                w_in = [w.to(dev) for w in ws]
                for op in ops:  # everything a peer owes, what is shipped from, and the GEMM's output: poisoned
                    for buf in (op.recv_x, op.land_x, op.send_x, op.send_y, op.combine_buf, op.out, op.y):
                        buf.fill_(nan)
                    op.recv_src.fill_(-1)
                    op.src_stage.fill_(-1)
                    op.recv_count.fill_(-1)
                torch.cuda.synchronize(cuda_device)
                handles = []
                for r, op in enumerate(ops):
                    with torch.cuda.stream(streams[r]):
                        if call == "dispatch":
                            handles.append(op.dispatch(x_dev[r], idx_dev[r], w_in[r], stream=streams[r]))
                        else:
                            handles.append(op.dispatch_gemm(x_dev[r], idx_dev[r], w_in[r], w_rank[r],
                                                            stream=streams[r], compute=call == "gemm"))
                torch.cuda.synchronize(cuda_device)

                model = dispatch_model(lays, idx)
                ys = []
                for r, (op, (first, recv_count, handle)) in enumerate(zip(ops, handles, strict=True)):
                    what = f"{fabric} {out_dtype} round {rnd} rank {r}"
                    assert op.channel.status()[0] == 0, (what, op.channel.status())
                    assert first is (op.recv_x if call == "dispatch" else op.y), what
                    assert recv_count.cpu().numpy().tolist() == model[r]["recv_count"].tolist(), what
                    assert (handle.recv_layout.cpu().numpy() == model[r]["recv_layout"]).all(), what
                    assert (handle.topk_idx.cpu().numpy() == model[r]["idx"]).all(), what
                    src = handle.recv_src.cpu().numpy()
                    rows, y = op.recv_x.cpu(), op.y.cpu()
                    for le in range(local):
                        n = int(model[r]["recv_count"][le])
                        assert (src[le, :n] == model[r]["recv_src"][le, :n]).all(), (what, le)
                        for p in range(n):  # every row is its token's row, bit for bit (NaN: never arrived)
                            s, t, _ = lays[r].decode(src[le, p])
                            assert torch.equal(rows[le, p].view(torch.int16), xs[s][t].view(torch.int16)), (
                                what, le, p)
                        if call == "dispatch":
                            continue
                        if call == "comm-only":  # compute=False: the GEMM wrote nothing
                            assert torch.isnan(y[le].float()).all(), (what, le)
                            continue
                        expert_rows_ok(y, r, le, n, src, what)
                    if call == "dispatch":  # the experts in torch, on the plain dispatch's rows
                        ys.append(torch.bmm(op.recv_x, w_rank[r]))
                    elif call == "comm-only":  # the rows alone: combine them as they came (an identity expert)
                        ys.append(op.recv_x)
                    else:  # combine takes bf16: y itself, or fp32 y rounded (while no MoE kernel runs)
                        ys.append(op.y if out_dtype == "bf16" else op.y.to(torch.bfloat16))
                torch.cuda.synchronize(cuda_device)

                _combine_and_check(ops, streams, handles, ys, lays, model, xs, ws, weights_e, tokens, hidden,
                                   cuda_device, f"{fabric} {out_dtype} round {rnd}", dense=call != "comm-only")

                if rnd == 4:  # compute alone: round 4's GEMM again, from its rows and counts, bit for bit
                    for r, op in enumerate(ops):
                        with torch.cuda.stream(streams[r]):
                            y2, _, none = op.dispatch_gemm(None, None, None, w_rank[r], out=again[r],
                                                                stream=streams[r], communicate=False)
                        assert y2 is again[r] and none is None
                    torch.cuda.synchronize(cuda_device)
                    for r, op in enumerate(ops):
                        for le in range(local):
                            n = int(model[r]["recv_count"][le])
                            assert torch.equal(again[r][le, :n].view(torch.uint8), op.y[le, :n].view(torch.uint8))
                            assert torch.isnan(again[r][le, n:].float()).all()
                    # other tiles (retile_gemm; both ranks' variants loaded before either launches: this rerun's
                    # and round 5's): the same products, within the GEMM's tolerance, over exactly the round's rows
                    # (the fp32 cases: the default tiles for many rows an expert, 128-row blocks over ~40 rows)
                    block, warps, stages = MANY_ROWS_TILES if out_dtype == "fp32" else ((32, 256, 128), 8, 2)
                    for op in ops:
                        op.retile_gemm(block, num_warps=warps, num_stages=stages)
                    for op in ops:
                        op.preload_gemm(communicate=False)
                        op.preload_gemm(compute=False)
                    for r, op in enumerate(ops):
                        again[r].fill_(nan)
                        with torch.cuda.stream(streams[r]):
                            op.dispatch_gemm(None, None, None, w_rank[r], out=again[r], stream=streams[r],
                                             communicate=False)
                    torch.cuda.synchronize(cuda_device)
                    for r in range(world):
                        src = handles[r][2].recv_src.cpu().numpy()
                        for le in range(local):
                            expert_rows_ok(again[r].cpu(), r, le, int(model[r]["recv_count"][le]), src,
                                           f"{fabric} {out_dtype} retiled rank {r}")
            for op in ops:  # every round communicated; all but the plain dispatch were fused (the device's count)
                assert op.rounds == len(GEMM_ROUNDS)
                assert op._rounds.tolist() == [len(GEMM_ROUNDS), 0, len(GEMM_ROUNDS) - 1]
        finally:
            _close(sessions)


@pytest.mark.parametrize("fabric", ["ib", "efa"])
def test_a_dispatch_gemm_timeline_orders_every_event_and_changes_nothing(cuda_device, fabric: str) -> None:
    """``dispatch_gemm(timeline=)``, three fused rounds with no flag reset (uneven routing, a hot expert), each
    followed by combine: ``y`` still matches float64 ``x @ w`` with the peers' rows and ``y`` poisoned first, and
    what the timeline recorded is ordered the way the kernel runs, on the one GPU clock both ranks share: a
    block pushed to every peer's every expert; each source's rows seen only after that source pushed them, and
    never a wait for the own rows; every expert with rows computed, its last tile after its rows arrived; a
    tile's start before its end; every program's end after the tiles."""
    world, experts, max_tokens, topk, hidden = 2, 6, 40, 3, 200
    dev = f"cuda:{cuda_device}"
    rng, gen, lays, local = _seeded(13, world, experts, max_tokens, topk, hidden)
    with _cluster(world, fabric) as cluster:
        sessions = _ranks(cluster, "moe-gemm-timeline", cuda_device)
        try:
            ops, streams = _prepared(sessions, hidden, experts, max_tokens, topk, cuda_device, gemm_n=hidden,
                                     comm_programs=2, gemm_programs=6)
            for op in ops:  # both ranks' every variant loaded before either launches
                op.preload_gemm(timeline=True)
            weights_e, w_dev = _expert_weights(gen, experts, hidden, dev)
            w_rank = [w_dev[r * local:(r + 1) * local] for r in range(world)]
            with pytest.raises(ValueError, match="timeline must be"):
                ops[0].dispatch_gemm(None, None, None, w_rank[0], communicate=False,
                                     timeline=torch.zeros(3, dtype=torch.int64, device=dev))
            for rnd in range(1, ROUNDS + 1):
                tokens = [max_tokens, max_tokens - 5]
                idx = [_routing(rng, n, topk, np.arange(experts), hot=1, dtype=np.int64) for n in tokens]
                xs = [torch.randn(n, hidden, generator=gen).to(torch.bfloat16) for n in tokens]
                ws = [torch.rand(n, topk, generator=gen) for n in tokens]
                x_dev, w_in = [x.to(dev) for x in xs], [w.to(dev) for w in ws]
                idx_dev = [torch.from_numpy(i).to(dev) for i in idx]
                for op in ops:
                    for buf in (op.recv_x, op.land_x, op.send_x, op.send_y, op.combine_buf, op.out, op.y):
                        buf.fill_(float("nan"))
                timelines = [op.gemm_timeline() for op in ops]
                torch.cuda.synchronize(cuda_device)
                handles = []
                for r, op in enumerate(ops):
                    with torch.cuda.stream(streams[r]):
                        handles.append(op.dispatch_gemm(x_dev[r], idx_dev[r], w_in[r], w_rank[r], stream=streams[r],
                                                        timeline=timelines[r]))
                torch.cuda.synchronize(cuda_device)
                model = dispatch_model(lays, idx)
                events = [lay.split_timeline(t.cpu().numpy(), op.gemm_programs)
                          for lay, t, op in zip(lays, timelines, ops, strict=True)]
                for r, op in enumerate(ops):
                    what = f"{fabric} round {rnd} rank {r}"
                    assert op.channel.status()[0] == 0, (what, op.channel.status())
                    src, y = handles[r][2].recv_src.cpu().numpy(), op.y.cpu()
                    ev, counts = events[r], model[r]["recv_layout"][:, :, 1]  # [local, source] rows
                    assert (ev["sent"][np.arange(world) != r] > 0).all() and not ev["sent"][r].any(), what
                    assert not ev["ready"][r].any() and not ev["arrived"][r].any(), what  # the own rows: no wait
                    for s in range(world):  # every peer's group lands, rows or none, after the peer pushed it
                        if s != r:
                            assert (ev["arrived"][s] >= events[s]["sent"][r]).all(), (what, s)
                            assert (events[s]["sent"][r] > 0).all(), (what, s)
                    for le in range(local):
                        n = int(model[r]["recv_count"][le])
                        _expert_rows_ok(y, lays[r], le, n, src, xs, weights_e[r * local + le], True, what)
                        for s in range(world):
                            if s != r and counts[le, s]:  # seen after its source pushed it
                                assert ev["ready"][s, le] > events[s]["sent"][r, le] > 0, (what, le, s)
                        if n:
                            assert ev["done"][:, le].max() >= ev["ready"][:, le].max(), (what, le)
                    ran = ev["done"] > 0
                    assert (ev["start"][ran] > 0).all() and (ev["start"][ran] <= ev["done"][ran]).all(), what
                    assert (ev["program_ends"] > 0).all() and ev["program_ends"].max() >= ev["done"].max(), what
                outs = []
                for r, op in enumerate(ops):
                    with torch.cuda.stream(streams[r]):
                        outs.append(op.combine(op.y, handles[r][2], stream=streams[r]))
                torch.cuda.synchronize(cuda_device)
                assert all(torch.isfinite(out.float()).all() for out in outs), f"{fabric} round {rnd}"
        finally:
            _close(sessions)


@pytest.mark.parametrize("fabric", ["ib", "efa"])
def test_moe_fp8_dispatch_matches_a_torch_quantization(cuda_device, fabric: str) -> None:
    """``MoE(fp8=True)``: rows travel as e4m3 with an fp32 scale per 128 values (DeepEP's low-latency FP8).

    Three rounds with no flag reset on uneven routing (round 2: rank 1 receives nothing; round 3: rank 1 sends
    nothing), everything a peer writes poisoned before each (0xFF bytes: NaN as e4m3 and as fp32). Checked
    against torch on each received row's token: the scales, ``max(|block|, 1e-4) / 448``, to 1e-6 relative
    (the kernel's fp32 division may be the fast one); the bytes, ``(x * 448 / amax).to(float8_e4m3fn)``, equal
    for at least 99.9 % of the values and within one e4m3 step everywhere (the product's last ulp can move a
    near-tie); every value back as ``fp8 * scale`` within e4m3's rounding. Then the experts run on the
    dequantized rows and ``combine`` is checked against the model on their outputs.
    """
    world, experts, max_tokens, topk, hidden = 2, 6, 40, 3, 384
    dev = f"cuda:{cuda_device}"
    rng, gen, lays, local = _seeded(13, world, experts, max_tokens, topk, hidden)
    with _cluster(world, fabric) as cluster:
        sessions = _ranks(cluster, "moe-fp8", cuda_device)
        try:
            ops, streams = _prepared(sessions, hidden, experts, max_tokens, topk, cuda_device, fp8=True)
            weights_e, w_dev = _expert_weights(gen, experts, hidden, dev)
            for rnd in range(1, ROUNDS + 1):
                pickable, tokens = _round_shape(rnd, local, experts, max_tokens)
                idx = [_routing(rng, n, topk, pickable, hot=1, dtype=np.int64) for n in tokens]
                xs = [(torch.randn(n, hidden, generator=gen) * torch.logspace(-3, 3, hidden)).to(torch.bfloat16)
                      for n in tokens]
                for x in xs:
                    x[:, 128:256][:1] = 0  # an all-zero block
                ws = [torch.rand(n, topk, generator=gen) for n in tokens]
                x_dev = [x.to(dev) for x in xs]
                idx_dev = [torch.from_numpy(i).to(dev) for i in idx]
                w_in = [w.to(dev) for w in ws]
                handles = _poison_and_dispatch(ops, streams, x_dev, idx_dev, w_in, cuda_device)

                model = dispatch_model(lays, idx)
                ys = []
                for r, (op, ((q, scales), recv_count, handle)) in enumerate(zip(ops, handles, strict=True)):
                    what = f"{fabric} fp8 round {rnd} rank {r}"
                    assert op.channel.status()[0] == 0, (what, op.channel.status())
                    assert q.dtype == torch.float8_e4m3fn and tuple(q.shape) == (local, lays[r].capacity, hidden)
                    assert scales.dtype == torch.float32 and tuple(scales.shape) == (local, lays[r].capacity,
                                                                                      hidden // 128)
                    assert recv_count.cpu().numpy().tolist() == model[r]["recv_count"].tolist(), what
                    src = handle.recv_src.cpu().numpy()
                    q_host, s_host = q.cpu(), scales.cpu()
                    for le in range(local):
                        n = int(model[r]["recv_count"][le])
                        assert (src[le, :n] == model[r]["recv_src"][le, :n]).all(), (what, le)
                        if n == 0:
                            continue
                        want = torch.stack([xs[s][t] for s, t, _ in (lays[r].decode(w) for w in src[le, :n])])
                        blocks = want.float().view(n, -1, 128)
                        amax = blocks.abs().amax(dim=2).clamp_min(1e-4)
                        got_s = s_host[le, :n]
                        assert torch.allclose(got_s, amax / 448, rtol=1e-6, atol=0), (what, le)
                        ref = (blocks * (448 / amax)[:, :, None]).to(torch.float8_e4m3fn).view(n, hidden)
                        got = q_host[le, :n]
                        same = (got.view(torch.uint8) == ref.view(torch.uint8)).float().mean().item()
                        assert same >= 0.999, (what, le, same)
                        back = got.float().view(n, -1, 128) * got_s[:, :, None]
                        bound = 2.0 ** -3 * blocks.abs() + 2.0 ** -9 * got_s[:, :, None]  # one e4m3 step
                        assert ((back - blocks).abs() <= bound).all(), (what, le)
                    # the experts on the dequantized rows (rows past the counts are NaN and stay in their rows)
                    deq = (q.float().view(local, -1, hidden // 128, 128) * scales[..., None]).view(local, -1, hidden)
                    ys.append(torch.bmm(deq.to(torch.bfloat16), w_dev[r * local:(r + 1) * local]))
                torch.cuda.synchronize(cuda_device)
                _combine_and_check(ops, streams, handles, ys, lays, model, xs, ws, weights_e, tokens, hidden,
                                   cuda_device, f"{fabric} fp8 round {rnd}", dense=False)
        finally:
            _close(sessions)
