"""gpuclient.kernels.MoE on two daemons (ib and efa), two ranks sharing the GPU in one process.

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

import numpy as np
import pytest

from gpuclient.kernels.moe_layout import MoELayout, combine_model, dispatch_model

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from tests.gpu.test_fused_kernels import _close, _exchange, _ranks  # noqa: E402  (needs torch)
from transportd_cli.localcluster import LocalCluster  # noqa: E402

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


@pytest.mark.parametrize("backend", ["ib", "efa"])
def test_moe_dispatch_and_combine_match_a_torch_reference(cuda_device, backend: str) -> None:
    from gpuclient.kernels import MoE

    # hidden 200: no multiple of the 256-wide copy block; 3 local experts per rank; 40 rows per rank at most
    world, experts, max_tokens, topk, hidden = 2, 6, 40, 3, 200
    dev = f"cuda:{cuda_device}"
    rng = np.random.default_rng(11)
    gen = torch.Generator(device="cpu").manual_seed(11)
    lays = [MoELayout(r, world, experts, max_tokens, topk, hidden) for r in range(world)]
    local = lays[0].local_experts
    nan = float("nan")
    with LocalCluster(world, backend=backend, overrides={"peers": {"heartbeat_timeout_s": 20.0}}) as cluster:
        sessions = _ranks(cluster, "moe-ll", cuda_device)
        try:
            # programs=4: both ranks' grids resident together, several programs per kernel
            ops = [MoE(s, hidden, experts, max_tokens, topk, share=world, programs=4) for _, s in sessions]
            _exchange(sessions)
            for op in ops:  # every kernel of both ranks loaded before either launches (one process, one GPU)
                op.prepare()
            streams = [torch.cuda.Stream(cuda_device) for _ in ops]
            weights_e = (torch.randn(experts, hidden, hidden, generator=gen) / hidden ** 0.5).to(torch.bfloat16)
            w_dev = weights_e.to(dev)
            bad = torch.zeros(max_tokens + 1, hidden, dtype=torch.bfloat16, device=dev)
            with pytest.raises(ValueError, match="x must be"):
                ops[0].dispatch(bad, bad[:, :topk].long(), bad[:, :topk].float())
            for rnd in range(1, ROUNDS + 1):
                # round 1: expert 5 unpicked, expert 1 hot; round 2: only rank 0's experts (rank 1 receives
                # nothing); round 3: rank 1 sends nothing, int32 indices
                pickable = {1: np.arange(5), 2: np.arange(local), 3: np.arange(experts)}[rnd]
                tokens = [max_tokens, max_tokens - 7] if rnd < 3 else [max_tokens - 3, 0]
                dtype = np.int64 if rnd < 3 else np.int32
                idx = [_routing(rng, n, topk, pickable, hot=1, dtype=dtype) for n in tokens]
                xs = [torch.randn(n, hidden, generator=gen).to(torch.bfloat16) for n in tokens]
                ws = [torch.rand(n, topk, generator=gen) for n in tokens]
                # all inputs on the GPU and every buffer poisoned before the round's first launch
                x_dev = [x.to(dev) for x in xs]
                idx_dev = [torch.from_numpy(i).to(dev) for i in idx]
                w_in = [w.to(dev) for w in ws]
                for op in ops:
                    op.recv_x.fill_(nan)
                    op.recv_src.fill_(-1)
                    op.send_x.fill_(nan)
                    op.send_y.fill_(nan)
                    op.combine_buf.fill_(nan)
                    op.out.fill_(nan)
                    op.recv_count.fill_(-1)
                torch.cuda.synchronize(cuda_device)
                handles = []
                for r, op in enumerate(ops):
                    with torch.cuda.stream(streams[r]):
                        handles.append(op.dispatch(x_dev[r], idx_dev[r], w_in[r], stream=streams[r]))
                torch.cuda.synchronize(cuda_device)

                model = dispatch_model(lays, idx)
                ys = []
                for r, (op, (recv_x, recv_count, handle)) in enumerate(zip(ops, handles, strict=True)):
                    what = f"{backend} round {rnd} rank {r}"
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

                outs = []
                for r, op in enumerate(ops):
                    with torch.cuda.stream(streams[r]):
                        outs.append(op.combine(ys[r], handles[r][2], stream=streams[r]))
                torch.cuda.synchronize(cuda_device)

                y_host = [y.double().cpu().numpy() for y in ys]
                want = combine_model(lays, model, y_host, [w.double().numpy() for w in ws])
                for r, op in enumerate(ops):
                    what = f"{backend} round {rnd} rank {r}"
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
            for op in ops:
                assert op.rounds == ROUNDS
        finally:
            _close(sessions)
