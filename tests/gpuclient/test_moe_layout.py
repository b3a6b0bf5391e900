"""gpuclient.kernels.MoE without a GPU: the layout model, the kernels compiled, and the kernels run on the CPU.

- ``moe_layout`` (the numpy model the host side and the GPU test use) against brute-force enumeration:
  normalisation (out-of-range and repeated experts dropped), counts, positions in token order, packed
  receive rows source by source, the handle words, the expert-major stage rows, the dispatch and combine
  puts (one per (peer, expert) block, split past the largest put) and the records per destination, and
  combine's weighted sums; on uneven routing (a hot expert, experts and a whole rank receiving nothing,
  tokens with no expert, fewer tokens than the maximum).
- Every MoE kernel compiles for sm_90 (PTX and cubin; Triton needs no GPU for it), with no read-only-cache
  loads (peers' NICs write what the kernels read) and each protocol call site once.
- The five kernels run in Triton's interpreter on numpy buffers, several ranks in sequence, with the
  channel calls replaced by a model that moves the bytes and counts the flags: three rounds of dispatch,
  an expert function and combine, with no reset, checked against the model (staged and received rows bit
  for bit, handle words exactly, every put's offsets and length, the records per destination, the sums
  within bf16 rounding) and every wait satisfied by the signals sent; once with blocks split into pieces.
- The fused dispatch + expert GEMM (``_moe_dispatch_gemm``, ``MoE.dispatch_gemm``) compiles for sm_90 in
  each variant (wgmma where the GEMM runs, every push and wait where the protocol runs), and runs in the
  interpreter with one process per rank over shared memory, puts landing only with the signal that covers
  them and late, every load of a peer's row or count checked against the waits of the program that made
  it: rounds of dispatch_gemm and plain dispatch with combine, against the model (puts included) and
  float64 ``x @ w`` (tests/gpuclient/moe_gemm_interpreted.py); once with blocks split into pieces.

The GPU test is tests/gpu/test_moe.py.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from gpuclient.kernels.moe_layout import MoELayout, combine_model, dispatch_model, dispatch_row

ROOT = Path(__file__).resolve().parents[2]


# --- the model against brute force ------------------------------------------------------------------------------
def layouts(world: int, experts: int, tokens: int, topk: int, hidden: int = 8) -> list[MoELayout]:
    return [MoELayout(r, world, experts, tokens, topk, hidden) for r in range(world)]


def uneven_routing(rng: np.random.Generator, world: int, experts: int, max_tokens: int, topk: int,
                   tokens: list[int] | None = None, dtype: type = np.int64) -> list[np.ndarray]:
    """Top-k lists with a hot expert (0), experts nobody picks (the last rank's: it receives nothing),
    -1 entries, a token with no expert, out-of-range indices and repeats."""
    local = experts // world
    pickable = np.arange(experts - local if world > 1 else experts)  # the last rank's experts are never picked
    out = []
    for r in range(world):
        n = max_tokens if tokens is None else tokens[r]
        rows = [rng.choice(pickable, size=topk, replace=len(pickable) < topk) for _ in range(n)]
        idx = np.stack(rows).astype(dtype) if n else np.zeros((0, topk), dtype=dtype)
        if n:
            idx[rng.random(n) < 0.5, 0] = 0  # hot expert 0
            idx[rng.random((n, topk)) < 0.15] = -1
            idx[0] = -1  # a token with no expert
            if n > 2 and topk > 1:
                idx[1, 1] = idx[1, 0] if idx[1, 0] >= 0 else 0  # a repeat: counts once
                idx[2, topk - 1] = experts + 3  # out of range: no expert
        out.append(idx)
    return out


def brute_force(lays: list[MoELayout], topk_idx: list[np.ndarray]) -> dict:
    """Receive rows per (rank, local expert), enumerated the slow way: list of (src, token, k), the rank's own
    rows first, then those of rank - 1, rank - 2, ... (each source's in token order)."""
    lay0 = lays[0]
    rows: dict = {(d, local): [] for d in range(lay0.world) for local in range(lay0.local_experts)}
    for src, idx in enumerate(topk_idx):
        for t in range(idx.shape[0]):
            seen = set()
            for k in range(idx.shape[1]):
                e = int(idx[t, k])
                if not 0 <= e < lay0.num_experts or e in seen:
                    continue
                seen.add(e)
                rows[lay0.owner(e)].append((src, t, k))
    for (d, _local), found in rows.items():
        found.sort(key=lambda r: ((d - r[0]) % lay0.world, r[1]))
    return rows


@pytest.mark.parametrize(("world", "experts", "max_tokens", "topk"), [(2, 8, 16, 3), (3, 9, 7, 4), (4, 4, 5, 1),
                                                                      (1, 4, 6, 2), (2, 2, 9, 2)])
@pytest.mark.parametrize("seed", [0, 1])
def test_the_model_matches_brute_force_on_uneven_routing(world: int, experts: int, max_tokens: int, topk: int,
                                                          seed: int) -> None:
    rng = np.random.default_rng(seed)
    lays = layouts(world, experts, max_tokens, topk)
    tokens = [max_tokens - (r % 3) for r in range(world)]  # fewer tokens than the maximum on some ranks
    idx = uneven_routing(rng, world, experts, max_tokens, topk, tokens)
    got = dispatch_model(lays, idx)
    want = brute_force(lays, idx)
    for d, lay in enumerate(lays):
        for local in range(lay.local_experts):
            rows = want[(d, local)]
            assert int(got[d]["recv_count"][local]) == len(rows) <= lay.capacity
            assert [lay.decode(w) for w in got[d]["recv_src"][local, :len(rows)]] == rows
            assert (got[d]["recv_src"][local, len(rows):] == -1).all()
            for s in range(world):  # (offset, count) of each source's rows
                from_s = [i for i, r in enumerate(rows) if r[0] == s]
                off, count = got[d]["recv_layout"][local, s]
                assert count == len(from_s) and (not from_s or from_s == list(range(off, off + count)))
    # the last rank's experts are never picked: it receives nothing; expert 0 is the hot one
    if world > 1:
        assert (got[-1]["recv_count"] == 0).all()
    per_expert = got[0]["counts_all"].sum(axis=0)
    assert per_expert.max() > per_expert.mean() and (world == 1 or (per_expert == 0).any())


def test_normalize_drops_out_of_range_and_repeats_and_keeps_the_first() -> None:
    lay = MoELayout(0, 2, 8, 4, 4, 16)
    idx = np.array([[3, 3, -1, 9], [5, 2, 5, 2], [-1, -1, -1, -1], [7, 0, 1, 6]])
    assert lay.normalize(idx).tolist() == [[3, -1, -1, -1], [5, 2, -1, -1], [-1] * 4, [7, 0, 1, 6]]
    counts, pos, send_src = lay.route(idx)
    assert counts.tolist() == [1, 1, 1, 1, 0, 1, 1, 1]
    assert pos[1].tolist() == [0, 0, -1, -1] and send_src[5, 0] == lay.encode(0, 1, 0)


def brute_force_stage(lay: MoELayout, topk_idx: np.ndarray) -> list[tuple[int, int]]:
    """A source's stage rows, the slow way: its valid (token, k) entries sorted by expert, then by token."""
    entries = []
    for t in range(topk_idx.shape[0]):
        seen = set()
        for k in range(topk_idx.shape[1]):
            e = int(topk_idx[t, k])
            if 0 <= e < lay.num_experts and e not in seen:
                seen.add(e)
                entries.append((e, t, k))
    return [(t, k) for _, t, k in sorted(entries)]


@pytest.mark.parametrize(("world", "experts", "max_tokens", "topk", "put_rows"),
                         [(2, 8, 16, 3, 16), (3, 9, 7, 4, 2), (4, 4, 5, 1, 1), (1, 4, 6, 2, 6), (2, 6, 20, 3, 3)])
def test_stage_rows_blocks_and_puts_against_brute_force(world: int, experts: int, max_tokens: int, topk: int,
                                                        put_rows: int) -> None:
    """Staging is expert-major; a dispatch puts each peer one block, its rows for all of the peer's experts, into
    the peer's land_x slice (split at ``land_put_rows``), where each expert's rows sit where ``land_offsets`` says
    and whence they pack to the receive layout; combine puts exactly the remote (expert, source) blocks split at
    ``put_rows`` rows; the writes per destination are the count, a row put per piece, one handle-word put and
    the SIGNAL."""
    rng = np.random.default_rng(world + put_rows)
    hidden = 16
    lays = [MoELayout(r, world, experts, max_tokens, topk, hidden, max_put_bytes=put_rows * hidden * 2 + 1)
            for r in range(world)]
    assert lays[0].put_rows == min(put_rows, max_tokens)
    idx = uneven_routing(rng, world, experts, max_tokens, topk, [max_tokens - (r % 2) for r in range(world)])
    got = dispatch_model(lays, idx)
    want = brute_force(lays, idx)
    counts_all = got[0]["counts_all"]
    for src, lay in enumerate(lays):
        stage = brute_force_stage(lay, idx[src])
        assert [lay.decode(w)[1:] for w in got[src]["stage_src"][:len(stage)]] == stage
        assert (got[src]["stage_src"][len(stage):] == -1).all()
        rows = got[src]["stage_row"]
        assert sorted((int(rows[t, k]), t, k) for t, k in stage) == [(i, t, k) for i, (t, k) in enumerate(stage)]
        assert (rows[got[src]["idx"] < 0] == -1).all()
        eoff = lay.stage_offsets(counts_all[src])
        assert eoff.tolist() == [sum(1 for t, k in stage if got[src]["idx"][t, k] < e) for e in range(experts)]
        # dispatch: the block of a peer d is this rank's stage rows for d's experts, landing in d's land_x slice for
        # this rank, each expert's rows where land_offsets says, then packed where the receive layout says
        puts = lay.dispatch_puts(counts_all)
        L = lay.local_experts  # noqa: N806
        for d, group, first, dst, n in puts:
            assert d != src and group == 0 and 1 <= n <= lay.land_put_rows
            assert dst // lay.source_rows == src and dst % lay.source_rows + n <= lay.source_rows
            for i in range(n):
                s2, t, k = lay.decode(got[src]["stage_src"][first + i])
                e = int(got[src]["idx"][t, k])
                d_, local = lay.owner(e)
                assert s2 == src and d_ == d
                landed = dst % lay.source_rows + i  # its row in the slice: the expert's start there, then its place
                pos = first + i - int(eoff[e])
                assert landed == int(lays[d].land_offsets(counts_all)[src, local]) + pos
                off = int(lay.source_offsets(counts_all)[src, e])
                assert want[(d, local)][off + pos][0] == src
                assert lay.decode(got[d]["recv_src"][local, off + pos])[1:] == (t, k)
        for d in range(world):  # the pieces of a peer's block tile it, in order
            if d != src:
                rows = int(counts_all[src, d * L:(d + 1) * L].sum())
                starts = [first for d2, _, first, _, _ in puts if d2 == d]
                assert starts == list(range(int(eoff[d * L]), int(eoff[d * L]) + rows, lay.land_put_rows))
        # combine, this rank as the experts' rank: each block back to its source's stage rows
        for s, e, y_row, comb_row, n in lay.combine_puts(counts_all):
            local = e - src * lay.local_experts
            assert s != src and 0 <= local < lay.local_experts and 1 <= n <= lay.put_rows
            p = y_row - local * lay.capacity
            for i in range(n):  # the row's output goes home to the entry's stage row
                s2, t, k = lay.decode(got[src]["recv_src"][local, p + i])
                assert s2 == s and got[s]["stage_row"][t, k] == comb_row + i
        # the records per destination
        w = lay.writes(counts_all)
        for d in range(world):
            if d == src:
                assert w["dispatch"][d] == w["dispatch_gemm"][d] == w["combine"][d] == 0
                assert lay.signals()[d] == lay.signals(gemm=True)[d] == 0
                continue
            mine = range(d * lay.local_experts, (d + 1) * lay.local_experts)
            blocks = [int(counts_all[src, e]) for e in mine if counts_all[src, e] > 0]
            rows = sum(blocks)
            # the handle words of d's experts, all of them, to d's slice for this rank: one put unless they pass
            # the largest put
            n, step = lay.local_experts * max_tokens, lay.handle_words
            handles = [(p, at, to, k) for p, at, to, k in lay.handle_puts() if p == d]
            assert handles == [(d, d * n + j, src * n + j, min(step, n - j)) for j in range(0, n, step)]
            assert w["dispatch"][d] == 2 + len(handles) + -(-rows // lay.land_put_rows)
            # the fused round at one expert a put (the layout's default): a put per piece of each expert's block
            # (the last a put_signal of its group flag), a SIGNAL per empty block, so every flag there rises once:
            # 2 + L signals against the plain dispatch's 2
            assert w["dispatch_gemm"][d] == 2 + len(handles) + lay.local_experts + sum(
                -(-n // lay.group_put_rows) - 1 for n in blocks)
            assert lay.signals()[d] == 2 and lay.signals(gemm=True)[d] == 2 + lay.local_experts
            back = [int(counts_all[d, e]) for e in range(src * lay.local_experts, (src + 1) * lay.local_experts)
                    if counts_all[d, e] > 0]
            assert w["combine"][d] == 1 + sum(-(-n // lay.put_rows) for n in back)



@pytest.mark.parametrize(("world", "block_m"), [(2, 16), (3, 8), (4, 32), (1, 16)])
def test_the_gemm_takes_every_row_block_once_at_the_step_of_its_latest_source(world: int, block_m: int) -> None:
    """``MoELayout.gemm_row_blocks``, the compute programs' deal: every (local expert, row block) exactly once; when
    the expert is split, a full block of own rows (they lead the expert's rows) at step -1, before any peer's
    count is in, and any other at the step of the latest source with rows in it; all of an expert's blocks at
    its latest source's step when it is whole; uneven counts, empty experts and a source that sends nothing."""
    rng = np.random.default_rng(world * 100 + block_m)
    experts = 4 * world
    for split in range(0, 5):
        for rank in range(world):
            lay = MoELayout(rank, world, experts, 64, 4, 16)
            counts_all = rng.integers(0, 3 * block_m, size=(world, experts))
            counts_all[:, rank * 4 + 1] = 0  # an empty expert
            counts_all[world - 1] = 0 if world > 1 else counts_all[world - 1]  # the last rank sends nothing
            mine = counts_all[:, rank * 4:(rank + 1) * 4]
            order = (rank - np.arange(world)) % world
            taken: dict[int, list[tuple[int, int]]] = {local: [] for local in range(4)}
            deal = lay.gemm_row_blocks(counts_all, block_m, split)
            assert [step for step, *_ in deal] == sorted(step for step, *_ in deal)  # in the programs' order
            for step, local, lo, hi in deal:
                assert 0 <= lo < hi and -1 <= step < world
                taken[local] += [(b, step) for b in range(lo, hi)]
            for local in range(4):
                counts = mine[:, local]
                n = int(counts.sum())
                off = np.array([counts[order < order[s]].sum() for s in range(world)])  # own rows first
                assert off[rank] == 0
                blocks = sorted(taken[local])
                assert [b for b, _ in blocks] == list(range(-(-n // block_m))), (split, rank, local)
                for b, step in blocks:
                    inside = (counts > 0) & (off < (b + 1) * block_m) & (off + counts > b * block_m)
                    latest = int(order[inside].max()) if local < split else int(order[counts > 0].max())
                    own_full = local < split and (b + 1) * block_m <= counts[rank]
                    assert step == (-1 if own_full else latest), (split, rank, local, b)
            passes, rows = lay.gemm_work(counts_all, block_m, split)
            assert rows == sum(-(-int(n) // block_m) for n in mine.sum(axis=0)) * block_m
            passes_taken = {(step, local) for step, local, _, _ in lay.gemm_row_blocks(counts_all, block_m, split)}
            assert passes == len(passes_taken) and passes >= int((mine.sum(axis=0) > 0).sum())


def test_split_experts_read_their_weights_once_a_step_and_whole_ones_once() -> None:
    """Two ranks, 128 rows of each an expert, 128-row blocks: split, the own block goes first (step -1, before
    the counts) and the peer's at step 1, two passes over the weights; whole, both blocks at step 1, one pass.
    130 + 130 rows take three blocks either way (384 rows of tensor-core work for 260). Four local experts, the
    first two split. Rank 1 too: its own rows lead each expert's rows as rank 0's do."""
    even = np.full((2, 8), 128)
    for rank in (0, 1):
        lay = MoELayout(rank, 2, 8, 256, 2, 16)
        assert lay.gemm_row_blocks(even, 128, 2) == [(-1, 0, 0, 1), (-1, 1, 0, 1), (1, 0, 1, 2), (1, 1, 1, 2),
                                                     (1, 2, 0, 2), (1, 3, 0, 2)]
    lay = MoELayout(0, 2, 8, 256, 2, 16)
    assert lay.gemm_work(even, 128, 2) == (2 * 2 + 2, 4 * 256)
    assert lay.gemm_row_blocks(even, 128, 0) == [(1, local, 0, 2) for local in range(4)]
    assert lay.gemm_work(even, 128, 0) == (4, 4 * 256)
    assert lay.gemm_work(np.full((2, 8), 130), 128, 0) == (4, 4 * 384)

@pytest.mark.parametrize(("world", "experts", "max_tokens", "topk", "experts_per_put", "put_rows"),
                         [(2, 8, 16, 3, 2, 1 << 10), (3, 12, 7, 4, 3, 5), (4, 8, 5, 2, 4, 1), (2, 6, 20, 3, 4, 7),
                          (1, 4, 6, 2, 2, 6), (2, 8, 9, 3, 1, 9)])
def test_dispatch_gemm_groups_land_where_the_gemm_reads_them(world: int, experts: int, max_tokens: int, topk: int,
                                                             experts_per_put: int, put_rows: int) -> None:
    """``dispatch_gemm`` sends a destination ``experts_per_put`` experts' rows per put: each group is one block of
    the source's stage, split at ``group_put_rows``, and lands in the destination's ``land_x`` slice for the
    source, where ``land_offsets`` says each expert's rows are (the same rows, in the same order, as
    ``dispatch`` lands in ``recv_x``). The records per destination are the count, a put per group piece (the last
    the group flag's put_signal), a SIGNAL per empty group, the handle words and the dispatch SIGNAL."""
    rng = np.random.default_rng(world * 10 + experts_per_put)
    hidden = 16
    lays = [MoELayout(r, world, experts, max_tokens, topk, hidden, max_put_bytes=put_rows * hidden * 2,
                      experts_per_put=experts_per_put) for r in range(world)]
    lay0 = lays[0]
    assert lay0.put_groups == -(-lay0.local_experts // experts_per_put)
    assert lay0.group_put_rows == min(max_tokens * min(topk, experts_per_put), put_rows)
    idx = uneven_routing(rng, world, experts, max_tokens, topk, [max_tokens - (r % 2) for r in range(world)])
    got = dispatch_model(lays, idx)
    counts_all = got[0]["counts_all"]
    L = lay0.local_experts  # noqa: N806
    landed = [np.full((world, lay0.source_rows), -1, dtype=np.int64) for _ in range(world)]
    for src, lay in enumerate(lays):
        puts = lay.gemm_puts(counts_all)
        eoff = lay.stage_offsets(counts_all[src])
        for d in range(world):
            for g in range(lay.put_groups):
                members = range(d * L + g * experts_per_put, min(d * L + (g + 1) * experts_per_put, (d + 1) * L))
                rows = int(counts_all[src, list(members)].sum())
                pieces = [(first, dst, n) for d2, g2, first, dst, n in puts if (d2, g2) == (d, g)]
                if d == src or rows == 0:
                    assert pieces == [], (src, d, g)
                    continue
                # the group's rows: one block of the stage from its first expert's, in pieces of group_put_rows
                assert [first for first, _, _ in pieces] == list(range(int(eoff[members[0]]),
                                                                       int(eoff[members[0]]) + rows,
                                                                       lay.group_put_rows))
                assert all(1 <= n <= lay.group_put_rows for _, _, n in pieces) and sum(n for *_, n in pieces) == rows
                for first, dst, n in pieces:
                    s_, row = divmod(dst, lay.source_rows)
                    assert s_ == src and row + n <= lay.source_rows
                    landed[d][src, row:row + n] = got[src]["stage_src"][first:first + n]
        w, signals = lay.writes(counts_all)["dispatch_gemm"], lay.signals(gemm=True)
        for d in range(world):
            if d == src:
                assert w[d] == signals[d] == 0
                continue
            pieces = sum(1 for d2, *_ in puts if d2 == d)
            groups_with_rows = len({g for d2, g, *_ in puts if d2 == d})
            handles = sum(1 for p, *_ in lay.handle_puts() if p == d)
            assert w[d] == 2 + handles + lay.put_groups + pieces - groups_with_rows
            assert signals[d] == 2 + lay.put_groups
    for d, lay in enumerate(lays):  # each peer's rows for each expert where the GEMM reads them, as dispatch lands them
        at, (_, recv_layout) = lay.land_offsets(counts_all), lay.receive(counts_all)
        for local in range(L):
            assert len({lay.group_slot(s, local) for s in range(world)}) == world
            assert lay.expert_slot <= lay.group_slot(world - 1, local) < lay.expert_slot + world * L
            for s in range(world):
                if s != d:
                    off, n = recv_layout[local, s]
                    assert (landed[d][s, at[s, local]:at[s, local] + n] == got[d]["recv_src"][local, off:off + n]).all()


def test_the_largest_put_is_the_daemons() -> None:
    from gpuclient.kernels.moe_layout import MAX_PUT_BYTES
    from transportd.dataplane.tables import DEFAULT_MAX_LENGTH

    assert MAX_PUT_BYTES == DEFAULT_MAX_LENGTH <= 0xFFFF_FFFF
    lay = MoELayout(0, 2, 64, 128, 8, 7168)
    assert lay.put_rows == 128  # DeepEP-LL's shape: every block in one put
    assert MoELayout(0, 2, 4, 1 << 16, 2, 1 << 15).put_rows == (1 << 31) // (1 << 16)  # 2 GiB of 64 KiB rows


def test_writes_per_destination_at_deepep_low_latency_shape() -> None:
    """128 tokens a rank, top-8 of 64 experts, two ranks, uniform routing: a dispatch pushes each peer its
    count row, one put of its rows for all of the peer's experts, one of the handle words of all its experts,
    and a SIGNAL (4 records; 35 with a put per expert block, about 530 with a put per row); combine one put per
    block and a SIGNAL."""
    rng = np.random.default_rng(0)
    lays = [MoELayout(r, 2, 64, 128, 8, 7168) for r in range(2)]
    idx = [np.stack([rng.permutation(64)[:8] for _ in range(128)]) for _ in range(2)]
    counts_all = dispatch_model(lays, idx)[0]["counts_all"]
    for r, lay in enumerate(lays):
        w = lay.writes(counts_all)
        blocks = int((counts_all[r, (1 - r) * 32:(2 - r) * 32] > 0).sum())
        back = int((counts_all[1 - r, r * 32:(r + 1) * 32] > 0).sum())
        assert blocks > 0 and w["dispatch"][1 - r] == 4 and w["combine"][1 - r] == 1 + back <= 33


def test_the_combine_model_is_the_weighted_sum_of_each_tokens_experts() -> None:
    rng = np.random.default_rng(4)
    world, experts, max_tokens, topk, hidden = 3, 6, 10, 3, 5
    lays = layouts(world, experts, max_tokens, topk, hidden)
    idx = uneven_routing(rng, world, experts, max_tokens, topk, [10, 4, 0])
    x = [rng.standard_normal((i.shape[0], hidden)) for i in idx]
    w = [rng.random(i.shape) for i in idx]
    scale = rng.standard_normal(experts)
    got = dispatch_model(lays, idx)
    expert_out = []
    for d, lay in enumerate(lays):  # the experts: expert e scales its rows by scale[e]
        y = np.full((lay.local_experts, lay.capacity, hidden), np.nan)
        for local in range(lay.local_experts):
            for p in range(int(got[d]["recv_count"][local])):
                src, t, _ = lay.decode(got[d]["recv_src"][local, p])
                y[local, p] = scale[d * lay.local_experts + local] * x[src][t]
        expert_out.append(y)
    outs = combine_model(lays, got, expert_out, w)
    for r, lay in enumerate(lays):
        norm = lay.normalize(idx[r])
        want = np.zeros_like(x[r])
        for t, k in zip(*np.nonzero(norm >= 0), strict=True):
            want[t] += w[r][t, k] * scale[norm[t, k]] * x[r][t]
        np.testing.assert_allclose(outs[r], want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"num_experts": 7}, "does not split evenly over 2 ranks"),
    ({"rank": 2}, r"rank must be in \[0, 2\)"),
    ({"topk": 0}, "topk must be an integer >= 1"),
    ({"topk": 9}, "topk=9 is more than num_experts=8"),
    ({"hidden": 2.0}, "hidden must be an integer >= 1"),
    ({"max_tokens": 1 << 29, "topk": 4}, "passes the int32 source word"),
    ({"slot_base": -1}, "slot_base must be an integer >= 0"),
    ({"hidden": (1 << 30) + 1}, r"a row \(2147483650 bytes\) passes the largest put"),
    ({"hidden": 64, "max_put_bytes": 100}, r"a row \(128 bytes\) passes the largest put \(100 bytes\)"),
    ({"hidden": 1, "max_put_bytes": 1}, r"a row \(2 bytes\) passes the largest put \(1 bytes\)"),
    ({"num_experts": 64, "max_put_bytes": 200}, r"the count row \(256 bytes\) passes"),
    ({"max_put_bytes": (1 << 31) + 1}, "more than the daemon takes"),
    ({"max_put_bytes": 0}, "max_put_bytes must be an integer >= 1"),
])
def test_bad_shapes_are_refused_with_the_culprit_named(kwargs: dict, message: str) -> None:
    args = {"rank": 0, "world": 2, "num_experts": 8, "max_tokens": 16, "topk": 2, "hidden": 64, **kwargs}
    with pytest.raises(ValueError, match=message):
        MoELayout(**args)


def test_flag_slots_are_disjoint_and_the_handle_word_round_trips() -> None:
    lay = MoELayout(1, 3, 6, 7, 2, 16, slot_base=5)
    used = [lay.count_slot + s for s in range(3)] + [lay.dispatch_slot + s for s in range(3)] + [
        lay.combine_slot + s for s in range(3)] + [lay.expert_slot + s * 2 + e for s in range(3) for e in range(2)]
    assert sorted(used) == list(range(5, 5 + lay.slots)) and lay.slots == 3 * 3 + 3 * 2
    for src, t, k in [(0, 0, 0), (2, 6, 1), (1, 3, 0)]:
        assert lay.decode(lay.encode(src, t, k)) == (src, t, k)


# --- compiling (Triton, no GPU) ------------------------------------------------------------------------------------
triton = pytest.importorskip("triton")

from gpuclient.kernels import moe_kernels  # noqa: E402
from tests.gpuclient.test_kernels import protocol_sites  # noqa: E402
from tests.gpuclient.test_triton import compile_kernel  # noqa: E402
from tests.support.interpreted import run_interpreted  # noqa: E402

W, E, L, K, T, H = 2, 8, 4, 3, 100, 200
SIGNATURES = {
    "_moe_route": ({"idx_ptr": "*i64", "idx32_ptr": "*i32", "row_ptr": "*i32", "count_ptr": "*i32", "eoff_ptr": "*i32",
                    "send_src_ptr": "*i32", "rank": "i32", "tokens": "i32"},
                   {"E": E, "K": K, "KP": 4, "T": T, "BLOCK_T": 128}),
    "_moe_stage": ({"x_ptr": "*bf16", "idx32_ptr": "*i32", "row_ptr": "*i32", "eoff_ptr": "*i32", "send_x_ptr": "*bf16",
                    "recv_x_ptr": "*bf16", "recv_src_ptr": "*i32", "rank": "i32", "tokens": "i32"},
                   {"W": W, "L": L, "K": K, "KP": 4, "T": T, "H": H, "ROW": H, "COPY_ROWS": 16, "BLOCK_H": 256}),
    "_moe_dispatch": ({"ch": "*u64", "rounds_ptr": "*i32", "rank": "i32", "count_ptr": "*i32",
                       "eoff_ptr": "*i32", "recv_x_ptr": "*bf16", "recv_src_ptr": "*i32", "src_stage_ptr": "*i32",
                       "land_ptr": "*bf16", "recv_count_ptr": "*i32", "layout_ptr": "*i32", "count_region": "i32",
                       "land_region": "i32", "src_stage_region": "i32", "send_x_region": "i32",
                       "send_src_region": "i32", "count_slot": "i32", "dispatch_slot": "i32"},
                      {"W": W, "E": E, "L": L, "T": T, "ROW": H, "ROW_BYTES": 2 * H, "SOURCE_ROWS": T * K,
                       "LAND_PUT_ROWS": T * K, "HANDLE_WORDS": L * T, "LP": 4, "WP": 2, "BLOCK_T": 128,
                       "COPY_ROWS": 16, "BLOCK_H": 256}),
    "_moe_combine_send": ({"ch": "*u64", "rank": "i32", "y_ptr": "*bf16", "count_ptr": "*i32", "send_y_ptr": "*bf16",
                           "comb_ptr": "*bf16", "comb_region": "i32", "send_y_region": "i32"},
                          {"W": W, "E": E, "L": L, "T": T, "H": H, "EP": E, "COPY_ROWS": 16, "BLOCK_H": 256,
                           "PUT_ROWS": T}),
    "_moe_combine_reduce": ({"ch": "*u64", "rounds_ptr": "*i32", "rank": "i32", "tokens": "i32", "idx32_ptr": "*i32",
                             "row_ptr": "*i32", "weights_ptr": "*fp32", "comb_ptr": "*bf16", "out_ptr": "*bf16",
                             "combine_slot": "i32"},
                            {"W": W, "K": K, "H": H, "BLOCK_H": 256}),
    "_moe_dispatch_gemm": ({"ch": "*u64", "rounds_ptr": "*i32", "rank": "i32", "count_ptr": "*i32",
                            "eoff_ptr": "*i32", "recv_x_ptr": "*bf16", "recv_src_ptr": "*i32", "src_stage_ptr": "*i32",
                            "land_ptr": "*bf16", "w_ptr": "*bf16", "y_ptr": "*bf16", "recv_count_ptr": "*i32",
                            "layout_ptr": "*i32", "count_region": "i32", "land_region": "i32",
                            "src_stage_region": "i32", "send_x_region": "i32", "send_src_region": "i32",
                            "count_slot": "i32", "dispatch_slot": "i32", "expert_slot": "i32", "timeline": "*i64"},
                           {"W": W, "E": E, "L": L, "T": T, "H": H, "N": 136, "LP": 4, "WP": 2,
                            "COMM_PROGRAMS": 2, "BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 64,
                            "BLOCK_T": 128, "EXPERTS_PER_PUT": 1, "GROUPS": 4,
                            "SOURCE_ROWS": T * K, "GROUP_PUT_ROWS": T * K, "HANDLE_WORDS": L * T,
                            "COMMUNICATE": True, "COMPUTE": True, "SPLIT_EXPERTS": 1}),
}
# Protocol call sites: (pushes per peer, waits per peer, other pushes). The loops over peers run W times (W is
# a constexpr: the compiler unrolls them); the dispatch: per peer the count put_signal, and per peer served
# (W - 1: so 4 a peer and -3 other) its block's row put, its handle-word put and its dispatch SIGNAL; then the
# count and dispatch waits per peer; the combine: a
# block's put; a SIGNAL and a wait per peer. No kernel quiets: each round's round trips order the reuse of the
# put sources (docs/kernels.md). The fused dispatch + GEMM: per peer the count put_signal; a group's row put (a
# piece before the last), the last piece's put_signal of the group flag, an empty group's SIGNAL of it, the
# peer's handle-word put and the dispatch SIGNAL, in a loop over the peers that is not unrolled; per peer the
# communication programs' count and dispatch waits, the compute programs' count wait and their group-flag wait.
SITES = {"_moe_route": (0, 0, 0), "_moe_stage": (0, 0, 0), "_moe_dispatch": (4, 2, -3), "_moe_combine_send": (0, 0, 1),
         "_moe_combine_reduce": (1, 1, 0), "_moe_dispatch_gemm": (1, 4, 5)}


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("name", sorted(SIGNATURES))
def test_every_moe_kernel_compiles_for_sm90(name: str, world: int) -> None:
    signature, meta = SIGNATURES[name]
    meta = {**meta, **({"W": world} if "W" in meta else {}), **({"WP": 4} if "WP" in meta else {})}
    compiled = compile_kernel(getattr(moe_kernels, name), signature, meta, num_warps=4)
    assert compiled.asm["cubin"][:4] == b"\x7fELF"
    pushes, waits, quiets, code = protocol_sites(compiled.asm["ptx"])
    per_push, per_wait, other = SITES[name]
    assert (pushes, waits, quiets) == (per_push * world + other, per_wait * world, 0)
    assert not [op for op in code if ".nc" in op]  # counts, rows, handle words and outputs are NIC-written


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize(("communicate", "compute", "out"), [(True, True, "fp32"), (True, False, "bf16"),
                                                             (False, True, "bf16")])
def test_the_dispatch_gemm_variants_compile_for_sm90(world: int, communicate: bool, compute: bool, out: str) -> None:
    """The GEMM on the tensor cores (wgmma) exactly where it runs; compute=False keeps every push and wait
    (the communication alone, on the fused schedule); communicate=False has no protocol and no counting."""
    signature, meta = SIGNATURES["_moe_dispatch_gemm"]
    meta = {**meta, "W": world, "WP": 4 if world > 2 else 2, "COMMUNICATE": communicate, "COMPUTE": compute}
    compiled = compile_kernel(moe_kernels._moe_dispatch_gemm, {**signature, "y_ptr": f"*{out}"}, meta, num_warps=4)
    assert compiled.asm["cubin"][:4] == b"\x7fELF"
    pushes, waits, quiets, code = protocol_sites(compiled.asm["ptx"])
    assert any(op.startswith("wgmma") for op in code) == compute
    assert not [op for op in code if ".nc" in op]
    if communicate:
        # without the GEMM the compiler may duplicate a wait's block (world 2 gives 8 sites for 6 waits)
        assert pushes == world + 5 and quiets == 0 and (waits == 4 * world if compute else waits >= 4 * world)
    else:
        assert (pushes, waits, quiets) == (0, 0, 0)
        assert not [op for op in code if op.startswith("atom")]


@pytest.mark.parametrize(("communicate", "compute"), [(True, True), (True, False), (False, True)])
def test_a_dispatch_gemm_timeline_adds_clock_reads_and_nothing_to_the_protocol(communicate: bool,
                                                                               compute: bool) -> None:
    from tests.gpuclient.test_triton import ptx_lines

    signature, meta = SIGNATURES["_moe_dispatch_gemm"]
    meta = {**meta, "COMMUNICATE": communicate, "COMPUTE": compute}
    plain, timed = (compile_kernel(moe_kernels._moe_dispatch_gemm, signature, {**meta, "TIMELINE": on}, num_warps=4)
                    for on in (False, True))
    reads = [sum("%globaltimer" in line for line in ptx_lines(c.asm["ptx"])) for c in (plain, timed)]
    # a tile's start and end and a program's end at least, and where it communicates a group pushed, a flag's
    # wait passed and a group seen landing (the plain kernel reads the clock too, for the waits' spin bound, in
    # blocks that the compiler may duplicate without the GEMM)
    assert reads[1] - reads[0] >= (6 if communicate and compute else 3), reads
    (pushes, waits, quiets), (pushes0, waits0, quiets0) = (protocol_sites(c.asm["ptx"])[:3] for c in (timed, plain))
    assert (pushes, quiets) == (pushes0, quiets0)
    # where it communicates, more waits: the last communication program watching each group land (it reads,
    # and sends nothing; the compiler may unroll its loop over the groups, and without the GEMM duplicate a
    # wait's block: the variants test above)
    if communicate:
        assert min(waits, waits0) >= 4 * W and waits > waits0
    else:
        assert waits == waits0 == 0


def test_the_dispatch_gemm_timeline_layout_names_every_word() -> None:
    lay = MoELayout(1, 3, 6, 8, 2, 16)  # 3 ranks x 2 local experts, 5 events, 5 programs
    assert lay.timeline_words(5) == 5 * 6 + 5
    start = lay.timeline_start(5)
    assert (start[6:18] == MoELayout.TIMELINE_UNSET).all() and not start[:6].any() and not start[18:].any()
    words = np.arange(lay.timeline_words(5))
    words[7] = MoELayout.TIMELINE_UNSET  # a ready word no program wrote
    got = lay.split_timeline(words, 5)
    assert sorted(got) == ["arrived", "done", "program_ends", "ready", "sent", "start"]
    assert got["sent"].tolist() == [[0, 1], [2, 3], [4, 5]] and got["ready"][0].tolist() == [6, 0]
    assert got["start"][2, 1] == 17 and got["done"][0, 0] == 18 and got["arrived"][1, 0] == 26
    assert got["program_ends"].tolist() == [30, 31, 32, 33, 34]
    with pytest.raises(ValueError, match="a timeline of 5 programs is 35 words"):
        lay.split_timeline(np.zeros(28), 5)


@pytest.mark.parametrize("communicate", [False, True])
def test_the_compiled_tile_deal_carries_its_running_count_through_both_loops(communicate: bool) -> None:
    """The compute programs deal each (source step, expert) group's tiles from where the previous group's deal
    ended (``item``, a running tile count), so a group's odd tiles fall on every program in turn. Written as a
    loop whose lower bound alone read it, Triton 3.6 dropped the count from the step and expert loops: every
    group started at program 0, and on the H200 the first ``tiles % programs`` programs ended about 1 ms after
    the rest (docs/performance-log.md, "MoE Dispatch+GEMM's timeline"). Compiled as a launch specializes it, both
    loops still carry an i32."""
    import re

    signature, meta = SIGNATURES["_moe_dispatch_gemm"]
    meta = {**meta, "L": 32, "E": 64, "LP": 32, "H": 256, "N": 16384, "COMMUNICATE": communicate}
    compiled = compile_kernel(moe_kernels._moe_dispatch_gemm, signature, meta, num_warps=4)
    carried = re.findall(r"scf\.for %\w+ = %c0_i32 to %c(\d+)_i32 step %c1_i32 iter_args\([^)]*\) -> \(([^)]*)\)",
                         compiled.asm["ttgir"])
    loops = {int(trip): types for trip, types in carried}
    assert "i32" in loops.get(W, "").split(", ") and "i32" in loops.get(32, "").split(", "), carried


def test_the_dispatch_gemm_k_loop_is_pipelined_only_after_the_tiles_waits() -> None:
    """Compiled as a launch specializes it (16-byte aligned tensors, H and N multiples of 16), the GEMM's
    k-loop is software-pipelined (cp.async), and its prologue comes after the tile's waits and the barrier
    behind them: no load of a peer's rows is issued ahead of the flag that covers them."""
    import inspect

    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from tests.gpuclient.test_triton import opcode, ptx_lines

    signature, meta = SIGNATURES["_moe_dispatch_gemm"]
    meta = {**meta, "H": 256, "N": 256}
    fn = moe_kernels._moe_dispatch_gemm
    names = list(inspect.signature(fn.fn).parameters)
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in signature if signature[n].startswith("*")}
    given = "constexprs" if "constexprs" in inspect.signature(ASTSource).parameters else "constants"
    source = ASTSource(fn=fn, signature={**signature, **dict.fromkeys(meta, "constexpr")}, attrs=attrs,
                       **{given: meta})
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "num_stages": 3})
    marks = []  # the PTX in order: protocol blocks, barriers and asynchronous copies
    for line in ptx_lines(compiled.asm["ptx"]):
        mark = ("wait" if line.startswith("TPD_WAIT_") else "push" if "st.release.sys" in line
                else "bar" if opcode(line).startswith("bar.sync") else "cp" if opcode(line).startswith("cp.async")
                else None)
        if mark and (not marks or marks[-1] != mark):
            marks.append(mark)
    assert "cp" in marks
    after_wait = [marks[i:i + 3] for i, m in enumerate(marks) if m == "wait" and "cp" in marks[i:i + 3]]
    assert after_wait == [["wait", "bar", "cp"]], marks


def test_the_route_kernel_compiles_for_int32_indices_and_one_expert_per_token() -> None:
    signature, meta = SIGNATURES["_moe_route"]
    compiled = compile_kernel(moe_kernels._moe_route, {**signature, "idx_ptr": "*i32"},
                              {**meta, "K": 1, "KP": 1, "T": 1, "BLOCK_T": 1}, num_warps=4)
    assert compiled.asm["cubin"][:4] == b"\x7fELF"
    signature, meta = SIGNATURES["_moe_stage"]
    compiled = compile_kernel(moe_kernels._moe_stage, signature, {**meta, "K": 1, "KP": 1}, num_warps=4)
    assert compiled.asm["cubin"][:4] == b"\x7fELF"


@pytest.mark.parametrize("world", [2, 3])
def test_the_fp8_dispatch_kernels_compile_for_sm90(world: int) -> None:
    """fp8=True: the stage kernel quantizes with the hardware's saturating e4m3 conversion into byte rows; the
    dispatch kernel keeps its protocol sites (its puts are the same puts of shorter rows)."""
    signature, meta = SIGNATURES["_moe_stage"]
    compiled = compile_kernel(moe_kernels._moe_stage, {**signature, "send_x_ptr": "*u8", "recv_x_ptr": "*u8"},
                              {**meta, "H": 256, "ROW": dispatch_row(256, True)[0], "FP8": True}, num_warps=4)
    assert compiled.asm["cubin"][:4] == b"\x7fELF"
    assert "cvt.rn.satfinite.e4m3x2.f32" in compiled.asm["ptx"]
    signature, meta = SIGNATURES["_moe_dispatch"]
    row_bytes = dispatch_row(256, True)[1]
    meta = {**meta, "W": world, "WP": 4, "ROW_BYTES": row_bytes}
    compiled = compile_kernel(moe_kernels._moe_dispatch, signature, meta, num_warps=4)
    pushes, waits, quiets, _ = protocol_sites(compiled.asm["ptx"])
    per_push, per_wait, other = SITES["_moe_dispatch"]
    assert (pushes, waits, quiets) == (per_push * world + other, per_wait * world, 0)


def test_fp8_rows_quantize_in_the_interpreter() -> None:
    """tests/gpuclient/moe_fp8_interpreted.py, with TRITON_INTERPRET=1: scales bit for bit, bytes as numpy's
    e4m3 encoding (within the interpreter's known rounding defects), a masked row untouched; then the stage
    kernel's FP8 rows, each of a token's destinations holding the bytes its row quantizes to, no other row
    written."""
    run = run_interpreted("tests.gpuclient.moe_fp8_interpreted")
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stdout[-4000:] + run.stderr[-8000:]


def test_fp8_is_refused_where_it_cannot_work() -> None:
    from gpuclient.kernels import MoE

    session = SimpleNamespace(rank=0, world=2, device=0)
    with pytest.raises(ValueError, match="multiple of 128"):
        MoE(session, 200, 8, 16, 2, fp8=True)
    with pytest.raises(ValueError, match="dispatch_gemm is bf16"):
        MoE(session, 256, 8, 16, 2, fp8=True, gemm_n=128)


def test_dispatch_gemm_tiles_are_checked_before_anything_is_allocated() -> None:
    from gpuclient.kernels import MoE
    from gpuclient.kernels.moe import check_gemm_tiles

    session = SimpleNamespace(rank=0, world=2, device=0)  # no daemon, no GPU: refused before either is used
    for kwargs, message in [({"gemm_block": (64, 96, 64)}, "gemm_block must be three powers of two"),
                            ({"gemm_block": (64, 128, True)}, "gemm_block must be three powers of two"),
                            ({"gemm_warps": 3}, "num_warps must be a power of two"),
                            ({"gemm_stages": 0}, "num_stages must be an integer >= 1"),
                            ({"split_experts": 5}, r"split_experts must be an integer in \[0, 4\]"),
                            ({"split_experts": -1}, r"split_experts must be an integer in \[0, 4\]"),
                            ({"split_experts": True}, r"split_experts must be an integer in \[0, 4\]")]:
        with pytest.raises(ValueError, match=message):
            MoE(session, 256, 8, 16, 2, gemm_n=128, **kwargs)
    assert check_gemm_tiles([32, 256, 64], 8, 4) == ((32, 256, 64), 8, 4)


def test_dispatch_gemm_tiles_default_by_the_rows_an_expert_gets() -> None:
    """Narrow row blocks for a few rows an expert (the tuned 64-expert shape: 32), a dense GEMM's wide tiles from
    MANY_ROWS on; both pass the op's checks."""
    from gpuclient.kernels.moe import FEW_ROWS_TILES, MANY_ROWS, MANY_ROWS_TILES, check_gemm_tiles, default_gemm_tiles

    assert default_gemm_tiles(128, 8, 2, 64) == FEW_ROWS_TILES == ((64, 128, 64), 4, 6)  # 32 rows an expert
    assert default_gemm_tiles(MANY_ROWS - 1, 1, 1, 1) == FEW_ROWS_TILES
    assert default_gemm_tiles(MANY_ROWS, 1, 1, 1) == default_gemm_tiles(128, 8, 2, 8) == MANY_ROWS_TILES
    for bad in ((0, 8, 2, 8), (128, 8, 2, 0), ("128", 8, 2, 8)):  # refused later, by MoELayout
        assert default_gemm_tiles(*bad) == FEW_ROWS_TILES
    for tiles in (FEW_ROWS_TILES, MANY_ROWS_TILES):
        assert check_gemm_tiles(*tiles) == tiles


def test_dispatch_gemm_splits_the_first_put_group_s_experts_by_default() -> None:
    from gpuclient.kernels.moe import default_experts_per_put, default_split_experts

    wide = MoELayout(0, 2, 64, 1024, 8, 7168, experts_per_put=default_experts_per_put(64, 2))
    assert (wide.experts_per_put, default_split_experts(wide)) == (8, 8)  # 32 local experts, four groups
    assert default_split_experts(MoELayout(1, 2, 6, 40, 3, 200, experts_per_put=2)) == 2
    assert default_split_experts(MoELayout(0, 2, 6, 40, 3, 200, experts_per_put=5)) == 3  # one group: all


def test_dispatch_gemm_sends_a_peer_four_puts_by_default() -> None:
    """``default_experts_per_put``: PUT_GROUPS puts a destination (the last may hold fewer experts), one expert a
    put where a rank has fewer; counts that are not positive integers get 1 (MoELayout refuses them)."""
    from gpuclient.kernels.moe import PUT_GROUPS, default_experts_per_put

    assert PUT_GROUPS == 4
    assert default_experts_per_put(64, 2) == 8  # DeepEP-LL's shape: 32 experts a rank, 8 a put
    for experts, world in [(64, 2), (6, 2), (9, 3), (8, 8), (40, 4), (1, 1)]:
        lay = MoELayout(0, world, experts, 8, 1, 16, experts_per_put=default_experts_per_put(experts, world))
        assert lay.put_groups == min(PUT_GROUPS, lay.local_experts), (experts, world)
    for bad in ((0, 2), (64, 0), (True, 2), ("64", 2)):
        assert default_experts_per_put(*bad) == 1
    with pytest.raises(ValueError, match="experts_per_put must be an integer >= 1"):
        MoELayout(0, 2, 8, 16, 2, 64, experts_per_put=0)
    from gpuclient.kernels import MoE

    session = SimpleNamespace(rank=0, world=2, device=0)  # refused before a daemon or a GPU is used
    for bad in (0, -1, True, 1.5, "2"):
        with pytest.raises(ValueError, match=f"experts_per_put must be an integer >= 1, got {bad!r}"):
            MoE(session, 256, 8, 16, 2, gemm_n=128, experts_per_put=bad)


def test_the_kernels_do_not_specialize_on_rank_or_tokens_and_take_no_round_number() -> None:
    for name in SIGNATURES:
        fn = getattr(moe_kernels, name)
        for p in fn.params:
            if p.name in ("rank", "tokens"):
                assert p.do_not_specialize, (name, p.name)
            # a round number passed by value would be frozen into a captured CUDA graph: the kernels read theirs
            # from the op's round words (rounds_ptr)
            assert "epoch" not in p.name, (name, p.name)


# --- the kernels in Triton's interpreter ----------------------------------------------------------------------------
@pytest.mark.parametrize("shape", [(2, 4, 9, 3, 40, 3), (3, 6, 5, 2, 24, 2), (1, 2, 6, 2, 16, 1),
                                   (2, 4, 9, 3, 40, 3, 2)],
                         ids=["2ranks", "3ranks", "1rank", "2ranks-split"])
def test_the_kernels_run_in_the_interpreter_and_match_the_model(shape: tuple) -> None:
    """(world, experts, max_tokens, topk, hidden, programs[, put_rows]): tests/gpuclient/moe_interpreted.py, in a
    process of its own with TRITON_INTERPRET=1; put_rows 2 splits every block of more than two rows into
    pieces (as a block past the largest put is)."""
    run = run_interpreted("tests.gpuclient.moe_interpreted", *shape)
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stdout[-4000:] + run.stderr[-8000:]


@pytest.mark.parametrize("shape", [(2, 6, 20, 3, 40, 40, 4, 2, 16, 16, 16, "bf16", 60, 1),
                                   (2, 6, 20, 3, 40, 40, 4, 2, 16, 16, 16, "bf16", 60, 2),
                                   (3, 9, 12, 4, 40, 24, 7, 2, 16, 16, 16, "fp32", 48, 3),
                                   (1, 2, 6, 2, 16, 16, 3, 1, 16, 16, 16, "bf16"),
                                   (2, 6, 20, 3, 40, 40, 4, 2, 16, 16, 16, "bf16", 3, 2),
                                   (2, 6, 20, 3, 40, 40, 4, 2, 16, 16, 16, "bf16", 60, 1, 0),
                                   (3, 9, 12, 4, 40, 24, 7, 2, 16, 16, 16, "fp32", 48, 1, 2),
                                   (2, 4, 40, 2, 40, 24, 4, 2, 16, 16, 16, "bf16", 60, 2)],
                         ids=["2ranks-bf16", "2ranks-bf16-groups", "3ranks-fp32-narrow-one-group", "1rank",
                              "2ranks-bf16-split-groups", "2ranks-bf16-whole-experts", "3ranks-fp32-split-two",
                              "2ranks-bf16-own-blocks"])
def test_dispatch_gemm_runs_in_the_interpreter_and_matches_the_model(shape: tuple) -> None:
    """(world, experts, max_tokens, topk, hidden, n_out, programs, comm_programs, block_m, block_n, block_k,
    out[, put_rows, experts_per_put[, split_experts]]): tests/gpuclient/moe_gemm_interpreted.py, one process per
    rank over shared memory. Tiles of 16 rows straddle the sources' rows, and an expert has several row blocks
    (dealt row block first, column block by column block); hidden 40 and n_out 24 are no multiples of the
    16-wide blocks; an expert a put, groups of two of three experts (the last group one), all three in one
    group; put_rows 3 splits the groups into pieces dealt over both communication programs. The local experts
    below split_experts (here by default the first group's) are taken source by source, own rows first; the others
    whole, at their latest source's step: every expert whole, every expert by source (one group of three),
    and two of three by source. With 20 rows an expert from each source (own-blocks), most split experts have
    a full block of own rows, which the compute programs take before the peers' counts are in."""
    run = run_interpreted("tests.gpuclient.moe_gemm_interpreted", *shape, timeout=900)
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stdout[-8000:] + run.stderr[-8000:]


def test_a_dispatch_row_is_bf16_values_or_fp8_bytes_and_their_scales() -> None:
    assert dispatch_row(7168, False) == (7168, 2 * 7168)
    row, nbytes = dispatch_row(7168, True)
    assert row == nbytes == 7168 + (7168 // 128) * 4  # one e4m3 byte a value, one fp32 scale per 128 values
