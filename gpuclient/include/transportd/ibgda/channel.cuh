/*
 * transportd ibgda: the device API (put, put_signal, signal, fence, quiet, wait, status) over queue pairs
 * the GPU drives itself — the same calls, with the same arguments, as tpd::Channel's proxy path.
 *
 * tpd::IbgdaChannel is a plain handle passed to the kernel by value (80 bytes; ibgda/device_handle.py
 * mirrors it and a probe test checks every offset). Its tables live in GPU memory, filled by the host
 * (ibgda/host_mlx5.py on a ConnectX, ibgda/soft_mlx5.py's tests under softverbs):
 *
 *   word 0 | qps:u64           QueuePair[world]; qps[r].wqe_cnt == 0: no connection to rank r        |
 *   word 1 | local:u64         Region[nregions]: this rank's regions (address, length, lkey)        |
 *   word 2 | remote:u64        Region[world * nregions]: every rank's regions (address, length, rkey) |
 *   word 3 | remote_flags:u64  Region[world]: every rank's flag array (address, length, rkey)       |
 *   word 4 | shadow:u64        u64[world * flag_count]: write/fence-mode flag values (zeroed)         |
 *   word 5 | flags:u64         this rank's flag words (what tpd::wait polls)                           |
 *   word 6 | error:u64         u32[2]: first error code (sticky), error count                          |
 *   word 7 | flag_count:u32   | rank:u32                                                             |
 *   word 8 | world:u32        | nregions:u32                                                         |
 *   word 9 | signal_mode:u32 (SignalMode) | abi:u32 (TPD_IBGDA_ABI)                                |
 *
 * Signals (the rule: a flag never becomes visible before the payload it covers):
 *
 *   Write   RDMA write, then an inline 8-byte RDMA write of the flag's absolute value on the same QP.
 *           Needs in-order placement: adaptive routing off, flag memory without relaxed ordering. ADD
 *           adds to a shadow counter in posting order (queue_pair.cuh), so a slot must have a single
 *           signalling rank — use Atomic for slots several ranks add to.
 *   Atomic  ADD is an RDMA fetch-and-add: the responder executes it after every earlier request of the
 *           QP is placed, so it is safe under adaptive routing. SET posts the Fence sequence.
 *   Fence   a zero-length RDMA read, then the flag write carrying the fence bit (IBV_SEND_FENCE ->
 *           MLX5_WQE_CTRL_FENCE). The fence waits for the read; the read is answered only after every
 *           earlier write is placed: the flag follows its payload under any routing.
 *
 * tpd::fence(ch, peer) posts the ordering read and fences the next WQE posted to that peer; tpd::quiet
 * drains every QP's CQ (queue_pair.cuh). Bad arguments are checked here, as the proxy checks records:
 * the command is not posted and its tpd::ErrorCode lands in the error word; a completion error found by
 * quiet lands there too (REMOTE_ACCESS, or TRANSPORT for any other syndrome).
 */
#ifndef TRANSPORTD_IBGDA_CHANNEL_CUH
#define TRANSPORTD_IBGDA_CHANNEL_CUH

#include <transportd/command.cuh>
#include <transportd/errors.cuh>
#include <transportd/signal_device.cuh>
#include <transportd/ibgda/queue_pair.cuh>

/** Bumped whenever IbgdaChannel, Region, QueuePair or QpState change; the host checks it. */
#define TPD_IBGDA_ABI 1u

namespace tpd {

namespace ibgda {

/** How flags follow payloads (the ib backend's signal.mode, same names and numbers). */
enum class SignalMode : uint32_t { Write = 0, Atomic = 1, Fence = 2 };

/** The largest transfer one WQE carries (a data segment's byte_count of 0 would mean 2^31). */
constexpr uint32_t kMaxTransfer = 0x7fffffffu;

/*
 * Region: one registered memory range, as the NIC addresses it (24 bytes):
 *
 *   word 0 | addr:u64    address of byte 0 in the key's address space (an iova for dmabuf MRs) |
 *   word 1 | length:u64  0: no region under this id                                             |
 *   word 2 | key:u32 (lkey in local tables, rkey in remote ones) | reserved:u32                 |
 */
struct Region {
    uint64_t addr;
    uint64_t length;
    uint32_t key;
    uint32_t reserved;
};
TPD_STATIC_ASSERT(sizeof(Region) == 24, "ibgda Region is 24 bytes");
TPD_STATIC_ASSERT_OFFSET(offsetof(Region, length) == 8, "length at 8");
TPD_STATIC_ASSERT_OFFSET(offsetof(Region, key) == 16, "key at 16");

}  // namespace ibgda

struct IbgdaChannel {
    ibgda::QueuePair* qps;
    ibgda::Region* local;
    ibgda::Region* remote;
    ibgda::Region* remote_flags;
    uint64_t* shadow;
    uint64_t* flags;
    uint32_t* error;
    uint32_t flag_count;
    uint32_t rank;
    uint32_t world;
    uint32_t nregions;
    uint32_t signal_mode;
    uint32_t abi;
};
TPD_STATIC_ASSERT(sizeof(IbgdaChannel) == 80, "tpd::IbgdaChannel is ten 8-byte words");
TPD_STATIC_ASSERT_OFFSET(offsetof(IbgdaChannel, qps) == 0, "qps at 0");
TPD_STATIC_ASSERT_OFFSET(offsetof(IbgdaChannel, local) == 8, "local at 8");
TPD_STATIC_ASSERT_OFFSET(offsetof(IbgdaChannel, remote) == 16, "remote at 16");
TPD_STATIC_ASSERT_OFFSET(offsetof(IbgdaChannel, remote_flags) == 24, "remote_flags at 24");
TPD_STATIC_ASSERT_OFFSET(offsetof(IbgdaChannel, shadow) == 32, "shadow at 32");
TPD_STATIC_ASSERT_OFFSET(offsetof(IbgdaChannel, flags) == 40, "flags at 40");
TPD_STATIC_ASSERT_OFFSET(offsetof(IbgdaChannel, error) == 48, "error at 48");
TPD_STATIC_ASSERT_OFFSET(offsetof(IbgdaChannel, flag_count) == 56, "flag_count at 56");
TPD_STATIC_ASSERT_OFFSET(offsetof(IbgdaChannel, rank) == 60, "rank at 60");
TPD_STATIC_ASSERT_OFFSET(offsetof(IbgdaChannel, world) == 64, "world at 64");
TPD_STATIC_ASSERT_OFFSET(offsetof(IbgdaChannel, nregions) == 68, "nregions at 68");
TPD_STATIC_ASSERT_OFFSET(offsetof(IbgdaChannel, signal_mode) == 72, "signal_mode at 72");
TPD_STATIC_ASSERT_OFFSET(offsetof(IbgdaChannel, abi) == 76, "abi at 76");

namespace ibgda {
namespace detail {

/** Record a refused command (or a completion error): the first code sticks, the count grows. */
TPD_HOST_DEVICE void report(const IbgdaChannel& ch, uint32_t code) {
    ordering::cas_relaxed_gpu(ch.error, 0u, code);
    ordering::fetch_add_relaxed_gpu(ch.error + 1, 1u);
}

TPD_HOST_DEVICE bool in_bounds(const Region& r, uint64_t off, uint64_t bytes) {
    return off <= r.length && bytes <= r.length - off;
}

/** The QP to ``peer``, or nullptr (BAD_PEER reported). */
TPD_HOST_DEVICE const QueuePair* qp_to(const IbgdaChannel& ch, uint32_t peer) {
    if (peer >= ch.world || ch.qps[peer].wqe_cnt == 0) {
        report(ch, TPD_ERR_BAD_PEER);
        return nullptr;
    }
    return &ch.qps[peer];
}

/** Check a signal's slot; fills the flag's remote address and key. */
TPD_HOST_DEVICE bool flag_target(const IbgdaChannel& ch, uint32_t peer, uint32_t slot, uint64_t* raddr,
                                 uint32_t* rkey) {
    const Region& f = ch.remote_flags[peer];
    if (slot >= ch.flag_count || !in_bounds(f, (uint64_t)slot * 8u, 8u)) {
        report(ch, TPD_ERR_BAD_SLOT);
        return false;
    }
    *raddr = f.addr + (uint64_t)slot * 8u;
    *rkey = f.key;
    if (*raddr & 7u) {
        report(ch, TPD_ERR_BAD_ALIGNMENT);
        return false;
    }
    return true;
}

/** Append the WQEs of one signal to ``b`` and describe its ordered part in ``o``. */
TPD_HOST_DEVICE void add_signal(const IbgdaChannel& ch, const QueuePair& qp, uint32_t peer, uint32_t slot,
                                uint64_t raddr, uint32_t rkey, uint64_t value, SignalOp op, Batch& b, Ordered& o) {
    const bool set = op == SignalOp::Set;
    const SignalMode mode = (SignalMode)ch.signal_mode;
    if (mode == SignalMode::Atomic && !set) {
        b.w[b.n++] = atomic_fetch_add(0, qp.qpn, 0, raddr, rkey, value, qp.scratch, qp.scratch_lkey);
        return;
    }
    bool fenced = mode != SignalMode::Write;
    if (fenced) b.w[b.n++] = rdma_read(0, qp.qpn, 0, 0, 0, 0, 0, 0);
    o.flag_wqe = (int)b.n;
    o.shadow = ch.shadow + (size_t)peer * ch.flag_count + slot;
    o.value = value;
    o.set = set;
    b.w[b.n++] = rdma_write_inline8(0, qp.qpn, ctrl_flags(false, fenced), raddr, rkey, 0);
}

/** The payload write of put / put_signal, after the checks the proxy makes on a record. */
TPD_HOST_DEVICE bool add_put(const IbgdaChannel& ch, const QueuePair& qp, uint32_t peer, uint16_t dst_region,
                             uint64_t dst_off, uint16_t src_region, uint64_t src_off, uint32_t bytes, Batch& b) {
    if (dst_region >= ch.nregions || src_region >= ch.nregions) {
        report(ch, TPD_ERR_BAD_REGION);
        return false;
    }
    const Region& src = ch.local[src_region];
    const Region& dst = ch.remote[(size_t)peer * ch.nregions + dst_region];
    if (src.length == 0 || dst.length == 0) {
        report(ch, TPD_ERR_BAD_REGION);
        return false;
    }
    if (bytes == 0 || bytes > kMaxTransfer) {
        report(ch, TPD_ERR_BAD_LENGTH);
        return false;
    }
    if (!in_bounds(src, src_off, bytes) || !in_bounds(dst, dst_off, bytes)) {
        report(ch, TPD_ERR_OUT_OF_BOUNDS);
        return false;
    }
    b.w[b.n++] = rdma_write(0, qp.qpn, 0, dst.addr + dst_off, dst.key, src.addr + src_off, src.key, bytes);
    return true;
}

/** A QP's error word -> the channel's error code. */
TPD_HOST_DEVICE uint32_t error_code_of(uint32_t qp_error) {
    return (qp_error & 0xffu) == (uint32_t)Syndrome::RemoteAccessErr ? (uint32_t)TPD_ERR_REMOTE_ACCESS
                                                                      : (uint32_t)TPD_ERR_TRANSPORT;
}

}  // namespace detail
}  // namespace ibgda

namespace ibgda {
namespace detail {

/** Check a put and build its WQE into ``b`` (refused: b.n stays 0, the code is reported). Returns the QP
 *  to ``peer``, or nullptr for a bad peer. tpd::put and tpd::warp_put share it. */
TPD_HOST_DEVICE const QueuePair* build_put(const IbgdaChannel& ch, uint32_t peer, uint16_t dst_region,
                                           uint64_t dst_off, uint16_t src_region, uint64_t src_off, uint32_t bytes,
                                           Batch& b) {
    const QueuePair* qp = qp_to(ch, peer);
    if (qp) add_put(ch, *qp, peer, dst_region, dst_off, src_region, src_off, bytes, b);
    return qp;
}

/** The same for put_signal: the payload write, then the flag's WQEs, described in ``o``. */
TPD_HOST_DEVICE const QueuePair* build_put_signal(const IbgdaChannel& ch, uint32_t peer, uint16_t dst_region,
                                                  uint64_t dst_off, uint16_t src_region, uint64_t src_off,
                                                  uint32_t bytes, uint32_t slot, uint64_t value, SignalOp op,
                                                  Batch& b, Ordered& o) {
    const QueuePair* qp = qp_to(ch, peer);
    if (!qp) return nullptr;
    uint64_t raddr;
    uint32_t rkey;
    if (!flag_target(ch, peer, slot, &raddr, &rkey)) return qp;
    if (!add_put(ch, *qp, peer, dst_region, dst_off, src_region, src_off, bytes, b)) return qp;
    add_signal(ch, *qp, peer, slot, raddr, rkey, value, op, b, o);
    return qp;
}

}  // namespace detail
}  // namespace ibgda

/** Write ``bytes`` from our ``src_region`` at ``src_off`` to ``peer``'s ``dst_region`` at ``dst_off``. */
TPD_HOST_DEVICE void put(const IbgdaChannel& ch, uint32_t peer, uint16_t dst_region, uint64_t dst_off,
                         uint16_t src_region, uint64_t src_off, uint32_t bytes, uint32_t chunk_id = 0,
                         Post post = Post::Batched) {
    (void)chunk_id;  // diagnostics on the proxy path; nothing travels with an RDMA write
    (void)post;      // the GPU rings the doorbell at every call: there is no batch to wait for
    ibgda::Batch b;
    const ibgda::QueuePair* qp =
        ibgda::detail::build_put(ch, peer, dst_region, dst_off, src_region, src_off, bytes, b);
    if (qp && b.n) ibgda::post(*qp, b);
}

/** put, then update ``peer``'s flag ``slot`` (add or set ``value``) once the payload is placed there. */
TPD_HOST_DEVICE void put_signal(const IbgdaChannel& ch, uint32_t peer, uint16_t dst_region, uint64_t dst_off,
                                uint16_t src_region, uint64_t src_off, uint32_t bytes, uint32_t slot, uint64_t value,
                                SignalOp op = SignalOp::Add, Post post = Post::Batched) {
    (void)post;
    ibgda::Batch b;
    ibgda::Ordered o;
    const ibgda::QueuePair* qp = ibgda::detail::build_put_signal(ch, peer, dst_region, dst_off, src_region, src_off,
                                                                 bytes, slot, value, op, b, o);
    if (qp && b.n) ibgda::post(*qp, b, o);
}

/** Update ``peer``'s flag ``slot`` after every earlier command of this channel to ``peer`` is placed. */
TPD_HOST_DEVICE void signal(const IbgdaChannel& ch, uint32_t peer, uint32_t slot, uint64_t value,
                            SignalOp op = SignalOp::Add, Post post = Post::Batched) {
    (void)post;
    const ibgda::QueuePair* qp = ibgda::detail::qp_to(ch, peer);
    if (!qp) return;
    uint64_t raddr;
    uint32_t rkey;
    if (!ibgda::detail::flag_target(ch, peer, slot, &raddr, &rkey)) return;
    ibgda::Batch b;
    ibgda::Ordered o;
    ibgda::detail::add_signal(ch, *qp, peer, slot, raddr, rkey, value, op, b, o);
    ibgda::post(*qp, b, o);
}

/** Later commands of this channel to ``peer`` are delivered after earlier ones are placed: an ordering
 *  read, and the fence bit on the next WQE posted to ``peer``. */
TPD_HOST_DEVICE void fence(const IbgdaChannel& ch, uint32_t peer) {
    const ibgda::QueuePair* qp = ibgda::detail::qp_to(ch, peer);
    if (!qp) return;
    ibgda::Batch b;
    ibgda::Ordered o;
    b.w[b.n++] = ibgda::rdma_read(0, qp->qpn, 0, 0, 0, 0, 0, 0);
    o.fence_after = true;
    ibgda::post(*qp, b, o);
}

/** Wait until every command posted on this channel before this call has completed locally (the source
 *  buffers may be reused). Completion errors land in the error word: read tpd::status afterwards. */
TPD_HOST_DEVICE void quiet(const IbgdaChannel& ch) {
    for (uint32_t peer = 0; peer < ch.world; ++peer) {
        const ibgda::QueuePair& qp = ch.qps[peer];
        if (qp.wqe_cnt == 0) continue;
        uint32_t err = ibgda::quiet(qp);
        if (err) ibgda::detail::report(ch, ibgda::detail::error_code_of(err));
    }
}

/** Wait until this rank's flag ``slot`` reaches ``at_least`` (wraparound-safe, acquire); returns it. */
TPD_HOST_DEVICE uint64_t wait(const IbgdaChannel& ch, uint32_t slot, uint64_t at_least) {
    return wait_until(ch.flags + slot, at_least);  // the proxy path's wait (signal_device.cuh)
}

/** The channel's error word: the first refused command's or completion error's code (0 = none). */
TPD_HOST_DEVICE uint32_t status(const IbgdaChannel& ch) { return ordering::ld_acquire_gpu(ch.error); }

/** How many commands were refused or failed so far. */
TPD_HOST_DEVICE uint32_t error_count(const IbgdaChannel& ch) { return ordering::ld_acquire_gpu(ch.error + 1); }

/** Always 0: IBGDA commands have no ring position (the proxy path reports the first bad one's). Kept so
 *  kernels written against tpd::DefaultChannel compile for either path. */
TPD_HOST_DEVICE uint64_t error_position(const IbgdaChannel&) { return 0; }

#if defined(__CUDACC__)
/** One thread of the block waits for the flag, then the whole block proceeds (a barrier). */
__device__ inline void block_wait(const IbgdaChannel& ch, uint32_t slot, uint64_t at_least) {
    if (threadIdx.x == 0 && threadIdx.y == 0 && threadIdx.z == 0) wait(ch, slot, at_least);
    __syncthreads();
}
#endif

}  // namespace tpd

#endif /* TRANSPORTD_IBGDA_CHANNEL_CUH */
