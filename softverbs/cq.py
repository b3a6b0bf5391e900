"""Completion queues (pyverbs.cq): CQ with batch poll, CQEX with start_poll/poll_next/end_poll, and WC.

Entries are produced by the device's I/O thread. A CQ holds exactly `cqe` entries; one more is an overrun
(on hardware an IBV_EVENT_CQ_ERR and lost completions), which the next poll reports as PyverbsRDMAError
(EOVERFLOW). Polling a completion is what frees its send/receive queue slots, as on mlx5 and EFA.
"""

from __future__ import annotations

import errno
import time
import weakref
from typing import Any

from ._base import SoftObject
from ._cq import CQCore
from ._dropped import SoftResource
from .pyverbs_error import PyverbsRDMAError, PyverbsUserError

__all__ = ["CQ", "CQEX", "CqInitAttrEx", "PollCqAttr", "WC"]


class WC(SoftObject):
    """A work completion (ibv_wc)."""

    __slots__ = ("wr_id", "status", "opcode", "vendor_err", "byte_len", "qp_num", "src_qp", "imm_data",
                 "wc_flags", "pkey_index", "slid", "sl", "dlid_path_bits")

    def __init__(self, wr_id: int = 0, status: int = 0, opcode: int = 0, vendor_err: int = 0, byte_len: int = 0,
                 qp_num: int = 0, src_qp: int = 0, imm_data: int = 0, wc_flags: int = 0, pkey_index: int = 0,
                 slid: int = 0, sl: int = 0, dlid_path_bits: int = 0) -> None:
        self.wr_id, self.status, self.opcode, self.vendor_err = wr_id, status, opcode, vendor_err
        self.byte_len, self.qp_num, self.src_qp, self.imm_data = byte_len, qp_num, src_qp, imm_data
        self.wc_flags, self.pkey_index, self.slid, self.sl = wc_flags, pkey_index, slid, sl
        self.dlid_path_bits = dlid_path_bits

    def __str__(self) -> str:
        return (f"WC: wr_id={self.wr_id} status={self.status} opcode={self.opcode} byte_len={self.byte_len} "
                f"qp_num={self.qp_num} src_qp={self.src_qp} imm_data={self.imm_data} wc_flags={self.wc_flags}")


def _wc(c: tuple) -> WC:
    wc = WC.__new__(WC)
    (wc.wr_id, wc.status, wc.opcode, wc.byte_len, wc.qp_num, wc.src_qp, wc.imm_data, wc.wc_flags,
     wc.slid) = c[:9]
    wc.vendor_err = wc.pkey_index = wc.sl = wc.dlid_path_bits = 0
    return wc


def _check_cqe(ctx: Any, cqe: int, comp_vector: int) -> None:
    """The kernel's checks: 1 <= cqe <= max_cqe, and comp_vector < the context's num_comp_vectors."""
    from .device import device_limits

    if cqe < 1 or cqe > device_limits(ctx._dev)["max_cqe"]:
        raise PyverbsRDMAError("Failed to create a CQ", errno.EINVAL)
    if not 0 <= comp_vector < ctx.num_comp_vectors:
        raise PyverbsRDMAError(f"Failed to create a CQ: comp_vector {comp_vector} out of range "
                               f"(num_comp_vectors {ctx.num_comp_vectors})", errno.EINVAL)


class _CQBase(SoftResource):
    __slots__ = ("_ctx", "_core", "_closed", "_children")

    def _attach(self, context: Any, cqe: int, comp_vector: int) -> None:
        _check_cqe(context, cqe, int(comp_vector))
        self._ctx = context
        self._core = CQCore(cqe)
        self._children: weakref.WeakSet[Any] = weakref.WeakSet()  # the QPs completing here
        self._closed = False
        context._children.add(self)

    def close(self) -> None:
        """Close the CQ, and first the QPs that complete on it (as pyverbs does: ibv_destroy_cq refuses a CQ
        that a QP still uses)."""
        if getattr(self, "_closed", True):
            return
        for qp in list(self._children):
            qp.close()
        self._closed = True
        self._core.closed = True

    def _check(self) -> None:
        if self._core.overrun:
            raise PyverbsRDMAError("Failed to poll CQ: completion queue overrun", errno.EOVERFLOW)


class CQ(_CQBase):
    """A completion queue of capacity `cqe`."""

    __slots__ = ()

    def __init__(self, context: Any, cqe: int, cq_context: Any = None, channel: Any = None,
                 comp_vector: int = 0) -> None:
        super().__init__()
        if channel is not None:
            raise PyverbsRDMAError("softverbs has no completion channels", errno.EOPNOTSUPP)
        self._attach(context, cqe, comp_vector)

    def poll(self, num_entries: int = 1) -> tuple[int, list[WC]]:
        """Up to `num_entries` completions as (count, [WC]); an empty poll yields the CPU briefly."""
        self._check()
        got = self._core.take(num_entries)
        if not got:
            time.sleep(0)
            return 0, []
        return len(got), [_wc(c) for c in got]

    @property
    def comp_channel(self) -> None:
        return None

    @property
    def cqe(self) -> int:
        return self._core.capacity


class CqInitAttrEx(SoftObject):
    """Attributes of an extended CQ (ibv_cq_init_attr_ex)."""

    __slots__ = ("cqe", "comp_channel", "comp_vector", "wc_flags", "comp_mask", "flags", "parent_domain")

    def __init__(self, cqe: int = 100, channel: Any = None, comp_vector: int = 0, wc_flags: int = 0,
                 comp_mask: int = 0, flags: int = 0, parent_domain: Any = None) -> None:
        super().__init__()
        self.cqe, self.comp_channel, self.comp_vector = cqe, channel, comp_vector
        self.wc_flags, self.comp_mask, self.flags, self.parent_domain = wc_flags, comp_mask, flags, parent_domain


class PollCqAttr(SoftObject):
    """ibv_poll_cq_attr (only comp_mask, which must be 0)."""

    __slots__ = ("comp_mask",)

    def __init__(self) -> None:
        super().__init__()
        self.comp_mask = 0


class CQEX(_CQBase):
    """An extended CQ: start_poll / poll_next / end_poll, with read_* accessors for the current entry."""

    __slots__ = ("_cur", "_polling")

    def __init__(self, context: Any, init_attr: CqInitAttrEx | None) -> None:
        super().__init__()
        if init_attr is None:
            init_attr = CqInitAttrEx()
        if init_attr.comp_channel is not None:
            raise PyverbsRDMAError("softverbs has no completion channels", errno.EOPNOTSUPP)
        self._attach(context, init_attr.cqe, init_attr.comp_vector)
        self._core.wc_flags = init_attr.wc_flags
        self._cur: tuple | None = None
        self._polling = False

    def start_poll(self, attr: PollCqAttr | None) -> int:
        """0 with the first completion current, or ENOENT when there is none."""
        if self._polling:
            raise PyverbsUserError("start_poll() while a poll batch is open; call end_poll() first")
        self._check()
        got = self._core.take(1)
        if not got:
            time.sleep(0)
            return errno.ENOENT
        self._cur = got[0]
        self._polling = True
        return 0

    def poll_next(self) -> int:
        if not self._polling:
            raise PyverbsUserError("poll_next() without a successful start_poll()")
        got = self._core.take(1)
        if not got:
            return errno.ENOENT
        self._cur = got[0]
        return 0

    def end_poll(self) -> None:
        if not self._polling:
            raise PyverbsUserError("end_poll() without a successful start_poll()")
        self._polling = False
        self._cur = None

    def _c(self) -> tuple:
        if self._cur is None:
            raise PyverbsUserError("no current completion")
        return self._cur

    def read_opcode(self) -> int:
        return self._c()[2]

    def read_vendor_err(self) -> int:
        return 0

    def read_byte_len(self) -> int:
        return self._c()[3]

    def read_imm_data(self) -> int:
        return self._c()[6]

    def read_qp_num(self) -> int:
        return self._c()[4]

    def read_src_qp(self) -> int:
        return self._c()[5]

    def read_wc_flags(self) -> int:
        return self._c()[7]

    def read_slid(self) -> int:
        return self._c()[8]

    def read_sl(self) -> int:
        return 0

    def read_dlid_path_bits(self) -> int:
        return 0

    @property
    def status(self) -> int:
        return self._c()[1]

    @property
    def wr_id(self) -> int:
        return self._c()[0]


