"""Ring Attention, forward: sequence-parallel attention with the KV blocks passed around the ring while the
attention on what has arrived is computed, in one persistent Triton launch per rank.

Rank r holds the r-th slice of the sequence: Q, K and V of ``seq_local`` positions (``[heads, seq_local,
head_dim]``, bf16, head_dim 64 or 128), and gets ``softmax(Q K^T * scale) V`` of its queries against the
keys and values of every rank (``[heads, seq_local, head_dim]``, fp32 or bf16). ``causal=True`` masks as
one causal sequence of ``world * seq_local`` positions, rank r's at ``[r * seq_local, (r+1) * seq_local)``.

Receive space: world-buffered. Every rank registers one ``kv`` buffer of ``world`` blocks; the block of
origin o (o's K and V) sits at block o on every rank, the layout ``ChunkPlan.ring`` describes. A block is
written once per launch and read until the launch ends, so no step's arrival can overwrite one being read,
and back-pressure is needed only between launches. Double buffering (two slots, reused every other step)
would cost 2 blocks instead of ``world``, but a rank could then forward into its neighbour's slot only
after the neighbour finished computing on it: the communication would wait on the compute, step by step,
and a slow rank would stall the ring. At the sizes ring attention is used for, ``world`` KV blocks are
small beside the activations (K and V of the whole sequence, per layer).

Block layout: ``[heads, seq_local, 2, head_dim]`` — a position's K row then its V row. A head's keys and
values are then one contiguous byte range of the block, so the compute waits once (``wait_range``) for
the chunks of one head, and chunks cut in byte order bring the heads' K and V in together, head 0 first.
The own block is written by the kernel itself (the communication programs interleave K and V from the
caller's tensors, chunk by chunk, shipping each chunk as soon as it is written): no torch kernel runs at
call time (the preload rule, docs/kernels.md), and the compute reads the own K and V straight from the
caller's tensors.

One launch, SM-specialized:

* The first ``comm_programs`` programs communicate. They wait until the right neighbour has finished
  reading the previous launch's blocks (its release flag), then, for step 1, write and ship the own block
  chunk by chunk, and for step s >= 2 (``world >= 3``) wait for each chunk of the block that arrived from
  the left at step s-1 (``wait_range`` over exactly that chunk) and ship it on at once — chunk by chunk, not
  block by block. Chunk j of step s is plan chunk ``(s-1) * chunks_per_block + j`` (the plan has one
  tile per chunk, so ``tile_done`` ships it); each program takes chunks j = pid, pid + comm_programs, ...
  Then ``quiet``, so every put has read its source before the launch ends.
* The other programs compute, step-major: step 0 is the own block, step s the block of origin
  ``(r - s) % world``, which arrives from the left at step s. A tile is ``block_m`` queries of one head;
  each program owns the tiles pid, pid + programs, ... and, for each step in turn, runs every one of its
  tiles over that step's block (flash-attention online softmax: running max and sum in fp32, exp2, an fp32
  accumulator; bf16 ``tl.dot`` for Q K^T and P V; ``TMA``: the whole key blocks through tensor descriptors
  over the caller's K and V, and over an arrived block's interleaved rows, with a row stride of two rows).
  Step-major rather than tile-major: with more tiles than programs, tile-major would finish the first wave
  of tiles over all steps (waiting for the whole ring) before starting the second, so only the first wave
  would overlap the communication. The running state of
  a tile (accumulator, max, sum) is kept between steps in fp32 scratch memory that only its program
  touches (a barrier at each step orders the program's own stores before its loads); the last step writes
  the normalized output instead. Before a tile reads a step's block it waits for the chunks of its head's
  range of that block — in a separate call before the pipelined key loop, so no load of the block can be
  issued before the wait (and, with TMA, a ``fence.proxy.async.global`` after it: the wait acquires the
  block through the generic proxy, the descriptor loads read it through the async one).

Memory ordering: a wait is thread 0 spinning with ``ld.acquire.sys`` on the flag, then a barrier; the block's
loads follow in program order (the NIC's bytes are placed before the flag rises: the daemon's rule). The own
block's stores are followed by ``tile_done``'s barrier and thread 0's system-scope release push.

Back-pressure between launches (flags are monotonic: launch e waits for ``e``, nothing is reset): every
program counts itself done at the end of a launch (communication programs after their quiet), and the last
one signals the left neighbour's ``release_slot`` — everything it wrote into this rank's blocks has been read
by the compute and by the forwarding puts. A launch ships nothing before its right neighbour's release for
the previous launch. The own block is rewritten by the next launch only after this launch's quiet.

Deadlock freedom, with every rank's grid resident (``share``/``programs``, as for the other ops): the
communication programs never wait on compute. Step 1's chunks wait only for the previous launch's release;
a chunk of step s waits for the left neighbour's chunk of step s-1 and for the same program's earlier
chunks (steps <= s), so induction on (step, position in the program's order) ships every chunk. The compute
waits only for chunks, and the release of launch e-1 needs only that launch to finish.

Why not more: there is no backward pass, the blocks are not balanced for causal masking (rank r computes
r+1 blocks, the later ranks more).
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
from gpuclient.kernels._tiles import DescriptorScratch, async_proxy_fence, check_launch
from gpuclient.plan import ChunkPlan

__all__ = ["RingAttention", "RingAttentionLayout"]

#: the compute tiles' default (block_m, block_n), by measurement: see RingAttention
ATTENTION_BLOCK = (128, 128)

_ELEMENT_BYTES = {"bfloat16": 2, "float32": 4}
_HEAD_DIMS = (64, 128)
_LOG2E = 1.4426950408889634
_I32_MAX = (1 << 31) - 1


@triton.jit
def _fold(q, acc, m_i, l_i, k, v, valid, qk_scale, MASKED: tl.constexpr):
    """One key block into a tile's online softmax state (MASKED: ``valid`` [1 or BLOCK_M, BLOCK_N] says
    which scores count). The scale is folded into the exponent's one multiply-add, and P V accumulates
    in place in the dot."""
    qk = tl.dot(q, tl.trans(k))
    if MASKED:
        qk = tl.where(valid, qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
    p = tl.math.exp2(qk * qk_scale - m_new[:, None])
    alpha = tl.math.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = tl.dot(p.to(tl.bfloat16), v, acc * alpha[:, None])
    return acc, m_new, l_i


@triton.jit
def _attend(q, acc, m_i, l_i, k_base, v_base, q0, q_pos, n_hi, seq, qk_scale, k_desc, v_desc, desc_row,
            STRIDE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, DIAGONAL: tl.constexpr,
            TMA: tl.constexpr):
    """Fold keys [0, n_hi) of one head (K row n at ``k_base + n * STRIDE``, V likewise; n_hi <= seq) into a
    tile's online softmax state; DIAGONAL masks key n > query q_pos (the causal diagonal block; q0 is the
    tile's first query). Whole key blocks that every query of the tile sees run without masks (TMA: loaded
    through ``k_desc`` / ``v_desc``, where this head's key n is row ``desc_row + n``); the rest (the
    diagonal, a last partial block) masked, through the pointers."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    n_full = n_hi // BLOCK_N * BLOCK_N
    if DIAGONAL:
        n_full = tl.minimum(n_full, (q0 + 1) // BLOCK_N * BLOCK_N)  # blocks wholly at or below the first query
    for n0 in range(0, n_full, BLOCK_N):
        if TMA:
            k = k_desc.load([desc_row + n0, 0])
            v = v_desc.load([desc_row + n0, 0])
        else:
            keys = n0 + offs_n
            k = tl.load(k_base + keys[:, None] * STRIDE + offs_d[None, :])
            v = tl.load(v_base + keys[:, None] * STRIDE + offs_d[None, :])
        acc, m_i, l_i = _fold(q, acc, m_i, l_i, k, v, None, qk_scale, False)
    for n0 in range(n_full, n_hi, BLOCK_N):
        keys = n0 + offs_n
        inside = keys < seq
        k = tl.load(k_base + keys[:, None] * STRIDE + offs_d[None, :], mask=inside[:, None], other=0.0)
        v = tl.load(v_base + keys[:, None] * STRIDE + offs_d[None, :], mask=inside[:, None], other=0.0)
        valid = inside[None, :]
        if DIAGONAL:
            valid = valid & (keys[None, :] <= q_pos[:, None])
        acc, m_i, l_i = _fold(q, acc, m_i, l_i, k, v, valid, qk_scale, True)
    return acc, m_i, l_i


@triton.jit
def _interleave(k_ptr, v_ptr, block, lo, hi, HEAD_DIM: tl.constexpr, COPY_BLOCK: tl.constexpr):
    """Elements [lo, hi) of a block ``[heads, seq, 2, head_dim]`` from k and v (``[heads, seq, head_dim]``)."""
    for e0 in range(lo, hi, COPY_BLOCK):
        idx = e0 + tl.arange(0, COPY_BLOCK)
        inside = idx < hi
        col = idx % (2 * HEAD_DIM)
        src = (idx // (2 * HEAD_DIM)) * HEAD_DIM + col % HEAD_DIM  # row h * seq + n of k and v
        kk = tl.load(k_ptr + src, mask=inside & (col < HEAD_DIM), other=0.0)
        vv = tl.load(v_ptr + src, mask=inside & (col >= HEAD_DIM), other=0.0)
        tl.store(block + idx, tl.where(col < HEAD_DIM, kk, vv), mask=inside)


# no specialization on the rank (Triton would compile again for rank 0 vs 1, and a second compile's module load
# waits behind the peer's running kernel)
@triton.jit(do_not_specialize=["rank", "release_slot"])
def _ring_attention(ch, plan, rounds_ptr, q_ptr, k_ptr, v_ptr, kv_ptr, out_ptr, acc_ptr, ml_ptr, rank, world,
                    heads, seq, chunk_elems, chunks_per_block, release_slot, qk_scale,
                    COMM_PROGRAMS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, COPY_BLOCK: tl.constexpr, CAUSAL: tl.constexpr,
                    COMMUNICATE: tl.constexpr, COMPUTE: tl.constexpr, TMA: tl.constexpr = False):
    pid = tl.program_id(0)
    epoch = this_round(rounds_ptr)  # launch e waits for flag values of e (_rounds: the round in device memory)
    left = (rank + world - 1) % world
    block_elems = heads * seq * (2 * HEAD_DIM)  # one origin's K and V, interleaved by row (< 2^31: the layout)
    block_bytes = tl.cast(block_elems, tl.uint64) * 2
    head_bytes = tl.cast(seq, tl.uint64) * (4 * HEAD_DIM)  # one head's K and V rows in a block
    if pid < COMM_PROGRAMS:
        if COMMUNICATE:
            chunk_bytes = tl.cast(chunk_elems, tl.uint64) * 2
            # the right neighbour reads our last launch's writes until it says so
            tpd.wait(ch, release_slot, epoch - 1)
            # step 1: our own block, interleaved from k and v chunk by chunk, each chunk shipped once written
            own = kv_ptr + tl.cast(rank, tl.int64) * block_elems
            for j in range(pid, chunks_per_block, COMM_PROGRAMS):
                lo = j * chunk_elems
                _interleave(k_ptr, v_ptr, own, lo, tl.minimum(lo + chunk_elems, block_elems), HEAD_DIM, COPY_BLOCK)
                tpd.tile_done(ch, plan, j)  # its barrier orders every thread's stores before the push
            # steps 2 .. world-1: pass on, chunk by chunk, the block that arrived from the left at step s-1
            for s in range(2, world):
                origin = (rank - s + 1 + world) % world
                for j in range(pid, chunks_per_block, COMM_PROGRAMS):
                    off = tl.cast(j, tl.uint64) * chunk_bytes
                    tpd.wait_range(ch, plan, epoch, left, tl.cast(origin, tl.uint64) * block_bytes + off,
                                   tl.minimum(chunk_bytes, block_bytes - off))
                    tpd.tile_done(ch, plan, (s - 1) * chunks_per_block + j)
            tpd.quiet(ch)
    else:
        cp = pid - COMM_PROGRAMS
        compute = tl.num_programs(0) - COMM_PROGRAMS
        q_blocks = tl.cdiv(seq, BLOCK_M)
        tiles = heads * q_blocks
        offs_m = tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, HEAD_DIM)
        k_desc = None
        v_desc = None
        # step 0: the own block, from the caller's k and v (COMPUTE off: nothing; the steps below wait alone)
        if COMPUTE:
            if TMA:  # [heads * seq, head_dim] rows: head h's key n is row h * seq + n
                k_desc = tl.make_tensor_descriptor(k_ptr, shape=[heads * seq, HEAD_DIM], strides=[HEAD_DIM, 1],
                                                   block_shape=[BLOCK_N, HEAD_DIM])
                v_desc = tl.make_tensor_descriptor(v_ptr, shape=[heads * seq, HEAD_DIM], strides=[HEAD_DIM, 1],
                                                   block_shape=[BLOCK_N, HEAD_DIM])
            for t in range(cp, tiles, compute):
                h = t // q_blocks
                row0 = (t % q_blocks) * BLOCK_M  # the tile's first query row
                rows = row0 + offs_m
                mine = (h * seq + rows)[:, None] * HEAD_DIM + offs_d[None, :]
                row_ok = (rows < seq)[:, None]
                q = tl.load(q_ptr + mine, mask=row_ok, other=0.0)
                acc = tl.zeros((BLOCK_M, HEAD_DIM), dtype=tl.float32)
                m_i = tl.full((BLOCK_M,), -1.0e30, dtype=tl.float32)  # finite: a fully masked row stays NaN-free
                l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
                n_hi = seq
                if CAUSAL:
                    n_hi = tl.minimum(seq, row0 + BLOCK_M)
                head = tl.cast(h * seq, tl.int64) * HEAD_DIM
                acc, m_i, l_i = _attend(q, acc, m_i, l_i, k_ptr + head, v_ptr + head, row0, rows, n_hi, seq,
                                        qk_scale, k_desc, v_desc, h * seq, HEAD_DIM, HEAD_DIM, BLOCK_N, CAUSAL, TMA)
                state = h * seq + rows
                if world > 1:
                    tl.store(acc_ptr + mine, acc, mask=row_ok)
                    tl.store(ml_ptr + state, m_i, mask=rows < seq)
                    tl.store(ml_ptr + heads * seq + state, l_i, mask=rows < seq)
                else:
                    tl.store(out_ptr + mine, (acc / l_i[:, None]).to(out_ptr.dtype.element_ty), mask=row_ok)
        # steps 1 .. world-1: the block of origin (rank - s) % world, as it arrives from the left
        for s in range(1, world):
            origin = (rank - s + world) % world
            tl.debug_barrier()  # this program's state stores of the step before, seen by all its threads
            n_hi = seq
            if CAUSAL:
                n_hi = seq * tl.cast(origin < rank, tl.int32)  # later origins are masked out entirely
            block = kv_ptr + tl.cast(origin, tl.int64) * block_elems
            if COMPUTE:
                if TMA:  # the block's K and V rows, interleaved: K of head h's key n is row h * seq + n of each
                    k_desc = tl.make_tensor_descriptor(block, shape=[heads * seq, HEAD_DIM],
                                                       strides=[2 * HEAD_DIM, 1], block_shape=[BLOCK_N, HEAD_DIM])
                    v_desc = tl.make_tensor_descriptor(block + HEAD_DIM, shape=[heads * seq, HEAD_DIM],
                                                       strides=[2 * HEAD_DIM, 1], block_shape=[BLOCK_N, HEAD_DIM])
            for t in range(cp, tiles, compute):
                h = t // q_blocks
                rows = (t % q_blocks) * BLOCK_M + offs_m
                mine = (h * seq + rows)[:, None] * HEAD_DIM + offs_d[None, :]
                row_ok = (rows < seq)[:, None]
                state = h * seq + rows
                if COMMUNICATE:
                    # the chunks of this head's K and V rows (an empty range when masked out), before the key
                    # loop: no load of the block may be issued ahead of the wait, whatever the pipeliner does
                    tpd.wait_range(ch, plan, epoch, left, tl.cast(origin, tl.uint64) * block_bytes +
                                   tl.cast(h, tl.uint64) * head_bytes, tl.cast(n_hi, tl.uint64) * (4 * HEAD_DIM))
                    if TMA:  # acquired through the generic proxy, read by descriptor loads through the async one
                        async_proxy_fence()
                if COMPUTE:
                    q = tl.load(q_ptr + mine, mask=row_ok, other=0.0)
                    acc = tl.load(acc_ptr + mine, mask=row_ok, other=0.0)
                    m_i = tl.load(ml_ptr + state, mask=rows < seq, other=-1.0e30)
                    l_i = tl.load(ml_ptr + heads * seq + state, mask=rows < seq, other=1.0)
                    k_head = block + tl.cast(h * seq, tl.int64) * (2 * HEAD_DIM)
                    acc, m_i, l_i = _attend(q, acc, m_i, l_i, k_head, k_head + HEAD_DIM, 0, rows, n_hi, seq,
                                            qk_scale, k_desc, v_desc, h * seq, 2 * HEAD_DIM, HEAD_DIM, BLOCK_N,
                                            False, TMA)
                    if s < world - 1:
                        tl.store(acc_ptr + mine, acc, mask=row_ok)
                        tl.store(ml_ptr + state, m_i, mask=rows < seq)
                        tl.store(ml_ptr + heads * seq + state, l_i, mask=rows < seq)
                    else:
                        tl.store(out_ptr + mine, (acc / l_i[:, None]).to(out_ptr.dtype.element_ty), mask=row_ok)
    if COMMUNICATE:
        # the last program to finish: every block this rank received was read by the compute and by the
        # forwarding puts (quieted before the count), so the left neighbour may write the next launch's; then
        # the round is run
        if last_to_finish(rounds_ptr):
            tpd.signal(ch, left, release_slot, 1)
            tl.store(rounds_ptr, epoch)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _positive(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


@dataclass(frozen=True)
class RingAttentionLayout:
    """Where everything of one rank's RingAttention lives, checked: the kv buffer's blocks, the chunks, the
    compute tiles, the ring plan and the flag slots. Pure Python (no GPU, no torch): the op builds one first,
    so a bad shape fails before anything is allocated.

    ``chunk_rows``: positions (of one head: a K row and a V row, ``4 * head_dim`` bytes) per chunk; chunks
    cut the block in byte order, so a chunk may straddle two heads. ``block``: (block_m, block_n), queries
    per tile and keys per step of the key loop. ``out_bytes``: 2 (bf16) or 4 (fp32). Flag slots from
    ``slot_base``: the plan's (one per incoming chunk), then the release flag.
    """

    rank: int
    world: int
    heads: int
    seq_local: int
    head_dim: int
    chunk_rows: int = 256
    block: tuple[int, int] = (64, 64)
    causal: bool = False
    out_bytes: int = 4
    slot_base: int = 0

    def __post_init__(self) -> None:
        for name in ("world", "heads", "seq_local", "chunk_rows"):
            _positive(name, getattr(self, name))
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or not 0 <= self.rank < self.world:
            raise ValueError(f"rank must be in [0, {self.world}), got {self.rank!r}")
        if self.head_dim not in _HEAD_DIMS or isinstance(self.head_dim, bool):
            raise ValueError(f"head_dim must be one of {_HEAD_DIMS}, got {self.head_dim!r}")
        if isinstance(self.slot_base, bool) or not isinstance(self.slot_base, int) or self.slot_base < 0:
            raise ValueError(f"slot_base must be an integer >= 0, got {self.slot_base!r}")
        if (len(self.block) != 2 or any(isinstance(b, bool) or not isinstance(b, int) or b < 16 or b > 256
                                        or b & (b - 1) for b in self.block)):
            raise ValueError(f"block (block_m, block_n) must be powers of two in [16, 256] (tl.dot), got "
                             f"{self.block!r}")
        if self.out_bytes not in (2, 4):
            raise ValueError(f"out_bytes must be 2 (bf16) or 4 (fp32), got {self.out_bytes!r}")
        if not isinstance(self.causal, bool):
            raise ValueError(f"causal must be a bool, got {self.causal!r}")
        # and so a block is under 2^32 bytes, and every chunk fits a put's 32-bit length
        if self.block_elems > _I32_MAX:
            raise ValueError(f"one rank's K and V ({self.block_elems} elements) pass 2^31 elements (the kernel's "
                             f"32-bit offsets within a block): lower heads or seq_local per rank")

    # --- geometry -------------------------------------------------------------------------------------------------
    @property
    def row_bytes(self) -> int:
        """One position of one head in a block: its K row and its V row, bf16."""
        return 4 * self.head_dim

    @property
    def head_bytes(self) -> int:
        """One head's K and V rows in a block (contiguous: the block is ``[heads, seq_local, 2, head_dim]``)."""
        return self.seq_local * self.row_bytes

    @property
    def block_elems(self) -> int:
        return self.heads * self.seq_local * 2 * self.head_dim

    @property
    def block_bytes(self) -> int:
        """One origin's K and V: what travels around the ring per step."""
        return 2 * self.block_elems

    @property
    def kv_bytes(self) -> int:
        """The registered receive buffer: one block per origin (world-buffered)."""
        return self.world * self.block_bytes

    @property
    def chunk_bytes(self) -> int:
        """One chunk (one put_signal); the last of a block may be short."""
        return min(self.chunk_rows, self.heads * self.seq_local) * self.row_bytes

    @property
    def chunk_elems(self) -> int:
        return self.chunk_bytes // 2

    @property
    def chunks_per_block(self) -> int:
        return _cdiv(self.block_bytes, self.chunk_bytes)

    @property
    def q_blocks(self) -> int:
        return _cdiv(self.seq_local, self.block[0])

    @property
    def tiles(self) -> int:
        """Compute tiles: ``block_m`` queries of one head (the last of a head may be short)."""
        return self.heads * self.q_blocks

    @property
    def left(self) -> int:
        """The rank every block arrives from."""
        return (self.rank - 1) % self.world

    @property
    def right(self) -> int:
        """The rank every block goes to."""
        return (self.rank + 1) % self.world

    def origin_at(self, step: int) -> int:
        """The origin of the block the compute reads at ``step`` (0: the own; s: arrived from the left at s)."""
        return (self.rank - step) % self.world

    def sent_at(self, step: int) -> int:
        """The origin of the block this rank ships at ``step`` (1 .. world-1): the one that arrived at s-1."""
        return (self.rank - step + 1) % self.world

    def chunk_span(self, origin: int, j: int) -> tuple[int, int]:
        """(byte offset in kv, bytes) of chunk ``j`` of origin ``origin``'s block (the comm programs' wait)."""
        if not 0 <= j < self.chunks_per_block:
            raise ValueError(f"chunk {j} is not in [0, {self.chunks_per_block})")
        off = j * self.chunk_bytes
        return origin * self.block_bytes + off, min(self.chunk_bytes, self.block_bytes - off)

    def plan_chunk(self, step: int, j: int) -> int:
        """The plan's chunk (and tile) that carries chunk ``j`` of the block shipped at ``step``."""
        return (step - 1) * self.chunks_per_block + j

    def head_span(self, origin: int, head: int, keys: int | None = None) -> tuple[int, int]:
        """(byte offset in kv, bytes) of the first ``keys`` (default all) K and V rows of ``head`` in origin's
        block: what a tile of that head waits for before reading the block."""
        keys = self.seq_local if keys is None else keys
        return origin * self.block_bytes + head * self.head_bytes, keys * self.row_bytes

    def keys_read(self, step: int) -> int:
        """Keys of each head a tile reads at ``step`` >= 1 (0 when the causal mask hides the whole block)."""
        if self.causal and self.origin_at(step) > self.rank:
            return 0
        return self.seq_local

    # --- flag slots -----------------------------------------------------------------------------------------------
    @property
    def incoming_chunks(self) -> int:
        """Chunks a rank receives per launch (and the plan's flag slots)."""
        return (self.world - 1) * self.chunks_per_block

    @property
    def release_slot(self) -> int:
        """On each rank's flags: the right neighbour has read a launch's blocks (raised once per launch)."""
        return self.slot_base + self.incoming_chunks

    @property
    def slots(self) -> int:
        """Flag slots the op uses from ``slot_base``."""
        return self.incoming_chunks + 1

    # --- the plan -------------------------------------------------------------------------------------------------
    def plan(self, kv_region: int) -> ChunkPlan:
        """The ring plan over the kv buffer (region ``kv_region``: the same id on every rank, as every rank
        registers its buffers in the same order), one tile per chunk so that ``tile_done`` ships at once."""
        plan = ChunkPlan.ring(self.rank, self.world, self.block_bytes, tile_bytes=self.chunk_bytes, chunk_tiles=1,
                              src_region=kv_region, slot_base=self.slot_base, flag_count=self.slot_base + self.slots,
                              region_bytes={kv_region: self.kv_bytes})
        # the kernel names chunk j of step s as plan tile (s - 1) * chunks_per_block + j
        assert plan.chunk_count == plan.tile_count == self.incoming_chunks, plan
        assert plan.slot_count == self.incoming_chunks, plan
        return plan


class RingAttention:
    """Ring attention, forward, for one rank: build before ``session.exchange()``, call after it.

    ``op(q, k, v)`` takes this rank's slice of the sequence (each ``[heads, seq_local, head_dim]``, bf16,
    contiguous) and returns ``softmax(q K^T * sm_scale) V`` against every rank's keys and values
    (``[heads, seq_local, head_dim]``, ``out_dtype``, fp32 by default). ``sm_scale`` defaults to
    ``head_dim ** -0.5``; ``causal`` masks as one sequence in rank order. K and V travel in chunks of
    ``chunk_rows`` positions; ``comm_programs`` programs forward, ``programs`` in all (default: this GPU's
    SMs divided by ``share``, the number of ranks that run on the GPU at once: every rank's programs must be
    resident together, since programs spin on the peers' chunks). Launch e waits for flag values e: nothing is
    reset between calls. ``block`` (block_m queries, block_n keys a step), ``num_warps`` and ``num_stages``
    are the compute tiles (``retile`` changes them). The defaults, 128 x 128 with 8 warps and 3 stages, by
    measurement on the H200 (head_dim 128): at 2 stages 1.8x faster than 64 x 64 with 4 warps, and the third
    stage 1.10x faster again (``fused_bench.py --tune``, 32 heads x 8192 a rank); a fourth does not fit 128 x
    128 tiles in shared memory. The key loop's unmasked whole blocks and the scale folded into the exponent
    took the compute at 32 heads x 4096 a rank, 48 programs, from 4.60 to 3.53 ms (``fused_bench.py``).
    ``tma`` (default True) loads the key loop's whole blocks through tensor descriptors (TMA), after an
    async-proxy fence behind the wait for an arrived block; the compute took 12 % less time than with pointer
    loads on the H200 (``fused_bench.py --ring-tma``, both backends and sizes). ``tma=False`` keeps the
    pointers.
    """

    def __init__(self, session: Any, heads: int, seq_local: int, head_dim: int, *, causal: bool = False,
                 sm_scale: float | None = None, chunk_rows: int = 256, block: tuple[int, int] = ATTENTION_BLOCK,
                 comm_programs: int = 1, num_warps: int = 8, num_stages: int = 3, slot_base: int = 0,
                 share: int = 1, programs: int | None = None, out_dtype: Any = None,
                 channel_capacity: int = 256, tma: bool = True) -> None:
        import torch

        if not isinstance(tma, bool):
            raise ValueError(f"tma must be a bool, got {tma!r}")
        out_dtype = out_dtype or torch.float32
        key = str(out_dtype).removeprefix("torch.")
        if key not in _ELEMENT_BYTES:
            raise ValueError(f"out_dtype must be torch.bfloat16 or torch.float32, got {out_dtype}")
        for name, value in (("comm_programs", comm_programs), ("share", share)):
            _positive(name, value)
        if programs is not None and (not isinstance(programs, int) or programs < comm_programs + 1):
            raise ValueError(f"programs must be at least comm_programs + 1 = {comm_programs + 1} (one computes), "
                             f"got {programs!r}")
        self.layout = RingAttentionLayout(session.rank, session.world, heads, seq_local, head_dim,
                                          chunk_rows=chunk_rows, block=tuple(block), causal=causal,
                                          out_bytes=_ELEMENT_BYTES[key], slot_base=slot_base)
        self.session, self.rank, self.world = session, session.rank, session.world
        self.heads, self.seq_local, self.head_dim, self.causal = heads, seq_local, head_dim, causal
        self.sm_scale = head_dim ** -0.5 if sm_scale is None else float(sm_scale)
        self.device = session.device if session.device is not None and session.device >= 0 else 0
        self.block, self.num_warps, self.num_stages, self.tma = tuple(block), num_warps, num_stages, tma
        self.comm_programs, self.share, self._programs = comm_programs, share, programs
        self.out_dtype = out_dtype
        # one block per origin, [heads, seq_local, 2, head_dim]: peers write theirs into it, ours is shipped from it
        self.kv = torch.empty((self.world, heads, seq_local, 2, head_dim), dtype=torch.bfloat16,
                              device=f"cuda:{self.device}")
        self.plan = self.layout.plan(session.register(self.kv).id)
        self.slots = self.layout.slots
        session.flag_slots(slot_base, self.slots, type(self).__name__)
        self.channel_capacity = channel_capacity
        self.launches = 0
        self._ch: Any = None
        self._descriptors = DescriptorScratch(self.kv.device)
        self._launcher = KernelLauncher(self.device)

    def retile(self, block: tuple[int, int] | None = None, *, num_warps: int | None = None,
               num_stages: int | None = None, tma: bool | None = None) -> None:
        """Change the compute tiles (None: keep): ``block`` (block_m, block_n) checked as the constructor
        checks it, ``num_warps`` a power of two in [1, 32], ``num_stages`` >= 1, ``tma`` a bool. Launches
        after it run the new variant: where ranks share a process, ``preload`` every variant they will run
        again before the next launch of any. Between launches only (the flags and the scratch do not depend
        on the tiles)."""
        num_warps = self.num_warps if num_warps is None else num_warps
        num_stages = self.num_stages if num_stages is None else num_stages
        tma = self.tma if tma is None else tma
        if not isinstance(tma, bool):
            raise ValueError(f"tma must be a bool, got {tma!r}")
        check_launch(num_warps, num_stages)
        if block is not None:
            self.layout = replace(self.layout, block=tuple(block))
            self.block = self.layout.block
        self.num_warps, self.num_stages, self.tma = num_warps, num_stages, tma

    def prepare(self) -> None:
        """After the exchange, before the first launch (``__call__`` does it if not yet done): open the
        channel, make the device copies of its handle and the plan, allocate the running-softmax scratch, and
        compile and load the kernel. Ranks that share one process and GPU must all prepare before any
        launches: loading a kernel waits for the kernels running in the context (``gpuclient.triton.preload``)."""
        import torch

        if self._ch is not None:
            return
        self.channel = self.session.channel(self.channel_capacity)
        self._handle = self.channel.device_handle(self.device)
        self._ch = tpd.channel_pointer(self._handle)
        self._plan = tpd.plan_pointer(self.plan, self.device)
        dev = self.kv.device
        shape = (self.heads, self.seq_local, self.head_dim)
        # a tile's running state between steps: the fp32 accumulator, then the running max and sum per query
        self._acc = torch.empty(shape, dtype=torch.float32, device=dev)
        self._ml = torch.empty((2, self.heads, self.seq_local), dtype=torch.float32, device=dev)
        self._rounds = round_words(dev)  # the rounds run and the launch's finished programs (_rounds)
        sms = torch.cuda.get_device_properties(self.device).multi_processor_count
        self.programs = self._programs or max(self.comm_programs + 1, sms // self.share)
        q = torch.empty(shape, dtype=torch.bfloat16, device=dev)
        self._scratch = (q, torch.empty(shape, dtype=self.out_dtype, device=dev))
        self.preload()

    def preload(self, communicate: bool = True, compute: bool = True) -> Any:
        """Compile and load the kernel variant that ``__call__(..., communicate=, compute=)`` launches
        (``prepare`` loads the default one): ranks in one process must load every variant they will run
        concurrently before the first launch of any. Returns Triton's compiled kernel."""
        self.prepare()
        q, out = self._scratch
        compiled = tpd.preload(_ring_attention, *self._args(q, q, q, out), grid=(self.programs,),
                               **self._meta(communicate, compute))
        self._descriptors.reserve_for(compiled, self.programs)  # the descriptors' memory (tma), before any launch
        return compiled

    def _args(self, q: Any, k: Any, v: Any, out: Any) -> tuple:
        lay = self.layout
        return (self._ch, self._plan, self._rounds, q, k, v, self.kv, out, self._acc, self._ml, self.rank,
                self.world, self.heads, self.seq_local, lay.chunk_elems, lay.chunks_per_block, lay.release_slot,
                self.sm_scale * _LOG2E)

    def _meta(self, communicate: bool, compute: bool = True) -> dict[str, Any]:
        bm, bn = self.block
        return {"COMM_PROGRAMS": self.comm_programs, "HEAD_DIM": self.head_dim, "BLOCK_M": bm, "BLOCK_N": bn,
                "COPY_BLOCK": 1024, "CAUSAL": self.causal, "COMMUNICATE": communicate and self.world > 1,
                "COMPUTE": compute, "TMA": self.tma, "num_warps": self.num_warps, "num_stages": self.num_stages}

    def __call__(self, q: Any, k: Any, v: Any, out: Any = None, *, communicate: bool = True,
                 compute: bool = True, stream: Any = None) -> Any:
        """Launch once on ``stream`` (torch's current one by default); returns the attention output of this
        rank's queries (``[heads, seq_local, head_dim]``; into ``out`` when given). ``communicate=False``
        neither ships nor waits (the compute alone, for timing: the peers' blocks are whatever ``kv`` holds);
        ``compute=False`` ships, forwards and waits for every head's chunks as the compute would, and computes
        nothing (the communication alone; ``out`` is left as it was). A variant other than the default must be
        ``preload``-ed first where ranks share a process."""
        import torch

        stream = launch_stream(stream, self.device, self._ch is not None)
        shape, device = (self.heads, self.seq_local, self.head_dim), self.kv.device
        q, k, v = (operand(name, tensor, shape, (torch.bfloat16,), device, stream)
                   for name, tensor in (("q", q), ("k", k), ("v", v)))
        if out is not None:
            out = operand("out", out, shape, (self.out_dtype,), device, stream)
        self.prepare()
        if out is None:
            out = output(shape, self.out_dtype, device, stream)
        if communicate and self.world > 1:
            self.launches += 1
        args, meta = self._args(q, k, v, out), self._meta(communicate, compute)
        self._descriptors.launch(lambda: self._launcher(_ring_attention, (self.programs,), stream, args, meta))
        return out
