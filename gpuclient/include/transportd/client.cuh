/*
 * transportd device API, umbrella header: include this from a kernel.
 *
 *   #include <transportd/client.cuh>
 *   // nvcc $(python -c 'import gpuclient; print(*("-I" + d for d in gpuclient.get_include_dirs()))')
 *
 *   __global__ void k(tpd::Channel ch, ...) {
 *       tpd::put_signal(ch, peer, dst_region, dst_off, src_region, src_off, bytes, slot, 1);
 *       tpd::wait(ch, slot, expected);
 *   }
 *
 * Builds with nvcc and with NVRTC (gpuclient.compile); host code may include it for the layouts.
 *
 * tpd::DefaultChannel is the handle for kernels that name one type and run on either path: tpd::Channel
 * (the proxy's command ring), or with -DTPD_IBGDA tpd::IbgdaChannel (the GPU posts to the NIC itself;
 * its headers, transportd/ibgda/, sit in this same include root).
 */
#ifndef TRANSPORTD_CLIENT_CUH
#define TRANSPORTD_CLIENT_CUH

#include <transportd/device.cuh>
#include <transportd/errors.cuh>
#include <transportd/command.cuh>
#include <transportd/ordering.cuh>
#include <transportd/ring_device.cuh>
#include <transportd/signal_device.cuh>
#include <transportd/channel_device.cuh>
#include <transportd/plan_device.cuh>

#if defined(TPD_IBGDA)
#include <transportd/ibgda/ibgda.cuh>
#else
namespace tpd {
using DefaultChannel = Channel;
}  // namespace tpd
#endif

#endif /* TRANSPORTD_CLIENT_CUH */
