#ifndef TRANSPORTD_CORE_PINGPONG_H
#define TRANSPORTD_CORE_PINGPONG_H
#include <stdint.h>

#include <transportd/cmd_ring.h>

/* Commit `count` PUTs one at a time into the mapped ring at `ring`, each to peer 1 + i % peers, stamped
 * into stamps[i]; each waits for the completion position to pass it. Returns how many completed before
 * a wait exceeded timeout_ns. */
int64_t tpd_pingpong_produce(uint8_t *ring, uint64_t count, uint16_t peers, uint32_t length, int64_t *stamps,
                             int64_t timeout_ns);

/* Commit `bursts` times `burst` PUTs back to back (chunk = ring position, to peer 1 + chunk % peers) and wait
 * for the completion position to pass the last of each burst before the next; round_trip_ns[b] = from
 * before burst b's first commit to seeing it complete. Returns how many bursts completed before one took
 * longer than timeout_ns. */
int64_t tpd_burst_produce(uint8_t *ring, uint64_t bursts, uint64_t burst, uint16_t peers, uint32_t length,
                          int64_t *round_trip_ns, int64_t timeout_ns);

/* The bare consumer: take committed records from the mapped ring at `ring` (copied out, block by block),
 * release their slots and publish the completion position, until the consumer position reaches `until` or
 * nothing new came for timeout_ns; `idle_pauses` spin-wait hints between looks at a slot not yet committed.
 * `parity`: the records are per-word parity (benchmarks/gpu_push.cu's PARITY push), committed when byte 0 of
 * each of a slot's six words is its lap's parity (1 on even laps, 2 on odd), not header-last. Returns the
 * consumer position reached. */
uint64_t tpd_bare_drain(uint8_t *ring, uint64_t until, int64_t timeout_ns, unsigned idle_pauses, int parity);
#endif
