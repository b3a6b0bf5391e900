"""A batch post's WR list built from whole columns (`softverbs.soft.batch.list_by_columns`, one ``wr_rows`` call)
is the list the C calls build WR by WR (`list_by_call`): the same entries, and the same first refusal (queue
space, QP state, EFA's signaled and flag rules), on RC and SRD QPs in every state a post can meet."""

from __future__ import annotations

import random

import numpy as np
import pytest

from softverbs import _ibv
from softverbs.soft.batch import BATCH_WR_DTYPE, SET_SGE, SET_SGE_LIST, list_by_call, list_by_columns, post_wr_batch
from tests.support.verbs_resources import open_provider, poll

SIGNALED, FENCE, INLINE = 2, 1, 8  # ibv_send_flags
FLAGS = (0, SIGNALED, SIGNALED | FENCE, SIGNALED | INLINE, FENCE, 1 << 4)  # the last is a bit EFA refuses
STATES = (_ibv.RESET, _ibv.INIT, _ibv.RTR, _ibv.RTS, _ibv.SQD, _ibv.ERR)


@pytest.fixture(scope="module")
def soft():
    return open_provider("soft")


def _rows(rng: random.Random, n: int, opcodes: tuple[int, ...]) -> np.ndarray:
    rows = np.zeros(n, dtype=BATCH_WR_DTYPE)
    for r in rows:
        r["wr_id"] = rng.getrandbits(64)
        r["opcode"] = rng.choice(opcodes)
        r["flags"] = rng.choice(FLAGS) if rng.random() < 0.1 else SIGNALED  # a refused flag now and then
        r["rkey"], r["raddr"] = rng.choice((0, rng.getrandbits(32))), rng.choice((0, rng.getrandbits(64)))
        r["imm"], r["add"], r["swap"] = rng.choice((0, 7)), rng.choice((0, 9)), rng.choice((0, 11))
        r["setters"] = rng.choice((0, SET_SGE, SET_SGE_LIST))
        r["sge_addr"], r["sge_length"], r["sge_lkey"] = rng.getrandbits(64), rng.randrange(1 << 16), rng.getrandbits(32)
    return rows


FIELDS = ("wr_id", "op", "signaled", "fence", "rkey", "raddr", "imm", "add", "swap", "sges", "inline")


def _entries(core) -> tuple[int, list[tuple]]:
    """The list's refusal, else what each WR carries (a field left at its class default reads as set to it); a
    refused list posts nothing (wr_complete), so the WRs before the refusal are not compared."""
    if core.wr_list_err:
        return core.wr_list_err, []
    return 0, [tuple(getattr(e, f) for f in FIELDS) for e in core.wr_list]


def _compare(core, rows: np.ndarray) -> tuple[int, list[tuple]]:
    core.wr_start()
    list_by_call(core, rows)
    by_call = _entries(core)
    core.wr_abort()
    core.wr_start()
    list_by_columns(core, rows)
    by_columns = _entries(core)
    core.wr_abort()
    assert by_columns == by_call
    return by_call


@pytest.mark.parametrize("kind", ["rc", "srd"])
def test_the_column_list_is_the_call_list_refusals_included(soft, kind: str) -> None:
    rng = random.Random(kind)
    pair = soft.rc_pair(max_send_wr=8) if kind == "rc" else soft.srd_pair(max_send_wr=8)
    with pair:
        core = pair.client.qp._core
        opcodes = (0, 1, 2, 3, 4, 5, 6) if kind == "rc" else (0, 1, 2, 3, 4)
        state, posted, seen = core.state, core.sq_posted, set()
        try:
            for _ in range(400):
                core.state = rng.choice(STATES)
                core.sq_posted = posted + rng.randrange(core.max_send_wr + 2)  # room from none to all of it
                err, entries = _compare(core, _rows(rng, rng.randrange(0, 12), opcodes))
                seen.add(err if err else len(entries) > 0)
        finally:
            core.state, core.sq_posted = state, posted
        assert seen >= {True, 12, 22}, f"every outcome met (a list, ENOMEM, EINVAL): {seen}"


def test_a_batch_post_delivers_its_columns(soft) -> None:
    """Posted through post_wr_batch, a list of writes lands as the WRs said (the fast path end to end)."""
    with soft.rc_pair() as pair:
        client, server = pair.client, pair.server
        payload = bytes(range(256)) * 16
        client.write_buf(0, payload)
        rows = np.zeros(4, dtype=BATCH_WR_DTYPE)
        rows["wr_id"] = np.arange(1, 5)
        rows["opcode"] = 0
        rows["setters"] = SET_SGE
        rows["sge_addr"] = client.mr.buf + np.arange(4) * 1024
        rows["sge_length"], rows["sge_lkey"] = 1024, client.mr.lkey
        rows["rkey"], rows["raddr"] = server.mr.rkey, server.mr.buf + 8192 + np.arange(4)[::-1] * 1024
        rows["flags"][-1] = SIGNALED
        assert post_wr_batch(client.qp, rows) == 0
        (wc,) = poll(client.cq)
        assert wc.status == 0 and wc.wr_id == 4
        got = server.read_buf(8192, 4096)
        assert [got[(3 - i) * 1024:(4 - i) * 1024] for i in range(4)] == [payload[i * 1024:(i + 1) * 1024]
                                                                         for i in range(4)]
