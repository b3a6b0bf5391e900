/*
 * The efa backend's data path in C (transportd._core.EfaPoster): plan rows -> RDMA write-with-immediate
 * on one SRD struct ibv_qp_ex per rail, completions and arrivals from its struct ibv_cq_ex -> the proxy's
 * token completions and the receiver's flag publication.
 *
 * This is the only lowering of efa plan rows; efa/backend.py documents the protocol and
 * transportd_models/efa_lowering.py is the Python model the shim tests compare it with. Everything goes through
 * the structs' function pointers (verbs_abi.h), so the same code drives an EFA NIC (pyverbs' structs) and
 * softverbs (efa_shim.c's SrdShimQP and transportd/core/verbs_shim.c's ShimCQ). post and poll run without
 * the GIL. Of the core this file includes only its poster interface and verbs ABI (by name, from the core's
 * include root that setup.py passes); it is linked into transportd._core with the core.
 *
 * Sending, as EfaBackend had it in Python:
 *   - WRITE: one WR per piece of at most max_rdma_size bytes (a zero-length write is one piece); each
 *     piece's immediate is (DATA, the peer's connection index, the piece's group);
 *   - SIGNAL / FENCE: a 32-byte control record (efa_arrivals.h EfaCtrl) written from a send staging slot
 *     into the peer's staging ring, entry seq % entries; immediate (CTRL, peer index, seq);
 *   - groups: a run of WRITEs and the records after it; SIGNAL's `after` is the last FENCE's group + 1
 *     (the group itself when cumulative); a FENCE marker raises `after` for later signals;
 *   - every WR is signaled, nothing inline, no fence flag (EFA's rules); a batch (a run of rows with one
 *     token; token 0 never ends a run) completes when all its WRs have, with the first error status seen;
 *   - post never refuses for space: WRs wait in a backlog shared by the rail's connections and are
 *     submitted as the SQ frees, keeping per connection fewer than 2^16 WRs between the oldest incomplete
 *     one and the newest, and fewer than half the peer's staging entries of records in flight (so the
 *     receiver's 18-bit indices stay unambiguous and no staging entry is overwritten before it is read).
 *     A record is copied into its send staging slot (record seq % entries) only when it is submitted: the
 *     same window makes the slot's previous record complete by then.
 * Receiving: RECV_RDMA_WITH_IMM completions are counted per connection by efa_arrivals.c; records are
 * copied out of the receive staging ring at once. Flags that became safe are stored directly into
 * host-mapped flag words the backend registered (set_host_flags), or into GPU flag words mapped into this
 * process through the GPU's BAR (GDRCopy; set_mapped_flags): those keep a host shadow of each counter
 * and get one 8-byte store of the new value, never a read across PCIe. The rest (GPU flags published
 * another way, unknown ranks), the optional visibility flush, protocol-error reports and receive-WR
 * replenishing go to Python in at most one call per poll (the `on_pass` callable), and so does every poll
 * while Python asks for it (`want_pass`: its loopback flag writes are in flight), at most every WANT_PASS_NS.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <arpa/inet.h>
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "efa_arrivals.h"
#include "poster.h"
#include "verbs_abi.h"

#define SEQ_BITS 48
#define SEQ_MASK ((1ull << SEQ_BITS) - 1)
#define RECV_TAG (1ull << 63) /* wr_id of a posted receive WR */
#define MAX_SPAN (1ull << 16)
#define WC_RECV_RDMA_WITH_IMM 129 /* IBV_WC_RECV_RDMA_WITH_IMM */

enum { S_WRS, S_PIECES, S_SIGNALS, S_FENCES, S_ERRORS, S_ARRIVALS, S_ARRIVAL_BYTES, S_PUBLISHED, S_PUBLISHED_HOST,
       S_PUBLISHED_MAPPED, S_FLUSHES, S_BACKLOGGED, S_PROTOCOL, S_UNKNOWN, S_SEND_CQES, N_STATS };
static const char *const STAT_NAMES[N_STATS] = {
    "wrs", "pieces", "signals", "fences", "errors", "arrivals", "arrival_bytes", "published", "published_host",
    "published_mapped", "visibility_flushes", "backlogged", "protocol_errors", "unknown_arrivals",
    "send_completions"};

/* A ring of fixed-size items indexed by a 64-bit sequence number: valid for seq in [lo, hi), hi - lo <= cap. */
typedef struct {
    uint8_t *v;
    uint64_t cap; /* power of two */
    size_t item;
} SeqRing;

static void *ring_at(SeqRing *r, uint64_t seq) { return r->v + (seq & (r->cap - 1)) * r->item; }

static int ring_reserve(SeqRing *r, uint64_t lo, uint64_t hi, uint64_t need_hi) {
    if (need_hi - lo <= r->cap) return 0;
    uint64_t ncap = r->cap ? r->cap : 64;
    while (ncap < need_hi - lo) ncap *= 2;
    uint8_t *v = calloc(ncap, r->item);
    if (!v) return -1;
    if (hi - lo > r->cap) hi = lo + r->cap; /* (what lies past the old capacity was never valid) */
    for (uint64_t s = lo; s < hi; s++) memcpy(v + (s & (ncap - 1)) * r->item, ring_at(r, s), r->item);
    free(r->v);
    r->v = v;
    r->cap = ncap;
    return 0;
}

typedef struct {
    uint32_t batch; /* index + 1 into the batch pool; 0: completed */
    uint32_t ctrl;  /* a record */
    uint64_t rec;   /* its record seq */
} Pend;

typedef struct {
    uint64_t token;
    uint32_t remaining, status, vendor_err, next_free;
} Batch;

typedef struct Conn {
    int64_t id;
    uint32_t index, key;
    int64_t job;
    int connected, failed;
    /* the peer's end */
    uint64_t ah;
    uint32_t qpn, qkey, peer_index, peer_staging_rkey;
    uint64_t peer_staging_addr, peer_entries;
    uint8_t *send_staging; /* peer_entries records, registered */
    uint32_t send_lkey;
    const uint8_t *recv_staging;
    uint64_t recv_entries;
    /* transportd_models.arrivals.SenderGroups */
    uint64_t g_group, g_pieces, g_after, g_seq;
    int g_closed;
    /* send bookkeeping */
    uint64_t next_seq, oldest, oldest_ctrl;
    size_t npending, waiting;
    SeqRing pend;   /* Pend by WR seq, [oldest, next_seq) */
    SeqRing ctrlp;  /* uint8 "record in flight" by record seq, [oldest_ctrl, g_seq) */
    EfaTracker tr;
    int touched;
} Conn;

/* A lowered WR: in the backlog until submitted. */
typedef struct {
    Conn *c;
    uint64_t seq, raddr, laddr, rec;
    uint32_t rkey, lkey, length, imm;
    int ctrl;
    EfaCtrl record;
} Wr;

typedef struct {
    int64_t conn;
    uint32_t rank, slot, op, pad;
    uint64_t value;
} PyPub; /* efa.backend's PUB_DTYPE */

typedef struct {
    uint64_t addr, count;
    uint64_t shadow; /* 0: host words, updated in place; else the host shadow of mapped GPU words */
} HostFlags;

typedef struct {
    uint64_t *word;
    uint64_t *shadow; /* NULL: a host word */
    uint64_t value;
    int set;
} HostStore;

typedef struct {
    PyObject_HEAD
    tpd_poster iface;
    struct ibv_qp_ex *qp;
    struct ibv_cq_ex *cq;
    PyObject *qp_owner, *cq_owner, *on_pass;
    PyObject *exc_backend, *exc_verbs;
    uint64_t max_rdma_size, sq_depth, submitted;
    int cumulative, unsolicited, visibility_flush, has_hook;
    int want_pass; /* Python asked for on_pass on every poll (its loopback flag writes are still in flight) */
    int64_t want_next_ns; /* ... but at most once per WANT_PASS_NS when nothing else needs the call */
    uint64_t rq_depth, rq_missing;
    Conn **conns;
    size_t nconns, conns_cap;
    Conn *by_index[EFA_MAX_CONNS];
    Batch *batches;
    size_t nbatches, batches_cap;
    uint32_t free_batch; /* index + 1, 0: none */
    /* the backlog: a ring of WRs in submission order */
    Wr *bl;
    size_t bl_head, bl_n, bl_cap;
    /* scratch of a post */
    Wr *tmp;
    size_t tmp_cap;
    size_t *ends;
    uint64_t *end_tokens;
    size_t ends_cap, end_tokens_cap;
    /* completions beyond what a poll could return */
    tpd_completion *work;
    size_t nwork, work_cap, ncarry;
    /* publication */
    EfaPub *pubs;
    size_t npubs, pubs_cap;
    PyPub *pypubs;
    size_t npypubs, pypubs_cap;
    HostStore *stores;
    size_t nstores, stores_cap;
    Conn **touched;
    size_t touched_cap;
    EfaMap host; /* (job << 16 | rank) -> index + 1 into hflags */
    HostFlags *hflags;
    size_t nhflags, hflags_cap;
    struct { int64_t conn; char why[200]; } fail_q[16]; /* protocol errors to log, in on_pass */
    size_t nfail;
    uint64_t stats[N_STATS];
    tpd_poster_error error;
} EfaPoster;

/* A want_pass alone calls Python at most this often: a loopback write completes in microseconds on a NIC, and
 * every call takes the GIL from the process's other threads (over softverbs, the soft device's I/O thread). */
#define WANT_PASS_NS 20000

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000ll + ts.tv_nsec;
}

static Conn *find_conn(EfaPoster *p, int64_t id) {
    for (size_t i = 0; i < p->nconns; i++)
        if (p->conns[i]->id == id) return p->conns[i];
    return NULL;
}

static Conn *conn_by_key(EfaPoster *p, uint64_t key) {
    for (size_t i = 0; i < p->nconns; i++)
        if (p->conns[i]->key == key) return p->conns[i];
    return NULL;
}

static uint32_t batch_new(EfaPoster *p, uint64_t token, uint32_t n) {
    uint32_t b = p->free_batch;
    if (b) {
        p->free_batch = p->batches[b - 1].next_free;
    } else {
        if (tpd_grow((void **)&p->batches, &p->batches_cap, p->nbatches + 1, sizeof(Batch))) return 0;
        b = (uint32_t)++p->nbatches;
    }
    p->batches[b - 1] = (Batch){.token = token, .remaining = n};
    return b;
}

static void batch_free(EfaPoster *p, uint32_t b) {
    p->batches[b - 1].next_free = p->free_batch;
    p->free_batch = b;
}

/* ---- lowering ------------------------------------------------------------------------------------------ */
static void close_record(Conn *c, EfaCtrl *r, uint8_t op, uint64_t value, uint16_t rank, uint32_t slot,
                         uint64_t after) {
    *r = (EfaCtrl){.value = value, .pieces = (uint32_t)c->g_pieces, .group = (uint32_t)c->g_group,
                   .after = (uint32_t)after, .slot = slot, .rank = rank, .op = op, .seq = (uint32_t)c->g_seq};
    c->g_seq++;
    c->g_closed = 1;
}

/* Rows of one slice -> p->tmp; *nwr WRs, *nends batches (ends/end_tokens). Group state rolls back on error. */
static int lower(EfaPoster *p, Conn *c, const tpd_plan_row *rows, size_t n, size_t *nwr, size_t *nends) {
    uint64_t saved[4] = {c->g_group, c->g_pieces, c->g_after, c->g_seq};
    int saved_closed = c->g_closed;
    uint64_t maxsz = p->max_rdma_size, stats_pieces = 0, stats_signals = 0, stats_fences = 0;
    size_t w = 0, ne = 0;
    if (tpd_grow((void **)&p->ends, &p->ends_cap, n, sizeof(size_t)) ||
        tpd_grow((void **)&p->end_tokens, &p->end_tokens_cap, n, sizeof(uint64_t)))
        return tpd_fail(&p->error, TPD_E_NOMEM, 0, "out of memory");
    for (size_t i = 0; i < n; i++) {
        const tpd_plan_row *r = &rows[i];
        if (r->op == TPD_PLAN_WRITE) {
            uint64_t len = r->length, npieces = len ? (len + maxsz - 1) / maxsz : 1;
            if (tpd_grow((void **)&p->tmp, &p->tmp_cap, w + npieces, sizeof(Wr))) goto nomem;
            if (c->g_closed) {
                c->g_group++;
                c->g_pieces = 0;
                c->g_closed = 0;
            }
            c->g_pieces += npieces;
            uint32_t imm = efa_encode_imm(EFA_KIND_DATA, c->peer_index, c->g_group);
            for (uint64_t k = 0, off = 0; k < npieces; k++, off += maxsz) {
                p->tmp[w++] = (Wr){.c = c, .rkey = r->rkey, .raddr = r->raddr + off, .laddr = r->laddr + off,
                                   .length = (uint32_t)(len - off < maxsz ? len - off : maxsz), .lkey = r->lkey,
                                   .imm = imm};
            }
            stats_pieces += npieces;
        } else if (r->op == TPD_PLAN_SIGNAL || r->op == TPD_PLAN_FENCE) {
            if (tpd_grow((void **)&p->tmp, &p->tmp_cap, w + 1, sizeof(Wr))) goto nomem;
            Wr *x = &p->tmp[w++];
            *x = (Wr){.c = c, .ctrl = 1, .rec = c->g_seq, .length = EFA_CTRL_SIZE};
            if (r->op == TPD_PLAN_SIGNAL) {
                close_record(c, &x->record, r->signal_op == TPD_SIGNAL_SET ? EFA_OP_SET : EFA_OP_ADD, r->value,
                             r->dst_rank, r->slot, p->cumulative ? c->g_group : c->g_after);
                stats_signals++;
            } else {
                close_record(c, &x->record, EFA_OP_FENCE, 0, 0, 0, 0);
                c->g_after = c->g_group + 1;
                stats_fences++;
            }
            x->rkey = c->peer_staging_rkey;
            x->raddr = c->peer_staging_addr + EFA_CTRL_SIZE * (x->rec % c->peer_entries);
            x->imm = efa_encode_imm(EFA_KIND_CTRL, c->peer_index, x->rec);
        } else {
            c->g_group = saved[0], c->g_pieces = saved[1], c->g_after = saved[2], c->g_seq = saved[3];
            c->g_closed = saved_closed;
            return tpd_fail(&p->error, TPD_E_BAD_OP, 0, "plan row %zu: unknown op %u", i, r->op);
        }
        if (i == n - 1 || (r->token != rows[i + 1].token && r->token != 0)) {
            p->ends[ne] = w;
            p->end_tokens[ne++] = r->token;
        }
    }
    p->stats[S_PIECES] += stats_pieces;
    p->stats[S_SIGNALS] += stats_signals;
    p->stats[S_FENCES] += stats_fences;
    *nwr = w;
    *nends = ne;
    return 0;
nomem:
    c->g_group = saved[0], c->g_pieces = saved[1], c->g_after = saved[2], c->g_seq = saved[3];
    c->g_closed = saved_closed;
    return tpd_fail(&p->error, TPD_E_NOMEM, 0, "out of memory");
}

static int bl_reserve(EfaPoster *p, size_t extra);

/* Room for what commit() adds, so that it cannot fail half way. */
static int reserve(EfaPoster *p, Conn *c, size_t nwr, size_t nends) {
    /* lower() already advanced g_seq: this slice's records are the end of [oldest_ctrl, g_seq); entries
     * copied for them from the old ring are overwritten by commit() */
    size_t free_batches = 0;
    for (uint32_t b = p->free_batch; b && free_batches < nends; b = p->batches[b - 1].next_free) free_batches++;
    return ring_reserve(&c->pend, c->oldest, c->next_seq, c->next_seq + nwr) ||
           ring_reserve(&c->ctrlp, c->oldest_ctrl, c->g_seq, c->g_seq) ||
           tpd_grow((void **)&p->batches, &p->batches_cap, p->nbatches + nends - free_batches, sizeof(Batch)) ||
           bl_reserve(p, nwr);
}

/* Number the lowered WRs, attach them to their batches and queue them (room reserved). */
static void commit(EfaPoster *p, Conn *c, size_t nwr, size_t nends) {
    size_t start = 0;
    uint64_t seq = c->next_seq;
    for (size_t j = 0; j < nends; j++) {
        uint32_t b = batch_new(p, p->end_tokens[j], (uint32_t)(p->ends[j] - start));
        for (size_t k = start; k < p->ends[j]; k++, seq++) {
            Wr *x = &p->tmp[k];
            x->seq = seq;
            Pend *pe = ring_at(&c->pend, seq);
            *pe = (Pend){.batch = b, .ctrl = (uint32_t)x->ctrl, .rec = x->rec};
            if (x->ctrl) *(uint8_t *)ring_at(&c->ctrlp, x->rec) = 1;
            p->bl[(p->bl_head + p->bl_n++) % p->bl_cap] = *x;
        }
        start = p->ends[j];
    }
    c->next_seq = seq;
    c->npending += nwr;
    c->waiting += nwr;
    p->stats[S_WRS] += nwr;
}

/* The backlog is a ring; grow it keeping the order (realloc alone would split a wrapped ring). */
static int bl_reserve(EfaPoster *p, size_t extra) {
    if (p->bl_n + extra <= p->bl_cap) return 0;
    size_t ncap = p->bl_cap ? p->bl_cap : 256;
    while (ncap < p->bl_n + extra) ncap *= 2;
    Wr *v = malloc(ncap * sizeof(Wr));
    if (!v) return -1;
    for (size_t i = 0; i < p->bl_n; i++) v[i] = p->bl[(p->bl_head + i) % p->bl_cap];
    free(p->bl);
    p->bl = v;
    p->bl_cap = ncap;
    p->bl_head = 0;
    return 0;
}

/* Move WRs from the backlog onto the SQ: as many as fit, keeping each connection's windows. */
static int submit(EfaPoster *p) {
    if (!p->bl_n) return 0;
    uint64_t room = p->sq_depth > p->submitted ? p->sq_depth - p->submitted : 0;
    size_t k = 0;
    while (k < p->bl_n && k < room) {
        const Wr *x = &p->bl[(p->bl_head + k) % p->bl_cap];
        const Conn *c = x->c;
        if (x->seq - c->oldest >= MAX_SPAN) break;
        if (x->ctrl && x->rec - c->oldest_ctrl >= c->peer_entries / 2) break;
        k++;
    }
    if (k) {
        struct ibv_qp_ex *qp = p->qp;
        qp->wr_start(qp);
        for (size_t i = 0; i < k; i++) {
            const Wr *x = &p->bl[(p->bl_head + i) % p->bl_cap];
            Conn *c = x->c;
            uint64_t laddr = x->laddr;
            uint32_t lkey = x->lkey;
            if (x->ctrl) { /* the slot's previous record completed: the window above */
                uint8_t *slot = c->send_staging + EFA_CTRL_SIZE * (x->rec % c->peer_entries);
                memcpy(slot, &x->record, EFA_CTRL_SIZE);
                laddr = (uint64_t)(uintptr_t)slot;
                lkey = c->send_lkey;
            }
            qp->wr_id = ((uint64_t)c->key << SEQ_BITS) | (x->seq & SEQ_MASK);
            qp->wr_flags = IBV_SEND_SIGNALED;
            qp->wr_rdma_write_imm(qp, x->rkey, x->raddr, htonl(x->imm));
            qp->wr_set_sge(qp, lkey, laddr, x->length);
            qp->wr_set_ud_addr(qp, (struct ibv_ah *)(uintptr_t)c->ah, c->qpn, c->qkey);
        }
        int rc = qp->wr_complete(qp);
        if (rc) /* nothing was posted: they wait again, in order */
            return tpd_fail(&p->error, TPD_E_VERBS, rc, "posting on the SRD QP: ibv_wr_complete failed: %s", strerror(rc));
        for (size_t i = 0; i < k; i++) p->bl[(p->bl_head + i) % p->bl_cap].c->waiting--;
        p->bl_head = (p->bl_head + k) % p->bl_cap;
        p->bl_n -= k;
        p->submitted += k;
    }
    if (p->bl_n) p->stats[S_BACKLOGGED]++;
    return 0;
}

/* Post one slice on one connection; *nwr its WRs. */
static int post_slice(EfaPoster *p, int64_t id, const tpd_plan_row *rows, size_t n, int64_t *nwr) {
    *nwr = 0;
    Conn *c = find_conn(p, id);
    if (!c) return tpd_fail(&p->error, TPD_E_UNKNOWN, 0, "unknown connection %lld", (long long)id);
    if (!c->connected) return tpd_fail(&p->error, TPD_E_NOT_CONNECTED, 0, "connection %lld is not connected", (long long)id);
    if (!n) return 0;
    size_t w = 0, ne = 0;
    uint64_t saved[4] = {c->g_group, c->g_pieces, c->g_after, c->g_seq};
    int saved_closed = c->g_closed;
    if (lower(p, c, rows, n, &w, &ne)) return -1;
    if (reserve(p, c, w, ne)) { /* nothing queued: the slice never happened */
        c->g_group = saved[0], c->g_pieces = saved[1], c->g_after = saved[2], c->g_seq = saved[3];
        c->g_closed = saved_closed;
        return tpd_fail(&p->error, TPD_E_NOMEM, 0, "out of memory");
    }
    commit(p, c, w, ne);
    *nwr = (int64_t)w;
    return 0;
}

/* tpd_poster.post: every slice lowered into the backlog, then one submission. */
static int efa_post(void *ctx, size_t nb, const int64_t *ids, const tpd_plan_row *plan, const int64_t *bounds,
                    int64_t *nwr) {
    EfaPoster *p = ctx;
    for (size_t b = 0; b < nb; b++)
        if (post_slice(p, ids[b], plan + bounds[b], (size_t)(bounds[b + 1] - bounds[b]), &nwr[b])) return -1;
    return submit(p);
}

/* ---- completions and arrivals ----------------------------------------------------------------------------- */
static int work_push(EfaPoster *p, uint64_t token, uint32_t status, uint32_t vendor_err) {
    if (tpd_grow((void **)&p->work, &p->work_cap, p->nwork + 1, sizeof(tpd_completion))) return -1;
    p->work[p->nwork++] = (tpd_completion){token, status, vendor_err};
    return 0;
}

static int on_send(EfaPoster *p, uint64_t wr_id, uint32_t status, uint32_t vendor_err) {
    Conn *c = conn_by_key(p, wr_id >> SEQ_BITS);
    if (!c) return 0; /* closed since */
    uint64_t seq = c->oldest + ((wr_id - c->oldest) & SEQ_MASK);
    if (seq >= c->next_seq) return 0;
    Pend *pe = ring_at(&c->pend, seq);
    if (!pe->batch) return 0;
    uint32_t b = pe->batch;
    pe->batch = 0;
    c->npending--;
    if (pe->ctrl) {
        *(uint8_t *)ring_at(&c->ctrlp, pe->rec) = 0;
        while (c->oldest_ctrl < c->g_seq && !*(uint8_t *)ring_at(&c->ctrlp, c->oldest_ctrl)) c->oldest_ctrl++;
    }
    while (c->oldest < c->next_seq && !((Pend *)ring_at(&c->pend, c->oldest))->batch) c->oldest++;
    Batch *bt = &p->batches[b - 1];
    if (status && !bt->status) {
        bt->status = status;
        bt->vendor_err = vendor_err;
    }
    if (--bt->remaining == 0) {
        if (work_push(p, bt->token, bt->status, bt->vendor_err)) return -1;
        batch_free(p, b);
    }
    return 0;
}

static void protocol_error(EfaPoster *p, Conn *c, const char *why) {
    c->failed = 1;
    p->stats[S_PROTOCOL]++;
    if (p->nfail < sizeof p->fail_q / sizeof p->fail_q[0]) {
        p->fail_q[p->nfail].conn = c->id;
        snprintf(p->fail_q[p->nfail].why, sizeof p->fail_q[0].why, "%s", why);
        p->nfail++;
    }
}

static int on_arrival(EfaPoster *p, uint32_t imm, Conn **touched, size_t *ntouched) {
    unsigned kind = imm >> (EFA_CONN_BITS + EFA_INDEX_BITS);
    uint32_t index = (imm >> EFA_INDEX_BITS) & (EFA_MAX_CONNS - 1), idx = imm & EFA_INDEX_MASK;
    Conn *c = p->by_index[index];
    if (!c || c->failed) {
        p->stats[S_UNKNOWN]++;
        return 0;
    }
    char why[200];
    int rc;
    if (kind == EFA_KIND_DATA) {
        rc = efa_tr_piece(&c->tr, idx, why, sizeof why);
    } else if (kind == EFA_KIND_CTRL) {
        EfaCtrl rec; /* copied out now: the entry is the peer's to reuse once this is counted */
        memcpy(&rec, c->recv_staging + EFA_CTRL_SIZE * (idx & (c->recv_entries - 1)), sizeof rec);
        rc = efa_tr_record(&c->tr, idx, &rec, why, sizeof why);
    } else {
        snprintf(why, sizeof why, "immediate kind %u", kind);
        rc = -1;
    }
    if (rc == -2) return -1;
    if (rc == -1) {
        protocol_error(p, c, why);
        return 0;
    }
    if (!c->touched) {
        c->touched = 1;
        touched[(*ntouched)++] = c;
    }
    return 0;
}

static HostFlags *host_flags(EfaPoster *p, int64_t job, uint32_t rank) {
    EfaMapEnt *e = efa_map_find(&p->host, (job << 16) | rank);
    return e ? &p->hflags[e->val - 1] : NULL;
}

/* Ready flags of the touched connections: host words become stores (done after the flush), the rest
 * rows for on_pass. */
static int collect(EfaPoster *p, Conn **touched, size_t nt) {
    for (size_t i = 0; i < nt; i++) {
        Conn *c = touched[i];
        c->touched = 0;
        p->npubs = 0;
        if (efa_tr_ready(&c->tr, &p->pubs, &p->npubs, &p->pubs_cap)) return -1;
        p->stats[S_PUBLISHED] += p->npubs;
        for (size_t k = 0; k < p->npubs; k++) {
            const EfaPub *pb = &p->pubs[k];
            HostFlags *hf = host_flags(p, c->job, pb->rank);
            if (hf && pb->slot < hf->count) {
                if (tpd_grow((void **)&p->stores, &p->stores_cap, p->nstores + 1, sizeof(HostStore))) return -1;
                p->stores[p->nstores++] = (HostStore){
                    .word = (uint64_t *)(uintptr_t)hf->addr + pb->slot,
                    .shadow = hf->shadow ? (uint64_t *)(uintptr_t)hf->shadow + pb->slot : NULL,
                    .value = pb->value, .set = pb->op == EFA_OP_SET};
                continue;
            }
            if (tpd_grow((void **)&p->pypubs, &p->pypubs_cap, p->npypubs + 1, sizeof(PyPub))) return -1;
            p->pypubs[p->npypubs++] = (PyPub){.conn = c->id, .rank = pb->rank, .slot = pb->slot, .op = pb->op,
                                              .value = pb->value};
        }
    }
    return 0;
}

/* At most one Python call per poll: visibility flush, flags that need Python, error reports, receives. */
static int call_python(EfaPoster *p, int flush, uint64_t replenish) {
    PyGILState_STATE g = PyGILState_Ensure();
    int rc = 0;
    PyObject *pubs = PyBytes_FromStringAndSize((const char *)p->pypubs, (Py_ssize_t)(p->npypubs * sizeof(PyPub)));
    PyObject *fails = PyList_New(0);
    for (size_t i = 0; fails && i < p->nfail; i++) {
        PyObject *t = Py_BuildValue("(Ls)", (long long)p->fail_q[i].conn, p->fail_q[i].why);
        if (!t || PyList_Append(fails, t)) Py_CLEAR(fails);
        Py_XDECREF(t);
    }
    PyObject *res = pubs && fails ? PyObject_CallFunction(p->on_pass, "OOKO", pubs, fails,
                                                          (unsigned long long)replenish,
                                                          flush ? Py_True : Py_False)
                                  : NULL;
    Py_XDECREF(pubs);
    Py_XDECREF(fails);
    if (!res) {
        tpd_stash_exception();
        rc = -1;
    }
    Py_XDECREF(res);
    PyGILState_Release(g);
    p->npypubs = 0;
    p->nfail = 0;
    if (rc) return tpd_fail(&p->error, TPD_E_PY, 0, "on_pass failed");
    return 0;
}

/* Drain the write-combining buffers: a store through a BAR mapping leaves the CPU now, not later. */
static inline void wc_flush(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_sfence();
#else
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
#endif
}

/* noinline: inlined where `value` is a variable whose address was taken, gcc 12 -O2 read it again after
 * the atomic add (returning old + old); as a call, the argument is a copy (tests/efa/test_flag_publication.py) */
__attribute__((noinline)) static uint64_t tpd_shadow_update(uint64_t *shadow, uint64_t value, int set) {
    if (set) {
        __atomic_store_n(shadow, value, __ATOMIC_SEQ_CST);
        return value;
    }
    return __atomic_fetch_add(shadow, value, __ATOMIC_SEQ_CST) + value;
}

/* Store `v` (the shadow's value after this worker's update) into the mapped word, once per value: no read
 * of the word itself (a read across PCIe costs a microsecond). Other rails' workers may update the same
 * shadow meanwhile and store their own value; whoever stores last then re-reads the shadow and stores
 * again until what it stored is the shadow's value, so the word always ends at the newest value. Every
 * value in the shadow was added after its own payload was visible, so storing a newer one is safe. */
static void tpd_mapped_store(volatile uint64_t *word, const uint64_t *shadow, uint64_t v) {
    for (;;) {
        __atomic_store_n((uint64_t *)word, v, __ATOMIC_RELAXED); /* one aligned 8-byte store: one PCIe write */
        wc_flush();
        uint64_t now = __atomic_load_n(shadow, __ATOMIC_SEQ_CST);
        if (now == v) return;
        v = now;
    }
}

static void apply_stores(EfaPoster *p) {
    /* atomic: another rail's worker may publish into the same flag array */
    uint64_t mapped = 0;
    for (size_t i = 0; i < p->nstores; i++) {
        HostStore *s = &p->stores[i];
        if (s->shadow) {
            tpd_mapped_store(s->word, s->shadow, tpd_shadow_update(s->shadow, s->value, s->set));
            mapped++;
        } else if (s->set)
            __atomic_store_n(s->word, s->value, __ATOMIC_RELEASE);
        else
            __atomic_fetch_add(s->word, s->value, __ATOMIC_RELEASE);
    }
    p->stats[S_PUBLISHED_HOST] += p->nstores - mapped;
    p->stats[S_PUBLISHED_MAPPED] += mapped;
    p->nstores = 0;
}

/* Everything polled so far stays for the next poll when this one fails. */
static long poll_failed(EfaPoster *p) {
    p->ncarry = p->nwork;
    return -1;
}

/* tpd_poster.poll */
static long efa_poll(void *ctx, size_t max, tpd_completion *out) {
    EfaPoster *p = ctx;
    p->nwork = p->ncarry;
    p->ncarry = 0;
    size_t want = 2 * max < 4096 ? 2 * max : 4096;
    if (want < 64) want = 64;
    if (tpd_grow((void **)&p->touched, &p->touched_cap, want, sizeof(Conn *))) return tpd_fail(&p->error, TPD_E_NOMEM, 0, "out of memory");
    size_t nt = 0;
    struct ibv_cq_ex *cq = p->cq;
    struct ibv_poll_cq_attr attr = {0};
    int rc = cq->start_poll(cq, &attr);
    if (rc != 0 && rc != ENOENT) {
        tpd_fail(&p->error, TPD_E_POLL, rc, "polling the CQ: ibv_start_poll failed: %s", strerror(rc));
        return poll_failed(p);
    }
    if (rc == 0) {
        size_t got = 0, sent_done = 0;
        int err = 0;
        for (;;) {
            uint64_t wr_id = cq->wr_id;
            uint32_t status = (uint32_t)cq->status;
            int opcode = status ? -1 : cq->read_opcode(cq);
            got++;
            if (opcode == WC_RECV_RDMA_WITH_IMM) {
                if (!p->unsolicited) p->rq_missing++; /* the arrival consumed a receive WR */
                p->stats[S_ARRIVALS]++;
                p->stats[S_ARRIVAL_BYTES] += cq->read_byte_len(cq);
                if (on_arrival(p, ntohl(cq->read_imm_data(cq)), p->touched, &nt)) err = 1;
            } else if (wr_id & RECV_TAG) {
                p->rq_missing++; /* a receive WR flushed (the QP is going away) */
            } else {
                sent_done++;
                if (status) p->stats[S_ERRORS]++;
                if (on_send(p, wr_id, status, status ? cq->read_vendor_err(cq) : 0)) err = 1;
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
        p->submitted -= sent_done < p->submitted ? sent_done : p->submitted;
        p->stats[S_SEND_CQES] += sent_done;
        if (err == 1) {
            tpd_fail(&p->error, TPD_E_NOMEM, 0, "out of memory");
            return poll_failed(p);
        }
        if (err == 2) {
            tpd_fail(&p->error, TPD_E_POLL, rc, "polling the CQ: ibv_next_poll failed: %s", strerror(rc));
            return poll_failed(p);
        }
    }
    if (nt && collect(p, p->touched, nt)) {
        tpd_fail(&p->error, TPD_E_NOMEM, 0, "out of memory");
        return poll_failed(p);
    }
    int flush = 0;
    if ((p->nstores || p->npypubs) && p->visibility_flush) {
        p->stats[S_FLUSHES]++;
        flush = p->has_hook;
    }
    uint64_t replenish = 0;
    if (p->rq_depth && p->rq_missing >= (p->rq_depth / 8 > 1 ? p->rq_depth / 8 : 1)) replenish = p->rq_missing;
    int prc = 0;
    int wanted = 0;
    if (p->want_pass && !(flush || p->npypubs || p->nfail || replenish)) {
        int64_t now = now_ns();
        wanted = now >= p->want_next_ns;
        if (wanted) p->want_next_ns = now + WANT_PASS_NS;
    }
    if (flush || p->npypubs || p->nfail || replenish || wanted) {
        prc = call_python(p, flush, replenish);
        if (!prc) p->rq_missing -= replenish;
    }
    apply_stores(p); /* after the flush; on a failed call too: the flags are safe and already counted */
    if (prc) return poll_failed(p);
    if (submit(p)) return poll_failed(p);
    size_t n = p->nwork < max ? p->nwork : max;
    if (n) memcpy(out, p->work, n * sizeof(tpd_completion)); /* work is NULL until the first completion */
    if (p->nwork > n) memmove(p->work, p->work + n, (p->nwork - n) * sizeof(tpd_completion));
    p->ncarry = p->nwork - n;
    p->nwork = 0;
    return (long)n;
}

static void efa_raise(void *ctx) {
    EfaPoster *p = ctx;
    tpd_raise_error(&p->error, p->exc_backend, p->exc_verbs, NULL);
}

/* ---- the Python type ------------------------------------------------------------------------------------ */
static int EfaPoster_init(EfaPoster *p, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"qp", "cq", "max_rdma_size", "sq_depth", "rq_depth", "cumulative", "unsolicited",
                             "visibility_flush", "on_pass", "backend_error", "verbs_error", NULL};
    PyObject *qp, *cq, *on_pass, *eb, *ev;
    unsigned long long maxsz, sq, rq;
    int cumulative, unsolicited, vflush;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOKKKpppOOO", kwlist, &qp, &cq, &maxsz, &sq, &rq, &cumulative,
                                     &unsolicited, &vflush, &on_pass, &eb, &ev))
        return -1;
    if (!maxsz || !sq) {
        PyErr_SetString(PyExc_ValueError, "max_rdma_size and sq_depth must be positive");
        return -1;
    }
    if (maxsz > 0xFFFFFFFFull) maxsz = 0xFFFFFFFFull; /* an SGE length is 32 bits */
    struct ibv_qp_ex *qpx = tpd_handle_pointer(qp, "ibv_qp_ex");
    struct ibv_cq_ex *cqx = qpx ? tpd_handle_pointer(cq, "ibv_cq_ex") : NULL;
    if (!cqx) return -1;
    if (!PyCallable_Check(on_pass)) {
        PyErr_SetString(PyExc_TypeError, "on_pass must be callable");
        return -1;
    }
    p->qp = qpx;
    p->cq = cqx;
    Py_INCREF(qp);
    Py_XSETREF(p->qp_owner, qp);
    Py_INCREF(cq);
    Py_XSETREF(p->cq_owner, cq);
    Py_INCREF(on_pass);
    Py_XSETREF(p->on_pass, on_pass);
    Py_INCREF(eb);
    Py_XSETREF(p->exc_backend, eb);
    Py_INCREF(ev);
    Py_XSETREF(p->exc_verbs, ev);
    p->max_rdma_size = maxsz;
    p->sq_depth = sq;
    p->rq_depth = rq;
    p->cumulative = cumulative;
    p->unsolicited = unsolicited;
    p->visibility_flush = vflush;
    p->iface = (tpd_poster){.ctx = p, .post = efa_post, .poll = efa_poll, .raise_error = efa_raise};
    return 0;
}

static void conn_free(Conn *c) {
    efa_tr_free(&c->tr);
    free(c->pend.v);
    free(c->ctrlp.v);
    free(c);
}

static void EfaPoster_dealloc(EfaPoster *p) {
    for (size_t i = 0; i < p->nconns; i++) conn_free(p->conns[i]);
    free(p->conns);
    free(p->batches);
    free(p->bl);
    free(p->tmp);
    free(p->ends);
    free(p->end_tokens);
    free(p->work);
    free(p->pubs);
    free(p->pypubs);
    free(p->stores);
    free(p->touched);
    free(p->host.t);
    free(p->hflags);
    Py_XDECREF(p->qp_owner);
    Py_XDECREF(p->cq_owner);
    Py_XDECREF(p->on_pass);
    Py_XDECREF(p->exc_backend);
    Py_XDECREF(p->exc_verbs);
    Py_TYPE(p)->tp_free((PyObject *)p);
}

static Conn *conn_arg(EfaPoster *p, PyObject *arg) {
    long long id = PyLong_AsLongLong(arg);
    if (id == -1 && PyErr_Occurred()) return NULL;
    Conn *c = find_conn(p, id);
    if (!c) PyErr_Format(p->exc_backend, "unknown connection %lld", id);
    return c;
}

/* add_connection(conn_id, index, key, job, base, recv_staging_addr, recv_entries) */
static PyObject *EfaPoster_add_connection(EfaPoster *p, PyObject *args) {
    long long id, job;
    unsigned int index, key;
    unsigned long long base, raddr, rentries;
    if (!PyArg_ParseTuple(args, "LIILKKK", &id, &index, &key, &job, &base, &raddr, &rentries)) return NULL;
    if (find_conn(p, id)) return PyErr_Format(p->exc_backend, "connection %lld already exists", id);
    if (index >= EFA_MAX_CONNS || p->by_index[index] || !key || key >= (1u << (64 - SEQ_BITS - 1)) ||
        conn_by_key(p, key))
        return PyErr_Format(PyExc_ValueError, "connection index %u or key %u out of range or in use", index, key);
    if (!rentries || rentries & (rentries - 1))
        return PyErr_Format(PyExc_ValueError, "recv_entries must be a power of two");
    if (tpd_grow((void **)&p->conns, &p->conns_cap, p->nconns + 1, sizeof(Conn *))) return PyErr_NoMemory();
    Conn *c = calloc(1, sizeof(Conn));
    if (!c) return PyErr_NoMemory();
    c->id = id;
    c->index = index;
    c->key = key;
    c->job = job;
    c->next_seq = c->oldest = base;
    c->recv_staging = (const uint8_t *)(uintptr_t)raddr;
    c->recv_entries = rentries;
    c->pend.item = sizeof(Pend);
    c->ctrlp.item = 1;
    p->conns[p->nconns++] = c;
    p->by_index[index] = c;
    Py_RETURN_NONE;
}

/* connect(conn_id, peer_index, ah, qpn, qkey, peer_staging_addr, peer_staging_rkey, peer_entries,
 *         send_staging_addr, send_lkey) */
static PyObject *EfaPoster_connect(EfaPoster *p, PyObject *args) {
    long long id;
    unsigned int pindex, qpn, qkey, srkey, slkey;
    unsigned long long ah, saddr, sents, send;
    if (!PyArg_ParseTuple(args, "LIKIIKIKKI", &id, &pindex, &ah, &qpn, &qkey, &saddr, &srkey, &sents, &send,
                          &slkey))
        return NULL;
    Conn *c = find_conn(p, id);
    if (!c) return PyErr_Format(p->exc_backend, "unknown connection %lld", id);
    if (!sents || sents & (sents - 1))
        return PyErr_Format(p->exc_backend, "connection %lld: the peer's staging entries must be a power of two", id);
    c->peer_index = pindex;
    c->ah = ah;
    c->qpn = qpn;
    c->qkey = qkey;
    c->peer_staging_addr = saddr;
    c->peer_staging_rkey = srkey;
    c->peer_entries = sents;
    c->send_staging = (uint8_t *)(uintptr_t)send;
    c->send_lkey = slkey;
    c->connected = 1;
    Py_RETURN_NONE;
}

/* Forget a connection: its backlog is dropped, its outstanding tokens never reported, arrivals ignored. */
static PyObject *EfaPoster_remove_connection(EfaPoster *p, PyObject *arg) {
    long long id = PyLong_AsLongLong(arg);
    if (id == -1 && PyErr_Occurred()) return NULL;
    Conn *c = find_conn(p, id);
    if (!c) Py_RETURN_NONE;
    if (c->waiting) {
        size_t k = 0;
        for (size_t i = 0; i < p->bl_n; i++) {
            Wr *x = &p->bl[(p->bl_head + i) % p->bl_cap];
            if (x->c != c) p->bl[(p->bl_head + k++) % p->bl_cap] = *x;
        }
        p->bl_n = k;
    }
    for (uint64_t s = c->oldest; s < c->next_seq; s++) { /* its batches go back to the pool once */
        Pend *pe = ring_at(&c->pend, s);
        if (pe->batch && p->batches[pe->batch - 1].remaining) {
            p->batches[pe->batch - 1].remaining = 0;
            batch_free(p, pe->batch);
        }
    }
    for (size_t i = 0; i < p->nconns; i++)
        if (p->conns[i] == c) p->conns[i] = p->conns[--p->nconns];
    p->by_index[c->index] = NULL;
    conn_free(c);
    Py_RETURN_NONE;
}

static PyObject *EfaPoster_inflight(EfaPoster *p, PyObject *arg) {
    Conn *c = conn_arg(p, arg);
    return c ? PyLong_FromSize_t(c->npending) : NULL;
}

/* arrivals_idle(conn_id): every record arrived and every signal was published */
static PyObject *EfaPoster_arrivals_idle(EfaPoster *p, PyObject *arg) {
    Conn *c = conn_arg(p, arg);
    return c ? PyBool_FromLong(efa_tr_idle(&c->tr)) : NULL;
}

static PyObject *EfaPoster_post_batches(EfaPoster *p, PyObject *args) {
    return tpd_post_batches_method(&p->iface, args);
}

static PyObject *EfaPoster_post(EfaPoster *p, PyObject *args) {
    long long id;
    Py_buffer plan;
    if (!PyArg_ParseTuple(args, "Ly*", &id, &plan)) return NULL;
    PyObject *res = NULL;
    if (plan.len % sizeof(tpd_plan_row)) {
        PyErr_SetString(PyExc_ValueError, "plan must be PLAN_DTYPE rows");
    } else {
        int64_t ids[1] = {id}, bounds[2] = {0, (int64_t)(plan.len / sizeof(tpd_plan_row))}, nwr = 0;
        int rc;
        Py_BEGIN_ALLOW_THREADS
        rc = efa_post(p, 1, ids, plan.buf, bounds, &nwr);
        Py_END_ALLOW_THREADS
        if (rc)
            efa_raise(p);
        else
            res = PyLong_FromLongLong(nwr);
    }
    PyBuffer_Release(&plan);
    return res;
}

static PyObject *EfaPoster_poll(EfaPoster *p, PyObject *arg) { return tpd_poll_method(&p->iface, arg); }

/* set_host_flags(job, rank, addr, count[, shadow]): flags of (job, rank) are these u64 words; with a
 * shadow (host memory, `count` words, shared by the rails' workers) the words are GPU memory mapped here
 * (GDRCopy) and each update is the shadow's new value stored once */
static PyObject *EfaPoster_set_host_flags(EfaPoster *p, PyObject *args) {
    long long job;
    unsigned int rank;
    unsigned long long addr, count, shadow = 0;
    if (!PyArg_ParseTuple(args, "LIKK|K", &job, &rank, &addr, &count, &shadow)) return NULL;
    if (rank > 0xFFFF || !addr || addr % 8 || shadow % 8)
        return PyErr_Format(PyExc_ValueError, "rank < 65536, 8-byte aligned addr and shadow");
    EfaMapEnt *e = efa_map_slot(&p->host, (job << 16) | rank);
    if (!e) return PyErr_NoMemory();
    if (!e->val) {
        if (tpd_grow((void **)&p->hflags, &p->hflags_cap, p->nhflags + 1, sizeof(HostFlags))) {
            efa_map_del(&p->host, e);
            return PyErr_NoMemory();
        }
        e->val = ++p->nhflags;
    }
    p->hflags[e->val - 1] = (HostFlags){addr, count, shadow};
    Py_RETURN_NONE;
}

static PyObject *EfaPoster_clear_host_flags(EfaPoster *p, PyObject *args) {
    long long job;
    unsigned int rank;
    if (!PyArg_ParseTuple(args, "LI", &job, &rank)) return NULL;
    EfaMapEnt *e = efa_map_find(&p->host, (job << 16) | rank);
    if (e) p->hflags[e->val - 1] = (HostFlags){0, 0, 0}; /* the slot stays, empty: count 0 sends to Python */
    Py_RETURN_NONE;
}

static PyObject *EfaPoster_set_flush_hook(EfaPoster *p, PyObject *arg) {
    int v = PyObject_IsTrue(arg);
    if (v < 0) return NULL;
    p->has_hook = v;
    Py_RETURN_NONE;
}

static PyObject *EfaPoster_want_pass(EfaPoster *p, PyObject *arg) {
    int v = PyObject_IsTrue(arg);
    if (v < 0) return NULL;
    p->want_pass = v;
    Py_RETURN_NONE;
}

static PyObject *EfaPoster_stats(EfaPoster *p, PyObject *unused) {
    PyObject *d = PyDict_New();
    for (int i = 0; d && i < N_STATS; i++) {
        PyObject *v = PyLong_FromUnsignedLongLong(p->stats[i]);
        if (!v || PyDict_SetItemString(d, STAT_NAMES[i], v)) Py_CLEAR(d);
        Py_XDECREF(v);
    }
    return d;
}

static PyObject *EfaPoster_get_poster(EfaPoster *p, void *unused) {
    return PyCapsule_New(&p->iface, TPD_POSTER_CAPSULE, NULL);
}
static PyObject *EfaPoster_get_backlog(EfaPoster *p, void *unused) { return PyLong_FromSize_t(p->bl_n); }
static PyObject *EfaPoster_get_submitted(EfaPoster *p, void *unused) {
    return PyLong_FromUnsignedLongLong(p->submitted);
}

static PyMethodDef EfaPoster_methods[] = {
    {"add_connection", (PyCFunction)EfaPoster_add_connection, METH_VARARGS,
     "add_connection(conn_id, index, key, job, base, recv_staging_addr, recv_entries)"},
    {"connect", (PyCFunction)EfaPoster_connect, METH_VARARGS,
     "connect(conn_id, peer_index, ah, qpn, qkey, peer_staging_addr, peer_staging_rkey, peer_entries, "
     "send_staging_addr, send_lkey)"},
    {"remove_connection", (PyCFunction)EfaPoster_remove_connection, METH_O, "Forget a connection."},
    {"inflight", (PyCFunction)EfaPoster_inflight, METH_O, "WRs lowered on a connection and not yet completed."},
    {"arrivals_idle", (PyCFunction)EfaPoster_arrivals_idle, METH_O,
     "True when every record of the connection arrived and every signal was published."},
    {"post_batches", (PyCFunction)EfaPoster_post_batches, METH_VARARGS,
     "post_batches(conn_ids, plan, bounds) -> int64 WR counts per batch, as bytes."},
    {"post", (PyCFunction)EfaPoster_post, METH_VARARGS, "post(conn_id, plan) -> WRs lowered."},
    {"poll", (PyCFunction)EfaPoster_poll, METH_O, "poll(max) -> COMPLETION_DTYPE rows, as bytes."},
    {"set_host_flags", (PyCFunction)EfaPoster_set_host_flags, METH_VARARGS,
     "set_host_flags(job, rank, addr, count, shadow=0): publish (job, rank)'s flags by storing into these words "
     "(with a shadow: mapped GPU words, one store of the shadow's new value per update)."},
    {"clear_host_flags", (PyCFunction)EfaPoster_clear_host_flags, METH_VARARGS,
     "clear_host_flags(job, rank): (job, rank)'s flags go to on_pass again."},
    {"set_flush_hook", (PyCFunction)EfaPoster_set_flush_hook, METH_O,
     "Whether on_pass is called with flush=True before flags are published."},
    {"want_pass", (PyCFunction)EfaPoster_want_pass, METH_O,
     "Whether on_pass is called on every poll (at most every 20 us when it has nothing else to do), until "
     "called with False."},
    {"stats", (PyCFunction)EfaPoster_stats, METH_NOARGS, "Counters, by name."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef EfaPoster_getset[] = {
    {"poster", (getter)EfaPoster_get_poster, NULL, "The tpd_poster capsule the engine calls.", NULL},
    {"backlog", (getter)EfaPoster_get_backlog, NULL, "WRs lowered and waiting for the send queue.", NULL},
    {"submitted", (getter)EfaPoster_get_submitted, NULL, "WRs on the send queue, not yet completed.", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject EfaPosterType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "transportd._core.EfaPoster",
    .tp_basicsize = sizeof(EfaPoster),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "The efa lowering, completion tracking and arrival counting in C, on an SRD ibv_qp_ex and an "
              "ibv_cq_ex.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)EfaPoster_init,
    .tp_dealloc = (destructor)EfaPoster_dealloc,
    .tp_methods = EfaPoster_methods,
    .tp_getset = EfaPoster_getset,
};

int tpd_efa_shim_register(PyObject *m);

/* flag_shadow_publish(word, shadow, op, value) -> new value: the shadow update and mapped store the poster
 * makes, for flags published from Python (the loopback and CUDA-copy paths use the update alone: word 0) */
static PyObject *flag_shadow_publish(PyObject *unused, PyObject *args) {
    unsigned long long word, shadow, value;
    int op;
    if (!PyArg_ParseTuple(args, "KKiK", &word, &shadow, &op, &value)) return NULL;
    if (!shadow || shadow % 8 || word % 8) return PyErr_Format(PyExc_ValueError, "8-byte aligned, nonzero shadow");
    uint64_t *sh = (uint64_t *)(uintptr_t)shadow;
    uint64_t v = tpd_shadow_update(sh, value, op == EFA_OP_SET);
    if (word) tpd_mapped_store((volatile uint64_t *)(uintptr_t)word, sh, v);
    return PyLong_FromUnsignedLongLong(v);
}

/* mapped_store(word, shadow, value): store value into the mapped word, then keep storing the shadow's newer
 * value until they agree (tpd_mapped_store) */
static PyObject *flag_mapped_store(PyObject *unused, PyObject *args) {
    unsigned long long word, shadow, value;
    if (!PyArg_ParseTuple(args, "KKK", &word, &shadow, &value)) return NULL;
    if (!word || !shadow || word % 8 || shadow % 8) return PyErr_Format(PyExc_ValueError, "8-byte aligned words");
    tpd_mapped_store((volatile uint64_t *)(uintptr_t)word, (const uint64_t *)(uintptr_t)shadow, value);
    Py_RETURN_NONE;
}

static PyMethodDef flag_functions[] = {
    {"flag_shadow_publish", flag_shadow_publish, METH_VARARGS,
     "flag_shadow_publish(word, shadow, op, value) -> new: atomically ADD (op 0) or SET (op 1) the host shadow "
     "word; where word is nonzero, store the new value into it (a mapped GPU word) as the poster does."},
    {"flag_mapped_store", flag_mapped_store, METH_VARARGS,
     "flag_mapped_store(word, shadow, value): store value, then the shadow's newer value until they agree."},
    {NULL, NULL, 0, NULL},
};

int tpd_efa_register(void *mod) {
    PyObject *m = mod;
    if (PyType_Ready(&EfaPosterType) < 0) return -1;
    Py_INCREF(&EfaPosterType);
    if (PyModule_AddObject(m, "EfaPoster", (PyObject *)&EfaPosterType) < 0) {
        Py_DECREF(&EfaPosterType);
        return -1;
    }
    if (PyModule_AddIntConstant(m, "EFA_PUB_SIZE", sizeof(PyPub)) < 0) return -1;
    if (PyModule_AddFunctions(m, flag_functions) < 0) return -1;
    return tpd_efa_shim_register(m);
}
