/*
 * The C-level poster: how the engine reaches a backend's NIC without a Python call per pass.
 *
 * A backend that lowers plan rows in C (ib/csrc/ib_post.c, efa/csrc/efa_post.c) hands the engine a
 * tpd_poster in a PyCapsule named TPD_POSTER_CAPSULE; the engine then calls post/poll directly, with the GIL
 * released, instead of the backend's Python post/poll. This header and verbs_abi.h are what a backend's C
 * is built against (the only core headers it includes: tests/test_import_layers.py). Either call returns -1 on failure, after which the engine (holding the GIL
 * again) calls raise_error to set the Python exception. post/poll may take the GIL themselves
 * (PyGILState_Ensure: the softverbs shim does, once per pass), so they must be called without it.
 */
#ifndef TRANSPORTD_CORE_POSTER_H
#define TRANSPORTD_CORE_POSTER_H

#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

#include "validate.h"

#define TPD_POSTER_CAPSULE "transportd._core.poster"

/* One completed token; byte for byte transportd.backends.interface.COMPLETION_DTYPE. */
typedef struct tpd_completion {
    uint64_t token;
    uint32_t status;
    uint32_t vendor_err;
} tpd_completion;

typedef struct tpd_poster {
    void *ctx;
    /* batch b = plan[bounds[b]..bounds[b+1]) on connection conn_ids[b]; WRs per batch into nwr */
    int (*post)(void *ctx, size_t nb, const int64_t *conn_ids, const tpd_plan_row *plan, const int64_t *bounds,
                int64_t *nwr);
    /* up to max completed tokens into out; how many */
    long (*poll)(void *ctx, size_t max, tpd_completion *out);
    void (*raise_error)(void *ctx);
} tpd_poster;

/* A Python exception raised inside a C callback with no way to return it (a shim's Python call), kept
 * per thread until the caller that can raise it asks (GIL held for both). poster.c. */
void tpd_stash_exception(void);
int tpd_restore_exception(void);

/* What a poster failed with, kept until the engine (holding the GIL again) calls its raise_error: set by
 * tpd_fail where the failure happens (GIL released), turned into the Python exception by tpd_raise_error. */
enum { TPD_E_NONE, TPD_E_UNKNOWN, TPD_E_NOT_CONNECTED, TPD_E_SQ_FULL, TPD_E_VERBS, TPD_E_POLL, TPD_E_BAD_OP,
       TPD_E_NOMEM, TPD_E_PY };
typedef struct {
    int code, sys_errno;
    char msg[320];
} tpd_poster_error;

/* Record the failure (code, errno, printf-style message); returns -1 for `return tpd_fail(...)`. */
int tpd_fail(tpd_poster_error *e, int code, int sys_errno, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
/* Raise e's exception (GIL held): an exception stashed by a shim's Python call wins; then MemoryError for
 * TPD_E_NOMEM, exc_verbs(msg, errno) for verbs and poll failures, exc_sq_full (where not NULL) for a full
 * send queue, and exc_backend(msg) for the rest. */
void tpd_raise_error(const tpd_poster_error *e, struct _object *exc_backend, struct _object *exc_verbs,
                     struct _object *exc_sq_full);

/* The C struct behind a verbs handle: its attribute `name` (``ibv_qp_ex``, ``ibv_cq_ex``) is a capsule of that
 * name (the shims' and the pyverbs bridge's handles); NULL with a Python exception set otherwise. */
void *tpd_handle_pointer(struct _object *owner, const char *name);

/* Grow *p (of *cap items of `item` bytes) to hold at least `need`, doubling; -1 when out of memory.
 * Inline: the engine checks it once per waiting row, and the common case is the first comparison. */
static inline int tpd_grow(void **p, size_t *cap, size_t need, size_t item) {
    if (need <= *cap) return 0;
    size_t n = *cap ? *cap : 16;
    while (n < need) n *= 2;
    void *q = realloc(*p, n * item);
    if (!q) return -1;
    *p = q;
    *cap = n;
    return 0;
}

/* A poster type's Python post_batches(conn_ids, plan, bounds) -> bytes of int64 WR counts per batch:
 * checks the buffers, posts through iface with the GIL released, raises through iface on failure.
 * (struct _object is PyObject: this header needs no Python.h.) */
struct _object *tpd_post_batches_method(const tpd_poster *iface, struct _object *args);

/* A poster type's Python poll(max_completions) -> bytes of COMPLETION_DTYPE rows, polled through iface with
 * the GIL released. */
struct _object *tpd_poll_method(const tpd_poster *iface, struct _object *arg);

/* A shim QP's WR list (the WRs between wr_start and wr_complete), the part the RC shim (verbs_shim.c) and
 * efa's SRD shim (efa_shim.c) share: wr_start opens it, each wr_* call appends one fixed-size WR record (the
 * shim fills it), wr_set_* calls fill the last one, and wr_complete hands them all to the Python callable
 * `post` in one call (taking the GIL); its int result is the errno, EIO when it raised (the exception is
 * stashed, see above). The first error of a WR list sticks and fails its wr_complete, as a provider fails the
 * whole list. */
typedef struct {
    struct _object *post; /* post(bytes) -> errno; a strong reference */
    void *wrs;            /* n records of wr_size bytes */
    size_t n, cap, wr_size;
    int open, err;
    unsigned long long calls, posted; /* post calls made; WRs they accepted */
} tpd_shim_wr_list;

void tpd_shim_init(tpd_shim_wr_list *s, struct _object *post, size_t wr_size); /* takes a reference */
void tpd_shim_release(tpd_shim_wr_list *s);
void *tpd_shim_new_wr(tpd_shim_wr_list *s); /* a zeroed record to fill, or NULL with s->err set */
void *tpd_shim_cur_wr(tpd_shim_wr_list *s); /* the last record (for wr_set_*), or NULL with s->err set */
void tpd_shim_start(tpd_shim_wr_list *s);
void tpd_shim_abort(tpd_shim_wr_list *s);
int tpd_shim_complete(tpd_shim_wr_list *s);

/* What each part linked into transportd._core adds to the module (with the module as argument): the core's
 * verbs shim (verbs_shim.c: ShimQP, ShimCQ, abi_layout) and each backend's C, which defines its hook where it
 * lives: ib/csrc/ib_post.c (IbPoster), efa/csrc/efa_post.c (EfaPoster, SrdShimQP, the flag functions). The
 * module's init (module.c) calls them; it is the one place the core names a backend, because they share one
 * extension (setup.py says why). The engine itself reaches a backend only through the capsule above. */
int tpd_shim_register(void *module);
int tpd_ib_register(void *module);
int tpd_efa_register(void *module);

#endif
