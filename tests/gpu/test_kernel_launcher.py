"""gpuclient.kernels._launch on the GPU: a kept kernel computes what Triton's own launch does, on the stream it is
given; an argument Triton would specialize apart (a pointer off 16 bytes, an integer of 1) goes through Triton and
gets its own kernel; and a capture before the op is prepared, or a stream on another device, is refused.

Which launches went through Triton is read from the kernel's pre-run hook, which only Triton's own launch runs.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
triton = pytest.importorskip("triton")
tl = triton.language

from gpuclient.kernels._launch import KernelLauncher, launch_stream  # noqa: E402


@triton.jit
def _scaled_plus(x, y, n, step, BLOCK: tl.constexpr, SCALE: tl.constexpr = 2):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    keep = offs < n
    tl.store(y + offs, tl.load(x + offs, mask=keep) * SCALE + step, mask=keep)


@pytest.fixture
def through_triton():
    """The arguments of each launch that went through Triton's own path (``n`` of each)."""
    seen: list[int] = []
    hook = lambda *args, **kwargs: seen.append(args[2])  # noqa: E731
    _scaled_plus.add_pre_run_hook(hook)
    yield seen
    _scaled_plus.pre_run_hooks.remove(hook)


def test_a_kept_kernel_computes_as_triton_does_and_a_new_specialization_goes_through_triton(cuda_device,
                                                                                            through_triton) -> None:
    launcher = KernelLauncher(cuda_device)
    stream = torch.cuda.Stream(cuda_device)
    base = torch.randn(4096 + 16, device=f"cuda:{cuda_device}")
    meta = {"BLOCK": 256}
    # (view, n, step): aligned, then the same key again (another aligned view, n and step); a view 4 bytes in
    # (Triton: not 16-byte aligned); n = 1 (Triton: a constant); then the aligned and the misaligned keys again
    calls = [(base[:4096], 4096, 3), (base[16:4112], 4000, 5), (base[1:4097], 4096, 3), (base[:4096], 1, 3),
             (base[:4096], 4000, 7), (base[1:4097], 4000, 7)]
    for view, n, step in calls:
        y = torch.full_like(view, float("nan"))
        launcher(_scaled_plus, (16,), launch_stream(stream, cuda_device, True), (view, y, n, step), meta)
        stream.synchronize()
        torch.testing.assert_close(y[:n], view[:n] * 2 + step, rtol=0, atol=0)
        assert torch.isnan(y[n:]).all(), "the kernel wrote past n"
    # Triton launched the first of each key: aligned, misaligned, n == 1; the rest were kept kernels
    assert through_triton == [4096, 4096, 1]


def test_a_constexpr_left_to_its_default_and_one_given_are_kernels_apart(cuda_device, through_triton) -> None:
    launcher = KernelLauncher(cuda_device)
    stream = launch_stream(None, cuda_device, True)
    x = torch.arange(64, dtype=torch.float32, device=f"cuda:{cuda_device}")
    for scale in (None, 3, None, 3):
        y = torch.empty_like(x)
        meta = {"BLOCK": 64} if scale is None else {"BLOCK": 64, "SCALE": scale}
        launcher(_scaled_plus, (1,), stream, (x, y, 64, 0), meta)
        torch.cuda.synchronize(cuda_device)
        torch.testing.assert_close(y, x * (scale or 2), rtol=0, atol=0)
    assert len(through_triton) == 2


def test_without_direct_launches_every_launch_is_tritons(cuda_device, through_triton) -> None:
    launcher = KernelLauncher(cuda_device)
    launcher.direct = False
    x = torch.ones(32, device=f"cuda:{cuda_device}")
    y = torch.empty_like(x)
    for _ in range(3):
        launcher(_scaled_plus, (1,), launch_stream(None, cuda_device, True), (x, y, 32, 1), {"BLOCK": 32})
    torch.cuda.synchronize(cuda_device)
    assert (y == 3).all() and len(through_triton) == 3


def test_a_capture_before_the_op_is_prepared_and_a_stream_on_another_device_are_refused(cuda_device) -> None:
    x = torch.zeros(8, device=f"cuda:{cuda_device}")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        x.add_(1)
        with pytest.raises(RuntimeError, match="prepare"):
            launch_stream(None, cuda_device, prepared=False)
        # a prepared op's launches are captured: the stream is the capture's
        assert launch_stream(None, cuda_device, prepared=True) == torch.cuda.current_stream(cuda_device)
    side = torch.cuda.Stream(cuda_device)
    assert launch_stream(side, cuda_device, False) is side  # a stream that is not capturing is the one used
    with pytest.raises(ValueError, match=f"the op runs on cuda:{cuda_device + 1}; the stream given is on cuda:"):
        launch_stream(side, cuda_device + 1, True)
