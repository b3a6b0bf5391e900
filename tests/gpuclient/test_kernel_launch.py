"""gpuclient.kernels._launch without a GPU: the key under which the ops' launcher keeps a compiled kernel is never
coarser than Triton's own specialization of the same arguments.

Triton's specialization of an argument is read from Triton itself (``native_specialize_impl`` with the CUDA
backend, as ``JITFunction.run`` calls it for a parameter that specializes and cares about alignment). If two
arguments share a key but Triton would compile them apart, the launcher would launch one's kernel for the
other: these tests fail then, for any Triton that specializes on more than the key holds. The launches
themselves run in tests/gpu/test_kernel_launcher.py.

CI installs Triton (.[triton]); without it these tests skip here and fail under CI.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.support.triton_required import require_triton

require_triton()

from triton._C.libtriton import native_specialize_impl  # noqa: E402
from triton.backends.nvidia.compiler import CUDABackend  # noqa: E402

from gpuclient.kernels._launch import _UNKNOWN, specialization  # noqa: E402
from gpuclient.triton import DevicePointer  # noqa: E402

DTYPES = ("uint8", "int32", "int64", "float32", "bfloat16")
# the integers at the edges Triton types and specializes by: 1, multiples of 16, i32 / i64 / u64
EDGES = (0, 1, 2, 15, 16, 17, -1, -16, -17, (1 << 31) - 16, (1 << 31) - 1, 1 << 31, -(1 << 31), -(1 << 31) - 1,
         -(1 << 31) - 16, (1 << 63) - 16, (1 << 63) - 1, 1 << 63, (1 << 63) + 16, (1 << 64) - 16, (1 << 64) - 1)


def triton_specialization(arg: object) -> tuple:
    """What Triton specializes a launch on in ``arg``: its type and its attribute ("D": 16-divisible)."""
    return tuple(native_specialize_impl(CUDABackend, arg, False, True, True))


def assert_key_decides(args: list[object]) -> None:
    """Arguments with one key have one Triton specialization."""
    seen: dict[object, tuple] = {}
    for arg in args:
        key, triton_spec = specialization(arg), triton_specialization(arg)
        assert seen.setdefault(key, triton_spec) == triton_spec, f"{arg!r}: key {key} covers {seen[key]} too"


def test_the_key_decides_triton_specialization_at_every_edge() -> None:
    pointers = [DevicePointer(base + off, dtype) for dtype in DTYPES for base in (0, 1 << 40)
                for off in (0, 1, 2, 4, 8, 15, 16, 32, 48, 4096)]
    args = [*pointers, *EDGES, True, False, 0.0, 1.0, -2.5, None]
    assert_key_decides(args)
    # and it is fine enough to tell apart what Triton tells apart among these
    assert len({specialization(a) for a in args}) >= len({triton_specialization(a) for a in args})


ADDRESSES = st.integers(0, 1 << 20).map(lambda n: n * 4) | st.integers(0, (1 << 48) - 1)
INTEGERS = st.sampled_from(EDGES) | st.integers(-64, 64) | st.integers(-(1 << 63), (1 << 64) - 1)
ARGS = (st.builds(DevicePointer, ADDRESSES, st.sampled_from(DTYPES)) | INTEGERS | st.booleans()
        | st.floats(allow_nan=False) | st.none())


@settings(max_examples=300, deadline=None)
@given(st.lists(ARGS, min_size=2, max_size=30))
def test_the_key_decides_triton_specialization(args: list[object]) -> None:
    assert_key_decides(args)


@pytest.mark.parametrize("arg", ["text", (1, 2), [DevicePointer(0)], object()])
def test_an_argument_the_key_cannot_describe_is_marked_for_triton(arg: object) -> None:
    assert specialization(arg) is _UNKNOWN
