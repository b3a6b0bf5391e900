"""efa backend over softverbs: split writes, out-of-order arrival, flags published only after their data."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytest

from efa.backend import EfaBackend
from ib.backend import IbBackend
from tests.support.waiting import wait_until
from transportd.backends.interface import SignalOp
from transportd.backends.null import NullBackend
from transportd.dataplane.worker import DEEP_WATCH_S, deep_watch_s
from transportd.errors import BackendError

REM_ACCESS_ERR = 10


class CoverageJudge:
    """Publisher hook: a flag may be published only when every write it covers has fully landed.

    Coverage (transportd_models.arrivals): the writes of the signal's group (posted since the previous SIGNAL or FENCE
    row), every write before the last FENCE, and whatever earlier signals to the same flag covered;
    ``cumulative``: every earlier write. Signals are told apart by their value (unique per trial).
    """

    def __init__(self, link: Any, cumulative: bool = False) -> None:
        self.link = link
        self.cumulative = cumulative
        self.writes: list[tuple[int, int]] = []
        self.covers: dict[int, list[int]] = {}  # signal value -> write indices
        self.slot_of: dict[int, tuple[int, int]] = {}
        self.order: list[int] = []  # signal values in posting order
        self.group: list[int] = []
        self.closed = False
        self.before_fence: list[int] = []
        self.violations: list[str] = []
        link.on_publish = self

    def on_write(self, off: int, n: int) -> None:
        if self.closed:
            self.group, self.closed = [], False
        self.group.append(len(self.writes))
        self.writes.append((off, n))

    def on_signal(self, value: int, rank: int, slot: int) -> None:
        cover = set(self.group) | set(self.before_fence)
        if self.cumulative:
            cover |= set(range(len(self.writes)))
        for v in self.order:
            if self.slot_of[v] == (rank, slot):
                cover |= set(self.covers[v])
        self.covers[value] = sorted(cover)
        self.slot_of[value] = (rank, slot)
        self.order.append(value)
        self.closed = True

    def on_fence(self) -> None:
        self.before_fence = list(range(len(self.writes)))
        self.closed = True

    def __call__(self, _conn: int, rank: int, slot: int, _op: SignalOp, value: int) -> None:
        if self.slot_of.get(value) != (rank, slot):
            self.violations.append(f"unknown flag update {rank}/{slot}={value}")
            return
        dst, src = self.link.dst, self.link.src
        for i in self.covers[value]:
            off, n = self.writes[i]
            if not np.array_equal(dst[off:off + n], src[off:off + n]):
                self.violations.append(f"signal {value} published before write {i} [{off}, {off + n}) landed")
                return


def random_trial(link: Any, judge: CoverageJudge, rng: random.Random, ncmds: int) -> int:
    """Post a random mix of writes (some above max_rdma_size), signals and fences; returns batches."""
    off = 0
    rows: list[tuple] = []
    token = 1
    value = 1
    for i in range(ncmds):
        r = rng.random()
        if r < 0.55:
            n = rng.randint(1, 40) * 512
            rows.append(link.write(off, n, token))
            judge.on_write(off, n)
            off += n
        elif r < 0.9:
            rank, slot = rng.randrange(2), rng.randrange(3)
            op = SignalOp.SET if rng.random() < 0.3 else SignalOp.ADD
            rows.append(link.signal(slot, value, token, op, rank))
            judge.on_signal(value, rank, slot)
            value += 1
        else:
            rows.append(link.fence(token))
            judge.on_fence()
        if len(rows) >= 8 or i == ncmds - 1:
            link.post(rows)
            rows = []
            token += 1
    return token - 1


def check_published(link: Any, judge: CoverageJudge) -> None:
    assert judge.violations == []
    values = [p[4] for p in link.published]
    assert sorted(values) == sorted(judge.order), "every signal published exactly once"
    last: dict[tuple[int, int], int] = {}
    for v in values:  # one flag's updates in posting order
        key = judge.slot_of[v]
        assert last.get(key, 0) < v
        last[key] = v


# --- data and flags ------------------------------------------------------------------------------------


def test_write_is_split_above_max_rdma_size(make_link: Any) -> None:
    link = make_link(device_opts={"max_rdma_size": 4096, "srd_packet_size": 1024})
    assert link.a.max_rdma_size == 4096
    judge = CoverageJudge(link)
    n = 10 * 4096 + 3
    judge.on_write(0, n)
    judge.on_signal(1, 1, 0)
    assert link.post([link.write(0, n, 1), link.signal(0, 1, 1)]) == 11 + 1
    link.wait(tokens=1, published=1)
    assert link.completions == [(1, 0, 0)]
    assert np.array_equal(link.dst[:n], link.src[:n])
    check_published(link, judge)
    assert link.b.stats["arrivals"] == 12


@pytest.mark.parametrize("cumulative", (False, True))
def test_flags_never_before_data_over_random_trials(make_link: Any, cumulative: bool) -> None:
    link = make_link(seed=9, cumulative=cumulative, staging_entries=64,
                     device_opts={"max_rdma_size": 8192, "srd_packet_size": 512, "reorder_window": 32})
    rng = random.Random(1234 if cumulative else 4321)
    for _ in range(15):
        link.reconnect()
        judge = CoverageJudge(link, cumulative)
        batches = random_trial(link, judge, rng, ncmds=rng.randint(5, 30))
        link.wait(tokens=batches, published=len(judge.order))
        assert all(status == 0 for _, status, _ in link.completions)
        for off, n in judge.writes:
            assert np.array_equal(link.dst[off:off + n], link.src[off:off + n])
        check_published(link, judge)
        assert link.a.inflight(link.conn) == 0
    assert link.b.stats["protocol_errors"] == 0


def test_signal_covers_only_its_group_unless_fenced(make_link: Any) -> None:
    """A failed write blocks the flags that cover it and nothing else."""
    link = make_link()
    bad = list(link.write(0, 4096, 1))
    bad[7] ^= 0x3300
    link.post([tuple(bad), link.signal(0, 1, 1)])  # its data never arrives: never published
    link.post([link.write(8192, 4096, 2), link.signal(1, 2, 2)])  # independent: published
    link.post([link.fence(3), link.write(16384, 4096, 3), link.signal(2, 3, 3)])  # behind the fence: never
    link.wait(tokens=3, published=1)
    assert sorted(link.completions) == [(1, REM_ACCESS_ERR, 0), (2, 0, 0), (3, 0, 0)]
    for _ in range(200):
        link.poll()
    assert [p[2] for p in link.published] == [1]


def test_same_flag_updates_keep_their_order(make_link: Any) -> None:
    link = make_link(device_opts={"srd_packet_size": 256})
    rows = []
    for k in range(1, 9):
        rows += [link.write(k * 8192, 8192 - 64 * k, k), link.signal(0, k, k, SignalOp.SET)]
    for i in range(0, len(rows), 4):
        link.post(rows[i:i + 4])
    link.wait(tokens=8, published=8)
    assert [p[4] for p in link.published] == list(range(1, 9))


# --- EFA rules ----------------------------------------------------------------------------------------


def test_every_wr_is_signaled(make_link: Any) -> None:
    """One send completion per WR (EFA refuses unsignaled WRs; the shim tests check the flag per WR)."""
    link = make_link(device_opts={"max_rdma_size": 2048})
    posted = link.post([link.write(0, 10000, 1), link.signal(0, 1, 1), link.fence(1), link.write(10000, 100, 1)])
    assert posted == 5 + 1 + 1 + 1
    link.wait(tokens=1, published=1)
    assert link.a.stats["send_completions"] == posted


def test_softverbs_refuses_unsignaled_wr_on_efa(make_link: Any, verbs: Any) -> None:
    """The rule the backend follows, checked against the provider: an unsignaled WR is refused."""
    link = make_link()
    qp = link.a.qp
    qp.wr_start()
    qp.wr_id = 1
    qp.wr_flags = 0
    qp.wr_rdma_write_imm(link.kdst.rkey, link.kdst.addr, 0)
    qp.wr_set_sge(verbs.wr.SGE(link.ksrc.addr, 8, link.ksrc.lkey))
    with pytest.raises(verbs.pyverbs_error.PyverbsRDMAError):
        qp.wr_complete()


def test_without_unsolicited_write_receive_keeps_receives_posted(make_link: Any, verbs: Any) -> None:
    ee = verbs.efa_enums
    caps = (ee.EFADV_DEVICE_ATTR_CAPS_RDMA_WRITE | ee.EFADV_DEVICE_ATTR_CAPS_RDMA_READ
            | ee.EFADV_DEVICE_ATTR_CAPS_RNR_RETRY)
    link = make_link(rq_depth=32, device_opts={"efa_device_caps": caps, "max_rdma_size": 1024})
    assert not link.b.rail.unsolicited and link.b.rq_depth == 32
    judge = CoverageJudge(link)
    rows = []
    for k in range(20):
        rows.append(link.write(k * 4096, 4096, 1))  # 4 pieces each: 80 arrivals through 32 receive WRs
        judge.on_write(k * 4096, 4096)
    rows.append(link.signal(0, 1, 1))
    judge.on_signal(1, 1, 0)
    link.post(rows)
    link.wait(tokens=1, published=1, timeout=20)
    check_published(link, judge)
    assert link.b.stats["arrivals"] == 81


def test_refuses_device_without_rdma_write(verbs: Any) -> None:

    ee = verbs.efa_enums
    # (named to sort last: other tests let the backend pick the first EFA device)
    verbs.soft.add_device("zz-efa-nowrite", "efa", efa_device_caps=int(ee.EFADV_DEVICE_ATTR_CAPS_RDMA_READ))
    with pytest.raises(BackendError, match="RDMA write"):
        EfaBackend("zz-efa-nowrite", verbs=verbs)


def test_refuses_non_efa_device(verbs: Any) -> None:

    with pytest.raises(BackendError, match="not an EFA device"):
        EfaBackend("softib0", verbs=verbs)
    with EfaBackend(verbs=verbs) as be:  # the first EFA device, though softib0 may sort before it
        assert be.rail.ctx.query_device().vendor_id == 0x1D0F


# --- completions, backlog, windows -------------------------------------------------------------------------


def test_inflight_counts_wrs_until_completed(make_link: Any) -> None:
    link = make_link()
    n = link.post([link.write(0, 1024, 1), link.signal(0, 1, 1), link.write(1024, 1024, 2)])
    assert n == 3
    assert link.a.inflight(link.conn) == 3
    link.wait(tokens=2, published=1)
    assert link.a.inflight(link.conn) == 0


def test_small_send_queue_backlogs_and_drains(make_link: Any) -> None:
    link = make_link(sq_depth=8)
    rows = [r for k in range(60) for r in (link.write(k * 1024, 1024, k + 1), link.signal(k % 3, 1, k + 1))]
    for i in range(0, len(rows), 8):
        link.post(rows[i:i + 8])
    assert link.a.inflight(link.conn) == 120
    link.wait(tokens=60, published=60, timeout=20)
    assert link.a.inflight(link.conn) == 0
    assert link.a.stats["backlogged"] > 0
    assert np.array_equal(link.dst[:60 * 1024], link.src[:60 * 1024])


def test_staging_window_holds_records_back_until_earlier_ones_complete(make_link: Any) -> None:
    link = make_link(staging_entries=64)
    rows = [link.signal(k % 4, 1, 1 + k // 8) for k in range(300)]
    for i in range(0, len(rows), 8):
        link.post(rows[i:i + 8])
    link.wait(tokens=(300 + 7) // 8, published=300, timeout=20)
    assert link.b.stats["protocol_errors"] == 0


def test_visibility_flush_runs_before_publishing(make_link: Any) -> None:
    calls: list[int] = []
    link = make_link(flush_hook=lambda: calls.append(len(link.published)))
    link.post([link.write(0, 1024, 1), link.signal(0, 1, 1)])
    link.wait(tokens=1, published=1)
    assert calls and calls[0] == 0
    assert link.b.stats["visibility_flushes"] == len(calls)


def test_visibility_flush_can_be_turned_off(make_link: Any) -> None:
    link = make_link(visibility_flush=False, flush_hook=lambda: pytest.fail("flush hook called"))
    link.post([link.write(0, 1024, 1), link.signal(0, 1, 1)])
    link.wait(tokens=1, published=1)
    assert link.b.stats["visibility_flushes"] == 0


def test_flags_wait_for_a_publisher(make_link: Any) -> None:
    link = make_link()
    late: list[tuple] = []
    link.b._publisher = None  # as before the daemon installs one
    link.post([link.write(0, 1024, 1), link.signal(0, 7, 1)])
    wait_until(lambda: link.poll() >= 0 and link.b.stats["published"] == 1, "the flag to become ready", interval=0)
    link.b.set_flag_publisher(lambda *args: late.append(args))
    assert late == [(link.conn, 1, 0, SignalOp.ADD, 7)]


def test_closing_a_connection_with_work_in_flight(make_link: Any) -> None:
    link = make_link(sq_depth=4)
    link.post([link.write(k * 1024, 1024, 1) for k in range(8)] + [link.signal(0, 1, 1)])
    link.a.close_connection(link.conn)
    link.b.close_connection(link.conn)
    for _ in range(100):
        link.a.poll()
        link.b.poll()
    link.conn += 1
    ea, eb = link.a.create_endpoint(link.conn, "job"), link.b.create_endpoint(link.conn, "job")
    link.a.connect(link.conn, eb)
    link.b.connect(link.conn, ea)
    link.completions.clear()
    link.published.clear()
    link.post([link.write(0, 1024, 1), link.signal(0, 1, 1)])
    link.wait(tokens=1, published=1)
    assert link.completions == [(1, 0, 0)]


def test_endpoint_and_address_are_plain_data(make_link: Any) -> None:
    import msgpack

    link = make_link()
    ep = link.a.create_endpoint(99, "job")
    for info in (ep, link.a.local_address()):
        assert msgpack.unpackb(msgpack.packb(info)) == info
    with pytest.raises(BackendError, match="not efa"):
        link.a.connect(99, {"transport": "ib"})


def test_a_long_idle_worker_keeps_polling_an_efa_backend_between_naps() -> None:
    # efa arrivals show in no ring header: a worker that only watched its rings for DEEP_WATCH_S would hold
    # their flags back that long (10 ms on the H200 host's put -> flag); ib and null wait for a record.
    assert deep_watch_s(EfaBackend, 50e-6) == 50e-6
    assert deep_watch_s(IbBackend, 50e-6) == DEEP_WATCH_S == deep_watch_s(NullBackend, 50e-6)
    assert DEEP_WATCH_S > 50e-6
