/*
 * The engine, the proxy's data path in C (docs/design.md, "No Python per record"): this file is its loop,
 * the engine proper. engine.h holds its state; engine_type.c is the Python type around it
 * (transportd._core.Engine: the constructor, the table, channel and connection calls, the stats); module.c
 * puts the module together.
 *
 * One Engine per rail worker runs the whole iteration of transportd.dataplane.proxy.Proxy with the GIL released:
 *
 *   take      from every channel's ring, the records that are committed (header-last, lap-stamped seq),
 *             as many as the connections its job feeds can still accept (inflight cap: backpressure
 *             reaches the producer, nothing is dropped); validate and translate each (validate.h),
 *             write a bad record's code into the channel's error word, keep the good ones;
 *   post      cut each connection's waiting rows into batches (<= batch_max commands; NO_BATCH, FENCE
 *             and QUIET cut; the polling window), reduce signals (decoupled signaling), hand the batches
 *             to the backend in one call, one token per batch;
 *   progress  take the backend's completions in one call, retire tokens, publish each channel's
 *             completion position, REMOTE_ACCESS / TRANSPORT into error words.
 *
 * Every refused or failed record is also counted by code per channel (the error word keeps only the
 * first code). A traced channel (trace.h) appends each record it takes, and each later failure, to its
 * recorder; one branch per channel per pass when it is not traced.
 *
 * The control plane stays in Python (transportd/dataplane/proxy.py): it owns the region and peer tables (numpy
 * arrays in transportd/dataplane/tables.py's layout) and hands the engine views of them between iterations;
 * the engine holds a buffer reference to every array it reads, so a table replaced in Python stays alive
 * until the engine is given its successor. The backend is reached through its C poster (poster.h: ib and efa post
 * and poll from C, GIL released, no Python per pass), else through two callables (post, poll); with
 * neither the engine is its own null NIC, completing every batch on the next poll, for benchmarks.
 *
 * Why C and not Cython: the core builds with only a C compiler on a fresh machine (no Cython at build
 * time), and the same validation header compiles into the fuzzer and the sanitizer build unchanged.
 *
 * Exactness: transportd_models/engine.py is the same loop in numpy.
 * tests/transportd/dataplane/test_core_differential.py feeds both the same random records, tables and knobs
 * and requires the same codes, the same rows in the same order per connection and the same completion
 * positions; so the comments here do not repeat the rules, they point at where each one is decided.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdlib.h>
#include <string.h>
#include <poll.h>
#include <time.h>

#include "engine.h"

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000ll + ts.tv_nsec;
}

/* MemoryError from a part that runs without the GIL; -1 for `return nomem(e)`. */
static int nomem(Engine *e) {
    int held = e->ts == NULL;
    gil_take(e);
    PyErr_NoMemory();
    if (!held) gil_drop(e);
    return -1;
}

static void report_error(Engine *e, DrainedRing *ch, uint16_t code, uint64_t pos) {
    e->counters[C_REJECTED]++;
    e->errors[code & 0xFF]++;
    ch->codes[code & 0xFF]++;
    /* the lowest bad position and its code: completions out of post order (SRD, a failed connection's
     * flush) can report a later record first, and the client re-sends from this position */
    if (*ring_u32(ch, TPD_RING_OFF_ERROR_CODE) == 0 || pos < *ring_u64(ch, TPD_RING_OFF_ERROR_POS)) {
        *ring_u64(ch, TPD_RING_OFF_ERROR_POS) = pos;
        *ring_u32(ch, TPD_RING_OFF_ERROR_CODE) = code;
    }
    *ring_u32(ch, TPD_RING_OFF_ERROR_COUNT) += 1;
}

/* A record taken earlier failed later (completion, lost peer, client gone): counted as above, and traced. */
static void report_late(Engine *e, DrainedRing *ch, uint16_t code, uint64_t pos) {
    report_error(e, ch, code, pos);
    if (__builtin_expect(ch->trace != NULL, 0)) tpd_trace_failed(ch->trace, pos, code, now_ns());
}

static void mark_done(DrainedRing *ch, uint64_t pos) {
    ch->done[pos & (ch->track - 1)] = 1;
    ch->touched = 1;
}

/* Whatever held a channel's head record may have changed: wait_ready counts every head again. (Every pass
 * translates the head anew, so a table changed in place is seen at the next pass anyway.) */
void tpd_unblock_channels(Engine *e) {
    for (size_t i = 0; i < e->nchans; i++) e->chans[i]->blocked = 0;
}

/* Publish each touched channel's completion position: the first position not yet complete. */
void tpd_advance_touched(Engine *e) {
    for (size_t i = 0; i < e->nchans; i++) {
        DrainedRing *ch = e->chans[i];
        if (!ch->touched) continue;
        ch->touched = 0;
        uint64_t p = ch->completed;
        const uint64_t mask = ch->track - 1, end = ch->position;
        uint8_t *const done = ch->done; /* in a local: the byte stores below would otherwise reload it */
        /* eight marks at a time where eight aligned ones lie before `end` (a track of at least 8, a power of
         * two, holds whole aligned words), else one by one */
        const int wide = mask >= 7;
        for (;;) {
            if (wide && !(p & 7) && end - p >= 8) {
                uint64_t word;
                memcpy(&word, done + (p & mask), 8);
                if (word == 0x0101010101010101ull) {
                    memset(done + (p & mask), 0, 8);
                    p += 8;
                    continue;
                }
            }
            if (p < end && done[p & mask]) {
                done[p++ & mask] = 0;
                continue;
            }
            break;
        }
        if (p != ch->completed) {
            ch->completed = p;
            publish_completion(ch, p);
        }
    }
}

void tpd_note_waiting(DrainedRing *ch, int64_t now) {
    if (!ch->seen || ch->seen_pos != ch->position) {
        ch->seen = 1;
        ch->seen_pos = ch->position;
        ch->seen_ns = now;
    }
}

/* ---- take ----------------------------------------------------------------------------------------- */
static int ensure_take_scratch(Engine *e, size_t n) {
    if (tpd_grow((void **)&e->recs, &e->recs_cap, n, sizeof(tpd_cmd_record))) return -1;
    if (tpd_grow((void **)&e->tcode, &e->t_cap, n, sizeof(uint16_t))) return -1;
    return 0;
}

/* Room for `k` more waiting rows at the back of the connection's FIFO (the consumed front is reused before
 * it grows); NULL when out of memory. */
static Waiting *conn_reserve(Conn *c, size_t k) {
    if (c->head && c->count + k > c->cap) {
        memmove(c->rows, c->rows + c->head, (c->count - c->head) * sizeof(Waiting));
        c->count -= c->head;
        c->head = 0;
    }
    if (tpd_grow((void **)&c->rows, &c->cap, c->count + k, sizeof(Waiting))) return NULL;
    return c->rows + c->count;
}

/* Take one channel's ready records; returns 1 if any were taken, 0 if none, -1 on allocation failure.
 *
 * One walk over the ring per pass: each record whose seq says it is committed is copied out (validation
 * reads the copy, never the shared slot, which its producer could still scribble on), validated and
 * translated, and its rows go straight to the back of their connection's FIFO. The walk stops at the first
 * record that is not committed, at the budget (the ring's tracking window, and the room the job's
 * connections have under the inflight cap), or at the first record whose rows would overrun its
 * connection's cap: that record and the rest stay in the ring, never released. */
static int take_channel(Engine *e, DrainedRing *ch, int64_t now, int *stalled) {
    uint64_t pos = ch->position;
    uint32_t want = seq_for(pos);
    const tpd_cmd_record *slots = ch->records;
    const uint64_t mask = ch->mask;
    if (__atomic_load_n(&slots[pos & mask].seq, __ATOMIC_ACQUIRE) != want) return 0; /* the idle loop's main cost */
    Job *job = &e->jobs[ch->job];
    const tpd_sources *src = &e->srcs[ch->src].view;
    int64_t budget = (int64_t)e->max_take;
    int64_t left = (int64_t)(ch->track - (pos - ch->completed));
    if (left < budget) budget = left;
    int64_t safe = budget; /* records that fit even if they all went to the busiest connection */
    if (job->nconns && !ch->gone) {
        int64_t room_sum = 0, room_min = INT64_MAX;
        for (size_t i = 0; i < job->nconns; i++) {
            Conn *c = &e->conns[job->conns[i]];
            int64_t room = e->inflight_cap - (c->inflight + (int64_t)conn_pending(c));
            if (room > 0) room_sum += room;
            if (room < room_min) room_min = room;
        }
        if (room_sum < budget) budget = room_sum;
        safe = room_min >= 0 ? room_min / 2 : -((-room_min + 1) / 2); /* floor division, as Python's // */
    }
    if (budget <= 0) {
        *stalled = 1;
        tpd_note_waiting(ch, now);
        return 0;
    }
    uint64_t limit = (uint64_t)budget < ch->capacity ? (uint64_t)budget : ch->capacity;
    tpd_trace *const trace = ch->trace; /* its records and codes are kept (e->recs, e->tcode) for the recorder */
    if (trace && ensure_take_scratch(e, limit)) return -1;
    const int64_t cap = e->inflight_cap;
    const int64_t chan = ch->id;
    const int gone = ch->gone;
    const uint64_t max_length = e->max_length;
    /* the tables in locals: the stores into the FIFOs below cannot alias them, so they stay in registers */
    const tpd_sources sv = *src;
    const tpd_peers pv = job->view;
    tpd_cmd_record *recs = e->recs;
    uint16_t *codes = e->tcode;
    Conn *const conns = e->conns;
    uint64_t n = 0, commands = 0;
    size_t added = 0; /* rows appended to the FIFOs: e->nwaiting once, after the walk */
    int overrun = 0, held = 0;
    for (; n < limit; n++) {
        const tpd_cmd_record *slot = &slots[(pos + n) & mask];
        if (__atomic_load_n(&slot->seq, __ATOMIC_ACQUIRE) != want) break;
        /* the record copied once out of the shared slot (its producer could still scribble on it) into a
         * local, which the compiler keeps in registers: validation and translation read that, and the
         * trace's copy (e->recs) is made only for a traced channel */
        const tpd_cmd_record one = *slot;
        if (trace) recs[n] = one;
        const tpd_cmd_record *rec = &one;
        tpd_resolved res;
        int k = 0;
        int64_t conn = -1;
        uint16_t code = gone ? TPD_ERR_CLIENT_GONE : tpd_check(rec, &sv, &pv, max_length, &k, &conn, &res);
        if (k) {
            Conn *c = &conns[conn];
            if (c->holding) { /* its peer's daemon is restarting: this record and the rest wait in the ring */
                held = 1;
                break;
            }
            if (c->inflight + (int64_t)conn_pending(c) + k > cap) { /* the rest stays in the ring */
                overrun = 1;
                break;
            }
            Waiting *w = conn_reserve(c, (size_t)k);
            if (!w) {
                e->nwaiting += added;
                return -1;
            }
            uint8_t closes = (rec->flags & TPD_FLAG_NO_BATCH) || rec->opcode == TPD_OP_FENCE;
            tpd_emit(rec, &sv, &pv, &res, &w->row, sizeof(Waiting)); /* the rows straight into the FIFO */
            for (int j = 0; j < k; j++) {
                w[j].pos = pos + n;
                w[j].t = now;
                w[j].chan = chan;
                w[j].first = j == 0;
                w[j].closes = closes;
            }
            c->count += (size_t)k;
            added += (size_t)k;
        }
        if (trace) codes[n] = code;
        want = want == 0xFFFFFFFFu ? 1 : want + 1; /* seq_for(pos + n + 1) */
        if (code) {
            report_error(e, ch, code, pos + n);
            mark_done(ch, pos + n);
            continue;
        }
        commands++;
        if (!k) { /* a QUIET: complete now, and it cuts batches */
            e->counters[C_QUIETS]++;
            ch->quiet = 1;
            mark_done(ch, pos + n);
        }
    }
    e->nwaiting += added;
    e->counters[C_COMMANDS] += commands;
    ch->position = pos + n;
    if (overrun) {
        *stalled = 1;
        tpd_note_waiting(ch, now);
    } else if (held) { /* until the peer is re-wired: not a stall, and wait_ready does not count this head */
        ch->blocked = 1;
        ch->blocked_pos = ch->position;
        tpd_note_waiting(ch, now);
    } else if ((int64_t)n <= safe && (int64_t)n == budget && (uint64_t)budget < e->max_take &&
               record_ready(ch, ch->position)) {
        *stalled = 1;
        tpd_note_waiting(ch, now);
    }
    if (n && __builtin_expect(trace != NULL, 0)) tpd_trace_taken(trace, recs, codes, n, pos, now);
    __atomic_store_n(ring_u64(ch, TPD_RING_OFF_CONSUMER_POS), ch->position, __ATOMIC_RELEASE);
    return n != 0;
}

static int take(Engine *e, int64_t now) {
    int took = 0, stalled = 0;
    if (!e->taking) return 0;
    for (size_t i = 0; i < e->nchans; i++) {
        int rc = take_channel(e, e->chans[i], now, &stalled);
        if (rc < 0) return -1;
        took |= rc;
    }
    if (stalled) e->counters[C_STALLS]++;
    return took;
}

/* ---- batches -------------------------------------------------------------------------------------- */
/* Rows [from, to) of a segment: its WRITEs in order, then one SIGNAL per flag word (dst_rank, raddr, rkey),
 * in the order of each word's first signal: ADDs summed, a SET resetting the sum; the last signal of the word
 * is the template. Appended to out at m; returns the new count. */
static size_t reduce_part(const tpd_plan_row *rows, size_t from, size_t to, tpd_plan_row *out, size_t m) {
    tpd_plan_row sig[64];
    uint64_t value[64];
    uint8_t has_set[64];
    size_t s = 0;
    for (size_t i = from; i < to; i++) {
        if (rows[i].op != TPD_PLAN_SIGNAL) {
            out[m++] = rows[i];
            continue;
        }
        size_t k = 0;
        while (k < s && !(sig[k].dst_rank == rows[i].dst_rank && sig[k].raddr == rows[i].raddr &&
                          sig[k].rkey == rows[i].rkey))
            k++;
        if (k == s) {
            value[s] = 0;
            has_set[s] = 0;
            s++;
        }
        sig[k] = rows[i];
        if (rows[i].signal_op == TPD_SIGNAL_SET) {
            value[k] = rows[i].value;
            has_set[k] = 1;
        } else {
            value[k] += rows[i].value;
        }
    }
    for (size_t k = 0; k < s; k++) {
        sig[k].value = value[k];
        sig[k].signal_op = has_set[k] ? TPD_SIGNAL_SET : TPD_SIGNAL_ADD;
        out[m++] = sig[k];
    }
    return m;
}

/* Perseus decoupled signaling on one batch's rows, in place; returns the new row count. Within each
 * FENCE-delimited segment the WRITEs go first, then the reduced SIGNALs (reduce_part), except at its two
 * ends: the signals before its first WRITE and the writes after its last SIGNAL stay where they are (the
 * signals reduced among themselves). On efa a signal covers the writes since the connection's previous
 * signal, so a leading signal moved behind this batch's writes, or a trailing write moved ahead of its
 * signals, would change what a signal covers (transportd_models/batching.py says how). */
static size_t decouple(tpd_plan_row *rows, size_t n) {
    tpd_plan_row out[64];
    size_t m = 0, a = 0;
    while (a < n) {
        if (rows[a].op == TPD_PLAN_FENCE) {
            out[m++] = rows[a++];
            continue;
        }
        size_t b = a;
        while (b < n && rows[b].op != TPD_PLAN_FENCE) b++;
        size_t first_write = b, body_end = a; /* leading signals [a, first_write), trailing writes [body_end, b) */
        for (size_t i = a; i < b; i++) {
            if (rows[i].op == TPD_PLAN_WRITE && first_write == b) first_write = i;
            if (rows[i].op == TPD_PLAN_SIGNAL) body_end = i + 1;
        }
        if (body_end < first_write) body_end = first_write;
        m = reduce_part(rows, a, first_write, out, m);        /* signals only */
        m = reduce_part(rows, first_write, body_end, out, m); /* writes, then the reduced signals */
        m = reduce_part(rows, body_end, b, out, m);           /* writes only */
        a = b;
    }
    memcpy(rows, out, m * sizeof(tpd_plan_row));
    return m;
}

static int ensure_post_scratch(Engine *e, size_t rows, size_t batches) {
    if (tpd_grow((void **)&e->plan, &e->plan_cap, rows, sizeof(tpd_plan_row))) return -1;
    size_t cap = e->b_cap;
    if (tpd_grow((void **)&e->b_conn, &cap, batches + 1, sizeof(int64_t))) return -1;
    cap = e->b_cap;
    if (tpd_grow((void **)&e->b_ncmds, &cap, batches + 1, sizeof(int64_t))) return -1;
    cap = e->b_cap;
    if (tpd_grow((void **)&e->b_bounds, &cap, batches + 1, sizeof(int64_t))) return -1;
    cap = e->b_cap;
    if (tpd_grow((void **)&e->b_nwr, &cap, batches + 1, sizeof(int64_t))) return -1;
    e->b_cap = cap;
    return 0;
}

static int channel_quiet(Engine *e, int64_t id) {
    DrainedRing *ch = find_channel(e, id);
    return ch && ch->quiet;
}

/* One batch of a connection's waiting rows from `start`: up to batch_max commands, cut after a command
 * that closes its batch. Returns the row after it; *cmds its commands; *ready whether it may go now (a
 * full or closed batch, one that is not the connection's last, the polling window passed, or a QUIET
 * taken in this pass from a channel with a row in it). */
static size_t cut_batch(Engine *e, const Waiting *w, size_t have, size_t start, int64_t now, size_t *cmds,
                        int *ready) {
    size_t r = start;
    int closed = 0;
    *cmds = 0;
    while (r < have && *cmds < (size_t)e->batch_max && !closed) {
        (*cmds)++;
        closed = w[r].closes;
        r++;
        while (r < have && !w[r].first) r++;
    }
    *ready = r < have || closed || *cmds == (size_t)e->batch_max || e->window_ns <= 0 ||
             now - w[start].t >= e->window_ns;
    for (size_t k = start; !*ready && k < r; k++)
        if (channel_quiet(e, w[k].chan)) *ready = 1;
    return r;
}

/* A group of `bytes` (its arrays after it): a kept one that is large enough, else a new one; NULL when out of
 * memory. */
static Group *group_alloc(Engine *e, size_t bytes) {
    for (size_t i = e->nspare; i-- > 0;) {
        Group *g = e->spare[i];
        if (g->bytes < bytes) continue;
        e->spare[i] = e->spare[--e->nspare];
        return g;
    }
    Group *g = malloc(bytes);
    if (g) g->bytes = bytes;
    return g;
}

/* A group done with: kept for group_alloc while there is room, else freed (the smallest kept one makes way). */
static void group_release(Engine *e, Group *g) {
    const size_t room = sizeof e->spare / sizeof e->spare[0];
    if (e->nspare < room) {
        e->spare[e->nspare++] = g;
        return;
    }
    size_t smallest = 0;
    for (size_t i = 1; i < room; i++)
        if (e->spare[i]->bytes < e->spare[smallest]->bytes) smallest = i;
    if (e->spare[smallest]->bytes < g->bytes) {
        free(e->spare[smallest]);
        e->spare[smallest] = g;
    } else {
        free(g);
    }
}

/* Cut each connection's waiting rows into batches and move the ones to post now into e->plan (grouped by
 * connection, each connection a prefix of its batches that fits under the inflight cap; the first batch
 * of an idle connection always fits). Fills e->b_* and a new group's command arrays; returns the number
 * of batches, -1 when out of memory. */
static long plan_post(Engine *e, int64_t now, Group **out_group) {
    *out_group = NULL;
    size_t nb = 0, nrows = 0, ncmd = 0;
    int signal_stall = 0;
    /* cut: the batches that go now, each connection a prefix of its waiting rows */
    for (size_t ci = 0; ci < e->nconns; ci++) {
        Conn *c = &e->conns[ci];
        size_t have = conn_pending(c);
        const Waiting *w = c->rows + c->head;
        size_t r = 0, cum = 0;
        int stopped = 0;
        while (r < have) {
            size_t cmds;
            int ready;
            size_t end = cut_batch(e, w, have, r, now, &cmds, &ready);
            cum += end - r;
            int fits = c->inflight + (int64_t)cum <= e->inflight_cap || (r == 0 && c->inflight == 0);
            if (stopped || !(ready && fits)) {
                /* the rest waits for completions; a signal among what was ready is a signal stall */
                stopped = 1;
                for (size_t q = r; ready && q < end; q++)
                    if (w[q].row.op == TPD_PLAN_SIGNAL) signal_stall = 1;
                r = end;
                continue;
            }
            if (tpd_grow((void **)&e->cuts, &e->cuts_cap, nb + 1, sizeof(Cut))) return -1;
            e->cuts[nb++] = (Cut){.conn = ci, .start = r, .end = end, .cmds = cmds};
            nrows += end - r;
            ncmd += cmds;
            r = end;
        }
    }
    if (signal_stall) e->counters[C_SIGNAL_STALLS]++;
    if (!nb) return 0;
    /* move them into e->plan, tokens set (one per batch), and their commands into a new group */
    if (ensure_post_scratch(e, nrows, nb)) return -1;
    size_t words = 3 * nb + 1 + 3 * ncmd;
    Group *g = group_alloc(e, sizeof(Group) + words * sizeof(int64_t) + nb); /* every array is filled but done */
    if (!g) return -1;
    int64_t *p = (int64_t *)(g + 1);
    g->tok_conn = p;
    g->tok_nwr = p + nb;
    g->tok_cmds = p + 2 * nb;
    g->cmd_tok = p + 3 * nb + 1;
    g->cmd_chan = p + 3 * nb + 1 + ncmd;
    g->cmd_pos = (uint64_t *)(p + 3 * nb + 1 + 2 * ncmd);
    g->done = (uint8_t *)(p + words);
    memset(g->done, 0, nb);
    g->first = e->next_token;
    g->nb = g->remaining = nb;
    g->ncmd = ncmd;
    size_t m = 0, k = 0;
    /* the arrays in locals: the row copies (a struct with byte fields) would otherwise reload them each row */
    tpd_plan_row *const plan = e->plan;
    int64_t *const cmd_tok = g->cmd_tok, *const cmd_chan = g->cmd_chan;
    uint64_t *const cmd_pos = g->cmd_pos;
    for (size_t b = 0; b < nb; b++) {
        const Cut *cut = &e->cuts[b];
        Conn *c = &e->conns[cut->conn];
        const Waiting *w = c->rows + c->head;
        const uint64_t token = e->next_token + b;
        e->b_conn[b] = (int64_t)cut->conn;
        e->b_ncmds[b] = (int64_t)cut->cmds;
        e->b_bounds[b] = (int64_t)m;
        g->tok_cmds[b] = (int64_t)k;
        for (size_t q = cut->start, end = cut->end; q < end; q++) {
            if (w[q].first) {
                cmd_tok[k] = (int64_t)b;
                cmd_chan[k] = w[q].chan;
                cmd_pos[k] = w[q].pos;
                k++;
            }
            plan[m] = w[q].row;
            plan[m++].token = token;
        }
        if (b + 1 == nb || e->cuts[b + 1].conn != cut->conn) { /* the connection's last batch now */
            c->head += cut->end;
            e->nwaiting -= cut->end;
            if (c->head == c->count) c->head = c->count = 0;
        }
    }
    e->b_bounds[nb] = (int64_t)m;
    g->tok_cmds[nb] = (int64_t)k;
    *out_group = g;
    return (long)nb;
}

static int group_append(Engine *e, Group *g) {
    if (tpd_grow((void **)&e->groups, &e->groups_cap, e->ngroups + 1, sizeof(Group *))) return -1;
    e->groups[e->ngroups++] = g;
    return 0;
}

/* The backend's Python post(conn_ids, plan, bounds) -> WR counts per batch; GIL held. */
static int post_python(Engine *e, size_t nb, size_t m) {
    PyObject *ids = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(nb * sizeof(int64_t)));
    PyObject *plan = PyByteArray_FromStringAndSize((const char *)e->plan, (Py_ssize_t)(m * sizeof(tpd_plan_row)));
    PyObject *bounds = PyBytes_FromStringAndSize((const char *)e->b_bounds, (Py_ssize_t)((nb + 1) * sizeof(int64_t)));
    if (!ids || !plan || !bounds) {
        Py_XDECREF(ids);
        Py_XDECREF(plan);
        Py_XDECREF(bounds);
        return -1;
    }
    int64_t *idp = (int64_t *)PyBytes_AS_STRING(ids);
    for (size_t b = 0; b < nb; b++) idp[b] = e->conns[e->b_conn[b]].id;
    PyObject *res = PyObject_CallFunctionObjArgs(e->post_cb, ids, plan, bounds, NULL);
    Py_DECREF(ids);
    Py_DECREF(plan);
    Py_DECREF(bounds);
    if (!res) return -1;
    Py_buffer view;
    if (PyObject_GetBuffer(res, &view, PyBUF_SIMPLE) < 0) {
        Py_DECREF(res);
        return -1;
    }
    int rc = 0;
    if ((size_t)view.len != nb * sizeof(int64_t)) {
        PyErr_Format(PyExc_ValueError, "post returned %zd bytes of WR counts for %zu batches", view.len, nb);
        rc = -1;
    } else {
        memcpy(e->b_nwr, view.buf, nb * sizeof(int64_t));
    }
    PyBuffer_Release(&view);
    Py_DECREF(res);
    return rc;
}

/* Hand the planned batches to the backend (GIL released): its C poster, the null NIC, or one Python call. */
static int post_to_backend(Engine *e, size_t nb, size_t m) {
    if (e->poster) {
        if (tpd_grow((void **)&e->post_ids, &e->post_ids_cap, nb, sizeof(int64_t))) return nomem(e);
        for (size_t b = 0; b < nb; b++) e->post_ids[b] = e->conns[e->b_conn[b]].id;
        tpd_poster *p = e->poster;
        if (!p->post(p->ctx, nb, e->post_ids, e->plan, e->b_bounds, e->b_nwr)) return 0;
        gil_take(e);
        p->raise_error(p->ctx);
        gil_drop(e);
        return -1;
    }
    if (e->post_cb == Py_None) {
        int64_t t = e->post_log_cap ? now_ns() : 0;
        if (tpd_grow((void **)&e->null_due, &e->null_cap, e->null_ndue + nb, sizeof(Completion))) return nomem(e);
        for (size_t b = 0; b < nb; b++) {
            e->b_nwr[b] = e->b_bounds[b + 1] - e->b_bounds[b];
            e->null_due[e->null_ndue++] = (Completion){.token = e->plan[e->b_bounds[b]].token};
        }
        for (size_t r = 0; r < m && e->post_log_n + 2 <= e->post_log_cap; r++) {
            if (e->plan[r].op != TPD_PLAN_WRITE) continue;
            e->post_log[e->post_log_n++] = (uint64_t)t;
            e->post_log[e->post_log_n++] = e->plan[r].chunk_id;
        }
        return 0;
    }
    gil_take(e);
    int rc = post_python(e, nb, m);
    gil_drop(e);
    return rc;
}

/* Post the ready batches (GIL released); returns 1 if any went out, 0 if none, -1 with a Python error set. */
static int post(Engine *e, int64_t now) {
    Group *g = NULL;
    long nbl = plan_post(e, now, &g);
    if (nbl < 0) return nomem(e);
    if (nbl == 0) return 0;
    size_t nb = (size_t)nbl;
    uint64_t *c = e->counters;
    /* decoupled signaling batch by batch (rows only shrink, so in place; each keeps its batch's token) */
    size_t m = 0;
    for (size_t b = 0; b < nb; b++) {
        size_t s = (size_t)e->b_bounds[b], t = (size_t)e->b_bounds[b + 1];
        e->b_bounds[b] = (int64_t)m;
        if (e->decoupled) {
            for (size_t r = s; r < t; r++) c[C_SIGNALS_REQUESTED] += e->plan[r].op == TPD_PLAN_SIGNAL;
            if (m != s) memmove(e->plan + m, e->plan + s, (t - s) * sizeof(tpd_plan_row));
            m += decouple(e->plan + m, t - s);
        } else {
            if (m != s) memmove(e->plan + m, e->plan + s, (t - s) * sizeof(tpd_plan_row));
            m += t - s;
        }
    }
    e->b_bounds[nb] = (int64_t)m;
    e->next_token += nb; /* plan_post set the rows' tokens from it: g->first */
    if (post_to_backend(e, nb, m) < 0) {
        group_release(e, g);
        return -1;
    }
    /* the counters in locals over all batches (each row adds to a few of them), into e->counters after */
    uint64_t wrs = 0, signals = 0, writes = 0, fences = 0, bytes = 0, dest_batches = 0;
    const tpd_plan_row *const plan = e->plan;
    for (size_t b = 0; b < nb; b++) {
        Conn *cn = &e->conns[e->b_conn[b]];
        g->tok_conn[b] = e->b_conn[b];
        g->tok_nwr[b] = e->b_nwr[b];
        cn->inflight += e->b_nwr[b];
        wrs += (uint64_t)e->b_nwr[b];
        int64_t ncmds = e->b_ncmds[b];
        c[ncmds == e->batch_max ? C_BATCHES_FULL : C_BATCHES_PARTIAL]++;
        e->batch_hist[ncmds]++;
        cn->hist[ncmds]++;
        /* distinct destinations signalled in this batch */
        uint16_t dests[64];
        size_t nd = 0;
        uint64_t conn_bytes = 0;
        for (size_t r = (size_t)e->b_bounds[b], end = (size_t)e->b_bounds[b + 1]; r < end; r++) {
            const tpd_plan_row *row = &plan[r];
            if (row->op == TPD_PLAN_SIGNAL) {
                signals++;
                size_t d = 0;
                while (d < nd && dests[d] != row->dst_rank) d++;
                if (d == nd) dests[nd++] = row->dst_rank;
            } else {
                writes += row->op == TPD_PLAN_WRITE;
                fences += row->op == TPD_PLAN_FENCE;
                conn_bytes += row->length;
            }
        }
        bytes += conn_bytes;
        cn->bytes += conn_bytes;
        dest_batches += nd;
    }
    c[C_WRS] += wrs;
    c[C_SIGNALS] += signals;
    if (!e->decoupled) c[C_SIGNALS_REQUESTED] += signals;
    c[C_WRITES] += writes;
    c[C_FENCES] += fences;
    c[C_BYTES] += bytes;
    c[C_SIGNAL_DEST_BATCHES] += dest_batches;
    c[C_BATCHES] += nb;
    if (group_append(e, g)) {
        group_release(e, g);
        return nomem(e);
    }
    return 1;
}

/* ---- completions ---------------------------------------------------------------------------------- */
enum { WC_LOC_PROT = 4, WC_FLUSH = 5, WC_REM_ACCESS = 10, WC_RETRY_EXC = 12, WC_RESP_TIMEOUT = 20 };

static uint16_t completion_code(uint32_t status) {
    if (status == 0) return 0;
    return (status == WC_LOC_PROT || status == WC_REM_ACCESS) ? TPD_ERR_REMOTE_ACCESS : TPD_ERR_TRANSPORT;
}

/* The far end not answering (RC retry exceeded, SRD response timeout: its daemon died, or the path) leaves
 * a WR's outcome unknown: the data may or may not be placed. Its connection is held from then on (records
 * for its peers wait in the rings) and broken (the control plane re-wires it when the peer's next life
 * comes, else fails it); what its QP flushes from then on has an unknown outcome too. */
static int unanswered(uint32_t status) { return status == WC_RETRY_EXC || status == WC_RESP_TIMEOUT; }

/* A failed completion's code for the command's channel (after its group marked broken connections). */
static uint16_t failed_code(const Conn *c, uint32_t status) {
    if (unanswered(status) || (status == WC_FLUSH && c->broken)) return TPD_ERR_UNKNOWN_OUTCOME;
    return completion_code(status);
}

/* Tokens of `g` listed in `local` (indexes, with statuses) completed: free their WRs, finish their commands
 * (a command's error goes into its channel's error word: `forced` when nonzero, else by status). */
static void complete_group(Engine *e, Group *g, const int64_t *local, const int64_t *status, size_t n,
                           uint16_t forced, uint8_t *newly, int64_t *tok_status) {
    int ascending = 1;
    for (size_t i = 1; i < n && ascending; i++) ascending = local[i - 1] < local[i];
    if (ascending) { /* the usual case (completions in post order): only the completed batches' commands */
        if (!forced)
            for (size_t i = 0; i < n; i++)
                if (status[i] && unanswered((uint32_t)status[i]) && !g->done[local[i]]) {
                    Conn *c = &e->conns[g->tok_conn[local[i]]];
                    c->holding = c->broken = 1;
                }
        /* the group's arrays and the channel's marks in locals: the byte stores (g->done, the marks) would
         * otherwise reload every one of them after each store */
        const int64_t *const tok_conn = g->tok_conn, *const tok_nwr = g->tok_nwr, *const tok_cmds = g->tok_cmds;
        const int64_t *const cmd_chan = g->cmd_chan;
        const uint64_t *const cmd_pos = g->cmd_pos;
        uint8_t *const gdone = g->done;
        Conn *const conns = e->conns;
        DrainedRing *ch = NULL;
        uint8_t *marks = NULL;
        uint64_t mask = 0;
        int64_t id = 0;
        size_t fresh = 0;
        for (size_t i = 0; i < n; i++) {
            int64_t t = local[i];
            if (gdone[t]) continue;
            gdone[t] = 1;
            fresh++;
            conns[tok_conn[t]].inflight -= tok_nwr[t];
            uint16_t code = 0;
            if (status[i]) {
                e->counters[C_COMPLETION_ERRORS]++;
                code = forced ? forced : failed_code(&conns[tok_conn[t]], (uint32_t)status[i]);
            }
            for (int64_t k = tok_cmds[t], end = tok_cmds[t + 1]; k < end; k++) {
                if (!ch || id != cmd_chan[k]) { /* mark_done, with the channel's fields in locals */
                    ch = find_channel(e, cmd_chan[k]);
                    if (!ch) continue;
                    id = ch->id;
                    marks = ch->done;
                    mask = ch->track - 1;
                }
                if (code) report_late(e, ch, code, cmd_pos[k]);
                marks[cmd_pos[k] & mask] = 1;
                ch->touched = 1;
            }
        }
        g->remaining -= fresh;
        return;
    }
    /* in any order, a token maybe more than once (its last status counts): every command of the group */
    memset(newly, 0, g->nb);
    memset(tok_status, 0, g->nb * sizeof(int64_t));
    int any_status = 0;
    for (size_t i = 0; i < n; i++) {
        newly[local[i]] = 1;
        any_status |= status[i] != 0;
    }
    size_t fresh = 0;
    for (size_t t = 0; t < g->nb; t++) {
        if (newly[t] && g->done[t]) newly[t] = 0;
        if (newly[t]) {
            fresh++;
            g->done[t] = 1;
            e->conns[g->tok_conn[t]].inflight -= g->tok_nwr[t];
        }
    }
    if (!fresh) return;
    g->remaining -= fresh;
    if (any_status) {
        for (size_t i = 0; i < n; i++)
            if (newly[local[i]]) tok_status[local[i]] = status[i];
        for (size_t t = 0; t < g->nb; t++) {
            e->counters[C_COMPLETION_ERRORS] += tok_status[t] != 0;
            if (!forced && unanswered((uint32_t)tok_status[t])) {
                Conn *c = &e->conns[g->tok_conn[t]];
                c->holding = c->broken = 1;
            }
        }
    }
    DrainedRing *ch = NULL; /* commands come in runs of one channel: look it up once per run */
    for (size_t k = 0; k < g->ncmd; k++) {
        int64_t t = g->cmd_tok[k];
        if (!newly[t]) continue;
        if (!ch || ch->id != g->cmd_chan[k]) ch = find_channel(e, g->cmd_chan[k]);
        if (!ch) continue;
        if (tok_status[t])
            report_late(e, ch, forced ? forced : failed_code(&e->conns[g->tok_conn[t]], (uint32_t)tok_status[t]),
                        g->cmd_pos[k]);
        mark_done(ch, g->cmd_pos[k]);
    }
}

static void drop_finished_groups(Engine *e) {
    size_t k = 0;
    for (size_t i = 0; i < e->ngroups; i++) {
        if (e->groups[i]->remaining) e->groups[k++] = e->groups[i];
        else group_release(e, e->groups[i]);
    }
    e->ngroups = k;
}

static int complete_tokens(Engine *e, const Completion *comps, size_t n) {
    size_t maxnb = 0;
    for (size_t i = 0; i < e->ngroups; i++) maxnb = e->groups[i]->nb > maxnb ? e->groups[i]->nb : maxnb;
    if (tpd_grow((void **)&e->done_scratch, &e->done_scratch_cap,
                 (n + 1) * 2 * sizeof(int64_t) + maxnb * (1 + sizeof(int64_t)) + 1, 1))
        return -1;
    int64_t *local = (int64_t *)e->done_scratch;
    int64_t *status = local + n + 1;
    int64_t *tok_status = status + n + 1;
    uint8_t *newly = (uint8_t *)(tok_status + maxnb);
    size_t matched = 0;
    for (size_t i = 0; i < e->ngroups; i++) {
        Group *g = e->groups[i];
        size_t k = 0;
        for (size_t j = 0; j < n; j++) {
            if (comps[j].token >= g->first && comps[j].token < g->first + g->nb) {
                local[k] = (int64_t)(comps[j].token - g->first);
                status[k] = comps[j].status;
                k++;
            }
        }
        if (k) {
            matched += k;
            complete_group(e, g, local, status, k, 0, newly, tok_status);
        }
    }
    e->counters[C_UNKNOWN_COMPLETIONS] += n - matched;
    drop_finished_groups(e);
    return 0;
}

/* The backend's Python poll(max) -> COMPLETION_DTYPE rows, retired here; GIL held. */
static long poll_python(Engine *e) {
    PyObject *res = PyObject_CallFunction(e->poll_cb, "L", (long long)e->poll_max);
    if (!res) return -1;
    Py_buffer view;
    if (PyObject_GetBuffer(res, &view, PyBUF_SIMPLE) < 0) {
        Py_DECREF(res);
        return -1;
    }
    size_t n = (size_t)view.len / sizeof(Completion);
    int rc = 0;
    if ((size_t)view.len % sizeof(Completion)) {
        PyErr_SetString(PyExc_ValueError, "poll must return COMPLETION_DTYPE rows (16 bytes each)");
        rc = -1;
    } else if (n) {
        e->counters[C_COMPLETIONS] += n;
        if (complete_tokens(e, (const Completion *)view.buf, n)) {
            PyErr_NoMemory();
            rc = -1;
        }
    }
    PyBuffer_Release(&view);
    Py_DECREF(res);
    return rc < 0 ? -1 : (long)n;
}

/* Drain the backend's completions (GIL released); returns how many came, -1 with a Python error set. */
long tpd_progress(Engine *e) {
    if (e->poster) {
        tpd_poster *p = e->poster;
        long n = p->poll(p->ctx, (size_t)e->poll_max, e->poll_buf);
        if (n < 0) {
            gil_take(e);
            p->raise_error(p->ctx);
            gil_drop(e);
            return -1;
        }
        if (!n) return 0;
        e->counters[C_COMPLETIONS] += (uint64_t)n;
        if (complete_tokens(e, e->poll_buf, (size_t)n)) return nomem(e);
        return n;
    }
    if (e->poll_cb == Py_None) {
        size_t n = e->null_ndue;
        if ((int64_t)n > e->poll_max) n = (size_t)e->poll_max;
        if (!n) return 0;
        e->counters[C_COMPLETIONS] += n;
        if (complete_tokens(e, e->null_due, n)) return nomem(e);
        memmove(e->null_due, e->null_due + n, (e->null_ndue - n) * sizeof(Completion));
        e->null_ndue -= n;
        return (long)n;
    }
    gil_take(e);
    long n = poll_python(e);
    gil_drop(e);
    return n;
}

typedef struct {
    int64_t chan;
    uint64_t pos;
} Dropped;

static int cmp_dropped(const void *a, const void *b) {
    const Dropped *x = a, *y = b;
    if (x->chan != y->chan) return x->chan < y->chan ? -1 : 1;
    return x->pos < y->pos ? -1 : x->pos > y->pos;
}

/* Rows of channel `chan` (or of connection index `conn`) leave the waiting set. With `mark`, their
 * commands complete, with `code` in their channels' error words (none when 0), channel by channel in
 * position order; without, they are forgotten (a removed channel). -1: out of memory. */
int tpd_drop_waiting(Engine *e, int64_t chan, int64_t conn, uint16_t code, int mark) {
    Dropped *dropped = NULL;
    size_t nd = 0, cap = 0;
    for (size_t ci = 0; ci < e->nconns; ci++) {
        Conn *c = &e->conns[ci];
        size_t k = c->head;
        for (size_t r = c->head; r < c->count; r++) {
            Waiting *w = &c->rows[r];
            if (w->chan == chan || (int64_t)ci == conn) {
                e->nwaiting--;
                if (mark && w->first) {
                    if (tpd_grow((void **)&dropped, &cap, nd + 1, sizeof(Dropped))) {
                        free(dropped);
                        return -1;
                    }
                    dropped[nd++] = (Dropped){w->chan, w->pos};
                }
                continue;
            }
            c->rows[k++] = *w;
        }
        c->count = k;
        if (c->head == c->count) c->head = c->count = 0;
    }
    if (nd) qsort(dropped, nd, sizeof(Dropped), cmp_dropped);
    for (size_t i = 0; i < nd; i++) {
        DrainedRing *ch = find_channel(e, dropped[i].chan);
        if (!ch) continue;
        if (code) report_late(e, ch, code, dropped[i].pos);
        mark_done(ch, dropped[i].pos);
    }
    free(dropped);
    return 0;
}

/* Connection index `conn` is gone: its waiting rows are dropped and its posted batches completed here
 * with `code` (silently when 0); its inflight count returns to 0. */
int tpd_fail_connection(Engine *e, int64_t conn, uint16_t code) {
    if (tpd_drop_waiting(e, -1, conn, code, 1)) return -1;
    for (size_t i = 0; i < e->ngroups; i++) {
        Group *g = e->groups[i];
        int64_t *buf = malloc(g->nb * (3 * sizeof(int64_t) + 1) + 1);
        if (!buf) return -1;
        int64_t *local = buf, *status = buf + g->nb, *tok_status = buf + 2 * g->nb;
        uint8_t *newly = (uint8_t *)(buf + 3 * g->nb);
        size_t k = 0;
        for (size_t t = 0; t < g->nb; t++) {
            if (g->tok_conn[t] == conn && !g->done[t]) {
                local[k] = (int64_t)t;
                status[k] = code ? -1 : 0;
                k++;
            }
        }
        if (k) complete_group(e, g, local, status, k, code, newly, tok_status);
        free(buf);
    }
    drop_finished_groups(e);
    e->conns[conn].inflight = 0;
    tpd_advance_touched(e);
    return 0;
}

/* ---- one pass -------------------------------------------------------------------------------------- */
/* Take, post, progress (GIL released: e->ts set); *did whether it did any work. -1 with a Python error set. */
int tpd_run_pass(Engine *e, int *did) {
    e->counters[C_ITERATIONS]++;
    int64_t now = e->pass_ns = now_ns();
    for (size_t i = 0; i < e->nchans; i++) e->chans[i]->quiet = 0;
    int took = take(e, now);
    if (took < 0) return nomem(e);
    *did = took;
    if (e->nwaiting) {
        int posted = post(e, now);
        if (posted < 0) return -1;
        *did |= posted;
    }
    long n = tpd_progress(e);
    if (n < 0) return -1;
    *did |= n > 0;
    tpd_advance_touched(e);
    return 0;
}

static int interrupted(Engine *e) { return __atomic_load_n(&e->interrupt, __ATOMIC_ACQUIRE); }

static struct timespec ns_timespec(int64_t ns) {
    if (ns < 0) ns = 0;
    return (struct timespec){(time_t)(ns / 1000000000), (long)(ns % 1000000000)};
}

/* Look at the rings' head slots until one holds a committed record (WATCH_FOUND), timeout_ns passes
 * (WATCH_TIMEOUT), or wake_fd turns readable or interrupt() is called (WATCH_WOKEN); reads one seq word per
 * ring per look and takes nothing. nap_ns > 0 sleeps that long between looks (a long-idle worker: one short
 * sleep per look instead of a spinning core, a record still seen within about nap_ns); with wake_fd >= 0
 * each nap is a ppoll on it, so a request on the worker's link ends the wait at once however long it is.
 * WATCH_TIMEOUT at once while rows wait or work is in flight: the next pass is due anyway. */
int tpd_watch(Engine *e, int64_t timeout_ns, int64_t nap_ns, int wake_fd) {
    if (!e->taking || busy(e)) return WATCH_TIMEOUT;
    int64_t deadline = now_ns() + timeout_ns;
    struct timespec pause = ns_timespec(nap_ns);
    struct pollfd wake = {.fd = wake_fd, .events = POLLIN};
    for (;;) {
        for (size_t i = 0; i < e->nchans; i++) {
            DrainedRing *ch = e->chans[i];
            if (!(ch->blocked && ch->blocked_pos == ch->position) && record_ready(ch, ch->position))
                return WATCH_FOUND;
        }
        if (interrupted(e)) return WATCH_WOKEN;
        if (now_ns() >= deadline) return WATCH_TIMEOUT;
        if (wake_fd >= 0) {
            if (ppoll(&wake, 1, &pause, NULL) != 0) return WATCH_WOKEN; /* readable (or an error): Python's turn */
        } else if (nap_ns > 0) {
            nanosleep(&pause, NULL);
        }
    }
}

/* Sleep nap_ns, or until wake_fd turns readable; 1 if it did. */
static int nap(int64_t nap_ns, int wake_fd) {
    struct timespec pause = ns_timespec(nap_ns);
    if (wake_fd < 0) {
        nanosleep(&pause, NULL);
        return 0;
    }
    struct pollfd wake = {.fd = wake_fd, .events = POLLIN};
    return ppoll(&wake, 1, &pause, NULL) != 0;
}

/* Whether wake_fd is readable now (one poll, no wait). */
static int link_ready(int wake_fd) {
    if (wake_fd < 0) return 0;
    struct pollfd wake = {.fd = wake_fd, .events = POLLIN};
    return poll(&wake, 1, 0) != 0;
}

/* ---- the serve loop: the rail worker's whole loop, GIL released ---------------------------------------
 * Pass after pass while there is work, the link's descriptor looked at once link_every ns have passed since
 * the last look (a poll() costs about what three idle passes do, so it is timed, not counted). When a pass
 * finds nothing, the back-off, timed from the end of the last pass that did work (e->idle_since, which a
 * return to Python does not reset):
 *   idle >= deep_after a pass, the link looked at, up to deep_watch of looks deep_nap apart, each nap a
 *                      ppoll on the link's descriptor; a nap after a pass that left work in flight;
 *   idle >= spin       a pass, the link looked at, the ring heads watched for up to watch (spinning; a
 *                      committed record ends it), then a nap (a ppoll on the link's descriptor);
 *   else               passes back to back (the link looked at every link_every ns).
 * Every phase times itself by the clock its pass read (e->pass_ns): one clock read a pass.
 * It returns SERVE_LINK when the descriptor is readable (the worker's link has a request, or may have: zmq's
 * ZMQ_FD is readable until zmq processes its commands, which the Python side's poll of the link does) and
 * SERVE_INTERRUPTED after interrupt(). A backend's Python (a post/poll callable, a shim's one call per
 * pass, efa's per-poll call) runs inside the pass, the GIL taken for that call only. The constants and what
 * they cost are transportd/dataplane/worker.py's; transportd_models/engine.py's model_serve is the
 * same policy in Python. */
int tpd_serve_loop(Engine *e, const Policy *p, int *reason) {
    uint64_t *s = e->loop;
    int64_t looked = now_ns(); /* the last look at the link */
    for (;;) {
        if (interrupted(e)) {
            __atomic_store_n(&e->interrupt, 0, __ATOMIC_RELEASE);
            s[L_INTERRUPTED]++;
            *reason = SERVE_INTERRUPTED;
            return 0;
        }
        int did = 0;
        s[L_PASSES]++;
        if (tpd_run_pass(e, &did)) return -1;
        const int64_t now = e->pass_ns;
        int look = now - looked >= p->link_every;
        if (did) {
            e->idle_since = -1;
            s[L_BUSY]++;
        } else {
            if (e->idle_since < 0) e->idle_since = now;
            int64_t idle = now - e->idle_since;
            if (idle < p->spin && idle < p->deep_after) {
                s[L_SPINS]++;
            } else if (link_ready(p->wake_fd)) {
                goto link;
            } else if (idle >= p->deep_after) {
                s[L_DEEP_WATCHES]++;
                if (tpd_watch(e, p->deep_watch, p->deep_nap, p->wake_fd) == WATCH_TIMEOUT && busy(e)) {
                    s[L_NAPS]++;
                    nap(p->deep_nap, p->wake_fd);
                }
                look = 0; /* a readable descriptor ended the watch or nap: the next idle pass returns */
            } else {
                s[L_WATCHES]++;
                if (tpd_watch(e, p->watch, 0, -1) != WATCH_FOUND) {
                    s[L_NAPS]++;
                    nap(p->nap, p->wake_fd);
                }
                look = 0;
            }
        }
        if (!look) continue;
        looked = now;
        if (!link_ready(p->wake_fd)) continue;
    link:
        s[L_LINK]++;
        *reason = SERVE_LINK;
        return 0;
    }
}
