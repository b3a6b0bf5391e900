"""MoE's fp8 row quantization (``_quantize_block`` and ``_store_quantized``, what ``_moe_stage`` stages with
``fp8=True``) in Triton's interpreter, against numpy: run by tests/gpuclient/test_moe_layout.py with
TRITON_INTERPRET=1.

Rows of 384 values (three 128-value blocks): an all-zero block, a block under the scale's 1e-4 floor, a
huge one, signs mixed; a row masked off must stay untouched. Checked: every scale is the block's largest
magnitude / 448 (its floor 1e-4 / 448), bit for bit; every fp8 byte is numpy's round-to-nearest-even,
saturating encoding of the same float32 product the kernel forms (``value * (448 / amax)``), within one
step where the interpreter rounds a near-tie the other way, or exactly one exponent step low where rounding
carries into the exponent: Triton 3.6's interpreter drops that carry (125.2 becomes 64, not 128). The
hardware's cvt.rn.satfinite is checked against torch on the GPU (tests/gpu/test_moe.py). The values come
back as ``fp8 * scale`` within one e4m3 step wherever no carry was dropped.

Then ``_moe_stage`` with FP8, after ``_moe_route``, on rank 0 of two (top-3 of 8, a repeated and an invalid entry,
one token with no expert): each row is quantized once and stored once per expert, so every valid entry's
destination (``send_x`` at its stage row for a peer's expert, ``recv_x`` at its receive row for one of the rank's
own) must hold exactly the bytes the quantization above gives that token's row, and every other row must stay
poisoned. Prints "ok".
"""

from __future__ import annotations

import numpy as np
import triton
import triton.language as tl

from gpuclient.kernels import moe_kernels as m
from gpuclient.kernels.moe import _pow2
from gpuclient.kernels.moe_layout import MoELayout, dispatch_row
from tests.gpuclient.moe_interpreted import _b, bf16, index_scalars

R, H = 8, 384


@triton.jit
def _quantize(src, dst, live, R: tl.constexpr, H: tl.constexpr, ROW: tl.constexpr, BLOCK_H: tl.constexpr):
    rs = tl.arange(0, R)
    rows = rs < live
    for h0 in range(0, H, BLOCK_H):
        q, scale = m._quantize_block(src + rs * H, rows, h0, H, BLOCK_H)
        m._store_quantized(dst + rs * ROW, rows, q, scale, h0, H, BLOCK_H)


def to_e4m3(v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float32 values -> (float8_e4m3fn bytes, rounded to nearest even and saturated at 448; where the rounding
    carried into the next exponent)."""
    a = np.minimum(np.abs(v.astype(np.float64)), 448.0)
    e = np.clip(np.floor(np.log2(np.maximum(a, 2.0 ** -9))), -6, 8)
    m = np.round(a / 2.0 ** (e - 3))  # numpy rounds halves to even
    carried = m == 16
    e, m = np.where(carried, e + 1, e), np.where(carried, 8, m)
    normal = m >= 8  # a subnormal's mantissa that rounded up to 8 is 2^-6, the first normal
    code = np.where(normal, (e + 7).astype(np.int64) << 3 | (m - 8).astype(np.int64), m.astype(np.int64))
    return (np.where(v < 0, code | 0x80, code)).astype(np.uint8), carried


def e4m3(bits: np.ndarray) -> np.ndarray:
    """float8_e4m3fn bytes -> float64 (sign, 4 exponent bits biased by 7, 3 mantissa bits; S.1111.111 is NaN)."""
    b = bits.astype(np.int64)
    exp, man = (b >> 3) & 0xF, b & 7
    value = np.where(exp == 0, man / 8 * 2.0 ** -6, (1 + man / 8) * 2.0 ** (exp - 7))
    value = np.where((exp == 15) & (man == 7), np.nan, value)
    return np.where(b & 0x80, -value, value)


def main() -> None:
    rng = np.random.default_rng(3)
    x = rng.standard_normal((R, H)) * 3
    x[1, :128] = 0  # an all-zero block
    x[2, 128:256] *= 1e-6  # largest magnitude under the scale's 1e-4 floor: they map below 448
    x[3, 256:] *= 1e4
    x[4] = -np.abs(x[4])
    xb = bf16(x)
    exact = (xb.astype(np.uint32) << 16).view(np.float32).astype(np.float64)  # the bf16 values
    out = np.full((R, dispatch_row(H, True)[0]), 0xA5, np.uint8)
    # 256 values a step: the second step's last two groups lie past H and must write nothing
    _quantize[(1,)](_b(xb), _b(out), R - 1, R=R, H=H, ROW=out.shape[1], BLOCK_H=256)
    assert (out[R - 1] == 0xA5).all(), "a masked row was written"
    live = slice(0, R - 1)
    got = out[live, :H].reshape(R - 1, H // 128, 128)
    scales = out[live, H:].copy().view(np.float32)  # [rows, blocks]
    blocks = exact[live].reshape(R - 1, H // 128, 128).astype(np.float32)
    amax = np.maximum(np.abs(blocks).max(axis=2), np.float32(1e-4))
    assert (scales == amax / np.float32(448)).all(), (scales, amax / 448)
    want, carried = to_e4m3(blocks * (np.float32(448) / amax)[:, :, None])
    dropped = carried & (got == want - 8)  # the interpreter's lost carry (see the module's docstring)
    near = np.abs(got.astype(np.int64) - want) <= 1  # its rounding of a near-tie may differ by one step
    assert (near | dropped).all(), (got[~near & ~dropped], want[~near & ~dropped])
    assert (got == want).mean() > 0.95  # the interpreter's defects are the exception, not the rule
    back = e4m3(got) * scales[:, :, None]
    bound = 2.0 ** -3 * np.abs(blocks) * (1 + 1e-6) + 2.0 ** -9 * scales[:, :, None]  # one e4m3 step
    assert (np.abs(back - blocks) <= bound)[~dropped].all()
    check_stage()
    print("ok")


def check_stage() -> None:
    """``_moe_stage``'s FP8 destinations against the quantization alone (the module's docstring)."""
    index_scalars()
    world, experts, T, K, H = 2, 8, 6, 3, 256  # noqa: N806
    lay = MoELayout(0, world, experts, T, K, H)
    L, ROW = lay.local_experts, dispatch_row(H, True)[0]  # noqa: N806
    rng = np.random.default_rng(5)
    xb = bf16(rng.standard_normal((T, H)) * 2)
    idx = np.stack([rng.choice(experts, size=K, replace=False) for _ in range(T)]).astype(np.int64)
    idx[1, 2] = idx[1, 0]  # a repeat: staged once
    idx[2, 1] = -1  # no expert in that slot
    idx[3] = -1  # a token with no expert at all
    alone = np.full((T, ROW), 0xA5, np.uint8)
    _quantize[(1,)](_b(xb), _b(alone), T, R=8, H=H, ROW=ROW, BLOCK_H=128)
    idx32, row = np.full((T, K), -1, np.int32), np.full((T, K), -1, np.int32)
    counts, eoff = np.zeros((world, experts), np.int32), np.zeros(experts, np.int32)
    send_src = np.full((experts, T), -1, np.int32)
    send_x = np.full((lay.stage_capacity, ROW), 0xA5, np.uint8)
    recv_x = np.full((L, lay.capacity, ROW), 0xA5, np.uint8)
    recv_src = np.full((L, lay.capacity), -1, np.int32)
    m._moe_route[(3,)](_b(idx), _b(idx32), _b(row), _b(counts), _b(eoff), _b(send_src), 0, T, E=experts, K=K,
                       KP=_pow2(K), T=T, BLOCK_T=4)
    m._moe_stage[(2,)](_b(xb), _b(idx32), _b(row), _b(eoff), _b(send_x), _b(recv_x), _b(recv_src), 0, T, W=world, L=L,
                       K=K, KP=_pow2(K), T=T, H=H, ROW=ROW, COPY_ROWS=2, BLOCK_H=128, FP8=True)
    assert (idx32 == lay.normalize(idx)).all()
    sent, received = np.zeros(len(send_x), bool), np.zeros(recv_x.shape[:2], bool)
    for t, k in zip(*np.nonzero(idx32 >= 0), strict=True):
        e = int(idx32[t, k])
        if e < L:  # this rank's own expert: its receive row (own rows lead, in token order)
            dst, mark = recv_x[e, row[t, k] - eoff[e]], (e, row[t, k] - eoff[e])
            received[mark] = True
        else:
            dst = send_x[row[t, k]]
            sent[row[t, k]] = True
        assert (dst == alone[t]).all(), (t, k, e)
    assert received.sum() + sent.sum() == (idx32 >= 0).sum()  # every entry had a row of its own
    assert (send_x[~sent] == 0xA5).all() and (recv_x[~received] == 0xA5).all(), "a row no entry names was written"


if __name__ == "__main__":
    main()
