/*
 * The SRD verbs shim: a struct ibv_qp_ex whose function pointers collect the write-with-immediate WRs
 * (with their UD address) from wr_start on and hand them to a Python `post` callable in one call at
 * wr_complete (transportd._core.SrdShimQP). The core's verbs shim (transportd/core/verbs_shim.c) serves RC
 * QPs and refuses wr_set_ud_addr; an SRD QP needs the address handle, remote QPN and QKey of every WR, so
 * its records carry them. It builds its WR list on the core's shim helpers (poster.h, tpd_shim_*).
 *
 * Accepted calls: wr_rdma_write_imm (the only WR the efa lowering makes), wr_set_sge, wr_set_ud_addr,
 * wr_start/complete/abort. Anything else, or a setter without an open WR, fails the WR list as a provider
 * would (EOPNOTSUPP / EINVAL from wr_complete). The records are also what the efa ABI tests read.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#include "poster.h"
#include "verbs_abi.h"

enum { SRD_WR_RDMA_WRITE_WITH_IMM = 1 }; /* enum ibv_wr_opcode */
enum { SRD_SET_SGE = 1, SRD_SET_UD = 4 };

/* One collected WR; byte for byte efa.srd_shim.SRD_WR_DTYPE. */
typedef struct {
    uint64_t wr_id, raddr, sge_addr, ah;
    uint32_t sge_length, sge_lkey, rkey, flags;
    uint32_t imm; /* as passed: big-endian */
    uint32_t remote_qpn, remote_qkey;
    uint8_t opcode, setters;
    uint16_t pad;
} SrdWr;
_Static_assert(sizeof(SrdWr) == 64, "SrdWr layout");

typedef struct {
    PyObject_HEAD
    struct ibv_qp_ex ex;
    tpd_shim_wr_list wr_list; /* of SrdWr records */
} SrdShimQP;

static SrdShimQP *shim_of(struct ibv_qp_ex *qp) { return (SrdShimQP *)((char *)qp - offsetof(SrdShimQP, ex)); }

static SrdWr *cur(struct ibv_qp_ex *qp) { return tpd_shim_cur_wr(&shim_of(qp)->wr_list); }

static void srd_write_imm(struct ibv_qp_ex *qp, uint32_t rkey, uint64_t raddr, tpd_be32 imm) {
    SrdWr *w = tpd_shim_new_wr(&shim_of(qp)->wr_list);
    if (w) *w = (SrdWr){.wr_id = qp->wr_id, .flags = qp->wr_flags, .rkey = rkey, .raddr = raddr, .imm = imm,
                             .opcode = SRD_WR_RDMA_WRITE_WITH_IMM};
}

static void srd_set_sge(struct ibv_qp_ex *qp, uint32_t lkey, uint64_t addr, uint32_t length) {
    SrdWr *w = cur(qp);
    if (!w) return;
    w->sge_addr = addr;
    w->sge_length = length;
    w->sge_lkey = lkey;
    w->setters |= SRD_SET_SGE;
}

static void srd_set_ud_addr(struct ibv_qp_ex *qp, struct ibv_ah *ah, uint32_t qpn, uint32_t qkey) {
    SrdWr *w = cur(qp);
    if (!w) return;
    w->ah = (uint64_t)(uintptr_t)ah;
    w->remote_qpn = qpn;
    w->remote_qkey = qkey;
    w->setters |= SRD_SET_UD;
}

static void srd_set_inline(struct ibv_qp_ex *qp, void *addr, size_t length) {
    shim_of(qp)->wr_list.err = EINVAL; /* EFA has no inline RDMA */
}
static void srd_unsupported_rw(struct ibv_qp_ex *qp, uint32_t rkey, uint64_t raddr) {
    shim_of(qp)->wr_list.err = EOPNOTSUPP;
}
static void srd_start(struct ibv_qp_ex *qp) { tpd_shim_start(&shim_of(qp)->wr_list); }
static void srd_abort(struct ibv_qp_ex *qp) { tpd_shim_abort(&shim_of(qp)->wr_list); }

/* The one Python call of a WR list: the records to `post`, which returns an errno. */
static int srd_complete(struct ibv_qp_ex *qp) { return tpd_shim_complete(&shim_of(qp)->wr_list); }

static PyObject *SrdShimQP_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"post", "qp_num", NULL};
    PyObject *post;
    unsigned int qpn = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "O|I", kwlist, &post, &qpn)) return NULL;
    if (!PyCallable_Check(post)) return PyErr_Format(PyExc_TypeError, "post must be callable");
    SrdShimQP *s = (SrdShimQP *)type->tp_alloc(type, 0);
    if (!s) return NULL;
    tpd_shim_init(&s->wr_list, post, sizeof(SrdWr));
    struct ibv_qp_ex *x = &s->ex;
    x->qp_base.qp_num = qpn;
    x->wr_rdma_write_imm = srd_write_imm;
    x->wr_rdma_write = srd_unsupported_rw;
    x->wr_rdma_read = srd_unsupported_rw;
    x->wr_set_sge = srd_set_sge;
    x->wr_set_ud_addr = srd_set_ud_addr;
    x->wr_set_inline_data = srd_set_inline;
    x->wr_start = srd_start;
    x->wr_complete = srd_complete;
    x->wr_abort = srd_abort;
    return (PyObject *)s;
}

static void SrdShimQP_dealloc(SrdShimQP *s) {
    tpd_shim_release(&s->wr_list);
    Py_TYPE(s)->tp_free((PyObject *)s);
}

static PyObject *SrdShimQP_capsule(SrdShimQP *s, void *unused) { return PyCapsule_New(&s->ex, "ibv_qp_ex", NULL); }
static PyObject *SrdShimQP_calls(SrdShimQP *s, void *unused) { return PyLong_FromUnsignedLongLong(s->wr_list.calls); }
static PyObject *SrdShimQP_posted(SrdShimQP *s, void *unused) { return PyLong_FromUnsignedLongLong(s->wr_list.posted); }

static PyGetSetDef SrdShimQP_getset[] = {
    {"ibv_qp_ex", (getter)SrdShimQP_capsule, NULL, "The struct ibv_qp_ex, as a capsule.", NULL},
    {"calls", (getter)SrdShimQP_calls, NULL, "Python post calls made (one per wr_complete with WRs).", NULL},
    {"posted", (getter)SrdShimQP_posted, NULL, "WRs the post callable accepted.", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject SrdShimQPType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "transportd._core.SrdShimQP",
    .tp_basicsize = sizeof(SrdShimQP),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "SrdShimQP(post, qp_num=0): an SRD ibv_qp_ex whose wr_complete hands the "
              "write-with-imm WRs since wr_start (with UD addresses) to post(bytes).",
    .tp_new = SrdShimQP_new,
    .tp_dealloc = (destructor)SrdShimQP_dealloc,
    .tp_getset = SrdShimQP_getset,
};

int tpd_efa_shim_register(PyObject *m) {
    if (PyType_Ready(&SrdShimQPType) < 0) return -1;
    Py_INCREF(&SrdShimQPType);
    if (PyModule_AddObject(m, "SrdShimQP", (PyObject *)&SrdShimQPType) < 0) {
        Py_DECREF(&SrdShimQPType);
        return -1;
    }
    return PyModule_AddIntConstant(m, "SRD_WR_SIZE", sizeof(SrdWr));
}
