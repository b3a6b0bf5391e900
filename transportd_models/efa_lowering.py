"""The efa lowering in Python: the model the compiled one (efa/csrc/efa_post.c) is checked against.

This is the rule set ``EfaBackend`` ran in Python before the lowering moved to C, kept only as a test
oracle (the daemon never runs it): plan rows -> write-with-immediate WRs, splits at ``max_rdma_size``,
control records built by :class:`transportd_models.arrivals.SenderGroups`. A WR here is what the C
lowering passes to ``wr_rdma_write_imm`` / ``wr_set_sge`` / ``wr_set_ud_addr``, except the send staging
address of a record (the C side picks the slot), so a record WR carries the record's 32 bytes instead.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from efa.wire import CTRL_DTYPE, CTRL_SIZE, KIND_CTRL, KIND_DATA, OP_ADD, OP_SET, encode_imm
from transportd.backends.interface import PlanOp, SignalOp
from transportd_models.arrivals import SenderGroups

__all__ = ["OracleWr", "lower"]


@dataclass(frozen=True)
class OracleWr:
    rkey: int
    raddr: int
    length: int
    imm: int  # host order
    laddr: int = 0  # a data piece's source (records: 0)
    lkey: int = 0
    record: bytes = b""  # a record's 32 bytes (pieces: empty)


def lower(groups: SenderGroups, plan: np.ndarray, *, max_rdma_size: int, peer_index: int, staging_addr: int,
          staging_rkey: int, staging_entries: int) -> tuple[list[OracleWr], list[int]]:
    """WRs for ``plan`` on one connection, and the number of WRs of each batch (token run) in order."""
    out: list[OracleWr] = []
    batches: list[int] = []
    rows = plan.tolist()
    start = 0
    for i, (op, sop, rank, length, laddr, raddr, lkey, rkey, value, slot, _chunk, token) in enumerate(rows):
        if op == PlanOp.WRITE:
            npieces = max(1, -(-length // max_rdma_size))
            imm = encode_imm(KIND_DATA, peer_index, groups.piece_group(npieces))
            for off in range(0, max(length, 1), max_rdma_size):
                out.append(OracleWr(rkey, raddr + off, min(max_rdma_size, length - off), imm, laddr + off, lkey))
        elif op in (PlanOp.SIGNAL, PlanOp.FENCE):
            rec = np.zeros(1, dtype=CTRL_DTYPE)
            if op == PlanOp.SIGNAL:
                seq = groups.signal(rec[0], OP_SET if sop == SignalOp.SET else OP_ADD, value, rank, slot)
            else:
                seq = groups.fence(rec[0])
            out.append(OracleWr(staging_rkey, staging_addr + CTRL_SIZE * (seq % staging_entries), CTRL_SIZE,
                                encode_imm(KIND_CTRL, peer_index, seq), record=rec.tobytes()))
        else:
            raise ValueError(f"plan row {i}: unknown op {op}")
        if i == len(rows) - 1 or (token != rows[i + 1][11] and token != 0):
            batches.append(len(out) - start)
            start = len(out)
    return out, batches
