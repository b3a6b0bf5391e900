// The IBGDA device code, compiled for the host: a C ABI over <transportd/ibgda/ibgda.cuh> for the CPU
// tests (loaded with ctypes). Every function calls the header's own __host__ __device__ code — the same
// builders, doorbell, ticket, CQ polling and channel operations a kernel runs — so driving the soft
// NIC from here tests the real device path, minus the GPU. ctypes releases the GIL around each call, so
// Python threads calling in concurrently post concurrently; tpd_test_stress adds native threads.
#include <thread>
#include <vector>

#include <transportd/ibgda/ibgda.cuh>

using namespace tpd::ibgda;
using tpd::IbgdaChannel;
using tpd::SignalOp;

extern "C" {

// --- builders, one WQE into ``out`` (64 bytes) -------------------------------------------------------
void tpd_test_build_write(void* out, uint64_t index, uint32_t qpn, uint8_t fm, uint64_t raddr, uint32_t rkey,
                          uint64_t laddr, uint32_t lkey, uint32_t bytes) {
    store_wqe(out, rdma_write(index, qpn, fm, raddr, rkey, laddr, lkey, bytes));
}
void tpd_test_build_inline8(void* out, uint64_t index, uint32_t qpn, uint8_t fm, uint64_t raddr, uint32_t rkey,
                            uint64_t value) {
    store_wqe(out, rdma_write_inline8(index, qpn, fm, raddr, rkey, value));
}
void tpd_test_build_read(void* out, uint64_t index, uint32_t qpn, uint8_t fm, uint64_t raddr, uint32_t rkey,
                         uint64_t laddr, uint32_t lkey, uint32_t bytes) {
    store_wqe(out, rdma_read(index, qpn, fm, raddr, rkey, laddr, lkey, bytes));
}
void tpd_test_build_fadd(void* out, uint64_t index, uint32_t qpn, uint8_t fm, uint64_t raddr, uint32_t rkey,
                         uint64_t add, uint64_t laddr, uint32_t lkey) {
    store_wqe(out, atomic_fetch_add(index, qpn, fm, raddr, rkey, add, laddr, lkey));
}
void tpd_test_build_nop(void* out, uint64_t index, uint32_t qpn, uint8_t fm) { store_wqe(out, nop(index, qpn, fm)); }

uint8_t tpd_test_ctrl_flags(int completion, int fence) { return ctrl_flags(completion != 0, fence != 0); }

uint64_t tpd_test_doorbell_word(const void* wqe) {
    Wqe w;
    memcpy(&w, wqe, sizeof w);
    return doorbell_word(w);
}

// doorbell record + doorbell for send counter ``head`` (what a poster does after storing WQEs)
void tpd_test_ring(uint32_t* dbrec, uint64_t* bf, uint64_t head, uint64_t word) {
    ring_send_doorbell(dbrec, bf, head, word);
}

int tpd_test_cqe_ready(uint8_t op_own, uint64_t ci, uint32_t ncqes) { return cqe_ready(op_own, ci, ncqes); }

// --- one QP ------------------------------------------------------------------------------------------
void tpd_test_qp_progress(const QueuePair* qp) { progress(*qp); }
uint32_t tpd_test_qp_quiet(const QueuePair* qp) { return quiet(*qp); }

// --- the channel: the device API ---------------------------------------------------------------------
void tpd_test_put(const IbgdaChannel* ch, uint32_t peer, uint16_t dst_region, uint64_t dst_off, uint16_t src_region,
                  uint64_t src_off, uint32_t bytes) {
    tpd::put(*ch, peer, dst_region, dst_off, src_region, src_off, bytes);
}
void tpd_test_put_signal(const IbgdaChannel* ch, uint32_t peer, uint16_t dst_region, uint64_t dst_off,
                         uint16_t src_region, uint64_t src_off, uint32_t bytes, uint32_t slot, uint64_t value,
                         int set) {
    tpd::put_signal(*ch, peer, dst_region, dst_off, src_region, src_off, bytes, slot, value,
                    set ? SignalOp::Set : SignalOp::Add);
}
void tpd_test_signal(const IbgdaChannel* ch, uint32_t peer, uint32_t slot, uint64_t value, int set) {
    tpd::signal(*ch, peer, slot, value, set ? SignalOp::Set : SignalOp::Add);
}
void tpd_test_fence(const IbgdaChannel* ch, uint32_t peer) { tpd::fence(*ch, peer); }
void tpd_test_quiet(const IbgdaChannel* ch) { tpd::quiet(*ch); }
uint64_t tpd_test_wait(const IbgdaChannel* ch, uint32_t slot, uint64_t at_least) {
    return tpd::wait(*ch, slot, at_least);
}
uint32_t tpd_test_status(const IbgdaChannel* ch) { return tpd::status(*ch); }
uint32_t tpd_test_error_count(const IbgdaChannel* ch) { return tpd::error_count(*ch); }

// ``threads`` native threads each post ``iters`` put_signals to ``peer``: thread t, iteration i writes
// ``bytes`` at offset (t * iters + i) * bytes of region 0 (source and destination), then adds 1 to flag
// slot ``t % slots`` and to the shared slot ``slots``; every thread quiets at the end.
void tpd_test_stress(const IbgdaChannel* ch, uint32_t peer, int threads, int iters, uint32_t bytes, uint32_t slots) {
    std::vector<std::thread> pool;
    for (int t = 0; t < threads; ++t) {
        pool.emplace_back([=] {
            for (int i = 0; i < iters; ++i) {
                uint64_t off = ((uint64_t)t * iters + i) * bytes;
                tpd::put_signal(*ch, peer, 0, off, 0, off, bytes, (uint32_t)t % slots, 1);
                tpd::signal(*ch, peer, slots, 1);
            }
            tpd::quiet(*ch);
        });
    }
    for (auto& th : pool) th.join();
}

}  // extern "C"
