"""Batch cutting and Perseus decoupled signaling, checked against a naive in-order model."""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from transportd.backends.interface import PLAN_DTYPE, PlanOp, SignalOp
from transportd.rows import compress_rows, concat_rows, take_rows
from transportd_models import batching
from transportd_models.batching import (
    cumsum_within,
    cut_batches,
    decouple_signals,
)

W, S, F = int(PlanOp.WRITE), int(PlanOp.SIGNAL), int(PlanOp.FENCE)
ADD, SET = int(SignalOp.ADD), int(SignalOp.SET)
FLAG_BASE = 0x9000


def rows(*items: tuple) -> np.ndarray:
    """Plan rows from ``(W, chunk)``, ``(S, dst, slot, ADD|SET, value)`` or ``(F,)`` tuples."""
    plan = np.zeros(len(items), dtype=PLAN_DTYPE)
    for i, item in enumerate(items):
        plan[i]["op"] = item[0]
        plan[i]["chunk_id"] = i
        if item[0] == W:
            plan[i]["chunk_id"] = item[1]
            plan[i]["dst_rank"] = item[2] if len(item) > 2 else 0
        elif item[0] == S:
            _, dst, slot, op, value = item
            plan[i]["dst_rank"], plan[i]["slot"], plan[i]["signal_op"], plan[i]["value"] = dst, slot, op, value
            plan[i]["raddr"] = FLAG_BASE + 0x1000 * dst + 8 * slot
            plan[i]["rkey"] = 100 + dst
    return plan


def summary(plan: np.ndarray) -> list[tuple]:
    out = []
    for r in plan:
        if r["op"] == S:
            out.append(("S", int(r["dst_rank"]), int(r["slot"]), "SET" if r["signal_op"] == SET else "ADD",
                        int(r["value"])))
        elif r["op"] == W:
            out.append(("W", int(r["chunk_id"])))
        else:
            out.append(("F",))
    return out


# --- row helpers --------------------------------------------------------------------------------------------
def test_row_helpers_match_numpy_on_structured_arrays() -> None:
    plan = np.zeros(50, dtype=PLAN_DTYPE)
    rng = np.random.default_rng(1)
    for name in PLAN_DTYPE.names:
        plan[name] = rng.integers(0, 200, len(plan))
    idx = rng.permutation(50)[:20]
    mask = rng.random(50) < 0.5
    assert take_rows(plan, idx).tobytes() == plan[idx].tobytes()
    assert compress_rows(plan, mask).tobytes() == plan[mask].tobytes()
    assert concat_rows([plan[:7], plan[20:], plan[:0]]).tobytes() == np.concatenate([plan[:7], plan[20:]]).tobytes()
    assert take_rows(plan, idx).dtype == PLAN_DTYPE and len(compress_rows(plan[:0], mask[:0])) == 0


def test_cumsum_within_restarts_at_group_starts() -> None:
    starts = np.array([1, 0, 0, 1, 0, 1], dtype=bool)
    assert cumsum_within(starts, np.array([1, 2, 3, 4, 5, 6])).tolist() == [1, 3, 6, 4, 9, 6]


# --- cutting batches ----------------------------------------------------------------------------------------
def test_batches_fill_to_batch_max_per_connection_in_order() -> None:
    conn = np.array([0] * 10 + [1] * 3)
    first = np.ones(13, dtype=bool)
    b = cut_batches(conn, first, np.zeros(13, bool), batch_max=4)
    assert b.conn.tolist() == [0, 0, 0, 1]
    assert b.ncmds.tolist() == [4, 4, 2, 3]
    assert b.last.tolist() == [False, False, True, True]
    assert b.start.tolist() == [0, 4, 8, 10] and b.stop.tolist() == [4, 8, 10, 13]


def test_closing_command_ends_its_batch_and_a_two_row_command_never_splits() -> None:
    #            c0 c1(2 rows) c2 c3(closes) c4
    conn = np.zeros(6, dtype=np.int64)
    first = np.array([1, 1, 0, 1, 1, 1], dtype=bool)
    closes = np.array([0, 0, 0, 0, 1, 0], dtype=bool)
    b = cut_batches(conn, first, closes, batch_max=2)
    assert b.start.tolist() == [0, 3, 5]  # [c0 c1] [c2 c3] [c4]
    assert b.closed.tolist() == [False, True, False]
    assert b.row_batch.tolist() == [0, 0, 0, 1, 1, 2]
    b = cut_batches(conn, first, closes, batch_max=8)
    assert b.ncmds.tolist() == [4, 1] and b.closed.tolist() == [True, False]


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(1, 2), st.booleans()), min_size=1, max_size=60),
       st.integers(1, 8))
def test_cut_batches_properties(cmds: list[tuple[int, int, bool]], batch_max: int) -> None:
    cmds = sorted(cmds, key=lambda c: c[0])  # rows arrive sorted by connection (stable)
    conn = np.array([c for c, n, _ in cmds for _ in range(n)])
    first = np.array([i == 0 for _, n, _ in cmds for i in range(n)])
    closes = np.array([x for _, n, x in cmds for _ in range(n)])
    b = cut_batches(conn, first, closes, batch_max)
    assert b.start[0] == 0 and b.stop[-1] == len(conn) and (b.start[1:] == b.stop[:-1]).all()
    assert (np.diff(b.row_batch) >= 0).all()
    for i in range(len(b)):
        sl = slice(b.start[i], b.stop[i])
        assert first[b.start[i]], "a batch starts at a command boundary"
        assert (conn[sl] == b.conn[i]).all()
        assert first[sl].sum() == b.ncmds[i] <= batch_max
        cmd_closes = closes[sl][first[sl]]
        assert not cmd_closes[:-1].any(), "a closing command is always last in its batch"
        assert b.closed[i] == cmd_closes[-1]
        full_or_closed = b.ncmds[i] == batch_max or b.closed[i]
        assert full_or_closed or b.last[i], "only a connection's last batch may be partial and open"



@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(1, 2), st.booleans()), min_size=1, max_size=20),
       st.integers(1, 8), st.sampled_from([np.int32, np.int64]))
def test_small_cut_matches_the_vectorized_cut(cmds: list[tuple[int, int, bool]], batch_max: int, dtype) -> None:
    cmds = sorted(cmds, key=lambda c: c[0])
    conn = np.array([c for c, n, _ in cmds for _ in range(n)], dtype=dtype)
    first = np.array([i == 0 for _, n, _ in cmds for i in range(n)])
    closes = np.array([x for _, n, x in cmds for _ in range(n)])
    saved = batching.SMALL_ROWS
    batching.SMALL_ROWS = 0
    try:
        want = cut_batches(conn, first, closes, batch_max)
    finally:
        batching.SMALL_ROWS = saved
    got = batching._cut_small(conn, first, closes, batch_max)
    for name in ("row_batch", "start", "stop", "conn", "ncmds", "closed", "last"):
        a, b = getattr(want, name), getattr(got, name)
        assert a.dtype == b.dtype and a.tolist() == b.tolist(), name


# --- decoupled signaling: examples --------------------------------------------------------------------------
def reduce(*items: tuple) -> list[tuple]:
    plan = rows(*items)
    out, batch = decouple_signals(plan, np.zeros(len(plan), dtype=np.int64))
    assert (batch == 0).all()
    return summary(out)


def test_adds_to_one_flag_sum_into_one_signal_after_all_writes() -> None:
    got = reduce((W, 1), (S, 2, 0, ADD, 1), (W, 2), (S, 2, 0, ADD, 1), (W, 3), (S, 2, 0, ADD, 5))
    assert got == [("W", 1), ("W", 2), ("W", 3), ("S", 2, 0, "ADD", 7)]


def test_set_then_adds_is_a_set_of_the_sum_and_the_last_set_wins() -> None:
    assert reduce((S, 1, 0, SET, 10), (S, 1, 0, ADD, 2), (S, 1, 0, ADD, 3)) == [("S", 1, 0, "SET", 15)]
    assert reduce((S, 1, 0, ADD, 2), (S, 1, 0, SET, 10)) == [("S", 1, 0, "SET", 10)]
    assert reduce((S, 1, 0, SET, 4), (S, 1, 0, ADD, 1), (S, 1, 0, SET, 9), (S, 1, 0, ADD, 1)) == [
        ("S", 1, 0, "SET", 10)]


def test_one_signal_per_destination_and_slot_in_first_appearance_order() -> None:
    got = reduce((W, 1, 3), (S, 3, 1, ADD, 1), (W, 2, 2), (S, 2, 0, ADD, 1), (S, 3, 0, ADD, 1), (S, 3, 1, ADD, 1))
    assert got == [("W", 1), ("W", 2), ("S", 3, 1, "ADD", 2), ("S", 2, 0, "ADD", 1), ("S", 3, 0, "ADD", 1)]


def test_adds_wrap_modulo_2_64() -> None:
    assert reduce((S, 0, 0, ADD, (1 << 64) - 1), (S, 0, 0, ADD, 2)) == [("S", 0, 0, "ADD", 1)]


def test_nothing_moves_across_a_fence() -> None:
    got = reduce((W, 1), (S, 0, 0, ADD, 1), (W, 2), (F,), (W, 3), (S, 0, 0, ADD, 1), (W, 4), (S, 0, 0, ADD, 1))
    assert got == [("W", 1), ("S", 0, 0, "ADD", 1), ("W", 2), ("F",), ("W", 3), ("W", 4), ("S", 0, 0, "ADD", 2)]


def test_trailing_writes_stay_behind_the_last_signal() -> None:
    """A write after a segment's last signal belongs to a later signal's group (on efa): it is not moved ahead."""
    got = reduce((W, 1), (S, 0, 0, ADD, 1), (W, 2), (S, 1, 0, ADD, 1), (W, 3), (W, 4))
    assert got == [("W", 1), ("W", 2), ("S", 0, 0, "ADD", 1), ("S", 1, 0, "ADD", 1), ("W", 3), ("W", 4)]


def test_leading_signals_stay_ahead_of_the_first_write_and_are_reduced_on_their_own() -> None:
    """Signals before a segment's first write cover the writes before the batch (on efa): they are reduced among
    themselves and stay first, and the same flag's signals after the writes make a second one."""
    got = reduce((S, 0, 0, ADD, 1), (S, 0, 0, ADD, 2), (S, 1, 0, SET, 5), (W, 1), (S, 0, 0, ADD, 4), (W, 2),
                 (S, 1, 0, ADD, 1))
    assert got == [("S", 0, 0, "ADD", 3), ("S", 1, 0, "SET", 5), ("W", 1), ("W", 2), ("S", 0, 0, "ADD", 4),
                   ("S", 1, 0, "ADD", 1)]


def test_batches_are_reduced_separately() -> None:
    plan = rows((W, 1), (S, 0, 0, ADD, 1), (W, 2), (S, 0, 0, ADD, 1))
    out, batch = decouple_signals(plan, np.array([0, 0, 1, 1]))
    assert summary(out) == [("W", 1), ("S", 0, 0, "ADD", 1), ("W", 2), ("S", 0, 0, "ADD", 1)]
    assert batch.tolist() == [0, 0, 1, 1]


def test_rows_without_signals_come_back_untouched() -> None:
    plan = rows((W, 1), (F,), (W, 2))
    out, batch = decouple_signals(plan, np.zeros(3, dtype=np.int64))
    assert out is plan


# --- decoupled signaling against the naive in-order model --------------------------------------------------
def apply_in_order(plan: np.ndarray, flags: dict[int, int]) -> None:
    for r in plan:
        if r["op"] == S:
            key, value = int(r["raddr"]), int(r["value"])
            flags[key] = value if r["signal_op"] == SET else (flags.get(key, 0) + value) % (1 << 64)


def segments(plan: np.ndarray, batch: np.ndarray) -> list[np.ndarray]:
    """Split into (batch, FENCE)-delimited segments; each FENCE is a segment of its own."""
    out, cur = [], []
    for i in range(len(plan)):
        if cur and (batch[i] != batch[cur[-1]] or plan[i]["op"] == F or plan[cur[-1]]["op"] == F):
            out.append(np.array(cur))
            cur = []
        cur.append(i)
    if cur:
        out.append(np.array(cur))
    return out


item = st.one_of(
    st.tuples(st.just(W), st.integers(0, 1000)),
    st.tuples(st.just(S), st.integers(0, 2), st.integers(0, 2), st.sampled_from([ADD, ADD, SET]),
              st.one_of(st.integers(0, 5), st.just((1 << 64) - 1))),
    st.tuples(st.just(F)),
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.lists(item, min_size=1, max_size=16), min_size=1, max_size=5))
def test_decoupled_equals_naive_order_at_every_segment_boundary(batches: list[list[tuple]]) -> None:
    plan = rows(*[it for b in batches for it in b])
    batch = np.repeat(np.arange(len(batches)), [len(b) for b in batches])
    out, out_batch = decouple_signals(plan, batch)

    naive_segs, dec_segs = segments(plan, batch), segments(out, out_batch)
    assert len(naive_segs) == len(dec_segs)
    naive_flags: dict[int, int] = {}
    dec_flags: dict[int, int] = {}
    for ns, ds in zip(naive_segs, dec_segs, strict=True):
        before, after = plan[ns], out[ds]
        # the same writes and fences, in the same order
        assert summary(before[before["op"] != S]) == summary(after[after["op"] != S])
        # the pushed segment's leading signals (before its first write) and trailing writes (after its last
        # signal) keep their places; between them every write goes before the signals
        ops = before["op"]
        first_write = int(np.argmax(ops != S)) if (ops != S).any() else len(ops)
        last_signal = len(ops) - 1 - int(np.argmax(ops[::-1] == S)) if (ops == S).any() else -1
        body = before[first_write:max(last_signal + 1, first_write)]
        parts = [before[:first_write], body[body["op"] != S], body[body["op"] == S],
                 before[max(last_signal + 1, first_write):]]
        at = 0
        for k, part in enumerate(parts):
            if k in (0, 2):  # signals: one per flag word
                words = sorted(set(part["raddr"].tolist()))
                got = after[at:at + len(words)]
                assert (got["op"] == S).all() and sorted(got["raddr"].tolist()) == words
                at += len(words)
            else:
                assert summary(after[at:at + len(part)]) == summary(part)
                at += len(part)
        assert at == len(after)
        apply_in_order(before, naive_flags)
        apply_in_order(after, dec_flags)
        assert dec_flags == naive_flags
