/*
 * transportd device API: the one place that decides the compile mode.
 *
 *   TPD_NVRTC          defined when NVRTC compiles the header (no C library headers exist there)
 *   TPD_DEVICE         __device__ __forceinline__ (every device primitive)
 *   TPD_HOST_DEVICE    __host__ __device__ __forceinline__ (pure layout helpers)
 *   TPD_DEBUG          define it (or build without NDEBUG under nvcc -G) to bound every device spin:
 *                      a spin that outlasts TPD_SPIN_TIMEOUT_NS prints what it waited for and traps,
 *                      so a lost flag or a dead proxy fails the kernel instead of hanging the GPU.
 *   TPD_HOST_SPIN_TIMEOUT_NS  the bound of a spin compiled for the CPU (the IBGDA path in the CPU tests),
 *                      always on: print what it waited for, then abort (ordering.cuh's Spin).
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

#ifndef TPD_HOST_SPIN_TIMEOUT_NS
#define TPD_HOST_SPIN_TIMEOUT_NS 30000000000ull /* 30 s */
#endif

#include <transportd/cmd_ring.h>

#if defined(__CUDACC__) && defined(TPD_DEBUG) && !defined(TPD_NVRTC)
#include <stdio.h> /* device printf for TPD_DEVICE_CHECK's report (NVRTC has printf built in) */
#endif

#if defined(__CUDACC__)
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
