"""The null backend (what the proxy tests and benchmark post into) and the one place that opens backends."""

from __future__ import annotations

import time

import numpy as np
import pytest

from tests.support.waiting import wait_until
from transportd.backends import BACKENDS, open_backend
from transportd.backends.interface import PLAN_DTYPE, PlanOp, SignalOp
from transportd.backends.null import NullBackend, apply_plans


def plan(ops: list[int], token: int, dst: int = 1) -> np.ndarray:
    p = np.zeros(len(ops), dtype=PLAN_DTYPE)
    p["op"] = ops
    p["token"] = token
    p["length"] = [100 if o == PlanOp.WRITE else 8 if o == PlanOp.SIGNAL else 0 for o in ops]
    p["dst_rank"] = dst
    p["raddr"] = 0x1000
    p["value"] = 1
    return p


def test_open_backend_picks_by_name_and_accepts_the_rail_options() -> None:
    backend = open_backend("null", device="mlx5_0", verbs="soft", signal_mode="atomic", inflight_cap=64,
                           batch_max=8, visibility_flush=False)
    assert isinstance(backend, NullBackend) and backend.name == "null" and "null" in BACKENDS
    with pytest.raises(ValueError, match="unknown backend 'nope'; known: .*null"):
        open_backend("nope")


def test_every_batch_completes_on_the_next_poll_and_is_counted() -> None:
    b = NullBackend()
    assert b.post(5, plan([PlanOp.WRITE, PlanOp.SIGNAL], token=1)) == 2
    nwr = b.post_batches(np.array([5, 6]), np.concatenate([plan([PlanOp.WRITE], 2), plan([PlanOp.FENCE], 3)]),
                         np.array([0, 1, 2]))
    assert nwr.tolist() == [1, 1]
    assert b.inflight(5) == 3 and b.inflight(6) == 1
    done = b.poll()
    assert sorted(done["token"].tolist()) == [1, 2, 3] and (done["status"] == 0).all()
    assert b.inflight(5) == 0 and b.inflight(6) == 0
    assert b.counts == {"batches": 3, "wrs": 4, "writes": 2, "signals": 1, "fences": 1, "bytes": 200}
    assert len(b.poll()) == 0


def test_poll_respects_max_completions_and_keeps_the_rest() -> None:
    b = NullBackend()
    p = np.concatenate([plan([PlanOp.WRITE], t) for t in range(1, 6)])
    b.post_batches(np.full(5, 7), p, np.arange(6))
    assert b.poll(2)["token"].tolist() == [1, 2]
    assert b.inflight(7) == 3
    assert b.poll(10)["token"].tolist() == [3, 4, 5]


def test_delay_pause_hold_and_failure_injection() -> None:
    # a delay no descheduling between the post and the first poll reaches (20 ms did, once, on a loaded 2-core
    # machine: the completion was already due at the first poll)
    b = NullBackend(completion_delay_us=1_000_000)
    b.post(1, plan([PlanOp.WRITE], 1))
    assert len(b.poll()) == 0
    assert wait_until(lambda: b.poll()["token"].tolist(), "the completion 1 s after its post", 10.0,
                      interval=0.001) == [1]

    b = NullBackend()
    b.paused = True
    b.post(1, plan([PlanOp.WRITE], 1))
    assert len(b.poll()) == 0
    b.paused = False
    b.held = {2}
    b.post(2, plan([PlanOp.WRITE], 2))
    b.fail_next(3, 10)
    b.post(3, plan([PlanOp.WRITE], 3))
    b.post(3, plan([PlanOp.WRITE], 4))
    done = b.poll()
    assert dict(zip(done["token"].tolist(), done["status"].tolist(), strict=True)) == {1: 0, 3: 10, 4: 0}
    b.held = set()
    assert b.poll()["token"].tolist() == [2]


def test_kept_plans_post_log_and_flag_model() -> None:
    b = NullBackend(keep_plans=True, log_posts=True)
    first = plan([PlanOp.WRITE, PlanOp.SIGNAL], 1)
    b.post(4, first)
    b.poll()
    first["op"] = 0  # the backend keeps its own copy
    second = plan([PlanOp.SIGNAL], 2)
    second["signal_op"] = SignalOp.SET
    second["value"] = 10
    b.post(4, second)
    b.poll()
    assert [p["op"].tolist() for p in b.plans[4]] == [[PlanOp.WRITE, PlanOp.SIGNAL], [PlanOp.SIGNAL]]
    assert b.flag_values() == {(1, 0x1000): 10}
    times, chunks = b.post_log[0]
    assert len(times) == len(chunks) == 1 and times[0] <= time.monotonic_ns()


def test_apply_plans_adds_modulo_2_64_and_sets() -> None:
    p = plan([PlanOp.SIGNAL, PlanOp.SIGNAL], 1)
    p["value"] = [(1 << 64) - 1, 3]
    assert apply_plans([p]) == {(1, 0x1000): 2}
