/*
 * efa arrival counting (efa_arrivals.h): transportd_models/arrivals.py's ArrivalTracker with its dicts as
 * hash maps and its deque as a ring. Counters are int64 so that unwrapping near zero can go negative and be
 * refused, exactly as Python's unbounded ints are.
 */
#include "efa_arrivals.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- the map ----------------------------------------------------------------------------------------- */
static size_t hash64(int64_t k) {
    uint64_t x = (uint64_t)k + 0x9E3779B97F4A7C15ull; /* splitmix64's finaliser */
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return (size_t)(x ^ (x >> 31));
}

static EfaMapEnt *map_find(const EfaMap *m, int64_t k) {
    if (!m->n) return NULL;
    size_t mask = m->cap - 1;
    for (size_t h = hash64(k) & mask;; h = (h + 1) & mask) {
        EfaMapEnt *e = &m->t[h];
        if (!e->used) return NULL;
        if (e->key == k) return e;
    }
}

static int map_grow(EfaMap *m) {
    size_t ncap = m->cap ? 2 * m->cap : 16;
    EfaMapEnt *t = calloc(ncap, sizeof *t);
    if (!t) return -1;
    for (size_t i = 0; i < m->cap; i++) {
        if (!m->t[i].used) continue;
        size_t h = hash64(m->t[i].key) & (ncap - 1);
        while (t[h].used) h = (h + 1) & (ncap - 1);
        t[h] = m->t[i];
    }
    free(m->t);
    m->t = t;
    m->cap = ncap;
    return 0;
}

/* The entry for k, created with value 0 if absent; NULL when out of memory. */
static EfaMapEnt *map_slot(EfaMap *m, int64_t k) {
    if ((m->n + 1) * 2 > m->cap && map_grow(m)) return NULL;
    size_t mask = m->cap - 1;
    size_t h = hash64(k) & mask;
    while (m->t[h].used && m->t[h].key != k) h = (h + 1) & mask;
    if (!m->t[h].used) {
        m->t[h] = (EfaMapEnt){.key = k, .val = 0, .used = 1};
        m->n++;
    }
    return &m->t[h];
}

static void map_del(EfaMap *m, EfaMapEnt *e) {
    size_t mask = m->cap - 1, i = (size_t)(e - m->t), j = i;
    e->used = 0;
    m->n--;
    for (;;) { /* shift later members of the run back so lookups never stop at the hole */
        j = (j + 1) & mask;
        if (!m->t[j].used) return;
        size_t home = hash64(m->t[j].key) & mask;
        if ((j > i && (home <= i || home > j)) || (j < i && home <= i && home > j)) {
            m->t[i] = m->t[j];
            m->t[j].used = 0;
            i = j;
        }
    }
}

static void map_clear(EfaMap *m) {
    if (m->n) memset(m->t, 0, m->cap * sizeof *m->t);
    m->n = 0;
}

static uint64_t map_get(const EfaMap *m, int64_t k, int *found) {
    EfaMapEnt *e = map_find(m, k);
    *found = e != NULL;
    return e ? e->val : 0;
}

EfaMapEnt *efa_map_find(const EfaMap *m, int64_t k) { return map_find(m, k); }
EfaMapEnt *efa_map_slot(EfaMap *m, int64_t k) { return map_slot(m, k); }
void efa_map_del(EfaMap *m, EfaMapEnt *e) { map_del(m, e); }

/* ---- the tracker --------------------------------------------------------------------------------------- */
static void advance_low(EfaTracker *t) {
    for (;;) {
        EfaMapEnt *want = map_find(&t->expected, t->low);
        if (!want) return;
        EfaMapEnt *got = map_find(&t->arrived, t->low);
        if ((got ? got->val : 0) != want->val) return;
        map_del(&t->expected, want);
        got = map_find(&t->arrived, t->low); /* the deletion above may have moved it */
        if (got) map_del(&t->arrived, got);
        t->low++;
    }
}

int efa_tr_piece(EfaTracker *t, uint32_t index, char *why, size_t whylen) {
    int64_t group = efa_unwrap(index, EFA_INDEX_BITS, t->low);
    if (group < t->low) {
        snprintf(why, whylen, "piece for group %lld, which was already complete", (long long)group);
        return -1;
    }
    EfaMapEnt *e = map_slot(&t->arrived, group);
    if (!e) return -2;
    e->val++;
    t->pieces_seen++;
    if (group == t->low) advance_low(t);
    return 0;
}

static int accept(EfaTracker *t, EfaSig *s) {
    t->next_seq++;
    if (!s) return 0;
    if (t->pn == t->pcap) {
        size_t ncap = t->pcap ? 2 * t->pcap : 16;
        EfaSig *r = malloc(ncap * sizeof *r);
        if (!r) return -2;
        for (size_t i = 0; i < t->pn; i++) r[i] = t->pending[(t->phead + i) % t->pcap];
        free(t->pending);
        t->pending = r;
        t->pcap = ncap;
        t->phead = 0;
    }
    t->pending[(t->phead + t->pn++) % t->pcap] = *s;
    return 0;
}

int efa_tr_record(EfaTracker *t, uint32_t index, const EfaCtrl *rec, char *why, size_t whylen) {
    int64_t seq = efa_unwrap(rec->seq, 32, t->next_seq);
    if ((uint32_t)((uint64_t)seq & EFA_INDEX_MASK) != index) {
        snprintf(why, whylen, "staging entry holds record %lld, the immediate names %u: overwritten", (long long)seq,
                 index);
        return -1;
    }
    if (seq < t->next_seq || map_find(&t->early, seq)) {
        snprintf(why, whylen, "record %lld arrived twice", (long long)seq);
        return -1;
    }
    t->records_seen++;
    int64_t group = efa_unwrap(rec->group, 32, t->low);
    uint64_t pieces = rec->pieces;
    if (group >= t->low) {
        int known;
        uint64_t was = map_get(&t->expected, group, &known);
        if (known && was != pieces) {
            snprintf(why, whylen, "group %lld announced with %llu and %llu pieces", (long long)group,
                     (unsigned long long)was, (unsigned long long)pieces);
            return -1;
        }
        EfaMapEnt *e = map_slot(&t->expected, group);
        if (!e) return -2;
        e->val = pieces;
        int have;
        if (map_get(&t->arrived, group, &have) > pieces) {
            snprintf(why, whylen, "group %lld: more pieces arrived than announced", (long long)group);
            return -1;
        }
    }
    EfaSig sig, *entry = NULL;
    if (rec->op == EFA_OP_ADD || rec->op == EFA_OP_SET) {
        sig = (EfaSig){.seq = seq, .group = group, .after = efa_unwrap(rec->after, 32, t->low), .value = rec->value,
                       .slot = rec->slot, .rank = rec->rank, .op = rec->op};
        entry = &sig;
    } else if (rec->op != EFA_OP_FENCE) {
        snprintf(why, whylen, "record %lld: unknown op %u", (long long)seq, rec->op);
        return -1;
    }
    if (seq == t->next_seq) {
        if (accept(t, entry)) return -2;
        for (;;) {
            EfaMapEnt *e = map_find(&t->early, t->next_seq);
            if (!e) break;
            EfaSig *s = (EfaSig *)(uintptr_t)e->val;
            map_del(&t->early, e);
            int rc = accept(t, s);
            free(s);
            if (rc) return -2;
        }
    } else {
        EfaSig *copy = NULL;
        if (entry) {
            copy = malloc(sizeof *copy);
            if (!copy) return -2;
            *copy = sig;
        }
        EfaMapEnt *e = map_slot(&t->early, seq);
        if (!e) {
            free(copy);
            return -2;
        }
        e->val = (uint64_t)(uintptr_t)copy;
    }
    if (group == t->low) advance_low(t);
    return 0;
}

static int complete(const EfaTracker *t, int64_t group) {
    if (group < t->low) return 1;
    int known, have;
    uint64_t want = map_get(&t->expected, group, &known);
    return known && map_get(&t->arrived, group, &have) == want;
}

int efa_tr_ready(EfaTracker *t, EfaPub **out, size_t *n, size_t *cap) {
    if (!t->pn) return 0;
    map_clear(&t->blocked);
    size_t keep = 0;
    for (size_t i = 0; i < t->pn; i++) {
        EfaSig *s = &t->pending[(t->phead + i) % t->pcap];
        int64_t key = ((int64_t)s->rank << 32) | s->slot;
        if (!map_find(&t->blocked, key) && complete(t, s->group) && s->after <= t->low) {
            if (*n == *cap) {
                size_t ncap = *cap ? 2 * *cap : 64;
                EfaPub *o = realloc(*out, ncap * sizeof *o);
                if (!o) return -1;
                *out = o;
                *cap = ncap;
            }
            (*out)[(*n)++] = (EfaPub){.value = s->value, .slot = s->slot, .rank = s->rank, .op = s->op};
        } else {
            if (!map_slot(&t->blocked, key)) return -1;
            t->pending[(t->phead + keep++) % t->pcap] = *s; /* compacted in place, order kept */
        }
    }
    t->pn = keep;
    return 0;
}

int efa_tr_idle(const EfaTracker *t) { return !t->pn && !t->early.n; }

void efa_tr_free(EfaTracker *t) {
    for (size_t i = 0; i < t->early.cap; i++)
        if (t->early.t[i].used) free((void *)(uintptr_t)t->early.t[i].val);
    free(t->early.t);
    free(t->arrived.t);
    free(t->expected.t);
    free(t->blocked.t);
    free(t->pending);
    memset(t, 0, sizeof *t);
}
