"""Chunk plans, host side: one distributed buffer as seen by one rank, as the tables behind ``tpd::Plan``.

A plan maps three granularities that stay independent (mKernel): a *tile* is what the producing kernel
computes at once (``tile_bytes`` of the source), a *chunk* is what travels as one put_signal (a whole number
of tiles; the last chunk of a segment may be short), and the proxy's batch is the daemon's. Each chunk goes
to zero or more (peer, region, offset) destinations and raises one flag slot on each receiver.

``PLAN_DTYPE`` and the table dtypes mirror ``include/transportd/plan_device.cuh`` byte for byte (a test
compiles a probe against the header and compares every offset)::

    word 0  | chunks:u64      PlanChunk[chunk_count]: this rank's outgoing chunks (source side)
    word 1  | sends:u64       PlanSend[send_count]: chunk c's sends are sends[first_send, +send_count)
    word 2  | recvs:u64       PlanRecv[recv_count]: incoming chunks, by source rank, then by offset
    word 3  | tile_chunk:u64  u32[tile_count]: the one chunk each compute tile belongs to
    word 4  | recv_index:u64  u32[world + 1]: rank r's incoming chunks are recvs[idx[r], idx[r+1])
    word 5  | counters:u64    u32[chunk_count]: tile arrivals per chunk (device memory, monotonic)
    word 6  | epoch:u64       the launch number, from 1
    word 7  | tile_count:u32 | chunk_count:u32
    word 8  | send_count:u32 | recv_count:u32
    word 9  | rank:u32       | world:u32
    word 10 | abi:u32        | slot_base:u32
    word 11 | slot_count:u32 | reserved:u32

Every rank builds its plan from the same global description (the templates take the job's whole shape), so
plans agree without talking: the flag slots of a receiver are assigned in one canonical order (its
incoming chunks by source rank, then by offset, from ``slot_base``), and a sender computes the slot its
peer will wait on. Epochs come from the monotonic flags: a send adds ``value`` once per launch, so launch
``k`` waits for ``k * value``; the per-chunk tile counters are monotonic too. Nothing is reset.

Plans are push-only: the producer ships each chunk with put_signal. A pull plan (the receiver reads)
would need a GET command through the ring, the proxy and every backend, which does not exist.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from gpuclient.errors import PlanError

if TYPE_CHECKING:
    from gpuclient.cuda_memory import DeviceMemory

__all__ = ["NO_RECV", "PLAN_ABI", "PLAN_CHUNK_DTYPE", "PLAN_DTYPE", "PLAN_RECV_DTYPE", "PLAN_SEND_DTYPE",
           "PLAN_SIZE", "ChunkPlan", "DevicePlan", "Segment"]

PLAN_ABI = 1  # TPD_PLAN_ABI
PLAN_SIZE = 96  # TPD_PLAN_SIZE
U16_MAX = 0xFFFF
U32_MAX = 0xFFFF_FFFF
U64_MAX = 0xFFFF_FFFF_FFFF_FFFF
OFF_MAX = (1 << 62) - 1  # offsets and sizes (regions are at most 1 TiB): sums stay within int64
NO_RECV = U32_MAX  # ChunkPlan.forwards: the chunk carries the rank's own bytes

PLAN_CHUNK_DTYPE = np.dtype(
    [("src_off", "<u8"), ("bytes", "<u4"), ("tiles", "<u4"), ("first_send", "<u4"), ("send_count", "<u2"),
     ("src_region", "<u2")],
    align=True,
)
PLAN_SEND_DTYPE = np.dtype(
    [("dst_off", "<u8"), ("slot", "<u4"), ("value", "<u4"), ("peer", "<u2"), ("dst_region", "<u2"),
     ("chunk_id", "<u4")],
    align=True,
)
PLAN_RECV_DTYPE = np.dtype(
    [("off", "<u8"), ("bytes", "<u4"), ("slot", "<u4"), ("value", "<u4"), ("source", "<u4")],
    align=True,
)
PLAN_DTYPE = np.dtype(
    [("chunks", "<u8"), ("sends", "<u8"), ("recvs", "<u8"), ("tile_chunk", "<u8"), ("recv_index", "<u8"),
     ("counters", "<u8"), ("epoch", "<u8"), ("tile_count", "<u4"), ("chunk_count", "<u4"), ("send_count", "<u4"),
     ("recv_count", "<u4"), ("rank", "<u4"), ("world", "<u4"), ("abi", "<u4"), ("slot_base", "<u4"),
     ("slot_count", "<u4"), ("reserved", "<u4")],
    align=True,
)
assert PLAN_CHUNK_DTYPE.itemsize == 24 and PLAN_SEND_DTYPE.itemsize == 24 and PLAN_RECV_DTYPE.itemsize == 24
assert PLAN_DTYPE.itemsize == PLAN_SIZE

_TABLES = ("chunks", "sends", "recvs", "tile_chunk", "recv_index")
_ALIGN = 256  # each table's offset in the one device allocation


@dataclass(frozen=True)
class Segment:
    """A contiguous source range of one rank, cut into chunks and sent whole to each destination.

    ``dests`` holds ``(peer, dst_region, dst_off)``: chunk bytes at ``src_off + x`` land at ``dst_off + x``.
    A segment with no destinations still has tiles and chunks (the rank's own part, say), which ship nowhere.
    ``step`` orders a rank's chunks (the ring's steps; 0 elsewhere).
    """

    source: int
    src_region: int
    src_off: int
    nbytes: int
    dests: tuple[tuple[int, int, int], ...] = ()
    step: int = 0


Cover = Sequence[Sequence[tuple[int, int, int]]]  # per rank: (region, off, nbytes) ranges covered exactly once


def _int(field: str, value: Any, lo: int = 0, hi: int = U64_MAX) -> int:
    """``value`` as an int in [lo, hi], else a PlanError naming ``field``."""
    try:
        if isinstance(value, bool):
            raise TypeError
        out = operator.index(value)
    except TypeError:
        raise PlanError(field, f"must be an integer, got {value!r}") from None
    if not lo <= out <= hi:
        raise PlanError(field, f"{out} is out of range [{lo}, {hi}]")
    return out


def _chunk_tiles(tile_bytes: int, chunk_tiles: int | None, chunk_bytes: int | None) -> int:
    if (chunk_tiles is None) == (chunk_bytes is None):
        raise PlanError("chunk_tiles", "give exactly one of chunk_tiles or chunk_bytes")
    if chunk_bytes is not None:
        chunk_bytes = _int("chunk_bytes", chunk_bytes, 1, U64_MAX)
        if chunk_bytes > U32_MAX:
            raise PlanError("chunk_bytes", f"{chunk_bytes} does not fit the 32-bit length (at most {U32_MAX})")
        if chunk_bytes % tile_bytes:
            raise PlanError("chunk_bytes", f"{chunk_bytes} is not a whole number of tiles of {tile_bytes} bytes")
        chunk_tiles = chunk_bytes // tile_bytes
    tiles = _int("chunk_tiles", chunk_tiles, 1, U32_MAX)
    if tiles * tile_bytes > U32_MAX:
        raise PlanError("chunk_bytes", f"a chunk of {tiles} x {tile_bytes} bytes does not fit the 32-bit length "
                                       f"(at most {U32_MAX})")
    return tiles


def _sizes(field: str, value: int | Sequence[int], world: int) -> list[int]:
    """A per-rank size list: one integer > 0 for every rank, or ``world`` integers >= 0."""
    if isinstance(value, (int, np.integer)):
        return [_int(field, value, 1)] * world
    sizes = [_int(field, v, 0) for v in value]
    if len(sizes) != world:
        raise PlanError(field, f"has {len(sizes)} entries for a world of {world}")
    return sizes


def _prefix(sizes: Sequence[int]) -> list[int]:
    out = [0]
    for s in sizes:
        out.append(out[-1] + s)
    return out


class ChunkPlan:
    """One rank's chunk plan: numpy tables mirrored by ``tpd::Plan``, uploaded once by :meth:`to_device`.

    Build one with a template (:meth:`all_gather`, :meth:`reduce_scatter`, :meth:`all_to_all`, :meth:`ring`)
    or from the job's whole list of :class:`Segment` (every rank passes the same list). Tables:

    * ``chunks`` (PLAN_CHUNK_DTYPE): this rank's outgoing chunks, ordered by step, then segment, then offset;
    * ``sends`` (PLAN_SEND_DTYPE): each chunk's destinations, with the receiver's flag slot;
    * ``recvs`` (PLAN_RECV_DTYPE) and ``recv_index`` (u32[world + 1]): incoming chunks by source rank, then
      offset in this rank's one receive region; slot ``slot_base + i`` for incoming chunk ``i``;
    * ``tile_chunk`` (u32 per tile): tiles are ``tile_bytes`` pieces of each chunk in chunk order (the last
      of a segment may be short); ``tile_off`` (u64, host only) is where each starts in its source region;
    * ``step_index`` (u32, host only): chunks of step ``s`` are ``step_chunks(s)``; ``forwards`` (u32 per
      chunk, host only): for the ring, the index in ``recvs`` of the incoming chunk a chunk passes on.
    """

    def __init__(self, rank: int, world: int, segments: Iterable[Segment], *, tile_bytes: int,
                 chunk_tiles: int | None = None, chunk_bytes: int | None = None, slot_base: int = 0, value: int = 1,
                 flag_count: int | None = None, region_bytes: Mapping[int, int] | Sequence[Mapping[int, int]] | None
                 = None, src_cover: Cover | None = None, dst_cover: Cover | None = None, kind: str = "custom") -> None:
        """Every rank passes the job's same ``segments``; this rank's tables are cut from them.

        ``region_bytes`` (region id -> size, or one such mapping per rank) refuses a chunk past its region;
        ``flag_count`` refuses slots past the flag array; ``src_cover`` / ``dst_cover`` (per rank, a list of
        ``(region, off, nbytes)``) refuse gaps: the segments (resp. the incoming bytes) must cover exactly
        those ranges. Every check raises PlanError naming the field.
        """
        self.world = _int("world", world, 1, U16_MAX)
        self.rank = _int("rank", rank, 0, self.world - 1)
        self.tile_bytes = _int("tile_bytes", tile_bytes, 1, U32_MAX)
        self.chunk_tiles = _chunk_tiles(self.tile_bytes, chunk_tiles, chunk_bytes)
        self.chunk_bytes = self.chunk_tiles * self.tile_bytes
        self.slot_base = _int("slot_base", slot_base, 0, U32_MAX)
        self.value = _int("value", value, 1, U32_MAX)
        self.kind = kind
        self._device: DevicePlan | None = None
        segs = [self._segment(s) for s in segments]
        # a rank's chunks go in step order (stable): the ring's kernel walks steps
        segs = [segs[i] for i in sorted(range(len(segs)), key=lambda i: (segs[i].source, segs[i].step, i))]
        self._check_segments(segs, region_bytes, src_cover, dst_cover)
        self._build(segs, flag_count)
        self.check()

    # --- templates ---------------------------------------------------------------------------------------------
    @classmethod
    def all_gather(cls, rank: int, world: int, shard_bytes: int | Sequence[int], tile_bytes: int, *,
                   chunk_tiles: int | None = None, chunk_bytes: int | None = None, dst_region: int = 0,
                   dst_base: int = 0, src_region: int | None = None, src_base: int | None = None,
                   slot_base: int = 0, value: int = 1, flag_count: int | None = None,
                   region_bytes: Mapping[int, int] | Sequence[Mapping[int, int]] | None = None) -> ChunkPlan:
        """Rank i's shard lands at ``dst_base + sum(shard_bytes[:i])`` of every other rank's ``dst_region``.

        ``shard_bytes``: one size for every rank, or one per rank (0: that rank contributes nothing). The
        shard sits at ``src_base`` of ``src_region``; by default in place (``src_region`` is ``dst_region``,
        the shard at its own offset in the gathered layout), or at 0 of a separate ``src_region``.
        """
        world = _int("world", world, 1, U16_MAX)
        sizes = _sizes("shard_bytes", shard_bytes, world)
        offs = _prefix(sizes)
        in_place = src_region is None or src_region == dst_region
        src_region = dst_region if src_region is None else src_region
        segs, src_cover, dst_cover = [], [], []
        for i, size in enumerate(sizes):
            src_off = src_base if src_base is not None else dst_base + offs[i] if in_place else 0
            src_cover.append([(src_region, src_off, size)] if size else [])
            dst_cover.append([(dst_region, dst_base + offs[j], sizes[j]) for j in range(world) if j != i and sizes[j]])
            if size:
                dests = tuple((j, dst_region, dst_base + offs[i]) for j in range(world) if j != i)
                segs.append(Segment(i, src_region, src_off, size, dests))
        return cls(rank, world, segs, tile_bytes=tile_bytes, chunk_tiles=chunk_tiles, chunk_bytes=chunk_bytes,
                   slot_base=slot_base, value=value, flag_count=flag_count, region_bytes=region_bytes,
                   src_cover=src_cover, dst_cover=dst_cover, kind="all_gather")

    @classmethod
    def reduce_scatter(cls, rank: int, world: int, segment_bytes: int | Sequence[int], tile_bytes: int, *,
                       chunk_tiles: int | None = None, chunk_bytes: int | None = None, src_region: int = 0,
                       src_base: int = 0, dst_region: int = 0, dst_base: int = 0, slot_base: int = 0,
                       value: int = 1, flag_count: int | None = None,
                       region_bytes: Mapping[int, int] | Sequence[Mapping[int, int]] | None = None) -> ChunkPlan:
        """Each rank's buffer holds ``world`` segments; segment j goes to rank j, and lands in j's staging
        ``dst_region`` at ``dst_base + i * segment_bytes[j]`` for sender i (j then reduces the world parts).

        ``segment_bytes``: one size, or one per destination rank (the same list on every rank). Segment j
        sits at ``src_base + sum(segment_bytes[:j])``. A rank's own segment has tiles and chunks that ship
        nowhere (``send_count`` 0), so ``tile_done`` may be called for every tile of the buffer.
        """
        world = _int("world", world, 1, U16_MAX)
        sizes = _sizes("segment_bytes", segment_bytes, world)
        offs = _prefix(sizes)
        segs, src_cover, dst_cover = [], [], []
        for i in range(world):
            src_cover.append([(src_region, src_base + offs[j], sizes[j]) for j in range(world) if sizes[j]])
            dst_cover.append([(dst_region, dst_base + k * sizes[i], sizes[i]) for k in range(world)
                              if k != i and sizes[i]])
            for j in range(world):
                if sizes[j]:
                    dests = ((j, dst_region, dst_base + i * sizes[j]),) if j != i else ()
                    segs.append(Segment(i, src_region, src_base + offs[j], sizes[j], dests))
        return cls(rank, world, segs, tile_bytes=tile_bytes, chunk_tiles=chunk_tiles, chunk_bytes=chunk_bytes,
                   slot_base=slot_base, value=value, flag_count=flag_count, region_bytes=region_bytes,
                   src_cover=src_cover, dst_cover=dst_cover, kind="reduce_scatter")

    @classmethod
    def all_to_all(cls, rank: int, world: int, counts: Sequence[Sequence[int]], tile_bytes: int, *,
                   item_bytes: int = 1, chunk_tiles: int | None = None, chunk_bytes: int | None = None,
                   src_region: int = 0, src_base: int = 0, dst_region: int = 0, dst_base: int = 0,
                   slot_base: int = 0, value: int = 1, flag_count: int | None = None,
                   region_bytes: Mapping[int, int] | Sequence[Mapping[int, int]] | None = None) -> ChunkPlan:
        """Variable counts (MoE dispatch/combine): rank i sends ``counts[i][j] * item_bytes`` bytes to rank j.

        Offsets are exclusive prefix sums: rank i's part for j starts at ``src_base`` plus its row's earlier
        cells, and lands at ``dst_base`` plus column j's earlier cells (so rank j's own cell keeps its place
        for the local copy). Zero cells make no chunk and no slot; the diagonal cell has chunks that ship
        nowhere; a rank that receives nothing has empty recv tables.
        """
        world = _int("world", world, 1, U16_MAX)
        item = _int("item_bytes", item_bytes, 1, U32_MAX)
        rows = [list(r) for r in counts]
        if len(rows) != world or any(len(r) != world for r in rows):
            raise PlanError("counts", f"must be a {world} x {world} matrix")
        size = [[_int("counts", c, 0) * item for c in row] for row in rows]
        row_off = [_prefix(row) for row in size]
        col_off = [_prefix([size[i][j] for i in range(world)]) for j in range(world)]
        segs, src_cover, dst_cover = [], [], []
        for i in range(world):
            src_cover.append([(src_region, src_base + row_off[i][j], size[i][j]) for j in range(world) if size[i][j]])
            dst_cover.append([(dst_region, dst_base + col_off[i][k], size[k][i]) for k in range(world)
                              if k != i and size[k][i]])
            for j in range(world):
                if size[i][j]:
                    dests = ((j, dst_region, dst_base + col_off[j][i]),) if j != i else ()
                    segs.append(Segment(i, src_region, src_base + row_off[i][j], size[i][j], dests))
        return cls(rank, world, segs, tile_bytes=tile_bytes, chunk_tiles=chunk_tiles, chunk_bytes=chunk_bytes,
                   slot_base=slot_base, value=value, flag_count=flag_count, region_bytes=region_bytes,
                   src_cover=src_cover, dst_cover=dst_cover, kind="all_to_all")

    @classmethod
    def ring(cls, rank: int, world: int, block_bytes: int, tile_bytes: int, *, chunk_tiles: int | None = None,
             chunk_bytes: int | None = None, src_region: int = 0, dst_region: int | None = None, base: int = 0,
             slot_base: int = 0, value: int = 1, flag_count: int | None = None,
             region_bytes: Mapping[int, int] | Sequence[Mapping[int, int]] | None = None) -> ChunkPlan:
        """Ring pass-along (ring attention): the block of origin o lives at ``base + o * block_bytes`` of
        every rank's buffer, and every block travels around the ring to every rank.

        At step s (1 .. world-1) rank r sends to ``(r + 1) % world`` the block it received at step s-1 (at
        step 1, its own): the block of origin ``(r - s + 1) % world``. So at step s it receives the block of
        origin ``(r - s) % world`` from ``(r - 1) % world``. ``step_chunks(s)`` are the chunks of step s and,
        for s >= 2, ``forwards[c]`` is the incoming chunk (an index in ``recvs``; the same offset and length)
        that chunk c passes on: the kernel waits for it (``wait_range`` over the chunk's bytes, or
        ``wait_chunk``), then ships c (``ship_chunk``, or ``tile_done`` for each of its tiles).
        """
        world = _int("world", world, 1, U16_MAX)
        block = _int("block_bytes", block_bytes, 1)
        dst_region = src_region if dst_region is None else dst_region
        segs, src_cover, dst_cover = [], [], []
        for i in range(world):
            src_cover.append([(src_region, base + ((i - s + 1) % world) * block, block) for s in range(1, world)])
            dst_cover.append([(dst_region, base + o * block, block) for o in range(world) if o != i])
            for s in range(1, world):
                off = base + ((i - s + 1) % world) * block
                segs.append(Segment(i, src_region, off, block, (((i + 1) % world, dst_region, off),), step=s))
        plan = cls(rank, world, segs, tile_bytes=tile_bytes, chunk_tiles=chunk_tiles, chunk_bytes=chunk_bytes,
                   slot_base=slot_base, value=value, flag_count=flag_count, region_bytes=region_bytes,
                   src_cover=src_cover, dst_cover=dst_cover, kind="ring")
        left = (plan.rank - 1) % world
        lo, hi = int(plan.recv_index[left]), int(plan.recv_index[left + 1])
        offs = plan.recvs["off"][lo:hi]
        for c in range(plan.step_index[2] if len(plan.step_index) > 2 else 0, plan.chunk_count):
            i = lo + int(np.searchsorted(offs, plan.chunks["src_off"][c]))
            assert i < hi and plan.recvs["off"][i] == plan.chunks["src_off"][c], "ring: a forward without its arrival"
            plan.forwards[c] = i
        return plan

    # --- building -------------------------------------------------------------------------------------------
    def _segment(self, s: Segment) -> Segment:
        world = self.world
        dests = tuple((_int("peer", p, 0, world - 1), _int("dst_region", r, 0, U16_MAX), _int("dst_off", o, 0, OFF_MAX))
                      for p, r, o in s.dests)
        if len(dests) > U16_MAX:
            raise PlanError("send_count", f"a segment of rank {s.source} has {len(dests)} destinations, "
                                          f"more than {U16_MAX}")
        return Segment(_int("source", s.source, 0, world - 1), _int("src_region", s.src_region, 0, U16_MAX),
                       _int("src_off", s.src_off, 0, OFF_MAX), _int("nbytes", s.nbytes, 1, OFF_MAX), dests,
                       _int("step", s.step, 0, 1 << 20))

    def _check_segments(self, segs: list[Segment], region_bytes: Any, src_cover: Cover | None,
                        dst_cover: Cover | None) -> None:
        world = self.world
        src: dict[tuple[int, int], list[tuple[int, int, int]]] = {}  # (rank, region) -> [(off, end, source)]
        dst: dict[tuple[int, int], list[tuple[int, int, int]]] = {}
        dst_region: dict[int, int] = {}
        for s in segs:
            src.setdefault((s.source, s.src_region), []).append((s.src_off, s.src_off + s.nbytes, s.source))
            for peer, region, off in s.dests:
                if dst_region.setdefault(peer, region) != region:
                    raise PlanError("dst_region", f"rank {peer} receives into regions {dst_region[peer]} and "
                                                  f"{region}: a plan has one receive region per rank")
                dst.setdefault((peer, region), []).append((off, off + s.nbytes, s.source))
        for field, side in (("src_off", src), ("dst_off", dst)):
            for (r, region), spans in side.items():
                spans.sort()
                for (a0, a1, sa), (b0, b1, sb) in zip(spans, spans[1:], strict=False):
                    if b0 < a1:
                        what = "outgoing" if field == "src_off" else f"incoming (from ranks {sa} and {sb})"
                        raise PlanError(field, f"{what} bytes [{a0}, {a1}) and [{b0}, {b1}) overlap in rank {r}'s "
                                               f"region {region}")
        if region_bytes is not None:
            for field, side in (("src_region", src), ("dst_region", dst)):
                for (r, region), spans in side.items():
                    table = region_bytes if isinstance(region_bytes, Mapping) else region_bytes[r]
                    if region not in table:
                        raise PlanError(field, f"region {region} of rank {r} is not in region_bytes")
                    end = max(e for _, e, _ in spans)
                    if end > table[region]:
                        raise PlanError(field, f"a chunk ends at byte {end} of rank {r}'s region {region}, which "
                                               f"holds {table[region]} bytes (region_bytes)")
        for field, side, cover in (("src_off", src, src_cover), ("dst_off", dst, dst_cover)):
            if cover is None:
                continue
            for r in range(world):
                want = sorted((reg, off, off + n) for reg, off, n in cover[r] if n)
                have = sorted((reg, a, b) for (rr, reg), spans in side.items() if rr == r for a, b, _ in spans)
                _check_cover(field, r, want, have)

    def _build(self, segs: list[Segment], flag_count: int | None) -> None:
        tb, ct, cb, world = self.tile_bytes, self.chunk_tiles, self.chunk_bytes, self.world
        # every rank's chunks (global), then every send (global) so that receivers' slots are known;
        # the segments are sorted by source, so each rank's chunks are consecutive
        i64 = np.int64
        g_src, g_region, g_off, g_bytes, g_step = (np.array([getattr(s, f) for s in segs], dtype=i64)
                                                   for f in ("source", "src_region", "src_off", "nbytes", "step"))
        g_tiles = -(-g_bytes // tb)
        g_n = -(-g_tiles // ct)  # chunks per segment
        seg = np.repeat(np.arange(len(segs)), g_n)
        k = _within(g_n)  # the chunk's index in its segment
        rel = k * cb
        c_src, c_region, c_step = g_src[seg], g_region[seg], g_step[seg]
        c_off = g_off[seg] + rel
        c_bytes = np.minimum(cb, g_bytes[seg] - rel)
        c_tiles = np.minimum(ct, g_tiles[seg] - k * ct)
        c_local = np.arange(len(seg)) - np.searchsorted(c_src, c_src)
        dests = [(i, *d) for i, s in enumerate(segs) for d in s.dests]
        d_seg, d_peer, d_region, d_off = np.array(dests, dtype=i64).reshape(-1, 4).T
        d_n = g_n[d_seg]
        j = _within(d_n)
        s_chunk = np.repeat((np.cumsum(g_n) - g_n)[d_seg], d_n) + j
        s_peer, s_region = np.repeat(d_peer, d_n), np.repeat(d_region, d_n)
        s_off = np.repeat(d_off, d_n) + j * cb
        s_src = c_src[s_chunk]
        # a receiver's slots: its incoming chunks by source rank, then offset, from slot_base
        order = np.lexsort((s_off, s_src, s_peer))
        per_peer = np.bincount(s_peer, minlength=world)
        first_of = np.concatenate(([0], np.cumsum(per_peer)))
        s_slot = np.empty(len(order), dtype=np.int64)
        s_slot[order] = self.slot_base + np.arange(len(order)) - first_of[s_peer[order]]
        need = int(per_peer.max(initial=0))
        if self.slot_base + need > U32_MAX + 1:
            raise PlanError("slot_base", f"slots [{self.slot_base}, {self.slot_base + need}) pass 2^32")
        if flag_count is not None:
            flag_count = _int("flag_count", flag_count, 0)
            if self.slot_base + need > flag_count:
                r = int(per_peer.argmax())
                raise PlanError("slot_count", f"rank {r} needs {need} flag slots from slot_base {self.slot_base}, "
                                              f"past flag_count {flag_count}")
        if len(c_off) > U32_MAX or len(s_off) > U32_MAX or int(c_tiles.sum()) > U32_MAX:
            raise PlanError("chunk_count", "more than 2^32-1 chunks, sends or tiles")

        mine = np.flatnonzero(c_src == self.rank)  # in step order already (segments were sorted)
        self.chunks = np.zeros(len(mine), dtype=PLAN_CHUNK_DTYPE)
        self.chunks["src_off"] = c_off[mine]
        self.chunks["bytes"] = c_bytes[mine]
        self.chunks["tiles"] = c_tiles[mine]
        self.chunks["src_region"] = c_region[mine]
        my_sends = np.flatnonzero(s_src == self.rank)
        my_sends = my_sends[np.argsort(c_local[s_chunk[my_sends]], kind="stable")]
        local = c_local[s_chunk[my_sends]]
        send_count = np.bincount(local, minlength=len(mine))
        self.chunks["send_count"] = send_count
        self.chunks["first_send"] = np.concatenate(([0], np.cumsum(send_count)[:-1])) if len(mine) else []
        self.sends = np.zeros(len(my_sends), dtype=PLAN_SEND_DTYPE)
        self.sends["dst_off"] = s_off[my_sends]
        self.sends["slot"] = s_slot[my_sends]
        self.sends["value"] = self.value
        self.sends["peer"] = s_peer[my_sends]
        self.sends["dst_region"] = s_region[my_sends]
        self.sends["chunk_id"] = local
        incoming = order[first_of[self.rank]:first_of[self.rank + 1]]
        self.recvs = np.zeros(len(incoming), dtype=PLAN_RECV_DTYPE)
        self.recvs["off"] = s_off[incoming]
        self.recvs["bytes"] = c_bytes[s_chunk[incoming]]
        self.recvs["slot"] = s_slot[incoming]
        self.recvs["value"] = self.value
        self.recvs["source"] = s_src[incoming]
        self.recv_index = np.concatenate(([0], np.cumsum(np.bincount(s_src[incoming], minlength=world)))).astype(
            np.uint32)
        self.slot_count = len(incoming)
        tiles = c_tiles[mine]
        self.tile_chunk = np.repeat(np.arange(len(mine), dtype=np.uint32), tiles)
        self.tile_off = (np.repeat(c_off[mine], tiles) + _within(tiles) * tb).astype(np.uint64)
        steps = c_step[mine]
        self.step_index = np.searchsorted(steps, np.arange(int(steps.max(initial=0)) + 2)).astype(np.uint32)
        self.forwards = np.full(len(mine), NO_RECV, dtype=np.uint32)

    # --- the tables' own consistency (also after a caller edits them) --------------------------------------------
    def check(self) -> None:
        """Refuse tables that ``tpd::Plan`` cannot use (PlanError naming the field); run before every upload."""
        chunks, sends, recvs, world = self.chunks, self.sends, self.recvs, self.world
        for name, dtype in (("chunks", PLAN_CHUNK_DTYPE), ("sends", PLAN_SEND_DTYPE), ("recvs", PLAN_RECV_DTYPE)):
            table = getattr(self, name)
            if table.dtype != dtype or table.ndim != 1 or not table.flags.c_contiguous:
                raise PlanError(name, f"must be a contiguous 1-d array of {name.upper()} dtype")
        if (chunks["bytes"] == 0).any():
            raise PlanError("bytes", f"chunk {int(np.argmax(chunks['bytes'] == 0))} has 0 bytes")
        if (chunks["tiles"] == 0).any():
            raise PlanError("tiles", f"chunk {int(np.argmax(chunks['tiles'] == 0))} has no tiles")
        starts = chunks["first_send"].astype(np.int64)
        ends = starts + chunks["send_count"]
        if (ends[-1] if len(chunks) else 0) != len(sends) or (len(chunks) and (
                starts[0] != 0 or (starts[1:] != ends[:-1]).any())):
            raise PlanError("first_send", "each chunk's sends must follow the previous chunk's, covering sends")
        tc = self.tile_chunk
        if tc.dtype != np.uint32 or tc.ndim != 1 or (len(tc) and int(tc.max()) >= len(chunks)):
            raise PlanError("tile_chunk", "must be u32 chunk indices below chunk_count")
        named = np.bincount(tc, minlength=len(chunks))
        if (named != chunks["tiles"]).any():
            c = int(np.argmax(named != chunks["tiles"]))
            raise PlanError("tile_chunk", f"chunk {c} has tiles={int(chunks['tiles'][c])} but {int(named[c])} "
                                          "tile_chunk entries name it")
        if len(sends) and int(sends["peer"].max()) >= world:
            raise PlanError("peer", f"a send names rank {int(sends['peer'].max())} in a world of {world}")
        if (sends["value"] == 0).any() or (recvs["value"] == 0).any():
            raise PlanError("value", "a flag update of 0 never says anything arrived")
        idx = self.recv_index
        if (idx.dtype != np.uint32 or idx.shape != (world + 1,) or idx[0] != 0 or idx[-1] != len(recvs)
                or (np.diff(idx.astype(np.int64)) < 0).any()):
            raise PlanError("recv_index", f"must be u32[{world + 1}], from 0 to recv_count, non-decreasing")
        if (recvs["source"] != np.repeat(np.arange(world), np.diff(idx.astype(np.int64)))).any():
            raise PlanError("source", "recvs must be grouped by source rank as recv_index says")
        if (recvs["bytes"] == 0).any():
            raise PlanError("bytes", "an incoming chunk has 0 bytes")
        for r in range(world):
            part = recvs[idx[r]:idx[r + 1]]
            if (part["off"][1:] < part["off"][:-1] + part["bytes"][:-1]).any():
                raise PlanError("off", f"rank {r}'s incoming chunks must be sorted by offset and disjoint")
        slots = recvs["slot"].astype(np.int64)
        if len(np.unique(slots)) != len(slots) or (len(slots) and (
                slots.min() < self.slot_base or slots.max() >= self.slot_base + self.slot_count)):
            raise PlanError("slot", f"incoming slots must be distinct, in [{self.slot_base}, "
                                    f"{self.slot_base + self.slot_count})")

    # --- counts ---------------------------------------------------------------------------------------------
    @property
    def chunk_count(self) -> int:
        return len(self.chunks)

    @property
    def send_count(self) -> int:
        return len(self.sends)

    @property
    def recv_count(self) -> int:
        return len(self.recvs)

    @property
    def tile_count(self) -> int:
        return len(self.tile_chunk)

    @property
    def steps(self) -> int:
        """The highest step of this rank's chunks (world-1 for the ring, 0 for the other templates)."""
        return len(self.step_index) - 2

    def step_chunks(self, step: int) -> range:
        """The chunks of ``step`` (the ring's steps 1 .. world-1; step 0 holds every other template's)."""
        if not 0 <= step <= self.steps:
            return range(0)
        return range(int(self.step_index[step]), int(self.step_index[step + 1]))

    def tile_range(self, tile: int) -> tuple[int, int, int]:
        """(src_region, src_off, nbytes) of compute tile ``tile``."""
        c = int(self.tile_chunk[tile])
        end = int(self.chunks["src_off"][c]) + int(self.chunks["bytes"][c])
        off = int(self.tile_off[tile])
        return int(self.chunks["src_region"][c]), off, min(self.tile_bytes, end - off)

    # --- the receiver's side, mirrored from the header ----------------------------------------------------------
    def recv_span(self, rank: int, byte_off: int, nbytes: int) -> tuple[int, int]:
        """Indices [first, end) of ``recvs``: the chunks from ``rank`` that intersect [byte_off, +nbytes) of the
        receive region (``tpd::recv_span``; an empty range, or a rank outside the world, covers nothing)."""
        if not 0 <= rank < self.world or nbytes <= 0:
            return (0, 0)
        lo, hi = int(self.recv_index[rank]), int(self.recv_index[rank + 1])
        part = self.recvs[lo:hi]
        first = lo + int(np.searchsorted(part["off"] + part["bytes"], byte_off, side="right"))
        end = lo + int(np.searchsorted(part["off"], byte_off + nbytes, side="left"))
        return (first, max(first, end))

    def target(self, i: int, epoch: int) -> int:
        """The value incoming chunk ``i``'s flag reaches once launch ``epoch`` delivered it (recv_target)."""
        return (int(epoch) * int(self.recvs["value"][i])) & U64_MAX

    def targets(self, epoch: int) -> np.ndarray:
        """``target(i, epoch)`` for every incoming chunk (u64)."""
        return (self.recvs["value"].astype(np.uint64) * np.uint64(epoch)).astype(np.uint64)

    def waits(self, rank: int, byte_off: int, nbytes: int, epoch: int) -> list[tuple[int, int]]:
        """(slot, target) of every flag ``wait_range(plan, rank, byte_off, nbytes)`` waits on at ``epoch``."""
        first, end = self.recv_span(rank, byte_off, nbytes)
        return [(int(self.recvs["slot"][i]), self.target(i, epoch)) for i in range(first, end)]

    # --- the tpd::Plan value ------------------------------------------------------------------------------------
    def host_struct(self, epoch: int, *, counters: int | np.ndarray, chunks: int | None = None,
                    sends: int | None = None, recvs: int | None = None, tile_chunk: int | None = None,
                    recv_index: int | None = None) -> np.ndarray:
        """One PLAN_DTYPE record pointing at the given addresses: by default at this plan's numpy tables (host
        memory: for host code, such as the CPU model of the device calls). ``counters``: an address, or a
        u32 numpy array of at least chunk_count words (kept zeroed once, then left alone between epochs)."""
        if isinstance(counters, np.ndarray):
            if counters.dtype != np.uint32 or counters.size < self.chunk_count or not counters.flags.c_contiguous:
                raise PlanError("counters", f"must be a contiguous u32 array of at least {self.chunk_count} words")
            counters = counters.ctypes.data
        given = {"chunks": chunks, "sends": sends, "recvs": recvs, "tile_chunk": tile_chunk, "recv_index": recv_index}
        value = np.zeros(1, dtype=PLAN_DTYPE)
        for name in _TABLES:
            value[name] = getattr(self, name).ctypes.data if given[name] is None else given[name]
        value["counters"] = counters
        value["epoch"] = _int("epoch", epoch, 1)
        value["tile_count"], value["chunk_count"] = self.tile_count, self.chunk_count
        value["send_count"], value["recv_count"] = self.send_count, self.recv_count
        value["rank"], value["world"], value["abi"] = self.rank, self.world, PLAN_ABI
        value["slot_base"], value["slot_count"] = self.slot_base, self.slot_count
        return value

    def to_device(self, device: int) -> DevicePlan:
        """Upload the tables once (one allocation) and zero the per-chunk counters; later calls return it."""
        from gpuclient.cuda_memory import DeviceMemory

        if self._device is not None:
            if self._device.device != device:
                raise PlanError("device", f"already on device {self._device.device}; build another plan for "
                                          f"device {device}")
            return self._device
        self.check()
        offsets, size = {}, 0
        for name in (*_TABLES, "counters"):
            offsets[name] = size
            nbytes = 4 * self.chunk_count if name == "counters" else getattr(self, name).nbytes
            size += -(-max(nbytes, 1) // _ALIGN) * _ALIGN
        blob = bytearray(offsets["counters"])
        for name in _TABLES:
            data = getattr(self, name).tobytes()
            blob[offsets[name]:offsets[name] + len(data)] = data
        memory = DeviceMemory(size, device)  # zeroed: the counters start at 0
        try:
            memory.write(0, bytes(blob))
            value = self.host_struct(1, counters=memory.ptr + offsets["counters"],
                                     **{name: memory.ptr + offsets[name] for name in _TABLES})
        except BaseException:
            memory.free()
            raise
        self._device = DevicePlan(self, device, memory, offsets["counters"], value)
        return self._device

    def handle(self, epoch: int) -> bytes:
        """The 96 bytes of ``tpd::Plan`` for launch ``epoch`` (from 1), after :meth:`to_device`."""
        if self._device is None:
            raise PlanError("device", "the tables are not on a GPU yet: call plan.to_device(device) first")
        return self._device.handle(epoch)

    def __repr__(self) -> str:
        return (f"ChunkPlan({self.kind}, rank {self.rank}/{self.world}: {self.tile_count} tiles, {self.chunk_count} "
                f"chunks, {self.send_count} sends, {self.recv_count} recvs, slots [{self.slot_base}, "
                f"{self.slot_base + self.slot_count}))")


class DevicePlan:
    """A plan's tables and counters in device memory; ``handle(epoch)`` is the kernel argument."""

    def __init__(self, plan: ChunkPlan, device: int, memory: DeviceMemory, counters_off: int,
                 value: np.ndarray) -> None:
        self.plan = plan
        self.device = device
        self.memory = memory
        self._counters_off = counters_off
        self.value = value  # one PLAN_DTYPE record; handle() only rewrites its epoch

    def handle(self, epoch: int) -> bytes:
        """``tpd::Plan`` for launch ``epoch`` (from 1): no allocation or copy on the device."""
        self.value["epoch"] = _int("epoch", epoch, 1)
        return self.value.tobytes()

    def counters(self) -> np.ndarray:
        """The per-chunk tile counters (a synchronous device-to-host copy; for tests and diagnostics)."""
        n = self.plan.chunk_count
        return np.frombuffer(self.memory.read(self._counters_off, 4 * n), dtype="<u4") if n else np.zeros(0, "<u4")

    def release(self) -> None:
        """Free the device memory (no kernel may still use the handle)."""
        self.memory.free()
        if self.plan._device is self:
            self.plan._device = None


def _within(counts: np.ndarray) -> np.ndarray:
    """For groups of ``counts`` items laid end to end: each item's index inside its group."""
    return np.arange(int(counts.sum()), dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)


def _check_cover(field: str, rank: int, want: list[tuple[int, int, int]], have: list[tuple[int, int, int]]) -> None:
    """``have`` (sorted, disjoint) must cover exactly the union of ``want``: report the first gap or stray."""
    def merged(spans: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
        out: list[tuple[int, int, int]] = []
        for reg, a, b in spans:
            if out and out[-1][0] == reg and a <= out[-1][2]:
                out[-1] = (reg, out[-1][1], max(out[-1][2], b))
            else:
                out.append((reg, a, b))
        return out

    w, h = merged(want), merged(have)
    if w == h:
        return
    for reg, a, b in w:
        inside = [(x, y) for r, x, y in h if r == reg and x < b and y > a]
        pos = a
        for x, y in inside:
            if x > pos:
                break
            pos = max(pos, y)
        if pos < b:
            side = "sends" if field == "src_off" else "receives"
            raise PlanError(field, f"a gap in the buffer's coverage: rank {rank} {side} nothing for bytes "
                                   f"[{pos}, {min(b, next((x for x, _ in inside if x > pos), b))}) of region {reg}")
    reg, a, b = next(s for s in h if not any(r == s[0] and x <= s[1] and s[2] <= y for r, x, y in w))
    raise PlanError(field, f"rank {rank}'s bytes [{a}, {b}) of region {reg} lie outside the buffer's coverage")
