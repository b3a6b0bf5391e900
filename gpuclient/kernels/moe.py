"""MoE dispatch and combine on transportd channels, shaped like DeepEP's low-latency API.

``dispatch(x, topk_idx, topk_weights)`` sends every token row to the ranks of its top-k experts and returns
the rows each local expert received, packed per expert in a fixed worst-case layout; ``combine(y, handle)``
sends the experts' outputs back and returns, at each token's home rank, the top-k weighted sum. The layout
math is ``gpuclient.kernels.moe_layout`` (numpy; the tests' model); docs/kernels.md has the whole contract.

Kernels, in stream order (each a small grid; all Triton, all preloaded by ``prepare``):

dispatch round e
  1. ``_moe_route``   normalise topk_idx (invalid and repeated experts become -1); per expert: where its block
                      starts in the stage (``eoff[e]``, the exclusive sum of this rank's counts over the lower
                      experts), its count, each entry's stage row ``eoff[e] + position`` (token order), the
                      handle words; then the block's rows copied from x into the registered ``send_x``, so
                      this rank's rows for one expert are contiguous there (expert-major, ``T*K`` rows at most;
                      with ``fp8`` quantized on the way: H e4m3 bytes and H/128 fp32 scales a row).
  2. ``_moe_dispatch`` every program sends: program 0 put_signals this rank's count row to every peer
                      (``count_slot + rank``); every program waits for every peer's counts, derives where each
                      block lands (the counts for the expert of the sources before this rank in the
                      receiver's order: its own rows first, then its ring predecessors') and puts each
                      remote expert's block in one put (a block past the largest put, ``put_rows`` rows, goes in
                      pieces), and the handle words of each peer's experts in one put into its ``src_stage``;
                      blocks for this rank are copied. Then the last program to finish its pushes sends one
                      SIGNAL per peer (``dispatch_slot + rank``: it covers every earlier put of this channel to
                      the peer), waits for every peer's, writes the per-expert receive counts and scatters
                      each peer's staged handle words into ``recv_src``.
combine round e
  3. ``_moe_combine_send``   each (local expert, source) block of y, contiguous in recv_x's layout, as one put to
                             the source's ``combine_buf`` at the source's stage rows for the expert (``eoff``
                             from the source's count row, which every rank holds; copied into the registered
                             ``send_y`` first: puts read registered memory only).
  4. ``_moe_combine_reduce`` one SIGNAL per peer (``combine_slot + rank``), a wait for every peer's, then the
                             weighted sum in fp32 per token, entry (t, k) read from its stage row.

So a dispatch pushes each peer its count row, one put per expert with rows there, one of the handle words
and one SIGNAL, and a combine one put per (expert, source) block and one SIGNAL, whatever the number of rows.

On efa a SIGNAL covers only the writes since the connection's previous signal: blocks a program pushes
before program 0's count put_signal are covered by the count flag instead, which the receiver waits for
before the dispatch flag, so every block is covered by a flag the receiver waited for.

dispatch_gemm round e (``gemm_n`` set): ``_moe_route``, then ``_moe_dispatch_gemm`` in place of 2, one
persistent launch split by role. Its first ``comm_programs`` programs push each peer its rows at once (no wait
for the peers' counts: our own counts place them in our slice of the peer's ``gemm_stage``), peer by peer in
ring order, each peer served by one program (``(step - 1) % comm_programs``), in *groups* of ``experts_per_put``
of the peer's experts: a group's rows are one block of ``send_x`` (staged expert-major), put into our slice of
the peer's ``gemm_stage`` [W, source_rows, H] (``MoELayout.gemm_puts``: at the rows we sent its lower experts),
the last piece a put_signal of the peer's *group flag* (``expert_slot + rank * L + group``); an empty group
SIGNALs its flag. Then the peer's handle words in one put and a SIGNAL of its dispatch flag
(``dispatch_slot + rank``); the last communication program then waits for every peer's dispatch flag and
scatters their handle words into ``recv_src`` (last, by one program: it waits on the peers' communication
programs, which wait for nothing but the counts). The compute programs wait for the count flags, then walk
each local expert's packed rows in (row block, column block) tiles, own rows first (read from their block in
``send_x``: no wait), then the sources in the order they send to this rank, and before a tile of expert l
wait for the group flag ``(s, l // experts_per_put)`` of every source s with rows in it: a tile starts once
its own expert's group is in, not the sources' whole transfers. A peer's rows are gathered from its
``gemm_stage`` slice (``gemm_stage_offsets``); each tile of a row block copies a share of their columns into
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

from dataclasses import dataclass
from typing import Any

import triton
import triton.language as tl

from gpuclient import triton as tpd
from gpuclient.kernels._launch import KernelLauncher, launch_stream
from gpuclient.kernels._rounds import last_to_finish, round_words, this_round
from gpuclient.kernels._tiles import check_launch, is_dot_block
from gpuclient.kernels.moe_layout import MoELayout, dispatch_row

# ---- kernels ---------------------------------------------------------------------------------------------------
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
def _quantize_rows(src, dst, rows, H: tl.constexpr, BLOCK_H: tl.constexpr):
    """Row i of bf16 ``src`` to fp8 row i of ``dst`` (bytes; each a block of row pointers) where ``rows[i]``: every
    block of 128 values scaled by 448 / its largest magnitude (e4m3's largest finite), the H fp8 bytes, then the
    H / 128 fp32 scales (value = fp8 * scale). BLOCK_H values (a multiple of 128) a step, as [rows, groups, 128]."""
    gs = tl.arange(0, BLOCK_H // 128)
    cs = tl.arange(0, 128)
    for h0 in range(0, H, BLOCK_H):
        col = h0 + gs[:, None] * 128 + cs[None, :]
        inside = rows[:, None, None] & (col[None, :, :] < H)
        v = tl.load(src[:, None, None] + col[None, :, :], mask=inside, other=0.0).to(tl.float32)
        amax = tl.maximum(tl.max(tl.abs(v), axis=2), 1e-4)  # an all-zero block still gets a finite scale
        q = (v * (448.0 / amax)[:, :, None]).to(tl.float8e4nv)
        tl.store(dst[:, None, None] + col[None, :, :], q.to(tl.uint8, bitcast=True), mask=inside)
        g = h0 // 128 + gs
        tl.store((dst[:, None] + H + g[None, :] * 4).to(tl.pointer_type(tl.float32)), amax / 448.0,
                 mask=rows[:, None] & (g[None, :] < H // 128))


@triton.jit(do_not_specialize=["rank", "tokens"])
def _moe_route(x_ptr, idx_ptr, send_x_ptr, idx32_ptr, row_ptr, count_ptr, eoff_ptr, send_src_ptr, rank, tokens,
               E: tl.constexpr, K: tl.constexpr, KP: tl.constexpr, T: tl.constexpr, H: tl.constexpr,
               BLOCK_T: tl.constexpr, COPY_ROWS: tl.constexpr, BLOCK_H: tl.constexpr, ROW: tl.constexpr,
               FP8: tl.constexpr = False):
    pid = tl.program_id(0)
    progs = tl.num_programs(0)
    ks = tl.arange(0, KP)
    rs = tl.arange(0, COPY_ROWS)
    # per token: the normalised expert list
    for t in range(pid, tokens, progs):
        e = tl.load(idx_ptr + t * K + ks, mask=ks < K, other=-1).to(tl.int32)
        repeat = tl.sum(((e[:, None] == e[None, :]) & (ks[None, :] < ks[:, None])).to(tl.int32), axis=1) > 0
        tl.store(idx32_ptr + t * K + ks, tl.where((e >= 0) & (e < E) & (repeat == 0), e, -1), mask=ks < K)
    # per expert: where its block starts in the stage (eoff: the valid entries naming a lower expert), the first
    # hit of each token (a repeat is not counted), each entry's stage row eoff + position (token order), the
    # handle words, the count; then the block's rows staged from x into the registered send_x
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
        tl.debug_barrier()  # the handle words, read back below by other threads of the program
        for j in range(0, carry, COPY_ROWS):
            inside = j + rs < carry
            word = tl.load(send_src_ptr + e * T + j + rs, mask=inside, other=0)
            if FP8:  # send_x holds bytes: each row its H fp8 values and H / 128 fp32 scales
                _quantize_rows(x_ptr + tl.cast(word // K - rank * T, tl.int64) * H,
                               send_x_ptr + tl.cast(start + j + rs, tl.int64) * ROW, inside, H, BLOCK_H)
            else:
                _copy_rows(x_ptr + tl.cast(word // K - rank * T, tl.int64) * H,
                           send_x_ptr + tl.cast(start + j + rs, tl.int64) * H, inside, H, BLOCK_H)


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
def _copy_own(send_x_ptr, send_src_ptr, recv_x_ptr, recv_src_ptr, e, start, row, count, first, step,
              T: tl.constexpr, H: tl.constexpr, COPY_ROWS: tl.constexpr, BLOCK_H: tl.constexpr):
    """This rank's block for its own expert e: stage rows ``start ...`` and their handle words to its receive
    rows ``row ...``, in pieces of COPY_ROWS rows, piece ``first``, ``first + step``, ... of them."""
    rs = tl.arange(0, COPY_ROWS)
    for j in range(first * COPY_ROWS, count, step * COPY_ROWS):
        inside = j + rs < count
        _copy_rows(send_x_ptr + tl.cast(start + j + rs, tl.int64) * H,
                   recv_x_ptr + tl.cast(row + j + rs, tl.int64) * H, inside, H, BLOCK_H)
        tl.store(recv_src_ptr + row + j + rs, tl.load(send_src_ptr + e * T + j + rs, mask=inside), mask=inside)


@triton.jit
def _put_block(ch, d, recv_region, send_x_region, start, row, count, first, step, ROW_BYTES: tl.constexpr,
               PUT_ROWS: tl.constexpr):
    """This rank's block for an expert of rank d: stage rows ``start ...`` to d's receive rows ``row ...`` (rows of
    ROW_BYTES bytes), a put of at most PUT_ROWS rows per piece, piece ``first``, ``first + step``, ... of them
    (one piece unless the block passes the largest put)."""
    for j in range(first * PUT_ROWS, count, step * PUT_ROWS):
        n = tl.minimum(count - j, PUT_ROWS)
        tpd.put(ch, d, recv_region, tl.cast(row + j, tl.int64) * ROW_BYTES, send_x_region,
                tl.cast(start + j, tl.int64) * ROW_BYTES, tl.cast(n, tl.int64) * ROW_BYTES)


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
def _moe_dispatch(ch, rounds_ptr, rank, count_ptr, eoff_ptr, send_x_ptr, send_src_ptr, recv_x_ptr, recv_src_ptr,
                  src_stage_ptr, recv_count_ptr, layout_ptr, count_region, recv_region, src_stage_region, send_x_region,
                  send_src_region, count_slot, dispatch_slot, W: tl.constexpr, E: tl.constexpr, L: tl.constexpr,
                  T: tl.constexpr, ROW: tl.constexpr, ROW_BYTES: tl.constexpr, COPY_ROWS: tl.constexpr,
                  BLOCK_H: tl.constexpr, PUT_ROWS: tl.constexpr, HANDLE_WORDS: tl.constexpr, LP: tl.constexpr,
                  WP: tl.constexpr, BLOCK_T: tl.constexpr, SEND: tl.constexpr = True, FINISH: tl.constexpr = True):
    """dispatch after ``_moe_route``, one launch: every program sends (``_send_blocks``), then the last to finish
    its pushes signals and receives (``_finish_dispatch``). One launch, not a send kernel and a finish kernel:
    ranks sharing a process and GPU launch on streams that may share a hardware work queue (under MPS a
    client has few), and a finish kernel queued behind its waiting send kernel would hold back a peer's send
    kernel queued behind it. ``SEND`` / ``FINISH`` False leave a phase out, for a model that runs the ranks in
    turn (the finish then one program, the last to finish: ``_rounds.last_to_finish``)."""
    epoch = this_round(rounds_ptr)
    if SEND:
        _send_blocks(ch, epoch, rank, count_ptr, eoff_ptr, send_x_ptr, send_src_ptr, recv_x_ptr, recv_src_ptr,
                     count_region, recv_region, src_stage_region, send_x_region, send_src_region, count_slot, W, E, L,
                     T, ROW, ROW_BYTES, COPY_ROWS, BLOCK_H, PUT_ROWS, HANDLE_WORDS)
    if FINISH:
        # every program's pushes are in the ring before the last one's SIGNALs, which cover them; then the round
        # is run
        if last_to_finish(rounds_ptr):
            _finish_dispatch(ch, epoch, rank, count_ptr, recv_count_ptr, layout_ptr, src_stage_ptr, recv_src_ptr,
                             dispatch_slot, W, E, L, T, LP, WP, BLOCK_T)
            tl.store(rounds_ptr, epoch)


@triton.jit
def _send_blocks(ch, epoch, rank, count_ptr, eoff_ptr, send_x_ptr, send_src_ptr, recv_x_ptr, recv_src_ptr, count_region,
                 recv_region, src_stage_region, send_x_region, send_src_region, count_slot, W: tl.constexpr,
                 E: tl.constexpr, L: tl.constexpr, T: tl.constexpr, ROW: tl.constexpr, ROW_BYTES: tl.constexpr,
                 COPY_ROWS: tl.constexpr, BLOCK_H: tl.constexpr, PUT_ROWS: tl.constexpr, HANDLE_WORDS: tl.constexpr):
    """The send phase, every program: the count row, the handle words and every remote expert's block."""
    pid = tl.program_id(0)
    progs = tl.num_programs(0)
    if pid == 0:  # our count row (written by _moe_route) to every peer's copy of the count matrix
        for peer in range(0, W):
            if peer != rank:
                tpd.put_signal(ch, peer, count_region, rank * E * 4, count_region, rank * E * 4, E * 4,
                               count_slot + rank, 1)
    for peer in range(0, W):  # every program: the counts of the sources before us at a receiver place our rows
        if peer != rank:
            tpd.wait(ch, count_slot + peer, epoch)
            if peer % progs == pid:  # the handle words of the peer's experts, one put (program peer % progs)
                _put_handles(ch, peer, rank, src_stage_region, send_src_region, L, T, HANDLE_WORDS)
    # expert by expert, its block (stage rows eoff[e] ..., staged by _moe_route): one put to the expert's rank,
    # or copied for this rank (with its handle words); the pieces of expert e from program e % progs on
    for e in range(0, E):
        count = tl.load(count_ptr + rank * E + e)
        if count > 0:
            d = e // L
            row = (e - d * L) * (W * T) + _source_offset(count_ptr, rank, e, W, E, L)
            start = tl.load(eoff_ptr + e)
            first = (pid + progs - e % progs) % progs
            # a staged / received row: ROW elements of ROW_BYTES bytes (moe_layout.dispatch_row)
            if d == rank:
                _copy_own(send_x_ptr, send_src_ptr, recv_x_ptr, recv_src_ptr, e, start, row, count, first, progs,
                          T, ROW, COPY_ROWS, BLOCK_H)
            else:
                _put_block(ch, d, recv_region, send_x_region, start, row, count, first, progs,
                           ROW_BYTES, PUT_ROWS)


@triton.jit
def _finish_dispatch(ch, epoch, rank, count_ptr, recv_count_ptr, layout_ptr, src_stage_ptr, recv_src_ptr, dispatch_slot,
                     W: tl.constexpr, E: tl.constexpr, L: tl.constexpr, T: tl.constexpr, LP: tl.constexpr,
                     WP: tl.constexpr, BLOCK_T: tl.constexpr):
    """The finish phase, one program: a SIGNAL per peer (after every row and handle word of the send phase in
    the ring: it covers them all), a wait for every peer's, then the receive counts and layout and the peers'
    handle words scattered into ``recv_src``."""
    for peer in range(0, W):
        if peer != rank:
            tpd.signal(ch, peer, dispatch_slot + rank, 1)
    for peer in range(0, W):
        if peer != rank:
            tpd.wait(ch, dispatch_slot + peer, epoch)
    _scatter_handles(count_ptr, src_stage_ptr, recv_src_ptr, rank, W, E, L, T, BLOCK_T)
    _store_receive_layout(count_ptr, recv_count_ptr, layout_ptr, rank, W, E, L, LP, WP)


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
    """``_put_block`` for one program, every piece in order: the last piece's put is a put_signal (ADD 1 to d's
    ``slot``), after every other put of the block in this program's order."""
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
def _moe_dispatch_gemm(ch, rounds_ptr, rank, count_ptr, eoff_ptr, send_x_ptr, send_src_ptr, recv_x_ptr,
                       recv_src_ptr, src_stage_ptr, gemm_stage_ptr, w_ptr, y_ptr, recv_count_ptr, layout_ptr,
                       count_region, gemm_stage_region, src_stage_region, send_x_region, send_src_region, count_slot,
                       dispatch_slot, expert_slot, timeline, W: tl.constexpr, E: tl.constexpr, L: tl.constexpr,
                       T: tl.constexpr, H: tl.constexpr, N: tl.constexpr, LP: tl.constexpr, WP: tl.constexpr,
                       COMM_PROGRAMS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_T: tl.constexpr, COPY_ROWS: tl.constexpr,
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
            # No wait for the peers' counts first: our rows land in our own slice of each peer's gemm_stage, where
            # our counts alone place them (the peers' finished reading it last round: our combine of that round
            # waited for theirs, which followed their GEMM). So the rows leave a fabric round trip sooner.
            # peer by peer in ring order (rank + 1 first, which takes our rows first), each peer served by one
            # program (step - 1) % COMM_PROGRAMS, the only one that pushes to it besides program 0's count
            # put_signal: group by group (EXPERTS_PER_PUT of its experts), the group's rows (stage rows from
            # eoff[first expert], contiguous: staged expert-major by _moe_route) as one put into our slice of
            # the peer's gemm_stage (piece by piece if it passes the largest put), the last a put_signal of the
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
                            _put_block_signal(ch, d, gemm_stage_region, send_x_region, start,
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
            for peer in range(0, W):  # the counts, for recv_layout (program 0, below) and the handle words
                if peer != rank:
                    tpd.wait(ch, count_slot + peer, epoch)
            # our own experts' blocks and handle words into recv_x and recv_src (the GEMM reads them from send_x:
            # this copy is for the caller and for combine, and waits for nothing; the peers' rows reach recv_x
            # through the compute programs, from gemm_stage)
            for local in range(0, L):
                e = rank * L + local
                count = tl.load(count_ptr + rank * E + e)
                if count > 0:
                    row = local * (W * T) + _source_offset(count_ptr, rank, e, W, E, L)
                    _copy_own(send_x_ptr, send_src_ptr, recv_x_ptr, recv_src_ptr, e, tl.load(eoff_ptr + e), row,
                              count, (pid + COMM_PROGRAMS - e % COMM_PROGRAMS) % COMM_PROGRAMS, COMM_PROGRAMS, T, H,
                              COPY_ROWS, BLOCK_H)
            # the peers' handle words into recv_src once each peer's dispatch flag says they are placed (the
            # GEMM needs none: the handle is for the caller and for combine), by the last communication
            # program after its own pushes: a peer's dispatch flag may come from any of its communication
            # programs, and those wait for nothing but counts, so no program waits on one that waits on it
            if pid == COMM_PROGRAMS - 1:
                for peer in range(0, W):
                    if peer != rank:
                        tpd.wait(ch, dispatch_slot + peer, epoch)
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
            own_start = tl.load(eoff_ptr + rank * L + local)
            j0 = (cp + progs - item % progs) % progs
            for jj in range(0, tiles - j0, progs):
                j = j0 + jj
                rows = (j % early) * BLOCK_M + offs_m
                if TIMELINE:
                    tl.atomic_min(timeline + 2 * W * L + rank * L + local, tpd.globaltimer().to(tl.int64))
                if COMPUTE:
                    _expert_tile(send_x_ptr + tl.cast(own_start + rows, tl.int64) * H, rows, rows < BLOCK_M * early,
                                 w_ptr, y_ptr, local, (j // early) * BLOCK_N, W, T, H, N, BLOCK_M, BLOCK_N, BLOCK_K)
                if TIMELINE:
                    tl.atomic_max(timeline + 3 * W * L + rank * L + local, tpd.globaltimer().to(tl.int64))
            item += tiles
        if COMMUNICATE:  # every source's counts: where each source's rows sit in each expert's packed rows
            for peer in range(0, W):
                if peer != rank:
                    tpd.wait(ch, count_slot + peer, epoch)
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
                    own_start = tl.load(eoff_ptr + rank * L + local)  # our block of the expert in send_x
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
                            # a peer's row from its gemm_stage slice (where its group put landed: its rows for our
                            # lower experts first); the row block's tiles also store it into recv_x, where dispatch
                            # would have put it, each a share of its columns (below)
                            at_source = (c > 0)[None, :] & (off[None, :] <= rows[:, None]) \
                                & (rows[:, None] < (off + c)[None, :])  # [BLOCK_M, WP]: the row's source
                            row_source = tl.sum(tl.where(at_source, ss[None, :], 0), axis=1)
                            staged = tl.sum(tl.where(at_source, (below - off)[None, :], 0), axis=1) + rows
                            a_row = gemm_stage_ptr + tl.cast(row_source * SOURCE_ROWS + staged, tl.int64) * H
                            copy = valid & (mine == 0)
                        else:  # a rerun: the latest round's rows, in recv_x
                            a_row = received
                        # our own rows straight from their block in send_x (staged by _moe_route, an earlier
                        # kernel)
                        a_row = tl.where(mine, send_x_ptr + tl.cast(own_start + rows - off_own, tl.int64) * H, a_row)
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
        for peer in range(0, W):
            if peer != rank:
                tpd.signal(ch, peer, combine_slot + rank, 1)
    for peer in range(0, W):
        if peer != rank:
            tpd.wait(ch, combine_slot + peer, epoch)
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


# ---- host side ----------------------------------------------------------------------------------------------------
def _pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


#: ``dispatch_gemm``'s default tiles, by the rows a local expert gets under even routing (``max_tokens * topk *
#: world / num_experts``), tuned on the H200 (docs/performance-log.md, "MoE's expert GEMM with more rows an expert"):
#: with a few rows an expert (128 tokens x top-8 over 64 experts: 32) narrow row blocks stream the weights; from
#: ``MANY_ROWS`` on, a dense GEMM's wide tiles (1.41x the narrow ones at 128 rows, 1.64x at 256).
GemmTiles = tuple[tuple[int, int, int], int, int]  # (block_m, block_n, block_k), warps, stages
FEW_ROWS_TILES: GemmTiles = ((64, 128, 64), 4, 6)
MANY_ROWS_TILES: GemmTiles = ((128, 256, 64), 8, 3)
MANY_ROWS = 128


def default_gemm_tiles(max_tokens: int, topk: int, world: int, num_experts: int) -> GemmTiles:
    """``(gemm_block, gemm_warps, gemm_stages)`` for the rows a local expert gets under even routing; counts that
    are not positive integers get the few-rows tiles (``MoELayout`` refuses them with the reason)."""
    counts = (max_tokens, topk, world, num_experts)
    if not all(isinstance(v, int) and v > 0 for v in counts):
        return FEW_ROWS_TILES
    return MANY_ROWS_TILES if max_tokens * topk * world / num_experts >= MANY_ROWS else FEW_ROWS_TILES


#: ``dispatch_gemm`` sends each destination its rows in this many puts (and flags) by default: a put of every
#: expert there would cost the soft fabric ~70 us each (docs/performance.md), one put of all of them would let
#: no tile start before the last row.
PUT_GROUPS = 4


def default_experts_per_put(num_experts: int, world: int) -> int:
    """``experts_per_put`` for ``PUT_GROUPS`` puts a destination; 1 for counts that are not positive integers
    (``MoELayout`` refuses them with the reason)."""
    counts = (num_experts, world)
    if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in counts):
        return 1
    return max(1, -(-(num_experts // world) // PUT_GROUPS))


def default_split_experts(layout: MoELayout) -> int:
    """``split_experts`` left out: the first put group's local experts. Their rows land first, and the compute of
    this rank's own rows of them runs while those fly; the other experts are read once each, whole. The fastest
    fused launch of the three measured at 1024 tokens a rank and N 16384 (docs/performance-log.md). A fabric whose
    first landing takes long against an expert's own rows wants more (docs/kernels.md: every expert at N 6144 over
    softverbs)."""
    return min(layout.experts_per_put, layout.local_experts)


def check_gemm_tiles(block: Any, num_warps: Any, num_stages: Any) -> GemmTiles:
    """``dispatch_gemm``'s tiles, checked (ValueError naming the culprit) and returned as stored: ``block`` =
    (block_m, block_n, block_k), three powers of two >= 16 (``tl.dot``), and ``check_launch``'s terms."""
    block = tuple(block)
    if not is_dot_block(block):
        raise ValueError(f"gemm_block must be three powers of two >= 16 (tl.dot), got {block}")
    check_launch(num_warps, num_stages)
    return block, num_warps, num_stages


@dataclass
class MoEHandle:
    """What ``combine`` needs from a ``dispatch`` (valid until the op's next dispatch).

    ``recv_src`` [L, W*T] int32: for each received row, ``src * T * K + token * K + k`` (source rank, its
    token index, the top-k entry; -1 where no row landed); ``recv_count`` [L] and ``recv_layout`` [L, W, 2]
    (offset, count of each source's rows per local expert); ``topk_idx`` [tokens, K] int32, normalised
    (invalid and repeated experts -1) and ``topk_weights`` (the caller's tensor: keep it unchanged until
    combine).
    """

    tokens: int
    recv_src: Any
    recv_count: Any
    recv_layout: Any
    topk_idx: Any
    topk_weights: Any


class MoE:
    """Expert-parallel MoE dispatch and combine for one rank: build before ``session.exchange()``.

    Experts ``[rank * L, (rank + 1) * L)`` live on this rank (``L = num_experts / world``). Every buffer is
    allocated and registered here at its worst case, so a call registers and allocates nothing:
    ``recv_x`` [L, W*T, H] bf16 (a source sends an expert each token at most once), ``recv_src`` [L, W*T]
    int32, ``counts_all`` [W, E] int32 (every rank's per-expert counts), ``send_x`` [T*K, H] (this rank's
    rows staged expert-major, one contiguous block per expert) and ``send_src`` [E, T] (put sources),
    ``combine_buf`` [T*K, H] bf16 (the experts' outputs of this rank's tokens, in ``send_x``'s order) and
    ``send_y`` [L, W*T, H] (combine's put source). ``programs`` programs per kernel (default: SMs / share,
    at most 32): every rank sharing the GPU must have its grid resident at once (``share`` of them).

    ``fp8=True`` sends the rows as fp8 (e4m3) with one fp32 scale per 128 values (DeepEP's low-latency FP8
    dispatch: about half the bytes); ``hidden`` must be a multiple of 128, ``recv_x`` and ``send_x`` hold bytes
    ([.., H + H/32]: a row's H fp8 values, then its H/128 scales) and ``dispatch`` returns the pair
    ``(recv_x_fp8 [L, W*T, H] float8_e4m3fn, recv_scales [L, W*T, H/128] fp32)``, views of ``recv_x``, where a
    value is ``fp8 * scale``. ``combine`` is bf16 either way; ``dispatch_gemm`` is bf16 only.

    ``gemm_n`` (columns of each local expert's weight) builds ``dispatch_gemm``, the dispatch fused with the
    expert GEMM: its output ``y`` [L, W*T, gemm_n] (``gemm_dtype``: bf16 or fp32) is allocated here too. Its one
    kernel has ``gemm_programs`` programs (default: SMs / share), the first ``comm_programs`` of them moving
    rows, the rest computing ``gemm_block`` = (block_m, block_n, block_k) tiles with ``gemm_warps`` warps and
    ``gemm_stages`` pipeline stages; each left out comes from :func:`default_gemm_tiles` for the rows an expert
    gets under even routing. It sends a peer the rows of ``experts_per_put`` of its experts per put and flag
    (default :func:`default_experts_per_put`: four puts a peer) into ``gemm_stage`` [W, T*min(K, L), H] bf16,
    allocated and registered here too. Its GEMM takes the row blocks of the first ``split_experts`` local experts
    source by source, this rank's own rows first, so it starts before any peer's rows land, at the cost of
    reading such an expert's weights once per source step; every other expert's row blocks go at once, after
    all of its sources' rows are in, and read its weights once (default: the first put group's experts, the
    fastest fused launch measured at 1024 tokens a rank).
    """

    def __init__(self, session: Any, hidden: int, num_experts: int, max_tokens: int, topk: int, *,
                 slot_base: int = 0, share: int = 1, programs: int | None = None, num_warps: int = 4,
                 channel_capacity: int = 1024, gemm_n: int | None = None, gemm_dtype: Any = None,
                 gemm_block: tuple[int, int, int] | None = None, comm_programs: int = 2,
                 gemm_programs: int | None = None, gemm_warps: int | None = None, gemm_stages: int | None = None,
                 experts_per_put: int | None = None, split_experts: int | None = None, fp8: bool = False) -> None:
        if fp8 and (hidden % 128 or gemm_n is not None):
            raise ValueError(f"fp8 dispatch needs hidden a multiple of 128 (one scale per 128 values) and no gemm_n "
                             f"(dispatch_gemm is bf16), got hidden={hidden}, gemm_n={gemm_n}")
        # what the caller leaves out, from the tiles for the rows an expert gets
        block0, warps0, stages0 = default_gemm_tiles(max_tokens, topk, session.world, num_experts)
        gemm_block = block0 if gemm_block is None else gemm_block
        gemm_warps = warps0 if gemm_warps is None else gemm_warps
        gemm_stages = stages0 if gemm_stages is None else gemm_stages
        if gemm_n is not None:
            gemm_block, gemm_warps, gemm_stages = check_gemm_tiles(gemm_block, gemm_warps, gemm_stages)
        if experts_per_put is None:
            experts_per_put = default_experts_per_put(num_experts, session.world)
        # the shapes, refused here with the culprit named (before torch is needed)
        self.layout = lay = MoELayout(session.rank, session.world, num_experts, max_tokens, topk, hidden, slot_base,
                                      experts_per_put=experts_per_put)
        if split_experts is None:
            split_experts = default_split_experts(lay)
        if isinstance(split_experts, bool) or not isinstance(split_experts, int) \
                or not 0 <= split_experts <= lay.local_experts:
            raise ValueError(f"split_experts must be an integer in [0, {lay.local_experts}] (the local experts), "
                             f"got {split_experts!r}")
        import torch

        if share < 1 or (programs is not None and programs < 1):
            raise ValueError(f"share and programs must be >= 1, got share={share}, programs={programs}")
        if gemm_n is not None:
            if isinstance(gemm_n, bool) or not isinstance(gemm_n, int) or gemm_n < 1:
                raise ValueError(f"gemm_n must be an integer >= 1, got {gemm_n!r}")
            if comm_programs < 1 or (gemm_programs is not None and gemm_programs <= comm_programs):
                raise ValueError(f"comm_programs must be >= 1 and gemm_programs more than it, got comm_programs="
                                 f"{comm_programs}, gemm_programs={gemm_programs}")
            if gemm_dtype not in (None, torch.bfloat16, torch.float32):
                raise ValueError(f"gemm_dtype must be torch.bfloat16 or torch.float32, got {gemm_dtype}")
        self.session, self.rank, self.world = session, session.rank, session.world
        self.hidden, self.num_experts, self.max_tokens, self.topk = hidden, num_experts, max_tokens, topk
        self.local_experts, self.split_experts = lay.local_experts, split_experts
        self.device = session.device if session.device is not None and session.device >= 0 else 0
        self.share, self._programs, self.num_warps = share, programs, num_warps
        dev = f"cuda:{self.device}"
        W, E, L, T, K, H = self.world, num_experts, lay.local_experts, max_tokens, topk, hidden  # noqa: N806
        # registered in this order on every rank, so region ids agree across ranks (kernels name the peers')
        self.fp8 = fp8
        self.row, self.row_bytes = dispatch_row(H, fp8)  # a staged / received row: elements, bytes
        row_dtype = torch.uint8 if fp8 else torch.bfloat16
        self.counts_all = torch.zeros((W, E), dtype=torch.int32, device=dev)
        self.recv_x = torch.empty((L, lay.capacity, self.row), dtype=row_dtype, device=dev)
        self.recv_src = torch.full((L, lay.capacity), -1, dtype=torch.int32, device=dev)
        self.send_x = torch.empty((lay.stage_capacity, self.row), dtype=row_dtype, device=dev)
        self.send_src = torch.full((E, T), -1, dtype=torch.int32, device=dev)
        self.src_stage = torch.full((W, L, T), -1, dtype=torch.int32, device=dev)  # each source's handle words
        self.combine_buf = torch.empty((lay.stage_capacity, H), dtype=torch.bfloat16, device=dev)
        self.send_y = torch.empty((L, lay.capacity, H), dtype=torch.bfloat16, device=dev)
        # dispatch_gemm's landing rows: each source's puts of several experts at once (MoELayout.gemm_puts)
        self.gemm_stage = None if gemm_n is None else torch.empty((W, lay.source_rows, H), dtype=torch.bfloat16,
                                                                  device=dev)
        self.regions = {name: session.register(getattr(self, name)).id
                        for name in ("counts_all", "recv_x", "src_stage", "send_x", "send_src", "combine_buf",
                                     "send_y", "gemm_stage") if getattr(self, name) is not None}
        # this rank's per-round state (not registered), allocated once: a call allocates nothing
        self.idx32 = torch.full((T, K), -1, dtype=torch.int32, device=dev)
        self.stage_row = torch.full((T, K), -1, dtype=torch.int32, device=dev)  # each entry's row in send_x
        self.stage_off = torch.zeros(E, dtype=torch.int32, device=dev)  # each expert's block in send_x
        self.recv_count = torch.zeros(L, dtype=torch.int32, device=dev)
        self.recv_layout = torch.zeros((L, W, 2), dtype=torch.int32, device=dev)
        self.out = torch.empty((T, H), dtype=torch.bfloat16, device=dev)
        # the fused dispatch + expert GEMM (dispatch_gemm): its output, in recv_x's layout
        self.gemm_n, self.gemm_dtype = gemm_n, gemm_dtype or torch.bfloat16
        self.gemm_block, self.comm_programs, self._gemm_programs = tuple(gemm_block), comm_programs, gemm_programs
        self.gemm_warps, self.gemm_stages = gemm_warps, gemm_stages
        self.y = None if gemm_n is None else torch.empty((L, lay.capacity, gemm_n), dtype=self.gemm_dtype, device=dev)
        self._no_timeline = torch.zeros(1, dtype=torch.int64, device=dev)  # the argument of a launch without one
        # the rounds run, a launch's finished programs, and the dispatch_gemm rounds that communicated (_rounds)
        self._rounds = round_words(dev, 3)
        self.slots = lay.slots
        session.flag_slots(slot_base, self.slots, type(self).__name__)
        self.block_h = min(_pow2(H), 1024)
        self.block_t = min(_pow2(T), 1024)  # handle words per step of the scatter into recv_src
        self.copy_rows = max(1, 4096 // self.block_h)  # rows per tile of a block copy
        self.put_rows = lay.put_rows  # rows per put of a block: all of them unless they pass the largest put
        self.channel_capacity = channel_capacity
        self.rounds = 0  # the dispatches called (a graph replay runs one uncounted): the device keeps the rounds run
        self._pending: MoEHandle | None = None
        self._ch: Any = None
        self._launcher = KernelLauncher(self.device)

    # --- launch plumbing ------------------------------------------------------------------------------------------
    def prepare(self) -> None:
        """After the exchange, before the first call: open the channel, copy its handle to the GPU, and compile
        and load all five kernels (the route kernel for int32 and int64 ``topk_idx``). Ranks sharing one process
        and GPU must all prepare before any of them calls (``gpuclient.triton.preload``)."""
        import torch

        if self._ch is not None:
            return
        self.channel = self.session.channel(self.channel_capacity)
        self._handle = self.channel.device_handle(self.device)
        self._ch = tpd.channel_pointer(self._handle)
        sms = torch.cuda.get_device_properties(self.device).multi_processor_count
        self.programs = self._programs or max(1, min(32, sms // self.share))
        dev = self.recv_x.device
        weights = torch.zeros((self.max_tokens, self.topk), dtype=torch.float32, device=dev)
        for dtype in (torch.int32, torch.int64):
            idx = torch.full((self.max_tokens, self.topk), -1, dtype=dtype, device=dev)
            tpd.preload(_moe_route, *self._route_args(self.out, idx, 0), grid=(self.programs,),  # out: bf16 like x
                        **self._route_meta())
        tpd.preload(_moe_dispatch, *self._dispatch_args(), grid=(self.programs,), **self._dispatch_meta())
        tpd.preload(_moe_combine_send, *self._combine_send_args(self.send_y), grid=(self.programs,),
                    **self._combine_send_meta())
        tpd.preload(_moe_combine_reduce, *self._reduce_args(0, weights, self.out), grid=(self.programs,),
                    **self._reduce_meta())
        if self.gemm_n is not None:
            self.gemm_programs = self._gemm_programs or max(self.comm_programs + 1, sms // self.share)
            self.preload_gemm()
        torch.cuda.synchronize(self.device)

    def retile_gemm(self, block: tuple[int, int, int] | None = None, *, num_warps: int | None = None,
                    num_stages: int | None = None) -> None:
        """Change ``dispatch_gemm``'s GEMM tiles (None: keep), checked as the constructor checks them. Between
        rounds only; where ranks share a process, ``preload_gemm`` every variant they will run again before the
        next launch of any (the flags and the rows do not depend on the tiles)."""
        if self.gemm_n is None:
            raise RuntimeError("this MoE was built without gemm_n: dispatch_gemm has no tiles")
        self.gemm_block, self.gemm_warps, self.gemm_stages = check_gemm_tiles(
            self.gemm_block if block is None else block, self.gemm_warps if num_warps is None else num_warps,
            self.gemm_stages if num_stages is None else num_stages)

    def preload_gemm(self, communicate: bool = True, compute: bool = True, timeline: bool = False) -> Any:
        """Compile and load the ``dispatch_gemm`` kernel variant that ``communicate=``, ``compute=`` and (with a
        timeline or not) ``timeline=`` launch (``prepare`` loads the default one): ranks sharing a process must
        load every variant they will run before the first launch of any (the preload rule). Returns Triton's
        compiled kernel."""
        import torch

        if self.gemm_n is None:
            raise RuntimeError("this MoE was built without gemm_n: dispatch_gemm has no kernel")
        self.prepare()
        w = torch.empty(8, dtype=torch.bfloat16, device=self.recv_x.device)  # a stand-in: only dtype and alignment
        return tpd.preload(_moe_dispatch_gemm, *self._gemm_args(w, self.y, None), grid=(self.gemm_programs,),
                           **self._gemm_meta(communicate, compute, timeline))

    def gemm_timeline(self) -> Any:
        """A fresh int64 tensor for one ``dispatch_gemm`` launch's timeline (``timeline=``): what each event of the
        launch was, on the GPU's %globaltimer (``MoELayout.split_timeline`` reads it, ``timeline_words`` sizes it;
        docs/kernels.md). Made before the launch: a torch kernel between the ranks' launches could wait behind
        a spinning one."""
        import torch

        if self.gemm_n is None:
            raise RuntimeError("this MoE was built without gemm_n: dispatch_gemm has no timeline")
        self.prepare()
        start = self.layout.timeline_start(self.gemm_programs)
        return torch.from_numpy(start).to(self.recv_x.device)

    def _route_args(self, x: Any, idx: Any, tokens: int) -> tuple:
        return (x, idx, self.send_x, self.idx32, self.stage_row, self.counts_all, self.stage_off, self.send_src,
                self.rank, tokens)

    def _route_meta(self) -> dict[str, Any]:
        return {"E": self.num_experts, "K": self.topk, "KP": _pow2(self.topk), "T": self.max_tokens,
                "H": self.hidden, "BLOCK_T": min(_pow2(self.max_tokens), 256), "COPY_ROWS": self.copy_rows,
                "BLOCK_H": self.block_h, "ROW": self.row, "FP8": self.fp8, "num_warps": self.num_warps}

    def _dispatch_args(self) -> tuple:
        r = self.regions
        return (self._ch, self._rounds, self.rank, self.counts_all, self.stage_off, self.send_x,
                self.send_src, self.recv_x, self.recv_src, self.src_stage, self.recv_count, self.recv_layout,
                r["counts_all"], r["recv_x"], r["src_stage"], r["send_x"], r["send_src"], self.layout.count_slot,
                self.layout.dispatch_slot)

    def _dispatch_meta(self) -> dict[str, Any]:
        return {"W": self.world, "E": self.num_experts, "L": self.local_experts, "T": self.max_tokens,
                "ROW": self.row, "ROW_BYTES": self.row_bytes, "COPY_ROWS": self.copy_rows, "BLOCK_H": self.block_h,
                "PUT_ROWS": self.put_rows, "HANDLE_WORDS": self.layout.handle_words, "LP": _pow2(self.local_experts),
                "WP": _pow2(self.world), "BLOCK_T": self.block_t, "num_warps": self.num_warps}

    def _gemm_args(self, w: Any, y: Any, timeline: Any) -> tuple:
        r = self.regions
        return (self._ch, self._rounds, self.rank, self.counts_all, self.stage_off, self.send_x, self.send_src,
                self.recv_x, self.recv_src, self.src_stage, self.gemm_stage, w, y, self.recv_count, self.recv_layout,
                r["counts_all"], r["gemm_stage"], r["src_stage"], r["send_x"], r["send_src"], self.layout.count_slot,
                self.layout.dispatch_slot, self.layout.expert_slot,
                self._no_timeline if timeline is None else timeline)

    def _gemm_meta(self, communicate: bool = True, compute: bool = True, timeline: bool = False) -> dict[str, Any]:
        bm, bn, bk = self.gemm_block
        return {"W": self.world, "E": self.num_experts, "L": self.local_experts, "T": self.max_tokens,
                "H": self.hidden, "N": self.gemm_n, "LP": _pow2(self.local_experts), "WP": _pow2(self.world),
                "COMM_PROGRAMS": self.comm_programs, "BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk,
                "BLOCK_H": self.block_h, "BLOCK_T": self.block_t, "COPY_ROWS": self.copy_rows,
                "HANDLE_WORDS": self.layout.handle_words,
                "EXPERTS_PER_PUT": self.layout.experts_per_put, "GROUPS": self.layout.put_groups,
                "SOURCE_ROWS": self.layout.source_rows, "GROUP_PUT_ROWS": self.layout.group_put_rows,
                "COMMUNICATE": communicate, "COMPUTE": compute, "TIMELINE": timeline,
                "SPLIT_EXPERTS": self.split_experts,
                "num_warps": self.gemm_warps, "num_stages": self.gemm_stages}

    def _combine_send_args(self, y: Any) -> tuple:
        r = self.regions
        return (self._ch, self.rank, y, self.counts_all, self.send_y, self.combine_buf, r["combine_buf"], r["send_y"])

    def _combine_send_meta(self) -> dict[str, Any]:
        return {"W": self.world, "E": self.num_experts, "L": self.local_experts, "T": self.max_tokens,
                "H": self.hidden, "EP": _pow2(self.num_experts), "COPY_ROWS": self.copy_rows, "BLOCK_H": self.block_h,
                "PUT_ROWS": self.put_rows, "num_warps": self.num_warps}

    def _reduce_args(self, tokens: int, weights: Any, out: Any) -> tuple:
        return (self._ch, self._rounds, self.rank, tokens, self.idx32, self.stage_row, weights, self.combine_buf, out,
                self.layout.combine_slot)

    def _reduce_meta(self) -> dict[str, Any]:
        return {"W": self.world, "K": self.topk, "H": self.hidden, "BLOCK_H": self.block_h,
                "num_warps": self.num_warps}

    def _check(self, name: str, tensor: Any, shape: tuple[int, ...], dtypes: tuple) -> None:
        """Refuse what the kernels would misread or recompile for (no conversion here: a torch kernel launched
        between the ranks' launches could load a module behind a waiting kernel; an address off 16 bytes
        would make Triton compile, and load, another variant)."""
        if tuple(tensor.shape) != shape or tensor.dtype not in dtypes:
            want = " or ".join(str(d) for d in dtypes)
            raise ValueError(f"{name} must be {list(shape)} {want}, got {list(tensor.shape)} {tensor.dtype}")
        if not tensor.is_contiguous() or tensor.device != self.recv_x.device:
            raise ValueError(f"{name} must be contiguous on {self.recv_x.device}")
        if tensor.numel() and tensor.data_ptr() % 16:
            raise ValueError(f"{name} must start 16-byte aligned (Triton specializes on it)")

    # --- the API -----------------------------------------------------------------------------------------------------
    def dispatch(self, x: Any, topk_idx: Any, topk_weights: Any, *, stream: Any = None) -> tuple[Any, Any, MoEHandle]:
        """Send each token to its top-k experts; returns ``(recv_x, recv_count, handle)`` (with ``fp8``, ``recv_x``
        is the pair ``(fp8 values, scales)``: see the class).

        ``x`` [tokens, H] bf16 (tokens <= max_tokens), ``topk_idx`` [tokens, K] int32 or int64 (-1, or any
        index outside [0, E), is no expert; a repeated expert in a row counts once, at its first k),
        ``topk_weights`` [tokens, K] fp32. ``recv_x`` is the registered [L, W*T, H] buffer itself: expert l's
        first ``recv_count[l]`` rows are its tokens (source by source, each source's in token order; the
        rest is stale). It and the handle stay valid until this round's ``combine`` is launched; the
        expert computation must be ordered before it (same stream, or synchronised).
        """
        tokens = self._check_inputs(x, topk_idx, topk_weights)
        stream = launch_stream(stream, self.device, self._ch is not None)
        self.prepare()
        self.rounds += 1
        grid = (self.programs,)
        self._launcher(_moe_route, grid, stream, self._route_args(x, topk_idx, tokens), self._route_meta())
        self._launcher(_moe_dispatch, grid, stream, self._dispatch_args(), self._dispatch_meta())
        self._pending = MoEHandle(tokens, self.recv_src, self.recv_count, self.recv_layout,
                                  self.idx32[:tokens], topk_weights)
        return self.received(), self.recv_count, self._pending

    def received(self) -> Any:
        """The received rows: ``recv_x``, or with ``fp8`` the pair (fp8 values, fp32 scales), views of it."""
        import torch

        if not self.fp8:
            return self.recv_x
        H = self.hidden  # noqa: N806
        return self.recv_x[..., :H].view(torch.float8_e4m3fn), self.recv_x[..., H:].view(torch.float32)

    def _check_inputs(self, x: Any, topk_idx: Any, topk_weights: Any) -> int:
        import torch

        if self._pending is not None:
            raise RuntimeError("combine the previous dispatch first: its buffers are still in use")
        tokens = int(x.shape[0]) if x.dim() == 2 else -1
        if not 0 <= tokens <= self.max_tokens:
            raise ValueError(f"x must be [tokens <= {self.max_tokens}, {self.hidden}], got {list(x.shape)}")
        self._check("x", x, (tokens, self.hidden), (torch.bfloat16,))
        self._check("topk_idx", topk_idx, (tokens, self.topk), (torch.int32, torch.int64))
        self._check("topk_weights", topk_weights, (tokens, self.topk), (torch.float32,))
        return tokens

    def dispatch_gemm(self, x: Any, topk_idx: Any, topk_weights: Any, w: Any, *, out: Any = None,
                      stream: Any = None, communicate: bool = True, compute: bool = True,
                      timeline: Any = None) -> tuple[Any, Any, MoEHandle | None]:
        """``dispatch`` fused with each local expert's GEMM: returns ``(y, recv_count, handle)`` with
        ``y[l, :recv_count[l]] = recv_x[l, :recv_count[l]] @ w[l]`` (fp32 accumulation; ``gemm_dtype``).

        Arguments as ``dispatch``, plus ``w`` [L, H, gemm_n] bf16 (the local experts' weights, contiguous).
        ``y`` [L, W*T, gemm_n] is in ``recv_x``'s layout (the op's ``y`` buffer, or ``out``): expert l's first
        ``recv_count[l]`` rows are written, the rest is left as it was. ``recv_x``, ``recv_count`` and the handle
        are exactly ``dispatch``'s, so ``combine(y, handle)`` follows (it needs ``gemm_n == hidden`` and bf16).
        The GEMM starts on a tile as soon as the sources of its rows have arrived (docs/kernels.md).

        For timing: ``compute=False`` moves the rows and waits as usual but skips the GEMM (``y`` is not
        written); ``communicate=False`` sends and waits for nothing, counts no round and returns no handle: it
        runs the GEMM again over the latest round's rows and counts (``x``, ``topk_idx`` and ``topk_weights`` are
        not read and may be None). ``timeline``: a ``gemm_timeline()`` tensor, to record when this launch pushed
        each block, saw each source's rows arrive and computed each expert's tiles (a variant of its own). Each
        variant must be preloaded (``preload_gemm``) where ranks share a process.
        """
        import torch

        if self.gemm_n is None:
            raise RuntimeError("this MoE was built without gemm_n: dispatch_gemm has no kernel")
        L, H, N = self.local_experts, self.hidden, self.gemm_n  # noqa: N806
        tokens = self._check_inputs(x, topk_idx, topk_weights) if communicate else 0
        self._check("w", w, (L, H, N), (torch.bfloat16,))
        y = self.y if out is None else out
        self._check("out", y, tuple(self.y.shape), (self.gemm_dtype,))
        if timeline is not None:
            self.prepare()
            self._check("timeline", timeline, (self.layout.timeline_words(self.gemm_programs),), (torch.int64,))
        if not communicate and self.rounds == 0:
            raise RuntimeError("communicate=False reruns the GEMM of the latest round: dispatch one first")
        stream = launch_stream(stream, self.device, self._ch is not None)
        self.prepare()
        if communicate:  # compute=False too: its rows move and its flags rise like any fused round's
            self.rounds += 1
            self._launcher(_moe_route, (self.programs,), stream, self._route_args(x, topk_idx, tokens),
                           self._route_meta())
        self._launcher(_moe_dispatch_gemm, (self.gemm_programs,), stream,
                       self._gemm_args(w, y, timeline),
                       self._gemm_meta(communicate, compute, timeline is not None))
        if not communicate:
            return y, self.recv_count, None
        self._pending = MoEHandle(tokens, self.recv_src, self.recv_count, self.recv_layout,
                                  self.idx32[:tokens], topk_weights)
        return y, self.recv_count, self._pending

    def combine(self, y: Any, handle: MoEHandle, *, out: Any = None, stream: Any = None) -> Any:
        """Send the experts' outputs home and sum them; returns [tokens, H] bf16 (into ``out`` when given,
        else a view of the op's ``out`` buffer, valid until the next combine).

        ``y`` [L, W*T, H] bf16: the experts' outputs in ``recv_x``'s layout (may be ``recv_x`` itself; only the
        first ``recv_count[l]`` rows of each expert are read). ``handle``: this round's, from ``dispatch``.
        """
        import torch

        if handle is not self._pending:
            raise RuntimeError("combine takes the handle of the op's latest dispatch, once")
        self._check("y", y, (*self.recv_x.shape[:2], self.hidden), (torch.bfloat16,))
        if out is None:
            out = self.out[:handle.tokens]
        self._check("out", out, (handle.tokens, self.hidden), (torch.bfloat16,))
        stream = launch_stream(stream, self.device, self._ch is not None)
        grid = (self.programs,)
        self._launcher(_moe_combine_send, grid, stream, self._combine_send_args(y), self._combine_send_meta())
        self._launcher(_moe_combine_reduce, grid, stream,
                       self._reduce_args(handle.tokens, handle.topk_weights, out), self._reduce_meta())
        self._pending = None
        return out
