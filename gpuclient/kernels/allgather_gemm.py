"""AllGather + GEMM, fused: ``C = all_gather(A) @ B`` with A's rows sharded over the ranks.

Every rank holds a row shard of A (``m_local x k``) and a whole B (``k x n``, typically its column shard
of a tensor-parallel weight) and computes all ``world * m_local`` rows of C. The kernel is one persistent
Triton launch with SM specialization: the first ``comm_programs`` programs ship the local shard to every
peer, chunk by chunk (``tile_done`` on an all-gather plan whose tiles are the chunks, so each ships at
once), while the compute programs walk C's tiles ordered by input availability (the local shard's rows
first, then each peer's in ring order; within a shard ``group_m`` row blocks at a time, column by column:
``_tiles.tile_at``) and wait, before a tile, only for the chunks its rows touch (``wait_range``). Chunks
are ``chunk_rows`` rows, independent of the tile's ``block_m``: a tile that straddles two chunks waits for
both.

Compute: bf16 ``tl.dot`` (wgmma on sm_90) with fp32 accumulation, C in fp32 or bf16. Triton rather than
CUTLASS/CuTe: the same language as the device calls (``gpuclient.triton``), no C++ template build at run
time; a CuTe kernel was not measured against it. Operands are loaded with pointer arithmetic and masks, or
with ``tma=True`` through tensor descriptors made in the kernel (``tl.make_tensor_descriptor``: TMA on
sm_90, out-of-bounds elements zero-filled by the copy engine). A descriptor spans the whole gathered A, so a
tile that runs past a shard's last row reads the next shard's rows; those rows of C are not stored. After a
``wait_range`` the TMA path issues ``fence.proxy.async.global``: the wait acquires the peer's rows in the
generic proxy, and the descriptor loads read them through the async proxy.
"""

from __future__ import annotations

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
    async_proxy_fence,
    check_group,
    check_tiles,
    gemm_operands,
    gemm_tile,
    tile_at,
)
from gpuclient.plan import ChunkPlan


# no specialization on the rank (Triton would compile again for rank 0 vs 1)
@triton.jit(do_not_specialize=["rank", "release_slot"])
def _allgather_gemm(ch, plan, rounds_ptr, a_ptr, b_ptr, c_ptr, done_ptr, rank, world, m_local, n, k, chunks,
                    release_slot,
                    COMM_PROGRAMS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, COMMUNICATE: tl.constexpr, COMPUTE: tl.constexpr,
                    TMA: tl.constexpr = False, GROUP_M: tl.constexpr = 1):
    pid = tl.program_id(0)
    epoch = this_round(rounds_ptr)  # launch e waits for flag values of e (_rounds: the round in device memory)
    if pid < COMM_PROGRAMS:
        if COMMUNICATE:
            # a peer reads our last launch's rows until it says so: wait for every peer's release first
            tpd.wait_peers(ch, rank, world, release_slot, epoch - 1)
            # every chunk of the local shard, to every peer (the plan's sends); then local completion, so
            # the shard may be overwritten once the kernel is over
            for chunk in range(pid, chunks, COMM_PROGRAMS):
                tpd.tile_done(ch, plan, chunk)
            tpd.quiet(ch)
    else:
        compute = tl.num_programs(0) - COMM_PROGRAMS
        row_blocks = tl.cdiv(m_local, BLOCK_M)
        col_blocks = tl.cdiv(n, BLOCK_N)
        per_rank = row_blocks * col_blocks
        if COMPUTE:  # the whole gathered A and B, once per program
            a_in, b_in = gemm_operands(a_ptr, b_ptr, world * m_local, n, k, BLOCK_M, BLOCK_N, BLOCK_K, TMA)
        for t in range(pid - COMM_PROGRAMS, world * per_rank, compute):
            src = (rank + t // per_rank) % world  # the local shard's tiles first, then the peers' in ring order
            row_block, col_block = tile_at(t % per_rank, row_blocks, col_blocks, GROUP_M)
            row0 = row_block * BLOCK_M
            col0 = col_block * BLOCK_N
            rows = tl.minimum(BLOCK_M, m_local - row0)
            if COMMUNICATE:
                if src != rank:
                    tpd.wait_range(ch, plan, epoch, src, (src * m_local + row0).to(tl.uint64) * k * 2,
                                   rows.to(tl.uint64) * k * 2)
                    if TMA:
                        async_proxy_fence()
            if COMPUTE:
                offs_m = row0 + tl.arange(0, BLOCK_M)
                offs_n = col0 + tl.arange(0, BLOCK_N)
                acc = gemm_tile(a_in, b_in, src * m_local, row0, m_local - row0, col0, n, k, BLOCK_M, BLOCK_N,
                                BLOCK_K, TMA)
                c = c_ptr + (src * m_local + offs_m).to(tl.int64)[:, None] * n + offs_n[None, :]
                tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=(offs_m[:, None] < m_local) & (offs_n[None, :] < n))
        if COMMUNICATE:
            # the last compute program to finish tells every peer that their rows of this launch are read
            tl.debug_barrier()
            finished = tl.atomic_add(done_ptr, 1, sem="acq_rel", scope="gpu")
            if (finished + 1) % compute == 0:
                tpd.signal_peers(ch, rank, world, release_slot, 1)
    if COMMUNICATE:
        if last_to_finish(rounds_ptr):
            tl.store(rounds_ptr, epoch)


class AllGatherGemm:
    """``C = all_gather(A) @ B`` for one rank: build before ``session.exchange()``, call after it.

    ``a_shard`` (``m_local x k``, bf16) is copied into this rank's rows of a gathered buffer registered
    with the daemon (peers write theirs into it); ``b`` is ``k x n`` bf16. ``chunk_rows`` rows travel as one
    put_signal; ``comm_programs`` programs push, ``programs`` in all (default: this GPU's SMs divided by
    ``share``, the number of ranks that run on the GPU at once: every rank's programs must be resident
    together, since compute programs spin on the peers' chunks). Launch k of the op waits for flag values
    k: nothing is reset between calls. ``block`` (block_m, block_n, block_k), ``num_warps`` and
    ``num_stages`` are the GEMM's tiles (``retile`` changes them); ``tma=True`` loads A and B through tensor
    descriptors (needs ``n`` and ``k`` multiples of 8) instead of pointers and masks, ``tma=None`` (the
    default) does so exactly when ``n`` and ``k`` allow it. ``group_m``: the tile order within a shard,
    that many row blocks at a time (1: row-major).
    """

    def __init__(self, session: Any, m_local: int, n: int, k: int, *, chunk_rows: int = 64,
                 comm_programs: int = 1, block: tuple[int, int, int] = GEMM_BLOCK, num_warps: int = 8,
                 num_stages: int = 3, slot_base: int = 0, share: int = 1, programs: int | None = None,
                 out_dtype: Any = None, channel_capacity: int = 256, tma: bool | None = None,
                 group_m: int = GROUP_M) -> None:
        import torch

        if min(m_local, n, k, chunk_rows, comm_programs, share) < 1:
            raise ValueError("m_local, n, k, chunk_rows, comm_programs and share must be >= 1")
        self.session, self.rank, self.world = session, session.rank, session.world
        self.m_local, self.n, self.k = m_local, n, k
        self.device = session.device if session.device is not None and session.device >= 0 else 0
        self.block, self.num_warps, self.num_stages, self.tma = check_tiles(block, num_warps, num_stages, tma, n, k)
        self.group_m = check_group(group_m)
        self.comm_programs, self.share, self._programs = comm_programs, share, programs
        self.out_dtype = out_dtype or torch.float32
        self.gathered = torch.empty((self.world * m_local, k), dtype=torch.bfloat16, device=f"cuda:{self.device}")
        region = session.register(self.gathered)
        row_bytes = k * 2
        self.plan = ChunkPlan.all_gather(self.rank, self.world, m_local * row_bytes, tile_bytes=chunk_rows * row_bytes,
                                         chunk_tiles=1, dst_region=region.id, slot_base=slot_base)
        # the plan's slots, then one per rank: "rank r has read launch k's rows" (back-pressure between launches)
        self.release_slot = slot_base + self.plan.slot_count
        self.slots = self.plan.slot_count + self.world
        session.flag_slots(slot_base, self.slots, type(self).__name__)
        self.channel_capacity = channel_capacity
        self.launches = 0
        self._ch: Any = None
        self._scratch = DescriptorScratch(self.gathered.device)
        self._launcher = KernelLauncher(self.device)

    def retile(self, block: tuple[int, int, int] | None = None, *, num_warps: int | None = None,
               num_stages: int | None = None, tma: bool | None = None, group_m: int | None = None) -> None:
        """Change the GEMM's tiles and order (None: keep), checked as the constructor checks them. Launches
        after it run the new variant: where ranks share a process, ``preload`` every variant they will run
        again before the next launch of any. Between launches only (the flags do not depend on the tiles)."""
        group_m = check_group(self.group_m if group_m is None else group_m)
        self.block, self.num_warps, self.num_stages, self.tma = check_tiles(
            self.block if block is None else block, self.num_warps if num_warps is None else num_warps,
            self.num_stages if num_stages is None else num_stages, self.tma if tma is None else tma, self.n, self.k)
        self.group_m = group_m

    def prepare(self) -> None:
        """After the exchange, before the first launch (``__call__`` does it if not yet done): open the
        channel, make the device copies of its handle and the plan, and compile and load the kernel. Ranks
        that share one process and GPU must all prepare before any launches: loading a kernel waits for the
        kernels running in the context (``gpuclient.triton.preload``)."""
        import torch

        if self._ch is not None:
            return
        self.channel = self.session.channel(self.channel_capacity)
        self._handle = self.channel.device_handle(self.device)
        self._ch = tpd.channel_pointer(self._handle)
        self._plan = tpd.plan_pointer(self.plan, self.device)
        self._done = torch.zeros(1, dtype=torch.int32, device=self.gathered.device)  # monotonic, never reset
        self._rounds = round_words(self.gathered.device)  # the rounds run (_rounds)
        sms = torch.cuda.get_device_properties(self.device).multi_processor_count
        self.programs = self._programs or max(self.comm_programs + 1, sms // self.share)
        self.preload()

    def preload(self, communicate: bool = True, compute: bool = True) -> Any:
        """Compile and load the kernel variant that ``__call__(..., communicate=, compute=)`` launches
        (``prepare`` loads the default one): ranks in one process must load every variant they will run
        concurrently before the first launch of any. Returns Triton's compiled kernel."""
        import torch

        self.prepare()
        # stand-ins for B and C, held only while compiling: a compile specializes on a pointer's dtype and
        # 16-byte alignment, not on what it points at
        b = torch.empty(8, dtype=torch.bfloat16, device=self.gathered.device)
        out = torch.empty(8, dtype=self.out_dtype, device=self.gathered.device)
        compiled = tpd.preload(_allgather_gemm, *self._args(b, out), grid=(self.programs,),
                               **self._meta(communicate, compute))
        self._scratch.reserve_for(compiled, self.programs)  # the descriptors' memory (tma), before any launch
        return compiled

    def _args(self, b: Any, out: Any) -> tuple:
        return (self._ch, self._plan, self._rounds, self.gathered, b, out, self._done, self.rank, self.world,
                self.m_local, self.n, self.k, self.plan.chunk_count, self.release_slot)

    def _meta(self, communicate: bool, compute: bool = True) -> dict[str, Any]:
        bm, bn, bk = self.block
        return {"COMM_PROGRAMS": self.comm_programs, "BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk,
                "COMMUNICATE": communicate, "COMPUTE": compute, "TMA": self.tma, "GROUP_M": self.group_m,
                "num_warps": self.num_warps,
                "num_stages": self.num_stages}

    def local_rows(self) -> Any:
        """This rank's rows of the gathered A: write the shard here to skip the copy in ``__call__``."""
        return self.gathered[self.rank * self.m_local:(self.rank + 1) * self.m_local]

    def __call__(self, a_shard: Any, b: Any, out: Any = None, *, communicate: bool = True, compute: bool = True,
                 stream: Any = None) -> Any:
        """Launch once on ``stream`` (torch's current one by default); returns C (``world*m_local x n``).
        ``a_shard`` is copied into ``local_rows()`` on ``stream`` too, before the kernel (None: the rows are there).

        Between launches nothing needs resetting or synchronizing: a launch ships its shard to a peer only
        once that peer has said it finished reading the previous launch's rows (a flag per rank).
        ``communicate=False`` neither ships nor waits (the compute alone, for timing: the peers' rows are
        whatever the buffer holds). ``compute=False`` ships and waits as usual but skips the GEMM (C is left
        unwritten): the communication alone, on the same schedule, for timing.
        """
        import torch

        stream = launch_stream(stream, self.device, self._ch is not None)
        device = self.gathered.device
        b = operand("b", b, (self.k, self.n), (torch.bfloat16,), device, stream)
        if out is not None:
            out = operand("out", out, (self.world * self.m_local, self.n), (self.out_dtype,), device, stream)
        if a_shard is not None:
            a_shard = operand("a_shard", a_shard, (self.m_local, self.k), (torch.bfloat16,), device, stream,
                              copied=True)
        self.prepare()
        if a_shard is not None and a_shard.data_ptr() != self.local_rows().data_ptr():
            with torch.cuda.stream(stream):  # in the launch's stream, ahead of the kernel that reads and ships it
                self.local_rows().copy_(a_shard)
        if out is None:
            out = output((self.world * self.m_local, self.n), self.out_dtype, device, stream)
        if communicate:
            self.launches += 1
        args, meta = self._args(b, out), self._meta(communicate, compute)
        self._scratch.launch(lambda: self._launcher(_allgather_gemm, (self.programs,), stream, args, meta))
        return out

