"""gpuclient.kernels without a GPU: every fused kernel compiles for sm_90, and the host side's layouts are checked.

- AllGatherGemm's, GemmReduceScatter's and GemmAllReduce's kernels compile to PTX and a cubin for sm_90
  (Triton needs no GPU for that); the PTX is read back: tensor-core MMAs, no read-only-cache loads (the NIC
  writes what the kernels read mid-launch), and each device call site of the protocol once (pushes, waits,
  the quiet), none at all with ``COMMUNICATE=False``. With ``TMA=True`` (operands through tensor
  descriptors) the same protocol, bulk tensor copies instead of the operands' plain loads, and in the
  all-gather kernel one async-proxy fence, after the peers' rows are waited for; both paths' compute runs in
  Triton's interpreter against float64 on shapes whose rows, n and k do not line up with the tiles; the
  tile checks (``check_tiles``) refuse what Triton or a descriptor cannot take.
- ReduceScatterLayout (what the ops build first, torch-free): bad shapes are refused with an error naming
  the culprit; the chunks the kernel counts arrivals for are the plan's chunks, the arrival counts are what
  enumerating the tiles gives, each own tile's ``wait_range`` names exactly the chunks its rows touch, and
  the flag slots of every plan and release flag are disjoint and agree between sender and receiver.
- RingAttention: its kernel compiles for sm_90 (head_dim 64 and 128, causal or not, sizes Triton turns into
  constants), and compiled as a launch specializes it, the key loop over an arrived block is pipelined only
  after its wait; RingAttentionLayout refuses bad shapes, and the ring plan ships, forwards and raises
  exactly the chunks the kernel names; a model of the kernel's waits and sends on the plans' tables runs
  three launches in random interleavings (no stall, no early forward, no overwrite of a block being read);
  the compute programs and the own block's writer run in Triton's interpreter against float64 attention.

The ops' GPU test is tests/gpu/test_fused_kernels.py. CI installs Triton; without it these tests skip here.
"""

from __future__ import annotations

from itertools import product

import numpy as np
import pytest

from tests.support.triton_required import require_triton

require_triton()

from gpuclient.errors import PlanError  # noqa: E402
from gpuclient.kernels._tiles import DescriptorScratch, check_group, check_tiles, tile_order  # noqa: E402
from gpuclient.kernels.allgather_gemm import _allgather_gemm  # noqa: E402
from gpuclient.kernels.gemm_reduce_scatter import ReduceScatterLayout, _gemm_reduce_scatter  # noqa: E402
from gpuclient.kernels.ring_attention import RingAttentionLayout, _ring_attention  # noqa: E402
from gpuclient.plan import NO_RECV  # noqa: E402
from tests.gpuclient.test_triton import compile_kernel, guarded_blocks, opcode, ptx_lines  # noqa: E402
from tests.support.interpreted import run_interpreted  # noqa: E402

BLOCK = {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64}


# --- compiling ------------------------------------------------------------------------------------------------
def protocol_sites(ptx: str) -> tuple[int, int, int, list[str]]:
    """(push sites, wait sites, quiet sites, every opcode) of a compiled kernel's PTX."""
    lines = ptx_lines(ptx)
    blocks = guarded_blocks(lines)
    quiets = [b for b in blocks if any(s.startswith("TPD_QUIET_") for s in b)]
    pushes = [b for b in blocks if any(opcode(s) == "st.release.sys.global.u64" for s in b) and b not in quiets]
    waits = [b for b in blocks if any(s.startswith("TPD_WAIT_") for s in b)]
    return len(pushes), len(waits), len(quiets), [opcode(s) for s in lines]


AG_SIG = {"ch": "*u64", "plan": "*u64", "rounds_ptr": "*i32", "a_ptr": "*bf16", "b_ptr": "*bf16", "c_ptr": "*fp32",
          "done_ptr": "*i32", "rank": "i32", "world": "i32", "m_local": "i32", "n": "i32", "k": "i32",
          "chunks": "i32", "release_slot": "i32"}


def rs_signature(partial: str, out: str) -> dict[str, str]:
    return {"ch": "*u64", "rs_plan": "*u64", "ag_plan": "*u64", "rounds_ptr": "*i32", "a_ptr": "*bf16",
            "b_ptr": "*bf16",
            "partial_ptr": f"*{partial}", "staging_ptr": f"*{partial}", "out_ptr": f"*{out}", "arrive_ptr": "*i32",
            "rank": "i32", "world": "i32", "m_seg": "i32", "n": "i32", "k": "i32",
            "chunk_rows": "i32", "chunks_per_segment": "i32", "release_slot": "i32", "ag_release_slot": "i32",
            "timeline": "*i64"}


@pytest.mark.parametrize(("communicate", "compute"), [(True, True), (False, True), (True, False)])
def test_the_allgather_gemm_kernel_compiles_for_sm90(communicate: bool, compute: bool) -> None:
    compiled = compile_kernel(_allgather_gemm, AG_SIG, {"COMM_PROGRAMS": 1, **BLOCK, "COMMUNICATE": communicate,
                                                        "COMPUTE": compute}, num_warps=8)
    assert compiled.asm["cubin"][:4] == b"\x7fELF"
    pushes, waits, quiets, code = protocol_sites(compiled.asm["ptx"])
    # bf16 tl.dot on the tensor cores, and none when compute=False (the communication alone)
    assert any(op.startswith("wgmma") for op in code) == compute
    assert not [op for op in code if ".nc" in op]  # no read-only-cache loads of rows a peer's NIC writes
    # tile_done's send loop and the release signal; the release wait and wait_range; the closing quiet
    assert (pushes, waits, quiets) == ((2, 2, 1) if communicate else (0, 0, 0))


@pytest.mark.parametrize(("all_gather", "partial", "out", "compute"), [
    (False, "bf16", "fp32", True), (False, "fp32", "bf16", True), (True, "bf16", "bf16", True),
    (False, "bf16", "fp32", False), (True, "bf16", "bf16", False)])
def test_the_gemm_reduce_scatter_kernels_compile_for_sm90(all_gather: bool, partial: str, out: str,
                                                         compute: bool) -> None:
    meta = {**BLOCK, "PARTIAL_BYTES": 2 if partial == "bf16" else 4, "COMMUNICATE": True, "COMPUTE": compute,
            "ALL_GATHER": all_gather}
    compiled = compile_kernel(_gemm_reduce_scatter, rs_signature(partial, out), meta, num_warps=8)
    assert compiled.asm["cubin"][:4] == b"\x7fELF"
    pushes, waits, quiets, code = protocol_sites(compiled.asm["ptx"])
    # bf16 tl.dot on the tensor cores, and none with compute off; the protocol is the same either way
    assert any(op.startswith("wgmma") for op in code) == compute
    assert not [op for op in code if ".nc" in op]  # staging and result are written by the NIC mid-launch
    if all_gather:
        # pushes: both plans' tile_done, the result release at the start, the staging release at the end;
        # waits: staging release, every peer's result release, wait_range over staging, wait_chunk of result
        assert (pushes, waits, quiets) == (4, 4, 1)
    else:
        # pushes: tile_done, the staging release; waits: the staging release, wait_range over staging
        assert (pushes, waits, quiets) == (2, 2, 1)


@pytest.mark.parametrize("all_gather", [False, True])
def test_a_timeline_adds_clock_reads_and_nothing_to_the_protocol(all_gather: bool) -> None:
    meta = {**BLOCK, "PARTIAL_BYTES": 2, "COMMUNICATE": True, "COMPUTE": True, "ALL_GATHER": all_gather}
    plain, timed = (compile_kernel(_gemm_reduce_scatter, rs_signature("bf16", "bf16"), {**meta, "TIMELINE": on},
                                   num_warps=8) for on in (False, True))
    clock_reads = [sum("%globaltimer" in line for line in ptx_lines(c.asm["ptx"])) for c in (plain, timed)]
    # tile start, computed, waited, end, program end, and a chunk's completion and shipping per _arrive site
    assert clock_reads[1] - clock_reads[0] == 5 + 2 * (2 if all_gather else 1)
    assert protocol_sites(timed.asm["ptx"])[:3] == protocol_sites(plain.asm["ptx"])[:3]


def test_the_timeline_layout_counts_every_event() -> None:
    lay = ReduceScatterLayout(0, 2, m=300, n=200, k=64, chunk_rows=64, block=(128, 128, 64))
    # 2 segments x 2 row blocks x 2 column blocks, 3 chunk counters per segment and one more set, 7 programs
    assert lay.timeline_words(7) == 4 * 8 + 2 * 3 * 3 + 7
    tiles, chunks, ends = lay.split_timeline(np.arange(lay.timeline_words(7)), 7)
    assert tiles.shape == (8, 4) and chunks.shape == (3, 3, 2) and list(ends) == list(range(50, 57))
    assert tiles[1, 0] == 4 and chunks[0, 0, 0] == 32 and chunks[2, 2, 1] == 49  # in the kernel's order
    with pytest.raises(ValueError, match="a timeline of 7 programs is 57 words"):
        lay.split_timeline(np.zeros(56), 7)


def test_the_compute_only_variant_has_no_protocol_at_all() -> None:
    meta = {**BLOCK, "PARTIAL_BYTES": 2, "COMMUNICATE": False, "COMPUTE": True, "ALL_GATHER": True}
    compiled = compile_kernel(_gemm_reduce_scatter, rs_signature("bf16", "fp32"), meta, num_warps=8)
    pushes, waits, quiets, code = protocol_sites(compiled.asm["ptx"])
    assert (pushes, waits, quiets) == (0, 0, 0)
    assert not [op for op in code if op.startswith("atom")]  # no arrival or done counting either


@pytest.mark.parametrize("communicate", [True, False])
@pytest.mark.parametrize("block", [(128, 128, 64), (128, 256, 64)])
def test_the_gemm_kernels_compile_with_tensor_descriptors_for_sm90(communicate: bool, block: tuple) -> None:
    tiles = dict(zip(("BLOCK_M", "BLOCK_N", "BLOCK_K"), block, strict=True))
    ag = compile_kernel(_allgather_gemm, AG_SIG, {"COMM_PROGRAMS": 1, **tiles, "COMMUNICATE": communicate,
                                                  "COMPUTE": True, "TMA": True}, num_warps=8)
    ar = compile_kernel(_gemm_reduce_scatter, rs_signature("bf16", "bf16"),
                        {**tiles, "PARTIAL_BYTES": 2, "COMMUNICATE": communicate, "COMPUTE": True,
                         "ALL_GATHER": True, "TMA": True}, num_warps=8)
    for compiled, protocol in ((ag, (2, 2, 1)), (ar, (4, 4, 1))):
        assert compiled.asm["cubin"][:4] == b"\x7fELF"
        assert compiled.metadata.global_scratch_size > 0  # the descriptors Triton asks an allocator for
        pushes, waits, quiets, code = protocol_sites(compiled.asm["ptx"])
        assert (pushes, waits, quiets) == (protocol if communicate else (0, 0, 0))
        assert any(op.startswith("wgmma") for op in code)
        assert any(op.startswith("cp.async.bulk.tensor") for op in code)  # A and B through TMA
        assert not [op for op in code if ".nc" in op]
    lines = ptx_lines(ag.asm["ptx"])
    if not communicate:  # the compute alone loads nothing but through the descriptors
        assert not [opcode(line) for line in lines if opcode(line).startswith(("ld.global", "cp.async.c"))]
    fences = [i for i, line in enumerate(lines) if opcode(line) == "fence.proxy.async.global"]
    if communicate:  # one fence, after the wait for the peers' rows (the wait is the kernel's second)
        waits = [i for i, line in enumerate(lines) if line.startswith("TPD_WAIT_")]
        assert len(fences) == 1 and fences[0] > min(waits)
    else:
        assert fences == []
    assert "fence.proxy.async.global" not in ar.asm["ptx"]  # A and B are local: nothing to order


def test_a_grouped_tile_order_compiles_with_the_same_protocol() -> None:
    tiles = {"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64, "TMA": True, "GROUP_M": 4}
    ag = compile_kernel(_allgather_gemm, AG_SIG, {"COMM_PROGRAMS": 1, **tiles, "COMMUNICATE": True, "COMPUTE": True},
                        num_warps=8)
    ar = compile_kernel(_gemm_reduce_scatter, rs_signature("bf16", "bf16"),
                        {**tiles, "PARTIAL_BYTES": 2, "COMMUNICATE": True, "COMPUTE": True, "ALL_GATHER": True},
                        num_warps=8)
    for compiled, protocol in ((ag, (2, 2, 1)), (ar, (4, 4, 1))):
        pushes, waits, quiets, code = protocol_sites(compiled.asm["ptx"])
        assert (pushes, waits, quiets) == protocol
        assert any(op.startswith("wgmma") for op in code)


def test_the_descriptor_scratch_is_tritons_allocator_only_inside_the_ops_launch() -> None:
    from types import SimpleNamespace

    from triton.runtime import _allocation

    class Reserved:  # a buffer reserved at preload (torch's, on the GPU)
        def numel(self) -> int:
            return 66 * 256

        def data_ptr(self) -> int:
            return 1 << 20

    scratch = DescriptorScratch("cuda:0")
    def compiled(size: int) -> SimpleNamespace:  # what preload returns, as far as the scratch reads it
        return SimpleNamespace(metadata=SimpleNamespace(global_scratch_size=size, num_ctas=1))

    scratch.reserve_for(compiled(0), 66)  # no descriptors: nothing taken
    assert scratch.nbytes == 0
    scratch._buffers.append(Reserved())
    scratch.reserve_for(compiled(256), 66)  # fits: nothing new
    assert scratch.nbytes == 66 * 256
    before = _allocation._allocator.get()

    def launch():  # what Triton's launcher does for a kernel with global scratch
        return _allocation._allocator.get()(66 * 256, 128, 0)

    assert scratch.launch(launch) is scratch._buffers[-1]
    assert _allocation._allocator.get() is before  # the caller's allocator is untouched


def test_the_gemm_compute_in_the_interpreter() -> None:
    """AllGatherGemm's and GemmReduceScatter's / GemmAllReduce's compute programs, pointers and descriptors,
    run by Triton's interpreter against float64 numpy (tests/gpuclient/gemm_interpreted.py says what and how)."""
    run = run_interpreted("tests.gpuclient.gemm_interpreted")
    assert run.returncode == 0 and run.stdout.rstrip().endswith("ok"), run.stdout + run.stderr


@pytest.mark.parametrize(("args", "message"), [
    (((128, 96, 64), 8, 3, False), "powers of two >= 16"),
    (((128, 128), 8, 3, False), "powers of two >= 16"),
    (((128, 128, 8), 8, 3, False), "powers of two >= 16"),
    (((128, 128, 64), 6, 3, False), "num_warps must be a power of two"),
    (((128, 128, 64), True, 3, False), "num_warps must be a power of two"),
    (((128, 128, 64), 8, 0, False), "num_stages must be an integer >= 1"),
    (((128, 128, 64), 8, 3, 1), "tma must be a bool or None"),
    (((128, 128, 64), 8, 3, True), "needs n to be a multiple of 8"),
])
def test_bad_tiles_are_refused_with_the_culprit_named(args: tuple, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        check_tiles(*args, n=100, k=64)
    assert check_tiles([64, 256, 64], 4, 4, True, n=96, k=64) == ((64, 256, 64), 4, 4, True)
    with pytest.raises(ValueError, match="needs k to be a multiple of 8"):
        check_tiles((128, 128, 64), 8, 3, True, n=96, k=100)


@pytest.mark.parametrize("group_m", [0, -1, True, 1.0, "4", None])
def test_a_bad_tile_order_is_refused_with_the_culprit_named(group_m: object) -> None:
    with pytest.raises(ValueError, match="group_m must be an integer >= 1"):
        check_group(group_m)
    assert check_group(3) == 3


@pytest.mark.parametrize(("row_blocks", "col_blocks", "group_m"), [(5, 3, 1), (5, 3, 2), (8, 4, 4), (3, 7, 8)])
def test_the_tile_order_visits_every_tile_once_group_by_group(row_blocks: int, col_blocks: int, group_m: int) -> None:
    order = tile_order(row_blocks, col_blocks, group_m)
    assert sorted(order) == list(product(range(row_blocks), range(col_blocks)))
    if group_m == 1:
        assert order == list(product(range(row_blocks), range(col_blocks)))  # row-major
    for i, (r, c) in enumerate(order):  # group by group, column by column inside one
        first = r // group_m * group_m
        size = min(group_m, row_blocks - first)
        assert i == first * col_blocks + c * size + (r - first)


@pytest.mark.parametrize("shape", [(2, 4096, 8192, 512, 128), (3, 3 * 700, 1024, 256, 64), (2, 1000, 640, 96, 32)])
def test_a_group_of_one_chunks_rows_completes_each_chunk_as_row_major_order_does(shape: tuple) -> None:
    """A GEMM+RS chunk ships with its last tile: grouped by one chunk's row blocks, that tile comes at the same
    index of the kernel's order as in row-major order, so every chunk ships as early."""
    world, m, n, chunk_rows, bm = shape
    def last_tile(group_m: int) -> list[int]:
        layout = ReduceScatterLayout(0, world, m, n, 64, chunk_rows=chunk_rows, block=(bm, 128, 64), group_m=group_m)
        last = [0] * layout.chunks_per_segment
        for i, (step, r, _c) in enumerate(layout.tile_order()):
            if step == 0:
                for chunk in layout.tile_chunks(r * bm, min(bm, layout.m_seg - r * bm)):
                    last[chunk] = i
        return last
    assert last_tile(chunk_rows // bm) == last_tile(1)
    assert last_tile(2 * chunk_rows // bm) != last_tile(1)  # two chunks a group: the first ships later


def test_tma_none_takes_descriptors_exactly_where_the_rows_allow() -> None:
    assert check_tiles((128, 256, 64), 8, 3, None, n=96, k=64)[3] is True
    assert check_tiles((128, 256, 64), 8, 3, None, n=100, k=64)[3] is False
    assert check_tiles((128, 256, 64), 8, 3, None, n=96, k=36)[3] is False
    assert check_tiles((128, 256, 64), 8, 3, False, n=96, k=64)[3] is False


# --- the layout: refusals ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(("kwargs", "message"), [
    ({"m": 401}, "m=401 rows do not split into 2 equal segments"),
    ({"m": 0}, "m must be an integer >= 1"),
    ({"n": -3}, "n must be an integer >= 1"),
    ({"k": 2.5}, "k must be an integer >= 1"),
    ({"chunk_rows": 0}, "chunk_rows must be an integer >= 1"),
    ({"rank": 2}, r"rank must be in \[0, 2\)"),
    ({"rank": True}, r"rank must be in \[0, 2\)"),
    ({"slot_base": -1}, "slot_base must be an integer >= 0"),
    ({"block": (128, 96, 64)}, "powers of two >= 16"),
    ({"block": (8, 128, 64)}, "powers of two >= 16"),
    ({"block": (128, 128)}, "powers of two >= 16"),
    ({"partial_bytes": 1}, "partial_bytes must be 2 .bf16. or 4 .fp32."),
    ({"group_m": 0}, "group_m must be an integer >= 1"),
    ({"group_m": 2.0}, "group_m must be an integer >= 1"),
    ({"out_bytes": 8}, "out_bytes must be 2 .bf16. or 4 .fp32."),
    ({"n": 1 << 26, "chunk_rows": 64}, "passes a put's 32-bit length: lower chunk_rows"),
    ({"n": 1 << 26, "chunk_rows": 1, "out_bytes": 4, "partial_bytes": 2, "all_gather": True},
     "rows of 268435456 bytes .output."),
])
def test_bad_shapes_are_refused_with_the_culprit_named(kwargs: dict, message: str) -> None:
    args = {"rank": 0, "world": 2, "m": 400, "n": 320, "k": 320, **kwargs}
    if "output" in message:  # one row of fp32 output passes 2^32 / 16: make chunks of 16 rows
        args["chunk_rows"] = 16
    with pytest.raises(ValueError, match=message):
        ReduceScatterLayout(**args)


def test_a_missing_result_region_and_slots_past_2_to_the_32_are_refused() -> None:
    layout = ReduceScatterLayout(0, 2, 400, 320, 320, chunk_rows=48, slot_base=3)
    plan, _ = layout.plans(0, 1)
    assert plan.slot_base == 3 and layout.slots == layout.incoming_chunks + 2
    with pytest.raises(ValueError, match="result buffer's region"):
        ReduceScatterLayout(0, 2, 400, 320, 320, all_gather=True).plans(0, 1)
    with pytest.raises(PlanError, match="slot_base"):
        ReduceScatterLayout(0, 2, 400, 320, 320, slot_base=1 << 32).plans(0, 1)


# --- the layout: what the kernel relies on -----------------------------------------------------------------------
SHAPES = [  # (world, m, n, chunk_rows, block_m, block_n): tiles, chunks and segments out of line
    (2, 400, 320, 48, 128, 128),
    (3, 3 * 77, 200, 16, 64, 64),
    (4, 4 * 130, 96, 200, 128, 32),  # one chunk per segment, longer than the segment
    (2, 2 * 256, 256, 64, 128, 128),  # everything in line
    (1, 100, 64, 30, 32, 64),  # no peers
]


def tiles_of(layout: ReduceScatterLayout) -> list[tuple[int, int, int]]:
    """Every tile of one segment as the kernel cuts it: (row0, rows, col0)."""
    bm, bn, _ = layout.block
    return [(rb * bm, min(bm, layout.m_seg - rb * bm), cb * bn)
            for rb, cb in product(range(layout.row_blocks), range(layout.col_blocks))]


@pytest.mark.parametrize("shape", SHAPES)
def test_arrivals_are_the_tiles_that_touch_each_chunk(shape: tuple) -> None:
    world, m, n, chunk_rows, bm, bn = shape
    layout = ReduceScatterLayout(0, world, m, n, 64, chunk_rows=chunk_rows, block=(bm, bn, 64))
    counted = np.zeros(layout.chunks_per_segment, dtype=int)
    for row0, rows, _ in tiles_of(layout):
        touched = [c for c in range(layout.chunks_per_segment)
                   if max(row0, layout.chunk_rows_of(c)[0]) < min(row0 + rows, layout.chunk_rows_of(c)[1])]
        assert list(layout.tile_chunks(row0, rows)) == touched
        counted[touched] += 1
    assert [layout.arrivals(c) for c in range(layout.chunks_per_segment)] == counted.tolist()
    assert (counted > 0).all()
    assert layout.tiles == world * len(tiles_of(layout))


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("out_bytes", [2, 4])
def test_the_plans_carry_the_chunks_the_kernel_names(shape: tuple, out_bytes: int) -> None:
    world, m, n, chunk_rows, bm, bn = shape
    layouts = [ReduceScatterLayout(r, world, m, n, 64, chunk_rows=chunk_rows, block=(bm, bn, 64), out_bytes=out_bytes,
                                   slot_base=5, all_gather=True) for r in range(world)]
    plans = [lay.plans(partial_region=0, staging_region=1, result_region=2) for lay in layouts]
    lay = layouts[0]
    cps, row_p, row_o = lay.chunks_per_segment, n * lay.partial_bytes, n * out_bytes
    for r, (rs, ag) in enumerate(plans):
        for j, c in product(range(world), range(cps)):
            lo, hi = lay.chunk_rows_of(c)
            chunk = rs.chunks[j * cps + c]  # the kernel ships chunk c of segment j as plan tile j * cps + c
            assert int(rs.tile_chunk[j * cps + c]) == j * cps + c
            assert (int(chunk["src_off"]), int(chunk["bytes"])) == ((j * lay.m_seg + lo) * row_p, (hi - lo) * row_p)
            sends = rs.sends[int(chunk["first_send"]):int(chunk["first_send"]) + int(chunk["send_count"])]
            if j == r:
                assert len(sends) == 0  # the own segment is summed in registers, never shipped
                continue
            # into j's staging, at the slot of sender r, raising the flag j's wait_range waits on
            assert [(int(s["peer"]), int(s["dst_region"]), int(s["dst_off"])) for s in sends] == [
                (j, 1, (r * lay.m_seg + lo) * row_p)]
            assert plans[j][0].waits(r, (r * lay.m_seg + lo) * row_p, (hi - lo) * row_p, 1) == [
                (int(sends[0]["slot"]), 1)]
        for c in range(cps):  # our reduced rows, in place, to every peer's result
            lo, hi = lay.chunk_rows_of(c)
            chunk = ag.chunks[c]
            assert (int(chunk["src_off"]), int(chunk["bytes"])) == ((r * lay.m_seg + lo) * row_o, (hi - lo) * row_o)
            assert int(chunk["send_count"]) == world - 1
        # an own tile's wait_range over its rows names exactly the chunks the tile touches, from every peer
        for (row0, rows, _), src in product(tiles_of(lay), range(world)):
            if src == r:
                continue
            first, end = rs.recv_span(src, (src * lay.m_seg + row0) * row_p, rows * row_p)
            assert [int(o) // row_p - src * lay.m_seg for o in rs.recvs["off"][first:end]] == [
                lay.chunk_rows_of(c)[0] for c in lay.tile_chunks(row0, rows)]
        # wait_chunk(src, c) in the closing phase: c-th chunk from src is rows c of src's segment
        for src in range(world):
            if src != r:
                lo_i = int(ag.recv_index[src])
                assert [int(o) for o in ag.recvs["off"][lo_i:lo_i + cps]] == [
                    (src * lay.m_seg + lay.chunk_rows_of(c)[0]) * row_o for c in range(cps)]


@pytest.mark.parametrize("world", [1, 2, 3, 5])
def test_flag_slots_are_disjoint_and_inside_the_ops_range(world: int) -> None:
    lay = ReduceScatterLayout(world - 1, world, world * 90, 64, 64, chunk_rows=40, slot_base=7, all_gather=True)
    rs, ag = lay.plans(0, 1, 2)
    used = [*rs.recvs["slot"].tolist(), *range(lay.release_slot, lay.release_slot + world),
            *ag.recvs["slot"].tolist(), *range(lay.ag_release_slot, lay.ag_release_slot + world)]
    assert len(used) == len(set(used)) == lay.slots
    assert min(used) == lay.slot_base and max(used) == lay.slot_base + lay.slots - 1
    rs_only = ReduceScatterLayout(0, world, world * 90, 64, 64, chunk_rows=40, slot_base=7)
    assert rs_only.slots == rs_only.incoming_chunks + world


# --- RingAttention ------------------------------------------------------------------------------------------------
RA_SIG = {"ch": "*u64", "plan": "*u64", "rounds_ptr": "*i32", "q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16",
          "kv_ptr": "*bf16", "out_ptr": "*fp32", "acc_ptr": "*fp32", "ml_ptr": "*fp32",
          "rank": "i32", "world": "i32", "heads": "i32", "seq": "i32", "chunk_elems": "i32",
          "chunks_per_block": "i32", "release_slot": "i32", "qk_scale": "fp32"}


def ra_meta(head_dim: int, causal: bool, communicate: bool = True, compute: bool = True) -> dict:
    return {"COMM_PROGRAMS": 1, "HEAD_DIM": head_dim, "BLOCK_M": 64, "BLOCK_N": 64, "COPY_BLOCK": 1024,
            "CAUSAL": causal, "COMMUNICATE": communicate, "COMPUTE": compute}


@pytest.mark.parametrize(("head_dim", "causal", "out"), [(64, False, "fp32"), (128, False, "bf16"), (64, True, "bf16"),
                                                         (128, True, "fp32")])
def test_the_ring_attention_kernel_compiles_for_sm90(head_dim: int, causal: bool, out: str) -> None:
    compiled = compile_kernel(_ring_attention, {**RA_SIG, "out_ptr": f"*{out}"}, ra_meta(head_dim, causal))
    assert compiled.asm["cubin"][:4] == b"\x7fELF"
    pushes, waits, quiets, code = protocol_sites(compiled.asm["ptx"])
    assert any(op.startswith("wgmma") for op in code)  # Q K^T and P V on the tensor cores
    assert not [op for op in code if ".nc" in op]  # kv is written by the NIC mid-launch
    # pushes: tile_done of the own block's chunks, tile_done of a forwarded chunk, the release signal;
    # waits: the release, the forwarded chunk's arrival, a head's range before the key loop; the closing quiet
    assert (pushes, waits, quiets) == (3, 3, 1)


@pytest.mark.parametrize("communicate", [True, False])
def test_the_ring_attention_kernel_compiles_with_tensor_descriptors_for_sm90(communicate: bool) -> None:
    meta = {**ra_meta(128, False, communicate), "BLOCK_M": 128, "BLOCK_N": 128, "TMA": True}
    compiled = compile_kernel(_ring_attention, RA_SIG, meta, num_warps=8)
    assert compiled.asm["cubin"][:4] == b"\x7fELF"
    assert compiled.metadata.global_scratch_size > 0  # the descriptors Triton asks an allocator for
    pushes, waits, quiets, code = protocol_sites(compiled.asm["ptx"])
    assert (pushes, waits, quiets) == ((3, 3, 1) if communicate else (0, 0, 0))  # the protocol as without
    assert any(op.startswith("wgmma") for op in code)
    assert any(op.startswith("cp.async.bulk.tensor") for op in code)  # the whole key blocks through TMA
    assert not [op for op in code if ".nc" in op]
    lines = ptx_lines(compiled.asm["ptx"])
    fences = [i for i, line in enumerate(lines) if opcode(line) == "fence.proxy.async.global"]
    if communicate:  # after the wait for a head's range of an arrived block, before any descriptor load
        waits_at = [i for i, line in enumerate(lines) if line.startswith("TPD_WAIT_")]
        assert len(fences) == 1 and fences[0] > min(waits_at)
        wait = max(i for i in waits_at if i < fences[0])
        assert not [line for line in lines[wait:fences[0]] if opcode(line).startswith("cp.async.bulk.tensor")]
    else:
        assert fences == []


def test_the_ring_attention_communication_only_variant_ships_and_waits_without_tensor_cores() -> None:
    compiled = compile_kernel(_ring_attention, RA_SIG, ra_meta(128, False, compute=False))
    pushes, waits, quiets, code = protocol_sites(compiled.asm["ptx"])
    assert not any(op.startswith("wgmma") for op in code)
    assert (pushes, waits, quiets) == (3, 3, 1)  # the same protocol as the fused kernel's


def test_the_ring_attention_compute_only_variant_has_no_protocol() -> None:
    compiled = compile_kernel(_ring_attention, RA_SIG, ra_meta(128, False, communicate=False))
    pushes, waits, quiets, code = protocol_sites(compiled.asm["ptx"])
    assert (pushes, waits, quiets) == (0, 0, 0)
    assert not [op for op in code if op.startswith("atom")]


def test_the_ring_attention_kernel_compiles_where_triton_makes_sizes_of_1_constants() -> None:
    # Triton specializes an int argument equal to 1 into a constant: one head, one position, one rank
    ones = {"world": 1, "heads": 1, "seq": 1, "chunks_per_block": 1}
    for communicate in (True, False):
        compiled = compile_kernel(_ring_attention, RA_SIG, {**ones, **ra_meta(64, True, communicate)})
        assert compiled.asm["cubin"][:4] == b"\x7fELF"


def test_the_ring_attention_arithmetic_in_the_interpreter() -> None:
    """The compute programs and the own block's interleave, run by Triton's interpreter against float64
    numpy (tests/gpuclient/ring_attention_interpreter.py says what and how)."""
    run = run_interpreted("tests.gpuclient.ring_attention_interpreter")
    assert run.returncode == 0 and run.stdout.rstrip().endswith("ok"), run.stdout + run.stderr


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"head_dim": 96}, r"head_dim must be one of \(64, 128\)"),
    ({"head_dim": 256}, r"head_dim must be one of \(64, 128\)"),
    ({"heads": 0}, "heads must be an integer >= 1"),
    ({"seq_local": -1}, "seq_local must be an integer >= 1"),
    ({"seq_local": 2.0}, "seq_local must be an integer >= 1"),
    ({"chunk_rows": 0}, "chunk_rows must be an integer >= 1"),
    ({"world": 0}, "world must be an integer >= 1"),
    ({"rank": 2}, r"rank must be in \[0, 2\)"),
    ({"rank": -1}, r"rank must be in \[0, 2\)"),
    ({"slot_base": -1}, "slot_base must be an integer >= 0"),
    ({"block": (64, 48)}, r"powers of two in \[16, 256\]"),
    ({"block": (8, 64)}, r"powers of two in \[16, 256\]"),
    ({"block": (64,)}, r"powers of two in \[16, 256\]"),
    ({"out_bytes": 1}, r"out_bytes must be 2 \(bf16\) or 4 \(fp32\)"),
    ({"causal": 1}, "causal must be a bool"),
    ({"heads": 64, "seq_local": 1 << 17}, "pass 2.31 elements"),  # (so a chunk always fits a put's 32 bits)
])
def test_ring_attention_refuses_bad_shapes_with_the_culprit_named(kwargs: dict, message: str) -> None:
    args = {"rank": 0, "world": 2, "heads": 3, "seq_local": 200, "head_dim": 128, **kwargs}
    with pytest.raises(ValueError, match=message):
        RingAttentionLayout(**args)


RA_SHAPES = [  # (world, heads, seq_local, head_dim, chunk_rows): chunks out of line with heads and tiles
    (2, 3, 200, 128, 48),
    (3, 2, 77, 64, 30),
    (4, 1, 64, 64, 64),  # everything in line
    (3, 2, 50, 128, 1000),  # one chunk per block, longer than the block
    (5, 3, 33, 64, 7),
]


@pytest.mark.parametrize("shape", RA_SHAPES)
def test_the_ring_plan_carries_the_chunks_the_kernel_ships(shape: tuple) -> None:
    world, heads, seq, head_dim, chunk_rows = shape
    lays = [RingAttentionLayout(r, world, heads, seq, head_dim, chunk_rows=chunk_rows, slot_base=4)
            for r in range(world)]
    plans = [lay.plan(kv_region=2) for lay in lays]
    cpb = lays[0].chunks_per_block
    assert cpb == -(-lays[0].block_bytes // lays[0].chunk_bytes)
    for r, (lay, plan) in enumerate(zip(lays, plans, strict=True)):
        assert lay.block_bytes == heads * seq * 2 * head_dim * 2 and lay.kv_bytes == world * lay.block_bytes
        for s in range(1, world):
            # the kernel's chunk j of step s is plan chunk (and tile) (s - 1) * cpb + j, of the block sent at s
            assert plan.step_chunks(s) == range(lay.plan_chunk(s, 0), lay.plan_chunk(s, cpb))
            for j in range(cpb):
                c = lay.plan_chunk(s, j)
                assert int(plan.tile_chunk[c]) == c and int(plan.chunks["tiles"][c]) == 1
                off, nbytes = lay.chunk_span(lay.sent_at(s), j)
                chunk = plan.chunks[c]
                assert (int(chunk["src_off"]), int(chunk["bytes"]), int(chunk["src_region"])) == (off, nbytes, 2)
                (send,) = plan.sends[int(chunk["first_send"]):int(chunk["first_send"]) + int(chunk["send_count"])]
                assert (int(send["peer"]), int(send["dst_region"]), int(send["dst_off"])) == (lay.right, 2, off)
                # the right neighbour's wait for exactly these bytes raises on this send's slot
                assert plans[lay.right].waits(r, off, nbytes, 3) == [(int(send["slot"]), 3)]
                if s >= 2:  # the kernel's wait_range before forwarding names exactly the chunk the plan forwards
                    first, end = plan.recv_span(lay.left, off, nbytes)
                    assert (first, end) == (int(plan.forwards[c]), int(plan.forwards[c]) + 1)
        # the compute's wait at step s, head h: the chunks from the left that intersect the head's K and V rows
        for s, h in product(range(1, world), range(heads)):
            origin = lay.origin_at(s)
            off, nbytes = lay.head_span(origin, h)
            first, end = plan.recv_span(lay.left, off, nbytes)
            recvs = plan.recvs[first:end]
            assert len(recvs) > 0 and (recvs["source"] == lay.left).all()
            assert int(recvs["off"][0]) <= off and int(recvs["off"][-1] + recvs["bytes"][-1]) >= off + nbytes
            inside = [(int(o), int(o + b)) for o, b in plan.recvs[["off", "bytes"]][int(plan.recv_index[lay.left]):
                                                                                 int(plan.recv_index[lay.left + 1])]
                      if o < off + nbytes and o + b > off]
            assert inside == [(int(o), int(o + b)) for o, b in recvs[["off", "bytes"]]]
            assert origin * lay.block_bytes <= int(recvs["off"][0]) < (origin + 1) * lay.block_bytes


@pytest.mark.parametrize("world", [1, 2, 3, 5])
def test_ring_attention_flag_slots_are_disjoint_and_inside_the_ops_range(world: int) -> None:
    lay = RingAttentionLayout(world - 1, world, 3, 40, 64, chunk_rows=16, slot_base=9)
    plan = lay.plan(0)
    used = [*plan.recvs["slot"].tolist(), lay.release_slot]
    assert len(used) == len(set(used)) == lay.slots
    assert min(used) == lay.slot_base and max(used) == lay.slot_base + lay.slots - 1
    assert plan.recv_count == (world - 1) * lay.chunks_per_block  # every origin but ours, once per launch


def test_causal_steps_skip_exactly_the_later_origins() -> None:
    for world, rank in product(range(1, 5), range(4)):
        if rank >= world:
            continue
        lay = RingAttentionLayout(rank, world, 2, 30, 64, causal=True)
        read = {lay.origin_at(s) for s in range(1, world) if lay.keys_read(s)}
        assert read == set(range(rank))  # origins before ours in full, ours on the diagonal (step 0)
        assert {lay.origin_at(s) for s in range(world)} == set(range(world))


@pytest.mark.parametrize(("world", "comm_programs"), [(2, 1), (3, 1), (3, 2), (4, 3)])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_ring_schedule_completes_and_never_overwrites_what_is_read(world: int, comm_programs: int,
                                                                       seed: int) -> None:
    """A model of the kernel's waits and sends, on the plans' own tables, over three launches per rank and a
    random interleaving: every program finishes (no deadlock), every wait is met by exactly the launch's
    chunk, a chunk is passed on only once it arrived, and no chunk lands in a block its receiver may still
    read (the release flag's back-pressure)."""
    launches = 3
    lays = [RingAttentionLayout(r, world, 2, 37, 64, chunk_rows=20) for r in range(world)]
    plans = [lay.plan(0) for lay in lays]
    cpb = lays[0].chunks_per_block
    flags = [np.zeros(lays[0].slot_base + lays[0].slots, dtype=np.int64) for _ in range(world)]
    landed = [{} for _ in range(world)]  # rank -> {incoming chunk index: launch whose bytes are there}
    reading = [0] * world  # the launch whose blocks a rank may still read (0: none)

    def ship(r: int, c: int, e: int) -> None:
        chunk = plans[r].chunks[c]
        if plans[r].forwards[c] != NO_RECV:  # passing on what came from the left: it must be this launch's
            assert landed[r].get(int(plans[r].forwards[c])) == e, f"rank {r} forwards chunk {c} before it arrived"
        for send in plans[r].sends[int(chunk["first_send"]):int(chunk["first_send"]) + int(chunk["send_count"])]:
            dst = int(send["peer"])
            assert reading[dst] in (0, e), f"rank {r} launch {e} overwrites rank {dst}'s launch {reading[dst]}"
            (i,) = range(*plans[dst].recv_span(r, int(send["dst_off"]), int(chunk["bytes"])))
            landed[dst][i] = e
            flags[dst][int(send["slot"])] += int(send["value"])

    def wait_range(r: int, e: int, off: int, nbytes: int):
        for slot, target in plans[r].waits(lays[r].left, off, nbytes, e):
            while flags[r][slot] < target:
                yield
        first, end = plans[r].recv_span(lays[r].left, off, nbytes)
        assert all(landed[r].get(i) == e for i in range(first, end)), "a wait met by another launch's chunk"

    def comm(r: int, p: int, e: int):
        lay = lays[r]
        while flags[r][lay.release_slot] < e - 1:
            yield
        for j in range(p, cpb, comm_programs):
            ship(r, lay.plan_chunk(1, j), e)
            yield
        for s in range(2, world):
            for j in range(p, cpb, comm_programs):
                yield from wait_range(r, e, *lay.chunk_span(lay.sent_at(s), j))
                ship(r, lay.plan_chunk(s, j), e)
                yield

    def compute(r: int, e: int):
        lay = lays[r]
        for s, h in product(range(1, world), range(lay.heads)):
            yield from wait_range(r, e, *lay.head_span(lay.origin_at(s), h))

    def launch(r: int, e: int):
        reading[r] = e
        programs = [comm(r, p, e) for p in range(comm_programs)] + [compute(r, e)]
        while programs:
            programs = [g for g in programs if next(g, StopIteration) is not StopIteration]
            yield
        reading[r] = 0  # everything read (the comm programs' quiet: their puts have read their sources)
        flags[lays[r].left][lays[r].release_slot] += 1

    def stream(r: int):
        for e in range(1, launches + 1):
            yield from launch(r, e)

    rng = np.random.default_rng(seed)
    streams = [stream(r) for r in range(world)]
    for _ in range(100_000):
        if not streams:
            break
        g = streams[int(rng.integers(len(streams)))]
        if next(g, StopIteration) is StopIteration:
            streams.remove(g)
    assert not streams, "the schedule stalled: a wait that no send meets"
    for r in range(world):  # every incoming chunk's flag raised once per launch
        assert (flags[r][plans[r].recvs["slot"]] == launches).all()
        assert flags[r][lays[r].release_slot] == launches


def test_the_ring_attention_key_loop_is_pipelined_only_after_its_wait() -> None:
    """Compiled as a launch specializes it (16-byte aligned tensors, chunk_elems a multiple of 16), the key
    loops are software-pipelined (cp.async); the one over an arrived block starts its prologue after the
    compute's wait and the barrier behind it, never before."""
    import inspect

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = list(inspect.signature(_ring_attention.fn).parameters)
    meta = ra_meta(128, False)
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in RA_SIG if RA_SIG[n].startswith("*")}
    attrs[(names.index("chunk_elems"),)] = [["tt.divisibility", 16]]
    given = "constexprs" if "constexprs" in inspect.signature(ASTSource).parameters else "constants"
    source = ASTSource(fn=_ring_attention, signature={**RA_SIG, **dict.fromkeys(meta, "constexpr")},
                       attrs=attrs, **{given: meta})
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "num_stages": 2})
    marks = []  # the PTX in order: protocol blocks, barriers and asynchronous copies
    for line in ptx_lines(compiled.asm["ptx"]):
        mark = ("wait" if line.startswith("TPD_WAIT_") else "push" if "st.release.sys" in line
                else "bar" if opcode(line).startswith("bar.sync") else "cp" if opcode(line).startswith("cp.async.cg")
                else None)
        if mark and (not marks or marks[-1] != mark):
            marks.append(mark)
    assert "cp" in marks
    after_wait = [marks[i:i + 3] for i, m in enumerate(marks) if m == "wait" and "cp" in marks[i:i + 3]]
    assert after_wait == [["wait", "bar", "cp"]], marks
