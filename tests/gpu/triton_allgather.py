"""An all-gather through a chunk plan from a Triton kernel (gpuclient.triton), the twin of plan_kernels.cu.

Producer programs copy tiles of the local shard into this rank's rows of the gathered buffer and call
``tile_done`` (the last tile of a chunk ships it to every peer); then consumer programs take row blocks that
align with neither tiles nor chunks, ``wait_range`` for the rows of each peer they read (a block that
straddles two chunks waits for both) and write the row sums. The rank's own rows are read from ``x``:
another program's stores to the gathered buffer are not ordered before this one's loads.

The grid is persistent (programs loop over tiles, then over row blocks) and small, so both ranks' kernels
are resident at once on one GPU: a consumer only ever waits for the other rank's producers.
"""

from __future__ import annotations

import triton
import triton.language as tl

import gpuclient.triton as tdt

__all__ = ["allgather_rowsum", "quiet_status"]


# no specialization on values (Triton would compile again for rank 1 or epoch 1), so one compile serves both
# ranks and every launch: a compile between the two ranks' launches would hold up the first one's waits
@triton.jit(do_not_specialize=["epoch", "rank", "world", "rows_local", "tile_count"])
def allgather_rowsum(ch, plan, epoch, x, gathered, row_sums, rank, world, rows_local, tile_count,
                     ROW_FLOATS: tl.constexpr, ROW_BLOCK: tl.constexpr, TILE_ROWS: tl.constexpr,
                     TILE_BLOCK: tl.constexpr, CONSUMER_ROWS: tl.constexpr):
    """``x``: this rank's ``rows_local`` x ``ROW_FLOATS`` shard; ``gathered``: every rank's rows, in rank order
    (the plan's region); ``row_sums``: one float per gathered row. Launch ``epoch`` counts from 1."""
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    cols = tl.arange(0, ROW_BLOCK)
    col_ok = cols < ROW_FLOATS
    # producers: tile t is rows [t * TILE_ROWS, +TILE_ROWS) of the shard (the last one may be short)
    for tile in range(pid, tile_count, programs):
        rows = tile * TILE_ROWS + tl.arange(0, TILE_BLOCK)
        ok = (tl.arange(0, TILE_BLOCK) < TILE_ROWS) & (rows < rows_local)
        mask = ok[:, None] & col_ok[None, :]
        v = tl.load(x + rows[:, None].to(tl.int64) * ROW_FLOATS + cols[None, :], mask=mask)
        out = (rank * rows_local + rows)[:, None].to(tl.int64) * ROW_FLOATS + cols[None, :]
        tl.store(gathered + out, v, mask=mask)
        tdt.tile_done(ch, plan, tile)
    # consumers: row blocks of the whole gathered buffer
    total = world * rows_local
    row_bytes = ROW_FLOATS * 4
    for r0 in range(pid * CONSUMER_ROWS, total, programs * CONSUMER_ROWS):
        r1 = tl.minimum(r0 + CONSUMER_ROWS, total)
        for src in range(r0 // rows_local, (r1 - 1) // rows_local + 1):
            if src != rank:
                a = tl.maximum(r0, src * rows_local)
                b = tl.minimum(r1, (src + 1) * rows_local)
                tdt.wait_range(ch, plan, epoch, src, a.to(tl.int64) * row_bytes, (b - a).to(tl.int64) * row_bytes)
        rows = r0 + tl.arange(0, CONSUMER_ROWS)
        live = rows < r1
        mine = (rows // rows_local) == rank
        own = (rows - rank * rows_local)[:, None].to(tl.int64) * ROW_FLOATS + cols[None, :]
        theirs = rows[:, None].to(tl.int64) * ROW_FLOATS + cols[None, :]
        v = tl.load(x + own, mask=(live & mine)[:, None] & col_ok[None, :], other=0.0)
        v += tl.load(gathered + theirs, mask=(live & ~mine)[:, None] & col_ok[None, :], other=0.0)
        tl.store(row_sums + rows, tl.sum(v, axis=1), mask=live)


@triton.jit
def quiet_status(ch, status):
    """After the fused kernel, on its stream: everything pushed has completed locally; report the error word."""
    tdt.quiet(ch)
    tl.store(status, tdt.status(ch))
