/*
 * transportd device API: the 48-byte command record, as six 64-bit words.
 *
 * The layout itself lives in <transportd/cmd_ring.h> (shared with the C/Python host side and checked
 * against cmd_ring/record.py by a probe test); this header only packs fields into the words the push
 * stores, little-endian as the host reads them:
 *
 *   word 0  | seq:u32            | opcode:u8 | flags:u8 | peer:u16 |   header, committed last
 *   word 1  | src_off:u64                                           |
 *   word 2  | dst_off:u64                                           |
 *   word 3  | length:u32         | src_region:u16 | dst_region:u16  |
 *   word 4  | chunk_id:u32       | signal_slot:u32                  |
 *   word 5  | signal_value:u64                                      |
 */
#ifndef TRANSPORTD_COMMAND_CUH
#define TRANSPORTD_COMMAND_CUH

#include <transportd/device.cuh>
#include <transportd/errors.cuh>

namespace tpd {

/** What a record asks the proxy for (cmd_ring.h TPD_OP_*; 0 is never valid). */
enum class Opcode : uint8_t {
    Put = TPD_OP_PUT,
    PutSignal = TPD_OP_PUT_SIGNAL,
    Signal = TPD_OP_SIGNAL,
    Fence = TPD_OP_FENCE,
    Quiet = TPD_OP_QUIET,
};

/** How a signal updates the peer's flag: add the value (monotonic counters) or store it. */
enum class SignalOp : uint8_t {
    Add = 0,
    Set = TPD_FLAG_SIGNAL_SET,
};

/**
 * When the proxy posts a command: with its connection's batch (once batch_max commands have gathered, or
 * proxy.poll_window_us after the batch's first, or at a QUIET or FENCE), or at once, closing the batch and
 * posting the commands before it with it (TPD_FLAG_NO_BATCH): for the last record of a burst a reader
 * waits on, which would otherwise wait out the window.
 */
enum class Post : uint8_t {
    Batched = 0,
    Now = TPD_FLAG_NO_BATCH,
};

/** A record's flags byte: how its signal updates the flag (a PUT's is Add: no bit), and when it is posted. */
TPD_HOST_DEVICE uint8_t record_flags(SignalOp op, Post post) { return (uint8_t)((uint8_t)op | (uint8_t)post); }

/** A record's five body words (1..5); the header word is built at commit time, when seq is known. */
struct Body {
    uint64_t w1, w2, w3, w4, w5;
};

/** seq stamp of absolute ring position ``pos``: (pos mod 2^32-1) + 1, never 0 (cmd_ring.h). */
TPD_HOST_DEVICE uint32_t seq_for(uint64_t pos) { return (uint32_t)(pos % 0xFFFFFFFFull) + 1u; }

/** Header word 0: seq | opcode << 32 | flags << 40 | peer << 48. */
TPD_HOST_DEVICE uint64_t header_word(uint32_t seq, uint8_t opcode, uint8_t flags, uint16_t peer) {
    return (uint64_t)seq | ((uint64_t)opcode << 32) | ((uint64_t)flags << 40) | ((uint64_t)peer << 48);
}

TPD_HOST_DEVICE Body make_body(uint64_t src_off, uint64_t dst_off, uint32_t length, uint16_t src_region,
                               uint16_t dst_region, uint32_t chunk_id, uint32_t signal_slot,
                               uint64_t signal_value) {
    Body b;
    b.w1 = src_off;
    b.w2 = dst_off;
    b.w3 = (uint64_t)length | ((uint64_t)src_region << 32) | ((uint64_t)dst_region << 48);
    b.w4 = (uint64_t)chunk_id | ((uint64_t)signal_slot << 32);
    b.w5 = signal_value;
    return b;
}

}  // namespace tpd

#endif /* TRANSPORTD_COMMAND_CUH */
