# cython: language_level=3
"""The pyverbs bridge: the libibverbs structs behind pyverbs' extended QP and CQ objects, as capsules.

The compiled data path (``ib/csrc/ib_post.c``, ``poster.h``) posts through the function pointers of a
``struct ibv_qp_ex`` and polls a ``struct ibv_cq_ex``. On a NIC those are the structs pyverbs created;
pyverbs keeps them in ``cdef`` fields (``QPEx.qp_ex``, ``CQEX.cq``) that only a Cython module compiled
against pyverbs' own ``.pxd`` files can read. This module is that reader and nothing more: it wraps the
pointer in a capsule named like the struct, on a handle that keeps the pyverbs object alive, which is
the shape the data path takes (the softverbs shim's ShimQP/ShimCQ offer the same attributes), and gives
the ``struct ibv_ah *`` of an address handle as the integer the efa lowering passes to wr_set_ud_addr.

Built against the rdma-core tree whose pyverbs is installed (``make pyverbs-bridge``); never needed with
softverbs.
"""

from cpython.pycapsule cimport PyCapsule_New
from libc.stdint cimport uintptr_t

from pyverbs.addr cimport AH
from pyverbs.cq cimport CQEX
from pyverbs.qp cimport QPEx


cdef class QPHandle:
    """``ibv_qp_ex``: a capsule of the ``struct ibv_qp_ex *`` of ``qp`` (a pyverbs QPEx, or a provider's
    subclass such as efadv.SRDQPEx); ``qp`` stays referenced as long as the handle lives."""

    cdef readonly object qp
    cdef readonly object ibv_qp_ex

    def __init__(self, QPEx qp not None):
        if qp.qp_ex == NULL:
            raise ValueError("this QPEx has no ibv_qp_ex (created without IBV_QP_INIT_ATTR_SEND_OPS_FLAGS?)")
        self.qp = qp
        self.ibv_qp_ex = PyCapsule_New(<void *>qp.qp_ex, b"ibv_qp_ex", NULL)


cdef class CQHandle:
    """``ibv_cq_ex``: a capsule of the ``struct ibv_cq_ex *`` of ``cq`` (a pyverbs CQEX or a provider's
    subclass such as efadv.EfaCQ); ``cq`` stays referenced as long as the handle lives."""

    cdef readonly object cq
    cdef readonly object ibv_cq_ex

    def __init__(self, CQEX cq not None):
        if cq.cq == NULL:
            raise ValueError("this CQEX is closed")
        self.cq = cq
        self.ibv_cq_ex = PyCapsule_New(<void *>cq.cq, b"ibv_cq_ex", NULL)


def ah_address(AH ah not None):
    """The ``struct ibv_ah *`` of a pyverbs AH as an integer: what the efa lowering hands wr_set_ud_addr for
    every WR to that peer. The caller keeps ``ah`` open as long as a connection uses it."""
    if ah.ah == NULL:
        raise ValueError("this AH is closed")
    return <uintptr_t>ah.ah
