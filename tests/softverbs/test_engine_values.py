"""The engine's plain-int verbs values (softverbs._ibv, softverbs._requester's opcode table) are rdma-core's."""

from __future__ import annotations

from softverbs import _ibv
from softverbs import _wire as w
from softverbs import libibverbs_enums as e
from softverbs._requester import WR_TO_OP

# engine name -> the enum member it stands for
SAME = {
    "OK": e.IBV_WC_SUCCESS, "LOC_LEN": e.IBV_WC_LOC_LEN_ERR, "LOC_QP_OP": e.IBV_WC_LOC_QP_OP_ERR,
    "LOC_PROT": e.IBV_WC_LOC_PROT_ERR, "FLUSH": e.IBV_WC_WR_FLUSH_ERR, "REM_INV_REQ": e.IBV_WC_REM_INV_REQ_ERR,
    "REM_ACCESS": e.IBV_WC_REM_ACCESS_ERR, "REM_OP": e.IBV_WC_REM_OP_ERR, "RETRY_EXC": e.IBV_WC_RETRY_EXC_ERR,
    "RNR_EXC": e.IBV_WC_RNR_RETRY_EXC_ERR, "REM_INV_RD_REQ": e.IBV_WC_REM_INV_RD_REQ_ERR,
    "RESP_TIMEOUT": e.IBV_WC_RESP_TIMEOUT_ERR,
    "RESET": e.IBV_QPS_RESET, "INIT": e.IBV_QPS_INIT, "RTR": e.IBV_QPS_RTR, "RTS": e.IBV_QPS_RTS,
    "SQD": e.IBV_QPS_SQD, "SQE": e.IBV_QPS_SQE, "ERR": e.IBV_QPS_ERR,
    "LOCAL_WRITE": e.IBV_ACCESS_LOCAL_WRITE, "REMOTE_WRITE": e.IBV_ACCESS_REMOTE_WRITE,
    "REMOTE_READ": e.IBV_ACCESS_REMOTE_READ, "REMOTE_ATOMIC": e.IBV_ACCESS_REMOTE_ATOMIC,
    "RELAXED_ORDERING": e.IBV_ACCESS_RELAXED_ORDERING,
    "FENCE": e.IBV_SEND_FENCE, "SIGNALED": e.IBV_SEND_SIGNALED, "SOLICITED": e.IBV_SEND_SOLICITED,
    "INLINE": e.IBV_SEND_INLINE,
    "WC_SEND": e.IBV_WC_SEND, "WC_RDMA_WRITE": e.IBV_WC_RDMA_WRITE, "WC_RDMA_READ": e.IBV_WC_RDMA_READ,
    "WC_COMP_SWAP": e.IBV_WC_COMP_SWAP, "WC_FETCH_ADD": e.IBV_WC_FETCH_ADD, "WC_RECV": e.IBV_WC_RECV,
    "WC_RECV_RDMA_WITH_IMM": e.IBV_WC_RECV_RDMA_WITH_IMM, "WC_WITH_IMM": e.IBV_WC_WITH_IMM,
    "QPT_RC": e.IBV_QPT_RC, "QPT_DRIVER": e.IBV_QPT_DRIVER,
}


def test_engine_values_are_the_enums() -> None:
    assert {name: getattr(_ibv, name) for name in SAME} == {name: int(v) for name, v in SAME.items()}


def test_wr_opcodes_map_to_the_wire_ops() -> None:
    assert WR_TO_OP == {
        int(e.IBV_WR_RDMA_WRITE): w.OP_WRITE, int(e.IBV_WR_RDMA_WRITE_WITH_IMM): w.OP_WRITE_IMM,
        int(e.IBV_WR_SEND): w.OP_SEND, int(e.IBV_WR_SEND_WITH_IMM): w.OP_SEND_IMM,
        int(e.IBV_WR_RDMA_READ): w.OP_READ, int(e.IBV_WR_ATOMIC_CMP_AND_SWP): w.OP_CSWAP,
        int(e.IBV_WR_ATOMIC_FETCH_AND_ADD): w.OP_FADD,
    }


def test_mtu_codes() -> None:
    assert [_ibv.mtu_bytes(int(m)) for m in (e.IBV_MTU_256, e.IBV_MTU_1024, e.IBV_MTU_4096)] == [256, 1024, 4096]
    assert _ibv.mtu_bytes(0) == 256 and _ibv.mtu_bytes(9) == 4096  # out-of-range codes clamp
