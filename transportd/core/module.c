/*
 * transportd._core, the module: the engine's type (engine_type.c), the verbs shim's (verbs_shim.c), each
 * backend's C linked into it (ib/csrc, efa/csrc: their register hooks, poster.h), the record and row sizes,
 * the benchmark's two C loops (pingpong.c), and the soft fabric's run of GPU copies (copy_run.c).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "copy_run.h"
#include "engine.h"
#include "pingpong.h"

/* A producer's two buffers, both writable: a mapped ring (its capacity in *capacity) and `n` int64 results.
 * -1 with an error set, both released, when either cannot be had or does not fit (`what` names the caller). */
static int producer_buffers(const char *what, PyObject *ring, PyObject *out, uint64_t n, Py_buffer *rv,
                            Py_buffer *ov, uint64_t *capacity) {
    if (PyObject_GetBuffer(ring, rv, PyBUF_WRITABLE) < 0) return -1;
    if (PyObject_GetBuffer(out, ov, PyBUF_WRITABLE) < 0) {
        PyBuffer_Release(rv);
        return -1;
    }
    *capacity = rv->len >= TPD_RING_RECORDS_OFFSET ? *(uint64_t *)((uint8_t *)rv->buf + TPD_RING_OFF_CAPACITY) : 0;
    if ((uint64_t)ov->len >= n * 8 && *capacity) return 0;
    PyBuffer_Release(rv);
    PyBuffer_Release(ov);
    PyErr_Format(PyExc_ValueError, "%s: results buffer too short, or not a ring", what);
    return -1;
}

/* pingpong_produce(ring buffer, count, peers, length, stamps int64 buffer, timeout_s) -> completed count */
static PyObject *pingpong_produce(PyObject *mod, PyObject *args) {
    PyObject *ring, *stamps;
    unsigned long long count;
    unsigned peers, length;
    double timeout;
    if (!PyArg_ParseTuple(args, "OKIIOd", &ring, &count, &peers, &length, &stamps, &timeout)) return NULL;
    if (!peers) return PyErr_Format(PyExc_ValueError, "pingpong_produce: no peers");
    Py_buffer rv, sv;
    uint64_t capacity;
    if (producer_buffers("pingpong_produce", ring, stamps, count, &rv, &sv, &capacity)) return NULL;
    int64_t done;
    Py_BEGIN_ALLOW_THREADS
    done = tpd_pingpong_produce(rv.buf, count, (uint16_t)peers, length, sv.buf, (int64_t)(timeout * 1e9));
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&rv);
    PyBuffer_Release(&sv);
    return PyLong_FromLongLong(done);
}

/* burst_produce(ring buffer, bursts, burst, peers, length, round-trip int64 buffer, timeout_s) -> completed
 * bursts (pingpong.c), GIL released */
static PyObject *burst_produce(PyObject *mod, PyObject *args) {
    PyObject *ring, *out;
    unsigned long long bursts, burst;
    unsigned peers, length;
    double timeout;
    if (!PyArg_ParseTuple(args, "OKKIIOd", &ring, &bursts, &burst, &peers, &length, &out, &timeout)) return NULL;
    if (!peers || !burst) return PyErr_Format(PyExc_ValueError, "burst_produce: no peers, or a burst of 0");
    Py_buffer rv, ov;
    uint64_t capacity;
    if (producer_buffers("burst_produce", ring, out, bursts, &rv, &ov, &capacity)) return NULL;
    if (burst > capacity) {
        PyBuffer_Release(&rv);
        PyBuffer_Release(&ov);
        return PyErr_Format(PyExc_ValueError, "burst_produce: a burst of %llu passes the ring's %llu slots", burst,
                            (unsigned long long)capacity);
    }
    int64_t done;
    Py_BEGIN_ALLOW_THREADS
    done = tpd_burst_produce(rv.buf, bursts, burst, (uint16_t)peers, length, ov.buf, (int64_t)(timeout * 1e9));
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&rv);
    PyBuffer_Release(&ov);
    return PyLong_FromLongLong(done);
}

/* bare_drain(ring buffer, until, timeout_s, parity=False, idle_pauses=0) -> consumer position reached
 * (pingpong.c), GIL released; parity: the records are per-word parity, not header-last; idle_pauses: spin-wait
 * hints between looks at a slot not committed yet */
static PyObject *bare_drain(PyObject *mod, PyObject *args) {
    PyObject *ring;
    unsigned long long until;
    double timeout;
    int parity = 0;
    unsigned pauses = 0;
    if (!PyArg_ParseTuple(args, "OKd|pI", &ring, &until, &timeout, &parity, &pauses)) return NULL;
    Py_buffer rv;
    if (PyObject_GetBuffer(ring, &rv, PyBUF_WRITABLE) < 0) return NULL;
    if (rv.len < TPD_RING_RECORDS_OFFSET) {
        PyBuffer_Release(&rv);
        return PyErr_Format(PyExc_ValueError, "bare_drain: not a ring");
    }
    uint64_t pos;
    Py_BEGIN_ALLOW_THREADS
    pos = tpd_bare_drain(rv.buf, until, (int64_t)(timeout * 1e9), pauses, parity);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&rv);
    return PyLong_FromUnsignedLongLong(pos);
}

static PyMethodDef core_functions[] = {
    {"bare_drain", bare_drain, METH_VARARGS, "Benchmark ceiling: the bare C consumer of a ring (pingpong.c)."},
    {"pingpong_produce", pingpong_produce, METH_VARARGS, "Benchmark producer: one record at a time (pingpong.c)."},
    {"burst_produce", burst_produce, METH_VARARGS, "Benchmark producer: bursts, each waited for (pingpong.c)."},
    {"copy_run", tpd_copy_run, METH_VARARGS, "A run of copies into GPU memory, queued and waited for without the GIL."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef core_module = {PyModuleDef_HEAD_INIT, "transportd._core",
                                         "The compiled data path of the proxy (see engine.c).", -1,
                                         core_functions};

PyMODINIT_FUNC PyInit__core(void) {
    PyObject *m = PyModule_Create(&core_module);
    if (!m) return NULL;
    if (tpd_engine_register(m) < 0 || tpd_ib_register(m) < 0 || tpd_shim_register(m) < 0 ||
        tpd_efa_register(m) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    PyModule_AddIntConstant(m, "PLAN_ROW_SIZE", sizeof(tpd_plan_row));
    PyModule_AddIntConstant(m, "COMPLETION_SIZE", sizeof(tpd_completion));
    PyModule_AddIntConstant(m, "RECORD_SIZE", sizeof(tpd_cmd_record));
    PyModule_AddIntConstant(m, "TRACE_ENTRY_SIZE", sizeof(tpd_trace_entry));
    return m;
}
