// An all-gather through a chunk plan (gpuclient.ChunkPlan.all_gather): producers copy their tiles of the
// local shard into the gathered buffer and call tile_done (the last tile of a chunk ships it); consumers
// take row blocks that do not align with chunks, wait_range for the rows they read, and write row sums.
#include <transportd/client.cuh>

struct Gather {
    uint32_t rank, world;
    uint32_t rows_local;     // rows of every rank's shard
    uint32_t row_floats;     // floats per row
    uint32_t tile_rows;      // producer tile: rows per tile (the last one may be short)
    uint32_t consumer_rows;  // consumer block: rows per wait_range (unrelated to chunks)
    uint32_t per_lane;       // 1: one producer tile per lane, shipped with tile_done_warp; 0: a block per tile
    uint32_t pad;
};

// Produce tile t: copy its rows of x (the local shard) into our rows of the gathered buffer.
__device__ void copy_tile_rows(const Gather& g, const float* x, float* gathered, uint32_t tile, uint32_t first,
                               uint32_t step) {
    uint32_t row0 = tile * g.tile_rows, rows = min(g.tile_rows, g.rows_local - row0);
    float* dst = gathered + ((size_t)g.rank * g.rows_local + row0) * g.row_floats;
    const float* src = x + (size_t)row0 * g.row_floats;
    for (uint32_t i = first; i < rows * g.row_floats; i += step) dst[i] = src[i];
}

extern "C" __global__ void plan_allgather(tpd::DefaultChannel ch, tpd::Plan plan, Gather g, const float* x,
                                          float* gathered, float* row_sums) {
    if (g.per_lane) {
        // every lane produces its own tile, then the warp counts them together (one push per round of sends)
        uint32_t warps = gridDim.x * (blockDim.x / 32), warp = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
        for (uint32_t base = warp * 32; base < plan.tile_count; base += warps * 32) {
            uint32_t tile = base + tpd::ordering::lane_id();
            bool mine = tile < plan.tile_count;
            if (mine) copy_tile_rows(g, x, gathered, tile, 0, 1);
            tpd::tile_done_warp(ch, plan, mine, mine ? tile : 0);
        }
    } else {
        for (uint32_t tile = blockIdx.x; tile < plan.tile_count; tile += gridDim.x) {
            copy_tile_rows(g, x, gathered, tile, threadIdx.x, blockDim.x);
            __syncthreads();
            if (threadIdx.x == 0) tpd::tile_done(ch, plan, tile);
            __syncthreads();
        }
    }
    // consumers: row blocks of the whole gathered buffer; our own rows are read from x
    uint32_t rows = g.world * g.rows_local, row_bytes = g.row_floats * 4;
    for (uint32_t r0 = blockIdx.x * g.consumer_rows; r0 < rows; r0 += gridDim.x * g.consumer_rows) {
        uint32_t r1 = min(r0 + g.consumer_rows, rows);
        for (uint32_t src = r0 / g.rows_local; src <= (r1 - 1) / g.rows_local; ++src) {
            if (src == g.rank) continue;
            uint32_t a = max(r0, src * g.rows_local), b = min(r1, (src + 1) * g.rows_local);
            tpd::wait_range(ch, plan, src, (uint64_t)a * row_bytes, (uint64_t)(b - a) * row_bytes);
        }
        for (uint32_t r = r0 + threadIdx.x / 32; r < r1; r += blockDim.x / 32) {
            uint32_t owner = r / g.rows_local;
            const float* row = owner == g.rank ? x + (size_t)(r - owner * g.rows_local) * g.row_floats
                                               : gathered + (size_t)r * g.row_floats;
            float s = 0.f;
            for (uint32_t i = threadIdx.x % 32; i < g.row_floats; i += 32) s += row[i];
            for (int o = 16; o > 0; o /= 2) s += __shfl_xor_sync(0xffffffffu, s, o);
            if (threadIdx.x % 32 == 0) row_sums[r] = s;
        }
        __syncthreads();
    }
}

// After the fused kernel (same stream): everything pushed has completed locally; report the error word.
extern "C" __global__ void plan_quiet_status(tpd::DefaultChannel ch, uint32_t* status) {
    tpd::quiet(ch);
    status[0] = tpd::status(ch);
}
