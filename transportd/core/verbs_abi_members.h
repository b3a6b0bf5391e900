/*
 * The members, sizes and constants of the libibverbs ABI the core relies on, as X-macro lists. Kept apart
 * from verbs_abi.h (which declares the structs) so the layout probe can expand the same lists against the
 * real <infiniband/verbs.h> (tests/transportd/core/verbs_abi_probe.c) and the extension against ours.
 */
#ifndef TRANSPORTD_CORE_VERBS_ABI_MEMBERS_H
#define TRANSPORTD_CORE_VERBS_ABI_MEMBERS_H

/* What the layout test compares, member by member, against the real headers. */
#define TPD_VERBS_ABI_MEMBERS(X)                                                                            \
    X(ibv_sge, addr) X(ibv_sge, length) X(ibv_sge, lkey)                                                   \
    X(ibv_poll_cq_attr, comp_mask)                                                                         \
    X(ibv_qp, context) X(ibv_qp, qp_context) X(ibv_qp, pd) X(ibv_qp, send_cq) X(ibv_qp, recv_cq)            \
    X(ibv_qp, srq) X(ibv_qp, handle) X(ibv_qp, qp_num) X(ibv_qp, state) X(ibv_qp, qp_type) X(ibv_qp, mutex)  \
    X(ibv_qp, cond) X(ibv_qp, events_completed)                                                             \
    X(ibv_qp_ex, qp_base) X(ibv_qp_ex, comp_mask) X(ibv_qp_ex, wr_id) X(ibv_qp_ex, wr_flags)                \
    X(ibv_qp_ex, wr_atomic_cmp_swp) X(ibv_qp_ex, wr_atomic_fetch_add) X(ibv_qp_ex, wr_bind_mw)              \
    X(ibv_qp_ex, wr_local_inv) X(ibv_qp_ex, wr_rdma_read) X(ibv_qp_ex, wr_rdma_write)                       \
    X(ibv_qp_ex, wr_rdma_write_imm) X(ibv_qp_ex, wr_send) X(ibv_qp_ex, wr_send_imm) X(ibv_qp_ex, wr_send_inv) \
    X(ibv_qp_ex, wr_send_tso) X(ibv_qp_ex, wr_set_ud_addr) X(ibv_qp_ex, wr_set_xrc_srqn)                    \
    X(ibv_qp_ex, wr_set_inline_data) X(ibv_qp_ex, wr_set_inline_data_list) X(ibv_qp_ex, wr_set_sge)         \
    X(ibv_qp_ex, wr_set_sge_list) X(ibv_qp_ex, wr_start) X(ibv_qp_ex, wr_complete) X(ibv_qp_ex, wr_abort)   \
    X(ibv_cq_ex, context) X(ibv_cq_ex, channel) X(ibv_cq_ex, cq_context) X(ibv_cq_ex, handle)               \
    X(ibv_cq_ex, cqe) X(ibv_cq_ex, mutex) X(ibv_cq_ex, cond) X(ibv_cq_ex, comp_events_completed)            \
    X(ibv_cq_ex, async_events_completed) X(ibv_cq_ex, comp_mask) X(ibv_cq_ex, status) X(ibv_cq_ex, wr_id)   \
    X(ibv_cq_ex, start_poll) X(ibv_cq_ex, next_poll) X(ibv_cq_ex, end_poll) X(ibv_cq_ex, read_opcode)       \
    X(ibv_cq_ex, read_vendor_err) X(ibv_cq_ex, read_byte_len) X(ibv_cq_ex, read_imm_data)                   \
    X(ibv_cq_ex, read_qp_num) X(ibv_cq_ex, read_src_qp) X(ibv_cq_ex, read_wc_flags) X(ibv_cq_ex, read_slid) \
    X(ibv_cq_ex, read_sl) X(ibv_cq_ex, read_dlid_path_bits)

/* Whole structs whose size matters: the base QP is embedded, the SGE and poll attr are passed by array. */
#define TPD_VERBS_ABI_SIZES(X) X(ibv_sge) X(ibv_poll_cq_attr) X(ibv_qp)

/* Constants: (name, value) pairs the test checks against the real enums. */
#define TPD_VERBS_ABI_CONSTANTS(X)                                                                          \
    X(IBV_SEND_FENCE) X(IBV_SEND_SIGNALED) X(IBV_SEND_SOLICITED) X(IBV_SEND_INLINE) X(IBV_WC_SUCCESS)       \
    X(IBV_WC_LOC_PROT_ERR) X(IBV_WC_WR_FLUSH_ERR) X(IBV_WC_REM_ACCESS_ERR) X(IBV_WC_GENERAL_ERR)            \
    X(IBV_WC_SEND) X(IBV_WC_RDMA_WRITE) X(IBV_WC_RDMA_READ) X(IBV_WC_COMP_SWAP) X(IBV_WC_FETCH_ADD)         \
    X(IBV_QP_EX_WITH_RDMA_WRITE) X(IBV_QP_EX_WITH_RDMA_WRITE_WITH_IMM) X(IBV_QP_EX_WITH_SEND)               \
    X(IBV_QP_EX_WITH_SEND_WITH_IMM) X(IBV_QP_EX_WITH_RDMA_READ) X(IBV_QP_EX_WITH_ATOMIC_CMP_AND_SWP)        \
    X(IBV_QP_EX_WITH_ATOMIC_FETCH_AND_ADD)

#endif
