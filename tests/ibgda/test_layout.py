"""The IBGDA headers against their Python twins: sizes, offsets and constants; WQEs built by the header
decode, field by field, to what was asked; nvcc's host pass builds the same bytes; the static_asserts
are live; the device path compiles for sm_90 and under NVRTC."""

from __future__ import annotations

import random
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from ibgda import device_handle as H
from ibgda import mlx5_layout as L
from tests.support.ibgda_link import IBGDA_TESTS, INCLUDE, compiler, include_flags
from tests.support.nvrtc import nvrtc_or_skip

STRUCTS = {
    "CtrlSeg": (L.CTRL_SEG_DTYPE, {"opmod_idx_opcode_be": "opmod", "qpn_ds_be": "qpn_ds", "signature": "signature",
                                   "stream_id_be": "stream_id", "fm_ce_se": "fm_ce_se", "imm_be": "imm"}),
    "RaddrSeg": (L.RADDR_SEG_DTYPE, {"raddr_be": "raddr", "rkey_be": "rkey", "reserved": "reserved"}),
    "DataSeg": (L.DATA_SEG_DTYPE, {"byte_count_be": "byte_count", "lkey_be": "lkey", "addr_be": "addr"}),
    "AtomicSeg": (L.ATOMIC_SEG_DTYPE, {"swap_add_be": "swap_add", "compare_be": "compare"}),
    "Cqe64": (L.CQE64_DTYPE, {"srqn_uidx_be": "srqn_uidx", "imm_inval_pkey_be": "imm_inval_pkey", "app": "app",
                              "app_op": "app_op", "app_info_be": "app_info", "byte_cnt_be": "byte_cnt",
                              "timestamp_be": "timestamp", "sop_drop_qpn_be": "sop_drop_qpn",
                              "wqe_counter_be": "wqe_counter", "signature": "signature", "op_own": "op_own"}),
    "ErrCqe64": (L.ERR_CQE_DTYPE, {"srqn_be": "srqn", "vendor_err_synd": "vendor_err_synd", "syndrome": "syndrome",
                                   "s_wqe_opcode_qpn_be": "s_wqe_opcode_qpn", "wqe_counter_be": "wqe_counter",
                                   "signature": "signature", "op_own": "op_own"}),
    "QpState": (H.QP_STATE_DTYPE, {n: n for n in H.QP_STATE_DTYPE.names}),
    "QueuePair": (H.QUEUE_PAIR_DTYPE, {n: n for n in H.QUEUE_PAIR_DTYPE.names}),
    "Region": (H.REGION_DTYPE, {n: n for n in H.REGION_DTYPE.names}),
    "IbgdaChannel": (H.CHANNEL_DTYPE, {n: n for n in H.CHANNEL_DTYPE.names}),
}
CONSTANTS = {
    "CTRL_FENCE": L.CTRL_FENCE, "CTRL_SMALL_FENCE": L.CTRL_SMALL_FENCE, "CTRL_CQ_UPDATE": L.CTRL_CQ_UPDATE,
    "CTRL_SOLICITED": L.CTRL_SOLICITED, "WQE_BB": L.WQE_BB, "INLINE_SEG": L.INLINE_SEG, "SND_DBR": L.SND_DBR,
    "CQ_SET_CI": L.CQ_SET_CI, "CQE_INITIAL_OP_OWN": L.CQE_INITIAL_OP_OWN, "ABI": H.ABI,
    **{f"op.{o.name}": int(o) for o in (L.Opcode.NOP, L.Opcode.RDMA_WRITE, L.Opcode.RDMA_READ, L.Opcode.ATOMIC_FA,
                                        L.Opcode.ATOMIC_CS)},
    "cqe.REQ": L.CqeOpcode.REQ, "cqe.REQ_ERR": L.CqeOpcode.REQ_ERR, "cqe.INVALID": L.CqeOpcode.INVALID,
    **{f"syn.{s.name}": int(s) for s in (L.Syndrome.LOCAL_LENGTH_ERR, L.Syndrome.LOCAL_QP_OP_ERR,
                                         L.Syndrome.LOCAL_PROT_ERR, L.Syndrome.WR_FLUSH_ERR,
                                         L.Syndrome.REMOTE_ACCESS_ERR)},
    **{f"mode.{m.name}": int(m) for m in H.SignalMode},
}
# the warp-aggregated calls as a kernel body uses them (lanes off, two peers in one warp, ADD and SET)
WARP_CALLS = (
    "  uint64_t at = tpd::warp_put(ch, threadIdx.x % 3 == 0, 1, 0, 64 * threadIdx.x, 0, 0, 64);\n"
    "  at += tpd::warp_put(ch, true, 1 + (threadIdx.x & 1), 0, 0, 0, 0, 64, 9);\n"
    "  at += tpd::warp_put_signal(ch, true, 1, 0, 0, 0, 0, 4096, 3, 1);\n"
    "  at += tpd::warp_put_signal(ch, threadIdx.x < 7, 1, 0, 0, 0, 0, 4096, 3, 5, tpd::SignalOp::Set);\n"
    "  if (at == 0) tpd::quiet(ch);\n")
RECORD = 64 + 8 + 4 + 4  # probe output per case: WQE image, doorbell word, doorbell record, padding


def nvcc() -> str | None:
    found = shutil.which("nvcc")
    if found:
        return found
    default = Path("/usr/local/cuda/bin/nvcc")
    return str(default) if default.exists() else None


def parse(out: str) -> dict[str, int]:
    return {k: int(v) for k, v in re.findall(r"^(\S+) (\d+)$", out, re.M)}


def expected() -> dict[str, int]:
    out: dict[str, int] = {}
    for struct, (dtype, names) in STRUCTS.items():
        out[f"sizeof.{struct}"] = dtype.itemsize
        for cname, pname in names.items():
            out[f"offset.{struct}.{cname}"] = dtype.fields[pname][1]
    out["sizeof.InlineSeg8"] = 16
    out["offset.InlineSeg8.byte_count_be"] = 0
    out["offset.InlineSeg8.data"] = 4
    out["sizeof.Wqe"] = L.WQE_BB
    out.update({f"const.{k}": int(v) for k, v in CONSTANTS.items()})
    return out


@pytest.fixture(scope="module")
def probe(build_dir: Path) -> Path:
    exe = build_dir / "probe"
    subprocess.run([compiler(), "-std=c++17", "-Wall", "-Wextra", "-Werror", *include_flags(),
                    str(IBGDA_TESTS / "probe.cpp"), "-o", str(exe)], check=True)
    return exe


def random_cases(n: int, seed: int) -> list[tuple]:
    rng = random.Random(seed)
    kinds = ["write", "inline8", "read", "fadd", "nop"]
    cases = [  # the edges first: index wrap at 2^16, 24-bit QPN, zero-length read, 2^31-1 bytes
        ("write", 0xFFFF, 0xFFFFFF, L.CTRL_CQ_UPDATE, 2**64 - 8, 2**32 - 1, 2**64 - 64, 2**32 - 1, 2**31 - 1, 0),
        ("write", 0x10001, 1, 0, 0, 0, 0, 0, 1, 0),
        ("read", 7, 0x1234, L.CTRL_FENCE, 0, 0, 0, 0, 0, 0),
        ("inline8", 3, 0x42, L.CTRL_FENCE | L.CTRL_CQ_UPDATE, 0x1000, 5, 0, 0, 8, 2**64 - 1),
        ("fadd", 9, 0x42, 0, 0x2008, 6, 0x3000, 7, 8, 1),
    ]
    for _ in range(n):
        kind = rng.choice(kinds)
        fm = rng.choice([0, L.CTRL_CQ_UPDATE, L.CTRL_FENCE, L.CTRL_FENCE | L.CTRL_CQ_UPDATE])
        nbytes = rng.choice([0, 1, rng.randrange(1, 1 << 31)]) if kind == "read" else rng.randrange(1, 1 << 31)
        cases.append((kind, rng.getrandbits(40), rng.getrandbits(24), fm, rng.getrandbits(64) & ~7,
                      rng.getrandbits(32), rng.getrandbits(64), rng.getrandbits(32), nbytes, rng.getrandbits(64)))
    return cases


def run_probe(exe: Path, cases: list[tuple], out: Path) -> tuple[dict[str, int], bytes]:
    text = "".join(" ".join(str(x) for x in c) + "\n" for c in cases)
    res = subprocess.run([str(exe), str(out)], input=text, capture_output=True, text=True, check=True)
    return parse(res.stdout), out.read_bytes()


def check_case(case: tuple, rec: bytes) -> None:
    kind, index, qpn, fm, raddr, rkey, laddr, lkey, nbytes, value = case
    wqe = rec[:64]
    w = L.decode_wqe(wqe)
    assert w.wqe_index == index & 0xFFFF and w.qpn == qpn and w.fm_ce_se == fm and w.opmod == 0 and w.imm == 0
    assert w.fence == bool(fm & L.CTRL_FENCE) and w.completion == bool(fm & L.CTRL_CQ_UPDATE)
    assert wqe[8:11] == b"\0\0\0", "signature and DCI stream id stay 0 on RC"
    if kind == "nop":
        assert (w.opcode, w.ds) == (L.Opcode.NOP, 1)
    else:
        assert (w.raddr, w.rkey) == (raddr, rkey)
        assert np.frombuffer(wqe, dtype=L.RADDR_SEG_DTYPE, count=1, offset=16)[0]["reserved"] == 0
    if kind == "write":
        assert (w.opcode, w.ds, w.data, w.inline) == (L.Opcode.RDMA_WRITE, 3, [(nbytes, lkey, laddr)], None)
    elif kind == "inline8":
        assert (w.opcode, w.ds, w.data) == (L.Opcode.RDMA_WRITE, 3, [])
        assert w.inline == value.to_bytes(8, "little"), "inline flag bytes land as a little-endian u64"
        assert int.from_bytes(wqe[32:36], "big") == 8 | L.INLINE_SEG
    elif kind == "read":
        assert w.opcode == L.Opcode.RDMA_READ
        assert (w.ds, w.data) == ((2, []) if nbytes == 0 else (3, [(nbytes, lkey, laddr)]))
    elif kind == "fadd":
        assert (w.opcode, w.ds, w.swap_add, w.compare) == (L.Opcode.ATOMIC_FA, 4, value, 0)
        assert w.data == [(8, lkey, laddr)]
    used = {"nop": 16, "read": 32 if nbytes == 0 else 48, "write": 48, "inline8": 44, "fadd": 64}[kind]
    assert wqe[used:] == bytes(64 - used), "bytes past the WQE's segments are zero"
    # the doorbell: the control segment's first 8 bytes; the doorbell record: be32(send counter & 0xffff)
    assert rec[64:72] == wqe[:8]
    assert rec[72:76] == ((index + 1) & 0xFFFF).to_bytes(4, "big")
    assert int.from_bytes(rec[72:76], "little") == L.sq_dbrec_value(index + 1)


def test_layout_agrees_with_python(probe: Path, tmp_path: Path) -> None:
    got, _ = run_probe(probe, [], tmp_path / "none.bin")
    assert got == expected()


def test_built_wqes_decode_to_what_was_asked(probe: Path, tmp_path: Path) -> None:
    cases = random_cases(400, seed=7)
    _, data = run_probe(probe, cases, tmp_path / "wqes.bin")
    assert len(data) == RECORD * len(cases)
    for i, case in enumerate(cases):
        check_case(case, data[i * RECORD:(i + 1) * RECORD])


def test_nvcc_host_pass_builds_the_same_bytes(probe: Path, tmp_path: Path) -> None:
    cc = nvcc()
    if not cc:
        pytest.skip("nvcc not found: the CUDA host-pass probe runs where the CUDA toolkit is installed")
    src = tmp_path / "probe.cu"
    src.write_text((IBGDA_TESTS / "probe.cpp").read_text())
    exe = tmp_path / "probe_nvcc"
    subprocess.run([cc, "-std=c++17", "-arch=sm_90", *include_flags(), str(src), "-o", str(exe)], check=True)
    cases = random_cases(100, seed=11)
    got_gcc, data_gcc = run_probe(probe, cases, tmp_path / "gcc.bin")
    got_nvcc, data_nvcc = run_probe(exe, cases, tmp_path / "nvcc.bin")
    assert got_nvcc == got_gcc == expected()
    assert data_nvcc == data_gcc


def test_device_path_compiles_for_sm90(tmp_path: Path) -> None:
    cc = nvcc()
    if not cc:
        pytest.skip("nvcc not found: the device compile check runs where the CUDA toolkit is installed")
    src = tmp_path / "k.cu"
    src.write_text(
        "#include <transportd/client.cuh>\n#include <transportd/ibgda/ibgda.cuh>\n"
        "template <class Ch> __global__ void k(Ch ch) {\n"
        "  tpd::put(ch, 1, 0, 0, 0, 0, 64);\n"
        "  tpd::put_signal(ch, 1, 0, 0, 0, 0, 4096, 3, 1);\n"
        "  tpd::signal(ch, 1, 3, 7, tpd::SignalOp::Set);\n"
        "  tpd::put(ch, 1, 0, 0, 0, 0, 64, 0, tpd::Post::Now);\n"  # both channels take the post hint
        "  tpd::put_signal(ch, 1, 0, 0, 0, 0, 4096, 3, 1, tpd::SignalOp::Add, tpd::Post::Now);\n"
        "  tpd::signal(ch, 1, 3, 7, tpd::SignalOp::Set, tpd::Post::Now);\n"
        "  tpd::warp_put(ch, true, 1, 0, 0, 0, 0, 64, 0, tpd::Post::Now);\n"
        "  tpd::warp_put_signal(ch, true, 1, 0, 0, 0, 0, 64, 3, 1, tpd::SignalOp::Add, tpd::Post::Now);\n"
        "  tpd::fence(ch, 1);\n  tpd::quiet(ch);\n  tpd::block_wait(ch, 3, 1);\n"
        "  if (tpd::status(ch) || tpd::error_count(ch)) tpd::wait(ch, 3, 2);\n"
        f"{WARP_CALLS}}}\n"
        "template __global__ void k<tpd::Channel>(tpd::Channel);\n"
        "template __global__ void k<tpd::IbgdaChannel>(tpd::IbgdaChannel);\n")
    for extra in ([], ["-G"]):  # release, and debug (bounded spins)
        res = subprocess.run([cc, "-std=c++17", "-arch=sm_90", *extra, *include_flags(), "-ptx", str(src), "-o",
                              str(tmp_path / "k.ptx")], capture_output=True, text=True)
        assert res.returncode == 0, res.stderr
    ptx = (tmp_path / "k.ptx").read_text()
    assert "match.any.sync.b32" in ptx, "the warp calls group lanes by peer"
    assert "st.mmio.relaxed.sys.global.u64" in ptx, "the doorbell is one MMIO store"
    assert "st.release.sys.global.u32" in ptx, "the doorbell record is a release store at system scope"
    assert "fence.sc.sys" in ptx


def test_single_put_loads_no_handle_field_on_its_way_to_the_doorbell(tmp_path: Path) -> None:
    """One thread's tpd::put, in its PTX: after the claim's acquire of ``done`` and after the ticket's acquire
    of ``posted`` the handle is not read again (each such load is an L2 round trip: the acquire invalidates
    L1), the only load between the ticket and the doorbell is the pending-fence word, and the doorbell
    count's atomic comes after the hand on, where no fence of this post waits for it. The tree that read
    the handle again in each ordered step and added to the count before the doorbell record measured
    3.8 us a put on the H200 against 3.4 before (benchmarks/results/h200-2026-12-02-ibgda-bench-warp.json,
    h200-2026-11-29-ibgda-bench.json)."""
    cc = nvcc()
    if not cc:
        pytest.skip("nvcc not found: the PTX check runs where the CUDA toolkit is installed")
    src = tmp_path / "one.cu"
    src.write_text("#include <transportd/ibgda/ibgda.cuh>\n"
                   "extern \"C\" __global__ void k(tpd::IbgdaChannel ch) { tpd::put(ch, 1, 0, 0, 0, 0, 64); }\n")
    subprocess.run([cc, "-std=c++17", "-arch=sm_90", *include_flags(), "-ptx", str(src), "-o", str(tmp_path / "k.ptx")],
                   check=True)
    lines = [ln.strip() for ln in (tmp_path / "k.ptx").read_text().splitlines()]
    memory = re.compile(r"(ld|st|atom|red|fence)\.")
    acquires = [i for i, ln in enumerate(lines) if ln.startswith("ld.acquire.gpu.global.u64")]
    doorbell = next(i for i, ln in enumerate(lines) if ln.startswith("st.mmio."))
    first_wqe = next(i for i, ln in enumerate(lines) if ln.startswith("st.v4.u32"))
    ticket = max(i for i in acquires if i < doorbell)
    claim = [ln for ln in lines[min(acquires):first_wqe] if memory.match(ln)]
    assert not [ln for ln in claim if ln.startswith("ld.global")], f"handle read again after the space check: {claim}"
    ordered = [ln for ln in lines[ticket + 1:doorbell] if memory.match(ln)]
    assert [ln.split()[0] for ln in ordered if ln.startswith(("ld", "atom", "red"))] == ["ld.u32"], (
        f"between the ticket and the doorbell only fence_next is loaded, nothing atomic: {ordered}")
    after = [ln.split()[0] for ln in lines[doorbell + 1:] if memory.match(ln)][:2]
    assert after == ["st.release.gpu.global.u64", "atom.relaxed.gpu.global.add.u32"], (
        f"hand on (posted), then the doorbell count: {after}")


@pytest.mark.parametrize("channel", ["tpd::IbgdaChannel", "tpd::Channel"])
def test_device_path_compiles_under_nvrtc(channel: str) -> None:
    """The device calls, the warp-aggregated ones included (both signal ops, lanes inactive, lanes to
    different peers), build under NVRTC for either handle type."""
    nvrtc = nvrtc_or_skip()
    src = ("#include <transportd/client.cuh>\n#include <transportd/ibgda/ibgda.cuh>\n"
           f"extern \"C\" __global__ void k({channel} ch) {{\n"
           "  tpd::put_signal(ch, 1, 0, 0, 0, 0, 4096, 3, 1);\n  tpd::quiet(ch);\n  tpd::wait(ch, 3, 1);\n"
           f"{WARP_CALLS}}}\n").encode()
    err, prog = nvrtc.nvrtcCreateProgram(src, b"k.cu", 0, [], [])
    opts = [*(f.encode() for f in include_flags()), b"-arch=compute_90", b"-std=c++17"]
    (res,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
    if res != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        _, n = nvrtc.nvrtcGetProgramLogSize(prog)
        log = b" " * n
        nvrtc.nvrtcGetProgramLog(prog, log)
        pytest.fail(log.decode())
    nvrtc.nvrtcDestroyProgram(prog)


@pytest.mark.parametrize(("header", "old", "new", "message"), [
    ("segments.cuh", "    uint8_t fm_ce_se;\n    uint32_t imm_be;", "    uint32_t imm_be;\n    uint8_t fm_ce_se;",
     "fm_ce_se at 11"),
    ("cqe.cuh", "    uint8_t vendor_err_synd;\n    uint8_t syndrome;",
     "    uint8_t syndrome;\n    uint8_t vendor_err_synd;", "syndrome at 55"),
    ("queue_pair.cuh", "    uint64_t posted;\n", "    uint64_t posted;\n    uint64_t extra;\n", "signaled at 136"),
])
def test_static_asserts_catch_a_drifted_layout(tmp_path: Path, header: str, old: str, new: str, message: str) -> None:
    inc = tmp_path / "inc"
    shutil.copytree(Path(INCLUDE), inc)
    path = inc / "transportd" / "ibgda" / header
    text = path.read_text()
    assert old in text
    path.write_text(text.replace(old, new))
    src = tmp_path / "t.cpp"
    src.write_text("#include <transportd/ibgda/ibgda.cuh>\nint main() { return 0; }\n")
    res = subprocess.run([compiler(), "-std=c++17", f"-I{inc}", *include_flags()[1:], str(src), "-o",
                          str(tmp_path / "t")], capture_output=True, text=True)
    assert res.returncode != 0 and message in res.stderr


def test_python_cqe_codec_round_trips() -> None:
    raw = L.encode_cqe(pi=5, ncqes=8, wqe_counter=0x1_2345, wqe_opcode=L.Opcode.RDMA_READ, qpn=0xABCDEF, byte_cnt=4096)
    c = L.decode_cqe(raw)
    assert (c.opcode, c.owner, c.wqe_counter, c.wqe_opcode, c.qpn, c.byte_cnt) == (0, 0, 0x2345, 0x10, 0xABCDEF, 4096)
    assert raw[56:60] == bytes([0x10, 0xAB, 0xCD, 0xEF]) and raw[60:62] == b"\x23\x45"
    e = L.decode_cqe(L.encode_err_cqe(pi=8, ncqes=8, wqe_counter=3, wqe_opcode=8, qpn=7, syndrome=0x13,
                                      vendor_err=0x88))
    assert (e.opcode, e.owner, e.syndrome, e.vendor_err, e.wqe_counter, e.is_error) == (13, 1, 0x13, 0x88, 3, True)
    assert L.cqe_ready(L.CQE_INITIAL_OP_OWN, 0, 8) is False
    assert L.cqe_ready(0x00, 0, 8) and not L.cqe_ready(0x00, 8, 8) and L.cqe_ready(0x01, 8, 8)


@pytest.mark.parametrize("kernels", ["tests/ibgda/gpu_kernels.cu", "benchmarks/ibgda_kernels.cu"])
def test_gpu_kernels_compile_with_nvrtc(kernels: str) -> None:
    """The GPU test's and the benchmark's kernels build (NVRTC, sm_90, debug and release) without a GPU."""
    nvrtc_or_skip()
    from gpuclient.compiler import CompileError, compile_to_cubin

    source = (IBGDA_TESTS.parents[1] / kernels).read_text()
    for debug in (False, True):
        try:
            cubin = compile_to_cubin(source, name=Path(kernels).name, arch="sm_90", debug=debug,
                                     defines={"TPD_SPIN_TIMEOUT_NS": "20000000000ull"})
        except CompileError as exc:
            pytest.fail(exc.log)
        assert cubin[:4] == b"\x7fELF"


def test_constants_agree_with_pyverbs_mlx5_enums() -> None:
    """Where rdma-core's pyverbs is built (.ci/build_pyverbs.sh), its mlx5 enums must match ours."""
    try:
        from pyverbs.providers.mlx5 import mlx5_enums as E
    except ImportError as exc:
        pytest.skip(f"pyverbs with the mlx5 provider is not importable ({exc})")
    pairs = {"MLX5_WQE_CTRL_CQ_UPDATE": L.CTRL_CQ_UPDATE, "MLX5_WQE_CTRL_FENCE": L.CTRL_FENCE,
             "MLX5_WQE_CTRL_SOLICITED": L.CTRL_SOLICITED,
             "MLX5_WQE_CTRL_INITIATOR_SMALL_FENCE": L.CTRL_SMALL_FENCE, "MLX5_SEND_WQE_BB": L.WQE_BB,
             "MLX5_SND_DBR": L.SND_DBR, "MLX5_CQE_INVALID": L.CqeOpcode.INVALID, "MLX5_CQE_REQ": L.CqeOpcode.REQ,
             "MLX5_CQE_REQ_ERR": L.CqeOpcode.REQ_ERR}
    for name, ours in pairs.items():
        if hasattr(E, name):
            assert int(getattr(E, name)) == int(ours), name
