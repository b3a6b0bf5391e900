"""Batch entry points: one Python call posts a whole extended-API WR list, or takes a batch of completions.

transportd's compiled core posts through the function pointers of a ``struct ibv_qp_ex`` and polls
through a ``struct ibv_cq_ex``; on softverbs those structs are transportd's verbs shim, which collects a
pass's work requests in C and hands them here at once. :func:`post_wr_batch` is exactly
``wr_start()``, the ``wr_*`` / ``wr_set_*`` calls of each record, ``wr_complete()`` on a :class:`QPEx`
(same checks, same errors, all or nothing), and :func:`poll_wc_batch` is ``start_poll`` /
``poll_next`` / ``end_poll`` on a :class:`CQEX`, without a Python call per WR or per completion.

The record layouts are C structs of the shim (``transportd/core/verbs_shim.c``); a transportd test
checks that these dtypes match them byte for byte.
"""

from __future__ import annotations

import errno
import socket
import time
from typing import Any

import numpy as np

from softverbs import _trace
from softverbs._requester import WR_TO_OP
from softverbs.pyverbs_error import PyverbsUserError

__all__ = ["BATCH_WR_DTYPE", "WC_BATCH_DTYPE", "SET_SGE", "SET_INLINE", "SET_SGE_LIST", "post_wr_batch",
           "poll_wc_batch", "doorbell", "list_by_call", "list_by_columns"]

#: One work request: what the wr_<op>() call and the wr_set_*() calls after it carried.
BATCH_WR_DTYPE = np.dtype(
    [
        ("wr_id", "<u8"),
        ("raddr", "<u8"),
        ("add", "<u8"),  # fetch-add operand, or compare-and-swap's compare
        ("swap", "<u8"),
        ("sge_addr", "<u8"),
        ("sge_length", "<u4"),
        ("sge_lkey", "<u4"),
        ("rkey", "<u4"),
        ("flags", "<u4"),  # wr_flags (ibv_send_flags)
        ("imm", "<u4"),  # big-endian, as the C call takes it
        ("opcode", "u1"),  # ibv_wr_opcode
        ("setters", "u1"),  # SET_* bits: which wr_set_* calls reached the WR
        ("inline_length", "<u2"),
        ("inline_data", "u1", (32,)),
    ],
    align=True,
)
SET_SGE, SET_INLINE, SET_UD, SET_SGE_LIST = 1, 2, 4, 8

#: One completion (the fields transportd's CQ drain reads); ``imm`` in host order.
WC_BATCH_DTYPE = np.dtype(
    [
        ("wr_id", "<u8"),
        ("status", "<u4"),
        ("opcode", "<u4"),
        ("vendor_err", "<u4"),
        ("imm", "<u4"),
        ("byte_len", "<u4"),
        ("qp_num", "<u4"),
        ("wc_flags", "<u4"),
        ("unsolicited", "u1"),
    ],
    align=True,
)
_WITH_IMM = 1 << 1


def post_wr_batch(qp: Any, wrs: bytes | np.ndarray) -> int:
    """Post ``wrs`` (BATCH_WR_DTYPE) on ``qp`` (a QPEx) as one WR list; returns wr_complete()'s errno.

    An operation the QP was not created for raises as the ``wr_*`` call would; a refusal inside the
    WR list (queue full, state, inline too long) posts nothing and comes back as the errno.
    """
    if _trace.DIR:
        _trace.stamp("post")
    rows = wrs if isinstance(wrs, np.ndarray) else np.frombuffer(wrs, dtype=BATCH_WR_DTYPE)
    if not qp._ex:
        raise PyverbsUserError("qp_ex is not accessible: QP created without IBV_QP_INIT_ATTR_SEND_OPS_FLAGS")
    ops = [WR_TO_OP.get(op) for op in set(rows["opcode"].tolist())]
    if None in ops:
        return errno.EINVAL
    for op in ops:
        qp._op(op)
    core = qp._core
    core.wr_start()
    try:
        setters = rows["setters"].tolist()
        if any(s & SET_INLINE and n for s, n in zip(setters, rows["inline_length"].tolist(), strict=True)):
            list_by_call(core, rows)
        else:
            list_by_columns(core, rows, setters)
    except BaseException:
        core.wr_abort()
        raise
    if _trace.DIR:
        _trace.stamp(f"listed {len(rows)}")
    err = core.wr_complete()
    if _trace.DIR:  # the post's end: what it held the GIL for ends here (`softverbs.soft.trace.ready_waits`)
        _trace.stamp("posted")
    return err


def list_by_columns(core: Any, rows: np.ndarray, setters: list[int] | None = None) -> None:
    """The WR list of ``rows`` (none with inline data) on ``core`` (a QP's core, inside wr_start()): one
    ``wr_rows`` call from whole columns, no Python call per WR and no tuple of each row's 32 inline bytes. What
    `list_by_call` does, refusals included (tests/softverbs/test_batch_post.py compares the two)."""
    if setters is None:
        setters = rows["setters"].tolist()
    sges = [(a, n, k) if s & (SET_SGE | SET_SGE_LIST) else None for a, n, k, s in zip(
        rows["sge_addr"].tolist(), rows["sge_length"].tolist(), rows["sge_lkey"].tolist(), setters, strict=True)]
    core.wr_rows([WR_TO_OP[op] for op in rows["opcode"].tolist()], rows["wr_id"].tolist(), rows["flags"].tolist(),
                 rows["rkey"].tolist(), rows["raddr"].tolist(), rows["imm"].tolist(), rows["add"].tolist(),
                 rows["swap"].tolist(), sges)


def list_by_call(core: Any, rows: np.ndarray) -> None:
    """The WR list of ``rows`` on ``core`` as the C calls make it: ``wr_<op>`` then ``wr_set_inline_data`` or
    ``wr_set_sge``, WR by WR."""
    for (wr_id, raddr, add, swap, sge_addr, sge_length, sge_lkey, rkey, flags, imm, opcode, setters,
         inline_length, inline_data) in rows.tolist():
        core.wr_op(WR_TO_OP[opcode], wr_id, flags, rkey, raddr, imm, add, swap)
        if setters & SET_INLINE and inline_length:
            core.wr_set_inline(bytes(inline_data[:inline_length]))
        elif setters & (SET_SGE | SET_SGE_LIST):
            core.wr_set_sge(sge_addr, sge_length, sge_lkey)


def poll_wc_batch(cq: Any, max_entries: int) -> np.ndarray:
    """Up to ``max_entries`` completions of ``cq`` (a CQEX or CQ), oldest first, as WC_BATCH_DTYPE."""
    if getattr(cq, "_polling", False):
        raise PyverbsUserError("poll batch while a start_poll() batch is open; call end_poll() first")
    cq._check()
    got = cq._core.take(max_entries)
    if not got:
        time.sleep(0)  # as CQEX.start_poll on an empty CQ: let the provider's threads run
        return np.zeros(0, dtype=WC_BATCH_DTYPE)
    if _trace.DIR:
        _trace.stamp("polled")
    ntohl = socket.ntohl
    return np.array([(c[0], c[1], c[2], 0, ntohl(c[6]) if c[7] & _WITH_IMM else 0, c[3], c[4], c[7], c[12])
                     if c[1] == 0 else (c[0], c[1], 0, 0, 0, 0, c[4], 0, 0) for c in got], dtype=WC_BATCH_DTYPE)


def doorbell(cq: Any) -> memoryview:
    """The 8-byte word (native uint64) that counts what was queued on ``cq`` (a CQEX or CQ): completions and
    overruns. A poller that reads it without calling in skips an empty CQ's :func:`poll_wc_batch`, and so
    leaves the GIL to the provider's threads while it spins; a changed count says a poll is due."""
    return memoryview(cq._core.pushed).cast("B")
