/*
 * Compiled helpers of `transportd bench proxy`:
 *
 * a producer for its one-record-at-a-time run: commit one PUT with a plain store sequence (body, then the
 * header with release order), stamped with CLOCK_MONOTONIC, and wait for the proxy's completion position to
 * pass it before the next. numpy's per-call cost (~13 us) would otherwise be what the benchmark measured;
 *
 * a producer for its burst round trips, the CPU's twin of gpu_bench's thread sweep: commit `burst` PUTs
 * back to back (a warp's worth, say), wait for the completion position to pass the last, time it;
 *
 * the bare C consumer its drain is compared with: take what is committed (the lap-stamped seq read with
 * acquire, the record copied out), release the slots and publish the completion position, block by block,
 * and nothing else: no validation, translation, batching or posting. What a pass costs beyond that is the
 * engine's.
 *
 * and, with `parity`, the same loop over per-word-parity records (the design's alternative commit, measured
 * by the benchmark only): a slot is committed when byte 0 of each of its six words carries its lap's parity.
 */
#include "pingpong.h"

#include <string.h>
#include <time.h>

static int64_t mono_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000ll + ts.tv_nsec;
}

/* One PUT at ring position `pos` (chunk `chunk`, to peer 1 + chunk % peers), body first, header last. */
static void commit_put(tpd_cmd_record *records, uint64_t capacity, uint64_t pos, uint64_t chunk, uint16_t peers,
                       uint32_t length, int64_t stamp) {
    tpd_cmd_record *r = &records[pos & (capacity - 1)];
    r->src_off = r->dst_off = 0;
    r->length = length;
    r->src_region = r->dst_region = 0;
    r->chunk_id = (uint32_t)chunk;
    r->signal_slot = 0;
    r->signal_value = (uint64_t)stamp;
    uint64_t header = (uint64_t)(pos % 0xFFFFFFFFull + 1) | (uint64_t)TPD_OP_PUT << 32 |
                      (uint64_t)(1 + chunk % peers) << 48;
    __atomic_store_n((uint64_t *)r, header, __ATOMIC_RELEASE);
}

int64_t tpd_pingpong_produce(uint8_t *ring, uint64_t count, uint16_t peers, uint32_t length, int64_t *stamps,
                             int64_t timeout_ns) {
    const uint64_t capacity = *(volatile uint64_t *)(ring + TPD_RING_OFF_CAPACITY);
    tpd_cmd_record *records = (tpd_cmd_record *)(ring + TPD_RING_RECORDS_OFFSET);
    volatile uint64_t *completion = (volatile uint64_t *)(ring + TPD_RING_OFF_COMPLETION_POS);
    uint64_t pos = *(volatile uint64_t *)(ring + TPD_RING_OFF_PRODUCER_POS);
    for (uint64_t i = 0; i < count; i++, pos++) {
        int64_t t = mono_ns();
        commit_put(records, capacity, pos, i, peers, length, t);
        stamps[i] = t;
        int64_t deadline = t + timeout_ns;
        while (__atomic_load_n(completion, __ATOMIC_ACQUIRE) <= pos)
            if (mono_ns() > deadline) return (int64_t)i;
    }
    *(volatile uint64_t *)(ring + TPD_RING_OFF_PRODUCER_POS) = pos;
    return (int64_t)count;
}

int64_t tpd_burst_produce(uint8_t *ring, uint64_t bursts, uint64_t burst, uint16_t peers, uint32_t length,
                          int64_t *round_trip_ns, int64_t timeout_ns) {
    const uint64_t capacity = *(volatile uint64_t *)(ring + TPD_RING_OFF_CAPACITY);
    tpd_cmd_record *records = (tpd_cmd_record *)(ring + TPD_RING_RECORDS_OFFSET);
    volatile uint64_t *completion = (volatile uint64_t *)(ring + TPD_RING_OFF_COMPLETION_POS);
    volatile uint64_t *consumer = (volatile uint64_t *)(ring + TPD_RING_OFF_CONSUMER_POS);
    uint64_t pos = *(volatile uint64_t *)(ring + TPD_RING_OFF_PRODUCER_POS);
    int64_t done = (int64_t)bursts;
    for (uint64_t b = 0; b < bursts; b++) {
        const int64_t t = mono_ns(), deadline = t + timeout_ns;
        while (pos + burst > __atomic_load_n(consumer, __ATOMIC_ACQUIRE) + capacity) /* credit for the burst */
            if (mono_ns() > deadline) {
                done = (int64_t)b;
                goto out;
            }
        for (uint64_t j = 0; j < burst; j++, pos++) commit_put(records, capacity, pos, pos, peers, length, t);
        while (__atomic_load_n(completion, __ATOMIC_ACQUIRE) < pos)
            if (mono_ns() > deadline) {
                done = (int64_t)b;
                goto out;
            }
        round_trip_ns[b] = mono_ns() - t;
    }
out:
    *(volatile uint64_t *)(ring + TPD_RING_OFF_PRODUCER_POS) = pos;
    return done;
}

enum { BLOCK = 4096 };

/* `n` spin-wait hints between looks at a slot that was not committed yet (0: look again at once) */
static inline void idle_pause(unsigned n) {
    for (unsigned i = 0; i < n; i++) {
#if defined(__x86_64__) || defined(__i386__)
        __builtin_ia32_pause();
#else
        __asm__ __volatile__("" ::: "memory");
#endif
    }
}
/* where the bare consumer copies its records (kept: the copies are part of what it costs) */
__attribute__((used)) static tpd_cmd_record taken[BLOCK];

/* Lap parity of a slot at `pos` in per-word-parity records: 1 on even laps, 2 on odd ones, never 0 (a zeroed
 * ring holds no record). */
static inline uint8_t lap_parity(uint64_t pos, uint64_t capacity) { return (pos & capacity) ? 2 : 1; }

/* Copy the record at ring position `pos` into *out if it is committed: header-last, its lap-stamped seq (read
 * with acquire); per-word parity, all six words carrying the lap's parity (each word lands whole, as one
 * 8-byte store, but in any order). */
static inline int take_slot(const uint8_t *ring, uint64_t capacity, uint64_t pos, int parity, tpd_cmd_record *out) {
    const tpd_cmd_record *r = (const tpd_cmd_record *)(ring + TPD_RING_RECORDS_OFFSET) + (pos & (capacity - 1));
    if (!parity) {
        if (__atomic_load_n(&r->seq, __ATOMIC_ACQUIRE) != (uint32_t)(pos % 0xFFFFFFFFull + 1)) return 0;
        *out = *r;
        return 1;
    }
    const uint64_t *w = (const uint64_t *)r, par = lap_parity(pos, capacity);
    uint64_t copy[6];
    for (int k = 0; k < 6; k++) {
        copy[k] = __atomic_load_n(&w[k], __ATOMIC_RELAXED);
        if ((copy[k] & 0xFF) != par) return 0;
    }
    __atomic_thread_fence(__ATOMIC_ACQUIRE);
    memcpy(out, copy, sizeof copy);
    return 1;
}

uint64_t tpd_bare_drain(uint8_t *ring, uint64_t until, int64_t timeout_ns, unsigned idle_pauses, int parity) {
    const uint64_t capacity = *(volatile uint64_t *)(ring + TPD_RING_OFF_CAPACITY);
    volatile uint64_t *consumer = (volatile uint64_t *)(ring + TPD_RING_OFF_CONSUMER_POS);
    volatile uint64_t *completion = (volatile uint64_t *)(ring + TPD_RING_OFF_COMPLETION_POS);
    uint64_t pos = *consumer;
    int64_t deadline = mono_ns() + timeout_ns;
    while (pos < until) {
        uint64_t n = 0;
        while (n < BLOCK && pos + n < until && take_slot(ring, capacity, pos + n, parity, &taken[n])) n++;
        if (!n) {
            if (mono_ns() > deadline) break;
            idle_pause(idle_pauses);
            continue;
        }
        pos += n;
        __atomic_store_n(consumer, pos, __ATOMIC_RELEASE);
        __atomic_store_n(completion, pos, __ATOMIC_RELEASE);
    }
    return pos;
}
