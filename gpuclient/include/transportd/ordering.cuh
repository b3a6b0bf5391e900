/*
 * transportd device API: the memory-ordering primitives the ring and the flags are built from.
 *
 * Each is one PTX instruction with an explicit semantic and scope, so the ordering argument in
 * ring_device.cuh and signal_device.cuh can name exactly what it relies on:
 *
 *   .sys scope   — the other party is the CPU (the proxy reading the ring, writing credits and flags)
 *                  or another process's copy engine; mapped pinned host memory needs it.
 *   .gpu scope   — the other party is a thread of this GPU (the slot-claim head, the credit cache).
 *   release      — every earlier load and store of this thread is visible before this store.
 *   acquire      — no later load or store of this thread is performed before this load.
 */
#ifndef TRANSPORTD_ORDERING_CUH
#define TRANSPORTD_ORDERING_CUH

#include <transportd/device.cuh>

#if defined(__CUDACC__)
namespace tpd {
namespace ptx {

TPD_DEVICE uint64_t ld_acquire_sys(const uint64_t* p) {
    uint64_t v;
    asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}

TPD_DEVICE uint32_t ld_acquire_sys(const uint32_t* p) {
    uint32_t v;
    asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

TPD_DEVICE uint64_t ld_relaxed_sys(const uint64_t* p) {
    uint64_t v;
    asm volatile("ld.relaxed.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}

TPD_DEVICE uint64_t ld_acquire_gpu(const uint64_t* p) {
    uint64_t v;
    asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}

/** Plain (weak) 8-byte store; ordered before a later release by that release. */
TPD_DEVICE void st_weak(uint64_t* p, uint64_t v) {
    asm volatile("st.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

/** Plain (weak) 16-byte store of two words; ``p`` must be 16-byte aligned. */
TPD_DEVICE void st_weak_v2(uint64_t* p, uint64_t a, uint64_t b) {
    asm volatile("st.global.v2.u64 [%0], {%1, %2};" ::"l"(p), "l"(a), "l"(b) : "memory");
}

TPD_DEVICE void st_relaxed_sys(uint64_t* p, uint64_t v) {
    asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

TPD_DEVICE void st_relaxed_sys_v2(uint64_t* p, uint64_t a, uint64_t b) {
    asm volatile("st.relaxed.sys.global.v2.u64 [%0], {%1, %2};" ::"l"(p), "l"(a), "l"(b) : "memory");
}

TPD_DEVICE void st_release_sys(uint64_t* p, uint64_t v) {
    asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

TPD_DEVICE void st_release_sys_v2(uint64_t* p, uint64_t a, uint64_t b) {
    asm volatile("st.release.sys.global.v2.u64 [%0], {%1, %2};" ::"l"(p), "l"(a), "l"(b) : "memory");
}

/** Sequentially consistent fence at system scope (what __threadfence_system() emits). */
TPD_DEVICE void fence_sys() { asm volatile("fence.sc.sys;" ::: "memory"); }

/** Acquire fence at GPU scope: later loads see what releases at GPU scope published. */
TPD_DEVICE void fence_acq_rel_gpu() { asm volatile("fence.acq_rel.gpu;" ::: "memory"); }

/** ``*p = max(*p, v)`` with release semantics at GPU scope (no return value). */
TPD_DEVICE void red_max_release_gpu(uint64_t* p, uint64_t v) {
    asm volatile("red.release.gpu.global.max.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

/** Claim ``n`` consecutive positions of a 64-bit counter (relaxed, GPU scope). */
TPD_DEVICE uint64_t fetch_add_relaxed_gpu(uint64_t* p, uint64_t n) {
    uint64_t old;
    asm volatile("atom.relaxed.gpu.global.add.u64 %0, [%1], %2;" : "=l"(old) : "l"(p), "l"(n) : "memory");
    return old;
}

}  // namespace ptx
}  // namespace tpd
#endif /* __CUDACC__ */

#endif /* TRANSPORTD_ORDERING_CUH */
