"""The fused GEMMs' compute in Triton's interpreter (numpy on the CPU), run by test_kernels.py in a process of
its own (``TRITON_INTERPRET=1`` must be set before the kernels are decorated).

What it checks, without a GPU and without torch: AllGatherGemm's and GemmReduceScatter's / GemmAllReduce's
compute programs (``COMMUNICATE=False``: the protocol calls are inline PTX, which the interpreter cannot run),
with operands loaded through pointers and masks and through tensor descriptors (``TMA``), on shapes where
neither the rows of a shard or segment, nor n, nor k line up with the tiles: every output element a launch
defines matches float64, and nothing past it is written; in row-major tile order and grouped (``GROUP_M`` row
blocks at a time, a last group shorter), and ``_tiles.tile_at`` itself walks each grid as ``tile_order``
(the Python model the timelines read) says. It is the descriptors' coordinates (a shard's or a
segment's rows inside the whole A) and their zero fill past the edges that the TMA runs check; the hardware's
terms (16-byte strides) are the ops' host checks.
"""

from __future__ import annotations

import os
import sys

os.environ["TRITON_INTERPRET"] = "1"

import numpy as np  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from gpuclient.kernels._tiles import tile_at, tile_order  # noqa: E402
from gpuclient.kernels.allgather_gemm import _allgather_gemm  # noqa: E402
from gpuclient.kernels.gemm_reduce_scatter import _gemm_reduce_scatter  # noqa: E402

# the interpreter's patches (scalars as ints, bf16 tl.dot) and its host tensors
from tests.gpuclient.ring_attention_interpreter import HostTensor, bf16, f32  # noqa: E402

NAN_BF16 = 0x7FC0


def _unused() -> tuple[HostTensor, HostTensor]:
    """Stand-ins for the channel and plan handles (never read with COMMUNICATE=False)."""
    return HostTensor(np.zeros(8, np.uint64), "uint64"), HostTensor(np.zeros(12, np.uint64), "uint64")


@triton.jit
def _walk(out_ptr, tiles, row_blocks, col_blocks, GROUP_M: tl.constexpr):
    for t in range(0, tiles):
        row_block, col_block = tile_at(t, row_blocks, col_blocks, GROUP_M)
        tl.store(out_ptr + 2 * t, row_block)
        tl.store(out_ptr + 2 * t + 1, col_block)


def check_tile_order(row_blocks: int, col_blocks: int, group_m: int) -> None:
    """tile_at over the whole grid: the model's order, which visits every tile once."""
    tiles = row_blocks * col_blocks
    out = np.full(2 * tiles, -1, dtype=np.int32)
    _walk[(1,)](HostTensor(out, "int32"), tiles, row_blocks, col_blocks, GROUP_M=group_m)
    got = [tuple(map(int, pair)) for pair in out.reshape(-1, 2)]
    want = tile_order(row_blocks, col_blocks, group_m)
    assert got == want, f"tile_at {row_blocks}x{col_blocks} group {group_m}: {got} != {want}"
    assert sorted(want) == [(r, c) for r in range(row_blocks) for c in range(col_blocks)]


def check_allgather(world: int, m_local: int, n: int, k: int, block: tuple[int, int, int], programs: int,
                    tma: bool, seed: int, group_m: int = 1) -> float:
    """C = gathered A @ B for every rank's view (the rank only changes the tile order)."""
    rng = np.random.default_rng(seed)
    a = bf16(rng.standard_normal((world * m_local, k)))
    b = bf16(rng.standard_normal((k, n)))
    want = f32(a).astype(np.float64) @ f32(b).astype(np.float64)
    worst = 0.0
    for rank in range(world):
        c = np.full((world * m_local + 3, n), np.nan, dtype=np.float32)  # 3 rows past C: must stay NaN
        ch, plan = _unused()
        rounds = np.zeros(2, np.int32)  # a launch that moves nothing leaves the round as it was
        _allgather_gemm[(programs,)](ch, plan, HostTensor(rounds, "int32"), HostTensor(a, "bfloat16"),
                                     HostTensor(b, "bfloat16"), HostTensor(c, "float32"),
                                     HostTensor(np.zeros(1, np.int32), "int32"), rank,
                                     world, m_local, n, k, 1, 0, COMM_PROGRAMS=1, BLOCK_M=block[0],
                                     BLOCK_N=block[1], BLOCK_K=block[2], COMMUNICATE=False, COMPUTE=True, TMA=tma,
                                     GROUP_M=group_m)
        assert np.isnan(c[world * m_local:]).all(), f"allgather tma={tma}: wrote past C"
        assert (rounds == 0).all(), f"allgather: a launch with COMMUNICATE=False moved the round: {rounds}"
        got = c[:world * m_local]
        assert np.isfinite(got).all(), f"allgather tma={tma} rank {rank}: a tile left unwritten"
        err = float(np.abs(got - want).max())
        assert err < 1e-3 * max(1.0, np.abs(want).max()), f"allgather tma={tma} rank {rank}: off by {err}"
        worst = max(worst, err)
    return worst


def check_reduce(world: int, m_seg: int, n: int, k: int, block: tuple[int, int, int], programs: int, tma: bool,
                 all_gather: bool, seed: int, group_m: int = 1) -> float:
    """The compute alone: the peers' segments of A_r @ B_r in partial (bf16), the own one in the output."""
    rng = np.random.default_rng(seed)
    m = world * m_seg
    a = bf16(rng.standard_normal((m, k)))
    b = bf16(rng.standard_normal((k, n)))
    want = f32(a).astype(np.float64) @ f32(b).astype(np.float64)
    worst = 0.0
    for rank in range(world):
        partial = np.full((m, n), NAN_BF16, dtype=np.uint16)
        staging = np.full((m, n), NAN_BF16, dtype=np.uint16)
        out_rows = m if all_gather else m_seg
        out = np.full((out_rows + 2, n), np.nan, dtype=np.float32)  # 2 rows past the output: must stay NaN
        ch, plan = _unused()
        rounds = np.zeros(2, np.int32)
        _gemm_reduce_scatter[(programs,)](
            ch, plan, plan, HostTensor(rounds, "int32"), HostTensor(a, "bfloat16"), HostTensor(b, "bfloat16"),
            HostTensor(partial, "bfloat16"),
            HostTensor(staging, "bfloat16"), HostTensor(out, "float32"), HostTensor(np.zeros(8, np.int32), "int32"),
            rank, world, m_seg, n, k, 16, 1, 0, 0,
            HostTensor(np.zeros(1, np.int64), "int64"), BLOCK_M=block[0],
            BLOCK_N=block[1], BLOCK_K=block[2], PARTIAL_BYTES=2, COMMUNICATE=False, COMPUTE=True,
            ALL_GATHER=all_gather, TMA=tma, GROUP_M=group_m)
        own = slice(rank * m_seg, (rank + 1) * m_seg)
        got = out[own] if all_gather else out[:m_seg]
        assert np.isnan(out[out_rows:]).all(), f"reduce tma={tma}: wrote past the output"
        assert (rounds == 0).all(), f"reduce: a launch with COMMUNICATE=False moved the round: {rounds}"
        if all_gather:
            assert np.isnan(np.delete(out[:m], np.s_[own], axis=0)).all(), "all-reduce: wrote the peers' rows"
        err = float(np.abs(got - want[own]).max())
        assert err < 1e-3 * max(1.0, np.abs(want).max()), f"reduce tma={tma} rank {rank}: off by {err}"
        worst = max(worst, err)
        for peer in range(world):  # the peers' partials, in bf16 (2^-7 relative: the interpreter may truncate)
            if peer != rank:
                rows = slice(peer * m_seg, (peer + 1) * m_seg)
                sent = f32(partial[rows]).astype(np.float64)
                assert np.isfinite(sent).all(), f"reduce tma={tma}: a peer's tile left unwritten"
                assert (np.abs(sent - want[rows]) <= 2 ** -7 * np.abs(want[rows]) + 1e-6).all(), \
                    f"reduce tma={tma} rank {rank}: a partial for rank {peer} is off"
        assert (partial[own] == NAN_BF16).all(), "the own segment's partial is never written"
    return worst


def main() -> int:
    for row_blocks, col_blocks, group_m in ((5, 3, 1), (5, 3, 2), (5, 3, 4), (4, 2, 4), (3, 4, 8), (1, 1, 2)):
        check_tile_order(row_blocks, col_blocks, group_m)
    print("tile order: as the model says")
    for tma in (False, True):
        # shards of 40 rows (tiles of 32 straddle shards: the descriptor reads the next shard's rows, not
        # stored), n 48 and k 40 past the 32- and 16-wide tiles' last full one (zero fill)
        err = check_allgather(2, 40, 48, 40, (32, 32, 16), 3, tma, seed=1)
        print(f"allgather tma={tma}: max error {err:.2e}")
        err = check_allgather(3, 24, 40, 56, (16, 32, 32), 2, tma, seed=2)
        print(f"allgather world 3 tma={tma}: max error {err:.2e}")
        for all_gather in (False, True):
            err = check_reduce(2, 40, 48, 40, (32, 32, 16), 3, tma, all_gather, seed=3)
            print(f"reduce all_gather={all_gather} tma={tma}: max error {err:.2e}")
        err = check_reduce(3, 24, 40, 56, (16, 32, 32), 2, tma, False, seed=4)
        print(f"reduce world 3 tma={tma}: max error {err:.2e}")
        # grouped: 3 row blocks a shard / segment (16-row tiles of 40 rows) two at a time, the last group one
        err = check_allgather(2, 40, 48, 40, (16, 32, 16), 3, tma, seed=5, group_m=2)
        print(f"allgather group 2 tma={tma}: max error {err:.2e}")
        err = check_reduce(2, 40, 48, 40, (16, 32, 16), 3, tma, True, seed=6, group_m=2)
        print(f"reduce all_gather group 2 tma={tma}: max error {err:.2e}")
    print("ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
