/*
 * transportd ibgda: the atomics, fences and stores the posting protocol is built from — one definition
 * for the GPU (one PTX instruction each, with an explicit semantic and scope) and one for the host
 * (GCC __atomic builtins with the same semantic), so the very same posting code runs in a CUDA kernel
 * and, in the CPU tests, against the soft NIC.
 *
 *   scope gpu    the other party is another thread posting to the same QP (claim, ticket, CQ lock).
 *   scope sys    the other party is the NIC (doorbell record, CQEs, remote flags) or the CPU.
 *   mmio         the doorbell register: a UAR page mapped into the GPU with cudaHostRegisterIoMemory.
 *                st.mmio.relaxed.sys is performed exactly once and never merged with another store.
 *
 * Spins use Backoff: tight polls, then __nanosleep (device) or sched_yield (host). Device spins are
 * bounded in debug builds like every transportd spin (TPD_SPIN_TIMEOUT_NS, then print and trap); host
 * spins are always bounded (print what was awaited, then abort) so a CPU test fails instead of hanging.
 */
#ifndef TRANSPORTD_IBGDA_SYNC_CUH
#define TRANSPORTD_IBGDA_SYNC_CUH

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
namespace ibgda {
namespace sync {

/** Claim ``v`` consecutive positions of a counter (relaxed; gpu scope). */
TPD_HOST_DEVICE uint64_t fetch_add_relaxed(uint64_t* p, uint64_t v) {
#if defined(__CUDA_ARCH__)
    uint64_t old;
    asm volatile("atom.relaxed.gpu.global.add.u64 %0, [%1], %2;" : "=l"(old) : "l"(p), "l"(v) : "memory");
    return old;
#else
    return __atomic_fetch_add(p, v, __ATOMIC_RELAXED);
#endif
}

TPD_HOST_DEVICE uint32_t fetch_add_relaxed(uint32_t* p, uint32_t v) {
#if defined(__CUDA_ARCH__)
    uint32_t old;
    asm volatile("atom.relaxed.gpu.global.add.u32 %0, [%1], %2;" : "=r"(old) : "l"(p), "r"(v) : "memory");
    return old;
#else
    return __atomic_fetch_add(p, v, __ATOMIC_RELAXED);
#endif
}

/** ``*p == expected ? *p = desired`` (relaxed; gpu scope); returns the old value. */
TPD_HOST_DEVICE uint32_t cas_relaxed(uint32_t* p, uint32_t expected, uint32_t desired) {
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

/** Take a one-word lock if it is free (acquire; gpu scope). */
TPD_HOST_DEVICE bool try_lock(uint32_t* p) {
#if defined(__CUDA_ARCH__)
    uint32_t old;
    asm volatile("atom.acquire.gpu.global.cas.b32 %0, [%1], 0, 1;" : "=r"(old) : "l"(p) : "memory");
    return old == 0u;
#else
    uint32_t expected = 0u;
    return __atomic_compare_exchange_n(p, &expected, 1u, false, __ATOMIC_ACQUIRE, __ATOMIC_RELAXED);
#endif
}

TPD_HOST_DEVICE void unlock(uint32_t* p) {
#if defined(__CUDA_ARCH__)
    asm volatile("st.release.gpu.global.u32 [%0], 0;" ::"l"(p) : "memory");
#else
    __atomic_store_n(p, 0u, __ATOMIC_RELEASE);
#endif
}

TPD_HOST_DEVICE uint64_t load_acquire(const uint64_t* p) {
#if defined(__CUDA_ARCH__)
    uint64_t v;
    asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
#else
    return __atomic_load_n(p, __ATOMIC_ACQUIRE);
#endif
}

TPD_HOST_DEVICE uint32_t load_acquire(const uint32_t* p) {
#if defined(__CUDA_ARCH__)
    uint32_t v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
#else
    return __atomic_load_n(p, __ATOMIC_ACQUIRE);
#endif
}

TPD_HOST_DEVICE uint64_t load_relaxed(const uint64_t* p) {
#if defined(__CUDA_ARCH__)
    uint64_t v;
    asm volatile("ld.relaxed.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
#else
    return __atomic_load_n(p, __ATOMIC_RELAXED);
#endif
}

TPD_HOST_DEVICE void store_release(uint64_t* p, uint64_t v) {
#if defined(__CUDA_ARCH__)
    asm volatile("st.release.gpu.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
#else
    __atomic_store_n(p, v, __ATOMIC_RELEASE);
#endif
}

TPD_HOST_DEVICE void store_relaxed(uint32_t* p, uint32_t v) {
#if defined(__CUDA_ARCH__)
    asm volatile("st.relaxed.gpu.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
#else
    __atomic_store_n(p, v, __ATOMIC_RELAXED);
#endif
}

/** Acquire load at system scope: a word the NIC or the CPU writes (a CQE's last 8 bytes, a flag). */
TPD_HOST_DEVICE uint64_t load_acquire_sys(const uint64_t* p) {
#if defined(__CUDA_ARCH__)
    uint64_t v;
    asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
#else
    return __atomic_load_n(p, __ATOMIC_ACQUIRE);
#endif
}

/** Relaxed load at system scope (a CQE word read after the acquire of its last word). */
TPD_HOST_DEVICE uint64_t load_relaxed_sys(const uint64_t* p) {
#if defined(__CUDA_ARCH__)
    uint64_t v;
    asm volatile("ld.relaxed.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
#else
    return __atomic_load_n(p, __ATOMIC_RELAXED);
#endif
}

/** Release store at system scope of a 32-bit word the NIC reads (a doorbell record). */
TPD_HOST_DEVICE void store_release_sys(uint32_t* p, uint32_t v) {
#if defined(__CUDA_ARCH__)
    asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
#else
    __atomic_store_n(p, v, __ATOMIC_RELEASE);
#endif
}

/** Sequentially consistent fence at system scope: every earlier store (WQEs in host or GPU memory)
 *  is performed for the NIC before any later one (the doorbell record, the doorbell). */
TPD_HOST_DEVICE void fence_sys() {
#if defined(__CUDA_ARCH__)
    asm volatile("fence.sc.sys;" ::: "memory");
#else
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
#endif
}

/** The 8-byte doorbell store into the UAR page (MMIO on a real NIC; plain host memory under softverbs). */
TPD_HOST_DEVICE void mmio_store(uint64_t* p, uint64_t v) {
#if defined(__CUDA_ARCH__)
    asm volatile("st.mmio.relaxed.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
#else
    __atomic_store_n((volatile uint64_t*)p, v, __ATOMIC_RELAXED);
#endif
}

/** Nanoseconds of a monotonic clock (%globaltimer on the device). */
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

#ifndef TPD_IBGDA_HOST_SPIN_TIMEOUT_NS
#define TPD_IBGDA_HOST_SPIN_TIMEOUT_NS 30000000000ull /* 30 s */
#endif

/** One spin: call pause(what) each time the awaited condition is still false. */
struct Backoff {
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
                printf("transportd ibgda: block %d thread %d spun %llu ns on: %s\n", (int)blockIdx.x,
                       (int)threadIdx.x, (unsigned long long)(t - start_ns), what);
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
            } else if (t - start_ns > TPD_IBGDA_HOST_SPIN_TIMEOUT_NS) {
                fprintf(stderr, "transportd ibgda: host thread spun %llu ns on: %s\n",
                        (unsigned long long)(t - start_ns), what);
                abort();
            }
        }
#endif
    }
};

}  // namespace sync
}  // namespace ibgda
}  // namespace tpd

#endif /* TRANSPORTD_IBGDA_SYNC_CUH */
