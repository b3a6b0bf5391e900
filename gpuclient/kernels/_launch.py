"""How the fused ops launch their Triton kernels: little host time per call, and CUDA graphs once prepared.

**Host time.** ``kernel[grid](*args, **meta)`` binds every argument again at each launch: Triton types and
specializes each one, formats the options into its cache key, asks torch for the device and stream, and checks
the kernel's globals. On an H100 host that took 67 us p50 for MoE's expert GEMM kernel (25 arguments, 24
constexprs) and 44 for an empty kernel of 22 arguments, against 11-13 us for the same compiled kernels' own
launch. With what follows, the ops' calls take 1.6-2x less host time (``benchmarks/launch_bench.py``).
:class:`KernelLauncher` keeps the compiled kernel that Triton launched for a
call, under a key of everything Triton specializes on, and launches it itself when a later call has the same
key. A new key goes through Triton once, which compiles only what it has not compiled before, exactly as a
plain launch would.

The key (:func:`specialization` of each argument, with the grid, the constexprs and the options) is never
coarser than Triton's: a pointer's dtype and whether its address is a multiple of 16, an integer's type (i32,
i64 or u64 by its range), whether it is 1 and whether it is a multiple of 16 (Triton 3's
``BaseBackend.get_*_specialization``; ``tests/gpuclient/test_kernel_launch.py`` holds the key to Triton's own
specialization of the same values). An argument of any other kind sends the call through Triton every time.

**CUDA graphs.** An op's launches may be captured in a CUDA graph and replayed: a launch reads its round
number from device memory, not from its arguments (``gpuclient.kernels._rounds``). What a capture cannot hold is
the op's first call, which opens the channel and loads the kernels (an allocation, a daemon round trip and a
module load), so :func:`launch_stream` refuses a capturing stream until the op is prepared.
"""

from __future__ import annotations

from typing import Any

__all__ = ["KernelLauncher", "launch_stream", "output", "specialization"]

_I32 = range(-(1 << 31), 1 << 31)
_UNKNOWN = object()  # an argument the key cannot describe: such a call is Triton's every time


def specialization(arg: Any) -> Any:
    """What a Triton launch could specialize on in ``arg``, as a hashable key (``_UNKNOWN`` for an argument
    that is neither a pointer, an integer, a float, a bool nor None)."""
    data_ptr = getattr(arg, "data_ptr", None)
    if data_ptr is not None:
        return arg.dtype, data_ptr() & 15 == 0
    kind = arg.__class__
    if kind is int:
        return arg in _I32, arg >= 1 << 63, arg == 1, arg & 15 == 0
    if kind is float or kind is bool or arg is None:
        return kind
    return _UNKNOWN


def launch_stream(stream: Any, device: int, prepared: bool) -> Any:
    """The torch stream a call launches on: ``stream``, else torch's current stream on ``device``. Raises
    ValueError for a stream on another device, and RuntimeError for a stream capturing a CUDA graph while the
    op is not ``prepared`` (see the module doc)."""
    import torch

    from transportd.cuda_driver import check, driver

    stream = stream or torch.cuda.current_stream(device)
    if stream.device.index != device:
        raise ValueError(f"the op runs on cuda:{device}; the stream given is on {stream.device}")
    if not prepared:
        drv = driver()
        status = check(drv.cuStreamIsCapturing(drv.CUstream(stream.cuda_stream)), "cuStreamIsCapturing")
        if status != drv.CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_NONE:
            raise RuntimeError("prepare() the op before capturing it in a CUDA graph: its first call opens the "
                               "channel and loads the kernels, which a capture cannot hold")
    return stream


def output(shape: tuple[int, ...], dtype: Any, device: Any, stream: Any) -> Any:
    """A fresh tensor for a launch to write, allocated on the launch's ``stream``: torch's caching allocator then
    hands its memory to no other stream's work until the launch's stream is past it."""
    import torch

    with torch.cuda.stream(stream):
        return torch.empty(shape, dtype=dtype, device=device)


class KernelLauncher:
    """One op's launches on ``device``: each call's compiled kernel kept by its key and launched directly when
    the key comes again (see the module doc)."""

    def __init__(self, device: int) -> None:
        self.device = device
        self.direct = True  # False: every launch is Triton's own (the reference of benchmarks/launch_bench.py)
        self._runs: dict[tuple, tuple[Any, tuple]] = {}  # key -> (the compiled kernel's runner, the constexprs)

    def __call__(self, kernel: Any, grid: tuple[int, ...], stream: Any, args: tuple, meta: dict[str, Any]) -> None:
        """Launch ``kernel[grid](*args, **meta)`` on ``stream`` (a torch stream, from :func:`launch_stream`):
        ``args`` are the kernel's leading parameters, ``meta`` its constexprs (every one after ``args``) and
        launch options."""
        import torch

        if not self.direct:
            with torch.cuda.stream(stream):
                kernel[grid](*args, **meta)
            return
        specs = tuple(map(specialization, args))
        key = (kernel, grid, tuple(meta.items()), specs)
        run = self._runs.get(key)
        if run is not None and torch.cuda.current_device() == self.device:
            runner, constexprs = run
            runner(*args, *constexprs, stream=stream.cuda_stream)
            return
        with torch.cuda.stream(stream):  # Triton's own launch: it binds, compiles if it must, and launches
            compiled = kernel[grid](*args, **meta)
        if _UNKNOWN in specs or not hasattr(compiled, "packed_metadata"):
            return  # not a key this can hold, or not a compiled kernel (Triton's interpreter)
        params = kernel.params[len(args):]
        constexprs = tuple(meta[p.name] if p.name in meta else p.default for p in params)
        self._runs[key] = (compiled[(*grid, 1, 1)[:3]], constexprs)  # its runner takes all three dimensions
