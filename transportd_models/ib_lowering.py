"""The Python lowering of ib plan rows that IbBackend ran before the compiled core: now only the oracle the
ABI shim tests compare ib/csrc/ib_post.c with. Never used by the daemon.

:class:`OracleConn` is one connection's state (WR numbers, shadow values, fence_next, after_read) and
:meth:`OracleConn.post` turns a plan into the ``ibv_wr_*`` calls it must make, as :data:`Call` tuples:
``(opcode, wr_id, wr_flags, rkey, raddr, add, sge, inline)`` with ``sge`` = (addr, length, lkey) or None
and ``inline`` the bytes or None. The rules are ib/backend.py's module doc; this is the code that had them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from transportd.backends.interface import PlanOp, SignalOp
from transportd.backends.verbs_shim import SET_INLINE, SET_SGE, SHIM_WR_DTYPE, WR_OPCODES

SEQ_BITS = 48
SEQ_MASK = (1 << SEQ_BITS) - 1
FENCE, SIGNALED = 1, 2
_WRITE, _SIGNAL, _FENCE = int(PlanOp.WRITE), int(PlanOp.SIGNAL), int(PlanOp.FENCE)
_SET = int(SignalOp.SET)
_MASK64 = (1 << 64) - 1
_W, _F, _A, _R = 0, 1, 2, 3

Call = tuple[int, int, int, int, int, int, tuple[int, int, int] | None, bytes | None]


@dataclass
class OracleConn:
    mode: str
    key: int
    base: int
    depth: int
    inline: bool
    staging_addr: int
    staging_lkey: int
    scratch_addr: int
    scratch_lkey: int
    shadow: dict[tuple[int, int], int] = field(default_factory=dict)
    fence_next: bool = False
    after_read: bool = False

    def post(self, plan: np.ndarray) -> list[Call]:
        """The calls ``plan`` must become, in order; updates the connection's state as a successful post."""
        wrs, ends = self._lower(plan)
        calls = self._calls(wrs, ends)
        self.base += len(wrs)
        return calls

    def _lower(self, plan: np.ndarray) -> tuple[list[tuple], list[tuple[int, int]]]:
        mode = self.mode
        wrs: list[tuple] = []
        fences: list[bool] = []
        ends: list[tuple[int, int]] = []
        shadow = self.shadow
        fence_next, after_read = self.fence_next, self.after_read
        rows = plan.tolist()
        for i, (op, sop, _rank, length, laddr, raddr, lkey, rkey, value, _slot, _chunk, token) in enumerate(rows):
            if op == _WRITE:
                wrs.append((_W, rkey, raddr, laddr, length, lkey, 0))
                fences.append(fence_next)
                fence_next = after_read = False
            elif op == _SIGNAL:
                if mode == "atomic" and sop != _SET:
                    wrs.append((_A, rkey, raddr, 0, 8, 0, value))
                    fences.append(fence_next)
                    fence_next = after_read = False
                else:
                    k = (raddr, rkey)
                    new = value & _MASK64 if sop == _SET else (shadow.get(k, 0) + value) & _MASK64
                    shadow[k] = new
                    if mode != "write":
                        if not after_read:
                            wrs.append((_R, rkey, raddr, 0, 0, 0, 0))
                            fences.append(fence_next)
                        fence_next = True
                    wrs.append((_F, rkey, raddr, 0, 8, 0, new))
                    fences.append(fence_next)
                    fence_next = after_read = False
            elif op == _FENCE:
                wrs.append((_R, 0, 0, 0, 0, 0, 0))
                fences.append(fence_next)
                fence_next = after_read = True
            else:
                raise ValueError(f"plan row {i}: unknown op {op}")
            if i == len(rows) - 1 or (token != rows[i + 1][11] and token != 0):
                ends.append((len(wrs) - 1, token))
        self.fence_next, self.after_read = fence_next, after_read
        return [wr + (FENCE if f else 0,) for wr, f in zip(wrs, fences, strict=True)], ends

    def _calls(self, wrs: list[tuple], ends: list[tuple[int, int]]) -> list[Call]:
        signaled = {index for index, _ in ends}
        key = self.key << SEQ_BITS
        out: list[Call] = []
        for k, (kind, rkey, raddr, laddr, length, lkey, value, flags) in enumerate(wrs):
            seq = self.base + k + 1
            wr_id = key | (seq & SEQ_MASK)
            flags |= SIGNALED if k in signaled else 0
            if kind == _W:
                out.append((WR_OPCODES["wr_rdma_write"], wr_id, flags, rkey, raddr, 0, (laddr, length, lkey), None))
            elif kind == _F:
                slot = seq % self.depth
                if self.inline:
                    out.append((WR_OPCODES["wr_rdma_write"], wr_id, flags, rkey, raddr, 0, None,
                                int(value).to_bytes(8, "little")))
                else:
                    out.append((WR_OPCODES["wr_rdma_write"], wr_id, flags, rkey, raddr, 0,
                                (self.staging_addr + 8 * slot, 8, self.staging_lkey), None))
            elif kind == _A:
                out.append((WR_OPCODES["wr_atomic_fetch_add"], wr_id, flags, rkey, raddr, value,
                            (self.scratch_addr, 8, self.scratch_lkey), None))
            else:
                out.append((WR_OPCODES["wr_rdma_read"], wr_id, flags, rkey, raddr, 0,
                            (self.scratch_addr + 8, 0, self.scratch_lkey), None))
        return out


def calls_of(records: bytes | np.ndarray) -> list[Call]:
    """The shim's collected WR records (SHIM_WR_DTYPE) as Call tuples; a WR must have exactly one setter."""
    rows = records if isinstance(records, np.ndarray) else np.frombuffer(records, dtype=SHIM_WR_DTYPE)
    out: list[Call] = []
    for r in rows:
        setters = int(r["setters"])
        assert setters in (SET_SGE, SET_INLINE), f"WR {int(r['wr_id']):#x}: setters {setters:#x}"
        sge = (int(r["sge_addr"]), int(r["sge_length"]), int(r["sge_lkey"])) if setters == SET_SGE else None
        inline = bytes(r["inline_data"][: int(r["inline_length"])]) if setters == SET_INLINE else None
        out.append((int(r["opcode"]), int(r["wr_id"]), int(r["flags"]), int(r["rkey"]), int(r["raddr"]),
                    int(r["add"]), sge, inline))
    return out
