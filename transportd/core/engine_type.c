/*
 * transportd._core.Engine: the Python type around the engine (engine.c, the loop). Each method parses its
 * arguments, runs the loop's part with the GIL released where it may block or take long (run_once, serve,
 * progress, wait_ready, a trace flush), and turns the engine's state into Python values. The tables and
 * channels Python hands over are held here as buffer views (see engine.c on why the engine keeps a
 * reference to every array it reads).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>

#include "engine.h"

static PyObject *Engine_run_once(Engine *e, PyObject *unused) {
    int did = 0;
    gil_drop(e);
    int rc = tpd_run_pass(e, &did);
    gil_take(e);
    if (rc) return NULL;
    return PyBool_FromLong(did);
}

/* serve(spin_ns, watch_ns, nap_ns, deep_after_ns, deep_watch_ns, deep_nap_ns, wake_fd, link_every_ns) -> reason */
static PyObject *Engine_serve(Engine *e, PyObject *args) {
    Policy p;
    if (!PyArg_ParseTuple(args, "LLLLLLiL", &p.spin, &p.watch, &p.nap, &p.deep_after, &p.deep_watch, &p.deep_nap,
                          &p.wake_fd, &p.link_every))
        return NULL;
    if (p.link_every < 0) return PyErr_Format(PyExc_ValueError, "link_every_ns must be >= 0");
    int reason = SERVE_INTERRUPTED;
    gil_drop(e);
    /* the default 50 us timer slack of a thread would more than double a 20 or 50 us nap */
    prctl(PR_SET_TIMERSLACK, 1000UL, 0, 0, 0);
    int rc = tpd_serve_loop(e, &p, &reason);
    gil_take(e);
    if (rc) return NULL;
    return PyLong_FromLong(reason);
}

/* Ask a serve running in another thread to return (SERVE_INTERRUPTED), or the next one not to start. */
static PyObject *Engine_interrupt(Engine *e, PyObject *unused) {
    __atomic_store_n(&e->interrupt, 1, __ATOMIC_RELEASE);
    Py_RETURN_NONE;
}

static PyObject *Engine_loop_stats(Engine *e, PyObject *unused) {
    static const char *names[N_LOOP] = {"passes", "busy", "spins", "watches", "naps", "deep_watches", "link",
                                        "interrupted"};
    PyObject *out = PyDict_New();
    for (int i = 0; out && i < N_LOOP; i++) {
        PyObject *v = PyLong_FromUnsignedLongLong(e->loop[i]);
        if (!v || PyDict_SetItemString(out, names[i], v) < 0) Py_CLEAR(out);
        Py_XDECREF(v);
    }
    return out;
}

static PyObject *Engine_progress(Engine *e, PyObject *unused) {
    gil_drop(e);
    long n = tpd_progress(e);
    if (n >= 0) tpd_advance_touched(e);
    gil_take(e);
    if (n < 0) return NULL;
    return PyLong_FromLong(n);
}

/* wait_ready(timeout_s, nap_s=0, wake_fd=-1): tpd_watch() from Python; True once a ring head holds a record.
 * An interrupt() that ends the wait is consumed by it, as a serve consumes one. */
static PyObject *Engine_wait_ready(Engine *e, PyObject *args) {
    double timeout, nap_s = 0.0;
    int wake_fd = -1;
    if (!PyArg_ParseTuple(args, "d|di", &timeout, &nap_s, &wake_fd)) return NULL;
    int w;
    Py_BEGIN_ALLOW_THREADS
    if (nap_s > 0) prctl(PR_SET_TIMERSLACK, 1000UL, 0, 0, 0);
    w = tpd_watch(e, (int64_t)(timeout * 1e9), (int64_t)(nap_s * 1e9), wake_fd);
    Py_END_ALLOW_THREADS
    if (w == WATCH_WOKEN) __atomic_store_n(&e->interrupt, 0, __ATOMIC_RELEASE);
    return PyBool_FromLong(w == WATCH_FOUND);
}

static PyObject *Engine_busy(Engine *e, PyObject *unused) { return PyBool_FromLong(busy(e)); }

static int get_buffer(PyObject *obj, Py_buffer *view, Py_ssize_t itemsize, const char *what) {
    if (PyObject_GetBuffer(obj, view, PyBUF_SIMPLE) < 0) return -1;
    if (itemsize && view->len % itemsize) {
        PyBuffer_Release(view);
        PyErr_Format(PyExc_ValueError, "%s: %zd bytes is not a whole number of %zd-byte items", what, view->len,
                     itemsize);
        return -1;
    }
    return 0;
}

/* set_sources(sid, addr u64[], length u64[], key u32[], valid bool[]): entries 0..n-2 ids, n-1 sentinel. */
static PyObject *Engine_set_sources(Engine *e, PyObject *args) {
    Py_ssize_t sid;
    PyObject *obj[4];
    if (!PyArg_ParseTuple(args, "nOOOO", &sid, &obj[0], &obj[1], &obj[2], &obj[3])) return NULL;
    if (sid < 0 || sid > 1 << 24) return PyErr_Format(PyExc_ValueError, "source table id %zd", sid);
    if ((size_t)sid >= e->nsrcs) {
        if (tpd_grow((void **)&e->srcs, &e->srcs_cap, (size_t)sid + 1, sizeof(Sources))) return PyErr_NoMemory();
        memset(e->srcs + e->nsrcs, 0, ((size_t)sid + 1 - e->nsrcs) * sizeof(Sources));
        e->nsrcs = (size_t)sid + 1;
    }
    Py_buffer bufs[4];
    const Py_ssize_t sizes[4] = {8, 8, 4, 1};
    for (int i = 0; i < 4; i++) {
        if (get_buffer(obj[i], &bufs[i], sizes[i], "source table")) {
            while (i--) PyBuffer_Release(&bufs[i]);
            return NULL;
        }
    }
    Py_ssize_t n = bufs[0].len / 8;
    for (int i = 1; i < 4; i++) {
        if (bufs[i].len / sizes[i] != n || n < 1) {
            for (int k = 0; k < 4; k++) PyBuffer_Release(&bufs[k]);
            return PyErr_Format(PyExc_ValueError, "source table arrays disagree in length");
        }
    }
    Sources *s = &e->srcs[sid];
    if (s->held)
        for (int i = 0; i < 4; i++) PyBuffer_Release(&s->bufs[i]);
    memcpy(s->bufs, bufs, sizeof(bufs));
    s->held = 1;
    s->view = (tpd_sources){.addr = bufs[0].buf, .length = bufs[1].buf, .key = bufs[2].buf, .valid = bufs[3].buf,
                            .size = (uint64_t)(n - 1)};
    Py_RETURN_NONE;
}

/* set_peers(jid, world, rows, cols, conn i64[], code u16[], flag_base u64[], flag_slots u64[], flag_rkey
 * u32[], addr u64[], length u64[], rkey u32[], valid bool[], conns i64[]). */
static PyObject *Engine_set_peers(Engine *e, PyObject *args) {
    Py_ssize_t jid;
    unsigned long long world, rows, cols;
    PyObject *obj[10];
    if (!PyArg_ParseTuple(args, "nKKKOOOOOOOOOO", &jid, &world, &rows, &cols, &obj[0], &obj[1], &obj[2], &obj[3],
                          &obj[4], &obj[5], &obj[6], &obj[7], &obj[8], &obj[9]))
        return NULL;
    if (jid < 0 || jid > 1 << 24) return PyErr_Format(PyExc_ValueError, "job id %zd", jid);
    if (rows >= 1u << 17 || cols >= 1u << 17) return PyErr_Format(PyExc_ValueError, "peer table too large");
    if ((size_t)jid >= e->njobs) {
        if (tpd_grow((void **)&e->jobs, &e->jobs_cap, (size_t)jid + 1, sizeof(Job))) return PyErr_NoMemory();
        memset(e->jobs + e->njobs, 0, ((size_t)jid + 1 - e->njobs) * sizeof(Job));
        e->njobs = (size_t)jid + 1;
    }
    /* per rank: conn, code, flag_base, flag_slots, flag_rkey; per (rank, region): addr, length, rkey, valid */
    Py_buffer bufs[10];
    const Py_ssize_t sizes[10] = {8, 2, 8, 8, 4, 8, 8, 4, 1, 8};
    const Py_ssize_t per_rank = (Py_ssize_t)rows + 1, per_region = (Py_ssize_t)((rows + 1) * (cols + 1));
    for (int i = 0; i < 10; i++) {
        if (get_buffer(obj[i], &bufs[i], sizes[i], "peer table")) {
            while (i--) PyBuffer_Release(&bufs[i]);
            return NULL;
        }
        Py_ssize_t want = i < 5 ? per_rank : i < 9 ? per_region : 0;
        if (bufs[i].len / sizes[i] < want) {
            for (int k = 0; k <= i; k++) PyBuffer_Release(&bufs[k]);
            return PyErr_Format(PyExc_ValueError, "peer table array %d is shorter than its %zd entries", i, want);
        }
    }
    /* every connection index the table names must be one the engine has, before anything is installed */
    const char *bad = NULL;
    long long bad_index = 0;
    const int64_t *listed = bufs[9].buf, *bound = bufs[0].buf;
    size_t nconns = (size_t)bufs[9].len / 8;
    for (size_t i = 0; !bad && i < nconns; i++)
        if (listed[i] < 0 || (size_t)listed[i] >= e->nconns) bad = "names", bad_index = listed[i];
    for (uint64_t r = 0; !bad && r <= rows; r++)
        if (bound[r] >= (int64_t)e->nconns) bad = "binds a rank to", bad_index = bound[r];
    int64_t *conns = bad ? NULL : malloc((nconns + 1) * sizeof(int64_t));
    if (conns) memcpy(conns, listed, nconns * sizeof(int64_t));
    PyBuffer_Release(&bufs[9]);
    if (!conns) {
        for (int k = 0; k < 9; k++) PyBuffer_Release(&bufs[k]);
        if (bad)
            return PyErr_Format(PyExc_ValueError, "job %zd's table %s connection index %lld, which was never added",
                                jid, bad, bad_index);
        return PyErr_NoMemory();
    }
    Job *j = &e->jobs[jid];
    if (j->held)
        for (int i = 0; i < 9; i++) PyBuffer_Release(&j->bufs[i]);
    memcpy(j->bufs, bufs, 9 * sizeof(Py_buffer));
    j->held = 1;
    j->view = (tpd_peers){.world = world, .rows = rows, .cols = cols, .conn = bufs[0].buf, .code = bufs[1].buf,
                          .flag_base = bufs[2].buf, .flag_slots = bufs[3].buf, .flag_rkey = bufs[4].buf,
                          .addr = bufs[5].buf, .length = bufs[6].buf, .rkey = bufs[7].buf, .valid = bufs[8].buf};
    free(j->conns);
    j->conns = conns;
    j->nconns = nconns;
    tpd_unblock_channels(e); /* a held peer may be bound elsewhere now */
    Py_RETURN_NONE;
}

static PyObject *Engine_add_connection(Engine *e, PyObject *arg) {
    long long id = PyLong_AsLongLong(arg);
    if (id == -1 && PyErr_Occurred()) return NULL;
    if (tpd_grow((void **)&e->conns, &e->conns_cap, e->nconns + 1, sizeof(Conn))) return PyErr_NoMemory();
    memset(&e->conns[e->nconns], 0, sizeof(Conn));
    e->conns[e->nconns].id = id;
    return PyLong_FromSize_t(e->nconns++);
}

/* add_channel(cid, ring buffer (the whole mapped file), job, src, track) */
static PyObject *Engine_add_channel(Engine *e, PyObject *args) {
    long long cid;
    PyObject *ring;
    Py_ssize_t job, src;
    unsigned long long track;
    if (!PyArg_ParseTuple(args, "LOnnK", &cid, &ring, &job, &src, &track)) return NULL;
    if (find_channel(e, cid)) return PyErr_Format(PyExc_ValueError, "channel %lld already exists", cid);
    if (job < 0 || (size_t)job >= e->njobs || !e->jobs[job].held || src < 0 || (size_t)src >= e->nsrcs ||
        !e->srcs[src].held)
        return PyErr_Format(PyExc_ValueError, "channel %lld: set its job's tables first", cid);
    if (!track || track & (track - 1)) return PyErr_Format(PyExc_ValueError, "track must be a power of two");
    DrainedRing *ch = calloc(1, sizeof(DrainedRing));
    if (!ch) return PyErr_NoMemory();
    if (PyObject_GetBuffer(ring, &ch->ring, PyBUF_WRITABLE) < 0) {
        free(ch);
        return NULL;
    }
    ch->base = ch->ring.buf;
    uint64_t capacity = ch->ring.len >= TPD_RING_RECORDS_OFFSET ? *ring_u64(ch, TPD_RING_OFF_CAPACITY) : 0;
    if (!capacity || capacity & (capacity - 1) ||
        (uint64_t)ch->ring.len < TPD_RING_RECORDS_OFFSET + capacity * TPD_RECORD_SIZE) {
        PyBuffer_Release(&ch->ring);
        free(ch);
        return PyErr_Format(PyExc_ValueError, "channel %lld: not a mapped ring", cid);
    }
    ch->done = calloc(track, 1);
    if (!ch->done || tpd_grow((void **)&e->chans, &e->chans_cap, e->nchans + 1, sizeof(DrainedRing *))) {
        free(ch->done);
        PyBuffer_Release(&ch->ring);
        free(ch);
        return PyErr_NoMemory();
    }
    ch->id = cid;
    ch->capacity = capacity;
    ch->mask = capacity - 1;
    ch->records = (const tpd_cmd_record *)(ch->base + TPD_RING_RECORDS_OFFSET);
    ch->position = ch->completed = *ring_u64(ch, TPD_RING_OFF_CONSUMER_POS); /* earlier ones were never ours */
    ch->job = (int)job;
    ch->src = (int)src;
    ch->track = track;
    publish_completion(ch, ch->completed);
    e->chans[e->nchans++] = ch;
    Py_RETURN_NONE;
}

static DrainedRing *channel_arg(Engine *e, PyObject *arg) {
    long long cid = PyLong_AsLongLong(arg);
    if (cid == -1 && PyErr_Occurred()) return NULL;
    DrainedRing *ch = find_channel(e, cid);
    if (!ch) PyErr_Format(PyExc_KeyError, "no channel %lld", cid);
    return ch;
}

static PyObject *Engine_mark_gone(Engine *e, PyObject *arg) {
    DrainedRing *ch = channel_arg(e, arg);
    if (!ch) return NULL;
    ch->gone = 1;
    if (tpd_drop_waiting(e, ch->id, -1, TPD_ERR_CLIENT_GONE, 1)) return PyErr_NoMemory();
    tpd_advance_touched(e);
    Py_RETURN_NONE;
}

static PyObject *Engine_remove_channel(Engine *e, PyObject *arg) {
    DrainedRing *ch = channel_arg(e, arg);
    if (!ch) return NULL;
    if (tpd_drop_waiting(e, ch->id, -1, 0, 0)) return PyErr_NoMemory();
    size_t k = 0;
    for (size_t i = 0; i < e->nchans; i++)
        if (e->chans[i] != ch) e->chans[k++] = e->chans[i];
    e->nchans = k;
    tpd_trace_free(ch->trace);
    PyBuffer_Release(&ch->ring);
    free(ch->done);
    free(ch);
    Py_RETURN_NONE;
}

static PyObject *Engine_fail_connection(Engine *e, PyObject *args) {
    Py_ssize_t idx;
    int code;
    if (!PyArg_ParseTuple(args, "ni", &idx, &code)) return NULL;
    if (idx < 0 || (size_t)idx >= e->nconns) return PyErr_Format(PyExc_ValueError, "no connection index %zd", idx);
    if (tpd_fail_connection(e, idx, (uint16_t)code)) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

/* hold_connection(idx, on): while on, records for the peers bound to the connection stay in their rings
 * (the peer's daemon is restarting); rows already waiting for it still post, so it drains. */
static PyObject *Engine_hold_connection(Engine *e, PyObject *args) {
    Py_ssize_t idx;
    int on;
    if (!PyArg_ParseTuple(args, "np", &idx, &on)) return NULL;
    if (idx < 0 || (size_t)idx >= e->nconns) return PyErr_Format(PyExc_ValueError, "no connection index %zd", idx);
    e->conns[idx].holding = on;
    tpd_unblock_channels(e);
    Py_RETURN_NONE;
}

/* broken_connections() -> ids of connections newly broken (failed_code) since the last call. */
static PyObject *Engine_broken_connections(Engine *e, PyObject *unused) {
    PyObject *out = PyList_New(0);
    for (size_t i = 0; out && i < e->nconns; i++) {
        Conn *c = &e->conns[i];
        if (!c->broken || c->broken_told) continue;
        c->broken_told = 1;
        PyObject *id = PyLong_FromLongLong(c->id);
        if (!id || PyList_Append(out, id) < 0) Py_CLEAR(out);
        Py_XDECREF(id);
    }
    return out;
}

static PyObject *Engine_set_taking(Engine *e, PyObject *arg) {
    e->taking = PyObject_IsTrue(arg);
    Py_RETURN_NONE;
}

static uint64_t ready_count(DrainedRing *ch, uint64_t limit) {
    uint64_t n = 0;
    while (n < limit && record_ready(ch, ch->position + n)) n++;
    return n;
}

/* (position, ready, completed, gone, oldest_age_ns, error code, error count, error position) of a channel;
 * with `now` >= 0 the head's waiting age is noted as queue statistics do. */
static PyObject *Engine_channel_state(Engine *e, PyObject *args) {
    PyObject *cid;
    long long now;
    if (!PyArg_ParseTuple(args, "OL", &cid, &now)) return NULL;
    DrainedRing *ch = channel_arg(e, cid);
    if (!ch) return NULL;
    uint64_t depth = ready_count(ch, ch->capacity);
    long long age = 0;
    if (depth && now >= 0) {
        tpd_note_waiting(ch, now);
        age = now - ch->seen_ns;
    }
    return Py_BuildValue("KKKiLIIK", (unsigned long long)ch->position, (unsigned long long)depth,
                         (unsigned long long)ch->completed, ch->gone, age,
                         (unsigned)*ring_u32(ch, TPD_RING_OFF_ERROR_CODE),
                         (unsigned)*ring_u32(ch, TPD_RING_OFF_ERROR_COUNT),
                         (unsigned long long)*ring_u64(ch, TPD_RING_OFF_ERROR_POS));
}

/* {code: count} of a channel's refused or failed records, nonzero codes only. */
static PyObject *Engine_channel_codes(Engine *e, PyObject *arg) {
    DrainedRing *ch = channel_arg(e, arg);
    if (!ch) return NULL;
    PyObject *out = PyDict_New();
    for (int code = 0; out && code < 256; code++) {
        if (!ch->codes[code]) continue;
        PyObject *k = PyLong_FromLong(code), *v = PyLong_FromUnsignedLongLong(ch->codes[code]);
        if (!k || !v || PyDict_SetItem(out, k, v) < 0) Py_CLEAR(out);
        Py_XDECREF(k);
        Py_XDECREF(v);
    }
    return out;
}

/* ---- the trace recorder (trace.h): Python opens the file and hands its descriptor over --------------- */
static PyObject *trace_state(const tpd_trace *t) {
    return Py_BuildValue("KKKi", (unsigned long long)t->entries, (unsigned long long)t->written,
                         (unsigned long long)t->dropped, t->last_errno);
}

/* trace_open(cid, fd, buffer_entries): record the channel's records into fd from the next pass on. */
static PyObject *Engine_trace_open(Engine *e, PyObject *args) {
    PyObject *cid;
    int fd;
    Py_ssize_t cap;
    if (!PyArg_ParseTuple(args, "Oin", &cid, &fd, &cap)) return NULL;
    DrainedRing *ch = channel_arg(e, cid);
    if (!ch) return NULL;
    if (ch->trace) return PyErr_Format(PyExc_ValueError, "channel %lld is traced already", (long long)ch->id);
    if (fd < 0 || cap < 1) return PyErr_Format(PyExc_ValueError, "trace_open needs a descriptor and a buffer >= 1");
    ch->trace = tpd_trace_new(fd, (uint32_t)ch->id, (size_t)cap);
    if (!ch->trace) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

static DrainedRing *traced_arg(Engine *e, PyObject *arg) {
    DrainedRing *ch = channel_arg(e, arg);
    if (ch && !ch->trace) {
        PyErr_Format(PyExc_ValueError, "channel %lld is not traced", (long long)ch->id);
        return NULL;
    }
    return ch;
}

/* trace_flush(cid) -> (entries, written, dropped, errno): write out what is buffered. */
static PyObject *Engine_trace_flush(Engine *e, PyObject *arg) {
    DrainedRing *ch = traced_arg(e, arg);
    if (!ch) return NULL;
    Py_BEGIN_ALLOW_THREADS
    tpd_trace_flush(ch->trace);
    Py_END_ALLOW_THREADS
    return trace_state(ch->trace);
}

/* trace_close(cid) -> (entries, written, dropped, errno): flush and stop; the descriptor stays open. */
static PyObject *Engine_trace_close(Engine *e, PyObject *arg) {
    DrainedRing *ch = traced_arg(e, arg);
    if (!ch) return NULL;
    Py_BEGIN_ALLOW_THREADS
    tpd_trace_flush(ch->trace);
    Py_END_ALLOW_THREADS
    PyObject *state = trace_state(ch->trace);
    if (!state) return NULL;
    tpd_trace_free(ch->trace);
    ch->trace = NULL;
    return state;
}

static PyObject *u64_tuple(const uint64_t *v, size_t n) {
    PyObject *t = PyTuple_New((Py_ssize_t)n);
    if (!t) return NULL;
    for (size_t i = 0; i < n; i++) {
        PyObject *x = PyLong_FromUnsignedLongLong(v[i]);
        if (!x) {
            Py_DECREF(t);
            return NULL;
        }
        PyTuple_SET_ITEM(t, (Py_ssize_t)i, x);
    }
    return t;
}

static PyObject *Engine_counters(Engine *e, PyObject *unused) { return u64_tuple(e->counters, N_COUNTERS); }
static PyObject *Engine_errors(Engine *e, PyObject *unused) { return u64_tuple(e->errors, 256); }
static PyObject *Engine_batch_hist(Engine *e, PyObject *unused) { return u64_tuple(e->batch_hist, HIST); }

/* [(conn id, inflight, pending, hist tuple, bytes)] by connection index */
static PyObject *Engine_connections(Engine *e, PyObject *unused) {
    PyObject *out = PyList_New((Py_ssize_t)e->nconns);
    if (!out) return NULL;
    for (size_t i = 0; i < e->nconns; i++) {
        Conn *c = &e->conns[i];
        PyObject *h = u64_tuple(c->hist, HIST);
        PyObject *row = h ? Py_BuildValue("LLnNK", (long long)c->id, (long long)c->inflight,
                                          (Py_ssize_t)conn_pending(c), h, (unsigned long long)c->bytes)
                          : NULL;
        if (!row) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, (Py_ssize_t)i, row);
    }
    return out;
}

static PyObject *Engine_pending_rows(Engine *e, PyObject *unused) { return PyLong_FromSize_t(e->nwaiting); }

/* The null NIC's post log: keep (post ns, chunk id) of up to `capacity` WRITE rows from now on. */
static PyObject *Engine_log_posts(Engine *e, PyObject *arg) {
    Py_ssize_t cap = PyLong_AsSsize_t(arg);
    if (cap < 0) return PyErr_Occurred() ? NULL : PyErr_Format(PyExc_ValueError, "capacity must be >= 0");
    free(e->post_log);
    e->post_log = cap ? calloc((size_t)cap * 2, sizeof(uint64_t)) : NULL;
    if (cap && !e->post_log) return PyErr_NoMemory();
    e->post_log_cap = (size_t)cap * 2;
    e->post_log_n = 0;
    Py_RETURN_NONE;
}

static PyObject *Engine_post_log(Engine *e, PyObject *unused) {
    return PyBytes_FromStringAndSize((const char *)e->post_log, (Py_ssize_t)(e->post_log_n * sizeof(uint64_t)));
}

static int Engine_init(Engine *e, PyObject *args, PyObject *kw) {
    static char *names[] = {"batch_max", "window_ns", "inflight_cap", "decoupled", "max_length", "max_take",
                            "poll_max", "post", "poll", "poster", NULL};
    long long window, cap, poll_max;
    unsigned long long max_length, max_take;
    PyObject *post_cb, *poll_cb, *poster = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "iLLpKKLOO|O", names, &e->batch_max, &window, &cap, &e->decoupled,
                                     &max_length, &max_take, &poll_max, &post_cb, &poll_cb, &poster))
        return -1;
    if (e->batch_max < 1 || e->batch_max > 8) {
        PyErr_Format(PyExc_ValueError, "batch_max must be in 1..8, got %d", e->batch_max);
        return -1;
    }
    if (cap < 2 || max_take < 1 || poll_max < 1) {
        PyErr_SetString(PyExc_ValueError, "inflight_cap must be >= 2, max_take and poll_max >= 1");
        return -1;
    }
    if ((post_cb == Py_None) != (poll_cb == Py_None)) {
        PyErr_SetString(PyExc_ValueError, "post and poll are both callables, or both None (the null NIC)");
        return -1;
    }
    if (poster != Py_None) {
        /* a backend's C poster: its `poster` attribute is the tpd_poster capsule */
        if (post_cb != Py_None) {
            PyErr_SetString(PyExc_ValueError, "a poster replaces post and poll: pass None for both");
            return -1;
        }
        PyObject *cap_obj = PyObject_GetAttrString(poster, "poster");
        if (!cap_obj) return -1;
        tpd_poster *p = PyCapsule_GetPointer(cap_obj, TPD_POSTER_CAPSULE);
        Py_DECREF(cap_obj);
        if (!p) return -1;
        Completion *buf = realloc(e->poll_buf, (size_t)poll_max * sizeof(Completion));
        if (!buf) {
            PyErr_NoMemory();
            return -1;
        }
        e->poll_buf = buf;
        e->poster = p;
        Py_INCREF(poster);
        Py_XSETREF(e->poster_obj, poster);
    }
    e->window_ns = window;
    e->inflight_cap = cap;
    e->max_length = max_length;
    e->max_take = max_take;
    e->poll_max = poll_max;
    Py_INCREF(post_cb);
    Py_INCREF(poll_cb);
    Py_XSETREF(e->post_cb, post_cb);
    Py_XSETREF(e->poll_cb, poll_cb);
    e->taking = 1;
    e->next_token = 1;
    e->idle_since = -1;
    return 0;
}

static void Engine_dealloc(Engine *e) {
    for (size_t i = 0; i < e->nchans; i++) {
        tpd_trace_free(e->chans[i]->trace);
        PyBuffer_Release(&e->chans[i]->ring);
        free(e->chans[i]->done);
        free(e->chans[i]);
    }
    for (size_t i = 0; i < e->nsrcs; i++)
        if (e->srcs[i].held)
            for (int k = 0; k < 4; k++) PyBuffer_Release(&e->srcs[i].bufs[k]);
    for (size_t i = 0; i < e->njobs; i++) {
        if (e->jobs[i].held)
            for (int k = 0; k < 9; k++) PyBuffer_Release(&e->jobs[i].bufs[k]);
        free(e->jobs[i].conns);
    }
    for (size_t i = 0; i < e->nconns; i++) free(e->conns[i].rows);
    for (size_t i = 0; i < e->ngroups; i++) free(e->groups[i]);
    for (size_t i = 0; i < e->nspare; i++) free(e->spare[i]);
    free(e->done_scratch);
    free(e->chans);
    free(e->srcs);
    free(e->jobs);
    free(e->conns);
    free(e->groups);
    free(e->plan);
    free(e->b_conn);
    free(e->b_ncmds);
    free(e->b_bounds);
    free(e->b_nwr);
    free(e->cuts);
    free(e->recs);
    free(e->tcode);
    free(e->null_due);
    free(e->post_log);
    Py_XDECREF(e->post_cb);
    Py_XDECREF(e->poll_cb);
    Py_XDECREF(e->poster_obj);
    free(e->post_ids);
    free(e->poll_buf);
    Py_TYPE(e)->tp_free((PyObject *)e);
}

static PyMethodDef Engine_methods[] = {
    {"run_once", (PyCFunction)Engine_run_once, METH_NOARGS, "One pass: take, post, progress. True if it did work."},
    {"serve", (PyCFunction)Engine_serve, METH_VARARGS,
     "serve(spin_ns, watch_ns, nap_ns, deep_after_ns, deep_watch_ns, deep_nap_ns, wake_fd, link_every_ns): the "
     "rail worker's loop, GIL released, until wake_fd is readable (SERVE_LINK) or interrupt() (SERVE_INTERRUPTED)."},
    {"interrupt", (PyCFunction)Engine_interrupt, METH_NOARGS,
     "Make a running serve or wait_ready return (or the next one)."},
    {"loop_stats", (PyCFunction)Engine_loop_stats, METH_NOARGS, "What serve did: passes, spins, watches, naps, ..."},
    {"progress", (PyCFunction)Engine_progress, METH_NOARGS, "Drain completions now; how many came."},
    {"wait_ready", (PyCFunction)Engine_wait_ready, METH_VARARGS,
     "wait_ready(timeout_s, nap_s=0, wake_fd=-1): watch the ring heads (GIL released), napping nap_s between "
     "looks; a readable wake_fd ends the wait."},
    {"busy", (PyCFunction)Engine_busy, METH_NOARGS, "Rows wait or batches are in flight."},
    {"set_sources", (PyCFunction)Engine_set_sources, METH_VARARGS, "Install a rank's source region table."},
    {"set_peers", (PyCFunction)Engine_set_peers, METH_VARARGS, "Install a job's peer table."},
    {"add_connection", (PyCFunction)Engine_add_connection, METH_O, "A backend connection id -> its index."},
    {"add_channel", (PyCFunction)Engine_add_channel, METH_VARARGS, "Start draining a mapped ring."},
    {"mark_gone", (PyCFunction)Engine_mark_gone, METH_O, "The channel's client left."},
    {"remove_channel", (PyCFunction)Engine_remove_channel, METH_O, "Forget a channel."},
    {"fail_connection", (PyCFunction)Engine_fail_connection, METH_VARARGS, "A connection index is gone."},
    {"set_taking", (PyCFunction)Engine_set_taking, METH_O, "Whether records are taken from the rings."},
    {"broken_connections", (PyCFunction)Engine_broken_connections, METH_NOARGS,
     "Ids of connections whose far end stopped answering, each reported once."},
    {"hold_connection", (PyCFunction)Engine_hold_connection, METH_VARARGS,
     "hold_connection(idx, on): keep records for the connection's peers in their rings (a peer restarting)."},
    {"channel_state", (PyCFunction)Engine_channel_state, METH_VARARGS, "A channel's positions and error word."},
    {"channel_codes", (PyCFunction)Engine_channel_codes, METH_O, "A channel's refused records by ErrorCode."},
    {"trace_open", (PyCFunction)Engine_trace_open, METH_VARARGS,
     "trace_open(cid, fd, buffer_entries): record what the channel takes into fd (trace.h)."},
    {"trace_flush", (PyCFunction)Engine_trace_flush, METH_O, "Write a traced channel's buffer out; its state."},
    {"trace_close", (PyCFunction)Engine_trace_close, METH_O, "Stop tracing a channel (fd left open); its state."},
    {"counters", (PyCFunction)Engine_counters, METH_NOARGS, "The counters, in COUNTERS order."},
    {"errors", (PyCFunction)Engine_errors, METH_NOARGS, "Rejected records by ErrorCode value."},
    {"batch_hist", (PyCFunction)Engine_batch_hist, METH_NOARGS, "Batches by commands in them."},
    {"connections", (PyCFunction)Engine_connections, METH_NOARGS, "Per connection index queue state."},
    {"pending_rows", (PyCFunction)Engine_pending_rows, METH_NOARGS, "Rows waiting for their batch."},
    {"log_posts", (PyCFunction)Engine_log_posts, METH_O, "Null NIC: log (ns, chunk id) of posted WRITEs."},
    {"post_log", (PyCFunction)Engine_post_log, METH_NOARGS, "The null NIC's post log as u64 pairs."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject EngineType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "transportd._core.Engine",
    .tp_basicsize = sizeof(Engine),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "The proxy's data path: rings in, batches to a backend, completions back (see transportd.dataplane.proxy).",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Engine_init,
    .tp_dealloc = (destructor)Engine_dealloc,
    .tp_methods = Engine_methods,
};

int tpd_engine_register(PyObject *m) {
    if (PyType_Ready(&EngineType) < 0) return -1;
    Py_INCREF(&EngineType);
    if (PyModule_AddObject(m, "Engine", (PyObject *)&EngineType) < 0) {
        Py_DECREF(&EngineType);
        return -1;
    }
    PyModule_AddIntConstant(m, "SERVE_INTERRUPTED", SERVE_INTERRUPTED);
    PyModule_AddIntConstant(m, "SERVE_LINK", SERVE_LINK);

    const char *names[N_COUNTERS] = {"iterations", "commands", "quiets", "bytes", "wrs", "writes", "signals",
                                     "signals_requested", "fences", "batches", "batches_full", "batches_partial",
                                     "signal_dest_batches", "stalls", "signal_stalls", "rejected", "completions",
                                     "completion_errors", "unknown_completions"};
    PyObject *t = PyTuple_New(N_COUNTERS);
    for (int i = 0; t && i < N_COUNTERS; i++) PyTuple_SET_ITEM(t, i, PyUnicode_FromString(names[i]));
    if (!t || PyModule_AddObject(m, "COUNTERS", t) < 0) {
        Py_XDECREF(t);
        return -1;
    }
    return 0;
}
