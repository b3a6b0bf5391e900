/*
 * The verbs shim: a struct ibv_qp_ex and a struct ibv_cq_ex whose function pointers are ours, so the ib
 * lowering (ib/csrc/ib_post.c) that drives a NIC through pyverbs' structs drives softverbs (or any Python verbs
 * provider) unchanged, with one Python call per pass each way (transportd._core.ShimQP / ShimCQ).
 *
 * ShimQP: wr_start() opens a WR list; every wr_<op>() appends one record (SHIM_WR below, the dtype
 * transportd.backends.verbs_shim.SHIM_WR_DTYPE) carrying wr_id and wr_flags as they were at that call; the
 * wr_set_*() calls fill the current record (inline data copied at the call, as providers copy it into the
 * WQE); wr_complete() hands the whole array to the Python `post` callable in ONE call and returns its
 * errno (all or nothing, as ibv_wr_complete(3) posts the WRs since ibv_wr_start); wr_abort() drops it. A
 * setter with no open WR, or inline data longer than the record holds, fails the list (EINVAL).
 *
 * ShimCQ: start_poll() calls the Python `poll(n)` once when the shim holds no entries and keeps what it
 * returns (WC_DTYPE rows); next_poll() walks them in C. Entries a caller did not get to stay for the next
 * start_poll, as they stay in a hardware CQ. With `doorbell` (an 8-byte count the provider bumps after it
 * queues a completion: softverbs.soft.batch.doorbell) an unchanged count since the last poll that drained
 * the CQ answers ENOENT without the GIL: a spinning worker's idle passes then leave the GIL to the
 * provider's threads, whose every step (a frame read, a copy placed, an ack) needs it.
 *
 * The records are also what the ABI tests read: what reached wr_rdma_write, wr_set_sge, ... call by call.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <arpa/inet.h>
#include <errno.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#include "poster.h"
#include "verbs_abi.h"

enum { WR_RDMA_WRITE = 0, WR_RDMA_WRITE_WITH_IMM = 1, WR_SEND = 2, WR_SEND_WITH_IMM = 3, WR_RDMA_READ = 4,
       WR_ATOMIC_CMP_AND_SWP = 5, WR_ATOMIC_FETCH_AND_ADD = 6 }; /* enum ibv_wr_opcode */
enum { SET_SGE = 1, SET_INLINE = 2, SET_UD = 4, SET_SGE_LIST = 8 };
#define SHIM_INLINE_MAX 32

/* One collected WR; byte for byte transportd.backends.verbs_shim.SHIM_WR_DTYPE (a test compares them). */
typedef struct {
    uint64_t wr_id;
    uint64_t raddr;
    uint64_t add; /* fetch-add operand, or compare-and-swap's compare */
    uint64_t swap;
    uint64_t sge_addr;
    uint32_t sge_length;
    uint32_t sge_lkey;
    uint32_t rkey;
    uint32_t flags; /* wr_flags */
    uint32_t imm;   /* as passed: big-endian */
    uint8_t opcode; /* enum ibv_wr_opcode */
    uint8_t setters; /* which wr_set_* calls reached it */
    uint16_t inline_length;
    uint8_t inline_data[SHIM_INLINE_MAX];
} ShimWr;
_Static_assert(sizeof(ShimWr) == 96, "ShimWr layout");

/* One completion as the poll callable returns it; byte for byte transportd.backends.verbs_common.WC_DTYPE. */
typedef struct {
    uint64_t wr_id;
    uint32_t status, opcode, vendor_err, imm, byte_len, qp_num, wc_flags;
    uint8_t unsolicited;
} ShimWc;
_Static_assert(sizeof(ShimWc) == 40, "ShimWc layout");

#define container(ptr, type, member) ((type *)((char *)(ptr) - offsetof(type, member)))

/* ---- QP ----------------------------------------------------------------------------------------------- */
typedef struct {
    PyObject_HEAD
    struct ibv_qp_ex ex;
    tpd_shim_wr_list wr_list; /* of ShimWr records */
} ShimQP;

static ShimQP *qp_of(struct ibv_qp_ex *qp) { return container(qp, ShimQP, ex); }

static ShimWr *new_wr(struct ibv_qp_ex *qp, uint8_t opcode, uint32_t rkey, uint64_t raddr) {
    ShimWr *w = tpd_shim_new_wr(&qp_of(qp)->wr_list);
    if (!w) return NULL;
    w->wr_id = qp->wr_id;
    w->flags = qp->wr_flags;
    w->opcode = opcode;
    w->rkey = rkey;
    w->raddr = raddr;
    return w;
}

static ShimWr *cur_wr(struct ibv_qp_ex *qp) { return tpd_shim_cur_wr(&qp_of(qp)->wr_list); }

static void shim_cmp_swp(struct ibv_qp_ex *qp, uint32_t rkey, uint64_t raddr, uint64_t compare, uint64_t swap) {
    ShimWr *w = new_wr(qp, WR_ATOMIC_CMP_AND_SWP, rkey, raddr);
    if (w) {
        w->add = compare;
        w->swap = swap;
    }
}
static void shim_fetch_add(struct ibv_qp_ex *qp, uint32_t rkey, uint64_t raddr, uint64_t add) {
    ShimWr *w = new_wr(qp, WR_ATOMIC_FETCH_AND_ADD, rkey, raddr);
    if (w) w->add = add;
}
static void shim_rdma_read(struct ibv_qp_ex *qp, uint32_t rkey, uint64_t raddr) { new_wr(qp, WR_RDMA_READ, rkey, raddr); }
static void shim_rdma_write(struct ibv_qp_ex *qp, uint32_t rkey, uint64_t raddr) {
    new_wr(qp, WR_RDMA_WRITE, rkey, raddr);
}
static void shim_rdma_write_imm(struct ibv_qp_ex *qp, uint32_t rkey, uint64_t raddr, tpd_be32 imm) {
    ShimWr *w = new_wr(qp, WR_RDMA_WRITE_WITH_IMM, rkey, raddr);
    if (w) w->imm = imm;
}
static void shim_send(struct ibv_qp_ex *qp) { new_wr(qp, WR_SEND, 0, 0); }
static void shim_send_imm(struct ibv_qp_ex *qp, tpd_be32 imm) {
    ShimWr *w = new_wr(qp, WR_SEND_WITH_IMM, 0, 0);
    if (w) w->imm = imm;
}
static void shim_set_sge(struct ibv_qp_ex *qp, uint32_t lkey, uint64_t addr, uint32_t length) {
    ShimWr *w = cur_wr(qp);
    if (!w) return;
    w->sge_addr = addr;
    w->sge_length = length;
    w->sge_lkey = lkey;
    w->inline_length = 0;
    w->setters |= SET_SGE;
}
static void shim_set_sge_list(struct ibv_qp_ex *qp, size_t num, const struct ibv_sge *sg) {
    ShimWr *w = cur_wr(qp);
    if (!w) return;
    if (num > 1) { /* one SGE per record: more is outside what the core posts */
        qp_of(qp)->wr_list.err = EINVAL;
        return;
    }
    w->setters |= SET_SGE_LIST;
    if (num) {
        w->sge_addr = sg[0].addr;
        w->sge_length = sg[0].length;
        w->sge_lkey = sg[0].lkey;
    }
}
static void shim_set_inline(struct ibv_qp_ex *qp, void *addr, size_t length) {
    ShimWr *w = cur_wr(qp);
    if (!w) return;
    if (length > SHIM_INLINE_MAX) {
        qp_of(qp)->wr_list.err = EINVAL;
        return;
    }
    memcpy(w->inline_data, addr, length); /* copied now, as the provider copies it into the WQE */
    w->inline_length = (uint16_t)length;
    w->sge_addr = 0;
    w->sge_length = w->sge_lkey = 0;
    w->setters |= SET_INLINE;
}
static void shim_set_ud_addr(struct ibv_qp_ex *qp, struct ibv_ah *ah, uint32_t qpn, uint32_t qkey) {
    qp_of(qp)->wr_list.err = EOPNOTSUPP; /* RC only */
}
static void shim_start(struct ibv_qp_ex *qp) { tpd_shim_start(&qp_of(qp)->wr_list); }
static void shim_abort(struct ibv_qp_ex *qp) { tpd_shim_abort(&qp_of(qp)->wr_list); }
/* The one Python call of a pass: the collected records to `post`, which returns an errno. */
static int shim_complete(struct ibv_qp_ex *qp) { return tpd_shim_complete(&qp_of(qp)->wr_list); }

static PyObject *ShimQP_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"post", "qp_num", NULL};
    PyObject *post;
    unsigned int qpn = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "O|I", kwlist, &post, &qpn)) return NULL;
    if (!PyCallable_Check(post)) return PyErr_Format(PyExc_TypeError, "post must be callable");
    ShimQP *s = (ShimQP *)type->tp_alloc(type, 0);
    if (!s) return NULL;
    tpd_shim_init(&s->wr_list, post, sizeof(ShimWr));
    struct ibv_qp_ex *x = &s->ex;
    x->qp_base.qp_num = qpn;
    x->wr_atomic_cmp_swp = shim_cmp_swp;
    x->wr_atomic_fetch_add = shim_fetch_add;
    x->wr_rdma_read = shim_rdma_read;
    x->wr_rdma_write = shim_rdma_write;
    x->wr_rdma_write_imm = shim_rdma_write_imm;
    x->wr_send = shim_send;
    x->wr_send_imm = shim_send_imm;
    x->wr_set_ud_addr = shim_set_ud_addr;
    x->wr_set_inline_data = shim_set_inline;
    x->wr_set_sge = shim_set_sge;
    x->wr_set_sge_list = shim_set_sge_list;
    x->wr_start = shim_start;
    x->wr_complete = shim_complete;
    x->wr_abort = shim_abort;
    /* the rest stay NULL: the core never calls them */
    return (PyObject *)s;
}

static void ShimQP_dealloc(ShimQP *s) {
    tpd_shim_release(&s->wr_list);
    Py_TYPE(s)->tp_free((PyObject *)s);
}

static PyObject *ShimQP_capsule(ShimQP *s, void *unused) { return PyCapsule_New(&s->ex, "ibv_qp_ex", NULL); }
static PyObject *ShimQP_calls(ShimQP *s, void *unused) { return PyLong_FromUnsignedLongLong(s->wr_list.calls); }
static PyObject *ShimQP_posted(ShimQP *s, void *unused) { return PyLong_FromUnsignedLongLong(s->wr_list.posted); }

static PyGetSetDef ShimQP_getset[] = {
    {"ibv_qp_ex", (getter)ShimQP_capsule, NULL, "The struct ibv_qp_ex, as a capsule.", NULL},
    {"calls", (getter)ShimQP_calls, NULL, "Python post calls made (one per wr_complete with WRs).", NULL},
    {"posted", (getter)ShimQP_posted, NULL, "WRs the post callable accepted.", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject ShimQPType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "transportd._core.ShimQP",
    .tp_basicsize = sizeof(ShimQP),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "ShimQP(post, qp_num=0): an ibv_qp_ex whose wr_complete hands the WRs since wr_start to post(bytes).",
    .tp_new = ShimQP_new,
    .tp_dealloc = (destructor)ShimQP_dealloc,
    .tp_getset = ShimQP_getset,
};

/* ---- CQ ------------------------------------------------------------------------------------------------ */
typedef struct {
    PyObject_HEAD
    struct ibv_cq_ex ex;
    PyObject *poll;
    size_t fetch;
    ShimWc *wcs;
    size_t head, n, cap;
    int polling;
    unsigned long long calls, entries;
    Py_buffer doorbell; /* .buf NULL without one */
    uint64_t rung;      /* the doorbell's count when a poll last drained the CQ */
} ShimCQ;

static ShimCQ *cq_of(struct ibv_cq_ex *cq) { return container(cq, ShimCQ, ex); }

static void set_current(ShimCQ *s) {
    s->ex.wr_id = s->wcs[s->head].wr_id;
    s->ex.status = (int)s->wcs[s->head].status;
}

static int shim_start_poll(struct ibv_cq_ex *cq, struct ibv_poll_cq_attr *attr) {
    ShimCQ *s = cq_of(cq);
    if (s->polling || (attr && attr->comp_mask)) return EINVAL;
    if (s->head == s->n) {
        s->head = s->n = 0;
        uint64_t rung = 0;
        if (s->doorbell.buf) {
            rung = __atomic_load_n((const uint64_t *)s->doorbell.buf, __ATOMIC_ACQUIRE);
            if (rung == s->rung) return ENOENT; /* nothing queued since a poll found the CQ empty */
        }
        PyGILState_STATE g = PyGILState_Ensure();
        int rc = 0;
        PyObject *res = PyObject_CallFunction(s->poll, "n", (Py_ssize_t)s->fetch);
        Py_buffer view;
        if (res && PyObject_GetBuffer(res, &view, PyBUF_SIMPLE) == 0) {
            size_t n = (size_t)view.len / sizeof(ShimWc);
            if ((size_t)view.len % sizeof(ShimWc) || n > s->fetch) {
                PyErr_SetString(PyExc_ValueError, "poll must return at most n WC_DTYPE rows");
            } else {
                memcpy(s->wcs, view.buf, (size_t)view.len);
                s->n = n;
            }
            PyBuffer_Release(&view);
        }
        Py_XDECREF(res);
        if (PyErr_Occurred()) {
            tpd_stash_exception();
            rc = EIO;
        }
        s->calls++;
        PyGILState_Release(g);
        if (rc) return rc;
        /* fewer than asked: everything queued by the count read above was taken */
        if (s->doorbell.buf && s->n < s->fetch) s->rung = rung;
    }
    if (s->head == s->n) return ENOENT;
    s->polling = 1;
    set_current(s);
    s->entries++;
    return 0;
}

static int shim_next_poll(struct ibv_cq_ex *cq) {
    ShimCQ *s = cq_of(cq);
    if (!s->polling) return EINVAL;
    if (s->head + 1 >= s->n) {
        s->head = s->n; /* the current one is consumed */
        return ENOENT;
    }
    s->head++;
    set_current(s);
    s->entries++;
    return 0;
}

static void shim_end_poll(struct ibv_cq_ex *cq) {
    ShimCQ *s = cq_of(cq);
    if (s->polling && s->head < s->n) s->head++; /* the current entry was consumed */
    s->polling = 0;
}

static ShimWc *cur_wc(struct ibv_cq_ex *cq) { return &cq_of(cq)->wcs[cq_of(cq)->head]; }
static int shim_read_opcode(struct ibv_cq_ex *cq) { return (int)cur_wc(cq)->opcode; }
static uint32_t shim_read_vendor_err(struct ibv_cq_ex *cq) { return cur_wc(cq)->vendor_err; }
static uint32_t shim_read_byte_len(struct ibv_cq_ex *cq) { return cur_wc(cq)->byte_len; }
static tpd_be32 shim_read_imm_data(struct ibv_cq_ex *cq) { return htonl(cur_wc(cq)->imm); }
static uint32_t shim_read_qp_num(struct ibv_cq_ex *cq) { return cur_wc(cq)->qp_num; }
static unsigned int shim_read_wc_flags(struct ibv_cq_ex *cq) { return cur_wc(cq)->wc_flags; }

static PyObject *ShimCQ_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"poll", "fetch", "doorbell", NULL};
    PyObject *poll, *doorbell = Py_None;
    Py_ssize_t fetch = 1024;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "O|nO", kwlist, &poll, &fetch, &doorbell)) return NULL;
    if (!PyCallable_Check(poll) || fetch < 1) return PyErr_Format(PyExc_ValueError, "poll callable, fetch >= 1");
    ShimCQ *s = (ShimCQ *)type->tp_alloc(type, 0);
    if (!s) return NULL;
    if (doorbell != Py_None) {
        if (PyObject_GetBuffer(doorbell, &s->doorbell, PyBUF_SIMPLE) < 0) {
            Py_DECREF(s);
            return NULL;
        }
        if (s->doorbell.len != sizeof(uint64_t) || (uintptr_t)s->doorbell.buf % sizeof(uint64_t)) {
            Py_DECREF(s);
            return PyErr_Format(PyExc_ValueError, "doorbell: one aligned 8-byte word");
        }
    }
    s->wcs = calloc((size_t)fetch, sizeof(ShimWc));
    if (!s->wcs) {
        Py_DECREF(s);
        return PyErr_NoMemory();
    }
    Py_INCREF(poll);
    s->poll = poll;
    s->fetch = (size_t)fetch;
    struct ibv_cq_ex *x = &s->ex;
    x->cqe = (int)fetch;
    x->start_poll = shim_start_poll;
    x->next_poll = shim_next_poll;
    x->end_poll = shim_end_poll;
    x->read_opcode = shim_read_opcode;
    x->read_vendor_err = shim_read_vendor_err;
    x->read_byte_len = shim_read_byte_len;
    x->read_imm_data = shim_read_imm_data;
    x->read_qp_num = shim_read_qp_num;
    x->read_wc_flags = shim_read_wc_flags;
    return (PyObject *)s;
}

static void ShimCQ_dealloc(ShimCQ *s) {
    if (s->doorbell.obj) PyBuffer_Release(&s->doorbell);
    Py_XDECREF(s->poll);
    free(s->wcs);
    Py_TYPE(s)->tp_free((PyObject *)s);
}

static PyObject *ShimCQ_capsule(ShimCQ *s, void *unused) { return PyCapsule_New(&s->ex, "ibv_cq_ex", NULL); }
static PyObject *ShimCQ_calls(ShimCQ *s, void *unused) { return PyLong_FromUnsignedLongLong(s->calls); }
static PyObject *ShimCQ_entries(ShimCQ *s, void *unused) { return PyLong_FromUnsignedLongLong(s->entries); }

static PyGetSetDef ShimCQ_getset[] = {
    {"ibv_cq_ex", (getter)ShimCQ_capsule, NULL, "The struct ibv_cq_ex, as a capsule.", NULL},
    {"calls", (getter)ShimCQ_calls, NULL, "Python poll calls made.", NULL},
    {"entries", (getter)ShimCQ_entries, NULL, "Completions handed to the caller (start_poll/next_poll).", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject ShimCQType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "transportd._core.ShimCQ",
    .tp_basicsize = sizeof(ShimCQ),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "ShimCQ(poll, fetch=1024, doorbell=None): an ibv_cq_ex whose start_poll fills itself from poll(n) "
               "(WC_DTYPE rows), and skips the call while the doorbell's count has not moved.",
    .tp_new = ShimCQ_new,
    .tp_dealloc = (destructor)ShimCQ_dealloc,
    .tp_getset = ShimCQ_getset,
};

/* ---- ABI layout as this build sees it (the probe test compares it with the real headers) ------------ */
static int add_int(PyObject *d, const char *key, long long v) {
    PyObject *o = PyLong_FromLongLong(v);
    int rc = o ? PyDict_SetItemString(d, key, o) : -1;
    Py_XDECREF(o);
    return rc;
}

static PyObject *abi_layout(PyObject *self, PyObject *unused) {
    PyObject *d = PyDict_New();
    if (!d) return NULL;
    int rc = 0;
#define MEMBER(s, m)                                                                                         \
    rc |= add_int(d, "offset " #s "." #m, (long long)offsetof(struct s, m));                                   \
    rc |= add_int(d, "size " #s "." #m, (long long)sizeof(((struct s *)0)->m));
#define SIZE(s) rc |= add_int(d, "size " #s, (long long)sizeof(struct s));
#define CONST(c) rc |= add_int(d, "const " #c, (long long)(c));
    TPD_VERBS_ABI_MEMBERS(MEMBER)
    TPD_VERBS_ABI_SIZES(SIZE)
    TPD_VERBS_ABI_CONSTANTS(CONST)
#undef MEMBER
#undef SIZE
#undef CONST
    if (rc) Py_CLEAR(d);
    return d;
}

static PyMethodDef shim_functions[] = {
    {"abi_layout", abi_layout, METH_NOARGS, "{'offset struct.member' | 'size ...' | 'const NAME': value} of verbs_abi.h."},
    {NULL, NULL, 0, NULL},
};

int tpd_shim_register(void *mod) {
    PyObject *m = mod;
    if (PyType_Ready(&ShimQPType) < 0 || PyType_Ready(&ShimCQType) < 0) return -1;
    Py_INCREF(&ShimQPType);
    if (PyModule_AddObject(m, "ShimQP", (PyObject *)&ShimQPType) < 0) return -1;
    Py_INCREF(&ShimCQType);
    if (PyModule_AddObject(m, "ShimCQ", (PyObject *)&ShimCQType) < 0) return -1;
    if (PyModule_AddFunctions(m, shim_functions) < 0) return -1;
    if (PyModule_AddIntConstant(m, "SHIM_WR_SIZE", sizeof(ShimWr)) < 0) return -1;
    if (PyModule_AddIntConstant(m, "SHIM_WC_SIZE", sizeof(ShimWc)) < 0) return -1;
    return 0;
}
