/*
 * The part of the libibverbs ABI the compiled core calls, declared here so the core builds with only a
 * C compiler (no rdma-core headers or library at build time; the NCCL approach).
 *
 * Declared from the documented ABI (ibv_wr_post(3), ibv_create_qp_ex(3), ibv_create_cq_ex(3)): the
 * extended QP and CQ are structs of plain fields followed by function pointers the provider fills, and the
 * inline helpers of <infiniband/verbs.h> (ibv_wr_rdma_write(), ibv_start_poll(), ...) only call through
 * those pointers. So posting and polling need the struct layouts and a few constants, nothing linked.
 *
 * Only the members the core touches need to be right, but every member before them must have its size
 * and alignment, so the whole prefix is declared. tests/transportd/core/test_verbs_abi.py compiles a probe
 * against the real rdma-core 59 headers and checks every offset and size below against
 * transportd._core.abi_layout(), which reports them as this header lays them out.
 *
 * Names are the libibverbs names (this header is never included together with <infiniband/verbs.h>).
 */
#ifndef TRANSPORTD_CORE_VERBS_ABI_H
#define TRANSPORTD_CORE_VERBS_ABI_H

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>

/* opaque: the core only carries pointers to these */
struct ibv_context;
struct ibv_pd;
struct ibv_cq;
struct ibv_srq;
struct ibv_ah;
struct ibv_mw;
struct ibv_mw_bind_info;
struct ibv_data_buf;
struct ibv_comp_channel;
struct ibv_wc_tm_info;

typedef uint32_t tpd_be32; /* __be32: big-endian on the wire, a plain u32 in the ABI */

enum ibv_send_flags {
    IBV_SEND_FENCE = 1 << 0,
    IBV_SEND_SIGNALED = 1 << 1,
    IBV_SEND_SOLICITED = 1 << 2,
    IBV_SEND_INLINE = 1 << 3,
};

enum ibv_wc_status {
    IBV_WC_SUCCESS = 0,
    IBV_WC_LOC_PROT_ERR = 4,
    IBV_WC_WR_FLUSH_ERR = 5,
    IBV_WC_REM_ACCESS_ERR = 10,
    IBV_WC_GENERAL_ERR = 21,
};

enum ibv_wc_opcode {
    IBV_WC_SEND = 0,
    IBV_WC_RDMA_WRITE = 1,
    IBV_WC_RDMA_READ = 2,
    IBV_WC_COMP_SWAP = 3,
    IBV_WC_FETCH_ADD = 4,
};

enum ibv_qp_create_send_ops_flags {
    IBV_QP_EX_WITH_RDMA_WRITE = 1 << 0,
    IBV_QP_EX_WITH_RDMA_WRITE_WITH_IMM = 1 << 1,
    IBV_QP_EX_WITH_SEND = 1 << 2,
    IBV_QP_EX_WITH_SEND_WITH_IMM = 1 << 3,
    IBV_QP_EX_WITH_RDMA_READ = 1 << 4,
    IBV_QP_EX_WITH_ATOMIC_CMP_AND_SWP = 1 << 5,
    IBV_QP_EX_WITH_ATOMIC_FETCH_AND_ADD = 1 << 6,
};

struct ibv_sge {
    uint64_t addr;
    uint32_t length;
    uint32_t lkey;
};

struct ibv_poll_cq_attr {
    uint32_t comp_mask; /* must be 0 */
};

/* The base QP: the extended QP embeds it first. Enums are int-sized in the ABI. */
struct ibv_qp {
    struct ibv_context *context;
    void *qp_context;
    struct ibv_pd *pd;
    struct ibv_cq *send_cq;
    struct ibv_cq *recv_cq;
    struct ibv_srq *srq;
    uint32_t handle;
    uint32_t qp_num;
    int state;   /* enum ibv_qp_state */
    int qp_type; /* enum ibv_qp_type */
    pthread_mutex_t mutex;
    pthread_cond_t cond;
    uint32_t events_completed;
};

struct ibv_qp_ex {
    struct ibv_qp qp_base;
    uint64_t comp_mask;
    uint64_t wr_id;
    unsigned int wr_flags; /* enum ibv_send_flags bits of the next WR */

    void (*wr_atomic_cmp_swp)(struct ibv_qp_ex *qp, uint32_t rkey, uint64_t remote_addr, uint64_t compare,
                              uint64_t swap);
    void (*wr_atomic_fetch_add)(struct ibv_qp_ex *qp, uint32_t rkey, uint64_t remote_addr, uint64_t add);
    void (*wr_bind_mw)(struct ibv_qp_ex *qp, struct ibv_mw *mw, uint32_t rkey,
                       const struct ibv_mw_bind_info *bind_info);
    void (*wr_local_inv)(struct ibv_qp_ex *qp, uint32_t invalidate_rkey);
    void (*wr_rdma_read)(struct ibv_qp_ex *qp, uint32_t rkey, uint64_t remote_addr);
    void (*wr_rdma_write)(struct ibv_qp_ex *qp, uint32_t rkey, uint64_t remote_addr);
    void (*wr_rdma_write_imm)(struct ibv_qp_ex *qp, uint32_t rkey, uint64_t remote_addr, tpd_be32 imm_data);
    void (*wr_send)(struct ibv_qp_ex *qp);
    void (*wr_send_imm)(struct ibv_qp_ex *qp, tpd_be32 imm_data);
    void (*wr_send_inv)(struct ibv_qp_ex *qp, uint32_t invalidate_rkey);
    void (*wr_send_tso)(struct ibv_qp_ex *qp, void *hdr, uint16_t hdr_sz, uint16_t mss);
    void (*wr_set_ud_addr)(struct ibv_qp_ex *qp, struct ibv_ah *ah, uint32_t remote_qpn, uint32_t remote_qkey);
    void (*wr_set_xrc_srqn)(struct ibv_qp_ex *qp, uint32_t remote_srqn);
    void (*wr_set_inline_data)(struct ibv_qp_ex *qp, void *addr, size_t length);
    void (*wr_set_inline_data_list)(struct ibv_qp_ex *qp, size_t num_buf, const struct ibv_data_buf *buf_list);
    /* note the order: lkey before addr (ibv_wr_set_sge(3)) */
    void (*wr_set_sge)(struct ibv_qp_ex *qp, uint32_t lkey, uint64_t addr, uint32_t length);
    void (*wr_set_sge_list)(struct ibv_qp_ex *qp, size_t num_sge, const struct ibv_sge *sg_list);
    void (*wr_start)(struct ibv_qp_ex *qp);
    int (*wr_complete)(struct ibv_qp_ex *qp);
    void (*wr_abort)(struct ibv_qp_ex *qp);
    /* later members (wr_atomic_write, wr_flush, ...) are never called and not declared */
};

struct ibv_cq_ex {
    struct ibv_context *context;
    struct ibv_comp_channel *channel;
    void *cq_context;
    uint32_t handle;
    int cqe;
    pthread_mutex_t mutex;
    pthread_cond_t cond;
    uint32_t comp_events_completed;
    uint32_t async_events_completed;
    uint32_t comp_mask;
    int status;      /* enum ibv_wc_status of the current entry */
    uint64_t wr_id;  /* of the current entry */

    int (*start_poll)(struct ibv_cq_ex *current, struct ibv_poll_cq_attr *attr); /* 0, ENOENT or an errno */
    int (*next_poll)(struct ibv_cq_ex *current);
    void (*end_poll)(struct ibv_cq_ex *current);
    int (*read_opcode)(struct ibv_cq_ex *current); /* enum ibv_wc_opcode */
    uint32_t (*read_vendor_err)(struct ibv_cq_ex *current);
    uint32_t (*read_byte_len)(struct ibv_cq_ex *current);
    tpd_be32 (*read_imm_data)(struct ibv_cq_ex *current);
    uint32_t (*read_qp_num)(struct ibv_cq_ex *current);
    uint32_t (*read_src_qp)(struct ibv_cq_ex *current);
    unsigned int (*read_wc_flags)(struct ibv_cq_ex *current);
    uint32_t (*read_slid)(struct ibv_cq_ex *current);
    uint8_t (*read_sl)(struct ibv_cq_ex *current);
    uint8_t (*read_dlid_path_bits)(struct ibv_cq_ex *current);
    /* later readers (completion timestamps, cvlan, flow tag, ...) are never called and not declared */
};

#include "verbs_abi_members.h"

#endif
