/*
 * transportd device API: the one place that decides the compile mode.
 *
 *   TPD_NVRTC          defined when NVRTC compiles the header (no C library headers exist there)
 *   TPD_DEVICE         __device__ __forceinline__ (every device primitive)
 *   TPD_HOST_DEVICE    __host__ __device__ __forceinline__ (pure layout helpers)
 *   TPD_DEBUG          define it (or build without NDEBUG under nvcc -G) to bound every device spin:
 *                      a spin that outlasts TPD_SPIN_TIMEOUT_NS prints what it waited for and traps,
 *                      so a lost flag or a dead proxy fails the kernel instead of hanging the GPU.
 *
 * Host code may include the umbrella header too: everything device-only sits under __CUDACC__.
 */
#ifndef TRANSPORTD_DEVICE_CUH
#define TRANSPORTD_DEVICE_CUH

#if defined(__CUDACC_RTC__)
#define TPD_NVRTC 1
#endif

#if defined(__CUDACC__)
#define TPD_DEVICE __device__ __forceinline__
#define TPD_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define TPD_DEVICE inline
#define TPD_HOST_DEVICE inline
#endif

#if defined(__CUDACC_DEBUG__) && !defined(TPD_DEBUG)
#define TPD_DEBUG 1
#endif

#ifndef TPD_SPIN_TIMEOUT_NS
#define TPD_SPIN_TIMEOUT_NS 20000000000ull /* 20 s: far beyond any healthy wait */
#endif

#include <transportd/cmd_ring.h>

#if defined(__CUDACC__) && defined(TPD_DEBUG) && !defined(TPD_NVRTC)
#include <stdio.h> /* device printf for the bounded-spin report (NVRTC has printf built in) */
#endif

#if defined(__CUDACC__)
namespace tpd {
namespace detail {

/** Nanoseconds from the GPU's global timer (%globaltimer; coarse, but comparable across SMs). */
TPD_DEVICE uint64_t globaltimer_ns() {
    uint64_t t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

/**
 * One device spin: call ``pause()`` each time the condition is still false. It backs off with
 * __nanosleep after a short burst of tight polls; in debug builds it traps after TPD_SPIN_TIMEOUT_NS
 * with ``what`` (the condition's text) printed, as a bounded spin should.
 */
struct Spin {
    uint32_t polls = 0;
    uint32_t sleep_ns = 0;
#if defined(TPD_DEBUG)
    uint64_t start_ns = 0;
#endif

    TPD_DEVICE void pause(const char* what) {
        ++polls;
        if (polls > 64) {
            sleep_ns = sleep_ns == 0 ? 32 : (sleep_ns < 1024 ? sleep_ns * 2 : sleep_ns);
            __nanosleep(sleep_ns);
        }
#if defined(TPD_DEBUG)
        if ((polls & 1023) == 1) {
            uint64_t now = globaltimer_ns();
            if (start_ns == 0) {
                start_ns = now;
            } else if (now - start_ns > TPD_SPIN_TIMEOUT_NS) {
                printf("transportd: block (%d,%d,%d) thread %d spun %llu ns on: %s\n", (int)blockIdx.x,
                       (int)blockIdx.y, (int)blockIdx.z, (int)threadIdx.x, (unsigned long long)(now - start_ns),
                       what);
                __trap();
            }
        }
#else
        (void)what;
#endif
    }
};

}  // namespace detail
}  // namespace tpd

/** Spin until ``cond`` holds (bounded in debug builds; the message names the condition). */
#define TPD_SPIN_UNTIL(cond)                                  \
    do {                                                      \
        ::tpd::detail::Spin tpd_spin_;                        \
        while (!(cond)) tpd_spin_.pause("TPD_SPIN_UNTIL(" #cond ")"); \
    } while (0)

#if defined(TPD_DEBUG)
/** Debug-build argument check: print the failed condition and trap. */
#define TPD_DEVICE_CHECK(cond, msg)                                                          \
    do {                                                                                     \
        if (!(cond)) {                                                                       \
            printf("transportd: %s (%s) in block %d thread %d\n", msg, #cond, (int)blockIdx.x, \
                   (int)threadIdx.x);                                                        \
            __trap();                                                                        \
        }                                                                                    \
    } while (0)
#else
#define TPD_DEVICE_CHECK(cond, msg) ((void)0)
#endif

#endif /* __CUDACC__ */

#endif /* TRANSPORTD_DEVICE_CUH */
