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

// One command of a group (tests/ibgda/test_group_post.py's GROUP_CMD_DTYPE): kind 0 put, 1 put_signal.
struct GroupCmd {
    uint32_t kind, peer;
    uint64_t dst_off, src_off;
    uint32_t bytes, slot;
    uint64_t value;
    uint32_t set, dst_region;
};
static_assert(sizeof(GroupCmd) == 48, "GroupCmd is 48 bytes");

// Post ``count`` (<= 64) commands to ``cmds[0].peer`` as one group (post_group: one claim and one doorbell
// per group_cap WQEBBs), each built by the channel's own builders, as the lanes of a warp build theirs.
// first_of[i] receives command i's first WQEBB, or kNoWqe if it was refused.
void tpd_test_post_group(const IbgdaChannel* ch, const GroupCmd* cmds, uint32_t count, uint64_t* first_of) {
    Batch b[64];
    Ordered o[64];
    const QueuePair* qp = nullptr;
    for (uint32_t i = 0; i < count && i < 64; ++i) {
        const GroupCmd& c = cmds[i];
        const uint16_t region = (uint16_t)c.dst_region;
        const QueuePair* q =
            c.kind == 0 ? tpd::ibgda::detail::build_put(*ch, c.peer, region, c.dst_off, 0, c.src_off, c.bytes, b[i])
                        : tpd::ibgda::detail::build_put_signal(*ch, c.peer, region, c.dst_off, 0, c.src_off, c.bytes,
                                                               c.slot, c.value, c.set ? SignalOp::Set : SignalOp::Add,
                                                               b[i], o[i]);
        if (q) qp = q;
    }
    if (qp) {
        post_group(*qp, b, o, count < 64 ? count : 64, first_of);
    } else {
        for (uint32_t i = 0; i < count; ++i) first_of[i] = kNoWqe;
    }
}

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

// ``threads`` native threads each post ``iters`` groups of ``group`` (<= 64) put_signals with post_group (as
// many warps post at once): thread t, group i, member k writes ``bytes`` at offset ((t * iters + i) * group
// + k) * bytes of region 0 and adds 1 to flag (t + k) % slots; every thread quiets at the end.
void tpd_test_group_stress(const IbgdaChannel* ch, uint32_t peer, int threads, int iters, uint32_t group,
                           uint32_t bytes, uint32_t slots) {
    std::vector<std::thread> pool;
    for (int t = 0; t < threads; ++t) {
        pool.emplace_back([=] {
            Batch b[64];
            Ordered o[64];
            for (int i = 0; i < iters; ++i) {
                const QueuePair* qp = nullptr;
                for (uint32_t k = 0; k < group && k < 64; ++k) {
                    b[k] = Batch();
                    o[k] = Ordered();
                    uint64_t off = (((uint64_t)t * iters + i) * group + k) * bytes;
                    qp = tpd::ibgda::detail::build_put_signal(*ch, peer, 0, off, 0, off, bytes, (t + k) % slots, 1,
                                                              SignalOp::Add, b[k], o[k]);
                }
                if (qp) post_group(*qp, b, o, group < 64 ? group : 64);
            }
            tpd::quiet(*ch);
        });
    }
    for (auto& th : pool) th.join();
}

}  // extern "C"
