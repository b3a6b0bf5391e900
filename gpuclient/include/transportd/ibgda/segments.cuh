/*
 * transportd ibgda: the mlx5 send-WQE segments (rdma-core providers/mlx5/mlx5dv.h), field for field.
 *
 * A send WQE is a sequence of 16-byte segments in 64-byte basic blocks (WQEBBs). ds, in the control
 * segment, counts the WQE's 16-byte units; the send queue counts WQEBBs. Every multi-byte field is
 * big-endian (fields named *_be hold the swapped value; build them with be16/be32/be64). Byte offsets
 * below are from the start of each segment. The Python twin is ibgda/mlx5_layout.py; a probe test
 * compiles this header and checks every size and offset against it.
 *
 * The WQEs transportd posts (all RC, all one WQEBB):
 *
 *   RDMA write          ctrl | raddr | data                   ds 3   48 of 64 bytes
 *   RDMA write, inline  ctrl | raddr | inline hdr + 8 bytes   ds 3   44 of 64 bytes (a flag value)
 *   RDMA read           ctrl | raddr | data                   ds 3   (0 bytes: ctrl | raddr, ds 2)
 *   fetch-and-add       ctrl | raddr | atomic | data          ds 4   64 of 64 bytes
 *   NOP                 ctrl                                  ds 1
 */
#ifndef TRANSPORTD_IBGDA_SEGMENTS_CUH
#define TRANSPORTD_IBGDA_SEGMENTS_CUH

#include <transportd/ibgda/endian.cuh>

namespace tpd {
namespace ibgda {

/** mlx5 send opcodes (MLX5_OPCODE_*), the low byte of the control segment's first word. */
enum class Mlx5Opcode : uint8_t {
    Nop = 0x00,
    RdmaWrite = 0x08,
    RdmaWriteImm = 0x09,
    Send = 0x0a,
    RdmaRead = 0x10,
    AtomicCompareSwap = 0x11,
    AtomicFetchAdd = 0x12,
};

/* fm_ce_se, byte 11 of the control segment (MLX5_WQE_CTRL_*):
 *   bits 7..5  fm   fence mode: 4 = fence (what IBV_SEND_FENCE maps to), 1 = initiator small fence
 *   bits 3..2  ce   completion: 2 = always write a CQE (IBV_SEND_SIGNALED); 0 = a CQE on error only
 *   bit  1     se   solicited event */
constexpr uint8_t kCtrlFence = 4u << 5;        /* MLX5_WQE_CTRL_FENCE */
constexpr uint8_t kCtrlSmallFence = 1u << 5;   /* MLX5_WQE_CTRL_INITIATOR_SMALL_FENCE */
constexpr uint8_t kCtrlCqUpdate = 2u << 2;     /* MLX5_WQE_CTRL_CQ_UPDATE */
constexpr uint8_t kCtrlSolicited = 1u << 1;    /* MLX5_WQE_CTRL_SOLICITED */

constexpr uint32_t kWqeBasicBlock = 64;        /* MLX5_SEND_WQE_BB */
constexpr uint32_t kInlineSeg = 0x80000000u;   /* MLX5_INLINE_SEG: byte_count flag of an inline segment */
constexpr uint32_t kSendDbr = 1;               /* MLX5_SND_DBR: the send counter's word in the QP dbrec */
constexpr uint32_t kRecvDbr = 0;               /* MLX5_RCV_DBR */

/*
 * Control segment (struct mlx5_wqe_ctrl_seg), 16 bytes:
 *
 *   bytes  0..3   | opmod:u8 | wqe_index:u16 | opcode:u8 |   opmod_idx_opcode_be
 *   bytes  4..7   | qpn:u24                  | ds:u8     |   qpn_ds_be (ds: low 6 bits, 16-byte units)
 *   bytes  8..11  | signature:u8 | stream_id:u16 (DCI only) | fm_ce_se:u8 |
 *   bytes 12..15  | imm:u32 (immediate / invalidation key; 0 here)  |
 *
 * wqe_index is the WQEBB counter of the WQE's first block, mod 2^16. The first 8 bytes are also what
 * the doorbell carries.
 */
struct CtrlSeg {
    uint32_t opmod_idx_opcode_be;
    uint32_t qpn_ds_be;
    uint8_t signature;
    uint8_t stream_id_be[2];
    uint8_t fm_ce_se;
    uint32_t imm_be;
};
TPD_STATIC_ASSERT(sizeof(CtrlSeg) == 16, "mlx5 control segment is 16 bytes");
TPD_STATIC_ASSERT_OFFSET(offsetof(CtrlSeg, opmod_idx_opcode_be) == 0, "opmod_idx_opcode at 0");
TPD_STATIC_ASSERT_OFFSET(offsetof(CtrlSeg, qpn_ds_be) == 4, "qpn_ds at 4");
TPD_STATIC_ASSERT_OFFSET(offsetof(CtrlSeg, signature) == 8, "signature at 8");
TPD_STATIC_ASSERT_OFFSET(offsetof(CtrlSeg, stream_id_be) == 9, "dci_stream_channel_id at 9");
TPD_STATIC_ASSERT_OFFSET(offsetof(CtrlSeg, fm_ce_se) == 11, "fm_ce_se at 11");
TPD_STATIC_ASSERT_OFFSET(offsetof(CtrlSeg, imm_be) == 12, "imm at 12");

/*
 * Remote-address segment (struct mlx5_wqe_raddr_seg), 16 bytes:
 *
 *   bytes  0..7   | raddr:u64                      |
 *   bytes  8..15  | rkey:u32        | reserved:u32 |
 */
struct RaddrSeg {
    uint64_t raddr_be;
    uint32_t rkey_be;
    uint32_t reserved;
};
TPD_STATIC_ASSERT(sizeof(RaddrSeg) == 16, "mlx5 remote-address segment is 16 bytes");
TPD_STATIC_ASSERT_OFFSET(offsetof(RaddrSeg, raddr_be) == 0, "raddr at 0");
TPD_STATIC_ASSERT_OFFSET(offsetof(RaddrSeg, rkey_be) == 8, "rkey at 8");
TPD_STATIC_ASSERT_OFFSET(offsetof(RaddrSeg, reserved) == 12, "reserved at 12");

/*
 * Data (scatter/gather pointer) segment (struct mlx5_wqe_data_seg), 16 bytes:
 *
 *   bytes  0..7   | byte_count:u32  | lkey:u32     |   byte_count 0 means 2^31 bytes, not 0: a
 *   bytes  8..15  | addr:u64                       |   zero-length transfer carries no data segment
 */
struct DataSeg {
    uint32_t byte_count_be;
    uint32_t lkey_be;
    uint64_t addr_be;
};
TPD_STATIC_ASSERT(sizeof(DataSeg) == 16, "mlx5 data segment is 16 bytes");
TPD_STATIC_ASSERT_OFFSET(offsetof(DataSeg, byte_count_be) == 0, "byte_count at 0");
TPD_STATIC_ASSERT_OFFSET(offsetof(DataSeg, lkey_be) == 4, "lkey at 4");
TPD_STATIC_ASSERT_OFFSET(offsetof(DataSeg, addr_be) == 8, "addr at 8");

/*
 * Inline-data segment (struct mlx5_wqe_inl_data_seg) carrying one 8-byte flag value, 16 bytes:
 *
 *   bytes  0..3   | byte_count:u32 = 8 | MLX5_INLINE_SEG   |
 *   bytes  4..11  | data: the 8 bytes, in the order they land in remote memory (a little-endian u64:
 *                 |   NOT byte-swapped — the NIC copies them, it does not interpret them)
 *   bytes 12..15  | padding to the 16-byte unit (ds counts ceil((4 + 8) / 16) = 1 unit)
 *
 * data starts 4 bytes into the segment, so it is only 4-byte aligned: store it as two 32-bit words.
 */
struct InlineSeg8 {
    uint32_t byte_count_be;
    uint32_t data[2];
    uint32_t pad;
};
TPD_STATIC_ASSERT(sizeof(InlineSeg8) == 16, "inline segment with 8 bytes of data is one 16-byte unit");
TPD_STATIC_ASSERT_OFFSET(offsetof(InlineSeg8, byte_count_be) == 0, "inline byte_count at 0");
TPD_STATIC_ASSERT_OFFSET(offsetof(InlineSeg8, data) == 4, "inline data at 4");

/*
 * Atomic segment (struct mlx5_wqe_atomic_seg), 16 bytes:
 *
 *   bytes  0..7   | swap_add:u64   the addend of a fetch-and-add (the swap value of a compare-swap) |
 *   bytes  8..15  | compare:u64    0 for fetch-and-add                                             |
 */
struct AtomicSeg {
    uint64_t swap_add_be;
    uint64_t compare_be;
};
TPD_STATIC_ASSERT(sizeof(AtomicSeg) == 16, "mlx5 atomic segment is 16 bytes");
TPD_STATIC_ASSERT_OFFSET(offsetof(AtomicSeg, swap_add_be) == 0, "swap_add at 0");
TPD_STATIC_ASSERT_OFFSET(offsetof(AtomicSeg, compare_be) == 8, "compare at 8");

/** Any 16-byte segment after the control segment. */
union Seg16 {
    RaddrSeg raddr;
    DataSeg data;
    InlineSeg8 inl;
    AtomicSeg atomic;
    uint32_t words[4];
};
TPD_STATIC_ASSERT(sizeof(Seg16) == 16, "a segment is 16 bytes");

/*
 * One WQE basic block, as transportd builds it (every WQE it posts fits one):
 *
 *   bytes  0..15  | ctrl       |
 *   bytes 16..31  | seg[0]     |   raddr
 *   bytes 32..47  | seg[1]     |   data, inline or atomic
 *   bytes 48..63  | seg[2]     |   data after an atomic, else zero
 */
struct alignas(16) Wqe {
    CtrlSeg ctrl;
    Seg16 seg[3];
};
TPD_STATIC_ASSERT(sizeof(Wqe) == kWqeBasicBlock, "a WQE basic block is 64 bytes");
TPD_STATIC_ASSERT_OFFSET(offsetof(Wqe, seg) == 16, "first segment after ctrl at 16");

/** Byte offset, in a WQEBB, of an inline flag value (ctrl, raddr, inline byte_count). */
constexpr uint32_t kInlineDataOffset = 16 + 16 + 4;
/** Byte offset, in a WQEBB, of fm_ce_se. */
constexpr uint32_t kFmCeSeOffset = 11;

}  // namespace ibgda
}  // namespace tpd

#endif /* TRANSPORTD_IBGDA_SEGMENTS_CUH */
