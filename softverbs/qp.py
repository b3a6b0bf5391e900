"""Queue pairs (pyverbs.qp): RC QPs on ib devices, with post_send/post_recv and the QPEx wr_* API.

State changes are checked like the kernel's ib_modify_qp_is_ok: each transition needs its attribute mask
(INIT: pkey, port, access flags; RTR: address, path MTU, dest QPN, RQ PSN, max_dest_rd_atomic,
min_rnr_timer; RTS: SQ PSN, timeout, retry counts, max_rd_atomic), and nothing else may be in the mask.
Posting checks follow the provider (mlx5 for ib devices, EFA for SRD QPs); see softverbs._requester.
"""

from __future__ import annotations

import errno
import sys
from typing import Any

from . import _wire as w
from . import libibverbs_enums as e
from ._base import SoftObject
from ._dropped import SoftResource
from ._ibv import ERR, INIT, QPT_RC, RESET, RTR, RTS
from ._memory import host_view
from ._qp import QPCore
from ._requester import OP_SEND_OPS_BIT
from .addr import AHAttr, resolve_endpoint
from .pyverbs_error import PyverbsRDMAError, PyverbsUserError

__all__ = ["QP", "QPAttr", "QPCap", "QPEx", "QPInitAttr", "QPInitAttrEx"]

_M = e.ibv_qp_attr_mask
STATE, CUR_STATE = int(_M.IBV_QP_STATE), int(_M.IBV_QP_CUR_STATE)
_RC_TRANSITIONS = {
    (RESET, INIT): (int(_M.IBV_QP_PKEY_INDEX | _M.IBV_QP_PORT | _M.IBV_QP_ACCESS_FLAGS), 0),
    (INIT, INIT): (0, int(_M.IBV_QP_PKEY_INDEX | _M.IBV_QP_PORT | _M.IBV_QP_ACCESS_FLAGS)),
    (INIT, RTR): (int(_M.IBV_QP_AV | _M.IBV_QP_PATH_MTU | _M.IBV_QP_DEST_QPN | _M.IBV_QP_RQ_PSN
                      | _M.IBV_QP_MAX_DEST_RD_ATOMIC | _M.IBV_QP_MIN_RNR_TIMER),
                  int(_M.IBV_QP_ALT_PATH | _M.IBV_QP_ACCESS_FLAGS | _M.IBV_QP_PKEY_INDEX)),
    (RTR, RTS): (int(_M.IBV_QP_SQ_PSN | _M.IBV_QP_TIMEOUT | _M.IBV_QP_RETRY_CNT | _M.IBV_QP_RNR_RETRY
                     | _M.IBV_QP_MAX_QP_RD_ATOMIC),
                 int(_M.IBV_QP_CUR_STATE | _M.IBV_QP_ALT_PATH | _M.IBV_QP_ACCESS_FLAGS | _M.IBV_QP_MIN_RNR_TIMER
                     | _M.IBV_QP_PATH_MIG_STATE)),
    (RTS, RTS): (0, int(_M.IBV_QP_CUR_STATE | _M.IBV_QP_ACCESS_FLAGS | _M.IBV_QP_ALT_PATH
                        | _M.IBV_QP_PATH_MIG_STATE | _M.IBV_QP_MIN_RNR_TIMER)),
}
_SRD_TRANSITIONS = {
    (RESET, INIT): (int(_M.IBV_QP_PKEY_INDEX | _M.IBV_QP_PORT | _M.IBV_QP_QKEY), 0),
    (INIT, INIT): (0, int(_M.IBV_QP_PKEY_INDEX | _M.IBV_QP_PORT | _M.IBV_QP_QKEY)),
    (INIT, RTR): (0, int(_M.IBV_QP_QKEY)),
    (RTR, RTS): (int(_M.IBV_QP_SQ_PSN), int(_M.IBV_QP_CUR_STATE | _M.IBV_QP_QKEY | _M.IBV_QP_RNR_RETRY)),
    (RTS, RTS): (0, int(_M.IBV_QP_CUR_STATE | _M.IBV_QP_QKEY | _M.IBV_QP_RNR_RETRY)),
}
_RC_SEND_OPS = int(e.IBV_QP_EX_WITH_RDMA_WRITE | e.IBV_QP_EX_WITH_RDMA_WRITE_WITH_IMM | e.IBV_QP_EX_WITH_SEND
                   | e.IBV_QP_EX_WITH_SEND_WITH_IMM | e.IBV_QP_EX_WITH_RDMA_READ
                   | e.IBV_QP_EX_WITH_ATOMIC_CMP_AND_SWP | e.IBV_QP_EX_WITH_ATOMIC_FETCH_AND_ADD)
_BSWAP = sys.byteorder == "little"


def _htobe32(v: int) -> int:
    v &= 0xFFFFFFFF
    return int.from_bytes(v.to_bytes(4, "little"), "big") if _BSWAP else v


class QPCap(SoftObject):
    """Queue sizes (ibv_qp_cap)."""

    __slots__ = ("max_send_wr", "max_recv_wr", "max_send_sge", "max_recv_sge", "max_inline_data")

    def __init__(self, max_send_wr: int = 1, max_recv_wr: int = 10, max_send_sge: int = 1, max_recv_sge: int = 1,
                 max_inline_data: int = 0) -> None:
        super().__init__()
        self.max_send_wr, self.max_recv_wr = max_send_wr, max_recv_wr
        self.max_send_sge, self.max_recv_sge, self.max_inline_data = max_send_sge, max_recv_sge, max_inline_data

    def _copy(self) -> QPCap:
        return QPCap(self.max_send_wr, self.max_recv_wr, self.max_send_sge, self.max_recv_sge,
                     self.max_inline_data)


def _cap_prop(name: str) -> property:
    def get(self: Any) -> int:
        return getattr(self._cap, name)

    def put(self: Any, val: int) -> None:
        setattr(self._cap, name, val)

    return property(get, put)


class _InitAttrBase(SoftObject):
    __slots__ = ("_cap", "qp_type", "_qp_context", "_scq", "_rcq", "srq", "sq_sig_all")

    def _init(self, qp_type: int, qp_context: Any, scq: Any, rcq: Any, srq: Any, cap: QPCap | None,
              sq_sig_all: int) -> None:
        from .cq import CQ, CQEX

        for cq in (scq, rcq):
            if cq is not None and not isinstance(cq, CQ | CQEX):
                raise PyverbsUserError(f"Expected CQ/CQEX, got {type(cq)}")
        # pyverbs copies nothing when cap is None: the C struct stays zeroed
        self._cap = cap._copy() if cap is not None else QPCap(0, 0, 0, 0, 0)
        self.qp_type, self._qp_context, self._scq, self._rcq = qp_type, qp_context, scq, rcq
        self.srq, self.sq_sig_all = srq, sq_sig_all

    @property
    def send_cq(self) -> Any:
        return self._scq

    @send_cq.setter
    def send_cq(self, val: Any) -> None:
        self._scq = val

    @property
    def recv_cq(self) -> Any:
        return self._rcq

    @recv_cq.setter
    def recv_cq(self, val: Any) -> None:
        self._rcq = val

    @property
    def cap(self) -> QPCap:
        return self._cap._copy()

    @cap.setter
    def cap(self, val: QPCap) -> None:
        self._cap = val._copy()

    max_send_wr = _cap_prop("max_send_wr")
    max_recv_wr = _cap_prop("max_recv_wr")
    max_send_sge = _cap_prop("max_send_sge")
    max_recv_sge = _cap_prop("max_recv_sge")
    max_inline_data = _cap_prop("max_inline_data")


class QPInitAttr(_InitAttrBase):
    """ibv_qp_init_attr (QP created from a PD)."""

    __slots__ = ()

    def __init__(self, qp_type: int = e.IBV_QPT_UD, qp_context: Any = None, scq: Any = None, rcq: Any = None,
                 srq: Any = None, cap: QPCap | None = None, sq_sig_all: int = 1) -> None:
        super().__init__()
        self._init(qp_type, qp_context, scq, rcq, srq, cap, sq_sig_all)


class QPInitAttrEx(_InitAttrBase):
    """ibv_qp_init_attr_ex (QP created from a Context; needs pd and comp_mask with IBV_QP_INIT_ATTR_PD)."""

    __slots__ = ("comp_mask", "pd", "xrcd", "create_flags", "max_tso_header", "source_qpn", "ind_table",
                 "_send_ops_flags", "_hash_conf")

    def __init__(self, qp_type: int = e.IBV_QPT_UD, qp_context: Any = None, scq: Any = None, rcq: Any = None,
                 srq: Any = None, cap: QPCap | None = None, sq_sig_all: int = 0, comp_mask: int = 0,
                 pd: Any = None, xrcd: Any = None, create_flags: int = 0, max_tso_header: int = 0,
                 source_qpn: int = 0, hash_conf: Any = None, ind_table: Any = None,
                 send_ops_flags: int = 0) -> None:
        super().__init__()
        self._init(qp_type, qp_context, scq, rcq, srq, cap, sq_sig_all)
        self.comp_mask, self.pd, self.xrcd, self.create_flags = comp_mask, pd, xrcd, create_flags
        self.max_tso_header, self.source_qpn, self.ind_table = max_tso_header, source_qpn, ind_table
        self._send_ops_flags, self._hash_conf = send_ops_flags, hash_conf


class QPAttr(SoftObject):
    """ibv_qp_attr: the values a modify applies (only those named in the mask)."""

    __slots__ = ("qp_state", "cur_qp_state", "path_mtu", "path_mig_state", "qkey", "rq_psn", "sq_psn",
                 "dest_qp_num", "qp_access_flags", "_cap", "_ah", "_alt_ah", "pkey_index", "alt_pkey_index",
                 "en_sqd_async_notify", "sq_draining", "max_rd_atomic", "max_dest_rd_atomic", "min_rnr_timer",
                 "port_num", "timeout", "retry_cnt", "rnr_retry", "alt_port_num", "alt_timeout", "rate_limit")

    def __init__(self, qp_state: int = e.IBV_QPS_INIT, cur_qp_state: int = e.IBV_QPS_RESET, port_num: int = 1,
                 path_mtu: int = e.IBV_MTU_1024) -> None:
        super().__init__()
        self.qp_state, self.cur_qp_state, self.port_num, self.path_mtu = qp_state, cur_qp_state, port_num, path_mtu
        self.path_mig_state = self.qkey = self.rq_psn = self.sq_psn = self.dest_qp_num = 0
        self.qp_access_flags = self.pkey_index = self.alt_pkey_index = self.en_sqd_async_notify = 0
        self.sq_draining = self.max_rd_atomic = self.max_dest_rd_atomic = self.min_rnr_timer = 0
        self.timeout = self.retry_cnt = self.rnr_retry = self.alt_port_num = self.alt_timeout = 0
        self.rate_limit = 0
        self._cap = QPCap(0, 0, 0, 0, 0)
        self._ah = AHAttr()
        self._alt_ah = AHAttr()

    @property
    def cap(self) -> QPCap:
        return self._cap._copy()

    @cap.setter
    def cap(self, val: QPCap) -> None:
        self._cap = val._copy()

    @property
    def ah_attr(self) -> AHAttr:
        return self._ah._copy()

    @ah_attr.setter
    def ah_attr(self, val: AHAttr | None) -> None:
        if val is not None:
            self._ah = val._copy()

    @property
    def alt_ah_attr(self) -> AHAttr:
        return self._alt_ah._copy()

    @alt_ah_attr.setter
    def alt_ah_attr(self, val: AHAttr | None) -> None:
        if val is not None:
            self._alt_ah = val._copy()


def modify_core(core: QPCore, attr: QPAttr, mask: int) -> int:
    """Apply a modify; returns an errno (0 on success). Checks the transition and mask first."""
    try:
        return _modify(core, attr, int(mask))
    finally:
        if core.inbox:
            core.drain_inbox()


def _modify(core: QPCore, attr: QPAttr, mask: int) -> int:
    with core.lock:
        cur = core.state
        new = int(attr.qp_state) if mask & STATE else cur
        if mask & CUR_STATE and int(attr.cur_qp_state) != cur:
            return errno.EINVAL
        if new in (RESET, ERR):
            if mask & ~(STATE | CUR_STATE):
                return errno.EINVAL
            if new == ERR:
                core.enter_error()
            else:
                _reset(core)
            return 0
        table = _SRD_TRANSITIONS if core.srd else _RC_TRANSITIONS
        rule = table.get((cur, new))
        if rule is None:
            return errno.EINVAL
        req, opt = rule
        if mask & req != req or mask & ~(req | opt | STATE):
            return errno.EINVAL
        dev = core.device
        from .device import device_limits

        lim = device_limits(dev)
        if mask & _M.IBV_QP_PORT and attr.port_num != 1:
            return errno.EINVAL
        if mask & _M.IBV_QP_PKEY_INDEX and attr.pkey_index != 0:
            return errno.EINVAL
        if mask & _M.IBV_QP_PATH_MTU and not 1 <= int(attr.path_mtu) <= 5:
            return errno.EINVAL
        if mask & _M.IBV_QP_MAX_DEST_RD_ATOMIC and attr.max_dest_rd_atomic > lim["max_rd_atom"]:
            return errno.EINVAL
        if mask & _M.IBV_QP_MAX_QP_RD_ATOMIC and attr.max_rd_atomic > lim["max_rd_atom"]:
            return errno.EINVAL
        endpoint = None
        if mask & _M.IBV_QP_AV:
            endpoint = resolve_endpoint(attr._ah, dev.advertise)
            if endpoint is None:
                return errno.EINVAL
        # all checks passed: apply
        if mask & _M.IBV_QP_PORT:
            core.port_num = attr.port_num
        if mask & _M.IBV_QP_PKEY_INDEX:
            core.pkey_index = attr.pkey_index
        if mask & _M.IBV_QP_ACCESS_FLAGS:
            core.access_flags = int(attr.qp_access_flags)
        if mask & _M.IBV_QP_QKEY:
            core.qkey = attr.qkey
        if mask & _M.IBV_QP_AV:
            core.remote = endpoint
            core.ah_attr = attr._ah._copy()
        if mask & _M.IBV_QP_PATH_MTU:
            core.path_mtu = int(attr.path_mtu)
        if mask & _M.IBV_QP_DEST_QPN:
            core.dest_qpn = attr.dest_qp_num
        if mask & _M.IBV_QP_RQ_PSN:
            core.rq_psn = core.exp_psn = attr.rq_psn & 0xFFFFFF
        if mask & _M.IBV_QP_SQ_PSN:
            core.sq_psn = core.tx_psn = attr.sq_psn & 0xFFFFFF
        if mask & _M.IBV_QP_MAX_DEST_RD_ATOMIC:
            core.max_dest_rd_atomic = attr.max_dest_rd_atomic
        if mask & _M.IBV_QP_MAX_QP_RD_ATOMIC:
            core.max_rd_atomic = attr.max_rd_atomic
        if mask & _M.IBV_QP_MIN_RNR_TIMER:
            core.min_rnr_timer = attr.min_rnr_timer
        if mask & _M.IBV_QP_TIMEOUT:
            core.timeout = attr.timeout
        if mask & _M.IBV_QP_RETRY_CNT:
            core.retry_cnt = attr.retry_cnt
        if mask & _M.IBV_QP_RNR_RETRY:
            core.rnr_retry = attr.rnr_retry
        core.state = new
        if new == RTS:
            core._pump_tx()
        return 0


def _reset(core: QPCore) -> None:
    core.state = RESET
    core.order.clear()
    core.txq.clear()
    core.inflight.clear()
    core.rq.clear()
    core.backlog.clear()
    core.pool.clear()
    core.pool_bytes = 0
    core.pend.clear()
    core.rnr_wait.clear()
    core.stalled = core.tx_halted = False
    core.rd_out = core.unsig = 0
    core.sq_retired = core.sq_posted - core.sq_polled  # every slot free again
    core.rq_retired = core.rq_posted - core.rq_polled


class QP(SoftResource):
    """A queue pair. Created from a PD (QPInitAttr) or a Context (QPInitAttrEx)."""

    __slots__ = ("_core", "_pd", "_ctx", "_scq", "_rcq", "_closed", "_ex")

    def __init__(self, creator: Any, init_attr: Any, qp_attr: QPAttr | None = None) -> None:
        super().__init__()
        self._closed = True
        self._ex = False
        self._create(creator, init_attr, None)
        if qp_attr is not None:
            if self.qp_type in (e.IBV_QPT_RC, e.IBV_QPT_UC, e.IBV_QPT_XRC_RECV, e.IBV_QPT_XRC_SEND):
                self.to_init(qp_attr)
            else:
                self.to_rts(qp_attr)

    def _create(self, creator: Any, init_attr: Any, efa: Any) -> None:
        """Validate the create request the way the provider does, then build the QP."""
        from .device import Context, device_limits
        from .pd import PD

        if isinstance(creator, Context):
            if not isinstance(init_attr, QPInitAttrEx):
                raise PyverbsUserError("a QP created from a Context needs a QPInitAttrEx")
            pd = init_attr.pd
            ctx = creator
            comp_mask = int(init_attr.comp_mask)
            if not comp_mask & e.IBV_QP_INIT_ATTR_PD or pd is None:
                raise PyverbsRDMAError("Failed to create QP", errno.EINVAL)
            send_ops = int(init_attr._send_ops_flags) if comp_mask & e.IBV_QP_INIT_ATTR_SEND_OPS_FLAGS else None
            # EFA takes PD and SEND_OPS_FLAGS only; mlx5 also takes CREATE_FLAGS, of which softverbs models
            # none (a zero create_flags is accepted, as there). XRCD, TSO and RSS are outside its subset.
            supported = int(e.IBV_QP_INIT_ATTR_PD | e.IBV_QP_INIT_ATTR_SEND_OPS_FLAGS)
            if efa is None:
                supported |= int(e.IBV_QP_INIT_ATTR_CREATE_FLAGS)
            if comp_mask & ~supported:
                raise PyverbsRDMAError("Failed to create QP", errno.EOPNOTSUPP)
            if comp_mask & e.IBV_QP_INIT_ATTR_CREATE_FLAGS and int(init_attr.create_flags):
                raise PyverbsRDMAError(f"Failed to create QP: create_flags {int(init_attr.create_flags):#x} are "
                                       "not supported by softverbs", errno.EOPNOTSUPP)
        elif isinstance(creator, PD):
            pd, ctx, send_ops = creator, creator._ctx, None
        else:
            raise PyverbsUserError(f"Cannot create a QP from {type(creator)}")
        if pd._closed or pd._gone:  # an imported PD whose exporter closed it (or its context)
            raise PyverbsRDMAError("Failed to create QP: its PD is gone", errno.EINVAL)
        dev = pd._dev
        qp_type = int(init_attr.qp_type)
        if efa is None:
            if dev.is_efa:
                raise PyverbsRDMAError("Failed to create QP", errno.EOPNOTSUPP)  # EFA: UD/SRD only
            if qp_type != QPT_RC:
                raise PyverbsRDMAError("Failed to create QP: softverbs supports RC QPs on ib devices",
                                       errno.EOPNOTSUPP)
            if send_ops is not None and send_ops & ~_RC_SEND_OPS:
                raise PyverbsRDMAError("Failed to create QP", errno.EOPNOTSUPP)
        scq, rcq = init_attr.send_cq, init_attr.recv_cq
        if scq is None or rcq is None:
            raise PyverbsRDMAError("Failed to create QP", errno.EINVAL)
        if init_attr.srq is not None:
            raise PyverbsRDMAError("Failed to create QP", errno.EINVAL if efa is not None else errno.EOPNOTSUPP)
        lim = device_limits(dev)
        c = init_attr._cap
        if (c.max_send_wr > lim["max_qp_wr"] or c.max_recv_wr > lim["max_rq_wr"] or c.max_send_sge > lim["max_sge"]
                or c.max_recv_sge > lim["max_rq_sge"] or c.max_inline_data > lim["max_inline"]):
            raise PyverbsRDMAError("Failed to create QP", errno.EINVAL)
        cap = {"max_send_wr": c.max_send_wr, "max_recv_wr": c.max_recv_wr, "max_send_sge": c.max_send_sge,
               "max_recv_sge": c.max_recv_sge, "max_inline_data": c.max_inline_data}
        unsolicited = bool(efa is not None and efa.flags & 1)
        core = QPCore(dev, pd._ident, qp_type, scq._core, rcq._core, cap, bool(init_attr.sq_sig_all), send_ops,
                      unsolicited)
        with dev.lock:
            dev.qps[core.qpn] = core
        self._core = core
        self._pd, self._ctx, self._scq, self._rcq = pd, ctx, scq, rcq
        self._closed = False
        pd._children.add(self)
        ctx._children.add(self)
        scq._children.add(self)
        rcq._children.add(self)

    def close(self) -> None:
        if getattr(self, "_closed", True):
            return
        self._closed = True
        core = self._core
        with core.lock:
            core.closed = True
            _reset(core)
        dev = core.device
        with dev.lock:
            dev.qps.pop(core.qpn, None)

    def _get_comp_mask(self, dst: str) -> int:
        masks = {
            e.IBV_QPT_RC: {"INIT": e.IBV_QP_PKEY_INDEX | e.IBV_QP_PORT | e.IBV_QP_ACCESS_FLAGS,
                           "RTR": e.IBV_QP_AV | e.IBV_QP_PATH_MTU | e.IBV_QP_DEST_QPN | e.IBV_QP_RQ_PSN
                           | e.IBV_QP_MAX_DEST_RD_ATOMIC | e.IBV_QP_MIN_RNR_TIMER,
                           "RTS": e.IBV_QP_TIMEOUT | e.IBV_QP_RETRY_CNT | e.IBV_QP_RNR_RETRY | e.IBV_QP_SQ_PSN
                           | e.IBV_QP_MAX_QP_RD_ATOMIC},
            e.IBV_QPT_UC: {"INIT": e.IBV_QP_PKEY_INDEX | e.IBV_QP_PORT | e.IBV_QP_ACCESS_FLAGS,
                           "RTR": e.IBV_QP_AV | e.IBV_QP_PATH_MTU | e.IBV_QP_DEST_QPN | e.IBV_QP_RQ_PSN,
                           "RTS": e.IBV_QP_SQ_PSN},
            e.IBV_QPT_UD: {"INIT": e.IBV_QP_PKEY_INDEX | e.IBV_QP_PORT | e.IBV_QP_QKEY, "RTR": 0,
                           "RTS": e.IBV_QP_SQ_PSN},
        }
        # Like pyverbs, there is no entry for IBV_QPT_DRIVER: SRDQP (not SRDQPEx) cannot use to_rts().
        return int(masks[self._core.qp_type][dst] | e.IBV_QP_STATE)

    def to_init(self, qp_attr: QPAttr) -> None:
        mask = self._get_comp_mask("INIT")
        qp_attr.qp_state = e.IBV_QPS_INIT
        rc = modify_core(self._core, qp_attr, mask)
        if rc:
            raise PyverbsRDMAError("Failed to modify QP state to init", rc)

    def to_rtr(self, qp_attr: QPAttr) -> None:
        if self.qp_state != e.IBV_QPS_INIT:
            self.to_init(qp_attr)
        mask = self._get_comp_mask("RTR")
        qp_attr.qp_state = e.IBV_QPS_RTR
        rc = modify_core(self._core, qp_attr, mask)
        if rc:
            raise PyverbsRDMAError("Failed to modify QP state to RTR", rc)

    def to_rts(self, qp_attr: QPAttr) -> None:
        if self.qp_state != e.IBV_QPS_RTR:
            self.to_rtr(qp_attr)
        mask = self._get_comp_mask("RTS")
        qp_attr.qp_state = e.IBV_QPS_RTS
        rc = modify_core(self._core, qp_attr, mask)
        if rc:
            raise PyverbsRDMAError("Failed to modify QP state to RTS", rc)

    def modify(self, qp_attr: QPAttr, comp_mask: int) -> None:
        rc = modify_core(self._core, qp_attr, comp_mask)
        if rc:
            raise PyverbsRDMAError("Failed to modify QP", rc)

    def query(self, attr_mask: int) -> tuple[QPAttr, QPInitAttr]:
        core = self._core
        attr = QPAttr(qp_state=core.state, cur_qp_state=core.state, port_num=core.port_num,
                      path_mtu=core.path_mtu)
        attr.qkey, attr.rq_psn, attr.sq_psn, attr.dest_qp_num = core.qkey, core.rq_psn, core.sq_psn, core.dest_qpn
        attr.qp_access_flags, attr.pkey_index = core.access_flags, core.pkey_index
        attr.max_rd_atomic, attr.max_dest_rd_atomic = core.max_rd_atomic, core.max_dest_rd_atomic
        attr.min_rnr_timer, attr.timeout = core.min_rnr_timer, core.timeout
        attr.retry_cnt, attr.rnr_retry = core.retry_cnt, core.rnr_retry
        cap = QPCap(core.max_send_wr, core.max_recv_wr, core.max_send_sge, core.max_recv_sge, core.max_inline)
        attr.cap = cap
        if core.ah_attr is not None:
            attr.ah_attr = core.ah_attr
        init = QPInitAttr(qp_type=core.qp_type, scq=self._scq, rcq=self._rcq, cap=cap,
                          sq_sig_all=int(core.sq_sig_all))
        return attr, init

    def post_recv(self, wr: Any, bad_wr: Any = None) -> None:
        wrs, node = [], wr
        while node is not None:
            wrs.append(node._extract())
            node = node._next
        err, bad = self._core.post_recv(wrs)
        if err:
            if bad_wr is not None:
                src = _nth(wr, bad)
                bad_wr.wr_id, bad_wr.num_sge, bad_wr._sg = src.wr_id, src.num_sge, list(src._sg)
            raise PyverbsRDMAError("Failed to post recv", err)

    def post_send(self, wr: Any, bad_wr: Any = None) -> None:
        wrs, node = [], wr
        while node is not None:
            wrs.append(node._extract())
            node = node._next
        err, bad = self._core.post_legacy(wrs)
        if err:
            if bad_wr is not None:
                src = _nth(wr, bad)
                for name in ("wr_id", "num_sge", "imm_data", "opcode", "send_flags"):
                    setattr(bad_wr, name, getattr(src, name))
                bad_wr._sg = list(src._sg)
            raise PyverbsRDMAError("Failed to post send", err)

    @property
    def qp_type(self) -> int:
        return self._core.qp_type

    @property
    def qp_state(self) -> int:
        return self._core.state

    @property
    def qp_num(self) -> int:
        return self._core.qpn

    def __str__(self) -> str:
        return f"QP type: {self.qp_type}\n  number: {self.qp_num}\n  state: {self.qp_state}\n"


def _nth(wr: Any, n: int) -> Any:
    for _ in range(n):
        wr = wr._next
    return wr


class QPEx(QP):
    """A QP with the extended post API: wr_start(), wr_* per WR, wr_complete() posts them all or none."""

    __slots__ = ("_wr_id", "_wr_flags", "_comp_mask")

    def __init__(self, creator: Any, init_attr: Any, qp_attr: QPAttr | None = None) -> None:
        self._wr_id = 0
        self._wr_flags = 0
        self._comp_mask = 0
        super().__init__(creator, init_attr, qp_attr)
        self._ex = bool(int(getattr(init_attr, "comp_mask", 0)) & e.IBV_QP_INIT_ATTR_SEND_OPS_FLAGS)

    @property
    def ind_table(self) -> None:
        """The RSS indirection table the QP receives through: always None (softverbs has no RSS QPs)."""
        return None

    @property
    def comp_mask(self) -> int:
        return self._comp_mask

    @comp_mask.setter
    def comp_mask(self, val: int) -> None:
        self._comp_mask = val

    @property
    def wr_id(self) -> int:
        return self._wr_id

    @wr_id.setter
    def wr_id(self, val: int) -> None:
        self._wr_id = val

    @property
    def wr_flags(self) -> int:
        return self._wr_flags

    @wr_flags.setter
    def wr_flags(self, val: int) -> None:
        self._wr_flags = val

    def _op(self, op: int) -> None:
        """Refuse an operation this QP was not created for (the C call would hit a NULL pointer)."""
        if not self._ex:
            raise PyverbsUserError("qp_ex is not accessible: QP created without IBV_QP_INIT_ATTR_SEND_OPS_FLAGS")
        if not (self._core.send_ops or 0) & OP_SEND_OPS_BIT[op]:
            raise PyverbsRDMAError("QP was not created with this operation in send_ops_flags", errno.EOPNOTSUPP)

    def wr_rdma_write(self, rkey: int, remote_addr: int) -> None:
        if not self._ex or not self._core.send_ops & 1:
            self._op(w.OP_WRITE)
        self._core.wr_op(w.OP_WRITE, self._wr_id, self._wr_flags, rkey, remote_addr)

    def wr_rdma_write_imm(self, rkey: int, remote_addr: int, data: int) -> None:
        # pyverbs converts the immediate with htobe32(); the peer's WC.imm_data shows the converted value
        self._op(w.OP_WRITE_IMM)
        self._core.wr_op(w.OP_WRITE_IMM, self._wr_id, self._wr_flags, rkey, remote_addr, _htobe32(data))

    def wr_send(self) -> None:
        self._op(w.OP_SEND)
        self._core.wr_op(w.OP_SEND, self._wr_id, self._wr_flags)

    def wr_send_imm(self, data: int) -> None:
        self._op(w.OP_SEND_IMM)
        self._core.wr_op(w.OP_SEND_IMM, self._wr_id, self._wr_flags, imm=_htobe32(data))

    def wr_rdma_read(self, rkey: int, remote_addr: int) -> None:
        self._op(w.OP_READ)
        self._core.wr_op(w.OP_READ, self._wr_id, self._wr_flags, rkey, remote_addr)

    def wr_atomic_fetch_add(self, rkey: int, remote_addr: int, add: int) -> None:
        self._op(w.OP_FADD)
        self._core.wr_op(w.OP_FADD, self._wr_id, self._wr_flags, rkey, remote_addr, add=add)

    def wr_atomic_cmp_swp(self, rkey: int, remote_addr: int, compare: int, swap: int) -> None:
        self._op(w.OP_CSWAP)
        self._core.wr_op(w.OP_CSWAP, self._wr_id, self._wr_flags, rkey, remote_addr, add=compare, swap=swap)

    def wr_set_sge(self, sge: Any) -> None:
        self._core.wr_set_sge(sge.addr, sge.length, sge.lkey)

    def wr_set_sge_list(self, num_sge: int, sg_list: Any) -> None:
        self._core.wr_set_sges([(s.addr, s.length, s.lkey) for s in list(sg_list)[:num_sge]])

    def wr_set_inline_data(self, addr: int, length: int) -> None:
        """Inline data is copied now, as the provider copies it into the WQE."""
        self._core.wr_set_inline(bytes(host_view(addr, length)))

    def wr_set_ud_addr(self, ah: Any, remote_qpn: int, remote_rkey: int) -> None:
        self._core.wr_set_ud(ah._endpoint, remote_qpn, remote_rkey)

    def wr_start(self) -> None:
        if not self._ex:
            raise PyverbsUserError("qp_ex is not accessible: QP created without IBV_QP_INIT_ATTR_SEND_OPS_FLAGS")
        self._core.wr_start()

    def wr_complete(self) -> None:
        rc = self._core.wr_complete()
        if rc:
            raise PyverbsRDMAError("ibv_wr_complete failed.", rc)

    def wr_abort(self) -> None:
        self._core.wr_abort()
