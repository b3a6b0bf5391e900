/*
 * transportd device API: chunk plans — which compute tiles make up which network chunk, where each chunk
 * goes, and which incoming chunks cover a byte range.
 *
 * A tpd::Plan is a plain handle passed to the kernel by value (96 bytes). gpuclient.ChunkPlan builds it on
 * the host from one distributed buffer's shape (templates: all-gather, reduce-scatter, all-to-all with
 * variable counts, ring pass-along); gpuclient.plan.PLAN_DTYPE and the table dtypes mirror it byte for
 * byte, and a probe test checks every offset. The tables live in device memory; the plan only points:
 *
 *   word 0  | chunks:u64      PlanChunk[chunk_count]: this rank's outgoing chunks (source side)         |
 *   word 1  | sends:u64       PlanSend[send_count]: chunk c's sends are sends[first_send, +send_count)  |
 *   word 2  | recvs:u64       PlanRecv[recv_count]: incoming chunks, by source rank, then by offset     |
 *   word 3  | tile_chunk:u64  u32[tile_count]: the one chunk each compute tile belongs to              |
 *   word 4  | recv_index:u64  u32[world + 1]: rank r's incoming chunks are recvs[idx[r], idx[r+1])     |
 *   word 5  | counters:u64    u32[chunk_count]: tile arrivals per chunk (device memory, monotonic)     |
 *   word 6  | epoch:u64       the launch number, from 1: a chunk of launch k has raised its flag to k*v |
 *   word 7  | tile_count:u32 | chunk_count:u32                                                         |
 *   word 8  | send_count:u32 | recv_count:u32                                                          |
 *   word 9  | rank:u32       | world:u32                                                               |
 *   word 10 | abi:u32        | slot_base:u32 (the first flag slot the plan uses)                       |
 *   word 11 | slot_count:u32 | reserved:u32                                                            |
 *
 * Three granularities stay independent (mKernel): a tile is what the kernel computes at once, a chunk is
 * what travels as one put_signal (a whole number of the producer's tiles, by tile_chunk), and the proxy's
 * batch is the daemon's. The consumer's own tiles need not align with chunks: tpd::wait_range waits for
 * every chunk that intersects a byte range, so a token that straddles two chunks waits for both.
 *
 * Epochs come from the monotonic flags: every send adds its ``value`` to the receiver's slot once per
 * launch, so launch k (plan.epoch == k) waits for k * value and nothing is reset between launches. The
 * per-chunk tile counters are monotonic as well: the last of ``tiles`` arrivals of a round ships the chunk.
 *
 * Everything here takes the channel as a template parameter, so it runs on the proxy path (tpd::Channel)
 * and on the IBGDA path (tpd::IbgdaChannel) alike; the table lookups are host + device, so the CPU tests
 * compile this header with a recording channel and check it against the host plan.
 */
#ifndef TRANSPORTD_PLAN_DEVICE_CUH
#define TRANSPORTD_PLAN_DEVICE_CUH

#include <transportd/device.cuh>
#include <transportd/ordering.cuh>
#include <transportd/signal_device.cuh>

/** Bumped whenever Plan, PlanChunk, PlanSend or PlanRecv change; the host refuses another ABI. */
#define TPD_PLAN_ABI 1u
#define TPD_PLAN_SIZE 96

namespace tpd {

/** One outgoing chunk: a byte range of a local region, complete once ``tiles`` tiles arrived (24 bytes). */
struct PlanChunk {
    uint64_t src_off;     // byte offset in src_region
    uint32_t bytes;       // chunk length (> 0)
    uint32_t tiles;       // tiles that belong to this chunk (tile_chunk entries naming it)
    uint32_t first_send;  // index of its first PlanSend
    uint16_t send_count;  // destinations of this chunk (0: nowhere to go, e.g. an empty all-to-all cell)
    uint16_t src_region;  // local region id
};
TPD_STATIC_ASSERT(sizeof(PlanChunk) == 24, "PlanChunk is 24 bytes");
TPD_STATIC_ASSERT_OFFSET(offsetof(PlanChunk, src_off) == 0, "src_off at 0");
TPD_STATIC_ASSERT_OFFSET(offsetof(PlanChunk, bytes) == 8, "bytes at 8");
TPD_STATIC_ASSERT_OFFSET(offsetof(PlanChunk, tiles) == 12, "tiles at 12");
TPD_STATIC_ASSERT_OFFSET(offsetof(PlanChunk, first_send) == 16, "first_send at 16");
TPD_STATIC_ASSERT_OFFSET(offsetof(PlanChunk, send_count) == 20, "send_count at 20");
TPD_STATIC_ASSERT_OFFSET(offsetof(PlanChunk, src_region) == 22, "src_region at 22");

/** One destination of a chunk: the peer's region and offset, and the flag it raises there (24 bytes). */
struct PlanSend {
    uint64_t dst_off;     // byte offset in the peer's dst_region
    uint32_t slot;        // the peer's flag slot, raised by ``value`` once the bytes are placed
    uint32_t value;       // the ADD per launch (the receiver's PlanRecv.value)
    uint16_t peer;        // destination rank
    uint16_t dst_region;  // the peer's region id
    uint32_t chunk_id;    // the chunk's number in the plan, for diagnostics (put_signal records carry 0)
};
TPD_STATIC_ASSERT(sizeof(PlanSend) == 24, "PlanSend is 24 bytes");
TPD_STATIC_ASSERT_OFFSET(offsetof(PlanSend, dst_off) == 0, "dst_off at 0");
TPD_STATIC_ASSERT_OFFSET(offsetof(PlanSend, slot) == 8, "slot at 8");
TPD_STATIC_ASSERT_OFFSET(offsetof(PlanSend, value) == 12, "value at 12");
TPD_STATIC_ASSERT_OFFSET(offsetof(PlanSend, peer) == 16, "peer at 16");
TPD_STATIC_ASSERT_OFFSET(offsetof(PlanSend, dst_region) == 18, "dst_region at 18");
TPD_STATIC_ASSERT_OFFSET(offsetof(PlanSend, chunk_id) == 20, "chunk_id at 20");

/** One incoming chunk: where it lands in the local receive region and the flag that says so (24 bytes). */
struct PlanRecv {
    uint64_t off;      // byte offset in the local receive region
    uint32_t bytes;    // chunk length
    uint32_t slot;     // local flag slot
    uint32_t value;    // the sender's ADD per launch: launch k waits for k * value
    uint32_t source;   // the sending rank
};
TPD_STATIC_ASSERT(sizeof(PlanRecv) == 24, "PlanRecv is 24 bytes");
TPD_STATIC_ASSERT_OFFSET(offsetof(PlanRecv, off) == 0, "off at 0");
TPD_STATIC_ASSERT_OFFSET(offsetof(PlanRecv, bytes) == 8, "bytes at 8");
TPD_STATIC_ASSERT_OFFSET(offsetof(PlanRecv, slot) == 12, "slot at 12");
TPD_STATIC_ASSERT_OFFSET(offsetof(PlanRecv, value) == 16, "value at 16");
TPD_STATIC_ASSERT_OFFSET(offsetof(PlanRecv, source) == 20, "source at 20");

struct Plan {
    const PlanChunk* chunks;
    const PlanSend* sends;
    const PlanRecv* recvs;
    const uint32_t* tile_chunk;
    const uint32_t* recv_index;
    uint32_t* counters;
    uint64_t epoch;
    uint32_t tile_count;
    uint32_t chunk_count;
    uint32_t send_count;
    uint32_t recv_count;
    uint32_t rank;
    uint32_t world;
    uint32_t abi;
    uint32_t slot_base;
    uint32_t slot_count;
    uint32_t reserved;
};
TPD_STATIC_ASSERT(sizeof(Plan) == TPD_PLAN_SIZE, "tpd::Plan is twelve 8-byte words");
TPD_STATIC_ASSERT_OFFSET(offsetof(Plan, chunks) == 0, "chunks at 0");
TPD_STATIC_ASSERT_OFFSET(offsetof(Plan, sends) == 8, "sends at 8");
TPD_STATIC_ASSERT_OFFSET(offsetof(Plan, recvs) == 16, "recvs at 16");
TPD_STATIC_ASSERT_OFFSET(offsetof(Plan, tile_chunk) == 24, "tile_chunk at 24");
TPD_STATIC_ASSERT_OFFSET(offsetof(Plan, recv_index) == 32, "recv_index at 32");
TPD_STATIC_ASSERT_OFFSET(offsetof(Plan, counters) == 40, "counters at 40");
TPD_STATIC_ASSERT_OFFSET(offsetof(Plan, epoch) == 48, "epoch at 48");
TPD_STATIC_ASSERT_OFFSET(offsetof(Plan, tile_count) == 56, "tile_count at 56");
TPD_STATIC_ASSERT_OFFSET(offsetof(Plan, chunk_count) == 60, "chunk_count at 60");
TPD_STATIC_ASSERT_OFFSET(offsetof(Plan, send_count) == 64, "send_count at 64");
TPD_STATIC_ASSERT_OFFSET(offsetof(Plan, recv_count) == 68, "recv_count at 68");
TPD_STATIC_ASSERT_OFFSET(offsetof(Plan, rank) == 72, "rank at 72");
TPD_STATIC_ASSERT_OFFSET(offsetof(Plan, world) == 76, "world at 76");
TPD_STATIC_ASSERT_OFFSET(offsetof(Plan, abi) == 80, "abi at 80");
TPD_STATIC_ASSERT_OFFSET(offsetof(Plan, slot_base) == 84, "slot_base at 84");
TPD_STATIC_ASSERT_OFFSET(offsetof(Plan, slot_count) == 88, "slot_count at 88");
TPD_STATIC_ASSERT_OFFSET(offsetof(Plan, reserved) == 92, "reserved at 92");

/** A half-open index range of plan.recvs: the incoming chunks a wait covers. */
struct RecvSpan {
    uint32_t first;
    uint32_t end;
};

/**
 * The incoming chunks from ``rank`` that intersect [byte_off, byte_off + nbytes) of the receive region:
 * a binary search over that rank's chunks (sorted by offset, disjoint). An empty range covers nothing.
 */
TPD_HOST_DEVICE RecvSpan recv_span(const Plan& plan, uint32_t rank, uint64_t byte_off, uint64_t nbytes) {
    RecvSpan span = {0, 0};
    if (rank >= plan.world || nbytes == 0) return span;
    uint32_t lo = plan.recv_index[rank], hi = plan.recv_index[rank + 1];
    uint64_t end = byte_off + nbytes;
    // first chunk whose end lies past byte_off
    uint32_t a = lo, b = hi;
    while (a < b) {
        uint32_t mid = a + (b - a) / 2;
        if (plan.recvs[mid].off + plan.recvs[mid].bytes <= byte_off) a = mid + 1; else b = mid;
    }
    uint32_t first = a;
    // first chunk that starts at or past end
    b = hi;
    while (a < b) {
        uint32_t mid = a + (b - a) / 2;
        if (plan.recvs[mid].off < end) a = mid + 1; else b = mid;
    }
    span.first = first;
    span.end = a;
    return span;
}

/** The flag value incoming chunk ``i`` reaches once this launch's copy of it has arrived. */
TPD_HOST_DEVICE uint64_t recv_target(const Plan& plan, uint32_t i) {
    return plan.epoch * (uint64_t)plan.recvs[i].value;
}

/**
 * Wait (this thread only; acquire) for incoming chunk ``chunk`` of ``rank`` (its index among that rank's
 * chunks, in offset order). The channel's flags are the plan's flags.
 */
template <typename Ch>
TPD_HOST_DEVICE void wait_chunk_thread(const Ch& ch, const Plan& plan, uint32_t rank, uint32_t chunk) {
    uint32_t i = plan.recv_index[rank] + chunk;
    wait(ch, plan.recvs[i].slot, recv_target(plan, i));
}

/** Wait (this thread only; acquire) for every chunk from ``rank`` that intersects the byte range. */
template <typename Ch>
TPD_HOST_DEVICE void wait_range_thread(const Ch& ch, const Plan& plan, uint32_t rank, uint64_t byte_off,
                                       uint64_t nbytes) {
    RecvSpan span = recv_span(plan, rank, byte_off, nbytes);
    for (uint32_t i = span.first; i < span.end; ++i) wait(ch, plan.recvs[i].slot, recv_target(plan, i));
}

/**
 * Count one tile's arrival at its chunk (host + device: the CPU tests run it). Returns the chunk's index
 * when this call is the last of the chunk's ``tiles`` arrivals of a round (its caller ships the chunk),
 * else chunk_count. Release/acquire at GPU scope, as tpd::chunk_arrive: a fence orders this tile's stores
 * (this thread's, and the block's before the __syncthreads that precedes the call) before the count, and
 * the last arrival's second fence orders its pushes after every other tile's stores; the push's own
 * system-scope release then carries them to the proxy and the NIC. (One atom.acq_rel.gpu would do the
 * same for less, and gpuclient.triton counts that way; this form is the one verified on the H200.)
 */
TPD_HOST_DEVICE uint32_t tile_arrive(const Plan& plan, uint32_t tile) {
    uint32_t chunk = plan.tile_chunk[tile];
    uint32_t tiles = plan.chunks[chunk].tiles;
    ordering::fence_gpu();
    uint32_t old = ordering::fetch_add_relaxed_gpu(plan.counters + chunk, 1u);
    if ((old + 1u) % tiles != 0u) return plan.chunk_count;
    ordering::fence_gpu();
    return chunk;
}

/** Push every send of ``chunk`` (a put_signal each) on ``ch``. */
template <typename Ch>
TPD_HOST_DEVICE void ship_chunk(const Ch& ch, const Plan& plan, uint32_t chunk) {
    const PlanChunk& c = plan.chunks[chunk];
    for (uint32_t s = c.first_send; s < c.first_send + c.send_count; ++s) {
        const PlanSend& d = plan.sends[s];
        put_signal(ch, d.peer, d.dst_region, d.dst_off, c.src_region, c.src_off, c.bytes, d.slot, d.value);
    }
}

/**
 * One thread per tile, after the tile's stores (and a __syncthreads when several threads stored it): the
 * last tile of a chunk ships the chunk. Correct under any tile order and any number of blocks. Returns
 * true for the call that shipped.
 */
template <typename Ch>
TPD_HOST_DEVICE bool tile_done(const Ch& ch, const Plan& plan, uint32_t tile) {
    uint32_t chunk = tile_arrive(plan, tile);
    if (chunk == plan.chunk_count) return false;
    ship_chunk(ch, plan, chunk);
    return true;
}

#if defined(__CUDACC__)

/** Block-wide: thread 0 waits for incoming chunk ``chunk`` of ``rank``, then the whole block proceeds. */
template <typename Ch>
TPD_DEVICE void wait_chunk(const Ch& ch, const Plan& plan, uint32_t rank, uint32_t chunk) {
    if (threadIdx.x == 0 && threadIdx.y == 0 && threadIdx.z == 0) wait_chunk_thread(ch, plan, rank, chunk);
    __syncthreads();
}

/**
 * Block-wide: thread 0 waits for every chunk from ``rank`` that intersects [byte_off, byte_off + nbytes)
 * of the receive region, then a barrier makes those bytes visible to the whole block.
 */
template <typename Ch>
TPD_DEVICE void wait_range(const Ch& ch, const Plan& plan, uint32_t rank, uint64_t byte_off, uint64_t nbytes) {
    if (threadIdx.x == 0 && threadIdx.y == 0 && threadIdx.z == 0) wait_range_thread(ch, plan, rank, byte_off, nbytes);
    __syncthreads();
}

/**
 * tile_done for the lanes of a warp whose tiles finish together: each lane with ``done`` counts its tile;
 * the lanes whose tile was the last of a chunk ship their chunks' sends with warp-cooperative pushes
 * (one slot claim and one system-scope release per round of sends, instead of one per record). Every
 * lane of the warp that reaches the call must be converged; pass the lane's own condition as ``done``.
 * Returns true on the lanes that shipped.
 */
template <typename Ch>
TPD_DEVICE bool tile_done_warp(const Ch& ch, const Plan& plan, bool done, uint32_t tile) {
    const uint32_t chunk = done ? tile_arrive(plan, tile) : plan.chunk_count;
    const bool ships = chunk != plan.chunk_count;
    const PlanChunk c = ships ? plan.chunks[chunk] : PlanChunk{0, 0, 0, 0, 0, 0};
    const uint32_t rounds = __reduce_max_sync(__activemask(), (uint32_t)c.send_count);
    for (uint32_t k = 0; k < rounds; ++k) {
        const bool active = k < c.send_count;
        const PlanSend d = active ? plan.sends[c.first_send + k] : PlanSend{0, 0, 0, 0, 0, 0};
        warp_put_signal(ch, active, d.peer, d.dst_region, d.dst_off, c.src_region, c.src_off, c.bytes, d.slot,
                        d.value);
    }
    return ships;
}

#endif /* __CUDACC__ */

}  // namespace tpd

#endif /* TRANSPORTD_PLAN_DEVICE_CUH */
