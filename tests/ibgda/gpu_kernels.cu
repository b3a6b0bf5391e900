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
