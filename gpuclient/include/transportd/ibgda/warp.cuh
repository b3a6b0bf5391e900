/*
 * transportd ibgda: warp-aggregated posting — one WQE-slot claim and one doorbell per warp.
 *
 * Every post on a QP passes its doorbell ticket (queue_pair.cuh): the ticket holder rings, then hands on.
 * When thousands of threads post one command each, the ticket serialises them and the QP rings once per
 * command. tpd::warp_put / tpd::warp_put_signal let the lanes of a warp post their commands together:
 *
 *   group     lanes posting to the same peer (__match_any_sync on the peer) form a group; each lane
 *             checks its own arguments and builds its own WQEs in registers (channel.cuh's builders:
 *             the same bytes as tpd::put / tpd::put_signal). A refused lane reports its code and posts
 *             nothing; the others go on.
 *   offsets   a lane's WQE count is 0..3; two ballots give every lane its offset in the group (exclusive
 *             prefix sum) and the total. Groups larger than group_cap(qp) = wqe_cnt / 2 WQEBBs are cut
 *             by offset into claims (queue_pair.cuh: why a claim must stay under 3/4 of the queue).
 *   claim     the lowest lane of a claim reserves all its WQEBBs with one atomicAdd (and waits for space,
 *             driving the CQ); a shuffle hands every lane the first index.
 *   store     every lane stamps and stores its own WQEs at first + offset, in parallel.
 *   barrier   __syncwarp: the lanes' WQE stores happen before anything the leader does next.
 *   ticket    the leader waits for posted == first.
 *   ordered   the leader applies a pending tpd::fence's bit to the claim's first WQE and, in write and
 *             fence modes, the flag values in lane order (lanes shuffle it each flag's shadow counter,
 *             value and WQEBB; one read and one store per run of lanes on the same counter).
 *   publish   the leader updates the doorbell record once to first + n, rings the doorbell once with
 *             the last lane's last WQE, and hands the ticket on (queue_pair.cuh's publish).
 *
 * Ordering: the same rules as one thread's post. The leader's doorbell record is a system-scope release
 * store (doorbell.cuh); the warp barrier puts every lane's WQE stores before it in causality order, and
 * a release is cumulative, so the NIC that sees the record sees every WQE of the claim. Within a claim,
 * lanes' commands sit in lane order, each lane's WQEs in the order its single post would use: a flag
 * still follows the payload it covers on the same QP (write mode: later WQE, in-order placement; atomic:
 * the fetch-and-add after the write; fence: the ordering read and the fenced flag write), so the flag
 * rule holds exactly as for tpd::put_signal. Commands of different lanes are as unordered as commands
 * of different threads: nothing orders lane 3's payload before lane 5's flag.
 *
 * What a kernel sees: each lane gets back the WQEBB index of its first WQE (diagnostics), or kNoWqe
 * (~0, the proxy path's kNoPosition) if it posted nothing. Every lane that reaches the call must be
 * converged with the others (call it outside lane-divergent branches; pass the branch as ``active``).
 * Lanes of one warp calling with different peers form one group per peer; groups proceed concurrently.
 *
 * Device only (warp intrinsics); the CPU tests run post_group (queue_pair.cuh), the same steps in one
 * thread, and the GPU test (tests/ibgda/test_gpu_ibgda.py) compares warp posts with single posts.
 */
#ifndef TRANSPORTD_IBGDA_WARP_CUH
#define TRANSPORTD_IBGDA_WARP_CUH

#include <transportd/ibgda/channel.cuh>

namespace tpd {

#if defined(__CUDACC__)

namespace ibgda {
namespace detail {

/** The group key of a lane that posts nothing to any QP (no rank is ~0). */
constexpr uint32_t kNoPeer = ~0u;

/**
 * Post each lane's batch ``b`` (b.n 0..3 WQEs, ``o`` its ordered part) to ``qp``, warp-aggregated as
 * described at the top of this file. ``key`` is the lane's peer, or kNoPeer when ``qp`` is null (then
 * b.n must be 0). ``members``: the lanes that entered the public call together (``__activemask()`` there).
 * Returns the lane's first WQEBB, or kNoWqe.
 */
TPD_DEVICE uint64_t warp_post(uint32_t members, const QueuePair* qp, uint32_t key, Batch& b, const Ordered& o) {
    // the lanes that entered the call together may have drifted apart while building their WQEs (each
    // lane's checks branch on its own arguments): gather them again before grouping, or a warp's commands
    // would split into several claims and doorbells
    __syncwarp(members);
    const uint32_t group = __match_any_sync(members, key);
    const uint32_t ones = __ballot_sync(group, (b.n & 1u) != 0u);
    const uint32_t twos = __ballot_sync(group, (b.n & 2u) != 0u);
    const uint32_t posting = ones | twos;
    if (posting == 0u) return kNoWqe;  // the whole group (every kNoPeer group among them) leaves together
    // from here on every lane of the group has the same, non-null qp; in registers (see QueuePair)
    const QueuePair q = *qp;
    const uint32_t lane = ordering::lane_id();
    const uint32_t lt = ordering::lanemask_lt();
    const uint32_t cap = group_cap(q);
    const uint32_t off = (uint32_t)__popc(ones & lt) + 2u * (uint32_t)__popc(twos & lt);
    const uint32_t last_off = __shfl_sync(group, off, 31 - __clz(posting));
    const uint32_t claims = last_off / cap + 1u;
    uint64_t mine = kNoWqe;
    for (uint32_t c = 0; c < claims; ++c) {
        const bool in = b.n != 0u && off / cap == c;
        const uint32_t members = __ballot_sync(group, in);  // never empty: offsets step by at most 3 < cap
        const uint32_t c1 = ones & members, c2 = twos & members;
        const uint32_t n = (uint32_t)__popc(c1) + 2u * (uint32_t)__popc(c2);
        const uint32_t leader = (uint32_t)__ffs(members) - 1u;
        uint64_t first = 0;
        if (lane == leader) first = reserve(q, n);
        first = __shfl_sync(group, first, leader);
        uint64_t cqe_end = 0;
        uint64_t word = 0;
        if (in) {
            mine = first + (uint64_t)__popc(c1 & lt) + 2u * (uint64_t)__popc(c2 & lt);
            cqe_end = store_batch(q, b, mine);
            word = doorbell_word(b.w[b.n - 1u]);
        }
        const uint32_t asked = __ballot_sync(group, cqe_end != 0u);  // the highest such lane's is the last
        cqe_end = asked ? __shfl_sync(group, cqe_end, 31 - __clz(asked)) : 0u;
        word = __shfl_sync(group, word, 31 - __clz(members));
        const uint32_t flagging = __ballot_sync(group, in && o.flag_wqe >= 0);
        __syncwarp(group);  // every lane's WQE stores before the leader's doorbell record (see the top)
        if (lane == leader) {
            wait_ticket(q, first);
            take_fence(q, first, b.w[0].ctrl.fm_ce_se, false);
        }
        FlagRun run;
        for (uint32_t m = flagging; m != 0u; m &= m - 1u) {
            const int j = __ffs(m) - 1;
            uint64_t* counter = reinterpret_cast<uint64_t*>(
                __shfl_sync(group, reinterpret_cast<unsigned long long>(o.shadow), j));
            const unsigned long long value = __shfl_sync(group, (unsigned long long)o.value, j);
            const int set = __shfl_sync(group, o.set ? 1 : 0, j);
            const unsigned long long at = __shfl_sync(group, (unsigned long long)(mine + (uint64_t)o.flag_wqe), j);
            if (lane == leader) run.apply(q, at, counter, value, set != 0);
        }
        if (lane == leader) {
            run.flush();
            publish(q, first + n, word, cqe_end);
        }
    }
    return mine;
}

}  // namespace detail
}  // namespace ibgda

/**
 * Warp-aggregated put: the lanes of a warp call it together, each with its own arguments, and those
 * with ``active`` each write ``bytes`` from our ``src_region`` at ``src_off`` to ``peer``'s
 * ``dst_region`` at ``dst_off`` — the WQE tpd::put would post — for one slot claim and one doorbell per
 * peer the warp writes to. Returns the lane's WQEBB index, or ~0 if it posted nothing (inactive or
 * refused: the code lands in the error word as for tpd::put).
 */
TPD_DEVICE uint64_t warp_put(const IbgdaChannel& ch, bool active, uint32_t peer, uint16_t dst_region, uint64_t dst_off,
                             uint16_t src_region, uint64_t src_off, uint32_t bytes, uint32_t chunk_id = 0,
                             Post post = Post::Batched) {
    (void)chunk_id;
    (void)post;  // IBGDA posts at every call
    const uint32_t members = __activemask();  // before any lane branches on its own arguments
    ibgda::Batch b;
    const ibgda::QueuePair* qp =
        active ? ibgda::detail::build_put(ch, peer, dst_region, dst_off, src_region, src_off, bytes, b) : nullptr;
    return ibgda::detail::warp_post(members, qp, qp ? peer : ibgda::detail::kNoPeer, b, ibgda::Ordered());
}

/**
 * Warp-aggregated put_signal: each lane with ``active`` posts what tpd::put_signal would (the payload
 * write, then its flag by the channel's signal mode), for one slot claim and one doorbell per peer the
 * warp writes to. Each lane's flag follows its own payload; flags of lanes adding to one slot sum as
 * separate put_signals would. Returns the lane's first WQEBB index, or ~0 if it posted nothing.
 */
TPD_DEVICE uint64_t warp_put_signal(const IbgdaChannel& ch, bool active, uint32_t peer, uint16_t dst_region,
                                    uint64_t dst_off, uint16_t src_region, uint64_t src_off, uint32_t bytes,
                                    uint32_t slot, uint64_t value, SignalOp op = SignalOp::Add,
                                    Post post = Post::Batched) {
    (void)post;
    const uint32_t members = __activemask();  // before any lane branches on its own arguments
    ibgda::Batch b;
    ibgda::Ordered o;
    const ibgda::QueuePair* qp = active ? ibgda::detail::build_put_signal(ch, peer, dst_region, dst_off, src_region,
                                                                          src_off, bytes, slot, value, op, b, o)
                                        : nullptr;
    return ibgda::detail::warp_post(members, qp, qp ? peer : ibgda::detail::kNoPeer, b, o);
}

#endif /* __CUDACC__ */

}  // namespace tpd

#endif /* TRANSPORTD_IBGDA_WARP_CUH */
