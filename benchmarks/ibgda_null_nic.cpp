// A null NIC for IBGDA benchmarks: a host thread that watches one queue's doorbell record, "completes"
// every WQE at once (nothing moves) and writes the CQEs the WQEs asked for, so what is measured is the
// GPU's posting path (build, claim, ticket, doorbell record, doorbell, CQ polling) and not a transport.
// Built with g++ -shared by benchmarks/ibgda_bench.py (and by a CPU test); used through ctypes.
//
// It keeps the NIC's side of the contract: WQEs are read only after the doorbell record covers them
// (acquire), a CQE's op_own byte is written last (release), and the CQ is never overrun (set_ci).
#include <atomic>
#include <thread>

#include <transportd/ibgda/ibgda.cuh>

using namespace tpd::ibgda;

namespace {

struct NullNic {
    uint8_t* sq;
    uint32_t* dbrec;
    uint8_t* cq;
    uint32_t* cq_dbrec;
    uint32_t qpn, wqe_cnt, ncqes;
    std::atomic<bool> stop{false};
    std::atomic<uint64_t> wqes{0};
    std::atomic<uint64_t> cqes{0};
    std::thread thread;

    void write_cqe(uint64_t pi, uint64_t index, uint8_t opcode) {
        for (;;) {  // wait for room: set_ci is the poller's consumer index (24 bits)
            uint32_t ci24 = be32(__atomic_load_n(cq_dbrec + kCqSetCi, __ATOMIC_ACQUIRE)) & 0xffffffu;
            uint64_t ci = pi - ((pi - ci24) & 0xffffffu);
            if (pi - ci < ncqes || stop.load(std::memory_order_relaxed)) break;
            std::this_thread::yield();
        }
        Cqe64* e = reinterpret_cast<Cqe64*>(cq + (pi & (ncqes - 1)) * 64);
        Cqe64 c;
        memset(&c, 0, sizeof c);
        c.byte_cnt_be = be32(opcode == (uint8_t)Mlx5Opcode::AtomicFetchAdd ? 8u : 0u);
        c.sop_drop_qpn_be = be32(((uint32_t)opcode << 24) | qpn);
        c.wqe_counter_be = be16((uint16_t)index);
        memcpy(e, &c, 63);
        __atomic_store_n(&e->op_own, (uint8_t)(((uint8_t)CqeOpcode::Req << 4) | ((pi & ncqes) ? 1 : 0)),
                         __ATOMIC_RELEASE);
    }

    void run() {
        uint64_t posted = 0, fetched = 0, pi = 0;
        while (!stop.load(std::memory_order_relaxed)) {
            uint16_t head = (uint16_t)be32(__atomic_load_n(dbrec + kSendDbr, __ATOMIC_ACQUIRE));
            posted += (uint16_t)(head - (uint16_t)posted);
            if (fetched == posted) {
                std::this_thread::yield();
                continue;
            }
            while (fetched < posted) {
                const CtrlSeg* c = reinterpret_cast<const CtrlSeg*>(sq + (fetched & (wqe_cnt - 1)) * 64);
                uint32_t ds = be32(c->qpn_ds_be) & 0x3fu;
                uint8_t opcode = (uint8_t)be32(c->opmod_idx_opcode_be);
                if (c->fm_ce_se & kCtrlCqUpdate) {
                    write_cqe(pi++, fetched, opcode);
                    cqes.fetch_add(1, std::memory_order_relaxed);
                }
                wqes.fetch_add(1, std::memory_order_relaxed);
                fetched += ds ? (ds * 16 + 63) / 64 : 1;
            }
        }
    }
};

}  // namespace

extern "C" {

void* tpd_null_nic_start(uint8_t* sq, uint32_t* dbrec, uint8_t* cq, uint32_t* cq_dbrec, uint32_t qpn,
                         uint32_t wqe_cnt, uint32_t ncqes) {
    NullNic* n = new NullNic;
    n->sq = sq;
    n->dbrec = dbrec;
    n->cq = cq;
    n->cq_dbrec = cq_dbrec;
    n->qpn = qpn;
    n->wqe_cnt = wqe_cnt;
    n->ncqes = ncqes;
    n->thread = std::thread([n] { n->run(); });
    return n;
}

// Stop the thread; returns the WQEs it saw (and stores the CQEs it wrote in *cqes).
uint64_t tpd_null_nic_stop(void* handle, uint64_t* cqes) {
    NullNic* n = static_cast<NullNic*>(handle);
    n->stop.store(true);
    n->thread.join();
    uint64_t w = n->wqes.load();
    if (cqes) *cqes = n->cqes.load();
    delete n;
    return w;
}

}  // extern "C"
