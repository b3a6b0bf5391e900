/*
 * transportd command ring: the 48-byte record and the ring's shared-memory layout.
 *
 * Plain C99 that also compiles as CUDA. The Python twin is cmd_ring/record.py (RECORD_DTYPE) and
 * cmd_ring/ring.py (the control-word offsets); tests compile a probe against this header and compare
 * every size and offset with the Python definitions.
 *
 * Record (little-endian, 8-byte aligned):
 *
 *   word 0  | seq:u32            | opcode:u8 | flags:u8 | peer:u16 |   header, committed last
 *   word 1  | src_off:u64                                           |
 *   word 2  | dst_off:u64                                           |
 *   word 3  | length:u32         | src_region:u16 | dst_region:u16  |
 *   word 4  | chunk_id:u32       | signal_slot:u32                  |
 *   word 5  | signal_value:u64                                      |
 *
 * seq = (position mod (2^32 - 1)) + 1 for the record at absolute ring position `position`: never 0, and
 * a slot still holding an older lap's record never carries the seq the consumer expects.
 *
 * Commit protocol (header-last): write words 1..5, then publish word 0 with a release store at system
 * scope (st.release.sys, or __threadfence_system() then the store). The consumer reads word 0, checks
 * seq, then reads the body: it never sees a torn record.
 */
#ifndef TRANSPORTD_CMD_RING_H
#define TRANSPORTD_CMD_RING_H

#if defined(__CUDACC_RTC__)
/* NVRTC ships no C library headers: declare the fixed-width types as glibc does on LP64, and check
 * offsets only where offsetof is a constant expression (cc, nvcc); sizes are checked everywhere. */
typedef unsigned char uint8_t;
typedef unsigned short uint16_t;
typedef unsigned int uint32_t;
#if defined(__LP64__)
typedef unsigned long uint64_t;
#else
typedef unsigned long long uint64_t;
#endif
#define TPD_STATIC_ASSERT_OFFSET(cond, msg)
#else
#include <stddef.h>
#include <stdint.h>
#define TPD_STATIC_ASSERT_OFFSET(cond, msg) TPD_STATIC_ASSERT(cond, msg)
#endif

#if defined(__cplusplus)
#define TPD_STATIC_ASSERT(cond, msg) static_assert(cond, msg)
#else
#define TPD_STATIC_ASSERT(cond, msg) _Static_assert(cond, msg)
#endif

#define TPD_RECORD_SIZE 48

/* Opcodes: 0 is never valid, so an all-zero slot is never a command. */
#define TPD_OP_PUT 1
#define TPD_OP_PUT_SIGNAL 2
#define TPD_OP_SIGNAL 3
#define TPD_OP_FENCE 4
#define TPD_OP_QUIET 5

/* Flags. A signal ADDs signal_value unless TPD_FLAG_SIGNAL_SET asks for a store. */
#define TPD_FLAG_SIGNAL_SET 0x01
#define TPD_FLAG_NO_BATCH 0x02

typedef struct tpd_cmd_record {
    uint32_t seq;
    uint8_t opcode;
    uint8_t flags;
    uint16_t peer;
    uint64_t src_off;
    uint64_t dst_off;
    uint32_t length;
    uint16_t src_region;
    uint16_t dst_region;
    uint32_t chunk_id;
    uint32_t signal_slot;
    uint64_t signal_value;
} tpd_cmd_record;

TPD_STATIC_ASSERT(sizeof(tpd_cmd_record) == TPD_RECORD_SIZE, "command record must be 48 bytes");
TPD_STATIC_ASSERT_OFFSET(offsetof(tpd_cmd_record, seq) == 0, "seq at 0");
TPD_STATIC_ASSERT_OFFSET(offsetof(tpd_cmd_record, opcode) == 4, "opcode at 4");
TPD_STATIC_ASSERT_OFFSET(offsetof(tpd_cmd_record, flags) == 5, "flags at 5");
TPD_STATIC_ASSERT_OFFSET(offsetof(tpd_cmd_record, peer) == 6, "peer at 6");
TPD_STATIC_ASSERT_OFFSET(offsetof(tpd_cmd_record, src_off) == 8, "src_off at 8");
TPD_STATIC_ASSERT_OFFSET(offsetof(tpd_cmd_record, dst_off) == 16, "dst_off at 16");
TPD_STATIC_ASSERT_OFFSET(offsetof(tpd_cmd_record, length) == 24, "length at 24");
TPD_STATIC_ASSERT_OFFSET(offsetof(tpd_cmd_record, src_region) == 28, "src_region at 28");
TPD_STATIC_ASSERT_OFFSET(offsetof(tpd_cmd_record, dst_region) == 30, "dst_region at 30");
TPD_STATIC_ASSERT_OFFSET(offsetof(tpd_cmd_record, chunk_id) == 32, "chunk_id at 32");
TPD_STATIC_ASSERT_OFFSET(offsetof(tpd_cmd_record, signal_slot) == 36, "signal_slot at 36");
TPD_STATIC_ASSERT_OFFSET(offsetof(tpd_cmd_record, signal_value) == 40, "signal_value at 40");

/*
 * Ring file layout: a 4096-byte control page, then `capacity` records. Each control word that a
 * different party writes sits on its own 64-byte line so the writers never share a cache line.
 */
#define TPD_RING_MAGIC 0x31474E4952445054ull /* "TPDRING1" little-endian */
#define TPD_RING_VERSION 1u
#define TPD_RING_OFF_MAGIC 0          /* u64 */
#define TPD_RING_OFF_VERSION 8        /* u32 */
#define TPD_RING_OFF_RECORD_SIZE 12   /* u32 */
#define TPD_RING_OFF_CAPACITY 16      /* u64, a power of two */
#define TPD_RING_OFF_TOTAL_SIZE 24    /* u64, bytes of the whole file */
#define TPD_RING_OFF_CONSUMER_POS 64  /* u64, written by the consumer: records taken (credits) */
#define TPD_RING_OFF_PRODUCER_POS 128 /* u64, written by a host producer: records committed */
#define TPD_RING_OFF_COMPLETION_POS 192 /* u64, written by the proxy: QUIET completion position */
#define TPD_RING_OFF_ERROR_CODE 256   /* u32, the code of the bad record at ERROR_POS, 0 = none */
#define TPD_RING_OFF_ERROR_COUNT 260  /* u32, bad records seen */
#define TPD_RING_OFF_ERROR_POS 264    /* u64, lowest ring position of a bad record seen so far */
#define TPD_RING_RECORDS_OFFSET 4096

#endif /* TRANSPORTD_CMD_RING_H */
