// Kernels for tests/ibgda/test_gpu_ibgda.py: the IBGDA device path on a real GPU, posting to the soft NIC
// (a SoftMlx5Queue whose queue memory is mapped into the GPU). Compiled with NVRTC by gpuclient.compile.
#include <transportd/ibgda/ibgda.cuh>

// Every thread: ``iters`` x (put_signal of ``bytes`` to its own range of region 0, flag t % slots += 1;
// then signal the shared flag ``slots`` += 1), then quiet. Many warps contend for one QP's ticket.
extern "C" __global__ void ibgda_stress(tpd::IbgdaChannel ch, uint32_t peer, int iters, uint32_t bytes,
                                        uint32_t slots) {
    const uint64_t t = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x;
    for (int i = 0; i < iters; ++i) {
        const uint64_t off = (t * (uint64_t)iters + (uint64_t)i) * bytes;
        tpd::put_signal(ch, peer, 0, off, 0, off, bytes, (uint32_t)(t % slots), 1);
        tpd::signal(ch, peer, slots, 1);
    }
    tpd::quiet(ch);
}

// One thread: a put, a fence, then SET flag ``slot`` to ``value``; quiet; report status and error count.
extern "C" __global__ void ibgda_put_fence_set(tpd::IbgdaChannel ch, uint32_t peer, uint32_t bytes, uint32_t slot,
                                               unsigned long long value, uint32_t* out) {
    tpd::put(ch, peer, 0, 0, 0, 0, bytes);
    tpd::fence(ch, peer);
    tpd::signal(ch, peer, slot, value, tpd::SignalOp::Set);
    tpd::quiet(ch);
    out[0] = tpd::status(ch);
    out[1] = tpd::error_count(ch);
}

// One thread: a command naming an unregistered region, then a good put; the kernel reads the error word.
extern "C" __global__ void ibgda_bad_then_good(tpd::IbgdaChannel ch, uint32_t peer, uint32_t* out) {
    tpd::put(ch, peer, 7, 0, 0, 0, 64);
    tpd::put(ch, peer, 0, 0, 0, 0, 64);
    tpd::quiet(ch);
    out[0] = tpd::status(ch);
    out[1] = tpd::error_count(ch);
}

// Every thread, ``iters`` times: the odd lanes warp_put ``bytes`` to their own range of region 0 in the
// first half; then every lane warp_put_signals ``bytes`` to its own range in the second half, flag
// t % slots += 1. Thread 0 of each block quiets after a barrier. Many warps contend for one QP's ticket,
// each warp call claiming and ringing once per group_cap WQEBBs.
extern "C" __global__ void ibgda_warp_stress(tpd::IbgdaChannel ch, uint32_t peer, int iters, uint32_t bytes,
                                             uint32_t slots, unsigned long long half) {
    const uint64_t t = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x;
    for (int i = 0; i < iters; ++i) {
        const uint64_t off = (t * (uint64_t)iters + (uint64_t)i) * bytes;
        __syncwarp();  // the whole warp enters each call together: one group (and claim) per call
        tpd::warp_put(ch, (threadIdx.x & 1) != 0, peer, 0, off, 0, off, bytes);
        __syncwarp();
        tpd::warp_put_signal(ch, true, peer, 0, half + off, 0, half + off, bytes, (uint32_t)(t % slots), 1);
    }
    __syncthreads();
    if (threadIdx.x == 0) tpd::quiet(ch);
}

// The commands of tests/ibgda/test_gpu_ibgda.py's lane table, one per lane: lane l is active if bit l of
// ``active`` is set; it goes to peer 1, or to 1 + (l & 1) when ``two_peers``; lanes l % 3 == 2 put, the
// others put_signal (flag l % 4, value l + 1, SET when l % 5 == 4); lane 9 asks for 0 bytes (refused).
struct LaneCmd {
    bool put;
    uint32_t peer, bytes, slot;
    uint64_t off, value;
    tpd::SignalOp op;
};

__device__ LaneCmd lane_cmd(uint32_t l, int two_peers) {
    LaneCmd c;
    c.put = l % 3 == 2;
    c.peer = two_peers ? 1 + (l & 1) : 1;
    c.bytes = l == 9 ? 0 : 64 * (l + 1);
    c.slot = l % 4;
    c.off = (uint64_t)l * 4096;
    c.value = l + 1;
    c.op = l % 5 == 4 ? tpd::SignalOp::Set : tpd::SignalOp::Add;
    return c;
}

// One warp: every lane calls the warp form with its command (fence_first: lane 0 first fences peer 1).
extern "C" __global__ void ibgda_lanes_warp(tpd::IbgdaChannel ch, uint32_t active, int two_peers, int fence_first,
                                            unsigned long long* first_of) {
    const uint32_t l = threadIdx.x;
    if (fence_first && l == 0) tpd::fence(ch, 1);
    __syncwarp();
    const LaneCmd c = lane_cmd(l, two_peers);
    const bool on = (active >> l) & 1u;
    // every lane makes both calls (a warp call is made by the whole warp): the puts, then the put_signals
    const uint64_t put_at = tpd::warp_put(ch, on && c.put, c.peer, 0, c.off, 0, c.off, c.bytes);
    __syncwarp();
    const uint64_t signal_at =
        tpd::warp_put_signal(ch, on && !c.put, c.peer, 0, c.off, 0, c.off, c.bytes, c.slot, c.value, c.op);
    first_of[l] = c.put ? put_at : signal_at;
}

// One thread posts the same commands with the per-thread calls, in the warp's order: the puts in lane
// order, then the put_signals in lane order.
extern "C" __global__ void ibgda_lanes_single(tpd::IbgdaChannel ch, uint32_t active, int two_peers, int fence_first) {
    if (fence_first) tpd::fence(ch, 1);
    for (int puts = 1; puts >= 0; --puts) {  // the warp's order: its warp_put call, then its warp_put_signal
        for (uint32_t l = 0; l < 32; ++l) {
            const LaneCmd c = lane_cmd(l, two_peers);
            if (!((active >> l) & 1u) || c.put != (puts != 0)) continue;
            if (c.put)
                tpd::put(ch, c.peer, 0, c.off, 0, c.off, c.bytes);
            else
                tpd::put_signal(ch, c.peer, 0, c.off, 0, c.off, c.bytes, c.slot, c.value, c.op);
        }
    }
}
