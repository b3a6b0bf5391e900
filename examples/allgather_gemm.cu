// AllGather + GEMM, fused at tile granularity: C = A_full @ B, where A_full's row blocks are sharded over the
// ranks. Each rank's kernel first ships its own shard's row chunks to every peer with put_signal (one flag
// slot per chunk, ADD 1 per launch), then computes its C tiles; a tile whose rows come from a peer waits
// only for that chunk's flag, so tiles on local rows start at once and remote ones start chunk by chunk.
#include <transportd/client.cuh>

#define TM 64
#define TN 64
#define TK 16

struct Problem {
    uint32_t rank, world;
    uint32_t m_local, n, k;       // A shard is m_local x k, B is k x n, C is (world * m_local) x n
    uint32_t rows_per_chunk;      // the unit of communication (and of waiting)
    uint32_t a_region;            // A_full registered on every rank at the same layout
    uint32_t epoch;               // launch number: flags reach `epoch` once this launch's chunk arrived
};

// 64x64 tile of C with 256 threads (16 x 16, 4 x 4 outputs each), plain fp32 FMA through shared memory.
__device__ void gemm_tile(const float* A, const float* B, float* C, uint32_t row0, uint32_t col0,
                          uint32_t n, uint32_t k) {
    __shared__ float As[TK][TM + 1];
    __shared__ float Bs[TK][TN];
    uint32_t tx = threadIdx.x % 16, ty = threadIdx.x / 16;
    float acc[4][4] = {};
    for (uint32_t k0 = 0; k0 < k; k0 += TK) {
        for (uint32_t i = threadIdx.x; i < TM * TK; i += blockDim.x) {
            uint32_t r = i / TK, c = i % TK;
            As[c][r] = A[(size_t)(row0 + r) * k + k0 + c];
        }
        for (uint32_t i = threadIdx.x; i < TK * TN; i += blockDim.x) {
            uint32_t r = i / TN, c = i % TN;
            Bs[r][c] = B[(size_t)(k0 + r) * n + col0 + c];
        }
        __syncthreads();
#pragma unroll
        for (uint32_t kk = 0; kk < TK; ++kk) {
            float a[4], b[4];
#pragma unroll
            for (int i = 0; i < 4; ++i) a[i] = As[kk][ty * 4 + i];
#pragma unroll
            for (int j = 0; j < 4; ++j) b[j] = Bs[kk][tx * 4 + j];
#pragma unroll
            for (int i = 0; i < 4; ++i)
#pragma unroll
                for (int j = 0; j < 4; ++j) acc[i][j] += a[i] * b[j];
        }
        __syncthreads();
    }
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) C[(size_t)(row0 + ty * 4 + i) * n + col0 + tx * 4 + j] = acc[i][j];
}

extern "C" __global__ void __launch_bounds__(256) allgather_gemm(tpd::Channel ch, Problem p, const float* a_full,
                                                                 const float* b, float* c) {
    uint32_t chunks_per_rank = p.m_local / p.rows_per_chunk;
    uint64_t chunk_bytes = (uint64_t)p.rows_per_chunk * p.k * sizeof(float);
    // 1. all-gather: ship every chunk of our shard to every peer (one thread per (peer, chunk) task)
    uint32_t tasks = (p.world - 1) * chunks_per_rank;
    for (uint32_t t = blockIdx.x; t < tasks; t += gridDim.x) {
        if (threadIdx.x == 0) {
            uint32_t peer = (p.rank + 1 + t / chunks_per_rank) % p.world;
            uint32_t chunk = t % chunks_per_rank;
            uint32_t global_chunk = p.rank * chunks_per_rank + chunk;
            uint64_t off = (uint64_t)global_chunk * chunk_bytes;
            tpd::put_signal(ch, peer, (uint16_t)p.a_region, off, (uint16_t)p.a_region, off, (uint32_t)chunk_bytes,
                            global_chunk, 1);
        }
    }
    // 2. GEMM tiles, persistent: a tile on a peer's rows waits for that chunk's flag first
    uint32_t m = p.world * p.m_local;
    uint32_t tiles_n = p.n / TN, tiles = (m / TM) * tiles_n;
    for (uint32_t tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
        uint32_t row0 = (tile / tiles_n) * TM, col0 = (tile % tiles_n) * TN;
        for (uint32_t r = row0; r < row0 + TM; r += p.rows_per_chunk) {  // every chunk the tile's rows touch
            uint32_t global_chunk = r / p.rows_per_chunk;
            if (global_chunk / chunks_per_rank != p.rank) tpd::block_wait(ch, global_chunk, p.epoch);
        }
        gemm_tile(a_full, b, c, row0, col0, p.n, p.k);
    }
}

// After the fused kernel (same stream): wait until every command of this launch completed locally, so the
// shard may be overwritten, and report the channel's error word.
extern "C" __global__ void quiet_status(tpd::Channel ch, uint32_t* status) {
    tpd::quiet(ch);
    status[0] = tpd::status(ch);
}
