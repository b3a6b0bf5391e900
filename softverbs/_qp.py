"""One QP of the engine: the requester and responder halves over the state they share, and the error state.

Errors. RC: a protection or length error completes that WR with an error status and moves the QP to the
error state; every later and outstanding WR, and every posted receive, completes with IBV_WC_WR_FLUSH_ERR.
The responder QP also goes to the error state on access / invalid-request errors. SRD (EFA): an error
completes only that WR; the QP stays usable (EFA flushes only on QP destroy).
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

from ._cq import CQCore
from ._ibv import ERR, QPT_DRIVER, RESET
from ._requester import QPRequester
from ._responder import QPResponder

if TYPE_CHECKING:  # annotations only: the device owns its QPs, not the other way round
    from ._device import SoftDevice


class QPCore(QPRequester, QPResponder):
    """One QP, guarded by `lock`: the state both halves share here; `QPRequester` and `QPResponder` keep their own."""

    def __init__(self, device: SoftDevice, pd: Any, qp_type: int, scq: CQCore, rcq: CQCore, cap: dict,
                 sq_sig_all: bool, send_ops: int | None, unsolicited: bool) -> None:
        self.device = device
        self.pd = pd
        self.qp_type = qp_type
        self.srd = qp_type == QPT_DRIVER
        self.efa = device.is_efa
        self.scq = scq
        self.rcq = rcq
        self.max_send_wr = cap["max_send_wr"]
        self.max_recv_wr = cap["max_recv_wr"]
        self.max_send_sge = cap["max_send_sge"]
        self.max_recv_sge = cap["max_recv_sge"]
        self.max_inline = cap["max_inline_data"]
        self.sq_sig_all = sq_sig_all
        self.send_ops = send_ops
        self.unsolicited = unsolicited
        self.qpn = device.new_qpn()
        self.lock = threading.RLock()
        self.state = RESET
        self.port_num = 1
        self.pkey_index = 0
        self.qkey = 0
        self.access_flags = 0
        self.path_mtu = 3
        self.dest_qpn = 0
        self.remote: tuple[str, int] | None = None
        self.ah_attr: Any = None
        self.rq_psn = 0
        self.sq_psn = 0
        self.max_rd_atomic = 0
        self.max_dest_rd_atomic = 0
        self.min_rnr_timer = 0
        self.timeout = 0
        self.retry_cnt = 0
        self.rnr_retry = 0
        self.ar: bool | None = None
        self._init_requester()
        self._init_responder()
        self.closed = False

    def enter_error(self) -> None:
        """Move to IBV_QPS_ERR: flush the send queue, posted receives and pending inbound work."""
        if self.state == ERR:
            return
        self.state = ERR
        self.tx_halted = False
        self._flush_sq()
        self._flush_rq()
        self.backlog.clear()
        self.stalled = False
        self.rnr_wait.clear()
        self.pool.clear()
        self.pool_bytes = 0
        self.pend.clear()
