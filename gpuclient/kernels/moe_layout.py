"""The routing and buffer layout of ``gpuclient.kernels.MoE``, in numpy: what the kernels compute, as a model.

The MoE op's GPU kernels (``gpuclient/kernels/moe.py``) implement exactly the functions here; the host side
uses :class:`MoELayout` for its checks, buffer shapes and flag slots, and the tests compare both the kernels
(on a GPU) and brute-force enumerations (on the CPU) against these functions. Nothing here needs torch.

Names: ``W`` ranks, ``E`` experts (``L = E / W`` local experts per rank: global expert ``e`` lives on rank
``e // L`` as its local expert ``e % L``), ``T`` the most tokens a rank dispatches per call, ``K`` top-k,
``H`` the hidden size.

Routing (per source rank). Entry ``(t, k)`` of ``topk_idx`` is *valid* when ``0 <= idx < E`` and no earlier
``k' < k`` of the same token names the same expert (a repeat is dropped, as if it were -1): so an expert
gets each token at most once and a source sends an expert at most ``T`` rows. Each valid entry travels once,
as one row, to its expert (per (token, expert), not per (token, rank): see docs/kernels.md). Its *position*
is its rank among the source's tokens routed to the same expert, in token order.

Receive layout (per rank ``d``, per local expert ``l``): ``W * T`` rows, packed source by source in the order
the sources send to ``d``: ``d``'s own rows first, then ``d - 1``'s, ``d - 2``'s, ... (mod ``W``; the *step*
of source ``s`` at ``d`` is ``(d - s) mod W``). The rows from source ``s`` start at ``offset[l, s] = sum of
count[s', e]`` over the sources ``s'`` of a lower step (``e`` the global expert), so the first
``recv_count[l]`` rows of expert ``l`` are its tokens, each source's in token order, and a rank's own rows
start at 0 whatever its peers send: the fused GEMM starts on them before any peer's count is in.
``recv_src[l, p] = s * T * K + t * K + k`` names the row's origin (-1 past the count).

Staging, expert-major (per source rank): the source's valid entries sorted by expert, then by token. Entry
``(t, k)`` for expert ``e`` has the *stage row* ``eoff[e] + pos[t, k]``, where ``eoff[e] = sum over e' < e
of count[e']`` (an exclusive sum over the source's own counts): the source stages its rows there
(``send_x``, at most ``T * K`` rows), so its rows for one expert are one contiguous block, and its rows for
one destination's experts too (they are consecutive).

Landing: a source's rows for a destination travel as one block of the stage (pieces of ``land_put_rows``
where it passes the largest put) into the destination's ``land_x`` slice for that source (``source_rows``
rows: every row one source can send one rank), where the source's own counts alone place them: ``land_x[s]``
holds source ``s``'s rows for the destination's experts packed expert by expert
(:meth:`MoELayout.land_offsets`), so no source waits for another's counts before it sends. The destination
then packs them into ``recv_x`` at the receive layout's rows, once the source's flags say they are in.
Combine is the same map backwards without the landing: the expert's rank puts each (local expert, source)
block of its output, contiguous in the receive layout, to the source's ``combine_buf`` at the source's stage
rows (``eoff`` from the source's count row, which every rank holds), and the source sums entry ``(t, k)``
from its stage row. A combine block longer than the largest put (``max_put_bytes``) goes as several puts of
``put_rows`` rows.

``dispatch_gemm`` lands the same rows in the same slices, in more puts: ``experts_per_put`` of the
destination's local experts (a *group*: ``g = local // experts_per_put``) at a time, each group's rows one
block of the stage at the rows the source staged before the group, so its GEMM can start on a group before
the rest is in. The GEMM reads the peers' rows from ``land_x`` and writes them into ``recv_x`` as it goes, so
``recv_x`` ends as after ``dispatch``. A group longer than the largest put goes in pieces of
``group_put_rows`` rows; its last piece is the put_signal of the group's flag.

Handle words: a source's ``send_src`` [E, T] holds, for each expert, the handle word of its j-th row; the
rows of one destination's experts (``L * T`` words, past the counts too) travel in one put per destination
(pieces of ``handle_words`` words where they pass the largest put) into the destination's
``src_stage[source]`` [L, T], and the destination scatters each (expert, source) run to ``recv_src`` at the
rows where that source's rows landed.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

import numpy as np

_INT32_MAX = (1 << 31) - 1

#: The largest PUT the daemon takes (``transportd.dataplane.tables.DEFAULT_MAX_LENGTH``: a record's length is
#: 32 bits, and the proxy refuses anything above its ``max_length``); a longer block is split.
MAX_PUT_BYTES = 1 << 31


def dispatch_row(hidden: int, fp8: bool) -> tuple[int, int]:
    """A staged / received dispatch row as (elements, bytes): ``hidden`` bf16 values, or with ``fp8`` bytes:
    ``hidden`` e4m3 values, then one fp32 scale per 128 of them (``hidden / 32`` bytes)."""
    if fp8:
        return hidden + hidden // 32, hidden + hidden // 32
    return hidden, 2 * hidden


def _positive(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    return int(value)


@dataclass(frozen=True)
class MoELayout:
    """Geometry, checks and flag slots of one rank's MoE dispatch/combine (torch-free)."""

    rank: int
    world: int
    num_experts: int
    max_tokens: int
    topk: int
    hidden: int
    slot_base: int = 0
    max_put_bytes: int = MAX_PUT_BYTES
    experts_per_put: int = 1

    def __post_init__(self) -> None:
        for name in ("world", "num_experts", "max_tokens", "topk", "hidden", "max_put_bytes", "experts_per_put"):
            _positive(name, getattr(self, name))
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or not 0 <= self.rank < self.world:
            raise ValueError(f"rank must be in [0, {self.world}), got {self.rank!r}")
        if self.num_experts % self.world:
            raise ValueError(f"num_experts={self.num_experts} does not split evenly over {self.world} ranks")
        if isinstance(self.slot_base, bool) or not isinstance(self.slot_base, int) or self.slot_base < 0:
            raise ValueError(f"slot_base must be an integer >= 0, got {self.slot_base!r}")
        if self.topk > self.num_experts:
            raise ValueError(f"topk={self.topk} is more than num_experts={self.num_experts}")
        # the handle's source word s*T*K + t*K + k and every row index are int32 in the kernels
        if self.world * self.max_tokens * self.topk > _INT32_MAX:
            raise ValueError(f"world * max_tokens * topk = {self.world * self.max_tokens * self.topk} passes "
                             "the int32 source word: lower max_tokens")
        if self.local_experts * self.capacity > _INT32_MAX:
            raise ValueError("local_experts * world * max_tokens receive rows pass int32: lower max_tokens")
        if self.max_put_bytes > MAX_PUT_BYTES:
            raise ValueError(f"max_put_bytes={self.max_put_bytes} is more than the daemon takes ({MAX_PUT_BYTES})")
        # a row and the count row (E int32) each go in one put
        for what, size in (("a row", self.row_bytes), ("the count row", 4 * self.num_experts)):
            if size > self.max_put_bytes:
                raise ValueError(f"{what} ({size} bytes) passes the largest put ({self.max_put_bytes} bytes)")

    # --- geometry -------------------------------------------------------------------------------------------------
    @property
    def local_experts(self) -> int:
        return self.num_experts // self.world

    @property
    def capacity(self) -> int:
        """Receive rows per local expert: every source may send it each of its ``T`` tokens once."""
        return self.world * self.max_tokens

    @property
    def row_bytes(self) -> int:
        """One token row, bf16."""
        return self.hidden * 2

    @property
    def stage_capacity(self) -> int:
        """Stage rows (``send_x``) and combine rows (``combine_buf``): every valid entry, ``T * K`` at most."""
        return self.max_tokens * self.topk

    @property
    def put_rows(self) -> int:
        """Rows per put of a combine block: all of an expert's output rows for one source (``T`` at most) unless
        they pass the largest put."""
        return min(self.max_tokens, self.max_put_bytes // self.row_bytes)

    @property
    def source_rows(self) -> int:
        """Rows one source can send one rank in a round (a token reaches an expert once, and at most K of them):
        the rows of each source's slice of ``land_x``."""
        return self.max_tokens * min(self.topk, self.local_experts)

    @property
    def land_put_rows(self) -> int:
        """Rows per put of a dispatch's block for one destination: all of them unless they pass the largest
        put."""
        return min(self.source_rows, self.max_put_bytes // self.row_bytes)

    @property
    def put_groups(self) -> int:
        """Groups of a destination's local experts that ``dispatch_gemm`` sends as one put (and one flag) each."""
        return -(-self.local_experts // self.experts_per_put)

    @property
    def group_put_rows(self) -> int:
        """Rows per put of a group: all of them unless they pass the largest put."""
        return min(self.max_tokens * min(self.topk, self.experts_per_put), self.max_put_bytes // self.row_bytes)

    def group_of(self, local: int) -> int:
        """The put group of local expert ``local``."""
        return int(local) // self.experts_per_put

    @property
    def handle_words(self) -> int:
        """Handle words per put of a destination's ``L * T``: all of them unless they pass the largest put."""
        return min(self.local_experts * self.max_tokens, self.max_put_bytes // 4)

    def owner(self, expert: int) -> tuple[int, int]:
        """(rank, local expert) of global expert ``expert``."""
        return divmod(int(expert), self.local_experts)

    def encode(self, src: int, token: int, k: int) -> int:
        """The handle's word for a row that came from ``src``'s token ``token``, top-k entry ``k``."""
        return (src * self.max_tokens + token) * self.topk + k

    def decode(self, word: int) -> tuple[int, int, int]:
        """(source rank, token, k) of a handle word."""
        rest, k = divmod(int(word), self.topk)
        src, token = divmod(rest, self.max_tokens)
        return src, token, k

    # --- flag slots (this rank's flags; index + s is "from rank s") -------------------------------------------------
    @property
    def count_slot(self) -> int:
        """``+ s``: rank s's per-expert counts of a round have arrived (its put_signal; ADD 1 per round)."""
        return self.slot_base

    @property
    def dispatch_slot(self) -> int:
        """``+ s``: every row and handle word rank s sends us in a round is placed (a SIGNAL after them; in a
        ``dispatch_gemm`` round, after its handle words)."""
        return self.slot_base + self.world

    @property
    def combine_slot(self) -> int:
        """``+ s``: every expert output rank s sends back in a round is placed (a SIGNAL after them)."""
        return self.slot_base + 2 * self.world

    @property
    def expert_slot(self) -> int:
        """``+ s * L + g``: every row rank s sends the local experts of our put group g in a ``dispatch_gemm``
        round is placed (a put_signal with the group's last rows, or a SIGNAL where the group is empty: one per
        (source, group) and fused round, so the flag counts ``dispatch_gemm`` rounds; plain ``dispatch`` leaves
        it alone). ``L`` slots per source; the first ``put_groups`` are used."""
        return self.slot_base + 3 * self.world

    def group_slot(self, source: int, local: int) -> int:
        """The flag that says source ``source``'s rows for our local expert ``local`` are placed."""
        return self.expert_slot + int(source) * self.local_experts + self.group_of(local)

    @property
    def slots(self) -> int:
        return 3 * self.world + self.world * self.local_experts

    # --- dispatch_gemm's timeline (``timeline=``) -----------------------------------------------------------------
    #: the events of each (rank, local expert) pair, in the timeline's order (``split_timeline``)
    TIMELINE_EVENTS = ("sent", "ready", "start", "done", "arrived")
    #: the value of a ``ready`` or ``start`` word (an atomic min) that no program wrote: read back as 0
    TIMELINE_UNSET = np.iinfo(np.int64).max

    def timeline_words(self, programs: int) -> int:
        """int64 words of a ``dispatch_gemm`` launch's timeline: ``world x L`` per event of ``TIMELINE_EVENTS``,
        then one per program."""
        return len(self.TIMELINE_EVENTS) * self.world * self.local_experts + programs

    def split_timeline(self, words: Any, programs: int) -> dict[str, np.ndarray]:
        """A launch's timeline (``timeline_words(programs)`` int64 words, any array-like) as ``world x L`` arrays
        of %globaltimer ns (0: it did not happen in that launch), and ``program_ends``:

        - ``sent[d, l]``: this rank pushed the last record of the put group holding peer d's local expert l
          (the put_signal of its group flag, or the SIGNAL of an empty group);
        - ``ready[s, l]``: a compute program first got past the wait for source s's block of local expert l;
        - ``start[s, l]`` / ``done[s, l]``: the first start and the last end of the tiles taken at source s's
          step for local expert l (a tile holding rows of several sources is taken at the latest one's);
        - ``arrived[s, l]``: the last communication program, watching source s's group flags in order once
          its own pushes are out, saw the group holding local expert l land (``ready`` waits for a compute
          program to get there; this does not).
        """
        words = np.asarray(words, dtype=np.int64)
        if words.shape != (self.timeline_words(programs),):
            raise ValueError(f"a timeline of {programs} programs is {self.timeline_words(programs)} words, got "
                             f"shape {words.shape}")
        n = len(self.TIMELINE_EVENTS) * self.world * self.local_experts
        events = words[:n].reshape(-1, self.world, self.local_experts)
        events = np.where(events == self.TIMELINE_UNSET, 0, events)
        return {**dict(zip(self.TIMELINE_EVENTS, events, strict=True)), "program_ends": words[n:]}

    def timeline_start(self, programs: int) -> np.ndarray:
        """A launch's timeline before it runs: 0, and ``TIMELINE_UNSET`` under the atomic minima."""
        words = np.zeros(self.timeline_words(programs), dtype=np.int64)
        per = self.world * self.local_experts
        words[per:3 * per] = self.TIMELINE_UNSET
        return words

    # --- the model -------------------------------------------------------------------------------------------------
    def check_topk(self, topk_idx: np.ndarray) -> np.ndarray:
        idx = np.asarray(topk_idx)
        if idx.ndim != 2 or idx.shape[1] != self.topk or idx.shape[0] > self.max_tokens:
            raise ValueError(f"topk_idx must be [tokens <= {self.max_tokens}, {self.topk}], got {idx.shape}")
        return idx.astype(np.int64)

    def normalize(self, topk_idx: np.ndarray) -> np.ndarray:
        """``topk_idx`` as the kernels keep it (int32): invalid entries and repeats within a token are -1."""
        idx = self.check_topk(topk_idx)
        out = np.where((idx >= 0) & (idx < self.num_experts), idx, -1)
        for k in range(1, self.topk):
            repeat = (out[:, :k] == out[:, k:k + 1]).any(axis=1)
            out[:, k] = np.where(repeat, -1, out[:, k])
        return out.astype(np.int32)

    def route(self, topk_idx: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """This rank's routing: ``counts`` [E] (rows to each expert), ``pos`` [tokens, K] (each valid entry's
        position among the expert's rows from this rank, -1 for invalid) and ``send_src`` [E, T] (the handle
        word of each expert's j-th row, -1 past the count)."""
        idx = self.normalize(topk_idx)
        tokens = idx.shape[0]
        counts = np.zeros(self.num_experts, dtype=np.int32)
        pos = np.full(idx.shape, -1, dtype=np.int32)
        send_src = np.full((self.num_experts, self.max_tokens), -1, dtype=np.int32)
        for e in range(self.num_experts):  # vectorised over tokens: a token holds e at most once after normalize
            t, k = np.nonzero(idx == e)
            order = np.argsort(t, kind="stable")
            t, k = t[order], k[order]
            pos[t, k] = np.arange(len(t))
            send_src[e, :len(t)] = (self.rank * self.max_tokens + t) * self.topk + k
            counts[e] = len(t)
        assert counts.sum() == (idx >= 0).sum() and (counts <= tokens).all()
        return counts, pos, send_src

    def stage_offsets(self, counts: np.ndarray) -> np.ndarray:
        """``eoff`` [E] (or [W, E] from a count matrix): where each expert's block starts in a source's stage
        rows, the exclusive sum over experts of that source's counts."""
        c = np.asarray(counts, dtype=np.int64)
        return (np.cumsum(c, axis=-1) - c).astype(np.int32)

    def stage_rows(self, topk_idx: np.ndarray) -> np.ndarray:
        """[tokens, K]: each valid entry's stage row ``eoff[e] + pos`` (-1 for invalid): where the source stages
        its row and where combine returns its expert's output."""
        counts, pos, _ = self.route(topk_idx)
        idx = self.normalize(topk_idx)
        eoff = self.stage_offsets(counts)
        return np.where(idx >= 0, eoff[np.maximum(idx, 0)] + pos, -1).astype(np.int32)

    def _chunks(self, rows: int) -> list[tuple[int, int]]:
        return [(j, min(self.put_rows, rows - j)) for j in range(0, rows, self.put_rows)]

    def dispatch_puts(self, counts_all: np.ndarray) -> list[tuple[int, int, int, int, int]]:
        """This rank's dispatch row puts: ``(peer, 0, stage row, land_x row, rows)``, the land_x row counted in the
        peer's ``land_x`` as ``rank * source_rows + offset``; one block per peer with rows (this rank's rows for
        all of its experts), split at ``land_put_rows``; rows for this rank are copied, not put. The handle
        words go apart, one put per peer (:meth:`handle_puts`)."""
        return self._land_puts(counts_all, self.local_experts, self.land_put_rows)

    def land_offsets(self, counts_all: np.ndarray) -> np.ndarray:
        """[W, L]: where source s's rows for our local expert l start in its ``land_x`` slice (the rows it sends
        us for our lower experts: an exclusive sum over l)."""
        c = np.asarray(counts_all, dtype=np.int64).reshape(self.world, self.num_experts)
        mine = c[:, self.rank * self.local_experts:(self.rank + 1) * self.local_experts]
        return (np.cumsum(mine, axis=1) - mine).astype(np.int32)

    def gemm_puts(self, counts_all: np.ndarray) -> list[tuple[int, int, int, int, int]]:
        """This rank's ``dispatch_gemm`` row puts: ``(peer, group, stage row, land_x row, rows)``, the second row
        counted in the peer's ``land_x`` as ``rank * source_rows + offset``; one per (peer, group) with rows,
        split at ``group_put_rows``. A group's rows are the stage rows of its experts, one contiguous block."""
        return self._land_puts(counts_all, self.experts_per_put, self.group_put_rows)

    def _land_puts(self, counts_all: np.ndarray, experts_per_put: int,
                   put_rows: int) -> list[tuple[int, int, int, int, int]]:
        """The row puts of groups of ``experts_per_put`` of each peer's experts into its ``land_x`` slice for this
        rank: ``(peer, group, stage row, land_x row, rows)``, pieces of ``put_rows``."""
        c = np.asarray(counts_all, dtype=np.int64).reshape(self.world, self.num_experts)
        eoff, L = self.stage_offsets(c[self.rank]), self.local_experts  # noqa: N806
        puts = []
        for d in range(self.world):
            if d == self.rank:
                continue
            for g in range(-(-L // experts_per_put)):
                first, last = d * L + g * experts_per_put, min(d * L + (g + 1) * experts_per_put, (d + 1) * L)
                rows = int(c[self.rank, first:last].sum())
                at = int(eoff[first]) - int(eoff[d * L])
                for j in range(0, rows, put_rows):
                    n = min(put_rows, rows - j)
                    puts.append((d, g, int(eoff[first]) + j, self.rank * self.source_rows + at + j, n))
        return puts

    def gemm_row_blocks(self, counts_all: np.ndarray, block_m: int,
                        split_experts: int) -> list[tuple[int, int, int, int]]:
        """The expert GEMM's row blocks in the order ``_moe_dispatch_gemm``'s compute programs take them: ``(step,
        local expert, first block, end block)`` (blocks of ``block_m`` of the expert's packed rows, every source's
        end to end in step order), step s taking source ``(rank - s) % W``'s rows (this rank's own first). A local
        expert below ``split_experts`` is taken source by source: first, at step -1 (before any peer's count is
        in), the full blocks of this rank's own rows, which lead the expert's rows; then at each step the blocks
        over that source's rows, a block that also holds other sources' rows at the step of the latest of them.
        Every other expert's blocks all go at its latest source's step. Each block of each expert appears once,
        and each (step, expert) at most once; each column block of the output is a tile of it."""
        c = np.asarray(counts_all, dtype=np.int64).reshape(self.world, self.num_experts)
        L, W = self.local_experts, self.world  # noqa: N806
        mine = c[:, self.rank * L:(self.rank + 1) * L]  # [W, L]
        offsets = self.source_offsets(c)[:, self.rank * L:(self.rank + 1) * L]
        order = (self.rank - np.arange(W)) % W  # the step at which each source's rows are taken

        def last_step(counts: np.ndarray, off: np.ndarray, r0: int, r1: int) -> int:
            inside = (counts > 0) & (off < r1) & (off + counts > r0)
            return int(order[inside].max()) if inside.any() else -1

        early = [int(mine[self.rank, local]) // block_m if local < split_experts else 0 for local in range(L)]
        blocks = [(-1, local, 0, early[local]) for local in range(L) if early[local]]
        for step in range(W):
            src = (self.rank - step) % W
            for local in range(L):
                counts, off = mine[:, local], offsets[:, local]
                n, c_src, off_src = int(counts.sum()), int(counts[src]), int(off[src])
                if c_src == 0:
                    continue
                if local >= split_experts:
                    lo, hi = 0, -(-n // block_m) if last_step(counts, off, 0, n) == step else 0
                else:
                    first, last = off_src // block_m, (off_src + c_src - 1) // block_m
                    lo = first + (last_step(counts, off, first * block_m, (first + 1) * block_m) != step)
                    hi = last + 1 - (last_step(counts, off, last * block_m, (last + 1) * block_m) != step)
                    lo = max(lo, early[local])  # the own full blocks went at step -1
                if hi > lo:
                    blocks.append((step, local, lo, hi))
        return blocks

    def gemm_work(self, counts_all: np.ndarray, block_m: int, split_experts: int) -> tuple[int, int]:
        """``(weight passes, row-block rows)`` of the expert GEMM (:meth:`gemm_row_blocks`): how many times the
        local experts' weights are streamed in all (one per expert and step that takes some of its blocks: the
        programs then run its column blocks, each read once from HBM) and the rows its blocks span (``block_m``
        a block; the received rows over it is the tensor cores' fill)."""
        blocks = self.gemm_row_blocks(counts_all, block_m, split_experts)  # one entry per (step, expert) pass
        return len(blocks), sum(hi - lo for *_, lo, hi in blocks) * block_m

    def handle_puts(self) -> list[tuple[int, int, int, int]]:
        """This rank's handle-word puts of a dispatch: ``(peer, send_src word, src_stage word, words)``, one per
        peer (split at ``handle_words``): ``send_src`` rows ``peer * L ...`` (``L * T`` words) to the peer's
        ``src_stage`` slice for this rank, whatever the counts."""
        n = self.local_experts * self.max_tokens
        return [(peer, peer * n + j, self.rank * n + j, min(self.handle_words, n - j))
                for peer in range(self.world) if peer != self.rank for j in range(0, n, self.handle_words)]

    def combine_puts(self, counts_all: np.ndarray) -> list[tuple[int, int, int, int, int]]:
        """This rank's combine puts, as the experts' rank: ``(source, expert, y row, combine row, rows)``, the y
        row counted in ``[L * W * T]`` (``local * W * T + offset``), the combine row in the source's stage
        rows; one per (local expert, remote source) block with rows, split at ``put_rows``."""
        c = np.asarray(counts_all, dtype=np.int64).reshape(self.world, self.num_experts)
        eoff, off = self.stage_offsets(c), self.source_offsets(c)
        puts = []
        for local in range(self.local_experts):
            e = self.rank * self.local_experts + local
            for s in range(self.world):
                if s != self.rank:
                    for j, n in self._chunks(int(c[s, e])):
                        puts.append((s, e, local * self.capacity + int(off[s, e]) + j, int(eoff[s, e]) + j, n))
        return puts

    def writes(self, counts_all: np.ndarray) -> dict[str, list[int]]:
        """Records this rank pushes per destination in a round (0 for itself): ``dispatch`` (the count
        put_signal, the row put of its block, or one per piece of a split block, the handle-word put, the SIGNAL),
        ``dispatch_gemm`` (the count put_signal, a row put per group piece, the last of a group a put_signal of
        its flag, a SIGNAL of the flag per empty group, the handle-word put, the SIGNAL) and ``combine`` (the
        output puts, the SIGNAL)."""
        dispatch, combine = [0] * self.world, [0] * self.world
        for peer in range(self.world):
            if peer != self.rank:
                dispatch[peer] = 2
                combine[peer] = 1
        for peer, _, _, _ in self.handle_puts():
            dispatch[peer] += 1
        c = np.asarray(counts_all, dtype=np.int64).reshape(self.world, self.num_experts)
        for d, _, _, _, _ in self.dispatch_puts(c):
            dispatch[d] += 1
        for s, _, _, _, _ in self.combine_puts(c):
            combine[s] += 1
        gemm = [0] * self.world
        for peer in range(self.world):
            if peer != self.rank:
                gemm[peer] = 2 + self.put_groups  # count, dispatch, and each group's flag (put_signal or SIGNAL)
        for peer, _, _, _ in self.handle_puts():
            gemm[peer] += 1
        # a group's last piece is its flag's put_signal, counted above: its other pieces are plain puts
        for (d, _), pieces in Counter((d, g) for d, g, _, _, _ in self.gemm_puts(c)).items():
            gemm[d] += pieces - 1
        return {"dispatch": dispatch, "dispatch_gemm": gemm, "combine": combine}

    def signals(self, gemm: bool = False) -> list[int]:
        """Signals this rank pushes per destination in a dispatch round (0 for itself): the count put_signal
        and the dispatch SIGNAL, plus, for ``dispatch_gemm``, one per put group there (its flag)."""
        per = 2 + (self.put_groups if gemm else 0)
        return [per * (peer != self.rank) for peer in range(self.world)]

    def source_offsets(self, counts_all: np.ndarray) -> np.ndarray:
        """[W, E]: where source s's rows start in expert e's receive rows (the counts of the sources that come
        before s at the expert's rank: its own rows first, then its ring predecessors')."""
        c = np.asarray(counts_all, dtype=np.int64).reshape(self.world, self.num_experts)
        step = (np.arange(self.num_experts)[None, :] // self.local_experts - np.arange(self.world)[:, None]) \
            % self.world  # [W, E]: source s's step at expert e's rank
        return np.stack([(c * (step < step[s])).sum(axis=0) for s in range(self.world)]).astype(np.int32)

    def destination(self, counts_all: np.ndarray, expert: int, pos: int) -> tuple[int, int, int]:
        """(rank, local expert, row) where this rank's entry with ``pos`` for ``expert`` lands."""
        d, local = self.owner(expert)
        return d, local, int(self.source_offsets(counts_all)[self.rank, expert]) + int(pos)

    def receive(self, counts_all: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """This rank's receive side from every source's counts ([W, E]): ``recv_count`` [L] and ``recv_layout``
        [L, W, 2] (offset, count of the rows from each source)."""
        c = np.asarray(counts_all, dtype=np.int64).reshape(self.world, self.num_experts)
        local = slice(self.rank * self.local_experts, (self.rank + 1) * self.local_experts)
        mine = c[:, local].T  # [L, W]
        layout = np.stack([self.source_offsets(c)[:, local].T, mine], axis=-1).astype(np.int32)
        recv_count = mine.sum(axis=1).astype(np.int32)
        assert (recv_count <= self.capacity).all()
        return recv_count, layout


def _place(dst: np.ndarray, rows: np.ndarray, what: str) -> None:
    """Write ``rows`` into ``dst``, a view whose slots must all still be empty (-1): no two rows share a slot."""
    assert (dst == -1).all(), what
    dst[:] = rows


def dispatch_model(layouts: list[MoELayout], topk_idx: list[np.ndarray]) -> list[dict[str, np.ndarray]]:
    """Every rank's dispatch, from every rank's ``topk_idx``: per rank ``counts_all`` [W, E], ``recv_count`` [L],
    ``recv_layout`` [L, W, 2], ``recv_src`` [L, W*T] (-1 where no row lands), its own ``idx``, ``pos`` and
    ``stage_row`` [tokens, K], and ``stage_src`` [T*K] (the handle word of the entry each stage row holds, -1
    past the valid entries). The rows move as the kernels move them: staged expert-major (a rank's own straight to
    its receive rows), one block per (source, peer) into the peer's ``land_x`` slice, then packed by the peer,
    which must place each entry where :meth:`MoELayout.destination` says."""
    routes = [lay.route(idx) for lay, idx in zip(layouts, topk_idx, strict=True)]
    counts_all = np.stack([r[0] for r in routes])
    out = []
    for lay in layouts:
        recv_count, recv_layout = lay.receive(counts_all)
        out.append({"counts_all": counts_all, "recv_count": recv_count, "recv_layout": recv_layout,
                    "recv_src": np.full((lay.local_experts, lay.capacity), -1, dtype=np.int32),
                    "idx": lay.normalize(topk_idx[lay.rank]), "pos": routes[lay.rank][1],
                    "stage_row": lay.stage_rows(topk_idx[lay.rank])})
    lands = [np.full((lay.world, lay.source_rows), -1, dtype=np.int32) for lay in layouts]  # land_x, as words
    for src, lay in enumerate(layouts):  # what each source's route, stage and send kernels do
        idx, rows = out[src]["idx"], out[src]["stage_row"]
        stage = np.full(lay.stage_capacity, -1, dtype=np.int32)
        for t, k in zip(*np.nonzero(idx >= 0), strict=True):  # staging: entry by entry, expert-major
            assert stage[rows[t, k]] == -1, "two entries staged on one row"
            stage[rows[t, k]] = lay.encode(src, t, k)
        out[src]["stage_src"] = stage
        eoff, off = lay.stage_offsets(counts_all[src]), lay.source_offsets(counts_all)[src]
        for e in range(lay.num_experts):  # an own expert's block goes straight to its receive rows
            d, local = lay.owner(e)
            n = int(counts_all[src, e])
            block = stage[eoff[e]:eoff[e] + n]
            assert (block >= 0).all() and all(idx[lay.decode(w)[1:]] == e for w in block), "a block of other rows"
            if d == src:
                _place(out[d]["recv_src"][local, off[e]:off[e] + n], block, "two rows landed on one slot")
        # the puts: each peer's block, once, into the peer's land_x slice for this source
        puts = lay.dispatch_puts(counts_all)
        for d, _, first, to, n in puts:
            assert d != src and to // lay.source_rows == src
            _place(lands[d].reshape(-1)[to:to + n], stage[first:first + n], "two rows landed on one land_x row")
        for d in range(lay.world):  # every remote row went, in pieces that add up to the peer's block
            want = int(counts_all[src, d * lay.local_experts:(d + 1) * lay.local_experts].sum()) * (d != src)
            assert sum(n for d2, *_, n in puts if d2 == d) == want
    for d, lay in enumerate(layouts):  # each destination packs its peers' landed rows into the receive rows
        at, off = lay.land_offsets(counts_all), lay.source_offsets(counts_all)
        for local in range(lay.local_experts):
            e = d * lay.local_experts + local
            for s in range(lay.world):
                if s != d:
                    n = int(counts_all[s, e])
                    _place(out[d]["recv_src"][local, off[s, e]:off[s, e] + n],
                           lands[d][s, at[s, local]:at[s, local] + n], "two rows packed on one slot")
    for src, lay in enumerate(layouts):  # each entry is where its destination says
        idx = out[src]["idx"]
        for t, k in zip(*np.nonzero(idx >= 0), strict=True):
            d, local, row = lay.destination(counts_all, idx[t, k], out[src]["pos"][t, k])
            assert out[d]["recv_src"][local, row] == lay.encode(src, t, k)
    # the handle words as the kernels move them: one put per (source, destination) of the source's send_src rows
    # of the destination's experts into the destination's src_stage, then each (expert, source) run scattered to
    # where that source's rows landed (a rank's own words go with its rows): the same recv_src as the blocks
    stages = [np.full((lay.world, lay.local_experts * lay.max_tokens), -1, dtype=np.int32) for lay in layouts]
    for src, lay in enumerate(layouts):
        words = routes[src][2].reshape(-1)
        for peer, at, to, n in lay.handle_puts():
            stages[peer].reshape(-1)[to:to + n] = words[at:at + n]
    for d, lay in enumerate(layouts):
        stage = stages[d].reshape(lay.world, lay.local_experts, lay.max_tokens)
        off = lay.source_offsets(counts_all)
        scattered = np.full_like(out[d]["recv_src"], -1)
        for local in range(lay.local_experts):
            e = d * lay.local_experts + local
            for s in range(lay.world):
                n = int(counts_all[s, e])
                run = routes[s][2][e, :n] if s == d else stage[s, local, :n]
                scattered[local, off[s, e]:off[s, e] + n] = run
        assert (scattered == out[d]["recv_src"]).all(), "the staged handle words scatter elsewhere"
    return out


def combine_model(layouts: list[MoELayout], received: list[dict[str, np.ndarray]], expert_out: list[np.ndarray],
                  weights: list[np.ndarray]) -> list[np.ndarray]:
    """Every rank's combine: ``expert_out[r]`` is rank r's output in its receive layout [L, W*T, H]; returns per
    rank [tokens, H] float64, the weighted sum over each token's valid entries of its experts' rows. The rows
    move as the kernels move them: each (local expert, source) block of the output to the source's combine
    rows at the source's stage rows, then each entry read back from its stage row."""
    lay0 = layouts[0]
    combine = [np.zeros((lay.stage_capacity, lay.hidden)) for lay in layouts]
    written = [np.zeros(lay.stage_capacity, dtype=bool) for lay in layouts]
    for d, lay in enumerate(layouts):  # the experts' rank: one block per (local expert, source)
        c = np.asarray(received[d]["counts_all"], dtype=np.int64)
        eoff, off = lay.stage_offsets(c), lay.source_offsets(c)
        for local in range(lay.local_experts):
            e = d * lay.local_experts + local
            for s in range(lay.world):
                n = int(c[s, e])
                assert not written[s][eoff[s, e]:eoff[s, e] + n].any(), "two outputs on one combine row"
                combine[s][eoff[s, e]:eoff[s, e] + n] = np.asarray(expert_out[d][local, off[s, e]:off[s, e] + n],
                                                                   dtype=np.float64)
                written[s][eoff[s, e]:eoff[s, e] + n] = True
        assert sum(n for *_, n in lay.combine_puts(c)) == sum(
            int(c[s, e]) for s in range(lay.world) if s != d
            for e in range(d * lay.local_experts, (d + 1) * lay.local_experts))
    outs = [np.zeros((w.shape[0], lay0.hidden)) for w in weights]
    for r in range(len(layouts)):  # the home rank: each valid entry from its stage row
        idx, rows = received[r]["idx"], received[r]["stage_row"]
        for t, k in zip(*np.nonzero(idx >= 0), strict=True):
            assert written[r][rows[t, k]], "a combine row nobody wrote"
            outs[r][t] += weights[r][t, k] * combine[r][rows[t, k]]
    return outs
