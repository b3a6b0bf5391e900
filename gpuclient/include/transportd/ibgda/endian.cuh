/*
 * transportd ibgda: byte order. Every multi-byte field the NIC reads or writes (WQE segments, doorbell
 * records, CQEs) is big-endian; the GPU and the hosts we target (x86-64, aarch64) are little-endian.
 *
 * be16/be32/be64 convert in both directions (a byte swap is its own inverse). They are pure functions
 * usable on the host (tests, the soft NIC's twin) and on the device (__byte_perm / prmt).
 */
#ifndef TRANSPORTD_IBGDA_ENDIAN_CUH
#define TRANSPORTD_IBGDA_ENDIAN_CUH

#include <transportd/device.cuh>

#if !defined(__CUDA_ARCH__) && defined(__BYTE_ORDER__)
TPD_STATIC_ASSERT(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "transportd ibgda assumes a little-endian host");
#endif

namespace tpd {
namespace ibgda {

/** Host (little-endian) <-> big-endian, 16 bits. */
TPD_HOST_DEVICE uint16_t be16(uint16_t v) { return (uint16_t)((v >> 8) | (v << 8)); }

/** Host (little-endian) <-> big-endian, 32 bits. */
TPD_HOST_DEVICE uint32_t be32(uint32_t v) {
#if defined(__CUDA_ARCH__)
    return __byte_perm(v, 0u, 0x0123u);
#else
    return __builtin_bswap32(v);
#endif
}

/** Host (little-endian) <-> big-endian, 64 bits. */
TPD_HOST_DEVICE uint64_t be64(uint64_t v) {
#if defined(__CUDA_ARCH__)
    return ((uint64_t)__byte_perm((uint32_t)v, 0u, 0x0123u) << 32) | __byte_perm((uint32_t)(v >> 32), 0u, 0x0123u);
#else
    return __builtin_bswap64(v);
#endif
}

}  // namespace ibgda
}  // namespace tpd

#endif /* TRANSPORTD_IBGDA_ENDIAN_CUH */
