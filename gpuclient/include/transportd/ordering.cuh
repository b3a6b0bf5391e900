/*
 * transportd device API: the one ordering layer — every fence, acquire/release load and store, atomic
 * and bounded spin that the proxy path (ring_device.cuh, signal_device.cuh, channel_device.cuh) and the
 * IBGDA path (ibgda/doorbell.cuh, ibgda/queue_pair.cuh, ibgda/channel.cuh) are built from.
 *
 * On the GPU each primitive is one PTX instruction with an explicit semantic and scope, so the ordering
 * arguments at the top of ring_device.cuh, signal_device.cuh and ibgda/queue_pair.cuh can name exactly
 * what they rely on. Most are host + device: for the CPU they are GCC __atomic builtins with the same
 * semantic, so the IBGDA posting code runs unchanged in the CPU tests against the soft NIC. The 16-byte
 * stores and red.max have no faithful host twin and are device only.
 *
 *   .sys scope   — the other party is the CPU (the proxy reading the ring, writing credits and flags),
 *                  the NIC (doorbell records, CQEs, remote flags) or another process's copy engine;
 *                  mapped pinned host memory needs it.
 *   .gpu scope   — the other party is a thread of this GPU (the ring's slot-claim head and credit cache;
 *                  a queue pair's claim counter, doorbell ticket and CQ lock).
 *   release      — every earlier load and store of this thread is visible before this store.
 *   acquire      — no later load or store of this thread is performed before this load.
 *   weak         — a plain store, ordered before a later release (or fence) of this thread by that release.
 *   mmio         — the doorbell register: a UAR page mapped into the GPU with cudaHostRegisterIoMemory.
 *                  st.mmio.relaxed.sys is performed exactly once and never merged with another store.
 *
 * Spins: Spin (and TPD_SPIN_UNTIL) polls tightly, then backs off — __nanosleep on the device, sched_yield
 * on the host. Device spins are bounded in debug builds (TPD_SPIN_TIMEOUT_NS: print what was awaited,
 * then trap); host spins always are (TPD_HOST_SPIN_TIMEOUT_NS: print, then abort), so a lost flag or a
 * dead proxy or NIC fails the kernel or the CPU test instead of hanging it. Both bounds: device.cuh.
 */
#ifndef TRANSPORTD_ORDERING_CUH
#define TRANSPORTD_ORDERING_CUH

#include <transportd/device.cuh>

#if !defined(TPD_NVRTC)
#include <stdio.h>
#include <stdlib.h>
#if !defined(__CUDA_ARCH__)
#include <sched.h>
#include <time.h>
#endif
#endif

namespace tpd {
namespace ordering {

/* --- loads ------------------------------------------------------------------------------------------------ */

/** Acquire load at system scope: a word the CPU or the NIC writes (a flag, a control word, a CQE's tail). */
TPD_HOST_DEVICE uint64_t ld_acquire_sys(const uint64_t* p) {
#if defined(__CUDA_ARCH__)
    uint64_t v;
    asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
#else
    return __atomic_load_n(p, __ATOMIC_ACQUIRE);
#endif
}

TPD_HOST_DEVICE uint32_t ld_acquire_sys(const uint32_t* p) {
#if defined(__CUDA_ARCH__)
    uint32_t v;
    asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
#else
    return __atomic_load_n(p, __ATOMIC_ACQUIRE);
#endif
}

/** Relaxed load at system scope (a CQE word read after the acquire of its last word). */
TPD_HOST_DEVICE uint64_t ld_relaxed_sys(const uint64_t* p) {
#if defined(__CUDA_ARCH__)
    uint64_t v;
    asm volatile("ld.relaxed.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
#else
    return __atomic_load_n(p, __ATOMIC_RELAXED);
#endif
}

/** Acquire load at GPU scope: a word other threads of this GPU release (credit cache, QpState counters). */
TPD_HOST_DEVICE uint64_t ld_acquire_gpu(const uint64_t* p) {
#if defined(__CUDA_ARCH__)
    uint64_t v;
    asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
#else
    return __atomic_load_n(p, __ATOMIC_ACQUIRE);
#endif
}

TPD_HOST_DEVICE uint32_t ld_acquire_gpu(const uint32_t* p) {
#if defined(__CUDA_ARCH__)
    uint32_t v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
#else
    return __atomic_load_n(p, __ATOMIC_ACQUIRE);
#endif
}

/* --- stores ----------------------------------------------------------------------------------------------- */

/** Plain (weak) 8-byte store; ordered before a later release by that release. */
TPD_HOST_DEVICE void st_weak(uint64_t* p, uint64_t v) {
#if defined(__CUDA_ARCH__)
    asm volatile("st.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
#else
    *p = v;
#endif
}

/** Relaxed 4-byte store at GPU scope (a QpState word other posters read with an acquire). */
TPD_HOST_DEVICE void st_relaxed_gpu(uint32_t* p, uint32_t v) {
#if defined(__CUDA_ARCH__)
    asm volatile("st.relaxed.gpu.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
#else
    __atomic_store_n(p, v, __ATOMIC_RELAXED);
#endif
}

TPD_HOST_DEVICE void st_relaxed_sys(uint64_t* p, uint64_t v) {
#if defined(__CUDA_ARCH__)
    asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
#else
    __atomic_store_n(p, v, __ATOMIC_RELAXED);
#endif
}

/** Release store at GPU scope: hands a QpState counter (posted, done, signaled) to the next poster. */
TPD_HOST_DEVICE void st_release_gpu(uint64_t* p, uint64_t v) {
#if defined(__CUDA_ARCH__)
    asm volatile("st.release.gpu.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
#else
    __atomic_store_n(p, v, __ATOMIC_RELEASE);
#endif
}

/** Release store at system scope: a ring record's header, a flag the CPU reads. */
TPD_HOST_DEVICE void st_release_sys(uint64_t* p, uint64_t v) {
#if defined(__CUDA_ARCH__)
    asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
#else
    __atomic_store_n(p, v, __ATOMIC_RELEASE);
#endif
}

/** Release store at system scope of a 32-bit word the NIC reads (a doorbell record). */
TPD_HOST_DEVICE void st_release_sys(uint32_t* p, uint32_t v) {
#if defined(__CUDA_ARCH__)
    asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
#else
    __atomic_store_n(p, v, __ATOMIC_RELEASE);
#endif
}

/** The 8-byte doorbell store into the UAR page (MMIO on a real NIC; plain host memory under softverbs). */
TPD_HOST_DEVICE void st_mmio_relaxed_sys(uint64_t* p, uint64_t v) {
#if defined(__CUDA_ARCH__)
    asm volatile("st.mmio.relaxed.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
#else
    __atomic_store_n((volatile uint64_t*)p, v, __ATOMIC_RELAXED);
#endif
}

/* --- fences ----------------------------------------------------------------------------------------------- */

/** Sequentially consistent fence at system scope (what __threadfence_system() emits): every earlier
 *  store (ring body words, WQEs in host or GPU memory) is performed for the CPU and the NIC before any
 *  later one (a relaxed header, the doorbell record, the doorbell). */
TPD_HOST_DEVICE void fence_sys() {
#if defined(__CUDA_ARCH__)
    asm volatile("fence.sc.sys;" ::: "memory");
#else
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
#endif
}

/** Sequentially consistent fence at GPU scope (what __threadfence() emits): a tile's stores are performed
 *  for every block before the arrival that counts it, and a chunk's last arrival sees all of them. */
TPD_HOST_DEVICE void fence_gpu() {
#if defined(__CUDA_ARCH__)
    asm volatile("fence.sc.gpu;" ::: "memory");
#else
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
#endif
}

/* --- read-modify-write ------------------------------------------------------------------------------------ */

/** Claim ``n`` consecutive positions of a 64-bit counter (relaxed, GPU scope). */
TPD_HOST_DEVICE uint64_t fetch_add_relaxed_gpu(uint64_t* p, uint64_t n) {
#if defined(__CUDA_ARCH__)
    uint64_t old;
    asm volatile("atom.relaxed.gpu.global.add.u64 %0, [%1], %2;" : "=l"(old) : "l"(p), "l"(n) : "memory");
    return old;
#else
    return __atomic_fetch_add(p, n, __ATOMIC_RELAXED);
#endif
}

TPD_HOST_DEVICE uint32_t fetch_add_relaxed_gpu(uint32_t* p, uint32_t n) {
#if defined(__CUDA_ARCH__)
    uint32_t old;
    asm volatile("atom.relaxed.gpu.global.add.u32 %0, [%1], %2;" : "=r"(old) : "l"(p), "r"(n) : "memory");
    return old;
#else
    return __atomic_fetch_add(p, n, __ATOMIC_RELAXED);
#endif
}

/** ``*p == expected ? *p = desired`` (relaxed, GPU scope); returns the old value. */
TPD_HOST_DEVICE uint32_t cas_relaxed_gpu(uint32_t* p, uint32_t expected, uint32_t desired) {
#if defined(__CUDA_ARCH__)
    uint32_t old;
    asm volatile("atom.relaxed.gpu.global.cas.b32 %0, [%1], %2, %3;"
                 : "=r"(old) : "l"(p), "r"(expected), "r"(desired) : "memory");
    return old;
#else
    __atomic_compare_exchange_n(p, &expected, desired, false, __ATOMIC_RELAXED, __ATOMIC_RELAXED);
    return expected;
#endif
}

/** Take a one-word lock if it is free (acquire, GPU scope); true if this caller now holds it. */
TPD_HOST_DEVICE bool try_lock_gpu(uint32_t* p) {
#if defined(__CUDA_ARCH__)
    uint32_t old;
    asm volatile("atom.acquire.gpu.global.cas.b32 %0, [%1], 0, 1;" : "=r"(old) : "l"(p) : "memory");
    return old == 0u;
#else
    uint32_t expected = 0u;
    return __atomic_compare_exchange_n(p, &expected, 1u, false, __ATOMIC_ACQUIRE, __ATOMIC_RELAXED);
#endif
}

/** Release a lock taken with try_lock_gpu (release, GPU scope). */
TPD_HOST_DEVICE void unlock_gpu(uint32_t* p) {
#if defined(__CUDA_ARCH__)
    asm volatile("st.release.gpu.global.u32 [%0], 0;" ::"l"(p) : "memory");
#else
    __atomic_store_n(p, 0u, __ATOMIC_RELEASE);
#endif
}

/* --- device only: no faithful host twin ------------------------------------------------------------------ */

#if defined(__CUDACC__)
/** Plain (weak) 16-byte store of two words; ``p`` must be 16-byte aligned. */
TPD_DEVICE void st_weak_v2(uint64_t* p, uint64_t a, uint64_t b) {
    asm volatile("st.global.v2.u64 [%0], {%1, %2};" ::"l"(p), "l"(a), "l"(b) : "memory");
}

TPD_DEVICE void st_relaxed_sys_v2(uint64_t* p, uint64_t a, uint64_t b) {
    asm volatile("st.relaxed.sys.global.v2.u64 [%0], {%1, %2};" ::"l"(p), "l"(a), "l"(b) : "memory");
}

TPD_DEVICE void st_release_sys_v2(uint64_t* p, uint64_t a, uint64_t b) {
    asm volatile("st.release.sys.global.v2.u64 [%0], {%1, %2};" ::"l"(p), "l"(a), "l"(b) : "memory");
}

/** This thread's lane in its warp, and the mask of the lanes below it (any block shape). */
TPD_DEVICE uint32_t lane_id() {
    uint32_t lane;
    asm volatile("mov.u32 %0, %%laneid;" : "=r"(lane));
    return lane;
}

TPD_DEVICE uint32_t lanemask_lt() {
    uint32_t mask;
    asm volatile("mov.u32 %0, %%lanemask_lt;" : "=r"(mask));
    return mask;
}

/** ``*p = max(*p, v)`` with release semantics at GPU scope (no return value). */
TPD_DEVICE void red_max_release_gpu(uint64_t* p, uint64_t v) {
    asm volatile("red.release.gpu.global.max.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
#endif /* __CUDACC__ */

/* --- time and spins --------------------------------------------------------------------------------------- */

/** Nanoseconds of a monotonic clock: %globaltimer on the device (coarse, but comparable across SMs). */
TPD_HOST_DEVICE uint64_t now_ns() {
#if defined(__CUDA_ARCH__)
    uint64_t t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
#else
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
#endif
}

/**
 * One spin: call ``pause(what)`` each time the awaited condition is still false. After a burst of 64 tight
 * polls it backs off: __nanosleep doubling from 32 ns to 1 us on the device, sched_yield on the host. In
 * debug builds a device spin that outlasts TPD_SPIN_TIMEOUT_NS prints ``what`` (the condition's text) and
 * traps; a host spin that outlasts TPD_HOST_SPIN_TIMEOUT_NS prints it and aborts, in every build.
 */
struct Spin {
    uint32_t polls = 0;
    uint32_t sleep_ns = 0;
    uint64_t start_ns = 0;

    TPD_HOST_DEVICE void pause(const char* what) {
        ++polls;
#if defined(__CUDA_ARCH__)
        if (polls > 64) {
            sleep_ns = sleep_ns == 0 ? 32 : (sleep_ns < 1024 ? sleep_ns * 2 : sleep_ns);
            __nanosleep(sleep_ns);
        }
#if defined(TPD_DEBUG)
        if ((polls & 1023) == 1) {
            uint64_t t = now_ns();
            if (start_ns == 0) {
                start_ns = t;
            } else if (t - start_ns > TPD_SPIN_TIMEOUT_NS) {
                printf("transportd: block (%d,%d,%d) thread %d spun %llu ns on: %s\n", (int)blockIdx.x,
                       (int)blockIdx.y, (int)blockIdx.z, (int)threadIdx.x, (unsigned long long)(t - start_ns),
                       what);
                __trap();
            }
        }
#else
        (void)what;
#endif
#else
        if (polls > 64) sched_yield();
        if ((polls & 255) == 1) {
            uint64_t t = now_ns();
            if (start_ns == 0) {
                start_ns = t;
            } else if (t - start_ns > TPD_HOST_SPIN_TIMEOUT_NS) {
                fprintf(stderr, "transportd: host thread spun %llu ns on: %s\n", (unsigned long long)(t - start_ns),
                        what);
                abort();
            }
        }
#endif
    }
};

}  // namespace ordering
}  // namespace tpd

/** Spin until ``cond`` holds (bounded as Spin is; the message names the condition). */
#define TPD_SPIN_UNTIL(cond)                                                \
    do {                                                                    \
        ::tpd::ordering::Spin tpd_spin_;                                    \
        while (!(cond)) tpd_spin_.pause("TPD_SPIN_UNTIL(" #cond ")");       \
    } while (0)

#endif /* TRANSPORTD_ORDERING_CUH */
