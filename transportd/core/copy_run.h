#ifndef TRANSPORTD_CORE_COPY_RUN_H
#define TRANSPORTD_CORE_COPY_RUN_H
#include <Python.h>

/* _core.copy_run: a run of copies into GPU memory queued on one stream and waited for once, GIL released
 * (copy_run.c) */
PyObject *tpd_copy_run(PyObject *mod, PyObject *args);
#endif
