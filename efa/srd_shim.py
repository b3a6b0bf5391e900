"""The Python side of the SRD verbs shim: an ``ibv_qp_ex`` (``transportd._core.SrdShimQP``) for an SRD QP of a
Python verbs provider, so the compiled efa lowering (``efa/csrc/efa_post.c``) posts through function pointers
whatever the provider; it polls the rail's CQ through the ib backend's ``ibv_cq_ex``
(``transportd.backends.verbs_shim.shim_cq``).

Per pass the shim makes one Python call to post:

- ``post``: the WRs since ``wr_start`` as :data:`SRD_WR_DTYPE` records. On softverbs :func:`post_soft`
  feeds them to the QP's requester directly (no Python call per WR into the verbs API); on pyverbs without the
  bridge (``make pyverbs-bridge``), :func:`replay_pyverbs` replays them through the QPEx ``wr_*`` methods
  (one binding call per WR, as before the compiled core). With the bridge there is no shim at all: the
  lowering calls pyverbs' own ``ibv_qp_ex`` and ``ibv_cq_ex``.

Address handles: the lowering passes ``wr_set_ud_addr`` the ``ah`` it was given per connection. Through the
shim that is a small integer naming an entry of an :class:`AddressTable`; with the bridge it is the
``struct ibv_ah *`` itself (``_pyverbs_bridge.ah_address``).
"""

from __future__ import annotations

import functools
import socket
from typing import Any

import numpy as np

from transportd import _core
from transportd.backends.verbs_shim import pyverbs_bridge

__all__ = ["SRD_WR_DTYPE", "SET_SGE", "SET_UD", "AddressTable", "bridged", "post_soft", "replay_pyverbs",
           "srd_shim_qp"]

#: One collected WR (efa/csrc/efa_shim.c SrdWr).
SRD_WR_DTYPE = np.dtype(
    [
        ("wr_id", "<u8"),
        ("raddr", "<u8"),
        ("sge_addr", "<u8"),
        ("ah", "<u8"),
        ("sge_length", "<u4"),
        ("sge_lkey", "<u4"),
        ("rkey", "<u4"),
        ("flags", "<u4"),
        ("imm", "<u4"),  # big-endian, as wr_rdma_write_imm takes it
        ("remote_qpn", "<u4"),
        ("remote_qkey", "<u4"),
        ("opcode", "u1"),  # ibv_wr_opcode: 1 = RDMA_WRITE_WITH_IMM
        ("setters", "u1"),
        ("pad", "<u2"),
    ]
)
SET_SGE, SET_UD = 1, 4
_WR_RDMA_WRITE_WITH_IMM = 1
assert SRD_WR_DTYPE.itemsize == _core.SRD_WR_SIZE


class AddressTable:
    """Address handles by the value the compiled lowering carries for ``wr_set_ud_addr``: a small integer
    the shim looks up, or, where the QP is pyverbs' own (``bridged``), the ``struct ibv_ah *`` itself."""

    def __init__(self, bridged: bool = False) -> None:
        self.ahs: dict[int, Any] = {}
        self._next = 1
        self._bridge = pyverbs_bridge() if bridged else None

    def add(self, ah: Any) -> int:
        if self._bridge is not None:
            handle = int(self._bridge.ah_address(ah))
        else:
            handle = self._next
            self._next += 1
        self.ahs[handle] = ah
        return handle

    def remove(self, handle: int) -> None:
        self.ahs.pop(handle, None)


def post_soft(qp: Any, table: AddressTable, wrs: bytes) -> int:
    """Post ``wrs`` on a softverbs SRD ``qp`` as one WR list; returns wr_complete()'s errno.

    The same WR list that calls to ``wr_rdma_write_imm`` / ``wr_set_sge`` / ``wr_set_ud_addr`` make, with their
    checks (every WR signaled, queue space, state), all or nothing.
    """
    from softverbs import _wire as w

    rows = np.frombuffer(wrs, dtype=SRD_WR_DTYPE)
    if len(rows) and not np.all(rows["opcode"] == _WR_RDMA_WRITE_WITH_IMM):
        return 95  # EOPNOTSUPP: the shim carries nothing else
    qp._op(w.OP_WRITE_IMM)  # raises as wr_rdma_write_imm would on a QP created without it
    core = qp._core
    ahs = table.ahs
    core.wr_start()
    try:
        for (wr_id, raddr, sge_addr, ah, sge_length, sge_lkey, rkey, flags, imm, qpn, qkey, _op, setters,
             _pad) in rows.tolist():
            core.wr_op(w.OP_WRITE_IMM, wr_id, flags, rkey, raddr, imm)
            if setters & SET_SGE:
                core.wr_set_sge(sge_addr, sge_length, sge_lkey)
            if setters & SET_UD:
                core.wr_set_ud(ahs[ah]._endpoint, qpn, qkey)
    except BaseException:
        core.wr_abort()
        raise
    return core.wr_complete()


def replay_pyverbs(v: Any, qp: Any, table: AddressTable, wrs: bytes) -> int:
    """Replay ``wrs`` through a pyverbs ``qp``'s wr_* methods as one WR list; wr_complete()'s errno."""
    rows = np.frombuffer(wrs, dtype=SRD_WR_DTYPE)
    SGE = v.wr.SGE
    ntohl = socket.ntohl
    qp.wr_start()
    try:
        for r in rows.tolist():
            wr_id, raddr, sge_addr, ah, sge_length, sge_lkey, rkey, flags, imm, qpn, qkey, _op, setters, _ = r
            qp.wr_id = wr_id
            qp.wr_flags = flags
            qp.wr_rdma_write_imm(rkey, raddr, ntohl(imm))  # the binding converts to big-endian itself
            if setters & SET_SGE:
                qp.wr_set_sge(SGE(sge_addr, sge_length, sge_lkey))
            if setters & SET_UD:
                qp.wr_set_ud_addr(table.ahs[ah], qpn, qkey)
    except BaseException:
        qp.wr_abort()
        raise
    try:
        qp.wr_complete()
    except v.pyverbs_error.PyverbsRDMAError as exc:
        return int(getattr(exc, "error_code", 0) or 5)  # EIO when the binding gave no errno
    return 0


def bridged(v: Any) -> bool:
    """Whether the compiled lowering reaches provider ``v``'s own structs (pyverbs with the bridge built)."""
    return v.name == "pyverbs" and pyverbs_bridge() is not None


def srd_shim_qp(v: Any, qp: Any, table: AddressTable) -> Any:
    """What the compiled efa lowering posts through for ``qp`` (an SRD QPEx of provider ``v``): pyverbs' own
    ``ibv_qp_ex`` through the bridge (``table`` must then be ``AddressTable(bridged=True)``), else a
    ``SrdShimQP`` whose wr_complete posts through ``qp``."""
    if bridged(v):
        return pyverbs_bridge().QPHandle(qp)
    if v.name == "soft":
        post = functools.partial(post_soft, qp, table)
    else:
        post = functools.partial(replay_pyverbs, v, qp, table)
    return _core.SrdShimQP(post, int(qp.qp_num))
