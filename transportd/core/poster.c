/*
 * What the backends' posters (ib/csrc/ib_post.c, efa/csrc/efa_post.c) and the verbs shims (verbs_shim.c here,
 * efa/csrc/efa_shim.c) share: growing arrays, exceptions raised inside callbacks, the Python entry point that
 * posts batches, and the one Python call a shim makes per wr_complete.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "poster.h"

/* ---- exceptions from inside callbacks ---------------------------------------------------------------- */
static __thread PyObject *stash_type, *stash_value, *stash_tb;

void tpd_stash_exception(void) {
    PyObject *t, *v, *tb;
    PyErr_Fetch(&t, &v, &tb);
    if (stash_type) { /* keep the first */
        Py_XDECREF(t);
        Py_XDECREF(v);
        Py_XDECREF(tb);
        return;
    }
    stash_type = t;
    stash_value = v;
    stash_tb = tb;
}

int tpd_restore_exception(void) {
    if (!stash_type) return 0;
    PyErr_Restore(stash_type, stash_value, stash_tb);
    stash_type = stash_value = stash_tb = NULL;
    return 1;
}

/* ---- post_batches(conn_ids, plan, bounds) ----------------------------------------------------------- */
PyObject *tpd_post_batches_method(const tpd_poster *iface, PyObject *args) {
    Py_buffer ids, plan, bounds;
    if (!PyArg_ParseTuple(args, "y*y*y*", &ids, &plan, &bounds)) return NULL;
    PyObject *res = NULL;
    size_t nb = (size_t)ids.len / sizeof(int64_t);
    if ((size_t)bounds.len != (nb + 1) * sizeof(int64_t) || plan.len % sizeof(tpd_plan_row) ||
        ids.len % sizeof(int64_t)) {
        PyErr_SetString(PyExc_ValueError, "conn_ids (int64), plan (PLAN_DTYPE) and bounds (int64, one more) expected");
        goto out;
    }
    const int64_t *b = bounds.buf;
    size_t nrows = (size_t)plan.len / sizeof(tpd_plan_row);
    for (size_t i = 0; i < nb; i++) {
        if (b[i] < 0 || b[i] > b[i + 1] || (size_t)b[i + 1] > nrows) {
            PyErr_SetString(PyExc_ValueError, "bounds must rise within the plan");
            goto out;
        }
    }
    res = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(nb * sizeof(int64_t)));
    if (!res) goto out;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = iface->post(iface->ctx, nb, ids.buf, plan.buf, b, (int64_t *)PyBytes_AS_STRING(res));
    Py_END_ALLOW_THREADS
    if (rc) {
        Py_CLEAR(res);
        iface->raise_error(iface->ctx);
    }
out:
    PyBuffer_Release(&ids);
    PyBuffer_Release(&plan);
    PyBuffer_Release(&bounds);
    return res;
}

/* ---- poll(max_completions) ------------------------------------------------------------------------ */
PyObject *tpd_poll_method(const tpd_poster *iface, PyObject *arg) {
    Py_ssize_t max = PyLong_AsSsize_t(arg);
    if (max == -1 && PyErr_Occurred()) return NULL;
    if (max < 1) max = 1;
    PyObject *res = PyBytes_FromStringAndSize(NULL, max * (Py_ssize_t)sizeof(tpd_completion));
    if (!res) return NULL;
    long n;
    Py_BEGIN_ALLOW_THREADS
    n = iface->poll(iface->ctx, (size_t)max, (tpd_completion *)PyBytes_AS_STRING(res));
    Py_END_ALLOW_THREADS
    if (n < 0) {
        Py_DECREF(res);
        iface->raise_error(iface->ctx);
        return NULL;
    }
    if (_PyBytes_Resize(&res, n * (Py_ssize_t)sizeof(tpd_completion))) return NULL;
    return res;
}

/* ---- a poster's last error ---------------------------------------------------------------------------- */
int tpd_fail(tpd_poster_error *e, int code, int sys_errno, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(e->msg, sizeof e->msg, fmt, ap);
    va_end(ap);
    e->code = code;
    e->sys_errno = sys_errno;
    return -1;
}

void tpd_raise_error(const tpd_poster_error *e, PyObject *exc_backend, PyObject *exc_verbs, PyObject *exc_sq_full) {
    if (tpd_restore_exception()) return;
    switch (e->code) {
    case TPD_E_NOMEM:
        PyErr_NoMemory();
        return;
    case TPD_E_VERBS:
    case TPD_E_POLL: {
        PyObject *exc = PyObject_CallFunction(exc_verbs, "si", e->msg, e->sys_errno);
        if (exc) {
            PyErr_SetObject(exc_verbs, exc);
            Py_DECREF(exc);
        }
        return;
    }
    case TPD_E_SQ_FULL:
        if (exc_sq_full) {
            PyErr_SetString(exc_sq_full, e->msg);
            return;
        }
        break;
    default:
        break;
    }
    PyErr_SetString(exc_backend, e->msg);
}

/* ---- verbs handles ------------------------------------------------------------------------------------ */
void *tpd_handle_pointer(PyObject *owner, const char *name) {
    PyObject *cap = PyObject_GetAttrString(owner, name);
    if (!cap) return NULL;
    void *ptr = PyCapsule_GetPointer(cap, name);
    Py_DECREF(cap);
    return ptr;
}

/* ---- a shim QP's WR list ---------------------------------------------------------------------------- */
void tpd_shim_init(tpd_shim_wr_list *s, PyObject *post, size_t wr_size) {
    memset(s, 0, sizeof *s);
    Py_INCREF(post);
    s->post = post;
    s->wr_size = wr_size;
}

void tpd_shim_release(tpd_shim_wr_list *s) {
    Py_CLEAR(s->post);
    free(s->wrs);
    s->wrs = NULL;
    s->n = s->cap = 0;
}

void *tpd_shim_new_wr(tpd_shim_wr_list *s) {
    if (!s->open || s->err) {
        if (!s->open) s->err = EINVAL; /* a WR outside wr_start .. wr_complete */
        return NULL;
    }
    if (tpd_grow(&s->wrs, &s->cap, s->n + 1, s->wr_size)) {
        s->err = ENOMEM;
        return NULL;
    }
    void *w = (char *)s->wrs + s->n++ * s->wr_size;
    memset(w, 0, s->wr_size);
    return w;
}

void *tpd_shim_cur_wr(tpd_shim_wr_list *s) {
    if (s->err) return NULL;
    if (!s->open || !s->n) { /* a wr_set_* with no WR to set */
        s->err = EINVAL;
        return NULL;
    }
    return (char *)s->wrs + (s->n - 1) * s->wr_size;
}

void tpd_shim_start(tpd_shim_wr_list *s) {
    s->open = 1;
    s->err = 0;
    s->n = 0;
}

void tpd_shim_abort(tpd_shim_wr_list *s) {
    s->open = 0;
    s->n = 0;
}

/* The one Python call of a pass. */
int tpd_shim_complete(tpd_shim_wr_list *s) {
    int err = s->open ? s->err : EINVAL;
    size_t n = s->n;
    s->open = 0;
    s->n = 0;
    if (err) return err;
    if (!n) return 0;
    PyGILState_STATE g = PyGILState_Ensure();
    int rc = EIO;
    PyObject *buf = PyBytes_FromStringAndSize((const char *)s->wrs, (Py_ssize_t)(n * s->wr_size));
    PyObject *res = buf ? PyObject_CallOneArg(s->post, buf) : NULL;
    Py_XDECREF(buf);
    if (res) {
        long v = PyLong_AsLong(res);
        Py_DECREF(res);
        if (!(v == -1 && PyErr_Occurred())) rc = (int)v;
    }
    if (PyErr_Occurred()) tpd_stash_exception(); /* raised by the poster's caller */
    PyGILState_Release(g);
    s->calls++;
    if (!rc) s->posted += n;
    return rc;
}
