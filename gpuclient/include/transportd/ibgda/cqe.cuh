/*
 * transportd ibgda: 64-byte completion queue entries (struct mlx5_cqe64 and struct mlx5_err_cqe in
 * rdma-core's mlx5dv.h) and how a poller decides one is new.
 *
 * Ownership (providers/mlx5/cq.c, get_sw_cqe): the CQ holds ncqes entries (a power of two); entry
 * ci & (ncqes - 1) belongs to software when its opcode is not MLX5_CQE_INVALID and its owner bit equals
 * the wrap parity of the consumer index, (ci & ncqes) != 0. The NIC writes the owner bit of each lap's
 * entries with that lap's parity; the host initialises every op_own to 0xf0 (opcode INVALID, as
 * rdma-core's mlx5 provider does), so nothing reads as ready before the NIC's first write, and an
 * entry left from the previous lap has the wrong parity.
 *
 * The poller reads the last 8 bytes (sop_drop_qpn, wqe_counter, signature, op_own) with one acquire
 * load: when op_own says "ready", the rest of the entry is visible too. The consumer index goes back to
 * the NIC through the CQ doorbell record (doorbell.cuh), so it can reuse the entries.
 */
#ifndef TRANSPORTD_IBGDA_CQE_CUH
#define TRANSPORTD_IBGDA_CQE_CUH

#include <transportd/ibgda/endian.cuh>

namespace tpd {
namespace ibgda {

/** CQE opcodes (MLX5_CQE_*), the high nibble of op_own. */
enum class CqeOpcode : uint8_t {
    Req = 0,       /* requester completion (our send queue) */
    RespWrImm = 1,
    RespSend = 2,
    ReqErr = 13,   /* requester completion with error: read it as ErrCqe64 */
    RespErr = 14,
    Invalid = 15,  /* never written by the NIC; the initial value */
};

/** Error syndromes of an ErrCqe64 (MLX5_CQE_SYNDROME_*). */
enum class Syndrome : uint8_t {
    None = 0x00,
    LocalLengthErr = 0x01,
    LocalQpOpErr = 0x02,      /* malformed WQE: bad opcode, ds, index or QPN */
    LocalProtErr = 0x04,      /* bad lkey or local bounds */
    WrFlushErr = 0x05,        /* the QP was already in error: the WQE was not executed */
    MwBindErr = 0x06,
    BadRespErr = 0x10,
    LocalAccessErr = 0x11,
    RemoteInvalReqErr = 0x12,
    RemoteAccessErr = 0x13,   /* the remote NIC refused the rkey, bounds or access */
    RemoteOpErr = 0x14,
    TransportRetryExcErr = 0x15,
    RnrRetryExcErr = 0x16,
    RemoteAbortedErr = 0x22,
};

/*
 * Successful CQE (struct mlx5_cqe64), 64 bytes; a requester CQE uses the fields marked *:
 *
 *   bytes  0..31  | receive-side fields (wqe_id, slid, flags_rqpn, ...) and tag matching |
 *   bytes 32..35  | srqn_uidx:u32                                                        |
 *   bytes 36..39  | imm_inval_pkey:u32                                                   |
 *   bytes 40..43  | app:u8 | app_op:u8 | app_info:u16                                    |
 *   bytes 44..47  | byte_cnt:u32 *   (bytes of a read; 8 for an atomic)                   |
 *   bytes 48..55  | timestamp:u64                                                        |
 *   bytes 56..59  | sop_drop_qpn:u32 *   (WQE opcode << 24 | qpn)                         |
 *   bytes 60..63  | wqe_counter:u16 * | signature:u8 | op_own:u8 * (opcode << 4 | ... | owner) |
 */
struct Cqe64 {
    uint8_t rsvd0[32];
    uint32_t srqn_uidx_be;
    uint32_t imm_inval_pkey_be;
    uint8_t app;
    uint8_t app_op;
    uint16_t app_info_be;
    uint32_t byte_cnt_be;
    uint64_t timestamp_be;
    uint32_t sop_drop_qpn_be;
    uint16_t wqe_counter_be;
    uint8_t signature;
    uint8_t op_own;
};
TPD_STATIC_ASSERT(sizeof(Cqe64) == 64, "mlx5 CQE is 64 bytes");
TPD_STATIC_ASSERT_OFFSET(offsetof(Cqe64, srqn_uidx_be) == 32, "srqn_uidx at 32");
TPD_STATIC_ASSERT_OFFSET(offsetof(Cqe64, byte_cnt_be) == 44, "byte_cnt at 44");
TPD_STATIC_ASSERT_OFFSET(offsetof(Cqe64, timestamp_be) == 48, "timestamp at 48");
TPD_STATIC_ASSERT_OFFSET(offsetof(Cqe64, sop_drop_qpn_be) == 56, "sop_drop_qpn at 56");
TPD_STATIC_ASSERT_OFFSET(offsetof(Cqe64, wqe_counter_be) == 60, "wqe_counter at 60");
TPD_STATIC_ASSERT_OFFSET(offsetof(Cqe64, signature) == 62, "signature at 62");
TPD_STATIC_ASSERT_OFFSET(offsetof(Cqe64, op_own) == 63, "op_own at 63");

/*
 * Error CQE (struct mlx5_err_cqe), the same 64 bytes read another way:
 *
 *   bytes  0..31  | reserved                                                |
 *   bytes 32..35  | srqn:u32                                                |
 *   bytes 36..53  | reserved                                                |
 *   bytes 54..55  | vendor_err_synd:u8 | syndrome:u8                        |
 *   bytes 56..59  | s_wqe_opcode_qpn:u32   (WQE opcode << 24 | qpn)         |
 *   bytes 60..63  | wqe_counter:u16 | signature:u8 | op_own:u8              |
 */
struct ErrCqe64 {
    uint8_t rsvd0[32];
    uint32_t srqn_be;
    uint8_t rsvd1[18];
    uint8_t vendor_err_synd;
    uint8_t syndrome;
    uint32_t s_wqe_opcode_qpn_be;
    uint16_t wqe_counter_be;
    uint8_t signature;
    uint8_t op_own;
};
TPD_STATIC_ASSERT(sizeof(ErrCqe64) == 64, "mlx5 error CQE is 64 bytes");
TPD_STATIC_ASSERT_OFFSET(offsetof(ErrCqe64, srqn_be) == 32, "srqn at 32");
TPD_STATIC_ASSERT_OFFSET(offsetof(ErrCqe64, vendor_err_synd) == 54, "vendor_err_synd at 54");
TPD_STATIC_ASSERT_OFFSET(offsetof(ErrCqe64, syndrome) == 55, "syndrome at 55");
TPD_STATIC_ASSERT_OFFSET(offsetof(ErrCqe64, s_wqe_opcode_qpn_be) == 56, "s_wqe_opcode_qpn at 56");
TPD_STATIC_ASSERT_OFFSET(offsetof(ErrCqe64, wqe_counter_be) == 60, "wqe_counter at 60");
TPD_STATIC_ASSERT_OFFSET(offsetof(ErrCqe64, op_own) == 63, "op_own at 63");

/** What every CQ entry holds before the NIC's first write (opcode INVALID << 4). */
constexpr uint8_t kCqeInitialOpOwn = 0xf0;

TPD_HOST_DEVICE uint8_t cqe_opcode(uint8_t op_own) { return (uint8_t)(op_own >> 4); }
TPD_HOST_DEVICE uint8_t cqe_owner(uint8_t op_own) { return (uint8_t)(op_own & 1u); }

/** Does the entry at consumer index ``ci`` of an ``ncqes``-entry CQ hold a new CQE? */
TPD_HOST_DEVICE bool cqe_ready(uint8_t op_own, uint64_t ci, uint32_t ncqes) {
    return cqe_opcode(op_own) != (uint8_t)CqeOpcode::Invalid && cqe_owner(op_own) == ((ci & ncqes) ? 1u : 0u);
}

/** The fields a requester reads from a CQE, decoded from its last 16 bytes (two little-endian u64). */
struct CqeView {
    uint16_t wqe_counter;   /* first WQEBB of the completed WQE, mod 2^16 */
    uint8_t opcode;         /* CqeOpcode */
    uint8_t owner;
    uint8_t wqe_opcode;     /* Mlx5Opcode of the completed WQE */
    uint8_t syndrome;       /* ReqErr only */
    uint8_t vendor_err;     /* ReqErr only */
    uint32_t qpn;
};

/** Decode from ``tail`` = bytes 56..63 and ``mid`` = bytes 48..55, each loaded as a little-endian u64. */
TPD_HOST_DEVICE CqeView cqe_view(uint64_t tail, uint64_t mid) {
    CqeView v;
    uint32_t opqpn = be32((uint32_t)tail);
    v.wqe_counter = be16((uint16_t)(tail >> 32));
    v.opcode = cqe_opcode((uint8_t)(tail >> 56));
    v.owner = cqe_owner((uint8_t)(tail >> 56));
    v.wqe_opcode = (uint8_t)(opqpn >> 24);
    v.qpn = opqpn & 0xffffffu;
    bool err = v.opcode == (uint8_t)CqeOpcode::ReqErr || v.opcode == (uint8_t)CqeOpcode::RespErr;
    v.syndrome = err ? (uint8_t)(mid >> 56) : 0u;
    v.vendor_err = err ? (uint8_t)(mid >> 48) : 0u;
    return v;
}

}  // namespace ibgda
}  // namespace tpd

#endif /* TRANSPORTD_IBGDA_CQE_CUH */
