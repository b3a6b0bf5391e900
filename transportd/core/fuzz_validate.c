/*
 * libFuzzer target for the record validation (validate.h), built with AddressSanitizer and UBSan by
 * `make fuzz-validate`. Each input is a table shape, table contents and records; the tables are heap
 * arrays of exactly their size, so any read past a table (a sentinel missed) is an ASan report. For every
 * record it checks what validation promises: a known code; rows only for good records; a good PUT's
 * addresses are its region's base plus its offsets with the whole transfer inside both regions; a good
 * signal's slot is inside the peer's flag array.
 */
#include <stdlib.h>
#include <string.h>

#include "validate.h"

typedef struct {
    const uint8_t *p;
    size_t n;
} Input;

static uint64_t take(Input *in, size_t bytes) {
    uint64_t v = 0;
    for (size_t i = 0; i < bytes && in->n; i++, in->n--) v |= (uint64_t)*in->p++ << (8 * i);
    return v;
}

#define CHECK(cond) \
    do {            \
        if (!(cond)) __builtin_trap(); \
    } while (0)

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    Input in = {data, size};
    const uint64_t nsrc = take(&in, 1) % 6, rows = take(&in, 1) % 6, cols = 1 + take(&in, 1) % 5;
    const uint64_t world = take(&in, 1) % 8; /* 0: not yet known */
    const uint64_t max_length = take(&in, 1) & 1 ? 4096 : 1ull << 31;
    const size_t per_rank = rows + 1, per_region = (rows + 1) * (cols + 1);
    uint64_t *saddr = malloc((nsrc + 1) * 8), *slen = malloc((nsrc + 1) * 8);
    uint32_t *skey = malloc((nsrc + 1) * 4);
    uint8_t *svalid = malloc(nsrc + 1);
    int64_t *conn = malloc(per_rank * 8);
    uint16_t *code = malloc(per_rank * 2);
    uint64_t *fbase = malloc(per_rank * 8), *fslots = malloc(per_rank * 8);
    uint32_t *frkey = malloc(per_rank * 4);
    uint64_t *paddr = malloc(per_region * 8), *plen = malloc(per_region * 8);
    uint32_t *prkey = malloc(per_region * 4);
    uint8_t *pvalid = malloc(per_region);
    for (size_t i = 0; i <= nsrc; i++) { /* entry nsrc is the sentinel: never valid, length 0 */
        saddr[i] = take(&in, 8);
        svalid[i] = i < nsrc && (take(&in, 1) & 1);
        slen[i] = svalid[i] ? take(&in, 3) : 0;
        skey[i] = (uint32_t)take(&in, 4);
    }
    for (size_t r = 0; r < per_rank; r++) {
        conn[r] = r < rows && (take(&in, 1) & 3) ? (int64_t)(r % 3) : -1;
        code[r] = conn[r] < 0 && (take(&in, 1) & 1) ? TPD_ERR_PEER_LOST : 0;
        fbase[r] = take(&in, 8) & ~7ull;
        fslots[r] = r < rows ? take(&in, 1) % 17 : 0;
        frkey[r] = (uint32_t)take(&in, 4);
    }
    for (size_t k = 0; k < per_region; k++) {
        int sentinel = k / (cols + 1) == rows || k % (cols + 1) == cols;
        paddr[k] = take(&in, 8);
        pvalid[k] = !sentinel && (take(&in, 1) & 1);
        plen[k] = pvalid[k] ? take(&in, 3) : 0;
        prkey[k] = (uint32_t)take(&in, 4);
    }
    const tpd_sources src = {saddr, slen, skey, svalid, nsrc};
    const tpd_peers peers = {world ? rows : 0, rows, cols, conn, code, fbase, fslots, frkey, paddr, plen, prkey,
                             pvalid};
    while (in.n >= sizeof(tpd_cmd_record)) {
        tpd_cmd_record r;
        memcpy(&r, in.p, sizeof r);
        in.p += sizeof r;
        in.n -= sizeof r;
        tpd_plan_row out[2];
        int n = -1;
        int64_t c = -2;
        uint16_t got = tpd_translate(&r, &src, &peers, max_length, out, &n, &c);
        CHECK(got <= TPD_ERR_PEER_LOST && n >= 0 && n <= 2);
        if (got) {
            CHECK(n == 0 && c == -1);
            continue;
        }
        CHECK(r.opcode >= TPD_OP_PUT && r.opcode <= TPD_OP_QUIET);
        if (r.opcode == TPD_OP_QUIET) {
            CHECK(n == 0);
            continue;
        }
        CHECK(c >= 0 && world && r.peer < rows);
        const tpd_plan_row *sig = NULL;
        if (r.opcode == TPD_OP_PUT || r.opcode == TPD_OP_PUT_SIGNAL) {
            CHECK(out[0].op == TPD_PLAN_WRITE && r.length >= 1 && r.length <= max_length);
            CHECK(r.src_region < nsrc && svalid[r.src_region]);
            size_t d = r.peer * (cols + 1) + r.dst_region;
            CHECK(r.dst_region < cols && pvalid[d]);
            CHECK(out[0].laddr == saddr[r.src_region] + r.src_off && out[0].raddr == paddr[d] + r.dst_off);
            CHECK(r.src_off <= slen[r.src_region] && r.length <= slen[r.src_region] - r.src_off);
            CHECK(r.dst_off <= plen[d] && r.length <= plen[d] - r.dst_off);
            CHECK(n == (r.opcode == TPD_OP_PUT_SIGNAL ? 2 : 1));
            if (r.opcode == TPD_OP_PUT_SIGNAL) sig = &out[1];
        } else if (r.opcode == TPD_OP_SIGNAL) {
            CHECK(n == 1);
            sig = &out[0];
        } else {
            CHECK(n == 1 && out[0].op == TPD_PLAN_FENCE);
        }
        if (sig) {
            CHECK(sig->op == TPD_PLAN_SIGNAL && r.signal_slot < fslots[r.peer] && sig->length == 8);
            CHECK(sig->raddr == fbase[r.peer] + 8ull * r.signal_slot && sig->value == r.signal_value);
        }
    }
    free(saddr), free(slen), free(skey), free(svalid), free(conn), free(code), free(fbase), free(fslots);
    free(frkey), free(paddr), free(plen), free(prkey), free(pvalid);
    return 0;
}
