"""RingAttention's kernel arithmetic in Triton's interpreter (numpy on the CPU), run by test_kernels.py in a
process of its own (``TRITON_INTERPRET=1`` must be set before the kernels are decorated).

What it checks, without a GPU and without torch:

* the compute programs (``COMMUNICATE=False``: the protocol calls are inline PTX, which the interpreter
  cannot run) on every rank of a ring whose ``kv`` blocks are filled as the ring would fill them and whose
  own block is NaN (the compute must read the own K and V from the caller's tensors), scratch and output
  NaN before the launch: the output matches float64 attention over the whole sequence, causal or not;
* ``_interleave``, the communication programs' writer of the own block, chunk by chunk with chunks that
  straddle heads: it lays K and V out as ``[heads, seq, 2, head_dim]``, and touches nothing past the chunk.

The interpreter's scalars are 1-element arrays that numpy >= 2.4 refuses to turn into ints, and its
``tl.dot`` multiplies bf16's raw uint16 storage: both are patched below, for this process only.
"""

from __future__ import annotations

import os
import sys

os.environ["TRITON_INTERPRET"] = "1"

import numpy as np  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
import triton.runtime.interpreter as interp  # noqa: E402

_patch_tensor = interp._patch_lang_tensor
_create_dot = interp.InterpreterBuilder.create_dot


def _patch_lang_tensor(tensor, scope):
    _patch_tensor(tensor, scope)
    scope.set_attr(tensor, "__index__", lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))


def _widen(x):
    if x.dtype == tl.bfloat16:
        return interp.TensorHandle((x.data.astype(np.uint32) << 16).view(np.float32), tl.float32)
    return x


def _create_dot_bf16(self, a, b, d, *rest):
    return _create_dot(self, _widen(a), _widen(b), d, *rest)


interp._patch_lang_tensor = _patch_lang_tensor
interp.InterpreterBuilder.create_dot = _create_dot_bf16

from gpuclient.kernels.ring_attention import _LOG2E, RingAttentionLayout, _interleave, _ring_attention  # noqa: E402

NAN_BF16 = 0x7FC0


class HostTensor:
    """The few torch-tensor methods Triton's interpreter calls, over a numpy array it may read and write."""

    def __init__(self, array: np.ndarray, dtype: str) -> None:
        assert array.flags.c_contiguous
        self.array, self.dtype = array, dtype

    def data_ptr(self) -> int:
        return self.array.ctypes.data

    def untyped_storage(self) -> HostTensor:
        return self

    def cpu(self) -> HostTensor:
        return self

    def new_empty(self, *args, **kwargs) -> HostTensor:
        return self

    def set_(self, *args) -> HostTensor:
        return self

    def storage_offset(self) -> int:
        return 0

    def size(self) -> tuple:
        return self.array.shape

    def stride(self) -> None:
        return None

    def copy_(self, other) -> None:  # the interpreter ran on this very memory
        pass


def bf16(x: np.ndarray) -> np.ndarray:
    """float -> bf16 bits (round to nearest even)."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def f32(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def attention(q, k, v, rank: int, causal: bool, scale: float) -> np.ndarray:
    """float64 attention of rank's queries over every rank's keys (the whole sequence, rank order)."""
    world, _, seq, _ = k.shape
    keys = np.concatenate([f32(k[o]) for o in range(world)], axis=1).astype(np.float64)
    values = np.concatenate([f32(v[o]) for o in range(world)], axis=1).astype(np.float64)
    s = np.einsum("hmd,hnd->hmn", f32(q[rank]).astype(np.float64), keys) * scale
    if causal:
        s = np.where(np.arange(world * seq)[None, :] <= rank * seq + np.arange(seq)[:, None], s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    return np.einsum("hmn,hnd->hmd", p / p.sum(-1, keepdims=True), values)


def check_compute(world: int, heads: int, seq: int, head_dim: int, causal: bool, block: tuple[int, int],
                  programs: int, seed: int, tma: bool = False) -> float:
    """Every rank's output against float64 attention (``tma``: whole key blocks through tensor descriptors);
    returns the largest error."""
    rng = np.random.default_rng(seed)
    q, k, v = (bf16(rng.standard_normal((world, heads, seq, head_dim))) for _ in range(3))
    scale = head_dim ** -0.5
    worst = 0.0
    for rank in range(world):
        lay = RingAttentionLayout(rank, world, heads, seq, head_dim, chunk_rows=48, block=block, causal=causal)
        kv = np.full((world, heads, seq, 2, head_dim), NAN_BF16, dtype=np.uint16)
        for o in range(world):
            if o != rank:  # as the ring leaves them; the own block is the comm programs' (not run here)
                kv[o, :, :, 0], kv[o, :, :, 1] = k[o], v[o]
        out = np.full((heads, seq, head_dim), np.nan, dtype=np.float32)
        acc = np.full((heads, seq, head_dim), np.nan, dtype=np.float32)
        ml = np.full((2, heads, seq), np.nan, dtype=np.float32)
        rounds = np.zeros(2, np.int32)  # a launch that moves nothing leaves the round as it was
        args = (HostTensor(np.zeros(8, np.uint64), "uint64"), HostTensor(np.zeros(12, np.uint64), "uint64"),
                HostTensor(rounds, "int32"),
                *(HostTensor(np.ascontiguousarray(x[rank]), "bfloat16") for x in (q, k, v)), HostTensor(kv, "bfloat16"),
                HostTensor(out, "float32"), HostTensor(acc, "float32"), HostTensor(ml, "float32"), rank, world, heads,
                seq, lay.chunk_elems, lay.chunks_per_block, lay.release_slot, scale * _LOG2E)
        _ring_attention[(programs,)](*args, COMM_PROGRAMS=1, HEAD_DIM=head_dim, BLOCK_M=block[0], BLOCK_N=block[1],
                                     COPY_BLOCK=64, CAUSAL=causal, COMMUNICATE=False, COMPUTE=True, TMA=tma)
        assert np.isfinite(out).all(), f"world {world} rank {rank}: NaN in the output (a read of an unset block)"
        assert (rounds == 0).all(), f"world {world}: a launch with COMMUNICATE=False moved the round: {rounds}"
        err = float(np.abs(out - attention(q, k, v, rank, causal, scale)).max())
        assert err < 1e-2, f"world {world} rank {rank} causal {causal} head_dim {head_dim}: off by {err}"
        worst = max(worst, err)
    return worst


@triton.jit
def _interleave_chunks(k_ptr, v_ptr, block_ptr, chunk_elems, block_elems, chunks, HEAD_DIM: tl.constexpr,
                       COPY_BLOCK: tl.constexpr):
    for j in range(0, chunks):  # as the comm programs call it, one chunk at a time
        lo = j * chunk_elems
        _interleave(k_ptr, v_ptr, block_ptr, lo, tl.minimum(lo + chunk_elems, block_elems), HEAD_DIM, COPY_BLOCK)


def check_interleave(heads: int, seq: int, head_dim: int, chunk_rows: int, chunks: int | None = None) -> None:
    """The own block written from k and v by ``chunks`` (default all) chunks: K row, V row per position."""
    lay = RingAttentionLayout(0, 2, heads, seq, head_dim, chunk_rows=chunk_rows)
    rng = np.random.default_rng(1)
    k, v = (bf16(rng.standard_normal((heads, seq, head_dim))) for _ in range(2))
    block = np.full((heads, seq, 2, head_dim), NAN_BF16, dtype=np.uint16)
    chunks = lay.chunks_per_block if chunks is None else chunks
    _interleave_chunks[(1,)](HostTensor(k, "bfloat16"), HostTensor(v, "bfloat16"), HostTensor(block, "bfloat16"),
                             lay.chunk_elems, lay.block_elems, chunks, HEAD_DIM=head_dim, COPY_BLOCK=256)
    want = np.stack([k, v], axis=2)
    written = min(chunks * lay.chunk_elems, lay.block_elems)
    assert (block.reshape(-1)[:written] == want.reshape(-1)[:written]).all(), "interleave: wrong element"
    assert (block.reshape(-1)[written:] == NAN_BF16).all(), "interleave: wrote past its chunks"


def main() -> int:
    check_interleave(3, 37, 64, chunk_rows=20)  # chunks straddle heads; the last is short
    check_interleave(2, 23, 128, chunk_rows=7, chunks=3)  # a prefix of the chunks: nothing past them
    for world, heads, seq, head_dim, causal, block, programs in (
            (1, 2, 40, 64, False, (16, 16), 2),
            (2, 2, 40, 64, False, (16, 16), 3),  # more tiles than compute programs: state carried in scratch
            (3, 1, 37, 64, True, (16, 32), 4),  # seq no multiple of either block; causal over three ranks
            (2, 2, 23, 128, True, (32, 16), 2),
            (3, 1, 20, 128, False, (16, 16), 5)):  # more compute programs than tiles
        for tma in (False, True):
            err = check_compute(world, heads, seq, head_dim, causal, block, programs, seed=world * 10 + seq, tma=tma)
            print(f"world {world} heads {heads} seq {seq} head_dim {head_dim} causal {causal} tma {tma}: "
                  f"max error {err:.2e}")
    print("ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
