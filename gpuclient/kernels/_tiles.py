"""What the fused ops share about their compute tiles: the checks of a tile configuration (``check_launch``
for every op, ``check_tiles`` for the GEMMs), and what loading operands through tensor descriptors (TMA)
made in the kernel needs.

``tl.make_tensor_descriptor`` writes each program's descriptors into global scratch memory that Triton asks
for at every launch, from the allocator set with ``triton.set_allocator`` (``programs x
global_scratch_size`` bytes; 128 bytes a descriptor). ``DescriptorScratch`` is that allocator for one op:
it hands out one buffer, reserved when a variant is preloaded, so a launch allocates nothing (a
``cudaMalloc`` behind another rank's running kernel is the kind of wait preloading avoids), and it is set
only around the op's own launches (in a context of their own: the caller's allocator is left as it was).
The op's launches are ordered (one stream, flag epochs), so one buffer serves all of them.

The GEMMs walk their tiles grouped (``tile_at``, ``group_m`` row blocks at a time, column by column): the
programs running at once then read a few row bands of A and a few column blocks of B, which they can
share in L2, where row-major order reads all of B for every row band or two.

The hardware's terms for a descriptor, checked on the host: the base address 16-byte aligned and every
stride but the last a multiple of 16 bytes (bf16 rows of a multiple of 8 elements).
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable
from typing import Any

import triton
import triton.language as tl

#: The GEMMs' default tiles, by measurement on the H200 (``fused_bench.py --tune``; docs/performance.md):
#: 128 x 256 x 64, 8 warps, 3 stages, A and B through tensor descriptors where the shape allows, ran the
#: compute 1.59-1.64x faster than the first choice (128 x 128 x 64, pointer loads) at the bench's sizes.
GEMM_BLOCK = (128, 256, 64)

#: The GEMMs' default tile order: row blocks a group of tiles spans (``tile_at``; 1 is row-major). By
#: measurement on the H200 (``fused_bench.py --group-m``; docs/performance-log.md, "GEMM tile order"): with 4 or 8
#: the compute took 11-32 % less time than row-major at the bench's sizes; 4 is one 512-row chunk of 128-row tiles, so a
#: chunk's last tile comes as early as in row-major order, where 8 made tiles wait on two chunks at once.
GROUP_M = 4

#: bytes of one element of the bf16 operands
_BF16 = 2


def check_rows(what: str, elements: int) -> None:
    """Refuse bf16 rows a descriptor cannot step over (its stride must be a multiple of 16 bytes)."""
    if (elements * _BF16) % 16:
        raise ValueError(f"tma=True needs {what} to be a multiple of 8 (a tensor descriptor's row stride is a "
                         f"multiple of 16 bytes), got {elements}")


class DescriptorScratch:
    """The global scratch of one op's launches (see the module doc)."""

    def __init__(self, device: Any) -> None:
        self.device = device
        self._buffers: list[Any] = []  # the last one is handed out; earlier ones stay alive (a launch may use one)

    @property
    def nbytes(self) -> int:
        return int(self._buffers[-1].numel()) if self._buffers else 0

    def reserve(self, nbytes: int) -> None:
        if nbytes > self.nbytes:
            import torch

            self._buffers.append(torch.empty(nbytes, dtype=torch.uint8, device=self.device))

    def reserve_for(self, compiled: Any, programs: int) -> None:
        """Room for ``programs`` programs of a compiled kernel (Triton's CompiledKernel, as preload returns)."""
        meta = compiled.metadata
        self.reserve(int(getattr(meta, "global_scratch_size", 0)) * programs * int(getattr(meta, "num_ctas", 1)))

    def __call__(self, size: int, alignment: int, stream: Any) -> Any:
        self.reserve(size)  # a variant launched without a preload: it allocates here, once
        buffer = self._buffers[-1]
        if buffer.data_ptr() % max(alignment, 1):
            raise RuntimeError(f"descriptor scratch at {buffer.data_ptr():#x} is not {alignment}-byte aligned")
        return buffer

    def launch(self, run: Callable[[], Any]) -> Any:
        """``run()`` (a kernel launch) with this scratch as Triton's allocator, in a context of its own."""
        import triton

        def inner() -> Any:
            triton.set_allocator(self)
            return run()

        return contextvars.copy_context().run(inner)


def check_launch(num_warps: Any, num_stages: Any) -> None:
    """Refuse launch parameters Triton cannot take: ``num_warps`` a power of two in [1, 32], ``num_stages``
    an integer >= 1 (ValueError naming the culprit)."""
    if isinstance(num_warps, bool) or not isinstance(num_warps, int) or num_warps not in (1, 2, 4, 8, 16, 32):
        raise ValueError(f"num_warps must be a power of two in [1, 32], got {num_warps!r}")
    if isinstance(num_stages, bool) or not isinstance(num_stages, int) or num_stages < 1:
        raise ValueError(f"num_stages must be an integer >= 1, got {num_stages!r}")


def is_dot_block(block: tuple[Any, ...]) -> bool:
    """``block`` is a GEMM tile ``(block_m, block_n, block_k)`` ``tl.dot`` takes: three integers (not bools),
    each a power of two >= 16."""
    return len(block) == 3 and all(not isinstance(b, bool) and isinstance(b, int) and b >= 16 and not b & (b - 1)
                                   for b in block)


def check_group(group_m: Any) -> int:
    """Refuse a tile order the kernels cannot take: ``group_m`` (row blocks a group of tiles spans) an
    integer >= 1; returned as stored."""
    if isinstance(group_m, bool) or not isinstance(group_m, int) or group_m < 1:
        raise ValueError(f"group_m must be an integer >= 1, got {group_m!r}")
    return group_m


def tile_order(row_blocks: int, col_blocks: int, group_m: int) -> list[tuple[int, int]]:
    """The ``(row block, column block)`` of each tile index in the order :func:`tile_at` walks a ``row_blocks
    x col_blocks`` grid: the model the timelines read and the tests check the kernel's helper against."""
    order = []
    for first in range(0, row_blocks, group_m):
        size = min(group_m, row_blocks - first)
        order += [(first + r, c) for c in range(col_blocks) for r in range(size)]
    return order


def check_tiles(block: Any, num_warps: Any, num_stages: Any, tma: Any, n: int,
                k: int) -> tuple[tuple[int, int, int], int, int, bool]:
    """A GEMM op's tiles, checked (ValueError naming the culprit) and returned as stored: ``block`` three
    powers of two >= 16 (``tl.dot``), ``check_launch``'s terms, ``tma`` a bool (True: rows of ``n`` and ``k``
    elements that a tensor descriptor can step over) or None: True exactly when those rows allow it."""
    block = tuple(block)
    if not is_dot_block(block):
        raise ValueError(f"block (block_m, block_n, block_k) must be powers of two >= 16 (tl.dot), got {block!r}")
    check_launch(num_warps, num_stages)
    if tma is None:
        tma = (n * _BF16) % 16 == 0 and (k * _BF16) % 16 == 0
    if not isinstance(tma, bool):
        raise ValueError(f"tma must be a bool or None, got {tma!r}")
    if tma:
        check_rows("n", n)
        check_rows("k", k)
    return block, num_warps, num_stages, tma


@triton.jit
def async_proxy_fence():
    """Order what this thread saw through the generic proxy (the rows a wait acquired) before its later
    async-proxy accesses of global memory (tensor-descriptor loads)."""
    tl.inline_asm_elementwise("fence.proxy.async.global;\nmov.u32 $0, 0;", "=r,~{memory}", [], dtype=tl.int32,
                              is_pure=False, pack=1)


# --- the GEMMs' compute, shared by AllGatherGemm and GemmReduceScatter / GemmAllReduce ---------------------------
@triton.jit
def tile_at(t, row_blocks, col_blocks, GROUP_M: tl.constexpr):
    """``(row block, column block)`` of tile ``t`` of a ``row_blocks x col_blocks`` grid, grouped: GROUP_M row
    blocks at a time (fewer in the last group), column by column within a group; ``GROUP_M = 1`` is row-major
    order. A group of one chunk's row blocks completes each chunk after as many tiles as row-major order."""
    per_group = GROUP_M * col_blocks
    first = (t // per_group) * GROUP_M
    size = tl.minimum(row_blocks - first, GROUP_M)
    within = t % per_group
    return first + within % size, within // size


@triton.jit
def gemm_operands(a_ptr, b_ptr, a_rows, n, k, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  TMA: tl.constexpr):
    """A (``a_rows x k``) and B (``k x n``), bf16 row-major, as ``gemm_tile`` reads them: with TMA one tensor
    descriptor over each (made once per program), else the pointers themselves."""
    if TMA:
        a = tl.make_tensor_descriptor(a_ptr, shape=[a_rows, k], strides=[k, 1], block_shape=[BLOCK_M, BLOCK_K])
        b = tl.make_tensor_descriptor(b_ptr, shape=[k, n], strides=[n, 1], block_shape=[BLOCK_K, BLOCK_N])
        return a, b
    else:
        return a_ptr, b_ptr


@triton.jit
def gemm_tile(a, b, base, row0, rows, col0, n, k, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              BLOCK_K: tl.constexpr, TMA: tl.constexpr):
    """The fp32 product of A's rows ``base + row0 ...`` (BLOCK_M of them, those past ``row0 + rows`` read as 0
    on the pointer path; through a descriptor they are the next rows of A, or 0 past its end, and the caller
    does not store them) with B's columns ``col0 ...`` (past ``n``: 0), over all of ``k``."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if TMA:
        for k0 in range(0, k, BLOCK_K):
            acc = tl.dot(a.load([base + row0, k0]), b.load([k0, col0]), acc)
    else:
        offs_m = tl.arange(0, BLOCK_M)
        offs_n = col0 + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        a_rows = a + (base + row0 + offs_m).to(tl.int64)[:, None] * k
        for k0 in range(0, k, BLOCK_K):
            x = tl.load(a_rows + (k0 + offs_k)[None, :], mask=(offs_m[:, None] < rows) & ((k0 + offs_k)[None, :] < k),
                        other=0.0)
            y = tl.load(b + (k0 + offs_k).to(tl.int64)[:, None] * n + offs_n[None, :],
                        mask=((k0 + offs_k)[:, None] < k) & (offs_n[None, :] < n), other=0.0)
            acc = tl.dot(x, y, acc)
    return acc
