"""The transportd device API for ``@triton.jit`` kernels: the same ring, records, flags and error words as
the CUDA header (``include/transportd/``), so a Triton kernel and a CUDA kernel can share a channel's peers.

Optional dependency (``pip install 'transportd[triton]'``); ``import gpuclient`` never imports Triton.

Device calls (each is a ``@triton.jit`` function; call it from every thread of a program, as any Triton
code runs, and it does its side effects once)::

    put(ch, peer, dst_region, dst_off, src_region, src_off, nbytes, chunk_id=0, now=False)
    put_signal(ch, peer, dst_region, dst_off, src_region, src_off, nbytes, slot, value, op=SIGNAL_ADD, now=False)
    signal(ch, peer, slot, value, op=SIGNAL_ADD, now=False)
    fence(ch, peer)
    wait(ch, slot, at_least) -> the flag value seen (>= at_least)
    signal_peers(ch, rank, world, slot, value, op=SIGNAL_ADD)
    wait_peers(ch, rank, world, slot, at_least)
    quiet(ch)
    status(ch) -> the channel's error word (0: every record so far accepted)
    tile_done(ch, plan, tile) -> True for the call that shipped the tile's chunk
    wait_chunk(ch, plan, epoch, rank, chunk)
    wait_range(ch, plan, epoch, rank, byte_off, nbytes)

How a kernel gets its handles. Triton kernels take no structs by value, so ``ch`` is a device pointer to a
device copy of the 64-byte ``tpd::Channel`` and ``plan`` one to the 96-byte ``tpd::Plan``; the calls load
the words they need at the header's offsets. The host makes each copy once (:func:`channel_pointer`,
:func:`plan_pointer`) and passes the returned object as a kernel argument (it has ``data_ptr()``, which is
all Triton asks of a pointer argument). The launch number ``epoch`` is a scalar kernel argument: Triton code
never reads the plan's own epoch word, so one plan copy serves every launch. Nothing is allocated or copied
per call or per launch.

How the calls are built: Triton's inline PTX (``tl.inline_asm_elementwise``) with the same instructions,
semantics and scopes as ``ordering.cuh`` — rather than the header compiled to LLVM bitcode and linked as an
extern library — because the protocol is a handful of instructions whose exact form matters (a PTX test can
read every one of them back), because it needs no CUDA toolkit or bitcode build in CI or at the user's, and
because Triton has no way to express "one thread of the program does this" across an extern call: a
bitcode function would run on every thread, so the guarding would have to live in Triton code anyway.

One thread, not 128. Inline assembly runs on every thread of a program, so every side effect is guarded
inside the PTX by ``%tid.x == 0`` (Triton programs are one-dimensional blocks): thread 0 claims the slot,
waits for credit, stores the record header-last and, for ``wait``/``quiet``, spins; the other threads skip
the block. Before a push, a barrier (``bar.sync``) orders every thread's earlier stores (a payload the put
reads) before thread 0's system-scope release, as ``__syncthreads()`` before a one-thread push does in
CUDA; after a wait, a barrier makes what thread 0 acquired visible to the whole program, as
``tpd::block_wait`` does. ``tile_done`` counts a tile with Triton's scalar ``tl.atomic_add`` (acq_rel, GPU
scope; Triton issues a scalar atomic from thread 0 and broadcasts the old value to every thread), so the
"last tile" decision is the same in every thread and the sends loop runs in step.

Protocol, instruction for instruction (``ring_device.cuh``; commit variant ``TPD_COMMIT_V2_SPLIT``)::

    claim    atom.relaxed.gpu.global.add.u64 pos, [head], 1
    credit   ld.acquire.gpu [credit]; if pos >= credit + capacity: loop { ld.acquire.sys [consumer_pos];
             red.release.gpu.global.max.u64 [credit]; back off with nanosleep }
    commit   st.global.v2.u64 words 2-3; st.global.v2.u64 words 4-5; st.global.u64 word 1;
             st.release.sys.global.u64 word 0 = seq | opcode << 32 | flags << 40 | peer << 48,
             seq = pos % (2^32 - 1) + 1
    wait     ld.acquire.sys [flag] until (int64)(value - at_least) >= 0
    quiet    push QUIET at pos, then ld.acquire.sys [control + 192] until > pos
    status   ld.acquire.sys.u32 [control + 256]
    tile     old = atom.acq_rel.gpu add 1 on counters[chunk]; last = (old + 1) % tiles == 0;
             last: one PUT_SIGNAL (ADD value) per send of the chunk

Every spin backs off (64 tight polls, then ``nanosleep`` doubling from 32 ns to 1 us) and is bounded: one
that outlasts ``SPIN_TIMEOUT_NS`` (20 s; the ``TPD_TRITON_SPIN_TIMEOUT_NS`` environment variable at import,
0 for no bound) executes ``trap``, so a lost flag or a dead proxy fails the launch instead of hanging it.

Kernels that wait for each other in one CUDA context (two ranks sharing a GPU in one process, a compute
kernel waiting for a communication kernel) must all be compiled and loaded before the first of them is
launched: :func:`preload`. Triton compiles and loads a kernel's module at its first launch, and that load
waits for the kernels already running in the context, so a late first launch hangs behind a kernel that is
waiting for it (until the spin bound traps).

Caveats: Triton's software pipeliner may issue a loop's loads for later iterations early, so keep a
``wait_range``/``wait`` out of a pipelined loop whose loads read what it waits for (``num_stages=1`` for such
a loop, or wait before the loop), as the all-gather kernel in ``tests/gpu/triton_allgather.py`` does; and the
barrier before a push orders ordinary stores, not asynchronous tensor-descriptor (TMA) stores. docs/triton.md
has the whole story and a complete kernel.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import triton
import triton.language as tl

from cmd_ring.record import Flag, Opcode
from cmd_ring.ring import OFF_COMPLETION_POS, OFF_CONSUMER_POS, OFF_ERROR_CODE
from gpuclient.device_channel import CHANNEL_ABI, CHANNEL_DTYPE, CHANNEL_SIZE, RING_DTYPE
from gpuclient.plan import (
    PLAN_ABI,
    PLAN_CHUNK_DTYPE,
    PLAN_DTYPE,
    PLAN_RECV_DTYPE,
    PLAN_SEND_DTYPE,
    PLAN_SIZE,
    ChunkPlan,
    DevicePlan,
)

if TYPE_CHECKING:
    from gpuclient.cuda_memory import DeviceMemory

__all__ = [
    "PLAN_ABI",
    "PLAN_SIZE",
    "SIGNAL_ADD",
    "SIGNAL_SET",
    "SPIN_TIMEOUT_NS",
    "DevicePointer",
    "channel_pointer",
    "device_pointer",
    "fence",
    "globaltimer",
    "header_word",
    "body_words",
    "plan_pointer",
    "preload",
    "put",
    "put_signal",
    "quiet",
    "record_words",
    "seq_for",
    "signal",
    "signal_peers",
    "status",
    "tile_done",
    "wait",
    "wait_chunk",
    "wait_peers",
    "wait_range",
]

_PLAN_OFF_EPOCH = PLAN_DTYPE.fields["epoch"][1]
_PLAN_OFF_ABI = PLAN_DTYPE.fields["abi"][1]

#: Signal kinds (the record's flags byte): ADD the value to the peer's flag, or store it.
SIGNAL_ADD = tl.constexpr(0)
SIGNAL_SET = tl.constexpr(int(Flag.SIGNAL_SET))
#: ``now=True`` on a put, put_signal or signal: the proxy posts it at once, closing its connection's batch
#: (the CUDA header's ``tpd::Post::Now``), instead of waiting up to ``proxy.poll_window_us`` for the batch to fill
_NO_BATCH = tl.constexpr(int(Flag.NO_BATCH))

#: The bound of every device spin, in ns of %globaltimer (0: unbounded); past it the spinning thread traps.
SPIN_TIMEOUT_NS = int(os.environ.get("TPD_TRITON_SPIN_TIMEOUT_NS", 20_000_000_000))

_OP_PUT = tl.constexpr(int(Opcode.PUT))
_OP_PUT_SIGNAL = tl.constexpr(int(Opcode.PUT_SIGNAL))
_OP_SIGNAL = tl.constexpr(int(Opcode.SIGNAL))
_OP_FENCE = tl.constexpr(int(Opcode.FENCE))
_OP_QUIET = tl.constexpr(int(Opcode.QUIET))
_OFF_CONSUMER = tl.constexpr(OFF_CONSUMER_POS)
_OFF_COMPLETION = tl.constexpr(OFF_COMPLETION_POS)
_OFF_ERROR = tl.constexpr(OFF_ERROR_CODE)

#: Where the device code finds each field it reads: (struct dtype, field, 64-bit word, bit shift in the word).
#: The dtypes mirror the headers (probe-checked); tests check this table against them, and the word indices
#: below are taken from it.
LAYOUT = (
    (CHANNEL_DTYPE, "records", 0, 0), (CHANNEL_DTYPE, "control", 1, 0), (CHANNEL_DTYPE, "head", 2, 0),
    (CHANNEL_DTYPE, "credit", 3, 0), (CHANNEL_DTYPE, "capacity", 4, 0), (CHANNEL_DTYPE, "flags", 5, 0),
    (PLAN_DTYPE, "chunks", 0, 0), (PLAN_DTYPE, "sends", 1, 0), (PLAN_DTYPE, "recvs", 2, 0),
    (PLAN_DTYPE, "tile_chunk", 3, 0), (PLAN_DTYPE, "recv_index", 4, 0), (PLAN_DTYPE, "counters", 5, 0),
    (PLAN_DTYPE, "world", 9, 32),
    (PLAN_CHUNK_DTYPE, "src_off", 0, 0), (PLAN_CHUNK_DTYPE, "bytes", 1, 0), (PLAN_CHUNK_DTYPE, "tiles", 1, 32),
    (PLAN_CHUNK_DTYPE, "first_send", 2, 0), (PLAN_CHUNK_DTYPE, "send_count", 2, 32),
    (PLAN_CHUNK_DTYPE, "src_region", 2, 48),
    (PLAN_SEND_DTYPE, "dst_off", 0, 0), (PLAN_SEND_DTYPE, "slot", 1, 0), (PLAN_SEND_DTYPE, "value", 1, 32),
    (PLAN_SEND_DTYPE, "peer", 2, 0), (PLAN_SEND_DTYPE, "dst_region", 2, 16),
    (PLAN_RECV_DTYPE, "off", 0, 0), (PLAN_RECV_DTYPE, "bytes", 1, 0), (PLAN_RECV_DTYPE, "slot", 1, 32),
    (PLAN_RECV_DTYPE, "value", 2, 0),
)
_ROW_WORDS = tl.constexpr(PLAN_CHUNK_DTYPE.itemsize // 8)  # PlanChunk, PlanSend and PlanRecv: 3 words each


def _word_of(dtype: np.dtype, name: str) -> tl.constexpr:
    return tl.constexpr(next(word for d, field_name, word, _ in LAYOUT if d is dtype and field_name == name))


_CH_RECORDS, _CH_CONTROL, _CH_HEAD, _CH_CREDIT, _CH_CAPACITY, _CH_FLAGS = (
    _word_of(CHANNEL_DTYPE, n) for n in ("records", "control", "head", "credit", "capacity", "flags"))
_PL_CHUNKS, _PL_SENDS, _PL_RECVS, _PL_TILE_CHUNK, _PL_RECV_INDEX, _PL_COUNTERS, _PL_WORLD = (
    _word_of(PLAN_DTYPE, n) for n in ("chunks", "sends", "recvs", "tile_chunk", "recv_index", "counters", "world"))


# --- the record, host side (the same packing the PTX does; tests check it against cmd_ring.record) -----------
def seq_for(pos: int) -> int:
    """The seq stamp of absolute ring position ``pos``: (pos mod 2^32-1) + 1, never 0 (cmd_ring.h)."""
    return pos % 0xFFFF_FFFF + 1


def header_word(seq: int, opcode: int, flags: int, peer: int) -> int:
    """Word 0 of a record: seq | opcode << 32 | flags << 40 | peer << 48 (peer above 0xFFFF becomes 0xFFFF)."""
    return (seq & 0xFFFF_FFFF) | (opcode & 0xFF) << 32 | (flags & 0xFF) << 40 | min(peer, 0xFFFF) << 48


def body_words(src_off: int, dst_off: int, length: int, src_region: int, dst_region: int, chunk_id: int,
               signal_slot: int, signal_value: int) -> tuple[int, int, int, int, int]:
    """Words 1..5 of a record, as ``tpd::make_body`` packs them."""
    return (src_off & (1 << 64) - 1, dst_off & (1 << 64) - 1,
            (length & 0xFFFF_FFFF) | (src_region & 0xFFFF) << 32 | (dst_region & 0xFFFF) << 48,
            (chunk_id & 0xFFFF_FFFF) | (signal_slot & 0xFFFF_FFFF) << 32, signal_value & (1 << 64) - 1)


def record_words(pos: int, opcode: int, flags: int, peer: int, src_off: int = 0, dst_off: int = 0, length: int = 0,
                 src_region: int = 0, dst_region: int = 0, chunk_id: int = 0, signal_slot: int = 0,
                 signal_value: int = 0) -> np.ndarray:
    """The six little-endian words a push at ring position ``pos`` stores (``view(RECORD_DTYPE)`` reads them)."""
    body = body_words(src_off, dst_off, length, src_region, dst_region, chunk_id, signal_slot, signal_value)
    return np.array((header_word(seq_for(pos), opcode, flags, peer), *body), dtype="<u8")


# --- host handles: device copies made once ------------------------------------------------------------------
@dataclass
class DevicePointer:
    """A device address that a Triton kernel takes as a pointer argument (``*dtype``).

    Triton asks a pointer argument for ``data_ptr()`` and ``dtype`` only, so this is all a kernel needs;
    ``memory`` is the allocation it owns (the handle copies), freed by :meth:`release`.
    """

    ptr: int
    dtype: str = "uint8"
    memory: DeviceMemory | None = field(default=None, repr=False)

    def data_ptr(self) -> int:
        return self.ptr

    def release(self) -> None:
        """Free the owned copy (no kernel may still use it)."""
        if self.memory is not None:
            self.memory.free()
            self.memory = None
            self.ptr = 0


def device_pointer(buffer: Any, dtype: str = "float32") -> DevicePointer:
    """A pointer argument for GPU memory this library does not own: a ``DeviceMemory``, anything with
    ``__cuda_array_interface__`` or CUDA DLPack, or a raw device address (an int)."""
    if isinstance(buffer, int):
        return DevicePointer(buffer, dtype)
    from gpuclient.cuda_memory import resolve_device_buffer

    return DevicePointer(resolve_device_buffer(buffer).ptr, dtype)


def _handle_bytes(handle: Any, size: int, what: str) -> bytes:
    if isinstance(handle, (bytes, bytearray, memoryview)):
        data = bytes(handle)
    elif isinstance(handle, np.ndarray | np.void):
        data = handle.tobytes()
    elif hasattr(handle, "bytes"):
        data = bytes(handle.bytes)
    else:
        data = bytes(handle)
    if len(data) != size:
        raise ValueError(f"{what} is {size} bytes, got {len(data)}")
    return data


def _copy_to_device(data: bytes, device: int) -> DevicePointer:
    from gpuclient.cuda_memory import DeviceMemory

    memory = DeviceMemory(len(data), device)
    try:
        memory.write(0, data)
    except BaseException:
        memory.free()
        raise
    return DevicePointer(memory.ptr, "uint64", memory)


def channel_pointer(channel: Any, device: int | None = None) -> DevicePointer:
    """A device copy of a channel's 64-byte ``tpd::Channel``, made once: the ``ch`` argument of the calls.

    ``channel``: a ``DeviceChannel`` (``ChannelHandle.device_handle()``), a ``DeviceRing`` (``map_ring``:
    a ring without flags, enough for put/put_signal/signal/fence/quiet/status), or the handle's bytes.
    ``device`` defaults to the one the channel was mapped for. Keep the channel alive while kernels run.
    """
    if hasattr(channel, "ring") and hasattr(channel, "value") and hasattr(channel, "device"):  # DeviceChannel
        data, device = _handle_bytes(channel.value, CHANNEL_SIZE, "tpd::Channel"), channel.device
    elif hasattr(channel, "counters") and hasattr(channel, "value"):  # DeviceRing: pad to a Channel
        ring = _handle_bytes(channel.value, RING_DTYPE.itemsize, "tpd::RingDevice")
        data = ring + bytes(CHANNEL_SIZE - len(ring))
        device = channel.counters.device if device is None else device
    else:
        data = _handle_bytes(channel, CHANNEL_SIZE, "tpd::Channel")
    abi = int(np.frombuffer(data, dtype=CHANNEL_DTYPE)[0]["abi"])
    if abi != CHANNEL_ABI:
        raise ValueError(f"tpd::Channel ABI {abi}, this library speaks {CHANNEL_ABI}")
    return _copy_to_device(data, 0 if device is None else device)


def plan_pointer(plan: Any, device: int | None = None) -> DevicePointer:
    """A device copy of a plan's 96-byte ``tpd::Plan`` (its tables stay where the plan put them), made once:
    the ``plan`` argument of tile_done / wait_chunk / wait_range.

    ``plan``: a ``ChunkPlan`` (uploaded with ``to_device(device)`` if it is not yet), a ``DevicePlan``, the
    handle's bytes, or a numpy record of ``gpuclient.plan.PLAN_DTYPE``. The copy's epoch word is zeroed:
    Triton kernels take the launch number as a scalar argument instead, so one copy serves every launch.
    """
    if isinstance(plan, ChunkPlan):
        if device is None:
            raise ValueError("plan_pointer(ChunkPlan) needs the device to upload its tables to")
        plan = plan.to_device(device)
    if isinstance(plan, DevicePlan):
        device = plan.device if device is None else device
        plan = plan.value
    data = bytearray(_handle_bytes(plan, PLAN_SIZE, "tpd::Plan"))
    abi = int.from_bytes(data[_PLAN_OFF_ABI:_PLAN_OFF_ABI + 4], "little")
    if abi != PLAN_ABI:
        raise ValueError(f"tpd::Plan ABI {abi}, this library speaks {PLAN_ABI}")
    data[_PLAN_OFF_EPOCH:_PLAN_OFF_EPOCH + 8] = bytes(8)
    return _copy_to_device(bytes(data), 0 if device is None else device)


def preload(kernel: Any, *args: Any, grid: tuple[int, ...], **meta: Any) -> Any:
    """Compile ``kernel`` (a ``@triton.jit`` function) for these arguments and load it onto the current GPU
    now; returns Triton's compiled kernel. The arguments are those of a launch (the same types and values
    wherever the kernel specializes on them), ``grid`` and ``meta`` too.

    Why: Triton loads a compiled kernel's module at its first launch, and a module load waits for the
    kernels already running in the CUDA context. Kernels that wait for each other in one context (ranks
    sharing a GPU in one process, or a compute kernel beside a communication kernel) would then hang: the
    second one's first launch waits for the first kernel, which waits for the second. Preload every kernel
    of such a set before launching any of them. (Ranks in processes of their own never meet this.)
    """
    compiled = kernel.warmup(*args, grid=grid, **meta)
    compiled.run  # noqa: B018  (the property loads the module and makes the launcher, once)
    return compiled


# --- the PTX ---------------------------------------------------------------------------------------------------
# Labels carry LLVM's per-instance ${:uid}, so a call inlined or unrolled many times never repeats a label.
_UID = "${:uid}"
_DECLS = """.reg .pred %tpd_p, %tpd_q;
.reg .b32 %tpd_tid, %tpd_n, %tpd_s;
.reg .b64 %tpd_a, %tpd_c, %tpd_h, %tpd_t0, %tpd_t1;"""


def _only_thread0(out: str) -> str:
    """Zero the output in every thread, then send every thread but thread 0 to the end of the block."""
    return (f"mov.u64 {out}, 0;\nmov.u32 %tpd_tid, %tid.x;\nsetp.ne.u32 %tpd_p, %tpd_tid, 0;\n"
            f"@%tpd_p bra TPD_DONE_{_UID};")


def _spin_start() -> str:
    return "mov.u32 %tpd_n, 0;\nmov.u32 %tpd_s, 16;\nmov.u64 %tpd_t0, 0;"


def _spin_pause(loop: str) -> str:
    """ordering::Spin::pause in PTX: 64 tight polls, then nanosleep 32 ns doubling to 1 us; trap past the bound."""
    lines = ["add.u32 %tpd_n, %tpd_n, 1;", "setp.le.u32 %tpd_q, %tpd_n, 64;", f"@%tpd_q bra {loop};",
             "shl.b32 %tpd_s, %tpd_s, 1;", "min.u32 %tpd_s, %tpd_s, 1024;", "nanosleep.u32 %tpd_s;"]
    if SPIN_TIMEOUT_NS > 0:
        lines += ["mov.u64 %tpd_t1, %globaltimer;", "setp.eq.u64 %tpd_q, %tpd_t0, 0;",
                  "@%tpd_q mov.u64 %tpd_t0, %tpd_t1;", "sub.u64 %tpd_t1, %tpd_t1, %tpd_t0;",
                  f"setp.gt.u64 %tpd_q, %tpd_t1, {SPIN_TIMEOUT_NS};", "@%tpd_q trap;"]
    lines.append(f"bra {loop};")
    return "\n".join(lines)


# Push operands: $0 pos (out) | $1 head | $2 credit | $3 &consumer_pos | $4 records | $5 capacity |
# $6 opcode << 32 | flags << 40 | peer << 48 | $7..$11 body words 1..5
_PUSH_BODY = f"""atom.relaxed.gpu.global.add.u64 $0, [$1], 1;
ld.acquire.gpu.global.u64 %tpd_c, [$2];
add.u64 %tpd_c, %tpd_c, $5;
setp.lt.u64 %tpd_p, $0, %tpd_c;
@%tpd_p bra TPD_COMMIT_{_UID};
{_spin_start()}
TPD_CREDIT_{_UID}:
ld.acquire.sys.global.u64 %tpd_c, [$3];
red.release.gpu.global.max.u64 [$2], %tpd_c;
add.u64 %tpd_c, %tpd_c, $5;
setp.lt.u64 %tpd_p, $0, %tpd_c;
@%tpd_p bra TPD_COMMIT_{_UID};
{_spin_pause(f"TPD_CREDIT_{_UID}")}
TPD_COMMIT_{_UID}:
sub.u64 %tpd_a, $5, 1;
and.b64 %tpd_a, $0, %tpd_a;
mad.lo.u64 %tpd_a, %tpd_a, 48, $4;
rem.u64 %tpd_h, $0, 4294967295;
add.u64 %tpd_h, %tpd_h, 1;
or.b64 %tpd_h, %tpd_h, $6;
st.global.v2.u64 [%tpd_a+16], {{$8, $9}};
st.global.v2.u64 [%tpd_a+32], {{$10, $11}};
st.global.u64 [%tpd_a+8], $7;
st.release.sys.global.u64 [%tpd_a], %tpd_h;"""

_PUSH_ASM = tl.constexpr(f"""{{
{_DECLS}
{_only_thread0("$0")}
{_PUSH_BODY}
TPD_DONE_{_UID}:
}}""")

# Quiet: the push above (a QUIET record), then $12 = &completion_pos polled until it passes pos.
_QUIET_ASM = tl.constexpr(f"""{{
{_DECLS}
{_only_thread0("$0")}
{_PUSH_BODY}
{_spin_start()}
TPD_QUIET_{_UID}:
ld.acquire.sys.global.u64 %tpd_c, [$12];
setp.gt.u64 %tpd_p, %tpd_c, $0;
@%tpd_p bra TPD_DONE_{_UID};
{_spin_pause(f"TPD_QUIET_{_UID}")}
TPD_DONE_{_UID}:
}}""")

_PUSH_CONSTRAINTS = tl.constexpr("=l,l,l,l,l,l,l,l,l,l,l,l,~{memory}")
_QUIET_CONSTRAINTS = tl.constexpr("=l,l,l,l,l,l,l,l,l,l,l,l,l,~{memory}")

# Wait: $0 value seen (out; thread 0) | $1 &flag | $2 at_least. Thread 0 spins until value - at_least >= 0.
_WAIT_ASM = tl.constexpr(f"""{{
{_DECLS}
{_only_thread0("$0")}
{_spin_start()}
TPD_WAIT_{_UID}:
ld.acquire.sys.global.u64 $0, [$1];
sub.u64 %tpd_c, $0, $2;
setp.ge.s64 %tpd_p, %tpd_c, 0;
@%tpd_p bra TPD_DONE_{_UID};
{_spin_pause(f"TPD_WAIT_{_UID}")}
TPD_DONE_{_UID}:
}}""")

_LD_ACQUIRE_SYS_U64 = tl.constexpr("ld.acquire.sys.global.u64 $0, [$1];")
_LD_ACQUIRE_SYS_U32 = tl.constexpr("ld.acquire.sys.global.u32 $0, [$1];")


# --- device helpers -------------------------------------------------------------------------------------------
@triton.jit
def _u64(x):
    return tl.cast(x, tl.uint64)


@triton.jit
def _word(handle, index):
    """Word ``index`` (8 bytes) of a device handle, as uint64 (every thread loads it; plain, cached)."""
    return tl.load(handle.to(tl.pointer_type(tl.uint64), bitcast=True) + index)


@triton.jit
def _ptr32(address):
    return address.to(tl.pointer_type(tl.uint32))


@triton.jit
def globaltimer():
    """Nanoseconds of the GPU's %globaltimer, in every thread: one clock for every SM and every kernel on the
    device (coarse, about 1 us a tick on some parts, and not the host's clock), for timelines of a launch."""
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.uint64, is_pure=False, pack=1)


@triton.jit
def _ld_acquire_sys_u64(address):
    """ld.acquire.sys of a 64-bit word, by every thread (each thread takes its own acquire)."""
    return tl.inline_asm_elementwise(_LD_ACQUIRE_SYS_U64, "=l,l,~{memory}", [address], dtype=tl.uint64,
                                     is_pure=False, pack=1)


@triton.jit
def _ld_acquire_sys_u32(address):
    return tl.inline_asm_elementwise(_LD_ACQUIRE_SYS_U32, "=r,l,~{memory}", [address], dtype=tl.uint32,
                                     is_pure=False, pack=1)


@triton.jit
def _spin_flag(flag_address, at_least):
    """Thread 0 spins (acquire, system scope) until the flag reaches ``at_least``; returns its value there."""
    return tl.inline_asm_elementwise(_WAIT_ASM, "=l,l,l,~{memory}", [_u64(flag_address), _u64(at_least)],
                                     dtype=tl.uint64, is_pure=False, pack=1)


@triton.jit
def _header_bits(opcode, flags, peer):
    """opcode << 32 | flags << 40 | peer << 48; a peer above 0xFFFF becomes 0xFFFF, which the proxy refuses."""
    return (_u64(opcode) << 32) | ((_u64(flags) & 0xFF) << 40) | (tl.minimum(_u64(peer), 0xFFFF) << 48)


@triton.jit
def _w3(nbytes, src_region, dst_region):
    return (_u64(nbytes) & 0xFFFFFFFF) | ((_u64(src_region) & 0xFFFF) << 32) | ((_u64(dst_region) & 0xFFFF) << 48)


@triton.jit
def _w4(chunk_id, slot):
    return (_u64(chunk_id) & 0xFFFFFFFF) | ((_u64(slot) & 0xFFFFFFFF) << 32)


@triton.jit
def _push(ch, opcode, flags, peer, w1, w2, w3, w4, w5):
    """Thread 0 pushes one record on ``ch``'s ring (claim, credit, header-last commit); returns its position
    (in thread 0; 0 elsewhere). No barrier: the public calls put one in front."""
    control = _word(ch, _CH_CONTROL)
    capacity = _word(ch, _CH_CAPACITY) & 0xFFFFFFFF
    return tl.inline_asm_elementwise(
        _PUSH_ASM, _PUSH_CONSTRAINTS,
        [_word(ch, _CH_HEAD), _word(ch, _CH_CREDIT), control + _OFF_CONSUMER, _word(ch, _CH_RECORDS), capacity,
         _header_bits(opcode, flags, peer), _u64(w1), _u64(w2), _u64(w3), _u64(w4), _u64(w5)],
        dtype=tl.uint64, is_pure=False, pack=1)


# --- the channel calls ------------------------------------------------------------------------------------------
@triton.jit
def put(ch, peer, dst_region, dst_off, src_region, src_off, nbytes, chunk_id=0, now: tl.constexpr = False):
    """Write ``nbytes`` from our ``src_region`` at ``src_off`` to ``peer``'s ``dst_region`` at ``dst_off``.

    Every store the program made before the call is ordered before the record (a barrier, then thread 0's
    system-scope release), so a put may ship what the program just wrote. ``now``: the proxy posts it at once,
    with the commands before it, instead of with its connection's batch (for the last record of a burst that
    a reader waits on), as for put_signal and signal.
    """
    tl.debug_barrier()
    _push(ch, _OP_PUT, _NO_BATCH if now else 0, peer, src_off, dst_off, _w3(nbytes, src_region, dst_region),
          _w4(chunk_id, 0), 0)


@triton.jit
def put_signal(ch, peer, dst_region, dst_off, src_region, src_off, nbytes, slot, value, op: tl.constexpr = 0,
               now: tl.constexpr = False):
    """put, then update ``peer``'s flag ``slot`` (``op``: SIGNAL_ADD adds ``value``, SIGNAL_SET stores it) once
    the payload is placed there."""
    tl.debug_barrier()
    _push(ch, _OP_PUT_SIGNAL, op | _NO_BATCH if now else op, peer, src_off, dst_off,
          _w3(nbytes, src_region, dst_region), _w4(0, slot), value)


@triton.jit
def signal(ch, peer, slot, value, op: tl.constexpr = 0, now: tl.constexpr = False):
    """Update ``peer``'s flag ``slot`` after every earlier command of this channel to ``peer`` is placed."""
    tl.debug_barrier()
    _push(ch, _OP_SIGNAL, op | _NO_BATCH if now else op, peer, 0, 0, 0, _w4(0, slot), value)


@triton.jit
def fence(ch, peer):
    """Later commands of this channel to ``peer`` are delivered after earlier ones are placed."""
    tl.debug_barrier()
    _push(ch, _OP_FENCE, 0, peer, 0, 0, 0, 0, 0)


@triton.jit
def quiet(ch):
    """Wait until every command pushed on this channel before the call has completed locally (source buffers
    may be reused): thread 0 pushes a QUIET record and polls the proxy's completion position past it, then
    the program proceeds together. Refused records count as complete: read :func:`status` afterwards."""
    tl.debug_barrier()
    control = _word(ch, _CH_CONTROL)
    capacity = _word(ch, _CH_CAPACITY) & 0xFFFFFFFF
    tl.inline_asm_elementwise(
        _QUIET_ASM, _QUIET_CONSTRAINTS,
        [_word(ch, _CH_HEAD), _word(ch, _CH_CREDIT), control + _OFF_CONSUMER, _word(ch, _CH_RECORDS), capacity,
         _header_bits(_OP_QUIET, 0, 0), _u64(0), _u64(0), _u64(0), _u64(0), _u64(0), control + _OFF_COMPLETION],
        dtype=tl.uint64, is_pure=False, pack=1)
    tl.debug_barrier()


@triton.jit
def status(ch):
    """The channel's error word: the first refused record's ErrorCode, 0 while every record was accepted
    (each thread reads it with ld.acquire.sys; the word only ever changes once, from 0)."""
    return _ld_acquire_sys_u32(_word(ch, _CH_CONTROL) + _OFF_ERROR)


@triton.jit
def wait(ch, slot, at_least):
    """Wait until this rank's flag ``slot`` reaches ``at_least`` (wraparound-safe; acquire at system scope).

    Thread 0 spins, a barrier releases the program, and every thread then reads the flag once more (its own
    acquire): the value returned is >= ``at_least`` in every thread.
    """
    flag = _word(ch, _CH_FLAGS) + _u64(slot) * 8
    _spin_flag(flag, at_least)
    tl.debug_barrier()
    return _ld_acquire_sys_u64(flag)


# --- every peer at once: the all-to-all handshake of the fused kernels -------------------------------------------
#   A rank tells each peer with a flag of its own at the peer (slot + the rank) and waits for each peer's flag at
#   home (slot + the peer), so every source's signal has a slot of its own and no two ever add to one flag.


@triton.jit
def signal_peers(ch, rank, world, slot, value, op: tl.constexpr = 0):
    """:func:`signal` every peer of ``rank`` (``0 <= peer < world``, ``peer != rank``) at its flag ``slot + rank``,
    in peer order; each covers every earlier command of this channel to that peer."""
    for peer in range(0, world):
        if peer != rank:
            signal(ch, peer, slot + rank, value, op)


@triton.jit
def wait_peers(ch, rank, world, slot, at_least):
    """:func:`wait` until this rank's flag ``slot + peer`` reaches ``at_least`` for every peer of ``rank``
    (``0 <= peer < world``, ``peer != rank``), in peer order: the flags :func:`signal_peers` raises."""
    for peer in range(0, world):
        if peer != rank:
            wait(ch, slot + peer, at_least)


# --- the plan calls (plan_device.cuh: tpd::Plan and its tables) --------------------------------------------------
#   plan words: 0 chunks | 1 sends | 2 recvs | 3 tile_chunk | 4 recv_index | 5 counters | 6 epoch (unused here) |
#               7 tile_count, chunk_count | 8 send_count, recv_count | 9 rank, world | 10 abi, slot_base | 11 ...
#   PlanChunk (24 B): src_off | bytes, tiles | first_send, send_count:u16, src_region:u16
#   PlanSend  (24 B): dst_off | slot, value | peer:u16, dst_region:u16, chunk_id
#   PlanRecv  (24 B): off | bytes, slot | value, source
#   (LAYOUT above names every field read here, with its word and shift.)


@triton.jit
def _recv(plan, i, word):
    return tl.load(_word(plan, _PL_RECVS).to(tl.pointer_type(tl.uint64)) + _u64(i) * _ROW_WORDS + word)


@triton.jit
def tile_done(ch, plan, tile):
    """Count tile ``tile`` of the plan as finished; the chunk's last tile ships the chunk (one PUT_SIGNAL, ADD
    of the send's value, per destination). Call it from the whole program after the tile's stores. Correct
    under any tile order and any number of programs; returns True in the call that shipped.

    Like ``tpd::tile_arrive`` (which spells the same ordering as two GPU-scope fences around a relaxed add):
    a barrier orders every thread's tile stores before thread 0's count, one atomic add with acq_rel
    semantics at GPU scope (its release carries the tile's stores to the count, the last
    arrival's acquire orders the pushes after every other tile's stores). Triton issues a scalar atomic from
    thread 0, the thread that pushes, and hands its old value to every thread, so all agree on who is last.
    """
    tl.debug_barrier()
    chunk = tl.load(_ptr32(_word(plan, _PL_TILE_CHUNK)) + tile)
    c = _word(plan, _PL_CHUNKS).to(tl.pointer_type(tl.uint64)) + _u64(chunk) * _ROW_WORDS
    src_off = tl.load(c)
    sizes = tl.load(c + 1)
    route = tl.load(c + 2)
    tiles = (sizes >> 32).to(tl.uint32)
    old = tl.atomic_add(_ptr32(_word(plan, _PL_COUNTERS)) + chunk, 1, sem="acq_rel", scope="gpu")
    last = (old + 1) % tiles == 0
    if last:
        nbytes = sizes & 0xFFFFFFFF
        src_region = route >> 48
        first = (route & 0xFFFFFFFF).to(tl.int32)
        count = ((route >> 32) & 0xFFFF).to(tl.int32)
        sends = _word(plan, _PL_SENDS).to(tl.pointer_type(tl.uint64))
        for s in range(first, first + count):
            d = sends + _u64(s) * _ROW_WORDS
            dst_off = tl.load(d)
            slot_value = tl.load(d + 1)
            dest = tl.load(d + 2)
            _push(ch, _OP_PUT_SIGNAL, 0, dest & 0xFFFF, src_off, dst_off, _w3(nbytes, src_region, dest >> 16),
                  _w4(0, slot_value), slot_value >> 32)
    return last


@triton.jit
def _wait_recv(ch, plan, epoch, i):
    """Thread 0 waits for incoming chunk ``i`` (index into plan.recvs) to reach epoch * value."""
    slot_bytes = _recv(plan, i, 1)
    value = _recv(plan, i, 2) & 0xFFFFFFFF
    _spin_flag(_word(ch, _CH_FLAGS) + (slot_bytes >> 32) * 8, _u64(epoch) * value)


@triton.jit
def wait_chunk(ch, plan, epoch, rank, chunk):
    """The program waits for incoming chunk ``chunk`` of ``rank`` (its index among that rank's chunks, in
    offset order) of launch ``epoch`` (from 1); then the chunk's bytes are visible to every thread."""
    i = tl.load(_ptr32(_word(plan, _PL_RECV_INDEX)) + rank) + chunk
    _wait_recv(ch, plan, epoch, i)
    tl.debug_barrier()


@triton.jit
def wait_range(ch, plan, epoch, rank, byte_off, nbytes):
    """The program waits for every chunk from ``rank`` that intersects [byte_off, byte_off + nbytes) of the
    receive region in launch ``epoch`` (from 1): a range that straddles chunks waits for each of them. Then
    a barrier makes those bytes visible to every thread. The chunks are found by ``tpd::recv_span``'s binary
    search over that rank's chunks (sorted by offset, disjoint); an empty range waits for nothing."""
    world = _word(plan, _PL_WORLD) >> 32
    start = _u64(byte_off)
    end = start + _u64(nbytes)
    if (_u64(rank) < world) & (end > start):
        index = _ptr32(_word(plan, _PL_RECV_INDEX))
        lo = tl.load(index + rank)
        hi = tl.load(index + rank + 1)
        a = lo
        b = hi
        while a < b:  # the first chunk whose end lies past byte_off
            mid = a + (b - a) // 2
            past = _recv(plan, mid, 0) + (_recv(plan, mid, 1) & 0xFFFFFFFF) > start
            a = tl.where(past, a, mid + 1)
            b = tl.where(past, mid, b)
        first = a
        b = hi
        while a < b:  # the first chunk that starts at or past end
            mid = a + (b - a) // 2
            before = _recv(plan, mid, 0) < end
            a = tl.where(before, mid + 1, a)
            b = tl.where(before, b, mid)
        for i in range(first, a):
            _wait_recv(ch, plan, epoch, i)
    tl.debug_barrier()
