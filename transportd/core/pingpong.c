/*
 * A compiled producer for `transportd bench proxy`'s one-record-at-a-time run: commit one PUT with a
 * plain store sequence (body, then the header with release order), stamped with CLOCK_MONOTONIC, and
 * wait for the proxy's completion position to pass it before the next. numpy's per-call cost (~13 us)
 * would otherwise be what the benchmark measured.
 */
#include "pingpong.h"

#include <time.h>

static int64_t mono_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000ll + ts.tv_nsec;
}

int64_t tpd_pingpong_produce(uint8_t *ring, uint64_t count, uint16_t peers, uint32_t length, int64_t *stamps,
                             int64_t timeout_ns) {
    const uint64_t capacity = *(volatile uint64_t *)(ring + TPD_RING_OFF_CAPACITY);
    tpd_cmd_record *records = (tpd_cmd_record *)(ring + TPD_RING_RECORDS_OFFSET);
    volatile uint64_t *completion = (volatile uint64_t *)(ring + TPD_RING_OFF_COMPLETION_POS);
    uint64_t pos = *(volatile uint64_t *)(ring + TPD_RING_OFF_PRODUCER_POS);
    for (uint64_t i = 0; i < count; i++, pos++) {
        tpd_cmd_record *r = &records[pos & (capacity - 1)];
        r->src_off = r->dst_off = 0;
        r->length = length;
        r->src_region = r->dst_region = 0;
        r->chunk_id = (uint32_t)i;
        r->signal_slot = 0;
        int64_t t = mono_ns();
        r->signal_value = (uint64_t)t;
        uint64_t header = (uint64_t)(pos % 0xFFFFFFFFull + 1) | (uint64_t)TPD_OP_PUT << 32 |
                          (uint64_t)(1 + i % peers) << 48;
        __atomic_store_n((uint64_t *)r, header, __ATOMIC_RELEASE);
        stamps[i] = t;
        int64_t deadline = t + timeout_ns;
        while (__atomic_load_n(completion, __ATOMIC_ACQUIRE) <= pos)
            if (mono_ns() > deadline) return (int64_t)i;
    }
    *(volatile uint64_t *)(ring + TPD_RING_OFF_PRODUCER_POS) = pos;
    return (int64_t)count;
}
