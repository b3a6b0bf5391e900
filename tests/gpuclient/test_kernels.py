"""gpuclient.kernels without a GPU: every fused kernel compiles for sm_90, and the host side's layouts are checked.

- AllGatherGemm's, GemmReduceScatter's and GemmAllReduce's kernels compile to PTX and a cubin for sm_90
  (Triton needs no GPU for that); the PTX is read back: tensor-core MMAs, no read-only-cache loads (the NIC
  writes what the kernels read mid-launch), and each device call site of the protocol once (pushes, waits,
  the quiet), none at all with ``COMMUNICATE=False``.
- ReduceScatterLayout (what the ops build first, torch-free): bad shapes are refused with an error naming
  the culprit; the chunks the kernel counts arrivals for are the plan's chunks, the arrival counts are what
  enumerating the tiles gives, each own tile's ``wait_range`` names exactly the chunks its rows touch, and
  the flag slots of every plan and release flag are disjoint and agree between sender and receiver.

The ops' GPU test is tests/gpu/test_fused_kernels.py. CI installs Triton; without it these tests skip here.
"""

from __future__ import annotations

import os
from itertools import product

import numpy as np
import pytest

try:
    import triton  # noqa: F401
except ImportError:  # pragma: no cover - depends on the machine
    if os.environ.get("CI"):
        raise ImportError("CI must install Triton (pip install -e '.[cuda,triton]' in .ci/run)") from None
    pytest.skip("Triton is not installed here: pip install -e '.[triton]' (CI installs it)", allow_module_level=True)

from gpuclient.errors import PlanError  # noqa: E402
from gpuclient.kernels.allgather_gemm import _allgather_gemm  # noqa: E402
from gpuclient.kernels.gemm_reduce_scatter import ReduceScatterLayout, _gemm_reduce_scatter  # noqa: E402
from tests.gpuclient.test_triton import compile_kernel, guarded_blocks, opcode, ptx_lines  # noqa: E402

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


AG_SIG = {"ch": "*u64", "plan": "*u64", "epoch": "i32", "a_ptr": "*bf16", "b_ptr": "*bf16", "c_ptr": "*fp32",
          "done_ptr": "*i32", "rank": "i32", "world": "i32", "m_local": "i32", "n": "i32", "k": "i32",
          "chunks": "i32", "release_slot": "i32"}


def rs_signature(partial: str, out: str) -> dict[str, str]:
    return {"ch": "*u64", "rs_plan": "*u64", "ag_plan": "*u64", "epoch": "i32", "a_ptr": "*bf16", "b_ptr": "*bf16",
            "partial_ptr": f"*{partial}", "staging_ptr": f"*{partial}", "out_ptr": f"*{out}", "arrive_ptr": "*i32",
            "done_ptr": "*i32", "rank": "i32", "world": "i32", "m_seg": "i32", "n": "i32", "k": "i32",
            "chunk_rows": "i32", "chunks_per_segment": "i32", "release_slot": "i32", "ag_release_slot": "i32"}


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


@pytest.mark.parametrize(("all_gather", "partial", "out"), [(False, "bf16", "fp32"), (False, "fp32", "bf16"),
                                                            (True, "bf16", "bf16")])
def test_the_gemm_reduce_scatter_kernels_compile_for_sm90(all_gather: bool, partial: str, out: str) -> None:
    meta = {**BLOCK, "PARTIAL_BYTES": 2 if partial == "bf16" else 4, "COMMUNICATE": True, "ALL_GATHER": all_gather}
    compiled = compile_kernel(_gemm_reduce_scatter, rs_signature(partial, out), meta, num_warps=8)
    assert compiled.asm["cubin"][:4] == b"\x7fELF"
    pushes, waits, quiets, code = protocol_sites(compiled.asm["ptx"])
    assert any(op.startswith("wgmma") for op in code)
    assert not [op for op in code if ".nc" in op]  # staging and result are written by the NIC mid-launch
    if all_gather:
        # pushes: both plans' tile_done, the result release at the start, the staging release at the end;
        # waits: staging release, every peer's result release, wait_range over staging, wait_chunk of result
        assert (pushes, waits, quiets) == (4, 4, 1)
    else:
        # pushes: tile_done, the staging release; waits: the staging release, wait_range over staging
        assert (pushes, waits, quiets) == (2, 2, 1)


def test_the_compute_only_variant_has_no_protocol_at_all() -> None:
    meta = {**BLOCK, "PARTIAL_BYTES": 2, "COMMUNICATE": False, "ALL_GATHER": True}
    compiled = compile_kernel(_gemm_reduce_scatter, rs_signature("bf16", "fp32"), meta, num_warps=8)
    pushes, waits, quiets, code = protocol_sites(compiled.asm["ptx"])
    assert (pushes, waits, quiets) == (0, 0, 0)
    assert not [op for op in code if op.startswith("atom")]  # no arrival or done counting either


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
