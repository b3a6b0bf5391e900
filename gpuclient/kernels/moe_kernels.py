"""The MoE op's device code (Triton): the kernels ``gpuclient.kernels.moe.MoE`` launches, and the protocol
they speak with their peers. The layout math is ``gpuclient.kernels.moe_layout`` (numpy; the tests' model).

Kernels, in stream order (each a small grid but the route's and the stage's; all Triton, all preloaded by
``prepare``):

dispatch round e
  1. ``_moe_route``   normalise topk_idx (invalid and repeated experts become -1); per expert (a program each,
                      over a grid of its own): where its block starts in the stage (``eoff[e]``, the exclusive
                      sum of this rank's counts over the lower experts), its count, each entry's stage row
                      ``eoff[e] + position`` (token order), the handle words.
     ``_moe_stage``   token by token, over a grid of its own, x's row copied to each of its experts: for a
                      peer's expert into the registered ``send_x`` at the entry's stage row, so this rank's rows
                      for one expert are contiguous there (expert-major, ``T*K`` rows at most); for one of this
                      rank's own experts straight to its receive row in ``recv_x``, with its handle word in
                      ``recv_src`` (with ``fp8`` quantized on the way: H e4m3 bytes and H/128 fp32 scales a row).
  2. ``_moe_dispatch`` program 0 sends, waiting for nothing: this rank's count row to every peer
                      (put_signal, ``count_slot + rank``); then peer by peer this rank's rows for all of the
                      peer's experts (one block of the stage) into this rank's slice of the peer's ``land_x``,
                      where this rank's own counts
                      alone place them (pieces of ``land_put_rows`` where the block passes the largest put),
                      then the handle words of the peer's experts in one put into its ``src_stage``, then one
                      SIGNAL (``dispatch_slot + rank``: it covers every earlier put of this channel to the
                      peer). Blocks for this rank are in place already. Then every program waits for every
                      peer's count and dispatch flags and packs a share of the peers' landed rows into
                      ``recv_x`` at their receive rows (the counts for the expert of the sources before each in
                      the receiver's order: its own rows first, then its ring predecessors'); the last to
                      finish writes the per-expert receive counts and scatters each peer's staged handle words
                      into ``recv_src``.
combine round e
  3. ``_moe_combine_send``   each (local expert, source) block of y, contiguous in recv_x's layout, as one put to
                             the source's ``combine_buf`` at the source's stage rows for the expert (``eoff``
                             from the source's count row, which every rank holds; copied into the registered
                             ``send_y`` first: puts read registered memory only).
  4. ``_moe_combine_reduce`` one SIGNAL per peer (``combine_slot + rank``), a wait for every peer's, then the
                             weighted sum in fp32 per token, entry (t, k) read from its stage row.

So a dispatch pushes each peer four records (its count row, its rows, the handle words, a SIGNAL) and a
combine one put per (expert, source) block and one SIGNAL, whatever the number of rows. No rank waits for a
peer's counts before it sends: the counts and the rows fly together, and only the receiver needs both.

On efa a SIGNAL covers only the writes since the connection's previous signal: a peer's rows and handle words
follow the count put_signal to it on the connection and precede its dispatch SIGNAL (one program pushes them
all, in that order), so the dispatch flag covers them.

dispatch_gemm round e (``gemm_n`` set): ``_moe_route`` and ``_moe_stage``, then ``_moe_dispatch_gemm`` in place
of 2, one persistent launch split by role. Its first ``comm_programs`` programs push each peer its rows at once (as
dispatch does: our own counts place them in our slice of the peer's ``land_x``), peer by peer in
ring order, each peer served by one program (``(step - 1) % comm_programs``), in *groups* of ``experts_per_put``
of the peer's experts: a group's rows are one block of ``send_x`` (staged expert-major), put into our slice of
the peer's ``land_x`` [W, source_rows, H] (``MoELayout.gemm_puts``: at the rows we sent its lower experts),
the last piece a put_signal of the peer's *group flag* (``expert_slot + rank * L + group``); an empty group
SIGNALs its flag. Then the peer's handle words in one put and a SIGNAL of its dispatch flag
(``dispatch_slot + rank``); the last communication program then waits for every peer's dispatch flag and
scatters their handle words into ``recv_src`` (last, by one program: it waits on the peers' communication
programs, which wait for nothing but the counts). The compute programs wait for the count flags, then walk
each local expert's packed rows in (row block, column block) tiles, own rows first (read from ``recv_x``, where
``_moe_stage`` put them: no wait), then the sources in the order they send to this rank, and before a tile of expert l
wait for the group flag ``(s, l // experts_per_put)`` of every source s with rows in it: a tile starts once
its own expert's group is in, not the sources' whole transfers. A peer's rows are gathered from its
``land_x`` slice (``land_offsets``); each tile of a row block copies a share of their columns into
``recv_x`` first, so ``recv_x`` ends as after ``dispatch``. ``y = rows @ w[l]`` (bf16 tl.dot, fp32
accumulation) in ``recv_x``'s layout, so ``combine`` follows as after ``dispatch``. Why groups: the soft
fabric costs ~70-135 us a message whatever its size, and a put per expert made 32 of them a peer
(docs/kernels.md, "Puts and signals").

Group flags count dispatch_gemm rounds: every (peer, group) pair gets exactly one signal per fused round
(the put_signal, or the SIGNAL of an empty group), so after n fused rounds each is n, rows or none, and the
compute programs wait for ``gemm_epoch`` = the op's count of fused rounds that communicated (its third round word;
``compute=False`` counts, ``communicate=False`` neither counts nor waits, and reads the rows from ``recv_x``).
Plain ``dispatch`` leaves them alone, so the two alternate freely. What covers a row, on efa too (a signal
covers the writes since the connection's previous signal): only the program serving a peer pushes to it,
besides program 0's count put_signal, so a group's puts and its put_signal are consecutive on the connection
unless the count put_signal falls between them; then the rows before it are covered by the count flag, which
the compute programs wait for first. So a row is covered by its group flag or the count flag, both waited
for; the handle words by the dispatch SIGNAL right after them (or the count flag). On ib the put_signal comes
after every put of the group in the ring. The price: ``2 + groups`` signals per destination and fused round
(count, a flag per group, dispatch) where plain dispatch sends 2.

No host sync, no host loop over tokens: the counts go GPU to GPU and every buffer has its worst-case size.
Every wait is for something its peer pushes in the same-numbered kernel before that kernel waits, and no
kernel waits for a later one, so two ranks progress as long as both grids are resident at once (``share``).
And no call queues a kernel behind one of its own that waits (the kernel before a waiting one waits for
nothing): ranks sharing a process launch on streams that may share a hardware work queue (under MPS a client
gets few), where a kernel waiting for its stream's waiting kernel would hold back a peer's launch behind it.
Flags are monotonic (ADD 1 per round, round e waits for e; a group flag per fused round); nothing is
reset. Buffer reuse between rounds
needs no release flags: each round's dispatch and combine form a round trip with every peer (see the reuse
argument in docs/kernels.md), which is why a dispatch must be followed by its combine before the next.
"""

from __future__ import annotations

import triton
import triton.language as tl

from gpuclient import triton as tpd
from gpuclient.kernels._rounds import last_to_finish, this_round

# No specialization on the round, the rank or the token count: Triton would compile (and load, behind a
# waiting kernel) again for another value.


@triton.jit
def _first_entries(tile, ks, KP: tl.constexpr):
    """[rows, KP] of expert indices: where an entry is the first of its value in its row (a repeat is not)."""
    repeat = tile != tile
    for j in tl.static_range(KP):
        col = tl.sum(tl.where(ks[None, :] == j, tile, 0), axis=1)
        repeat = repeat | ((ks[None, :] > j) & (tile == col[:, None]))
    return repeat == 0


@triton.jit
def _copy_rows(src, dst, rows, H: tl.constexpr, BLOCK_H: tl.constexpr):
    """Row i of ``src`` to row i of ``dst`` (each a block of row pointers) where ``rows[i]``."""
    hs = tl.arange(0, BLOCK_H)
    for h0 in range(0, H, BLOCK_H):
        m = rows[:, None] & (h0 + hs[None, :] < H)
        tl.store(dst[:, None] + h0 + hs[None, :], tl.load(src[:, None] + h0 + hs[None, :], mask=m), mask=m)


@triton.jit
def _quantize_block(src, rows, h0, H: tl.constexpr, BLOCK_H: tl.constexpr):
    """Columns ``h0 ... h0 + BLOCK_H`` of bf16 rows ``src`` (a block of row pointers; where ``rows[i]``) as e4m3:
    every group of 128 values scaled by 448 / its largest magnitude (e4m3's largest finite). Returns the fp8
    bytes [rows, BLOCK_H / 128, 128] (uint8) and the fp32 scales [rows, BLOCK_H / 128] (value = fp8 * scale),
    for ``_store_quantized`` to store at as many destinations as the rows have. BLOCK_H a multiple of 128."""
    gs = tl.arange(0, BLOCK_H // 128)
    cs = tl.arange(0, 128)
    col = h0 + gs[:, None] * 128 + cs[None, :]
    inside = rows[:, None, None] & (col[None, :, :] < H)
    v = tl.load(src[:, None, None] + col[None, :, :], mask=inside, other=0.0).to(tl.float32)
    amax = tl.maximum(tl.max(tl.abs(v), axis=2), 1e-4)  # an all-zero group still gets a finite scale
    q = (v * (448.0 / amax)[:, :, None]).to(tl.float8e4nv)
    return q.to(tl.uint8, bitcast=True), amax / 448.0


@triton.jit
def _store_quantized(dst, rows, q, scale, h0, H: tl.constexpr, BLOCK_H: tl.constexpr):
    """``_quantize_block``'s bytes and scales for columns ``h0 ...`` into fp8 rows ``dst`` (bytes; a block of row
    pointers) where ``rows[i]``: a row is its H fp8 bytes, then its H / 128 fp32 scales."""
    gs = tl.arange(0, BLOCK_H // 128)
    cs = tl.arange(0, 128)
    col = h0 + gs[:, None] * 128 + cs[None, :]
    tl.store(dst[:, None, None] + col[None, :, :], q, mask=rows[:, None, None] & (col[None, :, :] < H))
    g = h0 // 128 + gs
    tl.store((dst[:, None] + H + g[None, :] * 4).to(tl.pointer_type(tl.float32)), scale,
             mask=rows[:, None] & (g[None, :] < H // 128))


@triton.jit(do_not_specialize=["rank", "tokens"])
def _moe_route(idx_ptr, idx32_ptr, row_ptr, count_ptr, eoff_ptr, send_src_ptr, rank, tokens, E: tl.constexpr,
               K: tl.constexpr, KP: tl.constexpr, T: tl.constexpr, BLOCK_T: tl.constexpr):
    pid = tl.program_id(0)
    progs = tl.num_programs(0)
    ks = tl.arange(0, KP)
    # per token: the normalised expert list
    for t in range(pid, tokens, progs):
        e = tl.load(idx_ptr + t * K + ks, mask=ks < K, other=-1).to(tl.int32)
        repeat = tl.sum(((e[:, None] == e[None, :]) & (ks[None, :] < ks[:, None])).to(tl.int32), axis=1) > 0
        tl.store(idx32_ptr + t * K + ks, tl.where((e >= 0) & (e < E) & (repeat == 0), e, -1), mask=ks < K)
    # per expert: where its block starts in the stage (eoff: the valid entries naming a lower expert), the first
    # hit of each token (a repeat is not counted), each entry's stage row eoff + position (token order), the
    # handle words, the count (the rows follow in _moe_stage, token-parallel)
    for e in range(pid, E, progs):
        start = tl.zeros((), dtype=tl.int32)
        for t0 in range(0, tokens, BLOCK_T):
            ts = t0 + tl.arange(0, BLOCK_T)
            tile = tl.load(idx_ptr + ts[:, None] * K + ks[None, :], mask=(ts[:, None] < tokens) & (ks[None, :] < K),
                           other=-1).to(tl.int32)
            lower = _first_entries(tile, ks, KP) & (tile >= 0) & (tile < e)
            start += tl.sum(tl.sum(lower.to(tl.int32), axis=1), axis=0)
        carry = tl.zeros((), dtype=tl.int32)
        for t0 in range(0, tokens, BLOCK_T):
            ts = t0 + tl.arange(0, BLOCK_T)
            tile = tl.load(idx_ptr + ts[:, None] * K + ks[None, :], mask=(ts[:, None] < tokens) & (ks[None, :] < K),
                           other=-1).to(tl.int32)
            hit = (tile == e).to(tl.int32)
            first = (hit == 1) & (tl.cumsum(hit, axis=1) == 1)
            took = tl.sum(first.to(tl.int32), axis=1)
            k_of = tl.sum(tl.where(first, ks[None, :], 0), axis=1)
            p = carry + tl.cumsum(took, axis=0) - took
            tl.store(row_ptr + ts * K + k_of, start + p, mask=took > 0)
            tl.store(send_src_ptr + e * T + p, (rank * T + ts) * K + k_of, mask=took > 0)
            carry += tl.sum(took, axis=0)
        tl.store(count_ptr + rank * E + e, carry)
        tl.store(eoff_ptr + e, start)


@triton.jit(do_not_specialize=["rank", "tokens"])
def _moe_stage(x_ptr, idx32_ptr, row_ptr, eoff_ptr, send_x_ptr, recv_x_ptr, recv_src_ptr, rank, tokens,
               W: tl.constexpr, L: tl.constexpr, K: tl.constexpr, KP: tl.constexpr, T: tl.constexpr,
               H: tl.constexpr, ROW: tl.constexpr, COPY_ROWS: tl.constexpr, BLOCK_H: tl.constexpr,
               FP8: tl.constexpr = False):
    """Each token's row of x to each of its experts (``_moe_route``'s ``idx32`` and ``row_ptr``), COPY_ROWS tokens
    a step, the steps strided over the grid: for a peer's expert into the registered send_x at the entry's stage
    row, where the puts read it; for one of this rank's own experts straight to its receive row in recv_x (its
    own rows lead the expert's receive rows, in token order: row ``stage row - eoff[e]``), with its handle word
    in recv_src, so no later kernel copies them there. Its own kernel, after the route's: any number of programs
    can copy once every stage row is known, where the route staged each expert's block from the one program that
    counted it (a few rows in flight each: at 1024 tokens a rank and top-8, 117 MB that held back every put of
    the dispatch). A row block is read once and stored once per expert; with FP8 quantized once on the way
    (``_quantize_block``): H e4m3 bytes and H/128 fp32 scales a row."""
    pid = tl.program_id(0)
    progs = tl.num_programs(0)
    rs = tl.arange(0, COPY_ROWS)
    ks = tl.arange(0, KP)
    hs = tl.arange(0, BLOCK_H)
    for t0 in range(pid * COPY_ROWS, tokens, progs * COPY_ROWS):
        ts = t0 + rs
        live = ts < tokens
        src = x_ptr + tl.cast(ts, tl.int64) * H
        at = ts[:, None] * K + ks[None, :]
        entry = live[:, None] & (ks[None, :] < K)
        experts = tl.load(idx32_ptr + at, mask=entry, other=-1)  # [COPY_ROWS, KP]
        staged = experts >= 0
        stage_rows = tl.load(row_ptr + at, mask=staged, other=0)
        local = experts - rank * L
        own = staged & (local >= 0) & (local < L)
        recv_rows = local * (W * T) + stage_rows - tl.load(eoff_ptr + experts, mask=own, other=0)
        tl.store(recv_src_ptr + recv_rows, (rank * T + ts[:, None]) * K + ks[None, :], mask=own)
        if FP8:  # each row its H fp8 values and H / 128 fp32 scales, quantized once and stored once per expert
            for h0 in range(0, H, BLOCK_H):
                q, scale = _quantize_block(src, live, h0, H, BLOCK_H)
                for k in tl.static_range(K):
                    valid, dst = _stage_target(k, ks, live, experts, own, stage_rows, recv_rows, send_x_ptr,
                                               recv_x_ptr, ROW)
                    _store_quantized(dst, valid, q, scale, h0, H, BLOCK_H)
        else:
            for h0 in range(0, H, BLOCK_H):
                cols = h0 + hs[None, :]
                v = tl.load(src[:, None] + cols, mask=live[:, None] & (cols < H))
                for k in tl.static_range(K):
                    valid, dst = _stage_target(k, ks, live, experts, own, stage_rows, recv_rows, send_x_ptr,
                                               recv_x_ptr, ROW)
                    tl.store(dst[:, None] + cols, v, mask=valid[:, None] & (cols < H))


@triton.jit
def _stage_target(k, ks, live, experts, own, stage_rows, recv_rows, send_x_ptr, recv_x_ptr, ROW: tl.constexpr):
    """Entry k of each token in a ``_moe_stage`` step: whether it names an expert, and its row's destination (its
    receive row in recv_x for one of this rank's experts, else its stage row in send_x)."""
    pick = ks[None, :] == k
    valid = live & (tl.sum(tl.where(pick, experts, 0), axis=1) >= 0)
    mine = tl.sum(tl.where(pick, own.to(tl.int32), 0), axis=1) > 0
    dst = tl.where(mine, recv_x_ptr + tl.cast(tl.sum(tl.where(pick, recv_rows, 0), axis=1), tl.int64) * ROW,
                   send_x_ptr + tl.cast(tl.sum(tl.where(pick, stage_rows, 0), axis=1), tl.int64) * ROW)
    return valid, dst


@triton.jit
def _receive_place(d, s, W: tl.constexpr):
    """Source s's place in rank d's receive rows (0: d's own, then d - 1, d - 2, ...: the order the sources send
    to d in; MoELayout.source_offsets). The one rule every kernel packs and reads the receive rows by; its own
    inverse, so ``_receive_place(d, p, W)`` is also the source at place p."""
    return (d - s + W) % W


@triton.jit
def _receive_offsets(counts, place):
    """Each source's first row in each local expert's receive rows: ``counts`` [LP, WP] (an expert's rows from
    each source) summed over the sources placed before it (``place`` [WP], `_receive_place`)."""
    return tl.sum(tl.where(place[None, None, :] < place[None, :, None], counts[:, None, :], 0), axis=2)


@triton.jit
def _source_offset(count_ptr, src, e, W: tl.constexpr, E: tl.constexpr, L: tl.constexpr):
    """Where source src's rows for expert e start at the expert's rank d: the counts for e of the sources placed
    before src in d's receive rows (`_receive_place`)."""
    d = e // L
    place = _receive_place(d, src, W)
    off = tl.zeros((), dtype=tl.int32)
    for s in range(0, W):
        if _receive_place(d, s, W) < place:
            off += tl.load(count_ptr + s * E + e)
    return off


@triton.jit
def _put_handles(ch, d, rank, src_stage_region, send_src_region, L: tl.constexpr, T: tl.constexpr,
                 HANDLE_WORDS: tl.constexpr):
    """The handle words of every expert of rank d (``send_src`` rows ``d * L ...``, ``L * T`` words, past the counts
    too) to d's ``src_stage`` slice for this rank, in one put (pieces of HANDLE_WORDS words where they pass the
    largest put); d scatters them into ``recv_src``."""
    for j in range(0, L * T, HANDLE_WORDS):
        n = tl.minimum(L * T - j, HANDLE_WORDS)
        tpd.put(ch, d, src_stage_region, (tl.cast(rank, tl.int64) * (L * T) + j) * 4, send_src_region,
                (tl.cast(d, tl.int64) * (L * T) + j) * 4, tl.cast(n, tl.int64) * 4)


@triton.jit
def _scatter_handles(count_ptr, src_stage_ptr, recv_src_ptr, rank, W: tl.constexpr, E: tl.constexpr,
                     L: tl.constexpr, T: tl.constexpr, BLOCK_T: tl.constexpr):
    """Each peer's handle words, staged by its ``_put_handles``, into ``recv_src`` at its rows' receive rows
    (this rank's own were copied with its rows)."""
    ts = tl.arange(0, BLOCK_T)
    for local in range(0, L):
        off = tl.zeros((), dtype=tl.int32)
        for step in range(0, W):  # the sources in receive order: this rank's own rows first (MoELayout)
            s = _receive_place(rank, step, W)
            c = tl.load(count_ptr + s * E + rank * L + local)
            if s != rank:
                for j in range(0, c, BLOCK_T):
                    inside = j + ts < c
                    word = tl.load(src_stage_ptr + (s * L + local) * T + j + ts, mask=inside)
                    tl.store(recv_src_ptr + local * (W * T) + off + j + ts, word, mask=inside)
            off += c


@triton.jit(do_not_specialize=["rank"])
def _moe_dispatch(ch, rounds_ptr, rank, count_ptr, eoff_ptr, recv_x_ptr, recv_src_ptr, src_stage_ptr, land_ptr,
                  recv_count_ptr, layout_ptr, count_region, land_region, src_stage_region, send_x_region,
                  send_src_region, count_slot, dispatch_slot, W: tl.constexpr, E: tl.constexpr, L: tl.constexpr,
                  T: tl.constexpr, ROW: tl.constexpr, ROW_BYTES: tl.constexpr, SOURCE_ROWS: tl.constexpr,
                  LAND_PUT_ROWS: tl.constexpr, HANDLE_WORDS: tl.constexpr, LP: tl.constexpr, WP: tl.constexpr,
                  BLOCK_T: tl.constexpr, COPY_ROWS: tl.constexpr, BLOCK_H: tl.constexpr, SEND: tl.constexpr = True,
                  FINISH: tl.constexpr = True):
    """dispatch after ``_moe_route`` and ``_moe_stage``, one launch: program 0 sends everything (``_send_blocks``:
    no wait), then every program waits for every peer's count and dispatch flags and packs a share of their
    landed rows into recv_x (``_pack_rows``); the last to finish writes the receive layout and scatters the
    handle words. One launch, not a send kernel and a finish kernel: ranks sharing a process and GPU launch on
    streams that may share a hardware work queue (under MPS a client has few), and a finish kernel queued behind
    its waiting send kernel would hold back a peer's send kernel queued behind it. ``SEND`` / ``FINISH`` False
    leave a phase out, for a model that runs the ranks in turn (the finish then one program, the last to
    finish: ``_rounds.last_to_finish``)."""
    epoch = this_round(rounds_ptr)
    if SEND:
        _send_blocks(ch, rank, count_ptr, eoff_ptr, count_region, land_region, src_stage_region, send_x_region,
                     send_src_region, count_slot, dispatch_slot, W, E, L, T, ROW_BYTES, SOURCE_ROWS, LAND_PUT_ROWS,
                     HANDLE_WORDS, LP)
    if FINISH:
        # a peer's rows are in once its dispatch flag is, and placed by its counts, in once its count flag is
        tpd.wait_peers(ch, rank, W, count_slot, epoch)
        tpd.wait_peers(ch, rank, W, dispatch_slot, epoch)
        _pack_rows(count_ptr, land_ptr, recv_x_ptr, rank, W, E, L, T, ROW, SOURCE_ROWS, COPY_ROWS, BLOCK_H)
        if last_to_finish(rounds_ptr):
            _scatter_handles(count_ptr, src_stage_ptr, recv_src_ptr, rank, W, E, L, T, BLOCK_T)
            _store_receive_layout(count_ptr, recv_count_ptr, layout_ptr, rank, W, E, L, LP, WP)
            tl.store(rounds_ptr, epoch)


@triton.jit
def _send_blocks(ch, rank, count_ptr, eoff_ptr, count_region, land_region, src_stage_region, send_x_region,
                 send_src_region, count_slot, dispatch_slot, W: tl.constexpr, E: tl.constexpr, L: tl.constexpr,
                 T: tl.constexpr, ROW_BYTES: tl.constexpr, SOURCE_ROWS: tl.constexpr, LAND_PUT_ROWS: tl.constexpr,
                 HANDLE_WORDS: tl.constexpr, LP: tl.constexpr):
    """The send phase, all of it in program 0 (a few commands a peer) and waiting for nothing: our count row to
    every peer (put_signal), then peer by peer in ring order our rows for all of its experts, one block of the
    stage (``_moe_stage`` staged them expert-major), into our slice of its land_x, where our own counts alone
    place them (pieces of LAND_PUT_ROWS rows where it passes the largest put), the handle words of its experts
    into its src_stage slice for us, and the SIGNAL of its dispatch flag, which covers them. Program 0 sends all
    of it before it waits, so every flag a program waits for comes from a peer's program 0 with nothing before it
    to wait for (a spread over programs deadlocked where programs run one after another: one waited for a flag
    that the peer's later program sends, behind the peer's waiting first). Our own experts' rows and handle
    words are in place already."""
    if tl.program_id(0) == 0:
        ls = tl.arange(0, LP)
        for peer in range(0, W):
            if peer != rank:
                tpd.put_signal(ch, peer, count_region, rank * E * 4, count_region, rank * E * 4, E * 4,
                               count_slot + rank, 1)
        for step in range(1, W):
            d = (rank + step) % W
            start = tl.load(eoff_ptr + d * L)
            count = tl.sum(tl.load(count_ptr + rank * E + d * L + ls, mask=ls < L, other=0), axis=0)
            for j in range(0, count, LAND_PUT_ROWS):
                n = tl.minimum(count - j, LAND_PUT_ROWS)
                tpd.put(ch, d, land_region, (tl.cast(rank, tl.int64) * SOURCE_ROWS + j) * ROW_BYTES, send_x_region,
                        tl.cast(start + j, tl.int64) * ROW_BYTES, tl.cast(n, tl.int64) * ROW_BYTES)
            _put_handles(ch, d, rank, src_stage_region, send_src_region, L, T, HANDLE_WORDS)
            tpd.signal(ch, d, dispatch_slot + rank, 1)


@triton.jit
def _pack_rows(count_ptr, land_ptr, recv_x_ptr, rank, W: tl.constexpr, E: tl.constexpr, L: tl.constexpr,
               T: tl.constexpr, ROW: tl.constexpr, SOURCE_ROWS: tl.constexpr, COPY_ROWS: tl.constexpr,
               BLOCK_H: tl.constexpr):
    """Every peer's landed rows (its land_x slice: its rows for our experts, expert by expert) into recv_x at
    their receive rows, COPY_ROWS rows a step, the steps of each (source, expert) block dealt round-robin over
    the programs from where the block before left off, so a few rows an expert still spread over all of them."""
    pid = tl.program_id(0)
    progs = tl.num_programs(0)
    rs = tl.arange(0, COPY_ROWS)
    hs = tl.arange(0, BLOCK_H)
    item = 0  # the steps dealt so far
    for step in range(1, W):
        s = _receive_place(rank, step, W)
        at = tl.zeros((), dtype=tl.int32)  # where the expert's rows start in s's slice
        for local in range(0, L):
            c = tl.load(count_ptr + s * E + rank * L + local)
            row0 = local * (W * T) + _source_offset(count_ptr, s, rank * L + local, W, E, L)
            steps = tl.cdiv(c, COPY_ROWS)
            q0 = (pid + progs - item % progs) % progs
            for qq in range(0, steps - q0, progs):  # from 0, as _moe_dispatch_gemm's deal (Triton 3.6)
                rows = (q0 + qq) * COPY_ROWS + rs
                live = rows < c
                src = land_ptr + tl.cast(s * SOURCE_ROWS + at + rows, tl.int64) * ROW
                dst = recv_x_ptr + tl.cast(row0 + rows, tl.int64) * ROW
                for h0 in range(0, ROW, BLOCK_H):
                    cols = h0 + hs
                    moved = live[:, None] & (cols[None, :] < ROW)
                    tl.store(dst[:, None] + cols[None, :], tl.load(src[:, None] + cols[None, :], mask=moved),
                             mask=moved)
            item += steps
            at += c


@triton.jit
def _store_receive_layout(count_ptr, recv_count_ptr, layout_ptr, rank, W: tl.constexpr, E: tl.constexpr,
                          L: tl.constexpr, LP: tl.constexpr, WP: tl.constexpr):
    """``recv_layout`` [L, W, 2] (each source's first row and row count in each local expert's packed rows) and
    ``recv_count`` [L], from the count matrix [W, E] every source filled in."""
    ls = tl.arange(0, LP)
    ss = tl.arange(0, WP)
    inside = (ls[:, None] < L) & (ss[None, :] < W)
    c = tl.load(count_ptr + ss[None, :] * E + rank * L + ls[:, None], mask=inside, other=0)
    off = _receive_offsets(c, _receive_place(rank, ss, W))
    at = layout_ptr + (ls[:, None] * W + ss[None, :]) * 2
    tl.store(at, off, mask=inside)
    tl.store(at + 1, c, mask=inside)
    tl.store(recv_count_ptr + ls, tl.sum(c, axis=1), mask=ls < L)


# ---- dispatch + grouped expert GEMM, fused ----------------------------------------------------------------------
@triton.jit
def _put_block_signal(ch, d, recv_region, send_x_region, start, row, count, slot, H: tl.constexpr,
                      PUT_ROWS: tl.constexpr):
    """A block of stage rows ``start ...`` (bf16 rows of H) to d's rows ``row ...`` of the region, in pieces of at
    most PUT_ROWS rows, in order: the last piece's put is a put_signal (ADD 1 to d's ``slot``), after every other
    put of the block in this program's order."""
    for j in range(0, count, PUT_ROWS):
        n = tl.minimum(count - j, PUT_ROWS)
        if j + PUT_ROWS < count:
            tpd.put(ch, d, recv_region, tl.cast(row + j, tl.int64) * (H * 2), send_x_region,
                    tl.cast(start + j, tl.int64) * (H * 2), tl.cast(n, tl.int64) * (H * 2))
        else:
            tpd.put_signal(ch, d, recv_region, tl.cast(row + j, tl.int64) * (H * 2), send_x_region,
                           tl.cast(start + j, tl.int64) * (H * 2), tl.cast(n, tl.int64) * (H * 2), slot, 1)


@triton.jit
def _expert_tile(a_row, rows, valid, w_ptr, y_ptr, local, col0, W: tl.constexpr, T: tl.constexpr, H: tl.constexpr,
                 N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """One tile of local expert ``local``'s GEMM: ``y[local, rows, col0 ...] = A @ w[local][:, col0 ...]``, row i of
    A at ``a_row[i]`` (the ``valid`` ones; the others are zero and not stored), fp32 accumulation."""
    offs_k = tl.arange(0, BLOCK_K)
    cols = col0 + tl.arange(0, BLOCK_N)
    w_cols = w_ptr + tl.cast(local, tl.int64) * (H * N) + cols[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        ks = k0 + offs_k
        a = tl.load(a_row[:, None] + ks[None, :], mask=valid[:, None] & (ks[None, :] < H), other=0.0)
        b = tl.load(w_cols + tl.cast(ks, tl.int64)[:, None] * N, mask=(ks[:, None] < H) & (cols[None, :] < N),
                    other=0.0)
        acc = tl.dot(a, b, acc)
    out = y_ptr + tl.cast(local * (W * T) + rows, tl.int64)[:, None] * N + cols[None, :]
    tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=valid[:, None] & (cols[None, :] < N))


@triton.jit
def _last_source(c, off, r0, r1, order):
    """The latest step (in the compute programs' source order) among the sources with rows in [r0, r1)."""
    return tl.max(tl.where((c > 0) & (off < r1) & (off + c > r0), order, -1), axis=0)


@triton.jit(do_not_specialize=["rank"])
def _moe_dispatch_gemm(ch, rounds_ptr, rank, count_ptr, eoff_ptr, recv_x_ptr, recv_src_ptr, src_stage_ptr,
                       land_ptr, w_ptr, y_ptr, recv_count_ptr, layout_ptr, count_region, land_region,
                       src_stage_region, send_x_region, send_src_region, count_slot, dispatch_slot, expert_slot,
                       timeline, W: tl.constexpr, E: tl.constexpr, L: tl.constexpr, T: tl.constexpr, H: tl.constexpr,
                       N: tl.constexpr, LP: tl.constexpr, WP: tl.constexpr, COMM_PROGRAMS: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_T: tl.constexpr,
                       EXPERTS_PER_PUT: tl.constexpr, GROUPS: tl.constexpr, SOURCE_ROWS: tl.constexpr,
                       GROUP_PUT_ROWS: tl.constexpr, HANDLE_WORDS: tl.constexpr, COMMUNICATE: tl.constexpr,
                       COMPUTE: tl.constexpr, SPLIT_EXPERTS: tl.constexpr, TIMELINE: tl.constexpr = False):
    # TIMELINE (MoELayout.timeline_words): %globaltimer when each (peer, expert)'s group was pushed, and per (source,
    # expert) the first pass of its flag's wait, the first start and the last end of the tiles taken at its step
    # (atomic min / max over the programs), when the last communication program saw its group land, then each
    # program's end
    pid = tl.program_id(0)
    epoch = this_round(rounds_ptr)  # the count and dispatch flags' round (shared with dispatch)
    gemm_epoch = tl.load(rounds_ptr + 2) + 1  # the group flags' round: the fused rounds that communicated
    ls = tl.arange(0, LP)
    ss = tl.arange(0, WP)
    inside = (ls[:, None] < L) & (ss[None, :] < W)
    if pid < COMM_PROGRAMS:
        if COMMUNICATE:
            if pid == 0:  # our count row (written by _moe_route) to every peer's copy of the count matrix
                for peer in range(0, W):
                    if peer != rank:
                        tpd.put_signal(ch, peer, count_region, rank * E * 4, count_region, rank * E * 4, E * 4,
                                       count_slot + rank, 1)
            # No wait for the peers' counts first: our rows land in our own slice of each peer's land_x, where
            # our counts alone place them (the peers' finished reading it last round: our combine of that round
            # waited for theirs, which followed their GEMM). So the rows leave a fabric round trip sooner.
            # peer by peer in ring order (rank + 1 first, which takes our rows first), each peer served by one
            # program (step - 1) % COMM_PROGRAMS, the only one that pushes to it besides program 0's count
            # put_signal: group by group (EXPERTS_PER_PUT of its experts), the group's rows (stage rows from
            # eoff[first expert], contiguous: staged expert-major by _moe_stage) as one put into our slice of
            # the peer's land_x (piece by piece if it passes the largest put), the last a put_signal of the
            # peer's group flag (expert_slot + rank * L + group); an empty group a SIGNAL of it, so each flag
            # rises exactly once per dispatch_gemm round. Then the handle words of all the peer's experts in one
            # put, and the dispatch SIGNAL to the peer, which covers them.
            for step in range(1, W):
                d = (rank + step) % W
                if (step - 1) % COMM_PROGRAMS == pid:
                    peer_start = tl.load(eoff_ptr + d * L)
                    for g in range(0, GROUPS):
                        local0 = g * EXPERTS_PER_PUT
                        count = tl.zeros((), dtype=tl.int32)
                        for j in range(local0, tl.minimum(local0 + EXPERTS_PER_PUT, L)):
                            count += tl.load(count_ptr + rank * E + d * L + j)
                        start = tl.load(eoff_ptr + d * L + local0)
                        if count > 0:
                            _put_block_signal(ch, d, land_region, send_x_region, start,
                                              rank * SOURCE_ROWS + start - peer_start, count,
                                              expert_slot + rank * L + g, H, GROUP_PUT_ROWS)
                        else:
                            tpd.signal(ch, d, expert_slot + rank * L + g, 1)
                        if TIMELINE:
                            now = tpd.globaltimer().to(tl.int64)
                            for j in range(local0, tl.minimum(local0 + EXPERTS_PER_PUT, L)):
                                tl.store(timeline + d * L + j, now)
                    _put_handles(ch, d, rank, src_stage_region, send_src_region, L, T, HANDLE_WORDS)
                    tpd.signal(ch, d, dispatch_slot + rank, 1)
            if TIMELINE:  # when each peer's groups land, apart from when the compute programs get to them
                if pid == COMM_PROGRAMS - 1:
                    for step in range(1, W):
                        s = _receive_place(rank, step, W)
                        for g in range(0, GROUPS):
                            tpd.wait(ch, expert_slot + s * L + g, gemm_epoch)
                            now = tpd.globaltimer().to(tl.int64)
                            for j in range(g * EXPERTS_PER_PUT, tl.minimum(g * EXPERTS_PER_PUT + EXPERTS_PER_PUT, L)):
                                tl.store(timeline + 4 * W * L + s * L + j, now)
            # the counts, for recv_layout (program 0, below) and the handle words (our own experts' rows and
            # handle words are in recv_x and recv_src already: _moe_stage wrote them; the peers' rows reach recv_x
            # through the compute programs, from land_x)
            tpd.wait_peers(ch, rank, W, count_slot, epoch)
            # the peers' handle words into recv_src once each peer's dispatch flag says they are placed (the
            # GEMM needs none: the handle is for the caller and for combine), by the last communication
            # program after its own pushes: a peer's dispatch flag may come from any of its communication
            # programs, and those wait for nothing but counts, so no program waits on one that waits on it
            if pid == COMM_PROGRAMS - 1:
                tpd.wait_peers(ch, rank, W, dispatch_slot, epoch)
                _scatter_handles(count_ptr, src_stage_ptr, recv_src_ptr, rank, W, E, L, T, BLOCK_T)
        if pid == 0:  # recv_count and recv_layout, from the counts (this round's once the waits above passed)
            _store_receive_layout(count_ptr, recv_count_ptr, layout_ptr, rank, W, E, L, LP, WP)
    else:
        cp = pid - COMM_PROGRAMS
        progs = tl.num_programs(0) - COMM_PROGRAMS
        col_blocks = tl.cdiv(N, BLOCK_N)
        offs_m = tl.arange(0, BLOCK_M)
        item = 0  # running number of the (row block, column block) tiles, dealt round-robin to the programs
        # Before any peer's count: the split experts' full row blocks of our own rows. They lead each expert's
        # packed rows (the receive order puts our own first), so our own counts alone place them, and the GEMM
        # runs while the counts fly (MoELayout.gemm_row_blocks' step -1)
        for local in range(0, SPLIT_EXPERTS):
            early = tl.load(count_ptr + rank * E + rank * L + local) // BLOCK_M
            tiles = early * col_blocks
            j0 = (cp + progs - item % progs) % progs
            for jj in range(0, tiles - j0, progs):
                j = j0 + jj
                rows = (j % early) * BLOCK_M + offs_m
                if TIMELINE:
                    tl.atomic_min(timeline + 2 * W * L + rank * L + local, tpd.globaltimer().to(tl.int64))
                if COMPUTE:
                    _expert_tile(recv_x_ptr + tl.cast(local * (W * T) + rows, tl.int64) * H, rows,
                                 rows < BLOCK_M * early,
                                 w_ptr, y_ptr, local, (j // early) * BLOCK_N, W, T, H, N, BLOCK_M, BLOCK_N, BLOCK_K)
                if TIMELINE:
                    tl.atomic_max(timeline + 3 * W * L + rank * L + local, tpd.globaltimer().to(tl.int64))
            item += tiles
        if COMMUNICATE:  # every source's counts: where each source's rows sit in each expert's packed rows
            tpd.wait_peers(ch, rank, W, count_slot, epoch)
        counts = tl.load(count_ptr + ss[None, :] * E + rank * L + ls[:, None], mask=inside, other=0)  # [LP, WP]
        # the step at which each source's rows are taken: our own first, then rank - 1 (whose first peer we
        # are), rank - 2, ... as each source sends to its peers in ring order; the receive rows follow it
        order = _receive_place(rank, ss, W)
        offsets = _receive_offsets(counts, order)  # [LP, WP]: each source's first row in each expert's rows
        # the (local expert, source) flags this program has waited for (our own rows need no wait)
        waited = (ss[None, :] == rank) | (ss[None, :] >= W) | (ls[:, None] >= L)  # [LP, WP]
        offs_k = tl.arange(0, BLOCK_K)
        for step in range(0, W):
            src = _receive_place(rank, step, W)
            for local in range(0, L):
                c = tl.sum(tl.where(ls[:, None] == local, counts, 0), axis=0)  # [WP] rows from each source
                off = tl.sum(tl.where(ls[:, None] == local, offsets, 0), axis=0)  # [WP]
                below = tl.sum(tl.where(ls[:, None] < local, counts, 0), axis=0)  # [WP] each source's lower experts'
                n = tl.sum(c, axis=0)
                c_src = tl.sum(tl.where(ss == src, c, 0), axis=0)
                off_src = tl.sum(tl.where(ss == src, off, 0), axis=0)
                if c_src > 0:
                    # an expert past SPLIT_EXPERTS: all its row blocks at its latest source's step (its weights
                    # read once: at large N the GEMM is bound by the weights' reads). One below it: the row blocks
                    # over src's rows, the first and the last (which may hold other sources' rows too) at the
                    # step of the latest of them, so own rows start at once (MoELayout.gemm_row_blocks models
                    # this deal: change both together)
                    if local >= SPLIT_EXPERTS:
                        lo = 0
                        hi = tl.where(_last_source(c, off, 0, n, order) == step, tl.cdiv(n, BLOCK_M), 0)
                    else:
                        first = off_src // BLOCK_M
                        last = (off_src + c_src - 1) // BLOCK_M
                        lo = first + (_last_source(c, off, first * BLOCK_M, first * BLOCK_M + BLOCK_M, order) != step)
                        hi = last + 1 - (_last_source(c, off, last * BLOCK_M, last * BLOCK_M + BLOCK_M, order) != step)
                        if src == rank:  # our own full blocks went before the counts
                            lo = tl.maximum(lo, c_src // BLOCK_M)
                    row_blocks = tl.maximum(hi - lo, 1)
                    tiles = tl.maximum(hi - lo, 0) * col_blocks
                    c_own = tl.sum(tl.where(ss == rank, c, 0), axis=0)
                    off_own = tl.sum(tl.where(ss == rank, off, 0), axis=0)
                    # this program's tiles of the group: j = j0, j0 + progs, ... (j0 rotates with item, so the
                    # groups' odd tiles fall on every program in turn). The loop starts at 0: Triton 3.6 drops a
                    # loop-carried value that only an inner loop's lower bound reads (the deal then never rotated,
                    # and the first (tiles % progs) programs took one tile more in every group)
                    j0 = (cp + progs - item % progs) % progs
                    for jj in range(0, tiles - j0, progs):
                        j = j0 + jj  # row block first: the programs running at once share a column block of the
                        r0 = (lo + j % row_blocks) * BLOCK_M  # weights, read from HBM once and then from L2
                        col0 = (j // row_blocks) * BLOCK_N
                        if TIMELINE:
                            tl.atomic_min(timeline + 2 * W * L + src * L + local, tpd.globaltimer().to(tl.int64))
                        if COMMUNICATE:  # the group flag of each source with rows in the tile, once per program
                            touch = (c > 0) & (off < r0 + BLOCK_M) & (off + c > r0)
                            had = tl.sum(tl.where(ls[:, None] == local, waited.to(tl.int32), 0), axis=0)  # [WP]
                            need = touch & (had == 0)
                            for s in range(0, W):
                                if tl.sum(tl.where(ss == s, need.to(tl.int32), 0), axis=0) > 0:
                                    tpd.wait(ch, expert_slot + s * L + local // EXPERTS_PER_PUT, gemm_epoch)
                                    if TIMELINE:
                                        tl.atomic_min(timeline + W * L + s * L + local,
                                                      tpd.globaltimer().to(tl.int64))
                            waited = waited | ((ls[:, None] == local) & touch[None, :])
                        rows = r0 + offs_m
                        valid = rows < n
                        mine = valid & (rows >= off_own) & (rows < off_own + c_own)
                        received = recv_x_ptr + tl.cast(local * (W * T) + rows, tl.int64) * H
                        if COMMUNICATE:
                            # a peer's row from its land_x slice (where its group put landed: its rows for our
                            # lower experts first); the row block's tiles also store it into recv_x, where dispatch
                            # would have put it, each a share of its columns (below)
                            at_source = (c > 0)[None, :] & (off[None, :] <= rows[:, None]) \
                                & (rows[:, None] < (off + c)[None, :])  # [BLOCK_M, WP]: the row's source
                            row_source = tl.sum(tl.where(at_source, ss[None, :], 0), axis=1)
                            staged = tl.sum(tl.where(at_source, (below - off)[None, :], 0), axis=1) + rows
                            a_row = land_ptr + tl.cast(row_source * SOURCE_ROWS + staged, tl.int64) * H
                            copy = valid & (mine == 0)
                        else:  # a rerun: the latest round's rows, in recv_x
                            a_row = received
                        # our own rows where _moe_stage, an earlier kernel, wrote them: their receive rows in recv_x
                        a_row = tl.where(mine, received, a_row)
                        if COMMUNICATE:
                            # the peers' rows into recv_x, column block b's tile taking columns [b * share, ...) of
                            # them: spread so, no program runs behind the others (the first column block's tiles
                            # took the whole copy, and the programs holding them fell out of step with the rest: the
                            # programs share a column block of the weights through L2 only while they run in step).
                            # A loop of its own: a store of the GEMM's A tile in its k-loop broke the tensor-core
                            # results on sm_90
                            share = tl.cdiv(tl.cdiv(H, BLOCK_K), col_blocks) * BLOCK_K
                            k_lo = (col0 // BLOCK_N) * share
                            for k0 in range(k_lo, tl.minimum(k_lo + share, H), BLOCK_K):
                                ks = k0 + offs_k
                                moved = copy[:, None] & (ks[None, :] < H)
                                tl.store(received[:, None] + ks[None, :],
                                         tl.load(a_row[:, None] + ks[None, :], mask=moved), mask=moved)
                        if COMPUTE:
                            _expert_tile(a_row, rows, valid, w_ptr, y_ptr, local, col0, W, T, H, N, BLOCK_M, BLOCK_N,
                                         BLOCK_K)
                        if TIMELINE:
                            tl.atomic_max(timeline + 3 * W * L + src * L + local, tpd.globaltimer().to(tl.int64))
                    item += tiles
    if TIMELINE:
        tl.store(timeline + 5 * W * L + pid, tpd.globaltimer().to(tl.int64))
    if COMMUNICATE:
        if last_to_finish(rounds_ptr):
            tl.store(rounds_ptr, epoch)
            tl.store(rounds_ptr + 2, gemm_epoch)


@triton.jit(do_not_specialize=["rank"])
def _moe_combine_send(ch, rank, y_ptr, count_ptr, send_y_ptr, comb_ptr, comb_region, send_y_region,
                      W: tl.constexpr, E: tl.constexpr, L: tl.constexpr, T: tl.constexpr, H: tl.constexpr,
                      EP: tl.constexpr, COPY_ROWS: tl.constexpr, BLOCK_H: tl.constexpr, PUT_ROWS: tl.constexpr):
    pid = tl.program_id(0)
    progs = tl.num_programs(0)
    es = tl.arange(0, EP)
    rs = tl.arange(0, COPY_ROWS)
    # block by block, (source s, local expert): y's rows of s for the expert, contiguous in recv_x's layout, to
    # s's combine_buf at s's stage rows for the expert (eoff from s's count row), where s staged them; copied
    # into the registered send_y first (puts read registered memory only); the pieces of block b from program
    # b % progs on
    for b in range(0, L * W):
        s = b // L
        e = rank * L + b - s * L
        count = tl.load(count_ptr + s * E + e)
        if count > 0:
            row = (e - rank * L) * (W * T) + _source_offset(count_ptr, s, e, W, E, L)
            home = tl.sum(tl.where(es < e, tl.load(count_ptr + s * E + es, mask=es < E, other=0), 0), axis=0)
            first = (pid + progs - b % progs) % progs
            if s == rank:
                for j in range(first * COPY_ROWS, count, progs * COPY_ROWS):
                    _copy_rows(y_ptr + tl.cast(row + j + rs, tl.int64) * H,
                               comb_ptr + tl.cast(home + j + rs, tl.int64) * H, j + rs < count, H, BLOCK_H)
            else:
                for j in range(first * PUT_ROWS, count, progs * PUT_ROWS):
                    n = tl.minimum(count - j, PUT_ROWS)
                    for i in range(0, n, COPY_ROWS):
                        at = tl.cast(row + j + i + rs, tl.int64) * H
                        _copy_rows(y_ptr + at, send_y_ptr + at, i + rs < n, H, BLOCK_H)
                    tpd.put(ch, s, comb_region, tl.cast(home + j, tl.int64) * (H * 2), send_y_region,
                            tl.cast(row + j, tl.int64) * (H * 2), tl.cast(n, tl.int64) * (H * 2))


@triton.jit(do_not_specialize=["rank", "tokens"])
def _moe_combine_reduce(ch, rounds_ptr, rank, tokens, idx32_ptr, row_ptr, weights_ptr, comb_ptr, out_ptr, combine_slot,
                        W: tl.constexpr, K: tl.constexpr, H: tl.constexpr, BLOCK_H: tl.constexpr):
    pid = tl.program_id(0)
    progs = tl.num_programs(0)
    epoch = tl.load(rounds_ptr)  # the round of the dispatch before, which advanced it
    if pid == 0:  # covers every put of _moe_combine_send (earlier in the ring: stream order)
        tpd.signal_peers(ch, rank, W, combine_slot, 1)
    tpd.wait_peers(ch, rank, W, combine_slot, epoch)
    hs = tl.arange(0, BLOCK_H)
    for t in range(pid, tokens, progs):
        for h0 in range(0, H, BLOCK_H):
            acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
            for k in tl.static_range(K):
                e = tl.load(idx32_ptr + t * K + k)
                w = tl.load(weights_ptr + t * K + k)
                row = tl.where(e >= 0, tl.load(row_ptr + t * K + k), 0)  # the entry's stage row (stale if none)
                v = tl.load(comb_ptr + tl.cast(row, tl.int64) * H + h0 + hs, mask=(h0 + hs < H) & (e >= 0),
                            other=0.0)
                acc += tl.where(e >= 0, w * v.to(tl.float32), 0.0)  # where, not a product: a dead slot holds NaN
            tl.store(out_ptr + tl.cast(t, tl.int64) * H + h0 + hs, acc.to(out_ptr.dtype.element_ty), mask=h0 + hs < H)
