// Tiny kernels for the GPU tests (compiled with gpuclient.compile, debug build: every spin is bounded).
// The channel kernels take tpd::DefaultChannel: built as they are for the proxy path, with -DTPD_IBGDA
// for the IBGDA path, with no other change.
#include <transportd/client.cuh>

// ---- checksummed records for the ring stress test ------------------------------------------------------
__device__ __forceinline__ uint64_t mix64(uint64_t x) {
    x += 0x9E3779B97F4A7C15ull;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return x ^ (x >> 31);
}

// Every thread of every block pushes ids tid, tid + nthreads, ... < total; each record's fields are a
// function of its id (chunk_id), so the host can tell a torn, lost or duplicated record from a good one.
template <int Commit>
__device__ void stress_push(tpd::RingDevice ring, uint32_t total) {
    uint32_t nthreads = gridDim.x * blockDim.x;
    for (uint32_t id = blockIdx.x * blockDim.x + threadIdx.x; id < total; id += nthreads) {
        uint64_t a = mix64(id), b = mix64(id ^ 0x5555u), c = mix64(id ^ 0xAAAAu);
        tpd::Body body;
        body.w1 = a;
        body.w2 = b;
        body.w3 = c & 0xFFFFFFFFFFFFull;  // length:u32 | src_region:u16 (dst_region below)
        body.w3 |= (uint64_t)(id & 0xFFFFu) << 48;
        body.w4 = (uint64_t)id | ((uint64_t)(~id) << 32);
        body.w5 = a ^ b ^ c;
        tpd::Opcode op = (tpd::Opcode)(1 + id % 5);
        tpd::push<Commit>(ring, op, (uint8_t)(id & 3), (uint16_t)(id >> 3), body);
    }
}

extern "C" __global__ void stress_release_sys(tpd::RingDevice ring, uint32_t total) {
    stress_push<TPD_COMMIT_RELEASE_SYS>(ring, total);
}
extern "C" __global__ void stress_fence_sys(tpd::RingDevice ring, uint32_t total) {
    stress_push<TPD_COMMIT_FENCE_SYS>(ring, total);
}
extern "C" __global__ void stress_v2_release(tpd::RingDevice ring, uint32_t total) {
    stress_push<TPD_COMMIT_V2_RELEASE>(ring, total);
}
extern "C" __global__ void stress_v2_split(tpd::RingDevice ring, uint32_t total) {
    stress_push<TPD_COMMIT_V2_SPLIT>(ring, total);
}

// The same records through the warp-cooperative push: each warp takes 32 consecutive ids per round and
// pushes them in two warp_push calls whose lanes are picked by a hash of the id, so every call runs with
// an irregular set of active lanes (partial warps included) and the tail warp runs with fewer lanes.
extern "C" __global__ void stress_warp(tpd::RingDevice ring, uint32_t total) {
    const uint32_t nthreads = gridDim.x * blockDim.x;
    const uint32_t lane = tpd::ordering::lane_id();
    for (uint32_t first = blockIdx.x * blockDim.x + (threadIdx.x - lane); first < total; first += nthreads) {
        const uint32_t id = first + lane;
        const bool mine = id < total;
        uint64_t a = mix64(id), b = mix64(id ^ 0x5555u), c = mix64(id ^ 0xAAAAu);
        tpd::Body body;
        body.w1 = a;
        body.w2 = b;
        body.w3 = (c & 0xFFFFFFFFFFFFull) | ((uint64_t)(id & 0xFFFFu) << 48);
        body.w4 = (uint64_t)id | ((uint64_t)(~id) << 32);
        body.w5 = a ^ b ^ c;
        const tpd::Opcode op = (tpd::Opcode)(1 + id % 5);
        const bool early = (a & 3u) == 0u;
        tpd::warp_push(ring, mine && early, op, (uint8_t)(id & 3), (uint16_t)(id >> 3), body);
        tpd::warp_push(ring, mine && !early, op, (uint8_t)(id & 3), (uint16_t)(id >> 3), body);
    }
}

// ---- two ranks: stream chunks with put_signal, wait chunk by chunk and verify ----------------------------
__device__ __forceinline__ uint32_t pattern(uint32_t chunk, uint32_t word, uint32_t epoch) {
    return (uint32_t)mix64(((uint64_t)epoch << 40) ^ ((uint64_t)chunk << 24) ^ word);
}

// Kernel A: block b fills chunk b of the source with this epoch's pattern, then one thread ships it
// with put_signal to flag slot b of the peer (ADD 1 per epoch, so launch k waits for k).
extern "C" __global__ void stream_chunks(tpd::DefaultChannel ch, uint32_t* src, uint32_t peer, uint32_t src_region,
                                         uint32_t dst_region, uint32_t chunk_bytes, uint32_t nchunks, uint32_t epoch) {
    uint32_t words = chunk_bytes / 4;
    for (uint32_t chunk = blockIdx.x; chunk < nchunks; chunk += gridDim.x) {
        uint32_t* base = src + (size_t)chunk * words;
        for (uint32_t i = threadIdx.x; i < words; i += blockDim.x) base[i] = pattern(chunk, i, epoch);
        __syncthreads();
        if (threadIdx.x == 0) {
            uint64_t off = (uint64_t)chunk * chunk_bytes;
            tpd::put_signal(ch, peer, (uint16_t)dst_region, off, (uint16_t)src_region, off, chunk_bytes, chunk, 1);
        }
        __syncthreads();
    }
}

// One block ships chunk after chunk (the epoch's pattern, then put_signal to flag slot `chunk`), `gap_ns`
// apart: a kernel still running while a daemon restarts under it.
extern "C" __global__ void stream_paced(tpd::DefaultChannel ch, uint32_t* src, uint32_t peer, uint32_t src_region,
                                        uint32_t dst_region, uint32_t chunk_bytes, uint32_t nchunks, uint32_t epoch,
                                        uint64_t gap_ns) {
    uint32_t words = chunk_bytes / 4;
    for (uint32_t chunk = 0; chunk < nchunks; ++chunk) {
        uint32_t* base = src + (size_t)chunk * words;
        for (uint32_t i = threadIdx.x; i < words; i += blockDim.x) base[i] = pattern(chunk, i, epoch);
        __syncthreads();
        if (threadIdx.x == 0) {
            uint64_t off = (uint64_t)chunk * chunk_bytes;
            tpd::put_signal(ch, peer, (uint16_t)dst_region, off, (uint16_t)src_region, off, chunk_bytes, chunk, 1);
            const uint64_t start = tpd::ordering::now_ns();
            while (tpd::ordering::now_ns() - start < gap_ns) __nanosleep(1000);
        }
        __syncthreads();
    }
}

// One thread: QUIET (everything pushed before has completed locally), then the error word.
extern "C" __global__ void quiet_status(tpd::DefaultChannel ch, uint32_t* out) {
    tpd::quiet(ch);
    out[0] = tpd::status(ch);
    out[1] = tpd::error_count(ch);
    out[2] = (uint32_t)tpd::error_position(ch);
}

// Kernel B: block b waits for flag b to reach `epoch`, then checks chunk b word by word.
// out[0] += mismatching words, out[1] += chunks verified.
extern "C" __global__ void verify_chunks(tpd::DefaultChannel ch, const uint32_t* dst, uint32_t chunk_bytes,
                                         uint32_t nchunks, uint32_t epoch, uint32_t* out) {
    uint32_t words = chunk_bytes / 4;
    for (uint32_t chunk = blockIdx.x; chunk < nchunks; chunk += gridDim.x) {
        tpd::block_wait(ch, chunk, epoch);
        const uint32_t* base = dst + (size_t)chunk * words;
        uint32_t bad = 0;
        for (uint32_t i = threadIdx.x; i < words; i += blockDim.x) bad += base[i] != pattern(chunk, i, epoch);
        if (bad) atomicAdd(&out[0], bad);
        __syncthreads();
        if (threadIdx.x == 0) atomicAdd(&out[1], 1u);
    }
}

// A bad command between good ones: a put to a region the job never registered, then a good
// put_signal; QUIET; the kernel reads the error word. out = {status, count, position}.
extern "C" __global__ void bad_then_good(tpd::DefaultChannel ch, uint32_t peer, uint32_t src_region, uint32_t dst_region,
                                         uint32_t slot, uint32_t* out) {
    tpd::put(ch, peer, (uint16_t)999, 0, (uint16_t)src_region, 0, 64);
    tpd::put_signal(ch, peer, (uint16_t)dst_region, 0, (uint16_t)src_region, 0, 64, slot, 1);
    tpd::quiet(ch);
    out[0] = tpd::status(ch);
    out[1] = tpd::error_count(ch);
    out[2] = (uint32_t)tpd::error_position(ch);
}

// Wait on a flag from a kernel (the receiving side of bad_then_good); out[0] = value seen.
extern "C" __global__ void wait_flag(tpd::DefaultChannel ch, uint32_t slot, uint64_t at_least, uint64_t* out) {
    out[0] = tpd::wait(ch, slot, at_least);
}
