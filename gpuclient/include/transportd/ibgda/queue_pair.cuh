/*
 * transportd ibgda: one RC queue pair driven from the GPU — many threads post, one doorbell at a time.
 *
 * Protocol (any thread of any block may post to a QP):
 *
 *   claim     first = atomicAdd(claimed, n): WQEBBs [first, first + n) belong to this poster.
 *   space     its last slot is free once done >= first + n - wqe_cnt (done: WQEBBs the CQ reported
 *             complete). A poster that has to wait drives the CQ itself (progress), so nobody waits on a
 *             thread that is not running.
 *   build     the WQEs are built in registers, stamped with their indices, and stored into their slots
 *             outside any lock: posters write their WQEs in parallel.
 *   ticket    wait until posted == first (acquire): every earlier poster has rung for its WQEs.
 *   ordered   the ticket holder applies what depends on the order the NIC executes WQEs in: the fence bit
 *             a tpd::fence left pending for "the next WQE", and write-mode flag values (the absolute
 *             value of a shadow counter: ADD by posting order, so the last flag write carries the sum).
 *   publish   fence.sc.sys; doorbell record := first + n; fence; doorbell (doorbell.cuh).
 *   hand on   posted := first + n (release): the next poster may ring. Then rings += 1 (diagnostics).
 *
 * A poster may be one thread with one command (post), one thread with several (post_group), or the lanes
 * of a warp (ibgda/warp.cuh): then one lane claims and rings for all, every lane builds and stores its
 * own WQEs at its offset in the claim, and the ticket holder applies the ordered step to each command in
 * order. The WQEs are byte for byte what the same commands posted one by one would produce; only the
 * number of claims, tickets and doorbells differs (QpState::rings counts doorbells).
 *
 * Why it is right:
 *   - Doorbells and doorbell-record values rise monotonically: only the ticket holder writes them, and
 *     tickets go in claim order.
 *   - The NIC never reads a half-written WQE: each poster's fence.sc.sys orders its WQE stores before its
 *     doorbell record, and the ticket's release/acquire chain makes every earlier poster's WQEs visible
 *     before ours (the fence is cumulative over what this thread has observed).
 *   - No deadlock: a poster holds nothing while it waits for space, and waits for the ticket only with
 *     its WQEs stored; the lowest unposted claim has the weakest space condition and owns the ticket,
 *     so it always proceeds.
 *   - done keeps advancing while work is outstanding: a WQE asks for a CQE (CQ_UPDATE) when it ends a
 *     period of wqe_cnt / 4 WQEBBs, and quiet posts a signalled zero-length read when no CQE was asked
 *     for at or after the last posted WQE. RC completes in order: a CQE for WQEBB i retires every WQE
 *     before it, signalled or not. A claim [first, first + n) needs done >= first + n - wqe_cnt; the last
 *     period end before first is at most wqe_cnt / 4 back, and everything before first gets posted (by
 *     induction on claim order), so done can reach first - wqe_cnt / 4 + 1: enough whenever
 *     n <= 3 * wqe_cnt / 4 + 1. A single post claims at most 3 WQEBBs (one per WQE); a group is cut into
 *     claims of at most group_cap(qp) + 2 = wqe_cnt / 2 + 2 (the cut is by offset, so a command never
 *     straddles two claims), within the bound for every wqe_cnt >= 8.
 *   - The CQ never overflows: at most one CQE per WQE (errors and flushes included), at most wqe_cnt WQEs
 *     outstanding, ncqes >= wqe_cnt, and a slot is reused only after the CQE that freed it was consumed.
 *
 * Errors: an error CQE retires WQEs up to its wqe_counter like a normal one; the first syndrome is kept
 * in QpState::error and quiet returns it. The QP is then in the error state, so every later WQE
 * completes with a flush CQE (WR_FLUSH_ERR): posting and quiet still finish, nothing hangs. The host
 * resets or recreates the QP.
 */
#ifndef TRANSPORTD_IBGDA_QUEUE_PAIR_CUH
#define TRANSPORTD_IBGDA_QUEUE_PAIR_CUH

#include <transportd/ibgda/cqe.cuh>
#include <transportd/ibgda/doorbell.cuh>
#include <transportd/ibgda/wqe.cuh>

namespace tpd {
namespace ibgda {

/*
 * The posters' shared counters, in GPU memory (zeroed by the host before the first post), one
 * 128-byte line per writer role so the roles do not false-share:
 *
 *   line 0  | claimed:u64     WQEBBs claimed (every poster atomically adds)                      |
 *   line 1  | posted:u64      WQEBBs rung (the ticket)  | signaled:u64  end of the last WQE that |
 *           |                 asked for a CQE           | fence_next:u32 | rings:u32  doorbells   |
 *           |                 rung (diagnostics; wraps at 2^32; each poster adds 1 atomically   |
 *           |                 right after it hands the ticket on: read it when posting is over)  |
 *   line 2  | done:u64        WQEBBs reported complete  | cq_ci:u64  CQEs consumed               |
 *           | cq_lock:u32     one CQ poller at a time   | error:u32  first error (0 = none)      |
 *
 * error = syndrome | vendor_err << 8 | cqe opcode << 16 of the first error CQE.
 */
struct QpState {
    uint64_t claimed;
    uint64_t pad0[15];
    uint64_t posted;
    uint64_t signaled;
    uint32_t fence_next;
    uint32_t rings;
    uint64_t pad1[13];
    uint64_t done;
    uint64_t cq_ci;
    uint32_t cq_lock;
    uint32_t error;
    uint64_t pad2[13];
};
TPD_STATIC_ASSERT(sizeof(QpState) == 384, "QpState is three 128-byte lines");
TPD_STATIC_ASSERT_OFFSET(offsetof(QpState, claimed) == 0, "claimed at 0");
TPD_STATIC_ASSERT_OFFSET(offsetof(QpState, posted) == 128, "posted at 128");
TPD_STATIC_ASSERT_OFFSET(offsetof(QpState, signaled) == 136, "signaled at 136");
TPD_STATIC_ASSERT_OFFSET(offsetof(QpState, fence_next) == 144, "fence_next at 144");
TPD_STATIC_ASSERT_OFFSET(offsetof(QpState, rings) == 148, "rings at 148");
TPD_STATIC_ASSERT_OFFSET(offsetof(QpState, done) == 256, "done at 256");
TPD_STATIC_ASSERT_OFFSET(offsetof(QpState, cq_ci) == 264, "cq_ci at 264");
TPD_STATIC_ASSERT_OFFSET(offsetof(QpState, cq_lock) == 272, "cq_lock at 272");
TPD_STATIC_ASSERT_OFFSET(offsetof(QpState, error) == 276, "error at 276");

/*
 * QueuePair: the device handle of one RC QP (plain fields, 72 bytes; ibgda/device_handle.py mirrors it):
 *
 *   word 0 | sq:u64          send queue: wqe_cnt WQEBBs of 64 bytes (host-mapped or GPU memory)   |
 *   word 1 | dbrec:u64       QP doorbell record (two be32: receive, send)                          |
 *   word 2 | bf:u64          doorbell register in the UAR page (BlueFlame offset), 8-byte MMIO     |
 *   word 3 | cq:u64          CQ: ncqes 64-byte CQEs                                                |
 *   word 4 | cq_dbrec:u64    CQ doorbell record (be32 set_ci, be32 arm)                            |
 *   word 5 | state:u64       QpState (GPU memory)                                                  |
 *   word 6 | scratch:u64     8 local bytes under scratch_lkey: where fetch-and-add returns the old value |
 *   word 7 | qpn:u32                         | wqe_cnt:u32   power of two, 8 .. 32768           |
 *   word 8 | ncqes:u32 power of two >= wqe_cnt | scratch_lkey:u32                               |
 *
 * The handle does not change while kernels run, and the posting calls (post, post_group, quiet, the warp
 * leader) copy it into a local first. Every acquire, release and fence below is a compiler barrier for
 * memory (ordering.cuh), so a field read through a reference into the channel's table after one of them
 * is a fresh load, and after an acquire (which invalidates L1) an L2 round trip on the ticket holder's
 * path (read again in each of wait_ticket, take_fence and publish, ``state`` put two such dependent loads
 * on every single put's way to its doorbell). The copy lives in registers.
 */
struct QueuePair {
    uint8_t* sq;
    uint32_t* dbrec;
    uint64_t* bf;
    Cqe64* cq;
    uint32_t* cq_dbrec;
    QpState* state;
    uint64_t scratch;
    uint32_t qpn;
    uint32_t wqe_cnt;
    uint32_t ncqes;
    uint32_t scratch_lkey;
};
TPD_STATIC_ASSERT(sizeof(QueuePair) == 72, "QueuePair is nine 8-byte words");
TPD_STATIC_ASSERT_OFFSET(offsetof(QueuePair, sq) == 0, "sq at 0");
TPD_STATIC_ASSERT_OFFSET(offsetof(QueuePair, dbrec) == 8, "dbrec at 8");
TPD_STATIC_ASSERT_OFFSET(offsetof(QueuePair, bf) == 16, "bf at 16");
TPD_STATIC_ASSERT_OFFSET(offsetof(QueuePair, cq) == 24, "cq at 24");
TPD_STATIC_ASSERT_OFFSET(offsetof(QueuePair, cq_dbrec) == 32, "cq_dbrec at 32");
TPD_STATIC_ASSERT_OFFSET(offsetof(QueuePair, state) == 40, "state at 40");
TPD_STATIC_ASSERT_OFFSET(offsetof(QueuePair, scratch) == 48, "scratch at 48");
TPD_STATIC_ASSERT_OFFSET(offsetof(QueuePair, qpn) == 56, "qpn at 56");
TPD_STATIC_ASSERT_OFFSET(offsetof(QueuePair, wqe_cnt) == 60, "wqe_cnt at 60");
TPD_STATIC_ASSERT_OFFSET(offsetof(QueuePair, ncqes) == 64, "ncqes at 64");
TPD_STATIC_ASSERT_OFFSET(offsetof(QueuePair, scratch_lkey) == 68, "scratch_lkey at 68");

/** Up to three WQEs posted together (one claim, one doorbell): a payload, an ordering read, a flag. */
struct Batch {
    Wqe w[3];
    uint32_t n = 0;
    bool completion = false;  /* ask for a CQE on the last WQE (quiet's probe) */
};

/** What the ticket holder fills in (queue_pair.cuh's "ordered" step). */
struct Ordered {
    int flag_wqe = -1;           /* which WQE of the batch is a write-mode flag write; -1: none */
    uint64_t* shadow = nullptr;  /* its absolute-value counter (GPU memory) */
    uint64_t value = 0;          /* the ADD increment or the SET value */
    bool set = false;
    bool fence_after = false;    /* the batch ends with an ordering read: fence the next WQE posted */
};

TPD_HOST_DEVICE uint8_t* wqe_slot(const QueuePair& qp, uint64_t index) {
    return qp.sq + (size_t)(index & (qp.wqe_cnt - 1)) * kWqeBasicBlock;
}

/** Does WQEBB ``index`` end a CQE period (wqe_cnt / 4 WQEBBs)? */
TPD_HOST_DEVICE bool ends_period(const QueuePair& qp, uint64_t index) {
    return ((index + 1) & ((qp.wqe_cnt >> 2) - 1)) == 0;
}

/** Put ``index`` (its low 16 bits) into a built WQE's control segment, keeping opmod and opcode. */
TPD_HOST_DEVICE void stamp_index(Wqe& w, uint64_t index) {
    uint32_t v = be32(w.ctrl.opmod_idx_opcode_be);
    w.ctrl.opmod_idx_opcode_be = be32((v & 0xff0000ffu) | (((uint32_t)index & 0xffffu) << 8));
}

/**
 * Consume the CQEs that are ready (one poller at a time; others return at once): advance done, keep the
 * first error, give the entries back to the NIC. Called by posters waiting for space and by quiet.
 */
TPD_HOST_DEVICE void progress(const QueuePair& qp) {
    QpState* st = qp.state;
    if (!ordering::try_lock_gpu(&st->cq_lock)) return;
    const uint64_t start = st->cq_ci;
    uint64_t ci = start;
    uint64_t done = st->done;
    while (ci - start < qp.ncqes) {
        const Cqe64* e = qp.cq + (ci & (qp.ncqes - 1));
        uint64_t tail = ordering::ld_acquire_sys(reinterpret_cast<const uint64_t*>(&e->sop_drop_qpn_be));
        if (!cqe_ready((uint8_t)(tail >> 56), ci, qp.ncqes)) break;
        uint8_t opcode = cqe_opcode((uint8_t)(tail >> 56));
        if (opcode != (uint8_t)CqeOpcode::Req) {
            uint64_t mid = ordering::ld_relaxed_sys(reinterpret_cast<const uint64_t*>(&e->timestamp_be));
            CqeView v = cqe_view(tail, mid);
            uint32_t syndrome = v.syndrome ? v.syndrome : (uint32_t)Syndrome::LocalQpOpErr;
            uint32_t word = syndrome | ((uint32_t)v.vendor_err << 8) | ((uint32_t)opcode << 16);
            if (ordering::ld_acquire_gpu(&st->error) == 0u) ordering::st_relaxed_gpu(&st->error, word);
        }
        uint16_t counter = be16((uint16_t)(tail >> 32));
        done += (uint16_t)(counter + 1u - (uint16_t)done);
        ++ci;
    }
    if (ci != start) {
        st->cq_ci = ci;
        update_cq_doorbell(qp.cq_dbrec, ci);
        ordering::st_release_gpu(&st->done, done);
    }
    ordering::unlock_gpu(&st->cq_lock);
}

/** Claim ``n`` WQEBBs and wait until their slots are free; returns the first. */
TPD_HOST_DEVICE uint64_t reserve(const QueuePair& qp, uint32_t n) {
    QpState* st = qp.state;
    uint64_t first = ordering::fetch_add_relaxed_gpu(&st->claimed, (uint64_t)n);
    if (first + n - ordering::ld_acquire_gpu(&st->done) > qp.wqe_cnt) {
        ordering::Spin spin;
        do {
            progress(qp);
            spin.pause("ibgda: send queue full (waiting for CQEs to free slots)");
        } while (first + n - ordering::ld_acquire_gpu(&st->done) > qp.wqe_cnt);
    }
    return first;
}

/** What a warp lane or a group member that posted nothing gets instead of a WQEBB index. */
constexpr uint64_t kNoWqe = ~0ull;

/** The most WQEBBs a group (post_group, the warp calls) puts under one claim before it starts another:
 *  a command goes to claim offset / group_cap, so one claim holds at most group_cap + 2 WQEBBs (the
 *  space argument at the top needs n <= 3 * wqe_cnt / 4 + 1). */
TPD_HOST_DEVICE uint32_t group_cap(const QueuePair& qp) { return qp.wqe_cnt >> 1; }

/** Stamp batch ``b``'s WQEs with WQEBB indices from ``first``, ask for a CQE where a period ends (or on
 *  the last WQE when ``b.completion``), and store them. Returns one past the last WQEBB that asked for a
 *  CQE (what QpState::signaled records), or 0 if none did. */
TPD_HOST_DEVICE uint64_t store_batch(const QueuePair& qp, Batch& b, uint64_t first) {
    uint64_t cqe_end = 0;
    for (uint32_t i = 0; i < b.n; ++i) {
        Wqe& w = b.w[i];
        stamp_index(w, first + i);
        if (ends_period(qp, first + i) || (b.completion && i + 1 == b.n)) {
            w.ctrl.fm_ce_se = (uint8_t)(w.ctrl.fm_ce_se | kCtrlCqUpdate);
            cqe_end = first + i + 1;
        }
        store_wqe(wqe_slot(qp, first + i), w);
    }
    return cqe_end;
}

/** Step ticket: wait until every earlier claim has rung (posted == first, acquire). */
TPD_HOST_DEVICE void wait_ticket(const QueuePair& qp, uint64_t first) {
    QpState* st = qp.state;
    if (ordering::ld_acquire_gpu(&st->posted) != first) {
        ordering::Spin spin;
        do spin.pause("ibgda: waiting for the doorbell ticket (an earlier poster has not rung yet)");
        while (ordering::ld_acquire_gpu(&st->posted) != first);
    }
}

/** Ordered step, fence part (ticket holder): a pending tpd::fence marks the WQE at ``first`` (whose
 *  fm_ce_se byte, as stored, is ``first_fm_ce_se``); ``fence_after`` leaves one pending for the next. */
TPD_HOST_DEVICE void take_fence(const QueuePair& qp, uint64_t first, uint8_t first_fm_ce_se, bool fence_after) {
    QpState* st = qp.state;
    if (st->fence_next) set_fm_ce_se_in_slot(wqe_slot(qp, first), (uint8_t)(first_fm_ce_se | kCtrlFence));
    st->fence_next = fence_after ? 1u : 0u;
}

/**
 * Ordered step, flag part (ticket holder): write-mode flag values in posting order. ADD adds to the
 * (peer, slot) shadow counter, SET replaces it, and the inline flag write at WQEBB ``index`` carries
 * the result. Consecutive flags on one counter read it once and store it once (flush).
 */
struct FlagRun {
    uint64_t* shadow = nullptr;
    uint64_t value = 0;

    TPD_HOST_DEVICE void apply(const QueuePair& qp, uint64_t index, uint64_t* counter, uint64_t v, bool set) {
        if (counter != shadow) {
            flush();
            shadow = counter;
            value = *counter;
        }
        value = set ? v : value + v;
        set_inline8_in_slot(wqe_slot(qp, index), value);
    }
    TPD_HOST_DEVICE void flush() {
        if (shadow) *shadow = value;
        shadow = nullptr;
    }
};

/** Steps publish and hand on (ticket holder): WQEBBs up to ``head`` are stored and ordered; ring once
 *  with ``last_ctrl_word`` (doorbell_word of the last WQE), then pass the ticket on. ``cqe_end``: one
 *  past the last of these WQEBBs that asked for a CQE (store_batch), 0 if none. signaled must not be the
 *  batch's end: a CQE on a WQE before the last one retires only up to it, and quiet would wait forever
 *  for the rest instead of posting its probe. */
TPD_HOST_DEVICE void publish(const QueuePair& qp, uint64_t head, uint64_t last_ctrl_word, uint64_t cqe_end) {
    QpState* st = qp.state;
    if (cqe_end) ordering::st_release_gpu(&st->signaled, cqe_end);
    ring_send_doorbell(qp.dbrec, qp.bf, head, last_ctrl_word);
    ordering::st_release_gpu(&st->posted, head);
    // after the hand on, outside the critical section: placed before the doorbell record's release, the
    // add was one more L2 round trip that release (and so every poster on this QP) waited for
    ordering::fetch_add_relaxed_gpu(&st->rings, 1u);
}

/** Steps ticket .. hand on for WQEBBs [first, first + n), already stored. */
TPD_HOST_DEVICE void submit(const QueuePair& qp, uint64_t first, uint32_t n, uint8_t first_fm_ce_se,
                            uint64_t last_ctrl_word, uint64_t cqe_end, const Ordered& o) {
    wait_ticket(qp, first);
    take_fence(qp, first, first_fm_ce_se, o.fence_after);
    if (o.flag_wqe >= 0) {
        FlagRun run;
        run.apply(qp, first + (uint64_t)o.flag_wqe, o.shadow, o.value, o.set);
        run.flush();
    }
    publish(qp, first + n, last_ctrl_word, cqe_end);
}

/** Post a batch: claim, stamp indices and CQE requests, store, submit. Returns one past its last WQEBB. */
TPD_HOST_DEVICE uint64_t post(const QueuePair& handle, Batch& b, const Ordered& o = Ordered()) {
    const QueuePair qp = handle;  // in registers (see QueuePair)
    uint64_t first = reserve(qp, b.n);
    const uint64_t cqe_end = store_batch(qp, b, first);
    submit(qp, first, b.n, b.w[0].ctrl.fm_ce_se, doorbell_word(b.w[b.n - 1]), cqe_end, o);
    return first + b.n;
}

/**
 * Post ``count`` batches from one thread as a group: one claim, one ticket and one doorbell per
 * group_cap WQEBBs instead of one per batch (what the warp calls do across lanes, here in a loop).
 * Batches with n == 0 post nothing. The WQEs are those ``count`` post() calls in a row would store; a
 * batch's fence_after fences the next batch's first WQE. ``first_of[i]`` (optional) receives batch i's
 * first WQEBB, or kNoWqe. Returns one past the last WQEBB posted (the QP's posted count if none).
 */
TPD_HOST_DEVICE uint64_t post_group(const QueuePair& handle, Batch* b, const Ordered* o, uint32_t count,
                                    uint64_t* first_of = nullptr) {
    const QueuePair qp = handle;  // in registers (see QueuePair)
    const uint32_t cap = group_cap(qp);
    uint64_t head = ordering::ld_acquire_gpu(&qp.state->posted);
    uint32_t i = 0, off = 0;  // off: WQEBBs of the group before batch i
    while (i < count) {
        uint32_t end = i, n = 0;
        while (end < count && (off + n) / cap == off / cap) n += b[end++].n;
        if (n == 0) {  // nothing but empty batches left
            for (; i < end; ++i)
                if (first_of) first_of[i] = kNoWqe;
            break;
        }
        const uint64_t first = reserve(qp, n);
        uint64_t cqe_end = 0;
        bool fence_after = false;
        int first_batch = -1, last_batch = -1;
        uint64_t at = first;
        for (uint32_t k = i; k < end; ++k) {
            if (first_of) first_of[k] = b[k].n ? at : kNoWqe;
            if (b[k].n == 0) continue;
            if (fence_after) b[k].w[0].ctrl.fm_ce_se = (uint8_t)(b[k].w[0].ctrl.fm_ce_se | kCtrlFence);
            const uint64_t e = store_batch(qp, b[k], at);
            if (e) cqe_end = e;
            fence_after = o[k].fence_after;
            at += b[k].n;
            if (first_batch < 0) first_batch = (int)k;
            last_batch = (int)k;
        }
        wait_ticket(qp, first);
        take_fence(qp, first, b[first_batch].w[0].ctrl.fm_ce_se, fence_after);
        FlagRun run;
        at = first;
        for (uint32_t k = i; k < end; ++k) {
            if (o[k].flag_wqe >= 0 && b[k].n) run.apply(qp, at + (uint64_t)o[k].flag_wqe, o[k].shadow, o[k].value,
                                                        o[k].set);
            at += b[k].n;
        }
        run.flush();
        const Batch& last = b[last_batch];
        publish(qp, first + n, doorbell_word(last.w[last.n - 1]), cqe_end);
        head = first + n;
        off += n;
        i = end;
    }
    return head;
}

/**
 * Wait until every WQE posted to this QP before the call has completed (NIC-side: acknowledged by the
 * responder, reads and atomics answered). Returns the QP's first error word (0 = none; see QpState).
 */
TPD_HOST_DEVICE uint32_t quiet(const QueuePair& handle) {
    const QueuePair qp = handle;  // in registers (see QueuePair)
    QpState* st = qp.state;
    uint64_t target = ordering::ld_acquire_gpu(&st->posted);
    if (ordering::ld_acquire_gpu(&st->done) < target) {
        if (ordering::ld_acquire_gpu(&st->signaled) < target) {
            Batch b;  // nothing at or after the last WQE asked for a CQE: post a signalled zero-length read
            b.w[0] = rdma_read(0, qp.qpn, 0, 0, 0, 0, 0, 0);
            b.n = 1;
            b.completion = true;
            target = post(qp, b);
        }
        ordering::Spin spin;
        while (ordering::ld_acquire_gpu(&st->done) < target) {
            progress(qp);
            spin.pause("ibgda: quiet waiting for CQEs (is the NIC processing this QP's doorbells?)");
        }
    }
    return ordering::ld_acquire_gpu(&st->error);
}

}  // namespace ibgda
}  // namespace tpd

#endif /* TRANSPORTD_IBGDA_QUEUE_PAIR_CUH */
