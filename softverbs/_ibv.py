"""The verbs values the engine works with (ibv_wc_status, ibv_qp_state, access and send flags, ...).

Plain ints, not the enums of `libibverbs_enums`, so the data path compares small ints; the values are
rdma-core's and `tests/softverbs` checks them against the enums.
"""

from __future__ import annotations

# ibv_wc_status
OK = 0
LOC_LEN = 1
LOC_QP_OP = 2
LOC_PROT = 4
FLUSH = 5
BAD_RESP = 7
REM_INV_REQ = 9
REM_ACCESS = 10
REM_OP = 11
RETRY_EXC = 12
RNR_EXC = 13
REM_INV_RD_REQ = 15
RESP_TIMEOUT = 20
#: what a responder's answer can say of a request; a response saying anything else is a bad response (BAD_RESP)
REMOTE_STATUSES = frozenset((OK, REM_INV_REQ, REM_ACCESS, REM_OP, RETRY_EXC, RNR_EXC, REM_INV_RD_REQ, RESP_TIMEOUT))

# ibv_qp_state
RESET, INIT, RTR, RTS, SQD, SQE, ERR = range(7)

# ibv_access_flags
LOCAL_WRITE = 1
REMOTE_WRITE = 2
REMOTE_READ = 4
REMOTE_ATOMIC = 8
RELAXED_ORDERING = 1 << 20

# ibv_send_flags
FENCE = 1
SIGNALED = 2
SOLICITED = 4
INLINE = 8

# ibv_wc_opcode / flags
WC_SEND, WC_RDMA_WRITE, WC_RDMA_READ, WC_COMP_SWAP, WC_FETCH_ADD = 0, 1, 2, 3, 4
WC_RECV, WC_RECV_RDMA_WITH_IMM = 128, 129
WC_WITH_IMM = 2

# ibv_qp_type
QPT_RC = 2
QPT_DRIVER = 0xFF

# IBTA encoding of the RNR NAK timer (milliseconds)
RNR_TIMER_MS = (655.36, 0.01, 0.02, 0.03, 0.04, 0.06, 0.08, 0.12, 0.16, 0.24, 0.32, 0.48, 0.64, 0.96, 1.28,
                1.92, 2.56, 3.84, 5.12, 7.68, 10.24, 15.36, 20.48, 30.72, 40.96, 61.44, 81.92, 122.88,
                163.84, 245.76, 327.68, 491.52)


def mtu_bytes(code: int) -> int:
    """Bytes of an ibv_mtu code (IBV_MTU_256 = 1 .. IBV_MTU_4096 = 5), clamped to that range."""
    return 256 << (max(1, min(5, code)) - 1)
