/*
 * Record validation and translation: one 48-byte ring record -> an error code, or the plan rows it
 * becomes, through a job's resolved tables. Pure C with no Python, so the engine (engine.c) and the
 * fuzzer (fuzz_validate.c) run exactly this code.
 *
 * A bad record gets exactly one code, the first that applies in this order, and produces no rows:
 *
 *   CLIENT_GONE    the channel's client has left (decided by the caller: every record is rejected)
 *   BAD_OPCODE     opcode not in PUT..QUIET
 *   BAD_PEER       peer >= world, or no connection bound for it (FENCE, SIGNAL, PUT, PUT_SIGNAL);
 *                  the peer's own code instead where its connection failed (usually PEER_LOST)
 *   BAD_LENGTH     PUT/PUT_SIGNAL with length 0 or above max_length
 *   BAD_REGION     source or destination region id out of range or not registered
 *   OUT_OF_BOUNDS  offset + length past the end of the source or destination region
 *   BAD_SLOT       PUT_SIGNAL/SIGNAL slot >= the peer's flag count (or the peer has no flag array)
 *
 * Bounds are checked as `off <= len && length <= len - off`, so `off + length` never overflows.
 * Rows: PUT -> WRITE; PUT_SIGNAL -> WRITE, SIGNAL; SIGNAL -> SIGNAL; FENCE -> FENCE; QUIET -> none.
 * A signal's address is `flag base + 8 * slot` and its length 8. Addresses wrap modulo 2^64.
 *
 * Tables follow transportd/dataplane/tables.py's layout (the control plane fills them): every table has one
 * entry past its last id, a sentinel that is never valid, and ids out of range resolve onto it.
 */
#ifndef TRANSPORTD_CORE_VALIDATE_H
#define TRANSPORTD_CORE_VALIDATE_H

#include <stddef.h>
#include <stdint.h>

/* The record layout and the one error-code enum (TPD_ERR_*): the contract shared with the client
 * (cmd_ring/include, on the include path from setup.py). */
#include <transportd/cmd_ring.h>
#include <transportd/errors.h>

enum tpd_plan_op { TPD_PLAN_WRITE = 1, TPD_PLAN_SIGNAL = 2, TPD_PLAN_FENCE = 3 };
enum tpd_signal_op { TPD_SIGNAL_ADD = 0, TPD_SIGNAL_SET = 1 };

/* One plan row; byte for byte transportd.backends.interface.PLAN_DTYPE (a test compares the two). */
typedef struct tpd_plan_row {
    uint8_t op;
    uint8_t signal_op;
    uint16_t dst_rank;
    uint32_t length;
    uint64_t laddr;
    uint64_t raddr;
    uint32_t lkey;
    uint32_t rkey;
    uint64_t value;
    uint32_t slot;
    uint32_t chunk_id;
    uint64_t token;
} tpd_plan_row;
TPD_STATIC_ASSERT(sizeof(tpd_plan_row) == 56, "plan row must be 56 bytes");

/* One rank's source regions: entries 0..size-1 are ids, entry `size` the sentinel. */
typedef struct tpd_sources {
    const uint64_t *addr;
    const uint64_t *length; /* 0 while not valid */
    const uint32_t *key;
    const uint8_t *valid;
    uint64_t size;
} tpd_sources;

/* A job's peers: `rows` ranks plus the sentinel; regions are a (rows+1) x (cols+1) table. */
typedef struct tpd_peers {
    uint64_t world, rows, cols;
    const int64_t *conn; /* connection index per rank, -1: none */
    const uint16_t *code; /* nonzero: the rank's connection failed with this code */
    const uint64_t *flag_base;
    const uint64_t *flag_slots;
    const uint32_t *flag_rkey;
    const uint64_t *addr;
    const uint64_t *length;
    const uint32_t *rkey;
    const uint8_t *valid;
} tpd_peers;

/* Where a valid record's rows come from: its peer's row and its source and destination region entries. */
typedef struct tpd_resolved {
    uint64_t pidx, sidx, didx;
} tpd_resolved;

/* Validate `r`: returns the code; *nrows the rows it becomes (0 for QUIET and for a bad record), *conn its
 * connection index (-1 for QUIET and for a bad record) and *res what tpd_emit needs. */
static inline uint16_t tpd_check(const tpd_cmd_record *r, const tpd_sources *src, const tpd_peers *peers,
                                 uint64_t max_length, int *nrows, int64_t *conn, tpd_resolved *res) {
    *nrows = 0;
    *conn = -1;
    const unsigned op = r->opcode;
    if (op < TPD_OP_PUT || op > TPD_OP_QUIET) return TPD_ERR_BAD_OPCODE;
    if (op == TPD_OP_QUIET) return TPD_ERR_OK;

    const uint64_t pidx = (peers->world && r->peer < peers->rows) ? r->peer : peers->rows;
    const int64_t c = peers->conn[pidx];
    if (c < 0) return peers->code[pidx] ? peers->code[pidx] : TPD_ERR_BAD_PEER;

    const int data = op == TPD_OP_PUT || op == TPD_OP_PUT_SIGNAL;
    const int needs_slot = op == TPD_OP_PUT_SIGNAL || op == TPD_OP_SIGNAL;
    uint64_t sidx = 0, didx = 0;
    if (data) {
        const uint64_t limit = max_length < 0xFFFFFFFFull ? max_length : 0xFFFFFFFFull;
        const uint64_t length = r->length;
        if (length == 0 || length > limit) return TPD_ERR_BAD_LENGTH;
        sidx = r->src_region < src->size ? r->src_region : src->size;
        didx = pidx * (peers->cols + 1) + (r->dst_region < peers->cols ? r->dst_region : peers->cols);
        if (!src->valid[sidx] || !peers->valid[didx]) return TPD_ERR_BAD_REGION;
        const uint64_t sl = src->length[sidx], dl = peers->length[didx];
        if (!(r->src_off <= sl && length <= sl - r->src_off && r->dst_off <= dl && length <= dl - r->dst_off))
            return TPD_ERR_OUT_OF_BOUNDS;
    }
    if (needs_slot && !((uint64_t)r->signal_slot < peers->flag_slots[pidx])) return TPD_ERR_BAD_SLOT;

    *res = (tpd_resolved){.pidx = pidx, .sidx = sidx, .didx = didx};
    *nrows = data + needs_slot + (op == TPD_OP_FENCE);
    *conn = c;
    return TPD_ERR_OK;
}

/* Write the rows of `r`, which tpd_check passed with `res`, `stride` bytes apart from `rows` (the engine
 * writes them straight into its waiting FIFO, one row per entry: no copy of a row just built, whose narrow
 * stores a wide load could not forward from). */
static inline void tpd_emit(const tpd_cmd_record *r, const tpd_sources *src, const tpd_peers *peers,
                            const tpd_resolved *res, tpd_plan_row *rows, size_t stride) {
    const unsigned op = r->opcode;
    const uint64_t pidx = res->pidx, sidx = res->sidx, didx = res->didx;
    tpd_plan_row *row = rows;
    if (op == TPD_OP_PUT || op == TPD_OP_PUT_SIGNAL) {
        *row = (tpd_plan_row){.op = TPD_PLAN_WRITE, .signal_op = TPD_SIGNAL_ADD, .dst_rank = r->peer,
                              .length = r->length, .laddr = src->addr[sidx] + r->src_off,
                              .raddr = peers->addr[didx] + r->dst_off, .lkey = src->key[sidx],
                              .rkey = peers->rkey[didx], .chunk_id = r->chunk_id};
        row = (tpd_plan_row *)((char *)row + stride);
    }
    if (op == TPD_OP_PUT_SIGNAL || op == TPD_OP_SIGNAL) {
        *row = (tpd_plan_row){.op = TPD_PLAN_SIGNAL,
                              .signal_op = (r->flags & TPD_FLAG_SIGNAL_SET) ? TPD_SIGNAL_SET : TPD_SIGNAL_ADD,
                              .dst_rank = r->peer, .length = 8,
                              .raddr = peers->flag_base[pidx] + 8ull * r->signal_slot,
                              .rkey = peers->flag_rkey[pidx], .value = r->signal_value, .slot = r->signal_slot,
                              .chunk_id = r->chunk_id};
    }
    if (op == TPD_OP_FENCE) *row = (tpd_plan_row){.op = TPD_PLAN_FENCE, .dst_rank = r->peer, .chunk_id = r->chunk_id};
}

/* Validate `r` and write its rows (at most two) to `rows`; returns the code, *nrows and *conn set. */
static inline uint16_t tpd_translate(const tpd_cmd_record *r, const tpd_sources *src, const tpd_peers *peers,
                                     uint64_t max_length, tpd_plan_row *rows, int *nrows, int64_t *conn) {
    tpd_resolved res;
    const uint16_t code = tpd_check(r, src, peers, max_length, nrows, conn, &res);
    if (!code && *nrows) tpd_emit(r, src, peers, &res, rows, sizeof(tpd_plan_row));
    return code;
}

#endif
