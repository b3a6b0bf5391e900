"""gpuclient.triton without a GPU: Triton compiles every call for sm_90 here, so the tests read the PTX and run it.

- The host packing of a record agrees with cmd_ring.record, and the handle copies are what the header says.
- Every call compiles to PTX and a cubin (ptxas accepts it) for sm_90; the PTX is read back: every store,
  atomic and spin of the protocol sits behind the thread-0 guard, with the CUDA header's instructions
  (semantics and scopes; the push compared with NVRTC's PTX of ``tpd::put``), a barrier before each push and
  after each wait, and the wait's compare signed.
- The compiled PTX runs in a small interpreter (tests/support/ptxsim.py) over four threads of the program
  against a real ring file, consumed by the daemon's RingConsumer, and real ChunkPlan tables in host memory:
  the records come out exactly as cmd_ring decodes them (seq laps and wraparound included), only thread 0
  writes, a full ring waits for credit, quiet waits for the completion position, wait for the flag (wrapping
  counters included), tile_done ships each chunk once per round with the plan's sends, wait_range waits
  for exactly the chunks ChunkPlan.recv_span names, signal_peers signals every other rank at its own slot and
  wait_peers needs every peer's flag, never its own.
- The all-gather kernel of tests/gpu/triton_allgather.py and the push benchmark compile too.

CI installs Triton (.[triton]); without it these tests skip here and fail under CI.
"""

from __future__ import annotations

import inspect
import os
import re
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from cmd_ring.record import RECORD_DTYPE, Command, Flag, Opcode, decode, encode
from cmd_ring.record import seq_for as ring_seq_for
from cmd_ring.ring import RingConsumer, RingFile
from gpuclient.device_channel import CHANNEL_DTYPE, RING_DTYPE
from tests.support.benchmarks import load_benchmark
from tests.support.ptxsim import Kernel, Stuck
from tests.support.triton_required import require_triton

require_triton()

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

import gpuclient.triton as tdt  # noqa: E402
from gpuclient.plan import PLAN_DTYPE, ChunkPlan  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
THREADS = (0, 1, 32, 127)  # simulated threads of a 4-warp program: the first, a lane, another warp, the last
_COMPILED: dict = {}


# --- compiling ------------------------------------------------------------------------------------------------
def compile_kernel(fn, signature: dict[str, str], constexprs: dict[str, object] | None = None,
                   num_warps: int = 4):
    """``triton.compile`` for sm_90 without a GPU (cached): the CompiledKernel, with asm["ptx"] and asm["cubin"]."""
    key = (fn, tuple(signature.items()), tuple((constexprs or {}).items()), num_warps)
    if key not in _COMPILED:
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource

        # every constexpr with a default, given: Triton's compile cache keys constexprs by their values in
        # parameter order, not by name, so {A: True} and {B: True} (the other left to its default) collide
        constexprs = {**{p.name: p.default for p in fn.params if p.is_constexpr and p.has_default},
                      **(constexprs or {})}
        sig = dict(signature)
        for name in constexprs:
            sig[name] = "constexpr"
        given = "constexprs" if "constexprs" in inspect.signature(ASTSource).parameters else "constants"
        source = ASTSource(fn=fn, signature=sig, **{given: constexprs})
        _COMPILED[key] = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})
    return _COMPILED[key]


def ptx_lines(ptx: str) -> list[str]:
    """The entry's statements, without comments, debug locations and blank lines."""
    body = ptx[ptx.index(".entry"):]
    out = []
    for line in body.splitlines():
        s = line.split("//")[0].strip()
        if s and not s.startswith((".loc", ".file", "$L__tmp", "$L__func")):
            out.append(s)
    return out


def opcode(line: str) -> str:
    return re.sub(r"^@!?%\w+\s+", "", line).split()[0].rstrip(";")


ORDERING = re.compile(r"^(atom|red|st\.global|st\.release|st\.relaxed|ld\.acquire|ld\.relaxed|fence|bar\.sync)")


def guarded_blocks(lines: list[str]) -> list[list[str]]:
    """The inline-assembly blocks of gpuclient.triton that guard on %tid.x, each as its statements."""
    blocks, cur = [], None
    for line in lines:
        if line == "mov.u32 %tpd_tid, %tid.x;":
            cur = [line]
        elif cur is not None:
            cur.append(line)
            if re.match(r"^TPD_DONE_\d+:$", line):
                blocks.append(cur)
                cur = None
    return blocks


# --- test kernels --------------------------------------------------------------------------------------------
@triton.jit
def k_pushes(ch):
    tdt.put(ch, 3, 5, 4096, 6, 8192, 1000)
    tdt.put(ch, 3, 5, 4096, 6, 8192, 1000, 77)
    tdt.put_signal(ch, 1, 2, 64, 4, 128, 4096, 9, 5)
    tdt.put_signal(ch, 1, 2, 64, 4, 128, 4096, 9, 123456789012, tdt.SIGNAL_SET)
    tdt.signal(ch, 2, 10, 3)
    tdt.signal(ch, 70000, 11, 1 << 40, tdt.SIGNAL_SET)  # a rank past u16: the proxy refuses peer 0xFFFF
    tdt.fence(ch, 2)
    tdt.put(ch, 3, 5, 0, 6, 0, 64, 78, now=True)  # post at once: the record carries NO_BATCH
    tdt.put_signal(ch, 1, 2, 64, 4, 128, 4096, 9, 6, tdt.SIGNAL_SET, now=True)
    tdt.signal(ch, 2, 10, 4, now=True)


PUSHES = [
    Command(Opcode.PUT, peer=3, dst_region=5, dst_off=4096, src_region=6, src_off=8192, length=1000),
    Command(Opcode.PUT, peer=3, dst_region=5, dst_off=4096, src_region=6, src_off=8192, length=1000, chunk_id=77),
    Command(Opcode.PUT_SIGNAL, peer=1, dst_region=2, dst_off=64, src_region=4, src_off=128, length=4096,
            signal_slot=9, signal_value=5),
    Command(Opcode.PUT_SIGNAL, peer=1, dst_region=2, dst_off=64, src_region=4, src_off=128, length=4096,
            signal_slot=9, signal_value=123456789012, flags=Flag.SIGNAL_SET),
    Command(Opcode.SIGNAL, peer=2, signal_slot=10, signal_value=3),
    Command(Opcode.SIGNAL, peer=0xFFFF, signal_slot=11, signal_value=1 << 40, flags=Flag.SIGNAL_SET),
    Command(Opcode.FENCE, peer=2),
    Command(Opcode.PUT, peer=3, dst_region=5, src_region=6, length=64, chunk_id=78, flags=Flag.NO_BATCH),
    Command(Opcode.PUT_SIGNAL, peer=1, dst_region=2, dst_off=64, src_region=4, src_off=128, length=4096,
            signal_slot=9, signal_value=6, flags=Flag.SIGNAL_SET | Flag.NO_BATCH),
    Command(Opcode.SIGNAL, peer=2, signal_slot=10, signal_value=4, flags=Flag.NO_BATCH),
]


@triton.jit
def k_put_loop(ch, n):
    for i in range(n):
        off = i.to(tl.uint64) * 4096
        tdt.put_signal(ch, 1, 2, off, 3, off + 8, 4096, 7, i + 1)


@triton.jit
def k_quiet(ch, out):
    tdt.put(ch, 1, 2, 0, 3, 0, 64)
    tdt.quiet(ch)
    tl.store(out, 1)


@triton.jit
def k_status(ch, out):
    tl.store(out, tdt.status(ch))


@triton.jit
def k_wait(ch, slot, at_least, out):
    tl.store(out, tdt.wait(ch, slot, at_least))


@triton.jit
def k_tile_done(ch, plan, tile, out):
    tl.store(out, tdt.tile_done(ch, plan, tile).to(tl.uint32))


@triton.jit
def k_wait_range(ch, plan, epoch, rank, byte_off, nbytes, out):
    tdt.wait_range(ch, plan, epoch, rank, byte_off, nbytes)
    tl.store(out, 1)


@triton.jit
def k_wait_chunk(ch, plan, epoch, rank, chunk, out):
    tdt.wait_chunk(ch, plan, epoch, rank, chunk)
    tl.store(out, 1)


@triton.jit
def k_signal_peers(ch, rank, world, slot):
    tdt.signal_peers(ch, rank, world, slot, 3)


@triton.jit
def k_wait_peers(ch, rank, world, slot, at_least, out):
    tdt.wait_peers(ch, rank, world, slot, at_least)
    tl.store(out, 1)


@triton.jit
def k_put_once(ch):
    tdt.put(ch, 1, 2, 3, 4, 5, 6)


SIGS = {
    "pushes": {"ch": "*u64"},
    "put_loop": {"ch": "*u64", "n": "i32"},
    "quiet": {"ch": "*u64", "out": "*u32"},
    "status": {"ch": "*u64", "out": "*u32"},
    "wait": {"ch": "*u64", "slot": "i32", "at_least": "u64", "out": "*u64"},
    "tile_done": {"ch": "*u64", "plan": "*u64", "tile": "i32", "out": "*u32"},
    "wait_range": {"ch": "*u64", "plan": "*u64", "epoch": "u64", "rank": "i32", "byte_off": "u64", "nbytes": "u64",
                   "out": "*u32"},
    "wait_chunk": {"ch": "*u64", "plan": "*u64", "epoch": "u64", "rank": "i32", "chunk": "i32", "out": "*u32"},
    "signal_peers": {"ch": "*u64", "rank": "i32", "world": "i32", "slot": "i32"},
    "wait_peers": {"ch": "*u64", "rank": "i32", "world": "i32", "slot": "i32", "at_least": "u64", "out": "*u32"},
}
KERNELS = {"pushes": k_pushes, "put_loop": k_put_loop, "quiet": k_quiet, "status": k_status, "wait": k_wait,
           "tile_done": k_tile_done, "wait_range": k_wait_range, "wait_chunk": k_wait_chunk,
           "signal_peers": k_signal_peers, "wait_peers": k_wait_peers}


def sim(name: str) -> Kernel:
    """A fresh interpreter of test kernel ``name`` (4 warps)."""
    return Kernel.parse(compile_kernel(KERNELS[name], SIGS[name]).asm["ptx"])


# --- a channel in host memory ----------------------------------------------------------------------------------
class HostChannel:
    """A ring file with its head and credit words and a flag array, all in host memory, and the 64-byte
    ``tpd::Channel`` pointing at them: what the simulated kernels push into and wait on."""

    def __init__(self, capacity: int = 64, flags: int = 32, head: int = 0, credit: int | None = None) -> None:
        self.ring, fd = RingFile.create_memfd(capacity, lock=False)
        os.close(fd)
        self.ring._consumer_pos[0] = head
        self.consumer = RingConsumer(self.ring)
        self.words = np.array([head, head if credit is None else credit], dtype=np.uint64)  # head, credit
        self.flags = np.zeros(flags, dtype=np.uint64)
        self.handle = np.zeros(1, CHANNEL_DTYPE)
        self.handle[0] = (self.ring.address + 4096, self.ring.address, self.words.ctypes.data,
                          self.words.ctypes.data + 8, capacity, 1, self.flags.ctypes.data, flags, 0, 2, 9)
        self.records: list[np.void] = []

    @property
    def ptr(self) -> int:
        return self.handle.ctypes.data

    def drain(self, *_: object) -> None:
        """The proxy's part: take every committed record (releasing credits)."""
        self.records.extend(self.consumer.consume_ready())

    def run(self, kernel: Kernel, args: list[int], *buffers: np.ndarray, **kw: object) -> None:
        """Run ``kernel`` over THREADS of a 4-warp program, touching only this channel and ``buffers``."""
        memory = [(self.ring.address, self.ring.size)] + [(b.ctypes.data, b.nbytes) for b in
                                                          (self.words, self.flags, self.handle, *buffers)]
        kw = {"tids": THREADS, "ntid": 128, **kw}
        kernel.run(args, memory=memory, **kw)

    def commands(self) -> list[tuple[int, Command]]:
        self.drain()
        return [decode(r) for r in self.records]

    def close(self) -> None:
        self.ring.close()


@pytest.fixture
def chan():
    channels: list[HostChannel] = []

    def make(**kw) -> HostChannel:
        channels.append(HostChannel(**kw))
        return channels[-1]

    yield make
    for c in channels:
        c.close()


def no_sleep(tid: int) -> None:
    raise AssertionError(f"thread {tid} had to wait (nanosleep) where nothing should block")


def writers(kernel: Kernel) -> set[int]:
    """Threads that stored to global memory or ran an atomic."""
    return {e.tid for e in kernel.events if e.op.startswith(("st.", "atom", "red"))}


# --- host packing --------------------------------------------------------------------------------------------
def test_record_words_match_cmd_ring_records() -> None:
    rng = np.random.default_rng(3)
    positions = [0, 1, 5, 0xFFFF_FFFD, 0xFFFF_FFFE, 0xFFFF_FFFF, 1 << 32, (1 << 33) + 7, (1 << 63) + 11]
    for pos in positions + [int(p) for p in rng.integers(0, 1 << 62, 200)]:
        fields = {"src_off": int(rng.integers(0, 1 << 63)), "dst_off": int(rng.integers(0, 1 << 63)),
                  "length": int(rng.integers(0, 1 << 32)), "src_region": int(rng.integers(0, 1 << 16)),
                  "dst_region": int(rng.integers(0, 1 << 16)), "chunk_id": int(rng.integers(0, 1 << 32)),
                  "signal_slot": int(rng.integers(0, 1 << 32)), "signal_value": int(rng.integers(0, 1 << 63))}
        op, flags, peer = Opcode(int(rng.integers(1, 6))), Flag(int(rng.integers(0, 4))), int(rng.integers(0, 1 << 16))
        words = tdt.record_words(pos, op, flags, peer, **fields)
        assert tdt.seq_for(pos) == ring_seq_for(pos)
        assert words.tobytes() == encode(Command(op, peer=peer, flags=flags, **fields), seq=ring_seq_for(pos))
        assert decode(words.view(RECORD_DTYPE)[0]) == (ring_seq_for(pos), Command(op, peer=peer, flags=flags, **fields))
    assert tdt.seq_for(0xFFFF_FFFE) == 0xFFFF_FFFF and tdt.seq_for(0xFFFF_FFFF) == 1  # never 0
    assert tdt.header_word(1, 2, 0, 70000) >> 48 == 0xFFFF  # a rank past u16 becomes the refused 0xFFFF


def test_handle_copies_carry_the_header_layout(monkeypatch) -> None:
    copies = []
    monkeypatch.setattr(tdt, "_copy_to_device", lambda data, device: copies.append((data, device)) or data)
    ch = np.zeros(1, CHANNEL_DTYPE)
    ch[0] = (1, 2, 3, 4, 64, 1, 5, 6, 7, 8, 9)
    tdt.channel_pointer(ch.tobytes(), device=0)
    assert copies[-1] == (ch.tobytes(), 0)

    class Ring:  # a DeviceRing: the channel's first 40 bytes, padded to a Channel
        value = ch[["records", "control", "head", "credit", "capacity", "abi"]].astype(RING_DTYPE)
        counters = type("Counters", (), {"device": 3})()

    tdt.channel_pointer(Ring())
    assert copies[-1] == (ch.tobytes()[:40] + bytes(24), 3)
    ch["abi"] = 2
    with pytest.raises(ValueError, match="ABI 2"):
        tdt.channel_pointer(ch.tobytes(), device=0)
    with pytest.raises(ValueError, match="64 bytes"):
        tdt.channel_pointer(bytes(40), device=0)

    plan = ChunkPlan.all_gather(rank=0, world=2, shard_bytes=4096, tile_bytes=1024, chunk_tiles=2)
    value = plan.host_struct(5, counters=np.zeros(plan.chunk_count, np.uint32))
    tdt.plan_pointer(value, device=1)
    data, device = copies[-1]
    want = value.copy()
    want["epoch"] = 0  # kernels take the epoch as an argument
    assert (data, device) == (want.tobytes(), 1)
    assert PLAN_DTYPE.itemsize == tdt.PLAN_SIZE and PLAN_DTYPE.fields["abi"][1] == 80
    with pytest.raises(ValueError, match="needs the device"):
        tdt.plan_pointer(plan)
    bad = value.copy()
    bad["abi"] = 9
    with pytest.raises(ValueError, match="ABI 9"):
        tdt.plan_pointer(bad, device=0)


def test_the_fields_the_device_code_reads_are_where_the_dtypes_put_them() -> None:
    """gpuclient.triton.LAYOUT (word, shift) against the dtypes, which the probe tests hold to the headers."""
    for dtype, name, word, shift in tdt.LAYOUT:
        assert dtype.fields[name][1] == 8 * word + shift // 8, name
    assert tdt._ROW_WORDS == 3 and tdt._PL_WORLD == 9 and tdt._CH_FLAGS == 5


def test_importing_gpuclient_does_not_import_triton() -> None:
    import subprocess
    import sys

    code = "import sys, gpuclient; assert 'triton' not in sys.modules, 'import gpuclient pulled in triton'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


# --- the PTX -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(KERNELS))
def test_every_call_compiles_for_sm90(name: str) -> None:
    compiled = compile_kernel(KERNELS[name], SIGS[name])
    assert compiled.asm["cubin"][:4] == b"\x7fELF"  # ptxas accepted the inline PTX (labels unique per call)
    assert ".target sm_90" in compiled.asm["ptx"]


def test_every_protocol_store_atomic_and_spin_is_behind_the_thread0_guard() -> None:
    lines = ptx_lines(compile_kernel(k_pushes, SIGS["pushes"]).asm["ptx"])
    blocks = guarded_blocks(lines)
    assert len(blocks) == len(PUSHES)
    for block in blocks:
        assert block[1:3] == ["setp.ne.u32 %tpd_p, %tpd_tid, 0;", f"@%tpd_p bra {block[-1][:-1]};"]
        ops = [opcode(s) for s in block if ORDERING.match(opcode(s))]
        assert Counter(ops) == Counter({
            "atom.relaxed.gpu.global.add.u64": 1,  # the slot claim
            "ld.acquire.gpu.global.u64": 1,  # the cached credit
            "ld.acquire.sys.global.u64": 1,  # the consumer position, when the ring looks full
            "red.release.gpu.global.max.u64": 1,  # raise the credit cache for everyone
            "st.global.v2.u64": 2, "st.global.u64": 1,  # body words 2-3, 4-5, then 1
            "st.release.sys.global.u64": 1,  # the header, last
        })
        stores = [opcode(s) for s in block if opcode(s).startswith("st.")]
        assert stores[-1] == "st.release.sys.global.u64"
    # nothing outside the guarded blocks writes, and each push has a barrier in front of it
    inside = {id(s) for b in blocks for s in b}
    outside = [s for s in lines if id(s) not in inside]
    assert not [s for s in outside if opcode(s).startswith(("st.global", "atom", "red"))]
    code = [opcode(s) for s in lines]
    claims = [i for i, op in enumerate(code) if op == "atom.relaxed.gpu.global.add.u64"]
    barriers = [i for i, op in enumerate(code) if op == "bar.sync"]
    assert len(barriers) == len(claims) and all(b < c for b, c in zip(barriers, claims, strict=True))


def test_push_uses_the_cuda_headers_instructions() -> None:
    """NVRTC compiles tpd::put; its kinds of ordering instruction (semantics, scopes, widths) are the Triton
    put's (as kinds: the compiler may duplicate the credit loop's body)."""
    from tests.support.nvrtc import nvrtc_or_skip

    nvrtc = nvrtc_or_skip()
    from gpuclient.compiler import nvrtc_options

    source = ('#include <transportd/client.cuh>\n'
              'extern "C" __global__ void one_put(tpd::Channel ch) { tpd::put(ch, 1, 2, 3, 4, 5, 6); }\n')
    err, prog = nvrtc.nvrtcCreateProgram(source.encode(), b"one_put.cu", 0, [], [])
    opts = [o.encode() for o in nvrtc_options("compute_90")]
    (err,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
    assert err == nvrtc.nvrtcResult.NVRTC_SUCCESS
    _, size = nvrtc.nvrtcGetPTXSize(prog)
    buf = b" " * size
    nvrtc.nvrtcGetPTX(prog, buf)
    nvrtc.nvrtcDestroyProgram(prog)
    cuda = set(op for op in map(opcode, ptx_lines(buf.decode(errors="replace").rstrip("\x00 ")))
                   if ORDERING.match(op))
    ours = set(op for op in map(opcode, ptx_lines(compile_kernel(k_put_once, {"ch": "*u64"}).asm["ptx"]))
                   if ORDERING.match(op) and op != "bar.sync")
    assert ours == cuda


def test_waits_are_acquire_sys_signed_and_followed_by_a_barrier() -> None:
    lines = ptx_lines(compile_kernel(k_wait, SIGS["wait"]).asm["ptx"])
    (block,) = guarded_blocks(lines)
    assert "setp.ge.s64 %tpd_p, %tpd_c, 0;" in block  # (int64)(value - at_least) >= 0: wraparound-safe
    assert [opcode(s) for s in block if opcode(s).startswith(("ld.", "st.", "atom", "red"))] == [
        "ld.acquire.sys.global.u64"]
    after = [opcode(s) for s in lines[lines.index(block[-1]) + 1:]]
    assert "bar.sync" in after and after.index("bar.sync") < after.index("ld.acquire.sys.global.u64")
    status = [opcode(s) for s in ptx_lines(compile_kernel(k_status, SIGS["status"]).asm["ptx"])]
    assert "ld.acquire.sys.global.u32" in status


def test_tile_done_counts_with_one_acq_rel_atomic_from_thread0() -> None:
    """tpd::tile_arrive's one atom.acq_rel.gpu, after the barrier, issued by thread 0 (the pushing thread)."""
    lines = ptx_lines(compile_kernel(k_tile_done, SIGS["tile_done"]).asm["ptx"])
    code = [opcode(s) for s in lines]
    counts = [i for i, op in enumerate(code) if op.startswith("atom") and ".u32" in op]
    assert len(counts) == 1 and code[counts[0]] == "atom.global.gpu.acq_rel.add.u32"
    assert code.index("bar.sync") < counts[0]
    assert "fence.sc.gpu" not in code
    guard = re.match(r"^@(%p\d+) ", lines[counts[0]]).group(1)  # Triton's scalar atomic: one thread's
    setp = next(s for s in reversed(lines[:counts[0]]) if s.startswith(f"setp.eq.b32 \t{guard},")
                or s.startswith(f"setp.eq.b32 {guard},"))
    assert setp.rstrip(";").endswith(", 0")  # ... thread 0's (the interpreter runs it: only thread 0 counts)


# --- running the PTX -----------------------------------------------------------------------------------------
def test_pushes_become_the_records_cmd_ring_decodes_and_only_thread0_writes(chan) -> None:
    c = chan()
    k = sim("pushes")
    c.run(k, [c.ptr], on_sleep=no_sleep)
    assert c.commands() == [(i + 1, cmd) for i, cmd in enumerate(PUSHES)]
    assert int(c.words[0]) == len(PUSHES)  # one claim per push, not one per thread
    assert writers(k) == {0}


def test_a_full_ring_waits_for_credit_and_records_lap(chan) -> None:
    c = chan(capacity=8, credit=0)  # stale cache: the first pushes read the consumer position
    k = sim("put_loop")
    c.run(k, [c.ptr, 40], on_sleep=c.drain)
    got = c.commands()
    assert [seq for seq, _ in got] == list(range(1, 41))
    assert [cmd.dst_off for _, cmd in got] == [4096 * i for i in range(40)]
    assert [cmd.signal_value for _, cmd in got] == list(range(1, 41))
    assert int(c.words[1]) >= 32  # the credit cache was raised (red.max) from the consumer position
    assert writers(k) == {0}


def test_seq_wraps_past_2_to_the_32_as_the_consumer_expects(chan) -> None:
    start = 0xFFFF_FFFF - 3
    c = chan(capacity=8, head=start)
    c.run(sim("put_loop"), [c.ptr, 6], on_sleep=no_sleep)
    assert [seq for seq, _ in c.commands()] == [0xFFFF_FFFD, 0xFFFF_FFFE, 0xFFFF_FFFF, 1, 2, 3]


def test_quiet_pushes_quiet_and_waits_for_the_completion_position(chan) -> None:
    c = chan()
    out = np.zeros(1, np.uint32)
    with pytest.raises(Stuck):  # nobody completes: quiet keeps waiting
        c.run(sim("quiet"), [c.ptr, out.ctypes.data], out, max_steps=20_000)
    assert out[0] == 0

    c = chan()

    def proxy(_: int) -> None:
        c.drain()
        c.ring.publish_completion(c.consumer.position)

    c.run(sim("quiet"), [c.ptr, out.ctypes.data], out, on_sleep=proxy)
    assert out[0] == 1
    assert [cmd.opcode for _, cmd in c.commands()] == [Opcode.PUT, Opcode.QUIET]


def test_status_reads_the_error_word(chan) -> None:
    c = chan()
    out = np.zeros(1, np.uint32)
    c.run(sim("status"), [c.ptr, out.ctypes.data], out)
    assert out[0] == 0
    c.ring.report_error(6, 17)
    c.run(sim("status"), [c.ptr, out.ctypes.data], out)
    assert out[0] == 6


@pytest.mark.parametrize(("start", "at_least", "final"), [(9, 5, 9), ((1 << 64) - 2, 3, 4), (2, 3, 3)],
                         ids=["reached", "wraps", "arrives"])
def test_wait_spins_until_the_flag_reaches_at_least(chan, start: int, at_least: int, final: int) -> None:
    c = chan()
    c.flags[4] = start
    out = np.zeros(1, np.uint64)
    sleeps = []

    def arrive(tid: int) -> None:
        assert tid == 0, "only thread 0 spins"
        sleeps.append(tid)
        c.flags[4] = final

    k = sim("wait")
    c.run(k, [c.ptr, 4, at_least, out.ctypes.data], out, on_sleep=arrive)
    assert int(out[0]) == final
    assert bool(sleeps) == (start != final)
    assert writers(k) == {0}


@pytest.mark.parametrize(("rank", "world"), [(0, 2), (2, 4), (3, 4), (0, 1)])
def test_signal_peers_signals_every_other_rank_at_its_own_slot(chan, rank: int, world: int) -> None:
    c = chan()
    k = sim("signal_peers")
    c.run(k, [c.ptr, rank, world, 5], on_sleep=no_sleep)
    assert [cmd for _, cmd in c.commands()] == [
        Command(Opcode.SIGNAL, peer=peer, signal_slot=5 + rank, signal_value=3) for peer in range(world)
        if peer != rank]
    assert writers(k) <= {0}


def test_wait_peers_waits_for_every_peers_flag_and_never_its_own(chan) -> None:
    c = chan()
    rank, world, slot, at_least = 1, 4, 4, 2
    out = np.zeros(1, np.uint32)
    late = [slot + 3, slot + 0, slot + 2]  # the peers' flags arrive out of peer order, one a sleep

    def arrive(tid: int) -> None:
        assert tid == 0, "only thread 0 spins"
        assert out[0] == 0, "the program went on before every peer's flag arrived"
        if late:
            c.flags[late.pop(0)] = at_least

    k = sim("wait_peers")
    c.run(k, [c.ptr, rank, world, slot, at_least, out.ctypes.data], out, on_sleep=arrive)
    assert out[0] == 1 and not late  # it needed every one of them
    assert c.flags[slot + rank] == 0  # its own slot was never waited for: it never rises
    assert writers(k) == {0}

    c.flags[slot + 2] = 0  # one peer short: the wait holds
    out[0] = 0
    with pytest.raises(Stuck):
        c.run(sim("wait_peers"), [c.ptr, rank, world, slot, at_least, out.ctypes.data], out, max_steps=20_000)
    assert out[0] == 0


def tables(plan: ChunkPlan) -> tuple[np.ndarray, ...]:
    return plan.chunks, plan.sends, plan.recvs, plan.tile_chunk, plan.recv_index


def _plan(rank: int, value: int = 1) -> ChunkPlan:
    # uneven shards, a short last tile, chunks of 3 tiles: chunk and tile edges fall anywhere
    return ChunkPlan.all_gather(rank=rank, world=3, shard_bytes=[1000, 2600, 1700], tile_bytes=128, chunk_tiles=3,
                                src_region=2, dst_region=2, slot_base=4, value=value)


def test_tile_done_ships_each_chunk_once_per_round_with_the_plans_sends(chan) -> None:
    plan = _plan(rank=1)
    counters = np.zeros(plan.chunk_count, np.uint32)
    value = plan.host_struct(1, counters=counters)
    c = chan(capacity=16)
    k = sim("tile_done")
    out = np.zeros(1, np.uint32)
    rng = np.random.default_rng(5)
    shipped = []
    for _ in range(2):  # two launches: the counters are monotonic, nothing is reset
        for tile in rng.permutation(plan.tile_count):
            arrivals = int(counters[plan.tile_chunk[tile]])
            c.run(k, [c.ptr, value.ctypes.data, int(tile), out.ctypes.data], out, value, counters, *tables(plan),
                  on_sleep=c.drain)
            chunk = int(plan.tile_chunk[tile])
            last = (arrivals + 1) % int(plan.chunks["tiles"][chunk]) == 0
            assert out[0] == last
            assert int(counters[chunk]) == arrivals + 1
            assert writers(k) == {0}  # the count and the pushes: thread 0's alone
            if last:
                shipped.append(chunk)
    assert sorted(shipped) == sorted(list(range(plan.chunk_count)) * 2)
    want = []
    for chunk in shipped:
        ch = plan.chunks[chunk]
        for s in plan.sends[int(ch["first_send"]):int(ch["first_send"]) + int(ch["send_count"])]:
            want.append(Command(Opcode.PUT_SIGNAL, peer=int(s["peer"]), dst_region=int(s["dst_region"]),
                                dst_off=int(s["dst_off"]), src_region=int(ch["src_region"]),
                                src_off=int(ch["src_off"]), length=int(ch["bytes"]), signal_slot=int(s["slot"]),
                                signal_value=int(s["value"])))
    assert [cmd for _, cmd in c.commands()] == want
    assert len(want) == 2 * plan.send_count


def _polled(kernel: Kernel, flags: np.ndarray) -> set[int]:
    base = flags.ctypes.data
    return {(e.address - base) // 8 for e in kernel.events if e.op.startswith("ld.acquire.sys") and e.tid == 0}


def test_wait_range_waits_for_exactly_the_chunks_a_range_touches(chan) -> None:
    plan = _plan(rank=0, value=3)
    value = plan.host_struct(1, counters=np.zeros(plan.chunk_count, np.uint32))
    c = chan()
    out = np.zeros(1, np.uint32)
    rng = np.random.default_rng(9)
    cases = [(1, 0, 1000), (1, 999, 2), (1, 384, 1), (2, 3600, 1700), (1, 0, 0), (0, 0, 5300), (3, 0, 100),
             (2, 5299, 1)]
    cases += [(int(rng.integers(0, 3)), int(rng.integers(0, 5300)), int(rng.integers(0, 1500))) for _ in range(30)]
    straddles = 0
    for epoch in (1, 2):
        for rank, off, nbytes in cases:
            first, end = plan.recv_span(rank, off, nbytes)
            straddles += end - first > 1
            expected = {int(plan.recvs["slot"][i]) for i in range(first, end)}
            targets = plan.targets(epoch)
            c.flags[:] = 0
            for i, slot in enumerate(plan.recvs["slot"]):
                c.flags[slot] = targets[i] if int(slot) in expected else targets[i] - 1  # the rest: not yet
            out[0] = 0
            k = sim("wait_range")
            c.run(k, [c.ptr, value.ctypes.data, epoch, rank, off, nbytes, out.ctypes.data], out, value,
                  *tables(plan), on_sleep=no_sleep)
            assert out[0] == 1
            assert _polled(k, c.flags) == expected, (rank, off, nbytes)
    assert straddles > 4


def test_wait_range_and_wait_chunk_wait_for_launch_epoch(chan) -> None:
    plan = _plan(rank=2)
    value = plan.host_struct(1, counters=np.zeros(plan.chunk_count, np.uint32))
    c = chan()
    out = np.zeros(1, np.uint32)
    i = int(plan.recv_index[1]) + 1  # rank 1's second chunk
    slot, off = int(plan.recvs["slot"][i]), int(plan.recvs["off"][i])
    c.flags[slot] = 1  # launch 1 delivered, launch 2 not yet

    sleeps: list[int] = []

    def deliver(tid: int) -> None:
        sleeps.append(tid)
        c.flags[slot] = 2

    for name, args in (("wait_range", [1, off, 1]), ("wait_chunk", [1, 1])):
        c.flags[slot] = 1
        c.run(sim(name), [c.ptr, value.ctypes.data, 1, *args, out.ctypes.data], out, value, *tables(plan),
              on_sleep=no_sleep)
        sleeps.clear()
        c.run(sim(name), [c.ptr, value.ctypes.data, 2, *args, out.ctypes.data], out, value, *tables(plan),
              on_sleep=deliver)
        assert sleeps and set(sleeps) == {0}, name


# --- the kernels that use the API ---------------------------------------------------------------------------------
def test_the_gpu_tests_allgather_kernel_compiles_for_sm90() -> None:
    from tests.gpu.triton_allgather import allgather_rowsum, quiet_status

    sig = {"ch": "*u64", "plan": "*u64", "epoch": "i32", "x": "*fp32", "gathered": "*fp32", "row_sums": "*fp32",
           "rank": "i32", "world": "i32", "rows_local": "i32", "tile_count": "i32"}
    compiled = compile_kernel(allgather_rowsum, sig, {"ROW_FLOATS": 96, "ROW_BLOCK": 128, "TILE_ROWS": 3,
                                                      "TILE_BLOCK": 4, "CONSUMER_ROWS": 16})
    assert compiled.asm["cubin"][:4] == b"\x7fELF"
    lines = ptx_lines(compiled.asm["ptx"])
    code = [opcode(s) for s in lines]
    assert not [op for op in code if ".nc" in op]  # no read-only-cache loads of what the NIC writes mid-kernel
    blocks = guarded_blocks(lines)
    pushes = [b for b in blocks if any(opcode(s) == "st.release.sys.global.u64" for s in b)]
    waits = [b for b in blocks if any(s.startswith("TPD_WAIT_") for s in b)]
    assert len(pushes) == 1 and len(waits) == 1  # tile_done's send loop and wait_range's chunk loop
    q = compile_kernel(quiet_status, {"ch": "*u64", "status": "*u32"}, num_warps=1)
    assert q.asm["cubin"][:4] == b"\x7fELF"


def test_the_push_benchmark_kernel_pushes_with_a_preset_credit(chan) -> None:
    bench = load_benchmark("triton_push")
    compiled = compile_kernel(bench.push_loop, {"ch": "*u64", "pushes": "i32", "out": "*u64"}, num_warps=1)
    c = chan(capacity=16, credit=1 << 62)  # as measure_push presets it: no consumer needed
    out = np.zeros(2, np.uint64)
    c.run(Kernel.parse(compiled.asm["ptx"]), [c.ptr, 50, out.ctypes.data], out, tids=(0, 31), ntid=32,
          on_sleep=no_sleep)
    assert int(c.words[0]) == 50 and 0 < int(out[0]) <= int(out[1])
    last = c.ring.records[49 % 16]
    assert decode(last) == (50, Command(Opcode.PUT, peer=1, dst_off=49 << 12, src_off=49 << 12, length=4096,
                                        chunk_id=49))


def test_the_docs_allgather_kernel_is_the_tested_one() -> None:
    """docs/triton.md shows the kernel the GPU test runs (compared as syntax trees, docstrings aside)."""
    import ast

    def kernels(tree: ast.AST) -> dict[str, str]:
        out = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef):
                body = node.body[1:] if isinstance(node.body[0], ast.Expr) and isinstance(
                    node.body[0].value, ast.Constant) else node.body
                out[node.name] = ast.dump(ast.Module(body=[*node.decorator_list, node.args, *body], type_ignores=[]))
        return out

    doc = (ROOT / "docs" / "triton.md").read_text()
    block = next(b for b in re.findall(r"```python\n(.*?)```", doc, re.S) if "def allgather_rowsum" in b)
    shown = kernels(ast.parse(block))
    tested = kernels(ast.parse((ROOT / "tests" / "gpu" / "triton_allgather.py").read_text()))
    assert shown == tested
