/*
 * transportd device API: pushing commands into the ring from any thread of any block.
 *
 * Protocol (the host half is cmd_ring/ring.py, RingConsumer):
 *
 *   claim    pos = atomicAdd(head, 1) on a counter in device memory: every producer thread owns one
 *            absolute position, so any number of threads and blocks push at once without locks.
 *   credit   slot pos % capacity is free once the proxy has copied the record that held it a lap ago,
 *            i.e. once pos < consumer_pos + capacity. consumer_pos lives in the ring's control page
 *            (pinned host memory, written by the proxy after its copy). Each push compares against a
 *            cached copy in device memory and reads host memory (ld.acquire.sys) only when the ring
 *            looks full, then raises the cache with red.max.release.gpu for everyone else; a full
 *            ring backs off with __nanosleep. The proxy stops consuming when its NIC is full, so
 *            backpressure reaches the kernel here and nothing is ever dropped.
 *   commit   header-last: the five body words, then the header word (seq | opcode | flags | peer)
 *            with a release store at system scope. The consumer reads the header first, accepts the
 *            slot only if seq is the lap stamp it expects for that position, then reads the body: a
 *            release at .sys scope orders every body store before the header for a CPU reader, so it
 *            never takes a torn record, and the lap stamp means a stale slot is never taken as fresh.
 *            Producers commit out of order; the consumer takes the committed prefix.
 *   progress the lowest uncommitted position only needs positions below it consumed, and those are
 *            all committed, so the ring cannot deadlock as long as every claimed slot is committed.
 *
 * Commit variants (TPD_COMMIT; all header-last). Measured on the H200 by benchmarks/gpu_bench.py, all
 * variants in one run, two runs (a push = atomicAdd on the device head + one record into the mapped ring
 * file; one thread: ns per push over 20000 pushes; aggregate: 132 x 128 threads x 200 pushes):
 *
 *   variant                                               1 thread (ns)   aggregate (M/s)  10^6 stress
 *   TPD_COMMIT_RELEASE_SYS  5 x 8 B, st.release.sys header     865 / 930       125 / 130    none torn/lost
 *   TPD_COMMIT_FENCE_SYS    5 x 8 B, fence.sc.sys, relaxed hdr 868 / 940       125 / 127    none torn/lost
 *   TPD_COMMIT_V2_RELEASE   2 x 16 B, (hdr,w1) release.sys.v2  863 / 930       229 / 229    none torn/lost
 *   TPD_COMMIT_V2_SPLIT     2 x 16 B, w1, release.sys header   860 / 929       228 / 229    none torn/lost
 *   per-word parity, 6 x 8 B relaxed .sys (benchmark only)     272 / 375      1010 / 427
 *   per-word parity, 3 x 16 B relaxed .sys (benchmark only)    273 / 377       397 / 390
 *
 * Default: TPD_COMMIT_V2_SPLIT. It matches V2_RELEASE's aggregate rate (four stores per record, two of
 * them 16 bytes, instead of six 8-byte ones) without relying on a 16-byte store reaching host memory whole:
 * V2_RELEASE puts seq and word 1 in one store, V2_SPLIT publishes the 8-byte header alone after every
 * body word. One thread's cost is the system-scope release (it waits for the earlier PCIe writes), the
 * same for every header-last variant.
 *
 * Per-word parity (byte 0 of each word carries the lap parity, no system fence, 42 usable bytes) is
 * 2.5-3.2x cheaper per thread and 1.9-4.4x in aggregate (its aggregate varied most between runs), and it
 * is the only commit that came near the design's 300 ns per push. It needs a different record layout and
 * consumer (cmd_ring.h, record.py, ring.py, the proxy's translation), so it is measured side by side by
 * the benchmark only (benchmarks/gpu_push.cu) and the whole chain stays header-last. Its saving is the
 * missing release, and that release is also what carries the kernel's earlier stores (the tile a PUT ships)
 * to the proxy and the NIC: a parity record that ships fresh data needs a fence.sc.sys first, and then
 * its round trip through the bare consumer is header-last's (3.26 against 3.23 us, docs/performance.md).
 */
#ifndef TRANSPORTD_RING_DEVICE_CUH
#define TRANSPORTD_RING_DEVICE_CUH

#include <transportd/command.cuh>
#include <transportd/ordering.cuh>

#define TPD_COMMIT_RELEASE_SYS 0
#define TPD_COMMIT_FENCE_SYS 1
#define TPD_COMMIT_V2_RELEASE 2
#define TPD_COMMIT_V2_SPLIT 3

/* The library's commit (see the table above); a translation unit may pick another before including. */
#ifndef TPD_COMMIT
#define TPD_COMMIT TPD_COMMIT_V2_SPLIT
#endif

namespace tpd {

/**
 * The ring half of a channel handle: plain fields, passed by value inside tpd::Channel.
 *
 *   word 0  | records:u64   device address of slot 0 (the ring file, mapped pinned host memory) |
 *   word 1  | control:u64   device address of the ring's 4096-byte control page (same mapping)    |
 *   word 2  | head:u64      device address of the slot-claim counter (device memory)              |
 *   word 3  | credit:u64    device address of the cached consumer position (device memory)        |
 *   word 4  | capacity:u32 (a power of two)  | abi:u32 (TPD_CHANNEL_ABI)                          |
 */
struct RingDevice {
    tpd_cmd_record* records;
    uint8_t* control;
    uint64_t* head;
    uint64_t* credit;
    uint32_t capacity;
    uint32_t abi;
};
TPD_STATIC_ASSERT(sizeof(RingDevice) == 40, "RingDevice is five 8-byte words");
TPD_STATIC_ASSERT_OFFSET(offsetof(RingDevice, records) == 0, "records at 0");
TPD_STATIC_ASSERT_OFFSET(offsetof(RingDevice, control) == 8, "control at 8");
TPD_STATIC_ASSERT_OFFSET(offsetof(RingDevice, head) == 16, "head at 16");
TPD_STATIC_ASSERT_OFFSET(offsetof(RingDevice, credit) == 24, "credit at 24");
TPD_STATIC_ASSERT_OFFSET(offsetof(RingDevice, capacity) == 32, "capacity at 32");
TPD_STATIC_ASSERT_OFFSET(offsetof(RingDevice, abi) == 36, "abi at 36");

#if defined(__CUDACC__)

/** A control word of the ring's host page, by its cmd_ring.h offset. */
template <typename T>
TPD_DEVICE const T* control_word(const RingDevice& ring, unsigned offset) {
    return reinterpret_cast<const T*>(ring.control + offset);
}

/** Wait until slot ``pos`` is free (pos < consumer_pos + capacity); see "credit" above. */
TPD_DEVICE void acquire_credit(const RingDevice& ring, uint64_t pos) {
    if (pos < ordering::ld_acquire_gpu(ring.credit) + ring.capacity) return;
    ordering::Spin spin;
    for (;;) {
        uint64_t consumed = ordering::ld_acquire_sys(control_word<uint64_t>(ring, TPD_RING_OFF_CONSUMER_POS));
        ordering::red_max_release_gpu(ring.credit, consumed);
        if (pos < consumed + ring.capacity) return;
        spin.pause("ring credit (the proxy is not consuming this channel)");
    }
}

/** Store one record into ``slot`` header-last with commit variant ``Commit`` (see the list above). */
template <int Commit>
TPD_DEVICE void commit_record(uint64_t* slot, uint64_t header, const Body& b) {
    if (Commit == TPD_COMMIT_FENCE_SYS) {
        ordering::st_weak(slot + 1, b.w1);
        ordering::st_weak(slot + 2, b.w2);
        ordering::st_weak(slot + 3, b.w3);
        ordering::st_weak(slot + 4, b.w4);
        ordering::st_weak(slot + 5, b.w5);
        ordering::fence_sys();
        ordering::st_relaxed_sys(slot, header);
    } else if (Commit == TPD_COMMIT_V2_RELEASE) {
        ordering::st_weak_v2(slot + 2, b.w2, b.w3);
        ordering::st_weak_v2(slot + 4, b.w4, b.w5);
        ordering::st_release_sys_v2(slot, header, b.w1);
    } else if (Commit == TPD_COMMIT_V2_SPLIT) {
        ordering::st_weak_v2(slot + 2, b.w2, b.w3);
        ordering::st_weak_v2(slot + 4, b.w4, b.w5);
        ordering::st_weak(slot + 1, b.w1);
        ordering::st_release_sys(slot, header);
    } else {
        ordering::st_weak(slot + 1, b.w1);
        ordering::st_weak(slot + 2, b.w2);
        ordering::st_weak(slot + 3, b.w3);
        ordering::st_weak(slot + 4, b.w4);
        ordering::st_weak(slot + 5, b.w5);
        ordering::st_release_sys(slot, header);
    }
}

/**
 * Push one command from the calling thread; returns its absolute ring position. Blocks (backing off)
 * while the ring is full. Any thread of any block may call it concurrently.
 */
template <int Commit = TPD_COMMIT>
TPD_DEVICE uint64_t push(const RingDevice& ring, Opcode opcode, uint8_t flags, uint16_t peer, const Body& b) {
    uint64_t pos = ordering::fetch_add_relaxed_gpu(ring.head, 1);
    acquire_credit(ring, pos);
    uint64_t* slot = reinterpret_cast<uint64_t*>(ring.records + (pos & (uint64_t)(ring.capacity - 1)));
    commit_record<Commit>(slot, header_word(seq_for(pos), (uint8_t)opcode, flags, peer), b);
    return pos;
}

/** What warp_push returns to a lane that pushed nothing. */
constexpr uint64_t kNoPosition = ~0ull;

/**
 * Warp-cooperative push: every lane of the warp that reaches this call together takes part; the lanes
 * with ``active`` each push one record. One lane claims all the warp's slots with one atomicAdd (and
 * waits for their credit), the others learn their position by a shuffle, and every active lane commits
 * its own record header-last in the same instructions. A system-scope release is one fence for the
 * whole warp instruction, so the warp pays one release, not one per record: 32 records cost about what
 * one costs (benchmarks/gpu_bench.py, "warp push"). Records keep the per-thread protocol exactly (the
 * consumer cannot tell them apart). Returns the lane's ring position, or kNoPosition if inactive.
 */
template <int Commit = TPD_COMMIT>
TPD_DEVICE uint64_t warp_push(const RingDevice& ring, bool active, Opcode opcode, uint8_t flags, uint16_t peer,
                              const Body& b) {
    const uint32_t members = __activemask();
    const uint32_t pushing = __ballot_sync(members, active);
    if (pushing == 0u) return kNoPosition;
    const uint32_t leader = (uint32_t)__ffs(pushing) - 1u;
    uint64_t base = 0;
    if (ordering::lane_id() == leader) {
        const uint32_t n = (uint32_t)__popc(pushing);
        base = ordering::fetch_add_relaxed_gpu(ring.head, n);
        acquire_credit(ring, base + n - 1u);  // the last of the warp's slots free => all of them free
    }
    base = __shfl_sync(members, base, leader);
    if (!active) return kNoPosition;
    const uint64_t pos = base + (uint64_t)__popc(pushing & ordering::lanemask_lt());
    uint64_t* slot = reinterpret_cast<uint64_t*>(ring.records + (pos & (uint64_t)(ring.capacity - 1)));
    commit_record<Commit>(slot, header_word(seq_for(pos), (uint8_t)opcode, flags, peer), b);
    return pos;
}

#endif /* __CUDACC__ */

}  // namespace tpd

#endif /* TRANSPORTD_RING_DEVICE_CUH */
