"""The libibverbs enum values softverbs uses, with pyverbs' names and the real numeric values.

pyverbs (Cython cpdef enums) exposes each enum as an IntFlag class and every member at module level; this
module does the same, so `e.IBV_WC_SUCCESS` and `ibv_wc_status.IBV_WC_SUCCESS` both work. Values are copied from
libibverbs' verbs.h (rdma-core 59) and checked against real pyverbs by the API-agreement test.
"""

from __future__ import annotations

from enum import IntFlag


class ibv_transport_type(IntFlag):
    IBV_TRANSPORT_UNKNOWN = -1
    IBV_TRANSPORT_IB = 0
    IBV_TRANSPORT_IWARP = 1
    IBV_TRANSPORT_USNIC = 2
    IBV_TRANSPORT_USNIC_UDP = 3


class ibv_node_type(IntFlag):
    IBV_NODE_UNKNOWN = -1
    IBV_NODE_CA = 1
    IBV_NODE_SWITCH = 2
    IBV_NODE_ROUTER = 3
    IBV_NODE_RNIC = 4
    IBV_NODE_USNIC = 5
    IBV_NODE_USNIC_UDP = 6
    IBV_NODE_UNSPECIFIED = 7


class ibv_atomic_cap(IntFlag):
    IBV_ATOMIC_NONE = 0
    IBV_ATOMIC_HCA = 1
    IBV_ATOMIC_GLOB = 2


class ibv_port_state(IntFlag):
    IBV_PORT_NOP = 0
    IBV_PORT_DOWN = 1
    IBV_PORT_INIT = 2
    IBV_PORT_ARMED = 3
    IBV_PORT_ACTIVE = 4
    IBV_PORT_ACTIVE_DEFER = 5


class ibv_mtu(IntFlag):
    IBV_MTU_256 = 1
    IBV_MTU_512 = 2
    IBV_MTU_1024 = 3
    IBV_MTU_2048 = 4
    IBV_MTU_4096 = 5


class ibv_access_flags(IntFlag):
    IBV_ACCESS_LOCAL_WRITE = 1
    IBV_ACCESS_REMOTE_WRITE = 1 << 1
    IBV_ACCESS_REMOTE_READ = 1 << 2
    IBV_ACCESS_REMOTE_ATOMIC = 1 << 3
    IBV_ACCESS_MW_BIND = 1 << 4
    IBV_ACCESS_ZERO_BASED = 1 << 5
    IBV_ACCESS_ON_DEMAND = 1 << 6
    IBV_ACCESS_HUGETLB = 1 << 7
    IBV_ACCESS_FLUSH_GLOBAL = 1 << 8
    IBV_ACCESS_FLUSH_PERSISTENT = 1 << 9
    IBV_ACCESS_RELAXED_ORDERING = 1 << 20


class ibv_wr_opcode(IntFlag):
    IBV_WR_RDMA_WRITE = 0
    IBV_WR_RDMA_WRITE_WITH_IMM = 1
    IBV_WR_SEND = 2
    IBV_WR_SEND_WITH_IMM = 3
    IBV_WR_RDMA_READ = 4
    IBV_WR_ATOMIC_CMP_AND_SWP = 5
    IBV_WR_ATOMIC_FETCH_AND_ADD = 6
    IBV_WR_LOCAL_INV = 7
    IBV_WR_BIND_MW = 8
    IBV_WR_SEND_WITH_INV = 9
    IBV_WR_TSO = 10
    IBV_WR_FLUSH = 14
    IBV_WR_ATOMIC_WRITE = 15


class ibv_send_flags(IntFlag):
    IBV_SEND_FENCE = 1 << 0
    IBV_SEND_SIGNALED = 1 << 1
    IBV_SEND_SOLICITED = 1 << 2
    IBV_SEND_INLINE = 1 << 3
    IBV_SEND_IP_CSUM = 1 << 4


class ibv_qp_type(IntFlag):
    IBV_QPT_RC = 2
    IBV_QPT_UC = 3
    IBV_QPT_UD = 4
    IBV_QPT_RAW_PACKET = 8
    IBV_QPT_XRC_SEND = 9
    IBV_QPT_XRC_RECV = 10
    IBV_QPT_DRIVER = 0xFF


class ibv_qp_state(IntFlag):
    IBV_QPS_RESET = 0
    IBV_QPS_INIT = 1
    IBV_QPS_RTR = 2
    IBV_QPS_RTS = 3
    IBV_QPS_SQD = 4
    IBV_QPS_SQE = 5
    IBV_QPS_ERR = 6
    IBV_QPS_UNKNOWN = 7


class ibv_mig_state(IntFlag):
    IBV_MIG_MIGRATED = 0
    IBV_MIG_REARM = 1
    IBV_MIG_ARMED = 2


class ibv_wc_status(IntFlag):
    IBV_WC_SUCCESS = 0
    IBV_WC_LOC_LEN_ERR = 1
    IBV_WC_LOC_QP_OP_ERR = 2
    IBV_WC_LOC_EEC_OP_ERR = 3
    IBV_WC_LOC_PROT_ERR = 4
    IBV_WC_WR_FLUSH_ERR = 5
    IBV_WC_MW_BIND_ERR = 6
    IBV_WC_BAD_RESP_ERR = 7
    IBV_WC_LOC_ACCESS_ERR = 8
    IBV_WC_REM_INV_REQ_ERR = 9
    IBV_WC_REM_ACCESS_ERR = 10
    IBV_WC_REM_OP_ERR = 11
    IBV_WC_RETRY_EXC_ERR = 12
    IBV_WC_RNR_RETRY_EXC_ERR = 13
    IBV_WC_LOC_RDD_VIOL_ERR = 14
    IBV_WC_REM_INV_RD_REQ_ERR = 15
    IBV_WC_REM_ABORT_ERR = 16
    IBV_WC_INV_EECN_ERR = 17
    IBV_WC_INV_EEC_STATE_ERR = 18
    IBV_WC_FATAL_ERR = 19
    IBV_WC_RESP_TIMEOUT_ERR = 20
    IBV_WC_GENERAL_ERR = 21
    IBV_WC_TM_ERR = 22
    IBV_WC_TM_RNDV_INCOMPLETE = 23


class ibv_wc_opcode(IntFlag):
    IBV_WC_SEND = 0
    IBV_WC_RDMA_WRITE = 1
    IBV_WC_RDMA_READ = 2
    IBV_WC_COMP_SWAP = 3
    IBV_WC_FETCH_ADD = 4
    IBV_WC_BIND_MW = 5
    IBV_WC_LOCAL_INV = 6
    IBV_WC_TSO = 7
    IBV_WC_FLUSH = 8
    IBV_WC_ATOMIC_WRITE = 9
    IBV_WC_RECV = 1 << 7
    IBV_WC_RECV_RDMA_WITH_IMM = (1 << 7) + 1
    IBV_WC_TM_ADD = (1 << 7) + 2
    IBV_WC_TM_DEL = (1 << 7) + 3
    IBV_WC_TM_SYNC = (1 << 7) + 4
    IBV_WC_TM_RECV = (1 << 7) + 5
    IBV_WC_TM_NO_TAG = (1 << 7) + 6
    IBV_WC_DRIVER2 = (1 << 7) + 8
    IBV_WC_DRIVER3 = (1 << 7) + 9


class ibv_create_cq_wc_flags(IntFlag):
    IBV_WC_EX_WITH_BYTE_LEN = 1 << 0
    IBV_WC_EX_WITH_IMM = 1 << 1
    IBV_WC_EX_WITH_QP_NUM = 1 << 2
    IBV_WC_EX_WITH_SRC_QP = 1 << 3
    IBV_WC_EX_WITH_SLID = 1 << 4
    IBV_WC_EX_WITH_SL = 1 << 5
    IBV_WC_EX_WITH_DLID_PATH_BITS = 1 << 6
    IBV_WC_EX_WITH_COMPLETION_TIMESTAMP = 1 << 7
    IBV_WC_EX_WITH_CVLAN = 1 << 8
    IBV_WC_EX_WITH_FLOW_TAG = 1 << 9
    IBV_WC_EX_WITH_TM_INFO = 1 << 10
    IBV_WC_EX_WITH_COMPLETION_TIMESTAMP_WALLCLOCK = 1 << 11


class ibv_wc_flags(IntFlag):
    IBV_WC_GRH = 1 << 0
    IBV_WC_WITH_IMM = 1 << 1
    IBV_WC_IP_CSUM_OK = 1 << 2
    IBV_WC_WITH_INV = 1 << 3
    IBV_WC_TM_SYNC_REQ = 1 << 4
    IBV_WC_TM_MATCH = 1 << 5
    IBV_WC_TM_DATA_VALID = 1 << 6


class ibv_qp_init_attr_mask(IntFlag):
    IBV_QP_INIT_ATTR_PD = 1 << 0
    IBV_QP_INIT_ATTR_XRCD = 1 << 1
    IBV_QP_INIT_ATTR_CREATE_FLAGS = 1 << 2
    IBV_QP_INIT_ATTR_MAX_TSO_HEADER = 1 << 3
    IBV_QP_INIT_ATTR_IND_TABLE = 1 << 4
    IBV_QP_INIT_ATTR_RX_HASH = 1 << 5
    IBV_QP_INIT_ATTR_SEND_OPS_FLAGS = 1 << 6


class ibv_qp_attr_mask(IntFlag):
    IBV_QP_STATE = 1 << 0
    IBV_QP_CUR_STATE = 1 << 1
    IBV_QP_EN_SQD_ASYNC_NOTIFY = 1 << 2
    IBV_QP_ACCESS_FLAGS = 1 << 3
    IBV_QP_PKEY_INDEX = 1 << 4
    IBV_QP_PORT = 1 << 5
    IBV_QP_QKEY = 1 << 6
    IBV_QP_AV = 1 << 7
    IBV_QP_PATH_MTU = 1 << 8
    IBV_QP_TIMEOUT = 1 << 9
    IBV_QP_RETRY_CNT = 1 << 10
    IBV_QP_RNR_RETRY = 1 << 11
    IBV_QP_RQ_PSN = 1 << 12
    IBV_QP_MAX_QP_RD_ATOMIC = 1 << 13
    IBV_QP_ALT_PATH = 1 << 14
    IBV_QP_MIN_RNR_TIMER = 1 << 15
    IBV_QP_SQ_PSN = 1 << 16
    IBV_QP_MAX_DEST_RD_ATOMIC = 1 << 17
    IBV_QP_PATH_MIG_STATE = 1 << 18
    IBV_QP_CAP = 1 << 19
    IBV_QP_DEST_QPN = 1 << 20
    IBV_QP_RATE_LIMIT = 1 << 25


class ibv_qp_create_send_ops_flags(IntFlag):
    IBV_QP_EX_WITH_RDMA_WRITE = 1 << 0
    IBV_QP_EX_WITH_RDMA_WRITE_WITH_IMM = 1 << 1
    IBV_QP_EX_WITH_SEND = 1 << 2
    IBV_QP_EX_WITH_SEND_WITH_IMM = 1 << 3
    IBV_QP_EX_WITH_RDMA_READ = 1 << 4
    IBV_QP_EX_WITH_ATOMIC_CMP_AND_SWP = 1 << 5
    IBV_QP_EX_WITH_ATOMIC_FETCH_AND_ADD = 1 << 6
    IBV_QP_EX_WITH_LOCAL_INV = 1 << 7
    IBV_QP_EX_WITH_BIND_MW = 1 << 8
    IBV_QP_EX_WITH_SEND_WITH_INV = 1 << 9
    IBV_QP_EX_WITH_TSO = 1 << 10
    IBV_QP_EX_WITH_FLUSH = 1 << 11
    IBV_QP_EX_WITH_ATOMIC_WRITE = 1 << 12


class ibv_device_cap_flags(IntFlag):
    IBV_DEVICE_RESIZE_MAX_WR = 1
    IBV_DEVICE_BAD_PKEY_CNTR = 1 << 1
    IBV_DEVICE_BAD_QKEY_CNTR = 1 << 2
    IBV_DEVICE_RAW_MULTI = 1 << 3
    IBV_DEVICE_AUTO_PATH_MIG = 1 << 4
    IBV_DEVICE_CHANGE_PHY_PORT = 1 << 5
    IBV_DEVICE_UD_AV_PORT_ENFORCE = 1 << 6
    IBV_DEVICE_CURR_QP_STATE_MOD = 1 << 7
    IBV_DEVICE_SHUTDOWN_PORT = 1 << 8
    IBV_DEVICE_INIT_TYPE = 1 << 9
    IBV_DEVICE_PORT_ACTIVE_EVENT = 1 << 10
    IBV_DEVICE_SYS_IMAGE_GUID = 1 << 11
    IBV_DEVICE_RC_RNR_NAK_GEN = 1 << 12
    IBV_DEVICE_SRQ_RESIZE = 1 << 13
    IBV_DEVICE_N_NOTIFY_CQ = 1 << 14
    IBV_DEVICE_MEM_WINDOW = 1 << 17
    IBV_DEVICE_UD_IP_CSUM = 1 << 18
    IBV_DEVICE_XRC = 1 << 20
    IBV_DEVICE_MEM_MGT_EXTENSIONS = 1 << 21
    IBV_DEVICE_MEM_WINDOW_TYPE_2A = 1 << 23
    IBV_DEVICE_MEM_WINDOW_TYPE_2B = 1 << 24
    IBV_DEVICE_RC_IP_CSUM = 1 << 25
    IBV_DEVICE_RAW_IP_CSUM = 1 << 26
    IBV_DEVICE_MANAGED_FLOW_STEERING = 1 << 29


# Enums of features softverbs does not provide (SRQ, XRC, WQs, RSS, ODP, flow steering, tag matching,
# memory windows, ...). They exist so code that only names them (rdma-core's tests, capability checks)
# imports and reads the values pyverbs has; the devices report none of these features.

class ibv_cq_init_attr_mask(IntFlag):
    IBV_CQ_INIT_ATTR_MASK_FLAGS = 1
    IBV_CQ_INIT_ATTR_MASK_PD = 2


class ibv_create_cq_attr_flags(IntFlag):
    IBV_CREATE_CQ_ATTR_SINGLE_THREADED = 1
    IBV_CREATE_CQ_ATTR_IGNORE_OVERRUN = 2


class ibv_event_type(IntFlag):
    IBV_EVENT_CQ_ERR = 0
    IBV_EVENT_QP_FATAL = 1
    IBV_EVENT_QP_REQ_ERR = 2
    IBV_EVENT_QP_ACCESS_ERR = 3
    IBV_EVENT_COMM_EST = 1 << 2
    IBV_EVENT_SQ_DRAINED = 5
    IBV_EVENT_PATH_MIG = 6
    IBV_EVENT_PATH_MIG_ERR = 7
    IBV_EVENT_DEVICE_FATAL = 1 << 3
    IBV_EVENT_PORT_ACTIVE = 9
    IBV_EVENT_PORT_ERR = 10
    IBV_EVENT_LID_CHANGE = 11
    IBV_EVENT_PKEY_CHANGE = 12
    IBV_EVENT_SM_CHANGE = 13
    IBV_EVENT_SRQ_ERR = 14
    IBV_EVENT_SRQ_LIMIT_REACHED = 15
    IBV_EVENT_QP_LAST_WQE_REACHED = 1 << 4
    IBV_EVENT_CLIENT_REREGISTER = 17
    IBV_EVENT_GID_CHANGE = 18
    IBV_EVENT_WQ_FATAL = 19


class ibv_flow_spec_type(IntFlag):
    IBV_FLOW_SPEC_ETH = 1 << 5
    IBV_FLOW_SPEC_IPV4 = 48
    IBV_FLOW_SPEC_IPV6 = 49
    IBV_FLOW_SPEC_IPV4_EXT = 50
    IBV_FLOW_SPEC_ESP = 52
    IBV_FLOW_SPEC_TCP = 1 << 6
    IBV_FLOW_SPEC_UDP = 65
    IBV_FLOW_SPEC_VXLAN_TUNNEL = 80
    IBV_FLOW_SPEC_GRE = 81
    IBV_FLOW_SPEC_MPLS = 96
    IBV_FLOW_SPEC_INNER = 1 << 8
    IBV_FLOW_SPEC_ACTION_TAG = 1 << 12
    IBV_FLOW_SPEC_ACTION_DROP = 4097
    IBV_FLOW_SPEC_ACTION_HANDLE = 4098
    IBV_FLOW_SPEC_ACTION_COUNT = 4099


class ibv_fork_status(IntFlag):
    IBV_FORK_DISABLED = 0
    IBV_FORK_ENABLED = 1
    IBV_FORK_UNNEEDED = 2


class ibv_gid_type_sysfs(IntFlag):
    IBV_GID_TYPE_SYSFS_IB_ROCE_V1 = 0
    IBV_GID_TYPE_SYSFS_ROCE_V2 = 1


class ibv_mw_type(IntFlag):
    IBV_MW_TYPE_1 = 1
    IBV_MW_TYPE_2 = 2


class ibv_odp_general_caps(IntFlag):
    IBV_ODP_SUPPORT = 1
    IBV_ODP_SUPPORT_IMPLICIT = 2


class ibv_odp_transport_cap_bits(IntFlag):
    IBV_ODP_SUPPORT_SEND = 1
    IBV_ODP_SUPPORT_RECV = 2
    IBV_ODP_SUPPORT_WRITE = 1 << 2
    IBV_ODP_SUPPORT_READ = 1 << 3
    IBV_ODP_SUPPORT_ATOMIC = 1 << 4
    IBV_ODP_SUPPORT_SRQ_RECV = 1 << 5
    IBV_ODP_SUPPORT_FLUSH = 1 << 6
    IBV_ODP_SUPPORT_ATOMIC_WRITE = 1 << 7


class ibv_ops_flags(IntFlag):
    IBV_OPS_SIGNALED = 1
    IBV_OPS_TM_SYNC = 2


class ibv_ops_wr_opcode(IntFlag):
    IBV_WR_TAG_ADD = 0
    IBV_WR_TAG_DEL = 1
    IBV_WR_TAG_SYNC = 2


class ibv_placement_type(IntFlag):
    IBV_FLUSH_GLOBAL = 1
    IBV_FLUSH_PERSISTENT = 2


class ibv_qp_create_flags(IntFlag):
    IBV_QP_CREATE_BLOCK_SELF_MCAST_LB = 2
    IBV_QP_CREATE_SCATTER_FCS = 1 << 8
    IBV_QP_CREATE_CVLAN_STRIPPING = 1 << 9
    IBV_QP_CREATE_SOURCE_QPN = 1 << 10
    IBV_QP_CREATE_PCI_WRITE_END_PADDING = 1 << 11


class ibv_query_qp_data_in_order_caps(IntFlag):
    IBV_QUERY_QP_DATA_IN_ORDER_WHOLE_MSG = 1
    IBV_QUERY_QP_DATA_IN_ORDER_ALIGNED_128_BYTES = 2


class ibv_query_qp_data_in_order_flags(IntFlag):
    IBV_QUERY_QP_DATA_IN_ORDER_RETURN_CAPS = 1


class ibv_raw_packet_caps(IntFlag):
    IBV_RAW_PACKET_CAP_CVLAN_STRIPPING = 1
    IBV_RAW_PACKET_CAP_SCATTER_FCS = 2
    IBV_RAW_PACKET_CAP_IP_CSUM = 1 << 2
    IBV_RAW_PACKET_CAP_DELAY_DROP = 1 << 3


class ibv_rereg_mr_flags(IntFlag):
    IBV_REREG_MR_CHANGE_TRANSLATION = 1
    IBV_REREG_MR_CHANGE_PD = 2
    IBV_REREG_MR_CHANGE_ACCESS = 1 << 2


class ibv_rx_hash_fields(IntFlag):
    IBV_RX_HASH_SRC_IPV4 = 1
    IBV_RX_HASH_DST_IPV4 = 2
    IBV_RX_HASH_SRC_IPV6 = 1 << 2
    IBV_RX_HASH_DST_IPV6 = 1 << 3
    IBV_RX_HASH_SRC_PORT_TCP = 1 << 4
    IBV_RX_HASH_DST_PORT_TCP = 1 << 5
    IBV_RX_HASH_SRC_PORT_UDP = 1 << 6
    IBV_RX_HASH_DST_PORT_UDP = 1 << 7


class ibv_rx_hash_function_flags(IntFlag):
    IBV_RX_HASH_FUNC_TOEPLITZ = 1


class ibv_selectivity_level(IntFlag):
    IBV_FLUSH_MR = 1
    IBV_FLUSH_RANGE = 0


class ibv_srq_attr_mask(IntFlag):
    IBV_SRQ_MAX_WR = 1
    IBV_SRQ_LIMIT = 2


class ibv_srq_init_attr_mask(IntFlag):
    IBV_SRQ_INIT_ATTR_TYPE = 1
    IBV_SRQ_INIT_ATTR_PD = 2
    IBV_SRQ_INIT_ATTR_XRCD = 1 << 2
    IBV_SRQ_INIT_ATTR_CQ = 1 << 3
    IBV_SRQ_INIT_ATTR_TM = 1 << 4


class ibv_srq_type(IntFlag):
    IBV_SRQT_BASIC = 0
    IBV_SRQT_XRC = 1
    IBV_SRQT_TM = 2


class ibv_tm_cap_flags(IntFlag):
    IBV_TM_CAP_RC = 1


class ibv_tmh_op(IntFlag):
    IBV_TMH_NO_TAG = 0
    IBV_TMH_RNDV = 1
    IBV_TMH_FIN = 2
    IBV_TMH_EAGER = 3


class ibv_wq_attr_mask(IntFlag):
    IBV_WQ_ATTR_STATE = 1
    IBV_WQ_ATTR_CURR_STATE = 2
    IBV_WQ_ATTR_FLAGS = 1 << 2


class ibv_wq_state(IntFlag):
    IBV_WQS_RESET = 0
    IBV_WQS_RDY = 1
    IBV_WQS_ERR = 2
    IBV_WQS_UNKNOWN = 3


class ibv_wq_type(IntFlag):
    IBV_WQT_RQ = 0


class ibv_xrcd_init_attr_mask(IntFlag):
    IBV_XRCD_INIT_ATTR_FD = 1
    IBV_XRCD_INIT_ATTR_OFLAGS = 2
    IBV_XRCD_INIT_ATTR_RESERVED = 1 << 2

# Anonymous enums in verbs.h: pyverbs exposes only their members.
IBV_LINK_LAYER_UNSPECIFIED = 0
IBV_LINK_LAYER_INFINIBAND = 1
IBV_LINK_LAYER_ETHERNET = 2
IBV_WC_STANDARD_FLAGS = 0x7F
# Private module-level constants of pyverbs (not exported), read by some callers.
_IBV_ADVISE_MR_ADVICE_PREFETCH = 0
_IBV_ADVISE_MR_ADVICE_PREFETCH_NO_FAULT = 2
_IBV_ADVISE_MR_ADVICE_PREFETCH_WRITE = 1
_IBV_ADVISE_MR_FLAG_FLUSH = 1
_IBV_ALLOCATOR_USE_DEFAULT = 0xffffffffffffffff
_IBV_DEVICE_PCI_WRITE_END_PADDING = 1 << 36
_IBV_DEVICE_RAW_SCATTER_FCS = 1 << 34

_ENUMS = (
    ibv_transport_type, ibv_node_type, ibv_atomic_cap, ibv_port_state, ibv_mtu, ibv_access_flags,
    ibv_wr_opcode, ibv_send_flags, ibv_qp_type, ibv_qp_state, ibv_mig_state, ibv_wc_status, ibv_wc_opcode,
    ibv_create_cq_wc_flags, ibv_wc_flags, ibv_qp_init_attr_mask, ibv_qp_attr_mask,
    ibv_qp_create_send_ops_flags, ibv_device_cap_flags,
    ibv_cq_init_attr_mask, ibv_create_cq_attr_flags, ibv_event_type, ibv_flow_spec_type,
    ibv_fork_status, ibv_gid_type_sysfs, ibv_mw_type, ibv_odp_general_caps,
    ibv_odp_transport_cap_bits, ibv_ops_flags, ibv_ops_wr_opcode, ibv_placement_type,
    ibv_qp_create_flags, ibv_query_qp_data_in_order_caps, ibv_query_qp_data_in_order_flags, ibv_raw_packet_caps,
    ibv_rereg_mr_flags, ibv_rx_hash_fields, ibv_rx_hash_function_flags, ibv_selectivity_level,
    ibv_srq_attr_mask, ibv_srq_init_attr_mask, ibv_srq_type, ibv_tm_cap_flags,
    ibv_tmh_op, ibv_wq_attr_mask, ibv_wq_state, ibv_wq_type,
    ibv_xrcd_init_attr_mask,
)
_ANONYMOUS = ["IBV_LINK_LAYER_UNSPECIFIED", "IBV_LINK_LAYER_INFINIBAND", "IBV_LINK_LAYER_ETHERNET",
              "IBV_WC_STANDARD_FLAGS"]

for _enum in _ENUMS:
    globals().update(_enum.__members__)

__all__ = [_e.__name__ for _e in _ENUMS] + [_n for _e in _ENUMS for _n in _e.__members__] + _ANONYMOUS
