"""The verbs shim's Python side: an ``ibv_qp_ex`` / ``ibv_cq_ex`` (C structs, ``transportd._core.ShimQP`` /
``ShimCQ``) for a QP and CQ of a Python verbs provider, so the compiled ib lowering posts and polls
through function pointers whatever the provider.

Per pass the shim makes one Python call each way:

- ``post``: the WRs since ``wr_start`` as :data:`SHIM_WR_DTYPE` records. On softverbs that is
  :func:`softverbs.soft.batch.post_wr_batch` (no Python per WR).
- ``poll``: completions as :data:`~transportd.backends.verbs_common.WC_DTYPE` rows: softverbs'
  :func:`~softverbs.soft.batch.poll_wc_batch`, or the rail's :class:`~transportd.backends.verbs_common.CqDrain`.

On pyverbs :func:`shim_qp` / :func:`shim_cq` return the pyverbs bridge's handles instead
(``transportd._pyverbs_bridge``: pyverbs' own structs, the provider's function pointers, no Python at
all). Where the bridge is not built, the shim stands in: :func:`replay_wr_batch` replays the records
through the QPEx ``wr_*`` methods, one binding call per WR as before the compiled core, so a node
without the bridge still works, just slower.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from softverbs.soft.batch import doorbell, poll_wc_batch, post_wr_batch
from transportd import _core
from transportd.backends.verbs_common import WC_DTYPE, Rail

__all__ = ["SHIM_WR_DTYPE", "SET_SGE", "SET_INLINE", "SET_SGE_LIST", "WR_OPCODES", "pyverbs_bridge",
           "replay_wr_batch", "shim_cq", "shim_qp"]

#: One collected WR (transportd/core/verbs_shim.c ShimWr).
SHIM_WR_DTYPE = np.dtype(
    [
        ("wr_id", "<u8"),
        ("raddr", "<u8"),
        ("add", "<u8"),
        ("swap", "<u8"),
        ("sge_addr", "<u8"),
        ("sge_length", "<u4"),
        ("sge_lkey", "<u4"),
        ("rkey", "<u4"),
        ("flags", "<u4"),
        ("imm", "<u4"),
        ("opcode", "u1"),
        ("setters", "u1"),
        ("inline_length", "<u2"),
        ("inline_data", "u1", (32,)),
    ],
    align=True,
)
SET_SGE, SET_INLINE, SET_SGE_LIST = 1, 2, 8
#: ibv_wr_opcode values the records carry, by the wr_* call that made them
WR_OPCODES = {"wr_rdma_write": 0, "wr_rdma_write_imm": 1, "wr_send": 2, "wr_send_imm": 3, "wr_rdma_read": 4,
              "wr_atomic_cmp_swp": 5, "wr_atomic_fetch_add": 6}
assert SHIM_WR_DTYPE.itemsize == _core.SHIM_WR_SIZE and WC_DTYPE.itemsize == _core.SHIM_WC_SIZE


def replay_wr_batch(v: Any, qp: Any, wrs: bytes) -> int:
    """Replay ``wrs`` through ``qp``'s pyverbs wr_* methods as one WR list; wr_complete()'s errno."""
    rows = np.frombuffer(wrs, dtype=SHIM_WR_DTYPE)
    err = v.pyverbs_error
    SGE = v.wr.SGE
    qp.wr_start()
    try:
        for r in rows:
            qp.wr_id = int(r["wr_id"])
            qp.wr_flags = int(r["flags"])
            op, rkey, raddr = int(r["opcode"]), int(r["rkey"]), int(r["raddr"])
            if op == 0:
                qp.wr_rdma_write(rkey, raddr)
            elif op == 4:
                qp.wr_rdma_read(rkey, raddr)
            elif op == 6:
                qp.wr_atomic_fetch_add(rkey, raddr, int(r["add"]))
            else:
                raise ValueError(f"the shim's pyverbs replay has no opcode {op}")
            if r["setters"] & SET_INLINE and r["inline_length"]:
                data = r["inline_data"][: int(r["inline_length"])].copy()
                qp.wr_set_inline_data(data.ctypes.data, len(data))  # copied by the provider now
            elif r["setters"] & (SET_SGE | SET_SGE_LIST):
                qp.wr_set_sge(SGE(int(r["sge_addr"]), int(r["sge_length"]), int(r["sge_lkey"])))
    except BaseException:
        qp.wr_abort()
        raise
    try:
        qp.wr_complete()
    except err.PyverbsRDMAError as exc:
        return int(getattr(exc, "error_code", 0) or 5)  # EIO when the binding gave no errno
    return 0


def pyverbs_bridge() -> Any:
    """``transportd._pyverbs_bridge``, or None where it is not built here."""
    try:
        from transportd import _pyverbs_bridge
    except ImportError:  # not built here (make pyverbs-bridge), or built against another pyverbs
        return None
    return _pyverbs_bridge


def shim_qp(v: Any, qp: Any) -> Any:
    """What the compiled lowering posts through for ``qp`` (a QPEx of provider ``v``): the bridge's handle
    of pyverbs' own ``ibv_qp_ex``, else a ``ShimQP`` whose wr_complete posts through ``qp``."""
    bridge = pyverbs_bridge() if v.name == "pyverbs" else None
    if bridge is not None:
        return bridge.QPHandle(qp)
    if v.name == "soft":
        post = functools.partial(post_wr_batch, qp)
    else:
        post = functools.partial(replay_wr_batch, v, qp)
    return _core.ShimQP(post, int(qp.qp_num))


def shim_cq(rail: Rail, fetch: int = 1024) -> Any:
    """What the compiled poller (ib's or efa's) reads ``rail``'s CQ (shared by every connection of the rail)
    through: the bridge's handle of pyverbs' ``ibv_cq_ex``, else a ``ShimCQ`` taking up to ``fetch``
    completions a Python call."""
    bridge = pyverbs_bridge() if rail.v.name == "pyverbs" and rail.drain.extended else None
    if bridge is not None:
        return bridge.CQHandle(rail.cq)
    if rail.v.name == "soft" and rail.drain.extended:
        # idle passes look at the CQ's doorbell, not into Python (the GIL stays with softverbs' threads)
        return _core.ShimCQ(functools.partial(poll_wc_batch, rail.cq), fetch, doorbell(rail.cq))
    def poll(n: int) -> np.ndarray:
        return np.ascontiguousarray(rail.drain.poll(n))  # a copy: the drain reuses its buffer
    return _core.ShimCQ(poll, fetch)
