// Kernels for benchmarks/gpu_bench.py: push cost per commit variant, paced pushes for latency, round trips
// through the proxy one at a time and under load (the thread sweep), the GPU/host clock calibration
// ping-pong, and the put -> flag round trip between two ranks.
//
// The per-word parity push below is a benchmark-only comparison (the design's alternative commit): byte 0
// of every 8-byte word carries the lap parity, six relaxed system-scope stores, no fence, 42 usable bytes.
// The library commits header-last (ring_device.cuh); parity records need their own consumer (the
// benchmark's ParityConsumer), so they never reach the daemon.
#include <transportd/client.cuh>

namespace bench {

constexpr int PARITY = 100;     // six 8-byte relaxed .sys stores
constexpr int PARITY_V2 = 101;  // three 16-byte relaxed .sys stores
// fence.sc.sys, then PARITY's six stores: what a parity record costs when it publishes data the kernel wrote
// just before (a PUT of a fresh tile). Header-last's release store orders those writes for the NIC too;
// parity's relaxed stores order nothing, so such a record needs this fence first.
constexpr int PARITY_FENCED = 102;

// One per-word-parity PUT of 4 KiB to `peer` (offsets from `chunk`, `value` in the last word): the lap parity in
// byte 0 of every word, relaxed system-scope stores, no fence. Returns the ring position it took.
template <int Variant>
__device__ __forceinline__ uint64_t push_parity(const tpd::RingDevice& ring, uint16_t peer, uint32_t chunk,
                                                uint64_t value) {
    uint64_t pos = tpd::ordering::fetch_add_relaxed_gpu(ring.head, 1);
    tpd::acquire_credit(ring, pos);
    uint64_t* slot = reinterpret_cast<uint64_t*>(ring.records + (pos & (uint64_t)(ring.capacity - 1)));
    uint64_t par = (pos & ring.capacity) ? 2 : 1;  // lap parity, never 0
    uint64_t w0 = ((uint64_t)TPD_OP_PUT << 8) | ((uint64_t)peer << 24) | par;
    uint64_t w1 = ((uint64_t)chunk << 8) | par;
    uint64_t w2 = ((uint64_t)chunk << 20) | par, w3 = (4096ull << 8) | par, w4 = par, w5 = (value << 8) | par;
    if (Variant == PARITY_FENCED) tpd::ordering::fence_sys();
    if (Variant == PARITY || Variant == PARITY_FENCED) {
        tpd::ordering::st_relaxed_sys(slot + 1, w1);
        tpd::ordering::st_relaxed_sys(slot + 2, w2);
        tpd::ordering::st_relaxed_sys(slot + 3, w3);
        tpd::ordering::st_relaxed_sys(slot + 4, w4);
        tpd::ordering::st_relaxed_sys(slot + 5, w5);
        tpd::ordering::st_relaxed_sys(slot, w0);
    } else {
        tpd::ordering::st_relaxed_sys_v2(slot + 2, w2, w3);
        tpd::ordering::st_relaxed_sys_v2(slot + 4, w4, w5);
        tpd::ordering::st_relaxed_sys_v2(slot, w0, w1);
    }
    return pos;
}

// One 4 KiB PUT to `peer` with the commit `Variant` (a library header-last one, or per-word parity).
template <int Variant>
__device__ __forceinline__ uint64_t push_put(const tpd::RingDevice& ring, uint16_t peer, uint64_t off,
                                             uint32_t chunk, uint64_t value) {
    if (Variant >= PARITY) return push_parity<Variant>(ring, peer, chunk, value);
    tpd::Body b = tpd::make_body(off, off, 4096, 0, 0, chunk, 0, value);
    return tpd::push<Variant>(ring, tpd::Opcode::Put, 0, peer, b);
}

template <int Variant>
__device__ __forceinline__ uint64_t push_one(const tpd::RingDevice& ring, uint32_t chunk, uint64_t value) {
    return push_put<Variant>(ring, 1, (uint64_t)chunk << 12, chunk, value);
}

// Every thread pushes `iters` records; thread (0,0) stamps the global timer around its loop.
template <int Variant>
__device__ void push_loop(tpd::RingDevice ring, uint32_t iters, uint64_t* out) {
    uint32_t tid = blockIdx.x * blockDim.x + threadIdx.x;
    uint64_t t0 = tpd::ordering::now_ns();
    for (uint32_t i = 0; i < iters; ++i) push_one<Variant>(ring, tid, i);
    uint64_t t1 = tpd::ordering::now_ns();
    if (tid == 0) {
        out[0] = t0;
        out[1] = t1;
    }
}

// One thread pushes `n` records `gap_ns` apart, stamping the global timer just before each push.
template <int Variant>
__device__ void paced(tpd::RingDevice ring, uint32_t n, uint32_t gap_ns, uint64_t* stamps) {
    uint64_t next = tpd::ordering::now_ns();
    for (uint32_t i = 0; i < n; ++i) {
        while (tpd::ordering::now_ns() < next) {
        }
        uint64_t t = tpd::ordering::now_ns();
        stamps[i] = t;
        push_one<Variant>(ring, i, t);
        next = t + gap_ns;
    }
}

// Round trip on the GPU's clock alone: push one PUT, spin until the proxy's completion position passes it
// (the proxy posted it and its null NIC completed it), `gap_ns` apart; rtt[i] = ns from before the push
// to the kernel seeing that completion. No host clock is involved, so no calibration error either.
template <int Variant>
__device__ void roundtrip(tpd::RingDevice ring, uint32_t n, uint32_t gap_ns, uint64_t* rtt) {
    const uint64_t* done = tpd::control_word<uint64_t>(ring, TPD_RING_OFF_COMPLETION_POS);
    uint64_t next = tpd::ordering::now_ns();
    for (uint32_t i = 0; i < n; ++i) {
        while (tpd::ordering::now_ns() < next) {
        }
        uint64_t t = tpd::ordering::now_ns();
        uint64_t pos = push_one<Variant>(ring, i, t);
        while (tpd::ordering::ld_acquire_sys(done) <= pos) {
        }
        uint64_t t1 = tpd::ordering::now_ns();
        rtt[i] = t1 - t;
        next = t1 + gap_ns;
    }
}

// The warp-cooperative push: every lane pushes one record per round with one warp_push call (one slot
// claim and one system-scope release per warp); thread (0,0) stamps the timer around its loop, so one
// warp's ns per round / 32 is the per-record cost at 32 records per warp.
__device__ void push_loop_warp(tpd::RingDevice ring, uint32_t iters, uint64_t* out) {
    uint32_t tid = blockIdx.x * blockDim.x + threadIdx.x;
    tpd::Body b = tpd::make_body((uint64_t)tid << 12, (uint64_t)tid << 12, 4096, 0, 0, tid, 0, 0);
    uint64_t t0 = tpd::ordering::now_ns();
    for (uint32_t i = 0; i < iters; ++i) {
        b.w5 = i;
        tpd::warp_push(ring, true, tpd::Opcode::Put, 0, 1, b);
    }
    uint64_t t1 = tpd::ordering::now_ns();
    if (tid == 0) {
        out[0] = t0;
        out[1] = t1;
    }
}

// How a sweep thread waits for the completion position to pass its record. THREAD: every waiting thread
// polls the host word itself (one PCIe read each per poll). WARP: the lowest waiting lane of the warp polls
// and hands the value to the others (one PCIe read per warp per poll); a lane whose record is done leaves.
// RELAXED: every waiting thread polls with relaxed loads and orders what follows with one acquire fence
// once the position has passed (the acquire paid once, not on every PCIe read).
constexpr int WAIT_THREAD = 0;
constexpr int WAIT_WARP = 1;
constexpr int WAIT_RELAXED = 2;

template <int Wait>
__device__ __forceinline__ uint64_t poll_done(const uint64_t* done) {
    if (Wait == WAIT_THREAD) return tpd::ordering::ld_acquire_sys(done);
    if (Wait == WAIT_RELAXED) return tpd::ordering::ld_relaxed_sys(done);
    const uint32_t waiting = __activemask();
    const uint32_t leader = (uint32_t)__ffs(waiting) - 1u;
    uint64_t v = 0;
    if (tpd::ordering::lane_id() == leader) v = tpd::ordering::ld_acquire_sys(done);
    return __shfl_sync(waiting, v, leader);
}

// Round trips under load, on the GPU's clock alone: each of `threads` threads pushes a 4 KiB PUT (to peer
// 1 + tid % peers), waits until the proxy's completion position passes its own record, and pushes the next,
// `n` times, with no pause. rtt[tid * n + i] = ns from before push i to seeing its completion, and
// pushed[tid * n + i] the ns of the push alone (claim, credit, commit: the rest is the wait); span[2 * tid]
// and span[2 * tid + 1] = the thread's first push and last completion (the launch's ops/s). The wait is
// bounded in every build: a thread that waits longer than `timeout_ns` for one record stores ~0 as that
// round trip and stops (the host counts them as failures).
template <int Variant, int Wait, bool WarpPush>
__device__ void roundtrip_sweep(tpd::RingDevice ring, uint32_t threads, uint32_t n, uint32_t peers,
                                uint64_t timeout_ns, uint64_t* rtt, uint64_t* pushed, uint64_t* span) {
    uint32_t tid = blockIdx.x * blockDim.x + threadIdx.x;
    if (tid >= threads) return;
    const uint64_t* done = tpd::control_word<uint64_t>(ring, TPD_RING_OFF_COMPLETION_POS);
    const uint16_t peer = (uint16_t)(1 + tid % peers);
    const uint64_t off = (uint64_t)(tid & 255) << 12;  // within the 1 GiB regions whatever the thread count
    uint64_t first = tpd::ordering::now_ns(), t1 = first;
    for (uint32_t i = 0; i < n; ++i) {
        uint64_t t = tpd::ordering::now_ns();
        uint64_t pos;
        if (WarpPush) {  // the lanes that reach this together share one slot claim and one release
            tpd::Body b = tpd::make_body(off, off, 4096, 0, 0, tid * n + i, 0, t);
            pos = tpd::warp_push<Variant>(ring, true, tpd::Opcode::Put, 0, peer, b);
        } else {
            pos = push_put<Variant>(ring, peer, off, tid * n + i, t);
        }
        pushed[(uint64_t)tid * n + i] = tpd::ordering::now_ns() - t;
        uint32_t polls = 0;
        while (poll_done<Wait>(done) <= pos) {
            if ((++polls & 1023) == 0 && tpd::ordering::now_ns() - t > timeout_ns) {
                rtt[(uint64_t)tid * n + i] = ~0ull;
                span[2 * tid] = first;
                span[2 * tid + 1] = ~0ull;
                return;
            }
        }
        if (Wait == WAIT_RELAXED) asm volatile("fence.acq_rel.sys;" ::: "memory");
        t1 = tpd::ordering::now_ns();
        rtt[(uint64_t)tid * n + i] = t1 - t;
    }
    span[2 * tid] = first;
    span[2 * tid + 1] = t1;
}

// The sweep over up to four rings: warp w of the launch pushes into ring w % rings (each ring drained by a
// consumer of its own), every thread as in roundtrip_sweep. What one consumer costs the rate: the same
// threads over 1, 2 or 4 rings.
template <int Variant>
__device__ void roundtrip_sweep_rings(const tpd::RingDevice* rings, uint32_t count, uint32_t threads, uint32_t n,
                                      uint32_t peers, uint64_t timeout_ns, uint64_t* rtt, uint64_t* pushed,
                                      uint64_t* span) {
    const uint32_t warp = (blockIdx.x * blockDim.x + threadIdx.x) / 32u;
    roundtrip_sweep<Variant, WAIT_THREAD, false>(rings[warp % count], threads, n, peers, timeout_ns, rtt, pushed,
                                                 span);
}

}  // namespace bench

extern "C" __global__ void roundtrip_sweep_rings_v2_split(tpd::RingDevice r0, tpd::RingDevice r1, tpd::RingDevice r2,
                                                          tpd::RingDevice r3, uint32_t count, uint32_t threads,
                                                          uint32_t n, uint32_t peers, uint64_t timeout_ns,
                                                          uint64_t* rt, uint64_t* pushed, uint64_t* span) {
    const tpd::RingDevice rings[4] = {r0, r1, r2, r3};
    bench::roundtrip_sweep_rings<TPD_COMMIT_V2_SPLIT>(rings, count, threads, n, peers, timeout_ns, rt, pushed, span);
}

#define TPD_BENCH_VARIANT(name, v)                                                                      \
    extern "C" __global__ void push_loop_##name(tpd::RingDevice ring, uint32_t iters, uint64_t* out) {    \
        bench::push_loop<v>(ring, iters, out);                                                            \
    }                                                                                                     \
    extern "C" __global__ void paced_##name(tpd::RingDevice ring, uint32_t n, uint32_t gap, uint64_t* st) { \
        bench::paced<v>(ring, n, gap, st);                                                                \
    }                                                                                                     \
    extern "C" __global__ void roundtrip_##name(tpd::RingDevice ring, uint32_t n, uint32_t gap, uint64_t* rt) { \
        bench::roundtrip<v>(ring, n, gap, rt);                                                            \
    }

// the sweep's records go to the proxy (header-last commits) or to the bare parity consumer (parity ones)
#define TPD_BENCH_SWEEP_WAIT(name, v, prefix, wait, warp_push)                                          \
    extern "C" __global__ void roundtrip_sweep_##prefix##name(tpd::RingDevice ring, uint32_t threads,         \
                                                              uint32_t n, uint32_t peers, uint64_t timeout_ns, \
                                                              uint64_t* rt, uint64_t* pushed, uint64_t* span) { \
        bench::roundtrip_sweep<v, wait, warp_push>(ring, threads, n, peers, timeout_ns, rt, pushed, span); \
    }
#define TPD_BENCH_SWEEP(name, v)                                         \
    TPD_BENCH_SWEEP_WAIT(name, v, , bench::WAIT_THREAD, false)           \
    TPD_BENCH_SWEEP_WAIT(name, v, warpwait_, bench::WAIT_WARP, false)    \
    TPD_BENCH_SWEEP_WAIT(name, v, relaxedwait_, bench::WAIT_RELAXED, false)
// the warp-cooperative push (tpd::warp_push): header-last commits only
#define TPD_BENCH_SWEEP_WARP_PUSH(name, v) TPD_BENCH_SWEEP_WAIT(name, v, warppush_, bench::WAIT_THREAD, true)

TPD_BENCH_VARIANT(release_sys, TPD_COMMIT_RELEASE_SYS)
TPD_BENCH_VARIANT(fence_sys, TPD_COMMIT_FENCE_SYS)
TPD_BENCH_VARIANT(v2_release, TPD_COMMIT_V2_RELEASE)
TPD_BENCH_VARIANT(v2_split, TPD_COMMIT_V2_SPLIT)
TPD_BENCH_VARIANT(parity, bench::PARITY)
TPD_BENCH_VARIANT(parity_v2, bench::PARITY_V2)
TPD_BENCH_VARIANT(parity_fenced, bench::PARITY_FENCED)
TPD_BENCH_SWEEP(release_sys, TPD_COMMIT_RELEASE_SYS)
TPD_BENCH_SWEEP(fence_sys, TPD_COMMIT_FENCE_SYS)
TPD_BENCH_SWEEP(v2_release, TPD_COMMIT_V2_RELEASE)
TPD_BENCH_SWEEP(v2_split, TPD_COMMIT_V2_SPLIT)
TPD_BENCH_SWEEP_WARP_PUSH(release_sys, TPD_COMMIT_RELEASE_SYS)
TPD_BENCH_SWEEP_WARP_PUSH(fence_sys, TPD_COMMIT_FENCE_SYS)
TPD_BENCH_SWEEP_WARP_PUSH(v2_release, TPD_COMMIT_V2_RELEASE)
TPD_BENCH_SWEEP_WARP_PUSH(v2_split, TPD_COMMIT_V2_SPLIT)
TPD_BENCH_SWEEP(parity, bench::PARITY)
TPD_BENCH_SWEEP(parity_v2, bench::PARITY_V2)
TPD_BENCH_SWEEP(parity_fenced, bench::PARITY_FENCED)

extern "C" __global__ void push_loop_warp32(tpd::RingDevice ring, uint32_t iters, uint64_t* out) {
    bench::push_loop_warp(ring, iters, out);
}

// Chunk-plan overhead against the raw calls on the same chunks, one thread, flags preset so every wait
// is satisfied and credits preset so no consumer is needed: what the plan adds is its table reads, the
// per-chunk tile counters and the range search. out = {t0, t_plan, t_raw}.
extern "C" __global__ void plan_overhead(tpd::Channel ch, tpd::Plan plan, uint32_t peer, uint32_t rounds,
                                         uint64_t* out) {
    const uint64_t t0 = tpd::ordering::now_ns();
    for (uint32_t r = 0; r < rounds; ++r) {
        for (uint32_t tile = 0; tile < plan.tile_count; ++tile) tpd::tile_done(ch, plan, tile);
        for (uint32_t i = plan.recv_index[peer]; i < plan.recv_index[peer + 1]; ++i)
            tpd::wait_range_thread(ch, plan, peer, plan.recvs[i].off, plan.recvs[i].bytes);
    }
    const uint64_t t1 = tpd::ordering::now_ns();
    for (uint32_t r = 0; r < rounds; ++r) {
        for (uint32_t c = 0; c < plan.chunk_count; ++c) {
            const tpd::PlanChunk& k = plan.chunks[c];
            const tpd::PlanSend& d = plan.sends[k.first_send];
            tpd::put_signal(ch, d.peer, d.dst_region, d.dst_off, k.src_region, k.src_off, k.bytes, d.slot, d.value);
        }
        for (uint32_t i = plan.recv_index[peer]; i < plan.recv_index[peer + 1]; ++i)
            tpd::wait(ch, plan.recvs[i].slot, plan.epoch * plan.recvs[i].value);
    }
    const uint64_t t2 = tpd::ordering::now_ns();
    out[0] = t0;
    out[1] = t1 - t0;
    out[2] = t2 - t1;
}

// A PCIe read's round trip: one thread reads a host word `rounds` times, each read waited for before the
// next (acquire, then relaxed); out = {ns for the acquire reads, ns for the relaxed reads, their sum}.
extern "C" __global__ void pcie_read(const uint64_t* word, uint32_t rounds, uint64_t* out) {
    uint64_t sum = 0;
    const uint64_t t0 = tpd::ordering::now_ns();
    for (uint32_t r = 0; r < rounds; ++r) sum += tpd::ordering::ld_acquire_sys(word + (sum & 1));
    const uint64_t t1 = tpd::ordering::now_ns();
    for (uint32_t r = 0; r < rounds; ++r) sum += tpd::ordering::ld_relaxed_sys(word + (sum & 1));
    const uint64_t t2 = tpd::ordering::now_ns();
    out[0] = t1 - t0;
    out[1] = t2 - t1;
    out[2] = sum;
}

// Clock calibration: the host writes ping = r; the GPU answers with its global timer in pong[1] and r in
// pong[0]. The host brackets each round with its own clock; the tightest round gives the offset.
extern "C" __global__ void clock_pingpong(const uint64_t* ping, uint64_t* pong, uint32_t rounds) {
    for (uint32_t r = 1; r <= rounds; ++r) {
        TPD_SPIN_UNTIL(tpd::ordering::ld_acquire_sys(ping) == r);
        uint64_t g = tpd::ordering::now_ns();
        tpd::ordering::st_relaxed_sys(pong + 1, g);
        tpd::ordering::st_release_sys(pong, r);
    }
}

// put -> flag visible to the receiving kernel: rank 0 puts `bytes` with a signal, rank 1's kernel waits for
// the flag and acks through device memory (same process, two streams); both stamp the GPU global timer.
// The channel kernels take tpd::DefaultChannel: gpu_bench builds this file once more with -DTPD_IBGDA to
// run them on the IBGDA path.
extern "C" __global__ void flag_sender(tpd::DefaultChannel ch, uint32_t peer, uint32_t dst_region, uint32_t src_region,
                                       uint32_t bytes, uint32_t slot, uint32_t n, uint64_t* t_send, uint64_t* ack) {
    for (uint32_t i = 0; i < n; ++i) {
        t_send[i] = tpd::ordering::now_ns();
        tpd::put_signal(ch, peer, (uint16_t)dst_region, 0, (uint16_t)src_region, 0, bytes, slot, 1);
        TPD_SPIN_UNTIL(tpd::ordering::ld_acquire_gpu(ack) >= i + 1);
    }
}

extern "C" __global__ void flag_receiver(tpd::DefaultChannel ch, uint32_t slot, uint64_t base, uint32_t n, uint64_t* t_recv,
                                         uint64_t* ack) {
    for (uint32_t i = 0; i < n; ++i) {
        tpd::wait(ch, slot, base + i + 1);
        t_recv[i] = tpd::ordering::now_ns();
        tpd::ordering::st_release_gpu(ack, (uint64_t)(i + 1));
    }
}

// Command rate: every thread of the launch puts `per_thread` commands of `bytes` (thread t writes its own
// stripe, wrapped at `span` bytes: the payload is never read, so the stripes of thousands of threads may
// overlap); once the block's threads have posted, its thread 0 adds 1 to `slot` (a signal follows every
// earlier command of the channel to that peer, so it covers the block's puts) and QUIETs, so the launch
// ends when every command completed locally. One thread per block is the rate from `blocks` posters; a
// full block of threads is the rate from every thread of the GPU.
extern "C" __global__ void put_burst(tpd::DefaultChannel ch, uint32_t peer, uint32_t dst_region, uint32_t src_region,
                                     uint32_t bytes, uint32_t per_thread, uint32_t slot, uint64_t span) {
    const uint64_t t = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x;
    for (uint32_t i = 0; i < per_thread; ++i) {
        const uint64_t off = ((t * per_thread + i) * bytes) % span;
        tpd::put(ch, peer, (uint16_t)dst_region, off, (uint16_t)src_region, off, bytes);
    }
    __syncthreads();
    if (threadIdx.x != 0) return;
    tpd::signal(ch, peer, slot, 1);
    tpd::quiet(ch);
}
