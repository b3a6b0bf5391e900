/*
 * The C-level poster: how the engine reaches a backend's NIC without a Python call per pass.
 *
 * A backend that lowers plan rows in C (ib_post.c) hands the engine a tpd_poster in a PyCapsule named
 * TPD_POSTER_CAPSULE; the engine then calls post/poll directly, with the GIL released, instead of the
 * backend's Python post/poll. Either call returns -1 on failure, after which the engine (holding the GIL
 * again) calls raise_error to set the Python exception. post/poll may take the GIL themselves
 * (PyGILState_Ensure: the softverbs shim does, once per pass), so they must be called without it.
 */
#ifndef TRANSPORTD_CORE_POSTER_H
#define TRANSPORTD_CORE_POSTER_H

#include <stddef.h>
#include <stdint.h>

#include "validate.h"

#define TPD_POSTER_CAPSULE "transportd._core.poster"

/* One completed token; byte for byte transportd.backend.COMPLETION_DTYPE. */
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
 * per thread until the caller that can raise it asks (GIL held for both). */
void tpd_stash_exception(void);
int tpd_restore_exception(void);

/* The types ib_post.c and verbs_shim.c add to transportd._core (with a Python object argument). */
int tpd_ib_register(void *module);
int tpd_shim_register(void *module);
int tpd_efa_register(void *module); /* efa_post.c: EfaPoster, SrdShimQP */

#endif
