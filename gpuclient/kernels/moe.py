"""MoE dispatch and combine on transportd channels, shaped like DeepEP's low-latency API.

``dispatch(x, topk_idx, topk_weights)`` sends every token row to the ranks of its top-k experts and returns
the rows each local expert received, packed per expert in a fixed worst-case layout; ``combine(y, handle)``
sends the experts' outputs back and returns, at each token's home rank, the top-k weighted sum. The layout
math is ``gpuclient.kernels.moe_layout`` (numpy; the tests' model); docs/kernels.md has the whole contract.

The kernels, in stream order, and the protocol they speak with the peers are ``gpuclient.kernels.moe_kernels``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gpuclient import triton as tpd
from gpuclient.kernels._launch import KernelLauncher, launch_stream
from gpuclient.kernels._operands import as_tensor, operand
from gpuclient.kernels._rounds import round_words
from gpuclient.kernels._tiles import check_launch, is_dot_block
from gpuclient.kernels.moe_kernels import (
    _moe_combine_reduce,
    _moe_combine_send,
    _moe_dispatch,
    _moe_dispatch_gemm,
    _moe_route,
    _moe_stage,
)
from gpuclient.kernels.moe_layout import MoELayout, dispatch_row


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
    rows staged expert-major, one contiguous block per expert; the rows for its own experts go straight to
    ``recv_x`` instead and their blocks stay unused) and ``send_src`` [E, T] (put sources), ``land_x``
    [W, T*min(K, L), H] (each source's rows for this rank's experts as they land, a slice per source, packed
    into ``recv_x`` by the dispatch kernel), ``combine_buf`` [T*K, H] bf16 (the experts' outputs of this
    rank's tokens, in ``send_x``'s order) and ``send_y`` [L, W*T, H] (combine's put source). ``programs``
    programs per kernel (default: SMs / share, at most 32): every rank sharing the GPU must have its grid
    resident at once (``share`` of them). The row stage, which waits for nothing, has a program per four tokens
    (at hidden >= 1024), at most four per SM over ``share``; the routing, which waits for nothing either, a
    program per expert (as many at most).

    ``fp8=True`` sends the rows as fp8 (e4m3) with one fp32 scale per 128 values (DeepEP's low-latency FP8
    dispatch: about half the bytes); ``hidden`` must be a multiple of 128, ``recv_x``, ``send_x`` and ``land_x``
    hold bytes
    ([.., H + H/32]: a row's H fp8 values, then its H/128 scales) and ``dispatch`` returns the pair
    ``(recv_x_fp8 [L, W*T, H] float8_e4m3fn, recv_scales [L, W*T, H/128] fp32)``, views of ``recv_x``, where a
    value is ``fp8 * scale``. ``combine`` is bf16 either way; ``dispatch_gemm`` is bf16 only.

    ``gemm_n`` (columns of each local expert's weight) builds ``dispatch_gemm``, the dispatch fused with the
    expert GEMM: its output ``y`` [L, W*T, gemm_n] (``gemm_dtype``: bf16 or fp32) is allocated here too. Its one
    kernel has ``gemm_programs`` programs (default: SMs / share), the first ``comm_programs`` of them moving
    rows, the rest computing ``gemm_block`` = (block_m, block_n, block_k) tiles with ``gemm_warps`` warps and
    ``gemm_stages`` pipeline stages; each left out comes from :func:`default_gemm_tiles` for the rows an expert
    gets under even routing. It sends a peer the rows of ``experts_per_put`` of its experts per put and flag
    (default :func:`default_experts_per_put`: four puts a peer) into ``land_x``, and reads them from there. Its
    GEMM takes the row blocks of the first ``split_experts`` local experts
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
        # the peers' rows as they land, a slice per source, placed by that source's counts alone (MoELayout)
        self.land_x = torch.empty((W, lay.source_rows, self.row), dtype=row_dtype, device=dev)
        self.regions = {name: session.register(getattr(self, name)).id
                        for name in ("counts_all", "recv_x", "src_stage", "send_x", "send_src", "combine_buf",
                                     "send_y", "land_x")}
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
        self.put_rows = lay.put_rows  # rows per put of a combine block: all unless they pass the largest put
        self.channel_capacity = channel_capacity
        self.rounds = 0  # the dispatches called (a graph replay runs one uncounted): the device keeps the rounds run
        self._pending: MoEHandle | None = None
        self._ch: Any = None
        self._launcher = KernelLauncher(self.device)

    # --- launch plumbing ------------------------------------------------------------------------------------------
    def prepare(self) -> None:
        """After the exchange, before the first call: open the channel, copy its handle to the GPU, and compile
        and load all six kernels (the route kernel for int32 and int64 ``topk_idx``). Ranks sharing one process
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
        # the stage waits for nothing, so its grid need not be resident at once: wide enough to keep many rows in
        # flight (one load of four rows a step per program), small enough to share the SMs with the ranks' kernels
        self.stage_programs = max(1, min(-(-self.max_tokens // self.copy_rows), 4 * sms // self.share))
        # the route waits for nothing either, and each of its programs counts whole experts: one an expert, so its
        # time is one expert's pass over topk_idx, not (E / programs) of them
        self.route_programs = max(1, min(self.num_experts, 4 * sms // self.share))
        for dtype in (torch.int32, torch.int64):
            idx = torch.full((self.max_tokens, self.topk), -1, dtype=dtype, device=dev)
            tpd.preload(_moe_route, *self._route_args(idx, 0), grid=(self.route_programs,), **self._route_meta())
        tpd.preload(_moe_stage, *self._stage_args(self.out, 0), grid=(self.stage_programs,),  # out: bf16 like x
                    **self._stage_meta())
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

    def _route_args(self, idx: Any, tokens: int) -> tuple:
        return (idx, self.idx32, self.stage_row, self.counts_all, self.stage_off, self.send_src, self.rank, tokens)

    def _route_meta(self) -> dict[str, Any]:
        return {"E": self.num_experts, "K": self.topk, "KP": _pow2(self.topk), "T": self.max_tokens,
                "BLOCK_T": min(_pow2(self.max_tokens), 256), "num_warps": self.num_warps}

    def _stage_args(self, x: Any, tokens: int) -> tuple:
        return (x, self.idx32, self.stage_row, self.stage_off, self.send_x, self.recv_x, self.recv_src, self.rank,
                tokens)

    def _stage_meta(self) -> dict[str, Any]:
        return {"W": self.world, "L": self.local_experts, "K": self.topk, "KP": _pow2(self.topk),
                "T": self.max_tokens, "H": self.hidden, "ROW": self.row, "COPY_ROWS": self.copy_rows,
                "BLOCK_H": self.block_h, "FP8": self.fp8, "num_warps": self.num_warps}

    def _route_and_stage(self, x: Any, topk_idx: Any, tokens: int, stream: Any) -> None:
        """A dispatch's first two kernels: the routing (counts, stage rows, handle words), then the rows staged."""
        self._launcher(_moe_route, (self.route_programs,), stream, self._route_args(topk_idx, tokens),
                       self._route_meta())
        self._launcher(_moe_stage, (self.stage_programs,), stream, self._stage_args(x, tokens), self._stage_meta())

    def _dispatch_args(self) -> tuple:
        r = self.regions
        return (self._ch, self._rounds, self.rank, self.counts_all, self.stage_off, self.recv_x, self.recv_src,
                self.src_stage, self.land_x, self.recv_count, self.recv_layout, r["counts_all"], r["land_x"],
                r["src_stage"], r["send_x"], r["send_src"], self.layout.count_slot, self.layout.dispatch_slot)

    def _dispatch_meta(self) -> dict[str, Any]:
        return {"W": self.world, "E": self.num_experts, "L": self.local_experts, "T": self.max_tokens,
                "ROW": self.row, "ROW_BYTES": self.row_bytes, "SOURCE_ROWS": self.layout.source_rows,
                "LAND_PUT_ROWS": self.layout.land_put_rows, "HANDLE_WORDS": self.layout.handle_words,
                "LP": _pow2(self.local_experts), "WP": _pow2(self.world), "BLOCK_T": self.block_t,
                "COPY_ROWS": self.copy_rows, "BLOCK_H": self.block_h, "num_warps": self.num_warps}

    def _gemm_args(self, w: Any, y: Any, timeline: Any) -> tuple:
        r = self.regions
        return (self._ch, self._rounds, self.rank, self.counts_all, self.stage_off, self.recv_x, self.recv_src,
                self.src_stage, self.land_x, w, y, self.recv_count, self.recv_layout,
                r["counts_all"], r["land_x"], r["src_stage"], r["send_x"], r["send_src"], self.layout.count_slot,
                self.layout.dispatch_slot, self.layout.expert_slot,
                self._no_timeline if timeline is None else timeline)

    def _gemm_meta(self, communicate: bool = True, compute: bool = True, timeline: bool = False) -> dict[str, Any]:
        bm, bn, bk = self.gemm_block
        return {"W": self.world, "E": self.num_experts, "L": self.local_experts, "T": self.max_tokens,
                "H": self.hidden, "N": self.gemm_n, "LP": _pow2(self.local_experts), "WP": _pow2(self.world),
                "COMM_PROGRAMS": self.comm_programs, "BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk,
                "BLOCK_T": self.block_t, "HANDLE_WORDS": self.layout.handle_words,
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

    def _operand(self, name: str, obj: Any, shape: tuple[int, ...], dtypes: tuple, stream: Any) -> Any:
        """``obj`` as the torch tensor the kernels read or write, checked (``_operands.operand``)."""
        return operand(name, obj, shape, dtypes, self.recv_x.device, stream)

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
        stream = launch_stream(stream, self.device, self._ch is not None)
        x, topk_idx, topk_weights = self._inputs(x, topk_idx, topk_weights, stream)
        tokens = int(x.shape[0])
        self.prepare()
        self.rounds += 1
        self._route_and_stage(x, topk_idx, tokens, stream)
        self._launcher(_moe_dispatch, (self.programs,), stream, self._dispatch_args(), self._dispatch_meta())
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

    def _inputs(self, x: Any, topk_idx: Any, topk_weights: Any, stream: Any) -> tuple[Any, Any, Any]:
        """A dispatch's three inputs as checked torch tensors (``_operand``); ``x``'s rows are its tokens."""
        import torch

        if self._pending is not None:
            raise RuntimeError("combine the previous dispatch first: its buffers are still in use")
        x = as_tensor("x", x, self.recv_x.device, stream)
        tokens = int(x.shape[0]) if x.dim() == 2 else -1
        if not 0 <= tokens <= self.max_tokens:
            raise ValueError(f"x must be [tokens <= {self.max_tokens}, {self.hidden}], got {list(x.shape)}")
        return (self._operand("x", x, (tokens, self.hidden), (torch.bfloat16,), stream),
                self._operand("topk_idx", topk_idx, (tokens, self.topk), (torch.int32, torch.int64), stream),
                self._operand("topk_weights", topk_weights, (tokens, self.topk), (torch.float32,), stream))

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
        stream = launch_stream(stream, self.device, self._ch is not None)
        tokens = 0
        if communicate:
            x, topk_idx, topk_weights = self._inputs(x, topk_idx, topk_weights, stream)
            tokens = int(x.shape[0])
        w = self._operand("w", w, (L, H, N), (torch.bfloat16,), stream)
        y = self._operand("out", self.y if out is None else out, tuple(self.y.shape), (self.gemm_dtype,), stream)
        if timeline is not None:
            self.prepare()
            timeline = self._operand("timeline", timeline, (self.layout.timeline_words(self.gemm_programs),),
                                     (torch.int64,), stream)
        if not communicate and self.rounds == 0:
            raise RuntimeError("communicate=False reruns the GEMM of the latest round: dispatch one first")
        self.prepare()
        if communicate:  # compute=False too: its rows move and its flags rise like any fused round's
            self.rounds += 1
            self._route_and_stage(x, topk_idx, tokens, stream)
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
        stream = launch_stream(stream, self.device, self._ch is not None)
        y = self._operand("y", y, (*self.recv_x.shape[:2], self.hidden), (torch.bfloat16,), stream)
        out = self._operand("out", self.out[:handle.tokens] if out is None else out, (handle.tokens, self.hidden),
                            (torch.bfloat16,), stream)
        grid = (self.programs,)
        self._launcher(_moe_combine_send, grid, stream, self._combine_send_args(y), self._combine_send_meta())
        self._launcher(_moe_combine_reduce, grid, stream,
                       self._reduce_args(handle.tokens, handle.topk_weights, out), self._reduce_meta())
        self._pending = None
        return out
