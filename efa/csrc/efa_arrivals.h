/*
 * The receiving side of efa's counting protocol in C: one tracker per connection counts the pieces of
 * each group, orders the control records, and releases the signals that became safe to publish.
 *
 * This is transportd_models/arrivals.py's ArrivalTracker, rule for rule (its docstring states the three
 * rules); that module stays as the model tests/efa/test_efa_core.py compares this one with over random
 * completion streams. The wire layout (immediates, the 32-byte record) is efa/wire.py's.
 */
#ifndef TRANSPORTD_EFA_ARRIVALS_H
#define TRANSPORTD_EFA_ARRIVALS_H

#include <stddef.h>
#include <stdint.h>

#define EFA_KIND_DATA 0
#define EFA_KIND_CTRL 1
#define EFA_CONN_BITS 12
#define EFA_INDEX_BITS 18
#define EFA_MAX_CONNS (1u << EFA_CONN_BITS)
#define EFA_INDEX_MASK ((1u << EFA_INDEX_BITS) - 1)
#define EFA_OP_ADD 0
#define EFA_OP_SET 1
#define EFA_OP_FENCE 255
#define EFA_CTRL_SIZE 32

/* The control record, byte for byte efa.wire.CTRL_DTYPE (little-endian hosts only, as the wire is). */
typedef struct {
    uint64_t value;
    uint32_t pieces, group, after, slot;
    uint16_t rank;
    uint8_t op, rsv;
    uint32_t seq;
} EfaCtrl;
_Static_assert(sizeof(EfaCtrl) == EFA_CTRL_SIZE, "EfaCtrl layout");

static inline uint32_t efa_encode_imm(unsigned kind, uint32_t conn, uint64_t index) {
    return ((uint32_t)kind << (EFA_CONN_BITS + EFA_INDEX_BITS)) |
           ((conn & (EFA_MAX_CONNS - 1)) << EFA_INDEX_BITS) | (uint32_t)(index & EFA_INDEX_MASK);
}

/* The full counter whose low `bits` bits are `value`, nearest to `ref` (efa.wire.unwrap). */
static inline int64_t efa_unwrap(uint64_t value, unsigned bits, int64_t ref) {
    uint64_t size = 1ull << bits, half = size >> 1;
    return ref + (int64_t)((value - (uint64_t)ref + half) & (size - 1)) - (int64_t)half;
}

/* int64 -> uint64 open-addressing map (linear probing, backward-shift deletion: no tombstones). */
typedef struct {
    int64_t key;
    uint64_t val;
    uint8_t used;
} EfaMapEnt;

typedef struct {
    EfaMapEnt *t;
    size_t cap, n;
} EfaMap;

EfaMapEnt *efa_map_find(const EfaMap *m, int64_t k);
EfaMapEnt *efa_map_slot(EfaMap *m, int64_t k); /* created with value 0 if absent; NULL: out of memory */
void efa_map_del(EfaMap *m, EfaMapEnt *e);

typedef struct {
    int64_t seq, group, after;
    uint64_t value;
    uint32_t slot;
    uint16_t rank;
    uint8_t op;
} EfaSig;

/* A flag update that became safe (transportd_models.arrivals.FlagUpdate). */
typedef struct {
    uint64_t value;
    uint32_t slot;
    uint16_t rank;
    uint8_t op;
} EfaPub;

typedef struct {
    int64_t low;      /* every group below is complete */
    int64_t next_seq; /* every record below has arrived */
    EfaMap arrived, expected;
    EfaMap early;   /* seq -> EfaSig* (0: a fence marker) for records past a gap */
    EfaSig *pending; /* ring, seq order, not yet published */
    size_t phead, pn, pcap;
    EfaMap blocked; /* scratch of efa_tr_ready */
    uint64_t pieces_seen, records_seen;
} EfaTracker;

/* 0, or -1 with a protocol violation described in `why`, or -2 out of memory. */
int efa_tr_piece(EfaTracker *t, uint32_t index, char *why, size_t whylen);
int efa_tr_record(EfaTracker *t, uint32_t index, const EfaCtrl *rec, char *why, size_t whylen);
/* Appends the signals that may be published now, in order, to *out (grown as needed); -1 out of memory. */
int efa_tr_ready(EfaTracker *t, EfaPub **out, size_t *n, size_t *cap);
int efa_tr_idle(const EfaTracker *t);
void efa_tr_free(EfaTracker *t);

#endif
