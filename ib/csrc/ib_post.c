/*
 * The ib backend's data path in C: plan rows -> ibv_wr_* calls on a struct ibv_qp_ex, and completions
 * from a struct ibv_cq_ex -> the proxy's token completions (transportd._core.IbPoster).
 *
 * This is the only lowering of ib plan rows (ib/backend.py documents the signal modes and why each is
 * correct); transportd_models/ib_lowering.py is the Python model the shim tests compare it with. Everything
 * goes through the function pointers of the structs (verbs_abi.h), so the same code drives a NIC (structs
 * from pyverbs) and softverbs (structs filled by transportd/core/verbs_shim.c). No Python object is touched
 * on the data path: post and poll run without the GIL, and the engine calls them through a tpd_poster
 * (poster.h). Of the core this file includes only its poster interface and verbs ABI (by name, from the
 * core's include root that setup.py passes); it is linked into transportd._core with the core.
 *
 * Per connection, as IbBackend had it in Python:
 *   - WR numbers start after a random base; wr_id = key << SEQ_BITS | number (one CQ serves the rail);
 *   - only the last WR of a batch (a run of rows with one token; token 0 never ends a run) is signaled;
 *   - write/fence modes keep a shadow value per (raddr, rkey): ADD adds to it, SET sets it, the new
 *     absolute value is written from a staging slot (one per SQ entry, slot = number % depth), inline
 *     when the QP has inline data, else through an SGE; a shadow this connection never signalled starts at
 *     the value its receiver announced (seed_shadow: flags that outlived a daemon restart), else at 0;
 *   - fence mode (and SET in atomic mode) precede the flag with a zero-length ordering read unless the WR
 *     before is one, and fence the flag; a FENCE row is an ordering read and fences the next WR;
 *   - a post that would overrun the SQ is refused whole (nothing posted); a connection whose QP failed
 *     completes what is posted on it with IBV_WC_WR_FLUSH_ERR without touching the QP;
 *   - OrderedBatches: each token reported exactly once, with the status of the first completion seen for
 *     its batch; a failed WR flushes everything after it.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "poster.h"
#include "verbs_abi.h"

#define SEQ_BITS 48
#define SEQ_MASK ((1ull << SEQ_BITS) - 1)
#define MAX_KEYS ((1ull << (64 - SEQ_BITS)) - 1)
#define POLL_CHUNK 1024 /* completions read from the CQ per poll, at most */

enum { MODE_WRITE, MODE_ATOMIC, MODE_FENCE };
enum { K_WRITE, K_FLAG, K_ATOMIC, K_READ }; /* lowered WR kinds */
enum { S_WRS, S_SIGNALS, S_ORDER_READS, S_FENCES, S_ERRORS, S_CQES, N_STATS };
static const char *const STAT_NAMES[N_STATS] = {"wrs", "signals", "order_reads", "fences", "errors", "cqes"};


/* ---- per connection ------------------------------------------------------------------------------- */
typedef struct {
    uint64_t last; /* number of the batch's last WR */
    uint64_t token;
    int reported;
} Batch;

typedef struct {
    uint64_t raddr;
    uint32_t rkey;
    uint32_t used;
    uint64_t value;
} Shadow;

typedef struct {
    int64_t id;
    uint64_t key;
    struct ibv_qp_ex *qp;
    PyObject *qp_owner; /* keeps the struct's owner alive */
    uint64_t depth;
    uint64_t *staging;
    uint32_t staging_lkey;
    int connected, fence_next, after_read;
    int inline_flags; /* flag values go inline (the QP has inline data), else through an SGE */
    /* OrderedBatches */
    uint64_t posted, completed;
    uint32_t error;
    Batch *batches; /* ring of depth + 1: a batch has at least one WR, so at most depth are outstanding */
    size_t bhead, bcount;
    /* shadow values: open addressing; an entry is never removed (a value of 0 is the same as none) */
    Shadow *shadow;
    size_t shadow_cap, shadow_n;
} Conn;

static Batch *batch_at(Conn *c, size_t i) { return &c->batches[(c->bhead + i) % (c->depth + 1)]; }

static Shadow *shadow_slot(Conn *c, uint64_t raddr, uint32_t rkey) {
    if (c->shadow_n * 2 >= c->shadow_cap) {
        size_t ncap = c->shadow_cap ? c->shadow_cap * 2 : 64;
        Shadow *t = calloc(ncap, sizeof(Shadow));
        if (!t) return NULL;
        for (size_t i = 0; i < c->shadow_cap; i++) {
            Shadow *s = &c->shadow[i];
            if (!s->used) continue;
            size_t h = (size_t)((s->raddr * 0x9E3779B97F4A7C15ull) ^ s->rkey) & (ncap - 1);
            while (t[h].used) h = (h + 1) & (ncap - 1);
            t[h] = *s;
        }
        free(c->shadow);
        c->shadow = t;
        c->shadow_cap = ncap;
    }
    size_t h = (size_t)((raddr * 0x9E3779B97F4A7C15ull) ^ rkey) & (c->shadow_cap - 1);
    while (c->shadow[h].used && (c->shadow[h].raddr != raddr || c->shadow[h].rkey != rkey))
        h = (h + 1) & (c->shadow_cap - 1);
    if (!c->shadow[h].used) {
        c->shadow[h] = (Shadow){.raddr = raddr, .rkey = rkey, .used = 1};
        c->shadow_n++;
    }
    return &c->shadow[h];
}

/* ---- the poster ------------------------------------------------------------------------------------- */
typedef struct {
    uint8_t kind;
    uint8_t fence;
    uint32_t rkey, lkey, length;
    uint64_t raddr, laddr, value;
} Wr;

typedef struct {
    Shadow *slot;
    uint64_t old;
} Undo;

typedef struct {
    PyObject_HEAD
    tpd_poster iface;
    int mode;
    int inline_default; /* for add_connection without its inline argument */
    uint64_t scratch;
    uint32_t scratch_lkey;
    struct ibv_cq_ex *cq;
    PyObject *cq_owner;
    PyObject *exc_backend, *exc_sq_full, *exc_verbs;
    Conn **conns; /* by key; NULL: free */
    size_t nkeys;
    uint64_t stats[N_STATS];
    /* scratch of one post */
    Wr *wrs;
    size_t wrs_cap;
    size_t *ends;
    uint64_t *end_tokens;
    size_t ends_cap, ends_tok_cap;
    int64_t *counts;
    size_t counts_cap;
    Undo *undo;
    size_t undo_cap;
    /* completions beyond what a poll could return, for the next one */
    tpd_completion *carry, *work;
    size_t ncarry, carry_cap, work_cap;
    tpd_poster_error error;
} IbPoster;

static Conn *find_conn(IbPoster *p, int64_t id) {
    for (size_t k = 1; k < p->nkeys; k++)
        if (p->conns[k] && p->conns[k]->id == id) return p->conns[k];
    return NULL;
}

static int lower(IbPoster *p, Conn *c, const tpd_plan_row *rows, size_t n, size_t *nwr, size_t *nends,
                 size_t *nundo, int *fence_next_out, int *after_read_out) {
    size_t w = 0, ne = 0, nu = 0;
    int fence_next = c->fence_next, after_read = c->after_read;
    if (tpd_grow((void **)&p->wrs, &p->wrs_cap, 2 * n, sizeof(Wr)) ||
        tpd_grow((void **)&p->ends, &p->ends_cap, n, sizeof(size_t)) ||
        tpd_grow((void **)&p->end_tokens, &p->ends_tok_cap, n, sizeof(uint64_t)) ||
        tpd_grow((void **)&p->undo, &p->undo_cap, n, sizeof(Undo)))
        return tpd_fail(&p->error, TPD_E_NOMEM, 0, "out of memory");
    Wr *wrs = p->wrs;
#define PUT(k, rk, ra, la, len, lk, val)                                                                   \
    wrs[w++] = (Wr){.kind = (k), .fence = (uint8_t)fence_next, .rkey = (rk), .raddr = (ra), .laddr = (la), \
                    .length = (len), .lkey = (lk), .value = (val)}
    for (size_t i = 0; i < n; i++) {
        const tpd_plan_row *r = &rows[i];
        if (r->op == TPD_PLAN_WRITE) {
            PUT(K_WRITE, r->rkey, r->raddr, r->laddr, r->length, r->lkey, 0);
            fence_next = after_read = 0;
        } else if (r->op == TPD_PLAN_SIGNAL) {
            p->stats[S_SIGNALS]++;
            if (p->mode == MODE_ATOMIC && r->signal_op != TPD_SIGNAL_SET) {
                PUT(K_ATOMIC, r->rkey, r->raddr, 0, 8, 0, r->value);
                fence_next = after_read = 0;
            } else {
                Shadow *s = shadow_slot(c, r->raddr, r->rkey);
                if (!s) {
                    for (size_t u = nu; u-- > 0;) p->undo[u].slot->value = p->undo[u].old;
                    return tpd_fail(&p->error, TPD_E_NOMEM, 0, "out of memory");
                }
                p->undo[nu++] = (Undo){s, s->value};
                s->value = r->signal_op == TPD_SIGNAL_SET ? r->value : s->value + r->value;
                if (p->mode != MODE_WRITE) {
                    if (!after_read) {
                        PUT(K_READ, r->rkey, r->raddr, 0, 0, 0, 0);
                        p->stats[S_ORDER_READS]++;
                    }
                    fence_next = 1;
                }
                PUT(K_FLAG, r->rkey, r->raddr, 0, 8, 0, s->value);
                fence_next = after_read = 0;
            }
        } else if (r->op == TPD_PLAN_FENCE) {
            p->stats[S_FENCES]++;
            PUT(K_READ, 0, 0, 0, 0, 0, 0);
            p->stats[S_ORDER_READS]++;
            fence_next = after_read = 1;
        } else {
            /* undo in reverse: a slot touched twice gets its first old value back */
            for (size_t u = nu; u-- > 0;) p->undo[u].slot->value = p->undo[u].old;
            return tpd_fail(&p->error, TPD_E_BAD_OP, 0, "plan row %zu: unknown op %u", i, r->op);
        }
        if (i == n - 1 || (r->token != rows[i + 1].token && r->token != 0)) {
            p->ends[ne] = w - 1;
            p->end_tokens[ne] = r->token;
            ne++;
        }
    }
#undef PUT
    *nwr = w;
    *nends = ne;
    *nundo = nu;
    *fence_next_out = fence_next;
    *after_read_out = after_read;
    return 0;
}

static void issue(IbPoster *p, Conn *c, size_t nwr, size_t nends) {
    struct ibv_qp_ex *qp = c->qp;
    uint64_t key = c->key << SEQ_BITS;
    size_t e = 0;
    qp->wr_start(qp);
    for (size_t k = 0; k < nwr; k++) {
        const Wr *wr = &p->wrs[k];
        uint64_t seq = c->posted + k + 1;
        int last = e < nends && p->ends[e] == k;
        e += last;
        qp->wr_id = key | (seq & SEQ_MASK);
        qp->wr_flags = (wr->fence ? IBV_SEND_FENCE : 0) | (last ? IBV_SEND_SIGNALED : 0);
        switch (wr->kind) {
        case K_WRITE:
            qp->wr_rdma_write(qp, wr->rkey, wr->raddr);
            qp->wr_set_sge(qp, wr->lkey, wr->laddr, wr->length);
            break;
        case K_FLAG: {
            uint64_t slot = seq % c->depth;
            c->staging[slot] = wr->value;
            qp->wr_rdma_write(qp, wr->rkey, wr->raddr);
            if (c->inline_flags)
                qp->wr_set_inline_data(qp, &c->staging[slot], 8);
            else
                qp->wr_set_sge(qp, c->staging_lkey, (uint64_t)(uintptr_t)&c->staging[slot], 8);
            break;
        }
        case K_ATOMIC:
            qp->wr_atomic_fetch_add(qp, wr->rkey, wr->raddr, wr->value);
            qp->wr_set_sge(qp, p->scratch_lkey, p->scratch, 8);
            break;
        default: /* the zero-length ordering read: no memory touched, no rkey checked */
            qp->wr_rdma_read(qp, wr->rkey, wr->raddr);
            qp->wr_set_sge(qp, p->scratch_lkey, p->scratch + 8, 0);
        }
    }
}

static int carry_push(IbPoster *p, uint64_t token, uint32_t status, uint32_t vendor_err) {
    if (tpd_grow((void **)&p->carry, &p->carry_cap, p->ncarry + 1, sizeof(tpd_completion)))
        return tpd_fail(&p->error, TPD_E_NOMEM, 0, "out of memory");
    p->carry[p->ncarry++] = (tpd_completion){token, status, vendor_err};
    return 0;
}

/* Post `n` rows on one connection; counts[j] = WRs of its j-th batch, *nb how many batches. */
static int post_plan(IbPoster *p, int64_t id, const tpd_plan_row *rows, size_t n, int64_t *counts, size_t *nb) {
    *nb = 0;
    Conn *c = find_conn(p, id);
    if (!c) return tpd_fail(&p->error, TPD_E_UNKNOWN, 0, "unknown connection %lld", (long long)id);
    if (!c->connected) return tpd_fail(&p->error, TPD_E_NOT_CONNECTED, 0, "connection %lld is not connected", (long long)id);
    if (!n) return 0;
    if (c->error) { /* the QP is in error: it would only flush these; say so without touching it */
        for (size_t i = 0; i < n; i++) {
            if (i == n - 1 || rows[i].token != rows[i + 1].token) {
                if (carry_push(p, rows[i].token, IBV_WC_WR_FLUSH_ERR, 0)) return -1;
                if (counts) counts[*nb] = 0;
                (*nb)++;
            }
        }
        return 0;
    }
    size_t nwr = 0, nends = 0, nundo = 0;
    int fence_next = 0, after_read = 0;
    if (lower(p, c, rows, n, &nwr, &nends, &nundo, &fence_next, &after_read)) return -1;
    uint64_t inflight = c->posted - c->completed;
    if (inflight + nwr > c->depth) {
        for (size_t u = nundo; u-- > 0;) p->undo[u].slot->value = p->undo[u].old;
        return tpd_fail(&p->error, TPD_E_SQ_FULL, 0,
                    "connection %lld: %llu WRs outstanding, %zu more would overrun the %llu-entry send queue",
                    (long long)id, (unsigned long long)inflight, nwr, (unsigned long long)c->depth);
    }
    issue(p, c, nwr, nends);
    int rc = c->qp->wr_complete(c->qp);
    if (rc) {
        for (size_t u = nundo; u-- > 0;) p->undo[u].slot->value = p->undo[u].old;
        return tpd_fail(&p->error, TPD_E_VERBS, rc, "posting %zu WRs on connection %lld: ibv_wr_complete failed: %s", nwr,
                    (long long)id, strerror(rc));
    }
    size_t start = 0;
    for (size_t j = 0; j < nends; j++) {
        Batch *b = batch_at(c, c->bcount++);
        c->posted += p->ends[j] + 1 - start;
        *b = (Batch){.last = c->posted, .token = p->end_tokens[j], .reported = 0};
        if (counts) counts[j] = (int64_t)(p->ends[j] + 1 - start);
        start = p->ends[j] + 1;
    }
    *nb = nends;
    c->fence_next = fence_next;
    c->after_read = after_read;
    p->stats[S_WRS] += nwr;
    return 0;
}

/* tpd_poster.post: consecutive batches of one connection go out in one WR list (one wr_start .. wr_complete). */
static int ib_post(void *ctx, size_t nb, const int64_t *ids, const tpd_plan_row *plan, const int64_t *bounds,
                   int64_t *nwr) {
    IbPoster *p = ctx;
    size_t i = 0;
    while (i < nb) {
        size_t j = i + 1;
        while (j < nb && ids[j] == ids[i]) j++;
        size_t n = (size_t)(bounds[j] - bounds[i]), got;
        if (tpd_grow((void **)&p->counts, &p->counts_cap, n + 1, sizeof(int64_t))) return tpd_fail(&p->error, TPD_E_NOMEM, 0, "out of memory");
        if (post_plan(p, ids[i], plan + bounds[i], n, p->counts, &got)) return -1;
        /* per-batch counts when every batch carried its own token (the proxy's do), else zeros */
        for (size_t b = i; b < j; b++) nwr[b] = got == j - i ? p->counts[b - i] : 0;
        i = j;
    }
    return 0;
}

/* ---- completions ------------------------------------------------------------------------------------ */
static int work_push(IbPoster *p, size_t *nw, uint64_t token, uint32_t status, uint32_t vendor_err) {
    if (tpd_grow((void **)&p->work, &p->work_cap, *nw + 1, sizeof(tpd_completion))) return -1;
    p->work[(*nw)++] = (tpd_completion){token, status, vendor_err};
    return 0;
}

/* OrderedBatches.on_completion: a completion for WR `seq`; settles the batches it covers. */
static int on_completion(IbPoster *p, Conn *c, uint64_t seq, uint32_t status, uint32_t vendor_err, size_t *nw) {
    if (seq <= c->completed || seq > c->posted) return 0; /* stale (an earlier connection's) or not ours */
    c->completed = seq;
    uint32_t failed_before = c->error;
    if (status && !c->error) c->error = status;
    while (c->bcount && batch_at(c, 0)->last < seq) {
        /* every WR of this batch completed before `seq`: normally its own completion reported it; if not
         * (a provider that drops completions), it succeeded unless the QP had already failed */
        Batch b = *batch_at(c, 0);
        c->bhead = (c->bhead + 1) % (c->depth + 1);
        c->bcount--;
        if (!b.reported && work_push(p, nw, b.token, failed_before ? status : 0, failed_before ? vendor_err : 0))
            return -1;
    }
    if (c->bcount) {
        Batch *b = batch_at(c, 0);
        if (!b->reported && (status || b->last == seq)) {
            if (work_push(p, nw, b->token, status, vendor_err)) return -1;
            b->reported = 1;
        }
        if (b->last == seq) {
            c->bhead = (c->bhead + 1) % (c->depth + 1);
            c->bcount--;
        }
    }
    return 0;
}

/* tpd_poster.poll: what was carried over first, then up to POLL_CHUNK CQ entries. */
static long ib_poll(void *ctx, size_t max, tpd_completion *out) {
    IbPoster *p = ctx;
    size_t nw = 0;
    if (tpd_grow((void **)&p->work, &p->work_cap, p->ncarry + 1, sizeof(tpd_completion)))
        return tpd_fail(&p->error, TPD_E_NOMEM, 0, "out of memory");
    if (p->ncarry) memcpy(p->work, p->carry, p->ncarry * sizeof(tpd_completion)); /* carry may be NULL */
    nw = p->ncarry;
    p->ncarry = 0;
    if (nw < max && p->cq) {
        struct ibv_cq_ex *cq = p->cq;
        size_t want = max - nw < POLL_CHUNK ? max - nw : POLL_CHUNK;
        struct ibv_poll_cq_attr attr = {0};
        int rc = cq->start_poll(cq, &attr);
        if (rc != 0 && rc != ENOENT) {
            if (nw) memcpy(p->carry, p->work, nw * sizeof(tpd_completion)); /* nothing lost (carry may be NULL) */
            p->ncarry = nw;
            return tpd_fail(&p->error, TPD_E_POLL, rc, "polling the CQ: ibv_start_poll failed: %s", strerror(rc));
        }
        if (rc == 0) {
            size_t got = 0;
            int err = 0;
            for (;;) {
                uint64_t wr_id = cq->wr_id;
                uint32_t status = (uint32_t)cq->status;
                uint32_t vendor_err = cq->read_vendor_err(cq);
                got++;
                uint64_t key = wr_id >> SEQ_BITS;
                Conn *c = key < p->nkeys ? p->conns[key] : NULL;
                if (c) { /* else a connection closed since */
                    if (status) p->stats[S_ERRORS]++;
                    if (on_completion(p, c, wr_id & SEQ_MASK, status, vendor_err, &nw)) err = 1;
                }
                if (got == want || err) break;
                rc = cq->next_poll(cq);
                if (rc == ENOENT) break;
                if (rc) {
                    err = 2;
                    break;
                }
            }
            cq->end_poll(cq);
            p->stats[S_CQES] += got;
            if (err == 1) return tpd_fail(&p->error, TPD_E_NOMEM, 0, "out of memory");
            if (err == 2) {
                /* what was read is kept for the next poll */
                if (tpd_grow((void **)&p->carry, &p->carry_cap, nw, sizeof(tpd_completion)))
                    return tpd_fail(&p->error, TPD_E_NOMEM, 0, "out of memory");
                memcpy(p->carry, p->work, nw * sizeof(tpd_completion));
                p->ncarry = nw;
                return tpd_fail(&p->error, TPD_E_POLL, rc, "polling the CQ: ibv_next_poll failed: %s", strerror(rc));
            }
        }
    }
    size_t n = nw < max ? nw : max;
    memcpy(out, p->work, n * sizeof(tpd_completion));
    if (nw > n) {
        if (tpd_grow((void **)&p->carry, &p->carry_cap, nw - n, sizeof(tpd_completion)))
            return tpd_fail(&p->error, TPD_E_NOMEM, 0, "out of memory");
        memcpy(p->carry, p->work + n, (nw - n) * sizeof(tpd_completion));
        p->ncarry = nw - n;
    }
    return (long)n;
}

static void ib_raise(void *ctx) {
    IbPoster *p = ctx;
    tpd_raise_error(&p->error, p->exc_backend, p->exc_verbs, p->exc_sq_full);
}

/* ---- the Python type ------------------------------------------------------------------------------ */
static int IbPoster_init(IbPoster *p, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"cq", "mode", "scratch_addr", "scratch_lkey", "backend_error", "sq_full_error",
                             "verbs_error", "inline", NULL};
    PyObject *cq;
    const char *mode;
    unsigned long long scratch;
    unsigned int scratch_lkey;
    PyObject *eb, *es, *ev;
    int inl = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OsKIOOO|p", kwlist, &cq, &mode, &scratch, &scratch_lkey, &eb, &es,
                                     &ev, &inl))
        return -1;
    if (!strcmp(mode, "write")) p->mode = MODE_WRITE;
    else if (!strcmp(mode, "atomic")) p->mode = MODE_ATOMIC;
    else if (!strcmp(mode, "fence")) p->mode = MODE_FENCE;
    else {
        PyErr_Format(PyExc_ValueError, "mode must be write, atomic or fence, not %s", mode);
        return -1;
    }
    struct ibv_cq_ex *cqp = tpd_handle_pointer(cq, "ibv_cq_ex");
    if (!cqp) return -1;
    p->cq = cqp;
    Py_INCREF(cq);
    Py_XSETREF(p->cq_owner, cq);
    p->scratch = scratch;
    p->inline_default = inl;
    p->scratch_lkey = scratch_lkey;
    Py_INCREF(eb);
    Py_INCREF(es);
    Py_INCREF(ev);
    Py_XSETREF(p->exc_backend, eb);
    Py_XSETREF(p->exc_sq_full, es);
    Py_XSETREF(p->exc_verbs, ev);
    p->iface = (tpd_poster){.ctx = p, .post = ib_post, .poll = ib_poll, .raise_error = ib_raise};
    return 0;
}

static void conn_free(Conn *c) {
    Py_XDECREF(c->qp_owner);
    free(c->batches);
    free(c->shadow);
    free(c);
}

static void IbPoster_dealloc(IbPoster *p) {
    for (size_t k = 0; k < p->nkeys; k++)
        if (p->conns[k]) conn_free(p->conns[k]);
    free(p->conns);
    free(p->wrs);
    free(p->ends);
    free(p->end_tokens);
    free(p->undo);
    free(p->carry);
    free(p->work);
    free(p->counts);
    Py_XDECREF(p->cq_owner);
    Py_XDECREF(p->exc_backend);
    Py_XDECREF(p->exc_sq_full);
    Py_XDECREF(p->exc_verbs);
    Py_TYPE(p)->tp_free((PyObject *)p);
}

/* add_connection(conn_id, qp, depth, staging_addr, staging_lkey, base, inline) -> key */
static PyObject *IbPoster_add_connection(IbPoster *p, PyObject *args) {
    long long id;
    PyObject *qp;
    unsigned long long depth, staging, base;
    unsigned int lkey;
    int inl = p->inline_default;
    if (!PyArg_ParseTuple(args, "LOKKIK|p", &id, &qp, &depth, &staging, &lkey, &base, &inl)) return NULL;
    if (find_conn(p, id)) return PyErr_Format(p->exc_backend, "connection %lld already exists", id);
    if (depth < 1) return PyErr_Format(PyExc_ValueError, "depth must be at least 1");
    struct ibv_qp_ex *qpx = tpd_handle_pointer(qp, "ibv_qp_ex");
    if (!qpx) return NULL;
    size_t key = 1;
    while (key < p->nkeys && p->conns[key]) key++;
    if (key > MAX_KEYS) return PyErr_Format(p->exc_backend, "too many connections on this rail");
    if (key >= p->nkeys) {
        size_t cap = p->nkeys;
        if (tpd_grow((void **)&p->conns, &cap, key + 1, sizeof(Conn *))) return PyErr_NoMemory();
        memset(p->conns + p->nkeys, 0, (cap - p->nkeys) * sizeof(Conn *));
        p->nkeys = cap;
    }
    Conn *c = calloc(1, sizeof(Conn));
    if (!c || !(c->batches = calloc(depth + 1, sizeof(Batch)))) {
        free(c);
        return PyErr_NoMemory();
    }
    c->id = id;
    c->key = key;
    c->qp = qpx;
    Py_INCREF(qp);
    c->qp_owner = qp;
    c->depth = depth;
    c->staging = (uint64_t *)(uintptr_t)staging;
    c->staging_lkey = lkey;
    c->inline_flags = inl;
    c->posted = c->completed = base;
    p->conns[key] = c;
    return PyLong_FromSize_t(key);
}

static PyObject *IbPoster_connect(IbPoster *p, PyObject *arg) {
    long long id = PyLong_AsLongLong(arg);
    if (id == -1 && PyErr_Occurred()) return NULL;
    Conn *c = find_conn(p, id);
    if (!c) return PyErr_Format(p->exc_backend, "unknown connection %lld", id);
    c->connected = 1;
    Py_RETURN_NONE;
}

/* Forget a connection (its QP is being destroyed): outstanding tokens are dropped, the key freed. */
static PyObject *IbPoster_remove_connection(IbPoster *p, PyObject *arg) {
    long long id = PyLong_AsLongLong(arg);
    if (id == -1 && PyErr_Occurred()) return NULL;
    Conn *c = find_conn(p, id);
    if (c) {
        p->conns[c->key] = NULL;
        conn_free(c);
    }
    Py_RETURN_NONE;
}

/* seed_shadow(conn_id, base, rkey, seeds): the flag words at base + 8 * slot (rkey) hold these values already
 * (seeds: (u32 slot, u32 pad, u64 value) records, what their receiver announced). A word this connection
 * has signalled keeps its shadow: only words it never wrote start from the receiver's value. */
static PyObject *IbPoster_seed_shadow(IbPoster *p, PyObject *args) {
    long long id;
    unsigned long long base;
    unsigned int rkey;
    Py_buffer seeds;
    if (!PyArg_ParseTuple(args, "LKIy*", &id, &base, &rkey, &seeds)) return NULL;
    Conn *c = find_conn(p, id);
    PyObject *res = NULL;
    if (!c) {
        PyErr_Format(p->exc_backend, "unknown connection %lld", id);
    } else if (seeds.len % 16) {
        PyErr_SetString(PyExc_ValueError, "seeds must be 16-byte (slot, pad, value) records");
    } else {
        const uint8_t *b = seeds.buf;
        size_t n = (size_t)seeds.len / 16, seeded = 0;
        for (size_t i = 0; i < n; i++) {
            uint32_t slot;
            uint64_t value;
            memcpy(&slot, b + 16 * i, 4);
            memcpy(&value, b + 16 * i + 8, 8);
            size_t before = c->shadow_n;
            Shadow *sh = shadow_slot(c, base + 8ull * slot, rkey);
            if (!sh) {
                PyErr_NoMemory();
                break;
            }
            if (c->shadow_n != before) { /* a word this connection never signalled */
                sh->value = value;
                seeded++;
            }
        }
        if (!PyErr_Occurred()) res = PyLong_FromSize_t(seeded);
    }
    PyBuffer_Release(&seeds);
    return res;
}

static PyObject *IbPoster_inflight(IbPoster *p, PyObject *arg) {
    long long id = PyLong_AsLongLong(arg);
    if (id == -1 && PyErr_Occurred()) return NULL;
    Conn *c = find_conn(p, id);
    if (!c) return PyErr_Format(p->exc_backend, "unknown connection %lld", id);
    return PyLong_FromUnsignedLongLong(c->posted - c->completed);
}

/* post_batches(conn_ids, plan, bounds) -> bytes of int64 WR counts per batch (buffers in, like the engine) */
static PyObject *IbPoster_post_batches(IbPoster *p, PyObject *args) { return tpd_post_batches_method(&p->iface, args); }

/* post(conn_id, plan) -> WRs posted (every batch of the plan, whatever its tokens) */
static PyObject *IbPoster_post(IbPoster *p, PyObject *args) {
    long long id;
    Py_buffer plan;
    if (!PyArg_ParseTuple(args, "Ly*", &id, &plan)) return NULL;
    PyObject *res = NULL;
    size_t n = (size_t)plan.len / sizeof(tpd_plan_row), nb = 0;
    if (plan.len % sizeof(tpd_plan_row)) {
        PyErr_SetString(PyExc_ValueError, "plan must be PLAN_DTYPE rows");
    } else if (tpd_grow((void **)&p->counts, &p->counts_cap, n + 1, sizeof(int64_t))) {
        PyErr_NoMemory();
    } else {
        int rc;
        Py_BEGIN_ALLOW_THREADS
        rc = post_plan(p, id, plan.buf, n, p->counts, &nb);
        Py_END_ALLOW_THREADS
        if (rc) {
            ib_raise(p);
        } else {
            long long total = 0;
            for (size_t b = 0; b < nb; b++) total += p->counts[b];
            res = PyLong_FromLongLong(total);
        }
    }
    PyBuffer_Release(&plan);
    return res;
}

/* poll(max_completions) -> bytes of COMPLETION_DTYPE rows */
static PyObject *IbPoster_poll(IbPoster *p, PyObject *arg) { return tpd_poll_method(&p->iface, arg); }

static PyObject *IbPoster_stats(IbPoster *p, PyObject *unused) {
    PyObject *d = PyDict_New();
    for (int i = 0; d && i < N_STATS; i++) {
        PyObject *v = PyLong_FromUnsignedLongLong(p->stats[i]);
        if (!v || PyDict_SetItemString(d, STAT_NAMES[i], v)) {
            Py_XDECREF(v);
            Py_CLEAR(d);
            break;
        }
        Py_DECREF(v);
    }
    return d;
}

static PyObject *IbPoster_get_poster(IbPoster *p, void *unused) {
    return PyCapsule_New(&p->iface, TPD_POSTER_CAPSULE, NULL);
}

static PyMethodDef IbPoster_methods[] = {
    {"add_connection", (PyCFunction)IbPoster_add_connection, METH_VARARGS,
     "add_connection(conn_id, qp, depth, staging_addr, staging_lkey, base, inline) -> key; qp.ibv_qp_ex is a capsule."},
    {"connect", (PyCFunction)IbPoster_connect, METH_O, "Mark a connection connected (its QP is in RTS)."},
    {"remove_connection", (PyCFunction)IbPoster_remove_connection, METH_O, "Forget a connection and free its key."},
    {"inflight", (PyCFunction)IbPoster_inflight, METH_O, "WRs posted on a connection and not known complete."},
    {"seed_shadow", (PyCFunction)IbPoster_seed_shadow, METH_VARARGS,
     "seed_shadow(conn_id, base, rkey, seeds) -> words seeded: flag values the receiver announced."},
    {"post_batches", (PyCFunction)IbPoster_post_batches, METH_VARARGS,
     "post_batches(conn_ids, plan, bounds) -> int64 WR counts per batch, as bytes."},
    {"post", (PyCFunction)IbPoster_post, METH_VARARGS, "post(conn_id, plan) -> WRs posted."},
    {"poll", (PyCFunction)IbPoster_poll, METH_O, "poll(max) -> COMPLETION_DTYPE rows, as bytes."},
    {"stats", (PyCFunction)IbPoster_stats, METH_NOARGS, "Counters: wrs, signals, order_reads, fences, errors, cqes."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef IbPoster_getset[] = {
    {"poster", (getter)IbPoster_get_poster, NULL, "The tpd_poster capsule the engine calls.", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject IbPosterType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "transportd._core.IbPoster",
    .tp_basicsize = sizeof(IbPoster),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "The ib lowering and completion tracking in C, on an ibv_qp_ex per connection and an ibv_cq_ex.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)IbPoster_init,
    .tp_dealloc = (destructor)IbPoster_dealloc,
    .tp_methods = IbPoster_methods,
    .tp_getset = IbPoster_getset,
};

int tpd_ib_register(void *mod) {
    PyObject *m = mod;
    if (PyType_Ready(&IbPosterType) < 0) return -1;
    Py_INCREF(&IbPosterType);
    if (PyModule_AddObject(m, "IbPoster", (PyObject *)&IbPosterType) < 0) {
        Py_DECREF(&IbPosterType);
        return -1;
    }
    if (PyModule_AddIntConstant(m, "SEQ_BITS", SEQ_BITS) < 0) return -1;
    return 0;
}
