"""Chunk plans without a GPU: the templates' tables against an independent oracle of each collective, the
dtypes against plan_device.cuh (g++, nvcc, NVRTC), bad plans refused naming the field, and the header's
tile_done / wait_range compiled for the CPU with a recording channel and driven from several threads."""

from __future__ import annotations

import ctypes
import pickle
import random
import re
import shutil
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import gpuclient
from gpuclient.errors import PlanError
from gpuclient.plan import (
    NO_RECV,
    PLAN_ABI,
    PLAN_CHUNK_DTYPE,
    PLAN_DTYPE,
    PLAN_RECV_DTYPE,
    PLAN_SEND_DTYPE,
    PLAN_SIZE,
    ChunkPlan,
    Segment,
)
from tests.support.nvrtc import nvrtc_or_skip

INCLUDE = Path(gpuclient.get_include())
INCLUDE_FLAGS = [f"-I{d}" for d in gpuclient.get_include_dirs()]
KINDS = ("all_gather", "reduce_scatter", "all_to_all", "ring")


def cxx() -> str:
    found = shutil.which("c++") or shutil.which("g++")
    assert found, "a C++ compiler is required for the plan probes (CI installs build-essential)"
    return found


def nvcc() -> str | None:
    found = shutil.which("nvcc")
    if found:
        return found
    default = Path("/usr/local/cuda/bin/nvcc")
    return str(default) if default.exists() else None


# --- jobs: a template's arguments, and what the collective must do (written apart from gpuclient.plan) ----------
@dataclass
class Job:
    kind: str
    world: int
    tile: int
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    flows: list[tuple[int, int, int, int, int, int, int]] = field(default_factory=list)
    sources: list[list[tuple[int, int, int]]] = field(default_factory=list)

    def plan(self, rank: int) -> ChunkPlan:
        return getattr(ChunkPlan, self.kind)(rank, self.world, *self.args, self.tile, **self.kwargs)

    def plans(self) -> list[ChunkPlan]:
        return [self.plan(r) for r in range(self.world)]


def _prefix(sizes: list[int]) -> list[int]:
    return [sum(sizes[:i]) for i in range(len(sizes) + 1)]


@st.composite
def jobs(draw: st.DrawFn, kinds: tuple[str, ...] = KINDS, max_world: int = 5) -> Job:
    """A random template call with its oracle: ``flows`` (origin, src_region, src_off, receiver, dst_region,
    dst_off, nbytes): the bytes each rank must receive from the network, exactly once; ``sources[r]``: the
    (region, off, nbytes) the chunks of rank r must cover exactly."""
    kind = draw(st.sampled_from(kinds))
    world = draw(st.integers(1, max_world))
    tile = draw(st.integers(1, 40))
    chunk_tiles = draw(st.integers(1, 4))
    kwargs: dict[str, Any] = {"chunk_bytes": chunk_tiles * tile} if draw(st.booleans()) else {
        "chunk_tiles": chunk_tiles}
    kwargs["slot_base"] = draw(st.integers(0, 50))
    kwargs["value"] = draw(st.integers(1, 3))
    base = draw(st.integers(0, 40))
    flows, sources = [], []
    if kind == "all_gather":
        shard = draw(st.one_of(st.integers(1, 300), st.lists(st.integers(0, 300), min_size=world, max_size=world)))
        sizes = [shard] * world if isinstance(shard, int) else shard
        offs = _prefix(sizes)
        kwargs.update(dst_region=1, dst_base=base)
        if draw(st.booleans()):  # a separate source region
            src_base = draw(st.integers(0, 40))
            kwargs.update(src_region=2, src_base=src_base)
            src = [(2, src_base)] * world
        else:
            src = [(1, base + offs[i]) for i in range(world)]
        args: tuple[Any, ...] = (shard,)
        for i in range(world):
            sources.append([(*src[i], sizes[i])] if sizes[i] else [])
            flows += [(i, *src[i], j, 1, base + offs[i], sizes[i]) for j in range(world) if j != i and sizes[i]]
    elif kind == "reduce_scatter":
        seg = draw(st.one_of(st.integers(1, 200), st.lists(st.integers(0, 200), min_size=world, max_size=world)))
        sizes = [seg] * world if isinstance(seg, int) else seg
        offs = _prefix(sizes)
        src_base = draw(st.integers(0, 40))
        kwargs.update(src_region=0, src_base=src_base, dst_region=3, dst_base=base)
        args = (seg,)
        for i in range(world):
            sources.append([(0, src_base, offs[-1])] if offs[-1] else [])
            flows += [(i, 0, src_base + offs[j], j, 3, base + i * sizes[j], sizes[j]) for j in range(world)
                      if j != i and sizes[j]]
    elif kind == "all_to_all":
        item = draw(st.integers(1, 16))
        counts = draw(st.lists(st.lists(st.integers(0, 20), min_size=world, max_size=world), min_size=world,
                               max_size=world))
        size = [[c * item for c in row] for row in counts]
        src_base = draw(st.integers(0, 40))
        kwargs.update(item_bytes=item, src_region=4, src_base=src_base, dst_region=5, dst_base=base)
        args = (counts,)
        for i in range(world):
            row = _prefix(size[i])
            sources.append([(4, src_base, row[-1])] if row[-1] else [])
            for j in range(world):
                col = _prefix([size[k][j] for k in range(world)])
                if j != i and size[i][j]:
                    flows.append((i, 4, src_base + row[j], j, 5, base + col[i], size[i][j]))
    else:
        block = draw(st.integers(1, 200))
        kwargs.update(src_region=6, dst_region=6, base=base)
        args = (block,)
        for r in range(world):
            sources.append([(6, base + o * block, block) for o in range(world) if o != (r + 1) % world]
                           if world > 1 else [])
            flows += [(o, 6, base + o * block, r, 6, base + o * block, block) for o in range(world) if o != r]
    return Job(kind, world, tile, args, kwargs, flows, sources)


def _stamp(rank: int, region: int, off: np.ndarray) -> np.ndarray:
    return (rank << 40) + (region << 32) + off


def simulate(plans: list[ChunkPlan]) -> tuple[dict[tuple[int, int], np.ndarray], dict[tuple[int, int], np.ndarray]]:
    """Run every rank's sends, step by step (a step reads what earlier steps delivered), on memories that start
    with each byte stamped by (rank, region, offset). Returns the memories and how often each byte was written."""
    extent = 64 + max([int(c["src_off"]) + int(c["bytes"]) for p in plans for c in p.chunks]
                      + [int(r["off"]) + int(r["bytes"]) for p in plans for r in p.recvs] + [0])
    mem: dict[tuple[int, int], np.ndarray] = {}
    hits: dict[tuple[int, int], np.ndarray] = {}

    def at(rank: int, region: int) -> tuple[np.ndarray, np.ndarray]:
        if (rank, region) not in mem:
            mem[rank, region] = _stamp(rank, region, np.arange(extent, dtype=np.int64))
            hits[rank, region] = np.zeros(extent, dtype=np.int64)
        return mem[rank, region], hits[rank, region]

    for step in range(max(p.steps for p in plans) + 1):
        snapshot = {k: v.copy() for k, v in mem.items()}
        for r, p in enumerate(plans):
            for c in p.step_chunks(step):
                ch = p.chunks[c]
                src = snapshot.get((r, int(ch["src_region"])))
                if src is None:
                    src = at(r, int(ch["src_region"]))[0].copy()
                a, n = int(ch["src_off"]), int(ch["bytes"])
                for s in p.sends[ch["first_send"]:ch["first_send"] + ch["send_count"]]:
                    m, h = at(int(s["peer"]), int(s["dst_region"]))
                    d = int(s["dst_off"])
                    m[d:d + n] = src[a:a + n]
                    h[d:d + n] += 1
    return mem, hits


# --- the templates' tables ----------------------------------------------------------------------------------------
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(jobs())
def test_every_byte_reaches_every_destination_exactly_once(job: Job) -> None:
    plans = job.plans()
    mem, hits = simulate(plans)
    for origin, src_region, src_off, receiver, dst_region, dst_off, n in job.flows:
        got = mem[receiver, dst_region][dst_off:dst_off + n]
        want = _stamp(origin, src_region, np.arange(src_off, src_off + n, dtype=np.int64))
        assert (got == want).all(), f"{job.kind}: rank {receiver} holds the wrong bytes at [{dst_off}, +{n})"
        assert (hits[receiver, dst_region][dst_off:dst_off + n] == 1).all(), "a byte arrived more than once"
    assert sum(int(h.sum()) for h in hits.values()) == sum(f[-1] for f in job.flows), "bytes sent nowhere asked"


@settings(max_examples=150, deadline=None)
@given(jobs())
def test_tiles_and_chunks_cover_the_source_exactly(job: Job) -> None:
    for r, p in enumerate(job.plans()):
        assert p.chunks.dtype == PLAN_CHUNK_DTYPE and p.tile_chunk.dtype == np.uint32
        assert (np.bincount(p.tile_chunk, minlength=p.chunk_count) == p.chunks["tiles"]).all()
        covered = Counter()
        for c, ch in enumerate(p.chunks):
            a, n = int(ch["src_off"]), int(ch["bytes"])
            assert 0 < n <= p.chunk_bytes and int(ch["tiles"]) == -(-n // job.tile) <= p.chunk_tiles
            tiles = sorted(p.tile_range(t) for t in np.flatnonzero(p.tile_chunk == c))
            pos = a
            for region, off, nb in tiles:  # each chunk is its tiles, back to back; only its last may be short
                assert region == ch["src_region"] and off == pos and 0 < nb <= job.tile
                pos += nb
            assert pos == a + n and all(nb == job.tile for _, _, nb in tiles[:-1])
            covered.update((int(ch["src_region"]), b) for b in range(a, a + n))
        want = Counter((region, b) for region, off, n in job.sources[r] for b in range(off, off + n))
        assert covered == want, f"{job.kind}: rank {r}'s chunks do not cover its source exactly once"


@settings(max_examples=150, deadline=None)
@given(jobs())
def test_slots_are_distinct_and_senders_agree_with_receivers(job: Job) -> None:
    plans = job.plans()
    sent, received = Counter(), Counter()
    for r, p in enumerate(plans):
        slots = p.recvs["slot"].astype(np.int64)
        assert len(set(slots)) == len(slots) == p.slot_count == p.recv_count
        assert all(p.slot_base <= s < p.slot_base + p.slot_count for s in slots)
        assert (p.recv_index == np.searchsorted(p.recvs["source"], np.arange(job.world + 1))).all()
        for c in p.chunks:
            for s in p.sends[c["first_send"]:c["first_send"] + c["send_count"]]:
                assert s["peer"] != r and s["value"] == job.kwargs["value"]
                sent[r, int(s["peer"]), int(s["slot"]), int(s["dst_off"]), int(c["bytes"]), int(s["value"])] += 1
        for i, x in enumerate(p.recvs):
            received[int(x["source"]), r, int(x["slot"]), int(x["off"]), int(x["bytes"]), int(x["value"])] += 1
            for epoch in (1, 2, 7):
                assert p.target(i, epoch) == epoch * int(x["value"]) == int(p.targets(epoch)[i])
    assert sent == received


@settings(max_examples=100, deadline=None)
@given(jobs(), st.data())
def test_recv_span_is_exactly_the_chunks_a_range_touches(job: Job, data: st.DataObject) -> None:
    p = job.plan(data.draw(st.integers(0, job.world - 1)))
    extent = max([int(x["off"]) + int(x["bytes"]) for x in p.recvs] + [1]) + 8

    def brute(rank: int, off: int, n: int) -> set[int]:
        if not 0 <= rank < p.world or n == 0:  # an empty range touches nothing
            return set()
        lo, hi = int(p.recv_index[rank]), int(p.recv_index[rank + 1])
        return {i for i in range(lo, hi) if int(p.recvs["off"][i]) < off + n and off < int(p.recvs["off"][i])
                + int(p.recvs["bytes"][i])}

    queries = [(data.draw(st.integers(0, p.world)), data.draw(st.integers(0, extent)), data.draw(st.integers(0, 300)))
               for _ in range(20)]
    # tokens that straddle a chunk boundary, and ones that sit just inside or just outside a chunk
    queries += [(int(x["source"]), int(x["off"]) + d, n) for x in p.recvs for d, n in ((-1, 2), (0, 1), (-1, 1))
                if int(x["off"]) + d >= 0]
    for rank, off, n in queries:
        first, end = p.recv_span(rank, off, n)
        assert set(range(first, end)) == brute(rank, off, n), (rank, off, n)
        assert p.waits(rank, off, n, 3) == [(int(p.recvs["slot"][i]), 3 * int(p.recvs["value"][i]))
                                            for i in range(first, end)]
    for x in p.recvs:  # a byte range over two neighbours needs both
        lo, hi = p.recv_span(int(x["source"]), int(x["off"]) + int(x["bytes"]) - 1, 2)
        assert hi - lo == len(brute(int(x["source"]), int(x["off"]) + int(x["bytes"]) - 1, 2)) >= 1


@settings(max_examples=60, deadline=None)
@given(jobs(kinds=("ring",)))
def test_ring_steps_forward_what_arrived_the_step_before(job: Job) -> None:
    world = job.world
    block, base = job.args[0], job.kwargs["base"]
    for r, p in enumerate(job.plans()):
        assert p.steps == (world - 1 if world > 1 else 0) and len(p.step_chunks(0)) == 0
        left = (r - 1) % world
        for s in range(1, world):
            origin = (r - s + 1) % world
            chunks = p.chunks[list(p.step_chunks(s))]
            assert chunks["src_off"].min() == base + origin * block
            assert int(chunks["bytes"].sum()) == block
            for c in p.step_chunks(s):
                assert p.sends["peer"][p.chunks["first_send"][c]] == (r + 1) % world
                if s == 1:
                    assert p.forwards[c] == NO_RECV
                    continue
                i = int(p.forwards[c])  # the incoming chunk it passes on: same place and length, from the left
                assert p.recvs["source"][i] == left and p.recvs["off"][i] == p.chunks["src_off"][c]
                assert p.recvs["bytes"][i] == p.chunks["bytes"][c]
                assert p.recv_span(left, int(p.chunks["src_off"][c]), int(p.chunks["bytes"][c])) == (i, i + 1)


def test_all_to_all_zero_cells_make_no_chunk_and_no_slot() -> None:
    counts = [[0, 3, 0], [0, 0, 0], [2, 0, 1]]
    plans = [ChunkPlan.all_to_all(r, 3, counts, 8, item_bytes=8, chunk_tiles=1, slot_base=4) for r in range(3)]
    assert plans[1].chunk_count == 0 and plans[1].tile_count == 0  # sends nothing, has no tiles
    assert plans[1].recv_count == 3 and list(plans[1].recv_index) == [0, 3, 3, 3]
    assert plans[2].send_count == 2 and plans[2].chunk_count == 3  # its own cell: a chunk that ships nowhere
    assert plans[2].recv_count == 0 and plans[2].slot_count == 0 and list(plans[2].recv_index) == [0] * 4
    assert plans[0].recv_count == 2 and list(plans[0].recvs["slot"]) == [4, 5]
    assert list(plans[0].recvs["off"]) == [0, 8]  # rank 2's cell lands first: rank 0's own cell is empty


def test_reduce_scatter_keeps_the_local_segment_local() -> None:
    p = ChunkPlan.reduce_scatter(1, 3, 100, 50, chunk_tiles=1, src_region=0, dst_region=1)
    assert p.chunk_count == 6 and p.tile_count == 6  # every tile of the buffer counts ...
    assert list(p.chunks["send_count"]) == [1, 1, 0, 0, 1, 1]  # ... but segment 1 stays here
    assert sorted(set(p.sends["peer"])) == [0, 2] and list(p.sends["dst_off"]) == [100, 150, 100, 150]


def test_chunks_need_not_align_with_tiles_or_consumer_tokens() -> None:
    # 1000-byte shards in 96-byte tiles, 3 tiles a chunk: a short last tile and a short last chunk
    p = ChunkPlan.all_gather(0, 2, 1000, 96, chunk_tiles=3)
    assert list(p.chunks["bytes"]) == [288, 288, 288, 136] and list(p.chunks["tiles"]) == [3, 3, 3, 2]
    assert p.tile_count == 11 and p.tile_range(10) == (0, 960, 40) and p.tile_range(9) == (0, 864, 96)
    q = ChunkPlan.all_gather(1, 2, 1000, 96, chunk_tiles=3)
    # a 100-byte token at byte 250 of rank 0's shard straddles its first two chunks
    assert q.recv_span(0, 250, 100) == (0, 2) and q.recv_span(0, 288, 288) == (1, 2)
    assert q.recv_span(0, 0, 0) == (0, 0) and q.recv_span(1, 0, 1000) == (4, 4) and q.recv_span(5, 0, 9) == (0, 0)


# --- bad plans ---------------------------------------------------------------------------------------------------
def _edit(table: str, column: str | None, index: int, value: int) -> Any:
    def run() -> None:
        p = ChunkPlan.all_gather(0, 3, 500, 64, chunk_tiles=2)
        arr = getattr(p, table)
        if column is None:
            arr[index] = value
        else:
            arr[column][index] = value
        p.check()
    return run


def _segs(*segments: Segment, **kw: Any) -> Any:
    return lambda: ChunkPlan(0, 3, segments, tile_bytes=16, chunk_tiles=1, **kw)


BAD = {
    "src_off": _segs(Segment(0, 0, 0, 100, ((1, 0, 0),)), Segment(0, 0, 50, 100, ((2, 0, 0),))),
    "dst_off": _segs(Segment(0, 0, 0, 100, ((2, 0, 0),)), Segment(1, 0, 0, 100, ((2, 0, 64),))),
    "src_off ": _segs(Segment(0, 0, 0, 100, ((1, 0, 0),)), src_cover=[[(0, 0, 200)], [], []]),
    "dst_off ": _segs(Segment(0, 0, 0, 100, ((1, 0, 0),)), dst_cover=[[], [(0, 0, 100), (0, 150, 10)], []]),
    "dst_off  ": _segs(Segment(0, 0, 0, 100, ((1, 0, 10),)), dst_cover=[[], [(0, 0, 100)], []]),
    "dst_region": lambda: ChunkPlan.all_gather(0, 4, 1000, 64, chunk_tiles=1, dst_region=1, src_region=2,
                                               region_bytes={1: 3999, 2: 1000}),
    "src_region": lambda: ChunkPlan.all_gather(0, 4, 1000, 64, chunk_tiles=1, dst_region=1, src_region=2,
                                               region_bytes={1: 4000, 2: 999}),
    "src_region ": lambda: ChunkPlan.all_gather(0, 2, 10, 64, chunk_tiles=1, region_bytes={1: 4000}),
    "dst_region ": _segs(Segment(0, 0, 0, 16, ((1, 0, 0),)), Segment(0, 0, 16, 16, ((1, 1, 100),))),
    "dst_region  ": _segs(Segment(0, 0, 0, 16, ((1, 65536, 0),))),
    "src_region  ": _segs(Segment(0, 70000, 0, 16, ((1, 0, 0),))),
    "slot_count": lambda: ChunkPlan.all_gather(0, 4, 1000, 64, chunk_tiles=1, slot_base=8, flag_count=50),
    "shard_bytes": lambda: ChunkPlan.all_gather(0, 4, 0, 64, chunk_tiles=1),
    "shard_bytes ": lambda: ChunkPlan.all_gather(0, 4, [10, -1, 10, 10], 64, chunk_tiles=1),
    "shard_bytes  ": lambda: ChunkPlan.all_gather(0, 4, [10, 10], 64, chunk_tiles=1),
    "segment_bytes": lambda: ChunkPlan.reduce_scatter(0, 2, -5, 64, chunk_tiles=1),
    "block_bytes": lambda: ChunkPlan.ring(0, 2, 0, 64, chunk_tiles=1),
    "counts": lambda: ChunkPlan.all_to_all(0, 2, [[1, 2]], 64, chunk_tiles=1),
    "counts ": lambda: ChunkPlan.all_to_all(0, 2, [[1, -2], [0, 0]], 64, chunk_tiles=1),
    "nbytes": _segs(Segment(0, 0, 0, 0, ((1, 0, 0),))),
    "tile_bytes": lambda: ChunkPlan.all_gather(0, 2, 100, 0, chunk_tiles=1),
    "chunk_tiles": lambda: ChunkPlan.all_gather(0, 2, 100, 10, chunk_tiles=0),
    "chunk_tiles ": lambda: ChunkPlan.all_gather(0, 2, 100, 10, chunk_tiles=2, chunk_bytes=20),
    "chunk_tiles  ": lambda: ChunkPlan.all_gather(0, 2, 100, 10),
    "chunk_bytes": lambda: ChunkPlan.all_gather(0, 2, 100, 1, chunk_bytes=1 << 32),
    "chunk_bytes ": lambda: ChunkPlan.all_gather(0, 2, 100, 1 << 20, chunk_tiles=1 << 12),
    "chunk_bytes  ": lambda: ChunkPlan.all_gather(0, 2, 100, 10, chunk_bytes=25),
    "peer": _segs(Segment(0, 0, 0, 16, ((3, 0, 0),))),
    "source": _segs(Segment(-1, 0, 0, 16, ((1, 0, 0),))),
    "rank": lambda: ChunkPlan.all_gather(2, 2, 100, 10, chunk_tiles=1),
    "world": lambda: ChunkPlan.all_gather(0, 0, 100, 10, chunk_tiles=1),
    "value": lambda: ChunkPlan.all_gather(0, 2, 100, 10, chunk_tiles=1, value=0),
    "slot_base": lambda: ChunkPlan.all_gather(0, 2, 100, 10, chunk_tiles=1, slot_base=-1),
    "send_count": _segs(Segment(0, 0, 0, 16, tuple((1, 0, 16 * k) for k in range(65536)))),
    "tile_chunk": _edit("tile_chunk", None, 0, 1),
    "tile_chunk ": _edit("tile_chunk", None, 0, 99),
    "tiles": _edit("chunks", "tiles", 0, 0),
    "first_send": _edit("chunks", "first_send", 1, 0),
    "peer ": _edit("sends", "peer", 0, 3),
    "off": _edit("recvs", "off", 1, 0),
    "slot": _edit("recvs", "slot", 1, 0),
    "recv_index": _edit("recv_index", None, 1, 99),
    "source ": _edit("recvs", "source", 0, 2),
    "value ": _edit("sends", "value", 0, 0),
}


@pytest.mark.parametrize("name", BAD, ids=lambda n: n.strip() + ("+" * (len(n) - len(n.strip()))))
def test_bad_plans_are_refused_naming_the_field(name: str) -> None:
    with pytest.raises(PlanError, match=rf"^{name.strip()}: ") as info:
        BAD[name]()
    assert info.value.field == name.strip()


def test_plan_errors_are_value_errors_that_pickle() -> None:
    err = PlanError("dst_off", "overlap")
    copy = pickle.loads(pickle.dumps(err))
    assert isinstance(copy, ValueError) and str(copy) == str(err) == "dst_off: overlap" and copy.field == "dst_off"


def test_a_handle_needs_the_tables_on_a_gpu_and_a_launch_number() -> None:
    p = ChunkPlan.all_gather(0, 2, 100, 10, chunk_tiles=1)
    with pytest.raises(PlanError, match="^device: "):
        p.handle(1)
    with pytest.raises(PlanError, match="^epoch: "):
        p.host_struct(0, counters=np.zeros(p.chunk_count, np.uint32))
    with pytest.raises(PlanError, match="^counters: "):
        p.host_struct(1, counters=np.zeros(p.chunk_count - 1, np.uint32))


def test_host_struct_points_at_the_tables() -> None:
    p = ChunkPlan.ring(2, 4, 100, 16, chunk_tiles=2, slot_base=3)
    counters = np.zeros(p.chunk_count, np.uint32)
    v = p.host_struct(5, counters=counters)[0]
    assert v["chunks"] == p.chunks.ctypes.data and v["recv_index"] == p.recv_index.ctypes.data
    assert v["counters"] == counters.ctypes.data and v["epoch"] == 5 and v["abi"] == PLAN_ABI
    assert (v["tile_count"], v["chunk_count"], v["send_count"], v["recv_count"]) == (
        p.tile_count, p.chunk_count, p.send_count, p.recv_count)
    assert (v["rank"], v["world"], v["slot_base"], v["slot_count"], v["reserved"]) == (2, 4, 3, p.recv_count, 0)
    w = p.host_struct(1, counters=1 << 40, sends=4096)[0]
    assert w["counters"] == 1 << 40 and w["sends"] == 4096


def test_import_gpuclient_loads_no_cuda() -> None:
    code = "import sys, gpuclient; gpuclient.ChunkPlan; print(sorted(m for m in sys.modules if m.startswith('cuda')))"
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    assert out.stdout.strip() == "[]"


# --- layout --------------------------------------------------------------------------------------------------------
STRUCTS = {"Plan": PLAN_DTYPE, "PlanChunk": PLAN_CHUNK_DTYPE, "PlanSend": PLAN_SEND_DTYPE, "PlanRecv": PLAN_RECV_DTYPE}


def _probe_source() -> str:
    lines = ["#include <cstdio>", "#include <cstddef>", "#include <transportd/plan_device.cuh>", "int main() {",
             '  std::printf("abi %u\\n", (unsigned)TPD_PLAN_ABI);',
             '  std::printf("size %u\\n", (unsigned)TPD_PLAN_SIZE);']
    for struct, dtype in STRUCTS.items():
        lines.append(f'  std::printf("sizeof.{struct} %zu\\n", sizeof(tpd::{struct}));')
        lines.append(f'  std::printf("alignof.{struct} %zu\\n", alignof(tpd::{struct}));')
        for name in dtype.names:
            lines.append(f'  std::printf("offset.{struct}.{name} %zu\\n", offsetof(tpd::{struct}, {name}));')
            lines.append(f'  std::printf("size.{struct}.{name} %zu\\n", sizeof(((tpd::{struct}*)0)->{name}));')
    lines += ["  return 0;", "}"]
    return "\n".join(lines) + "\n"


def _expected() -> dict[str, int]:
    out = {"abi": PLAN_ABI, "size": PLAN_SIZE}
    for struct, dtype in STRUCTS.items():
        out[f"sizeof.{struct}"] = dtype.itemsize
        out[f"alignof.{struct}"] = dtype.alignment
        for name in dtype.names:
            sub, offset = dtype.fields[name][:2]
            out[f"offset.{struct}.{name}"] = offset
            out[f"size.{struct}.{name}"] = sub.itemsize
    return out


def _parse(text: str) -> dict[str, int]:
    return {k: int(v) for k, v in re.findall(r"^(\S+) (\d+)$", text, re.M)}


def test_plan_dtypes_and_header_agree(tmp_path: Path) -> None:
    src = tmp_path / "probe.cpp"
    src.write_text(_probe_source())
    exe = tmp_path / "probe"
    subprocess.run([cxx(), "-std=c++17", "-Wall", "-Werror", *INCLUDE_FLAGS, str(src), "-o", str(exe)], check=True)
    got = _parse(subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout)
    assert got == _expected()
    assert set(gpuclient.__all__) >= {"ChunkPlan", "PlanError", "PLAN_DTYPE", "PLAN_CHUNK_DTYPE", "PLAN_SEND_DTYPE",
                                      "PLAN_RECV_DTYPE"}


def test_plan_layout_probe_under_nvcc(tmp_path: Path) -> None:
    compiler = nvcc()
    if not compiler:
        pytest.skip("nvcc not found: the CUDA compile checks run where the CUDA toolkit is installed")
    src = tmp_path / "probe.cu"
    src.write_text(_probe_source().replace("#include <transportd/plan_device.cuh>",
                                           "#include <transportd/client.cuh>\n#include <transportd/plan_device.cuh>")
                   + USE_PLAN)
    exe = tmp_path / "probe_cuda"
    subprocess.run([compiler, "-arch=sm_90", "-std=c++17", *INCLUDE_FLAGS, str(src), "-o", str(exe)], check=True)
    assert _parse(subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout) == _expected()


USE_PLAN = """
extern "C" __global__ void use_plan(tpd::DefaultChannel ch, tpd::Plan plan, uint32_t* out) {
    uint32_t tile = blockIdx.x * blockDim.x + threadIdx.x;
    if (tile < plan.tile_count && tpd::tile_done(ch, plan, tile)) atomicAdd(out, 1u);
    tpd::wait_range(ch, plan, 1, 100, 300);
    tpd::wait_chunk(ch, plan, 1, 0);
    tpd::RecvSpan span = tpd::recv_span(plan, 0, 8, 16);
    out[1] = span.end - span.first + (uint32_t)tpd::recv_target(plan, 0);
    if (threadIdx.x == 0) {
        tpd::wait_range_thread(ch, plan, 0, 0, 8);
        tpd::ship_chunk(ch, plan, 0);
        out[2] = tpd::tile_arrive(plan, 0);
    }
}
"""


@pytest.mark.parametrize("ibgda", [False, True], ids=["proxy", "ibgda"])
def test_plan_calls_are_nvrtc_clean(ibgda: bool) -> None:
    nvrtc_or_skip()
    from gpuclient.compiler import CompileError, compile_to_cubin

    source = "#include <transportd/client.cuh>\n#include <transportd/plan_device.cuh>\n" + USE_PLAN
    for debug in (False, True):
        try:
            cubin = compile_to_cubin(source, arch="sm_90", debug=debug, defines={"TPD_IBGDA": 1} if ibgda else None)
        except CompileError as exc:
            pytest.fail(exc.log)
        assert cubin[:4] == b"\x7fELF"


# --- the header's plan calls on the CPU, with a recording channel ----------------------------------------------------
MODEL = r"""
#include <algorithm>
#include <atomic>
#include <cstring>
#include <thread>
#include <vector>
#include <transportd/command.cuh>

struct Shipped { uint64_t peer, dst_region, dst_off, src_region, src_off, bytes, slot, value, op, lo, hi; };
struct Waited { uint64_t slot, at_least, seen; };

namespace tpd {
/* A channel that records: put_signal notes the command and the smallest and largest source byte at the time
   (every tile stamps its bytes before tile_done, so a chunk shipped early shows an old stamp); wait notes what
   it was asked and never blocks. plan_device.cuh's templates find both by unqualified lookup. */
struct Rec {
    Shipped* shipped; uint32_t cap; std::atomic<uint32_t>* count;
    const uint8_t* src; uint64_t src_bytes;
    Waited* waited; uint32_t wait_cap; uint32_t* waits;
    const uint64_t* flags; uint32_t flag_count;
};

inline void put_signal(const Rec& r, uint32_t peer, uint16_t dst_region, uint64_t dst_off, uint16_t src_region,
                       uint64_t src_off, uint32_t bytes, uint32_t slot, uint64_t value, SignalOp op = SignalOp::Add) {
    uint64_t lo = 256, hi = 256;  /* 256: the range lies outside the source buffer */
    if (src_off + bytes <= r.src_bytes && bytes > 0) {
        const uint8_t* p = r.src + src_off;
        lo = *std::min_element(p, p + bytes);
        hi = *std::max_element(p, p + bytes);
    }
    uint32_t i = r.count->fetch_add(1);
    if (i < r.cap) r.shipped[i] = {peer, dst_region, dst_off, src_region, src_off, bytes, slot, value,
                                   (uint64_t)op, lo, hi};
}

inline uint64_t wait(const Rec& r, uint32_t slot, uint64_t at_least) {
    uint64_t seen = slot < r.flag_count ? r.flags[slot] : ~0ull;
    if (*r.waits < r.wait_cap) r.waited[*r.waits] = {slot, at_least, seen};
    ++*r.waits;
    return seen;
}
}  // namespace tpd

#include <transportd/plan_device.cuh>

extern "C" {

/* Threads take tiles[0..n) in that order: stamp the tile's bytes, then tpd::tile_done. Returns how many calls
   shipped; *count is how many put_signals were recorded. */
uint32_t run_tiles(const tpd::Plan* plan, const uint32_t* tiles, uint32_t n, uint32_t threads, const uint64_t* tile_off,
                   const uint32_t* tile_len, uint8_t stamp, uint8_t* src, uint64_t src_bytes, Shipped* out,
                   uint32_t cap, uint32_t* count) {
    std::atomic<uint32_t> next{0}, recorded{0}, shipped{0}, ready{0};
    tpd::Rec rec{out, cap, &recorded, src, src_bytes, nullptr, 0, nullptr, nullptr, 0};
    auto work = [&]() {
        ready.fetch_add(1);
        while (ready.load() < threads) std::this_thread::yield();
        for (uint32_t i; (i = next.fetch_add(1)) < n;) {
            uint32_t t = tiles[i];
            std::memset(src + tile_off[t], stamp, tile_len[t]);
            if (tpd::tile_done(rec, *plan, t)) shipped.fetch_add(1);
        }
    };
    std::vector<std::thread> pool;
    for (uint32_t t = 0; t < threads; ++t) pool.emplace_back(work);
    for (auto& t : pool) t.join();
    *count = recorded.load();
    return shipped.load();
}

uint32_t wait_range(const tpd::Plan* plan, uint32_t rank, uint64_t off, uint64_t nbytes, const uint64_t* flags,
                    uint32_t flag_count, Waited* out, uint32_t cap) {
    uint32_t waits = 0;
    tpd::Rec rec{nullptr, 0, nullptr, nullptr, 0, out, cap, &waits, flags, flag_count};
    tpd::wait_range_thread(rec, *plan, rank, off, nbytes);
    return waits;
}

uint32_t wait_chunk(const tpd::Plan* plan, uint32_t rank, uint32_t chunk, const uint64_t* flags, uint32_t flag_count,
                    Waited* out, uint32_t cap) {
    uint32_t waits = 0;
    tpd::Rec rec{nullptr, 0, nullptr, nullptr, 0, out, cap, &waits, flags, flag_count};
    tpd::wait_chunk_thread(rec, *plan, rank, chunk);
    return waits;
}

void spans(const tpd::Plan* plan, uint32_t n, const uint32_t* ranks, const uint64_t* offs, const uint64_t* lens,
           uint32_t* out) {
    for (uint32_t i = 0; i < n; ++i) {
        tpd::RecvSpan s = tpd::recv_span(*plan, ranks[i], offs[i], lens[i]);
        out[2 * i] = s.first;
        out[2 * i + 1] = s.end;
    }
}
}
"""

SHIPPED = np.dtype([(n, "<u8") for n in ("peer", "dst_region", "dst_off", "src_region", "src_off", "bytes", "slot",
                                         "value", "op", "lo", "hi")])
WAITED = np.dtype([("slot", "<u8"), ("at_least", "<u8"), ("seen", "<u8")])
P = ctypes.c_void_p


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> ctypes.CDLL:
    out = tmp_path_factory.mktemp("plan_model")
    src = out / "model.cpp"
    src.write_text(MODEL)
    lib = out / "libplanmodel.so"
    subprocess.run([cxx(), "-std=c++17", "-O1", "-Wall", "-Wextra", "-Werror", "-fPIC", "-shared", "-pthread",
                    *INCLUDE_FLAGS, str(src), "-o", str(lib)], check=True)
    dll = ctypes.CDLL(str(lib))
    dll.run_tiles.restype = ctypes.c_uint32
    dll.run_tiles.argtypes = [P, P, ctypes.c_uint32, ctypes.c_uint32, P, P, ctypes.c_uint8, P, ctypes.c_uint64, P,
                              ctypes.c_uint32, P]
    dll.wait_range.restype = ctypes.c_uint32
    dll.wait_range.argtypes = [P, ctypes.c_uint32, ctypes.c_uint64, ctypes.c_uint64, P, ctypes.c_uint32, P,
                               ctypes.c_uint32]
    dll.wait_chunk.restype = ctypes.c_uint32
    dll.wait_chunk.argtypes = [P, ctypes.c_uint32, ctypes.c_uint32, P, ctypes.c_uint32, P, ctypes.c_uint32]
    dll.spans.restype = None
    dll.spans.argtypes = [P, ctypes.c_uint32, P, P, P, P]
    return dll


class Producer:
    """Drives run_tiles for one plan: the source buffer, the tiles' byte ranges and the monotonic counters."""

    def __init__(self, model: ctypes.CDLL, plan: ChunkPlan) -> None:
        self.model, self.plan = model, plan
        ranges = [plan.tile_range(t) for t in range(plan.tile_count)]
        self.tile_off = np.array([off for _, off, _ in ranges], dtype=np.uint64)
        self.tile_len = np.array([n for _, _, n in ranges], dtype=np.uint32)
        end = max([int(c["src_off"]) + int(c["bytes"]) for c in plan.chunks] + [1])
        self.src = np.zeros(end, dtype=np.uint8)
        self.counters = np.zeros(max(plan.chunk_count, 1), dtype=np.uint32)
        self.out = np.zeros(max(plan.send_count, 1) * 2, dtype=SHIPPED)

    def run(self, epoch: int, tiles: list[int], threads: int, stamp: int) -> tuple[int, np.ndarray]:
        handle = self.plan.host_struct(epoch, counters=self.counters)
        order = np.array(tiles, dtype=np.uint32)
        count = np.zeros(1, dtype=np.uint32)
        shipped = self.model.run_tiles(handle.ctypes.data, order.ctypes.data, len(order), threads,
                                       self.tile_off.ctypes.data, self.tile_len.ctypes.data, stamp,
                                       self.src.ctypes.data, len(self.src), self.out.ctypes.data, len(self.out),
                                       count.ctypes.data)
        assert count[0] <= len(self.out)
        return shipped, self.out[:count[0]].copy()

    def expected(self, chunks: Any) -> Counter:
        want = Counter()
        for c in chunks:
            ch = self.plan.chunks[c]
            for s in self.plan.sends[ch["first_send"]:ch["first_send"] + ch["send_count"]]:
                want[int(s["peer"]), int(s["dst_region"]), int(s["dst_off"]), int(ch["src_region"]),
                     int(ch["src_off"]), int(ch["bytes"]), int(s["slot"]), int(s["value"]), 0] += 1
        return want


def _records(shipped: np.ndarray) -> Counter:
    return Counter(tuple(int(x) for x in row)[:9] for row in shipped)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(jobs(kinds=("all_gather", "reduce_scatter", "all_to_all")), st.integers(1, 4), st.randoms(use_true_random=False),
       st.data())
def test_tile_done_ships_each_chunk_once_per_launch_from_any_thread_in_any_order(
        model: ctypes.CDLL, job: Job, threads: int, rnd: random.Random, data: st.DataObject) -> None:
    plan = job.plan(data.draw(st.integers(0, job.world - 1)))
    producer = Producer(model, plan)
    for epoch in (1, 2, 3):  # counters are never reset between launches
        tiles = list(range(plan.tile_count))
        rnd.shuffle(tiles)
        stamp = epoch * 37 % 251 + 1
        shipped, records = producer.run(epoch, tiles, threads, stamp)
        assert shipped == plan.chunk_count, "each chunk's last tile ships it, once per launch"
        assert _records(records) == producer.expected(range(plan.chunk_count)), "exactly each chunk's sends"
        assert (records["lo"] == stamp).all() and (records["hi"] == stamp).all(), "a chunk shipped before its tiles"
        assert (producer.counters[:plan.chunk_count] == epoch * plan.chunks["tiles"]).all()


def test_a_chunk_waits_for_its_last_tile(model: ctypes.CDLL) -> None:
    plan = ChunkPlan.all_gather(1, 3, 1000, 64, chunk_tiles=3)  # chunk 2 holds tiles 6, 7, 8
    producer = Producer(model, plan)
    for epoch in (1, 2):
        rest = [t for t in range(plan.tile_count) if t != 7]
        shipped, records = producer.run(epoch, rest, 3, epoch)
        assert shipped == plan.chunk_count - 1
        assert _records(records) == producer.expected(c for c in range(plan.chunk_count) if c != 2)
        shipped, records = producer.run(epoch, [7], 1, epoch)
        assert shipped == 1 and _records(records) == producer.expected([2])


@settings(max_examples=60, deadline=None)
@given(jobs(), st.integers(1, 9), st.data())
def test_wait_range_waits_for_exactly_the_chunks_the_plan_names(model: ctypes.CDLL, job: Job, epoch: int,
                                                                data: st.DataObject) -> None:
    plan = job.plan(data.draw(st.integers(0, job.world - 1)))
    counters = np.zeros(max(plan.chunk_count, 1), dtype=np.uint32)
    handle = plan.host_struct(epoch, counters=counters)
    flags = np.zeros(plan.slot_base + plan.slot_count + 1, dtype=np.uint64)
    flags[plan.recvs["slot"]] = plan.targets(epoch)
    out = np.zeros(max(plan.recv_count, 1), dtype=WAITED)
    extent = max([int(x["off"]) + int(x["bytes"]) for x in plan.recvs] + [1]) + 4
    queries = [(data.draw(st.integers(0, plan.world)), data.draw(st.integers(0, extent)),
                data.draw(st.integers(0, 200))) for _ in range(10)]
    queries += [(int(x["source"]), int(x["off"]) - 1, 2) for x in plan.recvs if x["off"] > 0]
    for rank, off, n in queries:
        count = model.wait_range(handle.ctypes.data, rank, off, n, flags.ctypes.data, len(flags), out.ctypes.data,
                                 len(out))
        got = [(int(w["slot"]), int(w["at_least"])) for w in out[:count]]
        assert got == plan.waits(rank, off, n, epoch), (rank, off, n)
        assert all(w["seen"] == w["at_least"] for w in out[:count])
    for rank in range(plan.world):
        for k in range(int(plan.recv_index[rank + 1] - plan.recv_index[rank])):
            i = int(plan.recv_index[rank]) + k
            assert model.wait_chunk(handle.ctypes.data, rank, k, flags.ctypes.data, len(flags), out.ctypes.data, 1) == 1
            assert (int(out[0]["slot"]), int(out[0]["at_least"])) == (int(plan.recvs["slot"][i]), plan.target(i, epoch))
    # the C binary search and the Python one agree, empty ranges and ranks outside the world included
    n = len(queries)
    ranks = np.array([q[0] for q in queries], dtype=np.uint32)
    offs = np.array([q[1] for q in queries], dtype=np.uint64)
    lens = np.array([q[2] for q in queries], dtype=np.uint64)
    spans = np.zeros(2 * n, dtype=np.uint32)
    model.spans(handle.ctypes.data, n, ranks.ctypes.data, offs.ctypes.data, lens.ctypes.data, spans.ctypes.data)
    assert [tuple(spans[2 * i:2 * i + 2]) for i in range(n)] == [plan.recv_span(*q) for q in queries]


class HostMemory:
    """Stands in for gpuclient.cuda_memory.DeviceMemory: zeroed host memory with the same calls."""

    def __init__(self, nbytes: int, device: int) -> None:
        self.buf = ctypes.create_string_buffer(nbytes)
        self.ptr, self.nbytes, self.device = ctypes.addressof(self.buf), nbytes, device

    def write(self, offset: int, data: bytes) -> None:
        ctypes.memmove(self.ptr + offset, data, len(data))

    def read(self, offset: int, nbytes: int) -> bytes:
        return ctypes.string_at(self.ptr + offset, nbytes)

    def free(self) -> None:
        self.ptr = 0


def test_to_device_uploads_once_and_handles_only_change_the_epoch(model: ctypes.CDLL,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    import gpuclient.cuda_memory

    monkeypatch.setattr(gpuclient.cuda_memory, "DeviceMemory", HostMemory)
    plan = ChunkPlan.all_gather(2, 3, [1000, 0, 2600], 128, chunk_tiles=3, slot_base=5, value=2)
    with pytest.raises(PlanError, match="^device: "):
        plan.handle(1)
    dp = plan.to_device(0)
    assert plan.to_device(0) is dp and len(plan.handle(1)) == PLAN_SIZE
    with pytest.raises(PlanError, match="^device: "):
        plan.to_device(1)
    v = np.frombuffer(plan.handle(3), dtype=PLAN_DTYPE)[0]
    assert v["epoch"] == 3 and v["abi"] == PLAN_ABI and v["slot_base"] == 5 and v["slot_count"] == plan.recv_count
    for name in ("chunks", "sends", "recvs", "tile_chunk", "recv_index"):
        table = getattr(plan, name)
        assert (int(v[name]) - dp.memory.ptr) % 256 == 0
        assert ctypes.string_at(int(v[name]), table.nbytes) == table.tobytes(), f"{name} uploaded as built"
    assert (dp.counters() == 0).all() and len(dp.counters()) == plan.chunk_count
    w = np.frombuffer(plan.handle(4), dtype=PLAN_DTYPE)[0]
    assert w.tobytes()[:48] == v.tobytes()[:48] and w.tobytes()[56:] == v.tobytes()[56:] and w["epoch"] == 4
    # the uploaded tables drive the header's tile_done: three launches, counters kept in the "device" memory
    producer = Producer(model, plan)
    for epoch in (1, 2, 3):
        handle = np.frombuffer(plan.handle(epoch), dtype=PLAN_DTYPE).copy()
        count = np.zeros(1, dtype=np.uint32)
        order = np.arange(plan.tile_count, dtype=np.uint32)[::-1].copy()
        shipped = model.run_tiles(handle.ctypes.data, order.ctypes.data, len(order), 2, producer.tile_off.ctypes.data,
                                  producer.tile_len.ctypes.data, epoch, producer.src.ctypes.data, len(producer.src),
                                  producer.out.ctypes.data, len(producer.out), count.ctypes.data)
        assert shipped == plan.chunk_count
        assert _records(producer.out[:count[0]]) == producer.expected(range(plan.chunk_count))
        assert (dp.counters() == epoch * plan.chunks["tiles"]).all()
    dp.release()
    assert dp.memory.ptr == 0
    with pytest.raises(PlanError, match="^device: "):
        plan.handle(1)


def test_ring_kernel_loop_on_the_cpu(model: ctypes.CDLL) -> None:
    """The ring's loop as the docs give it: wait for what the left neighbour sent at step s-1, ship it on."""
    world, block = 4, 200
    plan = ChunkPlan.ring(1, world, block, 32, chunk_tiles=2)
    producer = Producer(model, plan)
    flags = np.zeros(plan.slot_count, dtype=np.uint64)
    out = np.zeros(plan.recv_count, dtype=WAITED)
    for epoch in (1, 2):
        handle = plan.host_struct(epoch, counters=producer.counters)
        flags[:] = plan.targets(epoch)
        tiles = [t for t in range(plan.tile_count) if plan.tile_chunk[t] in plan.step_chunks(1)]
        shipped, records = producer.run(epoch, tiles, 2, epoch)
        assert shipped == len(plan.step_chunks(1)) and _records(records) == producer.expected(plan.step_chunks(1))
        for s in range(2, world):
            first = plan.step_chunks(s)[0]
            off = int(plan.chunks["src_off"][first])
            count = model.wait_range(handle.ctypes.data, 0, off, block, flags.ctypes.data, len(flags), out.ctypes.data,
                                     len(out))
            want = [(int(plan.recvs["slot"][plan.forwards[c]]), epoch) for c in plan.step_chunks(s)]
            assert [(int(w["slot"]), int(w["at_least"])) for w in out[:count]] == want
            tiles = [t for t in range(plan.tile_count) if plan.tile_chunk[t] in plan.step_chunks(s)]
            shipped, records = producer.run(epoch, tiles, 2, epoch)
            assert _records(records) == producer.expected(plan.step_chunks(s))
