/*
 * transportd ibgda, umbrella header: the GPU posts mlx5 work requests itself (no proxy), behind the same
 * device API as the proxy path.
 *
 *   #include <transportd/client.cuh>          // tpd::Channel (proxy path), optional
 *   #include <transportd/ibgda/ibgda.cuh>     // tpd::IbgdaChannel
 *   // nvcc $(python -c 'import gpuclient; print(*("-I" + d for d in gpuclient.get_include_dirs()))')
 *
 *   template <class Ch>
 *   __global__ void k(Ch ch, ...) {              // the same kernel body for either path
 *       tpd::put_signal(ch, peer, dst_region, dst_off, src_region, src_off, bytes, slot, 1);
 *       tpd::quiet(ch);
 *       tpd::wait(ch, slot, expected);
 *   }
 *
 * How the path is selected: by the handle's type. tpd::IbgdaChannel is a separate plain struct and every
 * operation is an overload taking it, with tpd::Channel's parameter list; a kernel written against a
 * template parameter (or against tpd::DefaultChannel below) compiles for either, with no runtime branch
 * and no change to tpd::Channel's 64-byte layout. Building with -DTPD_IBGDA makes tpd::DefaultChannel
 * the IBGDA handle for kernels that name one type. See README in this directory for the reasoning.
 *
 * Headers, one concept each (the atomics, fences, MMIO doorbell store and bounded spins are the proxy
 * path's own, <transportd/ordering.cuh>, host and device):
 *   endian.cuh      be16/be32/be64
 *   segments.cuh    mlx5 ctrl / raddr / data / inline / atomic segments, diagrammed and asserted
 *   wqe.cuh         WQE builders (write, inline 8-byte write, read, fetch-and-add, NOP)
 *   cqe.cuh         CQE64 / error CQE, ownership test, syndromes
 *   doorbell.cuh    doorbell record and doorbell, CQ consumer index
 *   queue_pair.cuh  QueuePair handle; multi-warp posting with a doorbell ticket; CQ progress; quiet
 *   channel.cuh     tpd::IbgdaChannel and put / put_signal / signal / fence / quiet / wait / status
 *   warp.cuh        warp_put / warp_put_signal: one claim and one doorbell per warp (device only)
 *
 * Everything except block_wait and warp.cuh is __host__ __device__: the CPU tests run this exact code against the
 * soft NIC (ibgda/soft_mlx5.py). Compile mode macros come from <transportd/device.cuh>.
 */
#ifndef TRANSPORTD_IBGDA_IBGDA_CUH
#define TRANSPORTD_IBGDA_IBGDA_CUH

#include <transportd/ordering.cuh>
#include <transportd/ibgda/endian.cuh>
#include <transportd/ibgda/segments.cuh>
#include <transportd/ibgda/wqe.cuh>
#include <transportd/ibgda/cqe.cuh>
#include <transportd/ibgda/doorbell.cuh>
#include <transportd/ibgda/queue_pair.cuh>
#include <transportd/ibgda/channel.cuh>
#include <transportd/ibgda/warp.cuh>

#if defined(TPD_IBGDA)
namespace tpd {
/** The handle kernels written against one type use: the IBGDA channel when built with -DTPD_IBGDA. */
using DefaultChannel = IbgdaChannel;
}  // namespace tpd
#endif

#endif /* TRANSPORTD_IBGDA_IBGDA_CUH */
