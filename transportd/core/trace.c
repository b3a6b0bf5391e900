/* The trace recorder (trace.h): a buffer of fixed-size entries appended to a descriptor. */
#include "trace.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

tpd_trace *tpd_trace_new(int fd, uint32_t channel, size_t cap) {
    if (cap < 1) cap = 1;
    tpd_trace *t = calloc(1, sizeof(tpd_trace));
    if (!t) return NULL;
    t->buf = malloc(cap * sizeof(tpd_trace_entry));
    if (!t->buf) {
        free(t);
        return NULL;
    }
    t->fd = fd;
    t->channel = channel;
    t->cap = cap;
    return t;
}

int tpd_trace_flush(tpd_trace *t) {
    const char *p = (const char *)t->buf;
    size_t left = t->n * sizeof(tpd_trace_entry);
    int rc = 0;
    while (left) {
        ssize_t w = write(t->fd, p, left);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) {
            /* whole entries that made it out count as written; a torn tail is the reader's to ignore */
            t->last_errno = w < 0 ? errno : ENOSPC;
            rc = -1;
            break;
        }
        p += w;
        left -= (size_t)w;
    }
    uint64_t out = (uint64_t)(p - (const char *)t->buf) / sizeof(tpd_trace_entry);
    t->written += out;
    t->dropped += t->n - out;
    t->n = 0;
    return rc;
}

static tpd_trace_entry *next_entry(tpd_trace *t) {
    if (t->n == t->cap) tpd_trace_flush(t);
    t->entries++;
    return &t->buf[t->n++];
}

void tpd_trace_taken(tpd_trace *t, const tpd_cmd_record *records, const uint16_t *codes, size_t n,
                     uint64_t first, int64_t t_ns) {
    for (size_t i = 0; i < n; i++) {
        tpd_trace_entry *e = next_entry(t);
        e->record = records[i];
        e->t_ns = (uint64_t)t_ns;
        e->position = first + i;
        e->channel = t->channel;
        e->code = codes[i];
        e->kind = TPD_TRACE_TAKEN;
        e->reserved = 0;
    }
}

void tpd_trace_failed(tpd_trace *t, uint64_t position, uint16_t code, int64_t t_ns) {
    tpd_trace_entry *e = next_entry(t);
    memset(&e->record, 0, sizeof(e->record));
    e->t_ns = (uint64_t)t_ns;
    e->position = position;
    e->channel = t->channel;
    e->code = code;
    e->kind = TPD_TRACE_FAILED;
    e->reserved = 0;
}

void tpd_trace_free(tpd_trace *t) {
    if (!t) return;
    tpd_trace_flush(t);
    free(t->buf);
    free(t);
}
