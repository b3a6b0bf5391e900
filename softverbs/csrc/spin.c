/*
 * softverbs._spin: the I/O thread's wait without sleeping. wait_readable(epfd, spin_ns) looks at an epoll
 * set with a zero timeout, the GIL released, until one of its descriptors is ready (True) or spin_ns have
 * passed (False). It takes nothing off the set: the selector's own select() reads the events next (level
 * triggered). A thread that is awake takes the next frame at once, where one asleep in epoll pays the host's
 * wake-up first (tens of microseconds a step); see softverbs._device, DeviceOptions.io_spin_s.
 *
 * wait_ready(epfd, timeout_ms) sleeps in epoll_wait with the GIL released and says when the set became ready,
 * read before the GIL is taken back: a traced I/O thread stamps it, so a trace tells the wait for the GIL from
 * the work after it.
 *
 * spin_until(deadline_ns) waits, awake and with the GIL released, until CLOCK_MONOTONIC (Python's
 * time.monotonic_ns) reaches deadline_ns: a posting thread holding a shaped request until the NIC model says
 * it lands (DeviceOptions.nic_spin_s), a few microseconds, where a sleep would overshoot by tens.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <stdint.h>
#include <sys/epoll.h>
#include <time.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define cpu_relax() _mm_pause()
#else
#define cpu_relax() __asm__ __volatile__("" ::: "memory")
#endif

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static PyObject *wait_readable(PyObject *self, PyObject *args) {
    int epfd;
    long long spin_ns;
    if (!PyArg_ParseTuple(args, "iL", &epfd, &spin_ns)) return NULL;
    int ready = 0, err = 0;
    Py_BEGIN_ALLOW_THREADS
    int64_t deadline = now_ns() + spin_ns;
    struct epoll_event ev;
    for (;;) {
        int n = epoll_wait(epfd, &ev, 1, 0);
        if (n > 0) {
            ready = 1;
            break;
        }
        if (n < 0 && errno != EINTR) {
            err = errno;
            break;
        }
        if (now_ns() >= deadline) break;
        for (int i = 0; i < 16; i++) cpu_relax(); /* a look costs a syscall: a few hundred ns apart is enough */
    }
    Py_END_ALLOW_THREADS
    if (err) {
        errno = err;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    return PyBool_FromLong(ready);
}

static PyObject *spin_until(PyObject *self, PyObject *args) {
    long long deadline_ns;
    if (!PyArg_ParseTuple(args, "L", &deadline_ns)) return NULL;
    Py_BEGIN_ALLOW_THREADS
    while (now_ns() < deadline_ns) cpu_relax();
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *wait_ready(PyObject *self, PyObject *args) {
    int epfd, timeout_ms;
    if (!PyArg_ParseTuple(args, "ii", &epfd, &timeout_ms)) return NULL;
    int n, err = 0;
    int64_t at = 0;
    Py_BEGIN_ALLOW_THREADS
    struct epoll_event ev;
    do {
        n = epoll_wait(epfd, &ev, 1, timeout_ms);
    } while (n < 0 && errno == EINTR);
    if (n < 0) err = errno;
    else if (n > 0) at = now_ns(); /* before the GIL is taken back: what follows this is the wait for it */
    Py_END_ALLOW_THREADS
    if (err) {
        errno = err;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    return PyLong_FromLongLong(at);
}

static PyMethodDef methods[] = {
    {"wait_readable", wait_readable, METH_VARARGS,
     "wait_readable(epfd, spin_ns) -> bool: poll the epoll set without sleeping, GIL released, until one of its "
     "descriptors is ready (True) or spin_ns pass (False); consumes no event."},
    {"wait_ready", wait_ready, METH_VARARGS,
     "wait_ready(epfd, timeout_ms) -> int: sleep in epoll_wait, GIL released, until one of the set's descriptors "
     "is ready (-1: no timeout); the CLOCK_MONOTONIC ns at which it was, read before the GIL is taken back, or 0 "
     "when the timeout passed; consumes no event."},
    {"spin_until", spin_until, METH_VARARGS,
     "spin_until(deadline_ns): wait awake, GIL released, until time.monotonic_ns() >= deadline_ns."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "softverbs._spin",
    .m_doc = "Waits without sleeping: the soft device's I/O thread before it sleeps in epoll, a posting thread "
              "until a shaped request lands.",
    .m_size = -1,
    .m_methods = methods,
};

PyMODINIT_FUNC PyInit__spin(void) { return PyModule_Create(&module); }
