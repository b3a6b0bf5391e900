/*
 * transportd ibgda: building send WQEs (the layouts are in segments.cuh).
 *
 * Builders are pure __host__ __device__ functions returning a Wqe image by value: the GPU builds it in
 * registers and stores it with four 16-byte stores (store_wqe); the CPU tests call the very same
 * functions and compare the bytes with the Python decoder (ibgda/mlx5_layout.py). Fields follow
 * rdma-core's mlx5 provider exactly:
 *
 *   ctrl.opmod_idx_opcode = be32(opmod << 24 | wqe_index << 8 | opcode)   (mlx5dv_set_ctrl_seg)
 *   ctrl.qpn_ds           = be32(qpn << 8 | ds)
 *   ctrl.fm_ce_se         = fence | (signaled ? CQ_UPDATE : 0)              (IBV_SEND_FENCE, _SIGNALED)
 *   raddr                 = be64(remote address), be32(rkey), 0             (set_raddr_seg)
 *   data                  = be32(bytes), be32(lkey), be64(local address)    (mlx5dv_set_data_seg)
 *   inline                = be32(bytes | MLX5_INLINE_SEG), then the bytes   (set_data_inl_seg)
 *   atomic (fetch-add)    = be64(add), compare 0                            (_set_atomic_seg)
 *
 * A zero-length transfer has no data segment (rdma-core skips zero-length SGEs): a data segment of
 * byte_count 0 would mean 2 GiB to the NIC.
 */
#ifndef TRANSPORTD_IBGDA_WQE_CUH
#define TRANSPORTD_IBGDA_WQE_CUH

#include <transportd/ibgda/segments.cuh>

#if !defined(TPD_NVRTC) && !defined(__CUDA_ARCH__)
#include <string.h>
#endif

namespace tpd {
namespace ibgda {

/** fm_ce_se for a WQE: ask for a CQE (IBV_SEND_SIGNALED) and/or fence it (IBV_SEND_FENCE). */
TPD_HOST_DEVICE uint8_t ctrl_flags(bool completion, bool fence) {
    return (uint8_t)((completion ? kCtrlCqUpdate : 0u) | (fence ? kCtrlFence : 0u));
}

/** The control segment of a WQE whose first WQEBB has counter ``index`` (only its low 16 bits travel). */
TPD_HOST_DEVICE CtrlSeg make_ctrl(uint64_t index, Mlx5Opcode opcode, uint32_t qpn, uint32_t ds, uint8_t fm_ce_se,
                                  uint8_t opmod = 0) {
    CtrlSeg c;
    c.opmod_idx_opcode_be = be32(((uint32_t)opmod << 24) | (((uint32_t)index & 0xffffu) << 8) | (uint32_t)opcode);
    c.qpn_ds_be = be32(((qpn & 0xffffffu) << 8) | (ds & 0x3fu));
    c.signature = 0;
    c.stream_id_be[0] = 0;
    c.stream_id_be[1] = 0;
    c.fm_ce_se = fm_ce_se;
    c.imm_be = 0;
    return c;
}

TPD_HOST_DEVICE RaddrSeg make_raddr(uint64_t raddr, uint32_t rkey) {
    RaddrSeg r;
    r.raddr_be = be64(raddr);
    r.rkey_be = be32(rkey);
    r.reserved = 0;
    return r;
}

TPD_HOST_DEVICE DataSeg make_data(uint64_t addr, uint32_t lkey, uint32_t bytes) {
    DataSeg d;
    d.byte_count_be = be32(bytes);
    d.lkey_be = be32(lkey);
    d.addr_be = be64(addr);
    return d;
}

/** An all-zero WQEBB (what the unused segments of every builder hold). */
TPD_HOST_DEVICE Wqe zero_wqe() {
    Wqe w;
    w.ctrl = make_ctrl(0, Mlx5Opcode::Nop, 0, 0, 0);
    for (int i = 0; i < 3; ++i)
        for (int j = 0; j < 4; ++j) w.seg[i].words[j] = 0;
    return w;
}

/** RDMA write of ``bytes`` (1 .. 2^31-1) from (laddr, lkey) to (raddr, rkey): ctrl | raddr | data, ds 3. */
TPD_HOST_DEVICE Wqe rdma_write(uint64_t index, uint32_t qpn, uint8_t fm_ce_se, uint64_t raddr, uint32_t rkey,
                               uint64_t laddr, uint32_t lkey, uint32_t bytes) {
    Wqe w = zero_wqe();
    w.ctrl = make_ctrl(index, Mlx5Opcode::RdmaWrite, qpn, 3, fm_ce_se);
    w.seg[0].raddr = make_raddr(raddr, rkey);
    w.seg[1].data = make_data(laddr, lkey, bytes);
    return w;
}

/** RDMA write of one 8-byte value carried inline (a flag): ctrl | raddr | inline(8), ds 3.
 *  The value lands in remote memory as the little-endian u64 ``value``. */
TPD_HOST_DEVICE Wqe rdma_write_inline8(uint64_t index, uint32_t qpn, uint8_t fm_ce_se, uint64_t raddr, uint32_t rkey,
                                       uint64_t value) {
    Wqe w = zero_wqe();
    w.ctrl = make_ctrl(index, Mlx5Opcode::RdmaWrite, qpn, 3, fm_ce_se);
    w.seg[0].raddr = make_raddr(raddr, rkey);
    w.seg[1].inl.byte_count_be = be32(8u | kInlineSeg);
    w.seg[1].inl.data[0] = (uint32_t)value;
    w.seg[1].inl.data[1] = (uint32_t)(value >> 32);
    return w;
}

/** RDMA read of ``bytes`` from (raddr, rkey) into (laddr, lkey). bytes == 0 is the ordering read:
 *  ctrl | raddr, ds 2 — it touches no memory and needs no valid key (IBTA: no R_Key check at length 0). */
TPD_HOST_DEVICE Wqe rdma_read(uint64_t index, uint32_t qpn, uint8_t fm_ce_se, uint64_t raddr, uint32_t rkey,
                              uint64_t laddr, uint32_t lkey, uint32_t bytes) {
    Wqe w = zero_wqe();
    w.ctrl = make_ctrl(index, Mlx5Opcode::RdmaRead, qpn, bytes ? 3u : 2u, fm_ce_se);
    w.seg[0].raddr = make_raddr(raddr, rkey);
    if (bytes) w.seg[1].data = make_data(laddr, lkey, bytes);
    return w;
}

/** 8-byte fetch-and-add of ``add`` at (raddr, rkey); the old value lands at (laddr, lkey):
 *  ctrl | raddr | atomic | data(8), ds 4. raddr must be 8-byte aligned. */
TPD_HOST_DEVICE Wqe atomic_fetch_add(uint64_t index, uint32_t qpn, uint8_t fm_ce_se, uint64_t raddr, uint32_t rkey,
                                     uint64_t add, uint64_t laddr, uint32_t lkey) {
    Wqe w = zero_wqe();
    w.ctrl = make_ctrl(index, Mlx5Opcode::AtomicFetchAdd, qpn, 4, fm_ce_se);
    w.seg[0].raddr = make_raddr(raddr, rkey);
    w.seg[1].atomic.swap_add_be = be64(add);
    w.seg[1].atomic.compare_be = 0;
    w.seg[2].data = make_data(laddr, lkey, 8);
    return w;
}

/** NOP: ctrl only, ds 1 (completes in order; useful to ask for a CQE without moving data). */
TPD_HOST_DEVICE Wqe nop(uint64_t index, uint32_t qpn, uint8_t fm_ce_se) {
    Wqe w = zero_wqe();
    w.ctrl = make_ctrl(index, Mlx5Opcode::Nop, qpn, 1, fm_ce_se);
    return w;
}

/** The doorbell word: the first 8 bytes of the WQE's control segment, as a u64 in memory order. */
TPD_HOST_DEVICE uint64_t doorbell_word(const Wqe& w) {
    return (uint64_t)w.ctrl.opmod_idx_opcode_be | ((uint64_t)w.ctrl.qpn_ds_be << 32);
}

/** Store a WQE image into its send-queue slot (64-byte aligned): four 16-byte stores on the GPU. */
TPD_HOST_DEVICE void store_wqe(void* slot, const Wqe& w) {
#if defined(__CUDA_ARCH__)
    const uint4* src = reinterpret_cast<const uint4*>(&w);
    uint4* dst = reinterpret_cast<uint4*>(slot);
#pragma unroll
    for (int i = 0; i < 4; ++i) dst[i] = src[i];
#else
    memcpy(slot, &w, sizeof(Wqe));
#endif
}

/** Rewrite fm_ce_se of a WQE already in its slot (the ticket holder adds a pending tpd::fence's bit;
 *  it passes the whole byte, so nothing is read back from the queue). */
TPD_HOST_DEVICE void set_fm_ce_se_in_slot(void* slot, uint8_t fm_ce_se) {
    reinterpret_cast<uint8_t*>(slot)[kFmCeSeOffset] = fm_ce_se;
}

/** Rewrite the 8-byte value of an inline flag write already in its slot (two 4-byte stores). */
TPD_HOST_DEVICE void set_inline8_in_slot(void* slot, uint64_t value) {
    uint32_t* p = reinterpret_cast<uint32_t*>(reinterpret_cast<uint8_t*>(slot) + kInlineDataOffset);
    p[0] = (uint32_t)value;
    p[1] = (uint32_t)(value >> 32);
}

}  // namespace ibgda
}  // namespace tpd

#endif /* TRANSPORTD_IBGDA_WQE_CUH */
