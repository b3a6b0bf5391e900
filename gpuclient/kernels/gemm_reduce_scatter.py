"""GEMM + ReduceScatter and GEMM + AllReduce, fused: ``sum over ranks of A_r @ B_r``, reduced while it is made.

Each rank r holds ``A_r`` (``m x k``, bf16) and ``B_r`` (``k x n``, bf16), ``k`` its slice of the contraction
(a row-parallel linear layer: the activations' and the weight's k-shards). The product's rows split into
``world`` equal segments of ``m_seg = m / world`` rows; segment j of the sum belongs to rank j.

One persistent Triton launch per rank. Its programs walk the partial product's tiles (``block_m x
block_n``, cut per segment, so no tile straddles two segments; within a segment ``group_m`` row blocks at a
time, column by column: ``_tiles.tile_at``) in steps: step s (0 .. world-2) is the
segment of rank ``(r + 1 + s) % world`` — at every step each rank feeds a different peer, so no receiver is
hit by every sender at once and the first chunks ship after the first row band — and the last step is the
rank's own segment.

* A peer's tile goes to the ``partial`` buffer (registered; the RDMA source) and counts as an arrival at
  every chunk its rows touch. Chunks are ``chunk_rows`` full-width rows of a segment, independent of the
  tile: a chunk is done when every tile touching it has arrived (``arrivals``: the row blocks it meets
  times the column blocks), and the program that completes it ships it with ``tile_done`` on a
  ``ChunkPlan.reduce_scatter`` plan (one plan tile per chunk, so the plan's own count ships at once) into
  the owner's ``staging`` buffer, at the slot of the sending rank.
* An own tile is computed, then ``wait_range`` waits for each peer's chunks over the tile's rows, and the
  peers' partials are added in fp32 to the registers' sum before one store into the output: the own
  segment's partial is never written to memory.

GemmAllReduce is the two-shot form: the reduced own segment goes to a registered ``result`` buffer
(``m x n``) and, chunk by chunk as above, to every peer's ``result`` (an in-place ``ChunkPlan.all_gather``
plan); before the launch ends every program waits for a share of the peers' chunks. Two-shot rather than
one-shot (every rank sends its whole partial to every peer and reduces all m rows): two-shot sends
``2 (world-1)/world`` of the product per rank against one-shot's ``world-1``, equal at two ranks and less
above, and it is the reduce-scatter kernel plus one plan, so both ops share one kernel.

Back-pressure between launches (flags are monotonic: launch e waits for ``e * value``, nothing is reset):

* staging: a receiver's last program to finish a launch signals every peer's ``release_slot + receiver``;
  launch e ships a chunk to rank j only once that flag reached ``e - 1`` (j has read launch e-1's partials).
  The launch does not wait for those signals to complete: they carry no source buffer, and waiting would add
  a round trip to the peer after the last tile (on a proxy channel, through both daemons).
* result (all-reduce): program 0 signals every peer's ``ag_release_slot + rank`` when a launch starts (the
  stream has finished with the last result); launch e ships its segment to j once j's flag reached ``e``.
* the sources: the last program to finish quiets the channel before it signals the releases, so when the
  launch ends every put has read ``partial`` (and ``result``'s own rows) and the next launch may overwrite them.

Compute: bf16 ``tl.dot`` with fp32 accumulation, like ``AllGatherGemm`` (``tma=True`` loads A and B through
tensor descriptors, as there; a descriptor spans the whole A, so a tile past a segment's last row reads the
next segment's rows, which it does not store; staging is read with plain loads either way); partials travel
as ``partial_dtype`` (bf16 by default: half the bytes of fp32, at bf16's rounding of each partial).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import triton
import triton.language as tl

from gpuclient import triton as tpd
from gpuclient.kernels._launch import KernelLauncher, launch_stream, output
from gpuclient.kernels._operands import operand
from gpuclient.kernels._rounds import last_to_finish, round_words, this_round
from gpuclient.kernels._tiles import (
    GEMM_BLOCK,
    GROUP_M,
    DescriptorScratch,
    check_group,
    check_tiles,
    gemm_operands,
    gemm_tile,
    is_dot_block,
    tile_at,
    tile_order,
)
from gpuclient.plan import U32_MAX, ChunkPlan

__all__ = ["GemmAllReduce", "GemmReduceScatter", "ReduceScatterLayout"]

_ELEMENT_BYTES = {"bfloat16": 2, "float32": 4}


@triton.jit
def _arrive(ch, plan, counters, first_chunk, row0, rows, m_seg, chunk_rows, col_blocks, gate_slot, gate_at, rank,
            world, timeline, BLOCK_M: tl.constexpr, BROADCAST: tl.constexpr, TIMELINE: tl.constexpr):
    """Count a finished tile (segment rows [row0, row0 + rows)) at every chunk it touches; the arrival that
    completes a chunk waits for the destinations' release (BROADCAST: every peer's ``gate_slot + peer``, else
    ``gate_slot``) to reach ``gate_at``, then ships the chunk (plan tile ``first_chunk + c``). TIMELINE: the
    chunk's completion and its shipping times at ``timeline[2 * (counter index)]`` and the next word."""
    tl.debug_barrier()  # every thread's stores of the tile before thread 0's count
    for c in range(row0 // chunk_rows, (row0 + rows - 1) // chunk_rows + 1):
        lo = c * chunk_rows
        hi = tl.minimum(lo + chunk_rows, m_seg)
        expected = ((hi - 1) // BLOCK_M - lo // BLOCK_M + 1) * col_blocks
        # acq_rel at GPU scope: the release carries this tile's stores, the completing arrival's acquire
        # orders its pushes after every tile's (tile_done's argument, one level up)
        old = tl.atomic_add(counters + first_chunk + c, 1, sem="acq_rel", scope="gpu")
        if (old + 1) % expected == 0:
            if TIMELINE:
                tl.store(timeline + 2 * (first_chunk + c), tpd.globaltimer().to(tl.int64))
            if BROADCAST:
                tpd.wait_peers(ch, rank, world, gate_slot, gate_at)
            else:
                tpd.wait(ch, gate_slot, gate_at)
            tpd.tile_done(ch, plan, first_chunk + c)
            if TIMELINE:
                tl.store(timeline + 2 * (first_chunk + c) + 1, tpd.globaltimer().to(tl.int64))


# no specialization on the rank (Triton would compile again for rank 0 vs 1, and a second compile's module load
# waits behind the peer's running kernel)
@triton.jit(do_not_specialize=["rank", "release_slot", "ag_release_slot"])
def _gemm_reduce_scatter(ch, rs_plan, ag_plan, rounds_ptr, a_ptr, b_ptr, partial_ptr, staging_ptr, out_ptr, arrive_ptr,
                         rank, world, m_seg, n, k, chunk_rows, chunks_per_segment, release_slot,
                         ag_release_slot, timeline, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr, PARTIAL_BYTES: tl.constexpr, COMMUNICATE: tl.constexpr,
                         COMPUTE: tl.constexpr, ALL_GATHER: tl.constexpr, TMA: tl.constexpr = False,
                         TIMELINE: tl.constexpr = False, GROUP_M: tl.constexpr = 1):
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    epoch = this_round(rounds_ptr)  # launch e waits for flag values of e (_rounds: the round in device memory)
    # TIMELINE (ReduceScatterLayout.timeline_words): %globaltimer at 4 events of every tile, then 2 of every
    # chunk (_arrive), then each program's end
    chunk_times = timeline + 4 * world * tl.cdiv(m_seg, BLOCK_M) * tl.cdiv(n, BLOCK_N)
    program_ends = chunk_times + 2 * (world + 1) * chunks_per_segment
    if COMPUTE:  # the whole A and B, once per program (A and B are local: no wait precedes their loads)
        a_in, b_in = gemm_operands(a_ptr, b_ptr, world * m_seg, n, k, BLOCK_M, BLOCK_N, BLOCK_K, TMA)
    row_blocks = tl.cdiv(m_seg, BLOCK_M)
    col_blocks = tl.cdiv(n, BLOCK_N)
    per_segment = row_blocks * col_blocks
    partial_row = n.to(tl.uint64) * PARTIAL_BYTES  # bytes of one row of partials (the plan's offsets)
    if ALL_GATHER:
        out_row0 = rank * m_seg  # the whole m x n result, our segment at our rows
        if COMMUNICATE:
            if pid == 0:  # the stream reached this launch: peers may overwrite our result's rows of theirs
                tpd.signal_peers(ch, rank, world, ag_release_slot, 1)
    else:
        out_row0 = 0  # our segment alone
    for t in range(pid, world * per_segment, programs):
        dest = (rank + 1 + t // per_segment) % world  # the peers' segments in ring order, our own last
        row_block, col_block = tile_at(t % per_segment, row_blocks, col_blocks, GROUP_M)
        row0 = row_block * BLOCK_M  # rows within the segment
        col0 = col_block * BLOCK_N
        rows = tl.minimum(BLOCK_M, m_seg - row0)
        offs_m = row0 + tl.arange(0, BLOCK_M)
        offs_n = col0 + tl.arange(0, BLOCK_N)
        if TIMELINE:
            tl.store(timeline + 4 * t, tpd.globaltimer().to(tl.int64))
        if COMPUTE:  # off: the same stores, shipments and waits with a zero partial (communication alone)
            acc = gemm_tile(a_in, b_in, dest * m_seg, row0, m_seg - row0, col0, n, k, BLOCK_M, BLOCK_N, BLOCK_K,
                            TMA)
        else:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if TIMELINE:
            tl.store(timeline + 4 * t + 1, tpd.globaltimer().to(tl.int64))
        mask = (offs_m[:, None] < m_seg) & (offs_n[None, :] < n)
        if dest != rank:
            p = partial_ptr + (dest * m_seg + offs_m).to(tl.int64)[:, None] * n + offs_n[None, :]
            tl.store(p, acc.to(partial_ptr.dtype.element_ty), mask=mask)
            if COMMUNICATE:
                _arrive(ch, rs_plan, arrive_ptr, dest * chunks_per_segment, row0, rows, m_seg, chunk_rows, col_blocks,
                        release_slot + dest, epoch - 1, rank, world, chunk_times, BLOCK_M, False, TIMELINE)
        else:
            if COMMUNICATE:
                # every peer's chunks over these rows first (a separate loop: no load of staging may be issued
                # before the last wait, whatever the pipeliner does with the loop below)
                for src in range(0, world):
                    if src != rank:
                        tpd.wait_range(ch, rs_plan, epoch, src, (src * m_seg + row0).to(tl.uint64) * partial_row,
                                       rows.to(tl.uint64) * partial_row)
                if TIMELINE:
                    tl.store(timeline + 4 * t + 2, tpd.globaltimer().to(tl.int64))
                for src in range(0, world):
                    if src != rank:
                        s = staging_ptr + (src * m_seg + offs_m).to(tl.int64)[:, None] * n + offs_n[None, :]
                        acc += tl.load(s, mask=mask, other=0.0).to(tl.float32)
            o = out_ptr + (out_row0 + offs_m).to(tl.int64)[:, None] * n + offs_n[None, :]
            tl.store(o, acc.to(out_ptr.dtype.element_ty), mask=mask)
            if ALL_GATHER:
                if COMMUNICATE:
                    ag_times = chunk_times + 2 * world * chunks_per_segment
                    _arrive(ch, ag_plan, arrive_ptr + world * chunks_per_segment, 0, row0, rows, m_seg, chunk_rows,
                            col_blocks, ag_release_slot, epoch, rank, world, ag_times, BLOCK_M, True, TIMELINE)
        if TIMELINE:
            tl.store(timeline + 4 * t + 3, tpd.globaltimer().to(tl.int64))
    if COMMUNICATE:
        if ALL_GATHER:
            # the peers' reduced rows must be in result when the launch ends: each program waits for a share
            for q in range(pid, world * chunks_per_segment, programs):
                src = q // chunks_per_segment
                if src != rank:
                    tpd.wait_chunk(ch, ag_plan, epoch, src, q % chunks_per_segment)
        # the last program to finish: every chunk was pushed before its count, so one quiet covers all of this
        # launch's puts (their sources may then be overwritten); every own tile has read its staging, so release
        # it to the peers, without waiting for those signals (no source); then the round is run
        if last_to_finish(rounds_ptr):
            tpd.quiet(ch)
            tpd.signal_peers(ch, rank, world, release_slot, 1)
            tl.store(rounds_ptr, epoch)
    if TIMELINE:
        tl.store(program_ends + pid, tpd.globaltimer().to(tl.int64))


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class ReduceScatterLayout:
    """Where everything of one rank's GemmReduceScatter / GemmAllReduce lives, checked: segments, tiles,
    chunks, the plans and the flag slots. Pure Python (no GPU, no torch): the ops build one first, so a bad
    shape fails before anything is allocated.

    ``m``: rows of the product (``world`` segments of ``m // world``); ``k``: this rank's slice of the
    contraction; ``partial_bytes`` / ``out_bytes``: the element size of partials on the wire and of the
    output (2: bf16, 4: fp32); ``group_m``: the tile order within a segment (``tile_order``). Flag slots
    from ``slot_base``: the reduce-scatter plan's, ``world`` release flags, and for ``all_gather`` the
    all-gather plan's and ``world`` more.
    """

    rank: int
    world: int
    m: int
    n: int
    k: int
    chunk_rows: int = 64
    block: tuple[int, int, int] = (128, 128, 64)
    partial_bytes: int = 2
    out_bytes: int = 4
    slot_base: int = 0
    all_gather: bool = False
    group_m: int = GROUP_M

    def __post_init__(self) -> None:
        check_group(self.group_m)
        for name in ("world", "m", "n", "k", "chunk_rows"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or not 0 <= self.rank < self.world:
            raise ValueError(f"rank must be in [0, {self.world}), got {self.rank!r}")
        if isinstance(self.slot_base, bool) or not isinstance(self.slot_base, int) or self.slot_base < 0:
            raise ValueError(f"slot_base must be an integer >= 0, got {self.slot_base!r}")
        if self.m % self.world:
            raise ValueError(f"m={self.m} rows do not split into {self.world} equal segments (one per rank): "
                             f"make m a multiple of world")
        if not is_dot_block(tuple(self.block)):
            raise ValueError(f"block (block_m, block_n, block_k) must be powers of two >= 16 (tl.dot), got "
                             f"{self.block!r}")
        for name in ("partial_bytes", "out_bytes"):
            if getattr(self, name) not in (2, 4):
                raise ValueError(f"{name} must be 2 (bf16) or 4 (fp32), got {getattr(self, name)!r}")
        for what, row in (("partials", self.n * self.partial_bytes), ("output", self.n * self.out_bytes)):
            if self.all_gather or what == "partials":
                if min(self.chunk_rows, self.m_seg) * row > U32_MAX:
                    raise ValueError(f"a chunk of {min(self.chunk_rows, self.m_seg)} rows of {row} bytes ({what}) "
                                     f"passes a put's 32-bit length: lower chunk_rows")

    # --- geometry -------------------------------------------------------------------------------------------------
    @property
    def m_seg(self) -> int:
        """Rows of one segment (rank j owns rows [j * m_seg, (j + 1) * m_seg) of the sum)."""
        return self.m // self.world

    @property
    def chunks_per_segment(self) -> int:
        return _cdiv(self.m_seg, self.chunk_rows)

    @property
    def row_blocks(self) -> int:
        """Tile rows per segment (tiles are cut per segment: the last of each may be short)."""
        return _cdiv(self.m_seg, self.block[0])

    @property
    def col_blocks(self) -> int:
        return _cdiv(self.n, self.block[1])

    @property
    def tiles(self) -> int:
        """Tiles of one launch on this rank (every segment's)."""
        return self.world * self.row_blocks * self.col_blocks

    def chunk_rows_of(self, chunk: int) -> tuple[int, int]:
        """Rows [lo, hi) of a segment that chunk ``chunk`` (0 .. chunks_per_segment-1) carries."""
        if not 0 <= chunk < self.chunks_per_segment:
            raise ValueError(f"chunk {chunk} is not in [0, {self.chunks_per_segment})")
        lo = chunk * self.chunk_rows
        return lo, min(lo + self.chunk_rows, self.m_seg)

    def arrivals(self, chunk: int) -> int:
        """Tiles whose rows touch segment chunk ``chunk``: the kernel ships the chunk at the last of them."""
        lo, hi = self.chunk_rows_of(chunk)
        bm = self.block[0]
        return ((hi - 1) // bm - lo // bm + 1) * self.col_blocks

    def tile_order(self) -> list[tuple[int, int, int]]:
        """``(segment step, row block, column block)`` of each tile index, in the kernel's order (step s is the
        segment of rank ``(rank + 1 + s) % world``; the last is the own one)."""
        within = tile_order(self.row_blocks, self.col_blocks, self.group_m)
        return [(step, r, c) for step in range(self.world) for r, c in within]

    def tile_chunks(self, row0: int, rows: int) -> range:
        """The segment chunks that a tile of rows [row0, row0 + rows) touches (the kernel's loop)."""
        return range(row0 // self.chunk_rows, (row0 + rows - 1) // self.chunk_rows + 1)

    def timeline_words(self, programs: int) -> int:
        """int64 words of a launch's timeline (``timeline=`` of a call): 4 per tile (``tiles``, in the kernel's
        order: ``tile_order``), 2 per chunk counter, 1 per program."""
        return 4 * self.tiles + 2 * (self.world + 1) * self.chunks_per_segment + programs

    def split_timeline(self, words: Any, programs: int) -> tuple[Any, Any, Any]:
        """A launch's timeline (``timeline_words(programs)`` int64 words, any array-like) as numpy arrays:
        ``tiles`` (tiles x 4: start, computed, waited (own tiles; else 0), end), ``chunks`` (world + 1 counter
        sets x chunks_per_segment x 2: completed, shipped; the reduce-scatter chunks of each segment, then the
        all-gather's; 0: this rank shipped no such chunk) and each program's end."""
        import numpy as np

        words = np.asarray(words, dtype=np.int64)
        if words.shape != (self.timeline_words(programs),):
            raise ValueError(f"a timeline of {programs} programs is {self.timeline_words(programs)} words, got "
                             f"shape {words.shape}")
        chunk0 = 4 * self.tiles
        end0 = chunk0 + 2 * (self.world + 1) * self.chunks_per_segment
        return (words[:chunk0].reshape(self.tiles, 4),
                words[chunk0:end0].reshape(self.world + 1, self.chunks_per_segment, 2), words[end0:])

    # --- bytes ----------------------------------------------------------------------------------------------------
    @property
    def segment_bytes(self) -> int:
        """One segment of partials (what a rank sends each peer per launch)."""
        return self.m_seg * self.n * self.partial_bytes

    @property
    def staging_bytes(self) -> int:
        """The receive buffer: one segment per source rank (the own slot stays unused: the plan's layout)."""
        return self.world * self.segment_bytes

    # --- flag slots -----------------------------------------------------------------------------------------------
    @property
    def incoming_chunks(self) -> int:
        """Chunks a rank receives per plan and launch (and flag slots each plan needs)."""
        return (self.world - 1) * self.chunks_per_segment

    @property
    def release_slot(self) -> int:
        """``release_slot + j``: rank j has read a launch's staging (on the sender's flags)."""
        return self.slot_base + self.incoming_chunks

    @property
    def ag_slot_base(self) -> int:
        return self.release_slot + self.world

    @property
    def ag_release_slot(self) -> int:
        """``ag_release_slot + j``: rank j's stream reached a launch (its result may be overwritten)."""
        return self.ag_slot_base + self.incoming_chunks

    @property
    def slots(self) -> int:
        """Flag slots the op uses from ``slot_base``."""
        return (self.ag_release_slot + self.world if self.all_gather else self.ag_slot_base) - self.slot_base

    # --- plans ----------------------------------------------------------------------------------------------------
    def plans(self, partial_region: int, staging_region: int,
              result_region: int | None = None) -> tuple[ChunkPlan, ChunkPlan | None]:
        """The reduce-scatter plan (partial -> each owner's staging) and, for ``all_gather``, the all-gather
        plan (our rows of result -> every peer's result, in place). Region ids are the same on every rank:
        every rank registers its buffers in the same order."""
        flag_count = self.slot_base + self.slots
        rs = ChunkPlan.reduce_scatter(self.rank, self.world, self.segment_bytes,
                                      tile_bytes=min(self.chunk_rows, self.m_seg) * self.n * self.partial_bytes,
                                      chunk_tiles=1, src_region=partial_region, dst_region=staging_region,
                                      slot_base=self.slot_base, flag_count=flag_count)
        # the kernel names chunk c of segment j as plan tile j * chunks_per_segment + c
        assert rs.chunk_count == self.world * self.chunks_per_segment == rs.tile_count, rs
        assert rs.slot_count == self.incoming_chunks, rs
        if not self.all_gather:
            return rs, None
        if result_region is None:
            raise ValueError("an all-gather layout needs the result buffer's region")
        out_segment = self.m_seg * self.n * self.out_bytes
        ag = ChunkPlan.all_gather(self.rank, self.world, out_segment,
                                  tile_bytes=min(self.chunk_rows, self.m_seg) * self.n * self.out_bytes,
                                  chunk_tiles=1, dst_region=result_region, slot_base=self.ag_slot_base,
                                  flag_count=flag_count)
        assert ag.chunk_count == self.chunks_per_segment == ag.tile_count, ag
        assert ag.slot_count == self.incoming_chunks, ag
        return rs, ag


class GemmReduceScatter:
    """``reduce_scatter(A_r @ B_r)`` for one rank: build before ``session.exchange()``, call after it.

    ``a`` is ``m x k`` bf16 (``k``: this rank's slice of the contraction), ``b`` is ``k x n`` bf16; the call
    returns this rank's segment of the sum over ranks, rows ``[rank * m/world, (rank+1) * m/world)``, as
    ``out_dtype`` (fp32 by default). Partials of the peers' segments travel as ``partial_dtype`` in chunks of
    ``chunk_rows`` rows. ``programs`` programs in all (default: this GPU's SMs divided by ``share``, the number
    of ranks that run on the GPU at once: every rank's programs must be resident together, since programs
    spin on the peers' chunks). Launch e waits for flag values e: nothing is reset between calls.
    ``block`` (block_m, block_n, block_k), ``num_warps`` and ``num_stages`` are the GEMM's tiles (``retile``
    changes them); ``tma=True`` loads A and B through tensor descriptors (needs ``n`` and ``k`` multiples of
    8) instead of pointers and masks, ``tma=None`` (the default) does so exactly when ``n`` and ``k`` allow it.
    ``group_m``: the tile order within a segment, that many row blocks at a time (1: row-major).
    """

    _ALL_GATHER = False

    def __init__(self, session: Any, m: int, n: int, k: int, *, chunk_rows: int = 64,
                 block: tuple[int, int, int] = GEMM_BLOCK, num_warps: int = 8, num_stages: int = 3,
                 slot_base: int = 0, share: int = 1, programs: int | None = None, out_dtype: Any = None,
                 partial_dtype: Any = None, channel_capacity: int = 256, tma: bool | None = None,
                 group_m: int = GROUP_M) -> None:
        import torch

        out_dtype = out_dtype or torch.float32
        partial_dtype = partial_dtype or torch.bfloat16
        sizes = {}
        for name, dtype in (("out_dtype", out_dtype), ("partial_dtype", partial_dtype)):
            key = str(dtype).removeprefix("torch.")
            if key not in _ELEMENT_BYTES:
                raise ValueError(f"{name} must be torch.bfloat16 or torch.float32, got {dtype}")
            sizes[name] = _ELEMENT_BYTES[key]
        if share < 1 or (programs is not None and programs < 1):
            raise ValueError(f"share and programs must be >= 1, got share={share}, programs={programs}")
        tiles = check_tiles(block, num_warps, num_stages, tma, n, k)
        self.layout = ReduceScatterLayout(session.rank, session.world, m, n, k, chunk_rows=chunk_rows,
                                          block=tuple(block), partial_bytes=sizes["partial_dtype"],
                                          out_bytes=sizes["out_dtype"], slot_base=slot_base,
                                          all_gather=self._ALL_GATHER, group_m=group_m)
        self.session, self.rank, self.world = session, session.rank, session.world
        self.m, self.n, self.k, self.m_seg = m, n, k, self.layout.m_seg
        self.device = session.device if session.device is not None and session.device >= 0 else 0
        self.block, self.num_warps, self.num_stages, self.tma = tiles
        self.share, self._programs = share, programs
        self.out_dtype, self.partial_dtype = out_dtype, partial_dtype
        dev = f"cuda:{self.device}"
        # registered in this order on every rank, so region ids agree across ranks (the plans name the peers')
        self.partial = torch.empty((m, n), dtype=partial_dtype, device=dev)
        self.staging = torch.empty((self.world * self.m_seg, n), dtype=partial_dtype, device=dev)
        partial_region = session.register(self.partial).id
        staging_region = session.register(self.staging).id
        result_region = None
        if self._ALL_GATHER:
            self.result = torch.empty((m, n), dtype=out_dtype, device=dev)
            result_region = session.register(self.result).id
        self.rs_plan, self.ag_plan = self.layout.plans(partial_region, staging_region, result_region)
        self.slots = self.layout.slots
        session.flag_slots(slot_base, self.slots, type(self).__name__)
        self.channel_capacity = channel_capacity
        self.launches = 0
        self._ch: Any = None
        self._scratch = DescriptorScratch(self.partial.device)
        self._launcher = KernelLauncher(self.device)

    def retile(self, block: tuple[int, int, int] | None = None, *, num_warps: int | None = None,
               num_stages: int | None = None, tma: bool | None = None, group_m: int | None = None) -> None:
        """Change the GEMM's tiles and order (None: keep), checked as the constructor checks them. Launches after it
        run the new variant: where ranks share a process, ``preload`` every variant they will run again
        before the next launch of any. ``block`` only before the first launch that communicates: a chunk's
        arrival count (never reset) is in tiles of the block it was counted with."""
        block = self.block if block is None else tuple(block)
        group_m = check_group(self.layout.group_m if group_m is None else group_m)
        tiles = check_tiles(block, self.num_warps if num_warps is None else num_warps,
                            self.num_stages if num_stages is None else num_stages,
                            self.tma if tma is None else tma, self.n, self.k)
        if block != self.block:
            if self.launches:
                raise ValueError(f"block cannot change after a launch that communicated ({self.launches} so far): "
                                 f"the chunks' arrival counts are in tiles of {self.block}")
        self.layout = replace(self.layout, block=block, group_m=group_m)
        self.block, self.num_warps, self.num_stages, self.tma = tiles

    def prepare(self) -> None:
        """After the exchange, before the first launch (``__call__`` does it if not yet done): open the
        channel, make the device copies of its handle and the plans, and compile and load the kernel. Ranks
        that share one process and GPU must all prepare before any launches: loading a kernel waits for the
        kernels running in the context (``gpuclient.triton.preload``)."""
        import torch

        if self._ch is not None:
            return
        self.channel = self.session.channel(self.channel_capacity)
        self._handle = self.channel.device_handle(self.device)
        self._ch = tpd.channel_pointer(self._handle)
        self._rs = tpd.plan_pointer(self.rs_plan, self.device)
        self._ag = tpd.plan_pointer(self.ag_plan, self.device) if self.ag_plan is not None else self._rs
        dev = self.partial.device
        # chunk arrivals (reduce-scatter's, then all-gather's): monotonic, never reset
        self._arrive = torch.zeros((self.world + 1) * self.layout.chunks_per_segment, dtype=torch.int32, device=dev)
        self._rounds = round_words(dev)  # the rounds run and the launch's finished programs (_rounds)
        # the timeline argument of a launch without one: int64 like a timeline's words, so a launch with one and
        # the preloaded variant specialize alike
        self._no_timeline = torch.zeros(1, dtype=torch.int64, device=dev)
        sms = torch.cuda.get_device_properties(self.device).multi_processor_count
        self.programs = self._programs or max(1, sms // self.share)
        # stand-ins for A, B and the output (8 elements each), to compile with: a compile specializes on a
        # pointer's dtype and 16-byte alignment, not on what it points at
        a, b = (torch.empty(8, dtype=torch.bfloat16, device=dev) for _ in range(2))
        out = torch.empty(8, dtype=self.out_dtype, device=dev)
        self._stand_ins = (a, b, out)
        self.preload()

    def preload(self, communicate: bool = True, compute: bool = True, timeline: bool = False) -> Any:
        """Compile and load the kernel variant that ``__call__(..., communicate=, compute=, timeline=)``
        launches (``prepare`` loads the default one): ranks in one process must load every variant they will
        run concurrently before the first launch of any. Returns Triton's compiled kernel."""
        self.prepare()
        a, b, out = self._stand_ins
        compiled = tpd.preload(_gemm_reduce_scatter, *self._args(a, b, out, None), grid=(self.programs,),
                               **self._meta(communicate, compute, timeline))
        self._scratch.reserve_for(compiled, self.programs)  # the descriptors' memory (tma), before any launch
        return compiled

    def _args(self, a: Any, b: Any, out: Any, timeline: Any) -> tuple:
        lay = self.layout
        return (self._ch, self._rs, self._ag, self._rounds, a, b, self.partial, self.staging, out, self._arrive,
                self.rank, self.world, self.m_seg, self.n, self.k, lay.chunk_rows, lay.chunks_per_segment,
                lay.release_slot, lay.ag_release_slot, self._no_timeline if timeline is None else timeline)

    def _meta(self, communicate: bool, compute: bool = True, timeline: bool = False) -> dict[str, Any]:
        bm, bn, bk = self.block
        return {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "PARTIAL_BYTES": self.layout.partial_bytes,
                "COMMUNICATE": communicate, "COMPUTE": compute, "ALL_GATHER": self._ALL_GATHER, "TMA": self.tma,
                "TIMELINE": timeline, "GROUP_M": self.layout.group_m, "num_warps": self.num_warps,
                "num_stages": self.num_stages}

    def timeline(self) -> Any:
        """A zeroed int64 tensor for one launch's timeline (``timeline=`` of a call; the layout's
        ``timeline_words`` says where each event is; 0: the event did not happen in that launch)."""
        import torch

        self.prepare()
        return torch.zeros(self.layout.timeline_words(self.programs), dtype=torch.int64, device=self.partial.device)

    def _launch(self, a: Any, b: Any, out: Any, communicate: bool, compute: bool, stream: Any,
                timeline: Any = None) -> None:
        """The launch on ``stream`` (the caller's ``launch_stream``, resolved before anything is counted)."""
        import torch

        a = operand("a", a, (self.m, self.k), (torch.bfloat16,), self.partial.device, stream)
        b = operand("b", b, (self.k, self.n), (torch.bfloat16,), self.partial.device, stream)
        self.prepare()
        if communicate:
            self.launches += 1
        if timeline is not None:
            timeline = operand("timeline", timeline, (self.layout.timeline_words(self.programs),), (torch.int64,),
                               self.partial.device, stream)
        args = self._args(a, b, out, timeline)
        meta = self._meta(communicate, compute, timeline is not None)
        self._scratch.launch(lambda: self._launcher(_gemm_reduce_scatter, (self.programs,), stream, args, meta))

    def __call__(self, a: Any, b: Any, out: Any = None, *, communicate: bool = True, compute: bool = True,
                 stream: Any = None, timeline: Any = None) -> Any:
        """Launch once on ``stream`` (torch's current one by default); returns this rank's segment of the sum
        (``m/world x n``; into ``out`` when given). ``communicate=False`` neither ships nor waits: ``out`` is
        then this rank's own partial of its segment (the compute alone, for timing). ``compute=False`` ships
        and waits on the same schedule with zero partials (the communication alone, for timing).
        ``timeline`` (from ``timeline()``): the launch also writes the %globaltimer of each tile's start,
        compute, waits and end, each chunk's completion and shipping, and each program's end into it. A
        variant other than the default must be ``preload``-ed first where ranks share a process."""
        stream = launch_stream(stream, self.device, self._ch is not None)
        if out is not None:
            out = operand("out", out, (self.m_seg, self.n), (self.out_dtype,), self.partial.device, stream)
        else:
            out = output((self.m_seg, self.n), self.out_dtype, self.partial.device, stream)
        self._launch(a, b, out, communicate, compute, stream, timeline)
        return out


class GemmAllReduce(GemmReduceScatter):
    """``all_reduce(A_r @ B_r)`` for one rank (two-shot: the reduce-scatter above, then an all-gather of the
    reduced segments, in one launch): build before ``session.exchange()``, call after it.

    The sum (``m x n``, ``out_dtype``) lands in ``result``, a buffer registered with the daemon (peers write
    their segments into it); a call returns ``result`` itself, valid until the op's next launch on the same
    stream (copy it to keep it). Arguments as for GemmReduceScatter.

    Two-shot, not one-shot: each rank sends ``2 (world-1)/world`` of the product instead of ``world-1`` (the
    same at two ranks, less above), and it is the reduce-scatter kernel plus an all-gather plan.
    """

    _ALL_GATHER = True

    def __call__(self, a: Any, b: Any, out: Any = None, *, communicate: bool = True, compute: bool = True,
                 stream: Any = None, timeline: Any = None) -> Any:
        """Launch once on ``stream``; returns ``result`` (``m x n``). ``out`` is refused: the peers write into
        the registered buffer. ``communicate=False``: this rank's own segment holds its partial, the rest is
        stale. ``compute=False`` and ``timeline``: as for GemmReduceScatter."""
        if out is not None:
            raise ValueError("GemmAllReduce writes into its registered result buffer (op.result); copy from it")
        stream = launch_stream(stream, self.device, self._ch is not None)
        self._launch(a, b, self.result, communicate, compute, stream, timeline)
        return self.result
