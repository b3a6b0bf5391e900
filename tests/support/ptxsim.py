"""A small PTX interpreter for CPU tests: runs a compiled kernel's threads against host memory.

It executes the integer subset that scalar device code compiles to (moves, integer arithmetic, compares,
branches, loads/stores/atomics of global, shared and param memory, barriers, fences, nanosleep, trap), one
instruction at a time in program order, so the tests can run the PTX that Triton emits for the transportd
calls against a real ring file and plan tables in host memory and read back exactly what the GPU would
have stored. Memory ordering is not modelled (every access is performed at once, in program order); the
tests that check the ordering read the instructions themselves.

Threads of one block run as coroutines switched at ``bar.sync``: each runs until its next barrier, in the
order given, so what thread 0 stores to shared memory before a barrier is what the others load after it.
Global addresses are host addresses (ctypes); unknown instructions raise, naming the line.
"""

from __future__ import annotations

import ctypes
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Event", "Kernel", "PtxError", "Stuck"]

_TYPES = {"u8": 8, "s8": 8, "b8": 8, "u16": 16, "s16": 16, "b16": 16, "u32": 32, "s32": 32, "b32": 32,
          "u64": 64, "s64": 64, "b64": 64, "pred": 1, "f32": 32, "f64": 64}


class PtxError(RuntimeError):
    """The kernel did something the interpreter cannot run (or a trap)."""


class Stuck(PtxError):
    """A thread ran past the step limit (a spin that never ends)."""


@dataclass
class Event:
    """One memory operation a thread performed: ``op`` is the instruction's opcode with its qualifiers."""

    tid: int
    op: str
    address: int
    value: Any = None


@dataclass
class _Instr:
    pred: str | None
    negate: bool
    op: str
    args: list[str]
    line: str


def _split_args(text: str) -> list[str]:
    out, depth, cur = [], 0, ""
    for ch in text:
        if ch in "[{":
            depth += 1
        elif ch in "]}":
            depth -= 1
        if ch == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
        else:
            cur += ch
    if cur.strip():
        out.append(cur.strip())
    return out


def _signed(value: int, bits: int) -> int:
    value &= (1 << bits) - 1
    return value - (1 << bits) if value >> (bits - 1) else value


@dataclass
class Kernel:
    """One ``.entry`` of a PTX module, parsed."""

    name: str
    params: list[str]
    code: list[_Instr]
    labels: dict[str, int]
    events: list[Event] = field(default_factory=list)

    @classmethod
    def parse(cls, ptx: str, name: str | None = None) -> Kernel:
        start = ptx.index(".entry" if name is None else f".entry {name}(")
        header_end = ptx.index(")", start)
        kname = ptx[start:header_end].split()[1].split("(")[0]
        params = re.findall(r"\.param\s+\.[a-z0-9]+(?:\s+\.ptr\s+\.global\s+\.align\s+\d+)?\s+(\w+)",
                            ptx[start:header_end + 1])
        body_start = ptx.index("{", header_end)
        depth, i = 0, body_start
        while True:
            if ptx[i] == "{":
                depth += 1
            elif ptx[i] == "}":
                depth -= 1
                if depth == 0:
                    break
            i += 1
        code: list[_Instr] = []
        labels: dict[str, int] = {}
        for raw in ptx[body_start + 1:i].splitlines():
            line = raw.split("//")[0].strip()
            if not line or line in ("{", "}") or line.startswith("."):
                continue
            m = re.match(r"^([\w$]+):$", line)
            if m:
                labels[m.group(1)] = len(code)
                continue
            for stmt in line.split(";"):
                stmt = stmt.strip()
                if not stmt:
                    continue
                pred, negate = None, False
                if stmt.startswith("@"):
                    guard, stmt = stmt.split(None, 1)
                    negate = guard.startswith("@!")
                    pred = guard.lstrip("@!")
                op, _, rest = stmt.partition(" ")
                code.append(_Instr(pred, negate, op, _split_args(rest.strip()), raw.strip()))
        return cls(kname, params, code, labels)

    # --- running --------------------------------------------------------------------------------------------
    def run(self, args: list[int], *, tids: tuple[int, ...] = (0, 1, 31), ntid: int = 32, ctaid: int = 0,
            nctaid: int = 1, on_sleep: Callable[[int], None] | None = None, max_steps: int = 200_000,
            memory: list[tuple[int, int]] | None = None) -> None:
        """Run one block: the threads ``tids`` of ``ntid``, with kernel arguments ``args`` (ints, pointers as
        host addresses; Triton's trailing scratch pointers may be left out). ``on_sleep(tid)`` runs at every
        nanosleep (a test's hook to let a spin make progress). Memory events go to ``self.events``."""
        self.events.clear()
        params = {name: (args[i] if i < len(args) else 0) for i, name in enumerate(self.params)}
        shared = bytearray(1 << 16)  # shared memory: addresses are offsets into it (global_smem is 0)
        threads = {tid: self._thread(tid, params, ntid, ctaid, nctaid, shared, on_sleep, max_steps, memory)
                   for tid in tids}
        live = dict(threads)
        while live:
            arrived = []
            for tid, gen in list(live.items()):
                try:
                    next(gen)
                    arrived.append(tid)
                except StopIteration:
                    del live[tid]
            if arrived and len(arrived) != len(threads) and live:
                raise PtxError(f"threads {arrived} wait at a barrier that threads "
                               f"{sorted(set(threads) - set(arrived))} left (a barrier in divergent code)")

    def _thread(self, tid: int, params: dict[str, int], ntid: int, ctaid: int, nctaid: int, shared: bytearray,
                on_sleep: Callable[[int], None] | None, max_steps: int,
                memory: list[tuple[int, int]] | None) -> Iterator[None]:
        regs: dict[str, int] = {}
        special = {"%tid.x": tid, "%tid.y": 0, "%tid.z": 0, "%ntid.x": ntid, "%ntid.y": 1, "%ntid.z": 1,
                   "%ctaid.x": ctaid, "%ctaid.y": 0, "%ctaid.z": 0, "%nctaid.x": nctaid, "%nctaid.y": 1,
                   "%nctaid.z": 1, "%laneid": tid % 32}

        def value(text: str, bits: int = 64) -> int:
            text = text.strip()
            if text in special:
                return special[text]
            if text == "%globaltimer":
                return time.monotonic_ns()
            if text.startswith("%"):
                if text not in regs:
                    raise PtxError(f"thread {tid}: register {text} read before it was written")
                return regs[text]
            if text == "global_smem":
                return 0
            if text in params:
                return params[text]
            if text.startswith("0f"):
                raise PtxError(f"floating point immediate {text} is outside the integer subset")
            return int(text, 0) & ((1 << bits) - 1) if bits else int(text, 0)

        def address(text: str) -> int:
            inner = text.strip()[1:-1].replace(" ", "")
            m = re.match(r"^([%\w.$]+)(?:\+(-?\w+))?$", inner)
            if not m:
                raise PtxError(f"address {text}")
            base = value(m.group(1))
            return base + (int(m.group(2), 0) if m.group(2) else 0)

        def dests(text: str) -> list[str]:
            text = text.strip()
            return [t.strip() for t in text[1:-1].split(",")] if text.startswith("{") else [text]

        def write(reg: str, val: int, bits: int) -> None:
            if reg != "_":
                regs[reg] = val & ((1 << bits) - 1) if bits > 1 else int(bool(val))

        def check(addr: int, nbytes: int, space: str) -> None:
            if space == "shared":
                if not 0 <= addr <= len(shared) - nbytes:
                    raise PtxError(f"thread {tid}: shared address {addr:#x} out of range")
            elif memory is not None and not any(a <= addr and addr + nbytes <= a + n for a, n in memory):
                raise PtxError(f"thread {tid}: global address {addr:#x} ({nbytes} bytes) is outside every buffer")
            elif addr < 1 << 16:
                raise PtxError(f"thread {tid}: global address {addr:#x} (a null pointer?)")

        def load(addr: int, nbytes: int, space: str = "global") -> int:
            check(addr, nbytes, space)
            if space == "shared":
                return int.from_bytes(shared[addr:addr + nbytes], "little")
            return int.from_bytes(ctypes.string_at(addr, nbytes), "little")

        def store(addr: int, val: int, nbytes: int, space: str = "global") -> None:
            check(addr, nbytes, space)
            data = (val & ((1 << (8 * nbytes)) - 1)).to_bytes(nbytes, "little")
            if space == "shared":
                shared[addr:addr + nbytes] = data
            else:
                ctypes.memmove(addr, data, nbytes)

        pc, steps = 0, 0
        code = self.code
        while pc < len(code):
            ins = code[pc]
            pc += 1
            steps += 1
            if steps > max_steps:
                raise Stuck(f"thread {tid} ran {max_steps} instructions (last: {ins.line})")
            if ins.pred is not None and bool(regs.get(ins.pred, 0)) == ins.negate:
                continue
            parts = [q.split("::")[0] for q in ins.op.split(".")]  # st.shared::cta -> shared
            base = parts[0]
            space = next((q for q in parts if q in ("param", "global", "shared", "local")), "global")
            ty = next((p for p in reversed(parts) if p in _TYPES), "b64")
            bits = _TYPES[ty]
            signed = ty.startswith("s")
            a = ins.args
            mask = (1 << bits) - 1
            if base == "mov":
                if a[0].startswith("{"):  # unpack a 64-bit value into two 32-bit halves
                    v = value(a[1])
                    lo, hi = dests(a[0])
                    write(lo, v, 32)
                    write(hi, v >> 32, 32)
                elif a[1].startswith("{"):  # pack two halves
                    lo, hi = dests(a[1])
                    write(a[0], value(lo, 32) | value(hi, 32) << 32, 64)
                else:
                    write(a[0], value(a[1], bits), bits)
            elif base in ("add", "sub", "mul", "and", "or", "xor", "shl", "shr", "min", "max", "rem", "div"):
                x, y = value(a[1], bits), value(a[2], bits)
                sx, sy = (_signed(x, bits), _signed(y, bits)) if signed else (x, y)
                if base == "add":
                    r = x + y
                elif base == "sub":
                    r = x - y
                elif base == "mul":
                    if "wide" in parts:
                        write(a[0], sx * sy, 2 * bits)
                        continue
                    r = sx * sy
                elif base == "and":
                    r = x & y
                elif base == "or":
                    r = x | y
                elif base == "xor":
                    r = x ^ y
                elif base == "shl":
                    r = x << min(y, bits)
                elif base == "shr":
                    r = (sx >> min(y, bits)) if signed else x >> min(y, bits)
                elif base == "min":
                    r = min(sx, sy)
                elif base == "max":
                    r = max(sx, sy)
                elif base == "rem":
                    r = int(sx - sy * int(sx / sy)) if signed else x % y
                else:
                    r = int(sx / sy) if signed else x // y
                if bits == 1:
                    write(a[0], r, 1)
                else:
                    write(a[0], r, bits)
            elif base == "not":
                write(a[0], ~value(a[1], bits), bits)
            elif base == "neg":
                write(a[0], -value(a[1], bits), bits)
            elif base == "mad":
                if "wide" in parts:
                    x, y = value(a[1], 32), value(a[2], 32)
                    if signed:
                        x, y = _signed(x, 32), _signed(y, 32)
                    write(a[0], x * y + value(a[3], 64), 64)
                else:
                    x, y = value(a[1], bits), value(a[2], bits)
                    if signed:
                        x, y = _signed(x, bits), _signed(y, bits)
                    write(a[0], x * y + value(a[3], bits), bits)
            elif base == "selp":
                write(a[0], value(a[1], bits) if regs.get(a[3].strip(), 0) else value(a[2], bits), bits)
            elif base == "setp":
                cmp = parts[1]
                x, y = value(a[1], bits), value(a[2], bits)
                if signed:
                    x, y = _signed(x, bits), _signed(y, bits)
                r = {"eq": x == y, "ne": x != y, "lt": x < y, "le": x <= y, "gt": x > y, "ge": x >= y,
                     "lo": x < y, "ls": x <= y, "hi": x > y, "hs": x >= y}[cmp]
                write(a[0], int(r), 1)
            elif base == "cvt":
                dst_ty, src_ty = parts[-2], parts[-1]
                v = value(a[1], _TYPES[src_ty])
                if src_ty.startswith("s"):
                    v = _signed(v, _TYPES[src_ty])
                write(a[0], v, _TYPES[dst_ty])
            elif base == "ld":
                addr = value(a[1].strip()[1:-1].strip()) if space == "param" else address(a[1])
                nbytes = max(bits // 8, 1)
                outs = dests(a[0])
                if space == "param":
                    write(outs[0], addr, bits)
                    continue
                for k, reg in enumerate(outs):
                    write(reg, load(addr + k * nbytes, nbytes, space), bits)
                if space == "global" and ("acquire" in parts or "volatile" in parts or "relaxed" in parts):
                    self.events.append(Event(tid, ins.op, addr, load(addr, nbytes)))
            elif base == "st":
                addr = address(a[0])
                nbytes = max(bits // 8, 1)
                vals = [value(v, bits) for v in dests(a[1])]
                for k, v in enumerate(vals):
                    store(addr + k * nbytes, v, nbytes, space)
                if space == "global":
                    self.events.append(Event(tid, ins.op, addr, vals))
            elif base in ("atom", "red"):
                kind = next(p for p in parts if p in ("add", "max", "min", "exch", "cas", "or", "and"))
                off = 1 if base == "atom" else 0
                addr = address(a[off])
                nbytes = bits // 8
                old = load(addr, nbytes)
                v = value(a[off + 1], bits)
                new = {"add": old + v, "max": max(old, v), "min": min(old, v), "exch": v, "or": old | v,
                       "and": old & v}.get(kind)
                if kind == "cas":
                    new = value(a[off + 2], bits) if old == v else old
                store(addr, new & mask, nbytes)
                if base == "atom":
                    write(a[0], old, bits)
                self.events.append(Event(tid, ins.op, addr, (old, new & mask)))
            elif base == "bra":
                target = a[0].strip()
                if target not in self.labels:
                    raise PtxError(f"branch to unknown label {target}")
                pc = self.labels[target]
            elif base == "bar":
                yield
            elif base == "fence" or base == "membar":
                self.events.append(Event(tid, ins.op, 0))
            elif base == "nanosleep":
                if on_sleep is not None:
                    on_sleep(tid)
            elif base == "trap":
                raise PtxError(f"thread {tid} executed trap")
            elif base == "ret":
                return
            else:
                raise PtxError(f"instruction outside the interpreter's subset: {ins.line}")
