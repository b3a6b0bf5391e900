/*
 * transportd device API: waiting on flags, and counting tile arrivals.
 *
 * Flags are monotonic 64-bit counters (ADD adds, SET stores). A wait asks "has the flag reached
 * at_least?" with a signed difference, so it stays right across 2^64 wraparound and a kernel launched
 * for the k-th time simply waits for k * expected: no reset between launches.
 *
 * Ordering: the flag is read with ld.acquire.sys. The proxy (or the remote NIC) makes a flag visible
 * only after every payload byte it covers is placed (the design's central rule), so once the acquire
 * load returns a value that covers a chunk, this thread's later loads see that chunk's bytes.
 * tpd::block_wait extends that to the whole block through the barrier after the waiting thread.
 */
#ifndef TRANSPORTD_SIGNAL_DEVICE_CUH
#define TRANSPORTD_SIGNAL_DEVICE_CUH

#include <transportd/device.cuh>
#include <transportd/ordering.cuh>

namespace tpd {

/** Wraparound-safe "value >= at_least": the signed difference is non-negative. */
TPD_HOST_DEVICE bool reached(uint64_t value, uint64_t at_least) { return (long long)(value - at_least) >= 0; }

/**
 * Spin (with backoff; bounded as ordering::Spin is) until ``*flag`` reaches ``at_least``; returns the value
 * seen. Both paths' tpd::wait end here; host + device, so the IBGDA path's CPU tests run it too.
 */
TPD_HOST_DEVICE uint64_t wait_until(const uint64_t* flag, uint64_t at_least) {
    uint64_t value = ordering::ld_acquire_sys(flag);
    if (reached(value, at_least)) return value;
    ordering::Spin spin;
    do {
        spin.pause("tpd::wait: flag below at_least (no signal arrived)");
        value = ordering::ld_acquire_sys(flag);
    } while (!reached(value, at_least));
    return value;
}

#if defined(__CUDACC__)

/**
 * A tile finished its part of a chunk: one thread per tile calls this (after the tile's stores and a
 * __syncthreads). ``counter`` is a device-memory word shared by the chunk's ``tiles`` tiles; it is
 * monotonic like a flag, so it needs no reset between launches (while fewer than 2^32 arrivals).
 * Returns true for exactly one caller per round — the last arrival — whose later operations (say, the
 * put_signal that ships the chunk) are ordered after every other tile's stores.
 */
TPD_DEVICE bool chunk_arrive(uint32_t* counter, uint32_t tiles) {
    __threadfence();  // release this tile's stores at GPU scope
    uint32_t old = atomicAdd(counter, 1u);
    bool last = (old + 1u) % tiles == 0u;
    if (last) __threadfence();  // acquire the other tiles' stores
    return last;
}

#endif /* __CUDACC__ */

}  // namespace tpd

#endif /* TRANSPORTD_SIGNAL_DEVICE_CUH */
