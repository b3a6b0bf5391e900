"""The fused ops take CuPy arrays and bare ``__cuda_array_interface__`` objects as well as torch tensors
(``gpuclient/kernels/_operands.py``).

``operand`` on its own: a view over the same memory (bf16 bits as 16-bit integers viewed as bf16), a clear error for
what a kernel would misread, and the producer's stream ordered before the launch's (through DLPack, and through a
version-3 interface's ``stream``): a producer still writing when the op is called is waited for.

Every op on two daemons (ib), two ranks sharing the GPU, with CuPy operands and outputs given as CuPy arrays:
the owed data poisoned (NaN) before every launch, two launches with no flag reset, each checked against torch
as test_fused_kernels.py and test_moe.py check them, and the result returned as a torch view of the caller's
array. All CuPy arrays are made before the ranks launch (no module load behind a waiting kernel).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
cupy = pytest.importorskip("cupy")
pytest.importorskip("triton")

from gpuclient.kernels.moe_layout import dispatch_model  # noqa: E402
from tests.gpu.test_fused_kernels import (  # noqa: E402  (needs torch)
    SLEEP_CYCLES,
    _assert_ranks_match_torch,
    _close,
    _cluster,
    _exchange,
    _poison_owed,
    _ranks,
)
from tests.gpu.test_moe import (  # noqa: E402
    _combine_and_check,
    _expert_weights,
    _poison_and_dispatch,
    _prepared,
    _routing,
    _seeded,
)

LAUNCHES = 2
BF16_NAN = 0x7FC0  # a bf16 NaN's bits, to poison a uint16 array


class Bare:
    """Only a ``__cuda_array_interface__`` (as Numba's arrays), over a CuPy array's memory."""

    def __init__(self, array: Any, stream: int | None = None) -> None:
        self.array = array  # keeps the memory alive
        self.__cuda_array_interface__ = {**array.__cuda_array_interface__, "stream": stream}


def _cupy_bf16(tensor: Any) -> Any:
    """A CuPy uint16 array over a copy of a bf16 tensor's bits (CuPy has no bf16)."""
    return cupy.from_dlpack(tensor.contiguous().view(torch.int16).clone()).view(cupy.uint16)


def _as_bf16(array: Any) -> Any:
    return torch.from_dlpack(array).view(torch.bfloat16)


def test_operand_views_the_callers_memory_and_refuses_what_a_kernel_would_misread(cuda_device) -> None:
    from gpuclient.kernels._operands import operand

    dev = torch.device(f"cuda:{cuda_device}")
    stream = torch.cuda.Stream(cuda_device)
    bf16 = (torch.bfloat16,)
    with cupy.cuda.Device(cuda_device):
        t = torch.randn(4, 8).to(torch.bfloat16).to(dev)
        bits = _cupy_bf16(t)
        for what, obj in (("cupy uint16", bits), ("cupy int16", bits.view(cupy.int16)), ("bare interface", Bare(bits)),
                          ("torch", t)):
            got = operand("x", obj, (4, 8), bf16, dev, stream)
            assert got.dtype == torch.bfloat16 and torch.equal(got, t), what
            if what != "torch":
                assert got.data_ptr() == bits.data.ptr, f"{what}: not a view of the caller's memory"
        assert operand("i", cupy.zeros((4, 3), cupy.int64), (4, 3), (torch.int32, torch.int64), dev,
                       stream).dtype == torch.int64
        with pytest.raises(TypeError, match="x must be a torch tensor or a CUDA array"):
            operand("x", [[0] * 8] * 4, (4, 8), bf16, dev, stream)
        with pytest.raises(ValueError, match=f"x must be on {dev}, got a tensor on cpu"):  # host DLPack
            operand("x", np.zeros((4, 8), np.uint16), (4, 8), bf16, dev, stream)
        with pytest.raises(ValueError, match=r"x must be 4 x 8 torch.bfloat16, got 4 x 8 torch.float32"):
            operand("x", cupy.zeros((4, 8), cupy.float32), (4, 8), bf16, dev, stream)
        with pytest.raises(ValueError, match=r"x must be 4 x 8 torch.bfloat16, got 4 x 9"):
            operand("x", cupy.zeros((4, 9), cupy.uint16), (4, 8), bf16, dev, stream)
        with pytest.raises(ValueError, match="x must be contiguous"):
            operand("x", cupy.zeros((8, 4), cupy.uint16).T, (4, 8), bf16, dev, stream)
        with pytest.raises(ValueError, match="x must start on a 16-byte boundary"):
            operand("x", cupy.zeros(33, cupy.uint16)[1:].reshape(4, 8), (4, 8), bf16, dev, stream)
        # an operand torch only copies from: any layout
        assert operand("a", cupy.zeros((8, 4), cupy.uint16).T, (4, 8), bf16, dev, stream, copied=True).shape == (4, 8)


@pytest.mark.parametrize("protocol", ["dlpack", "interface"])
def test_operand_orders_the_producers_stream_before_the_launch(cuda_device, protocol: str) -> None:
    """A CuPy stream is held ~25 ms behind a sleep, then fills the array; the op's stream copies the array at
    once. Unordered, the copy runs during the sleep and reads zeros."""
    from gpuclient.kernels._operands import as_tensor

    dev = torch.device(f"cuda:{cuda_device}")
    stream = torch.cuda.Stream(cuda_device)
    with cupy.cuda.Device(cuda_device):
        producer = cupy.cuda.Stream(non_blocking=True)
        array = cupy.zeros(1 << 20, cupy.float32)
        torch.cuda._sleep(1)  # every kernel's module loaded before the timed part
        array.fill(0)
        array.copy()
        torch.cuda.synchronize(cuda_device)
        with torch.cuda.stream(torch.cuda.ExternalStream(producer.ptr, device=dev)):
            torch.cuda._sleep(SLEEP_CYCLES)
        with producer:
            array.fill(7)
            if protocol == "dlpack":  # the producer's current stream is the one DLPack orders
                view = as_tensor("x", array, dev, stream)
        if protocol == "interface":
            view = as_tensor("x", Bare(array, stream=producer.ptr), dev, stream)
        with torch.cuda.stream(stream):
            seen = view.clone()
        torch.cuda.synchronize(cuda_device)
        assert view.data_ptr() == array.data.ptr
        assert (seen == 7).all(), f"{protocol}: the launch's stream read the array before its producer wrote it"


def _tensor_parallel(kind: str, sessions: list, device: int) -> None:
    """Two launches of ``kind`` with CuPy operands; ``b`` of AllGatherGemm as a bare interface."""
    from gpuclient.kernels import AllGatherGemm, GemmAllReduce, GemmReduceScatter, RingAttention

    world, dev = len(sessions), f"cuda:{device}"
    gen = torch.Generator(device="cpu").manual_seed(5)
    heads, seq_local, head_dim = 2, 200, 64
    m_local, m, n, k = 200, 368, 200, 200  # no multiple of the tiles nor of the 48-row chunks
    if kind == "allgather_gemm":
        ops = [AllGatherGemm(s, m_local, n, k, chunk_rows=48, share=world, programs=24) for _, s in sessions]
        shapes, out_shape = [(m_local, k), (k, n)], (world * m_local, n)
    elif kind == "ring_attention":
        ops = [RingAttention(s, heads, seq_local, head_dim, chunk_rows=48, share=world, programs=5)
               for _, s in sessions]
        shapes, out_shape = [(heads, seq_local, head_dim)] * 3, (heads, seq_local, head_dim)
    else:
        cls = GemmAllReduce if kind == "gemm_all_reduce" else GemmReduceScatter
        ops = [cls(s, m, n, k, chunk_rows=48, share=world, programs=5) for _, s in sessions]
        shapes, out_shape = [(m, k), (k, n)], (m // world, n)
    _exchange(sessions)
    for op in ops:
        op.prepare()
    streams = [torch.cuda.Stream(device) for _ in ops]
    for launch in range(1, LAUNCHES + 1):
        inputs = [[torch.randn(shape, generator=gen).to(torch.bfloat16).to(dev) for shape in shapes] for _ in ops]
        arrays = [[_cupy_bf16(t) for t in per_rank] for per_rank in inputs]
        if kind == "allgather_gemm":
            arrays = [[a, Bare(b)] for a, b in arrays]
        outs = [None if kind == "gemm_all_reduce" else cupy.full(out_shape, np.nan, cupy.float32) for _ in ops]
        _poison_owed(ops, kind)
        cupy.cuda.Device(device).synchronize()
        torch.cuda.synchronize(device)
        got = []
        for r, op in enumerate(ops):
            got.append(op(*arrays[r], outs[r], stream=streams[r]))
        torch.cuda.synchronize(device)
        for r, out in enumerate(outs):
            if out is not None:
                assert got[r].data_ptr() == out.data.ptr, f"{kind} rank {r}: the result is not in the caller's array"
        _assert_ranks_match_torch(kind, ops, got, inputs, False, f"{kind} launch {launch}")


def _moe(sessions: list, device: int) -> None:
    """A round on torch tensors, checked against a torch MoE (test_moe.py's check), then the same inputs as CuPy
    arrays, ``combine``'s ``y`` and ``out`` too: the same output bit for bit, in the caller's array."""
    world, experts, max_tokens, topk, hidden = len(sessions), 6, 40, 3, 200
    dev = f"cuda:{device}"
    rng, gen, lays, local = _seeded(17, world, experts, max_tokens, topk, hidden)
    ops, streams = _prepared(sessions, hidden, experts, max_tokens, topk, device)
    weights_e, w_dev = _expert_weights(gen, experts, hidden, dev)
    tokens = [max_tokens, max_tokens - 7]
    idx = [_routing(rng, n, topk, np.arange(experts), hot=1, dtype=np.int64) for n in tokens]
    xs = [torch.randn(n, hidden, generator=gen).to(torch.bfloat16) for n in tokens]
    ws = [torch.rand(n, topk, generator=gen) for n in tokens]

    def experts_on(received: list) -> list:
        return [torch.bmm(recv_x, w_dev[r * local:(r + 1) * local]) for r, (recv_x, _, _) in enumerate(received)]

    x_dev, idx_dev, w_in = [x.to(dev) for x in xs], [torch.from_numpy(i).to(dev) for i in idx], [w.to(dev) for w in ws]
    handles = _poison_and_dispatch(ops, streams, x_dev, idx_dev, w_in, device)
    ys = experts_on(handles)
    torch.cuda.synchronize(device)
    _combine_and_check(ops, streams, handles, ys, lays, dispatch_model(lays, idx), xs, ws, weights_e, tokens, hidden,
                       device, "ib torch round")
    torch_out = [op.out[:n].clone() for op, n in zip(ops, tokens, strict=True)]

    x_arr = [_cupy_bf16(x) for x in x_dev]
    idx_arr = [cupy.from_dlpack(i.clone()) for i in idx_dev]
    w_arr = [cupy.from_dlpack(w.clone()) for w in w_in]
    handles = _poison_and_dispatch(ops, streams, x_arr, idx_arr, w_arr, device)
    ys = [_cupy_bf16(y) for y in experts_on(handles)]
    outs = [cupy.full((n, hidden), BF16_NAN, cupy.uint16) for n in tokens]
    cupy.cuda.Device(device).synchronize()
    torch.cuda.synchronize(device)
    got = []
    for r, op in enumerate(ops):
        got.append(op.combine(ys[r], handles[r][2], out=outs[r], stream=streams[r]))
    torch.cuda.synchronize(device)
    for r, op in enumerate(ops):
        assert op.channel.status()[0] == 0, (r, op.channel.status())
        assert got[r].data_ptr() == outs[r].data.ptr, f"rank {r}: the combined rows are not in the caller's array"
        assert torch.equal(_as_bf16(outs[r]).view(torch.int16), torch_out[r].view(torch.int16)), (
            f"rank {r}: CuPy operands combined to other bits than torch's")


@pytest.mark.parametrize("kind", ["allgather_gemm", "gemm_reduce_scatter", "gemm_all_reduce", "ring_attention", "moe"])
def test_the_fused_ops_take_cupy_arrays(cuda_device, kind: str) -> None:
    with _cluster(2, "ib") as cluster:
        sessions = _ranks(cluster, f"cupy-{kind}", cuda_device, 2)
        try:
            with cupy.cuda.Device(cuda_device):
                if kind == "moe":
                    _moe(sessions, cuda_device)
                else:
                    _tensor_parallel(kind, sessions, cuda_device)
        finally:
            _close(sessions)
