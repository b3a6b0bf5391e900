/*
 * transportd device API: the Channel handle and the operations a kernel issues through it.
 *
 * A Channel is a plain struct passed to the kernel by value (64 bytes). The host object that owns the
 * memory (gpuclient's ChannelHandle.device_handle()) fills it; gpuclient.device_channel.CHANNEL_DTYPE
 * mirrors it byte for byte and a test compiles a probe to check every offset:
 *
 *   word 0  | records:u64   device address of ring slot 0 (ring file, mapped pinned host memory)  |
 *   word 1  | control:u64   device address of the ring's control page (credits, QUIET, errors)    |
 *   word 2  | head:u64      device address of the slot-claim counter (device memory)              |
 *   word 3  | credit:u64    device address of the cached consumer position (device memory)        |
 *   word 4  | capacity:u32 (power of two)   | abi:u32 (TPD_CHANNEL_ABI)                           |
 *   word 5  | flags:u64     device address of this rank's flag words (device or mapped host)      |
 *   word 6  | flag_count:u32                | rank:u32                                            |
 *   word 7  | world:u32                     | id:u32 (the daemon's channel id)                    |
 *
 * Every operation below is one push of one record (see ring_device.cuh for the protocol), except
 * wait (a flag poll), quiet (a push, then a poll of the proxy's completion position) and status
 * (one load of the error word). The proxy validates every record; a bad one is not posted and its
 * ErrorCode lands in the error word, which tpd::status reads: kernels never crash the daemon.
 */
#ifndef TRANSPORTD_CHANNEL_DEVICE_CUH
#define TRANSPORTD_CHANNEL_DEVICE_CUH

#include <transportd/command.cuh>
#include <transportd/ring_device.cuh>
#include <transportd/signal_device.cuh>

/** Bumped whenever the Channel layout changes; the host refuses to build a handle of another ABI. */
#define TPD_CHANNEL_ABI 1u
#define TPD_CHANNEL_SIZE 64

namespace tpd {

struct Channel {
    RingDevice ring;
    uint64_t* flags;
    uint32_t flag_count;
    uint32_t rank;
    uint32_t world;
    uint32_t id;
};
TPD_STATIC_ASSERT(sizeof(Channel) == TPD_CHANNEL_SIZE, "tpd::Channel is eight 8-byte words");
TPD_STATIC_ASSERT(alignof(Channel) == 8, "tpd::Channel is 8-byte aligned");
TPD_STATIC_ASSERT_OFFSET(offsetof(Channel, ring) == 0, "ring at 0");
TPD_STATIC_ASSERT_OFFSET(offsetof(Channel, flags) == 40, "flags at 40");
TPD_STATIC_ASSERT_OFFSET(offsetof(Channel, flag_count) == 48, "flag_count at 48");
TPD_STATIC_ASSERT_OFFSET(offsetof(Channel, rank) == 52, "rank at 52");
TPD_STATIC_ASSERT_OFFSET(offsetof(Channel, world) == 56, "world at 56");
TPD_STATIC_ASSERT_OFFSET(offsetof(Channel, id) == 60, "id at 60");

#if defined(__CUDACC__)

namespace detail {
/** The record's peer field is 16 bits: a rank that does not fit becomes 0xFFFF, which the proxy refuses. */
TPD_DEVICE uint16_t peer_field(uint32_t peer) { return peer > 0xFFFFu ? (uint16_t)0xFFFFu : (uint16_t)peer; }
}  // namespace detail

/** Write ``bytes`` from our ``src_region`` at ``src_off`` to ``peer``'s ``dst_region`` at ``dst_off``. ``post``: with
 * the connection's batch, or at once (command.cuh's Post), as for every call below. */
TPD_DEVICE void put(const Channel& ch, uint32_t peer, uint16_t dst_region, uint64_t dst_off, uint16_t src_region,
                    uint64_t src_off, uint32_t bytes, uint32_t chunk_id = 0, Post post = Post::Batched) {
    push(ch.ring, Opcode::Put, record_flags(SignalOp::Add, post), detail::peer_field(peer),
         make_body(src_off, dst_off, bytes, src_region, dst_region, chunk_id, 0, 0));
}

/**
 * Warp-cooperative put: the lanes of a warp call it together, each with its own arguments, and those with
 * ``active`` push one PUT each for one atomicAdd and one system-scope release per warp (warp_push). Same
 * convergence rule as warp_put_signal. Returns the lane's ring position, or kNoPosition if inactive.
 */
TPD_DEVICE uint64_t warp_put(const Channel& ch, bool active, uint32_t peer, uint16_t dst_region, uint64_t dst_off,
                             uint16_t src_region, uint64_t src_off, uint32_t bytes, uint32_t chunk_id = 0,
                             Post post = Post::Batched) {
    return warp_push(ch.ring, active, Opcode::Put, record_flags(SignalOp::Add, post), detail::peer_field(peer),
                     make_body(src_off, dst_off, bytes, src_region, dst_region, chunk_id, 0, 0));
}

/** put, then update ``peer``'s flag ``slot`` (add or set ``value``) once the payload is placed there. */
TPD_DEVICE void put_signal(const Channel& ch, uint32_t peer, uint16_t dst_region, uint64_t dst_off,
                           uint16_t src_region, uint64_t src_off, uint32_t bytes, uint32_t slot, uint64_t value,
                           SignalOp op = SignalOp::Add, Post post = Post::Batched) {
    push(ch.ring, Opcode::PutSignal, record_flags(op, post), detail::peer_field(peer),
         make_body(src_off, dst_off, bytes, src_region, dst_region, 0, slot, value));
}

/**
 * Warp-cooperative put_signal: the lanes of a warp call it together, each with its own arguments, and
 * those with ``active`` push one PUT_SIGNAL each for one atomicAdd and one system-scope release per warp
 * (ring_device.cuh's warp_push). Inactive lanes push nothing. Every lane that reaches the call must be
 * converged with the others (call it outside lane-divergent branches; pass the branch as ``active``).
 */
TPD_DEVICE uint64_t warp_put_signal(const Channel& ch, bool active, uint32_t peer, uint16_t dst_region,
                                    uint64_t dst_off, uint16_t src_region, uint64_t src_off, uint32_t bytes,
                                    uint32_t slot, uint64_t value, SignalOp op = SignalOp::Add,
                                    Post post = Post::Batched) {
    return warp_push(ch.ring, active, Opcode::PutSignal, record_flags(op, post), detail::peer_field(peer),
                     make_body(src_off, dst_off, bytes, src_region, dst_region, 0, slot, value));
}

/** Update ``peer``'s flag ``slot`` after every earlier command of this channel to ``peer`` is placed. */
TPD_DEVICE void signal(const Channel& ch, uint32_t peer, uint32_t slot, uint64_t value,
                       SignalOp op = SignalOp::Add, Post post = Post::Batched) {
    push(ch.ring, Opcode::Signal, record_flags(op, post), detail::peer_field(peer),
         make_body(0, 0, 0, 0, 0, 0, slot, value));
}

/** Wait until this rank's flag ``slot`` reaches ``at_least`` (wraparound-safe, acquire); returns the value seen. */
TPD_DEVICE uint64_t wait(const Channel& ch, uint32_t slot, uint64_t at_least) {
    TPD_DEVICE_CHECK(ch.flags != nullptr, "tpd::wait: the channel has no flags (call session.flags first)");
    TPD_DEVICE_CHECK(slot < ch.flag_count, "tpd::wait: flag slot out of range");
    return wait_until(ch.flags + slot, at_least);
}

/** One thread of the block waits for the flag, then the whole block proceeds (a barrier). */
TPD_DEVICE void block_wait(const Channel& ch, uint32_t slot, uint64_t at_least) {
    if (threadIdx.x == 0 && threadIdx.y == 0 && threadIdx.z == 0) wait(ch, slot, at_least);
    __syncthreads();
}

/** Later commands of this channel to ``peer`` are delivered after earlier ones are placed. */
TPD_DEVICE void fence(const Channel& ch, uint32_t peer) {
    push(ch.ring, Opcode::Fence, 0, detail::peer_field(peer), make_body(0, 0, 0, 0, 0, 0, 0, 0));
}

/**
 * Wait until every command pushed on this channel before this call has completed locally (the source
 * buffers may be reused). Pushes a QUIET record and waits for the proxy's completion position to pass
 * it; bad records count as complete, so read tpd::status afterwards.
 */
TPD_DEVICE void quiet(const Channel& ch) {
    uint64_t pos = push(ch.ring, Opcode::Quiet, 0, 0, make_body(0, 0, 0, 0, 0, 0, 0, 0));
    const uint64_t* done = control_word<uint64_t>(ch.ring, TPD_RING_OFF_COMPLETION_POS);
    TPD_SPIN_UNTIL(ordering::ld_acquire_sys(done) > pos);
}

/** The channel's error word: the ErrorCode of the lowest bad position (0 = every record so far accepted). */
TPD_DEVICE uint32_t status(const Channel& ch) {
    return ordering::ld_acquire_sys(control_word<uint32_t>(ch.ring, TPD_RING_OFF_ERROR_CODE));
}

/** How many records of this channel the proxy refused so far. */
TPD_DEVICE uint32_t error_count(const Channel& ch) {
    return ordering::ld_acquire_sys(control_word<uint32_t>(ch.ring, TPD_RING_OFF_ERROR_COUNT));
}

/** Lowest ring position of a refused or failed record (meaningful when status(ch) != 0). */
TPD_DEVICE uint64_t error_position(const Channel& ch) {
    return ordering::ld_acquire_sys(control_word<uint64_t>(ch.ring, TPD_RING_OFF_ERROR_POS));
}

#endif /* __CUDACC__ */

}  // namespace tpd

#endif /* TRANSPORTD_CHANNEL_DEVICE_CUH */
