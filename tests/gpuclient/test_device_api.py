"""The device API without a GPU: layouts agree with Python, the headers compile (cc/g++, nvcc, NVRTC), the
error codes mirror ErrorCode, every device header lives in gpuclient's include root (IBGDA's included) or the
contract's (cmd_ring.h, errors.h), and the host-side helpers behave."""

from __future__ import annotations

import ctypes
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

import cmd_ring
import gpuclient
import ibgda
from gpuclient.compiler import _pack, nvrtc_options
from gpuclient.cuda_memory import _c_contiguous, is_device_buffer
from gpuclient.device_channel import CHANNEL_DTYPE, CHANNEL_SIZE, RING_DTYPE, ChannelStruct
from tests.support.nvrtc import nvrtc_or_skip
from transportd.control.protocol import Flags
from transportd.errors import error_code_c_enum

ROOT = Path(__file__).resolve().parents[2]
INCLUDE = Path(gpuclient.get_include())
INCLUDE_FLAGS = [f"-I{d}" for d in gpuclient.get_include_dirs()]
CONTRACT = Path(gpuclient.get_include_dirs()[1])  # cmd_ring/include: cmd_ring.h, errors.h
HEADERS = sorted((INCLUDE / "transportd").rglob("*.cuh"))
# every .cu in the project that includes the device API
SOURCES = [ROOT / "tests" / "gpu" / "kernels.cu", ROOT / "tests" / "gpu" / "plan_kernels.cu",
           ROOT / "benchmarks" / "gpu_push.cu", ROOT / "examples" / "allgather_gemm.cu"]
USE_ALL = """
#include <transportd/client.cuh>
extern "C" __global__ void use_all(tpd::Channel ch, tpd::Plan plan, uint32_t* out, uint32_t* counter) {
    tpd::put(ch, 1, 2, 3, 4, 5, 6);
    tpd::put(ch, 1, 2, 3, 4, 5, 6, 7);
    tpd::put_signal(ch, 1, 2, 3, 4, 5, 6, 7, 8);
    tpd::put_signal(ch, 1, 2, 3, 4, 5, 6, 7, 8, tpd::SignalOp::Set);
    tpd::signal(ch, 1, 7, 8);
    tpd::signal(ch, 1, 7, 8, tpd::SignalOp::Set);
    tpd::put(ch, 1, 2, 3, 4, 5, 6, 7, tpd::Post::Now);
    tpd::put_signal(ch, 1, 2, 3, 4, 5, 6, 7, 8, tpd::SignalOp::Set, tpd::Post::Now);
    tpd::signal(ch, 1, 7, 8, tpd::SignalOp::Add, tpd::Post::Now);
    tpd::fence(ch, 1);
    tpd::quiet(ch);
    uint32_t code = tpd::status(ch);
    uint64_t seen = tpd::wait(ch, 0, 1);
    out[0] = code + (uint32_t)seen + tpd::chunk_arrive(counter, 4);
    tpd::block_wait(ch, 1, 2);
    tpd::warp_put(ch, threadIdx.x % 2 == 0, 1, 2, 3, 4, 5, 6);
    tpd::warp_put(ch, true, 1, 2, 3, 4, 5, 6, 7);
    tpd::warp_put_signal(ch, threadIdx.x % 3 == 0, 1, 2, 3, 4, 5, 6, 7, 8);
    tpd::warp_put_signal(ch, true, 1, 2, 3, 4, 5, 6, 7, 8, tpd::SignalOp::Set);
    tpd::warp_put(ch, true, 1, 2, 3, 4, 5, 6, 7, tpd::Post::Now);
    tpd::warp_put_signal(ch, true, 1, 2, 3, 4, 5, 6, 7, 8, tpd::SignalOp::Add, tpd::Post::Now);
    out[1] = tpd::tile_done(ch, plan, threadIdx.x) + tpd::tile_done_warp(ch, plan, threadIdx.x % 2 == 0, threadIdx.x);
    tpd::wait_chunk(ch, plan, 1, 0);
    tpd::wait_range(ch, plan, 1, 100, 1000);
    tpd::wait_range_thread(ch, plan, 1, 0, 64);
    tpd::RecvSpan span = tpd::recv_span(plan, 1, 0, 64);
    out[2] = span.end - span.first;
}
"""


def nvcc() -> str | None:
    found = shutil.which("nvcc")
    if found:
        return found
    default = Path("/usr/local/cuda/bin/nvcc")
    return str(default) if default.exists() else None


# --- layout -----------------------------------------------------------------------------------------------------
def _probe_source() -> str:
    lines = ["#include <cstdio>", "#include <cstddef>", "#include <transportd/client.cuh>", "int main() {",
             '  std::printf("sizeof.Channel %zu\\n", sizeof(tpd::Channel));',
             '  std::printf("sizeof.RingDevice %zu\\n", sizeof(tpd::RingDevice));',
             '  std::printf("abi %u\\n", (unsigned)TPD_CHANNEL_ABI);']
    for name in RING_DTYPE.names:
        lines.append(f'  std::printf("offset.{name} %zu\\n", offsetof(tpd::Channel, ring) + '
                     f'offsetof(tpd::RingDevice, {name}));')
        lines.append(f'  std::printf("size.{name} %zu\\n", sizeof(((tpd::RingDevice*)0)->{name}));')
    for name in CHANNEL_DTYPE.names[len(RING_DTYPE.names):]:
        lines.append(f'  std::printf("offset.{name} %zu\\n", offsetof(tpd::Channel, {name}));')
        lines.append(f'  std::printf("size.{name} %zu\\n", sizeof(((tpd::Channel*)0)->{name}));')
    for op in ("Add", "Set"):  # the flags byte every push writes: signal op and post hint
        for post in ("Batched", "Now"):
            lines.append(f'  std::printf("flags.{op}.{post} %u\\n", '
                         f'(unsigned)tpd::record_flags(tpd::SignalOp::{op}, tpd::Post::{post}));')
    lines += ["  return 0;", "}"]
    return "\n".join(lines) + "\n"


def _expected() -> dict[str, int]:
    out = {"sizeof.Channel": CHANNEL_DTYPE.itemsize, "sizeof.RingDevice": RING_DTYPE.itemsize, "abi": 1}
    for name in CHANNEL_DTYPE.names:
        dtype, offset = CHANNEL_DTYPE.fields[name][:2]
        out[f"offset.{name}"] = offset
        out[f"size.{name}"] = dtype.itemsize
    for op, op_bits in (("Add", 0), ("Set", cmd_ring.Flag.SIGNAL_SET)):
        for post, post_bits in (("Batched", 0), ("Now", cmd_ring.Flag.NO_BATCH)):
            out[f"flags.{op}.{post}"] = int(op_bits | post_bits)
    return out


def _parse(text: str) -> dict[str, int]:
    return {k: int(v) for k, v in re.findall(r"^(\S+) (\d+)$", text, re.M)}


def test_channel_dtype_ctypes_and_header_agree(tmp_path: Path) -> None:
    cxx = shutil.which("c++") or shutil.which("g++")
    assert cxx, "a C++ compiler is required for the Channel layout probe (CI installs build-essential)"
    src = tmp_path / "probe.cpp"
    src.write_text(_probe_source())
    exe = tmp_path / "probe"
    subprocess.run([cxx, "-std=c++17", "-Wall", "-Werror", *INCLUDE_FLAGS, str(src), "-o", str(exe)],
                   check=True)
    assert _parse(subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout) == _expected()
    assert CHANNEL_SIZE == 64 and ctypes.sizeof(ChannelStruct) == 64
    for name, ctype in ChannelStruct._fields_:
        assert getattr(ChannelStruct, name).offset == CHANNEL_DTYPE.fields[name][1]
        assert ctypes.sizeof(ctype) == CHANNEL_DTYPE.fields[name][0].itemsize
    assert RING_DTYPE.names == CHANNEL_DTYPE.names[:6]


def test_channel_layout_probe_under_nvcc(tmp_path: Path) -> None:
    compiler = nvcc()
    if not compiler:
        pytest.skip("nvcc not found: the CUDA compile checks run where the CUDA toolkit is installed")
    src = tmp_path / "probe.cu"
    src.write_text(_probe_source() + USE_ALL)
    exe = tmp_path / "probe_cuda"
    subprocess.run([compiler, "-arch=sm_90", "-std=c++17", *INCLUDE_FLAGS, str(src), "-o", str(exe)], check=True)
    assert _parse(subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout) == _expected()


# --- the headers build everywhere they must -------------------------------------------------------------------
@pytest.mark.parametrize("header", HEADERS, ids=lambda p: p.relative_to(INCLUDE / "transportd").as_posix())
def test_each_header_stands_alone_in_host_code(tmp_path: Path, header: Path) -> None:
    cxx = shutil.which("c++") or shutil.which("g++")
    src = tmp_path / "one.cpp"
    src.write_text(f"#include <{header.relative_to(INCLUDE).as_posix()}>\nint main() {{ return 0; }}\n")
    subprocess.run([cxx, "-std=c++17", "-Wall", "-Werror", *INCLUDE_FLAGS, "-c", str(src), "-o",
                    str(tmp_path / "one.o")], check=True)


@pytest.mark.parametrize("debug", [False, True], ids=["release", "debug"])
@pytest.mark.parametrize("commit", [0, 1, 2, 3], ids=["release_sys", "fence_sys", "v2_release", "v2_split"])
def test_device_api_compiles_with_nvcc(tmp_path: Path, commit: int, debug: bool) -> None:
    compiler = nvcc()
    if not compiler:
        pytest.skip("nvcc not found: the CUDA compile checks run where the CUDA toolkit is installed")
    src = tmp_path / "use_all.cu"
    src.write_text(USE_ALL)
    flags = [f"-DTPD_COMMIT={commit}"] + (["-DTPD_DEBUG"] if debug else [])
    subprocess.run([compiler, "-arch=sm_90", "-std=c++17", "-Werror", "all-warnings", *flags, *INCLUDE_FLAGS,
                    "-c", str(src), "-o", str(tmp_path / "use_all.o")], check=True)


@pytest.mark.parametrize("source", SOURCES, ids=lambda p: p.name)
def test_project_kernels_compile_with_nvcc(tmp_path: Path, source: Path) -> None:
    compiler = nvcc()
    if not compiler:
        pytest.skip("nvcc not found: the CUDA compile checks run where the CUDA toolkit is installed")
    subprocess.run([compiler, "-arch=sm_90", "-std=c++17", "-DTPD_DEBUG", *INCLUDE_FLAGS, "-c", str(source),
                    "-o", str(tmp_path / "k.o")], check=True)


@pytest.mark.parametrize("source", [None, *SOURCES], ids=lambda p: "use_all" if p is None else p.name)
def test_device_api_is_nvrtc_clean(source: Path | None) -> None:
    nvrtc_or_skip()
    from gpuclient.compiler import compile_to_cubin

    text = USE_ALL if source is None else source.read_text()
    for debug in (False, True):
        assert compile_to_cubin(text, arch="sm_90", debug=debug)[:4] == b"\x7fELF"


def test_default_channel_kernels_build_for_the_ibgda_path() -> None:
    """The GPU tests' channel kernels take tpd::DefaultChannel: -DTPD_IBGDA builds them for IBGDA unchanged."""
    nvrtc_or_skip()
    from gpuclient.compiler import CompileError, compile_to_cubin

    for name in ("kernels.cu", "plan_kernels.cu"):
        source = (ROOT / "tests" / "gpu" / name).read_text()
        try:
            cubin = compile_to_cubin(source, arch="sm_90", debug=True, defines={"TPD_IBGDA": 1})
        except CompileError as exc:
            pytest.fail(f"{name}: {exc.log}")
        assert cubin[:4] == b"\x7fELF"


def test_nvrtc_errors_carry_the_log() -> None:
    nvrtc_or_skip()
    from gpuclient.compiler import CompileError, compile_to_cubin

    with pytest.raises(CompileError, match="tpd::no_such_call"):
        compile_to_cubin('#include <transportd/client.cuh>\n__global__ void k() { tpd::no_such_call(); }\n')


def test_nvrtc_options_set_the_include_path_and_debug_bounds() -> None:
    opts = nvrtc_options("sm_90", debug=True, defines={"X": 1, "Y": None})
    assert f"-I{gpuclient.get_include()}" in opts and "-arch=sm_90" in opts
    assert "-DTPD_DEBUG=1" in opts and "-DX=1" in opts and "-DY" in opts
    assert [o for o in opts if o.startswith("-I")] == INCLUDE_FLAGS, "the device API's root, then the contract's"


# --- mirrors -------------------------------------------------------------------------------------------------------
def test_error_codes_mirror_errorcode() -> None:
    text = (CONTRACT / "transportd" / "errors.h").read_text()
    block = text.split("/* BEGIN error_code_c_enum() */\n", 1)[1].split("/* END error_code_c_enum() */", 1)[0]
    assert block == error_code_c_enum(), "regenerate errors.h's block from transportd.errors.error_code_c_enum()"
    # the device API's name for it forwards to that one enum and defines none of its own
    assert "enum tpd_error_code" not in (INCLUDE / "transportd" / "errors.cuh").read_text()


def test_every_device_header_lives_in_one_of_the_two_include_roots() -> None:
    assert CONTRACT == ROOT / "cmd_ring" / "include"
    # cmd_ring.h and errors.h are real files in the contract's root (no link: a copy or a link elsewhere could
    # drift or break on install); the device API's own headers, IBGDA's included, in gpuclient's
    for name in ("cmd_ring.h", "errors.h"):
        header = CONTRACT / "transportd" / name
        assert header.is_file() and not header.is_symlink(), f"{header} must be the one {name}, a plain file"
    assert (INCLUDE / "transportd" / "ibgda" / "ibgda.cuh").is_file(), "the IBGDA headers live in gpuclient's root"
    assert not list(CONTRACT.rglob("*.cuh")), "the contract's root holds C headers only, no device API"
    elsewhere = [p.relative_to(ROOT).as_posix() for pkg in ("cmd_ring", "gpuclient", "ibgda", "ib", "efa", "transportd")
                 for pattern in ("*.cuh", "cmd_ring.h", "errors.h") for p in (ROOT / pkg).rglob(pattern)
                 if INCLUDE not in p.parents and CONTRACT not in p.parents]
    assert elsewhere == [], f"device headers outside {INCLUDE} and {CONTRACT}: {elsewhere}"
    assert not hasattr(cmd_ring, "get_include") and not hasattr(ibgda, "get_include"), (
        "gpuclient.get_include_dirs() is the only list of include roots")


def test_one_ordering_layer_for_the_proxy_and_the_ibgda_path() -> None:
    """Every fence, acquire/release access, atomic and spin is spelled out once, in ordering.cuh: no other
    device header writes inline PTX or keeps its own spin loop."""
    ordering = INCLUDE / "transportd" / "ordering.cuh"
    others = sorted(set((INCLUDE / "transportd").rglob("*.cuh")) - {ordering})
    assert others and "asm volatile" in ordering.read_text()
    for header in others:
        text = header.read_text()
        assert "asm" not in text, f"{header.name}: inline PTX belongs in ordering.cuh"
        assert "__nanosleep(" not in text and "sched_yield(" not in text, f"{header.name}: spin with ordering::Spin"
    assert not (INCLUDE / "transportd" / "ibgda" / "sync.cuh").exists()


# --- host-side helpers -----------------------------------------------------------------------------------------------
def test_host_arrays_are_not_device_buffers() -> None:
    assert not is_device_buffer(np.zeros(4))
    assert not is_device_buffer(b"abc")
    assert not is_device_buffer(gpuclient.host_array(16))

    class FakeCuda:
        __cuda_array_interface__ = {"shape": (4,), "typestr": "<f4", "data": (0x1000, False), "version": 3}

    class FakeDLPack:
        def __dlpack_device__(self) -> tuple[int, int]:
            return (2, 0)

    assert is_device_buffer(FakeCuda()) and is_device_buffer(FakeDLPack())


def test_contiguity_rule() -> None:
    assert _c_contiguous((4, 3), None, 4)
    assert _c_contiguous((4, 3), (12, 4), 4)
    assert not _c_contiguous((4, 3), (4, 16), 4)
    assert _c_contiguous((1, 3), (999, 4), 4)  # a size-1 dimension's stride does not matter


def test_kernel_arguments_pack_by_value() -> None:
    assert bytes(_pack(np.uint32(7))) == (7).to_bytes(4, "little")
    assert bytes(_pack(np.uint64(1 << 40))) == (1 << 40).to_bytes(8, "little")
    handle = np.zeros(1, dtype=CHANNEL_DTYPE)
    handle["capacity"] = 16
    assert bytes(_pack(handle)) == handle.tobytes()
    assert bytes(_pack(handle.tobytes())) == handle.tobytes()
    with pytest.raises(TypeError, match="sized type"):
        _pack(3)


def test_device_flags_request_validation() -> None:
    assert Flags(4, "device", handle=bytes(64), offset=256).to_msg()["handle"] == bytes(64)
    with pytest.raises(Exception, match="64 bytes"):
        Flags(4, "device", handle=b"short")
    with pytest.raises(Exception, match="only device flags"):
        Flags(4, "host", handle=bytes(64))
