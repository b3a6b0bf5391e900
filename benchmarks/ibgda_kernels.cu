// Kernels for benchmarks/ibgda_bench.py: the IBGDA posting path against a null NIC (ibgda_null_nic.cpp).
// Compiled with NVRTC by gpuclient.compile. Timing: %globaltimer (ns), read by tpd::ordering::now_ns.
#include <transportd/ibgda/ibgda.cuh>

namespace {

// op 0: put (1 WQE); 1: put_signal (2 WQEs in write/atomic mode, 3 in fence mode); 2: signal;
// 3: warp_put, 4: warp_put_signal (the same WQEs, one claim and one doorbell per warp; every lane of the
// warp calls, all active)
__device__ void one_op(const tpd::IbgdaChannel& ch, uint32_t peer, int op, uint64_t i, uint32_t bytes,
                       uint32_t slot) {
    const uint64_t off = (i * bytes) & ((1ull << 30) - 1);
    if (op == 0)
        tpd::put(ch, peer, 0, off, 0, off, bytes);
    else if (op == 1)
        tpd::put_signal(ch, peer, 0, off, 0, off, bytes, slot, 1);
    else if (op == 2)
        tpd::signal(ch, peer, slot, 1);
    else {
        __syncwarp();  // the whole warp enters a warp call together (one claim and one doorbell per call)
        if (op == 3)
            tpd::warp_put(ch, true, peer, 0, off, 0, off, bytes);
        else
            tpd::warp_put_signal(ch, true, peer, 0, off, 0, off, bytes, slot, 1);
    }
}

}  // namespace

// One thread (or the lanes of one warp) posts ``n`` ops each: out[0] = ns for the posts, out[1] = ns for
// the quiet after them, which lane 0 alone runs (so at most one probe WQE joins the count).
extern "C" __global__ void bench_single(tpd::IbgdaChannel ch, uint32_t peer, int n, int op, uint32_t bytes,
                                        unsigned long long* out) {
    const uint64_t lane = threadIdx.x;
    uint64_t t0 = tpd::ordering::now_ns();
    for (int i = 0; i < n; ++i) one_op(ch, peer, op, (uint64_t)i * blockDim.x + lane, bytes, 0);
    __syncwarp();
    if (lane != 0) return;
    uint64_t t1 = tpd::ordering::now_ns();
    tpd::quiet(ch);
    uint64_t t2 = tpd::ordering::now_ns();
    out[0] = t1 - t0;
    out[1] = t2 - t1;
}

// One thread, ``n`` rounds of (put, quiet): out[0] = ns for all rounds (a GPU -> NIC -> CQE -> GPU trip each).
extern "C" __global__ void bench_round_trip(tpd::IbgdaChannel ch, uint32_t peer, int n, uint32_t bytes,
                                            unsigned long long* out) {
    uint64_t t0 = tpd::ordering::now_ns();
    for (int i = 0; i < n; ++i) {
        tpd::put(ch, peer, 0, 0, 0, 0, bytes);
        tpd::quiet(ch);
    }
    out[0] = tpd::ordering::now_ns() - t0;
}

// Every thread posts ``n`` ops to the same QP, then quiets: out[0] = earliest start, out[1] = latest end.
extern "C" __global__ void bench_many(tpd::IbgdaChannel ch, uint32_t peer, int n, int op, uint32_t bytes,
                                      unsigned long long* out) {
    const uint64_t t = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x;
    uint64_t t0 = tpd::ordering::now_ns();
    for (int i = 0; i < n; ++i) one_op(ch, peer, op, t * (uint64_t)n + (uint64_t)i, bytes, (uint32_t)(t & 7));
    tpd::quiet(ch);
    uint64_t t1 = tpd::ordering::now_ns();
    atomicMin(out, (unsigned long long)t0);
    atomicMax(out + 1, (unsigned long long)t1);
}
