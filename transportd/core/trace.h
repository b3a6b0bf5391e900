/*
 * The trace recorder: every record the engine takes from a traced channel, appended to a file.
 *
 * A channel is traced while its tpd_trace pointer is set (Engine.trace_open .. trace_close); the engine
 * tests that pointer once per channel per pass that took records, so a channel not traced costs one
 * predictable branch and nothing per record. The Python side (transportd/dataplane/trace.py) opens the
 * file, writes nothing into it itself, and hands the engine its descriptor; the engine appends entries
 * through a buffer and writes the buffer out when it fills (inside the pass, GIL released) or when
 * asked (trace_flush, trace_close). A write that fails (disk full) drops that buffer's entries and
 * counts them: the data path never waits on the trace.
 *
 * Entry (72 bytes, little-endian; docs/trace.md, version 1):
 *
 *   bytes  0..47 | the 48-byte record as taken (seq as the producer stamped it)       |
 *   bytes 48..55 | t_ns:u64         CLOCK_MONOTONIC ns of the pass that took it      |
 *   bytes 56..63 | position:u64     the record's ring position                       |
 *   bytes 64..67 | channel:u32      the channel's id (low 32 bits)                   |
 *   bytes 68..69 | code:u16         the outcome (ErrorCode; 0 accepted)              |
 *   byte  70     | kind:u8          1 TAKEN: the take-time outcome                   |
 *                |                  2 FAILED: a later code for a record taken before |
 *                |                    (completion error, lost peer, client gone);    |
 *                |                    its record bytes are zero                      |
 *   byte  71     | reserved, 0                                                       |
 */
#ifndef TRANSPORTD_CORE_TRACE_H
#define TRANSPORTD_CORE_TRACE_H

#include <stddef.h>
#include <stdint.h>

#include <transportd/cmd_ring.h>

#define TPD_TRACE_TAKEN 1
#define TPD_TRACE_FAILED 2

typedef struct tpd_trace_entry {
    tpd_cmd_record record;
    uint64_t t_ns;
    uint64_t position;
    uint32_t channel;
    uint16_t code;
    uint8_t kind;
    uint8_t reserved;
} tpd_trace_entry;

TPD_STATIC_ASSERT(sizeof(tpd_trace_entry) == 72, "trace entry must be 72 bytes");
TPD_STATIC_ASSERT(offsetof(tpd_trace_entry, t_ns) == 48, "t_ns at 48");
TPD_STATIC_ASSERT(offsetof(tpd_trace_entry, position) == 56, "position at 56");
TPD_STATIC_ASSERT(offsetof(tpd_trace_entry, channel) == 64, "channel at 64");
TPD_STATIC_ASSERT(offsetof(tpd_trace_entry, code) == 68, "code at 68");
TPD_STATIC_ASSERT(offsetof(tpd_trace_entry, kind) == 70, "kind at 70");

typedef struct tpd_trace {
    int fd;                 /* the caller's descriptor: never closed here */
    uint32_t channel;
    tpd_trace_entry *buf;
    size_t n, cap;          /* entries buffered, buffer size */
    uint64_t entries;       /* entries accepted since open */
    uint64_t written;       /* entries written to fd */
    uint64_t dropped;       /* entries lost to a failed write */
    int last_errno;         /* of the last failed write, 0 if none */
} tpd_trace;

/* A recorder writing to `fd` through a buffer of `cap` entries (>= 1); NULL when out of memory. */
tpd_trace *tpd_trace_new(int fd, uint32_t channel, size_t cap);

/* Buffer `n` taken records (records[i] at position first + i, outcome codes[i]) taken at `t_ns`. */
void tpd_trace_taken(tpd_trace *t, const tpd_cmd_record *records, const uint16_t *codes, size_t n,
                     uint64_t first, int64_t t_ns);

/* Buffer a later outcome `code` for the record at `position`, known at `t_ns`. */
void tpd_trace_failed(tpd_trace *t, uint64_t position, uint16_t code, int64_t t_ns);

/* Write out what is buffered; 0, or -1 when a write failed (counted in dropped, errno in last_errno). */
int tpd_trace_flush(tpd_trace *t);

/* Flush and free (the descriptor stays open). */
void tpd_trace_free(tpd_trace *t);

#endif
