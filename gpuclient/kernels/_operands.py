"""What the fused ops take as operands, and the checks every operand passes before a launch.

An operand is a torch tensor, or any CUDA array torch can view without a copy: one that speaks DLPack
(CuPy, JAX, ...) or only ``__cuda_array_interface__`` (Numba, ...). :func:`operand` returns the torch view
over the same memory, so an op's result written into an ``out`` given as a CuPy array is in that array.

Stream order. DLPack's exchange names the consumer's stream: the array's producer makes the launch's stream
wait for the work that writes it. A ``__cuda_array_interface__`` (version 3) names the producer's stream
instead, and the launch's stream waits for it here. Neither launches a kernel: a kernel launched between the
ranks' launches could load a module behind a kernel that is waiting for a peer (the hang ``preload`` avoids),
so nothing here converts, copies or makes contiguous. Inside a CUDA graph capture, pass torch tensors: the wait
on another library's stream is an event recorded outside the capture.

bf16. CuPy and NumPy have no bfloat16: an array of 16-bit integers (``uint16`` or ``int16``: the bf16 bit
patterns, e.g. a torch bf16 tensor's ``.view(torch.int16)``) is taken where an op wants bf16, viewed as bf16.
"""

from __future__ import annotations

from typing import Any

__all__ = ["as_tensor", "operand"]


def as_tensor(name: str, obj: Any, device: Any, stream: Any) -> Any:
    """``obj`` as a torch tensor over the same memory, its producer's work ordered before ``stream`` (see the
    module doc). TypeError for an object that is not a CUDA array."""
    import torch

    if isinstance(obj, torch.Tensor):
        return obj
    if hasattr(obj, "__dlpack__"):
        with torch.cuda.stream(stream):  # the stream DLPack hands the producer to order its writes before
            return torch.from_dlpack(obj)
    cai = getattr(obj, "__cuda_array_interface__", None)
    if cai is None:
        raise TypeError(f"{name} must be a torch tensor or a CUDA array (DLPack or __cuda_array_interface__), "
                        f"got {type(obj).__name__}")
    producer = cai.get("stream")
    if producer is not None:  # v3: the data is ready in the producer's stream order, not yet in ours
        stream.wait_stream(torch.cuda.ExternalStream(producer, device=device))
    tensor = torch.as_tensor(obj, device=device)  # with a device: a view (without one torch copies to the host)
    if tensor.numel() and tensor.data_ptr() != cai["data"][0]:
        raise TypeError(f"{name}: torch copied the array instead of viewing it (is it on another GPU than {device}?)")
    return tensor


def operand(name: str, obj: Any, shape: tuple[int, ...] | None, dtypes: tuple[Any, ...], device: Any,
            stream: Any, *, copied: bool = False) -> Any:
    """``obj`` as the torch tensor a kernel reads or writes, checked: ``shape`` (None: any), one of ``dtypes``
    (16-bit integers where bf16 is wanted are viewed as bf16), contiguous, on ``device`` (a ``torch.device``) and
    16-byte aligned (Triton specializes a pointer on it: another alignment would compile, and load, another variant).
    ``copied``: torch copies the operand into the op's own buffer, so only its shape and dtype matter. Raises
    ValueError naming the operand and what it must be, TypeError for an object that is no CUDA array."""
    import torch

    tensor = as_tensor(name, obj, device, stream)
    if tensor.dtype in (torch.uint16, torch.int16) and torch.bfloat16 in dtypes:
        tensor = tensor.view(torch.bfloat16)
    if (shape is not None and tensor.shape != shape) or tensor.dtype not in dtypes:
        want = " or ".join(str(d) for d in dtypes)
        dims = "any shape" if shape is None else " x ".join(map(str, shape))
        raise ValueError(f"{name} must be {dims} {want}, got {' x '.join(map(str, tensor.shape))} {tensor.dtype}")
    if copied:
        return tensor
    if tensor.device != device:  # a torch.device: the ops pass their buffers' own
        raise ValueError(f"{name} must be on {device}, got a tensor on {tensor.device}")
    if not tensor.is_contiguous():
        raise ValueError(f"{name} must be contiguous, got a strided view")
    if tensor.numel() and tensor.data_ptr() % 16:
        raise ValueError(f"{name} must start on a 16-byte boundary (Triton specializes pointers on it)")
    return tensor
