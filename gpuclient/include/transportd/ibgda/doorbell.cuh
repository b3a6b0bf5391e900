/*
 * transportd ibgda: telling the NIC about new WQEs, and about consumed CQEs.
 *
 * Send side (rdma-core providers/mlx5/qp.c, post_send_db), after the WQEs are stored:
 *
 *   1. fence      every WQE store is performed for the NIC before the doorbell record: here the record's
 *                 own store is a system-scope release (st.release.sys), which orders every earlier
 *                 store of the ringing thread, and the ticket holder rings for WQEs it stored itself
 *                 (earlier posters' WQEs were released by their own records); no separate fence
 *   2. dbrec      QP doorbell record word MLX5_SND_DBR (= 1) := be32(send counter & 0xffff), where the
 *                 send counter is the WQEBB index one past the last WQE posted
 *   3. fence      the doorbell record is visible before the doorbell
 *   4. doorbell   one 8-byte store of the last WQE's control-segment bytes 0..7 (opmod|index|opcode,
 *                 qpn|ds) to the UAR's doorbell register (BlueFlame offset): st.mmio.relaxed.sys
 *
 *   QP doorbell record (8 bytes):   | rcv counter:be32 (word 0, unused: no RQ) | snd counter:be32 |
 *
 * The NIC processes WQEs up to the index a doorbell names, so doorbells must reach it in index order:
 * queue_pair.cuh hands the right to ring from poster to poster with a ticket.
 *
 * Completion side (update_cons_index in cq.c): after consuming CQEs, CQ doorbell record word
 * MLX5_CQ_SET_CI (= 0) := be32(consumer index & 0xffffff), so the NIC may overwrite those entries.
 *
 *   CQ doorbell record (8 bytes):   | set_ci:be32 (word 0) | arm:be32 (word 1, unused: we poll) |
 */
#ifndef TRANSPORTD_IBGDA_DOORBELL_CUH
#define TRANSPORTD_IBGDA_DOORBELL_CUH

#include <transportd/ibgda/segments.cuh>
#include <transportd/ordering.cuh>

namespace tpd {
namespace ibgda {

constexpr uint32_t kCqSetCi = 0; /* MLX5_CQ_SET_CI: the consumer index's word in the CQ dbrec */

/** The value of the QP doorbell record's send word for send counter ``head`` (WQEBBs posted). */
TPD_HOST_DEVICE uint32_t sq_dbrec_value(uint64_t head) { return be32((uint32_t)(head & 0xffffu)); }

/** The value of the CQ doorbell record's set_ci word for consumer index ``ci``. */
TPD_HOST_DEVICE uint32_t cq_dbrec_value(uint64_t ci) { return be32((uint32_t)(ci & 0xffffffu)); }

/** Steps 1-4 above: publish WQEBBs [.., head) and ring with ``last_ctrl_word`` (doorbell_word of the
 *  last WQE). The caller holds the ticket for ``head``'s WQEs. */
TPD_HOST_DEVICE void ring_send_doorbell(uint32_t* dbrec, uint64_t* bf, uint64_t head, uint64_t last_ctrl_word) {
    ordering::st_release_sys(dbrec + kSendDbr, sq_dbrec_value(head));  // steps 1 and 2
    ordering::fence_sys();
    ordering::st_mmio_relaxed_sys(bf, last_ctrl_word);
}

/** Give consumed CQ entries back to the NIC. */
TPD_HOST_DEVICE void update_cq_doorbell(uint32_t* cq_dbrec, uint64_t ci) {
    ordering::st_release_sys(cq_dbrec + kCqSetCi, cq_dbrec_value(ci));
}

}  // namespace ibgda
}  // namespace tpd

#endif /* TRANSPORTD_IBGDA_DOORBELL_CUH */
