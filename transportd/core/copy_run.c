/*
 * A run of copies into GPU memory, queued on one stream and waited for once, with the GIL released for all of
 * it: softverbs' in-order writes placed by a rail worker (transportd.dataplane.gpu_memory.GpuAccessor.copy_many).
 *
 * Queued from Python one driver call at a time, every call gave the GIL up and took it back, and in a rail
 * worker (its serve loop, softverbs' I/O and requester threads) each take waits its turn: a run of 16 took
 * twice as long to queue there as in a quiet process. Here the pieces are staged under the GIL, then queued
 * and waited for without it.
 *
 * The driver is reached through two entry points the caller passes as addresses (libcuda's cuMemcpyAsync and
 * cuStreamSynchronize, or a test's stand-ins), so this file needs no CUDA header or library to build.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "copy_run.h"

typedef int (*memcpy_async_fn)(uint64_t dst, uint64_t src, size_t length, void *stream);
typedef int (*stream_sync_fn)(void *stream);

typedef struct {
    uint64_t dst, src, length;
    int host; /* src is host bytes (staged or held), not an address the caller gave */
} piece;

/* copy_run(memcpy_fn, sync_fn, stream, copies, stage, stage_size) -> (CUresult, index)
 *
 * copies: a sequence of (dst, src, length); src is an address, or a buffer of host bytes to store at dst. Host
 * bytes are copied into the pinned `stage` (stage_size bytes) while it has room, else copied from where they
 * are (pageable: the driver stages them itself). Every piece is queued in order on `stream` (pieces that
 * continue each other joined into one copy, below), then one synchronize; (0, pieces) when all landed,
 * (error, i) when the copy starting with piece i could not be queued (the copies before it are waited for),
 * (error, -1) when the synchronize failed. */
PyObject *tpd_copy_run(PyObject *mod, PyObject *args) {
    unsigned long long memcpy_addr, sync_addr, stream, stage;
    Py_ssize_t stage_size;
    PyObject *copies;
    if (!PyArg_ParseTuple(args, "KKKOKn", &memcpy_addr, &sync_addr, &stream, &copies, &stage, &stage_size))
        return NULL;
    if (!memcpy_addr || !sync_addr) return PyErr_Format(PyExc_ValueError, "copy_run: no driver entry point");
    PyObject *seq = PySequence_Fast(copies, "copy_run: copies must be a sequence of (dst, src, length)");
    if (!seq) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    piece *pieces = PyMem_Calloc(n ? n : 1, sizeof(piece));
    Py_buffer *held = PyMem_Calloc(n ? n : 1, sizeof(Py_buffer)); /* unstaged host bytes, kept until the wait */
    if (!pieces || !held) {
        PyMem_Free(pieces);
        PyMem_Free(held);
        Py_DECREF(seq);
        return PyErr_NoMemory();
    }
    Py_ssize_t count = 0, nheld = 0, staged = 0;
    PyObject *result = NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PySequence_Fast_GET_ITEM(seq, i), *src;
        unsigned long long dst, length;
        if (!PyTuple_Check(item) || PyTuple_GET_SIZE(item) != 3) {
            PyErr_Format(PyExc_TypeError, "copy_run: each copy is (dst, src, length), not copy %zd", i);
            goto out;
        }
        if (!PyArg_ParseTuple(item, "KOK", &dst, &src, &length)) goto out;
        if (!length) continue;
        piece *p = &pieces[count];
        p->dst = dst;
        p->length = length;
        if (PyLong_Check(src)) {
            p->src = PyLong_AsUnsignedLongLong(src);
            if (PyErr_Occurred()) goto out;
        } else {
            p->host = 1;
            Py_buffer *view = &held[nheld];
            if (PyObject_GetBuffer(src, view, PyBUF_C_CONTIGUOUS) < 0) goto out;
            if ((unsigned long long)view->len < length) {
                PyBuffer_Release(view);
                PyErr_Format(PyExc_ValueError, "copy_run: copy %zd has %zd host bytes, not %llu", i, view->len,
                             length);
                goto out;
            }
            if (stage && (unsigned long long)(stage_size - staged) >= length) {
                memcpy((uint8_t *)(uintptr_t)stage + staged, view->buf, length);
                p->src = stage + staged;
                staged += (Py_ssize_t)length;
                PyBuffer_Release(view);
            } else {
                p->src = (uint64_t)(uintptr_t)view->buf;
                nheld++;
            }
        }
        count++;
    }
    memcpy_async_fn queue = (memcpy_async_fn)(uintptr_t)memcpy_addr;
    stream_sync_fn wait = (stream_sync_fn)(uintptr_t)sync_addr;
    void *s = (void *)(uintptr_t)stream;
    int err = 0;
    Py_ssize_t at = count;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0, next; i < count; i = next) {
        /* Pieces that continue piece i at both ends go with it as one copy: each cuMemcpyAsync is a kernel of
         * its own (3-4 us apiece on an H100, and each needs room on an SM beside a running GEMM), and a MoE
         * group's rows arrive as several writes that do continue each other. Only where the joined source and
         * destination do not overlap: then no piece reads what an earlier one of the same copy writes, and the
         * bytes that land are those of the pieces one by one. Host bytes join host bytes only, addresses
         * addresses (a staged piece that happened to end where a device source begins stays apart). */
        piece joined = pieces[i];
        for (next = i + 1; next < count; next++) {
            const piece *p = &pieces[next];
            uint64_t length = joined.length + p->length;
            if (p->host != joined.host || joined.dst + joined.length != p->dst || joined.src + joined.length != p->src
                || (joined.src < joined.dst + length && joined.dst < joined.src + length))
                break;
            joined.length = length;
        }
        err = queue(joined.dst, joined.src, (size_t)joined.length, s);
        if (err) {
            at = i;
            break;
        }
    }
    int synced = wait(s); /* after a failed queue too: what was queued reads the stage and the held bytes */
    if (!err && synced) {
        err = synced;
        at = -1;
    }
    Py_END_ALLOW_THREADS
    result = Py_BuildValue("(in)", err, at);
out:
    for (Py_ssize_t i = 0; i < nheld; i++) PyBuffer_Release(&held[i]);
    PyMem_Free(pieces);
    PyMem_Free(held);
    Py_DECREF(seq);
    return result;
}
