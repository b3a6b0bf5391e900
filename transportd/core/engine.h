/*
 * The engine's state, and what its two halves share: engine.c, the loop (the engine proper: take, post,
 * progress, the serve loop), and engine_type.c, the Python type around it (transportd._core.Engine: its
 * constructor and destructor, the table, channel and connection calls, the stats).
 */
#ifndef TRANSPORTD_CORE_ENGINE_H
#define TRANSPORTD_CORE_ENGINE_H

#include <Python.h>

#include <stddef.h>
#include <stdint.h>

#include "poster.h"
#include "trace.h"
#include "validate.h"

#define HIST 9 /* batch-size histogram: index = commands in the batch (batch_max <= 8) */

enum {
    C_ITERATIONS, C_COMMANDS, C_QUIETS, C_BYTES, C_WRS, C_WRITES, C_SIGNALS, C_SIGNALS_REQUESTED, C_FENCES,
    C_BATCHES, C_BATCHES_FULL, C_BATCHES_PARTIAL, C_SIGNAL_DEST_BATCHES, C_STALLS, C_SIGNAL_STALLS, C_REJECTED,
    C_COMPLETIONS, C_COMPLETION_ERRORS, C_UNKNOWN_COMPLETIONS, N_COUNTERS
};

/* What the serve loop did, for tests and stats: passes in all, those that did work, idle passes while
 * spinning, watches of the ring heads (and naps after them), long-idle watches, returns for the link and
 * for interrupt(). */
enum { L_PASSES, L_BUSY, L_SPINS, L_WATCHES, L_NAPS, L_DEEP_WATCHES, L_LINK, L_INTERRUPTED, N_LOOP };

static inline uint32_t seq_for(uint64_t pos) { return (uint32_t)(pos % 0xFFFFFFFFull + 1); }

/* ---- tables --------------------------------------------------------------------------------------- */
typedef struct {
    tpd_sources view;
    Py_buffer bufs[4];
    int held;
} Sources;

typedef struct {
    tpd_peers view;
    Py_buffer bufs[10];
    int held;
    int64_t *conns; /* distinct connection indexes this job's records may feed */
    size_t nconns;
} Job;

/* A row waiting for its batch: the plan row and where it came from. */
typedef struct {
    tpd_plan_row row;
    uint64_t pos;
    int64_t t;
    int64_t chan;
    uint8_t first;  /* the row begins a command */
    uint8_t closes; /* its command closes its batch (NO_BATCH or FENCE) */
} Waiting;

typedef struct {
    int64_t id;
    int64_t inflight; /* WRs posted and not completed */
    uint64_t hist[HIST];
    uint64_t bytes;
    int holding;   /* its peer's daemon is restarting: records for it stay in the rings (rows still post) */
    int broken;    /* the far end stopped answering (retry exceeded): held, until the control plane decides */
    int broken_told;
    Waiting *rows; /* FIFO: rows[head..count) wait */
    size_t head, count, cap;
} Conn;

/* A ring the engine drains: the consumer's side of one of a client's channels (`id`, the channel's id),
 * not the client's handle (tpd::Channel, gpuclient's ChannelHandle). */
typedef struct {
    int64_t id;
    Py_buffer ring;
    uint8_t *base;
    uint64_t capacity, mask;
    const tpd_cmd_record *records;
    uint64_t position;  /* records taken */
    uint64_t completed; /* published completion position */
    int job, src;
    int gone;
    uint8_t *done; /* completed positions, mod track (a power of two: done[pos & (track - 1)]) */
    uint64_t track;
    int seen; /* the head record was seen waiting at seen_pos since seen_ns */
    uint64_t seen_pos;
    int64_t seen_ns;
    int touched, quiet;
    int blocked; /* the record at blocked_pos was for a held connection: wait_ready does not count it */
    uint64_t blocked_pos;
    uint64_t codes[256]; /* refused or failed records by ErrorCode: the error word keeps only the first */
    tpd_trace *trace;    /* set while the channel is traced (trace.h); NULL costs one branch per pass */
} DrainedRing;

/* A batch plan_post cut: waiting rows [start, end) of connection index `conn` (from its head), `cmds` commands. */
typedef struct {
    size_t conn, start, end, cmds;
} Cut;

/* The batches posted in one iteration: tokens first .. first+nb-1 and the commands they cover. */
typedef struct {
    size_t bytes; /* allocated, with the arrays after the struct: a finished group is kept for reuse */
    uint64_t first;
    size_t nb, ncmd, remaining;
    int64_t *tok_conn, *tok_nwr;
    uint8_t *done;
    int64_t *cmd_tok, *cmd_chan;
    uint64_t *cmd_pos;
    int64_t *tok_cmds; /* batch t's commands are cmd_*[tok_cmds[t] .. tok_cmds[t + 1]) */
} Group;

typedef tpd_completion Completion;

typedef struct {
    PyObject_HEAD
    int batch_max;
    int64_t window_ns;
    int64_t inflight_cap;
    int decoupled;
    uint64_t max_length;
    uint64_t max_take;
    int64_t poll_max;
    PyObject *post_cb, *poll_cb; /* None: the engine is its own null NIC */
    PyObject *poster_obj;        /* a backend's C poster (poster.h): post/poll without Python */
    tpd_poster *poster;
    int64_t *post_ids;
    size_t post_ids_cap;
    Completion *poll_buf;
    int taking;

    Sources *srcs;
    size_t nsrcs, srcs_cap;
    Job *jobs;
    size_t njobs, jobs_cap;
    Conn *conns;
    size_t nconns, conns_cap;
    DrainedRing **chans;
    size_t nchans, chans_cap;
    Group **groups;
    size_t ngroups, groups_cap;
    Group *spare[4]; /* finished groups kept for the next posts: no malloc and free a pass */
    size_t nspare;
    uint8_t *done_scratch; /* complete_tokens' arrays, kept across passes */
    size_t done_scratch_cap;
    uint64_t next_token;
    size_t nwaiting;

    uint64_t counters[N_COUNTERS];
    uint64_t errors[256];
    uint64_t batch_hist[HIST];

    /* scratch for one post */
    tpd_plan_row *plan;
    size_t plan_cap;
    int64_t *b_conn, *b_ncmds, *b_bounds, *b_nwr;
    size_t b_cap;
    Cut *cuts;
    size_t cuts_cap;
    tpd_cmd_record *recs; /* the records of one take of a traced channel, copied out of the ring */
    size_t recs_cap;
    uint16_t *tcode;      /* their codes */
    size_t t_cap;

    /* the null NIC: tokens due on the next poll; optional log of (post ns, chunk id) per WRITE */
    Completion *null_due;
    size_t null_ndue, null_cap;
    uint64_t *post_log;
    size_t post_log_n, post_log_cap;

    /* the GIL while a pass runs without it: the thread state it was released with, NULL while held */
    PyThreadState *ts;
    /* the serve loop (tpd_serve_loop, engine.c): interrupt() asks it to return; when the last pass that did work
     * ended (-1: it was busy), kept across serve calls so a request served does not restart the back-off */
    int interrupt;
    int64_t idle_since;
    int64_t pass_ns; /* the clock when the last pass began: the serve loop times its phases by it */
    uint64_t loop[N_LOOP];
} Engine;

/* ---- the GIL ------------------------------------------------------------------------------------------
 * A pass runs without the GIL (run_once releases it around one pass, serve around all of them) and takes
 * it back only for what is Python: a backend's post/poll callables, raising an error. A C poster that
 * calls Python (the softverbs shims, efa's one call per poll) takes the GIL itself (PyGILState_Ensure). */
static inline void gil_take(Engine *e) {
    if (e->ts) {
        PyEval_RestoreThread(e->ts);
        e->ts = NULL;
    }
}

static inline void gil_drop(Engine *e) {
    if (!e->ts) e->ts = PyEval_SaveThread();
}

/* ---- ring words ----------------------------------------------------------------------------------- */
static inline volatile uint64_t *ring_u64(DrainedRing *ch, size_t off) { return (volatile uint64_t *)(ch->base + off); }
static inline volatile uint32_t *ring_u32(DrainedRing *ch, size_t off) { return (volatile uint32_t *)(ch->base + off); }

static inline int record_ready(DrainedRing *ch, uint64_t pos) {
    const volatile uint32_t *seq = (const volatile uint32_t *)&ch->records[pos & ch->mask].seq;
    return __atomic_load_n(seq, __ATOMIC_ACQUIRE) == seq_for(pos);
}

static inline void publish_completion(DrainedRing *ch, uint64_t pos) {
    volatile uint64_t *word = ring_u64(ch, TPD_RING_OFF_COMPLETION_POS);
    if (pos > *word) __atomic_store_n(word, pos, __ATOMIC_RELEASE);
}

static inline DrainedRing *find_channel(Engine *e, int64_t id) {
    for (size_t i = 0; i < e->nchans; i++)
        if (e->chans[i]->id == id) return e->chans[i];
    return NULL;
}

static inline size_t conn_pending(const Conn *c) { return c->count - c->head; }

/* Rows wait or batches are in flight. */
static inline int busy(const Engine *e) { return e->nwaiting || e->ngroups; }

/* What tpd_watch found: nothing before its timeout, a committed record, or a reason to return. */
enum { WATCH_TIMEOUT, WATCH_FOUND, WATCH_WOKEN };

/* Why tpd_serve_loop returned, and its back-off (engine.c says what each knob does). */
enum { SERVE_INTERRUPTED = 0, SERVE_LINK = 1 };

typedef struct {
    int64_t spin, watch, nap, deep_after, deep_watch, deep_nap;
    int wake_fd;
    int64_t link_every; /* ns between looks at the link's descriptor while busy or spinning */
} Policy;

/* ---- the loop's entry points (engine.c), for the Python type -----------------------------------------
 * Hidden: the extension's own, so a call is direct (no PLT) and the compiler may inline them within the
 * loop, as when they were one file's statics.
 * tpd_run_pass, tpd_serve_loop and tpd_progress are called with the GIL released through gil_drop (e->ts set)
 * and take it back only for what is Python; -1 with a Python error set. tpd_watch reads the rings' head
 * slots and takes nothing, with or without the GIL. The rest touch only the engine's state and the rings. */
#pragma GCC visibility push(hidden)
int tpd_run_pass(Engine *e, int *did);                       /* one pass; *did whether it did work */
int tpd_serve_loop(Engine *e, const Policy *p, int *reason); /* passes until the link or interrupt() */
long tpd_progress(Engine *e);                                /* drain completions; how many came */
int tpd_watch(Engine *e, int64_t timeout_ns, int64_t nap_ns, int wake_fd); /* WATCH_* */
void tpd_advance_touched(Engine *e);
void tpd_unblock_channels(Engine *e);
void tpd_note_waiting(DrainedRing *ch, int64_t now);
int tpd_drop_waiting(Engine *e, int64_t chan, int64_t conn, uint16_t code, int mark); /* -1: no memory */
int tpd_fail_connection(Engine *e, int64_t conn, uint16_t code);                      /* -1: no memory */
#pragma GCC visibility pop

/* Add the Engine type and its constants (SERVE_*, COUNTERS) to the module (engine_type.c). */
int tpd_engine_register(PyObject *module);

#endif
